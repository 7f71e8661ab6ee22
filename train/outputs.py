"""A run's directory, runs/<run-id>/: everything a smoke run leaves behind, also when it fails.

    config.toml           the job as resolved (defaults filled in, overrides applied)
    env.json              versions, GPU, driver, the env vars in effect, the allocator settings torch reports
    metrics.jsonl         one line per step (loss, lr, time) plus the profiler's samples, flushed every line
    summary.json          the verdict and the numbers (keys in DESIGN.md)
    memory.png            memory over the steps against the prediction
    memory_snapshot.pickle  allocator history of the first steps (drag into pytorch.org/memory_viz)
    smoke.log             the log
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from podkit.checks import strict_json
from podkit.checks.errors import ConfigError
from podkit.envsetup.secrets import SecretFilter, is_secret_name

# Variables recorded in env.json: what changes memory, speed or threading. Secrets never match.
ENV_PREFIXES = ("PYTORCH_", "CUDA_", "NCCL_", "TORCH_", "OMP_", "MKL_", "TOKENIZERS_", "HF_HOME", "HF_HUB_OFFLINE",
                "NVIDIA_", "LOCAL_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")

FILES = {"config": "config.toml", "env": "env.json", "metrics": "metrics.jsonl", "summary": "summary.json",
         "plot": "memory.png", "snapshot": "memory_snapshot.pickle", "log": "smoke.log"}


def new_run_id(job_source: str) -> str:
    """time-stem-random, the stem (a job file's, or a command's script (command_stem)) cut to what check_run_id's own
    advice allows: `bin/smoke -- python -c "print('hi')"` must not name a directory with quotes in it."""
    stem = Path(job_source).stem if job_source and not job_source.startswith("<") else "job"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:40].strip("-.") or "job"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-{secrets.token_hex(2)}"


def command_stem(command) -> str:
    """What names a `-- COMMAND` run: its script (the first word naming a .py or .sh file), else its program. Never
    its last word, which may be any argument (`--hf_token hf_...`): a secret in a directory name reaches every
    path in the log, the summary and fetch-logs' copy."""
    words = [Path(w).name for w in command]
    stem = next((w for w in words[1:] if w.endswith((".py", ".sh"))), words[0])
    return SecretFilter().text(stem)


def check_new_run_dir(root: Path, run_id: str, field: str = "--run-id") -> None:
    """A run id given by hand must name a new directory: a second run there would append its metrics to the
    first's metrics.jsonl and smoke.log and replace its summary, and the two could no longer be told apart."""
    if (root / run_id).exists():
        raise ConfigError(field, f"{root / run_id} already exists (an earlier run)",
                          "choose another --run-id, or leave it out for a fresh time-stamped one")


def decide_run_id(root: Path, given: str | None, stem: str, shared: bool = False) -> str:
    """The run directory's name, for the built-in run and `-- COMMAND` alike: --run-id (`given`), else
    PODKIT_RUN_ID from the environment (bin/pod run --nodes sets it on every node), else a fresh time-stamped
    name from `stem` (a job file's, or a command's script, command_stem). A name given either way must be a plain one and
    name a new directory: a second run there would mix its files into the first's, and a PODKIT_RUN_ID left
    exported names an earlier run. Unless `shared`: torchrun's ranks all open the directory their launcher
    checked, and the nodes of one multi-node run may share an output directory another node made already."""
    if given is not None:
        check_run_id(given)
        if not shared:
            check_new_run_dir(root, given)
        return given
    env = os.environ.get("PODKIT_RUN_ID")
    if not env:
        return new_run_id(stem)
    try:
        check_run_id(env)
    except ConfigError as exc:
        raise ConfigError("PODKIT_RUN_ID", exc.problem, exc.fix) from None
    if not shared and (root / env).exists():
        raise ConfigError("PODKIT_RUN_ID", f"{root / env} already exists (an earlier run)",
                          "unset PODKIT_RUN_ID for a fresh time-stamped run, or set it to a new name")
    return env


