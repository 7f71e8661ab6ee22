"""The shared remote shell (pods/shell.py) and rsync's relay (pods/rsh.py) against a real sshd.

The pod's login environment is noisy on purpose: BASH_ENV (set by sshd's SetEnv) prints to stdout
and stderr the way a `conda init` in ~/.bashrc can, and none of it may reach a command's output.
"""

import base64
import os
import signal
import subprocess
import sys
import threading
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.hosts import parse_host, resolve
from podkit.pods.rsh import CLIENT, RshServer
from podkit.pods.rsync import run_rsync
from podkit.pods.shell import _Stream
from sshd_harness import LoopbackPod, sshd_available, wait_for

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    base = tmp_path_factory.mktemp("shell")
    rc = base / "noisy_rc"
    rc.write_text('echo "conda: welcome"\necho "rc warning" >&2\nexport FROM_RC=yes\n')
    pod = LoopbackPod(base, "s", extra_config=f"SetEnv BASH_ENV={rc}\n").start()
    known = base / "known_hosts"
    known.write_text(pod.known_hosts_line())
    yield pod, known
    pod.stop()


@pytest.fixture
def conn(pod):
    p, known = pod
    with PodConnection(resolve(parse_host(p.spec, key=str(p.client_key))), known_hosts=known) as c:
        yield c


def test_output_is_exact_and_the_login_noise_is_gone(conn):
    assert conn.run("printf abc").stdout == "abc"
    assert conn.run("printf 'abc\\n\\n'").stdout == "abc\n\n"
    assert conn.run("true").stdout == ""
    r = conn.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    # the login environment is kept (conda's PATH must be), its chatter is not
    assert conn.run("echo $FROM_RC").stdout == "yes\n"


def test_each_command_runs_in_its_own_subshell_after_the_prelude(conn):
    conn.prelude = "cd /tmp; export PRE=1"
    assert conn.run("pwd; echo $PRE; cd /; X=2").stdout == "/tmp\n1\n"
    assert conn.run("pwd; echo ${X:-unset}").stdout == "/tmp\nunset\n"
    assert conn.run("echo $PRE", prelude=False).stdout == "\n"


def test_streamed_lines_match_the_collected_text(conn):
    lines = []
    r = conn.run("echo one; echo; echo two >&2; printf three", out=lines.append)
    assert sorted(lines) == sorted(["one", "", "two", "three"])
    assert (r.stdout, r.stderr) == ("one\n\nthree", "two\n")


def test_a_bar_that_stops_redrawing_shows_its_last_drawing_while_the_command_runs(conn):
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    # tqdm's way: each drawing starts with \r; then a long step with nothing written
    r = conn.run("printf '\\r 10%%|#'; sleep 0.3; printf '\\r 20%%|##'; sleep 3; printf '\\n'; echo done",
                 out=lambda line: seen.append((time.monotonic() - t0, line)))
    end = time.monotonic() - t0
    assert [line for _, line in seen] == [" 10%|#", " 20%|##", "done"]
    assert end - dict((line, t) for t, line in seen)[" 20%|##"] > 1.5  # shown during the step, not at its end
    assert r.stdout == "\r 10%|#\r 20%|##\ndone\n"


def test_a_fake_marker_in_output_does_not_end_the_command(conn):
    r = conn.run("printf '\\n\\x1epodkit-0000000000000000 0\\n'; echo after; exit 5")
    assert r.exit_code == 5 and r.stdout.endswith("after\n")


def test_stdin_data_reaches_the_command_and_never_argv_or_the_shell(conn, tmp_path):
    secret = "HF_TOKEN=hf_NOT_IN_ARGV_42\n"
    scan = "cat; for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"
    r = conn.run(scan, stdin=secret)
    assert r.stdout.startswith(secret)
    assert r.stdout.count("hf_NOT_IN_ARGV_42") == 1  # only cat's copy: no process had it in argv
    assert base64.b64encode(secret.encode()).decode()[:16] not in r.stdout
    # data a command does not read is dropped, not run as shell input
    marker = tmp_path / "pwned"
    assert conn.run("true", stdin=f"touch {marker}\n").ok
    assert not marker.exists() and conn.run("echo still here").stdout == "still here\n"


def test_a_command_past_its_timeout_is_one_error_and_the_next_one_runs(conn):
    with pytest.raises(PodError, match="ran past 1 s"):
        conn.run("sleep 5", timeout=1)
    assert conn.run("echo fresh shell").stdout == "fresh shell\n"


