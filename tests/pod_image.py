"""A loopback pod whose filesystem looks like a provider's image (RunPod's /workspace volume,
SageMaker's /home/ec2-user with its conda envs), built from directories, not from mocks.

sshd runs chrooted in a private mount namespace (root only): the root is a tmpfs holding a
recursive bind of every top-level directory of this machine, with the image's directories bound
over them (`replace`: "/workspace" -> a tmp dir, "/home" -> a tmp dir with ec2-user's home) and
single files bound over theirs (`files`: "/etc/passwd" with an ec2-user line). Nothing of it is
visible outside the namespace; it ends with the last process in it. Processes on the pod are
therefore exactly the processes in sshd's mount namespace, which is how `processes()` finds
whatever a test left running there, detached or not.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sshd_harness import LoopbackPod


def namespaces_available() -> str | None:
    """Why an image pod cannot run here, or None."""
    if os.geteuid() != 0:
        return "an image pod chroots sshd in a mount namespace: needs root"
    if not shutil.which("unshare") or not shutil.which("chroot"):
        return "needs unshare and chroot (util-linux, coreutils)"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return None if out.returncode == 0 else "this container does not allow mount namespaces"


class ImagePod(LoopbackPod):
    def __init__(self, base: Path, name: str, replace: dict[str, Path], files: dict[str, Path] | None = None,
                 **kwargs):
        super().__init__(base, name, **kwargs)
        self.replace, self.files = replace, files or {}
        self.root = self.base / "root"
        self.root.mkdir()

    def launch_prefix(self) -> list[str]:
        r = shlex.quote(str(self.root))
        lines = ["set -e", f"mount -t tmpfs podkit-pod {r}"]
        for entry in sorted(os.listdir("/")):
            src = Path("/") / entry
            if src.is_symlink():  # bin -> usr/bin and friends
                lines.append(f"ln -s {shlex.quote(os.readlink(src))} {r}/{shlex.quote(entry)}")
            elif src.is_dir():
                lines.append(f"mkdir {r}/{shlex.quote(entry)} && mount --rbind {shlex.quote(str(src))} {r}/{shlex.quote(entry)}")
        for target, src in {**self.replace, **self.files}.items():
            dest = f"{r}{shlex.quote(target)}"
            if target in self.replace and Path(target).parent == Path("/"):
                lines.append(f"mkdir -p {dest}")  # a new top-level directory lives on the tmpfs
            lines.append(f"mount --bind {shlex.quote(str(src))} {dest}")
        lines.append(f'exec chroot {r} "$@"')
        return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", "\n".join(lines), "pod-image"]

    def processes(self) -> list[int]:
        """Every process on the pod (in sshd's mount namespace) except the listening sshd itself."""
        ns = os.readlink(f"/proc/{self.proc.pid}/ns/mnt")
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != self.proc.pid:
                try:
                    if os.readlink(f"/proc/{pid}/ns/mnt") == ns:
                        found.append(int(pid))
                except OSError:
                    continue
        return found


def python_with_torch(bin_dir: Path, name: str = "python3") -> Path:
    """`bin_dir/name`: the suite's interpreter (it has torch) as the image's python, a shell
    wrapper so it keeps its own venv; envsetup bridges a venv interpreter's site-packages."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    if path.is_symlink() or path.exists():
        path.unlink()  # a mirror's link to the real one: replaced, never written through
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return path


def unusable_pythons(base: Path, without_torch: bool = False) -> dict[str, Path]:
    """Files that exist but cannot serve as the image's python, each made for real: one whose execute bit is
    off, a directory, a wrapper that fails as a python missing its libpython does, and a Python without torch
    (a bare venv of this interpreter's own base install), with `without_torch`: refused where torch is needed
    (a GPU pod, a node without the project venv), not on a CPU machine, where envsetup installs CPU torch."""
    base.mkdir(parents=True, exist_ok=True)
    not_executable = base / "not-executable"
    not_executable.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    not_executable.chmod(0o644)
    directory = base / "a-directory"
    directory.mkdir()
    broken = base / "broken"
    broken.write_text("#!/bin/sh\necho 'python3: error while loading shared libraries: libpython3.11.so.1.0: "
                      "cannot open shared object file' >&2\nexit 127\n")
    broken.chmod(0o755)
    found = {"is not executable (mode 644)": not_executable, "is a directory": directory,
             "does not run as Python 3 (exit 127: python3: error while loading shared libraries": broken}
    if without_torch:
        found["has no torch"] = torchless_python(base)
    return found


def torchless_python(base: Path) -> Path:
    """A real Python without torch: a bare venv of this interpreter's own base install."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "bare")], check=True)
    bare = base / "bare" / "bin" / "python"
    if subprocess.run([str(bare), "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{bare} has torch: no torch-less python to test with")
    return bare


def mirror(directory: str, dest: Path) -> Path:
    """`dest` with a link to each entry of `directory`, to be bound over it with more added."""
    dest.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            (dest / entry).symlink_to(Path(directory) / entry)
    return dest


def fresh_home(dest: Path, home: str) -> dict[str, Path]:
    """An image's own, empty `home` (no login rc files of this machine, no pyenv shims first on
    PATH), as `replace` entries. The suite's interpreter keeps working when its base install
    lives under that home (pyenv's ~/.pyenv): that one directory is bound back in."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    entries = {home: dest}
    for path in {os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)}:
        rel = Path(path).relative_to(home) if Path(path).is_relative_to(home) else None
        if rel is not None and rel.parts:
            top = rel.parts[0]
            (dest / top).mkdir(exist_ok=True)
            entries[f"{home}/{top}"] = Path(home) / top
    return entries


def laptop_venv(project: Path) -> None:
    """The copy's .venv as `make setup` leaves it (its .installed marker newer than the Makefile),
    built from links into the suite's venv, so `make deploy`'s setup prerequisite is satisfied and
    never re-runs pip on the suite's shared venv."""
    shared = Path(os.path.realpath(project / ".venv"))
    (project / ".venv").unlink()
    venv = project / ".venv"
    venv.mkdir()
    for entry in shared.iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()
