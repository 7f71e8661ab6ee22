"""Which local files deploy sends: what git would commit, then .podignore on top.

In a git work tree the list is git's own (`git ls-files --cached --others --exclude-standard`),
so negations, nested .gitignore files, .git/info/exclude and core.excludesFile behave exactly as
git does. Outside git the same rules are read with `pathspec` (GitIgnoreSpec follows git's
wildmatch and "last match wins" rules; pathspec 0.12.1). Either way every directory's
.podignore then removes files (`pattern`) or adds back ignored ones (`!pattern`), deeper files
winning over shallower ones, as git does for .gitignore.

Outputs and state never go: .venv/, .podkit/, runs/, logs/, pod-logs/ at the top, .git/ and
caches anywhere.
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path

import pathspec

TOP_LEVEL_NEVER = {".venv", ".podkit", "runs", "logs", "pod-logs"}
ANY_LEVEL_NEVER = {".git", "__pycache__", ".pytest_cache", ".rsync-partial"}


def never_sent(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] in TOP_LEVEL_NEVER:
        return True
    if any(p in ANY_LEVEL_NEVER or p.endswith(".egg-info") for p in parts):
        return True
    return rel.endswith(".pyc") or rel.endswith(".podkit-part")


class _Rules:
    """The ignore files of one tree, read once each, asked deepest directory first."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name

    @lru_cache(maxsize=None)
    def spec(self, directory: str) -> pathspec.GitIgnoreSpec | None:
        path = self.root / directory / self.name if directory else self.root / self.name
        try:
            return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())
        except OSError:
            return None

    def verdict(self, rel: str, is_dir: bool = False) -> bool | None:
        """True: ignored, False: explicitly kept (a negation), None: no rule speaks."""
        parts = rel.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            base = "/".join(parts[:depth])
            spec = self.spec(base)
            if spec is None:
                continue
            sub = "/".join(parts[depth:]) + ("/" if is_dir else "")
            result = spec.check_file(sub).include
            if result is not None:
                return result
        return None


def chosen_files(local: Path) -> list[str]:
    """Paths (relative, '/'-separated, sorted) of the files deploy sends from `local`."""
    local = local.resolve()
    podignore = _Rules(local, ".podignore")
    if _in_git(local):
        files, ignored = _git_lists(local)
    else:
        files, ignored = _walk(local)
    chosen = {f for f in files if not never_sent(f) and podignore.verdict(f) is not True}
    if _negates(local, files):  # git-ignored, but a .podignore negation may add it back
        for entry in ignored:
            if never_sent(entry.rstrip("/")):
                continue  # .venv/, runs/ ...: not even walked
            candidates = _all_files(local, entry.rstrip("/")) if entry.endswith("/") else [entry]
            chosen |= {f for f in candidates if not never_sent(f) and podignore.verdict(f) is False}
    return sorted(f for f in chosen if (local / f).is_symlink() or (local / f).is_file())


def _negates(local: Path, files: list[str]) -> bool:
    """Whether any .podignore has a `!pattern` (only then are ignored files looked at)."""
    for rel in {f for f in files if f.rsplit("/", 1)[-1] == ".podignore"} | {".podignore"}:
        try:
            if any(line.startswith("!") for line in (local / rel).read_text(errors="replace").splitlines()):
                return True
        except OSError:
            pass
    return False


def _in_git(local: Path) -> bool:
    try:
        out = subprocess.run(["git", "-C", str(local), "rev-parse", "--is-inside-work-tree"],
                             capture_output=True, text=True)
    except FileNotFoundError:
        return False
    return out.returncode == 0 and out.stdout.strip() == "true"


def _git_lists(local: Path) -> tuple[list[str], list[str]]:
    def ls(*args: str) -> list[str]:
        out = subprocess.run(["git", "-C", str(local), "ls-files", "-z", *args, "--", "."],
                             capture_output=True, check=True)
        return [p for p in out.stdout.decode(errors="surrogateescape").split("\0") if p]

    files = ls("--cached", "--others", "--exclude-standard")
    ignored = ls("--others", "--ignored", "--exclude-standard", "--directory")
    return files, ignored


def _walk(local: Path) -> tuple[list[str], list[str]]:
    """Outside git: .gitignore files read with pathspec; ignored directories are not entered."""
    gitignore = _Rules(local, ".gitignore")
    files, ignored = [], []
    for dirpath, dirnames, filenames in os.walk(local):
        base = os.path.relpath(dirpath, local)
        base = "" if base == "." else base.replace(os.sep, "/") + "/"
        for d in list(dirnames):
            rel = base + d
            if d == ".git" or gitignore.verdict(rel, is_dir=True) is True:
                dirnames.remove(d)
                if d != ".git":
                    ignored.append(rel + "/")
        for f in filenames:
            rel = base + f
            (ignored if gitignore.verdict(rel) is True else files).append(rel)
    return files, ignored


def _all_files(local: Path, rel_dir: str) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(local / rel_dir):
        base = os.path.relpath(dirpath, local).replace(os.sep, "/")
        out += [f"{base}/{f}" for f in filenames]
    return out
