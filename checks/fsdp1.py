"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) facts that decide reserved memory.

FSDP1 differs from FSDP2 (`fully_shard`) where memory is concerned (torch 2.2, the same in 2.13):

- unshard: `_unshard` runs `handle.unshard()` inside `with stream(unshard_stream)`, and
  `_alloc_padded_unsharded_flat_param` allocates the padded unsharded flat parameter there; the
  all-gather writes straight into it and the module's parameters become views of it
  (`_use_unsharded_flat_param`): no separate all-gather buffer and no copy-out. Resharding frees it
  with `record_stream(current stream)` (`_free_unsharded_flat_param`), so the block returns to the
  unshard stream's pool once the compute stream passes that point;
- the root is not resharded after forward (`_post_forward_reshard`: `not state._is_root`);
- backward prefetch (BACKWARD_PRE) targets the handle that finished its forward just before the
  current one (`get_handle_to_backward_prefetch`: `handles_post_forward_order[index - 1]`); with
  LoRA linears wrapped as their own units that is a LoRA unit of the same block, not the previous
  block;
- gradients: `_reduce_grad` reduce-scatters the unsharded `.grad` itself (padded with `F.pad` only
  when uneven) into `new_sharded_grad = torch.empty_like(chunk)`, allocated on the post-backward
  stream, which becomes the sharded `.grad` at `_finalize_params`;
- initialisation (`_init_param_handle_from_module`) moves the unit's parameters to the GPU tensor by
  tensor, broadcasts them with sync_module_states, flattens them into one new tensor
  (`flatten_tensors_into_flat_param`: torch.cat) and clones this rank's shard, while
  `managed_params` still holds the moved originals. The unit's buffers are moved and broadcast too,
  but never flattened: they stay where they were moved. The broadcast goes through ProcessGroupNCCL,
  whose collectives record the NCCL stream on their tensors, so the blocks it read are reused only
  after a later host sync (see _unit_init). The segments this leaves stay reserved: the
  training loop resets the peak counters afterwards, and reset_peak_memory_stats keeps the current
  reserved bytes as the new peak.
