"""Stopping a 2-process bin/smoke (torchrun + gloo on CPU) leaves nothing running (issue 12, item 2).

Every process the test starts carries a unique PODKIT_TEST_TAG in its environment, which
torchrun and its workers inherit; after the signal no process on this machine may carry it.
"""

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from smoke_helpers import ROOT, tiny_job


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds PODKIT_TEST_TAG=tag (the whole tree, orphans too)."""
    needle = f"PODKIT_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append(int(entry))
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_torchrun_and_every_worker(tmp_path, sig):
    job = tiny_job(tmp_path, cluster={"gpus_per_node": 2}, smoke={"steps": 100000})
    out, tag = tmp_path / "runs", uuid.uuid4().hex
    env = dict(os.environ, PODKIT_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    env.pop("PODKIT_RUN_ID", None)
    # SIGINT ignored on start, as for a job started in the background by a shell: it must still stop.
    proc = subprocess.Popen([str(ROOT / "bin" / "smoke"), "--config", str(job), "--output-dir", str(out), "--run-id", "s"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    metrics = out / "s" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert len(tagged(tag)) >= 4, "launcher, torchrun and two workers should be running"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = tagged(tag)
        for pid in left:  # never leave them running, even when the test fails
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after {sig.name}: {left}"
    assert proc.returncode == 130, err[-2000:]
    summary = json.loads((out / "s" / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert "interrupted" in err
