"""Bring a pod's runs and logs back to pod-logs/<pod>/, incrementally and resumably.

What comes back: runs/ (every smoke run, failed ones included) and logs/ (detached jobs' output,
envsetup's logs and report, the probe). The env file with secrets stays on the pod.

Nothing podkit did not write is replaced: `.podkit-fetched.json` records each file as the last fetch
left it (size and mtime), and a local file that is not in it, or that changed since, is the user's:
it is left alone, and the pod's copy of it is not fetched (it is reported as kept). Files that were
there before podkit kept a record (an older podkit's fetch) count as the user's too: podkit cannot tell
them apart. A newer local file is never replaced by an older remote one (--update), and nothing local
is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.rsync import PARTIAL_DIR, TransferStats, remote_target, run_rsync

FETCHED = ["/runs/***", "/logs/***"]
TOPS = ("runs", "logs")
RECORD = ".podkit-fetched.json"
PART = ".podkit-part"  # fetch_sftp's file in flight


def fetch(conn: PodConnection, remote_dir: str, local: Path, *, rsync_on_pod: bool = True,
          progress: Callable[[str], None] | None = None, bwlimit: int | None = None) -> TransferStats:
    local.mkdir(parents=True, exist_ok=True)
    kept = theirs(local)
    try:
        if not rsync_on_pod:
            stats = fetch_sftp(conn, remote_dir, local, kept)
        else:
            with tempfile.NamedTemporaryFile("wb", prefix="podkit-kept-", suffix=".rules") as rules:
                rules.write(b"".join(_exclude_rule(rel) + b"\0" for rel in sorted(kept)))
                rules.flush()
                # --from0: the rules file is NUL-separated, so a name may hold a newline. Excludes come first:
                # the first matching rule wins.
                args = ["-rlptz", "--update", "--from0", f"--exclude-from={rules.name}",
                        *[f"--include={p}" for p in FETCHED], "--exclude=*",
                        remote_target(conn, remote_dir.rstrip("/") + "/"), f"{local}/"]
                stats = run_rsync(conn, args, what="fetch", progress=progress, bwlimit=bwlimit,
                                  disk_full=lambda: shutil.disk_usage(local).free < 2**20)
    finally:
        # also after a cut transfer: what did arrive is podkit's, and the next run must know it
        _write_record(local, kept)
    stats.kept = sorted(kept)
    return stats


def theirs(local: Path) -> set[str]:
    """The files under runs/ and logs/ that podkit must not replace: not in the record of the last fetch,
    or changed since it (size or mtime)."""
    try:
        record = json.loads((local / RECORD).read_text())["files"]
    except FileNotFoundError:
        record = {}
    except (ValueError, KeyError, TypeError, OSError):
        raise PodError(f"fetch: {local / RECORD} is damaged, so podkit cannot tell its own files from yours",
                       "move it away; the next fetch then keeps every file already there as yours") from None
    return {rel for rel, now in _local_files(local).items() if record.get(rel) != now}


def _local_files(local: Path) -> dict[str, list[int]]:
    """Every file and symlink under runs/ and logs/ by path relative to `local`: [size, mtime_ns]; rsync's
    partial files and fetch_sftp's in-flight ones are not files yet."""
    found = {}
    for top in TOPS:
        for dirpath, dirnames, filenames in os.walk(local / top):
            dirnames[:] = [d for d in dirnames if d != PARTIAL_DIR]
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # os.walk lists them as dirs
            for name in filenames + links:
                if name.endswith(PART):
                    continue
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                found[os.path.relpath(path, local)] = [st.st_size, st.st_mtime_ns]
    return found


def _write_record(local: Path, kept: set[str]) -> None:
    files = {rel: now for rel, now in _local_files(local).items() if rel not in kept}
    tmp = local / (RECORD + ".tmp")
    tmp.write_text(json.dumps({"files": files}, sort_keys=True))
    os.replace(tmp, local / RECORD)


def _exclude_rule(rel: str) -> bytes:
    """An rsync exclude anchored at the transfer's root that matches `rel` and nothing else. rsync reads a
    backslash as an escape only in a pattern holding a wildcard (*, ?, [), so escape only there."""
    if any(c in rel for c in "*?["):
        rel = "".join("\\" + c if c in "*?[\\" else c for c in rel)
    return ("/" + rel).encode("utf-8", "surrogateescape")


def fetch_sftp(conn: PodConnection, remote_dir: str, local: Path, kept: set[str] = frozenset()) -> TransferStats:
    """Without rsync on the pod: walk runs/ and logs/ over SFTP, same rules (the user's files kept, a newer
    local file never replaced)."""
    start = time.monotonic()
    sftp = conn.sftp()
    stats = TransferStats()

    def walk(rel: str) -> None:
        try:
            entries = sftp.listdir_attr(f"{remote_dir}/{rel}")
        except FileNotFoundError:
            return
        for entry in entries:
            child = f"{rel}/{entry.filename}"
            if child in kept:
                continue
            if stat.S_ISDIR(entry.st_mode):
                walk(child)
                continue
            dst = local / child
            if dst.exists():
                have = dst.stat()
                if have.st_mtime > entry.st_mtime:
                    continue  # newer locally: never overwritten
                if have.st_mtime == entry.st_mtime and have.st_size == entry.st_size:
                    continue  # already here
            dst.parent.mkdir(parents=True, exist_ok=True)
            part = dst.with_name(dst.name + PART)
            sftp.get(f"{remote_dir}/{child}", str(part))
            os.utime(part, (entry.st_atime, entry.st_mtime))
            os.replace(part, dst)
            stats.files += 1
            stats.bytes += entry.st_size

    try:
        for top in TOPS:
            walk(top)
    except (EOFError, OSError) as exc:
        if conn.frozen is not None:
            raise PodError(f"fetch: {conn.frozen.problem}", conn.frozen.fix) from None
        raise PodError(f"fetch over SFTP failed: {exc}", "re-run; finished files are kept") from None
    stats.seconds = time.monotonic() - start
    return stats