def test_a_dropped_link_is_one_error(pod, conn):
    conn.run("true")
    pod[0].drop_connections()
    with pytest.raises(PodError, match="dropped") as raised:
        conn.run("echo never")
    assert "ShellClosed" not in str(raised.value)  # the reason in words, not podkit's class name


def test_rsync_rides_the_same_connection(pod, conn, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    (src / "big.bin").write_bytes(os.urandom(3 * 2**20))
    dest = tmp_path / "dest"
    sshd = pod[0].proc.pid
    sessions = []  # sshd's session processes, sampled while rsync runs: one per SSH login
    done = threading.Event()

    def sample():
        while not done.is_set():
            out = subprocess.run(["pgrep", "-P", str(sshd)], capture_output=True, text=True).stdout
            sessions.append(len(out.split()))
            time.sleep(0.05)

    conn.warm_spare()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        stats = run_rsync(conn, ["-rlpt", f"{src}/", f"{pod[0].address}:{dest}/"], what="sync", bwlimit=2000)
    finally:
        done.set()
        sampler.join()
    assert stats.files == 2 and (dest / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert (dest / "a.txt").read_text() == "hello\n"
    assert len(sessions) > 5 and max(sessions) == 1, sessions  # rsync never logged in on its own
    # a failing remote rsync is reported with its own message (its first complaint when the link is
    # up; its exit code when the message was lost), never as a dropped link
    with pytest.raises(PodError, match="No such file or directory|rsync exit"):
        run_rsync(conn, ["-rlpt", f"{src}/", f"{pod[0].address}:/proc/no/such/dir/"], what="sync")


def test_a_progress_bar_streams_before_its_line_ends():
    lines: list[str] = []
    stream = _Stream(b"\x1eM", lines.append)
    stream.feed(b"epoch 1\n 10%|#\r 20%|##\r 30%")  # tqdm: each redraw starts with \r, the newline comes at the end
    assert lines == ["epoch 1", " 20%|##"]  # what a terminal shows now, before any newline
    stream.feed(b"|###\r100%|#####\n\x1eM 0\n")
    assert lines[-1] == "100%|#####" and stream.status == 0
    assert bytes(stream.text) == b"epoch 1\n 10%|#\r 20%|##\r 30%|###\r100%|#####"  # collected whole


def test_an_idle_stream_shows_the_bars_current_drawing_once():
    lines: list[str] = []
    stream = _Stream(b"\x1eM", lines.append)
    stream.feed(b"epoch 1\n\r 10%|#\r 20%|##")
    assert lines == ["epoch 1", " 10%|#"]  # 20% may still be arriving
    stream.idle()  # nothing more came: a stuck step shows where it is, not the step before
    stream.idle()
    assert lines == ["epoch 1", " 10%|#", " 20%|##"]
    stream.feed(b"\r 30%|###")
    assert lines == ["epoch 1", " 10%|#", " 20%|##"]  # 20% is not shown twice when the next redraw ends it
    stream.idle()
    stream.feed(b"\n\x1eM 0\n")  # the bar's line ends on the drawing already shown
    assert lines == ["epoch 1", " 10%|#", " 20%|##", " 30%|###"] and stream.status == 0


def test_an_idle_stream_leaves_an_unfinished_line_for_its_end():
    lines: list[str] = []
    stream = _Stream(b"\x1eM", lines.append)
    stream.feed(b"Downloading...")
    stream.idle()  # no carriage return: an unfinished line, not a drawing; shown once, when it ends
    stream.feed(b"abc\r")
    stream.idle()  # its \r may be a CRLF's first half
    stream.feed(b"\nok\n\x1eM 0\n")
    assert lines == ["Downloading...abc", "ok"]


def test_a_crlf_split_between_chunks_is_one_line_end():
    lines: list[str] = []
    stream = _Stream(b"\x1eM", lines.append)
    stream.feed(b"abc\r")
    stream.feed(b"\nxyz\r\n\x1eM 0\n")
    assert lines == ["abc", "xyz"] and bytes(stream.text) == b"abc\r\nxyz\r"


def test_stream_framing_removes_exactly_the_newline_before_the_marker():
    for text in (b"", b"abc", b"abc\n", b"abc\n\n", b"\n", b"a\n\nb"):
        expected_lines = text.decode().split("\n")
        if expected_lines[-1] == "":
            expected_lines.pop()
        for cut in range(len(text) + 1):  # however the bytes arrive in chunks
            lines: list[str] = []
            stream = _Stream(b"\x1eM", lines.append)
            stream.feed(text[:cut])
            stream.feed(text[cut:] + b"\n\x1eM 4\n")
            assert (bytes(stream.text), stream.status) == (text, 4)
            assert lines == expected_lines, (text, cut, lines)


def test_the_relay_survives_a_slow_reader_on_a_non_blocking_pipe(conn):
    """rsync gives its remote shell non-blocking stdin/stdout and may read slowly (busy disk)."""
    size = 8 * 2**20
    with RshServer(conn) as server:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # as rsync leaves it for the child
        proc = subprocess.Popen([sys.executable, "-S", str(CLIENT), server.path, "pod", "head", "-c", str(size), "/dev/zero"],
                                stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.PIPE)
        os.close(write_end)
        got = 0
        with os.fdopen(read_end, "rb") as pipe:
            time.sleep(1.0)  # let the pipe fill up before anyone reads
            while chunk := pipe.read(65536):
                got += len(chunk)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert got == size


def test_a_login_rc_that_hangs_is_one_clear_error(tmp_path):
    rc = tmp_path / "hanging_rc"
    rc.write_text("read answer\n")  # waits for input: it would swallow podkit's first line, then hang
    pod = LoopbackPod(tmp_path, "h", extra_config=f"SetEnv BASH_ENV={rc}\n").start()
    try:
        known = tmp_path / "known_hosts"
        known.write_text(pod.known_hosts_line())
        endpoint = resolve(parse_host(pod.spec, key=str(pod.client_key)))
        start = time.monotonic()
        with PodConnection(endpoint, known_hosts=known, timeout=1) as c:
            with pytest.raises(PodError, match="login shell on 127.0.0.1 did not start within 6 s.*bashrc"):
                c.run("true")
        assert time.monotonic() - start < 30
    finally:
        pod.stop()


def _ppid(pid: int) -> int | None:
    """The parent of `pid`, as /proc says (after the last ") ": a comm may hold spaces); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(") ", 1)[1].split()[:2]
    except (OSError, IndexError):
        return None
    return None if state == "Z" else int(ppid)  # a zombie runs nothing


@pytest.mark.parametrize("how", ["ctrl-c", "cancel"])
def test_ctrl_c_stops_a_shell_loop_and_the_shared_shell_on_the_pod(pod, how):
    """A loop run by the shared shell itself (a fork of it, exec'ing only its `sleep`s) ends on a Ctrl-C of the
    client, in the main thread (conn.run's own stop) or from another thread (cancel(), as deploy does); the
    connection still runs commands after the plain Ctrl-C."""
    p, known = pod
    digits = str(uuid.uuid4().int)[:9]
    nap = f"0.2{digits}"  # the loop's sleeps are found by this argument; split below, so the client's argv lacks it
    script = textwrap.dedent(f"""
        import sys, threading
        from podkit.pods.connection import PodConnection
        from podkit.pods.hosts import parse_host, resolve
        conn = PodConnection(resolve(parse_host({p.spec!r}, key={str(p.client_key)!r})), known_hosts={str(known)!r})
        loop = "while :; do sleep 0.2" + {digits!r} + "; done"
        if {how!r} == "ctrl-c":
            try:
                conn.run(loop)
            except KeyboardInterrupt:
                print("interrupted", conn.run("echo usable").stdout.strip(), flush=True)
                sys.exit(130)
        caught = []
        def work():
            try:
                conn.run(loop)
            except BaseException as exc:
                caught.append(type(exc).__name__)
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.2)
        except KeyboardInterrupt:
            conn.cancel()
            worker.join(30)
            print("interrupted", caught, flush=True)
            sys.exit(130)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)

    def sleeps() -> list[int]:
        found = subprocess.run(["pgrep", "-f", f"^sleep {nap}$"], capture_output=True, text=True).stdout
        return [int(pid) for pid in found.split()]

    loop = shell = None
    try:
        assert wait_for(sleeps, 30), client.stderr.read() if client.poll() is not None else "the loop never ran"
        # the shell's fork that runs the loop: found while it runs, so it can be missed (a sleep between two sleeps
        # is none: asked again until one answers with its parent)
        found: list = []
        assert wait_for(lambda: found.append(next(filter(None, map(_ppid, sleeps())), None)) or found[-1], 10)
        loop = found[-1]
        shell = _ppid(loop)
        assert loop and shell and _ppid(shell), "the loop and its shared shell are running"
        client.send_signal(signal.SIGINT)
        out, err = client.communicate(timeout=60)
        assert client.returncode == 130, out + err
        assert out.split() == (["interrupted", "usable"] if how == "ctrl-c" else ["interrupted", "['KeyboardInterrupt']"]), out + err
        assert wait_for(lambda: _ppid(loop) is None, 5), "the loop still runs on the pod after Ctrl-C"
        assert wait_for(lambda: _ppid(shell) is None, 5), "the shared shell still runs on the pod after Ctrl-C"
        time.sleep(0.5)  # more than a turn of the loop: a sleep started after the stop would show
        assert not sleeps(), "the loop's sleeps still run on the pod"
    finally:
        if client.poll() is None:
            client.kill()
        for pid in [*sleeps(), loop, shell]:  # this test's own, by pid, when the stop failed
            if pid and _ppid(pid) is not None:
                os.kill(pid, signal.SIGKILL)


def _pgrep_sleep(arg: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"^sleep {arg}$"], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def test_a_command_past_its_timeout_is_stopped_on_the_pod_and_nothing_else_of_the_connection(conn):
    """The timed-out command's whole tree ends on the pod (a loop forks a `sleep` every turn: closing the channel
    alone leaves it running, unseen); what the connection runs beside it lives on: rsync's channel (a shell exec'd
    in place, as conn.exec hands it over) and a command another thread has waiting for the shell."""
    digits = str(uuid.uuid4().int)[:9]
    nap, beside, waiting = f"0.2{digits}", f"600.{digits}", f"0.5{digits}"  # found by these arguments
    side = conn.exec(f"sleep {beside}")  # stands for rsync, running while commands do
    caught, later = [], []

    def timed_out():
        try:
            conn.run("while :; do sleep 0.2" + digits + "; done", timeout=2)
        except PodError as exc:
            caught.append(str(exc))

    def queued():
        later.append(conn.run(f"sleep {waiting}; echo ran after").stdout)

    first = threading.Thread(target=timed_out)
    first.start()
    loop = None
    try:
        assert wait_for(lambda: _pgrep_sleep(nap), 10), "the loop never ran"
        loop = _ppid(_pgrep_sleep(nap)[0])  # the shell's fork that runs the loop, while it runs
        assert loop and wait_for(lambda: _pgrep_sleep(beside), 10), "the channel beside it runs"
        second = threading.Thread(target=queued)
        second.start()  # waits for the shell the loop holds
        first.join(60)
        assert len(caught) == 1 and "\n" not in caught[0] and "ran past 2 s and was stopped" in caught[0], caught
        assert _ppid(loop) is None, "the timed-out loop still runs on the pod"
        time.sleep(0.5)  # more than a turn of the loop: a sleep started after the stop would show
        assert not _pgrep_sleep(nap), "the timed-out loop's sleeps still run on the pod"
        second.join(60)
        assert later == ["ran after\n"], "the command waiting beside it ran, on a fresh shell"
        assert _pgrep_sleep(beside), "the channel beside the timed-out command was stopped with it"
        assert conn.run("echo usable").stdout == "usable\n"
    finally:
        side.close()
        for pid in [*_pgrep_sleep(nap), *_pgrep_sleep(beside), loop]:  # this test's own, by pid
            if pid and _ppid(pid) is not None:
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stopped, says", [
    ("stopped 3", "remote command ran past 120 s and was stopped (re-run"),
    ("killed 2", "remote command ran past 120 s and was stopped (re-run"),
    ("left 4242 4243", "remote command ran past 120 s; it could not be stopped on the pod (pids 4242 4243) (a process stuck"),
    ("", "remote command ran past 120 s; whether it still runs on the pod is unknown"),
])
def test_a_timeout_says_in_one_line_what_became_of_the_command_on_the_pod(stopped, says):
    """The stop's last line (pods/remote_stop.py) after a timeout, or none when the pod did not answer it."""
    line = str(PodConnection._timed_out(120, stopped))
    assert line.startswith(says) and "\n" not in line, line
