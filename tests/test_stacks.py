"""Each defect of the truth issue, with the bytes derived by hand from how the library works.

Shapes used: Llama-3.1-8B h = 4096, L = 32, heads 32 x 128 (q_dim 4096), kv 8 x 128 (kv_dim 1024),
ffn 14336, vocab 128256, untied; per block 218,103,808 linear weights + 8,192 norm weights.
"""

import dataclasses

import pytest
import torch

from podkit.checks import activations as A
from podkit.checks import stacks
from podkit.checks.errors import ConfigError
from podkit.checks.advisor import advise
from podkit.checks.allocator import CachingAllocator, segment_size
from podkit.checks.kernels import sdpa_backend
from podkit.checks.gpus import lookup
from podkit.checks.memory import GIB, NF4_BYTES, PAGED_MIN_NUMEL, estimate, trainable_groups, trainable_params
from podkit.checks.rules import flash_attention
from podkit.train.verdict import Row, prediction_warnings

H, L, QD, KVD, F, V, HEADS = 4096, 32, 4096, 1024, 14336, 128_256, 32
BLOCK_LINEAR = 2 * H * QD + 2 * H * KVD + 3 * H * F  # 218,103,808
P_8B = 8_030_261_248
LLAMA8B = 'preset = "llama-3.1-8b"'


def part(est, label, phase):
    return sum(p.bytes for p in est.phase_parts[phase] if p.label.startswith(label))


# ---- 1. offload with a frozen base --------------------------------------------------------------


def test_offload_all_keeps_a_qlora_base_on_the_host_and_gathers_it_packed(job):
    j = job(model=LLAMA8B, train="lora_rank = 16\nbase_quant = 'nf4'\ncheckpointing = 'full'\nprecision = 'bf16'",
            cluster="gpu = 'RTX4090'\ngpus_per_node = 2\nsharding = 'zero3'\noffload = 'all'\nhost_ram_gb = 128")
    est = estimate(j)
    # Nothing of the model stays resident on the GPU.
    assert part(est, "weights", "step") == 0
    # Gathered blocks as stored: packed 4-bit linears (0.5 B: bitsandbytes keeps the absmax in
    # weight.quant_state, an attribute FSDP neither shards nor gathers), bf16 norms and bf16 adapters
    # (pure bf16), plus the root module (embeddings + head + final norm in bf16) - not 2 B per
    # quantized weight. At the loss one block is gathered (the last, for its backward); in backward
    # two (current + prefetched).
    adapters_per_block = trainable_params(j) // L
    # Only the packed parameter is gathered (0.5 B per weight); the absmax stays on each module.
    block = BLOCK_LINEAR * 0.5 + 2 * H * 2 + adapters_per_block * 2
    root = (2 * V * H + H) * 2
    assert part(est, "unsharded weights", "forward-end") == int(block + root)
    assert part(est, "unsharded weights", "backward") == int(2 * block + root)
    # The frozen base is counted once, on the host: half of it per rank's share, two ranks per node.
    frozen = BLOCK_LINEAR * L * NF4_BYTES + (2 * V * H + (2 * L + 1) * H) * 2
    assert est.host_needed >= frozen


# ---- 2. reserved vs allocated -------------------------------------------------------------------


