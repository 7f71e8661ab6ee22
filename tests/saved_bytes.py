"""What autograd saves under one module of a real forward, the traced and estimated step peaks of a job, and the
replica's loss peaks: the counts the activation, mask and loss checks compare with podkit's."""

from __future__ import annotations

import torch


def saved_under(module, skip: set, run) -> int:
    """Bytes of the storages autograd saves while `module` runs inside `run()`, each once, leaving out the storages in
    `skip` (parameters, buffers) and any saved first outside it (the rotary cos/sin an earlier layer saved)."""
    inside = []
    pre = module.register_forward_pre_hook(lambda m, a: inside.append(1))
    post = module.register_forward_hook(lambda m, a, o: inside.pop() and None)
    seen, total = set(), []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip | seen:
            seen.add(storage.data_ptr())
            if inside:
                total.append(storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        pre.remove()
        post.remove()
    return sum(total)


def step_peaks(job) -> tuple[list[int], list[int]]:
    """The replica's traced forward and backward peaks of `job` on fake CPU tensors, and the estimate's at the same
    moments (tensors only): what the mask tests compare, job against job."""
    from podkit.checks.memory import estimate
    from podkit.train.traced import trace

    traced = trace(job, device_kind="cpu")
    est = estimate(job, device="cpu")
    analytic = [max(sum(p.bytes for p in est.phase_parts[m] if p.term != "overhead") for m in moments)
                for moments in (("forward-end",), ("backward", "backward-end"))]
    return [traced.phases["forward"].peak, traced.phases["backward"].peak], analytic


def loss_peaks(loss: str, precision: str, **opts) -> tuple[int, int]:
    """Peak bytes above the start in forward and in backward, counted by real torch on the CPU; a "-mixed"
    precision runs the forward under autocast (bf16), as accelerate's native AMP does. `opts`: more
    ModelOptions."""
    from podkit.checks.models import preset as shape_of
    from podkit.train import model as model_mod
    from podkit.train.memprobe import TensorCounter

    torch.manual_seed(0)
    model = model_mod.build(shape_of("tiny"), model_mod.ModelOptions(max_seq_len=128, loss=loss, **opts), precision)
    model = model_mod.materialize(model, torch.device("cpu"), 0)
    x, y = torch.randint(512, (4, 128)), torch.randint(512, (4, 128))
    counter = TensorCounter()
    counter.switch_on()
    try:
        counter.reset_peak()
        before = counter.allocated()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.endswith("-mixed")):
            out = model(x, y)
        forward = counter.window_peak() - before
        counter.reset_peak()
        out.backward()
        backward = counter.window_peak() - before
    finally:
        counter.switch_off()
    return forward, backward
