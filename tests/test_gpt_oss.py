"""GPT-OSS (model_type gpt_oss) by hand: its parameter totals, what its clamped-SwiGLU experts and its sink attention
keep per token, and the attention and releases podkit refuses for it (transformers 5.23 models/gpt_oss/
modeling_gpt_oss.py and configuration_gpt_oss.py; integrations/moe.py grouped_mm_experts_forward)."""

import dataclasses
import json

import pytest

from podkit.checks import activations as A
from podkit.checks.errors import ConfigError
from podkit.checks.models import preset

GPT_OSS_20B = 'preset = "gpt-oss-20b"'


def _block(job, lora: bool, precision: str = "bf16", attention: str = "eager", seq: int = 2048):
    train = (f"stack = 'hf'\nprecision = '{precision}'\nattention = '{attention}'\nseq_len = {seq}\n"
             + ("lora_rank = 8\nlora_targets = 'all-linear'\n" if lora else ""))
    return job(model=GPT_OSS_20B, train=train)


def test_preset_totals_by_hand():
    # openai/gpt-oss-20b config.json: hidden 2880, 24 layers, 64 heads of 64, 8 kv heads, 32 experts of 2880 (top 4),
    # vocabulary 201088, untied. Per layer: q/k/v/o with biases and 64 sinks; the router's weight and bias; each
    # expert's gate_up (2880 x 5760) and down (2880 x 2880) with their biases; two norms.
    h, f, q, kv, v, heads = 2880, 2880, 64 * 64, 8 * 64, 201088, 64

    def total(layers, experts):
        attention = (h * q + q) + 2 * (h * kv + kv) + (q * h + h) + heads
        moe = experts * h + experts + experts * ((h * 2 * f + 2 * f) + (f * h + h))
        return layers * (attention + moe + 2 * h) + 2 * v * h + h

    assert preset("gpt-oss-20b").params == total(24, 32) == 20_914_757_184
    assert preset("gpt-oss-120b").params == total(36, 128) == 116_829_156_672
    s = preset("gpt-oss-120b")
    assert (s.moe.experts, s.moe.top_k, s.sliding_window, s.sliding_layers[:3], len(s.sliding_layers)) == (
        128, 4, 128, (0, 2, 4), 18)
    # all-linear adapts q, k, v and o only: the router and the expert banks are bare Parameters, no nn.Linear
    assert [n for n, _, _ in s.linear_shapes()] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_a_tiny_real_model_counts_what_podkit_counts(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from podkit.checks.hf_config import from_file

    from tests.test_hf_saved_tensors import BASE, TINY

    cfg = {**BASE, **TINY["gpt_oss"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert from_file(tmp_path / "config.json").params == sum(p.numel() for p in model.parameters()) == 254_680


@pytest.mark.parametrize("lora", [False, True])
def test_clamped_swiglu_keeps_three_ffn_values_more_per_routed_row(job, lora):
    # GptOssExperts._apply_gate keeps gate_up's whole output (2 ffn: the clamps' strided inputs), the clamped gate,
    # sigmoid's output, glu and up + 1 (4 ffn), and where the banks train down's input (1 ffn): 7 or 6 values per
    # routed row. silu(gate) * up keeps gate and up (2 ffn), silu's output (1) and the product for down (1): 4 or 3.
    # Three more either way: top 4 rows x 2880 x 3 x 2 B per token and MoE layer.
    j = _block(job, lora)
    facts = A.block_facts(j)
    clamped = sum(A.saved_per_token(facts, "none", True).values())
    plain = sum(A.saved_per_token(dataclasses.replace(facts, clamped_swiglu=False), "none", True).values())
    assert clamped - plain == 4 * 2880 * 3 * 2
    row = 4 * 2880 * 2  # one ffn-wide value per routed row, per token
    kept = {k: v for k, v in A.saved_per_token(facts, "none", True).items()
            if k.startswith("experts.") and k != "experts.down_proj: output"}  # (that one is hidden-wide)
    assert kept == {"experts.gate_up_proj: output": 2 * row, "experts.gate, clamped": row,
                    "experts.sigmoid(gate x alpha)": row, "experts.gate x sigmoid": row, "experts.up + 1": row,
                    **({} if lora else {"experts.(up + 1) x glu": row})}


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_sink_attention_keeps_its_softmax_s_plus_one_wide(job, precision):
    # eager_attention_forward: the softmax over s scores and the sink column, kept in the scores' dtype, and the row
    # max's int64 indices (8 B per head). Pure bf16: one bf16 softmax of 64 x 2049 per token, which probs @ v keeps
    # through its slice. bf16-mixed (fp32 masters under autocast): torch.cat promotes the bf16 scores to the fp32
    # sinks', so the softmax is fp32 and `.to(value_states.dtype)` makes a bf16 copy of the 64 x 2048 weights.
    j = _block(job, lora=False, precision=precision)
    saved = A.saved_per_token(A.block_facts(j), "none", True)
    scores = {k: v for k, v in saved.items() if k.endswith("(s x s)") or k.startswith("row max")}
    if precision == "bf16":
        assert scores == {"row max indices of the scores and sink (int64)": 64 * 8,
                          "softmax output with the sink column (s x s)": 64 * 2049 * 2}
    else:
        assert scores == {"row max indices of the scores and sink (int64)": 64 * 8,
                          "softmax output with the sink column (s x s)": 64 * 2049 * 4,
                          "attention weights cast back (s x s)": 64 * 2048 * 2}


def test_router_keeps_its_top_k_softmax_only(job):
    # GptOssTopKRouter: softmax(router_top_value, dim=1, dtype=router_top_value.dtype): 4 bf16 values per token,
    # not an fp32 score for each of the 32 experts.
    saved = A.saved_per_token(A.block_facts(_block(job, lora=False)), "none", True)
    assert saved["router scores over the top-k (softmax)"] == 4 * 2
    assert "router scores (softmax or sigmoid)" not in saved


def test_flash_output_is_copied_back_for_o_proj_before_5_10(job):
    # _apply_rotary_emb's torch.cat makes q (b, heads, s, d)-contiguous; transformers 5.0 runs flash_attention_2 as
    # asked (no _compatible_flash_implementations), and the flash-attn package allocates its output like q, so
    # `attn_output.reshape(...).contiguous()` copies it (64 x 64 x 2 B per token), which a trained o_proj keeps.
    train = "stack = 'hf'\nprecision = 'bf16'\nattention = 'flash-attn'\ntransformers = '5.0.0'"
    j = job(model=GPT_OSS_20B, train=train)
    saved = A.saved_per_token(A.block_facts(j), "none", True)
    assert saved["attention output made contiguous"] == 64 * 64 * 2


@pytest.mark.parametrize("release", ["", "5.10.0", "5.23.0"])
def test_vllm_flash_attn3_output_is_not_copied(job, release):
    # transformers 5.10+ swaps flash_attention_2 for kernels-community/vllm-flash-attn3 on CUDA
    # (GptOssPreTrainedModel._compatible_flash_implementations), whose mha_fwd allocates its output
    # (b, s, heads, d)-contiguous whatever q's layout: o_proj takes a view of what the kernel saved, no copy.
    # podkit once priced the copy (64 x 64 x 2 B per token and layer) as for the flash-attn package.
    train = "stack = 'hf'\nprecision = 'bf16'\nattention = 'flash-attn'"
    train += f"\ntransformers = '{release}'" if release else ""
    saved = A.saved_per_token(A.block_facts(job(model=GPT_OSS_20B, train=train)), "none", True)
    assert "attention output made contiguous" not in saved


@pytest.mark.parametrize("stack", ["hf", "deepspeed"])
def test_sdpa_is_refused_as_transformers_refuses_it(job, stack):
    # GptOssPreTrainedModel._supports_sdpa = False: from_pretrained(attn_implementation="sdpa") raises, and a load
    # that names none runs eager. podkit's default attention is sdpa, so the job must say which it runs.
    with pytest.raises(ConfigError) as err:
        job(model=GPT_OSS_20B, train=f"stack = '{stack}'\nprecision = 'bf16'")
    assert err.value.field == "train.attention" and "_supports_sdpa = False" in str(err.value)
    assert "\n" not in str(err.value) and "attention = 'eager'" in str(err.value)
    for attention in ("eager", "flash-attn"):
        job(model=GPT_OSS_20B, train=f"stack = '{stack}'\nprecision = 'bf16'\nattention = '{attention}'")


@pytest.mark.parametrize("train, field", [
    ("stack = 'hf'\ntransformers = '4.57.1'\nattention = 'eager'", "train.transformers"),
    ("stack = 'torchtitan'\nattention = 'eager'", "train.stack"),
    ("stack = 'litgpt'\nattention = 'eager'", "train.stack"),
])
def test_what_is_not_modelled_is_refused(job, train, field):
    # transformers 4.55-4.57 looped over the hit experts in training (GptOssExperts.forward); other stacks build
    # their own GPT-OSS, which podkit has not read.
    with pytest.raises(ConfigError) as err:
        job(model=GPT_OSS_20B, train=train + "\nprecision = 'bf16'")
    assert err.value.field == field


def test_eager_warning_points_at_flash_attn_not_sdpa(job):
    from podkit.checks.rules import flash_attention

    result = flash_attention(_block(job, lora=True))
    assert "flash-attn" in result.fix and "'sdpa'" not in result.fix


def test_layer_types_default_to_every_other_layer_sliding():
    # GptOssConfig.__post_init__: `"sliding_attention" if bool((i + 1) % 2) else "full_attention"`, window 128.
    from podkit.checks.hf_config import shape_from_config

    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "num_local_experts": 4,
           "num_experts_per_tok": 2}
    shape = shape_from_config(cfg, "x")
    assert (shape.sliding_window, shape.sliding_layers, shape.d_head, shape.qkv_bias, shape.o_bias) == (
        128, (0, 2), 64, True, True)
