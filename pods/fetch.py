"""Bring a pod's runs and logs back to pod-logs/<pod>/, incrementally and resumably.

What comes back: runs/ (every smoke run, failed ones included) and logs/ (detached jobs' output,
envsetup's logs and report, the probe). The env file with secrets stays on the pod.
--update never replaces a newer local file with an older remote one; nothing local is deleted.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.rsync import TransferStats, remote_target, run_rsync

FETCHED = ["/runs/***", "/logs/***"]


def fetch(conn: PodConnection, remote_dir: str, local: Path, *, rsync_on_pod: bool = True,
          progress: Callable[[str], None] | None = None, bwlimit: int | None = None) -> TransferStats:
    local.mkdir(parents=True, exist_ok=True)
    if not rsync_on_pod:
        return fetch_sftp(conn, remote_dir, local)
    args = ["-rlptz", "--update", *[f"--include={p}" for p in FETCHED], "--exclude=*",
            remote_target(conn, remote_dir.rstrip("/") + "/"), f"{local}/"]
    return run_rsync(conn, args, what="fetch", progress=progress, bwlimit=bwlimit,
                     disk_full=lambda: shutil.disk_usage(local).free < 2**20)


def fetch_sftp(conn: PodConnection, remote_dir: str, local: Path) -> TransferStats:
    """Without rsync on the pod: walk runs/ and logs/ over SFTP, same rules (newer local wins)."""
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
            part = dst.with_name(dst.name + ".podkit-part")
            sftp.get(f"{remote_dir}/{child}", str(part))
            os.utime(part, (entry.st_atime, entry.st_mtime))
            os.replace(part, dst)
            stats.files += 1
            stats.bytes += entry.st_size

    try:
        for top in ("runs", "logs"):
            walk(top)
    except (EOFError, OSError) as exc:
        if conn.frozen is not None:
            raise PodError(f"fetch: {conn.frozen.problem}", conn.frozen.fix) from None
        raise PodError(f"fetch over SFTP failed: {exc}", "re-run; finished files are kept") from None
    stats.seconds = time.monotonic() - start
    return stats
