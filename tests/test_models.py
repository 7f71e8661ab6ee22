import json

import pytest

from checks.errors import ConfigError
from checks.models import PRESETS, from_hf_config, from_param_count, preset

# Totals as published on each model card / reported by transformers' num_parameters().
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    assert preset(name).params == PUBLISHED[name]


def test_every_published_preset_is_covered():
    assert set(PUBLISHED) == set(PRESETS) - {"tiny"}


def test_lora_count_llama3_8b_rank16_all_linear():
    # r * (in + out) per linear: q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096,
    # gate 4096+14336, up 4096+14336, down 14336+4096 = 81920 per layer x 16 x 32 layers.
    assert preset("llama-3.1-8b").lora_params(16) == 81920 * 16 * 32 == 41_943_040


def test_unknown_preset_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'llama-3.1-8b'"):
        preset("llama-3.1-8")


def test_hf_config_llama(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert from_hf_config(path).params == PUBLISHED["llama-3.1-8b"]  # LlamaConfig defaults to untied


def test_hf_config_qwen2_has_qkv_bias_and_tied(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert from_hf_config(path).params == PUBLISHED["qwen2.5-0.5b"]


def test_hf_config_gpt2(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert from_hf_config(path).params == PUBLISHED["gpt2-124m"]


def test_hf_config_missing_keys_are_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ConfigError, match="lacks num_hidden_layers, num_attention_heads, intermediate_size"):
        from_hf_config(path)


def test_param_count_inference_lands_on_a_real_shape():
    # 13.015B with a 32k vocabulary: 12 L h^2 + 2 V h with L = h/128 gives Llama-2-13B's shape.
    shape = from_param_count(13.015864320e9)
    ref = preset("llama-2-13b")
    assert (shape.hidden, shape.layers, shape.ffn) == (ref.hidden, ref.layers, ref.ffn)
    assert shape.approximate and shape.params == 13_015_864_320


def test_param_count_too_small_is_bad_input():
    with pytest.raises(ConfigError, match="model.params"):
        from_param_count(10)
