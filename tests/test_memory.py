"""The memory model against hand derivations, and its monotonicity.

Llama-3.2-1B: h = 2048, L = 16, heads 32 x 64, kv 8 x 64 (kv_dim 512), ffn 8192, vocab 128256,
tied embeddings, P = 1,235,814,400 of which 33 x 2048 = 67,584 are RMSNorm weights.
"""

import pytest

from podkit.checks.device_overhead import CUDA_CONTEXT, LAZY_KERNELS, cublas_workspace_bytes, nccl_bytes
from podkit.checks.gpus import lookup
from podkit.checks.memory import (MIB, NF4_BYTES, _rounding, estimate,
                           optimizer_bytes, trainable_groups)

P_1B = 1_235_814_400
NORMS_1B = 33 * 2048


def part(est, label, phase="forward-end"):
    [p] = [p for p in est.phase_parts[phase] if p.label.startswith(label)]
    return p.bytes


def test_bf16_mixed_adamw_single_gpu_by_hand(job):
    est = estimate(job(train="micro_batch = 2\nseq_len = 4096"))
    T, fwd = 8192, "forward-end"
    # fp32 master weights and fp32 Adam m, v.
    assert est.term("params", fwd) == P_1B * 4 + (P_1B - NORMS_1B) * 2  # + autocast bf16 cache of every matmul weight
    assert est.term("optimizer", fwd) == P_1B * 8
    # Saved activations per token per block, fp32 residual stream (autocast), bf16 matmuls:
    #   residual in + after attention      2 x 4h      = 16,384   (the fp32 stream is what the
    #   RMSNorm normalised fp32 x2         2 x 4h      = 16,384    norms' pow/mul keep)
    #   RMSNorm rsqrt, fp32 per token      2 x 4       =      8
    #   bf16 casts for q,k,v,gate,up       5 x 2h      = 20,480
    #   q, k, v after RoPE                 2(2048+2x512) = 6,144
    #   SDPA out + logsumexp               2x2048 + 4x32 = 4,224  (flash returns (b, s, h, d): o_proj
    #                                                              reads a view of it, no copy)
    #   SwiGLU gate, up, silu, product     4 x 2 x 8192 = 65,536      -> 129,160
    # Head: final residual 4h + norm 4h + rsqrt 4 + bf16 input of lm_head 2h = 20,484.
    assert est.term("activations", fwd) == (16 * 129_160 + 20_484) * T
    # cross-entropy in fp32: log-softmax output, its gradient in and out: 12 B per logit.
    assert est.term("loss", fwd) == 12 * 128_256 * T
    assert est.term("grads", fwd) == 0  # accum 1, set_to_none: no gradient exists during forward
    rounding = part(est, "allocator rounding", fwd)
    # podkit's forward returns only the loss, so the bf16 logits (2 B) and their fp32 copy (4 B) are
    # one freed hole at backward; nll_loss's 4 B gradient fills it, 2 B per logit stay unusable.
    assert part(est, "freed logits' slot", fwd) == 2 * 128_256 * T
    # The default A10G (sm86): two cuBLAS workspaces of :4096:2:16:8 inside the allocator.
    workspaces = 2 * cublas_workspace_bytes(lookup("A10G"))
    assert est.term("overhead", fwd) == CUDA_CONTEXT + LAZY_KERNELS + workspaces + rounding + 2 * 128_256 * T
    assert 0 < rounding < 0.01 * est.allocated
    # At 8k tokens the loss spike (12.6 GB) is the peak.
    assert est.peak_phase == "forward-end"
    assert est.total == max(est.phases.values())
    assert est.total == sum(est.per_gpu[t] for t in ("params", "grads", "optimizer", "activations", "loss", "overhead"))
    assert est.allocated == est.total - est.term("overhead") + workspaces
    # The loss's forward (bf16 logits, their fp32 copy, the log-softmax output: 10 B per logit) runs
    # beside the whole weight cache; its backward (log-softmax output, its gradient in and out: 12 B)
    # after autocast has ended, beside the casts autograd saved: without checkpointing, all of them.
    est, T = estimate(job(train="micro_batch = 1\nseq_len = 1024")), 1024
    head = 128_256 * 2048
    assert est.term("loss", fwd) == 12 * 128_256 * T
    assert est.term("params", fwd) == P_1B * 4 + (P_1B - NORMS_1B) * 2
    # At 256 tokens the head's backward holds more: its matmul node has made the weight's gradient in
    # bf16 and released its saved tensors (the head's cast, its input) and the logits' gradient, and
    # ToCopyBackward casts that gradient to fp32 for .grad (V x h x 6 B, 1.6 GB); the blocks' casts and
    # saved activations are still there. The trace of this job agrees to 0.1%.
    est, T = estimate(job(train="micro_batch = 1\nseq_len = 256")), 256
    assert part(est, "the head's weight gradient being accumulated", fwd) == head * 6
    assert est.term("loss", fwd) == 0
    assert est.term("params", fwd) == P_1B * 4 + (P_1B - NORMS_1B - head) * 2
    assert est.term("activations", fwd) == 16 * 129_160 * T
    # Backward through the last block: the head's gradient is in .grad (V x h x 4 B) and a block's
    # largest weight (gate/up/down, 8192 x 2048) is the gradient being cast.
    assert part(est, "gradients so far", "backward") == (head + 60_821_504) * 4
    assert part(est, "weight gradient", "backward") == 8192 * 2048 * 6
    # The peak is the embedding's backward: every fp32 gradient and the embedding's new one, which
    # autograd adds in place into the tied head's (autocast: a fresh fp32 copy it may steal).
    assert est.peak_phase == "backward-end"
    assert part(est, "the input embedding's gradient", "backward-end") == head * 4
    assert not [p for p in est.phase_parts["backward-end"] if p.label.startswith("the tied weight's two gradients")]


