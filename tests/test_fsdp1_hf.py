"""FSDP1 as the HF Trainer + accelerate run it, with the bytes derived by hand from the library sources.

The peft doc's Llama-2-70B QLoRA (peft 6008f27 examples/sft, accelerate 0.28 FSDP1, transformers 4.39):
h 8192, 80 blocks, 8 kv heads, ffn 28672, vocab 32000, LoRA r 8 on every block linear, bf16, 2 GPUs.
"""

from podkit.checks.allocator import MIB, CachingAllocator, block_bytes
from podkit.checks.fsdp1 import _block, _Ops, _unit_init, forward_events, quantized_load, replay
from podkit.checks.memory import estimate

H, L, KV, F, V, R = 8192, 80, 1024, 28672, 32000, 8
LINEARS = 2 * H * H + 2 * H * KV + 3 * H * F  # 855,638,016 weights per block
ROOT = (2 * V * H + H) * 2  # embedding + head + final norm, bf16
ADAPTERS = sum(i * R + R * o for i, o in [(H, H), (H, KV), (H, KV), (H, H), (H, F), (H, F), (F, H)])


def qlora70b(job, offload="none", accum=2):
    return job(model=f"hidden = {H}\nlayers = {L}\nheads = 64\nkv_heads = 8\nffn = {F}\nvocab = {V}\n"
                     "tie_embeddings = false\narch = 'llama'",
               train=f"stack = 'hf'\nprecision = 'bf16'\nlora_rank = {R}\nlora_targets = 'all-linear'\n"
                     f"lora_dtype = 'compute'\nbase_quant = 'nf4'\nbitsandbytes = '0.43.0'\ncheckpointing = 'full'\n"
                     f"attention = 'flash-attn'\nmicro_batch = 2\nseq_len = 2048\ngrad_accum = {accum}",
               cluster=f"gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'\noffload = '{offload}'")


def part(est, label, phase):
    return sum(p.bytes for p in est.phase_parts[phase] if p.label.startswith(label))


def test_hf_fsdp_is_fsdp1_with_each_lora_linear_its_own_unit(job):
    j = qlora70b(job)
    assert j.facts.fsdp_version == 1
    est = estimate(j)
    # A block's flat parameter holds only the packed 4-bit weights and the two bf16 norms; the adapters
    # are units of their own (peft fsdp_auto_wrap_policy), so no adapter unit is the block prefetched in
    # backward: the block in backward and the root are gathered.
    block = LINEARS * 0.5 + 2 * H * 2 + ADAPTERS * 2
    assert part(est, "unsharded weights", "forward-end") == ROOT
    assert part(est, "FSDP1 unshard-stream pool", "step") == int(ROOT + 2 * block)
    assert part(est, "FSDP all-gather", "forward-end") == 0  # no FSDP2 copy-in buffer


def test_offloaded_unit_init_leaves_only_freed_segments():
    # Two 100 MiB parameters, world 2: moved (2 x 100), one flattened broadcast bucket (200), the flat
    # parameter (reuses that freed 200 MiB block), the shard (100); then flat_param_to(cpu) frees the
    # shard too: the same 500 MiB reserved, nothing allocated.
    a = CachingAllocator()
    _unit_init(a, [100 * MIB, 100 * MIB], world=2, sync=True, offload=True)
    assert a.reserved == 500 * MIB and a.allocated == 0


def test_flash_attention_block_skips_the_qkv_contiguous_copies(job):
    j = qlora70b(job)
    T, e = 4096, 2
    allocated = {}
    for flash in (False, True):
        ops = _Ops()
        x = ops.new(e * H * T)
        _block(ops, x, T, j.shape, e, frozenset(j.facts.lora_targets), True, flash)
        allocated[flash] = sum(ev[2] for ev in ops.events if ev[0] == "a")
    # SDPA's path copies q (8192 wide), k and v (1024 wide each) with .contiguous(); flash does not.
    assert allocated[False] - allocated[True] == e * T * (H + 2 * KV)


def test_trainer_loss_frees_the_logits_before_backward_and_leaves_the_16_bit_hole(job):
    j = qlora70b(job)
    T = 512
    targets = frozenset(j.facts.lora_targets)
    kept = replay(forward_events(j.shape, T, 2, targets, True, loss="fp32-logits-kept", batch=1))
    trainer = replay(forward_events(j.shape, T, 2, targets, True, loss="fp32-upcast", batch=1))
    # At log_softmax's backward the 4.39 loop still holds the fp32 logits (4 B per logit); the Trainer
    # dropped `outputs` when compute_loss returned. The 4.39 loss shifts: its log-softmax output and the two
    # gradients (4 B each) span T - 1 positions, the >= 4.49 loss's all T.
    assert kept.allocated - trainer.allocated == 4 * V * T - 3 * 4 * V
    # The 16-bit logits (2 B) and the fp32 copy (4 B) got segments of their own (each over 10 MiB, larger
    # than any freed block); backward's first 4 B gradient takes the copy's, the second cannot use the
    # 2 B one: it stays reserved, empty.
    assert trainer.reserved_large - trainer.allocated >= 2 * V * T


