"""The verdict of a smoke run and the predicted-vs-measured table.

Measured terms come from allocator readings at fixed points of step 3 (optimizer states exist
and DDP has rebuilt its buckets) (see SmokeRun): params = after materialisation; grads = what the last backward
added (plus DDP's buckets, allocated when the model is wrapped); optimizer = what step 1 left
behind; and each phase's peak. The predicted side is checks/memory.py's estimate without the
device-only overhead (CUDA context, NCCL, fragmentation), which torch's allocator never sees;
the device row compares that overhead too, against NVML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from podkit.checks.memory import GIB, MemoryEstimate


@dataclass(frozen=True)
class Row:
    name: str
    predicted: int | None
    measured: int | None
    note: str = ""

    @property
    def error(self) -> float | None:
        """Signed relative error of the prediction: + means more was used than predicted."""
        if self.predicted is None or self.measured is None or self.predicted == 0:
            return None
        return (self.measured - self.predicted) / self.predicted

    def to_json(self) -> dict:
        err = self.error
        return {"name": self.name, "predicted": self.predicted, "measured": self.measured,
                "error": None if err is None else round(err, 4), "note": self.note}


def comparison(est: MemoryEstimate, marks: dict[str, int], peaks: dict[str, int], rises: dict[str, int],
               peak_allocated: int | None, device_peak: int | None, device_type: str,
               peak_reserved: int | None = None) -> list[Row]:
    def tensors(term: str, phase: str, lasting: bool = False) -> int:
        return sum(p.bytes for p in est.phase_parts[phase]
                   if p.term == term and p.where == "tensor" and not (lasting and p.transient))

    m = marks.get
    rows = [Row("params", tensors("params", "step"), m("materialized"), "weights as stored (this rank's shard)")]
    if m("grads_ready") is not None and m("step_start") is not None:
        buckets = (m("wrapped") or 0) - (m("materialized") or 0)
        rows.append(Row("grads", tensors("grads", "step"), m("grads_ready") - m("step_start") + buckets,
                        "added by step 3's backward" + (" (incl. DDP buckets)" if buckets else "")))
    if m("step_start") is not None and m("wrapped") is not None:
        # the states: the step's temporaries (foreach) are in the step's peak, not left behind
        rows.append(Row("optimizer", tensors("optimizer", "step", lasting=True), m("step_start") - m("wrapped"),
                        "states left by steps 1-2 (paged states are outside the allocator)"))
    fwd_extra = tensors("params", "forward-end") - tensors("params", "step")
    rows.append(Row("activations + loss", tensors("activations", "forward-end") + tensors("loss", "forward-end")
                    + fwd_extra, rises.get("forward"), "rise until backward reaches the blocks"))
    for phases, name in ((("forward-end",), "forward"), (("backward", "backward-end"), "backward"), (("step",), "step")):
        rows.append(Row(f"peak in {name}", max(est.phase_allocated(p) for p in phases), peaks.get(name),
                        "phase " + " / ".join(phases)))
    rows.append(Row("peak allocated", est.allocated, peak_allocated,
                    "torch.cuda.max_memory_allocated" if device_type == "cuda" else "tensor counter (CPU)"))
    if device_type == "cuda":
        rows.append(Row("peak reserved", est.reserved, peak_reserved, "torch.cuda.max_memory_reserved"))
        rows.append(Row("device (nvidia-smi)", est.total, device_peak, "incl. CUDA context, NCCL, paged states"))
    return rows


# The smoke run warns when a measured term strays this far from its prediction: the prediction is
# what users size their pods by, so a 10% miss is worth a line even when the run passed.
PREDICTION_TOLERANCE = 0.10


def prediction_warnings(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        err = r.error
        if err is not None and abs(err) > PREDICTION_TOLERANCE and max(r.predicted, r.measured) >= (1 << 20):
            out.append(f"{r.name}: measured {r.measured / GIB:.3f} GiB vs predicted {r.predicted / GIB:.3f} GiB "
                       f"({err:+.0%}): the prediction is off by more than {PREDICTION_TOLERANCE:.0%}")
    return out


# Exit codes by status (DESIGN.md: 0 ok, 1 failed, 3 out of memory; 130 is the shell's Ctrl-C).
EXIT_CODES = {"pass": 0, "failed": 1, "oom": 3, "interrupted": 130}


@dataclass
class Verdict:
    status: str  # pass | failed | oom | interrupted
    reasons: list[str] = field(default_factory=list)
    checks: dict[str, bool | None] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


def judge(losses: list[float], min_drop: float, peak: int | None, limit: int | None,
          planned_steps: int) -> Verdict:
    """pass: every step ran, no NaN/inf, the loss fell by min_drop, the peak stayed under the limit."""
    v = Verdict("pass")
    finite = all(math.isfinite(x) for x in losses)
    v.checks["finite_loss"] = finite and bool(losses)  # no loss seen is no evidence of a finite one
    if not finite:
        bad = next(i for i, x in enumerate(losses, 1) if not math.isfinite(x))
        v.reasons.append(f"loss is {losses[bad - 1]} at step {bad}")
    v.checks["all_steps"] = len(losses) == planned_steps
    if not losses:
        v.reasons.append("no loss was seen, so nothing shows the step trains")
    elif len(losses) != planned_steps:
        v.reasons.append(f"ran {len(losses)} of {planned_steps} steps")
    if finite and losses:
        tail = losses[-max(1, len(losses) // 10):]
        drop = 1 - (sum(tail) / len(tail)) / losses[0] if losses[0] else 0.0
        v.checks["loss_fell"] = drop >= min_drop
        if drop < min_drop:
            v.reasons.append(f"loss fell {drop:.0%} (from {losses[0]:.3f} to {tail[-1]:.3f}), less than the "
                             f"{min_drop:.0%} asked for: check the learning rate and the data")
    if limit:
        v.checks["under_limit"] = peak is None or peak <= limit
        if peak is not None and peak > limit:
            v.reasons.append(f"peak {peak / GIB:.2f} GiB over the limit of {limit / GIB:.2f} GiB")
    if v.reasons:
        v.status = "failed"
    return v
