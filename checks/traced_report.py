"""The traced estimate beside the analytic one: same phases, term by term.

Reads the JSON form of train.traced.TracedEstimate, so checks/ never imports torch. The analytic
model's moments map onto the traced phases' peaks: forward-end <-> forward (its peak is at the
loss), the larger of backward and backward-end <-> backward, step <-> step; both without the
device-only overhead, i.e. what torch.cuda.max_memory_allocated would show.
"""

from __future__ import annotations

from podkit.checks.memory import GIB, MemoryEstimate

PHASE_PAIRS = (("forward", ("forward-end",)), ("backward", ("backward", "backward-end")), ("step", ("step",)))
TRACED_TERMS = ("params", "grads", "optimizer", "activations", "temporaries")


def analytic_allocated(est: MemoryEstimate) -> dict[str, int]:
    """The analytic model's allocated bytes per traced phase name."""
    return {traced: max(sum(p.bytes for p in est.phase_parts[moment] if p.term != "overhead")
                         for moment in moments if moment in est.phase_parts)
            for traced, moments in PHASE_PAIRS}


def error(predicted: int, traced: int) -> float | None:
    """Relative error of the analytic figure against the trace; None when nothing was traced."""
    return (predicted - traced) / traced if traced else None


def comparison(est: MemoryEstimate, traced: dict) -> dict:
    """Per phase: analytic, traced and the analytic model's error; plus the peaks."""
    analytic = analytic_allocated(est)
    phases = {}
    for name, _ in PHASE_PAIRS:
        t = traced["phases"][name]["peak"]
        phases[name] = {"analytic": analytic[name], "traced": t, "error": _round(error(analytic[name], t))}
    # The peak on the same footing as the phases: the largest of them, no device-only overhead (est.allocated
    # also holds cuBLAS's workspaces, which the CUDA allocator serves and the fake-tensor trace never has: a tiny
    # job read +43% there while every phase agreed).
    peak = max(analytic.values())
    return {"phases": phases, "peak": {"analytic": peak, "traced": traced["peak"],
                                       "error": _round(error(peak, traced["peak"]))}}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4) + 0.0  # + 0.0: never a "-0.0" in the JSON


def render(console, est: MemoryEstimate, traced: dict) -> None:
    from rich.table import Table

    cmp = comparison(est, traced)
    table = Table(title=f"Analytic vs traced (allocated, GiB; traced in {traced['seconds']:.1f} s on fake tensors)",
                  title_justify="left")
    for col in ("phase", "analytic", "traced", "error", *TRACED_TERMS):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for name, _ in PHASE_PAIRS:
        row = cmp["phases"][name]
        terms = traced["phases"][name]["terms"]
        table.add_row(name, f"{row['analytic'] / GIB:.2f}", f"{row['traced'] / GIB:.2f}", _pct(row["error"]),
                      *(f"{terms.get(t, 0) / GIB:.2f}" for t in TRACED_TERMS))
    table.add_section()
    peak = cmp["peak"]
    table.add_row("[bold]peak[/]", f"{peak['analytic'] / GIB:.2f}", f"[bold]{peak['traced'] / GIB:.2f}[/]",
                  _pct(peak["error"]), *([""] * len(TRACED_TERMS)))
    console.print(table)
    if traced.get("sdpa"):
        console.print("attention kernel: " + "; ".join(f"{k} ({v})" for k, v in traced["sdpa"].items()))
    for note in traced.get("notes", []):
        console.print(f"[yellow]traced:[/] {note}")
    if traced.get("replica_leaves_out"):
        console.print("[yellow]traced:[/] the smoke step is podkit's replica of the stack, set beside the "
                      "analytic estimate of that replica; it leaves out: " + "; ".join(traced["replica_leaves_out"]))


def _pct(x: float | None) -> str:
    if x is None:
        return "n/a"
    colour = "green" if abs(x) <= 0.03 else "yellow" if abs(x) <= 0.10 else "red"
    return f"[{colour}]{x:+.1%}[/]"
