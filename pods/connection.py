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
import collections
import hashlib
import logging
import os
import secrets
import shlex
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import fabric
import paramiko

from podkit.pods.errors import OutputClosed, PodError, Unreachable
from podkit.pods.hosts import Endpoint, agent_available
from podkit.pods.shell import LOGIN_TIMEOUT_FACTOR, CommandTimeout, LoginTimeout, RemoteShell, Result, ShellClosed

# paramiko logs transport failures itself; podkit reports each one as its own single line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 5  # keepalives keep data in flight on a quiet link, so a dead one is noticed
DEAD_LINK_FACTOR = 3  # unacknowledged for 3x the connect timeout (30 s by default) = the link is dead
TIMEOUT_STOP_GRACE = 5.0  # s between SIGTERM and SIGKILL for a command past its timeout: a hung one rarely heeds TERM


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


class _Watchdog(threading.Thread):
    """OpenSSH's ServerAliveInterval/CountMax, which paramiko lacks: a global request that wants a
    reply (sshd answers every one, even unknown ones, RFC 4254 section 4) every `interval` s. A pod
    whose kernel still ACKs TCP while its sshd is frozen (stopped, swapping) answers nothing at the
    SSH level; after `dead_after` s without a reply the transport is closed, so every blocked read
    ends and the caller reports the host and what timed out."""

    def __init__(self, transport: paramiko.Transport, interval: float, dead_after: float):
        super().__init__(daemon=True, name="podkit-watchdog")
        self.transport, self.interval, self.dead_after = transport, interval, dead_after
        self.dead = False
        self._stop = threading.Event()

    def run(self) -> None:
        while self.transport.is_active() and not self._stop.is_set():
            asked = threading.Thread(target=self._ask, daemon=True)
            asked.start()
            asked.join(self.dead_after)
            if asked.is_alive() and not self._stop.is_set():
                self.dead = True
                self.transport.close()  # wakes every reader; the request thread returns too
                return
            self._stop.wait(self.interval)

    def _ask(self) -> None:
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a closed transport: the readers report it
            pass

    def stop(self) -> None:
        self._stop.set()


