"""The GPU smoke matrix (benchmarks/smoke_gpu_matrix.py) runs only where a GPU is lent, for minutes at a time:
its plumbing is checked here on the CPU with the tiny model, so that a lent GPU is not spent on a broken script."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_one_row_on_the_cpu_measures_and_compares_against_the_prediction(tmp_path):
    script = ROOT / "benchmarks" / "smoke_gpu_matrix.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu-tiny", "--steps", "3",
                           "--only", "^llama-3.2-1b bf16-mixed adamw none $", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "smoke_gpu_matrix_cpu.json").read_text())
    (row,) = out["rows"]
    assert (row["preset"], row["precision"], row["micro_batch"], row["seq_len"]) == ("tiny", "bf16-mixed", 2, 128)
    assert row["status"] == "pass"
    assert abs(row["peak_allocated"] / row["predicted"] - 1) < 0.10  # the smoke's own 10% bound on a term
    assert "| tiny | bf16-mixed | adamw | none |" in (tmp_path / "smoke_gpu_matrix_cpu.md").read_text()
