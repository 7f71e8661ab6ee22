"""FSDP1 under a reentrant checkpoint placed around each block's unit keeps every block's input and its
gradient until backward ends (JobFacts.fsdp1_keeps_block_inputs).

The first test runs the mechanism itself: real torch FullyShardedDataParallel over two gloo ranks on CPU,
frozen block units, torch.utils.checkpoint(use_reentrant=True) around each unit's call (as transformers
before 4.52 or 4.53 run `checkpoint(decoder_layer.__call__, ...)`) or inside the unit (a GradientCheckpointingLayer,
FSDP's checkpoint_wrapper). The rest derive podkit's term by hand and pin which jobs have it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from podkit.checks import stacks
from podkit.checks.memory import KEPT_INPUTS, estimate

WORKER = textwrap.dedent('''
    import gc, json, os, sys, weakref
    import torch, torch.distributed as dist, torch.nn as nn
    import torch.utils.checkpoint as ckpt
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    place, trains, out = sys.argv[1], sys.argv[2] == "trains", sys.argv[3]
    L, B, S, H = map(int, sys.argv[4:8])
    dist.init_process_group("gloo")
    torch.manual_seed(0)

    # Every leaf copy the reentrant checkpoint makes of a block's input (CheckpointFunction.backward calls
    # the module-level detach_variable): watched through weak references only.
    made = []
    detach = ckpt.detach_variable
    def watched(inputs):
        out_ = detach(inputs)
        made.extend(weakref.ref(t) for t in out_ if isinstance(t, torch.Tensor) and t.requires_grad)
        return out_
    ckpt.detach_variable = watched

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i
            self.lin = nn.Linear(H, H)
            self.lin.requires_grad_(trains)  # frozen: a LoRA base, the unit's flat parameter needs no gradient

        def body(self, x):
            y = self.lin(x)
            if torch.is_grad_enabled():  # the recompute, in backward: how many block units are gathered
                gathered.append(len(unsharded()))
                y.register_hook(lambda g: gathered.append(len(unsharded())))
            if self.i == 0 and torch.is_grad_enabled():  # fires inside block 0's backward
                y.register_hook(lambda g: snap("in the first block's backward"))
            return x + torch.tanh(y)

        def forward(self, x):
            return ckpt.checkpoint(self.body, x, use_reentrant=True) if place == "inside" else self.body(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(H, H)  # trains, so every block's input requires grad
            self.blocks = nn.ModuleList(Block(i) for i in range(L))

        def forward(self, x):
            x = self.proj(x)
            x.register_hook(lambda g: snap("first block done"))
            for b in self.blocks:
                saved.append(x.untyped_storage().data_ptr())  # the block input its checkpoint saves
                x = ckpt.checkpoint(b.__call__, x, use_reentrant=True) if place == "around" else b(x)
            return x

    seen, saved, gathered = {}, [], []
    def snap(moment):
        alive = [r() for r in made if r() is not None]
        seen[moment] = {"alive": len(alive), "with_grad": sum(t.grad is not None for t in alive),
                        "saved_storage": sum(t.untyped_storage().data_ptr() in saved for t in alive),
                        "bytes": sum(t.untyped_storage().nbytes() + (t.grad.untyped_storage().nbytes()
                                                                    if t.grad is not None else 0) for t in alive)}

    model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.device("cpu"), use_orig_params=False)
    units = [m for m in model.modules() if isinstance(m, FSDP) and m is not model]
    def unsharded():
        return [u for u in units if u._handle.flat_param._full_param_padded.untyped_storage().size() > 0]
    model(torch.randn(B, S, H)).sum().backward()
    snap("backward returned")
    seen["most blocks gathered in backward"] = max(gathered)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    # The FSDP model holds the process group: left alive until the interpreter exits, the group's destructor
    # ran in its teardown and, under a loaded suite, a rank aborted there ("terminate called without an active
    # exception", exit -6; 4 of 45 runs beside 4 busy processes, none of 50 with the model released first).
    del model, units
    gc.collect()
    # Both ranks past every collective before either tears gloo down.
    dist.barrier()
    dist.destroy_process_group()
''')


# Blocks, batch, sequence, hidden of the worker's model.
L, B, S, H = 4, 2, 8, 16


def _run(tmp_path, place, trains=False):
    script, out = tmp_path / "worker.py", tmp_path / f"{place}-{trains}.json"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), place, "trains" if trains else "frozen", str(out), *map(str, (L, B, S, H))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_fsdp1_keeps_each_recomputed_input_and_its_gradient_until_backward_ends(tmp_path):
    around, inside = _run(tmp_path, "around"), _run(tmp_path, "inside")
    # Inside the first block's backward, the moment podkit prices: every block's input copy is alive, each the
    # storage its checkpoint saved in the forward (detach shares it: no copy beyond the saved input), and all
    # but block 0's have their .grad (block 1's is the gradient now flowing into block 0).
    assert around["in the first block's backward"] == {"alive": L, "with_grad": L - 1, "saved_storage": L,
                                                       "bytes": (2 * L - 1) * B * S * H * 4}
    # Checkpoint around the unit: the recompute runs the unit's pre-forward on detach_variable's leaf copy,
    # whose AccumulateGrad the reshard-only hook's closure holds: when the first block's backward is done,
    # every block's input copy is alive with its .grad, fp32 here, L x (input + gradient).
    assert around["first block done"] == {"alive": L, "with_grad": L, "saved_storage": L,
                                          "bytes": L * 2 * B * S * H * 4}
    # _finalize_params removes the hooks when backward ends: then they go.
    assert around["backward returned"]["alive"] == 0
    # Checkpoint inside the unit: the unit's pre-forward ran in the outer forward on a non-leaf input, so
    # the copies die with each block's backward.
    assert inside["first block done"]["alive"] == 0
    assert inside["backward returned"]["alive"] == 0
    assert inside["in the first block's backward"]["alive"] == 1  # block 0's own, in use
    # Around the unit, each block is resharded before the previous block's recompute gathers it: one block
    # gathered at a time in backward (no two-block handoff, memory.py); inside, backward prefetch gathers two.
    assert around["most blocks gathered in backward"] == 1
    assert inside["most blocks gathered in backward"] == 2


def test_a_trained_block_unit_keeps_no_input_copies(tmp_path):
    """A full fine-tune: the unit's flat parameter needs a gradient, so FSDP1 hooks its AccumulateGrad instead
    of the unit's inputs, and each copy dies with its block's backward even with the checkpoint around it."""
    trained = _run(tmp_path, "around", trains=True)
    assert trained["in the first block's backward"]["alive"] == 1
    assert trained["first block done"]["alive"] == 0


# ---- podkit's term, derived by hand ----------------------------------------------------------------------

MISTRAL = 'preset = "mistral-7b"'  # hidden 4096, 32 layers
GPT2 = 'name = "g"\nhidden = 256\nlayers = 4\nheads = 4\nkv_heads = 4\nffn = 1024\nvocab = 1000\narch = "gpt2"'
FSDP_2GPUS = "gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'"


def _hf(job, transformers="4.48.1", model=MISTRAL, extra="", cluster=FSDP_2GPUS, stack="hf"):
    return job(model=model,
               train=f"stack = '{stack}'\nlora_rank = 16\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 1024\n"
                     f"checkpointing = 'full'\nattention = 'flash-attn'\ntransformers = '{transformers}'\n{extra}",
               cluster=cluster)


def _kept(est):
    return sum(p.bytes for p in est.phase_parts["backward-end"] if p.label == KEPT_INPUTS)


def test_the_first_blocks_backward_holds_the_other_inputs_and_all_but_one_gradient(job):
    j = _hf(job)
    assert j.facts.fsdp1_keeps_block_inputs
    T, H, L = 2 * 1024, 4096, 32
    # Blocks 1..31's inputs (bf16) and the gradients of blocks 2..31's: block 1's input gradient is the
    # first block's output gradient, which its backward already counts; block 0's input is its saved input.
    assert _kept(estimate(j)) == (31 + 30) * T * H * 2
    # Nothing else moves: 4.51.3 and 4.52.1 share the loss and the rest, but 4.52's Mistral layer checkpoints
    # inside the unit (GradientCheckpointingLayer); they differ at backward-end by that term and nowhere else.
    without, with_ = estimate(_hf(job, "4.52.1")), estimate(_hf(job, "4.51.3"))
    assert _kept(without) == 0
    assert with_.phase_allocated("backward-end") - without.phase_allocated("backward-end") == (2 * L - 3) * T * H * 2
    for phase in ("forward-end", "backward", "step"):
        assert with_.phase_allocated(phase) == without.phase_allocated(phase)


@pytest.mark.parametrize("transformers,model,kept", [
    ("4.48.1", MISTRAL, True),
    ("4.51.3", MISTRAL, True),
    ("4.52.1", MISTRAL, False),   # Mistral's layer checkpoints itself from 4.52.0
    ("4.52.1", 'preset = "mixtral-8x7b"', True),   # Mixtral's only from 4.53.0
    ("4.53.0", 'preset = "mixtral-8x7b"', False),
    ("5.0.0", MISTRAL, False),    # not reentrant by default (and inside the unit)
    ("4.53.0", 'preset = "deepseek-v2-lite"', True),   # the hub's own code until transformers builds it, 4.54.0
    ("4.54.0", 'preset = "deepseek-v2-lite"', False),
    ("4.52.1", GPT2, True),       # explicit dimensions built as GPT-2: its block checkpoints itself from 4.53.0
])
def test_which_transformers_releases_checkpoint_around_the_unit(job, transformers, model, kept):
    assert _hf(job, transformers, model=model).facts.fsdp1_keeps_block_inputs is kept


def test_only_a_frozen_unit_under_fsdp1_with_reentrant_block_checkpointing_keeps_them(job):
    assert not _hf(job, extra="torch = '2.0.1'").facts.fsdp1_keeps_block_inputs  # no reshard-only hook before 2.1
    assert _hf(job, extra="torch = '2.4.1'").facts.fsdp1_keeps_block_inputs
    full_ft = job(model=MISTRAL, train="stack = 'hf'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 1024\n"
                                       "checkpointing = 'full'\ntransformers = '4.48.1'", cluster=FSDP_2GPUS)
    assert not full_ft.facts.fsdp1_keeps_block_inputs  # a trained block unit gets the gradient hook instead
    assert not _hf(job, cluster="gpu = 'A100-80GB'").facts.fsdp1_keeps_block_inputs  # no FSDP
    assert not _hf(job, extra="", cluster=FSDP_2GPUS + "\nfsdp_version = 2").facts.fsdp1_keeps_block_inputs
    # fsdp_qlora applies FSDP's checkpoint_wrapper after wrapping: inside each unit.
    assert not _hf(job, stack="fsdp_qlora").facts.fsdp1_keeps_block_inputs
    # bin/smoke's replica shards with FSDP2, and says so where it matters.
    j = _hf(job)
    assert not j.as_replica().facts.fsdp1_keeps_block_inputs
    assert "checkpoint_around_unit" in [x.split(":")[0] for x in stacks.left_out(j.train, j.cluster, j.facts)]
    j = _hf(job, "4.52.1")
    assert "checkpoint_around_unit" not in [x.split(":")[0] for x in stacks.left_out(j.train, j.cluster, j.facts)]


def test_preflight_warns_with_the_kept_bytes_and_the_release_that_avoids_them(job):
    from podkit.checks.rules import fsdp1_kept_inputs

    j = _hf(job)
    r = fsdp1_kept_inputs(j, estimate(j))
    assert r.status == "warn" and f"{61 * 2048 * 4096 * 2 / 2**30:.1f} GiB" in r.message
    assert "train.transformers = '4.52.0'" in r.fix
    mixtral = _hf(job, model='preset = "mixtral-8x7b"')
    assert "train.transformers = '4.53.0'" in fsdp1_kept_inputs(mixtral, estimate(mixtral)).fix
    assert fsdp1_kept_inputs(_hf(job, "4.52.1"), estimate(_hf(job, "4.52.1"))).status == "skip"
    gpt2 = _hf(job, "4.52.1", model=GPT2)  # never told to move to the release it runs
    assert "train.transformers = '4.53.0'" in fsdp1_kept_inputs(gpt2, estimate(gpt2)).fix


def test_two_blocks_are_gathered_at_the_handoff_only_when_the_checkpoint_is_inside_the_unit(job):
    """Inside the unit, a block's pre-backward hook and the next block's reshard-only hook sit on one tensor, so
    the next block is still gathered when this one gathers for backward; around it, the recompute hooks the
    next block's leaf copy instead, which is resharded before the previous block's recompute begins."""
    def gathered_in_backward(transformers):
        j = job(model=MISTRAL, cluster=FSDP_2GPUS,  # 128 tokens: a unit outweighs a block's activations
                train=f"stack = 'hf'\nlora_rank = 16\nprecision = 'bf16'\nmicro_batch = 1\nseq_len = 128\n"
                      f"checkpointing = 'full'\nattention = 'flash-attn'\ntransformers = '{transformers}'")
        est = estimate(j)
        return [p for p in est.phase_parts["backward"] if p.label == "unsharded weights being used"]

    inside, around = gathered_in_backward("4.52.1"), gathered_in_backward("4.48.1")
    assert [p.formula.startswith("the block being gathered for backward") for p in inside] == [True]
    assert not any(p.formula.startswith("the block being gathered") for p in around)


# ---------------------------------------------------------------- where the kept gradients land


def test_autograd_sums_out_of_place_into_a_gradient_something_else_holds():
    """The rule the replay rests on (torch/csrc/autograd/input_buffer.cpp accumulate: in place only into a buffer
    whose last reference it holds), on real torch: a residual block's output gradient reaches the residual sum h
    itself (AddBackward hands it on) and the branch's gradient is added to it there. A later block's kept input
    holds it (FSDP1), and so does a reentrant checkpoint's backward (its `args`) while the block's inner backward
    runs; a non-reentrant checkpoint's recompute does not."""
    import torch
    import torch.utils.checkpoint as ckpt

    def body(x):
        h = x + torch.tanh(x)
        return h, h + torch.sin(h)

    def h_grad_is_the_output_grad(hold: bool = False, checkpoint: str = "") -> bool:
        x = torch.randn(64, 64, requires_grad=True)
        ptr, held = {}, []

        def block(x):
            h, out = body(x)
            if torch.is_grad_enabled():
                h.register_hook(lambda g: ptr.__setitem__("h", g.data_ptr()))
            return out

        def on_out(g):
            ptr["out"] = g.data_ptr()
            if hold:  # as a later block's kept input holds it as its .grad
                held.append(g)

        out = ckpt.checkpoint(block, x, use_reentrant=checkpoint == "reentrant") if checkpoint else block(x)
        out.register_hook(on_out)
        (out * 2).sum().backward()
        return ptr["out"] == ptr["h"]

    assert h_grad_is_the_output_grad()  # summed in place: one buffer runs through the block
    assert not h_grad_is_the_output_grad(hold=True)  # held elsewhere: `old_var + var`, a new buffer
    assert not h_grad_is_the_output_grad(checkpoint="reentrant")
    assert h_grad_is_the_output_grad(checkpoint="non-reentrant")


