"""Metric sinks on a real CPU smoke run: TensorBoard's own reader loads the event file, W&B offline
writes its run directory, both hold the same losses as metrics.jsonl; the key never on argv."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.smoke_helpers import ROOT, USER_LOOP


def smoke(tmp_path, *args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full.update(env or {})
    return subprocess.run([str(ROOT / "bin" / "smoke"), "--steps", "12", "--device", "cpu", "--output-dir",
                           str(tmp_path), "--run-id", "r", *args], capture_output=True, text=True, timeout=300,
                          env=full)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def wandb_offline_run(run: Path) -> tuple[str | None, list[dict]]:
    """The project and the history rows of the one offline W&B run under `run`, read with wandb's own reader."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    store = datastore.DataStore()
    store.open_for_scan(files[0])
    history, project = [], None
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
        elif kind == "run":
            project = record.run.project
    return project, history


def test_tensorboard_reader_loads_the_event_file(tmp_path):
    pytest.importorskip("tensorboard", reason="the TensorBoard sink is optional ([sinks] extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = smoke(tmp_path, "--sink", "tensorboard")
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "r"
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "memory/peak_allocated", "speed/tokens_per_s"} <= set(tags)
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 13))
    assert [e.value for e in events] == pytest.approx(losses(run), rel=1e-6)
    assert json.loads((run / "summary.json").read_text())["sinks"] == ["tensorboard"]


def test_wandb_offline_writes_its_run_dir_from_the_config_key(tmp_path):
    pytest.importorskip("wandb", reason="the W&B sink is optional ([sinks] extra)")

    job = tmp_path / "job.toml"
    job.write_text((ROOT / "checks" / "examples" / "tiny-cpu.toml").read_text()
                   + 'sinks = ["wandb"]\nwandb_project = "podkit-test"\n')
    out = smoke(tmp_path, "-c", str(job), env={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "r"
    project, history = wandb_offline_run(run)
    logged = [float(items["train/loss"]) for items in history]
    assert project == "podkit-test"
    assert logged == pytest.approx(losses(run), rel=1e-6)


def test_wandb_without_a_key_is_refused_before_the_run(tmp_path):
    pytest.importorskip("wandb", reason="the W&B sink is optional ([sinks] extra)")
    out = smoke(tmp_path, "--sink", "wandb")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "WANDB_API_KEY" in out.stderr and not (tmp_path / "r").exists()


# ---------------------------------------------------------------- bin/smoke -- COMMAND (the user's script)

TINY_TRAIN = USER_LOOP.format(extra="")


def script_smoke(tmp_path, *args, env=None):
    import sys

    (tmp_path / "tiny_train.py").write_text(TINY_TRAIN)
    full = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([str(ROOT / "bin" / "smoke"), "--steps", "12", "--output-dir", str(tmp_path), "--run-id", "r",
                           *args, "--", sys.executable, "tiny_train.py"], capture_output=True, text=True, timeout=300,
                          env=full, cwd=tmp_path)


def test_script_smoke_tensorboard_event_file_loads_in_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="the TensorBoard sink is optional ([sinks] extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = script_smoke(tmp_path, "--sink", "tensorboard")
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "r"
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # the built-in run's names: train/ for the step, memory/ and speed/ for the profiler's sample
    assert {"train/loss", "memory/peak_allocated", "speed/step_time"} <= tags, tags
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 13))
    assert [e.value for e in events] == pytest.approx(losses(run), rel=1e-6)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    profiled = {r["step"]: r["peak_allocated"] for r in records if "peak_allocated" in r}
    assert profiled and {e.step: e.value for e in acc.Scalars("memory/peak_allocated")} == pytest.approx(profiled)
    assert json.loads((run / "summary.json").read_text())["sinks"] == ["tensorboard"]


def test_script_smoke_wandb_offline_from_the_jobs_config(tmp_path):
    pytest.importorskip("wandb", reason="the W&B sink is optional ([sinks] extra)")

    job = tmp_path / "job.toml"
    job.write_text((ROOT / "checks" / "examples" / "tiny-cpu.toml").read_text()
                   + 'sinks = ["wandb"]\nwandb_project = "podkit-script"\n')
    out = script_smoke(tmp_path, "-c", str(job), env={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "r"
    project, history = wandb_offline_run(run)
    logged = [float(items["train/loss"]) for items in history if "train/loss" in items]
    assert project == "podkit-script"
    assert logged == pytest.approx(losses(run), rel=1e-6)


def test_script_smoke_wandb_without_a_key_is_refused_before_the_command_runs(tmp_path):
    pytest.importorskip("wandb", reason="the W&B sink is optional ([sinks] extra)")
    out = script_smoke(tmp_path, "--sink", "wandb")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert "WANDB_API_KEY" in out.stderr and not (tmp_path / "r").exists()


def test_the_follower_feeds_whole_lines_only_as_they_are_written(tmp_path):
    """Live: records reach the sinks while the command runs; a line cut mid-write waits for its end."""
    from podkit.train.script_smoke import MetricsFollower

    class Collect:
        def __init__(self):
            self.records = []

        def record(self, rec):
            self.records.append(rec)

    path = tmp_path / "metrics.rank0.jsonl"
    sinks = Collect()
    follower = MetricsFollower(path, sinks)
    follower.drain()  # no file yet: nothing, no error
    path.write_text('{"step": 1, "loss": 2.0, "time": 0.1, "step_time": 0.1}\n{"step": 2, "lo')
    follower.drain()
    assert sinks.records == [{"step": 1, "loss": 2.0, "time": 0.1}, {"profile": {"step": 1, "step_time": 0.1}}]
    with open(path, "a") as f:
        f.write('ss": 1.5, "step_time": 0.2, "peak_allocated": 4096}\n')
    follower.drain()
    assert sinks.records[2:] == [{"step": 2, "loss": 1.5}, {"profile": {"step": 2, "step_time": 0.2, "peak_allocated": 4096}}]
