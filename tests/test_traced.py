"""The traced estimate (train/traced.py) and the stack emulation of the smoke model, on real torch (CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time

import pytest
import torch

from podkit.checks import memory
from podkit.checks.config import load_job, parse_job
from podkit.checks.gpus import lookup
from podkit.checks.kernels import sdpa_backend
from podkit.checks.models import preset as shape_of
from podkit.train import liger, losses
from podkit.train import model as model_mod
from podkit.train.memprobe import TensorCounter, cuda_block_bytes
from podkit.train.parallel import World
from podkit.train.smoke import SmokeRun
from podkit.train.traced import trace
from tests.saved_bytes import loss_peaks as _loss_peaks
from tests.smoke_helpers import ROOT, tiny_job

GIB = 1 << 30


def _job(preset: str, train: str = "", cluster: str = ""):
    return parse_job(f'[model]\npreset = "{preset}"\n[train]\n{train}\n[cluster]\n{cluster}\n')


# ---------------------------------------------------------------- the trace agrees with a real run


@pytest.mark.parametrize("train", [{}, {"checkpointing": '"selective"'},
                                   {"precision": '"bf16-mixed"', "grad_accum": "3"},
                                   {"lora_rank": "4"}, {"optimizer": '"sgd"'},
                                   {"precision": '"bf16-mixed"', "loss": '"liger"'},
                                   {"precision": '"bf16-mixed"', "loss": '"liger"', "block_kernels": '"liger"',
                                    "lora_rank": "4"}],
                         ids=["fp32", "selective", "bf16-mixed-accum", "lora", "sgd", "liger", "liger-blocks"])
def test_trace_matches_the_real_cpu_step(tmp_path, train):
    """Fake tensors, counted per storage, against bin/smoke's own step on real CPU tensors."""
    job = load_job(tiny_job(tmp_path, train=train))
    run = SmokeRun(job, torch.device("cpu"), World(), None)
    run.run(4)  # step 3 is measured
    traced = trace(job, device_kind="cpu")
    for phase in ("forward", "backward", "step"):
        real, fake = run.phases.peaks[phase], traced.phases[phase].peak
        assert abs(fake - real) / real < 0.02, (phase, real, fake)
    # What is live between phases agrees too (params + states at the start, + grads when ready).
    for mark in ("step_start", "grads_ready"):
        real, fake = run.phases.marks[mark], sum(traced.marks[mark].values())
        assert abs(fake - real) / real < 0.02, (mark, real, fake)


@pytest.mark.parametrize("train", [
    'precision = "fp32"\ncheckpointing = "full"',
    'precision = "bf16-mixed"\ncheckpointing = "full"\nlora_rank = 8\nlora_targets = "all-linear"\n'
    'lora_dropout = 0.1\nstack = "hf"',
    # transformers 4.57: reentrant checkpointing, whose recompute runs the whole block (no early stop).
    'precision = "bf16-mixed"\ncheckpointing = "full"\nlora_rank = 8\nlora_targets = "all-linear"\n'
    'lora_dropout = 0.1\nstack = "hf"\ntransformers = "4.57.1"',
    # Chunked: a small loss backward, so that the traced backward peak is the blocks' (the whole-logits
    # loss backward is the analytic forward-end moment).
    'precision = "fp32"\ncheckpointing = "none"\nlora_rank = 8\nlora_dropout = 0.1\nloss = "chunked"',
    # Selective checkpointing (torch's SAC): the recompute pops the kept matmul outputs, and those autograd does
    # not save (a frozen linear's output, lora_B's) are gone by the block's backward. Counting them read +26%
    # on the LoRA job (QA, 2026-11-24) and +7% on the full fine-tune.
    'precision = "fp32"\ncheckpointing = "selective"\nlora_rank = 8\nloss = "chunked"',
    'precision = "fp32"\ncheckpointing = "selective"\nloss = "chunked"',
], ids=["full-ft-checkpointed", "peft-lora-dropout-checkpointed", "peft-lora-reentrant", "lora-dropout",
        "lora-selective", "full-ft-selective"])
def test_the_block_backward_follows_autograd_s_order_and_python_s_lifetimes(train):
    """The analytic backward of a block (checks/activations.py: the recompute's forward, then the ops in
    reverse, saved tensors released as each node runs, peft's fp32 input copy alive until its forward
    returns) against the CPU trace of the same step, which the test above holds to a real CPU run.
    At this size the block dominates: the old per-block sum (every saved tensor plus every gradient
    intermediate at once, the head's saved tensors kept) read +12% on the first job and, missing the
    recompute's own intermediates, -19% on the second."""
    job = _job("tiny", f"micro_batch = 8\nseq_len = 128\n{train}")
    traced = trace(job, device_kind="cpu")
    est = memory.estimate(job, device="cpu")
    analytic = max(sum(p.bytes for p in est.phase_parts[m] if p.term != "overhead") for m in ("backward", "backward-end"))
    assert abs(analytic - traced.phases["backward"].peak) / traced.phases["backward"].peak < 0.05