def test_cpu_offload_keeps_shard_copies_and_sharded_grads_on_the_gpu(job):
    est = estimate(qlora70b(job, offload="all", accum=1))
    assert part(est, "weights", "step") == 0 and part(est, "adamw states", "step") == 0
    # The root's bf16 shard copied from the host before its all-gather: 1,048,592,384 / 2 = 524,296,192 B, just over 250 x 2 MiB: a 251 x 2 MiB
    # segment on the pre-unshard stream (block shards, 216 MB, reuse it).
    assert ROOT // 2 == 524_296_192
    assert part(est, "FSDP1 pre-unshard stream pool", "step") == 251 * 2 * MIB
    # Each reduce-scattered gradient shard stays on the GPU (flat_param._saved_grad_shard) after its copy
    # to the host until the post-backward callback: all of them at the end of backward, none at the step.
    grads = ADAPTERS * L * 2 // 2
    assert part(est, "gradients so far", "backward-end") == grads
    assert sum(p.bytes for p in est.phase_parts["step"] if p.term == "grads") == 0


def test_fsdp1_and_gradient_accumulation_keep_unsharded_gradients_under_no_sync(job):
    # accelerate's accumulate() puts the first of 2 micro-steps under no_sync(): every adapter's whole
    # bf16 gradient stays on the GPU (also with CPU offload) through the next micro-step's forward and
    # backward; only the step sees the shards (none on the GPU with offload).
    for offload in ("none", "all"):
        est = estimate(qlora70b(job, offload=offload, accum=2))
        for phase in ("forward-end", "backward", "backward-end"):
            assert part(est, "unsharded gradients, accumulated under no_sync", phase) == ADAPTERS * L * 2
        assert part(est, "unsharded gradients", "step") == 0
    assert part(estimate(qlora70b(job, accum=1)), "unsharded gradients, accumulated", "backward") == 0


def test_quantized_loading_keeps_the_quant_state_and_the_16_bit_root_on_the_gpu():
    # One 2^28-weight linear quantized on the GPU between the embedding and the head (100 MiB each) and
    # a 1 KiB norm: the bf16 weight (512 MiB), fp32 absmax (16 MiB), packed data (128 MiB), the nested
    # absmax (64 KiB: small pool) and the uint8 absmax (4 MiB: under 10 MiB, a 20 MiB segment) each need
    # a segment; the head then fits in the freed 128 MiB packed block.
    a = CachingAllocator()
    root = quantized_load(a, [100 * MIB, 1024, 100 * MIB], [1 << 28])
    assert [block_bytes(b) for b in root] == [100 * MIB, 1024, 100 * MIB]
    assert a.reserved_large == (100 + 512 + 16 + 128 + 20) * MIB
    assert a.allocated == (200 + 4) * MIB + 64 * 1024 + 1024


def test_transformers_4_45_loads_the_16_bit_root_to_the_host_not_the_gpu(job):
    # The same linear without the 16-bit parameters on the GPU (4.45's `param_device = "cpu" if
    # is_local_dist_rank_0() else "meta"`): the bf16 weight (512 MiB), fp32 absmax (16 MiB) and packed data
    # (128 MiB) still take a segment each, the uint8 absmax (4 MiB) a 20 MiB one; what stays is the QuantState.
    a = CachingAllocator()
    assert quantized_load(a, [100 * MIB, 1024, 100 * MIB], [1 << 28], root_on_gpu=False) is None
    assert a.reserved_large == (512 + 16 + 128 + 20) * MIB
    assert a.allocated == 4 * MIB + 64 * 1024
    for version, on_gpu in (("4.44.2", True), ("4.45.0", False), ("4.48.1", False)):
        j = qlora70b(job).replace(train={"transformers": version})
        assert j.facts.quantized_load_16bit_on_gpu is on_gpu, version
    assert not qlora70b(job).replace(train={"transformers": "4.44.2", "base_quant": "none"}).facts.quantized_load_16bit_on_gpu