def test_fsdp_stream_pools_are_reserved_not_allocated(job):
    est = estimate(job(model=LLAMA8B, train="checkpointing = 'full'",
                       cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    block = BLOCK_LINEAR + 2 * H
    root = 2 * V * H + H

    def pools(phase):
        return {p.label: p.bytes for p in est.phase_parts[phase] if p.where == "pool"}

    # FSDP2 (podkit's smoke runs fully_shard): the copy-in stream's segments. The root's flat bf16
    # input (its fp32 shard cast, 1/8) and flat output come first; the input is freed before block 0's
    # copy-in, whose input (block / 8) splits that segment; block 0's output cannot use the rest
    # (root / 8 - block / 8 < block) while the root's output is still held (all_gather_state), so it
    # takes a third segment: root / 8 + root + block, in bf16. Segments are never released.
    ag = (root * 2) / 8 + root * 2 + block * 2
    assert pools("forward-end")["FSDP all-gather stream pool (cached)"] == int(ag)
    # Every sharded fp32 gradient is a reduce-scatter output: the pool is cached while no gradient
    # exists (forward) and in use, so not extra, at the step.
    assert pools("forward-end")["FSDP reduce-scatter stream pool (cached)"] == P_8B * 4 // 8
    assert "FSDP reduce-scatter stream pool (cached)" not in pools("step")
    assert est.reserved >= est.allocated + int(ag)
    # The fit is judged on the device total: reserved plus the CUDA context, workspaces and NCCL.
    assert est.total > est.reserved > est.allocated


def test_fsdp2_before_torch_2_5_caches_reduce_scatter_inputs_on_their_stream(job):
    # torch 2.4 foreach_reduce allocates the flat fp32 reduce-scatter input inside
    # `with torch.cuda.stream(reduce_scatter_stream)` (pytorch PR #129721 moved it to the default stream
    # for 2.5). Per stream, best fit: block k's input (218,112,000 x 4 B) reuses block k+1's freed
    # segment, so each block's output (1/8 of it) gets its own; the root (embeddings + head + final norm)
    # reduce-scatters last, its 4.2 GB input takes a new segment and its output (1/8) fits in the freed
    # block-input segment.
    def rs_pool(torch_version, phase="forward-end"):
        version = f"\ntorch = '{torch_version}'" if torch_version else ""
        est = estimate(job(model=LLAMA8B, train="stack = 'torchtitan'\nseq_len = 8192\ncheckpointing = 'selective'"
                           + version, cluster="gpu = 'A100-80GB'\ngpus_per_node = 8\nsharding = 'zero3'"))
        return est, part(est, "FSDP reduce-scatter stream pool", phase)

    block, root = BLOCK_LINEAR + 2 * H, 2 * V * H + H
    outputs = L * block * 4 // 8 + root * 4 // 8
    assert outputs == P_8B * 4 // 8
    old, old_pool = rs_pool("2.4.0")
    new, new_pool = rs_pool("")
    assert new_pool == outputs and rs_pool("2.5.0")[1] == outputs
    # No gradient exists at the loss: the whole pool is cached and empty.
    assert old_pool == (outputs - root * 4 // 8) + block * 4 + root * 4  # 8,564,948,992 B
    assert old.reserved - new.reserved == old_pool - new_pool
    # The same through podkit's caching-allocator replay (checks/allocator.py): three steps of
    # foreach_reduce's order on the reduce-scatter stream (input, output, free input; blocks 31..0, then
    # the root), the gradients (outputs) freed by zero_grad before the next step: the same segments,
    # each rounded up to 2 MiB (podkit counts that rounding in its own "allocator rounding" part).
    alloc = CachingAllocator()
    for _ in range(3):
        grads = []
        for numel in [block] * L + [root]:
            rs_in = alloc.malloc(numel * 4, stream=1)
            grads.append(alloc.malloc(numel * 4 // 8, stream=1))
            alloc.free(rs_in)
        for g in grads:
            alloc.free(g)
    assert alloc.reserved == L * segment_size(block * 4 // 8) + segment_size(block * 4) + segment_size(root * 4)
    assert old.allocated == new.allocated  # the pool holds no tensor then
    # In backward the block's input being reduce-scattered lives in that pool, not beside it.
    assert part(old, "FSDP reduce-scatter stream pool", "backward") < old_pool
    # Only FSDP2 stacks: FSDP1 (hf) has its own reduce-scatter path.
    sharded = "gpu = 'A100-80GB'\ngpus_per_node = 8\nsharding = 'zero3'"
    assert job(model=LLAMA8B, train="stack = 'torchtitan'\ntorch = '2.4.0'", cluster=sharded).facts.rs_input_on_rs_stream
    assert not job(model=LLAMA8B, train="stack = 'hf'\ntorch = '2.4.0'", cluster=sharded).facts.rs_input_on_rs_stream
    assert not job(model=LLAMA8B, train="stack = 'torchtitan'\ntorch = '2.4.0'").facts.rs_input_on_rs_stream


def test_fsdp2_all_gather_segments_when_a_block_outgrows_the_root(job):
    # A small vocabulary: the block's flat input no longer fits in the root's freed input segment, so
    # each of the four copy-in allocations (root in, root out, block in, block out) is a segment.
    j = job(model="hidden = 1024\nlayers = 2\nheads = 8\nffn = 4096\nvocab = 256",
            train="stack = 'torchtitan'\nseq_len = 512", cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'")
    groups = j.shape.param_groups()
    root = sum(g.total for g in groups if not g.per_layer) * 2
    block = sum(g.total for g in groups if g.per_layer) // 2 * 2
    assert block / 8 > root / 8
    pool = sum(p.bytes for p in estimate(j).phase_parts["forward-end"] if p.label.startswith("FSDP all-gather"))
    assert pool == int(root / 8 + root + block / 8 + block)


def test_hf_shards_with_fsdp1_flat_parameters_gathered_inside_their_pool(job):
    # accelerate's FSDP plugin is FSDP1: the all-gather writes into the unsharded flat parameter, which
    # lives in the unshard stream's pool (no FSDP2 copy-in buffer beside it). Full fine-tune, bf16-mixed
    # (MixedPrecision param_dtype bf16 over fp32 shards), 8 GPUs, accelerate's decoder-layer wrap.
    j = job(model=LLAMA8B, train="checkpointing = 'full'\nstack = 'hf'",
            cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'")
    assert j.facts.fsdp_version == 1
    est = estimate(j)
    root, block = (2 * V * H + H) * 2, (BLOCK_LINEAR + 2 * H) * 2  # as gathered: bf16

    def part(label, phase):
        return sum(p.bytes for p in est.phase_parts[phase] if p.label.startswith(label))

    assert part("FSDP all-gather", "forward-end") == 0
    # At the loss only the root is gathered; in backward the block and the one prefetched before it
    # (BACKWARD_PRE: the handle that ran its forward just before, with no LoRA units in between).
    assert part("unsharded weights", "forward-end") == root
    assert part("unsharded weights", "backward") == root + 2 * block
    assert part("FSDP1 unshard-stream pool", "step") == root + 2 * block
    # Each unit's fp32 shard is cast to bf16 on the pre-unshard stream before its all-gather: that pool
    # is the root's bf16 shard (2,101,354,496 / 8 = 262,669,312 B, a 126 x 2 MiB segment).
    assert root // 8 == 262_669_312
    assert part("FSDP1 pre-unshard stream pool", "step") == 126 * 2 * 1024 * 1024


def test_deepspeed_zero3_keeps_the_undereived_all_gather_pool(job):
    est = estimate(job(model=LLAMA8B, train="checkpointing = 'full'\nstack = 'deepspeed'",
                       cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    pool = sum(p.bytes for p in est.phase_parts["forward-end"] if p.label.startswith("FSDP all-gather"))
    assert pool == ((2 * V * H + H) + 2 * (BLOCK_LINEAR + 2 * H)) * 2


def test_freed_logits_leave_a_hole_the_loss_backward_cannot_fill(job):
    # torchtitan: bf16 pred (2 B/logit), its fp32 copy (4) freed when loss_fn returns, `del pred`:
    # one 6 B hole. Backward's nll_loss gradient (4) takes it, log_softmax's input gradient (4) must go
    # elsewhere, and 2 B per logit stay reserved but unused at that moment.
    train = "stack = 'torchtitan'\nmicro_batch = 2\nseq_len = 8192\ncheckpointing = 'selective'"
    logits = 2 * 8192 * V
    # Under FSDP (no autocast cache) the loss's backward (12 B per logit) is the forward phase's moment.
    est = estimate(job(model=LLAMA8B, train=train, cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    hole = [p for p in est.phase_parts["forward-end"] if p.label.startswith("freed logits")]
    assert [p.bytes for p in hole] == [2 * logits] and hole[0].where == "pool"
    assert est.term("loss", "forward-end") == 12 * logits
    # On one GPU autocast keeps its whole weight cache through the loss's forward (bf16 logits, their
    # fp32 copy, the log-softmax output: 10 B per logit), the phase's most tensors. Its backward (12 B),
    # after the casts were freed into weight-sized cached blocks its gradients cannot use, with the 2 B
    # hole beside, reserves 4 B per logit more than that: the phase reserves it.
    est = estimate(job(model=LLAMA8B, train=train, cluster="gpu = 'H100'"))
    assert est.term("loss", "forward-end") == 10 * logits
    assert part(est, "segments another moment of this phase reserves", "forward-end") == 4 * logits
    # Logits the loop keeps through backward (litgpt's chunk list) leave no hole; nor does a chunked loss.
    # (transformers <= 4.44's fp32-logits-kept keeps the fp32 logits but frees the 16-bit ones at
    # .float(): a 2 B hole, tests/test_fsdp1.py.)
    for train in ("stack = 'litgpt'", "stack = 'torchtune'", "precision = 'fp32'"):
        e = estimate(job(model=LLAMA8B, train=train, cluster="gpu = 'H100'"))
        assert not [p for p in e.phase_parts["forward-end"] if p.label.startswith("freed logits")], train


# ---- 3. the loss per stack ----------------------------------------------------------------------


@pytest.mark.parametrize("stack,loss,per_logit", [
    ("podkit", "stack", 12),         # bf16 logits + fp32 copy + fp32 log-softmax; backward 4 + 4 + 4
    ("hf", "fp32-logits-kept", 16),  # transformers <= 4.44: fp32 logits kept + log-softmax + grads
    ("torchtune", "stack", 6.5),     # 8 chunks: bf16 logits 2 + fp32 log-softmax 4 + one fp32 chunk 4/8
    # 128-token chunks kept, which Fabric's wrapper cast to fp32 (4), + their fp32 log-softmax (4), no
    # upcast of the loss's own; backward adds one chunk's gradient in and out of log_softmax, 2 x 4 B / 8
    # chunks of a 1024-token sequence.
    ("litgpt", "stack", 9),
    ("hf", "fused", 0),              # fused linear + cross-entropy: no logits tensor
])
def test_loss_bytes_per_logit(job, stack, loss, per_logit):
    # (no previous step's outputs, which litgpt's loop keeps: test_litgpt_previous_logits_meet_the_forward_only)
    j = job(model=LLAMA8B, train=f"stack = '{stack}'\nloss = '{loss}'\nseq_len = 1024\nprecision = 'bf16'\n"
                                 "previous_outputs = 'freed'")
    est = estimate(j)
    assert part(est, "loss:", "forward-end") == int(per_logit * V * 1024)


def test_litgpt_previous_logits_meet_the_forward_only(job):
    """litgpt fit(): `logits = model(input_ids, lm_head_chunk_size=128)` keeps the previous step's fp32 chunks
    bound while the forward runs, up to Fabric's cast of the new ones (bf16 2 + fp32 4 B per logit), and the
    assignment releases them before chunked_cross_entropy: 2 + 4 + 4 = 10 B per logit then, against the
    loss's 9 (4 kept + 4 log-softmax + one chunk's 2 x 4 B gradients over 8 chunks)."""
    T = 1024
    train = "stack = 'litgpt'\nseq_len = 1024\nprecision = 'bf16'\nlora_rank = 8\nprevious_outputs = "
    kept = estimate(job(model=LLAMA8B, train=train + "'kept'"))
    assert part(kept, "the forward's logits as it returns, cast to fp32", "forward-end") == 6 * V * T
    assert part(kept, "previous step's logits and graph", "forward-end") == 4 * V * T
    assert part(kept, "loss:", "forward-end") == 0
    freed = estimate(job(model=LLAMA8B, train=train + "'freed'"))
    assert part(freed, "loss:", "forward-end") == 9 * V * T
    assert kept.phase_allocated("forward-end") - freed.phase_allocated("forward-end") == (10 - 9) * V * T


def test_liger_loss_holds_the_gradients_it_made_in_forward(job):
    """Liger's fused linear cross-entropy (Liger-Kernel ops/fused_linear_cross_entropy.py): forward keeps
    grad_input = zeros_like(_input) (the final norm's fp32 output over fp32 weights), grad_weight =
    zeros_like(weight) (fp32 master) and an fp32 loss per row; its chunk is next_power_of_2(cdiv(BT,
    cdiv(V, H))) rows: 8192 tokens, cdiv(128256, 4096) = 32, 256 rows of bf16 logits, plus that chunk's
    rows of grad_input as the matmul makes them and its input cast to bf16."""
    T = 4 * 2048
    j = job(model=LLAMA8B, train="stack = 'hf'\nloss = 'liger'\nmicro_batch = 4\nseq_len = 2048\n"
                                  "precision = 'bf16-mixed'\ncheckpointing = 'full'")
    rows = 256
    held = T * H * 4 + V * H * 4 + T * 4
    assert part(estimate(j), "loss: Liger", "forward-end") == held + rows * V * 2 + 2 * rows * H * 2
    # A LoRA job's head is frozen: no weight gradient, and the input is the bf16 stream.
    lora = job(model=LLAMA8B, train="stack = 'hf'\nloss = 'liger'\nmicro_batch = 4\nseq_len = 2048\n"
                                     "precision = 'bf16'\nlora_rank = 16\ncheckpointing = 'full'")
    lg = A.liger_loss(lora, T, A.block_facts(lora).stream)
    assert (lg.held, lg.transient, lg.head_weight_grad) == (T * H * 2 + T * 4, rows * V * 2 + rows * H * 2, 0)
    # Against the transformers loss it replaces: no logits at all, so far less at the loss.
    plain = job(model=LLAMA8B, train="stack = 'hf'\nmicro_batch = 4\nseq_len = 2048\nprecision = 'bf16-mixed'\n"
                                      "checkpointing = 'full'")
    assert part(estimate(plain), "loss:", "forward-end") > 4 * held


def test_liger_block_kernels_keep_what_their_functions_save(job):
    """train.block_kernels = "liger" (Liger-Kernel ops/rms_norm.py, rope.py, swiglu.py). A pure-bf16 full
    fine-tune of Llama-3.1-8B, no checkpointing, flash attention with native GQA. Per token and block:
    LigerRMSNorm keeps its input X and an fp32 rstd (the weight is a parameter); the q/k/v and gate/up
    linears keep their (shared) inputs, the norms' outputs; RoPE rotates q and k in place, so the flash
    kernel keeps the projections themselves; LigerSiLUMul keeps gate and up; down_proj keeps the product."""
    j = job(model=LLAMA8B, train="precision = 'bf16'\ncheckpointing = 'none'\nblock_kernels = 'liger'\n"
                                  "micro_batch = 1\nseq_len = 2048")
    bf = A.block_facts(j)
    e = 2
    norm = H * e + 4  # X and rstd
    attention = (QD + 2 * KVD) * e + QD * e + HEADS * 4  # q, k, v; output; logsumexp
    expected = 2 * norm + 2 * H * e + attention + 3 * F * e  # + the two norm outputs; gate, up, product
    assert sum(A.saved_per_token(bf, "none").values()) == expected
    # transformers' modules keep more: per norm an fp32 upcast (4h) and the normalised x cast back (2h)
    # instead of X (2h); silu(gate) besides gate and up.
    torch_bf = dataclasses.replace(bf, liger=False)
    assert sum(A.saved_per_token(torch_bf, "none").values()) - expected == 2 * (4 * H + 2 * H - 2 * H) + F * e
    # Backward: RMSNorm writes dX into dY, so the final norm's backward holds nothing beyond its output's
    # gradient. A block's backward peaks at down_proj's node with Liger: the output's gradient (the
    # residual's too) and the product's, since SiLU-mul writes da and db into the saved gate and up;
    # transformers' mul node allocates silu(gate)'s and up's gradients beside the product's, once
    # down_proj has released the product.
    assert A.final_norm_backward_per_token(bf) == H * e
    assert A.final_norm_backward_per_token(torch_bf) > 4 * H * e
    # Gemma 2 and 3's patch builds the norm with in_place=False: dX is a new zeros_like(dY).
    assert not stacks.liger_norm_in_place("gemma2") and stacks.liger_norm_in_place("gemma")
    assert A.final_norm_backward_per_token(dataclasses.replace(bf, liger_norm_in_place=False)) == 2 * H * e
    assert A.backward_intermediates_per_token(bf) == H * e + F * e
    assert A.backward_intermediates_per_token(torch_bf) == H * e + 2 * F * e


def test_liger_chunk_follows_liger_s_rule():
    # Liger's own example (fused_linear_cross_entropy_forward): BT = 4096*4, V = 32000, H = 4096 -> 2048.
    assert A.liger_chunk_rows(4096 * 4, 4096, 32000) == 2048
    assert A.liger_chunk_rows(8192, 4096, 128_256) == 256
    assert A.liger_chunk_rows(100, 4096, 4096) == 100  # one chunk covers BT when the budget allows
    assert A.liger_chunk_rows(5, 64, 1000) == 1  # cdiv(5, 16) = 1


# ---- 4. QLoRA: bitsandbytes before 0.43.2 keeps every quantized matmul's input ------------------


def test_old_bitsandbytes_keeps_quantized_inputs_even_under_checkpointing(job):
    def acts(bnb, stack, ckpt):
        # transformers 4.39 (bitsandbytes 0.42's time): the Trainer's checkpoint is reentrant by default.
        j = job(model=LLAMA8B, train=f"lora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'\nseq_len = 512\n"
                                      f"stack = '{stack}'\ncheckpointing = '{ckpt}'\nbitsandbytes = '{bnb}'\n"
                                      f"transformers = '4.39.3'\ntrl = '0.8.6'")
        return part(estimate(j), "saved activations", "forward-end")

    # Inputs of q/k/v (one shared normed tensor, h), gate/up (h), down (ffn), bf16; o_proj's input is
    # a view of the flash kernel's output, which SDPA keeps anyway.
    extra = L * 512 * (2 * H + F) * 2
    assert acts("0.42.0", "hf", "none") - acts("0.45.5", "hf", "none") == extra
    # ctx.tensors is out of reach of non-reentrant checkpointing's hooks: kept under 'full' too, and
    # there o_proj's input (the attention output, q_dim) is held by nothing else.
    assert acts("0.42.0", "podkit", "full") - acts("0.45.5", "podkit", "full") == L * 512 * (2 * H + QD + F) * 2
    # ...but a reentrant checkpoint (transformers' default) runs forward in no_grad: nothing kept.
    assert acts("0.42.0", "hf", "full") == acts("0.45.5", "hf", "full")


def test_old_bitsandbytes_keeps_quantized_inputs_while_a_checkpointed_block_recomputes(job):
    # Backward re-runs the block's forward with grad enabled (reentrant: CheckpointFunction.backward under
    # torch.enable_grad()), so bitsandbytes < 0.43.2 sets ctx.tensors = (A, B) on every 4-bit matmul of
    # that block, alive until its backward ends: the normed input of q/k/v (h), of gate/up (h) and
    # down's input (ffn), bf16; o_proj's input is the attention output SDPA keeps anyway.
    def in_backward(bnb):
        j = job(model=LLAMA8B, train=f"lora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'\nseq_len = 512\n"
                                      f"stack = 'hf'\ncheckpointing = 'full'\nbitsandbytes = '{bnb}'\n"
                                      f"transformers = '4.39.3'\ntrl = '0.8.6'")
        return part(estimate(j), "one block in backward", "backward")

    assert in_backward("0.43.0") - in_backward("0.43.2") == 512 * (2 * H + F) * 2


# ---- 5. "selective" means each stack's policy -----------------------------------------------------


def test_torchtitan_op_sac_keeps_every_second_matmul(job):
    j = job(model=LLAMA8B, train="stack = 'torchtitan'\ncheckpointing = 'selective'\nseq_len = 2048",
            cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'")
    kept = sum(A.saved_per_token(A.block_facts(j), j.facts.ac_policy).values())
    # bf16 stream (FSDP's bf16 parameters): block input 2h; mm outputs 1 (wq), 3 (wv), 5 (w1), 7 (w2);
    # SDPA output and fp32 logsumexp.
    assert j.facts.ac_policy == "op-sac"
    assert kept == 2 * H + 2 * (QD + KVD + F + H) + 2 * QD + 4 * HEADS
    podkit = job(model=LLAMA8B, train="checkpointing = 'selective'\nseq_len = 2048",
                 cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'")
    assert podkit.facts.ac_policy == "matmuls"
    # podkit's policy also keeps wk, wo and w3.
    assert sum(A.saved_per_token(A.block_facts(podkit), "matmuls").values()) - kept == 2 * (KVD + H + F)


def test_hf_selective_is_per_layer_recompute(job):
    assert job(train="stack = 'hf'\ncheckpointing = 'selective'").facts.ac_policy == "block"


# ---- 6. LoRA targets and the adapters' activations ------------------------------------------------


def test_peft_targets_q_and_v_by_default(job):
    hf = job(model=LLAMA8B, train="stack = 'hf'\nlora_rank = 16")
    assert hf.facts.lora_targets == ("q_proj", "v_proj")
    assert trainable_params(hf) == L * 16 * ((H + QD) + (H + KVD))
    podkit = job(model=LLAMA8B, train="lora_rank = 16")
    assert trainable_params(podkit) == podkit.shape.lora_params(16)  # every block linear
    listed = job(model=LLAMA8B, train="lora_rank = 8\nlora_targets = ['o_proj', 'lm_head']")
    assert trainable_params(listed) == L * 8 * (QD + H) + 8 * (H + V)


def test_lora_matmul_outputs_are_kept_under_the_matmuls_policy(job):
    base = job(model=LLAMA8B, train="lora_rank = 16\nlora_targets = ['q_proj']\ncheckpointing = 'selective'")
    more = job(model=LLAMA8B, train="lora_rank = 16\nlora_targets = ['q_proj', 'v_proj']\ncheckpointing = 'selective'")
    a = sum(A.saved_per_token(A.block_facts(base), "matmuls").values())
    b = sum(A.saved_per_token(A.block_facts(more), "matmuls").values())
    # v_proj's adapter adds two matmuls: lora_A's output (r) and lora_B's (kv_dim), bf16 under autocast.
    assert b - a == 2 * (16 + KVD)


# ---- 7. the attention kernel SDPA really picks ---------------------------------------------------


def test_sdpa_kernel_choice():
    h100, t4 = lookup("H100"), lookup("T4")
    assert sdpa_backend(h100, 2, 128, gqa=True) == "flash"
    assert sdpa_backend(h100, 4, 128, gqa=True) == "math"       # no fp32 flash, no GQA in efficient
    assert sdpa_backend(h100, 4, 128, gqa=False) == "efficient"
    assert sdpa_backend(t4, 2, 128, gqa=False) == "efficient"   # flash needs sm80
    assert sdpa_backend(t4, 2, 128, gqa=True) == "math"


def test_pure_fp16_attention_kernel_by_gpu(job):
    """sdp_utils.cpp: flash takes fp16 on sm80-sm121 (check_flash_attention_hardware_support, check_dtypes_low_precision),
    memory-efficient takes fp16 from sm50 (less_than_sm80_mem_efficient_dtypes = {kHalf, kFloat}) but bf16 only from sm80."""
    from podkit.checks.kernels import attention_kernel

    mha = "hidden = 1024\nlayers = 2\nheads = 16\nffn = 4096\nvocab = 32000"  # head dim 64, no GQA
    for gpu, kernel in (("T4", "efficient"), ("V100", "efficient"), ("A100-80GB", "flash")):
        assert attention_kernel(job(model=mha, train="precision = 'fp16'", cluster=f"gpu = '{gpu}'")) == kernel, gpu
        assert attention_kernel(job(model=mha, train="precision = 'fp16-mixed'", cluster=f"gpu = '{gpu}'")) == kernel
    # Pure bf16 before Ampere has no fused kernel at all.
    assert attention_kernel(job(model=mha, train="precision = 'bf16'", cluster="gpu = 'T4'")) == "math"
    # Llama-3.2-1B's grouped-query attention: only flash takes it, so pre-Ampere fp16 falls to math...
    for gpu, kernel in (("T4", "math"), ("V100", "math"), ("A100-80GB", "flash")):
        assert attention_kernel(job(train="precision = 'fp16'", cluster=f"gpu = '{gpu}'")) == kernel, gpu
    check = flash_attention(job(train="precision = 'fp16'", cluster="gpu = 'T4'"))
    assert check.status == "warn" and "fp16 with grouped-query attention on sm75" in check.message
    assert check.fix == "use a sm80+ GPU (flash kernel), or a model without GQA"
    # ... unless the stack repeats k and v to every head first (litgpt): plain multi-head attention to SDPA.
    litgpt = job(train="stack = 'litgpt'\nprecision = 'fp16'", cluster="gpu = 'T4'")
    assert attention_kernel(litgpt) == "efficient" and flash_attention(litgpt).status == "pass"


def test_math_kernel_keeps_16_bit_inputs_in_fp32(job):
    """torch 2.5+ _scaled_dot_product_attention_math casts 16-bit q, k and v to fp32 first (attention.cpp
    `query_.to(at::kFloat)`, pytorch#128922): it keeps fp32 q, k, v and s x s weights; torch 2.4 keeps them in fp16."""
    from podkit.checks.rules import gib

    fp16 = "precision = 'fp16'\nseq_len = 1024\n"
    for torch_version, b in (("", 4), ("2.5.0", 4), ("2.4.1", 2)):
        j = job(train=fp16 + (f"torch = '{torch_version}'" if torch_version else ""), cluster="gpu = 'T4'")
        per_token = A.saved_per_token(A.block_facts(j), "none")
        heads, q = j.shape.heads, j.shape.q_dim
        assert per_token["attention weights s x s (math kernel)"] == heads * 1024 * b
        assert per_token["q scaled"] == per_token["k scaled (repeated)"] == q * b
        assert gib(heads * 1024 * 1024 * b) in flash_attention(j).message


def test_fp32_gqa_keeps_the_s_by_s_weights(job):
    fp32 = job(model=LLAMA8B, train="precision = 'fp32'\nseq_len = 1024", cluster="gpu = 'H100'")
    per_token = A.saved_per_token(A.block_facts(fp32), "none")
    assert per_token["attention weights s x s (math kernel)"] == HEADS * 1024 * 4
    check = flash_attention(fp32)
    assert check.status == "warn" and "math kernel" in check.message


# ---- 8. optimizer step temporaries and paged states ----------------------------------------------


def test_foreach_step_temporaries(job):
    sgd = estimate(job(model=LLAMA8B, train="optimizer = 'sgd'\noptimizer_impl = 'foreach'"))
    matrices = sum(g.total for g in trainable_groups(job(model=LLAMA8B)) if g.cols > 1)
    # torch._foreach_add(grads, params, alpha=weight_decay): a copy of every decayed fp32 gradient.
    assert part(sgd, "step temporaries", "step") == matrices * 4
    adamw = estimate(job(model=LLAMA8B, train="optimizer_impl = 'foreach'"))
    assert part(adamw, "step temporaries", "step") == P_8B * 4  # torch._foreach_sqrt(exp_avg_sqs)
    assert part(estimate(job(model=LLAMA8B)), "step temporaries", "step") == 0  # fused


def test_paged_states_are_outside_the_allocator(job):
    j = job(model=LLAMA8B, train="lora_rank = 16\noptimizer = 'paged_adamw'\nlora_targets = 'all-linear'")
    est = estimate(j)
    groups = trainable_groups(j)
    paged = sum(g.total for g in groups if g.numel >= PAGED_MIN_NUMEL) * 8  # fp32 m and v
    small = sum(g.total for g in groups if g.numel < PAGED_MIN_NUMEL) * 8
    assert paged and small  # r x 4096 adapters stay under 1e5 values; r x 14336 ones are paged
    assert part(est, "paged_adamw paged states", "step") == paged
    assert part(est, "paged_adamw states", "step") == small
    assert est.phase_allocated("step") < est.phase_reserved("step") + 1 <= est.phases["step"] - paged + 1


# ---- 9. the backward peak at its end -------------------------------------------------------------


def test_backward_end_holds_nearly_every_gradient(job):
    est = estimate(job(model=LLAMA8B, train="checkpointing = 'full'\nseq_len = 1024", cluster="gpu = 'H100'"))
    # Every fp32 gradient but the input embedding's, which embedding backward produces last.
    assert part(est, "gradients so far (all but", "backward-end") == (P_8B - V * H) * 4
    assert est.phase_allocated("backward-end") > est.phase_allocated("backward")


def test_fsdp2_root_reduce_scatters_when_backward_ends(job):
    # fully_shard(model) holds the embeddings, the final norm and the head; its post-backward runs in the
    # root's final callback, when backward ends. Until then its gradients stay unsharded in bf16 (the
    # gathered dtype), the head's and the norm's from their backward on; then foreach_reduce copies them
    # into one fp32 reduce-scatter input and frees them only after that copy. Every block's gradient is
    # sharded by then, and the root and the blocks are resharded.
    j = job(model=LLAMA8B, train="seq_len = 4096\ncheckpointing = 'full'",
            cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'")
    est = estimate(j)
    root = 2 * V * H + H
    assert part(est, "unsharded root gradients (head, final norm)", "backward") == (V * H + H) * 2
    assert part(est, "gradients so far (last block)", "backward") == (BLOCK_LINEAR + 2 * H) * 4 // 8
    end = est.phase_parts["backward-end"]
    assert {p.label for p in end if p.term == "grads"} == {
        "gradients so far (every block)", "unsharded root gradients", "the root's reduce-scatter input"}
    assert part(est, "gradients so far (every block)", "backward-end") == (P_8B - root) * 4 // 8
    assert part(est, "unsharded root gradients", "backward-end") == root * 2
    assert part(est, "the root's reduce-scatter input", "backward-end") == root * 4
    # Weights and AdamW states sharded, nothing gathered, no activation left: 20.34 GiB, the trace's
    # backward peak for this job (benchmarks/results/traced_vs_analytic.md).
    expected = P_8B * 4 // 8 + P_8B * 8 // 8 + (P_8B - root) * 4 // 8 + root * (2 + 4)
    assert est.phase_allocated("backward-end") == expected + part(est, "cuBLAS", "backward-end")
    # A LoRA job's root trains nothing: no such moment.
    lora = estimate(job(model=LLAMA8B, train="lora_rank = 16\nseq_len = 4096",
                        cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    assert part(lora, "the root's reduce-scatter input", "backward-end") == 0


def test_the_embeddings_backward_ends_backward(job):
    # embedding_dense_backward makes a dense vocab x hidden gradient beside every other. A tied head's
    # gradient waits for it in the weight's input buffer; autograd adds the two in place only into a
    # tensor it can steal (input_buffer.cpp can_accumulate_inplace): under autocast the head's is
    # ToCopyBackward's fresh fp32 copy (aten::add_), in bf16 it is the linear's weight gradient, which
    # it cannot steal (aten::add: a third vocab x hidden tensor; torch 2.13's profiler, profile_memory).
    V1, H1, P1 = 128_256, 2048, 1_235_814_400
    tied = "preset = 'llama-3.2-1b'"
    bf16 = estimate(job(model=tied, train="precision = 'bf16'\nseq_len = 16", cluster="gpu = 'A100-80GB'"))
    end = {p.label: p.bytes for p in bf16.phase_parts["backward-end"] if p.term == "grads"}
    assert end == {"gradients so far (all but the embedding)": P1 * 2,
                   "the input embedding's gradient, being made": V1 * H1 * 2,
                   "the tied weight's two gradients, summed out of place": V1 * H1 * 2}
    mixed = estimate(job(model=tied, train="seq_len = 16", cluster="gpu = 'A100-80GB'"))
    end = {p.label: p.bytes for p in mixed.phase_parts["backward-end"] if p.term == "grads"}
    assert end == {"gradients so far (all but the embedding)": P1 * 4,
                   "the input embedding's gradient, being made": V1 * H1 * 4}
    # FSDP2: the root (the tied embedding and the final norm) is still gathered, its gradients unsharded
    # in bf16 and summed out of place, and the first block's fp32 reduce-scatter input is kept until the
    # root's post-backward (reduce_scatter_states, one input buffer): 4.38 GiB, the trace's 4.37.
    fsdp = estimate(job(model=tied, train="seq_len = 4096\ncheckpointing = 'full'",
                        cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    root = V1 * H1 + H1  # the tied embedding and the final norm
    block = 2 * H1 * H1 + 2 * H1 * 512 + 3 * H1 * 8192 + 2 * H1  # q, o; k, v (GQA); gate, up, down; two norms
    grads = {p.label: p.bytes for p in fsdp.phase_parts["backward-end"] if p.term == "grads"}
    assert grads == {"gradients so far (every block)": (P1 - root) * 4 // 8,
                     "unsharded root gradients (head, final norm)": root * 2,
                     "the first block's reduce-scatter input, kept until the root's post-backward": block * 4,
                     "the input embedding's gradient, being made": V1 * H1 * 2,
                     "the tied weight's two gradients, summed out of place": V1 * H1 * 2}
    assert part(fsdp, "unsharded weights", "backward-end") == root * 2


def test_fsdp2_zero2_reshards_each_block_after_its_backward(job):
    # reshard_after_forward=False keeps every block gathered from its forward to its backward, but
    # reshard_after_backward (True by default) frees each once its backward is done: at the first
    # block's backward only it and the root are gathered.
    est = estimate(job(model=LLAMA8B, train="seq_len = 4096\ncheckpointing = 'full'",
                       cluster="gpu = 'A100-80GB'\ngpus_per_node = 8\nsharding = 'zero2'"))
    block, root = BLOCK_LINEAR + 2 * H, 2 * V * H + H
    assert part(est, "unsharded weights", "backward") == (L * block + root) * 2
    in_first_block = [p for p in est.phase_parts["backward-end"] if p.label == "unsharded weights being used"]
    assert [p.bytes for p in in_first_block] in ([(block + root) * 2], [])  # [] if the root's reduce wins
    assert est.phase_allocated("backward-end") < est.phase_allocated("backward")


# ---- 10. autocast's weight cache under checkpointing ---------------------------------------------


def test_autocast_cache_after_forward_is_the_head_only_when_checkpointed(job):
    ckpt = estimate(job(model=LLAMA8B, train="checkpointing = 'full'\nseq_len = 1024", cluster="gpu = 'H100'"))
    plain = estimate(job(model=LLAMA8B, train="seq_len = 1024", cluster="gpu = 'H100'"))
    everything = (L * BLOCK_LINEAR + V * H) * 2
    assert part(ckpt, "autocast weight cache", "forward-end") == everything
    # The head's cast is saved by the head's matmul alone: its backward node runs, and releases it,
    # before backward reaches the blocks. Without checkpointing every block's cast is saved until then.
    assert part(plain, "autocast weight cache", "backward") == L * BLOCK_LINEAR * 2
    # Checkpointed: only the block being recomputed.
    assert part(ckpt, "autocast weight cache", "backward") == BLOCK_LINEAR * 2


def test_a_tied_heads_gradient_waits_for_the_embeddings_under_accumulation(job):
    # Llama 3.2 1B ties the head to the embedding: that weight's AccumulateGrad runs once both inputs
    # arrived (engine.cpp dependencies), so the head's fp32 gradient waits in autograd's input buffer
    # from the head's backward until the embedding's, beside the .grad accumulation keeps.
    V1, H1, P1 = 128_256, 2048, 1_235_814_400
    accum = estimate(job(model='preset = "llama-3.2-1b"', train="grad_accum = 4\ncheckpointing = 'full'",
                         cluster="gpu = 'A10G'"))
    for phase in ("backward", "backward-end"):
        assert part(accum, "gradients", phase) == P1 * 4
        assert part(accum, "the head's gradient, waiting", phase) == V1 * H1 * 4
    # Untied (Llama 3.1 8B) the head's gradient goes into its .grad right away.
    untied = estimate(job(model=LLAMA8B, train="grad_accum = 4", cluster="gpu = 'H100'"))
    assert part(untied, "the head's gradient, waiting", "backward") == 0


# ---- 11. the advisor and the smoke verdict -------------------------------------------------------


def test_advisor_explores_from_the_valid_neighbour(job):
    j = job(model='preset = "mistral-7b"', train="optimizer = 'adamw8bit'\nseq_len = 2048",
            cluster="gpu = 'L40S'\nsharding = 'zero3'")
    assert j.facts.bnb_unsupported
    found = advise(j)
    assert found and all(s.estimate.total <= s.estimate.capacity * 0.9 for s in found)


def test_smoke_warns_when_a_term_is_off_by_more_than_ten_percent():
    rows = [Row("optimizer", 1_600_000, 3_300_000), Row("params", 10 << 20, (10 << 20) + 1)]
    [line] = prediction_warnings(rows)
    assert line.startswith("optimizer:") and "+106%" in line


# ---- seed scenarios keep their verdicts ------------------------------------------------------------


def test_fp32_logits_of_a_128k_vocabulary_dominate(job):
    est = estimate(job(train="micro_batch = 1\nseq_len = 8192\ncheckpointing = 'selective'"))
    loss = part(est, "loss:", "forward-end")
    assert loss == 12 * 128_256 * 8192 and loss / GIB == pytest.approx(11.74, abs=0.01)
    assert loss == max(p.bytes for p in est.phase_parts["forward-end"])


def test_qwen_7b_lora_batch_2_does_not_fit_a_24_gb_card(job):
    est = estimate(job(model='preset = "qwen2.5-7b"', train="stack = 'hf'\nlora_rank = 16\nmicro_batch = 2\n"
                                                        "seq_len = 2048\nprecision = 'bf16'",
                       cluster="gpu = 'RTX4090'"))
    assert not est.fits


# ---- Mixture of Experts (issue 13): all experts stored, activations follow the routed tokens ------


def test_moe_keeps_every_expert_and_routes_activations(job):
    j = job(model='preset = "mixtral-8x7b"', train="precision = 'bf16'\nseq_len = 1024", cluster="gpu = 'H100'")
    shape = j.shape
    est = estimate(j)
    # Every expert's weights (and gradients and AdamW states) live on the GPU without sharding.
    assert part(est, "weights", "step") == shape.params * 2
    assert shape.active_params < shape.params / 3
    h, qd, kvd, heads, experts, k, ffn = 4096, 4096, 1024, 32, 8, 2, 14336
    per_token = (2 * (6 * h + 4)             # two RMSNorms on a bf16 stream: fp32 upcast, rsqrt, normed
                 + 2 * h                     # the normed input shared by q, k, v
                 + 2 * (qd + 2 * kvd)        # q, k, v after RoPE
                 + 2 * qd + 4 * heads        # flash output (o_proj reads a view) and logsumexp
                 + 2 * h                     # the normed input the router keeps
                 + 4 * experts               # the router's fp32 softmax
                 + 2 * h * k                 # each token gathered once per routed expert
                 + 4 * 2 * ffn * k           # each expert's gate, silu, up and product
                 + 2 * h * k)                # expert outputs, kept for the routing weights' gradient
    assert sum(A.saved_per_token(A.block_facts(j), "none", moe_layer=True).values()) == per_token


def test_one_block_in_backward_is_a_block_the_model_has(job):
    # Mixtral's 32 blocks are all MoE: the block in backward is one of them, not a dense MLP of the
    # experts' width over every token (which would hold about four times an expert's intermediates).
    # An HF QLoRA with per-block checkpointing: the block's recompute, then its backward.
    j = job(model='preset = "mixtral-8x7b"', cluster="gpu = 'H100'",
            train="stack = 'hf'\nlora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16-mixed'\n"
                  "checkpointing = 'full'\nseq_len = 1024\ntransformers = '4.48.1'")
    bf, T, reentrant = A.block_facts(j), 1024, j.facts.reentrant

    def intermediates(moe):  # the most the recompute or the backward holds beyond what the block saves
        return max(A.backward_intermediates_per_token(bf, moe), A.recompute_transient_per_token(bf, moe, reentrant))

    assert intermediates(False) > intermediates(True)  # what the dense kind would have put there
    assert part(estimate(j), "one block in backward", "backward") == int(
        (A.recomputed_per_token(bf, "block", True) + intermediates(True)) * T)
    # DeepSeek-V2-Lite: 1 dense block (first_k_dense_replace) and 26 MoE blocks. The first block's saved
    # set at backward-end is a whole block's, the larger kind's, not the per-block average over both kinds.
    d = job(model='preset = "deepseek-v2-lite"', train="precision = 'bf16'\nseq_len = 1024\nlora_rank = 8",
            cluster="gpu = 'H100'")
    bf = A.block_facts(d)
    kinds = [sum(A.saved_per_token(bf, "none", moe_layer=m).values()) for m in (False, True)]
    assert kinds[0] != kinds[1]
    assert part(estimate(d), "first block's saved activations", "backward-end") == int(max(kinds) * T)


def test_lora_targets_defaults_and_empty_lists(job):
    # GPT-2's peft default is c_attn; an empty list is refused (for a MoE too, where peft may move names to banks).
    assert job(model='preset = "gpt2-124m"', train="stack = 'hf'\nlora_rank = 8").facts.lora_targets == ("c_attn",)
    for model in ('preset = "llama-3.2-1b"', 'preset = "mixtral-8x7b"'):
        with pytest.raises(ConfigError, match="is empty"):
            job(model=model, train="stack = 'hf'\ntransformers = '5.0.0'\nlora_rank = 8\nlora_targets = []")


def test_moe_lora_on_banks_keeps_no_per_token_adapter_outputs(job):
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\nlora_rank = 8\nlora_targets = 'all-linear'\n"
                                               "base_quant = 'nf4'")
    # peft adapts the 3-D banks and the router weight through ParamWrapper (tests/test_lora_banks.py): adapters,
    # but folded into the weight, so no lora_A / lora_B outputs per token there.
    names = {g.name for g in trainable_groups(j)}
    assert {"q_proj.lora_A", "experts.gate_up_proj.lora_A", "experts.down_proj.lora_B", "router.lora_A"} <= names
    assert not any(k.startswith("experts.") and "lora" in k
                   for k in A.saved_per_token(A.block_facts(j), "none", moe_layer=True))
    # The routing weights still need a gradient (it reaches the hidden states through the frozen
    # router), so their product keeps the expert outputs: top_k copies of h per token, in the banks' dtype (bf16:
    # a current TRL prepares nothing; tests/test_lora_banks.py has the fp32 banks of a k-bit-prepared base).
    bf = A.block_facts(j)
    saved = A.saved_per_token(bf, "none", moe_layer=True)
    assert not j.facts.kbit_prepared and bf.bank_bytes == 2
    assert saved["experts.down_proj: output"] == 2 * 4096 * 2
    # A 3-D bank is no nn.Linear: even a target naming it adapts nothing there.
    named = dataclasses.replace(bf, targets=frozenset({"experts.gate_proj"}), lora_dropout=True)
    assert not any(k.startswith("experts.") and "lora" in k for k in A.saved_per_token(named, "none", moe_layer=True))
    # An adapter on a routed expert nn.Linear (transformers 4.x) sees top_k copies of each token: its
    # dropout output and mask too.
    adapted = dataclasses.replace(named, expert_linears=True, expert_names=("w1", "w3", "w2"),
                                  targets=frozenset({"experts.w1"}))
    saved = A.saved_per_token(adapted, "none", moe_layer=True)
    assert saved["experts.w1: dropout mask"] == 4096 * 2 * 1
    ab = bf.e if bf.autocast else bf.adapter_bytes  # lora_A's output: autocast's dtype, or the adapter's
    assert saved["experts.w1: lora_A output"] == 8 * 2 * ab


MIXTRAL_QLORA = ("stack = 'hf'\nprecision = 'bf16'\nlora_rank = 16\nlora_targets = 'all-linear'\nbase_quant = 'nf4'\n"
                 "checkpointing = 'full'\nseq_len = 2048\ntrl = '0.25.1'\n")


def test_transformers_4_experts_are_linears_that_bitsandbytes_quantizes_and_peft_adapts(job):
    # transformers 4.57.1 modeling_mixtral.py: each expert a MixtralBlockSparseTop2MLP of nn.Linear w1, w3
    # (hidden -> ffn) and w2 (ffn -> hidden), the router `gate` an nn.Linear(hidden, experts); 5.0.0:
    # MixtralExperts' 3-D gate_up_proj / down_proj and MixtralTopKRouter's bare weight.
    old, new = (job(model='preset = "mixtral-8x7b"', train=MIXTRAL_QLORA + f"transformers = '{v}'",
                    cluster="gpu = 'H100'") for v in ("4.57.1", "5.0.0"))
    assert old.facts.expert_linears and not new.facts.expert_linears
    h, experts, layers, ffn, r, vocab = 4096, 8, 32, 14336, 16, 32000
    attention = 2 * h * h + 2 * h * 1024
    expert = 3 * h * ffn
    router = h * experts
    # Trained: adapters on attention, the router and every expert's three linears, A (in x r) + B (r x out); in 5.x
    # peft's ParamWrapper adapters on the banks (gate_up at rank 2r: r x experts rows each) and the router weight.
    adapters_old = r * layers * ((h + h) * 2 + (h + 1024) * 2 + (h + experts) + experts * ((h + ffn) * 3))
    banks = 2 * r * experts * (h + 2 * ffn) + r * experts * (ffn + h) + r * (h + experts)
    adapters_new = r * layers * ((h + h) * 2 + (h + 1024) * 2) + layers * banks
    assert trainable_params(old) == adapters_old and trainable_params(new) == adapters_new
    names = {g.name: g.count for g in trainable_groups(old)}
    assert names["experts.w1.lora_A"] == experts * layers and names["gate.lora_B"] == layers
    # Stored: 4-bit data (0.5 B) for every nn.Linear of the blocks, 16 bits for the embedding, the head,
    # the norms, and (5.x) the expert banks and the router; the adapters in fp32 (peft's
    # autocast_adapter_dtype), absmax apart.
    other = 2 * vocab * h + (2 * layers + 1) * h
    weights_old = (layers * (attention + router + experts * expert) * 0.5 + other * 2 + adapters_old * 4)
    weights_new = (layers * attention * 0.5 + layers * (router + experts * expert) * 2 + other * 2 + adapters_new * 4)
    assert part(estimate(old), "weights", "step") == pytest.approx(weights_old, abs=8)
    assert part(estimate(new), "weights", "step") == pytest.approx(weights_new, abs=8)
    assert estimate(old).fits and not estimate(new).fits  # 28 GiB vs 85 GiB on an 80 GB card
    # Activations: the adapters on the routed experts run on top_k copies of each token.
    saved = A.saved_per_token(A.block_facts(old), "none", moe_layer=True)
    assert saved["experts.w1: lora_A output"] == r * 2 * 4 and saved["gate: lora_A output"] == r * 4
    assert not any(k.startswith("experts.") and "lora" in k
                   for k in A.saved_per_token(A.block_facts(new), "none", moe_layer=True))


def test_expert_target_names_are_the_releases_module_names(job):
    def targets(version, names):
        return job(model='preset = "mixtral-8x7b"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{version}'\n"
                                                       f"lora_targets = {names}").facts.lora_targets

    assert targets("4.57.1", "['w1', 'w3']") == ("w1", "w3")
    # peft matches names by suffix: Mixtral 4.x has no gate_proj, and no release has w1 once experts are banks.
    with pytest.raises(ConfigError, match="'gate_proj' is not a linear of this model"):
        targets("4.57.1", "['gate_proj']")
    # 5.x: peft moves w1, w3 (fused into gate_up_proj) onto the bank, both or neither (tests/test_lora_banks.py).
    with pytest.raises(ConfigError, match="w1 and w3 of this transformers 5 model together"):
        targets("5.0.0", "['w1']")
    assert targets("5.0.0", "['w1', 'w3', 'q_proj']") == ("q_proj",)
    # Qwen2-MoE's shared expert is a plain MLP in both: gate_proj adapts it, and the routed experts only in 4.x.
    for version, routed in (("4.57.1", True), ("5.0.0", False)):
        j = job(model='preset = "qwen1.5-moe-a2.7b"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{version}'\n"
                                                          "lora_targets = ['gate_proj']")
        saved = A.saved_per_token(A.block_facts(j), "none", moe_layer=True)
        assert "shared_expert.gate_proj: lora_A output" in saved
        assert ("experts.gate_proj: lora_A output" in saved) is routed
        assert any(g.name == "experts.gate_proj.lora_A" for g in trainable_groups(j)) is routed


def test_which_stacks_build_experts_as_linears(job):
    def linears(train):
        return job(model='preset = "qwen3-30b-a3b"', train=train).facts.expert_linears

    # litgpt model.py LLaMAMoE: nn.ModuleList of LLaMAMLP; torchtitan and torchtune: 3-D GroupedExperts.
    assert linears("stack = 'litgpt'") and linears("stack = 'deepspeed'\ntransformers = '4.46.0'")
    assert not linears("stack = 'torchtitan'") and not linears("stack = 'hf'")  # a current transformers: 5.x
    # The optimizer step's largest tensor: a 3-D bank holds every expert of the layer.
    from podkit.checks.memory import _step_transient
    for version, largest in (("4.57.1", 151_936 * 2048), ("5.0.0", 128 * 2048 * 2 * 768)):
        j = job(model='preset = "qwen3-30b-a3b"', train=f"stack = 'hf'\ntransformers = '{version}'\n"
                                                       "optimizer_impl = 'for-loop'\nprecision = 'bf16'")
        assert _step_transient(j, j.shape.param_groups(), 2, 1)[0] == 2 * largest * 2


MISTRAL_TRL_QLORA = ("stack = 'hf'\ntransformers = '4.48.1'\ntrl = '0.13.0'\nbitsandbytes = '0.43.3'\n"
                     "precision = 'bf16-mixed'\n"
                     "lora_rank = 16\nlora_targets = ['q_proj', 'k_proj', 'v_proj', 'o_proj']\nbase_quant = 'nf4'\n"
                     "checkpointing = 'full'\nattention = 'flash-attn'\nseq_len = 4096\nmicro_batch = 4\n")


def test_trl_prepares_a_single_gpu_qlora_base_and_its_stream_turns_fp32(job):
    # TRL 0.13 SFTTrainer: prepare_model_for_kbit_training on a 4-bit base that is not FSDP-sharded, then
    # (bf16=True) peft_module_casting_to_bf16: norms fp32, embeddings and head back to bf16.
    one = job(model='preset = "mistral-7b"', train=MISTRAL_TRL_QLORA, cluster="gpu = 'A100-80GB'")
    assert one.facts.kbit_prepared
    sharded = job(model='preset = "mistral-7b"', train=MISTRAL_TRL_QLORA,
                  cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'")
    off = job(model='preset = "mistral-7b"', train=MISTRAL_TRL_QLORA + "kbit_prepare = 'off'", cluster="gpu = 'A100-80GB'")
    podkit = job(model='preset = "mistral-7b"', train=MISTRAL_TRL_QLORA.replace("stack = 'hf'", "stack = 'podkit'"),
                 cluster="gpu = 'A100-80GB'")
    assert not sharded.facts.kbit_prepared and not off.facts.kbit_prepared and not podkit.facts.kbit_prepared
    # bin/smoke's replica keeps its norms in the compute dtype, and says so.
    assert not one.as_replica().facts.kbit_prepared
    assert "kbit_prepare" in [x.split(":")[0] for x in stacks.left_out(one.train, one.cluster, one.facts)]
    h, layers, tokens = 4096, 32, 4 * 4096
    # Checkpointed block inputs: the first is the bf16 embedding, every later one the fp32 sum of a block's
    # fp32 projections into the stream; the final norm keeps its fp32 input and its rsqrt either way.
    head = 4 * h + 4
    assert part(estimate(one), "saved activations", "forward-end") == (layers * 4 * h - 2 * h + head) * tokens
    assert part(estimate(off), "saved activations", "forward-end") == (layers * 2 * h + head) * tokens
    # bitsandbytes Linear4bit returns its input's dtype: q_proj's autocast bf16 output comes back fp32, and
    # flash-attn gets q, k, v cast to bf16 again (what it saves).
    bf = A.block_facts(one)
    assert (bf.stream, bf.norm_weight_bytes) == (4, 4)
    walk, _ = A._walk_block(bf)
    outputs = {t.label: t.bytes for op in walk.ops for t in op.outputs}
    assert outputs["q_proj: output in its input's dtype (bitsandbytes)"] == 4 * h
    assert outputs["o_proj: base output clone (peft)"] == 2 * h  # o_proj reads flash-attn's bf16 output
    saved = A.saved_per_token(bf, "none")
    assert saved["q cast to the compute dtype"] == 2 * h and saved["v cast to the compute dtype"] == 2 * 1024
    # MatMul4Bit dequantizes to bf16, makes it fp32 for the fp32 input (.to(A.dtype)) and autocast casts it
    # back to bf16 for F.linear: 4 + 2 B per weight of the largest linear.
    assert part(estimate(one), "dequantized weight", "backward") == 14336 * h * 6
    assert part(estimate(off), "dequantized weight", "backward") == 14336 * h * 2


def test_trl_0_26_prepares_nothing_and_casts_the_adapters_to_bf16(job):
    # huggingface/trl 2af35fb0d (PR #4577, first in 0.26.0) removed SFTTrainer's prepare_model_for_kbit_training; for
    # a model loaded in 4 or 8 bits it casts every trainable parameter, the adapters, to bf16 instead (v0.26.0
    # sft_trainer.py l.715-718). A job that names no TRL release is priced as a current one.
    current = MISTRAL_TRL_QLORA.replace("trl = '0.13.0'\n", "")
    now = job(model='preset = "mistral-7b"', train=current, cluster="gpu = 'A100-80GB'")
    old = job(model='preset = "mistral-7b"', train=MISTRAL_TRL_QLORA, cluster="gpu = 'A100-80GB'")
    assert not now.facts.kbit_prepared and now.facts.adapter_bytes == 2
    assert old.facts.kbit_prepared and old.facts.adapter_bytes == 4
    assert job(model='preset = "mistral-7b"', train=current + "trl = '0.26.0'",
               cluster="gpu = 'A100-80GB'").facts == now.facts
    # The stream stays bf16: the checkpointed block inputs are 2 B per value (fp32 after the first block before).
    h, layers, tokens = 4096, 32, 4 * 4096
    assert part(estimate(now), "saved activations", "forward-end") < part(estimate(old), "saved activations",
                                                                          "forward-end") - (layers - 2) * 2 * h * tokens
    # Your own script's prepare_model_for_kbit_training is still priced when said so; a LoRA base is never cast.
    assert job(model='preset = "mistral-7b"', train=current + "kbit_prepare = 'on'",
               cluster="gpu = 'A100-80GB'").facts.kbit_prepared
    lora = job(model='preset = "mistral-7b"', train=current.replace("base_quant = 'nf4'\n", ""),
               cluster="gpu = 'A100-80GB'")
    assert lora.facts.adapter_bytes == 4
    with pytest.raises(ConfigError, match="train.trl"):
        job(train="trl = 'latest'")


def test_kbit_prepare_asks_for_what_podkit_models(job):
    with pytest.raises(ConfigError, match="quantized base"):
        job(train="lora_rank = 8\nkbit_prepare = 'on'")
    with pytest.raises(ConfigError, match="autocast"):
        job(train="stack = 'hf'\nlora_rank = 8\nbase_quant = 'nf4'\nprecision = 'bf16'\nkbit_prepare = 'on'")
    # The stack's default leaves a pure-bf16 QLoRA alone (TRL prepares it too, then runs its matmuls in fp32:
    # not modelled) rather than refusing it.
    assert not job(train="stack = 'hf'\nlora_rank = 8\nbase_quant = 'nf4'\nprecision = 'bf16'").facts.kbit_prepared


MIXTRAL_LORA_448 = ("stack = 'hf'\ntransformers = '4.48.1'\nprecision = 'bf16'\nlora_rank = 16\n"
                    "lora_targets = ['q_proj', 'k_proj', 'v_proj', 'o_proj']\ncheckpointing = 'full'\nseq_len = 4096\n")


def test_expert_modules_run_one_at_a_time(job):
    def facts(train, model='preset = "mixtral-8x7b"'):
        return A.block_facts(job(model=model, train=train, cluster="gpu = 'A100-80GB'"))

    loop = facts(MIXTRAL_LORA_448)
    assert loop.expert_loop == "index_add"
    assert facts("stack = 'litgpt'\nprecision = 'bf16'").expert_loop == "index_put"
    assert facts(MIXTRAL_LORA_448.replace("4.48.1", "5.0.0")).expert_loop == ""  # banks: one grouped op
    h, k, ffn = 4096, 2, 14336
    # Saved over the whole loop, as over one grouped op: every routed copy's w1 output, silu, w3 output (the
    # frozen w2 keeps no input) and w2 output (kept for the routing weight's gradient), plus what
    # index_add_ keeps: its source, each expert's weighted output.
    saved = A.saved_per_token(loop, "none", moe_layer=True)
    assert saved["experts.w1: output"] == saved["experts.silu(gate)"] == saved["experts.w3: output"] == 2 * ffn * k
    assert saved["experts.w2: output"] == 2 * h * k
    assert saved["expert output x routing weight"] == 2 * h * k
    litgpt = dataclasses.replace(loop, expert_loop="index_put")
    assert "expert output x routing weight" not in A.saved_per_token(litgpt, "none", moe_layer=True)
    # Backward holds one expert's gradients at a time, over its share of the routed tokens (top_k / experts):
    # twice the experts with twice the top_k gives each the same share, so the same block backward, where one
    # grouped op over every routed copy would hold twice as much.
    wide = dataclasses.replace(loop, moe=dataclasses.replace(loop.moe, experts=16, top_k=4))
    grouped, grouped_wide = (dataclasses.replace(f, expert_loop="") for f in (loop, wide))
    inter = A.backward_intermediates_per_token
    assert inter(wide, True) == pytest.approx(inter(loop, True), abs=64)
    assert inter(grouped_wide, True) - inter(grouped, True) > 2 * ffn * k * 2
    assert inter(loop, True) < inter(grouped, True)


# ---- litgpt's loop, from its source (finetune/lora.py, lightning's bitsandbytes plugin) -----------


def test_litgpt_fused_qkv_view_keeps_the_whole_output(job):
    def per_token(stack):
        j = job(model='preset = "llama-2-7b"', train=f"stack = '{stack}'\nprecision = 'bf16'\nlora_rank = 8\n"
                                                    "lora_targets = ['q_proj', 'v_proj']")
        return sum(A.saved_per_token(A.block_facts(j), "none").values())

    # Llama-2 has as many kv heads as heads: no repeat, so litgpt's v stays a view of the fused
    # qkv output (4096 + 2 x 4096 wide), and SDPA saving v keeps q and k's parts alive too. Its one adapter
    # for q and v pads its B output to the fused width with index_copy, which saves that output (q + v wide).
    assert per_token("litgpt") - per_token("podkit") == 2 * (4096 + 4096) + 2 * (4096 + 4096)


def test_litgpt_fused_qkv_adapter_drops_out_once_and_zero_pad_saves_its_source(job):
    """litgpt lora.py LoRAQKVLinear.forward (5895df1): `after_A = F.linear(self.lora_dropout(x), self.lora_A)`
    for all of q, k and v together, then zero_pad, which for a partial q/k/v set writes the B output into
    `x.new_zeros(...).index_copy(1, lora_ind, ...)`; IndexCopyBackward0 saves its source whole."""
    def per_token(stack, targets, dropout):
        j = job(model='preset = "llama-2-7b"', train=f"stack = '{stack}'\nprecision = 'bf16'\nlora_rank = 8\n"
                                                    f"lora_targets = {targets}\nlora_dropout = {dropout}")
        return sum(A.saved_per_token(A.block_facts(j), "none").values())

    qv, qkv, h = "['q_proj', 'v_proj']", "['q_proj', 'k_proj', 'v_proj']", 4096
    # Dropout: its bf16 output and 1-byte mask replace the norm output as lora_A's saved input, once for the
    # fused adapter, once per adapter where q and v are two linears (podkit's own stack).
    assert per_token("litgpt", qv, 0.05) - per_token("litgpt", qv, 0) == h * (2 + 1) - h * 2
    assert per_token("podkit", qv, 0.05) - per_token("podkit", qv, 0) == 2 * h * (2 + 1) - h * 2
    # With k adapted too zero_pad returns its input: no index_copy source (q + v wide, bf16), and k's
    # rank-8 lora_A output is saved by its B.
    assert per_token("litgpt", qkv, 0) - per_token("litgpt", qv, 0) == -2 * (h + h) + 8 * 2
    x = torch.randn(4, 6, requires_grad=True)
    node = torch.zeros(4, 9).index_copy(1, torch.tensor([0, 1, 2, 6, 7, 8]), x).grad_fn
    assert node.name() == "IndexCopyBackward0" and node._saved_source.shape == x.shape


def test_litgpt_qlora_previous_step_and_fp16_dequantization(job):
    j = job(model=LLAMA8B, train="stack = 'litgpt'\nprecision = 'bf16'\nlora_rank = 32\nbase_quant = 'nf4'\n"
                                 "double_quant = false\nbitsandbytes = '0.42.0'\nseq_len = 512\nmicro_batch = 2")
    est = estimate(j)
    T = 1024
    # The previous step's 128-token logit chunks (4 per sequence, fp32 as Fabric's wrapper returned them)
    # and every quantized matmul's input its graph still holds: q/k/v's normed input (h), o_proj's (q_dim; a
    # view of the attention output), gate/up's normed input (h), down's (ffn), bf16; and the LM head's input.
    held = 4 * V * T + (L * (2 * H + QD + F) * 2 + H * 2) * T
    assert part(est, "previous step's logits and graph", "forward-end") == held
    # Quantized from fp16 by lightning: the head's weight dequantized to fp16, then cast to bf16.
    assert part(est, "dequantized weight", "forward-end") == V * H * 4


def test_deepspeed_zero3_keeps_its_reduce_bucket_on_the_gpu(job):
    # deepspeed/runtime/zero/stage3.py (v0.14.0): contiguous_gradients (default True) allocates
    # torch.empty(reduce_bucket_size, dtype=bf16) once; the default is 5e8 elements, "auto" is hidden^2.
    def bucket(value):
        j = job(model=LLAMA8B, train="stack = 'deepspeed'\ncheckpointing = 'full'",
                cluster=f"gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'\nreduce_bucket = {value}")
        return part(estimate(j), "DeepSpeed ZeRO-3 gradient bucket", "step")

    assert bucket("'default'") == 500_000_000 * 2
    assert bucket("'auto'") == H * H * 2
    assert bucket("1000") == 2000
    # Not ZeRO-3, or not DeepSpeed: no such buffer.
    other = estimate(job(model=LLAMA8B, cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    assert part(other, "DeepSpeed ZeRO-3 gradient bucket", "step") == 0


def test_the_replica_keeps_what_the_smoke_model_runs_and_drops_the_engines(job):
    """job.as_replica(): the stack's loss, checkpointing, LoRA and optimizer facts stay (train/step.py
    model_options has an option for each); FSDP1, DeepSpeed's 16-bit engine, litgpt's loop and fused
    qkv go, and stacks.left_out names each where it matters to the job."""
    hf = job(train="stack = 'hf'\nlora_rank = 8\ncheckpointing = 'full'\ngrad_accum = 2",
             cluster="gpus_per_node = 2\nsharding = 'zero3'")
    rep = hf.as_replica()
    assert hf.facts.fsdp_version == 1 and rep.facts.fsdp_version == 2 and rep.replica
    for name in ("loss", "ac_policy", "lora_targets", "lora_dtype", "optimizer_impl", "autocast"):
        assert getattr(rep.facts, name) == getattr(hf.facts, name), name
    assert rep.facts.stack.adapter_input_cast and rep.facts.stack.reentrant  # peft's cast, HF's reentrant AC
    assert rep.replace(train={"micro_batch": 2}).facts.fsdp_version == 2  # levers keep it a replica
    assert [x.split(":")[0] for x in stacks.left_out(hf.train, hf.cluster, hf.facts)] == [
        "fsdp_init_on_device", "lora_units", "fsdp_no_sync"]

    ds = job(train="stack = 'deepspeed'\nprecision = 'bf16-mixed'")
    assert not ds.facts.autocast and ds.as_replica().facts.autocast  # the replica autocasts fp32 weights
    n = ds.shape.params

    def per_param(j) -> dict[str, float]:  # bytes per parameter of each lasting step-phase part
        return {p.label: p.bytes / n for p in estimate(j).phase_parts["step"] if p.term in ("params", "grads", "optimizer")}

    # DeepSpeed's engine: 2 B weights and gradients, fp32 master (4 B) and AdamW (8 B) in its optimizer;
    # the replica trains fp32 weights (4 B) and gradients (4 B) with torch's AdamW (8 B), no master.
    assert per_param(ds) == {"weights": 2, "gradients": 2, "adamw states": 8, "fp32 master weights (DeepSpeed optimizer)": 4}
    assert per_param(ds.as_replica()) == {"weights": 4, "gradients": 4, "adamw states": 8}

    old_hf = job(model='preset = "llama-2-7b"', train="stack = 'hf'\ntransformers = '4.39.0'")
    assert old_hf.facts.rope_cache_bytes and not old_hf.as_replica().facts.rope_cache_bytes
    assert old_hf.as_replica().facts.reentrant  # transformers 4.39's reentrant AC, which the replica runs
    assert [x.split(":")[0] for x in stacks.left_out(old_hf.train, old_hf.cluster, old_hf.facts)] == ["rope_cache_buffers"]

    lit = job(train="stack = 'litgpt'")
    assert lit.facts.previous_outputs_kept and not lit.as_replica().facts.previous_outputs_kept
    off = job(cluster="gpus_per_node = 2\nsharding = 'zero3'\noffload = 'optimizer'")
    assert off.as_replica().cluster.offload == "all"
    assert stacks.left_out(off.train, off.cluster, off.facts) == [
        "offload 'optimizer': FSDP2's CPUOffloadPolicy offloads the parameters too (run as 'all')"]
    assert stacks.left_out(job().train, job().cluster, job().facts) == []  # podkit's own: nothing


def test_process_group_and_fsdp_param_cast_are_decided_once(job):
    """bin/smoke launches torchrun, and FSDP gathers compute-dtype parameters, by these two facts; the
    memory model's FSDP pools read the same cast fact."""
    assert not job().facts.process_group
    assert job(cluster="gpus_per_node = 2").facts.process_group  # DDP over two ranks
    one = job(cluster="sharding = 'zero3'")
    assert one.facts.process_group and one.cluster.world_size == 1  # FSDP needs a group even on one GPU
    zero3 = job(train="precision = 'bf16-mixed'", cluster="gpus_per_node = 2\nsharding = 'zero3'")
    assert zero3.facts.fsdp_param_cast and not zero3.facts.autocast
    assert not job(train="precision = 'bf16'", cluster="gpus_per_node = 2\nsharding = 'zero3'").facts.fsdp_param_cast
    assert not job(train="precision = 'bf16-mixed'", cluster="gpus_per_node = 2").facts.fsdp_param_cast  # DDP autocasts


@pytest.mark.parametrize("cluster,stack,compute", [
    ("", "podkit", 4),  # one GPU: fp32 adapters, which autocast casts per matmul
    ('gpus_per_node = 4\nsharding = "zero3"', "podkit", 2),  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16)
    ('gpus_per_node = 4\nsharding = "zero3"', "hf", 2),  # accelerate's FSDP1 MixedPrecision
    ('gpus_per_node = 4\nsharding = "zero2"', "deepspeed", 2),  # the engine casts each parameter
    ("", "deepspeed", 2),  # ... on one GPU too
    # DeepSpeed >= 0.19.2 leaves a zero.Init model's parameters as they are: peft's fp32 adapters stay fp32.
    ('gpus_per_node = 4\nsharding = "zero3"', "deepspeed", 4),
])
def test_adapters_multiply_in_the_dtype_their_gather_or_engine_gives_them(job, cluster, stack, compute):
    """fp32 adapters (peft's autocast_adapter_dtype, podkit's bf16-mixed) are stored in fp32, but FSDP's
    mixed-precision gather and DeepSpeed's engine hand them to their matmuls in bf16: lora_B's output, which
    a selective policy keeps, is hidden x 2 B per token, not x 4 (a 4-GPU Mistral LoRA read +37% above its
    trace, QA 2026-11-24)."""
    j = job(f'preset = "mistral-7b"', f'stack = "{stack}"\nprecision = "bf16-mixed"\nlora_rank = 16\n'
            'lora_dtype = "fp32"\ncheckpointing = "selective"', cluster)
    assert j.facts.adapter_bytes == 4 and j.facts.adapter_compute_bytes == compute
    tr, _ = A._walk_block(A.block_facts(j))
    lora_b = next(t for t in tr.matmuls if t.label == "q_proj: lora_B output")
    assert lora_b.bytes == j.shape.q_dim * (2 if j.facts.autocast else compute)
