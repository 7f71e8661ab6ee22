"""Optimizers and the learning-rate schedule of the smoke run.

The state each one keeps is what checks/memory.py's optimizer_bytes counts: AdamW two states in
the parameter dtype (fused kernel on CUDA: no step temporaries), bitsandbytes 8-bit AdamW two
uint8 states plus an fp32 absmax per 256 values, bitsandbytes Lion one fp32 state (Lion8bit one
uint8 state plus the absmax), torchao's low-bit AdamW two blockwise states (stacks.LowBitAdam), SGD one
momentum buffer, Adafactor a factored second moment.
"""

from __future__ import annotations

import math

import torch

from podkit.checks.errors import ConfigError
from podkit.checks.stacks import BNB_OPTIMIZERS, TORCHAO_OPTIMIZERS
from podkit.envsetup.resolve import torchao_release

BNB_INSTALL = "make deploy installs it on a pod (envsetup); here: .venv/bin/pip install bitsandbytes"


def torchao_install() -> str:
    """How to get torchao for this torch: the release envsetup pins for it (envsetup/resolve.py TORCHAO_FOR_TORCH)."""
    release = torchao_release(torch.__version__)
    if not release:
        return f"no torchao release is built for torch {torch.__version__}: use an image with torch 2.8 or newer"
    return (f"make deploy installs it on a pod (envsetup); here: .venv/bin/pip install torchao=={release} "
            f"(the release built for torch {torch.__version__})")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave norms, biases and other vectors alone (nanoGPT's split)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


ADAMW_IMPLS = ("fused", "foreach", "for-loop")


def optimizer_class(name: str, device: torch.device, impl: str = "fused", block: int = 0):
    """(class, extra kwargs) for an optimizer name; bitsandbytes imported only when asked for.

    `impl` picks torch AdamW's implementation: fused (podkit: one kernel over all tensors, CUDA and
    CPU since torch 2.4, no full-size temporaries), foreach (torch's default on CUDA: grouped
    kernels with per-group intermediates) or for-loop (tensor by tensor). `block` is a torchao
    optimizer's block_size (0: its default)."""
    if name == "adamw":
        if impl not in ADAMW_IMPLS:
            raise ConfigError("optimizer_impl", f"unknown AdamW implementation {impl!r}", " | ".join(ADAMW_IMPLS))
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
        return torch.optim.AdamW, {"betas": (0.9, 0.95), **kind}
    if name in BNB_OPTIMIZERS:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("train.optimizer", f"{name} needs bitsandbytes, which is not installed",
                              BNB_INSTALL) from None
        if name.startswith("lion"):
            # Lion (Chen et al. 2023) at the paper's betas (0.9, 0.99), bitsandbytes' own defaults too.
            return {"lion": bnb.optim.Lion, "lion8bit": bnb.optim.Lion8bit}[name], {"betas": (0.9, 0.99)}
        cls = {"paged_adamw8bit": bnb.optim.PagedAdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
               "adamw8bit": bnb.optim.AdamW8bit}[name]
        return cls, {"betas": (0.9, 0.95)}
    if name in TORCHAO_OPTIMIZERS:
        try:
            import torchao.optim as ao_optim
        except ImportError:
            raise ConfigError("train.optimizer", f"{name} needs torchao, which is not installed",
                              torchao_install()) from None
        low_bit = TORCHAO_OPTIMIZERS[name]
        return getattr(ao_optim, low_bit.cls), {"betas": (0.9, 0.95), "block_size": block or low_bit.block}
    if name == "sgd":
        return torch.optim.SGD, {"momentum": 0.9, "foreach": True}
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise ConfigError("train.optimizer", f"adafactor needs torch >= 2.5, found {torch.__version__}",
                              "use adamw, or a newer torch")
        return torch.optim.Adafactor, {}
    raise ConfigError("train.optimizer", f"unknown optimizer {name!r}")


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float,
                    device: torch.device, zero1: bool = False, impl: str = "fused",
                    block: int = 0) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(name, device, impl, block)
    groups = param_groups(model, weight_decay)
    if zero1:
        # ZeRO-1: each rank keeps and updates the states of its share of the parameters.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, lr=lr,
                                      weight_decay=weight_decay, **kwargs)
        if len(groups) > 1:
            opt.add_param_group(groups[1])
        return opt
    return cls(groups, lr=lr, **kwargs)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear from 1/warmup to 1 over warmup steps, then cosine down to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
