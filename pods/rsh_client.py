"""rsync's remote shell (`rsync -e`): carries rsync's stream over podkit's own SSH connection.

rsync runs this as `python -S rsh_client.py SOCKET [-l USER] HOST COMMAND...`. It hands the
command and then rsync's stdin to the podkit process listening on SOCKET (pods/rsh.py), which runs
the command on the pod in a shell of its open connection, and replays the frames that come back:
remote stdout, remote stderr, and finally the exit status, which becomes this process's own.
Standard library only, and started with -S, so it costs rsync a few milliseconds.
"""

import os
import socket
import struct
import sys
import threading

HEADER = struct.Struct(">cI")  # kind (b"o" stdout, b"e" stderr, b"x" exit status), payload length


def _upstream(sock: socket.socket) -> None:
    try:
        while True:
            data = os.read(0, 65536)
            if not data:
                break
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the podkit side went away; the main loop reports it


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def main(argv: list[str]) -> int:
    path, args = argv[0], argv[1:]
    if args[:1] == ["-l"]:
        args = args[2:]
    command = " ".join(args[1:])  # args[0] is the host: the connection already has it
    # rsync hands a remote shell non-blocking stdin/stdout (as ssh prefers); this relay uses
    # threads and plain blocking reads and writes instead, so EAGAIN never reads as a dropped link.
    for fd in (0, 1, 2):
        os.set_blocking(fd, True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(command.encode() + b"\n")
    threading.Thread(target=_upstream, args=(sock,), daemon=True).start()
    try:
        while True:
            kind, size = HEADER.unpack(_read_exact(sock, HEADER.size))
            payload = _read_exact(sock, size)
            if kind == b"o":
                _write_all(1, payload)
            elif kind == b"e":
                _write_all(2, payload)
            else:
                return int(payload)
    except (EOFError, OSError):
        os.write(2, b"podkit: connection to the pod dropped\n")
        return 255


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # do not wait for the stdin thread
