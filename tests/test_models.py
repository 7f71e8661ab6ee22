import json

import pytest

from checks.errors import ConfigError
from checks.models import PRESETS, from_hf_config, from_param_count, preset

# Exact totals, as transformers' num_parameters() reports them for each model (and the model cards round).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.3-70b": 70_553_706_496,  # the same architecture as 3.1-70B (meta-llama/Llama-3.3-70B-Instruct)
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
}

# Totals published rounded: (figure, source). A count matches when it is within one unit of the
# figure's last digit (publishers both round and truncate: Qwen2.5-7B's 7.6156B is "7.61B").
ROUNDED = {
    "gpt2-355m": ("355M", "openai-community/gpt2-medium model card: the 355M parameter version of GPT-2"),
    "llama-3.1-405b": ("405B", "meta-llama/Llama-3.1-405B model card: 405B"),
    "mistral-nemo-12b": ("12B", "mistral.ai/news/mistral-nemo: a 12B model"),
    "mistral-small-24b": ("24B", "mistral.ai/news/mistral-small-3: a 24B-parameter model"),
    "qwen2.5-1.5b": ("1.54B", "Qwen/Qwen2.5-1.5B model card: Number of Parameters 1.54B"),
    "qwen2.5-3b": ("3.09B", "Qwen/Qwen2.5-3B model card: Number of Parameters 3.09B"),
    "qwen2.5-72b": ("72.7B", "Qwen/Qwen2.5-72B model card: Number of Parameters 72.7B"),
    "qwen3-0.6b": ("0.6B", "Qwen/Qwen3-0.6B model card: Number of Parameters 0.6B"),
    "qwen3-1.7b": ("1.7B", "Qwen/Qwen3-1.7B model card: Number of Parameters 1.7B"),
    "qwen3-4b": ("4.0B", "Qwen/Qwen3-4B model card: Number of Parameters 4.0B"),
    "qwen3-8b": ("8.2B", "Qwen/Qwen3-8B model card: Number of Parameters 8.2B"),
    "qwen3-14b": ("14.8B", "Qwen/Qwen3-14B model card: Number of Parameters 14.8B"),
    "qwen3-32b": ("32.8B", "Qwen/Qwen3-32B model card: Number of Parameters 32.8B"),
    "phi-3-mini": ("3.8B", "Phi-3 report (Abdin et al. 2024): phi-3-mini, a 3.8 billion parameter model"),
    "phi-3-medium": ("14B", "Phi-3 report: phi-3-medium, 14B parameters"),
    "phi-4": ("14.7B", "microsoft/phi-4 on the Hub: 14.7B params (the Phi-4 report: 14 billion)"),
    "phi-4-mini": ("3.8B", "Phi-4-Mini report (Microsoft 2025): a 3.8-billion-parameter language model"),
    "mixtral-8x7b": ("46.7B", "mistral.ai/news/mixtral-of-experts: 46.7B total parameters"),
    "mixtral-8x22b": ("141B", "mistral.ai/news/mixtral-8x22b: 141B parameters"),
    "qwen1.5-moe-a2.7b": ("14.3B", "qwenlm.github.io/blog/qwen-moe: 14.3B parameters in total"),
    "qwen2-57b-a14b": ("57B", "Qwen2 report (Yang et al. 2024) Table 1: 57B total"),
    "qwen3-30b-a3b": ("30.5B", "Qwen/Qwen3-30B-A3B model card: 30.5B in total"),
    "qwen3-235b-a22b": ("235B", "Qwen/Qwen3-235B-A22B model card: 235B in total"),
    "olmoe-1b-7b": ("6.9B", "OLMoE paper (Muennighoff et al. 2024): 6.9B total parameters"),
    "deepseek-v2-lite": ("15.7B", "DeepSeek-V2 paper (DeepSeek-AI 2024) / V2-Lite model card: 15.7B total"),
    "deepseek-v2": ("236B", "DeepSeek-V2 paper: 236B total parameters"),
    "deepseek-v3": ("671B", "DeepSeek-V3 report (DeepSeek-AI 2024): 671B total (the Hub's 685B adds the MTP module)"),
}

