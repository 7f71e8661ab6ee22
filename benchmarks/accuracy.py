"""podkit's prediction against peaks that other projects measured and published.

Each case in benchmarks/published/<project>/*.toml is a podkit job config plus a [published]
table: the source (repository and commit, or paper and table), the metric it measured
(allocated = torch.cuda.max_memory_allocated, reserved = max_memory_reserved, nvidia-smi = the
device), the value and its unit, and every assumption made to express it. The prediction for a
case is read for the same metric. A case marked `excluded` (e.g. torch.compile, which podkit does
not model) is listed but not scored. A case whose source leaves one job key open between two values
(`open = {key = "train.x", values = [a, b], why = "..."}`) is predicted at both, and its error is the
distance from the measurement to the nearer end of that range (none inside it).

Each case's job kind (checks/ledger.py) groups the cases; each kind's worst under-prediction goes to
checks/ledger_misses.json, which preflight's memory.ledger check reads.

Run: .venv/bin/python benchmarks/accuracy.py [--traced]
     (writes benchmarks/results/accuracy.{md,json} and checks/ledger_misses.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from podkit.checks import ledger  # noqa: E402
from podkit.checks.config import JobConfig, parse_job  # noqa: E402
from podkit.checks.memory import GIB, MemoryEstimate, estimate  # noqa: E402

PUBLISHED = ROOT / "benchmarks" / "published"
RESULTS = ROOT / "benchmarks" / "results"
UNITS = {"GB": 1e9, "GiB": float(GIB), "MB": 1e6, "MiB": float(1 << 20), "bytes": 1.0}
METRICS = ("allocated", "reserved", "nvidia-smi")


@dataclass
class Case:
    path: Path
    job: JobConfig
    project: str
    metric: str
    measured: int  # bytes
    source: str
    excluded: str
    open_jobs: tuple = ()
    """The job at each end of the key the source leaves open ([published] open), or none."""

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.stem}"


def load_case(path: Path) -> Case:
    raw = tomllib.loads(path.read_text())
    pub = raw.pop("published")
    metric, unit = pub["metric"], pub["unit"]
    if metric not in METRICS or unit not in UNITS:
        raise ValueError(f"{path}: metric {metric!r} / unit {unit!r} not understood")
    # The job part is re-serialised section by section so parse_job validates it like any job.
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    job = parse_job("\n".join(lines), str(path))
    open_jobs = ()
    if "open" in pub:
        section, key = pub["open"]["key"].split(".")
        open_jobs = tuple(job.replace(**{section: {key: v}}) for v in pub["open"]["values"])
    return Case(path, job, pub["project"], metric, int(pub["value"] * UNITS[unit]), pub["source"],
                pub.get("excluded", ""), open_jobs)


def predicted(est: MemoryEstimate, metric: str) -> int:
    return {"allocated": est.allocated, "reserved": est.reserved, "nvidia-smi": est.total}[metric]


def peak_moment(est: MemoryEstimate, metric: str) -> str:
    """The moment whose figure of this metric is the prediction (the first listed wins a tie, as in max)."""
    if metric == "nvidia-smi":
        return est.peak_phase
    of = est.phase_allocated if metric == "allocated" else est.phase_reserved
    return max(est.phase_parts, key=of)


def summary(errors: list[float]) -> dict:
    if not errors:
        return {"n": 0, "median": None, "max": None}
    absolute = [abs(e) for e in errors]
    return {"n": len(errors), "median": round(statistics.median(absolute), 4), "max": round(max(absolute), 4)}


def run(traced: bool = False) -> dict:
    cases = [load_case(p) for p in sorted(PUBLISHED.glob("*/*.toml"))]
    rows = []
    t0 = time.perf_counter()
    for case in cases:
        est = estimate(case.job)
        pred = predicted(est, case.metric)
        span = None
        if case.open_jobs:
            ends = sorted(predicted(estimate(j), case.metric) for j in case.open_jobs)
            # the range's point nearest the measurement (the measurement itself inside it)
            pred = min(max(case.measured, ends[0]), ends[-1])
            span = [ends[0], ends[-1]] if ends[0] != ends[-1] else None  # an open key this job does not feel
        row = {"case": case.name, "project": case.project, "metric": case.metric, "measured": case.measured,
               "predicted": pred, "error": round((pred - case.measured) / case.measured, 4),
               "peak_phase": peak_moment(est, case.metric), "kind": ledger.kind(case.job), "excluded": case.excluded,
               "source": case.source}
        if span:
            row["predicted_range"] = span
        if traced:
            from podkit.train.traced import trace  # imports torch

            tr = trace(case.job)
            row["traced"] = getattr(tr, case.metric if case.metric != "nvidia-smi" else "allocated", None)
        rows.append(row)
    scored = [r for r in rows if not r["excluded"]]
    by_metric = {m: summary([r["error"] for r in scored if r["metric"] == m]) for m in METRICS}
    return {
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.perf_counter() - t0, 2),
        "cases": len(rows),
        "scored": len(scored),
        "projects": sorted({r["project"] for r in scored}),
        "ranges": {"scored": sum(1 for r in scored if "predicted_range" in r),
                   "inside": sum(1 for r in scored if "predicted_range" in r
                                 and r["predicted_range"][0] <= r["measured"] <= r["predicted_range"][1])},
        "overall": summary([r["error"] for r in scored]),
        "by_metric": by_metric,
        "by_kind": ledger.misses(rows, {r["case"]: r["kind"] for r in rows}),
        "rows": rows,
    }


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def to_markdown(res: dict) -> str:
    out = [f"# Predicted vs published peaks ({res['date']})", "",
           f"{res['scored']} scored cases ({res['cases']} in the ledger) from {len(res['projects'])} projects "
           f"({', '.join(res['projects'])}); `benchmarks/accuracy.py`, cases in `benchmarks/published/`. "
           f"{res['ranges']['scored']} of them are predicted as a range, their source leaving one input open "
           f"(the error is to the range's nearer end): {res['ranges']['inside']} measured inside it.", "",
           "| metric | cases | median abs error | max abs error |", "| --- | --- | --- | --- |"]
    for name, s in list(res["by_metric"].items()) + [("all", res["overall"])]:
        if s["n"]:
            out.append(f"| {name} | {s['n']} | {s['median']:.1%} | {s['max']:.1%} |")
    out += ["", "By job kind (checks/ledger.py) and metric, the case whose peak read furthest above the prediction; "
            "preflight's memory.ledger check scales a job's device total by its kind's worst nvidia-smi or reserved "
            "miss and warns when the job would no longer fit:", "",
            "| job kind | metric | cases | worst error | case |", "| --- | --- | --- | --- | --- |"]
    for kind, by_metric in res["by_kind"].items():
        for metric, m in by_metric.items():
            out.append(f"| {kind} | {metric} | {m['cases']} | {m['error']:+.1%} | {m['case']} |")
    out += ["", "A predicted range is a case whose source leaves one input open (its `open` key): the error is to its "
            "nearer end, none inside.", "",
            "| case | metric | measured GiB | predicted GiB | error | peak moment |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(res["rows"], key=lambda r: (bool(r["excluded"]), r["case"])):
        note = f" (not scored: {r['excluded']})" if r["excluded"] else ""
        pred = "-".join(map(_gib, r["predicted_range"])) if r.get("predicted_range") else _gib(r["predicted"])
        out.append(f"| {r['case']}{note} | {r['metric']} | {_gib(r['measured'])} | {pred} | "
                   f"{r['error']:+.1%} | {r['peak_phase']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traced", action="store_true", help="also run the traced estimate (imports torch; slow)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results/ alone")
    args = ap.parse_args()
    res = run(args.traced)
    md = to_markdown(res)
    print(md)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "accuracy.md").write_text(md)
        (RESULTS / "accuracy.json").write_text(json.dumps(res, indent=2) + "\n")
        ledger.MISSES.write_text(json.dumps(res["by_kind"], indent=2) + "\n")


if __name__ == "__main__":
    main()