def test_allocator_rounding_by_hand():
    # 512-byte blocks; over 10 MiB a segment of its own rounded to 2 MiB
    # (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize, kMinLargeAlloc, kRoundLarge).
    assert _rounding([(64 * MIB, 3)]) == 0
    assert _rounding([(64 * MIB + 1, 1)]) == 2 * MIB - 1
    assert _rounding([(5 * MIB + 100, 2)]) == 2 * (512 - 100)
    assert _rounding([(11 * MIB, 1)]) == 1 * MIB


def test_grad_accumulation_keeps_gradients_through_forward(job):
    one = estimate(job(train="micro_batch = 1\nseq_len = 1024"))
    accum = estimate(job(train="micro_batch = 1\nseq_len = 1024\ngrad_accum = 4"))
    # Every gradient stays from the micro-steps before, through the loss's backward (the forward phase's
    # moment at this length; the trace of the accumulating job agrees to 0.1%).
    assert accum.term("grads", "forward-end") == P_1B * 4
    assert one.term("grads", "forward-end") == 0
    assert accum.phase_allocated("forward-end") - one.phase_allocated("forward-end") == P_1B * 4
    assert accum.total > one.total


def test_full_checkpointing_keeps_block_inputs_only(job):
    est = estimate(job(train="micro_batch = 2\nseq_len = 2048\ncheckpointing = 'full'"))
    # 16 block inputs of 4h fp32 + the head's 20,484 per token, 4096 tokens.
    assert part(est, "saved activations") == (16 * 4 * 2048 + 20_484) * 4096


def test_pure_bf16_states_and_stream(job):
    est = estimate(job(train="precision = 'bf16'\nmicro_batch = 1\nseq_len = 512"))
    assert part(est, "weights") == P_1B * 2
    assert est.term("optimizer", "forward-end") == P_1B * 4  # Adam m, v in the parameter's dtype
    assert not any(p.label == "autocast weight cache" for p in est.phase_parts["forward-end"])
    # bf16 stream: no op keeps the bf16 residual itself (x.float() is what pow/mul keep); per
    # norm its fp32 upcast 4h + rsqrt 4 + the normed cast back 2h, one shared normed input per
    # sublayer 2 x 2h (no autocast: q/k/v share it), then the same q/k/v, attention and MLP tensors.
    per_block = 2 * (6 * 2048 + 4) + 2 * 2 * 2048 + 6_144 + 4_224 + 65_536
    head = 6 * 2048 + 4 + 2 * 2048
    assert part(est, "saved activations") == (16 * per_block + head) * 512


