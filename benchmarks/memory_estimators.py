"""podkit's per-GPU peak against the formulas people use today, for a fixed set of jobs.

  accelerate   `accelerate estimate-memory`'s "Training using Adam": weights in the dtype x 4
               (accelerate/commands/estimate.py), not divided by GPUs, no activations.
  deepspeed    DeepSpeed's model-states estimators: ZeRO-2 4P + 16P/N (offload: 2P),
               ZeRO-3 4 x largest layer + 18P/N (optimizer offload: + 2P/N), and the ZeRO paper's
               2P + 2P + 12P/N for ZeRO-1 and 16P unsharded. Model states only.
  measured     torch.cuda.max_memory_allocated of a real training step of the same shapes: needs
               a GPU and the smoke run's model; this column says "n/a" where there was none.

Also times the preflight path (estimate + advisor) that must answer in well under a second.
Run: .venv/bin/python benchmarks/memory_estimators.py  (writes benchmarks/results/).
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from podkit.checks.advisor import advise  # noqa: E402
from podkit.checks.config import parse_job  # noqa: E402
from podkit.checks.memory import GIB, estimate, trainable_params  # noqa: E402

JOBS = {
    "1b-bf16-adamw-8k-h100": ('preset="llama-3.2-1b"', "micro_batch=2\nseq_len=4096", 'gpu="H100-SXM"'),
    "1b-bf16-adam8bit-sel-a10g": ('preset="llama-3.2-1b"',
                                  "optimizer='adamw8bit'\nseq_len=2048\ncheckpointing='selective'\ngrad_accum=16",
                                  'gpu="A10G"'),
    "8b-zero3-full-8xh100": ('preset="llama-3.1-8b"', "seq_len=4096\ncheckpointing='full'",
                             'gpu="H100-SXM"\ngpus_per_node=8\nsharding="zero3"'),
    "8b-zero2-full-8xa100": ('preset="llama-3.1-8b"', "seq_len=4096\ncheckpointing='full'",
                             'gpu="A100-80GB"\ngpus_per_node=8\nsharding="zero2"'),
    "8b-qlora-nf4-a10g": ('preset="llama-3.1-8b"',
                          "optimizer='paged_adamw8bit'\nseq_len=4096\ncheckpointing='full'\nlora_rank=16\nbase_quant='nf4'",
                          'gpu="A10G"'),
    "qwen7b-lora-sel-l40s": ('preset="qwen2.5-7b"', "micro_batch=2\nseq_len=2048\ncheckpointing='selective'\nlora_rank=16",
                             'gpu="L40S"'),
    "mistral7b-purebf16-8bit-h100": ('preset="mistral-7b"',
                                     "precision='bf16'\noptimizer='adamw8bit'\nseq_len=4096\ncheckpointing='selective'",
                                     'gpu="H100-SXM"'),
    "70b-zero3-offload-8xh100": ('preset="llama-3.1-70b"', "seq_len=4096\ncheckpointing='full'",
                                 'gpu="H100-SXM"\ngpus_per_node=8\nsharding="zero3"\noffload="optimizer"\nhost_ram_gb=2048'),
    "gpt2-fp32-b8-t4": ('preset="gpt2-124m"', "precision='fp32'\nmicro_batch=8\nseq_len=1024", 'gpu="T4"'),
}


def accelerate_style(job) -> int:
    dtype_bytes = job.train.compute_bytes
    return job.shape.params * dtype_bytes * 4


def deepspeed_style(job) -> int:
    P, N = job.shape.params, job.cluster.world_size
    largest = max(g.numel for g in job.shape.param_groups())  # DeepSpeed: largest module's own params
    stage, offload = job.cluster.sharding, job.cluster.offload
    if stage == "zero3":
        return 4 * largest + int((2 if offload != "none" else 18) * P / N)
    if stage == "zero2" or offload != "none":
        return 2 * P if offload != "none" else 4 * P + int(16 * P / N)
    if stage == "zero1":
        return 4 * P + int(12 * P / N)
    return 16 * P


def main() -> None:
    rows = []
    for name, (model, train, cluster) in JOBS.items():
        job = parse_job(f"[model]\n{model}\n[train]\n{train}\n[cluster]\n{cluster}\n", name)
        est = estimate(job)
        rows.append({
            "job": name,
            "gpu": f"{job.cluster.world_size}x{est.gpu.name}",
            "params_b": round(job.shape.params / 1e9, 3),
            "trainable_b": round(trainable_params(job) / 1e9, 4),
            "podkit_gib": round(est.total / GIB, 2),
            "podkit_allocated_gib": round(est.allocated / GIB, 2),
            "peak_phase": est.peak_phase,
            "loss_spike_gib": round(est.term("loss", "forward-end") / GIB, 2),
            "activations_gib": round(est.term("activations", "forward-end") / GIB, 2),
            "accelerate_gib": round(accelerate_style(job) / GIB, 2),
            "deepspeed_gib": round(deepspeed_style(job) / GIB, 2),
            "measured_gib": "n/a",  # no GPU path yet: bin/smoke (issue 3) measures on a GPU
            "capacity_gib": round(est.capacity / GIB, 1),
            "fits": est.fits,
        })

    # The preflight path: parse, estimate, advise, for the slowest case (a job that does not fit).
    text = "[model]\npreset='llama-3.1-70b'\n[train]\nseq_len=4096\n[cluster]\ngpu='H100-SXM'\ngpus_per_node=8\n"
    runs = []
    for _ in range(20):
        t0 = time.perf_counter()
        job = parse_job(text)
        estimate(job)
        advise(job)
        runs.append(time.perf_counter() - t0)
    runs.sort()
    latency = {"median_ms": round(runs[len(runs) // 2] * 1e3, 1), "max_ms": round(runs[-1] * 1e3, 1)}

    header = ["job", "gpu", "podkit", "of which loss", "accelerate", "deepspeed", "measured", "capacity", "fits"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['job']} | {r['gpu']} | {r['podkit_gib']} ({r['peak_phase']}) | {r['loss_spike_gib']} | "
                     f"{r['accelerate_gib']} | {r['deepspeed_gib']} | {r['measured_gib']} | {r['capacity_gib']} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    table = "\n".join(lines)
    today = datetime.date.today().isoformat()
    machine = f"{platform.machine()} {platform.processor() or platform.system()}, Python {platform.python_version()}"
    print(f"Per-GPU memory, GiB ({today}, {machine})\n")
    print(table)
    print(f"\npreflight path (parse + estimate + advise, 70B not fitting): median {latency['median_ms']} ms, "
          f"max {latency['max_ms']} ms over 20 runs")

    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_estimators.json").write_text(json.dumps(
        {"date": today, "machine": machine, "gpu_measurement": "none: no GPU in this run",
         "rows": rows, "preflight_latency": latency}, indent=2) + "\n")
    (out / "memory_estimators.md").write_text(
        f"# Memory estimators compared ({today})\n\nMachine: {machine}. No GPU: the measured column is n/a.\n"
        f"Produced by `benchmarks/memory_estimators.py`; GiB per GPU; podkit's peak phase in brackets.\n\n"
        f"{table}\n\nPreflight path latency: median {latency['median_ms']} ms, max {latency['max_ms']} ms.\n")


if __name__ == "__main__":
    main()
