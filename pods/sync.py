"""Push the project to the pod: rsync over the same SSH settings, incremental, honouring .gitignore
and .podignore, confined to the remote project directory.

--delete removes files deleted locally, but only inside the project directory, and never what the
filters exclude: runs/, logs/, .venv/ and .podkit/ on the pod are outputs and state, not code.
Without rsync on the pod (and no way to install it) the same file list goes over SFTP.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from pods.connection import PodConnection
from pods.errors import PodError
from pods.rsync import TransferStats, remote_target, run_rsync

# Never synced, and protected from --delete on the pod: outputs, state and local environments.
ALWAYS_EXCLUDED = [".git/", "/.venv/", "/.podkit/", "/runs/", "/logs/", "/pod-logs/", "__pycache__/", "*.pyc",
                   ".pytest_cache/", "*.egg-info/"]


def filter_args(local: Path) -> list[str]:
    # dir-merge: every directory's .gitignore/.podignore applies below it, as in git
    args = ["--filter=:- .gitignore", "--filter=:- .podignore"]
    return args + [f"--exclude={pattern}" for pattern in ALWAYS_EXCLUDED]


def push(conn: PodConnection, local: Path, remote_dir: str, *, rsync_on_pod: bool,
         progress: Callable[[str], None] | None = None, bwlimit: int | None = None) -> TransferStats:
    if not remote_dir.startswith("/") or remote_dir.rstrip("/") in ("", "/root", "/home", "/workspace", "/tmp"):
        raise PodError(f"remote dir '{remote_dir}' is not a project directory", "give REMOTE_DIR=/absolute/path/to/project")
    if rsync_on_pod:
        args = ["-rlptz", "--delete", *filter_args(local), f"{local}/", remote_target(conn, remote_dir.rstrip("/") + "/")]
        return run_rsync(conn, args, what="sync", progress=progress, bwlimit=bwlimit,
                         disk_full=lambda: remote_disk_full(conn, remote_dir))
    return push_sftp(conn, local, remote_dir)


def remote_disk_full(conn: PodConnection, remote_dir: str) -> bool:
    """Whether the filesystem holding remote_dir has (almost) nothing left: under 1 MiB."""
    try:
        out = conn.run(f"df -Pk {shlex.quote(remote_dir)} | awk 'NR==2{{print $4}}'", prelude=False).stdout.strip()
    except PodError:
        return False  # the link is gone too: report what rsync said
    return out.isdigit() and int(out) < 1024


def local_files(local: Path) -> list[str]:
    """The files rsync would send, with the same filters: a dry run into an empty directory."""
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run(["rsync", "-rl", "--dry-run", "--out-format=%n", *filter_args(local), f"{local}/", empty],
                             capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line and not line.endswith("/")]


def push_sftp(conn: PodConnection, local: Path, remote_dir: str) -> TransferStats:
    """Fallback without rsync on the pod: upload files whose size or mtime differ. No deletes."""
    start = time.monotonic()
    sftp = conn.sftp()
    stats = TransferStats()
    made: set[str] = set()
    try:
        for rel in local_files(local):
            src = local / rel
            if src.is_symlink():
                continue
            st = src.stat()
            dst = f"{remote_dir}/{rel}"
            try:
                remote = sftp.stat(dst)
                if remote.st_size == st.st_size and int(remote.st_mtime) == int(st.st_mtime):
                    continue
            except FileNotFoundError:
                pass
            parent = os.path.dirname(dst)
            if parent not in made:
                conn.run(f"mkdir -p {shlex.quote(parent)}", check=True, prelude=False)
                made.add(parent)
            tmp = f"{dst}.podkit-part"  # renamed into place whole: a cut upload never leaves half a file
            sftp.put(str(src), tmp)
            sftp.chmod(tmp, stat.S_IMODE(st.st_mode))
            sftp.utime(tmp, (st.st_atime, st.st_mtime))
            sftp.posix_rename(tmp, dst)
            stats.files += 1
            stats.bytes += st.st_size
    except OSError as exc:
        if "No space" in str(exc) or getattr(exc, "errno", None) == 28:
            raise PodError("sync: the disk is full", "free space on the pod, then re-run") from None
        raise PodError(f"sync over SFTP failed: {exc}", "re-run; finished files are kept") from None
    except EOFError:
        raise PodError("sync: connection dropped", "re-run the same command; it continues where it stopped") from None
    stats.seconds = time.monotonic() - start
    return stats


def ensure_rsync(conn: PodConnection, fp_tools: dict, say: Callable[[str], None]) -> bool:
    """True when the pod has rsync (installing it with apt-get when we are root); False = use SFTP."""
    if "rsync" in fp_tools:
        return True
    if "apt-get" not in fp_tools:
        say("no rsync on the pod and no apt-get to install it: syncing over SFTP")
        return False
    sudo = "" if conn.endpoint.user == "root" else ("sudo -n " if "sudo" in fp_tools else None)
    if sudo is None:
        say("no rsync on the pod and no root to install it: syncing over SFTP")
        return False
    say("installing rsync on the pod (apt-get)")
    result = conn.run(f"{sudo}env DEBIAN_FRONTEND=noninteractive sh -c "
                      "'apt-get install -y -qq rsync >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq rsync)'",
                      timeout=600, prelude=False)
    if result.ok:
        return True
    say("could not install rsync: syncing over SFTP")
    return False
