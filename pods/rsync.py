"""Running rsync over the pod's open connection (pods/rsh.py), with progress and one-line errors.

Both directions use --partial-dir, so a transfer cut by a dropped connection resumes from the
partial file on the next run instead of starting over.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.rsh import RshServer

PARTIAL_DIR = ".rsync-partial"


@dataclass
class TransferStats:
    files: int = 0  # files transferred
    bytes: int = 0  # literal data sent
    seconds: float = 0.0
    deleted: int = 0  # files podkit sent before, no longer sends, and removed (pods/ownership.delete_stale)
    kept: list[str] = field(default_factory=list)  # local files that are not podkit's, left as they were (pods/fetch)

    def __str__(self) -> str:
        size = f"{self.bytes / 2**20:.1f} MiB" if self.bytes >= 2**20 else f"{self.bytes / 1024:.1f} KiB"
        gone = f", {self.deleted} removed (gone from the project)" if self.deleted else ""
        kept = ""
        if self.kept:
            shown = ", ".join(self.kept[:3]) + (f" and {len(self.kept) - 3} more" if len(self.kept) > 3 else "")
            kept = f"; kept {len(self.kept)} local path(s) podkit did not fetch or that changed since, so the pod's " \
                   f"copies were not fetched: {shown} (move them away to fetch those)"
        return f"{self.files} files changed{gone}, {size} in {self.seconds:.1f} s{kept}"


def remote_target(conn: PodConnection, path: str) -> str:
    host = conn.endpoint.hostname
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{path}"


def run_rsync(conn: PodConnection, args: list[str], *, what: str, progress: Callable[[str], None] | None = None,
              bwlimit: int | None = None, disk_full: Callable[[], bool] | None = None,
              written: set[str] | None = None, under: str = "") -> TransferStats:
    """rsync with `args`; `disk_full` checks the receiving side when rsync fails without saying why; `written`
    receives what it writes (files, links and directories, relative to the destination) as it goes, so it holds
    them also when the transfer is cut. `under` is the destination's own path where the caller names paths from
    a directory above it (fetch's runs/ in pod-logs/<pod>/): written's names and the errors' start with it."""
    if not shutil.which("rsync"):
        raise PodError("rsync is not installed on this machine", "install it (apt-get install rsync / brew install rsync)")
    try:
        with RshServer(conn) as server:
            return _run(conn, server, args, what=what, progress=progress, bwlimit=bwlimit, written=written,
                        under=under)
    except PodError as exc:
        # rsync's own message can be lost when the receiver dies mid-stream (seen with a full
        # disk: exit 11 and nothing on stderr), so ask the disk itself before blaming rsync.
        if exc.problem.startswith(f"{what}: rsync exit") and disk_full is not None and disk_full():
            raise _disk_full(what) from None
        raise


WROTE = "podkit-wrote:"  # --out-format's prefix for each item written (`names`)


def _run(conn: PodConnection, server: RshServer, args: list[str], *, what: str, progress, bwlimit,
         written: set[str] | None = None, under: str = "") -> TransferStats:
    argv = ["rsync", "--partial-dir=" + PARTIAL_DIR, "--protect-args", "--stats", "-e", server.rsh()]
    if progress is not None:
        argv.append("--info=progress2")
    if written is not None:
        argv.append(f"--out-format={WROTE}%n")
    if bwlimit:
        argv.append(f"--bwlimit={bwlimit}")
    argv += args
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "LC_ALL": "C"})
    out = bytearray()
    pending = b""  # a progress line cut at a read boundary, completed by the next read
    try:
        while True:
            chunk = proc.stdout.read1(4096)  # what is there now, so progress shows as it comes
            if not chunk:
                break
            out += chunk
            if progress is not None or written is not None:
                *pieces, pending = re.split(rb"[\r\n]", pending + chunk)
                for piece in pieces:
                    if written is not None and piece.startswith(WROTE.encode()):
                        written.add(_under(under, _out_name(piece[len(WROTE):])))
                        continue
                    text = piece.decode(errors="replace").strip()
                    if progress is not None and re.match(r"^[\d,]+\s+\d+%", text):
                        progress(text)
        err = proc.stderr.read().decode(errors="replace")
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        conn.stop_remote()  # rsync's other end on the pod
        raise
    stats = _parse_stats(out.decode(errors="replace"))
    stats.seconds = time.monotonic() - start
    if proc.returncode in (0, 24):  # 24: a source file vanished mid-transfer (a log rotated); fine
        return stats
    raise _describe(proc.returncode, err, conn, what, under)