def test_a_block_whose_output_gradient_is_held_makes_its_input_gradient_anew(job):
    from podkit.checks import activations as A

    j = job(model='preset = "mistral-7b"', cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'",
            train="stack = 'hf'\ntransformers = '4.48.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
                  "checkpointing = 'full'\nattention = 'flash-attn'\nlora_rank = 16\nlora_targets = ['q_proj', 'v_proj']")
    tr, x_in = A._walk_block(A.block_facts(j))
    stream = j.shape.hidden * 2  # bf16 residual stream, bytes per token

    def net(events):
        """Bytes per token alive when the block's backward is done: the output gradient, the saved tensors it
        starts with (each freed by its first saver), and what the events allocate."""
        size = {A.GRAD_OUT: stream, **{k: t.bytes for k, t in {**tr.ctx_kept, **tr.saved}.items()}}
        for kind, key, arg in events:
            if kind == A.ALLOC:
                size[key] = arg
            elif kind == A.FREE:
                del size[key]
            else:
                size[arg] = size.pop(key)
        return sum(size.values()) - sum(t.bytes for t in tr.ctx_kept.values())

    plain, grads = A.backward_events(tr)
    pinned, pinned_grads = A.backward_events(tr, pinned_out=True)
    # In place, the output's gradient becomes the input's (the residual path): one buffer alive at the end.
    assert grads[id(x_in)] == A.GRAD_OUT and net(plain) == stream
    # Held elsewhere, it is never freed here, and the post-attention residual's sum is a new buffer, which the
    # attention residual then carries to the input. Engine order (engine.cpp evaluate_function): the node's
    # gradient of the same size is made, the node's incoming gradients and saved tensors go, then
    # accumulate's `old_var + var`, then var.
    assert all(key != A.GRAD_OUT for _, key, _ in pinned)
    new = pinned_grads[id(x_in)]
    at = next(k for k, ev in enumerate(pinned) if ev[:2] == (A.ALLOC, new))
    var = next(ev[1] for ev in reversed(pinned[:at]) if ev[0] == A.ALLOC)
    assert var[0] == "sum" and pinned[at][2] == stream
    assert pinned[at + 1] == (A.FREE, var, 0)
    assert any(ev[0] == A.FREE for ev in pinned[pinned.index((A.ALLOC, var, stream)):at])
    assert net(pinned) == 2 * stream


