"""The fits one callback watches (a Trainer's train(), a Lightning fit()): each fit its own MemoryMonitor, its own
log, and a summary beside the log that always ends with a status, also when the fit crashed.

    memory.jsonl            the first fit's samples (the log_path given), one line per sample, flushed
    memory.summary.json     its summary: status (running | ok | failed | oom | interrupted), error, steps, peaks...
    memory.2.jsonl          the next fit's: a second train()/fit() with the same callback, a hyperparameter
    memory.2.summary.json   search's trial, a rerun of the script: never appended to another fit's log

Only the process that writes (rank 0) writes files; every process keeps its summaries in memory.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from podkit.checks import strict_json
from podkit.checks.command import stop_signals

from . import MemoryMonitor

log = logging.getLogger("podkit.monitor")


def ending(exc: BaseException) -> tuple[str, str]:
    """(status, error) for the exception that ended a fit: the statuses of bin/smoke's summary.json."""
    error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # Ctrl-C, or SIGTERM under Lightning (lightning 2.6.0 utilities/exceptions.py: SIGTERMException(SystemExit)).
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return "interrupted", error
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc):  # as train/rank_probe.py judges it
        return "oom", error
    return "failed", error


def claim_log(path: Path) -> tuple[Path, Path | None]:
    """(log, summary): the first of memory.jsonl, memory.2.jsonl, ... whose log and summary are both free, the
    log created empty here: exclusive creation, so two processes starting at once never share one. Absolute, so a
    chdir during the fit cannot put the summary elsewhere than its log. A log_path that exists and is not a
    regular file (/dev/stdout, a pipe) is used as given, with no summary file: the summary stays in memory."""
    path = path.absolute()
    if path.exists() and not path.is_file():
        return path, None
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        base = path.stem if n == 1 else f"{path.stem}.{n}"
        log_file, summary = path.with_name(base + path.suffix), path.with_name(base + ".summary.json")
        if summary.exists():
            continue
        try:
            open(log_file, "x").close()
        except FileExistsError:
            continue
        if n > 1:
            log.warning("%s or its summary is an earlier fit's: this fit writes %s", path, log_file)
        return log_file, summary
    raise AssertionError("unreachable")


class MonitoredFits:
    def __init__(self, every: int, log_path: str | Path | None, monitor_kwargs: dict):
        self.every, self.monitor_kwargs = every, monitor_kwargs
        self.log_path = Path(log_path) if log_path else None
        self.monitor: MemoryMonitor | None = None  # the latest fit's, open or ended
        self.summary: dict | None = None  # the latest ended fit's
        self.summaries: list[dict] = []  # every ended fit's, in order
        self.open = False
        self._files: tuple[Path, Path | None] | None = None
        self._earlier_exc: BaseException | None = None

    def begin(self, write: bool, abandoned: str, **monitor_kwargs) -> MemoryMonitor:
        """A fit starts. `abandoned`: the error to record when the previous fit is still open (it never ended:
        an exception inside it was caught by the library or by the user's code, which the callback cannot see)."""
        if self.open:
            self.end(status="failed", error=abandoned)
        self._files = claim_log(self.log_path) if write and self.log_path else None
        self.monitor = MemoryMonitor(every=self.every, log_path=self._files[0] if self._files else None,
                                     **monitor_kwargs, **self.monitor_kwargs)
        self.monitor.__enter__()
        self.open = True
        self._write({"status": "running", **self._where()})  # what a killed process (SIGKILL) leaves
        # An exception no one catches ends the process without a callback event (transformers has no on_exception):
        # the interpreter sets sys.last_value and then runs atexit's functions (CPython pythonrun.c, PyErr_Print).
        self._earlier_exc = getattr(sys, "last_value", None)  # one from before this fit (an interactive session)
        atexit.register(self._at_exit)
        self._catch_stop_signals()
        return self.monitor

    def _catch_stop_signals(self) -> None:
        """SIGTERM (bin/pod stop, a timeout, torchrun stopping the ranks when one failed) and SIGHUP end a process
        without atexit while they are at their default: the fit is ended as interrupted first, then the signal
        is sent again at its default, so the process still dies of it. Only from the main thread (signal.signal's
        rule), only where the script set no handler of its own; SIGINT is KeyboardInterrupt, which atexit sees."""
        self._signals: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in stop_signals():
            if sig != signal.SIGINT and signal.getsignal(sig) == signal.SIG_DFL:
                self._signals[sig] = signal.signal(sig, self._on_signal)

    def _release_signals(self) -> None:
        for sig, previous in getattr(self, "_signals", {}).items():
            if signal.getsignal(sig) == self._on_signal:  # not replaced by the script meanwhile
                signal.signal(sig, previous)
        self._signals = {}

    def _on_signal(self, sig: int, frame) -> None:
        self.end(status="interrupted", error=f"killed by {signal.Signals(sig).name}")
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    def end(self, exc: BaseException | None = None, *, status: str = "ok", error: str | None = None) -> dict | None:
        """The open fit ends: its monitor closed, its summary kept and written. `exc`: the exception that ended it."""
        if not self.open:
            return None
        self.open = False
        atexit.unregister(self._at_exit)
        self._release_signals()
        self._earlier_exc = None
        if exc is not None:
            status, error = ending(exc)
        # Neither may raise over the fit's own exception (on_exception, atexit) or end a good fit with a traceback:
        # a full disk, or a CUDA context broken by the crash (the last sample synchronises the device).
        try:
            self.monitor.close()  # the last sample, the snapshot, the log closed
        except Exception as e:
            self.monitor.warnings.append(f"the monitor's last sample failed: {type(e).__name__}: {e}")
            log.error("%s", self.monitor.warnings[-1])
        try:
            numbers = self.monitor.summary()
        except Exception as e:
            numbers = {"steps": self.monitor.steps, "warnings": self.monitor.warnings
                       + [f"the monitor's summary failed: {type(e).__name__}: {e}"]}
            log.error("%s", numbers["warnings"][-1])
        summary = {"status": status, **({"error": error} if error else {}), **numbers, **self._where()}
        self.summary = summary
        self.summaries.append(summary)
        self._write(summary)
        return summary

    def _at_exit(self) -> None:
        exc = getattr(sys, "last_value", None)
        if exc is not None and exc is not self._earlier_exc:
            self.end(exc)
        else:
            self.end(status="failed", error="the process exited during the fit (an exception caught before it "
                                            "reached the interpreter, or sys.exit)")

    def _where(self) -> dict:
        return {"log_path": str(self._files[0])} if self._files else {}

    def _write(self, summary: dict) -> None:
        if not self._files or self._files[1] is None:
            return
        path = self._files[1]
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(strict_json.dumps(summary, indent=2, default=str) + "\n")
            os.replace(tmp, path)  # never a half-written summary
        except OSError as e:  # never an exception out of on_exception or atexit, over the fit's own
            log.error("cannot write %s: %s", path, e)


class FitsView:
    """What a callback that holds `self.fits` (a MonitoredFits) shows its user: the HF and Lightning callbacks'."""

    fits: MonitoredFits

    @property
    def monitor(self) -> MemoryMonitor | None:
        """The latest fit's MemoryMonitor (its records, warnings)."""
        return self.fits.monitor

    @property
    def summary(self) -> dict | None:
        """The latest ended fit's summary, with its status; None before the first ends."""
        return self.fits.summary

    @property
    def summaries(self) -> list[dict]:
        """Every ended fit's summary, in order (one per train()/fit(), and one per auto_find_batch_size attempt)."""
        return self.fits.summaries
