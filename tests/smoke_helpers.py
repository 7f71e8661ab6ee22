"""Shared by the smoke tests: tiny job files and running bin/smoke for real."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checks" / "examples" / "tiny-cpu.toml"


def tiny_job(tmp_path: Path, train: dict | None = None, cluster: dict | None = None, smoke: dict | None = None,
             name: str = "job.toml") -> Path:
    """The bundled tiny CPU job with some keys replaced (values as TOML literals)."""
    text = TINY.read_text()
    for section, changes in (("train", train), ("cluster", cluster), ("smoke", smoke)):
        for key, value in (changes or {}).items():
            text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
            if not n:
                text = text.replace(f"[{section}]\n", f"[{section}]\n{key} = {value}\n")
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(text)
    return path


def smoke(tmp_path: Path, *args: str, timeout: int = 240) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run bin/smoke into tmp_path/runs; returns the process and the run's summary.json."""
    out = tmp_path / "runs"
    run_id = f"t{len(list(out.glob('*'))) if out.exists() else 0}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PODKIT_RUN_ID", None)
    proc = subprocess.run([str(ROOT / "bin" / "smoke"), "--output-dir", str(out), "--run-id", run_id, *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    summary_path = out / run_id / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


# A user's own training script for `bin/smoke -- COMMAND`: a tiny regression that learns in seconds;
# `{extra}` is one more statement inside its loop (a crash, a hang, a print).
USER_LOOP = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(256, 16); y = x.sum(1, keepdim=True)
for step in range(1000):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    {extra}
print("SCRIPT RAN TO ITS END")
"""
