"""MemoryMonitor: podkit's memory and speed profiler, usable from any training loop.

    from podkit.train import MemoryMonitor

    with MemoryMonitor(every=10, tokens_per_step=b * s) as mon:
        for batch in loader:
            ...  # forward, backward, optimizer step
            mon.step()
    print(mon.summary())

Every `every` steps (and at the end) it records, from torch.cuda.memory_stats, allocated,
reserved, peak allocated/active/reserved, allocation retries and OOMs; from NVML the device's
memory used, utilisation, power and temperature; the mean step time, tokens/s and MFU over the
window, excluding the first `warmup` steps. It warns once per kind of trouble: allocator
retries (fragmentation or near-OOM), peak reserved near the card's capacity, OOMs, and memory
on the device that PyTorch does not account for.

Overhead: between samples, step() reads a clock. A sample synchronises the device once (so the
window's time is exact) and reads host-side counters and NVML: well under a millisecond.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .memprobe import AllocatorStats, CudaProbe

log = logging.getLogger("podkit.monitor")


def _finite(rec: dict) -> dict:
    """Strict JSON for the log file (no bare NaN): a non-finite number is written as null. Local, not
    podkit.checks.strict_json: the per-rank probe in a user's command loads nothing it does not need."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
GIB = 1 << 30
NEAR_CAPACITY = 0.90  # peak reserved above this share of the card: one longer batch from an OOM
FOREIGN_MEMORY = 2 * GIB  # device memory beyond PyTorch's reserved (context included) worth a warning


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Nvml:
    """The NVML handle of the GPU this process uses, or nothing when NVML is unavailable."""

    def __init__(self, device: torch.device):
        self.handle = None
        self.why = ""
        if device.type != "cuda":
            self.why = "no CUDA device"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            props = torch.cuda.get_device_properties(device)
            uuid = getattr(props, "uuid", None)
            # Map by UUID: CUDA_VISIBLE_DEVICES renumbers CUDA devices, NVML does not.
            if uuid is not None:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception as exc:  # ImportError, NVMLError: the monitor still works without it
            self.why = f"NVML unavailable: {exc}"
            self.handle = None

    def sample(self) -> dict:
        if self.handle is None:
            return {}
        n, h, out = self._nvml, self.handle, {}
        for key, read in (
            ("device_used", lambda: n.nvmlDeviceGetMemoryInfo(h).used),
            ("device_total", lambda: n.nvmlDeviceGetMemoryInfo(h).total),
            ("gpu_util", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
            ("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000),
            ("temperature_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        ):
            try:
                out[key] = read()
            except Exception:  # a field a card or driver does not expose
                out[key] = None
        return out

    def driver(self) -> str | None:
        if self.handle is None:
            return None
        try:
            v = self._nvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        except Exception:
            return None


# What a sampled record holds of the monitor's own (MemoryMonitor.sample, Nvml.sample): step(**extra) may not reuse them.
RECORD_KEYS = frozenset({"step", "step_time", "tokens_per_s", "mfu", "host_rss", "device_used", "device_total",
                         "gpu_util", "power_w", "temperature_c"}
                        | {f.name for f in dataclasses.fields(AllocatorStats)})


class MemoryMonitor:
    def __init__(self, every: int = 10, device: torch.device | str | None = None, *, tokens_per_step: int = 0,
                 flops_per_token: float = 0.0, peak_flops: float = 0.0, warmup: int = 3,
                 capacity: int | None = None, log_path: str | Path | None = None, probe=None,
                 snapshot_path: str | Path | None = None, snapshot_steps: int = 3):
        for name, value, whole in (("every", every, True), ("warmup", warmup, True), ("snapshot_steps", snapshot_steps, True),
                                   ("tokens_per_step", tokens_per_step, False), ("flops_per_token", flops_per_token, False),
                                   ("peak_flops", peak_flops, False)):
            kinds = (int,) if whole else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
                raise TypeError(f"MemoryMonitor: {name} must be a {'whole' if whole else 'finite'} number >= 0, "
                                f"got {value!r}")
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if log_path is not None and not isinstance(log_path, (str, Path)):
            raise TypeError(f"MemoryMonitor: log_path must be a path, got {log_path!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.every, self.warmup = every, warmup
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.probe = probe if probe is not None else (CudaProbe(self.device) if self.device.type == "cuda" else None)
        if capacity is None and self.device.type == "cuda":
            capacity = torch.cuda.get_device_properties(self.device).total_memory
        self.capacity = capacity
        self.log_path = Path(log_path) if log_path else None
        self.snapshot_path, self.snapshot_steps = snapshot_path, snapshot_steps
        self.records: list[dict] = []
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self.steps = 0
        self._timed_steps = 0
        self._timed_seconds = 0.0
        self._window_start: float | None = None
        self._window_steps = 0
        self._last_retries = 0
        self._history = False
        self.nvml: Nvml | None = None
        self._log_file = None
        self.device_peak = 0

    # -- context ----------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryMonitor":
        self.nvml = Nvml(self.device)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "a")
        if self.snapshot_path and self.probe is not None and hasattr(self.probe, "start_history"):
            self.probe.start_history()
            self._history = True
        self._sync()
        self._window_start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.dump_snapshot()
        if self.steps and (not self.records or self.records[-1]["step"] != self.steps):
            self.sample()
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        self._window_start = None  # a step after close starts again, as a new `with` would (the log appended)

    def dump_snapshot(self) -> None:
        """Write the allocator history of the first steps (also called on OOM, to see what was live)."""
        if not self._history:
            return
        try:
            self.probe.dump_history(str(self.snapshot_path))
        finally:
            self.probe.stop_history()
            self._history = False

    # -- per step ---------------------------------------------------------------------------------
    def step(self, **extra) -> dict | None:
        """Call once per optimizer step. Returns the record when this step was sampled. `extra` goes into the
        record (e.g. loss=loss.item(); a one-value tensor is read with .item())."""
        if self._window_start is None:  # used without `with`: start as `with` would, so log_path is written
            self.__enter__()
        taken = RECORD_KEYS & extra.keys()
        if taken:
            raise ValueError(f"MemoryMonitor.step: {', '.join(sorted(taken))} is the monitor's own record key; "
                             "pass your value under another name")
        extra = {k: v.item() if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1 else v
                 for k, v in extra.items()}
        self.steps += 1
        self._window_steps += 1
        if self._history and self.steps >= self.snapshot_steps:
            self.dump_snapshot()
        if self.steps == self.warmup:
            # Warm-up ends: compile, allocator growth and the snapshot are behind us.
            self._sync()
            self._window_start, self._window_steps = time.perf_counter(), 0
        if self.steps % self.every == 0:
            return self.sample(**extra)
        return None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # note: a CPU-GPU sync point, once per window

    def sample(self, **extra) -> dict:
        self._sync()
        now = time.perf_counter()
        rec: dict = {"step": self.steps, **extra}
        if self.steps > self.warmup and self._window_steps and self._window_start is not None:
            step_time = (now - self._window_start) / self._window_steps
            self._timed_seconds += now - self._window_start
            self._timed_steps += self._window_steps
            rec["step_time"] = step_time
            if self.tokens_per_step:
                rec["tokens_per_s"] = self.tokens_per_step / step_time
                if self.flops_per_token and self.peak_flops:
                    rec["mfu"] = rec["tokens_per_s"] * self.flops_per_token / self.peak_flops
        self._window_start, self._window_steps = now, 0
        if self.probe is not None:
            rec.update(asdict(self.probe.stats()))
        rec["host_rss"] = _rss_bytes()
        if self.nvml is not None:
            rec.update(self.nvml.sample())
            self.device_peak = max(self.device_peak, rec.get("device_used") or 0)
        self._check(rec)
        self.records.append(rec)
        if self._log_file:
            self._log_file.write(json.dumps(_finite(rec), allow_nan=False) + "\n")
            self._log_file.flush()
        return rec

    def _check(self, rec: dict) -> None:
        retries = rec.get("alloc_retries") or 0
        if retries > self._last_retries:
            self._warn("retries", f"step {rec['step']}: {retries - self._last_retries} allocation retries: the caching "
                       "allocator had to free its cache to find memory (fragmentation or near OOM); set "
                       "PYTORCH_ALLOC_CONF=expandable_segments:True or lower the micro-batch")
        self._last_retries = retries
        if rec.get("ooms"):
            self._warn("oom", f"step {rec['step']}: {rec['ooms']} out-of-memory errors so far")
        peak = rec.get("peak_reserved") or 0
        if self.capacity and self.device.type == "cuda" and peak > NEAR_CAPACITY * self.capacity:
            self._warn("capacity", f"step {rec['step']}: peak reserved {peak / GIB:.1f} GiB is "
                       f"{peak / self.capacity:.0%} of the card's {self.capacity / GIB:.1f} GiB: one longer batch "
                       "from an OOM")
        used, reserved = rec.get("device_used"), rec.get("reserved")
        if used and reserved is not None and used - reserved > FOREIGN_MEMORY:
            self._warn("foreign", f"step {rec['step']}: {(used - reserved) / GIB:.1f} GiB on the device is not "
                       "PyTorch's (CUDA context, NCCL, or another process)")

    def _warn(self, kind: str, message: str) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        self.warnings.append(message)
        log.warning(message)

    # -- results ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Run-level numbers: peaks over every sample, mean speed after warm-up."""
        out: dict = {"steps": self.steps, "warnings": list(self.warnings)}
        if self.probe is not None:
            s = self.probe.stats()
            out.update(peak_allocated=s.peak_allocated, peak_active=s.peak_active, peak_reserved=s.peak_reserved,
                       alloc_retries=s.alloc_retries, ooms=s.ooms)
        else:  # the keys the README lists, null, with why (strict JSON's rule: every null says why)
            out.update(dict.fromkeys(("peak_allocated", "peak_active", "peak_reserved", "alloc_retries", "ooms")))
            out["null_reasons"] = {f"/{k}": f"no CUDA caching allocator on {self.device.type}" for k in
                                   ("peak_allocated", "peak_active", "peak_reserved", "alloc_retries", "ooms")}
        reasons = out.setdefault("null_reasons", {})
        out["device_peak"] = self.device_peak or None
        if out["device_peak"] is None:
            reasons["/device_peak"] = (
                f"NVML reads a CUDA device's memory; this monitor's device is {self.device.type}"
                if self.device.type != "cuda" else "no sample taken" if not self.records
                else "NVML gave no reading for this device")
        rss = [r["host_rss"] for r in self.records if r.get("host_rss")]
        out["host_rss_peak"] = max(rss) if rss else None
        if not rss:
            reasons["/host_rss_peak"] = ("no sample taken" if not self.records
                                         else "/proc/self/statm was unreadable at every sample")
        if not reasons:
            del out["null_reasons"]
        if self._timed_steps:
            step_time = self._timed_seconds / self._timed_steps
            out["step_time"] = step_time
            if self.tokens_per_step:
                out["tokens_per_s"] = self.tokens_per_step / step_time
                if self.flops_per_token and self.peak_flops:
                    out["mfu"] = out["tokens_per_s"] * self.flops_per_token / self.peak_flops
        return out


def flops_per_token(params: int, layers: int, q_dim: int, seq_len: int, embedding: int = 0) -> float:
    """Training FLOPs per token: 6N for the matmul weights (embedding lookups excluded) plus the
    attention scores and values, 12 * layers * q_dim * seq_len (Chowdhery et al. 2022, PaLM, App. B).
    Counted for a causal model without halving, as PaLM and torchtitan do."""
    return 6 * (params - embedding) + 12 * layers * q_dim * seq_len
