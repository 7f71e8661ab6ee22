"""The segments a single-GPU HF Trainer step's activations and loss leave reserved, from the allocator's rules.

Why a replay: the caching allocator places each tensor in the smallest cached free block that fits (best fit)
and never returns a segment, so what a step reserves beyond its allocated peak depends on the order and sizes of
its tensors, not on their sum. fms-acceleration's single-GPU LoRA/QLoRA runs hold 4-10 GiB more on the device
than their allocated peaks, growing with the tokens (benchmarks/published/fms-acceleration/SOURCES.md): each
checkpointed block input is carved out of a freed segment of the previous block's no-grad MLP intermediates,
and the remnant fits neither the next block's intermediates nor the loss's logits-sized tensors.

What is replayed, through checks/allocator.py, for two steps (the second starts from the first's segments):
- each block's forward under no_grad (a reentrant checkpoint: torch.utils.checkpoint CheckpointFunction),
  its ops in the order activations.py walks them, every intermediate freed after its last use, the
  block's output kept as the next block's checkpointed input;
- the head's bf16 logits and transformers 4.46-4.48 ForCausalLMLoss (loss/loss_utils.py): `logits.float()`,
  the shifted `.contiguous()` copy (none at micro-batch 1: activations.shifted_copy_bytes), log_softmax's output
  (kept); the first two die when the loss returns,
  the logits when compute_loss returns; its backward: nll_loss's zeros, log_softmax's input gradient,
  SliceBackward0's full-size zeros, ToCopyBackward0's 16-bit gradient, then the head's input gradient;
- each block in reverse: its recompute (the forward again, its saved tensors kept), then its backward as
  activations.backward_events orders it (engine.cpp), its input released at the end.
Scope, where this order is the one the code runs: one GPU (no sharding, no offload), per-block reentrant
checkpointing, that loss, a frozen base (LoRA/QLoRA: AdamW's states are made once, in the first step; the
adapters' gradients are left out, small-pool blocks while r x hidden x 4 B <= 1 MiB) and dense blocks (a MoE
block's expert loop is thousands of ops: too slow for preflight's half second). Elsewhere `segments` returns
None and memory.py keeps its closed-form pool terms. The final norm's few bytes per token are left out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from podkit.checks import activations as A
from podkit.checks.allocator import CachingAllocator


def applies(job) -> bool:
    f, t, c = job.facts, job.train, job.cluster
    return (f.stack.name == "hf" and not f.fsdp and not f.offloaded and c.sharding == "none"
            and c.gpus_per_node * c.nodes == 1 and f.ac_policy == "block" and f.reentrant
            and f.loss == "fp32-upcast-shifted" and f.lora and job.shape.moe is None
            and f.block_kernels == "torch" and not f.quant_saves_input and t.compute_bytes != 4)


@dataclass(frozen=True)
class Replay:
    """The step's activations and loss alone, through the allocator, in bytes."""

    peak_allocated: int
    reserved: int
    reserved_large: int
    """Of `reserved`, the large pool's segments (requests over 1 MiB)."""


def segments(job, device: str = "cuda") -> Replay | None:
    """What two steps of the job's activations and loss reserve; None where the replay does not apply."""
    if device != "cuda" or not applies(job):
        return None
    t, shape = job.train, job.shape
    return _replay(A.block_facts(job, device), shape.layers, shape.vocab, shape.hidden, t.compute_bytes,
                   t.micro_batch, t.micro_batch * t.seq_len, A.shifted_copy_bytes(job) > 0)


ALLOC, FREE, RENAME, GRAD_OUT = A.ALLOC, A.FREE, A.RENAME, A.GRAD_OUT
# A block's input, its output (the checkpointed residual stream) and the input's gradient, by these names; the
# block's other tensors by id, as activations.backward_events keys them.
IN, OUT, GRAD_IN = "in", "out", "grad in"