def test_pure_fp16_prices_as_pure_bf16_by_hand(job):
    """Pure fp16 (litgpt's 16-true, axolotl's float16) stores what pure bf16 stores: 2-byte weights, gradients
    and Adam states, a 16-bit residual stream, no autocast cache. The two dtypes split the same 16 bits
    differently (5 exponent + 10 mantissa bits against 8 + 7); no tensor changes size."""
    train = "micro_batch = 1\nseq_len = 512\noptimizer = 'adamw8bit'"
    fp16 = estimate(job(train=f"precision = 'fp16'\n{train}"))
    assert part(fp16, "weights") == P_1B * 2
    assert fp16.term("grads", "step") == P_1B * 2
    assert not any(p.label == "autocast weight cache" for p in fp16.phase_parts["forward-end"])
    # The bf16 test's stream above, per token: the norms' fp32 upcast, rsqrt and 16-bit cast back, the shared
    # normed inputs, q/k/v, attention and the MLP.
    per_block = 2 * (6 * 2048 + 4) + 2 * 2 * 2048 + 6_144 + 4_224 + 65_536
    head = 6 * 2048 + 4 + 2 * 2048
    assert part(fp16, "saved activations") == (16 * per_block + head) * 512
    # Term by term and phase by phase the same bytes as pure bf16 (on the A10G both take SDPA's flash kernel).
    bf16 = estimate(job(train=f"precision = 'bf16'\n{train}"))
    assert fp16.per_gpu == bf16.per_gpu and fp16.phases == bf16.phases
    # With torch's AdamW the states are the parameters' dtype too: m and v at 2 B each.
    assert estimate(job(train="precision = 'fp16'\nmicro_batch = 1\nseq_len = 512")).term("optimizer") == P_1B * 4


def test_adamw8bit_states_by_hand(job):
    j = job(train="optimizer = 'adamw8bit'")
    # Two 1-byte states plus an fp32 absmax per 256 values for every tensor of >= 4096 values;
    # the 33 RMSNorm weights (2048 values) keep two fp32 states.
    expected = (P_1B - NORMS_1B) * 2 * (1 + 4 / 256) + NORMS_1B * 8
    assert optimizer_bytes(j, trainable_groups(j), 4) == int(expected)


@pytest.mark.parametrize("optimizer,per_param", [("lion", 4), ("sgd", 4)])
def test_single_state_optimizers(job, optimizer, per_param):
    j = job(train=f"optimizer = '{optimizer}'")
    assert optimizer_bytes(j, trainable_groups(j), 4) == P_1B * per_param


def test_bitsandbytes_lion_keeps_one_fp32_state_even_in_pure_bf16(job):
    # bitsandbytes Optimizer1State.init_state (optim/optimizer.py, 0.50.2): optim_bits=32 -> fp32 state1.
    j = job(train="optimizer = 'lion'\nprecision = 'bf16'")
    assert optimizer_bytes(j, trainable_groups(j), 2) == P_1B * 4


def test_lion8bit_is_one_blockwise_state(job):
    j = job(train="optimizer = 'lion8bit'")
    # One uint8 state plus an fp32 absmax per 256 values for tensors of >= 4096 values; the norms fp32.
    expected = (P_1B - NORMS_1B) * (1 + 4 / 256) + NORMS_1B * 4
    assert optimizer_bytes(j, trainable_groups(j), 4) == int(expected)


def test_adafactor_is_factored(job):
    j = job(model='preset = "gpt2-124m"', train="optimizer = 'adafactor'")
    got = optimizer_bytes(j, trainable_groups(j), 4)
    # Matrices keep a row and a column vector; vectors a full second moment: tiny next to Adam.
    assert 0 < got < 124_439_808 * 0.1


