"""One optimizer step of the smoke run, shared by bin/smoke (train/smoke.py) and the traced
estimate (train/traced.py), so that what is traced is exactly what runs.

It reads top to bottom like nanoGPT's loop: grad_accum micro-steps of forward and backward under
autocast, then unscale, clip, step and zero_grad(set_to_none=True). `phases` (memprobe.PhasePeaks
or the tracer's) is told where forward, backward and the optimizer step begin and end.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from podkit.checks import activations as A
from podkit.checks.config import JobConfig
from podkit.checks.kernels import attention_run
from podkit.train import model as model_mod
from podkit.train import parallel


def model_options(job: JobConfig) -> model_mod.ModelOptions:
    """The smoke model's options for a job, from the facts the prediction reads (checks/stacks.py)."""
    t, f = job.train, job.facts
    chunks = f.loss_chunks or (-(-t.seq_len // f.loss_chunk_tokens) if f.loss_chunk_tokens else 0)
    kwargs = {"loss_chunks": chunks} if chunks else {}
    return model_mod.ModelOptions(
        attention=attention_run(job), ac_policy=f.ac_policy, loss=f.loss, lora_rank=t.lora_rank,
        lora_targets=f.lora_targets or model_mod.ModelOptions.lora_targets, lora_dropout=f.lora_dropout,
        lora_dtype=f.lora_dtype, base_quant=t.base_quant, max_seq_len=t.seq_len,
        loss_upcast=f.loss_upcast, logits_kept=f.logits_kept, logits_fp32=f.logits_fp32, logit_softcap=f.logit_softcap,
        repeat_kv=f.repeat_kv,
        reentrant=f.reentrant and f.ac_policy == "block", adapter_input_cast=f.stack.adapter_input_cast,
        block_kernels=f.block_kernels, qk_norm=A.qk_norm(job), attn_output_copy=f.flash_repad,
        **_mask_options(job), **kwargs)


def _mask_kind(m) -> str:
    if m is None:
        return ""
    return m.shape if m.shape in ("single", "positions", "flat") else "bool" if m.elem_bytes == 1 else "float"


def _mask_options(job: JobConfig) -> dict:
    """The replica's attention masks, as the job's model builds them (checks/stacks.py AttentionMask): the full
    layers' and, where they have their own (JobFacts.sliding_own), the sliding-window layers'."""
    f, shape = job.facts, job.shape
    kind = _mask_kind(f.attn_mask)
    out = {"attn_mask": kind, "attn_mask_positions": shape.rope_positions if kind == "positions" else 0}
    if f.sliding_own:
        out.update(sliding_layers=shape.sliding_layers, sliding_window=shape.sliding_window,
                   sliding_mask=_mask_kind(f.sliding_mask), sliding_repeat_kv=f.sliding_repeat_kv)
    return out


def autocast_context(enabled: bool, device_type: str, precision: str):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=model_mod.compute_dtype(precision))


@dataclass
class StepParts:
    """What one optimizer step touches."""

    model: torch.nn.Module  # as wrapped (DDP) or sharded (FSDP2)
    raw_model: torch.nn.Module  # the Decoder itself
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    params: list[torch.Tensor]  # trainable, for clipping
    amp: Callable[[], contextlib.AbstractContextManager]
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    grad_accum: int
    grad_clip: float


def optimizer_step(parts: StepParts, phases, on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """grad_accum forward/backward passes and one optimizer step; returns (summed loss, grad norm).

    `on_loss` may replace each micro-step's loss before backward (bin/smoke's fault injection).
    """
    model, opt, scaler = parts.model, parts.optimizer, parts.scaler
    if hasattr(parts.raw_model, "on_blocks_backward") and hasattr(phases, "fold_into"):
        # The measured forward runs until backward reaches the blocks: the loss spike checks/memory.py
        # prices at forward-end includes the loss's backward.
        parts.raw_model.on_blocks_backward = lambda: phases.fold_into("forward")
    loss_sum = None
    for micro in range(parts.grad_accum):
        x, y = parts.next_batch()
        last = micro == parts.grad_accum - 1
        # DDP all-reduces only after the last micro-step's backward.
        with parallel.grad_sync(model, sync=last):
            with phases.phase("forward"), parts.amp():
                loss = model(x, y) / parts.grad_accum
            phases.mark("forward_end")
            if on_loss is not None:
                loss = on_loss(loss)
            with phases.phase("backward"):
                (scaler.scale(loss) if scaler else loss).backward()
                # What the forward's output kept (HF's fp32 logits) is dropped with it, after backward.
                parts.raw_model.release_outputs()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        del loss, x, y
    phases.mark("grads_ready")
    with phases.phase("step"):
        if scaler:
            scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(parts.params, parts.grad_clip) if parts.grad_clip else None
        if scaler:
            scaler.step(opt)  # skips the step when the fp16 gradients overflowed
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    phases.mark("step_end")
    return loss_sum, grad_norm