@functools.lru_cache(maxsize=64)
def _block_events(bf: A.BlockFacts, out_held: bool = True) -> tuple[tuple, tuple, tuple]:
    """A block's forward under no_grad, its recompute and its backward as allocator events (the kinds of
    activations.backward_events), recorded once per walk. `out_held`: the output's gradient is held outside
    the block's graph (activations.backward_events pinned_out), as a reentrant checkpoint's backward holds
    it; the caller frees it after the block."""
    tr, x_in = A._walk_block(bf, False)
    last_use: dict[int, int] = {}  # per tensor, the forward's last op to use it
    for j, op in enumerate(tr.ops):
        for t in (*op.inputs, *op.holds, *op.saved):
            last_use[id(t)] = j

    def forward(recompute: bool) -> tuple:
        ev = []
        name = lambda t: IN if t is x_in else id(t)  # noqa: E731
        made = {id(x_in)}
        for j, op in enumerate(tr.ops):
            for t in (*op.outputs, *op.saved):
                if id(t) not in made:
                    made.add(id(t))
                    ev.append((ALLOC, OUT if t is tr.output and not recompute else name(t), t.bytes))
            for t in (*op.inputs, *op.holds, *op.saved):
                if last_use[id(t)] == j and t is not x_in and t is not tr.output \
                        and not (recompute and id(t) in tr.saved):
                    ev.append((FREE, name(t), 0))
        if recompute:
            ev.append((FREE, name(tr.output), 0))  # the recomputed output only carries the gradient back in
        return tuple(ev)

    def backward() -> tuple:
        ev, grads = A.backward_events(tr, out_held)
        # The block input stays alive through its backward (the reentrant checkpoint's detached input holds
        # it); _replay frees it after. Its gradient becomes the previous block's output gradient.
        return tuple(x for x in ev if x[1] != id(x_in)) + ((RENAME, grads[id(x_in)], GRAD_IN),)

    return forward(False), forward(True), backward()


def backward_replay(bf: A.BlockFacts, reentrant: bool) -> tuple[tuple, tuple, bool]:
    """A checkpointed block's recompute and backward as events, and whether its output's gradient is held
    outside it (a reentrant checkpoint: CheckpointFunction.backward holds its `args` through the inner
    backward, so the block sums into it out of place and the caller frees it after the block): what
    checks/fsdp1.py replays of the blocks' backward."""
    _, recompute, bwd = _block_events(bf, reentrant)
    return recompute, bwd, reentrant


@functools.lru_cache(maxsize=64)
def _replay(bf: A.BlockFacts, layers: int, vocab: int, hidden: int, e: int, batch: int, tokens: int,
            shift_copy: bool = True) -> Replay:
    fwd, recompute, bwd = _block_events(bf, True)  # reentrant (applies): each output gradient held
    alloc = CachingAllocator()
    live: dict = {}

    def malloc(key, per_token_or_bytes: float, per_token: bool = True) -> None:
        n = int(per_token_or_bytes * tokens) if per_token else int(per_token_or_bytes)
        if n > 0:
            live[key] = alloc.malloc(n)

    def free(key) -> None:
        block = live.pop(key, None)
        if block is not None:
            alloc.free(block)

    def run(events: tuple, i: int) -> None:
        names = {IN: ("x", i), OUT: ("x", i + 1), GRAD_IN: ("g", i), GRAD_OUT: ("g", i + 1)}
        for kind, key, arg in events:
            key = names.get(key, key)
            if kind == ALLOC:
                malloc(key, arg)
            elif kind == FREE:
                free(key)
            else:
                live[names.get(arg, arg)] = live.pop(key)

    full, shifted = vocab * tokens, vocab * (tokens - batch)
    for _ in range(2):
        malloc(("x", 0), hidden * e)  # the embedding's output: the first block's input
        for i in range(layers):
            run(fwd, i)
        for key, size in (("logits", e * full), ("fp32", 4 * full), ("shifted", 4 * shifted * shift_copy),
                          ("log_softmax", 4 * shifted)):
            malloc(key, size, per_token=False)
        for key in ("fp32", "shifted", "logits"):
            free(key)
        for key, size, done in (("nll_grad", 4 * shifted, ()), ("lsm_grad", 4 * shifted, ("nll_grad", "log_softmax")),
                                ("slice_grad", 4 * full, ("lsm_grad",)), ("logits_grad", e * full, ("slice_grad",))):
            malloc(key, size, per_token=False)
            for k in done:
                free(k)
        malloc(("g", layers), hidden * e)
        free("logits_grad")
        free(("x", layers))
        for i in range(layers - 1, -1, -1):
            run(recompute, i)
            run(bwd, i)
            free(("x", i))
            free(("g", i + 1))  # CheckpointFunction.backward returns: its `args` go
        free(("g", 0))
    return Replay(alloc.peak_allocated, alloc.reserved, alloc.reserved_large)
