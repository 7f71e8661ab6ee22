"""One long-lived bash on the pod that runs every command of a podkit invocation.

sshd runs each exec request through the user's login shell, which sources ~/.bashrc: `conda init`
or `pyenv init` there costs 0.2-1 s per command, and each exec costs extra round trips. A
`RemoteShell` pays that once: its channel runs `exec bash --noprofile --norc -s` and receives
commands on stdin, each in its own subshell, each followed by a marker line carrying the exit
status on both stdout and stderr.

The marker is random per shell, so no command output can fake it. Data for a command's stdin
(secrets, the probe record) travels base64-encoded on the line after the command and is read by
the shell itself, so it never appears in any process's argv and cannot be run as a command when
the command does not read it.
"""

from __future__ import annotations

import base64
import secrets
import select
import shlex
import time
from dataclasses import dataclass
from typing import Callable

import paramiko

LOGIN_TIMEOUT_FACTOR = 6  # x the connect timeout (60 s by default): conda init on a busy pod is slow


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ShellClosed(Exception):
    """The channel ended before the command's marker: the link dropped or the shell was killed."""


class CommandTimeout(Exception):
    """The command ran past its timeout; the shell closed its channel, which ends nothing on the pod."""

    stopped = ""  # what became of the command there: PodConnection's stop of its tree says


class LoginTimeout(Exception):
    """The shell never answered its greeting: the login rc files hang (or read stdin)."""


def _drawn(line: bytes) -> bytes:
    """What a terminal shows of a line redrawn with carriage returns: its last drawing."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


class _Stream:
    """One of the channel's two streams, split into lines until the marker line ends the command.

    The shell writes "\\n<marker> <status>" after each command, so exactly one newline before the
    marker is podkit's: it is removed from the collected text, and a blank line right before the
    marker is not passed on to `out`.
    """

    def __init__(self, marker: bytes, out: Callable[[str], None] | None):
        self.marker = marker + b" "
        self.out = out
        self.buf = b""
        self.text = bytearray()
        self.held_blank = False
        self.status: int | None = None
        self.redrawing = False  # what `buf` holds came after a carriage return: a progress bar's drawing
        self.shown_early: bytes | None = None  # that drawing, passed on by idle() before its end arrived

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self.status is None:
            end = self.buf.find(b"\n")
            if end < 0:
                self._progress()
                return
            line, self.buf = self.buf[:end], self.buf[end + 1:]
            if line.startswith(self.marker):
                self.status = int(line[len(self.marker):] or b"255")
                del self.text[-1:]  # the newline written before the marker
                return
            self.text += line + b"\n"
            self.redrawing = False
            if self.out is not None:
                self._emit(_drawn(line))

    def _progress(self) -> None:
        """A progress bar (tqdm, the HF Trainer) redraws its line with carriage returns and ends it with a newline
        only when done: pass on the last finished drawing (the one before the latest carriage return), so progress
        streams as it happens. A carriage return that ends what has arrived waits for the next byte: it may be a
        CRLF's first half."""
        cr = self.buf.rfind(b"\r", 0, len(self.buf) - 1)
        if cr < 0:
            return
        segment, self.buf = self.buf[:cr + 1], self.buf[cr + 1:]
        self.text += segment
        self.redrawing = True
        shown = _drawn(segment)
        if self.out is not None and shown:
            self._emit(shown)

    def idle(self) -> None:
        """Nothing arrived for a while: pass on the progress bar's current drawing, which `_progress` holds back
        until the next carriage return (it may still be arriving). Without this a bar shows one redraw late, and
        a job stuck in a step shows the step before it. Only after a carriage return: a line that is merely
        unfinished ("Downloading...") waits for its end, or it would be shown twice."""
        if self.out is None or self.status is not None or not self.redrawing:
            return
        shown = _drawn(self.buf)
        if shown and shown != self.shown_early:
            self._emit(shown)
            self.shown_early = shown

    def _emit(self, shown: bytes) -> None:
        """Pass a line on; a blank one is held back until the next, since the one right before the marker is
        podkit's. A drawing idle() passed on already is not passed on again when its end arrives."""
        early, self.shown_early = self.shown_early, None
        if shown == early:
            return
        if self.held_blank:
            self.out("")
        self.held_blank = not shown
        if shown:
            self.out(shown.decode(errors="replace"))


