"""rsync over the connection podkit already holds, instead of a second SSH login.

`RshServer(conn)` listens on a private Unix socket; `rsync -e` runs pods/rsh_client.py, which
connects there with the remote command (`rsync --server ...`). The connection execs it in a
fresh shell (the pre-started spare, so the pod's login rc files have already run), and the server
relays bytes both ways: rsync's stdin up the channel, the channel's stdout,
stderr and exit status back down as frames. Host-key checks, keys and keepalives are the
connection's own; a dropped link ends the relay with status 255, which rsync reports and
pods/rsync.py turns into one line.
"""

from __future__ import annotations

import select
import shlex
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.rsh_client import HEADER

CLIENT = Path(__file__).with_name("rsh_client.py")


class RshServer:
    def __init__(self, conn: PodConnection):
        self.conn = conn
        self._dir = tempfile.mkdtemp(prefix="podkit-rsh-")  # 0700: only this user can connect
        self.path = str(Path(self._dir) / "rsh.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(4)
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def rsh(self) -> str:
        """The value for rsync's -e."""
        return shlex.join([sys.executable, "-S", str(CLIENT), self.path])

    def __enter__(self) -> "RshServer":
        return self

    def __exit__(self, *exc) -> None:
        self._closing = True
        try:
            self._sock.close()
        finally:
            for t in self._threads:
                t.join(timeout=5)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                command, rest = _read_command(client)
                chan = self.conn.exec(command)
            except (PodError, OSError, EOFError) as exc:
                _frame(client, b"e", f"podkit: {exc}\n".encode())
                _frame(client, b"x", b"255")
                return
            up = threading.Thread(target=_upstream, args=(client, chan, rest), daemon=True)
            up.start()
            status = _downstream(client, chan)
            chan.close()
            try:
                _frame(client, b"x", str(status).encode())
            except OSError:
                pass  # rsync already gone


def _read_command(client: socket.socket) -> tuple[str, bytes]:
    buf = b""
    while b"\n" not in buf:
        chunk = client.recv(4096)
        if not chunk:
            raise EOFError("rsync closed before sending its command")
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    return line.decode(), rest


def _frame(client: socket.socket, kind: bytes, payload: bytes) -> None:
    client.sendall(HEADER.pack(kind, len(payload)) + payload)


def _upstream(client: socket.socket, chan, rest: bytes) -> None:
    try:
        if rest:
            chan.sendall(rest)
        while True:
            data = client.recv(65536)
            if not data:
                chan.shutdown_write()
                return
            chan.sendall(data)
    except (OSError, EOFError):
        return  # either side closed; _downstream sees the channel end


def _downstream(client: socket.socket, chan) -> int:
    transport = chan.get_transport()
    try:
        while True:
            # sshd may send the exit status before the last output; EOF comes after all of it
            ended = chan.closed or (chan.eof_received and chan.exit_status_ready()) or not transport.is_active()
            while chan.recv_ready() or chan.recv_stderr_ready():
                if chan.recv_ready():
                    _frame(client, b"o", chan.recv(65536))
                if chan.recv_stderr_ready():
                    _frame(client, b"e", chan.recv_stderr(65536))
            if ended:
                # a channel closed without an exit-status message reads as -1: the link dropped
                status = chan.exit_status if transport.is_active() else -1
                if status < 0:
                    _frame(client, b"e", b"podkit: connection to the pod dropped\n")
                    return 255
                return status
            if chan.eof_received:
                chan.status_event.wait(0.5)  # the pipe stays readable after EOF: wait on the status
            else:
                select.select([chan], [], [], 0.5)
    except OSError:
        return 255  # rsync went away (killed, or finished with an error)
