"""Which attention kernel torch's scaled_dot_product_attention picks on the target GPU.

The choice changes memory: the flash and memory-efficient kernels save the output and a
logsumexp, the math kernel saves the full s x s attention weights. The rules are torch's own
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.5 - 2.13), for dense causal inputs
(with a mask, flash is out: sdpa_backend's `masked`), tried in torch's priority order flash -> memory-efficient -> math:

  flash      fp16/bf16 only (check_tensor_dtype with flash_dtypes); sm80 to sm121
             (check_flash_attention_hardware_support); head dim <= 256 and a multiple of 8
             (check_head_dim_size_flash); on sm86/sm89/sm120 no training with head dim > 192
             (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120); grouped-query
             attention supported (check_batch_size_and_num_heads_dense<true>).
  efficient  fp32/fp16 from sm50, bf16 from sm80 (less_than_sm80_mem_efficient_dtypes); head dim a
             multiple of 4 (fp32) or 8 (16-bit); *no* grouped-query attention
             (check_batch_size_and_num_heads_dense<false>; torch 2.13's SDPA docs: GQA "works only
             for Flash_attention and math kernel on CUDA"): with enable_gqa and fewer kv heads it is
             skipped.
  math       everything else: repeats k/v to every head and materialises softmax(q k^T).
"""

from __future__ import annotations

from podkit.checks.gpus import GpuSpec


def sdpa_backend(gpu: GpuSpec, dtype_bytes: int, head_dim: int, gqa: bool, bf16: bool = False,
                 masked: bool = False, v_head_dim: int = 0) -> str:
    """'flash' | 'efficient' | 'math' for a causal training SDPA call of this dtype and head layout; `masked`:
    with an attn_mask, which the flash kernel does not take (sdp_utils.cpp use_flash_attention:
    check_for_attn_mask), so the memory-efficient kernel runs it where it can; `v_head_dim`: the values' head
    dim where it is not q's and k's (0: the same)."""
    half, cc = dtype_bytes == 2, gpu.compute_capability
    v_head_dim = v_head_dim or head_dim
    if bf16 and cc < (8, 0):
        return "math"  # no fused kernel takes bf16 before Ampere
    training_d_ok = not (cc in ((8, 6), (8, 9), (12, 0)) and head_dim > 192)
    if (half and not masked and (8, 0) <= cc <= (12, 1) and head_dim <= 256 and head_dim % 8 == 0
            and training_d_ok and v_head_dim == head_dim):
        return "flash"
    align = 8 if half else 4
    if cc >= (5, 0) and not gqa and head_dim % align == 0 and v_head_dim % align == 0:
        return "efficient"
    return "math"


def attention_run(job) -> str:
    """The attention the job's stack runs: train.attention, or "eager" where the stack computes a soft-capped
    model's scores itself whatever that says (Stack.softcap_attention_explicit: litgpt's and torchtune's Gemma 2)."""
    if job.shape.attn_softcap and job.facts.stack.softcap_attention_explicit:
        return "eager"
    return job.train.attention


def attention_kernel(job, device: str = "cuda", sliding: bool = False) -> str:
    """The kernel a job's attention runs: flash-attn's own, eager, or SDPA's pick on the job's GPU; `sliding`: in
    its sliding-window layers, which may get a mask where the others do not (JobFacts.layer).

    On a CPU (the smoke run's CPU mode, the tracer) SDPA runs _scaled_dot_product_flash_attention_for_cpu,
    which accepts fp32 and grouped-query attention (sdp_utils_cpp.cpp use_flash_attention_cpp) and,
    like the CUDA flash kernel, saves the output and a logsumexp.
    """
    t = job.train
    if attention_run(job) == "eager":
        return "eager"
    shape = job.shape
    if device == "cpu" and t.attention == "sdpa":
        # The CPU flash kernel too wants one head dim for q, k and v (sdp_utils_cpp.cpp check_head_dim_size_cpp).
        return "flash" if shape.v_head_dim == shape.d_head else "math"
    if t.attention == "flash-attn":
        return "flash"
    compute = t.compute_bytes
    f = job.facts.layer(sliding)
    # repeated k/v: plain MHA; MLA expands its keys and values to every head (DeepseekV3Attention.expand_kv)
    gqa = shape.kv_heads != shape.heads and not f.repeat_kv and not shape.mla
    return sdpa_backend(job.gpu, compute, shape.d_head, gqa, bf16=t.dtype == "bf16", masked=f.attn_mask is not None,
                        v_head_dim=shape.v_head_dim)
