"""What a padded batch costs an HF Trainer job under SDPA, by transformers release: preflight's prediction, padded and
padding-free (TRL's flattened rows) against unpadded (train.padding), for Llama 3.1 8B LoRA r16 (q, v) at bf16-mixed
on an H100, 4 x 4096 tokens.

A padded batch gives the model an attention_mask with zeros, so it builds a (b, 1, s, s) mask (checks/stacks.py
AttentionMask): 4.40-4.52 an additive one in the embeddings' dtype, shared by every layer; 4.53 on a boolean one
that SDPA converts to a bf16 copy in every layer, which the memory-efficient kernel keeps for backward. From 4.54 an
unpadded batch hands SDPA grouped k/v unrepeated (enable_gqa), a padded one repeats them; a padding-free batch (TRL's
padding_free, or packing with its default 'bfd' strategy: one row of 16,384 tokens) gets a block-causal mask over the
whole row (with torch >= 2.6). tests/test_attention_mask.py checks each against a real transformers forward and the
replica's traced step.

    .venv/bin/python benchmarks/padding.py     # writes benchmarks/results/padding.{md,json}
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))

from podkit.checks.config import parse_job  # noqa: E402
from podkit.checks.kernels import attention_kernel  # noqa: E402
from podkit.checks.memory import estimate  # noqa: E402

GIB = 1 << 30
JOB = """[model]
preset = "llama-3.1-8b"
[train]
stack = "hf"
precision = "bf16-mixed"
micro_batch = 4
seq_len = 4096
lora_rank = 16
checkpointing = "{checkpointing}"
transformers = "{release}"
padding = "{padding}"
[cluster]
gpu = "H100-80GB"
"""
RELEASES = ("4.52.4", "4.53.3", "4.57.1", "5.23.0")


def main() -> int:
    rows = []
    for checkpointing in ("none", "full"):
        for release in RELEASES:
            row = {"checkpointing": checkpointing, "transformers": release}
            for padding in ("none", "padded", "flattened"):
                job = parse_job(JOB.format(checkpointing=checkpointing, release=release, padding=padding))
                est = estimate(job)
                row[padding] = {"allocated": est.allocated, "kernel": attention_kernel(job),
                                "k/v repeated": job.facts.repeat_kv}
            rows.append(row)
    lines = [f"# A padded batch under SDPA, by transformers release ({datetime.date.today()})", "",
             "Llama 3.1 8B, LoRA r16 on q and v, bf16-mixed, 4 x 4096 tokens on an H100 (`benchmarks/padding.py`): "
             "preflight's allocated peak.", "",
             "| checkpointing | transformers | unpadded GiB | kernel, k/v | padded GiB | kernel, k/v | padding costs "
             "| flattened GiB | kernel, k/v | flattening costs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        a, b, c = r["none"], r["padded"], r["flattened"]

        def how(x):
            return f"{x['kernel']}, {'repeated' if x['k/v repeated'] else 'grouped'}"

        lines.append(f"| {r['checkpointing']} | {r['transformers']} | {a['allocated'] / GIB:.2f} | {how(a)} | "
                     f"{b['allocated'] / GIB:.2f} | {how(b)} | {(b['allocated'] - a['allocated']) / GIB:+.2f} GiB | "
                     f"{c['allocated'] / GIB:.2f} | {how(c)} | {(c['allocated'] - a['allocated']) / GIB:+.2f} GiB |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / "padding.md").write_text(text)
    (out / "padding.json").write_text(json.dumps({"date": str(datetime.date.today()), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