"""

from __future__ import annotations

from functools import lru_cache

from podkit.checks.allocator import CachingAllocator, replay

# torch/distributed/fsdp/_init_utils.py: PARAM_BROADCAST_BUCKET_SIZE = int(250 * 1024 * 1024), passed to
# dist._broadcast_coalesced (torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced): buckets close
# when their size reaches the limit (compute_bucket_assignment_by_size, one bucket list per dtype, the
# buckets then sorted by their first tensor), at most 2 are in flight, and a bucket of more than one
# tensor is flattened into a copy (torch/csrc/utils/tensor_flatten.h: flatten_dense_tensors returns a
# view for a single tensor, at::cat otherwise).
BROADCAST_BUCKET = 250 * 1024 * 1024
BROADCASTS_IN_FLIGHT = 2


def _buckets(states: list[int], buffers: int, buffers_share_dtype: bool) -> list[list[int]]:
    """Indices into `states` (the unit's buffers first, then its parameters: _sync_module_params_and_buffers
    lists module.buffers() before the params) per broadcast bucket, in broadcast order."""
    groups = [list(range(len(states)))] if buffers_share_dtype or not buffers else [
        list(range(buffers)), list(range(buffers, len(states)))]
    buckets = []
    for group in groups:
        bucket, size = [], 0
        for i in group:
            bucket.append(i)
            size += states[i]
            if size >= BROADCAST_BUCKET:
                buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            buckets.append(bucket)
    return sorted(buckets, key=lambda b: b[0])


def quantized_load(alloc: CachingAllocator, root: list[int], weights: list[int],
                   root_on_gpu: bool = True) -> list | None:
    """transformers 4.39 from_pretrained of a bitsandbytes 4-bit model on each FSDP rank
    (FSDP_CPU_RAM_EFFICIENT_LOADING): a quantized model skips the rank-0-only path
    (modeling_utils.py l.3951 `not is_quantized`), the 4-bit quantizer's device map is
    {"": current device} (quantizer_bnb_4bit.py update_device_map), so every 16-bit parameter (`root`,
    byte sizes: embedding, head, norms) is placed on the GPU and kept (`root_on_gpu`; from 4.45 they go to
    the host or meta instead: JobFacts.quantized_load_16bit_on_gpu), and each 4-bit weight (`weights`,
    element counts, in load order) is quantized there and then moved to the host
    (_load_state_dict_into_meta_model l.818-823: `value.data.to("cpu")`), its QuantState staying behind.
    Per weight, bitsandbytes 0.43.0: Params4bit._quantize `w = self.data.contiguous().cuda(device)`
    (2 B per weight); quantize_4bit allocates the fp32 absmax (4 B per 64) then the packed output (0.5 B);
    double quantization (quantize_blockwise, blocksize 256) its fp32 absmax (4 B per 256 absmax) then the
    uint8 absmax (1 B per 64), `del absmax`. Returns the kept 16-bit parameters' blocks, or None where they
    are not on the GPU."""
    kept = [alloc.malloc(n) for n in root[:1]] if root_on_gpu else []  # the embedding comes first
    for n in weights:
        w = alloc.malloc(2 * n)
        absmax = alloc.malloc(4 * -(-n // 64))
        packed = alloc.malloc(n // 2)
        alloc.malloc(4 * -(-n // (64 * 256)))  # state2.absmax, kept
        alloc.malloc(-(-n // 64))  # the uint8 absmax, kept
        alloc.free(absmax)
        alloc.free(w)
        alloc.free(packed)  # the packed data went to the host
    return kept + [alloc.malloc(n) for n in root[1:]] if root_on_gpu else None


def _unit_init(alloc: CachingAllocator, tensors: list[int], world: int, sync: bool, offload: bool = False,
               resident: list | None = None, buffers: tuple[int, ...] = (), buffers_share_dtype: bool = False,
               pending: list | None = None) -> None:
    """One FSDP1 unit's __init__ on a rank whose module starts on the CPU: returns with its shard live,
    or, with CPUOffload(offload_params=True), with its shard moved to the host (_init_utils.py
    _init_param_handle_from_params: `if state.cpu_offload.offload_params and handle.flat_param.device
    != cpu_device: handle.flat_param_to(cpu_device)`), leaving only freed segments behind. Its buffers
    are moved and broadcast but never flattened or sharded: they stay live.

    `pending`, when given, holds blocks freed while ProcessGroupNCCL still owned them: its collectives
    record the NCCL stream on their tensors (torch 2.2 ProcessGroupNCCL::collective, recordStream unless
    TORCH_NCCL_AVOID_RECORD_STREAMS=1), so the allocator frees such a block only once an event on that
    stream has completed (CUDACachingAllocator.cpp free -> insert_events; process_events at each malloc).
    The broadcast is taken to be still running when its buffer is dropped (work.wait() only makes the
    default stream wait; a block's ~100 MiB over PCIe takes milliseconds, the host reaches the unit's
    torch.cat within about one: a timing assumption, not a rule), so the unit's flat parameter and
    shard cannot reuse it; the next parameter move's blocking copy (.to(device): cudaMemcpyAsync +
    cudaStreamSynchronize on the default stream, which waits for the NCCL stream) completes it, and
    from the request after that move on the block is free."""

    def move(n: int):
        block = alloc.malloc(n)
        if pending:
            for freed in pending:
                alloc.free(freed)
            pending.clear()
        return block

    # _move_states_to_device: parameters (those already on the GPU, `resident`, stay), then buffers.
    moved = resident if resident is not None else [move(n) for n in tensors]
    kept = [move(n) for n in buffers]
    states = list(buffers) + list(tensors)
    state_blocks = kept + list(moved)
    nccl_used = set()
    if sync:
        in_flight: list = []

        def finish(copy) -> None:
            if copy is None:
                return
            if pending is None:
                alloc.free(copy)
            else:
                pending.append(copy)

        for bucket in _buckets(states, len(buffers), buffers_share_dtype):
            if len(in_flight) >= BROADCASTS_IN_FLIGHT:
                finish(in_flight.pop(0))
            if len(bucket) > 1:
                in_flight.append(alloc.malloc(sum(states[i] for i in bucket)))
            else:  # broadcast in place: the moved tensor itself is handed to NCCL
                in_flight.append(None)
                nccl_used.add(id(state_blocks[bucket[0]]))
        for copy in in_flight:
            finish(copy)
    total = sum(tensors)
    flat = alloc.malloc(total)
    shard = alloc.malloc(-(-total // world))  # this rank's shard (FlatParamHandle.shard)
    alloc.free(flat)  # orig_storage._resize_(0)
    if offload:
        alloc.free(shard)
    for m in moved:  # managed_params goes out of scope with _init_param_handle_from_module
        if pending is not None and id(m) in nccl_used:
            pending.append(m)
        else:
            alloc.free(m)


Unit = tuple[tuple[int, ...], tuple[int, ...]]
"""An FSDP1 unit as the replay sees it: its parameters' byte sizes and its buffers' byte sizes."""


def _wrap(alloc: CachingAllocator, units: tuple[Unit, ...], world: int, sync: bool, offload: bool,
          buffers_share_dtype: bool, nccl_events: bool, root: list | None = None) -> None:
    pending: list | None = [] if nccl_events else None
    for i, (params, buffers) in enumerate(units):
        _unit_init(alloc, list(params), world, sync, offload, root if i == len(units) - 1 else None,
                   buffers, buffers_share_dtype, pending)
    # A dist.barrier() after wrapping synchronises the device (ProcessGroupNCCL::barrier's wait:
    # cudaDeviceSynchronize; fsdp_qlora train.py calls it): what the last broadcasts held is free.
    for block in pending or []:
        alloc.free(block)


@lru_cache(maxsize=64)
def _init_replay(units: tuple[Unit, ...], world: int, sync: bool, offload: bool, buffers_share_dtype: bool,
                 nccl_events: bool) -> tuple[int, int]:
    alloc = CachingAllocator()
    _wrap(alloc, units, world, sync, offload, buffers_share_dtype, nccl_events)
    return alloc.reserved_large, alloc.reserved


def init_reserved(units: list[Unit], world: int, sync: bool = True, offload: bool = False,
                  buffers_share_dtype: bool = False, nccl_events: bool = True) -> tuple[int, int]:
    """(large-pool bytes, all bytes) reserved on one rank's default stream after FSDP1 has wrapped
    `units` ((parameter byte sizes, buffer byte sizes) each, in wrap order: inner units first, the root
    last), starting from a model on the CPU. Only the large pool's segments can take training's tensors
    of over 1 MiB. `buffers_share_dtype`: the buffers have the parameters' dtype (one broadcast bucket
    list); `nccl_events`: frees of blocks a broadcast used wait for the NCCL stream (see _unit_init)."""
    return _init_replay(tuple((tuple(p), tuple(b)) for p, b in units), world, sync, offload,
                        buffers_share_dtype, nccl_events)


# ---------------------------------------------------------------- the first training step's forward


class _Ops:
    """An allocation trace: ("a", name, bytes) allocates, ("f", name) frees."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._n = 0

    def new(self, size: float) -> str:
        self._n += 1
        name = f"t{self._n}"
        self.events.append(("a", name, int(size)))
        return name

    def free(self, *names: str) -> None:
        self.events += [("f", n) for n in names if n]


