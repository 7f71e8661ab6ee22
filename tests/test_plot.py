"""The memory plot: drawn by matplotlib at the end of a smoke run, redrawn or overlaid by bin/plot
from fetched files; without matplotlib the run says so and writes everything else."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def smoke(tmp_path: Path, run_id: str, *args, env=None):
    return subprocess.run([str(ROOT / "bin" / "smoke"), "--steps", "12", "--device", "cpu", "--output-dir",
                           str(tmp_path), "--run-id", run_id, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_without_matplotlib_the_run_says_so_and_writes_the_rest(tmp_path):
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = smoke(tmp_path, "r", env={"PYTHONPATH": str(hide)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memory.png not drawn: matplotlib is not installed" in out.stderr
    run = tmp_path / "r"
    assert not (run / "memory.png").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "pass" and "plot" not in summary["files"]
    assert {"config", "env", "metrics", "summary", "snapshot", "log"} <= set(summary["files"])


def test_bin_plot_redraws_one_run_and_overlays_two(tmp_path):
    pytest.importorskip("matplotlib", reason="bin/plot draws with matplotlib ([plot] extra, installed by make setup)")
    assert smoke(tmp_path, "a").returncode == 0
    assert smoke(tmp_path, "b", "--inject-fault", "nan:3").returncode == 1
    (tmp_path / "a" / "memory.png").unlink()
    one = subprocess.run([str(ROOT / "bin" / "plot"), str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "a" / "memory.png").read_bytes()[:8] == PNG
    over = subprocess.run([str(ROOT / "bin" / "plot"), str(tmp_path / "a"), str(tmp_path / "b"), "-o",
                           str(tmp_path / "both.png")], capture_output=True, text=True, timeout=120)
    assert over.returncode == 0, over.stderr
    assert over.stdout.strip() == str(tmp_path / "both.png")
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG


def test_read_run_finds_every_rank(tmp_path):
    from podkit.train.plot import read_run

    (tmp_path / "summary.json").write_text(json.dumps({"device": "cpu", "predicted": 10, "status": "pass"}))
    for name, loss in (("metrics.jsonl", 1.0), ("metrics.rank1.jsonl", 2.0), ("metrics.rank10.jsonl", 3.0)):
        (tmp_path / name).write_text(json.dumps({"step": 1, "loss": loss}) + "\n{cut\n")
    runs = read_run(tmp_path)
    assert [r.label.split(" rank ")[1] for r in runs] == ["0", "1", "10"]
    assert [r.loss[0][1] for r in runs] == [1.0, 2.0, 3.0]


def test_what_a_killed_or_half_fetched_run_leaves_is_passed_over(tmp_path):
    """Review 2026-11-25: a summary.json cut mid-write, a metrics line that is JSON but no object, and bytes
    that are no text were tracebacks; another node's run directory (only metrics.rank1.jsonl) was refused."""
    from podkit.train.plot import read_run

    (tmp_path / "summary.json").write_text('{"status": "pa')
    (tmp_path / "metrics.rank1.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n5\nnull\n\xdf\xff garbage\n'
                                                   b'{"step": 2, "loss": 1.5}\n')
    [run] = read_run(tmp_path)
    assert run.loss == [(1, 2.0), (2, 1.5)] and run.label == tmp_path.name
    pytest.importorskip("matplotlib", reason="bin/plot draws with matplotlib ([plot] extra, installed by make setup)")
    out = subprocess.run([str(ROOT / "bin" / "plot"), str(tmp_path), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["written"] == [str(tmp_path / "memory.png")], out.stderr


def test_bin_plot_never_draws_over_a_file_podkit_did_not_write(tmp_path):
    pytest.importorskip("matplotlib", reason="bin/plot draws with matplotlib ([plot] extra, installed by make setup)")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    theirs = tmp_path / "figure.png"
    theirs.write_bytes(PNG + b"the user's own figure")

    def plot(*args):
        return subprocess.run([str(ROOT / "bin" / "plot"), *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    refused = plot(str(run), "-o", str(theirs))
    assert refused.returncode == 2 and "exists and podkit did not write it" in refused.stderr
    assert theirs.read_bytes() == PNG + b"the user's own figure"
    ours = tmp_path / "ours.png"
    assert plot(str(run), "-o", str(ours)).returncode == 0 and plot(str(run), "-o", str(ours)).returncode == 0
    assert plot(str(run)).returncode == 0 and plot(str(run)).returncode == 0  # the run's own memory.png, again


def test_per_rank_plots_are_named_by_rank_not_by_position(tmp_path):
    """Review 2026-11-25: another node's run (ranks 2 and 3) wrote rank 2's curves to memory.png and rank 3's to
    memory.rank1.png."""
    pytest.importorskip("matplotlib", reason="bin/plot draws with matplotlib ([plot] extra, installed by make setup)")
    for rank in (2, 3):
        (tmp_path / f"metrics.rank{rank}.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    out = subprocess.run([str(ROOT / "bin" / "plot"), str(tmp_path), "--per-rank", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["written"] == [str(tmp_path / "memory.rank2.png"), str(tmp_path / "memory.rank3.png")]
