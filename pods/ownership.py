"""Deploy owns only what it writes: which remote directory it may use, and which files in it are its own.

A project directory is podkit's when podkit created it (or found it empty): it then holds
`.podkit/`. A directory that exists, is not empty and has no `.podkit/` belongs to someone else
and is refused unless the user says --force. Either way a sync only ever deletes files that
`.podkit/manifest` records as sent by podkit before, so a user's own files survive everything.
"""

from __future__ import annotations

import base64
import posixpath
import shlex

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError

MARKER = ".podkit"
MANIFEST = ".podkit/manifest"
# Directories that are never a project directory (FHS 3.0 top-level directories, plus the
# usual mount points and RunPod's volume root), refused outright and with everything below the
# system ones.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
                "/sbin", "/sys", "/usr", "/var/lib", "/var/log", "/var/run", "/snap")
NOT_PROJECT_DIRS = ("/", "/home", "/root", "/tmp", "/var", "/opt", "/srv", "/mnt", "/media", "/workspace", "/var/tmp")


def normalise(remote_dir: str, home: str) -> str:
    """Absolute, '~' expanded, no '.', '..', repeated or trailing slashes: the one form every check sees."""
    path = remote_dir.strip()
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    if not path.startswith("/"):
        raise PodError(f"REMOTE_DIR '{remote_dir}' is not an absolute path", "give REMOTE_DIR=/absolute/path/to/project")
    path = posixpath.normpath("/" + path.lstrip("/"))  # normpath keeps a leading '//' (POSIX): drop it first
    return "/" + path.lstrip("/")


def refuse_unsafe(path: str, home: str) -> None:
    """`path` is normalised. Refuse '/', home directories and system directories outright."""
    homes = {posixpath.normpath(home)} if home else set()
    parent = posixpath.dirname(path)
    if path in NOT_PROJECT_DIRS or path in homes or parent == "/home":
        raise PodError(f"REMOTE_DIR {path} is a system or home directory, not a project directory",
                       f"use a directory of its own, e.g. REMOTE_DIR={path.rstrip('/')}/podkit")
    for tree in SYSTEM_TREES:
        if path == tree or path.startswith(tree + "/"):
            raise PodError(f"REMOTE_DIR {path} is inside the system directory {tree}",
                           "use a directory of its own under your home or /workspace")


CLAIM_SCRIPT = r'''
d={d}
if [ -d "$d/.podkit" ]; then echo owned; exit 0; fi
if [ -e "$d" ] && [ ! -d "$d" ]; then echo notdir; exit 0; fi
if [ -d "$d" ] && [ -n "$(ls -A "$d" 2>/dev/null)" ] && [ {force} != 1 ]; then echo foreign; exit 0; fi
mkdir -p "$d/.podkit" || exit 3
date -u +%Y-%m-%dT%H:%M:%SZ > "$d/.podkit/created"
echo claimed
'''


def claim(conn: PodConnection, remote_dir: str, *, force: bool = False) -> str:
    """Make sure deploy may write into `remote_dir`: 'owned', 'claimed' (new, empty or --force)."""
    result = conn.run(CLAIM_SCRIPT.format(d=shlex.quote(remote_dir), force=int(force)), prelude=False)
    state = result.stdout.strip().splitlines()[-1:] or [""]
    if state[0] == "foreign":
        raise PodError(f"REMOTE_DIR {remote_dir} exists, is not empty and was not created by podkit; refusing to write there",
                       "pick a new or empty directory, or re-run with --force (FORCE=1) to add podkit's files "
                       "beside what is there; podkit never deletes files it did not send")
    if state[0] == "notdir":
        raise PodError(f"REMOTE_DIR {remote_dir} exists and is not a directory", "pick another REMOTE_DIR")
    if state[0] not in ("owned", "claimed"):
        detail = (result.stderr or result.stdout).strip().splitlines()
        if any("No space" in line for line in detail):
            raise PodError(f"the pod's disk is full at {remote_dir}", "free space, then re-run")
        raise PodError(f"cannot create {remote_dir}: {detail[-1] if detail else result.exit_code}",
                       "set REMOTE_DIR= to a writable path")
    return state[0]


def deployed(conn: PodConnection, remote_dir: str) -> bool:
    return conn.run(f"[ -d {shlex.quote(remote_dir)}/.podkit ]", prelude=False).ok


def read_manifest(conn: PodConnection, remote_dir: str) -> set[str] | None:
    """What podkit sent before; None when there is no manifest (nothing may be deleted then)."""
    q = shlex.quote(f"{remote_dir}/{MANIFEST}")
    result = conn.run(f"[ -r {q} ] || exit 3; base64 < {q}", prelude=False)
    if result.exit_code == 3:
        return None
    raw = base64.b64decode("".join(result.stdout.split()))
    return {p for p in raw.decode(errors="surrogateescape").split("\0") if _safe_relative(p)}