def _rmsnorm(ops: _Ops, T: int, h: int, e: int) -> str:
    """transformers 4.39 LlamaRMSNorm under no_grad: hs.to(float32); hs.pow(2).mean(-1); hs * rsqrt(...);
    weight * hs.to(input_dtype)."""
    x32 = ops.new(4 * h * T)
    sq = ops.new(4 * h * T)
    ops.free(sq)  # .mean(-1, keepdim=True) is T x 4 B
    normed = ops.new(4 * h * T)
    ops.free(x32)
    cast = ops.new(e * h * T)
    ops.free(normed)
    out = ops.new(e * h * T)
    ops.free(cast)
    return out


def _linear(ops: _Ops, x: str, T: int, fan_in: int, fan_out: int, e: int, lora: bool, quant: bool) -> str:
    """A base linear (bitsandbytes MatMul4Bit dequantizes the whole weight first, 0.43.0
    autograd/_functions.py l.516) with peft 0.10's LoRA beside it: lora/layer.py Linear.forward
    `result = result + lora_B(lora_A(dropout(x))) * scaling`; lora/bnb.py Linear4bit clones the base
    output first and adds `output * scaling` the same way. Dropout (aten native_dropout) makes its
    output and a 1-byte mask."""
    w = ops.new(e * fan_in * fan_out) if quant else ""
    out = ops.new(e * fan_out * T)
    ops.free(w)
    if not lora:
        return out
    if quant:
        cloned = ops.new(e * fan_out * T)
        ops.free(out)
        out = cloned
    dropped, mask = ops.new(e * fan_in * T), ops.new(fan_in * T)
    ops.free(mask)
    ops.free(dropped)  # lora_A's output is rank-wide: under 1 MiB per thousand tokens, not traced
    b = ops.new(e * fan_out * T)
    scaled = ops.new(e * fan_out * T)
    ops.free(b)
    total = ops.new(e * fan_out * T)
    ops.free(out, scaled)
    return total


