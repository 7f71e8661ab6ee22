"""The pods commands' tables for people (deploy's summary, bin/pod ls, bin/pod jobs), drawn by rich
like preflight's and smoke's reports. Scripts read --json instead."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from podkit.pods.deploy import Outcome
    from podkit.pods.jobs import Job

_RESULT = {0: ("ready", "green"), 1: ("FAILED", "red"), 2: ("ERROR", "red")}


def print_table(table: Table) -> None:
    """On stdout. Off a terminal (a pipe, a log) rich would wrap at 80 columns; nothing is cut there."""
    Console(width=None if sys.stdout.isatty() else 10_000).print(table)


def deploy_table(outcomes: list["Outcome"]) -> Table:
    table = Table(title="deploy", title_justify="left")
    for name in ("pod", "result", "profile", "GPU", "sync", "envsetup", "preflight"):
        table.add_column(name, overflow="fold")
    table.add_column("time", justify="right", no_wrap=True)
    for o in outcomes:
        result, colour = _RESULT.get(o.exit_code, ("ERROR", "red"))
        table.add_row(_plain(o.pod), Text(result, style=colour), *(_plain(v or "-") for v in (
            o.profile, o.gpu, o.sync, o.envsetup, o.preflight)), f"{o.seconds:.1f} s")
    return table


def jobs_table(jobs: list["Job"]) -> Table:
    table = Table(title_justify="left")
    table.add_column("job", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("started", no_wrap=True)
    table.add_column("command", overflow="fold")
    for job in jobs:
        state = f"{job.state} {job.exit_code}" if job.exit_code is not None else job.state
        if job.left_running:  # bin/pod stop ends them
            state += f", {job.left_running} process{'es' if job.left_running > 1 else ''} left running"
        table.add_row(_plain(job.id), _plain(state), _plain(job.started[:19].replace("T", " ") or "-"), _plain(job.command))
    return table


def pods_table(rows: list[dict]) -> Table:
    """bin/pod ls's rows (the --json objects): podkit's pods by their pods.toml name, others marked."""
    table = Table(title_justify="left")
    for name, justify in (("name", "left"), ("id", "left"), ("status", "left"), ("GPUs", "left"),
                          ("price", "right"), ("ssh", "left")) + ((("guard", "left"),) if any("guard_text" in r for r in rows) else ()):
        table.add_column(name, justify=justify, overflow="fold")
    for r in rows:
        ssh = f"root@{r['ssh_host']}:{r['ssh_port']}" if r["ssh_host"] else "-"
        label = r["inventory_name"] or f"{r['name'] or '-'} (not podkit's)"
        table.add_row(_plain(label), _plain(r["id"]), _plain(r["status"]), _plain(f"{r['gpu_count']}x {r['gpu'] or '?'}"),
                      f"${r['cost_per_hour']:.2f}/h", _plain(ssh), *([_plain(r["guard_text"])] if "guard_text" in r else []))
    return table


def _plain(text: str) -> Text:
    """A cell shown as typed: a command or a pod name may hold [brackets] that rich reads as markup."""
    return Text(str(text))
