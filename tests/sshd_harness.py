"""A real OpenSSH server on loopback for the pods tests and the deploy benchmark.

Each `LoopbackPod` has its own host key, a throwaway client key in authorized_keys, a free port
on 127.0.0.1, and a project directory under its tmp dir. `drop_connections()` kills the server's
session processes, which is what a pod restart or a network cut looks like to the client.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def sshd_available() -> str | None:
    """Why the SSH tests cannot run here, or None when they can."""
    for tool in (SSHD, shutil.which("ssh-keygen"), shutil.which("rsync"), shutil.which("ssh")):
        if not tool or not os.path.exists(tool):
            return "needs openssh-server, openssh-client and rsync (apt-get install -y openssh-server rsync)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


class LoopbackPod:
    def __init__(self, base: Path, name: str = "pod"):
        self.base = base / name
        self.base.mkdir(parents=True)
        self.name = name
        self.port = free_port()
        self.host_key = keygen(self.base / "host_key")
        self.client_key = keygen(self.base / "client_key")
        self.authorized = self.base / "authorized_keys"
        self.authorized.write_text(Path(f"{self.client_key}.pub").read_text())
        self.remote_dir = str(self.base / "remote" / "project")
        self.user = getpass.getuser()
        self.proc: subprocess.Popen | None = None

    @property
    def spec(self) -> str:
        return f"{self.user}@127.0.0.1:{self.port}"

    def known_hosts_line(self) -> str:
        pub = Path(f"{self.host_key}.pub").read_text().split()
        return f"[127.0.0.1]:{self.port} {pub[0]} {pub[1]}\n"

    def start(self) -> "LoopbackPod":
        Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None
        config = self.base / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.authorized}\nPidFile {self.base / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\nMaxStartups 50\nMaxSessions 50\nLogLevel ERROR\n")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.base / "sshd.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError("sshd exited: " + (self.base / "sshd.log").read_text())
            time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def drop_connections(self) -> int:
        """Kill every session process of this sshd (the listener stays): a dropped link."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in out:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(out)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.drop_connections()
            self.proc.terminate()
            self.proc.wait(timeout=10)


def project_copy(dest: Path) -> Path:
    """A clone-like copy of this repository (tracked and untracked-not-ignored files) to deploy
    from, with the suite's venv linked in so its launchers find fabric and torch."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    venv = Path(sys.prefix)
    (dest / ".venv").symlink_to(venv)
    return dest


def pod_cli(project: Path, *args: str, known_hosts: Path, timeout: float = 300, env: dict | None = None,
            **popen) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)
    argv = [str(project / "bin" / "pod"), args[0], "--known-hosts", str(known_hosts), *args[1:]]
    return subprocess.run(argv,
                          cwd=project, capture_output=True, text=True, timeout=timeout, env=full_env, **popen)
