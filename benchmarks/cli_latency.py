"""Wall time of the commands as a user runs them: the source of the README's latency figures.

Times, as subprocesses from the project root (so interpreter start and imports count, as they do
for a user): `bin/preflight --no-probe` and `bin/preflight` on the bundled example, `--repeat`
times each (median, min, max); `bin/preflight --no-probe` on each job of the accuracy ledger
(benchmarks/published/, its [published] table cut off), the fastest of 3 runs per job (a shared
host's stalls are not the job's): median, min and max over the jobs, the slowest named, as these
run the FSDP1 replays and the advisor's searches that real jobs run; `bin/preflight --traced` on
the bundled 1B example and on a 7B job
once each; `bin/smoke` on its CPU default (the tiny job, 100 steps) once, into a temporary
directory. Records the machine, its load average before and after (other work on a shared machine
shows up here), and the date. podkit's modules are byte-compiled first, as a user's second run finds
them: where PYTHONDONTWRITEBYTECODE is set, every run would otherwise compile each module changed
since its .pyc was last written.

    .venv/bin/python benchmarks/cli_latency.py     # writes benchmarks/results/cli_latency.{md,json}
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# A 7B job that --traced can run (no bitsandbytes layers) and that fits (exit 0):
# traced_vs_analytic.py's llama2-7b-bf16-adamw-accum4-h100 row.
JOB_7B = """[model]
preset = "llama-2-7b"
[train]
precision = "bf16"
optimizer = "adamw"
micro_batch = 2
grad_accum = 4
seq_len = 2048
[cluster]
gpu = "H100-SXM"
"""


def timed(argv: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> float:
    """Seconds of wall time for one run; an exit outside `ok` is an error (a benchmark of a failure is no
    figure)."""
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode not in ok:
        sys.exit(f"cli_latency: {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return seconds


def ledger_row(tmp: Path, env: dict[str, str]) -> dict:
    """bin/preflight --no-probe on each ledger job, the fastest of 3 runs; exit 1 (does not fit: the advisor
    searched) counts."""
    times = {}
    for path in sorted((ROOT / "benchmarks" / "published").glob("*/*.toml")):
        job = tmp / "ledger-job.toml"
        # A model config named relative to the case (hf_config = "dir/config.json") stays the case's own.
        text = re.sub(r'^(hf_config\s*=\s*")([^"/][^"]*)"', lambda m: f'{m[1]}{path.parent / m[2]}"',
                      path.read_text().split("[published]")[0], flags=re.M)
        job.write_text(text)
        argv = ["bin/preflight", "--no-probe", "--config", str(job)]
        times[f"{path.parent.name}/{path.stem}"] = min(timed(argv, env, ok=(0, 1)) for _ in range(3))
    slowest = max(times, key=times.get)
    over = sum(t > 0.5 for t in times.values())
    median = statistics.median(times.values())
    print(f"ledger jobs: median {median:.2f} s, {over} over 0.5 s", file=sys.stderr)
    return {"command": "bin/preflight --no-probe",
            "job": f"each of the {len(times)} ledger jobs (benchmarks/published/), fastest of 3; {over} over 0.5 s; "
                   f"slowest: {slowest}",
            "runs": len(times), "median_s": median, "min_s": min(times.values()), "max_s": times[slowest]}


def cpu_times() -> tuple[int, int]:
    """(all, steal) CPU ticks since boot (/proc/stat): on a virtual machine, steal is time the hypervisor
    gave this machine's CPUs to others, which stretches every wall time here."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs of each bin/preflight variant")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()

    env = {**os.environ, "NO_COLOR": "1"}
    for package in ("checks", "train", "envsetup", "pods", "podkit"):
        compileall.compile_dir(ROOT / package, quiet=1)
    load_before, ticks_before = os.getloadavg(), cpu_times()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        job_7b = Path(tmp) / "llama-2-7b-h100.toml"
        job_7b.write_text(JOB_7B)
        cases = [
            ("bin/preflight --no-probe", "bundled 1B example (A10G)", ["bin/preflight", "--no-probe"], args.repeat),
            ("bin/preflight", "bundled 1B example (A10G)", ["bin/preflight"], args.repeat),
            ("bin/preflight --traced", "bundled 1B example (A10G)", ["bin/preflight", "--traced"], 1),
            ("bin/preflight --traced", "llama-2-7b, pure bf16 AdamW, micro-batch 2 x 2048, H100",
             ["bin/preflight", "--config", str(job_7b), "--traced"], 1),
            ("bin/smoke", "CPU default: tiny job, 100 steps", ["bin/smoke", "--device", "cpu", "--output-dir",
                                                               str(Path(tmp) / "runs")], 1),
        ]
        for command, job, argv, n in cases:
            times = [timed(argv, env) for _ in range(n)]
            rows.append({"command": command, "job": job, "runs": n, "median_s": statistics.median(times),
                         "min_s": min(times), "max_s": max(times)})
            print(f"{command} ({job}): median {rows[-1]['median_s']:.2f} s over {n}", file=sys.stderr)
        rows.insert(2, ledger_row(Path(tmp), env))
    load_after, ticks_after = os.getloadavg(), cpu_times()
    ticks = ticks_after[0] - ticks_before[0]
    steal = (ticks_after[1] - ticks_before[1]) / ticks if ticks else 0.0

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, " \
              f"python {platform.python_version()}, torch {torch_version}"
    load = (f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1-minute load average); "
            f"{steal:.0%} of CPU time stolen by the hypervisor during the run")
    table = "| command | job | runs | median | min | max |\n| --- | --- | --- | --- | --- | --- |\n" + "\n".join(
        f"| `{r['command']}` | {r['job']} | {r['runs']} | {r['median_s']:.2f} s | {r['min_s']:.2f} s | {r['max_s']:.2f} s |"
        for r in rows)
    print(table)
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cli_latency.json").write_text(json.dumps(
        {"date": stamp, "machine": machine, "load_before": load_before, "load_after": load_after,
         "steal": round(steal, 3), "rows": rows},
        indent=2) + "\n")
    (RESULTS / "cli_latency.md").write_text(
        f"# Command latency, wall time ({stamp})\n\n"
        "Produced by `benchmarks/cli_latency.py`: each command run as a subprocess from the project root, "
        "interpreter start and imports included.\n\n"
        f"Machine: {machine}. Load: {load}.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
