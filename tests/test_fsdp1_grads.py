"""An FSDP1 full fine-tune's weight gradients in backward (step_replay.backward_events' unit_grad, root_grads).

FSDP1 gives a unit's modules views of its flat parameter (torch/distributed/fsdp/_flat_param.py
_get_unflat_views_aligned: torch.split, then .view), so autograd hands every weight's gradient to the views'
backward, which concatenates them into the flat gradient while they are all alive. The first test runs that
autograd mechanism on real torch; the others hold podkit's events to it and to the reduce-scatter's delayed
free, derived by hand.
"""

import pytest
import torch

from podkit.checks import activations as A
from podkit.checks import fsdp1, step_replay
from podkit.checks.memory import _fsdp1_units
from podkit.train.memprobe import TensorCounter

FULL_FSDP1 = dict(model='preset = "mistral-7b"', cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'",
                  train="stack = 'hf'\ntransformers = '4.48.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
                        "checkpointing = 'full'\nattention = 'flash-attn'")


def _backward_peak(flat_views: bool) -> int:
    """Live bytes a three-matmul chain's backward adds at its peak, with its weights as separate parameters or
    as views of one flat parameter."""
    torch.manual_seed(0)
    shapes = [(256, 128), (384, 256), (128, 384)]
    sizes = [a * b for a, b in shapes]
    counter = TensorCounter()
    counter.switch_on()
    try:
        if flat_views:
            flat = torch.zeros(sum(sizes), requires_grad=True)
            weights = [v.view(s) for v, s in zip(torch.split(flat, sizes), shapes)]
        else:
            weights = [torch.zeros(s, requires_grad=True) for s in shapes]
        h = torch.randn(1, 128)
        for w in weights:
            h = torch.tanh(h @ w.t())
        loss = h.sum()
        counter.reset_peak()
        base = counter.allocated()
        loss.backward()
        return counter.window_peak() - base
    finally:
        counter.switch_off()


def test_views_of_a_flat_parameter_hold_every_weight_gradient_until_their_concatenation():
    flat_bytes = 4 * (256 * 128 + 384 * 256 + 128 * 384)
    separate, views = _backward_peak(False), _backward_peak(True)
    # Separate parameters: each gradient becomes its .grad, once: the weights' bytes (give or take the one
    # token's activations and their gradients, a few KiB). Views: split_with_sizes_backward's at::cat makes the
    # flat gradient while the three weight gradients it concatenates are still alive: twice the weights' bytes.
    assert abs(separate - flat_bytes) < 8 * 1024
    assert abs(views - 2 * flat_bytes) < 8 * 1024
    assert abs(views - separate - flat_bytes) < 4 * 1024


def _events(job, transformers: str = "4.48.1"):
    j = job(**{**FULL_FSDP1, "train": FULL_FSDP1["train"].replace("4.48.1", transformers)})
    s, T, e = j.shape, 2 * 4096, 2
    units = _fsdp1_units(j, e)
    block = step_replay.backward_replay(A.block_facts(j), True, weight_grads=True)
    names: dict = {}
    ev = fsdp1.forward_events(s, T, e, frozenset(), False, 4, True, "fp32-upcast-shifted", True, names, batch=2,
                              norm_trains=True)
    vocab_grad = s.vocab * s.hidden * e
    ev += fsdp1.backward_events(names, s, T, e, block, False, sum(units[0][0]),
                                (vocab_grad, vocab_grad, sum(units[-1][0])), j.facts.fsdp1_checkpoint_around_unit)
    return j, units, ev


@pytest.mark.parametrize("transformers, waits", [("4.48.1", 1), ("4.52.4", 2)])
def test_each_block_concatenates_its_weight_gradients_and_frees_them(job, transformers, waits):
    j, units, ev = _events(job, transformers)
    s = j.shape
    # transformers < 4.52 checkpoints around the FSDP1 unit (each block gathered twice, none prefetched): a flat
    # gradient waits one block; 4.52's GradientCheckpointingLayer checkpoints inside it, BACKWARD_PRE prefetch
    # runs the host a block further ahead: two.
    assert j.facts.fsdp1_checkpoint_around_unit == (waits == 1)
    # Mistral 7B's block by hand: q and o 4096 x 4096, k and v 4096 x 1024, gate, up and down 4096 x 14336, and
    # two 4096-wide norm weights, all bf16 (no mixed precision: pure bf16).
    linears = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert sum(units[0][0]) == 2 * (linears + 2 * 4096)
    live: dict = {}
    cats = 0
    for kind, key, *size in ev:
        if kind == "a":
            if isinstance(key, tuple) and key[1:] == ("flat grad",):
                i = key[0]
                weight_grads = {k: n for k, n in live.items()
                                if isinstance(k, tuple) and k[0] == i and isinstance(k[1], tuple)
                                and k[1][0] == A.WEIGHT_GRAD}
                # Every trained linear's gradient is alive at the concatenation: 2 x the unit's flat gradient.
                assert sum(weight_grads.values()) == 2 * linears
                assert size[0] == sum(units[0][0])
                # The blocks before still wait for their reduce-scatter; the one before them was released when
                # this block's backward began.
                waiting = [k[0] for k in live if isinstance(k, tuple) and k[1:] == ("flat grad",)]
                assert waiting == [b for b in range(i + waits, i, -1) if b < s.layers]
                cats += 1
            live[key] = size[0]
        elif kind == "f":
            live.pop(key)
        else:
            live[size[0]] = live.pop(key)
    assert cats == s.layers
    assert not live  # backward ends with every gradient, activation and flat gradient freed


def test_the_root_holds_the_heads_weight_gradient_through_backward(job):
    j, units, ev = _events(job)
    alloc = [i for i, x in enumerate(ev) if x[0] == "a"]
    head = next(i for i, x in enumerate(ev) if x[:2] == ("a", "head weight grad"))
    freed = next(i for i, x in enumerate(ev) if x[:2] == ("f", "head weight grad"))
    root = next(i for i, x in enumerate(ev) if x[:2] == ("a", "root flat grad"))
    # Made with the head's input gradient, before any block's backward; freed only once the root's flat
    # gradient (embedding, final norm, head) is concatenated, after the embedding's dense gradient.
    assert head < min(i for i in alloc if isinstance(ev[i][1], tuple) and ev[i][1][1:] == ("flat grad",))
    assert ev[root][2] == sum(units[-1][0]) == 2 * (2 * 32000 * 4096 + 4096)
    assert next(i for i, x in enumerate(ev) if x[:2] == ("a", "embedding grad")) < root < freed
