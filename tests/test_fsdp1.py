"""FSDP1 and the caching allocator, with the bytes derived by hand from the library sources.

Llama-2-7B (h 4096, 32 blocks, MHA, ffn 11008, vocab 32000) as Answer.AI's fsdp_qlora trains it
(train.py 50efa1e): QLoRA r 64 on q, k, v, gate, up, down, pure bf16, 2 GPUs, FSDP1 full shard.
"""

from podkit.checks import activations as A
from podkit.checks.allocator import MIB, CachingAllocator, block_bytes, segment_size
from podkit.checks.fsdp1 import BROADCAST_BUCKET, _buckets, _unit_init, forward_events, init_reserved, replay
from podkit.checks.memory import _fsdp1_units, _small_state_bytes, estimate

H, L, F, V, R = 4096, 32, 11008, 32000, 64
LINEARS = 4 * H * H + 3 * H * F  # 202,375,168 weights per block
ADAPTERS = 3 * (H * R + R * H) + 3 * (H * R + R * F)  # 4,472,832 per block (o_proj not adapted)
ROOT = (2 * V * H + H) * 2  # embedding + head + final norm, bf16


def part(est, label, phase):
    return sum(p.bytes for p in est.phase_parts[phase] if p.label.startswith(label))


def qlora(job, micro_batch=1, seq_len=512, quant="nf4"):
    return job(model='preset = "llama-2-7b"',
               train=f"stack = 'fsdp_qlora'\nprecision = 'bf16'\nlora_rank = {R}\nbase_quant = '{quant}'\n"
                     f"checkpointing = 'full'\nmicro_batch = {micro_batch}\nseq_len = {seq_len}\nlora_dropout = 0.1",
               cluster="gpu = 'RTX3090'\ngpus_per_node = 2\nsharding = 'zero3'")


# ---- the caching allocator's rules (c10/cuda/CUDACachingAllocator.cpp) ----------------------------


def test_requests_under_10_mib_share_a_20_mib_segment_and_split_only_with_over_1_mib_left():
    a = CachingAllocator()
    a.malloc(8 * MIB)
    a.malloc(8 * MIB)  # the first segment's 12 MiB remainder serves it
    assert a.reserved == 20 * MIB
    a.malloc(8 * MIB)  # 4 MiB left is too small: a second 20 MiB segment
    assert a.reserved == 40 * MIB
    assert segment_size(MIB) == 2 * MIB and segment_size(10 * MIB) == 10 * MIB
    assert segment_size(10 * MIB + 1) == 12 * MIB  # kRoundLarge


def test_a_freed_block_serves_only_requests_it_can_hold_and_never_merges_across_segments():
    a = CachingAllocator()
    x, y = a.malloc(100 * MIB), a.malloc(100 * MIB)  # two segments of exactly 100 MiB
    a.free(x)
    a.free(y)
    a.malloc(150 * MIB)  # 200 MiB are free, but in two segments: a third
    assert a.reserved == 350 * MIB
    small = a.malloc(60 * MIB)  # best fit: a 100 MiB block, split (40 MiB left > 1 MiB)
    assert a.reserved == 350 * MIB and block_bytes(small) == 60 * MIB


def test_fsdp1_unit_init_keeps_moved_params_flat_and_shard_at_once(job):
    # Two 100 MiB parameters, world 2, starting on the CPU: moved (2 x 100), broadcast as one bucket
    # (200 MiB < 250 MiB, two tensors: a flattened copy), the flat parameter (reuses the copy's freed
    # segment exactly), the shard (100 MiB, nothing free is big enough while flat and params live).
    a = CachingAllocator()
    _unit_init(a, [100 * MIB, 100 * MIB], world=2, sync=True)
    assert a.reserved == (100 + 100 + 200 + 100) * MIB
    assert a.allocated == 100 * MIB  # only the shard survives the unit's __init__
    b = CachingAllocator()
    _unit_init(b, [300 * MIB], world=2, sync=True)  # one tensor per bucket: broadcast in place
    assert b.reserved == (300 + 300 + 150) * MIB