def _out_name(raw: bytes) -> str:
    """A name as --out-format's %n prints it, back to the local name: rsync writes each byte it will not print
    raw (under LC_ALL=C every byte over 127, a newline) as \\#ooo in octal, and a backslash that would read as
    such as \\#134 (log.c escape); a directory ends with "/"."""
    raw = re.sub(rb"\\#([0-7]{3})", lambda m: bytes([int(m[1], 8)]), raw)
    return os.fsdecode(raw).rstrip("/")


def _under(under: str, name: str) -> str:
    """`name`, relative to the destination, as a path from the directory above it ("." is `under` itself)."""
    return posixpath.normpath(posixpath.join(under, name)) if under else name


def _parse_stats(text: str) -> TransferStats:
    def number(label: str) -> int:
        m = re.search(rf"{label}:\s*([\d,]+)", text)
        return int(m.group(1).replace(",", "")) if m else 0

    return TransferStats(files=number("Number of regular files transferred"), bytes=number("Literal data"))


def _describe(code: int, err: str, conn: PodConnection, what: str, under: str = "") -> PodError:
    ep = conn.endpoint
    if conn.frozen is not None:
        return PodError(f"{what}: {conn.frozen.problem}", conn.frozen.fix)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if "No space left on device" in err or "Disk quota exceeded" in err:
        return _disk_full(what)
    if "rsync: command not found" in err or "rsync: not found" in err or code == 127:
        return PodError(f"{what}: rsync is missing on the pod", "re-run deploy; it installs rsync or falls back to SFTP")
    told = [line[len("podkit: "):] for line in lines if line.startswith("podkit: ") and "dropped" not in line]
    own = [line for line in lines if line.startswith(("rsync: ", "rsync error: ")) and "connection unexpectedly" not in line
           and "error in rsync protocol data stream" not in line]
    # A name the pod now has as a file where a directory was fetched (or the reverse): rsync says which
    # (generator.c: "cannot delete non-empty directory: %s", "could not make way for new %s: %s"), then ends with
    # code 23, "some files/attrs were not transferred (see previous errors)", the only line that starts "rsync".
    blocked = [m.group(1) for line in lines for m in [re.search(r"(?:could not make way for new [a-z ]+|cannot "
                                                               r"delete non-empty directory): (.+)$", line)] if m]
    if blocked:
        return PodError(f"{what}: {_under(under, blocked[-1])} is a file on one side and a directory on the other, "
                        "so it was not transferred (the rest was)", "move the receiving side's copy away, then re-run")
    if own and conn.alive:  # rsync's own complaint (a bad option, a missing directory), not the link
        return PodError(f"{what}: {own[0]}", "see rsync's message")
    if told:  # the relay's own diagnosis (pods/rsh.py), e.g. a login shell that never started
        return PodError(f"{what}: {told[0]}")
    if code in (12, 30, 35, 255, 20) or "connection unexpectedly closed" in err or "Broken pipe" in err:
        return PodError(f"{what}: connection to {ep.hostname}:{ep.port} dropped (rsync exit {code})",
                        "re-run the same command; it resumes where it stopped")
    return PodError(f"{what}: rsync exit {code}: {lines[-1] if lines else 'no message'}", "re-run; see rsync's message")


def _disk_full(what: str) -> PodError:
    return PodError(f"{what}: the disk is full", "free space (old runs, caches), then re-run; finished files are kept")
