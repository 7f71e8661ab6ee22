"""Metric sinks: TensorBoard and Weights & Biases, fed the same records as metrics.jsonl.

Off by default; `[smoke] sinks = ["tensorboard", "wandb"]` or `bin/smoke --sink NAME` switch them
on. Both are optional imports (pyproject's [sinks] extra): a sink asked for but not installed is bad
input, refused before the run. The pluggable shape follows torchtitan's components/metrics.py
(a logger with log(metrics, step) and close(), one per backend). W&B's key comes only from the
environment (WANDB_API_KEY, which the pod's env file exports), never from argv; without it W&B
must be told to run offline (WANDB_MODE=offline), else it would stop the run at a login prompt.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from podkit.checks.errors import ConfigError

SINKS = ("tensorboard", "wandb")
INSTALL = "pip install 'podkit[sinks]' (tensorboard, wandb), or make setup"


def check(names: tuple[str, ...]) -> None:
    """Refuse, as one line, a sink that cannot run here: before any step is paid for."""
    for name in names:
        if name == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("smoke.sinks", "tensorboard is not installed here", INSTALL)
        if name == "wandb":
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("smoke.sinks", "wandb is not installed here", INSTALL)
            mode = os.environ.get("WANDB_MODE", "")
            if not os.environ.get("WANDB_API_KEY") and mode not in ("offline", "disabled"):
                raise ConfigError("smoke.sinks", "wandb needs WANDB_API_KEY in the environment",
                                  "put it in the env file (make deploy forwards it to .podkit/env), "
                                  "or set WANDB_MODE=offline and `wandb sync` later")


def scalars(record: dict) -> tuple[int | None, dict[str, float]]:
    """(step, {name: value}) of a metrics.jsonl record: a step line, or a {"profile": sample} line
    (memory under memory/, speed under speed/). Non-finite and non-numeric values are left out."""
    if "profile" in record:
        sample = record["profile"]
        step = sample.get("step")
        prefix = {"tokens_per_s": "speed/", "mfu": "speed/", "step_time": "speed/"}
        items = {prefix.get(k, "memory/") + k: v for k, v in sample.items() if k not in ("step", "loss")}
    else:
        step = record.get("step")
        items = {"train/" + k: v for k, v in record.items() if k != "step"}
    out = {k: float(v) for k, v in items.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return step, out


def from_rank_record(record: dict) -> list[dict]:
    """A `bin/smoke -- COMMAND` record (train/rank_probe.py writes one per optimizer step: step,
    loss, time, step_time, and at profile steps the memory sample merged in) as the built-in run's
    two kinds of record, so both runs' scalars carry the same names (train/loss, memory/..., speed/...)."""
    step = record.get("step")
    sample = {k: v for k, v in record.items() if k not in ("loss", "time")}
    return [{k: record[k] for k in ("step", "loss", "time") if k in record}, {"profile": sample}] if step is not None else []


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard/, written by torch's SummaryWriter (needs tensorboard)."""

    def __init__(self, run_path: Path, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_path / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("job", "\n".join(f"    {line}" for line in config.get("toml", "").splitlines()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def summary(self, summary: dict) -> None:
        self.writer.add_text("verdict", f"{summary.get('status')}: {'; '.join(summary.get('reasons', []))}")

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in RUN_DIR/wandb/ (offline with WANDB_MODE=offline); the key only from the environment."""

    def __init__(self, run_path: Path, run_id: str, config: dict, project: str):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_id, id=None, dir=str(run_path), config=config.get("job", {}),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, summary: dict) -> None:
        for key in ("status", "loss_first", "loss_last", "peak_allocated", "peak_reserved", "predicted",
                    "tokens_per_s", "mfu", "prediction_error"):
            value = summary.get(key)
            if value is not None:
                self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish(exit_code=0)


class Sinks:
    """Every sink switched on, fed one record at a time; a sink that fails is dropped with a warning,
    never the run."""

    def __init__(self, names: tuple[str, ...], run_path: Path, run_id: str, config: dict, project: str, warn):
        self.sinks, self.warn = [], warn
        for name in names:
            try:
                self.sinks.append(TensorBoardSink(run_path, run_id, config) if name == "tensorboard"
                                  else WandbSink(run_path, run_id, config, project))
            except Exception as exc:  # a sink's own failure (a bad key, a full disk) costs only that sink
                warn(f"metric sink {name} not started: {type(exc).__name__}: {exc}")

    def record(self, record: dict) -> None:
        step, values = scalars(record)
        if step is None or not values:
            return
        for sink in list(self.sinks):
            try:
                sink.log(step, values)
            except Exception as exc:
                self.warn(f"metric sink {type(sink).__name__} dropped: {exc}")
                self.sinks.remove(sink)

    def close(self, summary: dict) -> None:
        for sink in self.sinks:
            try:
                sink.summary(summary)
                sink.close()
            except Exception as exc:
                self.warn(f"metric sink {type(sink).__name__} did not close cleanly: {exc}")
        self.sinks = []