def test_a_broadcast_buffer_is_reused_only_after_the_next_parameter_move_synchronises():
    # ProcessGroupNCCL records its stream on the broadcast's flat copy: freed while the broadcast runs,
    # it cannot serve the unit's own flat parameter and shard. Unit 1: moved 100 + 100 MiB, the copy
    # 200 (then pending), the flat parameter 200 (a new segment), the shard 100 (another): 700 MiB.
    a, pending = CachingAllocator(), []
    _unit_init(a, [100 * MIB, 100 * MIB], world=2, sync=True, pending=pending)
    assert a.reserved == (100 + 100 + 200 + 200 + 100) * MIB and len(pending) == 1
    # Unit 2 moves 100, 200, 200 MiB: the first move takes a freed 100 MiB original; its blocking copy
    # completes the broadcast, so the two 200 MiB moves find the flat's block and the copy's block.
    _unit_init(a, [100 * MIB, 200 * MIB, 200 * MIB], world=2, sync=False, pending=pending)
    assert not pending
    assert a.reserved == (700 + 500 + 250) * MIB  # only unit 2's flat (500) and shard (250) are new


def test_buffers_go_first_and_in_their_own_buckets_when_their_dtype_differs():
    # _sync_module_params_and_buffers lists buffers, then parameters; compute_bucket_assignment_by_size
    # keeps one bucket list per dtype and closes a bucket once it reaches 250 MiB.
    states = [2 * MIB, 2 * MIB, 100 * MIB, 200 * MIB]  # two fp32 buffers, two bf16 parameters
    assert _buckets(states, 2, buffers_share_dtype=False) == [[0, 1], [2, 3]]
    assert _buckets(states, 2, buffers_share_dtype=True) == [[0, 1, 2, 3]]
    assert _buckets([BROADCAST_BUCKET, MIB, MIB], 0, False) == [[0], [1, 2]]
    a = CachingAllocator()
    _unit_init(a, [100 * MIB], world=2, sync=True, buffers=(2 * MIB, 2 * MIB))
    assert a.allocated == 50 * MIB + 4 * MIB  # the shard and both buffers stay


# ---- FSDP1 semantics ----------------------------------------------------------------------------


def test_fsdp1_gathers_into_the_pool_and_shards_the_packed_data_only(job):
    j = qlora(job)
    est = estimate(j)
    assert j.facts.fsdp_version == 1 and j.facts.loss == "fp32-logits-kept"
    # Weights per rank: the packed 4-bit data (0.5 B), bf16 norms, root and adapters sharded over 2;
    # the absmax (uint8 per 64 weights + fp32 per 256 absmax) whole on every rank.
    absmax = int(LINEARS * L * (1 / 64 + 4 / (64 * 256)))
    sharded = LINEARS * L * 0.5 + 2 * H * L * 2 + ROOT + ADAPTERS * L * 2
    assert abs(part(est, "weights", "step") - sharded / 2) <= 2
    assert abs(part(est, "4-bit quantization state", "step") - absmax) <= 2
    # At the loss only the root is gathered (the last block reshards after forward, and FSDP1 gathers
    # it again only when its pre-backward hook fires).
    assert part(est, "unsharded weights", "forward-end") == ROOT
    # The unshard stream's pool is the root plus two blocks' flat parameters: the gathered weights
    # live in it (FSDP1 all-gathers into the unsharded flat parameter itself).
    block = LINEARS * 0.5 + 2 * H * 2 + ADAPTERS * 2
    assert part(est, "FSDP1 unshard-stream pool", "forward-end") == int(ROOT + 2 * block) - ROOT
    assert part(est, "FSDP1 unshard-stream pool", "step") == int(ROOT + 2 * block)


