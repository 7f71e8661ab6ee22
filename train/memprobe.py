"""Where measured memory comes from: the CUDA caching allocator, or a tensor counter on CPU.

Both answer the same questions (bytes allocated now, the peak since a reset, the peak over the
whole run) so the step loop, the predicted-vs-measured comparison and MemoryMonitor read one
interface. The probe is the only owner of peak resets: it folds each window's peak into the
run's peak first, so resetting for a phase never loses the overall maximum.

On CUDA the numbers are the allocator's host-side counters: reading them does not synchronise.
On CPU there is no allocator to ask, so TensorCounter, a TorchDispatchMode, counts the bytes of
every tensor storage an op creates and a weakref finalizer subtracts them when it is freed. It
costs Python time per op, so the smoke run enables it only for its first steps, like the CUDA
memory history; storages it saw keep being subtracted when they die after it is switched off.
"""

from __future__ import annotations

import contextlib
import pickle
import time
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from podkit.checks.allocator import round_size

OOM_ERROR = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# What torch's CPU allocator raises when malloc fails (c10/core/impl/alloc_cpu.cpp, torch 2.13:
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"), a RuntimeError.
CPU_OOM_TEXT = "can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM, Python's MemoryError, or the CPU allocator's failure: all are oom/3, not a crash. One rule for
    the built-in run (train/smoke.py) and a user's command (train/rank_probe.py)."""
    return isinstance(exc, (OOM_ERROR, MemoryError)) or (isinstance(exc, RuntimeError) and CPU_OOM_TEXT in str(exc))


@dataclass(frozen=True)
class AllocatorStats:
    """torchtitan's DeviceMemStats, in bytes: what matters for an OOM post-mortem."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_active: int
    peak_reserved: int
    alloc_retries: int
    ooms: int


class CudaProbe:
    kind = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self._run_peak = {"allocated": 0, "active": 0, "reserved": 0}

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def window_peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        self._fold()
        torch.cuda.reset_peak_memory_stats(self.device)

    def _fold(self) -> dict:
        s = torch.cuda.memory_stats(self.device)
        for key in self._run_peak:
            self._run_peak[key] = max(self._run_peak[key], s.get(f"{key}_bytes.all.peak", 0))
        return s

    def stats(self) -> AllocatorStats:
        s = self._fold()
        return AllocatorStats(
            allocated=s.get("allocated_bytes.all.current", 0),
            reserved=s.get("reserved_bytes.all.current", 0),
            peak_allocated=self._run_peak["allocated"],
            peak_active=self._run_peak["active"],
            peak_reserved=self._run_peak["reserved"],
            alloc_retries=s.get("num_alloc_retries", 0),
            ooms=s.get("num_ooms", 0),
        )

    # The allocator's own history: what PyTorch's memory_viz (pytorch.org/memory_viz) reads.
    def start_history(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=200_000)

    def dump_history(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)

    def stop_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_block_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator counts as allocated for one storage: its round_size (checks/allocator.py,
    the rule preflight's replay uses too); an empty storage allocates nothing."""
    return 0 if nbytes == 0 else round_size(nbytes)


def _address(storage) -> int:
    try:
        return storage.data_ptr()
    except Exception:  # a storage without data (meta, fake): no address to show
        return 0


