"""Profiling overhead of the smoke run: the same training loop with and without MemoryMonitor.

Blocks of steps alternate between monitored and bare (ABAB...), so drift in clock speed or
thermals hits both alike; the ratio of the medians of the per-block step times is the overhead.
The monitor samples every `--every` steps (the smoke default, 10): one device sync, the
allocator's counters, NVML and a flushed JSON line. Runs on the GPU when there is one (the
bundled 1B example's shape at a short sequence), else the tiny CPU job.

    .venv/bin/python benchmarks/smoke_overhead.py            # writes benchmarks/results/smoke_overhead.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from podkit.checks.config import EXAMPLE_JOB, load_job  # noqa: E402
from podkit.train import model as model_mod  # noqa: E402
from podkit.train.data import SyntheticTokens  # noqa: E402
from podkit.train.monitor import MemoryMonitor  # noqa: E402
from podkit.train.optim import build_optimizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10, help="blocks per arm")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    job = load_job(EXAMPLE_JOB if cuda else ROOT / "checks" / "examples" / "tiny-cpu.toml")
    t = job.train
    seq = 1024 if cuda else t.seq_len
    precision = "bf16-mixed" if cuda else t.precision
    opts = model_mod.ModelOptions(attention="sdpa", checkpointing="none", max_seq_len=seq)
    model = model_mod.materialize(model_mod.build(job.shape, opts, precision), device, 0)
    opt = build_optimizer(model, "adamw", t.lr, t.weight_decay, device)
    data = SyntheticTokens(job.shape.vocab, seq, 1 if cuda else t.micro_batch)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else None

    def step() -> float:
        x, y = (b.to(device) for b in data.next_batch())
        if amp:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # the loop's own per-step sync, present in both arms

    for _ in range(5):
        step()  # warm-up: allocator growth, kernel selection
    times = {"monitor": [], "bare": []}
    with tempfile.TemporaryDirectory() as tmp:
        mon = MemoryMonitor(every=args.every, device=device, tokens_per_step=seq, warmup=0,
                            log_path=Path(tmp) / "m.jsonl")
        with mon:
            for block in range(2 * args.blocks):
                arm = "monitor" if block % 2 == 0 else "bare"
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    loss = step()
                    if arm == "monitor":
                        mon.step(loss=loss)
                if cuda:
                    torch.cuda.synchronize()
                times[arm].append((time.perf_counter() - t0) / args.steps)
    on, off = statistics.median(times["monitor"]), statistics.median(times["bare"])
    overhead = on / off - 1
    name = torch.cuda.get_device_name() if cuda else "CPU"
    result = {"date": time.strftime("%Y-%m-%d"), "device": name, "model": job.shape.name, "seq_len": seq,
              "every": args.every, "blocks": args.blocks, "steps_per_block": args.steps,
              "step_time_monitor_s": on, "step_time_bare_s": off, "overhead": overhead,
              "torch": torch.__version__}
    table = ("| device | model | step (bare) | step (monitored) | overhead |\n| --- | --- | --- | --- | --- |\n"
             f"| {name} | {job.shape.name}, seq {seq} | {off * 1e3:.2f} ms | {on * 1e3:.2f} ms | {overhead:+.2%} |")
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "gpu" if cuda else "cpu"
    (RESULTS / f"smoke_overhead_{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"smoke_overhead_{suffix}.md").write_text(
        f"# Profiling overhead ({result['date']}, torch {torch.__version__})\n\n"
        "Produced by `benchmarks/smoke_overhead.py`: median step time over alternating blocks "
        f"of {args.steps} steps, {args.blocks} blocks per arm, MemoryMonitor sampling every {args.every} steps.\n\n"
        + table + "\n")


if __name__ == "__main__":
    main()
