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

A second table prices sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3) under transformers 5.23 with nothing
padded: past its window each such layer gets a boolean mask, converted to a bf16 copy it keeps, and k/v repeated
(checks/stacks.py sliding_attention_mask), against the same model with its config.json's sliding_window set to null.
tests/test_sliding_window.py checks it against a real Gemma 3 forward and the replica's traced step.

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
SLIDING = """[model]
hf_config = "{config}"
[train]
stack = "hf"
transformers = "5.23.0"
precision = "bf16-mixed"
micro_batch = 2
seq_len = 4096
lora_rank = 16
lora_targets = "all-linear"
checkpointing = "{checkpointing}"
padding = "none"
[cluster]
gpu = "H100-80GB"
"""
# Gemma 2 is left out: its attention soft-capping is eager's or flash-attn's, not SDPA's.
SLIDING_PRESETS = ("gemma-3-1b", "gemma-3-27b", "mistral-7b", "phi-3-mini")


def sliding_rows(tmp: Path) -> list[dict]:
    """Each preset's allocated peak with its window and with config.json's sliding_window null."""
    from podkit.checks.presets import CONFIGS, PRESETS

    rows = []
    for name in SLIDING_PRESETS:
        cfg = CONFIGS[name][1]
        windowless = ({**cfg, "text_config": {**cfg["text_config"], "sliding_window": None}} if "text_config" in cfg
                      else {**cfg, "sliding_window": None})
        for checkpointing in ("none", "full"):
            row = {"model": name, "window": PRESETS[name].sliding_window,
                   "sliding": f"{len(PRESETS[name].sliding_layers)} of {PRESETS[name].layers}",
                   "checkpointing": checkpointing}
            for key, config in (("without", windowless), ("with", cfg)):
                path = tmp / f"{name}-{key}.json"
                path.write_text(json.dumps(config))
                row[key] = estimate(parse_job(SLIDING.format(config=path, checkpointing=checkpointing))).allocated
            rows.append(row)
    return rows


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
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sliding = sliding_rows(Path(tmp))
    lines += ["", "## Sliding-window layers past their window, nothing padded (transformers 5.23)", "",
              "LoRA r16 on every linear, bf16-mixed, 2 x 4096 tokens on an H100: preflight's allocated peak with the "
              "model's window, and with its config.json's sliding_window set to null.", "",
              "| model | sliding layers | window | checkpointing | without the window GiB | with it GiB | the window costs |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sliding:
        lines.append(f"| {r['model']} | {r['sliding']} | {r['window']} | {r['checkpointing']} | "
                     f"{r['without'] / GIB:.2f} | {r['with'] / GIB:.2f} | "
                     f"{(r['with'] - r['without']) / GIB:+.2f} GiB |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / "padding.md").write_text(text)
    (out / "padding.json").write_text(json.dumps({"date": str(datetime.date.today()), "rows": rows,
                                                  "sliding": sliding}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