def test_fsdp1_replay_holds_every_input_and_gradient_until_backward_ends(job):
    from podkit.checks import fsdp1, step_replay
    from podkit.checks import activations as A
    from podkit.checks.allocator import CachingAllocator, block_bytes

    j = job(model='preset = "mistral-7b"', cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'",
            train="stack = 'hf'\ntransformers = '4.48.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
                  "checkpointing = 'full'\nattention = 'flash-attn'\nlora_rank = 16")
    assert j.facts.fsdp1_keeps_block_inputs and j.facts.reentrant
    s, T, L = j.shape, 8192, j.shape.layers
    block = step_replay.backward_replay(A.block_facts(j), True)
    for kept in (True, False):
        names: dict = {}
        events = fsdp1.forward_events(s, T, 2, frozenset(), False, 4, True, "fp32-upcast-shifted", True, names, batch=2)
        events += fsdp1.backward_events(names, s, T, 2, block, kept)
        ends = len(events) - (2 * L if kept else 1)  # the frees when backward ends
        live: dict = {}
        alloc = fsdp1.replay(events[:ends], CachingAllocator(), live)
        # Kept: every block's input and its gradient, 2 x L x T x hidden x 2 B; else block 0's input gradient.
        assert sum(map(block_bytes, live.values())) == (2 * L if kept else 1) * T * s.hidden * 2
        fsdp1.replay(events[ends:], alloc, live)
        assert not live and alloc.allocated == 0


