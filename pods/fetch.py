"""Bring a pod's runs and logs back to pod-logs/<pod>/, incrementally and resumably.

What comes back: runs/ (every smoke run, failed ones included) and logs/ (detached jobs' output,
envsetup's logs and report, the probe). The env file with secrets stays on the pod.

Nothing podkit did not write is replaced: `.podkit-fetched.json` records each file (size and mtime)
and directory that a fetch wrote, as it left them; a local file that is not in it, or that changed
since, and a directory not in it, are the user's: left alone, and the pod's copies of them not
fetched (reported as kept). Files and directories there before podkit kept a record (an older
podkit's fetch) count as the user's too: podkit cannot tell them apart. A newer local file is never
replaced by an older remote one (--update), and nothing local is deleted. A runs/ or logs/ that is a
symlink is refused (rsync would replace it, and from 3.4 it opens no path through one): --dest
puts pod-logs on another disk instead.

On the pod, runs/ or logs/ may be a symlink to a directory (on RunPod, runs/ is often linked to the
/workspace volume): it is followed, and what is under it comes back as under a directory. A symlink
below runs/ or logs/ comes back as a link, never followed (one may point at .podkit/env). A runs/ or
logs/ missing on the pod is nothing to fetch; one that is a symlink to nothing, or a file, is an error
once the other has come back (PartlyFetched: the error and what did come back, which --json reports both).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.progress import Transfer
from podkit.pods.rsync import PARTIAL_DIR, TransferStats, remote_target, run_rsync

TOPS = ("runs", "logs")  # fetched in this order (runs/ holds the big files), each a part of the progress shown
RECORD = ".podkit-fetched.json"
LOCK = ".podkit-fetch.lock"
PART = ".podkit-part"  # fetch_sftp's file in flight
DIR = "dir"  # a directory's entry in the record (its mtime moves with its contents: only its being podkit's counts)


def check_target(local: Path) -> None:
    """PodError unless `local` (DEST/<pod>) and its runs/ and logs/ are real directories or absent: a file there is
    the user's, which making the directory would replace (rsync does), and a symlink under it is refused."""
    if local.is_symlink() and not local.exists():
        raise PodError(f"fetch: {local} is a symlink to nothing", "remove it, or point it at a directory")
    if local.exists() and not local.is_dir():
        raise PodError(f"fetch: {local} is a file, not a directory podkit can fetch into",
                       "move it away, or give another --dest")
    for top in TOPS:
        path = local / top
        if path.is_symlink():
            raise PodError(f"fetch: {path} is a symlink; podkit fetches only into real directories",
                           "give the other disk as --dest instead (each pod's files go to DEST/<pod>/)")
        if path.exists() and not path.is_dir():
            raise PodError(f"fetch: {path} is a file of yours where the pod's {top}/ directory goes",
                           "move it away, or give another --dest")


