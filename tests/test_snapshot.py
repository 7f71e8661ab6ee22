"""The CPU memory snapshot loads in torch's own memory_viz tools, and its timeline is consistent:
replayed backwards from the snapshot's segments, every segment_free/segment_alloc of the trace
matches, so the timeline starts from what was really live (no invented segment)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("snap")
    proc = subprocess.run([str(ROOT / "bin" / "smoke"), "--steps", "5", "--device", "cpu", "--output-dir", str(out),
                           "--run-id", "s"], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 5 steps may not drop the loss enough: still a run
    return out / "s" / "memory_snapshot.pickle"


@pytest.mark.parametrize("tool", ["trace", "stats", "segment_plot", "trace_plot"])
def test_torch_memory_viz_reads_it(snapshot, tool, tmp_path):
    args = [sys.executable, "-W", "ignore", "-m", "torch.cuda._memory_viz", tool, str(snapshot)]
    if tool.endswith("_plot"):
        args += ["-o", str(tmp_path / "out.html")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if tool == "trace":
        assert "cudaMalloc(" in out.stdout and "entries" in out.stdout
    if tool.endswith("_plot"):
        assert "snapshot.pickle" in (tmp_path / "out.html").read_text()


def test_flamegraph_inputs_build(snapshot):
    # `segments` and `memory` hand their lines to flamegraph.pl, which torch downloads: check the lines.
    from torch.cuda import _memory_viz as viz

    data = pickle.loads(snapshot.read_bytes())
    lines = viz.segments(data, format_flamegraph=lambda text: text)
    assert lines.count("\n") == len(data["segments"]) and "active_allocated" in lines
    assert viz.memory(data, format_flamegraph=lambda text: text)


def test_timeline_replays_to_a_real_start(snapshot):
    data = pickle.loads(snapshot.read_bytes())
    segs = data["segments"]
    assert segs and all(s["address"] and s["total_size"] == s["allocated_size"] == sum(b["size"] for b in s["blocks"])
                        for s in segs)
    assert len({s["address"] for s in segs}) == len(segs)
    live = {s["address"]: s["total_size"] for s in segs}
    trace = data["device_traces"][0]
    assert trace and trace[0]["action"] == "segment_alloc"
    for e in reversed(trace):  # what memory_viz does to find the state before the trace began
        if e["action"] == "segment_free":
            assert e["addr"] not in live, e
            live[e["addr"]] = e["size"]
        elif e["action"] == "segment_alloc":
            assert live.pop(e["addr"], None) == e["size"], e
    # What was live before the first traced step: the weights and optimizer states of a 0.4M-param
    # model in fp32 (a few MiB), not one fake segment.
    assert all(size < (4 << 20) for size in live.values())
