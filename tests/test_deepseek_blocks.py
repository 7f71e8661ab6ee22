"""DeepSeek-V2/V3 blocks, derived by hand: the kernel SDPA picks for latent attention's q/k and v of different head
dims, what each attention path keeps of v, and the fp32 router weights transformers' MoE layers keep.
tests/test_hf_saved_tensors.py holds the eager walk to a real transformers 5.23 model."""

import json

from podkit.checks import activations as A
from podkit.checks.gpus import lookup
from podkit.checks.kernels import attention_kernel, sdpa_backend
from podkit.checks.memory import ROUTER_CASTS, estimate

LITE = 'preset = "deepseek-v2-lite"'  # 16 heads, q/k 128 + 64 RoPE = 192 wide, v 128, kv latent 512, no q latent
H100 = "gpu = 'H100-SXM'"


def test_sdpa_on_an_h100_runs_the_memory_efficient_kernel(job):
    # The flash kernel wants q, k and v of one head dim (sdp_utils.cpp check_head_dim_size_flash); the memory-efficient
    # kernel only q's equal to k's, each a multiple of 8 in 16-bit (check_head_dim_size_mem_efficient).
    j = job(model=LITE, train="stack = 'hf'", cluster=H100)
    assert (j.shape.d_head, j.shape.v_head_dim) == (192, 128)
    assert attention_kernel(j) == "efficient"
    h100 = lookup("H100-SXM")
    assert sdpa_backend(h100, 2, 192, False) == "flash"
    assert sdpa_backend(h100, 2, 192, False, v_head_dim=128) == "efficient"
    assert sdpa_backend(h100, 2, 192, False, v_head_dim=132) == "math"  # v not a multiple of 8
    # The CPU's flash kernel has the same rule (sdp_utils_cpp.cpp check_head_dim_size_cpp).
    assert attention_kernel(j, "cpu") == "math"


def _saved(job, train):
    j = job(model=LITE, train="stack = 'hf'\ntransformers = '5.23.0'\n" + train, cluster=H100)
    return j, sum(A.saved_per_token(A.block_facts(j), "none", False).values())


def test_flash_attn_pads_v_and_crops_the_output(job):
    # A full fine-tune in bf16, per token of a dense block. The memory-efficient kernel keeps q and k (16 x 192 x 2 B
    # each), v as the view of kv_b_proj's (b, s, 16, 128 + 128) output it is (8192 B), its (b, s, 16, 128) output,
    # which o_proj takes as a view (4096 B), and an fp32 logsumexp. flash-attn gets v padded to 192 (5.23
    # integrations/flash_attention.py F.pad), allocates its output like q (16 x 192), and the output cropped to 128
    # is copied for o_proj (4096 B); kv_b_proj's output dies with the forward.
    j, efficient = _saved(job, "precision = 'bf16'")
    assert A.block_facts(j).mla_value == "view"
    j, flash = _saved(job, "precision = 'bf16'\nattention = 'flash-attn'")
    assert A.block_facts(j).mla_value == "padded"
    q = 16 * 192 * 2
    assert flash - efficient == (q + q + 4096) - (8192 + 4096)


def test_transformers_4_48_to_4_55_sdpa_copies_v(job):
    # sdpa_attention_forward's `value = value.contiguous()` (4.48.0-4.55.x): the kernel keeps a 16 x 128 copy, not
    # kv_b_proj's 16 x 256 output.
    j = job(model=LITE, train="stack = 'hf'\ntransformers = '4.55.4'\nprecision = 'bf16'", cluster=H100)
    assert A.block_facts(j).mla_value == "copy"
    old = sum(A.saved_per_token(A.block_facts(j), "none", False).values())
    _, new = _saved(job, "precision = 'bf16'")
    assert new - old == 16 * 256 * 2 - 16 * 128 * 2



def _router_casts(est, phase):
    return [p.bytes for p in est.phase_parts[phase] if p.label == ROUTER_CASTS]


