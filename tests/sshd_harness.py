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
    address = "127.0.0.1"
    netns: str | None = None  # run sshd inside this network namespace

    def __init__(self, base: Path, name: str = "pod", extra_config: str = ""):
        self.extra_config = extra_config  # more sshd_config lines (e.g. SetEnv for a noisy login rc)
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
        return f"{self.user}@{self.address}:{self.port}"

    def known_hosts_line(self) -> str:
        pub = Path(f"{self.host_key}.pub").read_text().split()
        return f"[{self.address}]:{self.port} {pub[0]} {pub[1]}\n"

    def start(self) -> "LoopbackPod":
        Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None
        config = self.base / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress {self.address}\nHostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.authorized}\nPidFile {self.base / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\nMaxStartups 50\nMaxSessions 50\nLogLevel ERROR\n" + self.extra_config)
        self.proc = subprocess.Popen([*self.launch_prefix(), SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.base / "sshd.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 30  # a loaded 2-core CI machine can take seconds
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.address, self.port)) == 0:
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError("sshd exited: " + (self.base / "sshd.log").read_text())
            time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def launch_prefix(self) -> list[str]:
        """What sshd's command line is run under (a network namespace here; a subclass may add more)."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

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


class NamespacePod(LoopbackPod):
    """An sshd in its own network namespace, reached over a veth pair, so the test can cut the
    link silently (`cut()`: no reset, packets just stop), as a stopped pod or a network outage does."""

    def __init__(self, base: Path, name: str, subnet: int):
        super().__init__(base, name)
        self.netns = f"podkit-{os.getpid()}-{subnet}"
        self.host_if, self.pod_if = f"pkh{os.getpid() % 10000}x{subnet}", f"pkp{os.getpid() % 10000}x{subnet}"
        # A /30 of its own per test process and pod (10.231.<pid % 250>.<4 x subnet>): two suites on one
        # machine (or a namespace a killed run left behind) never share an address.
        if not 0 <= subnet < 63:
            raise ValueError(f"subnet {subnet} out of 0..62")
        self.prefix, self.net = f"10.231.{os.getpid() % 250}", 4 * subnet
        self.address = f"{self.prefix}.{self.net + 2}"

    @staticmethod
    def available() -> str | None:
        if os.geteuid() != 0 or not shutil.which("ip"):
            return "network namespaces need root and iproute2"
        probe = f"podkit-probe-{os.getpid()}"
        if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
            return "this kernel or container does not allow network namespaces"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def start(self) -> "NamespacePod":
        try:
            return self._start()
        except BaseException:
            self.stop()  # never leave a namespace or veth pair behind a failed start
            raise

    def _start(self) -> "NamespacePod":
        for cmd in (f"ip netns add {self.netns}",
                    f"ip link add {self.host_if} type veth peer name {self.pod_if}",
                    f"ip link set {self.pod_if} netns {self.netns}",
                    f"ip addr add {self.prefix}.{self.net + 1}/30 dev {self.host_if}",
                    f"ip link set {self.host_if} up",
                    f"ip netns exec {self.netns} ip addr add {self.address}/30 dev {self.pod_if}",
                    f"ip netns exec {self.netns} ip link set {self.pod_if} up",
                    f"ip netns exec {self.netns} ip link set lo up"):
            subprocess.run(cmd.split(), check=True, capture_output=True)
        return super().start()

    def cut(self) -> None:
        """The pod's side of the link goes down: nothing answers, nothing resets."""
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", self.pod_if, "down"], check=True)

    def restore(self) -> None:
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", self.pod_if, "up"], check=True)

    def stop(self) -> None:
        super().stop()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


class BridgedNetwork:
    """Network namespaces joined by a bridge in the root namespace: pods that reach each other and
    the laptop (the root namespace) as the nodes of one cluster do, each with its own sshd.

    Per test process a /28 of its own (10.232.0.0/16 cut by pid; NamespacePod uses 10.231/16): the
    bridge is .1, node i is .(i + 2). Names carry the full pid, so what a killed run left behind is
    found and removed on the next start, and only when that pid is dead.
    """

    def __init__(self, count: int):
        if not 1 <= count <= 13:
            raise ValueError(f"{count} nodes: a /28 holds 13 besides the bridge")
        pid = os.getpid()
        block = (pid % 4096) * 16
        self.prefix = f"10.232.{block // 256}"
        self.first = block % 256
        self.bridge = f"pkb{pid}"
        self.namespaces = [f"podkit-{pid}-node{i}" for i in range(count)]
        self.links = [(f"pkv{pid}n{i}", f"pkq{pid}n{i}") for i in range(count)]  # root side, node side

    def address(self, i: int) -> str:
        return f"{self.prefix}.{self.first + i + 2}"

    def interface(self, i: int) -> str:
        return self.links[i][1]

    def start(self) -> "BridgedNetwork":
        remove_stale_namespaces()
        try:
            _ip(f"link add {self.bridge} type bridge")
            _ip(f"addr add {self.prefix}.{self.first + 1}/28 dev {self.bridge}")
            _ip(f"link set {self.bridge} up")
            for i, (ns, (outer, inner)) in enumerate(zip(self.namespaces, self.links)):
                _ip(f"netns add {ns}")
                _ip(f"link add {outer} type veth peer name {inner}")
                _ip(f"link set {inner} netns {ns}")
                _ip(f"link set {outer} master {self.bridge}")
                _ip(f"link set {outer} up")
                _ip(f"netns exec {ns} ip addr add {self.address(i)}/28 dev {inner}")
                _ip(f"netns exec {ns} ip link set {inner} up")
                _ip(f"netns exec {ns} ip link set lo up")
        except BaseException:
            self.stop()  # never leave a namespace or a bridge behind a failed start
            raise
        return self

    def pod(self, base: Path, i: int) -> LoopbackPod:
        """A pod (not yet started) whose sshd listens on node i's address inside its namespace."""
        pod = LoopbackPod(base, f"node{i}")
        pod.netns, pod.address = self.namespaces[i], self.address(i)
        return pod

    def pids(self, i: int) -> list[int]:
        """Processes whose network is node i's namespace (what `ps` on that pod would list)."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> None:
        for ns, (outer, _) in zip(self.namespaces, self.links):
            subprocess.run(["ip", "link", "del", outer], capture_output=True)  # and its peer in the namespace
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _ip(args: str) -> None:
    subprocess.run(["ip", *args.split()], check=True, capture_output=True)


def remove_stale_namespaces() -> list[str]:
    """Namespaces and bridges a killed test run left behind (their pid is dead); never a live run's."""
    import re

    def dead(pid: str) -> bool:
        return not os.path.exists(f"/proc/{pid}")

    removed = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in names:
        m = re.fullmatch(r"podkit-(\d+)-\w+", name)
        if m and dead(m.group(1)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for m in re.finditer(r"^\d+: (pkb(\d+))[:@]", links, flags=re.M):
        if dead(m.group(2)):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)
            removed.append(m.group(1))
    return removed


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


def pod_world(base: Path, name: str, **pod_kwargs):
    """A started loopback pod, a copy of this project as the laptop, and a known_hosts that trusts
    the pod: what each pods test module's `world` fixture starts from. Stop it with world.pod.stop()."""
    from types import SimpleNamespace

    pod = LoopbackPod(base, name, **pod_kwargs).start()
    project = project_copy(base / "laptop" / "podkit")
    known_hosts = base / "known_hosts"
    known_hosts.write_text(pod.known_hosts_line())
    return SimpleNamespace(base=base, pod=pod, project=project, known_hosts=known_hosts)


def wait_for(predicate, timeout: float = 60.0, every: float = 0.1) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; its value at the deadline decides."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def one_line_error(out, notes_before: bool = False) -> str:
    """A command's bad-input contract: exit 2, one `error: ` line on stderr, no traceback. With
    `notes_before`, notes (a host key pinned, a pod that moved) may come before that one error line."""
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stderr, out.stderr
    if notes_before:
        assert lines and lines[-1].startswith("error: "), out.stderr
        assert sum(line.startswith("error: ") for line in lines) == 1, out.stderr
    else:
        assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[-1]