class TensorCounter(TorchDispatchMode):
    """Live tensor bytes on CPU, with a trace in memory_viz's snapshot format.

    The traced estimate (train/traced.py) runs it under FakeTensorMode with `block_bytes` set to
    the CUDA allocator's rounding, and sorts the live bytes by what they are (`category`, set by
    the phase; `reclassify` for gradients and optimizer states; `classify` for outputs an op makes
    from a parameter, such as autocast's weight cache). `scratch` adds the workspace a kernel
    allocates and frees inside one op (flash attention's backward) to the peak. `substitute` may run
    an op as the GPU would where a dispatch mode changes it (it returns None to run the op as called).
    """

    kind = "tensor-counter"

    def __init__(self, trace_limit: int = 200_000, block_bytes=None, classify=None, scratch=None, substitute=None):
        super().__init__()
        self._substitute = substitute
        self.live = 0
        self._window_peak = 0
        self._run_peak = 0
        self._sizes: dict[int, tuple[int, int, str]] = {}  # id(storage) -> (bytes, address, category)
        self._trace: list[dict] | None = None
        self._trace_limit = trace_limit
        self._block_bytes = block_bytes
        self._classify = classify
        self._scratch = scratch
        self.category = "activations"
        self.by_category: dict[str, int] = {}
        self._window_split: dict[str, int] = {}
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._substitute(func, args, kwargs) if self._substitute is not None else None
        if out is None:
            out = func(*args, **kwargs)
        category = self._classify(func, args, self) if self._classify is not None else None
        for t in tree_leaves(out):
            for plain in _plain_tensors(t):
                self._track(plain.untyped_storage(), func, category)
        if self._scratch is not None:
            extra = self._scratch(func, args)
            if extra and self.live + extra > self._window_peak:
                self._window_peak = self.live + extra
                self._window_split = dict(self.by_category)
                self._window_split["temporaries"] = self._window_split.get("temporaries", 0) + extra
        return out

    def _size(self, storage) -> int:
        n = storage.nbytes()
        return self._block_bytes(n) if self._block_bytes is not None else n

    def _track(self, storage, func, category: str | None = None) -> None:
        key = id(storage)
        if key in self._sizes:
            return  # a view or an in-place result: no new memory
        n = self._size(storage)
        addr = _address(storage) if self._trace_limit else 0  # the traced estimate (fake storages) keeps no trace
        category = category or self.category
        self._sizes[key] = (n, addr, category)
        self._add(category, n)
        if self._trace is not None and len(self._trace) + 2 <= self._trace_limit:
            # On CPU every storage is its own malloc: a segment of exactly its size, as memory_viz's
            # "segment_alloc" (cudaMalloc) then "alloc" (the block in it) spell it.
            now = time.perf_counter_ns() // 1000
            frames = [{"filename": "aten", "line": 0, "name": str(func)}]
            for action in ("segment_alloc", "alloc"):
                self._trace.append({"action": action, "addr": addr, "size": n, "stream": 0, "device_free": 0,
                                    "time_us": now, "frames": frames})
        weakref.finalize(storage, self._free, key)

    def _add(self, category: str, n: int) -> None:
        self.live += n
        self.by_category[category] = self.by_category.get(category, 0) + n
        if self.live > self._window_peak:
            self._window_peak = self.live
            self._window_split = dict(self.by_category)

    def _free(self, key: int) -> None:
        n, addr, category = self._sizes.pop(key, (0, 0, ""))
        self.live -= n
        if category:
            self.by_category[category] -= n
        if self._trace is not None and len(self._trace) + 3 <= self._trace_limit:
            now = time.perf_counter_ns() // 1000
            for action in ("free_requested", "free_completed", "segment_free"):
                self._trace.append({"action": action, "addr": addr, "size": n, "stream": 0, "device_free": 0,
                                    "time_us": now, "frames": []})

    def category_of(self, storage) -> str:
        entry = self._sizes.get(id(storage))
        return entry[2] if entry else ""

    def reclassify(self, tensor: torch.Tensor, category: str) -> None:
        """Count a tensor's storage (tracked or not) under `category` from now on."""
        for plain in _plain_tensors(tensor):
            storage = plain.untyped_storage()
            key = id(storage)
            if key not in self._sizes:
                self._track(storage, None, category)
                continue
            n, addr, old = self._sizes[key]
            if old != category:
                self._sizes[key] = (n, addr, category)
                self.by_category[old] -= n
                self.by_category[category] = self.by_category.get(category, 0) + n

    def resized(self, storage, category: str) -> None:
        """UntypedStorage.resize_ (FSDP2 allocates and frees unsharded parameters this way) bypasses
        the dispatcher: the caller reports it, and the storage counts under `category` from then on."""
        key = id(storage)
        n = self._size(storage)
        if key not in self._sizes:
            if n:
                self._track(storage, None, category)
            return
        old, addr, cat = self._sizes[key]
        self._sizes[key] = (n, addr, category)
        self.live -= old
        self.by_category[cat] -= old
        self._add(category, n)

    def window_split(self) -> dict[str, int]:
        """Live bytes by category at the window's peak."""
        return dict(self._window_split)

    # -- the probe interface ------------------------------------------------------------------
    def allocated(self) -> int:
        return self.live

    def window_peak(self) -> int:
        return self._window_peak

    def reset_peak(self) -> None:
        self._run_peak = max(self._run_peak, self._window_peak)
        self._window_peak = self.live
        self._window_split = dict(self.by_category)

    def stats(self) -> AllocatorStats:
        peak = max(self._run_peak, self._window_peak)
        return AllocatorStats(self.live, self.live, peak, peak, peak, 0, 0)

    def start_history(self) -> None:
        self._trace = []

    def stop_history(self) -> None:
        self._trace = None

    def dump_history(self, path: str) -> None:
        """The snapshot in torch.cuda.memory._snapshot()'s format (torch/cuda/memory.py, _snapshot's
        docstring: Segment, Block, TraceEntry; torch 2.13), so `python -m torch.cuda._memory_viz
        trace | segments | segment_plot | trace_plot` and pytorch.org/memory_viz read it: one segment
        per live storage at its real address (CPU storages are separate mallocs), no invented segment."""
        segments = []
        for n, addr, _ in sorted(self._sizes.values(), key=lambda v: v[1]):
            if not n:
                continue
            block = {"address": addr, "size": n, "requested_size": n, "state": "active_allocated", "frames": []}
            segments.append({"device": 0, "address": addr, "total_size": n, "allocated_size": n, "active_size": n,
                             "requested_size": n, "stream": 0, "segment_type": "large" if n > (1 << 20) else "small",
                             "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": [block]})
        snapshot = {"segments": segments, "device_traces": [list(self._trace or [])],
                    "allocator_settings": {"source": "podkit TensorCounter (CPU): one malloc per storage"}}
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)

    # -- switching ------------------------------------------------------------------------------
    def switch_on(self) -> None:
        if not self.active:
            self.__enter__()
            self._follow_resizes()
            self.active = True

    def switch_off(self) -> None:
        if self.active:
            self.__exit__(None, None, None)
            torch.UntypedStorage.resize_ = self._original_resize
            self.active = False

    def _follow_resizes(self) -> None:
        """FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_
        (torch/distributed/fsdp/_fully_shard/_fsdp_common.py _alloc_storage/_free_storage), which
        the dispatcher never sees: unfollowed, the first all-gather's outputs stay counted as live
        for the rest of the run (a ZeRO-3 smoke measured its optimizer term at twice the states)."""
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize(storage, size):
            out = original(storage, size)
            self.resized(storage, "params")
            return out

        torch.UntypedStorage.resize_ = resize