def test_zero3_eight_gpus_by_hand(job):
    est = estimate(job(model='preset = "llama-3.1-8b"', train="seq_len = 4096\ncheckpointing = 'full'",
                       cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    P = 8_030_261_248
    assert part(est, "weights") == P * 4 // 8
    assert est.term("optimizer", "forward-end") == P * 8 // 8
    # Blocks of 218,112,000 and the root module (embeddings, head, final norm = 2 x 128256 x 4096 +
    # 4096), gathered in bf16: at the loss the one block gathered for backward, in backward two
    # (current + prefetched).
    assert part(est, "unsharded weights") == (218_112_000 + 1_050_677_248) * 2
    assert part(est, "unsharded weights", "backward") == (2 * 218_112_000 + 1_050_677_248) * 2
    assert any(p.label == "NCCL buffers" and p.bytes == nccl_bytes(lookup("H100"), 8, 1)[0] for p in est.parts)


def test_qlora_nf4_base_by_hand(job):
    est = estimate(job(model='preset = "llama-3.1-8b"', train="lora_rank = 16\nbase_quant = 'nf4'\nseq_len = 512"))
    per_layer_linear = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    quantized = 32 * per_layer_linear * NF4_BYTES
    bf16_rest = (2 * 128_256 * 4096 + 65 * 4096) * 2  # embeddings, head, norms stay bf16
    adapters = 41_943_040 * 4  # fp32 trainable adapters
    # The packed 4-bit data (0.5 B) is the parameter; the absmax (uint8 per 64 + fp32 per 256 blocks,
    # double quantization) is the module's QuantState, counted apart (one GPU: the same total).
    qstate = 32 * per_layer_linear * (NF4_BYTES - 0.5)
    assert part(est, "weights") == int(adapters + int(quantized + bf16_rest) - int(qstate))
    assert part(est, "4-bit quantization state") == int(qstate)
    assert est.term("optimizer", "forward-end") == 41_943_040 * 8


def test_qlora_quantization_state_is_on_every_gpu_when_the_base_is_sharded(job):
    # bitsandbytes keeps QuantState on the Linear4bit module, not in the parameter FSDP/ZeRO-3 shards.
    est = estimate(job(model='preset = "llama-3.1-8b"', train="lora_rank = 16\nbase_quant = 'nf4'\nseq_len = 512",
                       cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'"))
    per_layer_linear = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    qstate = 32 * per_layer_linear * (1 / 64 + 4 / (64 * 256))  # not divided by 8
    packed = 32 * per_layer_linear * 0.5
    bf16_rest = (2 * 128_256 * 4096 + 65 * 4096) * 2
    assert part(est, "4-bit quantization state") == int(qstate)
    assert part(est, "weights") == (41_943_040 * 4 + int(packed + bf16_rest)) // 8
    # It stays on the GPU under offload = "all" too (only parameters go to the host).
    off = estimate(job(model='preset = "llama-3.1-8b"', train="lora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'",
                       cluster="gpu = 'H100'\ngpus_per_node = 8\nsharding = 'zero3'\noffload = 'all'\nhost_ram_gb = 512"))
    assert part(off, "weights") == 0 and part(off, "4-bit quantization state") == int(qstate)


def test_rounding_sizes_the_frozen_base_by_its_own_tensors(job):
    # A LoRA job's bf16 base: every Llama-3.2-3B matrix is a whole number of 2 MiB (q 3072 x 3072 x 2 B =
    # 18 MiB, gate 3072 x 8192 x 2 = 48 MiB; k/v 6 MiB stay below the 10 MiB rule), the tied embedding
    # 128256 x 3072 x 2 B = 751.5 MiB rounds up by 0.5 MiB; norms round to 512 B. Spreading the 6 GB
    # base over the adapters' shapes (the old rule) made hundreds of MiB of rounding up.
    est = estimate(job(model='preset = "llama-3.2-3b"', train="lora_rank = 32\nprecision = 'bf16'\nseq_len = 16",
                       cluster="gpu = 'L40S'"))
    rounding = part(est, "allocator rounding", "step")
    assert rounding < 2 * (1 << 20)


def test_offload_optimizer_moves_states_to_host(job):
    est = estimate(job(model='preset = "llama-3.1-8b"', cluster="gpu = 'A100-80GB'\noffload = 'optimizer'\n"
                                                                  "host_ram_gb = 512"))
    P = 8_030_261_248
    assert est.term("optimizer", "forward-end") == 0
    assert part(est, "weights") == P * 2  # only bf16 weights stay on the GPU
    # Host: Adam m, v (8) + fp32 grads (4) + fp32 master weights (4) per param, + the process.
    assert est.host_needed == int(P * 16 + 3 * 2**30)


def test_eager_attention_adds_the_s_squared_term(job):
    sdpa = estimate(job(train="seq_len = 4096"))
    eager = estimate(job(train="seq_len = 4096\nattention = 'eager'"))
    # 32 heads x 4096 x (4 B fp32 softmax output + 2 B bf16 copy) per token, per block.
    extra = eager.term("activations", "forward-end") - sdpa.term("activations", "forward-end")
    assert extra > 16 * 32 * 4096 * 6 * 4096 * 0.9


# ------------------------------------------------------------------ monotonicity


CONFIGS = [
    ("llama-3.2-1b", "precision = 'bf16-mixed'"),
    ("llama-3.1-8b", "precision = 'bf16'\noptimizer = 'adamw8bit'\ncheckpointing = 'selective'"),
    ("qwen2.5-7b", "lora_rank = 16\nbase_quant = 'nf4'\ncheckpointing = 'full'"),
    ("gpt2-124m", "precision = 'fp32'\nattention = 'eager'"),
]


@pytest.mark.parametrize("preset,train", CONFIGS)
def test_more_batch_more_memory(job, preset, train):
    totals = [estimate(job(model=f'preset = "{preset}"', train=f"{train}\nmicro_batch = {b}")).total
              for b in (1, 2, 4, 8)]
    assert totals == sorted(totals) and len(set(totals)) == 4


@pytest.mark.parametrize("preset,train", CONFIGS)
def test_longer_sequences_more_memory(job, preset, train):
    ests = [estimate(job(model=f'preset = "{preset}"', train=f"{train}\nseq_len = {s}")) for s in (512, 1024, 2048, 4096)]
    # The peak never falls; it may stay put while the optimizer step, which no sequence length
    # touches, is the largest moment.
    assert [e.total for e in ests] == sorted(e.total for e in ests)
    acts = [e.term("activations", "forward-end") + e.term("loss", "forward-end") for e in ests]
    assert acts == sorted(acts) and len(set(acts)) == 4


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_more_shards_less_memory(job, sharding):
    totals = [estimate(job(model='preset = "llama-3.1-8b"',
                           cluster=f"gpu = 'H100'\ngpus_per_node = {n}\nsharding = '{sharding}'")).total
              for n in (2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 3


def test_higher_stage_less_memory(job):
    totals = [estimate(job(model='preset = "llama-3.1-8b"', train="checkpointing = 'full'",
                           cluster=f"gpu = 'H100'\ngpus_per_node = 8\nsharding = '{s}'")).total
              for s in ("none", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)


def test_no_sharding_does_not_divide_by_gpus(job):
    one = estimate(job(model='preset = "llama-3.1-8b"', cluster="gpu = 'H100'"))
    eight = estimate(job(model='preset = "llama-3.1-8b"', cluster="gpu = 'H100'\ngpus_per_node = 8"))
    assert eight.term("optimizer") == one.term("optimizer")  # DDP: a full replica on every GPU
    assert eight.total > one.total  # plus NCCL and persistent DDP gradient buckets


def test_checkpointing_order(job):
    acts = [estimate(job(train=f"seq_len = 4096\ncheckpointing = '{c}'")).term("activations", "forward-end")
            for c in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_memory_savers_save(job):
    base = estimate(job(model='preset = "llama-3.1-8b"')).total
    for train in ("optimizer = 'adamw8bit'", "lora_rank = 16", "lora_rank = 16\nbase_quant = 'nf4'",
                  "precision = 'bf16'"):
        assert estimate(job(model='preset = "llama-3.1-8b"', train=train)).total < base, train


def test_fits_against_capacity(job):
    small = estimate(job(model='preset = "gpt2-124m"', train="seq_len = 512", cluster="gpu = 'T4'"))
    big = estimate(job(model='preset = "llama-3.1-70b"', cluster="gpu = 'T4'"))
    assert small.fits and 0 < small.headroom < 1
    assert not big.fits and big.headroom < 0


def test_approximate_shapes_are_flagged(job):
    est = estimate(job(model="params = 7e9"))
    assert est.approximate and any("approximate" in n for n in est.notes)


# A model whose tensors hit each of torchao's cases (torchao/optim/adam.py _new_buffer, v0.18.0: quantized when
# >= 4096 values and a whole number of blocks): h = 128, ffn = 75, vocab 1000, 2 layers, untied. The embedding and
# the head (128,000 = 500 x 256 = 1000 x 128) and q/k/v/o (16,384 = 64 x 256) are quantized at any block;
# gate/up/down (9,600 values = 37.5 blocks of 256, 75 of 128) only at block 128; the 5 RMSNorm weights
# (128 < 4096) never: those keep states in the parameter's dtype.
TAO_MODEL = "hidden = 128\nlayers = 2\nheads = 2\nkv_heads = 2\nffn = 75\nvocab = 1000"
TAO_ALWAYS = [128_000] * 2 + [16_384] * 8
TAO_MLP = [9_600] * 6
TAO_NORMS = 5 * 128


@pytest.mark.parametrize("optimizer,precision,block,per_value,qmap", [
    # AdamW8bit: uint8 codes, an fp32 scale per 256, a 256-entry fp32 qmap per state (subclass_8bit.py).
    ("torchao_adamw8bit", "bf16-mixed", 256, 1, 256),
    # AdamW4bit: two codes per byte, an fp32 scale per 128, a 16-entry fp32 qmap per state (subclass_4bit.py).
    ("torchao_adamw4bit", "bf16-mixed", 128, 0.5, 16),
    # ... at HF adamw_torch_4bit's block_size=256: the MLP weights are no whole number of blocks any more.
    ("torchao_adamw4bit", "bf16-mixed", 256, 0.5, 16),
    # AdamWFp8: float8_e4m3fn codes, an fp32 scale per 256, no qmap (subclass_fp8.py).
    ("torchao_adamw_fp8", "bf16-mixed", 256, 1, 0),
    # Pure bf16: zeros_like a bf16 parameter is bf16, so the plain states are 2 B, not bitsandbytes' fp32.
    ("torchao_adamw8bit", "bf16", 256, 1, 256),
])
def test_torchao_states_by_hand(job, optimizer, precision, block, per_value, qmap):
    j = job(model=TAO_MODEL, train=f"optimizer = '{optimizer}'\nprecision = '{precision}'\noptimizer_block = {block}")
    param = 2 if precision == "bf16" else 4  # fp32 masters under bf16-mixed
    quantized = TAO_ALWAYS + (TAO_MLP if block == 128 else [])
    plain = TAO_NORMS + (0 if block == 128 else sum(TAO_MLP))
    per_state = sum(n * per_value + n // block * 4 + qmap * 4 for n in quantized) + plain * param
    assert optimizer_bytes(j, trainable_groups(j), param) == 2 * per_state  # exp_avg and exp_avg_sq


def test_torchao_states_follow_fsdp2_local_shards(job):
    # Under FSDP2 torchao tests each rank's local shard: over 4 ranks q/k/v/o hold 4,096 values (16 blocks:
    # quantized), the embedding and head 32,000 (125 blocks); FSDP2 splits whole rows of dim 0, so gate/up
    # ([75, 128] weights) hold ceil(75 / 4) = 19 rows = 2,432 values, down ([128, 75]) 32 rows = 2,400, and the
    # norms 32 (all < 4096: fp32).
    j = job(model=TAO_MODEL, train="optimizer = 'torchao_adamw8bit'",
            cluster="gpus_per_node = 4\nsharding = 'zero3'")
    assert j.facts.fsdp_version == 2
    quantized = 2 * (32_000 + 125 * 4 + 1024) + 8 * (4_096 + 16 * 4 + 1024)
    plain = (4 * 2_432 + 2 * 2_400 + 5 * 32) * 4
    assert optimizer_bytes(j, trainable_groups(j), 4, 4) == 2 * (quantized + plain)
    # The estimate's optimizer term is that, on each GPU.
    assert estimate(j).term("optimizer", "forward-end") == 2 * (quantized + plain)


def test_torchao_fsdp2_shards_are_whole_rows(job):
    # Llama 3.1 8B's q_proj ([4096, 4096]) over 6 ranks: rank 0 holds ceil(4096 / 6) = 683 rows = 2,797,568
    # values, which divide by the 256-value block: 8-bit codes + a scale per block + the 256-entry table, per
    # state. (numel / 6 = 2,796,203 does not divide, and would have priced fp32 copies.)
    j = job(model="preset = 'llama-3.1-8b'", train="optimizer = 'torchao_adamw8bit'\nstack = 'torchtitan'",
            cluster="gpus_per_node = 6\nsharding = 'zero3'")
    assert j.facts.fsdp_version == 2
    q = [g for g in trainable_groups(j) if g.name == "q_proj"]
    values = 683 * 4096
    assert optimizer_bytes(j, q, 4, 6) == 2 * (values + values // 256 * 4 + 256 * 4) * 32


def test_torchao_states_are_torchaos_own():
    """The bytes LowBitAdam prices are those torchao's _new_buffer makes, for each class and case."""
    torch = pytest.importorskip("torch")
    ao = pytest.importorskip("torchao.optim", reason="torchao (a test extra)")
    from podkit.checks.stacks import TORCHAO_OPTIMIZERS

    shapes = [(1000, 128), (128, 75), (128,), (64, 64), (4352,)]
    for name, low_bit in TORCHAO_OPTIMIZERS.items():
        for dtype in (torch.float32, torch.bfloat16):
            params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
            opt = getattr(ao, low_bit.cls)(params)
            for p in params:
                state = opt._new_buffer(p, True)  # what step() makes for exp_avg (signed) on its first call
                if hasattr(state, "__tensor_flatten__") and type(state) is not torch.Tensor:
                    inner = tuple(getattr(state, n) for n in state.__tensor_flatten__()[0])
                else:
                    inner = (state,)
                made = tuple(t.numel() * t.element_size() for t in inner)
                assert made == low_bit.state_tensors(p.numel(), p.element_size()), (name, dtype, p.shape)
