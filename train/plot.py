"""The memory plot of a smoke run, drawn by matplotlib from the run's own files.

One figure per run directory, read from metrics.jsonl (the profiler's samples and every step's loss)
and summary.json (prediction, capacity, limit): the smoke run draws it at its end, and `bin/plot
RUN_DIR...` redraws it on the laptop after fetch-logs, or overlays several runs in one figure.
matplotlib is optional (pyproject's [plot] extra, envsetup's pod requirements): without it
`draw` raises PlotUnavailable and the run writes everything else. No torch here: bin/plot runs
where only the fetched files are.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MIB, GIB = 1 << 20, 1 << 30


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported here."""


@dataclass
class RunCurves:
    """What one run (one rank of it) says about memory and loss over its steps, in bytes."""

    label: str
    device: str = "cpu"
    loss: list[tuple[int, float | None]] = field(default_factory=list)
    series: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Measured memory per profiled step: 'allocated', 'peak reserved', 'nvidia-smi used' (CUDA),
    'peak tensors' (CPU)."""
    host_rss: list[tuple[int, int]] = field(default_factory=list)
    predicted: int | None = None
    predicted_reserved: int | None = None
    capacity: int | None = None
    """The card's memory (CUDA) as the summary reports it; None on CPU."""
    limit: int | None = None
    status: str = ""
    steps_planned: int = 0
    rank: int = 0
    """The rank whose metrics file this is (read_run: metrics.jsonl is rank 0's, metrics.rank<N>.jsonl rank N's)."""


def curves(records: list[dict], summary: dict, label: str) -> RunCurves:
    """RunCurves from metrics.jsonl's records (step lines and {"profile": sample} lines) and a summary."""
    device = str(summary.get("device") or "cpu")
    cuda = device.startswith("cuda")
    run = RunCurves(label=label, device=device, predicted=summary.get("predicted"),
                    predicted_reserved=summary.get("predicted_reserved"), limit=summary.get("limit"),
                    capacity=summary.get("capacity") if cuda else None, status=summary.get("status", ""),
                    steps_planned=summary.get("steps_planned") or 0)
    names = {"allocated": "allocated", "peak_reserved": "peak reserved", "device_used": "nvidia-smi used"} if cuda \
        else {"peak_allocated": "peak tensors"}
    for rec in records:
        if "profile" in rec:
            sample = rec["profile"]
            for key, name in names.items():
                if sample.get(key) is not None:
                    run.series.setdefault(name, []).append((sample["step"], sample[key]))
            if sample.get("host_rss") is not None:
                run.host_rss.append((sample["step"], sample["host_rss"]))
        elif "step" in rec and "loss" in rec:
            loss = rec["loss"]
            run.loss.append((rec["step"], loss if isinstance(loss, (int, float)) and math.isfinite(loss) else None))
    return run


def read_run(path: Path) -> list[RunCurves]:
    """Every rank's curves in a run directory: metrics.jsonl (rank 0) and metrics.rank<N>.jsonl (another node's
    fetched run holds only its own ranks' files). What a killed or half-fetched run leaves (a cut line, a
    summary.json still being written, bytes that are no text) is passed over, not a reason to draw nothing."""
    summary: dict = {}
    try:
        loaded = json.loads((path / "summary.json").read_text())
        summary = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass  # none yet, or cut mid-write: the curves do not need it
    out = []
    files = [f for f in [path / "metrics.jsonl"] + sorted(path.glob("metrics.rank*.jsonl"), key=lambda p: _rank(p))
             if f.is_file()]
    for f in files:
        records = []
        for line in f.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            if isinstance(rec, dict):
                records.append(rec)
        rank = _rank(f)
        label = path.name + (f" rank {rank}" if len(files) > 1 else "")
        out.append(dataclasses.replace(curves(records, summary, label), rank=rank))
    return out


PNG_SOFTWARE = "podkit"
"""The PNG tEXt "Software" value podkit's plots carry (matplotlib's savefig metadata)."""


def written_by_podkit(path: Path) -> bool:
    """Whether an existing PNG carries podkit's Software text chunk: a file bin/plot may draw over."""
    try:
        head = path.read_bytes()[:4096]
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + PNG_SOFTWARE.encode() in head