def _block(ops: _Ops, x: str, T: int, s, e: int, targets, quant: bool, flash: bool = False) -> str:
    """One transformers 4.39 LlamaDecoderLayer forward under no_grad (a reentrant checkpoint's first
    pass): the sdpa attention path with a causal mask (q, k, v made .contiguous(), rotate_half RoPE) and
    the gated MLP. Returns the block output, which stays alive (the next block's checkpointed input).

    flash: LlamaFlashAttention2 instead (4.39 modeling_llama.py): q, k, v only transposed to
    (b, s, heads, d), views whose last dimension is contiguous, which flash_attn_func takes without a
    copy (flash_attn_interface.py maybe_contiguous copies only when stride(-1) != 1); its output
    (b, s, heads, d) is reshaped to (b, s, hidden), a view."""
    h, qd, kvd, ffn = s.hidden, s.q_dim, s.kv_dim, s.dense_ffn

    def lin(inp, fi, fo, name):
        return _linear(ops, inp, T, fi, fo, e, name in targets, quant)

    n1 = _rmsnorm(ops, T, h, e)
    q, k, v = lin(n1, h, qd, "q_proj"), lin(n1, h, kvd, "k_proj"), lin(n1, h, kvd, "v_proj")
    embedded = []
    for t, width in ((q, qd), (k, kvd)):  # apply_rotary_pos_emb: (t * cos) + (rotate_half(t) * sin)
        tc = ops.new(e * width * T)
        neg = ops.new(e * width * T / 2)
        rh = ops.new(e * width * T)
        ops.free(neg)
        rs = ops.new(e * width * T)
        ops.free(rh)
        emb = ops.new(e * width * T)
        ops.free(tc, rs)
        embedded.append(emb)
    ops.free(q, k)
    if flash:
        attn = ops.new(e * qd * T)  # flash_attn_func's output (its fp32 softmax_lse is under 1 MiB)
        ops.free(embedded[0], embedded[1], v)
    else:
        contiguous = []
        for t, width in ((embedded[0], qd), (embedded[1], kvd), (v, kvd)):
            c = ops.new(e * width * T)
            ops.free(t)
            contiguous.append(c)
        attn = ops.new(e * qd * T)  # memory-efficient SDPA (a mask is given): output as (b, s, heads, d)
        ops.free(*contiguous)
    o = lin(attn, qd, h, "o_proj")
    ops.free(attn, n1)
    r1 = ops.new(e * h * T)
    ops.free(o)
    n2 = _rmsnorm(ops, T, h, e)
    g = lin(n2, h, ffn, "gate_proj")
    act = ops.new(e * ffn * T)
    ops.free(g)
    u = lin(n2, h, ffn, "up_proj")
    prod = ops.new(e * ffn * T)
    ops.free(act, u)
    d = lin(prod, ffn, h, "down_proj")
    ops.free(prod, n2)
    out = ops.new(e * h * T)
    ops.free(r1, d)
    return out


