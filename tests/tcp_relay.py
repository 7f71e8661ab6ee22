"""A ProxyCommand for the tests, as `nc HOST PORT` is one: stdin/stdout <-> a TCP connection.

    tcp_relay.py LOG HOST PORT [REAL_PORT]

Appends "HOST PORT" to LOG (so a test sees it was used and with which tokens), then connects to
127.0.0.1:REAL_PORT (default PORT): the "HOST" of an SSM target or a *.sagemaker name is not a
DNS name, the proxy is what knows where it is. Writes nothing but the relayed bytes to stdout.
"""

import os
import socket
import sys
import threading

log, host, port = sys.argv[1], sys.argv[2], sys.argv[3]
real_port = int(sys.argv[4]) if len(sys.argv) > 4 else int(port)
with open(log, "a") as f:
    f.write(f"{host} {port}\n")
try:
    sock = socket.create_connection(("127.0.0.1", real_port), timeout=10)
except OSError as exc:
    print(f"tcp_relay: cannot connect to {host}:{port}: {exc}", file=sys.stderr)
    sys.exit(1)
sock.settimeout(None)


def upstream() -> None:
    while data := os.read(0, 65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


threading.Thread(target=upstream, daemon=True).start()
while data := sock.recv(65536):
    os.write(1, data)