class _ProxyProcess(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, with its stderr drained and its end waited for.

    paramiko (5.1, proxy.py) pipes the process's stderr and never reads it: a chatty proxy (sm-ssh's
    logs) would block on a full pipe; drained here, the last lines say why it failed. Its close()
    sends SIGTERM even to a process already reaped (ProcessLookupError in the transport's thread);
    here a finished one is left alone and a running one is waited for, so none outlives podkit."""

    def __init__(self, command_line: str):
        super().__init__(command_line)
        self.stderr_tail: collections.deque = collections.deque(maxlen=20)
        threading.Thread(target=self.stderr_tail.extend, args=(self.process.stderr,), daemon=True).start()

    def close(self) -> None:
        if self.process.poll() is None:
            super().close()
            try:
                self.process.wait(timeout=5)
            except Exception:  # noqa: BLE001 - ignores SIGTERM: leave it, podkit's own exit is not held up
                pass


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


def _local(out: Callable[[str], None]) -> Callable[[str], None]:
    """`out` whose BrokenPipeError (the reader of this side's stdout went away) is told apart from the link's."""
    def guarded_out(line: str) -> None:
        try:
            out(line)
        except BrokenPipeError:
            raise OutputClosed() from None
    return guarded_out


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
        self._watchdog: _Watchdog | None = None
        self._hops: list[fabric.Connection] = []  # ProxyJump connections, closed with this one
        # Every process this invocation starts on the pod carries PODKIT_SESSION=<tag> in its
        # environment, so an interrupted step can be found and stopped there (`stop_remote`): the
        # shells that run the commands are exec'd with it (pods/shell.py), their forks included.
        self.tag = secrets.token_hex(8)
        self.cancelled = False  # set from another thread by cancel(): every later command raises

    # -- lifecycle
    def __enter__(self) -> "PodConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._shell = self._spare = None
        if self._watchdog is not None:
            self._watchdog.stop()
        for hop in reversed(self._hops):
            hop.close()
        self._hops = []
        if self._fabric is not None:
            self._fabric.close()
            self._fabric = None

    @property
    def connection(self) -> fabric.Connection:
        if self._fabric is None or not self._fabric.is_connected:
            self._fabric = self._open()
        return self._fabric

    def _open(self) -> fabric.Connection:
        gateway = None
        for hop in self.endpoint.jumps:  # ProxyJump: each hop reached through the one before
            gateway = self._connect(hop, gateway)
            self._hops.append(gateway)
        return self._connect(self.endpoint, gateway)

    def _connect(self, ep: Endpoint, gateway: fabric.Connection | None) -> fabric.Connection:
        keys = list(ep.key_files)
        proxy = self._proxy(ep) if ep.proxy_command and gateway is None else None
        # The config's ConnectTimeout, when longer, bounds the greeting (paramiko's connect timeout
        # also bounds the whole key exchange): an SSM proxy answers only after its session is set up.
        wait = max(self.timeout, ep.connect_timeout or 0)
        conn = fabric.Connection(
            host=ep.hostname, user=ep.user, port=ep.port, connect_timeout=wait, gateway=gateway,
            # An explicit empty SSHConfig: hosts.resolve already read the ssh config (ssh -G), once.
            config=fabric.Config(ssh_config=paramiko.SSHConfig()),
            connect_kwargs={
                "key_filename": keys,
                "look_for_keys": False,  # ssh -G already listed the default identity files
                "allow_agent": True,  # as OpenSSH: agent keys are offered too
                "banner_timeout": wait,
                "auth_timeout": self.timeout,
                **({"sock": proxy} if proxy else {}),
            },
        )
        client = conn.client
        if self.known_hosts.is_file():
            try:
                client.load_host_keys(str(self.known_hosts))
            except (OSError, paramiko.SSHException, UnicodeDecodeError, ValueError) as exc:
                raise PodError(f"cannot read {self.known_hosts}: {exc}", "fix or move that file") from None
        pinned = self._use_pin(client, ep)
        client.set_missing_host_key_policy(_HostKeyPolicy(self.known_hosts, self.accept_new, self.say))
        try:
            conn.open()
        except PodError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            error = self._proxy_failed(proxy, ep) or self._describe(exc, ep, pinned)  # before close() ends the proxy
            conn.close()
            raise error from None
        if ep.host_key_alias and not pinned:
            try:
                self._pin(ep, conn.transport.get_remote_server_key())
            except PodError:
                conn.close()
                raise
        dead_after = DEAD_LINK_FACTOR * self.timeout
        _tune_socket(conn.transport.sock, dead_after)
        self._watchdog = _Watchdog(conn.transport, min(KEEPALIVE_S, dead_after / 2), dead_after)
        self._watchdog.start()
        return conn

    @staticmethod
    def _proxy(ep: Endpoint) -> "_ProxyProcess":
        """The ssh config's ProxyCommand, started as OpenSSH starts it: `exec COMMAND` under the
        user's shell (ssh_config(5) ProxyCommand), so quoting, `~` and variables mean what they
        mean to ssh. paramiko splits its argument with shlex: joined here, it is exactly that argv."""
        shell = os.environ.get("SHELL") or "/bin/sh"
        try:
            return _ProxyProcess(shlex.join([shell, "-c", f"exec {ep.proxy_command}"]))
        except Exception as exc:  # noqa: BLE001 - ProxyCommandFailure: the shell did not start
            raise PodError(f"ProxyCommand for {ep.hostname} did not start: {exc}", "check the ssh config's ProxyCommand") from None

    @staticmethod
    def _proxy_failed(proxy: "_ProxyProcess | None", ep: Endpoint) -> PodError | None:
        """The proxy's own exit and last stderr line, when it is what ended the connection."""
        if proxy is None:
            return None
        try:
            code = proxy.process.wait(timeout=1)
        except Exception:  # noqa: BLE001 - still running: the failure was past the proxy
            return None
        time.sleep(0.1)  # the drain thread's last read
        try:
            lines = [line.decode(errors="replace") for line in list(proxy.stderr_tail) if line.strip()]
        except RuntimeError:  # still being drained (a child of the proxy holds its stderr)
            lines = []
        return PodError(f"ProxyCommand for {ep.hostname} exited {code}" + (f": {lines[-1].strip()}" if lines else ""),
                        f"run it by hand to see why: {ep.proxy_command}")

    def _use_pin(self, client: paramiko.SSHClient, ep: Endpoint) -> bool:
        """When the pod's key is pinned under its alias, check the server against that key alone,
        whatever known_hosts says for this [host]:port (OpenSSH's HostKeyAlias: the alias replaces
        the address in the lookup). RunPod hands a restarted pod a new address, and an address can
        later be another pod's, so the address is the wrong thing to key on. paramiko 5 looks the server up
        by "[host]:port" in client.get_host_keys() (paramiko/client.py, SSHClient.connect), so the
        pinned keys are put there in memory; the file is not rewritten."""
        if not ep.host_key_alias:
            return False
        keys = client.get_host_keys()
        pinned = keys.lookup(ep.host_key_alias)
        if not pinned:
            return False
        pinned = {kind: pinned[kind] for kind in pinned.keys()}
        while keys.lookup(ep.known_hosts_name) is not None:
            del keys[ep.known_hosts_name]
        keys[ep.known_hosts_name] = pinned
        return True

    def _pin(self, ep: Endpoint, key: paramiko.PKey) -> None:
        """First verified contact with a pod podkit recorded: pin its key to the pod id (a line under
        the alias, which `ssh -o HostKeyAlias=ALIAS` reads too)."""
        try:
            self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.known_hosts, "a") as f:
                f.write(f"{ep.host_key_alias} {key.get_name()} {key.get_base64()}\n")
        except OSError as exc:
            raise PodError(f"cannot pin the host key in {self.known_hosts}: {exc.strerror}", "fix that file's permissions") from None
        self.say(f"pinned host key {fingerprint(key)} to {ep.host_key_alias} in {self.known_hosts}")

    def _describe(self, exc: BaseException, ep: Endpoint | None = None, pinned: bool = False) -> PodError:
        ep = ep or self.endpoint
        where = f"{ep.hostname}:{ep.port}"
        if isinstance(exc, paramiko.BadHostKeyException) and pinned:
            return PodError(
                f"host key at {where} ({fingerprint(exc.key)}) is not the key pinned for {ep.host_key_alias} "
                f"({fingerprint(exc.expected_key)}); refusing to connect",
                f"if the pod was re-created, remove the pin: ssh-keygen -R '{ep.host_key_alias}' -f {self.known_hosts}")
        if isinstance(exc, UnknownHostKey):
            return PodError(
                f"host key of {exc.hostname} ({fingerprint(exc.key)}) is not in {self.known_hosts}",
                "check it, then re-run with ACCEPT_NEW=1 (--accept-new) to record it")
        if isinstance(exc, paramiko.BadHostKeyException):
            return PodError(
                f"host key of {ep.known_hosts_name} CHANGED (now {fingerprint(exc.key)}); refusing to connect",
                f"if the pod was re-created, remove the old key: ssh-keygen -R '{ep.known_hosts_name}' -f {self.known_hosts}")
        if isinstance(exc, paramiko.AuthenticationException):
            tried = ", ".join(k for k in ep.key_files if os.path.isfile(k)) + (" and ssh-agent's keys" if agent_available() else "")
            return PodError(f"{ep.user}@{where} refused the key ({tried or 'no key found'})",
                            "give the right KEY=path, or check the user")
        if isinstance(exc, socket.gaierror):
            return Unreachable(f"cannot resolve host name '{ep.hostname}'", "check HOST")
        if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
            return Unreachable(f"connection refused by {where}",
                            "is the pod running, and is the port right? RunPod changes it on every restart")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            wait = max(self.timeout, ep.connect_timeout or 0)
            return Unreachable(f"no answer from {where} within {wait:.0f} s", "check the host and port, and that the pod is running")
        if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower() or "No existing session" in str(exc)):
            wait = max(self.timeout, ep.connect_timeout or 0)
            return Unreachable(f"{where} did not answer as an SSH server within {wait:.0f} s", "check the port")
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
        if self.cancelled:
            raise KeyboardInterrupt
        if out is not None:
            out = _local(out)
        with self._lock, self._faults(timeout):
            try:
                shell = self._shell_for_commands()
                result = shell.run(script, stdin=stdin, out=out, timeout=timeout)
            except KeyboardInterrupt:
                self._shell = None  # mid-command: that shell is abandoned
                self.stop_remote()
                raise
            except CommandTimeout as exc:
                # The shell closed its channel, which ends nothing on the pod (no pty, no hangup): the
                # command's tree, which carries that shell's own tag, is stopped; a later command gets a new shell.
                self._shell = None
                exc.stopped = self._stop_tagged(shell.own_tag, TIMEOUT_STOP_GRACE)
                raise
        if self.cancelled:  # the command ended because cancel() stopped it
            raise KeyboardInterrupt
        if check and not result.ok:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise PodError(f"remote command failed ({result.exit_code}): {detail[-1] if detail else command[:60]}")
        return result

    def cancel(self) -> None:
        """Ctrl-C while another thread works on this pod (parallel deploy): stop its remote step
        now and make that thread's next command raise KeyboardInterrupt."""
        self.cancelled = True
        self.stop_remote()

    def stop_remote(self, grace: float = 10.0) -> None:
        """Stop every process this connection started on the pod (Ctrl-C on the laptop): SIGTERM,
        then SIGKILL after `grace` s. Best effort within the deadline: a dead link stops nothing.
        The shells that ran them are stopped too (they carry the tag): a later command starts a new one."""
        self._shell = self._spare = None
        self._stop_tagged(f"PODKIT_SESSION={self.tag}", grace)

    def _stop_tagged(self, tag: str, grace: float) -> str:
        """Stop every process on the pod whose environment holds `tag` (NAME=value), over a channel of its
        own (the shell that ran them is gone or busy). Returns stop_script's last line ("stopped 2",
        "left 123"), or "" when the pod was not asked or did not answer within the deadline."""
        from podkit.pods.remote_stop import stop_script

        said = b""
        try:
            chan = self.connection.transport.open_session(timeout=self.timeout)
            chan.exec_command(stop_script(tag, grace))
            deadline = time.monotonic() + grace + DEAD_LINK_FACTOR * self.timeout
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                chan.status_event.wait(0.2)
            while chan.exit_status_ready() and chan.recv_ready():
                said += chan.recv(4096)
            chan.close()
        except Exception:  # noqa: BLE001 - best effort: the caller reports what it was doing
            pass
        lines = said.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def exec(self, command: str) -> paramiko.Channel:
        """Run `command` in place of a fresh shell (the pre-started spare when there is one) and
        hand over its channel: rsync's transport (pods/rsh.py)."""
        shell, self._spare = self._spare, None
        with self._faults():
            if shell is None or shell.dead:
                shell = RemoteShell(self.connection.transport, self.timeout, self.tag)
            return shell.exec(command)

    def warm_spare(self) -> None:
        """Have a second shell ready for `exec`. It starts once the first shell is up, so its
        login rc files run while the first one works (two at once slow a small pod)."""
        self._want_spare = True
        if self._shell is not None and not self._shell.dead:
            self._start_spare()

    def _shell_for_commands(self) -> RemoteShell:
        if self._shell is None or self._shell.dead:
            self._shell = RemoteShell(self.connection.transport, self.timeout, self.tag)
            if self._want_spare:
                self._shell.wait_ready()
                self._start_spare()
        return self._shell

    def _start_spare(self) -> None:
        if self._spare is None:
            with self._faults():
                self._spare = RemoteShell(self.connection.transport, self.timeout, self.tag)

    @contextmanager
    def _faults(self, timeout: float | None = None) -> Iterator[None]:
        """The shell's and the transport's failures, each as one PodError."""
        try:
            yield
        except CommandTimeout as exc:
            raise self._timed_out(timeout, exc.stopped) from None
        except OutputClosed:
            self._shell = None  # mid-command: that shell is abandoned, as after Ctrl-C
            self.stop_remote()
            raise
        except LoginTimeout:
            raise PodError(f"the login shell on {self.endpoint.hostname} did not start within "
                           f"{LOGIN_TIMEOUT_FACTOR * self.timeout:.0f} s",
                           "check ~/.bashrc on the pod: something there hangs or waits for input") from None
        except PodError:
            raise
        except Exception as exc:  # noqa: BLE001 - ShellClosed, paramiko and socket errors alike
            if self.cancelled:  # cancel() stopped the shell under the command: Ctrl-C, not a dropped link
                raise KeyboardInterrupt from None
            raise self._dropped(exc) from None

    @staticmethod
    def _timed_out(timeout: float | None, stopped: str) -> PodError:
        """A command past its timeout, with what became of it on the pod (`_stop_tagged`'s line)."""
        ran_past = f"remote command ran past {timeout:.0f} s"
        if stopped.startswith(("stopped", "killed")):
            return PodError(f"{ran_past} and was stopped", "re-run; the pod may be overloaded")
        if stopped.startswith("left"):
            return PodError(f"{ran_past}; it could not be stopped on the pod (pids {stopped.split(None, 1)[1]})",
                            "a process stuck in the kernel (a hung mount or GPU driver) ends only with a reboot of the pod")
        return PodError(f"{ran_past}; whether it still runs on the pod is unknown (it did not answer the stop)",
                        "re-run; the pod may be overloaded")

    @property
    def alive(self) -> bool:
        """The SSH transport is still up and answering (so a failure was not the link's)."""
        return (self._fabric is not None and self._fabric.transport is not None
                and self._fabric.transport.is_active() and self.frozen is None)

    @property
    def frozen(self) -> PodError | None:
        """Set when the watchdog gave up on the pod: the error every operation then reports."""
        if self._watchdog is None or not self._watchdog.dead:
            return None
        ep = self.endpoint
        return PodError(f"{ep.hostname}:{ep.port} stopped answering: no reply to keepalives for "
                        f"{self._watchdog.dead_after:.0f} s (the connection is up, the pod's sshd is not)",
                        "the pod may be frozen or out of memory; re-run when it answers, finished work is kept")

    def _dropped(self, exc: BaseException) -> PodError:
        if self.frozen is not None:
            return self.frozen
        why = "the remote shell ended" if isinstance(exc, ShellClosed) else (str(exc) or type(exc).__name__)
        return PodError(f"connection to {self.endpoint.hostname}:{self.endpoint.port} dropped ({why})",
                        "re-run the same command; it continues where it stopped")

    def sftp(self) -> paramiko.SFTPClient:
        try:
            return self.connection.sftp()
        except Exception as exc:  # noqa: BLE001
            raise self._dropped(exc) from None