def check_run_id(run_id: str) -> str:
    """A run id names one directory under --output-dir: '../../x' or 'a/b' would write elsewhere."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\\" in run_id or "\0" in run_id \
            or run_id.startswith("-"):
        raise ConfigError("--run-id", f"{run_id!r} is not a plain directory name",
                          "use letters, digits, '-', '_' and '.', e.g. 20260101-lr3e4")
    return run_id


def check_output_root(root: Path, field: str) -> Path:
    """The directory runs go under, absolute and normalised; refused when it cannot be made: an
    existing ancestor that is a file (output_dir = "/etc/passwd/runs") or not writable. Writable is tried,
    not read from the mode bits: root passes os.access on /proc and on a read-only bind mount of some
    kernels, and the run then failed later, after it had said it was starting. The try makes a directory
    in the nearest existing ancestor (what the run does next) and removes it: nothing is left behind."""
    root = Path(os.path.normpath(root.absolute()))
    ancestor = root
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        where = f"{root} is a file" if ancestor == root else f"{root} lies under {ancestor}, which is a file"
        raise ConfigError(field, where, "point it at a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(field, f"{ancestor} is not writable (read-only or permission denied)",
                          "point it at a writable directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".podkit-write-test-", dir=ancestor))
    except OSError as exc:
        raise ConfigError(field, f"{ancestor} is not writable (making a directory there failed: "
                          f"{exc.strerror or exc})", "point it at a writable directory") from None
    return root


class RunDir:
    def __init__(self, root: str | Path, run_id: str):
        self.run_id = check_run_id(run_id)
        self.path = Path(root) / run_id
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics = None

    def file(self, key: str) -> Path:
        return self.path / FILES[key]

    def write_json(self, key: str, obj) -> None:
        text = strict_json.dumps(obj, indent=2, default=str) + "\n"
        tmp = self.file(key).with_suffix(".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, self.file(key))  # never a half-written summary, even when killed mid-write
        except OSError:
            # A full disk (ENOSPC) has no room for a second copy: overwrite in place, which first frees the
            # old file's blocks. Raises only when even that fails.
            tmp.unlink(missing_ok=True)
            try:
                self.file(key).write_text(text)
            except OSError:
                self.file(key).unlink(missing_ok=True)  # an empty env.json would only mislead
                raise

    def metric(self, record: dict) -> None:
        if self._metrics is None:
            self._metrics = open(self.file("metrics"), "a")
        self._metrics.write(strict_json.dumps(record) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None

    def present(self) -> dict[str, str]:
        return {key: name for key, name in FILES.items() if (self.path / name).exists()}


def resolved_toml(job) -> str:
    """The job as it ran: every field of every section, so a rerun needs nothing else."""
    from podkit.checks.config import SHAPE_KEYS

    lines = [f"# resolved by bin/smoke from {SecretFilter().text(str(job.source))}"]  # a comment: no value lost
    m = job.model
    by_dimensions = not (m.preset or m.hf_config or m.hf or m.params)
    for section in ("model", "train", "cluster", "smoke"):
        lines.append(f"\n[{section}]")
        for f in dataclasses.fields(getattr(job, section)):
            value = getattr(getattr(job, section), f.name)
            if section == "model" and (value in ("", 0, 0.0, False) and f.name != "tie_embeddings"
                                       or f.name in SHAPE_KEYS and not by_dimensions):
                continue  # unset model alternatives, or the shape keys a preset gives, would contradict it
            if f.name in ("hf_config", "dataset") and value:
                value = str(job.path(value).resolve())  # valid from the run directory too
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return json.dumps([str(x) for x in v])  # a JSON array of strings is a TOML array
    return json.dumps(str(v))


def _git_rev() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def allocator_settings() -> dict:
    """What the allocator actually uses, read back from torch rather than trusted from the env var
    (a typo in PYTORCH_CUDA_ALLOC_CONF is silently ignored by old torch and fatal in new)."""
    out: dict = {}
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            out["settings"] = getter()
            out["source"] = "torch._C._accelerator_getAllocatorSettings"
        except Exception as exc:  # a CPU build or an uninitialised allocator
            out["settings"], out["source"] = None, f"unreadable: {exc}"
    else:
        out["settings"], out["source"] = None, f"torch {torch.__version__} cannot report its allocator settings"
    if torch.cuda.is_available():
        try:
            out["backend"] = torch.cuda.memory.get_allocator_backend()
        except Exception:
            out["backend"] = None
    return out


def env_record(device: torch.device, world_size: int, nvml_driver: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k.startswith(ENV_PREFIXES) and not is_secret_name(k)}
    rec = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "podkit": _git_rev(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "bitsandbytes": _version("bitsandbytes"), "flash-attn": _version("flash-attn"),
                     "nvidia-ml-py": _version("nvidia-ml-py")},
        "device": str(device),
        "world_size": world_size,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "env": env,
        "allocator": allocator_settings(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        rec["gpu"] = {"name": p.name, "memory": p.total_memory, "compute_capability": f"{p.major}.{p.minor}",
                      "multiprocessors": p.multi_processor_count, "driver": nvml_driver,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if world_size > 1 else None}
        rec["sdpa"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                       "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                       "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                       "math": torch.backends.cuda.math_sdp_enabled()}
        rec["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return rec