def test_hf_qlora_wrap_starts_from_the_loaded_root_and_quant_state(job):
    # The replay of the 70B QLoRA's load and wrap holds, after wrapping with CPU offload, exactly what
    # stays on the GPU: every QuantState (uint8 absmax per 64 + fp32 per 16,384 weights), nothing else.
    from podkit.checks.memory import _fsdp1_units, _quantized_load_order

    j = qlora70b(job, offload="all").replace(train={"transformers": "4.39.3"})  # the peft doc's release
    load = _quantized_load_order(j)
    assert len(load) == 7 * L and sum(load) == LINEARS * L
    a = CachingAllocator()
    units = [params for params, _ in _fsdp1_units(j, 2)]  # (parameters, buffers): the hf stack has no buffers
    assert j.facts.quantized_load_16bit_on_gpu  # before 4.45 the root is loaded onto the GPU
    root = quantized_load(a, units[-1], list(load), j.facts.quantized_load_16bit_on_gpu)
    for tensors in units[:-1]:
        _unit_init(a, tensors, 2, True, offload=True)
    _unit_init(a, units[-1], 2, True, offload=True, resident=root)
    quant_state = sum(-(-n // 64) + 4 * -(-n // (64 * 256)) for n in load)
    assert a.allocated == sum(max(512, -(-b // 512) * 512) for b in
                              [-(-n // 64) for n in load] + [4 * -(-n // (64 * 256)) for n in load])
    assert abs(a.allocated - quant_state) < 512 * 2 * len(load)


def test_fsdp_version_2_prices_accelerates_fully_shard_instead(job, tmp_path):
    # accelerate >= 1.6 with fsdp_config.fsdp_version: 2 runs fully_shard: the importer says so and the
    # job gets FSDP2's copy-in all-gather pool instead of FSDP1's unshard pool.
    from podkit.checks.importers import build_job

    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
                    "  fsdp_reshard_after_forward: true\n")
    assert build_job(None, [str(yaml)], model_preset="llama-3.2-1b").job.cluster.fsdp_version == 2
    j = job(model='preset = "llama-3.2-1b"', train="stack = 'hf'\ncheckpointing = 'full'",
            cluster="gpu = 'H100'\ngpus_per_node = 2\nsharding = 'zero3'\nfsdp_version = 2")
    assert j.facts.fsdp_version == 2
    est = estimate(j)
    assert part(est, "FSDP all-gather stream pool", "forward-end") > 0
    assert part(est, "FSDP1 unshard-stream pool", "forward-end") == 0


# ---- a full fine-tune's first optimizer step -----------------------------------------------------------


def test_rank_zero_holds_the_leading_parameters_of_each_unit():
    from podkit.checks.fsdp1 import shard_pieces

    # Each unit's flat parameter is split in world parts; rank 0's part is the first: 90 of 100 + 50 + 30
    # values, and of 40 + 30 + 50 the first 40 whole and 20 of the next.
    assert shard_pieces((((100, 50, 30), ()), ((40, 30, 50), ())), 2, 1) == [90, 40, 20]
    assert shard_pieces((((200, 100), ()),), 1, 2) == [100, 50]  # byte sizes of 2 B values, one rank


def test_the_first_steps_states_take_the_freed_activation_blocks():
    from podkit.checks.fsdp1 import first_step

    alloc = CachingAllocator()
    for block in [alloc.malloc(100 * MIB), alloc.malloc(100 * MIB)]:  # the first forward's activations, freed
        alloc.free(block)
    # Two 60 MiB states: best fit splits each cached 100 MiB block, leaving 40 MiB free in each; the 60 MiB
    # temporary fits neither remainder and gets a segment of its own.
    first_step(alloc, (60 * MIB, 60 * MIB), (60 * MIB,))
    assert (alloc.allocated, alloc.reserved) == (120 * MIB, 260 * MIB)
    # The second forward's two 100 MiB activations find no block that holds them: two new segments, so 460 MiB
    # are reserved for 320 MiB at most allocated.
    alloc.malloc(100 * MIB), alloc.malloc(100 * MIB)
    assert (alloc.peak_allocated, alloc.reserved) == (320 * MIB, 460 * MIB)


def test_a_full_fine_tune_replays_its_second_forward_beside_the_states(job):
    from podkit.checks import fsdp1
    from podkit.checks.memory import _fsdp1_first_step, _fsdp1_units

    full = job(model='preset = "mistral-7b"', cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'",
               train="stack = 'hf'\ntransformers = '4.48.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
                     "checkpointing = 'full'\nattention = 'flash-attn'\noptimizer_impl = 'foreach'")
    units = _fsdp1_units(full, 2)
    states, temps = _fsdp1_first_step(full, units, 2, 2, 2)
    # AdamW: exp_avg and exp_avg_sq of rank 0's half of every parameter, bf16; foreach's sqrt: one more.
    assert sum(states) == 2 * sum(temps) == 2 * 2 * sum(fsdp1.shard_pieces(tuple(units), 2, 2))
    assert abs(sum(states) - 2 * full.shape.params) < 1e6  # 2 states x 2 B x half the parameters
    args = (units, 2, full.shape, 8192, 2, frozenset(), False, 4)
    kw = dict(flash=True, loss="fp32-upcast-shifted", shift_copy=True, batch=2, norm_trains=True)
    _, one_step = fsdp1.step_reserved(*args, **kw)
    _, two_steps = fsdp1.step_reserved(*args, **kw, step=(states, temps))
    # The second forward's loss peak holds everything the first's did, plus the states: at least that much more.
    assert two_steps >= one_step + sum(states)
