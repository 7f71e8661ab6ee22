"""How far published peaks of jobs like this one have read from podkit's prediction.

The public ledger (benchmarks/published/, scored by benchmarks/accuracy.py) measures the model, not one
job; where the model is known to read low for a kind of job, a user deciding whether a job fits on a card
should see that before renting it. benchmarks/accuracy.py groups its scored cases by `kind` and writes each
kind's worst under-prediction per metric to ledger_misses.json beside this module (tests/test_ledger.py holds
that file to the ledger); preflight reads it here. Nothing in it changes the prediction itself.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

MISSES = Path(__file__).with_name("ledger_misses.json")


def kind(job) -> str:
    """The job's kind as the ledger groups its cases: stack, what is trained, dense or MoE, and how the
    model is spread over GPUs. Each part moves which of the model's terms dominate and which allocator
    pools it holds (checks/memory.py), so a miss in one kind says little about another."""
    f, t, c = job.facts, job.train, job.cluster
    if c.sharding == "none":
        spread = "one GPU" if c.gpus_per_node * c.nodes == 1 else "DDP"
    else:
        spread = f"FSDP{f.fsdp_version}" if f.fsdp_version else c.sharding
    if c.offload != "none":
        spread += " + offload"
    trained = ("QLoRA" if t.base_quant != "none" else "LoRA") if t.lora_rank else "full"
    return f"{f.stack.name} {trained}, {'MoE' if job.shape.moe else 'dense'}, {spread}"


# What the card holds, and so what an OOM is about: a miss in either says how far the device total may read low.
# An allocated miss does not bound them (the ledger's device misses run several times its allocated ones).
DEVICE_METRICS = ("nvidia-smi", "reserved")


@dataclass(frozen=True)
class Miss:
    """The furthest a published peak of one kind read above podkit's prediction of the same metric."""

    kind: str
    cases: int
    """Scored cases of this kind in the ledger."""
    metric: str
    """allocated, reserved or nvidia-smi (benchmarks/accuracy.py METRICS)."""
    error: float
    """(predicted - measured) / measured of that case: below 0 where the prediction read low."""
    case: str

    @property
    def ratio(self) -> float:
        """Measured over predicted for that case: what to scale this job's figure by to meet it."""
        return 1 / (1 + self.error)

    @property
    def above(self) -> float:
        """How far the measured peak read above the prediction, as a share of the prediction."""
        return self.ratio - 1


def misses(rows: list[dict], kinds: dict[str, str]) -> dict[str, dict[str, dict]]:
    """Per kind and metric, the scored case whose published peak read furthest above the prediction.
    `rows`: benchmarks/accuracy.py's; `kinds`: each case's kind."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["excluded"]:
            continue
        by_metric = out.setdefault(kinds[r["case"]], {})
        entry = by_metric.setdefault(r["metric"], {"cases": 0, "error": r["error"], "case": r["case"]})
        entry["cases"] += 1
        if r["error"] < entry["error"]:
            entry.update(error=r["error"], case=r["case"])
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, dict]:
    return json.loads(MISSES.read_text()) if MISSES.exists() else {}


def measured(job) -> dict[str, dict]:
    """The ledger's cases of this job's kind, per metric (empty where it has none)."""
    return _load().get(kind(job), {})


def worst(job) -> Miss | None:
    """The worst miss of this job's kind in a metric of what the card holds (DEVICE_METRICS); None where the
    ledger holds no such case of its kind."""
    k, by_metric = kind(job), measured(job)
    found = [Miss(k, metric=m, **by_metric[m]) for m in DEVICE_METRICS if m in by_metric]
    return min(found, key=lambda m: m.error) if found else None
