"""pods/progress.py: rsync's and envsetup's progress lines as rich bars on a terminal, a plain line
per tenth elsewhere. (The same against a real sshd and rsync: tests/test_pods.py.)"""

from __future__ import annotations

import io
import re

from podkit.pods import progress as bars


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def rsync_line(sent: int, pct: int) -> str:
    # rsync 3.2 --info=progress2, as run_rsync hands it over (stripped)
    return f"{sent:,}  {pct}%  1.23MB/s  0:00:02 (xfr#1, to-chk=0/3)"


def test_plain_lines_at_most_one_per_tenth_and_full_at_the_end():
    lines: list[str] = []
    with bars.transfer("sync", plain=lines.append, tty=False) as show:
        for pct in (0, 1, 2, 9, 10, 11, 35, 99):
            show(rsync_line(pct * 10_000, pct))
        show("sent 1,234 bytes  received 56 bytes")  # rsync's --stats text: not progress
    assert [line.split("%")[0] for line in lines] == ["sync:   0", "sync:  10", "sync:  35", "sync:  99", "sync: 100"]
    assert lines[-1] == "sync: 100% 966.8 KiB 1.23MB/s"


def test_nothing_transferred_prints_nothing():
    lines: list[str] = []
    with bars.transfer("fetch", plain=lines.append, tty=False):
        pass
    assert lines == []


def test_a_terminal_gets_a_rich_bar_and_no_plain_lines():
    term, lines = Terminal(), []
    with bars.transfer("sync", plain=lines.append, stream=term) as show:
        show(rsync_line(2 * 2**20, 50))
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.getvalue())
    assert lines == [] and "━" in drawn and "100%" in drawn and "2.0 MiB 1.23MB/s" in drawn


def test_envsetup_step_lines_become_the_install_bar():
    said: list[str] = []
    steps = bars.Steps("install", said.append, stream=Terminal())
    for line in ("  [1/4] venv", "  bitsandbytes: still running (30 s)", "  [2/4] requirements: pip",
                 "  [3/4] bitsandbytes: pip", "  [4/4] verify", "envsetup: ready in 3.0 s"):
        steps(line)
    assert steps.bar is not None and steps.bar.done == 3 and steps.bar.total == 4
    steps.close(finished=True)
    assert said == ["  bitsandbytes: still running (30 s)", "envsetup: ready in 3.0 s"]
    plain: list[str] = []
    off = bars.Steps("install", plain.append, tty=False)
    for line in ("  [1/2] venv", "  [2/2] verify"):
        off(line)
    off.close(finished=True)
    assert plain == ["install:   0% venv", "install:  50% verify", "install: 100% done"]


def _rows(drawn: str) -> dict[str, list[int]]:
    """Each named row's percents, in the order rich drew them."""
    rows: dict[str, list[int]] = {}
    for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)):
        m = re.search(r"fetch (\S+/) .*?(\d+)%", line)
        if m:
            rows.setdefault(m.group(1), []).append(int(m.group(2)))
    return rows


def test_a_fetch_in_parts_is_a_row_per_part_and_never_starts_over():
    """fetch-logs runs one rsync per top, each counting from 0: the one bar went back to 0% for logs/ after runs/
    reached 100%, which read as a second fetch. Each part is now a row named after it; runs/'s stays full."""
    term = Terminal()
    with bars.transfer("fetch", stream=term) as show:
        with show.part("runs/"):
            for pct in (0, 40, 99):
                show(rsync_line(pct * 40_000, pct))
        with show.part("logs/"):
            show(rsync_line(0, 0))
            show(rsync_line(3_000, 60))
    rows = _rows(term.getvalue())
    assert set(rows) == {"runs/", "logs/"}, rows
    for name, percents in rows.items():
        assert percents == sorted(percents) and percents[-1] == 100, (name, percents)  # never back, full at the end


def test_a_part_that_fails_is_left_where_it_stopped_and_plain_lines_stay_one_per_tenth():
    term = Terminal()
    try:
        with bars.transfer("fetch", stream=term) as show:
            with show.part("runs/"):
                show(rsync_line(100, 30))
                raise RuntimeError("rsync failed")
    except RuntimeError:
        pass
    assert _rows(term.getvalue())["runs/"][-1] == 30
    # a script's log: the part names its lines, and logs/ counting from 0 again adds none
    lines: list[str] = []
    with bars.transfer("fetch", plain=lines.append, tty=False) as show:
        with show.part("runs/"):
            for pct in (0, 50, 100):
                show(rsync_line(pct * 10_000, pct))
        with show.part("logs/"):
            for pct in (0, 50, 100):
                show(rsync_line(pct * 10, pct))
    assert [re.match(r"fetch: +\d+% \S+", line).group() for line in lines] == \
        ["fetch:   0% runs/", "fetch:  50% runs/", "fetch: 100% runs/"], lines
