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
- the final norm, the head's bf16 logits and the release's loss in its order (head_events): the model's own
  (<= 4.45), ForCausalLMLoss with a shifted copy (4.46-4.48) or without (4.49 on);
  its backward: nll_loss's zeros, log_softmax's input gradient, SliceBackward0's full-size zeros where it sliced,
  ToCopyBackward0's 16-bit gradient, then the head's input gradient;
- each block in reverse: its recompute (the forward again, its saved tensors kept), then its backward as
  activations.backward_events orders it (engine.cpp), its input and its output gradient (which the reentrant
  checkpoint's backward holds, so the block sums into it out of place) released at the end.
Scope, where this order is the one the code runs: one GPU (no sharding, no offload), per-block reentrant
checkpointing (transformers < 5.0), those losses, a frozen base (LoRA/QLoRA: AdamW's states are made once, in the first step; the
adapters' gradients are left out, small-pool blocks while r x hidden x 4 B <= 1 MiB), and blocks all dense or all
MoE. Elsewhere `segments` returns None and memory.py keeps its closed-form pool terms.

MoE blocks whose routed experts are nn.Linear modules run them in a loop (transformers 4.x
MixtralSparseMoeBlock.forward: `for expert_idx in range(self.num_experts)`, each over the rows `torch.where`
routed to it), so each expert's tensors are as large as its share of the tokens, which the router decides. Even
shares would make every expert's tensors the same size, each reusing the blocks the one before freed; an expert
with more rows than the one before finds no freed block large enough and splits a bigger one or takes a new
segment. How many rows each expert gets, and in which order, is the data's: over ten random routings of a balanced
router, two steps of a Mixtral QLoRA on one GPU (micro-batch 4 x 4096) reserve 17.5-18.8 GiB (median 18.2) for
their activations and loss, against 16.8 GiB with even shares (benchmarks/moe_routing.py). The replay routes every
MoE block the same way (`routed_tokens`): a balanced router's expected counts, each expert given more rows than the
one before, the order in which best fit reuses none of the previous expert's blocks (18.3 GiB there, near the
random routings' median). A loop over more than `MAX_EXPERT_RUNS` experts x layers is left to the closed form:
its events would cost preflight seconds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from podkit.checks import activations as A
from podkit.checks.allocator import CachingAllocator, replay


def applies(job) -> bool:
    f, t, c = job.facts, job.train, job.cluster
    return (f.stack.name == "hf" and not f.fsdp and not f.offloaded and c.sharding == "none"
            and c.gpus_per_node * c.nodes == 1 and f.ac_policy == "block" and f.reentrant
            and f.loss in ("fp32-upcast-shifted", "fp32-upcast", "compute-shifted") and f.lora and blocks_replayable(job)
            and f.block_kernels == "torch" and not f.quant_saves_input and t.compute_bytes != 4)


# A Mixtral-8x7B block loop (8 experts x 32 layers) replays in about 0.2 s on a 2-core machine; the events grow
# with experts x layers.
MAX_EXPERT_RUNS = 8 * 32


def blocks_replayable(job) -> bool:
    """All blocks dense, or all MoE with their experts as 3-D banks or a loop short enough to replay (this
    replay and FSDP1's, checks/fsdp1.py)."""
    s = job.shape
    if s.moe is None:
        return True
    return s.moe.dense_layers == 0 and (not s.expert_linears or s.moe.experts * s.layers <= MAX_EXPERT_RUNS)


def routed_tokens(tokens: int, experts: int, top_k: int) -> tuple[int, ...]:
    """Rows each routed expert of a loop gets, in loop order: a balanced router's (each expert one of a token's
    top_k with probability p = top_k / experts: binomial counts, mean tokens x p, variance tokens x p x (1 - p))
    expected order statistics (Blom's normal approximation, (j + 1/2) / experts quantiles), smallest first,
    their sum made tokens x top_k."""
    from statistics import NormalDist  # here: only a MoE job pays for importing statistics

    p = top_k / experts
    mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
    counts = [min(tokens, max(0, round(mean + sd * NormalDist().inv_cdf((j + 0.5) / experts))))
              for j in range(experts)]
    counts[experts // 2] += tokens * top_k - sum(counts)  # the quantiles are symmetric: rounding only
    return tuple(counts)


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
    bf = A.main_block_facts(job, device)
    tokens = t.micro_batch * t.seq_len
    # The attention masks the model builds after the embedding (stacks.AttentionMask): a reentrant checkpoint keeps
    # them as every block's input, to the first block's backward (4.38-4.52) or to the graph's end (4.53+'s keyword).
    mask = int(sum(m.shared_bytes_per_token(t.seq_len, t.micro_batch, shape.rope_positions)
                   for m in job.facts.masks) * tokens)
    return _replay(bf, shape.layers, shape.vocab, shape.hidden, t.compute_bytes, t.micro_batch,
                   tokens, A.shifted_copy_bytes(job) > 0, block_routing(job, bf), head_loss(job.facts),
                   job.facts.loss_upcast, mask, job.facts.logit_softcap > 0)


def head_loss(f) -> str:
    """The loss as head_events orders it: the job's, or fp32-model-upcast where the model computes it
    (JobFacts.loss_in_model)."""
    return "fp32-model-upcast" if f.loss_in_model else f.loss


def block_routing(job, bf: A.BlockFacts) -> tuple | None:
    """Per block, each routed expert's rows in one micro-batch (routed_tokens) where the experts run in a loop
    (`bf.expert_loop`), as _scaled takes them; None otherwise. Every block is routed alike."""
    if not bf.expert_loop:
        return None
    m, tokens = job.shape.moe, job.train.micro_batch * job.train.seq_len
    return (routed_tokens(tokens, m.experts, m.top_k),) * job.shape.layers


ALLOC, FREE, RENAME, ALLOC_FIXED, GRAD_OUT = A.ALLOC, A.FREE, A.RENAME, A.ALLOC_FIXED, A.GRAD_OUT
# A block's input, its output (the checkpointed residual stream) and the input's gradient, by these names; the
# block's other tensors by id, as activations.backward_events keys them.
IN, OUT, GRAD_IN = "in", "out", "grad in"


class BlockWalk(NamedTuple):
    """A block's forward under no_grad, its recompute and its backward as allocator events (the kinds of
    activations.backward_events), recorded once per walk, and beside each event the routed expert (or -1) whose
    share of the tokens sizes it (activations.Trace.expert_of)."""

    forward: tuple
    recompute: tuple
    backward: tuple
    forward_experts: tuple
    recompute_experts: tuple
    backward_experts: tuple


@functools.lru_cache(maxsize=64)
def _block_walk(bf: A.BlockFacts, out_held: bool = True, weight_grads: bool = False) -> BlockWalk:
    """The block's events (a MoE block, `bf.moe`, walked with its MoE MLP). `out_held`: the output's gradient is
    held outside the block's graph (activations.backward_events pinned_out), as a reentrant checkpoint's backward
    holds it; the caller frees it after the block. `weight_grads`: the backward makes the trained weights'
    gradients too, which the caller frees (activations.backward_events)."""
    tr, x_in = A._walk_block(bf, bf.moe is not None)
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
            for t in {id(t): t for t in (*op.inputs, *op.holds, *op.saved)}.values():  # once each
                if last_use[id(t)] == j and t is not x_in and t is not tr.output \
                        and not (recompute and id(t) in tr.saved):
                    ev.append((FREE, name(t), 0))
        if recompute:
            ev.append((FREE, name(tr.output), 0))  # the recomputed output only carries the gradient back in
        return tuple(ev)

    owners: dict = {}

    def backward() -> tuple:
        ev, grads = A.backward_events(tr, out_held, weight_grads, owners)
        # The block input stays alive through its backward (the reentrant checkpoint's detached input holds
        # it); _replay frees it after. Its gradient becomes the previous block's output gradient.
        return tuple(x for x in ev if x[1] != id(x_in)) + ((RENAME, grads[id(x_in)], GRAD_IN),)

    def expert(kind, key) -> int:
        if kind != ALLOC:
            return -1
        if isinstance(key, tuple) and key[0] == "sum":  # ("sum", op, tensor id)
            key = key[2]
        elif isinstance(key, tuple) and key[0] == "scratch":  # ("scratch", op)
            key = ("op", key[1])
        return tr.expert_of.get(owners.get(key, key), -1)

    lists = forward(False), forward(True), backward()
    return BlockWalk(*lists, *(tuple(expert(kind, key) for kind, key, _ in ev) for ev in lists))


def backward_replay(bf: A.BlockFacts, reentrant: bool, weight_grads: bool = False) -> tuple[tuple, tuple, bool]:
    """A checkpointed block's recompute and backward as events, and whether its output's gradient is held
    outside it (a reentrant checkpoint: CheckpointFunction.backward holds its `args` through the inner
    backward, so the block sums into it out of place and the caller frees it after the block): what
    backward_events replays of each block. `weight_grads`: as for _block_walk."""
    walk = _block_walk(bf, reentrant, weight_grads)
    return walk.recompute, walk.backward, reentrant


def backward_experts(bf: A.BlockFacts, reentrant: bool, weight_grads: bool = False) -> tuple:
    """Beside each of backward_replay's recompute and backward events, the routed expert (or -1) whose rows size
    it (_block_walk): backward_events' `experts`."""
    walk = _block_walk(bf, reentrant, weight_grads)
    return walk.recompute_experts + walk.backward_experts


def forward_events(bf: A.BlockFacts, i: int, x_in, x_out, tokens: int, zero: set, rows: tuple | None = None) -> list:
    """Block i's forward under no_grad (a reentrant checkpoint's first pass) at `tokens`, as allocator.replay
    events from its input's key `x_in` to its output's `x_out`, which stays alive; `zero` and `rows` as _scaled
    takes them."""
    walk = _block_walk(bf, True)
    return _scaled(walk.forward, i, {IN: x_in, OUT: x_out}, tokens, zero, walk.forward_experts, rows)


def _scaled(events: tuple, i: int, keys: dict, tokens: int, zero: set, experts: tuple = (),
            rows: tuple | None = None) -> list[tuple]:
    """Block i's per-token events (activations.backward_events' kinds) at `tokens`, as allocator.replay takes
    them: IN, OUT, GRAD_IN and GRAD_OUT by `keys`, the block's own tensors by (i, key); a tensor of no bytes (a
    view, an in-place result) is neither allocated nor freed. `rows`: the tokens each routed expert gets in this
    block (routed_tokens), for the events `experts` (_block_walk) gives an expert: sized by its rows, not the
    even share the walk priced."""
    out = []
    for kind, key, arg in _sized(events, tokens, experts, rows):
        k = keys.get(key, (i, key))
        if kind == ALLOC_FIXED:
            out.append(("a", k, arg))
        elif kind == ALLOC:
            if arg > 0:
                out.append(("a", k, arg))
            else:
                zero.add(k)
        elif kind == FREE:
            if k in zero:
                zero.discard(k)
            else:
                out.append(("f", k))
        else:
            new = keys.get(arg, (i, arg))
            if k in zero:
                zero.discard(k)
                zero.add(new)
            else:
                out.append(("r", k, new))
    return out


@functools.lru_cache(maxsize=256)
def _sized(events: tuple, tokens: int, experts: tuple, rows: tuple | None) -> tuple:
    """`events` with each allocation's per-token bytes made bytes at `tokens` (_scaled), once for all the blocks
    that share them."""
    even = sum(rows) / len(rows) if rows else 0.0  # tokens x top_k / experts
    out = []
    for j, (kind, key, arg) in enumerate(events):
        if kind == ALLOC:
            arg = arg * tokens * (rows[experts[j]] / even if rows and experts[j] >= 0 else 1)
        out.append((kind, key, int(arg) if kind in (ALLOC, ALLOC_FIXED) else arg))
    return tuple(out)


def head_events(tokens: int, batch: int, vocab: int, hidden: int, e: int, loss: str, shift_copy: bool,
                lsm: int = 4, norm_trains: bool = False, amp: bool = False,
                softcap: bool = False) -> tuple[list[tuple], dict]:
    """The final norm, the head and the loss's forward, then backward through the loss to log_softmax's input
    gradient (the loss's peak), as allocator.replay events, after the last block's output: for this replay and
    FSDP1's (checks/fsdp1.py). transformers' LlamaRMSNorm (4.39-4.48) runs with grad: `hidden_states.to(float32)`
    (saved by pow and mul until the norm's backward, which runs with the head's), its pow, the normalised fp32
    product, its cast back, then `weight * ...` (the cast saved only when the weight trains, `norm_trains`); the
    norm's output lives until the model's forward returns (its `hidden_states` local and `outputs`), or, when the
    head's weight trains too (`norm_trains`: a full fine-tune), until the head's backward, whose MmBackward0 saves
    it. loss:
      fp32-logits-kept     transformers <= 4.45 (`logits = logits.float()` in the model, kept in the output by the
                           loop until the step ends: fsdp_qlora train.py), a shifted .contiguous() copy, log_softmax;
      fp32-model-upcast    the same under the HF Trainer (JobFacts.loss_in_model): compute_loss returns the loss
                           alone, so `outputs` and its fp32 logits go before backward (4.45.2 trainer.py
                           training_step: `loss = self.compute_loss(model, inputs)`, then accelerator.backward);
      fp32-upcast-shifted  4.46-4.48 loss_utils ForCausalLMLoss: the loss upcasts the 16-bit logits and shifts a
                           .contiguous() copy of them; both die with the loss function, the 16-bit logits when
                           compute_loss returns (the Trainer drops `outputs`);
      fp32-upcast          >= 4.49: the same without the shifted copy (the labels are shifted by padding), so
                           log_softmax spans every position;
      compute-shifted      transformers < 4.49 GPT-2: a shifted .contiguous() copy of the compute-dtype logits and
                           CrossEntropyLoss on it, which CUDA runs as nll_loss(log_softmax(x, dim, x.dtype))
                           (aten LossNLL.cpp cross_entropy_loss; it is on no CUDA autocast list): log_softmax in
                           the compute dtype and, under autocast (`amp`: accelerate's native AMP), nll_loss's fp32
                           cast of it (autocast_mode.h AT_FORALL_FP32), both saved; native AMP then makes the
                           forward's outputs fp32 (accelerate convert_outputs_to_fp32), an fp32 copy of the
                           logits until compute_loss returns. Its backward casts back before log_softmax's.
    A shifted loss works on batch x (seq - 1) positions; `shift_copy`: the slice is copied (not at micro-batch 1:
    activations.shifted_copy_bytes). `lsm`: the log-softmax dtype's bytes. Returns the events and what
    backward_events continues from: "loss" (nll_loss's gradient, log_softmax's output, its input gradient),
    "head_frees", "sliced", "logits" (the fp32 logits a loop keeps to the step's end, or None) and "cast_back"
    (log_softmax's input gradient is fp32 and is cast back to the compute dtype after the slice's backward)."""
    h, full = hidden * tokens, vocab * tokens
    shifted = vocab * (tokens - batch) if loss != "fp32-upcast" else full
    ev = [("a", "norm fp32 input", 4 * h), ("a", "norm pow", 4 * h), ("f", "norm pow"),
          ("a", "norm product", 4 * h), ("a", "norm cast", e * h), ("f", "norm product"),
          ("a", "norm output", e * h)] + ([] if norm_trains else [("f", "norm cast")])
    ev += [("a", "logits", e * full)]
    if softcap:
        # The model's logit soft-cap (JobFacts.logit_softcap): the quotient, tanh's output (saved for its backward:
        # backward_events frees it) and the product, each made before the one before it dies; the product is the
        # logits the loss sees.
        ev += [("a", "cap quotient", e * full), ("f", "logits"), ("a", "cap tanh", e * full), ("f", "cap quotient"),
               ("a", "logits", e * full)]
    kept = None
    if loss in ("fp32-logits-kept", "fp32-model-upcast"):
        kept = "fp32 logits"
        ev += [("a", kept, 4 * full), ("f", "logits")]
        ev += [("a", "shifted", 4 * shifted)] if shift_copy else []
        ev += [("a", "log_softmax", lsm * shifted)] + ([("f", "shifted")] if shift_copy else [])
        ev += [] if norm_trains else [("f", "norm output")]
        if loss == "fp32-model-upcast":
            ev.append(("f", kept))
            kept = None
    elif loss == "compute-shifted":
        ev += [("a", "shifted", e * shifted)] if shift_copy else []
        ev += [("a", "log_softmax", e * shifted)] + ([("a", "nll cast", 4 * shifted)] if amp else [])
        ev += [("f", "shifted")] if shift_copy else []  # the forward returns
        ev += [("a", "fp32 outputs", 4 * full)] if amp else []
        ev += ([] if norm_trains else [("f", "norm output")]) + [("f", "logits")]
        ev += [("f", "fp32 outputs")] if amp else []  # compute_loss returns
        # NllLossBackward0's gradient (fp32 under autocast; then its saved cast goes and ToCopyBackward0 casts it
        # back), and LogSoftmaxBackward0's input gradient, in the compute dtype
        ev += ([("a", "nll grad fp32", 4 * shifted), ("f", "nll cast"), ("a", "nll_grad", e * shifted),
                ("f", "nll grad fp32")] if amp else [("a", "nll_grad", e * shifted)])
        ev += [("a", "lsm_grad", e * shifted)]
        frees = ("norm fp32 input",) + (("norm cast", "norm output") if norm_trains else ())
        return ev, {"loss": ("nll_grad", "log_softmax", "lsm_grad"), "head_frees": frees, "sliced": True,
                    "logits": None, "cast_back": False, "softcap": softcap}
    else:
        ev += [("a", "fp32", 4 * full)]
        copy = loss == "fp32-upcast-shifted" and shift_copy
        ev += [("a", "shifted", 4 * shifted)] if copy else []
        ev += [("a", "log_softmax", lsm * shifted), ("f", "fp32")] + ([("f", "shifted")] if copy else [])
        ev += ([] if norm_trains else [("f", "norm output")]) + [("f", "logits")]
    ev += [("a", "nll_grad", lsm * shifted), ("a", "lsm_grad", lsm * shifted)]
    frees = ("norm fp32 input",) + (("norm cast", "norm output") if norm_trains else ())
    return ev, {"loss": ("nll_grad", "log_softmax", "lsm_grad"), "head_frees": frees,
                "sliced": loss != "fp32-upcast", "logits": kept, "cast_back": True, "softcap": softcap}


def backward_events(inputs: list, loss_live: tuple, tokens: int, vocab: int, hidden: int, e: int, sliced: bool,
                    block: tuple[tuple, tuple, bool], kept: bool = False, head_frees: tuple = (),
                    unit_grad: int = 0, root_grads: tuple[int, int, int] = (0, 0, 0), tied: bool = False,
                    around_unit: bool = True, experts: tuple = (), routing: tuple | None = None,
                    cast_back: bool = True, softcap: bool = False) -> list[tuple]:
    """A step from log_softmax's backward peak to the end of backward, as allocator.replay events, for this
    replay and FSDP1's (checks/fsdp1.py). `inputs`: the keys of the embedding's output and of each block's
    output (L + 1); `loss_live`: nll_loss's gradient, log_softmax's output and log_softmax's input gradient
    (just made). Then: SliceBackward0's full-size zeros where the loss shifted a slice (`sliced`), the slice
    copied in; ToCopyBackward0's 16-bit gradient of the logits (`cast_back`: head_events'; else the gradient is
    already in the compute dtype); through the logit soft-cap where head_events made one (`softcap`); the head's
    input gradient, the last block's
    output gradient (`head_frees`: what the final norm and the head saved, freed with the logits' gradient; the
    norm's own backward temporaries are left out); each block in reverse, its recompute and its backward
    (`block`: backward_replay's), after which its input dies, and a held output gradient too, unless FSDP1 keeps
    the inputs (`kept`: JobFacts.fsdp1_keeps_block_inputs: every block's input and its gradient, which a later
    block's kept input holds as its .grad, live until backward ends).

    FSDP1 full fine-tune (`block` from backward_replay with weight_grads; `unit_grad`: the bytes of a block's flat
    gradient): a unit's weights are views of its flat parameter, so their gradients wait in the input buffer of
    the views' backward until the unit's backward ends; split_with_sizes_backward then concatenates them into one
    flat gradient (at::cat) and they go; AccumulateGrad makes it flat_param.grad, and _post_backward_hook
    (torch/distributed/fsdp/_runtime_utils.py) reduce-scatters it on the post-backward stream and drops it after
    _no_dispatch_record_stream, so its block is reusable only once that reduce-scatter has run (the allocator's
    process_events). When that is depends on how far the host runs ahead of the GPU, which limit_all_gathers
    bounds: _unshard waits for the free event of the second-last reshard (_limiter_utils.py, 2 all-gathers in
    flight). Under a reentrant checkpoint around the unit (`around_unit`: JobFacts.fsdp1_checkpoint_around_unit)
    each block is gathered twice in backward and none is prefetched, so the host issues block j once the GPU has
    finished block j + 1's part: block k's flat gradient is reusable from block k - 2's backward on. Otherwise
    BACKWARD_PRE prefetching lets the host issue block j once the GPU has finished block j + 2, just when block
    k's reduce-scatter starts at k - 2: reusable from block k - 3 on. Both take a GPU-bound step whose
    reduce-scatter of a block is shorter than a block's backward, and no memory pressure (a cudaMalloc that fails
    makes the allocator wait for pending events and reuse their blocks instead). `root_grads`: the root unit's
    head weight gradient (made with the head's backward), the embedding's dense gradient (embedding_dense_backward,
    after the first block) and the root's flat gradient, concatenated from them when backward ends; `tied`: the
    head and the embedding share one weight, whose two gradients autograd sums out of place first
    (input_buffer.cpp: the head's is not stealable). `experts` (beside `block`'s recompute and backward events)
    and `routing` (per block, its rows as _scaled takes them) for a loop over routed experts."""
    nll_grad, log_probs, grad = loss_live
    head_grad, embedding_grad, root_flat = root_grads
    L = len(inputs) - 1
    ev: list[tuple] = [("f", nll_grad), ("f", log_probs)]
    if sliced:
        ev += [("a", "slice grad", (4 if cast_back else e) * vocab * tokens), ("f", grad)]
        grad = "slice grad"
    if cast_back:
        ev += [("a", "logits grad", e * vocab * tokens), ("f", grad)]
        grad = "logits grad"
    if softcap:
        # MulBackward0 and DivBackward0 by a number and TanhBackward0 each make a new gradient before their input
        # gradient goes; the engine releases TanhBackward0's saved output after the call (engine.cpp
        # evaluate_function: call_function, then release_variables).
        n = e * vocab * tokens
        ev += [("a", "cap grad mul", n), ("f", grad), ("a", "cap grad tanh", n), ("f", "cap grad mul"),
               ("f", "cap tanh"), ("a", "cap grad div", n), ("f", "cap grad tanh")]
        grad = "cap grad div"
    # MmBackward0 computes mat2's (the weight's) gradient before self's (torchgen load_derivatives.py emits the
    # formulas in sorted order).
    ev += [("a", "head weight grad", head_grad)] if head_grad else []
    ev += [("a", ("g", L), e * hidden * tokens), ("f", grad), *[("f", k) for k in head_frees],
           ("f", inputs[L])]
    recompute, bwd, out_held = block
    # A held output gradient the block does not pass on as its input's (renamed): freed after the block.
    free_out = out_held and not any(kind == RENAME and key == GRAD_OUT for kind, key, _ in bwd)
    weight_grads = [key for kind, key, _ in bwd if kind == ALLOC_FIXED]
    pending: list = []  # flat gradients whose reduce-scatter may still run
    lag = 2 if around_unit else 3
    zero: set = set()
    for i in range(L - 1, -1, -1):
        if len(pending) == lag:
            ev.append(("f", pending.pop(0)))
        ev += _scaled(recompute + bwd, i, {IN: inputs[i], GRAD_OUT: ("g", i + 1), GRAD_IN: ("g", i)}, tokens, zero,
                      experts, routing[i] if routing else None)
        if weight_grads:
            ev += [("a", (i, "flat grad"), unit_grad), *[("f", (i, key)) for key in weight_grads]]
            pending.append((i, "flat grad"))
        if not kept:
            ev.append(("f", inputs[i]))
        if free_out and not (kept and i < L - 1):
            ev.append(("f", ("g", i + 1)))  # CheckpointFunction.backward returns: its `args` go
    ev += [("a", "embedding grad", embedding_grad)] if embedding_grad else []
    ev.append(("f", ("g", 0)))
    root = [k for k, n in (("head weight grad", head_grad), ("embedding grad", embedding_grad)) if n]
    if tied and len(root) == 2:
        ev += [("a", "tied weight grad", embedding_grad), *[("f", k) for k in root]]
        root = ["tied weight grad"]
    ev += [("a", "root flat grad", root_flat)] if root_flat else []
    ev += [("f", k) for k in root] + ([("f", "root flat grad")] if root_flat else [])
    ev += [("f", k) for k in pending]
    if kept:
        ev += [("f", x) for x in inputs[:L]] + [("f", ("g", i)) for i in range(1, L)]
    return ev


@functools.lru_cache(maxsize=64)
def _replay(bf: A.BlockFacts, layers: int, vocab: int, hidden: int, e: int, batch: int, tokens: int,
            shift_copy: bool = True, routing: tuple | None = None, loss: str = "fp32-upcast-shifted",
            amp: bool = False, mask: int = 0, softcap: bool = False) -> Replay:
    """Two steps; `routing`: per block, each routed expert's rows (routed_tokens) where the experts run in a loop,
    else None; both steps route alike; `loss` and `amp` as head_events takes them; `mask`: the bytes of the
    attention mask built after the embedding and kept through the step."""
    # reentrant (applies): each output gradient held
    recompute, bwd, _ = backward_replay(bf, True)
    zero: set = set()
    step = [("a", ("x", 0), hidden * e * tokens)]  # the embedding's output: the first block's input
    if mask:
        step.append(("a", ("mask",), mask))
    for i in range(layers):
        step += forward_events(bf, i, ("x", i), ("x", i + 1), tokens, zero, routing[i] if routing else None)
    head, names = head_events(tokens, batch, vocab, hidden, e, loss, shift_copy, amp=amp, softcap=softcap)
    step += head + backward_events([("x", i) for i in range(layers + 1)], names["loss"], tokens, vocab, hidden, e,
                                   names["sliced"], (recompute, bwd, True), head_frees=names["head_frees"],
                                   experts=backward_experts(bf, True), routing=routing, cast_back=names["cast_back"],
                                   softcap=softcap)
    if mask:
        step.append(("f", ("mask",)))
    alloc = CachingAllocator()
    for _ in range(2):
        replay(step, alloc)
    return Replay(alloc.peak_allocated, alloc.reserved, alloc.reserved_large)
