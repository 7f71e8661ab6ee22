import dataclasses
import json

import pytest

from podkit.checks.errors import ConfigError
from podkit.checks.models import PRESETS, from_hf_config, from_param_count, preset

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
    "gemma-3-4b": ("4.3B", "google/gemma-3-4b-pt on the Hub: 4.3B params (text decoder and vision encoder)"),
    "gemma-3-12b": ("12.2B", "google/gemma-3-12b-pt on the Hub: 12.2B params"),
    "gemma-3-27b": ("27.4B", "google/gemma-3-27b-pt on the Hub: 27.4B params"),
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
    "gpt-oss-20b": ("20.91B", "gpt-oss-120b & gpt-oss-20b model card (OpenAI 2025) Table 1: 20.91B total"),
    "gpt-oss-120b": ("116.83B", "gpt-oss model card Table 1: 116.83B total"),
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
    # The gpt-oss model card counts the unembedding among the active parameters, not the embedding.
    "gpt-oss-20b": ("3.61B", "gpt-oss model card Table 1: 3.61B active"),
    "gpt-oss-120b": ("5.13B", "gpt-oss model card Table 1: 5.13B active"),
}

# Non-embedding counts (embedding table and untied head left out), where the source gives them. The
# Gemma reports give Gemma's exactly (their embedding rows count a 256,128-row table, the configs'
# vocab_size is 256,000); Gemma 3's are of the text decoder, its 417M vision encoder listed apart.
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
    if shape.family.startswith("deepseek") or shape.family == "gpt_oss":
        active -= shape.vocab * shape.hidden  # DeepSeek's and gpt-oss's convention: without the input embedding
    assert shape.moe and active < shape.params
    assert matches(active, text), f"{name}: {active:,} active vs {text} ({source})"


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_non_embedding_counts_match_published(name):
    shape = preset(name)
    text, source = NON_EMBEDDING[name]
    assert matches(shape.params - shape.embedding_params - shape.vision_params, text), f"{name} vs {text} ({source})"


@pytest.mark.parametrize("name", ["gemma-3-4b", "gemma-3-12b", "gemma-3-27b"])
def test_gemma3_vision_encoder_matches_published(name):
    shape = preset(name)
    encoder = sum(g.total for g in shape.param_groups() if g.name.startswith("vision.") and ".mm_" not in g.name)
    assert matches(encoder, "417M")  # Gemma 3 report Table 1: vision encoder 417M (SigLIP)
    assert shape.vision_params > encoder and all(not g.per_layer for g in shape.param_groups()
                                                  if g.name.startswith("vision."))


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
    expected = "lacks num_hidden_layers, num_attention_heads, vocab_size, intermediate_size"
    with pytest.raises(ConfigError, match=expected):
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


# ---- config.json files as users have them