# Active parameters per token of the MoE models, (figure, source).
ACTIVE = {
    "mixtral-8x7b": ("12.9B", "mistral.ai/news/mixtral-of-experts: only uses 12.9B parameters per token"),
    "mixtral-8x22b": ("39B", "mistral.ai/news/mixtral-8x22b: 39B active parameters"),
    "qwen1.5-moe-a2.7b": ("2.7B", "qwenlm.github.io/blog/qwen-moe: 2.7B activated"),
    "qwen2-57b-a14b": ("14B", "Qwen2 report Table 1: 14B activated"),
    "qwen3-30b-a3b": ("3.3B", "Qwen/Qwen3-30B-A3B model card: 3.3B activated"),
    "qwen3-235b-a22b": ("22B", "Qwen/Qwen3-235B-A22B model card: 22B activated"),
    "olmoe-1b-7b": ("1.3B", "OLMoE paper: 1.3B active parameters"),
    # DeepSeek counts activated parameters without the input embedding (one row is read per
    # token): V2-Lite's 2.4B is 2.45B without it and would be 2.66B with it.
    "deepseek-v2-lite": ("2.4B", "DeepSeek-V2 paper / V2-Lite model card: 2.4B activated"),
    "deepseek-v2": ("21B", "DeepSeek-V2 paper: 21B activated for each token"),
    "deepseek-v3": ("37B", "DeepSeek-V3 report: 37B activated for each token"),
}

# Non-embedding counts (embedding table and untied head left out), where the source gives them. The
# Gemma reports give Gemma's exactly (their embedding rows count a 256,128-row table, the configs'
# vocab_size is 256,000); Gemma 3's are of the text decoder, the 417M vision encoder listed apart.
NON_EMBEDDING = {
    "gemma-2b": ("1,981,884,416", "Gemma report Table 1"),
    "gemma-7b": ("7,751,248,896", "Gemma report Table 1"),
    "gemma-2-2b": ("2,024,517,888", "Gemma 2 report Table 1"),
    "gemma-2-9b": ("8,324,201,984", "Gemma 2 report Table 1"),
    "gemma-2-27b": ("26,047,480,320", "Gemma 2 report Table 1"),
    "gemma-3-1b": ("698M", "Gemma 3 report Table 1"),
    "gemma-3-4b": ("3,209M", "Gemma 3 report Table 1"),
    "gemma-3-12b": ("10,759M", "Gemma 3 report Table 1"),
    "gemma-3-27b": ("25,600M", "Gemma 3 report Table 1"),
    "qwen3-0.6b": ("0.44B", "Qwen/Qwen3-0.6B model card"),
    "qwen3-8b": ("6.95B", "Qwen/Qwen3-8B model card"),
    "qwen3-14b": ("13.2B", "Qwen/Qwen3-14B model card"),
    "qwen3-32b": ("31.2B", "Qwen/Qwen3-32B model card"),
    "qwen3-30b-a3b": ("29.9B", "Qwen/Qwen3-30B-A3B model card"),
    "qwen3-235b-a22b": ("234B", "Qwen/Qwen3-235B-A22B model card"),
}

UNITS = {"": 1, "M": 10**6, "B": 10**9}


def figure(text: str) -> tuple[float, float]:
    """'46.7B' -> (46.7e9, 0.1e9): the value and one unit of its last digit."""
    number, suffix = (text[:-1], text[-1]) if text[-1] in "MB" else (text, "")
    number = number.replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * UNITS[suffix], UNITS[suffix] / 10**decimals


def matches(count: int, text: str) -> bool:
    value, unit = figure(text)
    return abs(count - value) < unit if unit > 1 else count == value


def test_figure_parsing_is_strict():
    assert figure("46.7B") == (46.7e9, 0.1e9) and figure("3,209M") == (3209e6, 1e6)
    assert figure("2,024,517,888") == (2024517888, 1)
    assert matches(46_702_792_704, "46.7B") and not matches(46_550_000_000, "46.7B")
    assert not matches(2_024_517_889, "2,024,517,888")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    assert preset(name).params == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(ROUNDED))
def test_preset_totals_match_published_figures(name):
    text, source = ROUNDED[name]
    assert matches(preset(name).params, text), f"{name}: {preset(name).params:,} vs {text} ({source})"


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_active_parameters_match_published(name):
    shape = preset(name)
    text, source = ACTIVE[name]
    active = shape.active_params
    if shape.family.startswith("deepseek"):
        active -= shape.vocab * shape.hidden  # DeepSeek's convention: without the input embedding
    assert shape.moe and active < shape.params
    assert matches(active, text), f"{name}: {active:,} active vs {text} ({source})"


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_non_embedding_counts_match_published(name):
    shape = preset(name)
    text, source = NON_EMBEDDING[name]
    assert matches(shape.params - shape.embedding_params, text), f"{name} vs {text} ({source})"


def test_every_published_preset_is_covered():
    assert set(PUBLISHED) | set(ROUNDED) | set(NON_EMBEDDING) == set(PRESETS) - {"tiny"}
    assert {n for n, s in PRESETS.items() if s.moe} == set(ACTIVE)


def test_dense_models_are_all_active():
    shape = preset("qwen3-8b")
    assert shape.moe is None and shape.active_params == shape.params


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
    with pytest.raises(ConfigError, match="lacks num_hidden_layers, num_attention_heads, vocab_size, intermediate_size"):
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