def test_with_a_small_loss_the_forward_peak_is_inside_the_last_block():
    """A fused loss holds no logits: the forward's peak is the last block's own (its LoRA casts and
    dropout copies beside the other blocks' saved activations), which the analytic forward-end takes
    when it is the larger; it read a third of the real CPU run before."""
    job = _job("tiny", "micro_batch = 8\nseq_len = 128\nprecision = 'bf16-mixed'\ncheckpointing = 'full'\n"
                       "lora_rank = 8\nlora_targets = 'all-linear'\nlora_dropout = 0.1\nstack = 'hf'\nloss = 'fused'")
    traced = trace(job, device_kind="cpu")
    est = memory.estimate(job, device="cpu")
    analytic = sum(p.bytes for p in est.phase_parts["forward-end"] if p.term != "overhead")
    assert abs(analytic - traced.phases["forward"].peak) / traced.phases["forward"].peak < 0.05


@pytest.mark.parametrize("train", [
    "precision = 'fp32'\ncheckpointing = 'none'",
    "precision = 'bf16'\ncheckpointing = 'none'\ngrad_accum = 2",
    "precision = 'bf16-mixed'\ncheckpointing = 'full'",
    "precision = 'bf16-mixed'\ncheckpointing = 'full'\nlora_rank = 8\nlora_targets = 'all-linear'\n"
    "lora_dropout = 0.1\nstack = 'hf'",
], ids=["fp32", "bf16-accum", "bf16-mixed-checkpointed", "peft-lora"])
def test_liger_loss_phases_match_the_trace(train):
    """Liger's loss holds the input's and the head weight's gradients from forward on; the forward phase
    then peaks in the final norm's backward (PowBackward0's three x-sized tensors beside MeanBackward's
    gradient and the other branch's), or in the last block's forward. Before the norm's backward was
    replayed the fp32 job read -3.3% and the accumulating bf16 one -9.9%."""
    _phases_match_the_trace(_job("tiny", f"micro_batch = 8\nseq_len = 128\nloss = 'liger'\n{train}"), 0.03, 0.05)


def _phases_match_the_trace(job, forward_tol: float, backward_tol: float):
    """The analytic forward-end against the traced forward phase, the larger of backward and
    backward-end against the traced backward phase; returns the trace."""
    traced = trace(job, device_kind="cpu")
    est = memory.estimate(job, device="cpu")
    for moments, phase, tol in ((("forward-end",), "forward", forward_tol),
                                (("backward", "backward-end"), "backward", backward_tol)):
        analytic = max(sum(p.bytes for p in est.phase_parts[m] if p.term != "overhead") for m in moments)
        real = traced.phases[phase].peak
        assert abs(analytic - real) / real < tol, (phase, analytic, real)
    return traced


# Eight blocks, so that the blocks (not the embedding or the loss) set the peaks.
EIGHT_BLOCKS = ("[model]\nhidden = 256\nlayers = 8\nheads = 4\nkv_heads = 2\nffn = 688\nvocab = 512\n"
                "tie_embeddings = true\n")


@pytest.mark.slow
@pytest.mark.parametrize("train", [
    "precision = 'fp32'\ncheckpointing = 'none'",
    "precision = 'bf16'\ncheckpointing = 'none'\ngrad_accum = 2",
    "precision = 'bf16-mixed'\ncheckpointing = 'full'",
    "precision = 'bf16-mixed'\ncheckpointing = 'none'\nlora_rank = 8\nlora_targets = 'all-linear'\n"
    "lora_dropout = 0.1\nstack = 'hf'",
    "precision = 'bf16'\ncheckpointing = 'full'\nlora_rank = 8\nstack = 'hf'\ntransformers = '4.39.0'",
], ids=["fp32", "bf16-accum", "bf16-mixed-checkpointed", "peft-lora", "peft-lora-reentrant"])
def test_liger_block_kernels_phases_match_the_trace(train):
    """Liger's RMSNorm, RoPE and SiLU-mul (train/liger.py emulates what they save and write in place)
    against the analytic walk's Liger ops. Without checkpointing they keep a sixth less here than
    transformers' modules, in the trace as in the prediction; the prediction of the torch modules
    would read +12% or more on those jobs."""
    def job(kernels):
        return parse_job(EIGHT_BLOCKS + f"[train]\nmicro_batch = 4\nseq_len = 256\nloss = 'liger'\n"
                                        f"block_kernels = '{kernels}'\n{train}\n[cluster]\n")

    traced = _phases_match_the_trace(job("liger"), 0.03, 0.04)
    if "'none'" in train:
        torch_traced = trace(job("torch"), device_kind="cpu")
        assert traced.phases["forward"].peak < 0.87 * torch_traced.phases["forward"].peak


