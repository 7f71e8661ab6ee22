"""Progress of the long laptop-side steps (sync, fetch, a pod's install): a rich bar when stderr
is a terminal, else a plain line per tenth through the command's own `say` (stdout, or stderr under
--json, which owns stdout). Errors stay alone on stderr either way.

Two sources feed it: rsync's `--info=progress2` lines (bytes so far, percent, rate; the total
grows while rsync's incremental recursion still scans) and envsetup's step lines
(`  [2/6] bitsandbytes: pip`, see envsetup/cli.py). A transfer of several rsyncs (fetch-logs: runs/, then
logs/) shows each as a named part of the one bar, a row each on a terminal.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

# rsync 3.x --info=progress2: "  1,234,567  45%  1.23MB/s  0:00:02 (xfr#3, to-chk=10/20)"
# (rsync's progress.c, rprint_progress); the percent is of the bytes known so far.
_RSYNC = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+(\S+/s)?")
# envsetup's step line: "  [2/6] bitsandbytes: pip" (envsetup/cli.py, Setup.step)
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


class Bar:
    """One task's progress, out of `total` units: rich's Progress on a terminal, else plain lines at
    each tenth (and at the end) to `plain` (default: `stream`), so a log or CI shows progress without
    a line per rsync update."""

    def __init__(self, label: str, total: float = 100.0, *, stream: TextIO | None = None, tty: bool | None = None,
                 plain: Callable[[str], None] | None = None):
        self.label, self.total, self.plain = label, total, plain
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._progress = None
        self._task = None
        self._tenth = -1
        self._moved = False  # the current row has had an update (a part then starts a row of its own)
        self.part_name = ""
        self.done = 0.0

    def __enter__(self) -> "Bar":
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("  {task.description}"), BarColumn(), TaskProgressColumn(),
                                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                                      console=Console(file=self.stream), transient=False,
                                      # lines printed meanwhile land above the bar; stdout only when it is the
                                      # terminal too (a piped stdout, e.g. `| tee log`, keeps its lines)
                                      redirect_stdout=sys.stdout.isatty(), redirect_stderr=True)
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total, detail="")
        return self

    def part(self, name: str) -> None:
        """Go on with the next part of the same work (fetch's logs/ after its runs/), which counts from 0 again.
        On a terminal each part gets a row of its own, named, and the finished part's row stays as it ended, so
        the new part's 0% does not read as the work starting over. In plain lines the name follows the percent,
        and the tenths go on from where the last part stopped: a script's log gets no second run of lines."""
        self.part_name, self.done = name, 0.0
        if self._progress is not None:
            if self._moved:
                self._task = self._progress.add_task(f"{self.label} {name}", total=self.total, detail="")
            else:  # the row nothing has moved yet (the bar's first) takes the part's name
                self._progress.update(self._task, description=f"{self.label} {name}")
        self._moved = False

    def update(self, done: float, detail: str = "", description: str | None = None) -> None:
        self.done, self._moved = done, True
        if self._progress is not None:
            self._progress.update(self._task, completed=done, detail=detail,
                                  **({"description": f"{self.label}: {description}"} if description else {}))
            return
        tenth = int(10 * done / self.total) if self.total else 10
        if tenth > self._tenth:
            self._tenth = tenth
            what = "".join(f" {w}" for w in (self.part_name, description) if w)
            line = f"{self.label}: {100 * done / self.total:3.0f}%{what}{' ' + detail if detail else ''}"
            if self.plain is not None:
                self.plain(line)
            else:
                self.stream.write(line + "\n")
                self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


class Transfer:
    """run_rsync's `progress` callback over one Bar: each --info=progress2 line moves it. `part` names the
    rsync that starts next when one transfer takes several (fetch: one per top), each counting from 0."""

    def __init__(self, bar: Bar):
        self.bar = bar
        self.detail = ""

    def __call__(self, text: str) -> None:
        m = _RSYNC.match(text)
        if m:
            self.detail = _size(int(m.group(1).replace(",", ""))) + (f" {m.group(3)}" if m.group(3) else "")
            self.bar.update(float(m.group(2)), self.detail)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """The lines inside are the part `name`'s; one that ends without an error is shown full."""
        self.bar.part(name)
        self.detail = ""
        yield
        self.finish()

    def finish(self) -> None:
        if self.detail:  # rsync succeeded: everything is across, whatever its last line's rounding said
            self.bar.update(self.bar.total, self.detail)


@contextmanager
def transfer(label: str, *, plain: Callable[[str], None] | None = None, stream: TextIO | None = None,
             tty: bool | None = None) -> Iterator[Transfer]:
    """A callback for run_rsync's `progress` (a Transfer): each --info=progress2 line moves one bar."""
    with Bar(label, 100.0, stream=stream, tty=tty, plain=plain) as bar:
        show = Transfer(bar)
        yield show
        show.finish()


class Steps:
    """envsetup's `[k/n] name: action` lines as a bar over its steps; every other line goes to `say`."""

    def __init__(self, label: str, say: Callable[[str], None], *, stream: TextIO | None = None, tty: bool | None = None):
        self.label, self.say, self.stream, self.tty = label, say, stream, tty
        self.bar: Bar | None = None

    def __call__(self, line: str) -> None:
        m = STEP.match(line)
        if not m:
            self.say(line)  # rich's live display redirects sys.stdout/stderr: the line lands above the bar
            return
        k, n, what = int(m.group(1)), int(m.group(2)), m.group(3)
        if self.bar is None:
            self.bar = Bar(self.label, n, stream=self.stream, tty=self.tty, plain=self.say).__enter__()
        self.bar.update(k - 1, description=what)

    def close(self, finished: bool = False) -> None:
        """Stop the bar; full when every step `finished`, else left where the install stopped."""
        if self.bar is not None:
            if finished:
                self.bar.update(self.bar.total, description="done")
            self.bar.__exit__(None, None, None)
            self.bar = None
