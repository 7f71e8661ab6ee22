"""One SSH connection to one pod (fabric over paramiko), opened lazily and reused for a command.

Host keys are verified against known_hosts (~/.ssh/known_hosts unless told otherwise). An unknown
key is refused with the fix named; `accept_new=True` records it first, like OpenSSH's
StrictHostKeyChecking=accept-new. A changed key is always refused. Every failure becomes a
one-line `PodError`.

Commands run in one long-lived shell on the pod (pods/shell.py); rsync is carried over the
same transport (pods/rsh.py), so one SSH connection serves the whole invocation.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import fabric
import paramiko

from pods.errors import PodError
from pods.hosts import Endpoint
from pods.shell import LOGIN_TIMEOUT_FACTOR, CommandTimeout, LoginTimeout, RemoteShell, Result

# paramiko logs transport failures itself; podkit reports each one as its own single line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5  # keepalives keep data in flight on a quiet link, so a dead one is noticed
DEAD_LINK_FACTOR = 3  # unacknowledged for 3x the connect timeout (30 s by default) = the link is dead


def default_known_hosts() -> Path:
    return Path(os.path.expanduser("~/.ssh/known_hosts"))


def fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


def _tune_socket(sock: socket.socket, dead_after: float) -> None:
    """TCP settings for a link that carries small request/replies and must notice when it dies.

    TCP_NODELAY: rsync's exchange and each shell command are small writes; Nagle would hold one
    back for the peer's delayed ACK (~40 ms a stall), which OpenSSH avoids the same way.
    TCP_USER_TIMEOUT (Linux only): paramiko's keepalives expect no reply, so a link cut without a
    reset (a stopped pod, a network cut) would otherwise hang until TCP gives up, ~15 minutes;
    with it the kernel drops the connection after `dead_after` seconds unacknowledged.
    """
    if not isinstance(sock, socket.socket):
        return  # a proxy channel: no TCP socket of ours to tune
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after * 1000))


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        self.hostname, self.key = hostname, key
        super().__init__(hostname)


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys, or with accept_new record them in known_hosts (appending, so the
    user's file keeps its comments and other entries)."""

    def __init__(self, known_hosts: Path, accept_new: bool, say: Callable[[str], None]):
        self.known_hosts, self.accept_new, self.say = known_hosts, accept_new, say

    def missing_host_key(self, client, hostname, key):
        if not self.accept_new:
            raise UnknownHostKey(hostname, key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.say(f"recorded host key {fingerprint(key)} for {hostname} in {self.known_hosts}")


class PodConnection:
    """`with PodConnection(endpoint) as conn: conn.run("...")` — one transport for everything."""

    def __init__(self, endpoint: Endpoint, known_hosts: Path | None = None, accept_new: bool = False,
                 timeout: float = CONNECT_TIMEOUT, say: Callable[[str], None] = print):
        self.endpoint = endpoint
        self.known_hosts = Path(known_hosts) if known_hosts else default_known_hosts()
        self.accept_new = accept_new
        self.timeout = timeout
        self.say = say
        self.prelude = ""  # shell run before every command (the pod profile's environment)
        self._fabric: fabric.Connection | None = None
        self._shell: RemoteShell | None = None  # runs every command (see pods/shell.py)
        self._spare: RemoteShell | None = None
        self._want_spare = False
        self._lock = threading.Lock()

    # -- lifecycle
    def __enter__(self) -> "PodConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._shell = self._spare = None
        if self._fabric is not None:
            self._fabric.close()
            self._fabric = None

    @property
    def connection(self) -> fabric.Connection:
        if self._fabric is None or not self._fabric.is_connected:
            self._fabric = self._open()
        return self._fabric

    def _open(self) -> fabric.Connection:
        ep = self.endpoint
        keys = list(ep.key_files)
        conn = fabric.Connection(
            host=ep.hostname, user=ep.user, port=ep.port, connect_timeout=self.timeout,
            # An explicit empty SSHConfig: hosts.resolve already read ~/.ssh/config, once.
            config=fabric.Config(ssh_config=paramiko.SSHConfig()),
            connect_kwargs={
                "key_filename": keys,
                "look_for_keys": not keys,
                "allow_agent": not keys,
                "banner_timeout": self.timeout,
                "auth_timeout": self.timeout,
            },
        )
        client = conn.client
        if self.known_hosts.is_file():
            try:
                client.load_host_keys(str(self.known_hosts))
            except (OSError, paramiko.SSHException) as exc:
                raise PodError(f"cannot read {self.known_hosts}: {exc}", "fix or move that file") from None
        client.set_missing_host_key_policy(_HostKeyPolicy(self.known_hosts, self.accept_new, self.say))
        try:
            conn.open()
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            conn.close()
            raise self._describe(exc) from None
        conn.transport.set_keepalive(KEEPALIVE_S)
        _tune_socket(conn.transport.sock, DEAD_LINK_FACTOR * self.timeout)
        return conn

    def _describe(self, exc: BaseException) -> PodError:
        ep = self.endpoint
        where = f"{ep.hostname}:{ep.port}"
        if isinstance(exc, UnknownHostKey):
            return PodError(
                f"host key of {exc.hostname} ({fingerprint(exc.key)}) is not in {self.known_hosts}",
                "check it, then re-run with ACCEPT_NEW=1 (--accept-new) to record it")
        if isinstance(exc, paramiko.BadHostKeyException):
            return PodError(
                f"host key of {ep.known_hosts_name} CHANGED (now {fingerprint(exc.key)}); refusing to connect",
                f"if the pod was re-created, remove the old key: ssh-keygen -R '{ep.known_hosts_name}' -f {self.known_hosts}")
        if isinstance(exc, paramiko.AuthenticationException):
            tried = ", ".join(ep.key_files) or "agent and default keys"
            return PodError(f"{ep.user}@{where} refused the key ({tried})", "give the right KEY=path, or check the user")
        if isinstance(exc, socket.gaierror):
            return PodError(f"cannot resolve host name '{ep.hostname}'", "check HOST")
        if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
            return PodError(f"connection refused by {where}",
                            "is the pod running, and is the port right? RunPod changes it on every restart")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return PodError(f"no answer from {where} within {self.timeout:.0f} s", "check the host and port, and that the pod is running")
        if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower() or "No existing session" in str(exc)):
            return PodError(f"{where} did not answer as an SSH server within {self.timeout:.0f} s", "check the port")
        if isinstance(exc, (EOFError, ConnectionResetError, paramiko.SSHException, OSError)):
            return PodError(f"connection to {where} failed: {exc or type(exc).__name__}", "re-run; check the pod is up")
        return PodError(f"connection to {where} failed: {type(exc).__name__}: {exc}")

    # -- commands
    def open(self) -> "PodConnection":
        self.connection  # noqa: B018 - opens and verifies now, for a clear early error
        return self

    def run(self, command: str, *, stdin: str | None = None, out: Callable[[str], None] | None = None,
            timeout: float | None = None, check: bool = False, prelude: bool = True) -> Result:
        """Run `command` under bash on the pod after the profile's prelude, in the shared shell.

        `stdin` is the way secrets reach the pod (never argv). `out` receives output lines as they
        come (stdout and stderr each line by line); without it they are collected. A dropped
        connection raises PodError; a command's own failure is in Result.exit_code (or raises
        with check).
        """
        script = f"{self.prelude}\n{command}" if prelude and self.prelude else command
        with self._lock, self._faults(timeout):
            result = self._shell_for_commands().run(script, stdin=stdin, out=out, timeout=timeout)
        if check and not result.ok:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise PodError(f"remote command failed ({result.exit_code}): {detail[-1] if detail else command[:60]}")
        return result

    def exec(self, command: str) -> paramiko.Channel:
        """Run `command` in place of a fresh shell (the pre-started spare when there is one) and
        hand over its channel: rsync's transport (pods/rsh.py)."""
        shell, self._spare = self._spare, None
        with self._faults():
            if shell is None or shell.dead:
                shell = RemoteShell(self.connection.transport, self.timeout)
            return shell.exec(command)

    def warm_spare(self) -> None:
        """Have a second shell ready for `exec`. It starts once the first shell is up, so its
        login rc files run while the first one works (two at once slow a small pod)."""
        self._want_spare = True
        if self._shell is not None and not self._shell.dead:
            self._start_spare()

    def _shell_for_commands(self) -> RemoteShell:
        if self._shell is None or self._shell.dead:
            self._shell = RemoteShell(self.connection.transport, self.timeout)
            if self._want_spare:
                self._shell.wait_ready()
                self._start_spare()
        return self._shell

    def _start_spare(self) -> None:
        if self._spare is None:
            with self._faults():
                self._spare = RemoteShell(self.connection.transport, self.timeout)

    @contextmanager
    def _faults(self, timeout: float | None = None) -> Iterator[None]:
        """The shell's and the transport's failures, each as one PodError."""
        try:
            yield
        except CommandTimeout:
            raise PodError(f"remote command ran past {timeout:.0f} s", "re-run; the pod may be overloaded") from None
        except LoginTimeout:
            raise PodError(f"the login shell on {self.endpoint.hostname} did not start within "
                           f"{LOGIN_TIMEOUT_FACTOR * self.timeout:.0f} s",
                           "check ~/.bashrc on the pod: something there hangs or waits for input") from None
        except PodError:
            raise
        except Exception as exc:  # noqa: BLE001 - ShellClosed, paramiko and socket errors alike
            raise self._dropped(exc) from None

    def _dropped(self, exc: BaseException) -> PodError:
        return PodError(f"connection to {self.endpoint.hostname}:{self.endpoint.port} dropped ({type(exc).__name__})",
                        "re-run the same command; it continues where it stopped")

    def sftp(self) -> paramiko.SFTPClient:
        try:
            return self.connection.sftp()
        except Exception as exc:  # noqa: BLE001
            raise self._dropped(exc) from None
