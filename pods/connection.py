"""One SSH connection to one pod (fabric over paramiko), opened lazily and reused for a command.

Host keys are verified against known_hosts (~/.ssh/known_hosts unless told otherwise). An unknown
key is refused with the fix named; `accept_new=True` records it first, like OpenSSH's
StrictHostKeyChecking=accept-new. A changed key is always refused. Every failure becomes a
one-line `PodError`.

`ssh_argv()` gives the same settings to OpenSSH for rsync, which needs its own transport.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import select
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import fabric
import paramiko

from pods.errors import PodError
from pods.hosts import Endpoint

# paramiko logs transport failures itself; podkit reports each one as its own single line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5  # a dead link is noticed within a few keepalives instead of a TCP timeout


def default_known_hosts() -> Path:
    return Path(os.path.expanduser("~/.ssh/known_hosts"))


def fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


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


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


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

    # -- lifecycle
    def __enter__(self) -> "PodConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
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
        """Run `command` under bash on the pod after the profile's prelude.

        `stdin` is the way secrets reach the pod (never argv). `out` receives output lines as they
        come (stdout and stderr merged); without it they are collected. A dropped connection
        raises PodError; a command's own failure is in Result.exit_code (or raises with check).
        """
        script = f"{self.prelude}\n{command}" if prelude and self.prelude else command
        transport = self.connection.transport
        try:
            chan = transport.open_session(timeout=self.timeout)
            chan.exec_command("bash -c " + shlex.quote(script))
            if stdin is not None:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            result = self._pump(chan, out, timeout)
        except PodError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._dropped(exc) from None
        if check and not result.ok:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise PodError(f"remote command failed ({result.exit_code}): {detail[-1] if detail else command[:60]}")
        return result

    def _pump(self, chan: paramiko.Channel, out, timeout: float | None) -> Result:
        deadline = time.monotonic() + timeout if timeout else None
        stdout, stderr, pending = [], [], {"o": b"", "e": b""}

        def feed(tag: str, data: bytes, sink: list):
            sink.append(data)
            if out is None:
                return
            buf = pending[tag] + data
            *lines, pending[tag] = buf.split(b"\n")
            for line in lines:
                out(line.decode(errors="replace"))

        while True:
            if chan.recv_ready():
                feed("o", chan.recv(65536), stdout)
                continue
            if chan.recv_stderr_ready():
                feed("e", chan.recv_stderr(65536), stderr)
                continue
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if chan.closed or not self.connection.transport.is_active():
                break
            if deadline and time.monotonic() > deadline:
                chan.close()
                raise PodError(f"remote command ran past {timeout:.0f} s", "re-run; the pod may be overloaded")
            select.select([chan], [], [], 0.2)
        if out is not None:
            for tag in ("o", "e"):
                if pending[tag]:
                    out(pending[tag].decode(errors="replace"))
        if not chan.exit_status_ready():
            raise self._dropped(EOFError("channel closed without an exit status"))
        return Result(chan.recv_exit_status(), b"".join(stdout).decode(errors="replace"),
                      b"".join(stderr).decode(errors="replace"))

    def _dropped(self, exc: BaseException) -> PodError:
        return PodError(f"connection to {self.endpoint.hostname}:{self.endpoint.port} dropped ({type(exc).__name__})",
                        "re-run the same command; it continues where it stopped")

    def sftp(self) -> paramiko.SFTPClient:
        try:
            return self.connection.sftp()
        except Exception as exc:  # noqa: BLE001
            raise self._dropped(exc) from None

    # -- the same settings for OpenSSH (rsync's transport)
    def ssh_argv(self) -> list[str]:
        ep = self.endpoint
        argv = ["ssh", "-F", ep.ssh_config or "/dev/null", "-p", str(ep.port), "-l", ep.user,
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(self.timeout)}",
                "-o", f"ServerAliveInterval={KEEPALIVE_S}", "-o", "ServerAliveCountMax=3",
                "-o", "LogLevel=ERROR"]
        if ep.key_files:
            argv += ["-o", "IdentitiesOnly=yes"]
            for key in ep.key_files:
                argv += ["-i", key]
        return argv
