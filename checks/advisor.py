"""The fit advisor: which levers make a job fit, and what each costs in speed.

Levers, from least to most intrusive: micro-batch (grad_accum raised to keep the effective
batch), flash-attn for a transformers model whose SDPA would get a padding mask, Liger's kernels for a Hugging Face
Trainer job (TrainingArguments use_liger_kernel: its fused
loss and block kernels, the same model and maths), activation checkpointing, an 8-bit optimizer (bitsandbytes', or
torchao's where FSDP2 shards the states), a higher sharding stage, CPU offload,
LoRA / QLoRA (changes what is trained), and the sequence length (changes the data) last.

Speed costs are rough step-time multipliers from published measurements, for ranking, not
for promising: full checkpointing repeats the forward pass, about +33% compute (Chen et al.
2016; Korthikanti et al. 2022); op-level selective recompute of pointwise ops is a few
percent; ZeRO-Offload keeps the step on the CPU (Ren et al. 2021); QLoRA's dequantization
makes it slower than LoRA (Dettmers et al. 2023).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from podkit.checks.config import JobConfig
from podkit.checks.errors import ConfigError
from podkit.checks.memory import MemoryEstimate, estimate

HEADROOM = 0.10  # below this a job "fits" but one longer batch away from an OOM

# By the policy the job's stack runs (stacks.AC_POLICIES): a stack whose "selective" is per-block recompute
# (Hugging Face, litgpt, torchtune, ...: checks/stacks.py) pays what "full" pays.
CHECKPOINT_COST = {"none": 1.0, "matmuls": 1.08, "op-sac": 1.08, "block": 1.33}
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
        if any(name == "train.attention" and new == "flash-attn" for name, _, new in self.changes):
            text += " (attn_implementation='flash_attention_2'; make deploy installs flash-attn)"
        return text


def _cost(job: JobConfig) -> float:
    t, c = job.train, job.cluster
    cost = CHECKPOINT_COST[job.facts.ac_policy] * SHARDING_COST[c.sharding] * OFFLOAD_COST[c.offload]
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
    if job.facts.stack.selective == "block":
        # One policy under two names: keep the job's own, else the name that says what it does.
        ckpts = [ck for ck in ckpts if ck != ("full" if t.checkpointing == "selective" else "selective")]
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
    # flash-attn for a transformers model whose SDPA gets a mask (stacks.AttentionMask): its flash_attention_2 path
    # unpads a padded batch (modeling_flash_attention_utils _upad_input) and takes packed rows by their position_ids,
    # so no mask is built or copied; where the GPU, precision and head size allow it (rules.flash_attention).
    attentions = [t.attention]
    if job.facts.masks and t.dtype != "fp32" and job.gpu.compute_capability >= (8, 0) \
            and job.shape.d_head <= 256 and job.shape.d_head % 8 == 0:
        attentions.append("flash-attn")
    seqs = [t.seq_len]
    if allow_seq:
        while seqs[-1] > 256:
            seqs.append(seqs[-1] // 2)
    for ck, sh, off, opt, (rank, quant), seq, lg, attn in itertools.product(ckpts, shardings, offloads, optimizers,
                                                                            loras, seqs, ligers, attentions):
        if off == "all" and sh != "zero3":
            continue  # parameter offload needs ZeRO-3 gathering
        if lg and ck == "selective" and job.facts.stack.selective in ("matmuls", "op-sac"):
            continue  # Liger's in-place RoPE under a selective checkpoint: refused (stacks.resolve)
        train = {"checkpointing": ck, "optimizer": opt, "lora_rank": rank, "base_quant": quant, "seq_len": seq,
                 "attention": attn}
        if lg:
            train |= {"loss": "liger", "block_kernels": "liger"}
        yield train, {"sharding": sh, "offload": off}


def _fits(est: MemoryEstimate, host_known: bool, total: int | None = None) -> bool:
    host_ok = not est.host_needed or not host_known or est.host_needed <= est.host_capacity
    return (est.total if total is None else total) <= est.capacity * (1 - HEADROOM) and host_ok


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
    job as given and from its nearest valid neighbours.

    Estimates cost milliseconds, a full one with its allocator replays tens of them, and a job far over its
    card has hundreds of options, so the search is a branch and bound on how each option could at best rank
    (`_rank`; a smaller micro-batch only ranks it lower): first bounded at the job's micro-batch, then, once
    taken up, at the largest micro-batch whose tensors alone fit (`_floor_index`, no replays), then estimated
    in full. It stops once no option left could displace the last one chosen, and skips one that could only
    rank below a suggestion it adds to. The result is the one estimating every option in full would give."""
    base_cost = _cost(job)
    host_known = job.cluster.host_ram_gb > 0
    seen: set = set()
    found: list[tuple[tuple, int, Suggestion]] = []
    for allow_seq in (False, True):  # the sequence length only when nothing else fits
        # (bound on the rank, option index, its micro-batches, floor index or None)
        heap = [(_rank(job, batches.at(0), 0, base_cost), index, batches, None)
                for index, batches in enumerate(valid_options(job, allow_seq, seen))]
        heapq.heapify(heap)
        while heap:
            bound, index, batches, first = heapq.heappop(heap)
            chosen = _choose(found, limit)
            if len(chosen) == limit and bound > chosen[-1][0][:-1]:
                break  # this option, and every one after it, ranks below the last chosen
            levers = _changes(job, batches.at(0))  # what any micro-batch of it changes
            if any(bound > c[0][:-1] and _dominated(levers, c[2].changes) for c in found):
                continue  # it would rank below a suggestion it only adds to: never chosen
            if first is None:
                first = _floor_index(batches, host_known)
                if first is not None:
                    heapq.heappush(heap, (_rank(job, batches.at(first), first, base_cost), index, batches, first))
                continue
            best = _largest_fitting(batches, first, host_known)
            if best is None:
                continue
            candidate, est, halvings = best
            changes = _changes(job, candidate)
            if changes:
                caveat = _caveat(job, candidate)
                slowdown = _cost(candidate) / base_cost * HALVING_COST ** halvings
                found.append((_rank(job, candidate, halvings, base_cost) + (est.total,), index,
                               Suggestion(changes, est, slowdown, caveat)))
        if found:
            break
    return [s for _, _, s in _choose(found, limit)]