def test_an_in_place_norm_under_a_reentrant_checkpoint_sums_out_of_place(job):
    """Liger's in-place RMSNorm backward writes dX into dY, and the replay handed that aliased gradient on as
    the block input's, skipping the sum into the gradient the input already had (the residual's, which is the
    held output gradient): a rename the kept-inputs cleanup did not expect, so a KeyError and a traceback from
    bin/preflight for hf LoRA jobs with Liger's kernels under FSDP1 before transformers 4.52 (fuzzing,
    2026-11-24). autograd sums out of place into a gradient something else holds (input_buffer.cpp
    accumulate; reentrant: CheckpointFunction.backward's `args`), so the block makes its input's gradient
    anew, as without Liger (test_a_block_whose_output_gradient_is_held_makes_its_input_gradient_anew)."""
    from podkit.checks import fsdp1, step_replay
    from podkit.checks import activations as A
    from podkit.checks.allocator import CachingAllocator

    j = job(model='preset = "tiny"', cluster="gpus_per_node = 2\nsharding = 'zero3'",
            train="stack = 'hf'\ntransformers = '4.37.2'\nlora_rank = 4\nblock_kernels = 'liger'\n"
                  "checkpointing = 'full'")
    assert j.facts.fsdp1_keeps_block_inputs and j.facts.reentrant
    block = step_replay.backward_replay(A.block_facts(j), j.facts.reentrant)
    assert not any(kind == A.RENAME and key == A.GRAD_OUT for kind, key, _ in block[1])
    names: dict = {}
    s, T = j.shape, 1024
    events = fsdp1.forward_events(s, T, 2, frozenset(), False, 4, False, "fp32-upcast", True, names, batch=1)
    events += fsdp1.backward_events(names, s, T, 2, block, kept=True)
    live: dict = {}
    alloc = fsdp1.replay(events, CachingAllocator(), live)
    assert not live and alloc.allocated == 0
    est = estimate(j)
    assert est.phase_allocated(est.peak_phase) <= est.reserved