@contextmanager
def _one_fetch(local: Path):
    """One fetch of a pod's directory at a time: two at once each read the record before the other wrote it, and the
    later one's record dropped what the earlier one fetched (then kept as the user's, never fetched again)."""
    import fcntl

    with open(local / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PodError(f"fetch: another fetch-logs is writing {local}", "wait for it to finish, then re-run") from None
        yield


def fetch(conn: PodConnection, remote_dir: str, local: Path, *, rsync_on_pod: bool = True,
          progress: Transfer | None = None, bwlimit: int | None = None) -> TransferStats:
    check_target(local)
    local.mkdir(parents=True, exist_ok=True)
    with _one_fetch(local):
        return _fetch(conn, remote_dir, local, rsync_on_pod, progress, bwlimit)


class PartlyFetched(PodError):
    """A fetch that failed on one top once the others had come back: its error, `fetched` (the tops that came
    back, none where none did) and `stats` of them, so --json can say both (a script that reads only "error"
    cannot tell that runs/ is safe here)."""

    def __init__(self, error: PodError, stats: TransferStats, fetched: list[str]):
        super().__init__(error.problem, error.fix, error.host, error.field)
        self.stats, self.fetched = stats, fetched


def _fetch(conn: PodConnection, remote_dir: str, local: Path, rsync_on_pod: bool,
           progress: Transfer | None, bwlimit: int | None) -> TransferStats:
    record, before = _read_record(local), _local_entries(local)
    kept = {rel for rel, now in before.items() if record.get(rel) != now}
    written: set[str] = set()  # filled as the transfer goes, so a cut one still says what arrived
    start = time.monotonic()
    found = _tops_on_pod(conn, remote_dir)
    # a top the pod does not have is nothing to fetch; without an answer (the project directory itself cannot
    # be entered), each is tried and rsync says what is wrong
    tops = [top for top in TOPS if found is None or found[top][0] == "dir"]
    try:
        stats, fetched, failed = _transfer(conn, remote_dir, local, tops, rsync_on_pod, kept, written, progress,
                                           bwlimit)
    except BaseException:
        # also after a cut transfer: what did arrive is podkit's, and the next run must know it; a record that
        # cannot be written even then leaves the error that stopped the fetch to be reported
        try:
            _record_or_make_room(local, record, before, kept, written)
        except OSError:
            pass
        raise
    try:
        _record_or_make_room(local, record, before, kept, written)
    except OSError as exc:
        raise PodError(f"fetch: the files came back, but {local / RECORD} could not be written ({exc.strerror})",
                       "free space there and re-run; until then the next fetch keeps what came back as yours") from None
    stats.seconds = time.monotonic() - start
    stats.kept = sorted(rel + "/" if before[rel] == DIR else rel for rel in kept)
    failed += [_not_a_directory(remote_dir, top, *found[top], tops) for top in TOPS
               if found is not None and found[top][0] in ("dangling", "file")]
    if failed:
        raise PartlyFetched(failed[0], stats, fetched)
    return stats


def _transfer(conn: PodConnection, remote_dir: str, local: Path, tops: list[str], rsync_on_pod: bool,
              kept: set[str], written: set[str], progress: Transfer | None,
              bwlimit: int | None) -> tuple[TransferStats, list[str], list[PodError]]:
    """Bring `tops` back: what came, the tops that came back, and the error of each top that failed while the link
    stayed up."""
    if not rsync_on_pod:
        return fetch_sftp(conn, remote_dir, local, kept, written, tops=tops), list(tops), []
    stats, fetched, failed = TransferStats(), [], []
    for top in tops:
        try:
            one = _fetch_top(conn, remote_dir, local, top, kept, written, progress, bwlimit)
        except PodError as exc:
            if not conn.alive:
                raise
            # the link is up (a name that is a file on one side and a directory on the other, say): the
            # other top still comes back, as it did when one rsync carried both
            failed.append(exc)
            continue
        fetched.append(top)
        stats.files, stats.bytes = stats.files + one.files, stats.bytes + one.bytes
    return stats, fetched, failed


def _fetch_top(conn: PodConnection, remote_dir: str, local: Path, top: str, kept: set[str], written: set[str],
               progress: Transfer | None, bwlimit: int | None) -> TransferStats:
    """One rsync of the pod's `top` (runs or logs) into local/top. The source's trailing slash makes rsync enter
    it, so a top that is a symlink to a directory is followed; -l keeps every link below it a link."""
    prefix = top + "/"
    with tempfile.NamedTemporaryFile("wb", prefix="podkit-kept-", suffix=".rules") as rules:
        # the user's paths under this top, anchored at the transfer's root: local/top
        rules.write(b"".join(_exclude_rule(rel[len(prefix):]) + b"\0" for rel in sorted(kept)
                             if rel.startswith(prefix)))
        rules.flush()
        # --from0: the rules file is NUL-separated, so a name may hold a newline.
        args = ["-rlptz", "--update", "--from0", f"--exclude-from={rules.name}",
                remote_target(conn, f"{remote_dir.rstrip('/')}/{top}/"), f"{local / top}/"]
        # each top's rsync counts its progress from 0: shown as the fetch's part named after the top
        with progress.part(prefix) if progress is not None else nullcontext():
            return run_rsync(conn, args, what="fetch", progress=progress, bwlimit=bwlimit, written=written,
                             under=top, disk_full=lambda: shutil.disk_usage(local).free < 2**20)


# The project directory's kind (line "."), then, run in it, each top's: dir, none, dangling or file, and for a
# symlink where it points. Exit 3 when a directory that is there cannot be entered.
_TOPS_SCRIPT = """kind() {{
  if [ -d "$1" ]; then echo dir
  elif [ -L "$1" ] && ! [ -e "$1" ]; then echo dangling
  elif [ -e "$1" ] || [ -L "$1" ]; then echo file
  else echo none; fi
}}
report() {{ printf '%s %s %s\\n' "$1" "$(kind "$2")" "$(readlink -- "$2" 2>/dev/null | head -n 1)"; }}
report . {d}
cd -- {d} 2>/dev/null || exit 3
for top in {tops}; do report "$top" "$top"; done"""


def _tops_on_pod(conn: PodConnection, remote_dir: str) -> dict[str, tuple[str, str]] | None:
    """What runs/ and logs/ are on the pod, each (kind, where its symlink points or ""): "dir" (a directory, or a
    symlink to one), "none", "dangling" (a symlink to nothing), "file" (anything else); None when the project
    directory cannot be entered or the answer cannot be read. PodError when the project directory is not there:
    rsync said so only in its own words, and SFTP not at all (a fetch of nothing that exited 0)."""
    result = conn.run(_TOPS_SCRIPT.format(d=shlex.quote(remote_dir), tops=" ".join(TOPS)), prelude=False)
    found = {}
    for line in result.stdout.splitlines():
        top, _, rest = line.partition(" ")
        kind, _, target = rest.partition(" ")
        if top in (".", *TOPS) and kind in ("dir", "none", "dangling", "file"):
            found[top] = (kind, target)
    if found.get(".", ("dir",))[0] != "dir":
        raise _no_project_directory(remote_dir, *found["."])
    found.pop(".", None)
    return found if result.ok and set(found) == set(TOPS) else None


def _no_project_directory(remote_dir: str, kind: str, target: str) -> PodError:
    """The one line for a project directory that is missing on the pod (or a symlink to nothing, or a file)."""
    what = {"none": "does not exist", "dangling": f"is a symlink to {target}, which does not exist",
            "file": f"is a symlink to {target}, which is not a directory" if target else "is a file, not a directory"}
    return PodError(f"fetch: the project directory {remote_dir} on the pod {what[kind]}, so there is nothing to fetch",
                    "give the directory bin/pod deploy used there as --remote-dir, or deploy first")


def _not_a_directory(remote_dir: str, top: str, kind: str, target: str, fetched: list[str]) -> PodError:
    """The one line for a top that is a symlink to nothing, or not a directory: an error rather than a note, since
    the pod's runs are then not where the user keeps them, and a fetch that exits 0 reads as "all safe here"."""
    where = f"{remote_dir.rstrip('/')}/{top}"
    if kind == "dangling":
        what, fix = f"is a symlink to {target}, which does not exist or cannot be reached", \
            "mount or restore what it points to (a volume not attached?), or remove the link, then re-run"
    else:
        what = f"is a symlink to {target}, which is not a directory" if target else "is a file, not a directory"
        fix = f"the pod's {top}/ must be a directory (or a symlink to one): move it away, then re-run"
    rest = f" ({', '.join(t + '/' for t in fetched)} did)" if fetched else ""
    return PodError(f"fetch: {where} on the pod {what}, so nothing under {top}/ came back{rest}", fix)


def theirs(local: Path) -> set[str]:
    """The files and directories under runs/ and logs/ that podkit must not replace (see the module's note)."""
    record = _read_record(local)
    return {rel for rel, now in _local_entries(local).items() if record.get(rel) != now}


def _read_record(local: Path) -> dict:
    try:
        record = json.loads((local / RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError):
        record = None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(v == DIR or (isinstance(v, list) and len(v) == 2) for v in files.values()):
        raise PodError(f"fetch: {local / RECORD} is damaged, so podkit cannot tell its own files from yours",
                       "move it away; the next fetch then keeps every file already there as yours")
    return files


def _local_entries(local: Path) -> dict[str, list[int] | str]:
    """Every file, symlink and directory under runs/ and logs/ by path relative to `local`: [size, mtime_ns], or
    DIR; rsync's partial files and fetch_sftp's in-flight ones are not files yet."""
    found: dict[str, list[int] | str] = {}
    for top in TOPS:
        for dirpath, dirnames, filenames in os.walk(local / top):
            dirnames[:] = [d for d in dirnames if d != PARTIAL_DIR]
            for name in list(dirnames):
                path = os.path.join(dirpath, name)
                if os.path.islink(path):  # os.walk lists a symlink to a directory as a directory, and skips it
                    dirnames.remove(name)
                    filenames.append(name)
                else:
                    found[os.path.relpath(path, local)] = DIR
            for name in filenames:
                if name.endswith(PART):
                    continue
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                found[os.path.relpath(path, local)] = [st.st_size, st.st_mtime_ns]
    return found


def _write_record(local: Path, record: dict, before: dict, kept: set[str], written: set[str]) -> None:
    """What is podkit's now: what this fetch wrote, and what was podkit's before it and is as it was. A file the
    user made or changed while the fetch ran is neither. A directory that appeared during the fetch is taken as
    podkit's even when rsync's line for it never came (a transfer cut just after making it): owning a directory
    only lets the pod's files into it, and any file in it that podkit did not write stays the user's."""
    files = {}
    for rel, now in _local_entries(local).items():
        if rel in kept:
            continue
        if rel in written or (rel in record and before.get(rel) == now) or (now == DIR and rel not in before):
            files[rel] = now
    tmp = local / (RECORD + ".tmp")
    tmp.write_text(json.dumps({"files": files}, sort_keys=True))
    os.replace(tmp, local / RECORD)


def _record_or_make_room(local: Path, record: dict, before: dict, kept: set[str], written: set[str]) -> None:
    """_write_record; on a full disk, again after deleting the transfer's own partial files (rsync's partial-dir,
    fetch_sftp's *.podkit-part), which only make the next fetch resume sooner: without the record, what this fetch
    brought would count as the user's from then on, and never be fetched again."""
    try:
        _write_record(local, record, before, kept, written)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
    for top in TOPS:
        for dirpath, dirnames, filenames in os.walk(local / top):
            for name in dirnames:
                if name == PARTIAL_DIR:
                    shutil.rmtree(os.path.join(dirpath, name), ignore_errors=True)
            dirnames[:] = [d for d in dirnames if d != PARTIAL_DIR]
            for name in filenames:
                if name.endswith(PART):
                    os.unlink(os.path.join(dirpath, name))
    _write_record(local, record, before, kept, written)


def _exclude_rule(rel: str) -> bytes:
    """An rsync exclude anchored at the transfer's root that matches `rel` and nothing else. rsync reads a
    backslash as an escape only in a pattern holding a wildcard (*, ?, [), so escape only there."""
    if any(c in rel for c in "*?["):
        rel = "".join("\\" + c if c in "*?[\\" else c for c in rel)
    return ("/" + rel).encode("utf-8", "surrogateescape")


def fetch_sftp(conn: PodConnection, remote_dir: str, local: Path, kept: set[str] = frozenset(),
               written: set[str] | None = None, tops: list[str] | tuple[str, ...] = TOPS) -> TransferStats:
    """Without rsync on the pod: walk `tops` (runs/ and logs/) over SFTP, same rules (the user's files and
    directories kept, a newer local file never replaced); `written` receives what it writes, as it goes. A top
    that is a symlink to a directory is followed (listdir_attr opens the path); links below it stay links."""
    start = time.monotonic()
    sftp = conn.sftp()
    stats = TransferStats()
    written = set() if written is None else written

    def walk(rel: str) -> None:
        try:
            entries = sftp.listdir_attr(f"{remote_dir}/{rel}")
        except FileNotFoundError:
            return
        for entry in entries:
            child = f"{rel}/{entry.filename}"
            if child in kept:
                continue
            dst = local / child
            if stat.S_ISLNK(entry.st_mode):  # listdir_attr gives lstat's mode
                # As rsync -l: the link itself, never its target (which may be outside the project: .podkit/env).
                if not (dst.exists() or dst.is_symlink()):
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(sftp.readlink(f"{remote_dir}/{child}"), dst)
                    written.add(child)
                    stats.files += 1
                continue
            if dst.is_symlink():
                continue  # never written through a local link (it may point outside pod-logs)
            if stat.S_ISDIR(entry.st_mode):
                if not dst.is_dir():
                    if dst.exists() or dst.is_symlink():
                        continue  # a file of podkit's where the pod now has a directory: left, as rsync would fail
                    dst.mkdir(parents=True)
                    written.add(child)
                walk(child)
                continue
            if dst.is_dir() and not dst.is_symlink():
                continue  # a directory where the pod has a file
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
            written.add(child)
            stats.files += 1
            stats.bytes += entry.st_size

    try:
        for top in tops:
            walk(top)
    except (EOFError, OSError) as exc:
        if conn.frozen is not None:
            raise PodError(f"fetch: {conn.frozen.problem}", conn.frozen.fix) from None
        raise PodError(f"fetch over SFTP failed: {exc}", "re-run; finished files are kept") from None
    finally:
        stats.seconds = time.monotonic() - start
    return stats
