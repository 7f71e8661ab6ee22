"""Inside each process of a user's command under `bin/smoke -- COMMAND`: count optimizer steps, read
the loss, measure memory, stop after N steps, and leave a record that survives a crash.

Loaded by train/inject/sitecustomize.py as podkit.train.rank_probe (never as `train`: the user's
own `train` module may be on sys.path). No code change in the user's script:

- steps: torch.optim.optimizer.register_optimizer_step_post_hook, a hook on every optimizer's step()
  (torch/optim/optimizer.py, torch >= 2.0); the HF Trainer, accelerate and DeepSpeed's ZeRO
  optimizers all end in a torch Optimizer's step.
- loss: torch.autograd.backward is wrapped (Tensor.backward calls it by attribute, torch/_tensor.py):
  the scalar a top-level backward starts from, summed over the micro-batches of one step. It is the
  value the script passes to backward: the Trainer's loss divided by gradient_accumulation_steps,
  or the GradScaler-scaled loss under fp16; its trend is what the verdict reads.
- memory: MemoryMonitor with the CUDA allocator's counters (history for memory_viz on rank 0), or
  on CPU the TensorCounter, switched on before the script builds its model.
- stop: after the N-th step the hook raises SmokeStepsReached, a SystemExit(0): `except Exception`
  in the script does not swallow it, every rank stops at the same step (each step synchronises the
  ranks), and launchers see a clean exit. Python then joins the script's non-daemon threads, which the
  code after its loop would have stopped (a prefetch or logging thread): one still running after
  EXIT_GRACE_S would keep the process alive forever, so the probe ends it then (exit 0, with a warning).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..checks import strict_json
from .memprobe import CudaProbe, TensorCounter, is_out_of_memory
from .monitor import MemoryMonitor
from ..envsetup.secrets import SecretFilter


EXIT_GRACE_S = 10.0


class SmokeStepsReached(SystemExit):
    """Raised after the last requested optimizer step: ends the process with exit code 0."""

    def __init__(self, steps: int):
        super().__init__(0)
        self.steps = steps


class RankProbe:
    def __init__(self, run_dir: Path, steps: int, every: int):
        self.dir = run_dir / "ranks"
        self.target, self.every = steps, every
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.steps = 0
        self.losses: list[float | None] = []
        self._micro: list[float] = []
        self._depth = 0
        self.status, self.error = "running", ""
        self.monitor: MemoryMonitor | None = None
        self.counter: TensorCounter | None = None
        # Not torch.cuda.is_available(): that initialises the CUDA runtime before the script runs, and a
        # script that sets CUDA_VISIBLE_DEVICES itself would then be ignored. The device is the loss's.
        self._maybe_cuda = torch.version.cuda is not None and os.path.exists("/dev/nvidiactl")
        self._t0 = time.perf_counter()
        self._last = self._t0
        self._metrics = None
        self._secrets = SecretFilter()
        self.warnings: list[str] = []

    # -- installing --------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self._after_step)
        original = torch.autograd.backward

        def backward(tensors, *args, **kwargs):
            if self._depth == 0:
                self._first_backward(tensors)
                if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                    self._micro.append(float(tensors.detach().float().item()))  # note: a CPU-GPU sync point
            self._depth += 1
            try:
                return original(tensors, *args, **kwargs)
            finally:
                self._depth -= 1

        torch.autograd.backward = backward
        atexit.register(self._at_exit)
        previous_hook = sys.excepthook

        def excepthook(kind, value, tb):
            # A MemoryError's str() is empty: the summary's reason would end in "MemoryError: ".
            text = str(value) or ("out of host memory" if issubclass(kind, MemoryError) else "")
            self.error = self._secrets.text(f"{kind.__name__}: {text}")  # a token in the message stays out of ranks/
            # As the built-in run: host RAM running out (MemoryError, torch's CPU allocator) is oom/3 like CUDA's.
            self.status = "oom" if is_out_of_memory(value) or "out of memory" in str(value) else "error"
            if self.monitor is not None and self.status == "oom":
                self.monitor.dump_snapshot()  # what was live when it ran out
            self._write()
            previous_hook(kind, value, tb)

        sys.excepthook = excepthook
        if not self._maybe_cuda:
            # CPU: the counter must see the model being built, so it starts now (it costs Python
            # time per op, which a CPU smoke run of a small model affords).
            self.counter = TensorCounter()
            self.counter.switch_on()

    def _first_backward(self, tensors) -> None:
        """The monitor starts at the first backward: only a process that trains is measured (a
        launcher such as torchrun never creates a CUDA context here), on the device of its loss."""
        if self.monitor is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        first = tensors if isinstance(tensors, torch.Tensor) else next(
            (t for t in (tensors or ()) if isinstance(t, torch.Tensor)), None)
        device = first.device if first is not None else torch.device("cpu")
        cuda = device.type == "cuda"
        if cuda:
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            probe = CudaProbe(device)
        else:
            if self.counter is None:  # a CUDA machine training on CPU: counted from here on
                self.counter = TensorCounter()
                self.counter.switch_on()
            probe = self.counter
        snapshot = str(self.dir.parent / "memory_snapshot.pickle") if self.rank == 0 else None
        self.monitor = MemoryMonitor(every=self.every, device=device, probe=probe, snapshot_path=snapshot,
                                     snapshot_steps=min(3, self.target), capacity=None if cuda else 0)
        self.monitor.__enter__()
        self._metrics = open(self.dir / f"metrics.rank{self.rank}.jsonl", "a")

    # -- per optimizer step ------------------------------------------------------------------------
    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.monitor is None:
            return  # a step without a backward before it (e.g. a scheduler warm-up call): not a training step
        self.steps += 1
        loss = sum(self._micro) if self._micro else None
        self._micro = []
        self.losses.append(loss)
        now = time.perf_counter()
        rec = {"step": self.steps, "loss": loss, "time": round(now - self._t0, 4), "step_time": round(now - self._last, 6)}
        self._last = now
        sample = self.monitor.step()
        if sample is not None:
            rec.update(sample)
        self._metrics.write(strict_json.dumps(rec, default=str) + "\n")  # a NaN loss as null, with why
        self._metrics.flush()
        if self.steps >= self.target:
            self.status = "steps"
            self._write()
            threading.Thread(target=self._end_a_stuck_exit, name="podkit-smoke-exit", daemon=True).start()
            raise SmokeStepsReached(self.steps)
        self._write()

    def _end_a_stuck_exit(self) -> None:
        """Once the main thread has ended (SmokeStepsReached), the interpreter waits for every non-daemon
        thread before it exits (and before atexit); past EXIT_GRACE_S of that wait, finish the record and end
        the process as the step's SystemExit(0) would have."""
        main = threading.main_thread()
        stuck_since = None
        while True:
            time.sleep(0.2)
            waiting_for = [t.name for t in threading.enumerate()
                           if t is not main and not t.daemon and t is not threading.current_thread() and t.is_alive()]
            if main.is_alive():  # still unwinding (a finally, a context manager's exit)
                stuck_since = None
                continue
            if not waiting_for:
                return  # the threads ended: atexit runs, the process exits by itself
            if stuck_since is None:
                stuck_since = time.monotonic()
                print(f"podkit smoke: step {self.steps} was the last, but thread(s) {', '.join(waiting_for)} keep "
                      f"pid {os.getpid()} from exiting; ending it in {EXIT_GRACE_S:.0f} s", file=sys.stderr, flush=True)
            elif time.monotonic() - stuck_since >= EXIT_GRACE_S:
                self.warnings.append(
                    f"after the last step, thread(s) {', '.join(waiting_for)} kept the script (rank {self.rank}) from "
                    f"exiting; podkit ended it after {EXIT_GRACE_S:.0f} s: stop them in a `finally` (or make them "
                    "daemon threads) so that an early end of the loop does not hang your script")
                try:
                    self._at_exit()
                finally:
                    # 0 as the step's SystemExit(0) would have; an error the script raised after it (in a finally,
                    # its excepthook set the status) is 1, as Python would have exited
                    os._exit(0 if self.status == "steps" else 1)

    # -- records -----------------------------------------------------------------------------------
    def _write(self) -> None:
        if self.monitor is None:
            return
        summary = self.monitor.summary()
        record = {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "device": str(self.monitor.device),
                  "capacity": self.monitor.capacity or None, "status": self.status, "error": self.error,
                  "steps": self.steps, "losses": self.losses, **{k: v for k, v in summary.items() if k != "steps"}}
        record["warnings"] = [*record.get("warnings", []), *self.warnings]
        path = self.dir / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(strict_json.dumps(record, default=str))  # read back with strict_json.restore
        os.replace(tmp, path)  # a process killed mid-write leaves the previous step's record

    def _at_exit(self) -> None:
        if self.monitor is None:
            return
        if self.status == "running":
            self.status = "exited"
        try:
            self.monitor.close()
        finally:
            self._write()
            if self._metrics:
                self._metrics.close()


def install_from_env() -> RankProbe | None:
    run_dir = os.environ.get("PODKIT_SMOKE_DIR")
    if not run_dir:
        return None
    probe = RankProbe(Path(run_dir), int(os.environ.get("PODKIT_SMOKE_STEPS", "100")),
                      int(os.environ.get("PODKIT_SMOKE_EVERY", "10")))
    probe.install()
    return probe