def _plain_tensors(t) -> list[torch.Tensor]:
    """The tensors that own memory: a wrapper subclass (FSDP2's DTensor) owns none itself and
    its local shard is created while this mode is paused, so count its inner tensors instead."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for name in names for x in _plain_tensors(getattr(t, name))]
    return [t]


def make_probe(device: torch.device):
    return CudaProbe(device) if device.type == "cuda" else TensorCounter()


class PhasePeaks:
    """Peak bytes above the start of each phase of a step (forward, backward, step), over all
    measured steps, plus the allocated level at marked points: the measured side of the
    predicted-vs-measured table."""

    def __init__(self, probe):
        self.probe = probe
        self.peaks: dict[str, int] = {}  # phase -> highest absolute peak
        self.rises: dict[str, int] = {}  # phase -> highest peak minus the level at its start
        self.marks: dict[str, int] = {}
        self.enabled = True
        self._starts: dict[str, int] = {}  # phase -> allocated when it last began

    def mark(self, name: str) -> None:
        if self.enabled and name not in self.marks:
            self.marks[name] = self.probe.allocated()

    def fold_into(self, name: str) -> None:
        """Count the open window's peak so far as phase `name`'s, and restart the window: when backward
        reaches the blocks, what it held until then (the loss's backward, the head's) belongs to the
        loss spike that checks/memory.py prices at forward-end, not to the blocks' backward."""
        if self.enabled:
            peak = self.probe.window_peak()
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            if name in self._starts:
                self.rises[name] = max(self.rises.get(name, 0), peak - self._starts[name])
            self.probe.reset_peak()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start = self._starts[name] = self.probe.allocated()
        self.probe.reset_peak()
        try:
            yield
        finally:
            peak = self.probe.window_peak()
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            self.rises[name] = max(self.rises.get(name, 0), peak - start)
