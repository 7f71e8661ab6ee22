"""Predicted vs measured peak memory, tokens/s and MFU over a matrix of real smoke runs on a GPU.

Precisions x optimizers x checkpointing x micro-batch, for Llama 3.2 1B and a 7B shape
(Mistral 7B), and the other stacks' facts as bin/smoke emulates them (loss implementation,
checkpointing policy, LoRA targets and adapter dtype, optimizer kernel), each a `bin/smoke` run of
--steps steps (default 20); measured allocated, reserved and NVML device peaks against predicted. Prints a table and writes
benchmarks/results/smoke_gpu_matrix_<gpu>.{md,json} with the device and date.

    .venv/bin/python benchmarks/smoke_gpu_matrix.py             # on a GPU pod
    .venv/bin/python benchmarks/smoke_gpu_matrix.py --cpu-tiny  # the same plumbing on CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# (preset, precision, optimizer, checkpointing, micro_batch, seq_len[, extra [train] keys])
MATRIX = [
    ("llama-3.2-1b", "bf16-mixed", "adamw", "none", 2, 2048),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "selective", 4, 2048),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "full", 8, 2048),
    ("llama-3.2-1b", "bf16-mixed", "adamw8bit", "none", 2, 2048),
    ("llama-3.2-1b", "bf16-mixed", "paged_adamw8bit", "selective", 4, 2048),
    ("llama-3.2-1b", "bf16", "adamw", "none", 4, 2048),
    ("llama-3.2-1b", "fp16-mixed", "adamw", "selective", 2, 2048),
    ("llama-3.2-1b", "fp32", "adamw", "full", 2, 2048),
    ("llama-3.2-1b", "bf16-mixed", "lion", "none", 2, 2048),
    ("llama-3.2-1b", "bf16-mixed", "sgd", "full", 4, 2048),
    ("mistral-7b", "bf16", "adamw8bit", "full", 1, 2048),
    ("mistral-7b", "bf16", "adamw", "full", 1, 1024),
    ("mistral-7b", "bf16-mixed", "adamw8bit", "full", 1, 1024),
    ("mistral-7b", "bf16", "sgd", "selective", 1, 2048),
    # The stacks' facts, each measured where podkit's replica can emulate it.
    ("llama-3.2-1b", "bf16-mixed", "adamw", "full", 4, 2048, 'stack = "hf"\nlora_rank = 16'),
    ("llama-3.2-1b", "bf16", "adamw", "none", 4, 512, 'stack = "litgpt"\nlora_rank = 32\nlora_dropout = 0.05'),
    ("llama-3.2-1b", "bf16", "adamw", "full", 2, 4096, 'stack = "torchtune"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "selective", 2, 4096, 'stack = "torchtitan"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "none", 2, 2048, 'loss = "fused"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "none", 2, 2048, 'loss = "fp32-logits-kept"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "none", 2, 2048, 'optimizer_impl = "foreach"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "none", 1, 2048, 'attention = "eager"'),
    ("llama-3.2-1b", "bf16-mixed", "adamw", "selective", 4, 2048, 'lora_rank = 16\nlora_targets = "all-linear"'),
    ("mistral-7b", "bf16-mixed", "adamw", "full", 2, 2048, 'stack = "hf"\nlora_rank = 16\nlora_dropout = 0.05'),
    ("mistral-7b", "bf16", "paged_adamw8bit", "full", 1, 4096, 'lora_rank = 64'),
]


def job_toml(preset, precision, optimizer, checkpointing, micro, seq, gpu, extra="") -> str:
    # min_loss_drop 0: a row measures memory and speed over a few steps; whether the job learns is the
    # 100-step smoke's verdict (a 20-step CPU plumbing run of the tiny model drops 4%, not 5%).
    return (f'[model]\npreset = "{preset}"\n[train]\nprecision = "{precision}"\noptimizer = "{optimizer}"\n'
            f'checkpointing = "{checkpointing}"\nmicro_batch = {micro}\nseq_len = {seq}\nlr = 3e-4\n{extra}\n'
            f'[cluster]\ngpu = "{gpu}"\n[smoke]\nmin_loss_drop = 0\nprofile_every = 5\n')


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-tiny", action="store_true", help="run the matrix's plumbing on CPU with the tiny model")
    ap.add_argument("--only", default="", help="regex over 'preset precision optimizer checkpointing'")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the table and JSON go")
    args = ap.parse_args()
    import torch

    if not args.cpu_tiny and not torch.cuda.is_available():
        print("smoke_gpu_matrix: no CUDA GPU here; run it on a pod (or --cpu-tiny to check the plumbing)",
              file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if not args.cpu_tiny else "CPU"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (preset, prec, opt, ckpt, micro, seq, *rest) in enumerate(MATRIX):
            extra = rest[0] if rest else ""
            label = f"{preset} {prec} {opt} {ckpt} {extra}".replace("\n", " ")
            if args.only and not re.search(args.only, label):
                continue
            if args.cpu_tiny:
                preset, seq, micro = "tiny", 128, min(micro, 4)
                if opt in ("adamw8bit", "paged_adamw8bit") and prec == "fp16-mixed":
                    continue
            path = Path(tmp) / f"job{i}.toml"
            path.write_text(job_toml(preset, prec, opt, ckpt, micro, seq, "H100" if args.cpu_tiny else gpu, extra))
            cmd = [str(ROOT / "bin" / "smoke"), "-c", str(path), "--steps", str(args.steps), "--json",
                   "--output-dir", str(Path(tmp) / "runs"), "--device", "cpu" if args.cpu_tiny else "cuda"]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            try:
                s = json.loads(proc.stdout)
            except json.JSONDecodeError:
                s = {"status": f"no summary (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
            row = {"preset": preset, "precision": prec, "optimizer": opt, "checkpointing": ckpt,
                   "extra": extra.replace("\n", ", "), "predicted_reserved": s.get("predicted_reserved"),
                   "micro_batch": micro, "seq_len": seq, "status": s.get("status"),
                   "predicted": s.get("predicted"), "peak_allocated": s.get("peak_allocated"),
                   "peak_reserved": s.get("peak_reserved"), "device_peak": s.get("device_peak"),
                   "predicted_device": s.get("predicted_device"), "tokens_per_s": s.get("tokens_per_s"),
                   "mfu": s.get("mfu"), "memory": s.get("memory"), "wall_s": round(time.time() - t0, 1)}
            rows.append(row)
            print(_line(row), flush=True)
    table = _table(rows)
    print(table)
    date = time.strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = {"date": date, "device": gpu, "torch": torch.__version__, "steps": args.steps, "rows": rows}
    (args.out / f"smoke_gpu_matrix_{slug}.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / f"smoke_gpu_matrix_{slug}.md").write_text(
        f"# Smoke matrix on {gpu} ({date}, torch {torch.__version__}, {args.steps} steps each)\n\n"
        "Produced by `benchmarks/smoke_gpu_matrix.py`. error = measured / predicted - 1 for "
        "torch's peak allocated.\n\n" + table + "\n")
    return 0


def _err(measured, predicted) -> str:
    return f"{measured / predicted - 1:+.1%}" if measured and predicted else "-"


def _line(r) -> str:
    gib = 1 << 30
    peak = f"{r['peak_allocated'] / gib:.2f}" if r["peak_allocated"] else "-"
    pred = f"{r['predicted'] / gib:.2f}" if r["predicted"] else "-"
    tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
    return (f"| {r['preset']} | {r['precision']} | {r['optimizer']} | {r['checkpointing']} | {r.get('extra') or ''} | "
            f"{r['micro_batch']}x{r['seq_len']} | {r['status']} | {pred} | {peak} | "
            f"{_err(r['peak_allocated'], r['predicted'])} | {_err(r.get('peak_reserved'), r.get('predicted_reserved'))} | "
            f"{_err(r.get('device_peak'), r.get('predicted_device'))} | {tps} | {mfu} |")


def _table(rows) -> str:
    head = ("| model | precision | optimizer | checkpointing | stack keys | batch | status | predicted GiB | "
            "measured GiB | allocated error | reserved error | device error | tokens/s | MFU |\n|" + " --- |" * 14)
    return "\n".join([head] + [_line(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
