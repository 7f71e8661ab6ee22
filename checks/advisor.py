"""The fit advisor: which levers make a job fit, and what each costs in speed.

Levers, from least to most intrusive: micro-batch (grad_accum raised to keep the effective
batch), Liger's kernels for a Hugging Face Trainer job (TrainingArguments use_liger_kernel: its fused
loss and block kernels, the same model and maths), activation checkpointing, an 8-bit optimizer, a higher sharding stage, CPU offload,
LoRA / QLoRA (changes what is trained), and the sequence length (changes the data) last.

Speed costs are rough step-time multipliers from published measurements, for ranking, not
for promising: full checkpointing repeats the forward pass, about +33% compute (Chen et al.
2016; Korthikanti et al. 2022); op-level selective recompute of pointwise ops is a few
percent; ZeRO-Offload keeps the step on the CPU (Ren et al. 2021); QLoRA's dequantization
makes it slower than LoRA (Dettmers et al. 2023).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from podkit.checks.config import JobConfig
from podkit.checks.memory import MemoryEstimate, estimate

HEADROOM = 0.10  # below this a job "fits" but one longer batch away from an OOM

CHECKPOINT_COST = {"none": 1.0, "selective": 1.08, "full": 1.33}
SHARDING_COST = {"none": 1.0, "zero1": 1.0, "zero2": 1.05, "zero3": 1.15}
OFFLOAD_COST = {"none": 1.0, "optimizer": 1.6, "all": 3.0}
HALVING_COST = 1.05  # per halving of the micro-batch: smaller matmuls, more launches
LORA_COST = 0.75  # no weight gradients for the frozen base
QLORA_COST = 0.75 * 1.35


@dataclass(frozen=True)
class Suggestion:
    changes: tuple[tuple[str, object, object], ...]  # (field, old, new)
    estimate: MemoryEstimate
    slowdown: float  # step time relative to the job as given
    caveat: str  # non-empty where the change alters what is trained

    def describe(self) -> str:
        text = ", ".join(f"{name} {old} -> {new}" for name, old, new in self.changes)
        if any(name == "train.block_kernels" and new == "liger" for name, _, new in self.changes):
            text += " (TrainingArguments use_liger_kernel=True, pip install liger-kernel)"
        return text


def _cost(job: JobConfig) -> float:
    t, c = job.train, job.cluster
    cost = CHECKPOINT_COST[t.checkpointing] * SHARDING_COST[c.sharding] * OFFLOAD_COST[c.offload]
    if c.nodes > 1 and c.sharding == "zero3":
        cost *= 1.15  # gathers cross the slower inter-node network
    if t.lora_rank:
        cost *= QLORA_COST if t.base_quant != "none" else LORA_COST
    return cost


def _micro_batches(b: int) -> list[int]:
    out = [b]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def _options(job: JobConfig, allow_seq: bool):
    t, c = job.train, job.cluster
    ckpt = ["none", "selective", "full"]
    ckpts = ckpt[ckpt.index(t.checkpointing):]
    stages = ["none", "zero1", "zero2", "zero3"]
    shardings = stages[stages.index(c.sharding):] if c.world_size > 1 else [c.sharding]
    offloads = ["none", "optimizer", "all"][["none", "optimizer", "all"].index(c.offload):]
    optimizers = [t.optimizer] + (["adamw8bit"] if t.optimizer == "adamw" else [])
    if t.lora_rank == 0:
        loras = [(0, "none"), (16, "none"), (16, "nf4")]
    elif t.base_quant == "none":
        loras = [(t.lora_rank, "none"), (t.lora_rank, "nf4")]
    else:
        loras = [(t.lora_rank, t.base_quant)]
    # Liger patches transformers' Llama-style models in place (liger_kernel/transformers/monkey_patch.py);
    # no step-time cost is counted, though Liger reports its kernels faster than transformers' own.
    ligers = [False] + ([True] if job.facts.stack.name == "hf" and job.shape.arch == "llama"
                        and (job.facts.loss, job.facts.block_kernels) != ("liger", "liger") else [])
    seqs = [t.seq_len]
    if allow_seq:
        while seqs[-1] > 256:
            seqs.append(seqs[-1] // 2)
    for ck, sh, off, opt, (rank, quant), seq, lg in itertools.product(ckpts, shardings, offloads, optimizers, loras,
                                                                      seqs, ligers):
        if off == "all" and sh != "zero3":
            continue  # parameter offload needs ZeRO-3 gathering
        if lg and ck == "selective" and job.facts.stack.selective in ("matmuls", "op-sac"):
            continue  # Liger's in-place RoPE under a selective checkpoint: refused (stacks.resolve)
        train = {"checkpointing": ck, "optimizer": opt, "lora_rank": rank, "base_quant": quant, "seq_len": seq}
        if lg:
            train |= {"loss": "liger", "block_kernels": "liger"}
        yield train, {"sharding": sh, "offload": off}


def _fits(est: MemoryEstimate, host_known: bool) -> bool:
    host_ok = not est.host_needed or not host_known or est.host_needed <= est.host_capacity
    return est.total <= est.capacity * (1 - HEADROOM) and host_ok


def neighbours(job: JobConfig) -> list[JobConfig]:
    """The nearest valid jobs to start from besides the job itself: the levers only ever add memory
    savers, so a job that took a wrong turn (sharding on one GPU, a bitsandbytes optimizer under
    FSDP or offload) must also be explored from the configuration it should have been."""
    out = []
    c, f = job.cluster, job.facts
    if c.world_size == 1 and c.sharding != "none":
        out.append(job.replace(cluster={"sharding": "none", "offload": "none"}))
    if f.bnb_unsupported:
        out.append(job.replace(train={"optimizer": "adamw"}))
        out.append(job.replace(cluster={"sharding": "zero1" if c.world_size > 1 else "none", "offload": "none"}))
    return out


def advise(job: JobConfig, limit: int = 4) -> list[Suggestion]:
    """The cheapest few configurations that fit with 10% headroom, cheapest first, explored from the
    job as given and from its nearest valid neighbours."""
    base_cost = _cost(job)
    host_known = job.cluster.host_ram_gb > 0
    found: list[Suggestion] = []
    seen: set = set()
    starts = [job] + neighbours(job)
    for allow_seq in (False, True):  # the sequence length only when nothing else fits
        for train, cluster in (o for start in starts for o in _options(start, allow_seq)):
            key = (tuple(sorted(train.items())), tuple(sorted(cluster.items())))
            if key in seen:
                continue
            seen.add(key)
            if job.replace(train=train, cluster=cluster).facts.bnb_unsupported:
                continue
            batches = _micro_batches(job.train.micro_batch)
            effective = job.train.micro_batch * job.train.grad_accum
            # Memory falls as the micro-batch halves: find the largest that fits by bisection.
            lo, hi, best = 0, len(batches) - 1, None
            while lo <= hi:
                mid = (lo + hi) // 2
                b = batches[mid]
                candidate = job.replace(
                    train={**train, "micro_batch": b, "grad_accum": max(1, effective // b)}, cluster=cluster)
                est = estimate(candidate)
                if _fits(est, host_known):
                    best, hi = (candidate, est, mid), mid - 1
                else:
                    lo = mid + 1
            if best is None:
                continue
            candidate, est, halvings = best
            changes = _changes(job, candidate)
            if not changes:
                continue
            caveat = []
            if candidate.train.lora_rank and not job.train.lora_rank:
                caveat.append("trains LoRA adapters, not the full model")
            if candidate.train.base_quant != job.train.base_quant:
                caveat.append("4-bit base weights")
            if candidate.train.seq_len != job.train.seq_len:
                caveat.append("shorter context than intended")
            slowdown = _cost(candidate) / base_cost * HALVING_COST ** halvings
            found.append(Suggestion(changes, est, slowdown, "; ".join(caveat)))
        if found:
            break
    found.sort(key=lambda s: (bool(s.caveat), round(s.slowdown, 2), len(s.changes), s.estimate.total))
    chosen: list[Suggestion] = []
    for s in found:
        # Skip a suggestion that only adds changes to one already chosen: it is never better.
        if any(set(c.changes) <= set(s.changes) for c in chosen):
            continue
        chosen.append(s)
        if len(chosen) == limit:
            break
    return chosen


def _changes(old: JobConfig, new: JobConfig) -> tuple[tuple[str, object, object], ...]:
    out = []
    for section in ("train", "cluster"):
        a, b = getattr(old, section), getattr(new, section)
        for key in ("micro_batch", "grad_accum", "loss", "block_kernels", "checkpointing", "optimizer", "lora_rank",
                    "base_quant", "seq_len", "sharding", "offload"):
            if hasattr(a, key) and getattr(a, key) != getattr(b, key):
                out.append((f"{section}.{key}", getattr(a, key), getattr(b, key)))
    return tuple(out)