def test_fsdp1_backward_hands_off_with_two_blocks_gathered(job):
    # LoRA on a bf16 base at 512 tokens: the block's recompute and gradients are smaller than a
    # block's weights (385 MiB), so the peak of backward is the hand-off, when block k is gathered by
    # its pre-backward hook before block k+1's reshard-only hook on the same tensor frees it.
    est = estimate(qlora(job, seq_len=512, quant="none"))
    block = LINEARS * 2 + 2 * H * 2 + ADAPTERS * 2
    assert part(est, "unsharded weights", "backward") == int(2 * block + ROOT)
    assert part(est, "gradient of the block's input", "backward") == 512 * H * 2


def test_hf_439_loss_leaves_the_16_bit_logits_as_a_hole(job):
    lb = A.loss_bytes(qlora(job, micro_batch=2), 512)
    # logits.float() frees the bf16 logits (2 B); everything after is 4 B per logit: it stays empty.
    assert (lb.forward, lb.backward, lb.kept, lb.hole) == (12, 16, 4, 2)
    # One sequence: the shifted slice is contiguous, no copy (fp32 logits 4 + log-softmax 4 in forward).
    assert A.loss_bytes(qlora(job, micro_batch=1), 512).forward == 8


def test_forward_replay_peaks_with_the_loss_in_new_segments(job):
    j = qlora(job, micro_batch=4, seq_len=2048)
    T = 8192
    events = forward_events(j.shape, T, 2, frozenset(j.facts.lora_targets), True, batch=4)
    a = replay(events)
    # At log_softmax's backward: the kept fp32 logits, the fp32 log-softmax, its gradient in and out
    # (4 x 4 B per logit) are live; the 16-bit logits' and the shifted copy's blocks are free.
    logits = V * T
    assert a.allocated >= 16 * logits
    # The 16-bit logits' 2 B/logit block cannot hold any 4 B/logit tensor: reserved exceeds the live
    # loss tensors by at least that block.
    assert a.reserved_large - a.allocated >= 2 * logits


def test_rotary_caches_of_transformers_439_are_buffers_on_every_gpu(job):
    # LlamaRotaryEmbedding (4.38/4.39) registers _cos_cached and _sin_cached of 4096 x 128 in the default
    # dtype per layer: float32 for fsdp_qlora's QLoRA model (from_config), bf16 for its LoRA one.
    caches = part(estimate(qlora(job)), "rotary cos/sin caches", "step")
    assert caches == L * 2 * 4096 * 128 * 4  # 128 MiB, on top of the sharded weights
    assert part(estimate(qlora(job, quant="none")), "rotary cos/sin caches", "step") == L * 2 * 4096 * 128 * 2


def test_absmax_and_1_mib_caches_are_small_pool_blocks(job):
    # Per attention linear 4096 x 4096 / 64 = 262,144 B of uint8 absmax and 1,024 fp32 nested absmax;
    # per MLP linear 704,512 B and 2,752 x 4 B: all <= 1 MiB. The fp32 caches (2 MiB) are large-pool.
    per_layer = 4 * (H * H // 64 + H * H // 16384 * 4) + 3 * (H * F // 64 + H * F // 16384 * 4)
    assert _small_state_bytes(qlora(job)) == L * per_layer
    assert _small_state_bytes(qlora(job, quant="none")) == L * 2 * 4096 * 128 * 2  # 1 MiB each: small


def test_wrap_replay_reserves_what_the_write_up_reports_after_wrapping(job):
    # benchmarks_03_2024.md (fsdp_qlora 05ed9f2): QLoRA bs1 ctx512 reports reserved_after_model_wrap
    # = 3.72 GiB on rank 0. The replay (units with their rotary buffers, NCCL-held broadcast copies)
    # plus the QuantState that rank 0 moves back to the GPU while wrapping (small-pool blocks).
    j = qlora(job)
    _, reserved = init_reserved(_fsdp1_units(j, 2), 2, buffers_share_dtype=False)
    quant_state = part(estimate(j), "4-bit quantization state", "step")
    assert abs((reserved + quant_state) / 2**30 / 3.72 - 1) < 0.02
    _, without_events = init_reserved(_fsdp1_units(j, 2), 2, nccl_events=False)
    assert (without_events + quant_state) / 2**30 < 3.72 * 0.92  # the buffers alone do not get there