def write_manifest(conn: PodConnection, remote_dir: str, paths: set[str]) -> None:
    q = shlex.quote(f"{remote_dir}/{MANIFEST}")
    data = "\0".join(sorted(paths))
    conn.run(f"mkdir -p {shlex.quote(remote_dir)}/.podkit && cat > {q}.tmp && mv {q}.tmp {q}", stdin=data,
             prelude=False, check=True)


def delete_stale(conn: PodConnection, remote_dir: str, stale: set[str]) -> int:
    """Remove files podkit sent before and no longer sends, and directories they leave empty; returns how
    many files were there and are gone (one already missing, or now a directory, is not counted)."""
    stale = {p for p in stale if _safe_relative(p) and "\n" not in p}  # one name per line on the wire
    if not stale:
        return 0
    # A name whose directory is reached through a symlink (the user's: podkit makes real directories) is left
    # alone: removing it would remove a file elsewhere, which podkit never sent.
    script = (f"cd {shlex.quote(remote_dir)} || exit 3\n"
              "root=$(pwd -P)\n"
              "while IFS= read -r f || [ -n \"$f\" ]; do\n"
              "  p=$(dirname -- \"$f\")\n"
              "  d=$(cd -P -- \"./$p\" 2>/dev/null && pwd) || continue\n"  # ./: not $OLDPWD for -, not CDPATH
              "  if [ \"$p\" = . ]; then [ \"$d\" = \"$root\" ] || continue; else [ \"$d\" = \"$root/$p\" ] || continue; fi\n"
              "  if [ ! -d \"$f\" ] || [ -L \"$f\" ]; then { [ -e \"$f\" ] || [ -L \"$f\" ]; } && rm -f -- \"$f\" && printf '%s\\n' \"$f\"; fi\n"
              "  [ \"$p\" = . ] || rmdir -p --ignore-fail-on-non-empty -- \"$p\" 2>/dev/null\n"
              "done; true")
    out = conn.run(script, stdin="".join(f"{p}\n" for p in sorted(stale)), prelude=False, check=True).stdout
    return sum(1 for line in out.split("\n") if line in stale)


def _safe_relative(path: str) -> bool:
    return bool(path) and not path.startswith("/") and ".." not in path.split("/") and not path.startswith(MARKER)


def existing(conn: PodConnection, remote_dir: str, paths: set[str]) -> list[str]:
    """Which of `paths` (relative to remote_dir) podkit cannot write without replacing something on the pod: the
    path exists, or one of its parent directories is not a directory. Sorted."""
    paths = {p for p in paths if _safe_relative(p) and "\n" not in p}
    parents = {posixpath.dirname(p) for p in paths}
    parents = {d for p in parents for d in _ancestors(p)}
    if not paths:
        return []
    # One name per line each way; "F" for a path that exists, "N" for a parent that exists but is no directory.
    script = (f"cd {shlex.quote(remote_dir)} || exit 3\n"
              "while IFS= read -r kind && IFS= read -r f; do\n"
              "  if [ \"$kind\" = F ]; then { [ -e \"$f\" ] || [ -L \"$f\" ]; } && printf '%s\\n' \"$f\"\n"
              "  elif { [ -e \"$f\" ] || [ -L \"$f\" ]; } && [ ! -d \"$f\" ]; then printf '%s\\n' \"$f\"; fi\n"
              "done; true")
    # Every line ends in a newline: `read` fails on a last line without one, and the pair it began would go
    # unchecked (the last path in sorted order was never tested, so deploy overwrote a user's file there).
    stdin = "".join(f"{line}\n" for p in sorted(paths) for line in ("F", p)) + \
        "".join(f"{line}\n" for d in sorted(parents) for line in ("N", d))
    out = conn.run(script, stdin=stdin, prelude=False, check=True).stdout
    return sorted(line for line in out.split("\n") if line in paths or line in parents)


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("", "."):
        out.append(path)
        path = posixpath.dirname(path)
    return out


def unclaim(conn: PodConnection, remote_dir: str) -> None:
    """Undo a claim that sent nothing (a --force deploy that stopped before writing): its .podkit/ holds only the
    claim's own `created`, which would make the next deploy take the directory for podkit's."""
    d = shlex.quote(f"{remote_dir}/.podkit")
    conn.run(f"[ \"$(ls -A {d})\" = created ] && rm -f {d}/created && rmdir {d}; true", prelude=False)
