"""train/process_tree.py reads every process's /proc/PID/stat to find a command's tree (bin/smoke -- COMMAND's stop and
cleanup). Found 2026-11-25 in a full `make test` run: a process elsewhere on the machine whose name is not UTF-8 made
that walk raise UnicodeDecodeError, and bin/smoke died with the summary still "running"."""

import ctypes
import os
import subprocess
import sys

from sshd_harness import wait_for

from podkit.train import process_tree

# prctl(PR_SET_NAME): the kernel keeps 15 bytes of the name, here cutting the 2-byte "é" after its first byte.
PR_SET_NAME = 15
NAME = (f"import ctypes, time; ctypes.CDLL(None).prctl({PR_SET_NAME}, ('a' * 14 + '\\u00e9').encode(), 0, 0, 0); "
        "time.sleep(60)")


def test_a_process_named_in_cut_utf8_is_walked_and_seen_alive_like_any_other():
    assert ctypes.CDLL(None).prctl  # Linux
    child = subprocess.Popen([sys.executable, "-c", NAME])
    try:
        assert wait_for(lambda: b"\xc3)" in open(f"/proc/{child.pid}/stat", "rb").read(), 10)
        assert open(f"/proc/{child.pid}/comm", "rb").read().strip() == b"a" * 14 + b"\xc3"
        assert child.pid in process_tree.descendants(os.getpid())
        assert process_tree._alive([child.pid]) == [child.pid]
    finally:
        child.kill()
        child.wait()