def write(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("model_type", ["bert", "t5", "falcon", "llava"])
def test_unsupported_model_type_is_refused_naming_the_supported(tmp_path, model_type):
    path = write(tmp_path, {"model_type": model_type, "hidden_size": 768, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522})
    with pytest.raises(ConfigError) as err:
        from_hf_config(path)
    message = str(err.value)
    assert f"model_type '{model_type}' is not supported" in message
    assert "llama, mistral, qwen2, qwen3, gemma" in message and "deepseek_v3" in message
    assert "\n" not in message


def test_mixtral_config_is_a_mixture_not_a_dense_7b(tmp_path):
    # mistralai/Mixtral-8x7B-v0.1 config.json (the keys that fix its size).
    path = write(tmp_path, {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                            "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "vocab_size": 32000, "tie_word_embeddings": False})
    shape = from_hf_config(path)
    assert shape.params == preset("mixtral-8x7b").params and matches(shape.params, "46.7B")
    assert matches(shape.active_params, "12.9B")
    assert shape.moe.experts == 8 and shape.moe.top_k == 2 and shape.family == "mixtral" and shape.arch == "llama"


def test_moe_config_lacking_its_expert_keys_names_them(tmp_path):
    path = write(tmp_path, {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                            "num_attention_heads": 32, "vocab_size": 151936})
    with pytest.raises(ConfigError, match="lacks num_experts, num_experts_per_tok, moe_intermediate_size"):
        from_hf_config(path)


def test_phi3_without_tie_key_is_untied(tmp_path):
    # Phi3Config defaults tie_word_embeddings to False: 3.82B, not 3.72B with a shared head.
    path = write(tmp_path, {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32,
                            "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
                            "vocab_size": 32064})
    shape = from_hf_config(path)
    assert shape.params == 3_821_079_552 and not shape.tie_embeddings
    assert [n for n, _, _ in shape.linear_shapes()] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert shape.linear_shapes()[0] == ("qkv_proj", 3072, 3 * 3072)


def test_gemma3_multimodal_config_reads_text_defaults_and_its_vision_encoder(tmp_path):
    # google/gemma-3-4b-pt config.json: text_config omits heads, kv heads, head_dim and vocab_size.
    vision = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}
    path = write(tmp_path, {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                            "model_type": "gemma3_text", "num_hidden_layers": 34},
                            "vision_config": vision})
    shape = from_hf_config(path)
    assert (shape.heads, shape.kv_heads, shape.d_head, shape.vocab) == (8, 4, 256, 262_208)
    assert shape.tie_embeddings and shape.qk_norm == "head" and shape.norms_per_layer == 4
    assert shape.family == "gemma3" and shape.vision.layers == 27 and shape.params == preset("gemma-3-4b").params
    with pytest.raises(ConfigError, match="lacks text_config, vision_config"):
        from_hf_config(write(tmp_path, {"model_type": "gemma3"}))
    with pytest.raises(ConfigError, match="vision_config .siglip_vision_model. lacks patch_size, image_size"):
        from_hf_config(write(tmp_path, {"model_type": "gemma3", "text_config": {},
                                        "vision_config": {"hidden_size": 1152, "intermediate_size": 4304,
                                                          "num_hidden_layers": 27}}))


def test_family_features_are_on_the_shape():
    q3, g2, g3, olmoe = preset("qwen3-8b"), preset("gemma-2-9b"), preset("gemma-3-12b"), preset("olmoe-1b-7b")
    groups = {g.name: g for g in q3.param_groups()}
    assert groups["q_norm,k_norm"].rows == 128 and groups["q_norm,k_norm"].count == 2 * 36
    assert (g2.norms_per_layer, g2.logit_softcap, g2.attn_softcap, g2.d_head) == (4, 30.0, 50.0, 256)
    assert g3.logit_softcap == 0.0 and g3.qk_norm == "head" and g3.vocab == 262_208
    norms = {g.name: g.rows for g in olmoe.param_groups() if g.name in ("q_norm", "k_norm")}
    assert norms == {"q_norm": 2048, "k_norm": 2048} and olmoe.qk_norm == "full"
    assert {preset(n).family for n in PRESETS if n != "tiny"} >= {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"}


def test_moe_counts_every_expert_and_separates_them():
    shape = preset("qwen3-30b-a3b")
    experts = [g for g in shape.param_groups() if g.expert]
    assert {g.count for g in experts} == {128 * 48} and all(g.linear and g.per_layer for g in experts)
    assert shape.expert_linear_shapes() == [("experts.gate_up_proj", 2048, 2 * 768), ("experts.down_proj", 768, 2048)]
    # linear_shapes(): attention only (no dense MLP, no shared expert in Qwen3-MoE).
    assert [n for n, _, _ in shape.linear_shapes()] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    expert_total = sum(g.total for g in experts)
    assert shape.params - shape.active_params == expert_total * (128 - 8) // 128


def test_qwen2_moe_shared_expert_and_its_gate():
    shape = preset("qwen1.5-moe-a2.7b")
    names = [n for n, _, _ in shape.linear_shapes()]
    assert names[-4:] == ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                          "shared_expert_gate"]
    assert shape.moe.shared_ffn == 5632 and shape.moe.shared_gate and shape.qkv_bias and not shape.o_bias


def test_deepseek_dense_layers_mla_and_exact_lora_counts():
    shape = preset("deepseek-v2-lite")
    m, mla = shape.moe, shape.mla
    assert (m.dense_layers, m.dense_ffn, m.shared_experts, m.shared_ffn) == (1, 10944, 2, 2816)
    assert shape.moe_layers == 26 and shape.ffn == 10944 and mla.q_lora_rank == 0 and shape.d_head == 192
    counts = {g.name: g.count for g in shape.linear_groups()}
    assert counts["mlp.gate_proj"] == 1 and counts["shared_expert.gate_proj"] == 26 and counts["kv_b_proj"] == 27
    shapes = dict((n, (i, o)) for n, i, o in shape.linear_shapes())
    assert shapes["q_proj"] == (2048, 16 * 192) and shapes["kv_a_proj_with_mqa"] == (2048, 512 + 64)
    assert shapes["kv_b_proj"] == (512, 16 * (128 + 128)) and shapes["o_proj"] == (16 * 128, 2048)
    # LoRA counts each linear as often as it exists, not layers x every linear.
    r = 8
    assert shape.lora_params(r) == sum(r * (g.rows + g.cols) * g.count for g in shape.linear_groups())
    assert shape.lora_params(r) < shape.layers * sum(r * (i + o) for _, i, o in shape.linear_shapes())
    v3 = preset("deepseek-v3")
    assert v3.mla.q_lora_rank == 1536 and v3.moe.router_bias and v3.moe.dense_layers == 3
    assert "q_a_layernorm" in {g.name for g in v3.param_groups()}


def test_moe_spec_validation():
    from podkit.checks.models import MoeSpec

    with pytest.raises(ConfigError, match="top_k"):
        MoeSpec(experts=8, top_k=9, expert_ffn=128)
    with pytest.raises(ConfigError, match="shared_ffn"):
        MoeSpec(experts=8, top_k=2, expert_ffn=128, shared_experts=1)


# Configs off the beaten path (biases, sparse MoE strides, dense-only layers, MLA with and without a
# q latent, tied Phi-3, no soft-cap, decoupled head_dim, GPT-2 n_inner), tiny so that transformers
# builds them in milliseconds. Each maps to the count transformers 5.23.0 built from it on the meta
# device (sum of model.parameters() of AutoModelForCausalLM.from_config).
_BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 128}
VARIANTS = {
    "llama-bias": {"model_type": "llama", **_BASE, "attention_bias": True, "mlp_bias": True},
    "qwen3-bias": {"model_type": "qwen3", **_BASE, "head_dim": 32, "attention_bias": True},
    "gemma3-bias": {"model_type": "gemma3_text", **_BASE, "head_dim": 16, "attention_bias": True},
    "olmoe-bias": {"model_type": "olmoe", **_BASE, "attention_bias": True, "num_experts": 4,
                   "num_experts_per_tok": 2},
    "qwen2moe-sparse": {"model_type": "qwen2_moe", **_BASE, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                        "decoder_sparse_step": 2, "mlp_only_layers": [3], "qkv_bias": False},
    "qwen3moe-dense": {"model_type": "qwen3_moe", **_BASE, "head_dim": 16, "num_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0, 2]},
    "dsv2-bias": {"model_type": "deepseek_v2", **_BASE, "num_key_value_heads": 4, "attention_bias": True,
                  "mlp_bias": True, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 0, "q_lora_rank": 24, "kv_lora_rank": 16,
                  "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12},
    "dsv3-nolora": {"model_type": "deepseek_v3", **_BASE, "num_key_value_heads": 4, "attention_bias": True,
                    "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 2, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12},
    "phi3-tied": {"model_type": "phi3", **_BASE, "vocab_size": 32064, "tie_word_embeddings": True},
    "gemma2-nocap": {"model_type": "gemma2", **_BASE, "head_dim": 16, "final_logit_softcapping": None},
    "mistral-hd": {"model_type": "mistral", **_BASE, "head_dim": 8},
    "gemma3-head": {"model_type": "gemma3", "mm_tokens_per_image": 16,
                    "text_config": {**_BASE, "head_dim": 16, "vocab_size": 300},
                    "vision_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "patch_size": 4, "image_size": 32}},
    # GptOssConfig's defaults: head_dim 64 (not hidden // heads), attention_bias True; biased router and expert banks,
    # one sink per head.
    "gptoss-defaults": {"model_type": "gpt_oss", **_BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt2-inner": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 100, "vocab_size": 99,
                   "n_positions": 32},
}

TRANSFORMERS_COUNTS = {
    "llama-bias": 141_632,
    "qwen3-bias": 190_528,
    "gemma3-bias": 133_056,
    "olmoe-bias": 363_200,
    "qwen2moe-sparse": 155_520,
    "qwen3moe-dense": 152_768,
    "dsv2-bias": 175_248,
    "dsv3-nolora": 163_280,
    "phi3-tied": 2_175_552,
    "gemma2-nocap": 132_160,
    "mistral-hd": 115_264,
    "gptoss-defaults": 515_936,
    "gpt2-inner": 68_232,
    "gemma3-head": 171_536,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variants_count_what_transformers_builds(name):
    from podkit.checks.hf_config import shape_from_config

    assert shape_from_config(dict(VARIANTS[name]), name).params == TRANSFORMERS_COUNTS[name]


def _transformers_count(cfg: dict) -> int:
    transformers = pytest.importorskip("transformers", reason="the live cross-check needs transformers installed")
    torch = pytest.importorskip("torch", reason="torch is installed by make setup; this test reads real nn.Linear shapes")
    cfg = dict(cfg)
    conf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_live_against_transformers(name):
    assert _transformers_count(VARIANTS[name]) == TRANSFORMERS_COUNTS[name]


def test_every_preset_live_against_transformers():
    """Where transformers is installed: each preset's config built by transformers itself."""
    from podkit.checks.presets import CONFIGS

    for name, (_, cfg) in CONFIGS.items():
        assert _transformers_count(cfg) == preset(name).params, name


@pytest.mark.parametrize("params", [1e6, 3e6, 1e15])
def test_a_count_no_inferred_shape_tracks_is_refused(params):
    """At the ends of the search the shape stopped tracking the count (QA, 2026-11-24): 1e15 was priced as a
    2.6e13-parameter shape's activations (38x low), 1e6 as one block of hidden 128 and a 32k vocabulary (8.5x
    high). Refused, with the range it can infer."""
    with pytest.raises(ConfigError, match=r"model.params: .* outside what a Llama-like shape can be inferred for"):
        from_param_count(params)


def test_every_count_in_the_stated_range_is_inferred_within_a_factor_of_two():
    """The range the refusal names is the one accepted, with no holes (review: 1.1e7-1.5e7 was refused)."""
    for params in [10 ** (6.7 + i * 0.01) for i in range(0, 1300, 7)]:  # 5e6 to 5e19, log-spaced
        try:
            shape = from_param_count(params)
        except ConfigError as exc:
            assert params > 5e13, exc
            continue
        bare = dataclasses.replace(shape, params_override=0)
        assert shape.params == int(params) and 0.5 <= bare.params / params <= 2