def valid_options(job: JobConfig, allow_seq: bool, seen: set):
    """Each option to explore (its micro-batches: _Batches), from the job as given and from its nearest valid
    neighbours, once across the calls that share `seen`; those the stack cannot run are left out."""
    def unseen(train, cluster) -> bool:
        key = (tuple(sorted(train.items())), tuple(sorted(cluster.items())))
        if key in seen:
            return False
        seen.add(key)
        return True

    for train, cluster in (o for start in [job] + neighbours(job) for o in _options(start, allow_seq)):
        if not unseen(train, cluster):
            continue
        try:
            facts = job.replace(train=train, cluster=cluster).facts
        except ConfigError:
            continue  # LoRA where the model has none of the stack's default targets, as peft refuses it
        if facts.bnb_unsupported and train["optimizer"] == "adamw8bit" and facts.fsdp_version == 2:
            # The same 8-bit states from torchao, whose DTensor states shard with FSDP2 (rules._torchao_sharding).
            train = train | {"optimizer": "torchao_adamw8bit"}
            if not unseen(train, cluster):
                continue
        elif facts.bnb_unsupported:
            continue
        yield _Batches(job, train, cluster)


def _choose(found: list, limit: int) -> list:
    """The best `limit` of the (rank, option index, suggestion) found, in rank order (the option order
    breaking ties), skipping any that a suggestion already chosen dominates (`_dominated`): it is never
    better."""
    chosen: list = []
    for item in sorted(found, key=lambda f: f[:2]):
        if any(_dominated(item[2].changes, c[2].changes) for c in chosen):
            continue
        chosen.append(item)
        if len(chosen) == limit:
            break
    return chosen