class RemoteShell:
    def __init__(self, transport: paramiko.Transport, timeout: float, tag: str = ""):
        self.login_timeout = LOGIN_TIMEOUT_FACTOR * timeout
        self.marker = "\x1epodkit-" + secrets.token_hex(8)
        self.chan = transport.open_session(timeout=timeout)
        # The tags are in the environment bash is exec'd with, not exported by it: a process's
        # /proc/PID/environ (what remote_stop.stop_script reads) is the one it was exec'd with, so
        # only then do the shell's own forks (each command's subshell, a loop in it, a pipeline's
        # stages) carry them too. PODKIT_SESSION is the connection's: a Ctrl-C ends everything it
        # started. PODKIT_SHELL is this shell's own: it runs one command at a time, so after a
        # timeout it names that command's tree and nothing else the connection runs.
        self.own_tag = f"PODKIT_SHELL={secrets.token_hex(8)}"
        session = f"PODKIT_SESSION={tag} " if tag else ""
        self.chan.exec_command(f"exec env {session}{self.own_tag} bash --noprofile --norc -s")
        self.dead = False
        self._hello_pending = True
        # The greeting's marker separates whatever the login shell's rc files printed from the
        # first command's output.
        self._send(f"__podkit_done() {{ printf '\\n{self.marker} %d\\n' \"$1\"; "
                   f"printf '\\n{self.marker} %d\\n' \"$1\" >&2; }}\n__podkit_done 0\n")

    # -- use
    def run(self, script: str, *, stdin: str | None = None, out: Callable[[str], None] | None = None,
            timeout: float | None = None) -> Result:
        self.wait_ready()
        body = f"( eval {shlex.quote(script)} )"
        if stdin is None:
            line = f"{body} </dev/null; __podkit_done $?\n"
        else:
            data = base64.b64encode(stdin.encode()).decode()
            line = (f"IFS= read -r __podkit_in; printf %s \"$__podkit_in\" | base64 -d | {body}; "
                    f"__podkit_done $?; unset __podkit_in\n{data}\n")
        self._send(line)
        o, e = self._collect(out, timeout)
        return Result(o.status if o.status is not None else 255, o.text.decode(errors="replace"),
                      e.text.decode(errors="replace"))

    def wait_ready(self) -> None:
        if self._hello_pending:
            try:
                self._collect(None, self.login_timeout)
            except CommandTimeout:
                raise LoginTimeout() from None
            self._hello_pending = False

    def exec(self, command: str) -> paramiko.Channel:
        """Replace the shell with `command` and hand over the raw channel (rsync's transport)."""
        self.wait_ready()
        self._send(f"exec {command}\n")
        self.dead = True  # the channel now belongs to the caller
        return self.chan

    def close(self) -> None:
        self.dead = True
        self.chan.close()

    # -- internals
    def _send(self, text: str) -> None:
        try:
            self.chan.sendall(text.encode())
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.dead = True
            raise ShellClosed(str(exc)) from None

    def _collect(self, out, timeout: float | None) -> tuple[_Stream, _Stream]:
        mark = self.marker.encode()
        o, e = _Stream(mark, out), _Stream(mark, out)
        deadline = time.monotonic() + timeout if timeout else None
        chan = self.chan
        while o.status is None or e.status is None:
            if chan.recv_ready():
                o.feed(chan.recv(65536))
                continue
            if chan.recv_stderr_ready():
                e.feed(chan.recv_stderr(65536))
                continue
            if chan.closed or chan.exit_status_ready() or chan.eof_received or not chan.get_transport().is_active():
                if chan.recv_ready() or chan.recv_stderr_ready():
                    continue  # output that arrived with the end is read first
                self.dead = True
                raise ShellClosed("the remote shell ended")
            if deadline and time.monotonic() > deadline:
                self.close()
                raise CommandTimeout()
            if not select.select([chan], [], [], 0.5)[0]:  # the channel's pipe wakes this on data or close
                o.idle()
                e.idle()
        return o, e