def test_the_replicas_liger_norm_of_a_gemma_model_scales_by_one_plus_its_weight():
    """Review 2026-11-26: af5a847 initialised a Gemma norm's weight to 0 in bin/smoke's replica (GemmaRMSNorm scales
    by 1 + weight), but the replica's Liger RMSNorm scaled by the weight alone: with block_kernels = 'liger' every
    norm of a Gemma replica gave zeros, so its blocks and head saw none of the input and a LoRA run's loss could not
    fall (bin/smoke's 'loss did not fall'). Liger's Gemma norm takes offset=1.0 (liger_kernel/transformers/
    rms_norm.py LigerRMSNormForGemma2, init_fn='zeros'); the replica's does now, as its torch norm."""
    torch.manual_seed(0)
    x = torch.randn(2, 40, 32, dtype=torch.float64, requires_grad=True)
    w = (0.1 * torch.randn(32, dtype=torch.float64)).requires_grad_()
    y = liger.RMSNormFunction.apply(x, w, 1e-6, False, 1.0)
    y_ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)  # GemmaRMSNorm, fp64 throughout
    g = torch.randn_like(y)
    got, want = torch.autograd.grad(y, (x, w), g.clone()), torch.autograd.grad(y_ref, (x, w), g)
    assert torch.allclose(y, y_ref) and all(torch.allclose(a, c) for a, c in zip(got, want))
    norms = {}
    for kernels in ("torch", "liger"):
        j = parse_job(f'[model]\npreset = "gemma-2-2b"\n[train]\nprecision = "fp32"\nseq_len = 64\n'
                      f'block_kernels = "{kernels}"\n[cluster]\n').as_replica()
        shape = dataclasses.replace(j.shape, layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                                    vocab=256, sliding_layers=(0,))
        from podkit.train.step import model_options

        torch.manual_seed(0)
        model = model_mod.materialize(model_mod.build(shape, model_options(j), "fp32"), torch.device("cpu"), 0)
        ids = torch.randint(0, 256, (1, 64))
        with torch.no_grad():
            norms[kernels] = model.norm(model.embed_tokens(ids))
    assert norms["liger"].abs().mean() > 0.5 and torch.allclose(norms["liger"], norms["torch"], atol=1e-5)


def test_liger_block_kernel_emulations_give_torch_s_gradients_and_write_in_place():
    """The emulated Functions compute what transformers' modules compute (fp64 here), and keep Liger's
    storage: RoPE returns the projections rotated in place, RMSNorm's dX is dY's storage, SiLU-mul's
    gradients are the saved gate and up."""
    torch.manual_seed(0)
    b, s, heads, kv, d = 2, 40, 4, 2, 8
    x = torch.randn(b, s, heads * d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(heads * d, dtype=torch.float64, requires_grad=True)
    y = liger.RMSNormFunction.apply(x, w, 1e-5)
    y_ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # LlamaRMSNorm, in fp64 throughout
    g = torch.randn_like(y)
    got, want = torch.autograd.grad(y, (x, w), g.clone()), torch.autograd.grad(y_ref, (x, w), g)  # clone: dX
    assert torch.allclose(y, y_ref) and all(torch.allclose(a, c) for a, c in zip(got, want))
    dy = torch.randn(b, s, heads * d, dtype=torch.float64)
    before, ptr = dy.clone(), dy.data_ptr()
    copy = liger.RMSNormFunction.apply(x, w, 1e-5, False).grad_fn.apply(dy)[0]  # Gemma 2/3: in_place=False
    assert copy.data_ptr() != ptr and torch.equal(dy, before)  # a new dX; dY untouched
    node = liger.RMSNormFunction.apply(x, w, 1e-5).grad_fn
    assert node.apply(dy)[0].data_ptr() == ptr and torch.allclose(dy, copy)  # dX written into dY

    q0 = torch.randn(b, s, heads * d, dtype=torch.float64, requires_grad=True)
    k0 = torch.randn(b, s, kv * d, dtype=torch.float64, requires_grad=True)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_proj, k_proj = q0 * 1, k0 * 1  # the projections' outputs
    q, k = (t.view(b, s, -1, d).transpose(1, 2) for t in (q_proj, k_proj))
    qr, kr = liger.RopeFunction.apply(q, k, cos, sin)
    assert qr.data_ptr() == q_proj.data_ptr() and kr.data_ptr() == k_proj.data_ptr()  # rotated in place
    q, k = (t.view(b, s, -1, d).transpose(1, 2) for t in (q0, k0))
    q_ref, k_ref = (t * cos + model_mod.rotate_half(t) * sin for t in (q, k))
    assert torch.allclose(qr, q_ref) and torch.allclose(kr, k_ref)
    gq, gk = torch.randn_like(qr), torch.randn_like(kr)
    got = torch.autograd.grad((qr * gq).sum() + (kr * gk).sum(), (q0, k0))
    want = torch.autograd.grad((q_ref * gq).sum() + (k_ref * gk).sum(), (q0, k0))
    assert all(torch.allclose(a, c) for a, c in zip(got, want))

    gate = torch.randn(b, s, 24, dtype=torch.float64, requires_grad=True)
    up = torch.randn(b, s, 24, dtype=torch.float64, requires_grad=True)
    a, c = gate * 1, up * 1
    out = liger.SiLUMulFunction.apply(a, c)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * up)
    da, dc = out.grad_fn.apply(torch.ones_like(out))[:2]
    assert da.data_ptr() == a.data_ptr() and dc.data_ptr() == c.data_ptr()  # gradients in the saved storage
    ref = torch.autograd.grad((torch.nn.functional.silu(gate) * up).sum(), (gate, up))
    assert torch.allclose(da, ref[0]) and torch.allclose(dc, ref[1])