def test_router_weights_cast_to_fp32_are_kept_per_moe_layer(job):
    # DeepSeek-V2-Lite: 26 MoE layers (first_k_dense_replace 1 of 27), 64 routed experts, hidden 2048. Each MoE layer's
    # F.linear(hidden.float(), weight.float()) keeps the fp32 copy of a bf16 weight: 64 x 2048 x 4 B = 512 KiB.
    layer = 64 * 2048 * 4
    lora = "stack = 'hf'\nlora_rank = 16\nprecision = 'bf16'\n"
    assert _router_casts(estimate(job(model=LITE, train=lora + "checkpointing = 'none'", cluster=H100)),
                         "forward-end") == [26 * layer]
    # Checkpointed: only the block being recomputed keeps one.
    assert _router_casts(estimate(job(model=LITE, train=lora + "checkpointing = 'full'", cluster=H100)),
                         "backward") == [layer]
    # fp32 masters under autocast: F.linear keeps autocast's bf16 cast, which the autocast cache holds for every MoE
    # layer through a checkpointed forward too; torchtitan's router runs its linear in the compute dtype.
    mixed = "stack = 'hf'\nprecision = 'bf16-mixed'\ncheckpointing = "
    for ckpt in ("'none'", "'full'"):
        est = estimate(job(model=LITE, train=mixed + ckpt, cluster=H100))
        assert _router_casts(est, "forward-end") == [26 * layer // 2]
    assert _router_casts(est, "backward") == [layer // 2]
    assert _router_casts(estimate(job(model=LITE, train="stack = 'torchtitan'\nprecision = 'bf16-mixed'",
                                      cluster=H100)), "forward-end") == []
    # Pure fp32: weight.type(torch.float32) is the weight itself.
    assert _router_casts(estimate(job(model=LITE, train="stack = 'hf'\nprecision = 'fp32'", cluster=H100)),
                         "forward-end") == []


def test_fsdp1_does_not_replay_a_latent_attention_block_as_llama_s(job, tmp_path):
    # The FSDP1 wrap-and-step replay (checks/fsdp1.py) walks a transformers LlamaDecoderLayer's forward (q_proj,
    # k_proj, v_proj of heads x head dim), not MLA's latents and kv_b_proj: an all-MoE DeepSeek-V3 (no
    # first_k_dense_replace block), which it could otherwise take, is priced by the closed form.
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
              "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
              "intermediate_size": 8192, "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 0, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 1024, "n_group": 1,
              "topk_group": 1, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    train = ("stack = 'hf'\ntransformers = '4.57.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
             "checkpointing = 'full'\nattention = 'flash-attn'\nlora_rank = 16\nloss = 'stack'\n"
             "lora_targets = ['q_a_proj', 'o_proj']")
    j = job(model=f'hf_config = "{tmp_path / "config.json"}"', train=train,
            cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'")
    assert j.facts.fsdp_version == 1 and j.shape.mla and j.shape.moe.dense_layers == 0
    assert not [p for p in estimate(j).phase_parts["step"] if p.label.startswith("default-stream segments of the wrap")]


def test_deepseek_v2_router_adapter_runs_from_transformers_5_13(job):
    # peft's all-linear puts a ParamWrapper on DeepSeek-V2's router weight. In transformers 5.0-5.12 DeepseekV2Moe's
    # forward reads `self.gate.weight` itself, so the adapter never runs and the router stays frozen: its fp32 linear
    # keeps no copy of the hidden states. From 5.13 (DeepseekV2TopkRouter) the router trains and keeps it: 4 x 2048 B
    # per token in each MoE block.
    def moe_block(release):
        j = job(model=LITE, cluster=H100, train="stack = 'hf'\nlora_rank = 16\nlora_targets = 'all-linear'\n"
                f"precision = 'bf16'\ntransformers = '{release}'")
        assert "gate" in j.facts.peft_banks
        return sum(A.saved_per_token(A.block_facts(j), "none", True).values())

    assert moe_block("5.13.0") - moe_block("5.12.0") == 4 * 2048
    assert moe_block("5.23.0") == moe_block("5.13.0")
