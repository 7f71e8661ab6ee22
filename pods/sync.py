"""Push the project to the pod: rsync over the same SSH connection, incremental, sending exactly
the files pods/selection.py chooses (what git would commit, then .podignore).

rsync never deletes on the pod (no --delete): a file is removed there only when
.podkit/manifest says podkit sent it and it is no longer chosen. runs/, logs/, .venv/ and a
user's own files are therefore never touched. Without rsync on the pod (and no way to install
it) the same file list goes over SFTP.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.ownership import delete_stale, existing, read_manifest, write_manifest
from podkit.pods.rsync import TransferStats, remote_target, run_rsync
from podkit.pods.selection import chosen_files


class TheirFiles(PodError):
    """push stopped before writing anything: files podkit did not send sit where it would write."""


def refuse_theirs(conn: PodConnection, local: Path, remote_dir: str, first_writes: tuple[str, ...] = ()
                  ) -> tuple[list[str], set[str] | None]:
    """Raise TheirFiles where a path podkit would write, never sent before, is already taken on the pod: the user's
    (a --force deploy into their directory, or a file they added), which podkit never overwrites. `first_writes`:
    paths podkit writes itself besides the project's files (deploy's logs/probe.json), checked on a first deploy
    only (later ones find podkit's own). Returns the files to send and the manifest read."""
    files = chosen_files(local)
    before = read_manifest(conn, remote_dir)
    fresh = set(files) - (before or set()) | (set(first_writes) if before is None else set())
    theirs = existing(conn, remote_dir, fresh)
    if theirs:
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        raise TheirFiles(f"{remote_dir} holds {len(theirs)} file(s) podkit did not send at paths it would write: "
                         f"{shown}", "move them out of the way, or deploy to another REMOTE_DIR; podkit never "
                         "overwrites what it did not create")
    return files, before


def push(conn: PodConnection, local: Path, remote_dir: str, *, rsync_on_pod: bool,
         progress: Callable[[str], None] | None = None, bwlimit: int | None = None,
         checked: tuple[list[str], set[str] | None] | None = None) -> TransferStats:
    """Send the chosen files (pods/selection.py); delete on the pod only what podkit sent before
    and no longer sends (pods/ownership.py), never anything else. `checked`: what refuse_theirs returned for this
    directory in this deploy (it is run here otherwise)."""
    files, before = checked or refuse_theirs(conn, local, remote_dir)
    # as they are before the transfer (an edit during it counts as not sent); SFTP sends no symlinks
    sending = stamps(local, files, links=rsync_on_pod)
    # Record the union first: a sync cut short still knows every file it may have sent.
    write_manifest(conn, remote_dir, (before or set()) | set(files))
    if rsync_on_pod:
        with tempfile.NamedTemporaryFile("wb", suffix=".files") as listing:
            listing.write("\0".join(files).encode(errors="surrogateescape"))
            listing.flush()
            args = ["-lptz", "--files-from", listing.name, "--from0", f"{local}/",
                    remote_target(conn, remote_dir.rstrip("/") + "/")]
            stats = run_rsync(conn, args, what="sync", progress=progress, bwlimit=bwlimit,
                              disk_full=lambda: remote_disk_full(conn, remote_dir))
    else:
        stats = push_sftp(conn, local, remote_dir, files)
    if before is not None:
        stats.deleted = delete_stale(conn, remote_dir, before - set(files))
    write_manifest(conn, remote_dir, set(files))
    _record_sent(conn, remote_dir, local, sending, links=rsync_on_pod)
    return stats


# What the last deploy sent, by size and mtime, and from which machine and directory: `bin/pod run` says when
# the local project has changed since, because the job runs the pod's copy.
SENT = ".podkit/sent.json"


def stamps(local: Path, files: list[str], links: bool = True) -> dict[str, list[int]]:
    out = {}
    for rel in files:
        try:
            st = os.lstat(local / rel)
        except OSError:
            continue  # gone since it was chosen: not sent
        if links or not stat.S_ISLNK(st.st_mode):
            out[rel] = [st.st_size, st.st_mtime_ns]
    return out


CHECKOUT_ID = ".podkit/checkout-id"  # local, never sent (pods/selection.py TOP_LEVEL_NEVER)


def _origin(local: Path, make: bool = False) -> str | None:
    """Which checkout deployed: a random id kept in the project's .podkit/ (a hostname and path change with
    networks and containers, and repeat across machines); None where there is none yet and `make` is off."""
    path = local / CHECKOUT_ID
    try:
        return path.read_text().strip() or None
    except OSError:
        if not make:
            return None
    try:
        path.parent.mkdir(exist_ok=True)
        path.write_text(uuid.uuid4().hex + "\n")
        return path.read_text().strip()
    except OSError:
        return None  # a read-only checkout: nothing to compare against later


def _record_sent(conn: PodConnection, remote_dir: str, local: Path, sent: dict[str, list[int]], links: bool) -> None:
    q = shlex.quote(f"{remote_dir}/{SENT}")
    record = json.dumps({"origin": _origin(local, make=True), "links": links, "files": sent})
    conn.run(f"cat > {q}.tmp && mv {q}.tmp {q}", stdin=record, prelude=False, check=True)


def changed_since_deploy(conn: PodConnection, local: Path, remote_dir: str) -> list[str] | None:
    """The project's files that differ from what the last deploy from this checkout sent (changed, added or
    gone), sorted; None when that cannot be told (no record, a damaged one, a deploy from another checkout, or
    the project's files cannot be listed). Advisory: it never fails the command that asks."""
    q = shlex.quote(f"{remote_dir}/{SENT}")
    result = conn.run(f"cat {q} 2>/dev/null", prelude=False)
    try:
        record = json.loads(result.stdout)
        sent, origin, links = record["files"], record["origin"], record.get("links", True)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(sent, dict) or origin is None or origin != _origin(local):
        return None
    try:
        now = stamps(local, chosen_files(local), links=links)  # an SFTP deploy sends no symlinks
    except Exception:  # git missing or broken here (chosen_files runs it): no note rather than no run
        return None
    return sorted(p for p in set(sent) | set(now) if sent.get(p) != now.get(p))


def remote_disk_full(conn: PodConnection, remote_dir: str) -> bool:
    """Whether the filesystem holding remote_dir has (almost) nothing left: under 1 MiB."""
    try:
        out = conn.run(f"df -Pk {shlex.quote(remote_dir)} | awk 'NR==2{{print $4}}'", prelude=False).stdout.strip()
    except PodError:
        return False  # the link is gone too: report what rsync said
    return out.isdigit() and int(out) < 1024


def push_sftp(conn: PodConnection, local: Path, remote_dir: str, files: list[str]) -> TransferStats:
    """Fallback without rsync on the pod: upload the chosen files whose size or mtime differ."""
    start = time.monotonic()
    sftp = conn.sftp()
    stats = TransferStats()
    made: set[str] = set()
    try:
        for rel in files:
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
    except (OSError, EOFError) as exc:
        if conn.frozen is not None:
            raise PodError(f"sync: {conn.frozen.problem}", conn.frozen.fix) from None
        if isinstance(exc, EOFError):
            raise PodError("sync: connection dropped", "re-run the same command; it continues where it stopped") from None
        if "No space" in str(exc) or getattr(exc, "errno", None) == 28:
            raise PodError("sync: the disk is full", "free space on the pod, then re-run") from None
        raise PodError(f"sync over SFTP failed: {exc}", "re-run; finished files are kept") from None
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


def changed_note(changed: list[str], host: str) -> str:
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"note: {len(changed)} file(s) of this project changed here since the last deploy ({shown}); the pod runs "
            f"its deployed copy: bin/pod deploy {host} first to send them")