def forward_events(s, T: int, e: int, targets, quant: bool, lsm: int = 4, flash: bool = False,
                   loss: str = "fp32-logits-kept", shift_copy: bool = True, names: dict | None = None, *,
                   batch: int, norm_trains: bool = False, moe=None, routing: tuple | None = None,
                   softcap: bool = False) -> list[tuple]:
    """The default stream's allocations of one step of an HF Llama (transformers 4.39 decoder layers),
    up to the loss peak: embedding output, every checkpointed block under no_grad, then the final norm, the
    head and the loss, and backward through the loss to log_softmax's gradient, as the single-GPU replay runs
    them (step_replay.head_events: `loss`, `shift_copy`, `lsm`, `batch` sequences, `norm_trains`, `softcap`).
    names, when given, receives the blocks' inputs ("inputs": the embedding's output, then each block's
    output) and what head_events names, for backward_events.

    `moe`: the blocks' activations.BlockFacts where they are MoE blocks, which _block (a dense layer) cannot run:
    each is then walked as the single-GPU replay walks it (step_replay.forward_events), its routed experts' rows
    per block given by `routing` (step_replay.block_routing) where they run in a loop."""
    from podkit.checks import step_replay

    ops = _Ops()
    x = ops.new(e * s.hidden * T)
    inputs = [x]
    zero: set = set()
    for i in range(s.layers):
        if moe is None:
            x = _block(ops, x, T, s, e, targets, quant, flash)
        else:
            x = ("block output", i)
            ops.events += step_replay.forward_events(moe, i, inputs[i], x, T, zero, routing[i] if routing else None)
        inputs.append(x)
    head, head_names = step_replay.head_events(T, batch, s.vocab, s.hidden, e, loss, shift_copy, lsm, norm_trains,
                                               softcap=softcap)
    if names is not None:
        names.update(head_names, inputs=inputs)
    return ops.events + head


def backward_events(names: dict, s, T: int, e: int, block: tuple[tuple, tuple, bool], kept: bool,
                    unit_grad: int = 0, root_grads: tuple[int, int, int] = (0, 0, 0),
                    around_unit: bool = True, experts: tuple = (), routing: tuple | None = None) -> list[tuple]:
    """The rest of the step after forward_events' peak (whose `names` it continues), as the single-GPU replay
    runs it (step_replay.backward_events), then the fp32 logits a loop kept. `block`:
    step_replay.backward_replay's. kept: FSDP1 keeps each block's input and its gradient until backward ends
    (JobFacts.fsdp1_keeps_block_inputs; _finalize_params removes the hooks that hold them). `unit_grad`,
    `root_grads`: a full fine-tune's flat gradients, and `around_unit`, `experts` and `routing` (MoE blocks), as
    step_replay.backward_events takes them."""
    from podkit.checks import step_replay

    ev = step_replay.backward_events(names["inputs"], names["loss"], T, s.vocab, s.hidden, e, names["sliced"], block,
                                     kept, head_frees=names["head_frees"], unit_grad=unit_grad,
                                     root_grads=root_grads, tied=s.tie_embeddings, around_unit=around_unit,
                                     experts=experts, routing=routing, cast_back=names["cast_back"],
                                     softcap=names["softcap"])
    return ev + ([("f", names["logits"])] if names["logits"] else [])