def _dominated(changes, other) -> bool:
    """`changes` makes every change `other` makes, save that it may shorten the context further."""
    def split(cs):
        seq = [new for name, _, new in cs if name == "train.seq_len"]
        return {c for c in cs if c[0] != "train.seq_len"}, (seq[0] if seq else None)

    (rest, seq), (other_rest, other_seq) = split(changes), split(other)
    return other_rest <= rest and (other_seq is None or (seq is not None and seq <= other_seq))


def _rank(job: JobConfig, candidate: JobConfig, halvings: int, base_cost: float) -> tuple:
    """How a suggestion ranks, before its memory breaks ties: changes that alter what is trained last, then
    the slowdown, then the longest context kept, then the fewest changes. None of them improves as the
    micro-batch halves."""
    slowdown = _cost(candidate) / base_cost * HALVING_COST ** halvings
    return (bool(_caveat(job, candidate)), round(slowdown, 2), -candidate.train.seq_len,
            len(_changes(job, candidate)))


def _caveat(job: JobConfig, candidate: JobConfig) -> str:
    caveat = []
    if candidate.train.lora_rank and not job.train.lora_rank:
        caveat.append("trains LoRA adapters, not the full model")
    if candidate.train.base_quant != job.train.base_quant:
        caveat.append("4-bit base weights")
    if candidate.train.seq_len != job.train.seq_len:
        caveat.append("shorter context than intended")
    return "; ".join(caveat)


class _Batches:
    """An option at each micro-batch the advisor tries, largest first, the effective batch kept by
    accumulation."""

    def __init__(self, job: JobConfig, train: dict, cluster: dict) -> None:
        self.job, self.train, self.cluster = job, train, cluster
        self.sizes = _micro_batches(job.train.micro_batch)
        self.effective = job.train.micro_batch * job.train.grad_accum

    def at(self, i: int) -> JobConfig:
        b = self.sizes[i]
        return self.job.replace(train={**self.train, "micro_batch": b, "grad_accum": max(1, self.effective // b)},
                                cluster=self.cluster)


def _floor_index(batches: _Batches, host_known: bool) -> int | None:
    """The largest micro-batch (its index) whose tensors alone fit: no full estimate fits above it.

    Memory falls as the micro-batch halves once gradients accumulate, but not on the first halving of a job
    without accumulation: from there on the gradients are held through each forward (grad_accum 1 -> 2).
    So the job's own micro-batch on its own, then the smallest, which settles an option that fits at none
    (most of them, on a job far over its card), then a bisection between."""
    def fits(i: int) -> bool:
        lite = estimate(batches.at(i), replay=False)
        return _fits(lite, host_known, lite.floor)

    last = len(batches.sizes) - 1
    if fits(0):
        return 0
    if last == 0 or not fits(last):
        return None
    lo, hi, first = 1, last - 1, last
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            first, hi = mid, mid - 1
        else:
            lo = mid + 1
    return first


def _largest_fitting(batches: _Batches, first: int, host_known: bool):
    """(candidate, estimate, halvings) at the largest micro-batch from index `first` down that fits in full,
    or None. The floor puts `first` at or just above that micro-batch, so it steps down one at a time (which
    also holds where the first halving adds held gradients: _floor_index)."""
    for i in range(first, len(batches.sizes)):
        est = estimate(candidate := batches.at(i))
        if _fits(est, host_known):
            return candidate, est, i
    return None


def _changes(old: JobConfig, new: JobConfig) -> tuple[tuple[str, object, object], ...]:
    out = []
    for section in ("train", "cluster"):
        a, b = getattr(old, section), getattr(new, section)
        for key in ("micro_batch", "grad_accum", "attention", "loss", "block_kernels", "checkpointing", "optimizer",
                    "lora_rank", "base_quant", "seq_len", "sharding", "offload"):
            if hasattr(a, key) and getattr(a, key) != getattr(b, key):
                out.append((f"{section}.{key}", getattr(a, key), getattr(b, key)))
    return tuple(out)
