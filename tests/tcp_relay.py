"""A ProxyCommand for the tests, as `nc HOST PORT` is one: stdin/stdout <-> a TCP connection.

    tcp_relay.py --log LOG [--to PORT] [--delay S] [--key SRC DEST] HOST PORT

Appends "HOST PORT" to LOG (so a test sees it was used, and with which tokens), then connects to
127.0.0.1:--to (default PORT): the HOST of an SSM target or a *.sagemaker name is no DNS name, the
proxy is what knows where it is. --delay: seconds before the connection (SSM's session setup);
--key: copy SRC to DEST first, as sagemaker-ssh-helper's start-proxy writes a fresh ~/.ssh/<host>
on every connection. Writes nothing but the relayed bytes to stdout.
"""

import argparse
import os
import shutil
import socket
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--log", required=True)
parser.add_argument("--to", type=int)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--key", nargs=2)
parser.add_argument("host")
parser.add_argument("port", type=int)
args = parser.parse_args()
with open(args.log, "a") as f:
    f.write(f"{args.host} {args.port}\n")
if args.key:
    shutil.copy(args.key[0], args.key[1])
    os.chmod(args.key[1], 0o600)
time.sleep(args.delay)
try:
    sock = socket.create_connection(("127.0.0.1", args.to or args.port), timeout=10)
except OSError as exc:
    print(f"tcp_relay: cannot connect to {args.host}:{args.port}: {exc}", file=sys.stderr)
    sys.exit(1)
sock.settimeout(None)


def upstream() -> None:
    while data := os.read(0, 65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


threading.Thread(target=upstream, daemon=True).start()
while data := sock.recv(65536):
    os.write(1, data)