def _rank(path: Path) -> int:
    stem = path.name.split(".")
    return int(stem[1][4:]) if len(stem) == 3 and stem[1].startswith("rank") and stem[1][4:].isdigit() else 0


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a pod, none needed on a laptop
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise PlotUnavailable(f"matplotlib is not installed ({exc}); pip install 'podkit[plot]' or make setup") from None
    return plt, MaxNLocator


def draw(runs: list[RunCurves], path: str | Path, title: str) -> list[str]:
    """One PNG: memory (with the prediction and the card's capacity), the CPU process's RSS on its own
    axis (it dwarfs the tensors), and the loss. Several runs overlay, one colour each."""
    plt, MaxNLocator = _pyplot()
    cuda = any(r.device.startswith("cuda") for r in runs)
    rss = any(r.host_rss for r in runs) and not cuda
    panels = 3 if rss else 2
    fig, axes = plt.subplots(panels, 1, figsize=(10, 3.2 * panels), sharex=True, squeeze=False)
    axes = [a[0] for a in axes]
    top = max([v for r in runs for pts in r.series.values() for _, v in pts]
              + [v for r in runs for v in (r.predicted, r.capacity, r.limit) if v] + [1])
    scale, unit = (GIB, "GiB") if top >= GIB else (MIB, "MiB")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"allocated": "-", "peak reserved": "--", "nvidia-smi used": ":", "peak tensors": "-"}
    last = max([s for r in runs for pts in r.series.values() for s, _ in pts] + [s for r in runs for s, _ in r.loss]
               + [r.steps_planned for r in runs] + [1])
    mem = axes[0]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        prefix = f"{run.label}: " if len(runs) > 1 else ""
        for name, pts in run.series.items():
            if pts:
                mem.plot([s for s, _ in pts], [v / scale for _, v in pts], styles.get(name, "-"), color=colour,
                         marker="o", markersize=3, label=prefix + name)
        if run.predicted:
            mem.axhline(run.predicted / scale, color=colour, linestyle="-.", linewidth=1,
                        label=f"{prefix}predicted peak {run.predicted / scale:,.2f} {unit}")
        if run.capacity:
            mem.axhline(run.capacity / scale, color="black", linewidth=1.5,
                        label=f"{prefix}card capacity {run.capacity / scale:,.1f} {unit}")
        if run.limit and run.limit != run.capacity:
            mem.axhline(run.limit / scale, color="red", linestyle=":", linewidth=1,
                        label=f"{prefix}peak limit {run.limit / scale:,.2f} {unit}")
    mem.set_ylabel(f"{'GPU' if cuda else 'tensor'} memory ({unit})")
    mem.set_ylim(bottom=0)
    if not any(pts for r in runs for pts in r.series.values()):
        mem.text(0.5, 0.5, "no memory sample: the run ended before its first profiled step", ha="center",
                 va="center", transform=mem.transAxes, color="gray")
    if rss:
        ax = axes[1]
        for i, run in enumerate(runs):
            if run.host_rss:
                ax.plot([s for s, _ in run.host_rss], [v / MIB for _, v in run.host_rss], color=colours[i % len(colours)],
                        marker="o", markersize=3, label=(f"{run.label}: " if len(runs) > 1 else "") + "process RSS")
        ax.set_ylabel("process RSS (MiB)")
        ax.set_ylim(bottom=0)
    ax = axes[-1]
    for i, run in enumerate(runs):
        pts = [(s, v) for s, v in run.loss]
        if pts:
            ax.plot([s for s, _ in pts], [math.nan if v is None else v for _, v in pts], color=colours[i % len(colours)],
                    label=run.label if len(runs) > 1 else "loss")
            bad = [s for s, v in pts if v is None]
            if bad:
                ax.axvline(bad[0], color="red", linestyle=":", label=f"non-finite loss at step {bad[0]}")
    ax.set_ylabel("loss (nats/token)")
    ax.set_xlabel("optimizer step")
    ax.set_xlim(0, last)
    for a in axes:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: never ticks 0 0 0 1 1 1
        a.grid(True, alpha=0.3)
        handles, _ = a.get_legend_handles_labels()
        if handles:
            a.legend(fontsize=8, loc="best")
    status = ", ".join(f"{r.label}: {r.status}" for r in runs if r.status) if len(runs) > 1 else (runs[0].status if runs else "")
    fig.suptitle(title + (f" ({status})" if status else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": PNG_SOFTWARE})  # how bin/plot knows a PNG is podkit's
    labels = [a.get_ylabel() for a in axes]
    plt.close(fig)
    return labels
