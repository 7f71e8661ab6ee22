"""How far published peaks of jobs like this one have read from podkit's prediction.

The public ledger (benchmarks/published/, scored by benchmarks/accuracy.py) measures the model, not one
job; where the model is known to read low for a kind of job, a user deciding whether a job fits on a card
should see that before renting it. benchmarks/accuracy.py groups its scored cases by `kind` and writes each
kind's worst under-prediction to ledger_misses.json beside this module (tests/test_ledger.py holds that
file to the ledger); preflight reads it here. Nothing in it changes the prediction itself.
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


def misses(rows: list[dict], kinds: dict[str, str]) -> dict[str, dict]:
    """Per kind, the scored case whose published peak read furthest above the prediction. `rows`:
    benchmarks/accuracy.py's; `kinds`: each case's kind."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["excluded"]:
            continue
        k = kinds[r["case"]]
        entry = out.setdefault(k, {"cases": 0, "metric": r["metric"], "error": r["error"], "case": r["case"]})
        entry["cases"] += 1
        if r["error"] < entry["error"]:
            entry.update(metric=r["metric"], error=r["error"], case=r["case"])
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, dict]:
    return json.loads(MISSES.read_text()) if MISSES.exists() else {}


def worst(job) -> Miss | None:
    """This job's kind's worst miss in the ledger; None where the ledger holds no case of its kind."""
    k = kind(job)
    entry = _load().get(k)
    return Miss(k, **entry) if entry else None
