"""`bin/plot RUN_DIR...`: redraw a run's memory plot from its files (after fetch-logs, on a laptop),
or overlay several runs in one figure. Needs matplotlib, not torch.

Exit codes: 0 drawn, 2 bad input (a path that is not a run directory, no matplotlib).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from podkit.checks.command import OneLineCommand, wants_json
from podkit.checks.errors import ConfigError

EXIT_BAD_INPUT = 2


def _fail(message: str) -> None:
    """One line on stderr, exit 2; with --json also the error object on stdout, as preflight and smoke print it."""
    if wants_json():
        click.echo(json.dumps(ConfigError("", message).to_json(), indent=2))
    click.echo(f"plot: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _check_run(path: Path) -> None:
    if not path.exists():
        _fail(f"{path} does not exist (give a run directory, e.g. runs/<run-id>)")
    if not path.is_dir():
        _fail(f"{path} is not a run directory (give runs/<run-id>, the directory that holds metrics.jsonl)")
    if not (path / "metrics.jsonl").is_file() and not any(path.glob("metrics.rank*.jsonl")):
        _fail(f"{path} has no metrics.jsonl (nor another node's metrics.rank<N>.jsonl): not a smoke run directory, "
              "or fetched before its first step")


def _check_output(out: Path) -> None:
    parent = Path(os.path.normpath(out.absolute())).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        _fail(f"-o {out}: {parent} is a file (give a path in a writable directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(f"-o {out}: {parent} is not writable")
    if out.is_dir():
        _fail(f"-o {out} is a directory (give a .png file name)")


def _check_ours(path: Path, runs: tuple[Path, ...]) -> None:
    """Never draw over a file podkit did not write: a PNG in one of these runs' directories is the run's, any
    other existing file must carry podkit's PNG mark (train/plot.written_by_podkit)."""
    from podkit.train import plot

    inside_a_run = any(path.absolute().parent == r.absolute() for r in runs)
    if path.exists() and not inside_a_run and not plot.written_by_podkit(path):
        _fail(f"{path} exists and podkit did not write it (give another -o, or move it away)")


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="PNG to write. Default: RUN_DIR/memory.png for one run, memory-overlay.png here for several.")
@click.option("--per-rank", is_flag=True, help="One figure per rank (memory.rank<N>.png) instead of all ranks overlaid.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the runs read and the PNGs written.")
def main(runs: tuple[Path, ...], output: Path | None, per_rank: bool, as_json: bool = False) -> None:
    """Redraw the memory plot of smoke runs (runs/<run-id>/, fetched or local); several overlay."""
    from podkit.train import plot

    for run in runs:
        _check_run(run)
    out = output or (runs[0] / "memory.png" if len(runs) == 1 else Path("memory-overlay.png"))
    _check_output(out)
    curves = [c for run in runs for c in plot.read_run(run)]
    title = " vs ".join(r.name for r in runs) + " memory"
    written = [out]
    if per_rank and len(runs) == 1 and len(curves) > 1:  # named by each file's rank: memory.rank<N>.png
        written = [out if c.rank == 0 else out.with_name(f"{out.stem}.rank{c.rank}{out.suffix}") for c in curves]
    for path in written:
        _check_ours(path, runs)
    try:
        if len(written) > 1:
            for path, c in zip(written, curves):
                plot.draw([c], path, f"{title}, {c.label}")
        else:
            plot.draw(curves, out, title)
    except plot.PlotUnavailable as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps({"ok": True, "runs": [str(r) for r in runs], "curves": [c.label for c in curves],
                               "written": [str(p) for p in written]}, indent=2))
    else:
        click.echo(str(out))


if __name__ == "__main__":
    main(prog_name="bin/plot")
