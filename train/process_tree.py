"""Stopping everything a launcher started, workers included, so no training outlives a stop.

torchrun starts each worker in a session of its own (torch/distributed/elastic/multiprocessing/
subprocess_handler/subprocess_handler.py, `start_new_session=True`, torch 2.13), so a signal to
torchrun's process group never reaches them, and a torchrun that dies first leaves them to PID 1.
The launcher therefore becomes a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER, since 3.4):
orphans are re-parented to it instead of PID 1, and `descendants` can still find every one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # not Linux: orphans go to PID 1, as before


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            # bytes: comm is any 15 bytes a process named itself, a multi-byte character cut in two included
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # comm may hold spaces and ')'
        out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int, spare: frozenset[int] = frozenset()) -> list[int]:
    """Every live process below `pid` (children first), zombies included until reaped; `spare` and
    what is below them left out."""
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier and p not in spare]
        found += children
        frontier = children
    return found


def reap() -> None:
    """Collect exited children (orphans re-parented to this subreaper) so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_all_below(pid: int, grace: float, spare: frozenset[int] = frozenset()) -> int:
    """SIGTERM every descendant of `pid` but `spare` (and theirs), SIGKILL what is left after `grace` s;
    how many were signalled."""
    pids = descendants(pid, spare)
    for p in pids:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap()
        if not _alive(descendants(pid, spare)):
            return len(pids)
        time.sleep(0.1)
    for p in descendants(pid, spare):
        _signal(p, signal.SIGKILL)
    time.sleep(0.1)
    reap()
    return len(pids)


def _alive(pids: list[int]) -> list[int]:
    live = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z":
            live.append(p)
    return live


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