@pytest.mark.parametrize("train", [
    "precision = 'bf16-mixed'\ncheckpointing = 'none'\nlora_rank = 8\nstack = 'hf'",
    "precision = 'bf16-mixed'\ncheckpointing = 'full'",
    "precision = 'fp32'\ncheckpointing = 'none'",
], ids=["lora-frozen-head", "bf16-mixed-checkpointed", "fp32"])
def test_cut_cross_entropy_backward_matches_the_trace_at_a_real_vocabulary(train):
    """loss = "fused" is Cut Cross-Entropy (cut_cross_entropy/cce.py, cce_backward.py): it keeps the
    head's input and weight as cast for autocast, and its backward makes the input's gradient and,
    when the head trains, the weight's in the cast dtype, then casts it to the weight's. With a 32,000
    vocabulary that backward is the forward phase's peak; priced as a plain loss's (the logits'
    gradient beside the head's) the full fine-tune read +22%, and the emulation, which kept a chunk of
    full-vocabulary logits and a weight gradient for a frozen head, read the LoRA job at -57%."""
    job = parse_job(EIGHT_BLOCKS.replace("vocab = 512", "vocab = 32000").replace("true", "false")
                    + f"[train]\nmicro_batch = 4\nseq_len = 256\nloss = 'fused'\n{train}\n[cluster]\n")
    _phases_match_the_trace(job, 0.02, 0.02)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_autograd_sums_a_tied_weights_gradients_in_place_only_under_autocast(autocast):
    """The fact behind the embedding's backward moment: autograd's input buffer adds the embedding's
    gradient into the tied head's in place only when it can steal the head's (input_buffer.cpp
    can_accumulate_inplace). Measured by the profiler (no dispatch mode, which would itself force
    `old_var + var`): without autocast the sum is a new vocab x hidden tensor, with autocast (the
    head's gradient is ToCopyBackward's fresh fp32 copy) it is add_, and allocates nothing."""
    from torch.profiler import ProfilerActivity, profile

    V, H = 2048, 256
    dtype = torch.float32 if autocast else torch.bfloat16
    w = torch.nn.Parameter(torch.randn(V, H, dtype=dtype))
    ids = torch.randint(V, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.linear(torch.nn.functional.embedding(ids, w), w).float().sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    adds = {e.key: e.self_cpu_memory_usage for e in prof.key_averages() if e.key in ("aten::add", "aten::add_")}
    assert adds == ({"aten::add_": 0} if autocast else {"aten::add": V * H * 2})


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_a_tied_embeddings_backward_matches_the_trace(precision):
    """With a short sequence the input embedding's backward is the backward phase's peak: every
    gradient, the embedding's new one beside them, and (bf16) their out-of-place sum with the tied
    head's; the trace runs autocast's in-place sum as the GPU does (traced._tied_gradient_sum)."""
    job = parse_job(EIGHT_BLOCKS.replace("vocab = 512", "vocab = 32000")
                    + f"[train]\nmicro_batch = 1\nseq_len = 64\nprecision = '{precision}'\n[cluster]\n")
    est = memory.estimate(job, device="cpu")
    moment = max(("backward", "backward-end"), key=est.phase_allocated)
    labels = {p.label for p in est.phase_parts[moment]}
    assert "the input embedding's gradient, being made" in labels
    assert ("the tied weight's two gradients, summed out of place" in labels) == (precision == "bf16")
    _phases_match_the_trace(job, 0.02, 0.02)


def test_liger_loss_gradients_and_in_place_scaling():
    """The emulation returns Liger's gradients (made in forward) scaled by grad_output, as
    fused_linear_cross_entropy_backward does, in any chunking."""
    torch.manual_seed(1)
    for rows, vocab in ((10, 40), (37, 1000), (5, 3)):
        x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
        w = torch.randn(vocab, 6, dtype=torch.float64, requires_grad=True)
        t = torch.randint(vocab, (rows,))
        out = losses.LigerFusedLinearCrossEntropy.apply(x, w, t)
        (out * 0.25).backward()
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        ref = torch.nn.functional.cross_entropy(x @ w.t(), t)
        (ref * 0.25).backward()
        assert torch.allclose(out, ref) and torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    frozen = torch.randn(7, 6, dtype=torch.float64)
    xx = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    losses.LigerFusedLinearCrossEntropy.apply(xx, frozen, torch.randint(7, (4,))).backward()
    assert xx.grad is not None and frozen.grad is None


def test_the_head_s_saved_tensors_are_gone_once_backward_reaches_the_blocks():
    """The LM head's and the final norm's nodes run (and release what they saved) before any block's."""
    job = _job("llama-3.2-1b", 'precision = "bf16-mixed"\nseq_len = 1024\ncheckpointing = "full"')
    est = memory.estimate(job)
    T, L = 1024, 16
    [fwd] = [p for p in est.phase_parts["forward-end"] if p.label.startswith("saved activations")]
    [bwd] = [p for p in est.phase_parts["backward"] if p.label.startswith("blocks' saved activations")]
    # Full checkpointing keeps each block's fp32 input (4h); the head keeps the final residual (4h),
    # its normalised fp32 copy (4h), rsqrt (4) and the lm_head's bf16 input (2h).
    assert bwd.bytes == L * 4 * 2048 * T
    assert fwd.bytes - bwd.bytes == (4 * 2048 + 4 * 2048 + 4 + 2 * 2048) * T


def test_backward_until_the_blocks_counts_as_the_forward_phase():
    """PhasePeaks.fold_into: what backward holds before it reaches the blocks (the loss's gradients) is
    the forward phase's peak and rise; the backward phase's window restarts there."""
    from podkit.train.memprobe import PhasePeaks

    counter = TensorCounter(trace_limit=0)
    phases = PhasePeaks(counter)
    with counter:
        kept = torch.empty(1000, dtype=torch.uint8)
        with phases.phase("forward"):
            acts = torch.empty(4000, dtype=torch.uint8)
        with phases.phase("backward"):
            loss_grads = torch.empty(8000, dtype=torch.uint8)
            del loss_grads
            hidden_grad = torch.empty(500, dtype=torch.uint8)  # what reaches the last block
            phases.fold_into("forward")
            block_grads = torch.empty(2000, dtype=torch.uint8)
    assert phases.peaks["forward"] == 1000 + 4000 + 8000
    assert phases.rises["forward"] == 4000 + 8000
    assert phases.peaks["backward"] == 1000 + 4000 + 500 + 2000
    del kept, acts, hidden_grad, block_grads


def test_terms_at_the_boundaries_are_the_job_s_tensors():
    """fp32 AdamW at step start: weights and two states; when gradients are ready, one more copy."""
    job = _job("tiny", 'precision = "fp32"\nseq_len = 64\nmicro_batch = 2')
    traced = trace(job)
    params = sum(cuda_block_bytes(p.numel() * 4) for p in model_mod.build(job.shape, model_mod.ModelOptions(
        max_seq_len=64), "fp32").parameters())
    start = traced.marks["step_start"]
    assert start["params"] >= params  # + the two RoPE tables
    assert start["optimizer"] >= 2 * params
    assert traced.marks["grads_ready"]["grads"] == pytest.approx(params, rel=0.01)
    assert "grads" not in traced.marks["step_end"]  # zero_grad(set_to_none=True)


# ---------------------------------------------------------------- SDPA kernel routing


def test_sdpa_routing_follows_torch_rules():
    h100, a100, t4, a10g = lookup("H100-SXM"), lookup("A100-80GB"), lookup("T4"), lookup("A10G")
    assert sdpa_backend(h100, 4, 128, gqa=True) == "math"  # fp32 + GQA on an H100
    assert sdpa_backend(h100, 4, 128, gqa=False) == "efficient"
    assert sdpa_backend(a100, 2, 128, gqa=False, bf16=True) == "flash"  # bf16 on an A100
    assert sdpa_backend(a100, 2, 128, gqa=True, bf16=True) == "flash"
    assert sdpa_backend(h100, 2, 320, gqa=False, bf16=True) == "efficient"  # head_dim > 256
    assert sdpa_backend(a10g, 2, 256, gqa=False, bf16=True) == "efficient"  # sm86 training, d > 192
    for dtype_bytes, bf16 in ((4, False), (2, False), (2, True)):  # T4 (sm75): never flash
        for gqa in (False, True):
            assert sdpa_backend(t4, dtype_bytes, 128, gqa=gqa, bf16=bf16) != "flash"
    assert sdpa_backend(t4, 2, 128, gqa=False) == "efficient"
    assert sdpa_backend(t4, 2, 128, gqa=False, bf16=True) == "math"


def test_traced_jobs_take_the_routed_kernel():
    assert set(trace(_job("tiny", 'precision = "fp32"\nseq_len = 64', 'gpu = "H100-SXM"')).sdpa) == {"math"}
    assert set(trace(_job("tiny", 'precision = "bf16-mixed"\nseq_len = 64', 'gpu = "A100-80GB"')).sdpa) == {"flash"}
    assert set(trace(_job("tiny", 'precision = "fp16-mixed"\nseq_len = 64', 'gpu = "T4"')).sdpa) == {"math"}


def test_math_route_keeps_the_attention_weights():
    """fp32 + GQA on an H100 goes to math, which saves s x s fp32 weights per head; the same job
    through a fused kernel does not; bf16 on an A100 goes to flash."""
    s, b = 512, 1
    shape = shape_of("tiny")  # 4 heads, 2 kv heads: GQA
    job = _job("tiny", f'precision = "fp32"\nseq_len = {s}\nmicro_batch = {b}', 'gpu = "H100-SXM"')
    routed = trace(job)
    fused = trace(job, options=model_mod.ModelOptions(max_seq_len=s, sdpa_kernel="flash"))  # out + logsumexp
    assert set(routed.sdpa) == {"math"} and fused.sdpa == {}
    weights = shape.layers * b * shape.heads * s * s * 4
    extra = routed.marks["forward_end"]["activations"] - fused.marks["forward_end"]["activations"]
    assert weights <= extra < 3 * weights


# ---------------------------------------------------------------- losses


def _tiny_model(seq: int = 32, **opts):
    torch.manual_seed(0)
    model = model_mod.build(shape_of("tiny"), model_mod.ModelOptions(max_seq_len=seq, **opts), "fp32")
    return model_mod.materialize(model, torch.device("cpu"), 0)


@pytest.mark.parametrize("loss", ["fp32-logits-kept", "fp32-upcast-shifted", "compute-shifted", "chunked", "fused",
                                  "liger", "liger-block-kernels"])
def test_losses_and_kernels_match_the_plain_model_and_its_gradients(loss):
    """Each loss, and Liger's emulated block kernels, give the plain replica's loss and gradients."""
    x, y = torch.randint(512, (2, 32)), torch.randint(512, (2, 32))
    opts = {"block_kernels": "liger"} if loss == "liger-block-kernels" else {"loss": loss, "loss_chunks": 3}
    ref, other = _tiny_model(), _tiny_model(**opts)
    a, b = ref(x, y), other(x, y)
    assert torch.allclose(a, b, atol=1e-5)
    a.backward()
    b.backward()
    for (name, p), q in zip(ref.named_parameters(), other.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    if loss == "fp32-logits-kept":
        assert other.kept_logits is not None and other.kept_logits.dtype == torch.float32
        other.release_outputs()
        assert other.kept_logits is None


def test_fused_loss_gradient_by_autograd_check():
    torch.manual_seed(1)
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randint(7, (10,))
    f = lambda x, w: losses.FusedLinearCrossEntropy.apply(x, w, t, 3, torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.allclose(f(x, w), torch.nn.functional.cross_entropy(x @ w.t(), t))


def _saved_bytes(model, x, y) -> tuple[int, list[torch.Tensor]]:
    """Bytes live after forward (what autograd saved), and the gradients after backward."""
    counter = TensorCounter()
    counter.switch_on()
    try:
        before = counter.allocated()
        loss = model(x, y)
        saved = counter.allocated() - before
        loss.backward()
    finally:
        counter.switch_off()
    return saved, [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_every_ac_policy_gives_the_same_gradients_and_saves_less():
    x, y = torch.randint(512, (4, 128)), torch.randint(512, (4, 128))
    saved, grads = {}, {}
    for policy in model_mod.AC_POLICIES:
        saved[policy], grads[policy] = _saved_bytes(_tiny_model(128, ac_policy=policy), x, y)
    for policy in model_mod.AC_POLICIES[1:]:
        for g, ref in zip(grads[policy], grads["none"]):
            assert torch.allclose(g, ref, atol=1e-5, rtol=1e-4), policy
    assert saved["none"] > saved["matmuls"] > saved["op-sac"] > saved["block"], saved


def test_repeated_kv_and_reentrant_checkpointing():
    """HF's repeat_kv keeps full-width k and v; a reentrant block checkpoint gives the same gradients."""
    x, y = torch.randint(512, (2, 128)), torch.randint(512, (2, 128))
    shape = shape_of("tiny")
    native, g_native = _saved_bytes(_tiny_model(128), x, y)
    repeated, g_repeated = _saved_bytes(_tiny_model(128, repeat_kv=True), x, y)
    # SDPA saves k and v at every head instead of at the kv heads: (q_dim - kv_dim) more each, fp32.
    assert repeated - native == shape.layers * 2 * 2 * 128 * (shape.q_dim - shape.kv_dim) * 4
    reentrant, g_reentrant = _saved_bytes(_tiny_model(128, ac_policy="block", reentrant=True), x, y)
    for a, b, c in zip(g_native, g_repeated, g_reentrant):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4) and torch.allclose(a, c, atol=1e-5, rtol=1e-4)
    block, _ = _saved_bytes(_tiny_model(128, ac_policy="block"), x, y)
    assert reentrant == pytest.approx(block, rel=0.05) and reentrant < native / 2
    with pytest.raises(ValueError, match="reentrant"):
        model_mod.ModelOptions(ac_policy="op-sac", reentrant=True)


def test_transformers_4_46_loss_copies_the_fp32_logits_it_shifts():
    """transformers 4.46-4.48 ForCausalLMLoss: upcast, then shift_logits = logits[..., :-1, :].contiguous():
    4 B per logit more than >= 4.49's upcast at the forward peak (2 + 4 + 4 + 4 against 2 + 4 + 4 in
    bf16), none at backward's (3 x 4); at fp32 `.float()` is the tensor itself (4 + 4 + 4 against 4 + 4).
    The analytic loss (checks/activations.py loss_bytes) says the same."""
    logits = 4 * 128 * 512
    for precision in ("bf16", "fp32"):
        (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", precision), _loss_peaks("fp32-upcast-shifted", precision)
        assert (f1 - f0, b1 - b0) == (4 * logits, 0), precision


def test_transformers_4_45_loss_keeps_the_fp32_logits_and_copies_them_shifted():
    """transformers <= 4.45: `logits = logits.float()` kept in the output, then a shifted .contiguous() copy:
    in bf16, 4 + 4 + 4 B per logit at the forward peak against >= 4.49's 2 + 4 + 4, and at backward's the
    kept 4 beside its 3 x 4 (checks/activations.py loss_bytes: fp32-logits-kept)."""
    logits = 4 * 128 * 512
    (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", "bf16"), _loss_peaks("fp32-logits-kept", "bf16")
    assert (f1 - f0, b1 - b0) == (2 * logits, 4 * logits)


def test_gpt2_loss_before_4_49_shifts_a_compute_dtype_copy():
    """transformers < 4.49 GPT2LMHeadModel: a shifted .contiguous() copy of the compute-dtype logits and
    CrossEntropyLoss on it, run as CUDA decomposes it (nll_loss(log_softmax(x, dim, x.dtype))). In pure bf16:
    2 + 2 + 2 B per logit at the forward peak and 3 x 2 at backward's, against fp32-upcast's 2 + 4 + 4 and 3 x 4.
    Under autocast nll_loss casts log_softmax's bf16 output to fp32 and saves it, and accelerate's native AMP then
    makes an fp32 copy of the logits: 2 + 2 + 4 + 4 at the forward peak, 2 + 4 + 4 at backward's
    (checks/activations.py loss_bytes: compute-shifted)."""
    logits = 4 * 128 * 512
    (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", "bf16"), _loss_peaks("compute-shifted", "bf16")
    # (within a few bytes: the loss scalar is bf16 here, fp32 there)
    assert (f1 - f0, b1 - b0) == (pytest.approx(-4 * logits, abs=8), pytest.approx(-6 * logits, abs=8))
    (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", "bf16-mixed"), _loss_peaks("compute-shifted", "bf16-mixed")
    assert (f1 - f0, b1 - b0) == (pytest.approx(2 * logits, abs=8), pytest.approx(-2 * logits, abs=8))
    # the same op sequence as CUDA: log_softmax stays bf16 under autocast, nll_loss saves an fp32 cast
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = losses.compute_shifted(x.view(1, 8, 16), torch.randint(16, (1, 8)))
    node = loss.grad_fn
    assert node.name() == "NllLossBackward0" and node._saved_self.dtype == torch.float32
    assert node.next_functions[0][0].name() == "ToCopyBackward0"


def test_native_loss_under_autocast_saves_nll_losss_fp32_cast():
    """cross_entropy on compute-dtype logits runs on CUDA as nll_loss(log_softmax(x, dim, x.dtype)), and
    autocast runs nll_loss in fp32, which saves its fp32 cast of the bf16 log-softmax. Per logit, against
    fp32-upcast's 2 + 4 + 4 forward and 3 x 4 backward: pure bf16 2 + 2 forward and 3 x 2 backward; under
    autocast 2 + 2 + 4 forward and 2 + 4 + 4 backward (NllLossBackward0's fp32 gradient beside both saved
    tensors). The analytic loss (checks/activations.py loss_bytes) says the same."""
    logits = 4 * 128 * 512
    (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", "bf16"), _loss_peaks("native", "bf16")
    assert (f1 - f0, b1 - b0) == (pytest.approx(-6 * logits, abs=8), pytest.approx(-6 * logits, abs=8))
    (f0, b0), (f1, b1) = _loss_peaks("fp32-upcast", "bf16-mixed"), _loss_peaks("native", "bf16-mixed")
    assert (f1 - f0, b1 - b0) == (pytest.approx(-2 * logits, abs=8), pytest.approx(-2 * logits, abs=8))
    from podkit.checks.activations import loss_bytes
    for precision, fwd, bwd in (("bf16", 4, 6), ("bf16-mixed", 8, 10)):
        job = parse_job(f"[model]\npreset = 'llama-3.2-1b'\n[train]\nloss = 'native'\nprecision = '{precision}'\n")
        assert job.facts.loss_autocast == (precision == "bf16-mixed")
        lb = loss_bytes(job, job.train.seq_len)
        assert (lb.forward, lb.backward) == (fwd, bwd), precision


def test_litgpt_logits_reach_the_loss_as_fp32():
    """Fabric's _FabricModule.forward converts the model's outputs with precision.convert_output, to
    torch.get_default_dtype() once forward_context has restored it: fp32 at bf16-true and bf16-mixed alike
    (real lightning here). So litgpt's chunked_cross_entropy works on fp32 chunks, kept through backward:
    per logit 4 kept + 4 log-softmax, against bf16 chunks' 2 + 2, and a chunk's gradient in and out of
    log_softmax at 4 B too. The replica casts its chunks the same way (ModelOptions.logits_fp32)."""
    import lightning as L

    for precision in ("bf16-true", "bf16-mixed"):
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
        with fabric.init_module():
            head = torch.nn.Linear(8, 16)

        class Chunks(torch.nn.Module):  # litgpt's GPT.forward with lm_head_chunk_size: a list of head outputs
            def __init__(self):
                super().__init__()
                self.head = head

            def forward(self, x):
                return [self.head(c) for c in x.chunk(2, dim=1)]

        out = fabric.setup_module(Chunks())(torch.randn(2, 4, 8))
        assert [(t.dtype, t.grad_fn.name()) for t in out] == [(torch.float32, "ToCopyBackward0")] * 2, precision
    j = parse_job("[model]\npreset = 'llama-3.2-1b'\n[train]\nstack = 'litgpt'\nprecision = 'bf16'\nseq_len = 1024\n")
    from podkit.checks.activations import loss_bytes
    lb = loss_bytes(j, 1024)
    assert (j.facts.logits_fp32, lb.forward, lb.backward, lb.kept) == (True, 8, 4 + 4 + 2 * 4 / 8, 4)
    assert not parse_job("[model]\npreset = 'llama-3.2-1b'\n[train]\nstack = 'litgpt'\nprecision = 'fp32'\n").facts.logits_fp32
    logits = 4 * 128 * 512
    litgpt = {"loss_upcast": False, "logits_kept": True, "loss_chunks": 8}
    # The replica: kept chunks and log-softmax 2 + 2 -> 4 + 4 at the forward's end. (Its backward is not
    # compared: a CPU's bf16 log_softmax backward is not CUDA's kernel.)
    f0, _ = _loss_peaks("chunked", "bf16", **litgpt)
    f1, _ = _loss_peaks("chunked", "bf16", logits_fp32=True, **litgpt)
    assert f1 - f0 == pytest.approx(4 * logits, rel=0.001)


def test_chunked_and_fused_losses_save_less_than_kept_logits():
    x, y = torch.randint(512, (4, 128)), torch.randint(512, (4, 128))
    saved = {loss: _saved_bytes(_tiny_model(128, loss=loss), x, y)[0] for loss in model_mod.LOSSES}
    logits = 4 * 128 * 512 * 4
    assert saved["fp32-logits-kept"] - saved["fp32-upcast"] == pytest.approx(logits, rel=0.01)
    assert saved["fused"] < saved["fp32-upcast"] - logits // 2  # no log-softmax output kept


def test_lora_targets_dropout_and_dtype():
    shape = shape_of("tiny")
    qv = model_mod.build(shape, model_mod.ModelOptions(lora_rank=4, lora_targets=("q_proj", "v_proj")), "bf16-mixed")
    _, trainable = model_mod.count_params(qv)
    per_layer = 4 * (shape.hidden + shape.q_dim) + 4 * (shape.hidden + shape.kv_dim)
    assert trainable == shape.layers * per_layer
    compute = model_mod.build(shape, model_mod.ModelOptions(lora_rank=4, lora_dtype="compute"), "bf16-mixed")
    assert {p.dtype for p in compute.parameters() if p.requires_grad} == {torch.bfloat16}
    with pytest.raises(ValueError, match="lora_targets"):
        model_mod.ModelOptions(lora_rank=4, lora_targets=("qkv",))
    # Dropout before A keeps a mask and the dropped input per adapter: more saved than without.
    x, y = torch.randint(512, (2, 64)), torch.randint(512, (2, 64))
    plain = _saved_bytes(_tiny_model(64, lora_rank=4), x, y)[0]
    dropped = _saved_bytes(_tiny_model(64, lora_rank=4, lora_dropout=0.1), x, y)[0]
    tokens, h = 2 * 64, shape.hidden
    # At least q, k, v and gate/up's inputs: an fp32 dropped copy and a bool mask each.
    assert dropped - plain >= shape.layers * 4 * tokens * h * (4 + 1)
    # The mask is a bool, as CUDA's fused native_dropout saves it, on the CPU too (where F.dropout would
    # save an fp32 noise tensor: 4 B per value, not 1).
    x = torch.randn(64, 32, requires_grad=True)
    out = model_mod.Dropout(0.1)(x)
    saved = [getattr(out.grad_fn, n) for n in dir(out.grad_fn) if n.startswith("_saved_")]
    assert [t.dtype for t in saved if isinstance(t, torch.Tensor)] == [torch.bool]
    assert torch.nn.functional.dropout(x, 0.1).grad_fn._saved_other.dtype == torch.float32


# ---------------------------------------------------------------- full size


def test_7b_trace_completes_near_the_analytic_model():
    job = _job("mistral-7b", 'precision = "bf16-mixed"\nseq_len = 4096', 'gpu = "H100-SXM"')
    started = time.perf_counter()
    traced = trace(job)
    seconds = time.perf_counter() - started
    est = memory.estimate(job)
    assert traced.peak == pytest.approx(est.allocated, rel=0.10)
    assert traced.marks["step_start"]["params"] == pytest.approx(job.shape.params * 4, rel=0.01)
    assert seconds < 60, f"7B trace took {seconds:.1f} s"


def test_fsdp_zero3_over_8_fake_ranks_shards_params_and_states():
    job = _job("llama-3.2-1b", 'precision = "bf16-mixed"\nseq_len = 1024',
               'gpu = "H100-SXM"\ngpus_per_node = 8\nsharding = "zero3"')
    traced = trace(job)
    start = traced.marks["step_start"]
    assert start["params"] == pytest.approx(job.shape.params * 4 / 8, rel=0.02)
    assert start["optimizer"] == pytest.approx(job.shape.params * 8 / 8, rel=0.02)
    # Gathered bf16 blocks and the root are parameter memory during forward.
    assert traced.phases["forward"].terms["params"] > start["params"]


def test_ddp_keeps_gradient_buckets_from_the_start():
    job = _job("tiny", 'precision = "fp32"\nseq_len = 64', 'gpus_per_node = 2')
    traced = trace(job)
    assert traced.marks["step_start"]["grads"] == pytest.approx(traced.marks["grads_ready"]["grads"], rel=0.01)


# ---------------------------------------------------------------- bin/preflight --traced


def _preflight(*args, env=None):
    return subprocess.run([str(ROOT / "bin" / "preflight"), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_preflight_traced_json_and_table():
    example = str(ROOT / "checks" / "examples" / "tiny-cpu.toml")
    out = _preflight("--config", example, "--traced", "--json", "--no-probe")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    traced = data["traced"]
    assert set(traced["phases"]) == {"forward", "backward", "step"}
    assert traced["peak"] == max(p["peak"] for p in traced["phases"].values())
    assert traced["seconds"] > 0 and traced["comparison"]["peak"]["traced"] == traced["peak"]
    table = _preflight("--config", example, "--traced", "--no-probe")
    assert "Analytic vs traced" in table.stdout and "backward" in table.stdout


def test_preflight_traced_bad_combos_are_one_line(tmp_path):
    no_torch = tmp_path / "shadow" / "torch"
    no_torch.mkdir(parents=True)
    (no_torch / "__init__.py").write_text("raise ImportError('torch is not installed in this environment')\n")
    out = _preflight("--traced", "--no-probe", env={"PYTHONPATH": str(no_torch.parent)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "torch" in out.stderr, out.stderr
    job = tmp_path / "offload.toml"
    job.write_text('[model]\npreset = "llama-3.2-1b"\n[cluster]\ngpus_per_node = 2\nsharding = "zero3"\n'
                   'offload = "optimizer"\n')
    out = _preflight("--config", str(job), "--traced", "--no-probe")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "offload" in out.stderr, out.stderr


def test_model_options_reject_bad_values():
    with pytest.raises(ValueError, match="ac_policy"):
        model_mod.ModelOptions(ac_policy="selective")
    with pytest.raises(ValueError, match="fused"):
        model_mod.ModelOptions(loss="fused", lora_rank=4, lora_targets=("lm_head",))
    assert dataclasses.replace(model_mod.ModelOptions(), loss="chunked").loss == "chunked"
