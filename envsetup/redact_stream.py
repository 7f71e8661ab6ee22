"""stdin to stdout with the environment's secrets replaced (secrets.SecretFilter): what a detached job's output
passes through on the pod before it reaches logs/jobs/<id>/output.log (pods/jobs.py runs it).

Bytes, not lines: whatever arrives is written at once (attach streams it), but for a tail that may be the start of
a secret, held until the next read or the end. It ignores SIGTERM, SIGINT and SIGHUP (`bin/pod stop` signals the
job's whole session, this too) and ends at the end of its input: when the last process writing into it is gone,
after the command's last words (bin/smoke's summary on SIGTERM) are in the log.
"""

from __future__ import annotations

import os
import signal

from podkit.envsetup.secrets import SecretFilter


def _write(data: bytes) -> None:
    try:
        while data:
            data = data[os.write(1, data):]
    except OSError:  # a full disk: the command runs on, as it did writing the log itself; later output may fit
        pass


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    secrets = SecretFilter()
    while chunk := os.read(0, 1 << 16):
        _write(secrets.feed(chunk))
    _write(secrets.flush())


if __name__ == "__main__":
    main()