def shard_pieces(units: tuple[Unit, ...], world: int, bytes_per_value: int) -> list[int]:
    """Value counts of the original parameters' pieces in rank 0's shard, unit by unit in wrap order: FSDP1
    flattens a unit's parameters in order and rank 0 holds the first 1/world of the flat parameter
    (FlatParamHandle._get_unpadded_shard: flatten().chunk(world)[rank]), so it holds the leading parameters
    whole and one in part. The optimizer sees these pieces with use_orig_params=True (`accelerate launch`'s
    default, checks/stacks.py hf); with False it would see one flat shard per unit."""
    pieces = []
    for params, _ in units:
        values = [n // bytes_per_value for n in params]
        left = -(-sum(values) // world)
        for n in values:
            if left <= 0:
                break
            pieces.append(min(n, left))
            left -= n
    return pieces


def first_step(alloc: CachingAllocator, states: tuple[int, ...], temps: tuple[int, ...]) -> None:
    """The first optimizer step after the first backward: torch.optim makes its states lazily, parameter by
    parameter (torch/optim/adamw.py _init_group: `state["exp_avg"] = torch.zeros_like(p)`, then
    exp_avg_sq), into whatever the step's freed activation and loss blocks offer (best fit splits them), and
    the step's temporaries come and go. The states stay: the next forward's activations no longer find the
    blocks they used, and need segments of their own. A stand-in for the real order: states follow the wrap
    (torch makes them in parameter order, the root's embedding first, per parameter group), and of the backward
    before the step the unsharded gradients, which also shape the cached blocks, are not replayed."""
    for n in states:
        alloc.malloc(n)
    for block in [alloc.malloc(n) for n in temps]:
        alloc.free(block)


@lru_cache(maxsize=64)
def _step_replay(units: tuple[Unit, ...], world: int, sync: bool, offload: bool,
                 block_key: tuple, load: tuple[int, ...], buffers_share_dtype: bool, nccl_events: bool,
                 step: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                 block: tuple[tuple, tuple, bool] | None = None, kept: bool = False,
                 grads: tuple[int, tuple[int, int, int], bool] = (0, (0, 0, 0), True),
                 moe: tuple | None = None, load_root: bool = True) -> tuple[int, int]:
    alloc = CachingAllocator()
    root = quantized_load(alloc, list(units[-1][0]), list(load), load_root) if load else None
    _wrap(alloc, units, world, sync, offload, buffers_share_dtype, nccl_events, root)
    init_large = alloc.reserved_large
    shape, T, batch, e, targets, quant, lsm, flash, loss, shift_copy, norm_trains, softcap = block_key
    names: dict = {}
    bf, experts, routing = moe or (None, (), None)
    events = forward_events(shape, T, e, targets, quant, lsm, flash, loss, shift_copy, names, batch=batch,
                            norm_trains=norm_trains, moe=bf, routing=routing, softcap=softcap)
    if block is not None:
        events = events + backward_events(names, shape, T, e, block, kept, *grads, experts=experts, routing=routing)
    live: dict = {}
    replay(events, alloc, live)
    states, temps = step
    if states or block is not None:
        # Without the backward replayed, backward ends with every activation and loss tensor freed (its own
        # tensors reuse the forward's blocks), then the first step, then the second step in what is left.
        for b in live.values():
            alloc.free(b)
        if states:
            first_step(alloc, states, temps)
        replay(events, alloc)
    return init_large, alloc.reserved_large


def step_reserved(units: list[Unit], world: int, shape, tokens: int, e: int, targets, quant: bool,
                  lsm: int = 4, sync: bool = True, offload: bool = False, flash: bool = False,
                  loss: str = "fp32-logits-kept", load: tuple[int, ...] = (), buffers_share_dtype: bool = False,
                  nccl_events: bool = True, shift_copy: bool = True,
                  step: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                  block: tuple[tuple, tuple, bool] | None = None, kept: bool = False, *, batch: int,
                  norm_trains: bool = False, unit_grad: int = 0,
                  root_grads: tuple[int, int, int] = (0, 0, 0), around_unit: bool = True,
                  moe: tuple | None = None, load_root: bool = True, softcap: bool = False) -> tuple[int, int]:
    """(large-pool bytes reserved after the wrap, and at the end of the replay) on one rank's default stream:
    the wrap's replay followed by the step in the same allocator, so the step reuses what the wrap left
    cached where the sizes allow; without `block` or `step`, the first step's forward up to the loss's
    backward peak only. `load`: the 4-bit weights'
    element counts when the model was quantized on the GPU while loading (quantized_load), whose
    QuantStates and, with `load_root`, 16-bit root parameters are then already in the allocator when the wrap
    starts.
    `units`, `buffers_share_dtype` and `nccl_events` as for init_reserved; `shift_copy`, `batch` (sequences in
    the `tokens`) and `norm_trains` as for forward_events.
    `step`: the first optimizer step's state and temporary byte sizes on this rank (first_step), when its
    states are made on the GPU after the first backward; then the second step's forward is replayed too and
    the bytes returned are those at its loss peak.
    `block`: a block's recompute and backward events, as backward_events takes them: the first step's backward
    is replayed too (`kept` as there), and the second step whole; `unit_grad`, `root_grads` (a full
    fine-tune's flat gradients, with `block` from step_replay.backward_replay's weight_grads) and `around_unit`
    as there.
    `moe`: for MoE blocks, their activations.BlockFacts (forward_events' `moe`), the routed expert beside each of
    `block`'s events (step_replay.backward_experts) and each block's routing (step_replay.block_routing).
    `softcap`: the model soft-caps its logits (step_replay.head_events)."""
    return _step_replay(tuple((tuple(p), tuple(b)) for p, b in units), world, sync, offload,
                        (shape, tokens, batch, e, frozenset(targets), quant, lsm, flash, loss, shift_copy, norm_trains,
                         softcap),
                        tuple(load),
                        buffers_share_dtype, nccl_events, (tuple(step[0]), tuple(step[1])), block, kept,
                        (unit_grad, tuple(root_grads), around_unit), moe, load_root)
