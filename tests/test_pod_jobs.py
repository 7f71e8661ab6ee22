"""Detached jobs, stopping and deadlines against a real sshd on loopback (issue 12, items 2, 3, 4, 9).

The pod's login environment puts a pyenv-like shim first on PATH (BASH_ENV set by sshd's
SetEnv, read by every non-interactive bash), and every test checks what is left running by
listing this machine's processes, which are the pod's.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import threading
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from sshd_harness import one_line_error, pod_cli, pod_world, sshd_available, wait_for
from smoke_helpers import tiny_job

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


def with_env(entry: str) -> list[int]:
    """Live processes whose environment holds `entry` (NAME=value), found as the pod would."""
    needle, found = entry.encode(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("jobs")
    shims = base / "pyenv" / "shims"
    shims.mkdir(parents=True)
    (shims / "python").write_text("#!/bin/sh\necho 'pyenv: python: command not found' >&2\nexit 127\n")
    (shims / "python").chmod(0o755)
    rc = base / "bashrc"
    rc.write_text(f'export PATH="{shims}:$PATH"\n')  # what `eval "$(pyenv init -)"` does
    w = pod_world(base, "jobs", extra_config=f"SetEnv BASH_ENV={rc}\n")
    deployed = cli(w, "deploy", w.pod.spec, *args(w))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    yield w
    w.pod.stop()


def args(world) -> list[str]:
    return ["--key", str(world.pod.client_key), "--remote-dir", world.pod.remote_dir, "--python", sys.executable]


def cli(world, *a, **kw):
    return pod_cli(world.project, *a, known_hosts=world.known_hosts, **kw)


def test_a_detached_job_runs_the_venvs_python_whatever_the_rc_files_put_first(world):
    out = cli(world, "run", *args(world), world.pod.spec, "--", "python", "-c", "import sys; print(sys.prefix)")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(Path(world.pod.remote_dir) / ".venv")


def test_job_ids_are_checked_everywhere_and_attach_picks_the_newest(world):
    canary = world.base / "injected"
    evil = f"x; touch {canary}; #"
    for command in (["attach", world.pod.spec, *args(world), evil], ["stop", world.pod.spec, *args(world), evil],
                    ["run", *args(world), "--id", evil, world.pod.spec, "--", "true"]):
        assert "job id" in one_line_error(cli(world, *command))
    assert not canary.exists()
    assert "names a directory, not a job" in one_line_error(cli(world, "attach", world.pod.spec, *args(world), ".."))
    # Alphabetically last is not newest: attach without an id follows the start time.
    for jid in ("zzz-first", "aaa-second"):
        started = cli(world, "run", *args(world), "--id", jid, "--detach", world.pod.spec, "--", "echo", f"hello {jid}")
        assert started.returncode == 0, started.stderr
    attached = cli(world, "attach", world.pod.spec, *args(world))
    assert attached.returncode == 0 and "hello aaa-second" in attached.stdout, attached.stdout + attached.stderr


@pytest.mark.parametrize("command, code", [
    ("cd jobs && pwd && exit 0", 0),  # a cd that moved the wrapper lost the exit code file's relative path
    ("exec python -c 'import sys; sys.exit(5)'", 5),  # exec replaced the wrapper that records the code
    ("false || exit 3", 3),  # exit ended the wrapper before it recorded anything
    ("echo 'unterminated", 2),  # a syntax error is the command's failure, with its exit code recorded
])
def test_a_one_string_command_that_moves_replaces_or_exits_keeps_its_exit_code(world, command, code):
    (Path(world.pod.remote_dir) / "jobs").mkdir(exist_ok=True)
    out = cli(world, "run", *args(world), world.pod.spec, "--", command)
    assert out.returncode == code, out.stdout + out.stderr
    assert "without an exit code" not in out.stderr


@contextmanager
def pod_secret(world, name: str):
    """A secret exported by the pod's env file, as deploy writes HF_TOKEN there, while the block runs: its value."""
    env = Path(world.pod.remote_dir) / ".podkit" / "env"
    before = env.read_text()
    value = f"s3cr3t{uuid.uuid4().hex}"
    env.write_text(before + f"export {name}={value}\n")
    try:
        yield value
    finally:
        env.write_text(before)


def _in_session(sid: int) -> list[int]:
    """Live processes (zombies aside) of session `sid`: a job's wrapper leads its own."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and fields[3] == str(sid):
            found.append(int(p))
    return found


# Writes the pod's HF_TOKEN to stdout and stderr; bytes that are not UTF-8 and a line of 300,000 characters; the
# value split between two writes half a second apart; no newline at the end; exit 3.
_PRINTS_ITS_TOKEN = r"""import os, sys, time
v, out = os.environ["HF_TOKEN"].encode(), sys.stdout.buffer
out.write(b"token=" + v + b"\n" + bytes(range(256)) + b"x" * 300000 + b"\n"); out.flush()
sys.stderr.write("on stderr " + v.decode() + "\n"); sys.stderr.flush()
out.write(v[:5]); out.flush(); time.sleep(0.5); out.write(v[5:] + b" and no newline"); out.flush()
sys.exit(3)"""


def test_a_secret_a_job_prints_reaches_neither_its_log_nor_attach(world):
    """A command that printed a secret the pod's env file exports (`env`, a traceback quoting a token) put it
    verbatim into output.log, the stream `run` and `attach` show, and what fetch-logs copies. It reads
    "[HF_TOKEN redacted]" there now, and nothing else of the output changes; the exit code is the command's."""
    jid = f"redact-{uuid.uuid4().hex[:8]}"
    with pod_secret(world, "HF_TOKEN") as value:
        ran = cli(world, "run", *args(world), "--id", jid, world.pod.spec, "--", "python", "-c", _PRINTS_ITS_TOKEN)
    assert ran.returncode == 3, ran.stdout + ran.stderr
    assert value not in ran.stdout + ran.stderr
    assert "token=[HF_TOKEN redacted]" in ran.stdout and "on stderr [HF_TOKEN redacted]" in ran.stdout, ran.stdout
    assert ran.stdout.rstrip().endswith("[HF_TOKEN redacted] and no newline"), ran.stdout[-200:]
    log = (Path(world.pod.remote_dir) / "logs" / "jobs" / jid / "output.log").read_bytes()
    assert log == (b"token=[HF_TOKEN redacted]\n" + bytes(range(256)) + b"x" * 300000 + b"\n"
                   b"on stderr [HF_TOKEN redacted]\n[HF_TOKEN redacted] and no newline"), log[:100] + b"..." + log[-100:]
    attached = cli(world, "attach", world.pod.spec, *args(world), jid)
    assert attached.returncode == 3 and "token=[HF_TOKEN redacted]" in attached.stdout, attached.stderr
    assert value not in attached.stdout + attached.stderr


def test_stop_keeps_what_a_job_says_on_sigterm_and_leaves_nothing_running(world):
    """The filter between the job and its log is in the job's session, which `stop` signals whole: it outlives the
    SIGTERM, so the command's last words (bin/smoke's summary) still reach output.log, redacted, and ends with the
    command, so that the stop reports it stopped and nothing is left running."""
    jid = f"lastwords-{uuid.uuid4().hex[:8]}"
    log = Path(world.pod.remote_dir) / "logs" / "jobs" / jid / "output.log"
    with pod_secret(world, "HF_TOKEN") as value:
        started = cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "bash", "-c",
                      "trap 'echo \"last words $HF_TOKEN\"; exit 7' TERM; echo started; while :; do sleep 0.1; done")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert wait_for(lambda: log.exists() and b"started" in log.read_bytes(), 30)
        wrapper = int(log.with_name("pid").read_text())
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "10", "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert re.fullmatch(r"stopped \d+", _strict(stopped.stdout)["result"]), stopped.stdout
        lines = log.read_text().splitlines()  # between them perhaps bash's "Terminated" of its sleep
        assert (lines[0], lines[-1]) == ("started", "last words [HF_TOKEN redacted]"), lines
        assert value not in log.read_text()
        job = next(j for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]
                   if j["id"] == jid)
        assert (job["state"], job["exit_code"], job["left_running"]) == ("stopped", 7, 0), job
        assert wait_for(lambda: not _in_session(wrapper), 5), f"still running on the pod: {_in_session(wrapper)}"
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}"):
            os.kill(pid, signal.SIGKILL)


def test_stop_ends_a_two_process_smoke_and_everything_it_started(world):
    remote = Path(world.pod.remote_dir)
    job = tiny_job(remote / "jobs", cluster={"gpus_per_node": 2}, smoke={"steps": 100000})  # made on the pod
    jid = f"stop-{uuid.uuid4().hex[:8]}"
    started = cli(world, "run", *args(world), "--id", jid, "--detach", world.pod.spec, "--",
                  "bin/smoke", "--config", str(job.relative_to(remote)), "--run-id", jid)
    assert started.returncode == 0, started.stderr
    metrics = Path(world.pod.remote_dir) / "runs" / jid / "metrics.jsonl"
    try:
        log = remote / "logs" / "jobs" / jid
        assert wait_for(lambda: (log / "exit_code").exists() or (metrics.exists() and len(metrics.read_text().splitlines()) > 3),
                         180) and not (log / "exit_code").exists(), (log / "output.log").read_text()
        assert len(with_env(f"PODKIT_JOB_ID={jid}")) >= 4  # wrapper, launcher, torchrun, 2 workers
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "30")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"stopping job {jid}" in stopped.stderr and "SIGKILL" in stopped.stderr  # said before the grace
    finally:
        left = with_env(f"PODKIT_JOB_ID={jid}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running on the pod: {left}"
    listed = cli(world, "jobs", world.pod.spec, *args(world))
    assert re.search(rf"│ {jid}\s+│ stopped 130\s+│", listed.stdout), listed.stdout  # a rich table row
    summary = (Path(world.pod.remote_dir) / "runs" / jid / "summary.json").read_text()
    assert '"status": "interrupted"' in summary


@pytest.mark.parametrize("command", ["run", "attach"])
def test_ctrl_c_while_following_a_job_leaves_it_running_and_says_how_to_get_back(world, command):
    jid = f"follow-{command}-{uuid.uuid4().hex[:6]}"
    started = cli(world, "run", *args(world), "--id", jid, "--detach", world.pod.spec, "--",
                  "bash", "-c", "for i in $(seq 1 600); do echo tick $i; sleep 0.1; done")
    assert started.returncode == 0, started.stderr
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    follow = (["attach", "--known-hosts", str(world.known_hosts), world.pod.spec, *args(world), jid, "--json"]
              if command == "attach" else None)
    if follow is None:  # `run` without --detach follows a job of its own
        jid = f"{jid}-r"
        follow = ["run", "--known-hosts", str(world.known_hosts), *args(world), "--id", jid, "--json", world.pod.spec,
                  "--", "bash", "-c", "for i in $(seq 1 600); do echo tick $i; sleep 0.1; done"]
    proc = subprocess.Popen([str(world.project / "bin" / "pod"), *follow], cwd=world.project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(lambda: with_env(f"PODKIT_JOB_ID={jid}"), timeout=60)
        time.sleep(1.5)  # following: the output streams
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert f"job {jid} keeps running" in err, err
        # the hint is a command that reaches the same project directory, with the same key (review 2026-11-25:
        # without --remote-dir it looked for the job in the profile's default directory)
        hint = shlex.split(err.split("re-attach: ", 1)[1].split(";", 1)[0])
        assert hint[:3] == ["bin/pod", "attach", world.pod.spec] and hint[-1] == jid, err
        assert all(w in hint for w in ("--remote-dir", world.pod.remote_dir, "--key", str(world.pod.client_key))), err
        assert "re-run to continue" not in err
        obj = json.loads(out)  # --json: one object on stdout, even when interrupted
        assert obj["job"] == jid and obj["detached"] and obj["exit_code"] is None
        assert with_env(f"PODKIT_JOB_ID={jid}"), "the job was stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
        for job in {jid, jid.removesuffix("-r")}:  # the `run` case started a detached one first
            cli(world, "stop", world.pod.spec, *args(world), job, "--grace", "1")

@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_reader_that_stops_reading_is_not_a_dropped_connection(world, closed):
    """`bin/pod run HOST -- CMD | head -2` (or, under --json, whose stream is on stderr, `2>&1 >out | head -2`):
    the pipe closes, the link is fine, the job runs on."""
    jid = f"piped-{closed}-{uuid.uuid4().hex[:6]}"
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    argv = [str(world.project / "bin" / "pod"), "run", "--known-hosts", str(world.known_hosts), *args(world),
            "--id", jid, *(["--json"] if closed == "stderr" else []), world.pod.spec, "--", "seq", "1", "100000"]
    pod = subprocess.Popen(argv, cwd=world.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    piped, other = (pod.stdout, pod.stderr) if closed == "stdout" else (pod.stderr, pod.stdout)
    try:
        head = subprocess.run(["head", "-2"], stdin=piped, capture_output=True, text=True, timeout=60)
        piped.close()
        rest = other.read().decode()
        pod.wait(timeout=60)
    finally:
        if pod.poll() is None:
            pod.kill()
    assert head.stdout.splitlines()[-1] in ("1", "2")  # the stream was flowing when its reader left
    assert pod.returncode == 141, rest
    if closed == "stdout":  # the note reaches the stderr still read
        assert "dropped" not in rest and "output closed by its reader" in rest, rest
        assert "Traceback" not in rest and "Exception ignored" not in rest, rest
    else:  # --json: one object on the stdout still read
        obj = json.loads(rest)
        assert obj["job"] == jid and obj["detached"] and obj["exit_code"] is None


def test_ctrl_c_on_the_laptop_stops_the_remote_step(world):
    """A long remote step (an install) interrupted by Ctrl-C is stopped on the pod, not left running."""
    suffix = uuid.uuid4().hex[:8]
    marker = f"podkit-step-{suffix}"  # split below, so the client's own argv does not hold it
    script = textwrap.dedent(f"""
        import sys
        from podkit.pods.connection import PodConnection
        from podkit.pods.hosts import parse_host, resolve
        conn = PodConnection(resolve(parse_host({world.pod.spec!r}, key={str(world.pod.client_key)!r})),
                             known_hosts={str(world.known_hosts)!r})
        print("running", flush=True)
        marker = "podkit-step-" + {suffix!r}
        try:
            conn.run(f"bash -c 'exec -a {{marker}} sleep 600'")
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """)
    env = dict(os.environ, PYTHONPATH=str(world.project))
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    def remote_step() -> bool:
        return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0

    try:
        assert wait_for(remote_step, 30), client.stderr.read() if client.poll() is not None else "no remote step"
        client.send_signal(signal.SIGINT)
        out, err = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 130 and "interrupted" in out, out + err
    assert wait_for(lambda: not remote_step(), 5), "the remote step is still running after Ctrl-C"


def test_ctrl_c_of_a_stop_leaves_no_stop_running_on_the_pod(world):
    """`bin/pod stop` waits out the grace on the pod, in a loop of the shared shell. A Ctrl-C of it ends that loop
    there too: the job, which ignores SIGTERM, is not SIGKILLed later by a stop nobody sees, and is said to run."""
    jid = f"stubborn-{uuid.uuid4().hex[:6]}"
    started = cli(world, "run", *args(world), "--id", jid, "--detach", world.pod.spec, "--",
                  "bash", "-c", "trap '' TERM; while :; do sleep 0.1; done")
    assert started.returncode == 0, started.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(world.project / "bin" / "pod"), "stop", "--known-hosts", str(world.known_hosts),
                             world.pod.spec, *args(world), jid, "--grace", "4"], cwd=world.project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert f"stopping job {jid}" in proc.stderr.readline()
        time.sleep(1.5)  # the SIGTERM is sent; the grace runs
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out + err
        assert f"job {jid} may still run" in err and f"bin/pod stop {world.pod.spec}" in err, err
        time.sleep(5)  # past the grace: a stop left running would SIGKILL the job now
        assert with_env(f"PODKIT_JOB_ID={jid}"), "the stop ran on after its Ctrl-C and killed the job"
        # the job then ends by another hand (its command killed; its wrapper records the code): a stop cut short
        # did not stop it, and `jobs` must not say it did
        jobdir = Path(world.pod.remote_dir) / "logs" / "jobs" / jid
        wrapper = int((jobdir / "pid").read_text())
        for pid in with_env(f"PODKIT_JOB_ID={jid}"):
            if pid != wrapper:
                os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: (jobdir / "exit_code").exists(), 10)
        listed = {j["id"]: j for j in json.loads(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]}
        assert listed[jid]["state"] == "exited", listed[jid]
    finally:
        if proc.poll() is None:
            proc.kill()
        cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "1")
    assert not with_env(f"PODKIT_JOB_ID={jid}")


def test_a_frozen_sshd_session_gives_one_line_within_the_deadline(world):
    """TCP stays up (the kernel still ACKs) but the pod's sshd session answers nothing: SIGSTOP."""
    run = Path(world.pod.remote_dir) / "runs" / "frozen"
    run.mkdir(parents=True, exist_ok=True)
    (run / "big.bin").write_bytes(os.urandom(8 * 2**20))
    argv = [str(world.project / "bin" / "pod"), "fetch-logs", "--known-hosts", str(world.known_hosts),
            "--timeout", "2", "--bwlimit", "1000", world.pod.spec, *args(world)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    local = world.project / "pod-logs" / f"127.0.0.1-{world.pod.port}" / "runs" / "frozen"
    sessions: list[int] = []
    try:
        assert wait_for(lambda: local.exists() and any(local.rglob("*big.bin*")), 60), "the fetch never started"
        sessions = [int(p) for p in subprocess.run(["pgrep", "-P", str(world.pod.proc.pid)], capture_output=True,
                                                    text=True).stdout.split()]
        for pid in sessions:
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        for pid in sessions:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in (out + err).splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1, out + err
    assert "stopped answering" in lines[0] and f"127.0.0.1:{world.pod.port}" in lines[0] and "Traceback" not in err
    assert took < 20, f"took {took:.0f} s; the deadline is 3 x --timeout = 6 s"
    import shutil
    shutil.rmtree(run)


def test_ctrl_c_during_deploy_stops_envsetup_on_the_pod_at_once(world):
    """Deploy's steps run in worker threads; Ctrl-C reaches the main thread, which must stop them."""
    suffix = uuid.uuid4().hex[:8]
    slow = world.base / "slow-python"  # the image's python, except that envsetup hangs like a long pip install
    slow.write_text(f'#!/bin/bash\ncase "$*" in *envsetup.cli*) exec -a podkit-slow-envsetup-{suffix} sleep 600;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    remote = world.base / "pod-side" / "ctrl-c"
    argv = [str(world.project / "bin" / "pod"), "deploy", "--known-hosts", str(world.known_hosts), world.pod.spec,
            "--key", str(world.pod.client_key), "--remote-dir", str(remote), "--python", str(slow), "--json"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def envsetup_running() -> bool:
        return subprocess.run(["pgrep", "-f", f"podkit-slow-envsetup-{suffix}"], capture_output=True).returncode == 0

    try:
        assert wait_for(envsetup_running, 120), "envsetup never started"
        proc.send_signal(signal.SIGINT)
        pressed = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            proc.kill()
        found = subprocess.run(["pgrep", "-f", f"podkit-slow-envsetup-{suffix}"], capture_output=True, text=True)
        for pid in found.stdout.split():  # this test's own sleep, by pid, if the fix failed
            os.kill(int(pid), signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted" in err, out + err
    # --json: the one object on a Ctrl-C too (review 2026-11-25: stdout was empty)
    assert _strict(out) == {"ok": False, "interrupted": True, "exit_code": 130,
                            "pods": [{"pod": f"127.0.0.1-{world.pod.port}", "result": "interrupted"}]}, out
    assert took < 20, f"deploy took {took:.0f} s to stop after Ctrl-C"
    assert wait_for(lambda: not envsetup_running(), 5), "envsetup is still running on the pod"


def _strict(text: str):
    import json

    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_run_attach_stop_and_jobs_speak_json_on_stdout_alone(world):
    """--json: stdout is one strict object; the job's own output and podkit's notes go to stderr."""
    jid = f"json-{uuid.uuid4().hex[:8]}"
    log = Path(world.pod.remote_dir) / "logs" / "jobs" / jid / "output.log"
    started = cli(world, "run", *args(world), "--json", "--id", jid, "-d", world.pod.spec, "bash", "-c",
                  "echo from-the-job; exit 3")
    assert started.returncode == 0, started.stderr
    data = _strict(started.stdout)
    assert data == {"ok": True, "job": jid, "pod": f"127.0.0.1-{world.pod.port}", "host": "127.0.0.1",
                    "remote_dir": world.pod.remote_dir, "log": str(log), "changed_since_deploy": [], "detached": True,
                    "exit_code": None}, data
    assert wait_for(lambda: "from-the-job" in log.read_text() if log.exists() else False, 30)
    attached = cli(world, "attach", world.pod.spec, *args(world), jid, "--json")
    assert attached.returncode == 3, attached.stderr
    assert "from-the-job" in attached.stderr and "from-the-job" not in attached.stdout
    data = _strict(attached.stdout)
    assert (data["ok"], data["job"], data["exit_code"], data["log"]) == (False, jid, 3, str(log))

    # attached run: the exit code, and the output on stderr
    ran = cli(world, "run", *args(world), "--json", world.pod.spec, "--", "bash", "-c", "echo ran-it; exit 0")
    assert ran.returncode == 0 and "ran-it" in ran.stderr, ran.stdout + ran.stderr
    data = _strict(ran.stdout)
    assert (data["ok"], data["detached"], data["exit_code"]) == (True, False, 0)

    sleeper = f"sleep-{uuid.uuid4().hex[:8]}"
    assert cli(world, "run", *args(world), "--id", sleeper, "-d", world.pod.spec, "--", "sleep", "600").returncode == 0
    try:
        stopped = cli(world, "stop", world.pod.spec, *args(world), sleeper, "--grace", "5", "--json")
        assert stopped.returncode == 0, stopped.stderr
        data = _strict(stopped.stdout)
        assert data["ok"] is True and data["job"] == sleeper and data["result"]
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={sleeper}"):
            os.kill(pid, signal.SIGKILL)
    listed = _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)
    states = {j["id"]: (j["state"], j["exit_code"]) for j in listed["jobs"]}
    assert states[jid] == ("exited", 3) and states[sleeper][0] == "stopped"


def test_probe_json_stays_strict_when_a_host_key_is_recorded(world, tmp_path):
    fresh = tmp_path / "known_hosts"
    out = pod_cli(world.project, "probe", world.pod.spec, *args(world), "--accept-new", "--json", known_hosts=fresh)
    assert out.returncode == 0, out.stderr
    assert "recorded host key" in out.stderr
    assert _strict(out.stdout)["gpus"] == []


def test_stop_ends_a_process_that_cleared_its_environment_and_speaks_only_of_jobs_that_exist(world):
    """Review 2026-11-25: `env -i` dropped the PODKIT_JOB_ID tag, so stop left that process running while `jobs`
    said stopped; it is still in the job's session (setsid), which stop now also ends. And a stop of a job that
    does not exist said 'stopping job ...' before its one error line."""
    jid = f"envi-{uuid.uuid4().hex[:8]}"
    marker = f"{300 + int(jid[-4:], 16) % 500}.{uuid.uuid4().int % 1000}"  # this test's sleeps, and nobody else's
    started = cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "sh", "-c",
                  f"env -i sleep {marker} & sleep {marker}1")
    assert started.returncode == 0, started.stderr

    def sleeps() -> list[int]:
        out = subprocess.run(["pgrep", "-f", f"^sleep {marker}"], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    try:
        assert wait_for(lambda: len(sleeps()) == 2, 30), sleeps()
        untagged = [p for p in sleeps() if p not in with_env(f"PODKIT_JOB_ID={jid}")]
        assert len(untagged) == 1  # the env -i one: found by its session, not its environment
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert wait_for(lambda: not sleeps(), 10), f"still running on the pod: {sleeps()}"
    finally:
        for pid in sleeps():
            os.kill(pid, signal.SIGKILL)
    missing = cli(world, "stop", world.pod.spec, *args(world), "no-such-job")
    assert one_line_error(missing).startswith("error: no job 'no-such-job'"), missing.stderr


def test_attach_to_a_job_lost_without_an_exit_code_reports_none_and_exits_1(world):
    """Its wrapper killed with it (or the pod restarted): no code of its own, which `jobs` lists as null and
    attach used to make up as 4 (a code the job itself may use)."""
    lost, fours = f"lost-{uuid.uuid4().hex[:8]}", f"four-{uuid.uuid4().hex[:8]}"
    assert cli(world, "run", *args(world), "--id", lost, "-d", world.pod.spec, "--", "sleep", "600").returncode == 0
    assert cli(world, "run", *args(world), "--id", fours, "-d", world.pod.spec, "--", "sh", "-c", "exit 4"
               ).returncode == 0
    assert wait_for(lambda: len(with_env(f"PODKIT_JOB_ID={lost}")) >= 2, 30)
    for pid in with_env(f"PODKIT_JOB_ID={lost}"):  # as the OOM killer or a pod restart would: no trap runs
        os.kill(pid, signal.SIGKILL)
    attached = cli(world, "attach", world.pod.spec, *args(world), lost, "--json")
    assert attached.returncode == 1 and "ended without an exit code" in attached.stderr, attached.stderr
    assert _strict(attached.stdout)["exit_code"] is None
    own = cli(world, "attach", world.pod.spec, *args(world), fours, "--json")
    assert own.returncode == 4 and _strict(own.stdout)["exit_code"] == 4, own.stderr
    states = {j["id"]: (j["state"], j["exit_code"])
              for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]}
    assert states[lost] == ("lost", None) and states[fours] == ("exited", 4)


def test_attach_waits_for_a_job_whose_launcher_has_not_taken_its_tag_yet(world):
    """Full suite, 2026-11-25: `run` printed nothing for a job that printed and exited 0. Its attach came while
    the pid file named the launcher before its exec of the tagged environment, took the job for ended, printed
    the still-empty output.log and then picked up the exit code. Here the launcher's exec is held back 4 s
    (attach waits 5 s at most)."""
    job = f"late-{uuid.uuid4().hex[:8]}"
    d = Path(world.pod.remote_dir) / "logs" / "jobs" / job
    d.mkdir(parents=True)
    (d / "command").write_text("echo hello\n")
    (d / "started").write_text("2026-11-25T00:00:00.000000000Z\n")
    inner = f'sleep 0.5; echo hello; echo 0 > "{d}/exit_code.tmp" && mv "{d}/exit_code.tmp" "{d}/exit_code"'
    launcher = subprocess.Popen(["sh", "-c", f'sleep 4; exec env PODKIT_JOB_ID={job} sh -c \'{inner}\''],
                                stdout=open(d / "output.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    (d / "pid").write_text(f"{launcher.pid}\n")
    # reaped as soon as it ends, as a pod's init would: a zombie still answers kill -0, and tail --pid would wait on
    reaper = threading.Thread(target=launcher.wait, daemon=True)
    reaper.start()
    try:
        attached = cli(world, "attach", world.pod.spec, *args(world), job)
    finally:
        launcher.kill()
        reaper.join()
    assert attached.returncode == 0 and "hello" in attached.stdout, (attached.stdout, attached.stderr)


def test_a_stop_counts_no_zombie_of_the_session_as_left_running(tmp_path):
    """Review 2026-11-25: a stop reported 'left PID' for a worker that was already dead, its parent not yet
    having reaped it (state Z): no process to stop. Run here on this machine's /proc, as on a pod's."""
    from podkit.pods.remote_stop import stop_script

    # A session leader tagged as a job's wrapper, with one child that exits at once and is never reaped.
    leader = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0: os._exit(0)\ntime.sleep(60)"],
                              env={**os.environ, "PODKIT_JOB_ID": "zombie-test"}, start_new_session=True)
    try:
        assert wait_for(lambda: any(Path(f"/proc/{p}/stat").read_text().split(") ")[1][0] == "Z"
                                    for p in _children(leader.pid)), 10)
        session = stop_script("PODKIT_JOB_ID=zombie-test", 1, "wrapper").split("tagged()")[0]
        listed = subprocess.run(["bash", "-c", f"wrapper={leader.pid}\n{session}\nin_session"], capture_output=True,
                                text=True, timeout=30).stdout.split()
        assert listed == [str(leader.pid)], listed  # the leader, not its zombie
    finally:
        leader.kill()
        leader.wait()


def _children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{p}/stat").read_text().split(") ")[1].split()[1] == str(pid):
                out.append(int(p))
        except (OSError, IndexError):
            continue
    return out


def test_a_pid_file_naming_another_process_after_a_restart_is_a_lost_job_and_stop_spares_that_process(world, tmp_path):
    """Review 2026-11-25: a pod restart leaves logs/jobs/<id>/pid behind, and the pid it names may now be any other
    process (a later job's worker, the user's notebook). `kill -0` alone took it for the job: `jobs` said running,
    attach waited on it forever, stop SIGKILLed it, and the cost guard's idle-stop counted the pod busy for good."""
    import shutil

    from podkit.pods.guard import job_running

    jid = f"rebooted-{uuid.uuid4().hex[:8]}"
    other = subprocess.Popen(["sleep", "600"])  # not podkit's: no PODKIT_JOB_ID in its environment
    try:
        d = Path(world.pod.remote_dir) / "logs" / "jobs" / jid  # what the job left before the pod restarted
        d.mkdir(parents=True)
        (d / "pid").write_text(f"{other.pid}\n")
        (d / "command").write_text("python train.py\n")
        (d / "started").write_text("2026-11-24T00:00:00.000000000Z\n")
        (d / "output.log").write_text("step 1\n")
        states = {j["id"]: (j["state"], j["exit_code"])
                  for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]}
        assert states[jid] == ("lost", None), states[jid]
        attached = cli(world, "attach", world.pod.spec, *args(world), jid, timeout=60)
        said = attached.stdout + attached.stderr
        assert attached.returncode == 1 and "ended without an exit code" in said and "step 1" in said, said
        guarded = tmp_path / "project"  # the guard's view of a project holding only that job (others share world)
        shutil.copytree(d, guarded / "logs" / "jobs" / jid)
        assert not job_running(str(guarded))
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "1")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert other.poll() is None, "bin/pod stop killed a process that was not the job's"
    finally:
        other.kill()
        other.wait()


def test_stop_ends_what_an_exited_job_left_running_and_jobs_shows_it(world):
    """Review 2026-11-25: a job whose command exited (its code recorded) while something it started kept running (a
    server started with `&`, workers of a launcher the OOM killer took) was listed `exited 0`, and `bin/pod stop`
    answered 'already exited 0' and left those processes running: nothing podkit offered could see or stop them."""
    jid = f"leftover-{uuid.uuid4().hex[:8]}"
    ran = cli(world, "run", *args(world), "--id", jid, world.pod.spec, "--", "sh", "-c", "sleep 600 & exit 0")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    try:
        assert wait_for(lambda: len(with_env(f"PODKIT_JOB_ID={jid}")) == 1, 10), with_env(f"PODKIT_JOB_ID={jid}")
        listed = cli(world, "jobs", world.pod.spec, *args(world), "--json")
        job = next(j for j in _strict(listed.stdout)["jobs"] if j["id"] == jid)
        assert (job["state"], job["exit_code"], job["left_running"]) == ("exited", 0, 1), job
        assert re.search(rf"│ {jid}\s+│ exited 0, 1 process left running\s+│",
                         cli(world, "jobs", world.pod.spec, *args(world)).stdout)
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2", "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert _strict(stopped.stdout)["result"] == "already exited 0; of what it left running: stopped 1"
        assert wait_for(lambda: not with_env(f"PODKIT_JOB_ID={jid}"), 10), "still running on the pod"
        job = next(j for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]
                   if j["id"] == jid)
        assert (job["state"], job["exit_code"], job["left_running"]) == ("exited", 0, 0), job  # how it ended stays
        again = cli(world, "stop", world.pod.spec, *args(world), jid, "--json")
        assert _strict(again.stdout)["result"] == "already exited 0"
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}"):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """`pid` is a process, not gone nor a zombie (its parent yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _tree(roots: list[int]) -> set[int]:
    """`roots` and every process under them, by parent pid."""
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += _children(pid)
    return found


def _escaping(marker: str) -> str:
    """A command that leaves the job's environment and session both (as sudo under `Defaults use_pty` does) and
    ignores SIGTERM, `sleep MARKER` in the end."""
    return "setsid env -i bash -c " + shlex.quote(f'trap "" TERM; sleep {marker}')


def test_stop_ends_what_left_the_jobs_session_with_a_cleared_environment_and_nothing_beside_it(world):
    """Review 2026-11-25: a process that both cleared its environment and left the job's session (sudo with
    use_pty, `setsid env -i`) carried neither the tag nor the session stop looks for: stop killed its parent and it
    ran on under PID 1, seen by nobody. Stop now takes what the job's processes started too, before any signal. An
    unrelated process beside it under PID 1 (the same parent, once the job's is killed) is not touched."""
    jid, marker, other = f"escape-{uuid.uuid4().hex[:8]}", _marker(), _marker()
    started = cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "sh", "-c",
                  f"{_escaping(marker)} & wait")
    assert started.returncode == 0, started.stderr
    subprocess.run(["sh", "-c", f"sleep {other} </dev/null >/dev/null 2>&1 &"], check=True)  # left to PID 1
    try:
        assert wait_for(lambda: _sleeps(marker) and _sleeps(other), 30), (_sleeps(marker), _sleeps(other))
        [escaped] = _sleeps(marker)
        assert escaped not in with_env(f"PODKIT_JOB_ID={jid}")  # neither the tag nor the session: its parent's
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2", "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert _strict(stopped.stdout)["result"].startswith("killed "), stopped.stdout  # SIGTERM was ignored
        assert wait_for(lambda: not _alive(escaped), 10), f"still running on the pod: {escaped}"
        assert _sleeps(other), "stop killed a process that was not the job's"
    finally:
        for pid in {*with_env(f"PODKIT_JOB_ID={jid}"), *_sleeps(marker), *_sleeps(other)}:
            os.kill(pid, signal.SIGKILL)


def test_an_exited_job_lists_and_stop_ends_what_it_left_with_a_cleared_environment(world):
    """Review 2026-11-25: a job that exited leaving a tagged process whose child cleared its environment and left
    the session: `jobs` counted the tagged one alone, and stop killed it and left the child running unseen."""
    jid, marker = f"leftesc-{uuid.uuid4().hex[:8]}", _marker()
    keeper = "sh -c " + shlex.quote(f"{_escaping(marker)} & wait")
    ran = cli(world, "run", *args(world), "--id", jid, world.pod.spec, "--", "sh", "-c", f"{keeper} & exit 0")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    try:
        assert wait_for(lambda: _sleeps(marker), 10), "the escaping process did not start"
        [escaped] = _sleeps(marker)
        left = _tree(with_env(f"PODKIT_JOB_ID={jid}"))
        assert escaped in left and escaped not in with_env(f"PODKIT_JOB_ID={jid}"), left
        job = next(j for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]
                   if j["id"] == jid)
        assert (job["state"], job["left_running"]) == ("exited", len(left)), (job, left)
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2", "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert _strict(stopped.stdout)["result"] == f"already exited 0; of what it left running: killed {len(left)}"
        assert wait_for(lambda: not _alive(escaped), 10), f"still running on the pod: {escaped}"
        job = next(j for j in _strict(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]
                   if j["id"] == jid)
        assert job["left_running"] == 0, job
    finally:
        for pid in {*with_env(f"PODKIT_JOB_ID={jid}"), *_sleeps(marker)}:
            os.kill(pid, signal.SIGKILL)


def test_a_stop_keeps_a_pid_only_while_it_is_the_same_process_and_never_takes_another_tags(tmp_path):
    """The stop's look at the pod (its `tagged`, run here on this machine's /proc, as on a pod's): a pid found by an
    earlier look (its parent SIGKILLed since) is still the tag's while its start time is the one recorded, never
    once the pid is another process's. What a tagged process started is the tag's when it cleared its environment,
    not when it carries a tag of its own (a detached job, the cost guard, started from an invocation's shell)."""
    from podkit.pods.remote_stop import stop_script

    mark, other, handoff = _marker(), _marker(), _marker()
    lone = subprocess.Popen(["sleep", other])  # no tag, no tagged parent: only an earlier look could name it
    tree = subprocess.Popen(["bash", "-c", f"env -i sleep {mark} & env -u PODKIT_SESSION PODKIT_JOB_ID=handoff "
                             f"sh -c 'env -i sleep {handoff} & wait' & wait"],
                            env={**os.environ, "PODKIT_SESSION": "reuse-test"})
    started = set()
    try:
        assert wait_for(lambda: _sleeps(mark) and _sleeps(handoff), 10)
        started = _tree([tree.pid])  # all of it, for the cleanup: a stop would leave the sleeps to PID 1
        start = Path(f"/proc/{lone.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]  # field 22

        def tagged(kept: str) -> set[int]:
            look = stop_script("PODKIT_SESSION=reuse-test", 1).split("\npids()")[0]
            out = subprocess.run(["bash", "-c", f"{look}\nkept={shlex.quote(kept)}\ntagged"], capture_output=True,
                                 text=True, timeout=30).stdout
            return {int(w) for line in out.splitlines() for w in line.split()[:1] if w.isdigit()}

        ours = {tree.pid, *_sleeps(mark)}
        assert tagged("") == ours
        assert tagged(f"{lone.pid} {start}") == ours | {lone.pid}
        assert tagged(f"{lone.pid} {int(start) - 1}") == ours  # that pid's process started later: a reused pid
    finally:
        for pid in _tree([tree.pid]) | started | {lone.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        tree.wait()
        lone.wait()


def test_stop_and_jobs_see_a_tagged_process_whose_name_or_environment_is_not_utf8(tmp_path):
    """Review 2026-11-26: under a UTF-8 locale (LANG=C.UTF-8, as on most pods and in their Docker images), GNU grep
    takes a file holding a byte sequence that is no UTF-8 for binary and prints "binary file matches" instead of its
    lines (grep 3.8). The stop's look reads every /proc/PID/stat and environ by grep's lines (remote_stop._DEFS): a
    command whose name the kernel truncated inside a UTF-8 character (comm is 15 bytes: a script named in Chinese),
    or whose environment holds a Latin-1 value, was no process to it, and `stop` said "stopped 0" and left it
    running; the grep -l of the look before it found them."""
    from podkit.pods.remote_stop import owners_script, stop_script

    tag = f"utf8-{uuid.uuid4().hex[:8]}"
    named = tmp_path / "a训练脚本训练"  # 16 bytes: the comm keeps 15, cut inside the last character
    named.write_bytes(Path("/bin/sleep").read_bytes())
    named.chmod(0o755)
    env = {**os.environ, "PODKIT_SESSION": tag}
    procs = [subprocess.Popen([str(named), "600"], env=env),
             subprocess.Popen(["sleep", "600"], env={**env, "PODKIT_REVIEW_LATIN1": "caf\udce9"})]
    utf8 = {**os.environ, "LC_ALL": "C.UTF-8"}
    try:
        assert wait_for(lambda: all(f"PODKIT_SESSION={tag}".encode() in Path(f"/proc/{p.pid}/environ").read_bytes()
                                    for p in procs), 10)
        assert Path(f"/proc/{procs[0].pid}/comm").read_bytes() == "a训练脚本训练".encode()[:15] + b"\n"
        listed = subprocess.run(["bash", "-c", owners_script()], capture_output=True, env=utf8, timeout=30).stdout
        assert listed.split().count(f"PODKIT_SESSION={tag}".encode()) == 2, listed
        stopped = subprocess.run(["bash", "-c", stop_script(f"PODKIT_SESSION={tag}", 1)], capture_output=True,
                                 text=True, env=utf8, timeout=30)
        assert stopped.stdout.strip() == "stopped 2", stopped.stdout + stopped.stderr
        for p in procs:
            assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_stop_without_an_id_stops_the_running_job_not_a_later_one_that_exited(world):
    """Review 2026-11-25: `bin/pod run -d HOST -- train`, then a quick `bin/pod run HOST -- nvidia-smi` beside it, then
    `bin/pod stop HOST`: the default was the newest job, the finished check ('already exited 0', exit 0), and the
    training ran on, billing, while the user took it for stopped."""
    train, check = f"train-{uuid.uuid4().hex[:8]}", f"check-{uuid.uuid4().hex[:8]}"
    assert cli(world, "run", *args(world), "--id", train, "-d", world.pod.spec, "--", "sleep", "600").returncode == 0
    try:
        assert cli(world, "run", *args(world), "--id", check, world.pod.spec, "--", "true").returncode == 0
        stopped = cli(world, "stop", world.pod.spec, *args(world), "--grace", "2", "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert _strict(stopped.stdout)["job"] == train, stopped.stdout
        assert wait_for(lambda: not with_env(f"PODKIT_JOB_ID={train}"), 10), "the training runs on"
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={train}"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("command", ["run", "attach"])
def test_a_dropped_link_while_following_under_json_names_the_job_that_runs_on(world, command):
    """Review 2026-11-25: `bin/pod run --json` (or attach --json) whose link dropped mid-run printed the bad-input
    object, which named the job only in the prose of its message: a script had no id to re-attach to."""
    jid = f"drop-{command}-{uuid.uuid4().hex[:6]}"
    ticking = ["bash", "-c", "for i in $(seq 1 600); do echo tick $i; sleep 0.1; done"]
    if command == "attach":
        assert cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", *ticking).returncode == 0
        follow = ["attach", "--known-hosts", str(world.known_hosts), world.pod.spec, *args(world), jid, "--json"]
    else:
        follow = ["run", "--known-hosts", str(world.known_hosts), *args(world), "--id", jid, "--json", world.pod.spec,
                  "--", *ticking]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(world.project / "bin" / "pod"), *follow], cwd=world.project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The job's output streams to stderr under --json: the link is dropped once this follower shows a tick, not after
    # a fixed wait (a loaded machine was still connecting attach then, and the drop was a failed login).
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stderr], daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: any(line.startswith("tick ") for line in lines), timeout=60), lines
        world.pod.drop_connections()
        proc.wait(timeout=60)
        reader.join(timeout=10)
        out, err = proc.stdout.read(), "".join(lines)
        assert proc.returncode == 2 and "Traceback" not in err, err
        data = _strict(out)
        assert (data["ok"], data["job"], data["exit_code"]) == (False, jid, None), data
        assert "dropped" in data["error"]["problem"] and f"keeps running" in data["error"]["problem"], data
        assert with_env(f"PODKIT_JOB_ID={jid}"), "the job was stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
        cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "1")


@contextmanager
def launcher_trap(world, action: str):
    """Run `action` (shell) before each command of the launcher that starts a job on the pod. The pod's BASH_ENV
    (world's bashrc, read by every bash started there but the job's wrapper, which carries PODKIT_JOB_ID) sets it as
    a DEBUG trap, which `set -T` hands on to subshells: it reaches the launcher whether that runs in the shared
    shell's subshell or as a bash of its own. `$__b` is `$!` before any, so `[ "$!" != "$__b" ]` holds once the
    launcher has started the wrapper in the background; `$BASH_COMMAND` is the command about to run. The launcher
    carries the job's tag too, but also the session's, which the wrapper drops."""
    rc = world.base / "bashrc"
    before = rc.read_text()
    rc.write_text(before + f"if [ -z \"${{PODKIT_JOB_ID:-}}\" ] || [ -n \"${{PODKIT_SESSION:-}}\" ]; then __b=$!; set -T; "
                  f"trap {shlex.quote(action)} DEBUG; fi\n")
    try:
        yield
    finally:
        rc.write_text(before)


def _sleeps(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"^sleep {re.escape(marker)}$"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _marker() -> str:
    """A sleep's argument that names this test's processes, and nobody else's."""
    return f"{600 + uuid.uuid4().int % 300}.{uuid.uuid4().int % 10**6:06d}"


def test_a_job_whose_launcher_dies_right_after_starting_it_is_found_and_stopped(world):
    """Review 2026-11-26: the pid file was written by the launcher after the start; killed in between (a Ctrl-C,
    a dropped link, the OOM killer), it left a job running that `stop` could not find. The wrapper now records its
    own pid first."""
    jid, marker = f"orphan-{uuid.uuid4().hex[:8]}", _marker()
    try:
        with launcher_trap(world, '[ "$!" != "$__b" ] && kill -KILL $BASHPID'):  # killed the moment it started it
            started = cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "sleep", marker)
        assert started.returncode == 2 and "Traceback" not in started.stderr, started.stderr
        assert _sleeps(marker), "the job did not start"
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert wait_for(lambda: not _sleeps(marker), 10), "the job runs on"
        # and the failed start said so, rather than that the job could not start
        assert f"could not start job {jid} (its launcher was killed by signal 9); it started and runs" in started.stderr
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}") + _sleeps(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("after", ["asked", "stopped-before-its-pid", "unrecordable"])
def test_a_launcher_killed_before_its_fork_runs_the_wrapper_leaves_no_job_that_stop_cannot_find(world, after):
    """Review 2026-11-25: killed between forking the wrapper and that fork's exec of `env` (the OOM killer, a busy
    pod), the launcher left a process without the job's tag: start_state found nothing, said the job had not started
    and removed its directory from under the fork (which then ran an empty command): whether a start cut short ran
    was up to the scheduler (test_a_job_whose_launcher_dies_right_after_starting_it... failed so on a loaded machine).
    The launcher is exec'd with the tag now, which the fork inherits ("asked": the start says it runs, and stop
    stops it). And a wrapper that cannot record its pid (a full disk; here a directory in the way: "unrecordable")
    does not run the command, which no `stop` could find.
    The fork is held before its exec by an `env` function (a builtin read on a FIFO: no process of its own, so only
    the fork's own environ can carry the tag), defined in the pod's BASH_ENV for this start's launcher alone."""
    jid, marker = f"fork-{uuid.uuid4().hex[:8]}", _marker()
    fifo, go = world.base / f"hold-{jid}", world.base / f"go-{jid}"
    os.mkfifo(fifo)
    hold = (f'case $BASH_EXECUTION_STRING in *"PODKIT_JOB_ID={jid} env"*) '
            f'env() {{ if [ "$1" = -u ]; then while [ ! -e {go} ]; do read -t 0.1 <> {fifo}; done; fi; command env "$@"; }};; esac\n')
    rc = world.base / "bashrc"
    before = rc.read_text()
    rc.write_text(before + hold)
    try:
        with launcher_trap(world, '[ "$!" != "$__b" ] && kill -KILL $BASHPID'):  # killed the moment it forked
            started = cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "sleep", marker)
        rc.write_text(before)
        assert started.returncode == 2 and "Traceback" not in started.stderr, started.stderr
        assert f"could not start job {jid} (its launcher was killed by signal 9); it started and runs" in started.stderr
        jobdir = Path(world.pod.remote_dir) / "logs" / "jobs" / jid
        if after == "unrecordable":
            (jobdir / "pid.wrapper").mkdir()
        if after == "stopped-before-its-pid":  # the start's hint, taken at once: stop finds the job by its tag
            early = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2")
            assert early.returncode == 0 and "Traceback" not in early.stderr, early.stdout + early.stderr
            assert not with_env(f"PODKIT_JOB_ID={jid}"), "a process of the job outlived its stop"
        go.touch()  # the fork goes on: env, setsid, the wrapper
        if after == "unrecordable":
            assert wait_for(lambda: "not starting it" in (jobdir / "output.log").read_text(), 10)
            assert not _sleeps(marker), "a job started that no pid file names"
            return
        if after == "stopped-before-its-pid":
            time.sleep(2)
            assert not _sleeps(marker), "the job started after its stop"
            return
        assert wait_for(lambda: _sleeps(marker), 10), "the job did not start"
        stopped = cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert wait_for(lambda: not _sleeps(marker), 10), "the job runs on"
    finally:
        rc.write_text(before)
        go.touch()
        for pid in with_env(f"PODKIT_JOB_ID={jid}") + _sleeps(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_start_refused_for_a_taken_id_never_passes_for_that_job(world):
    """Review 2026-11-25: the launcher took the job's tag before it claimed the id, so a `run --id X` refused because
    X exists ran for a moment as a process of X: `jobs` counted it as left running by X, and a `stop X` then
    stopped it and said so. The claim comes first now. The refused launcher is held at its claim while asked."""
    jid, held = f"taken-{uuid.uuid4().hex[:8]}", world.base / f"held-{uuid.uuid4().hex[:8]}"
    assert cli(world, "run", *args(world), "--id", jid, world.pod.spec, "--", "true").returncode == 0  # exited 0
    hold = (f'case $BASH_EXECUTION_STRING in *"mkdir logs/jobs/{jid} "*) '
            f'case $BASH_COMMAND in "[ -e "*) touch {held}; sleep 3;; esac;; esac')  # that launcher alone
    with launcher_trap(world, hold):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        again = subprocess.Popen([str(world.project / "bin" / "pod"), "run", "--known-hosts", str(world.known_hosts),
                                  *args(world), "--id", jid, world.pod.spec, "--", "true"], cwd=world.project, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_for(held.exists, 30), "the refused launcher never reached its claim"
            listed = {j["id"]: j for j in json.loads(cli(world, "jobs", world.pod.spec, *args(world), "--json").stdout)["jobs"]}
            out, err = again.communicate(timeout=60)
        finally:
            if again.poll() is None:
                again.kill()
    assert (listed[jid]["state"], listed[jid]["left_running"]) == ("exited", 0), listed[jid]
    assert again.returncode == 2 and f"job {jid} exists" in err, err


def test_two_runs_of_one_id_at_once_start_it_once(world):
    """Review 2026-11-26: `mkdir -p`, then a test for the pid file: two `bin/pod run --id X` at once both passed it
    (here held together after it, at the start's `date`), and both started. A plain mkdir claims the id."""
    jid, marker = f"twice-{uuid.uuid4().hex[:8]}", _marker()
    barrier = world.base / f"barrier-{jid}"
    barrier.mkdir()
    wait = (f'case $BASH_COMMAND in "date -u"*) touch {barrier}/$BASHPID; i=0; '
            f'while [ "$(ls {barrier} | wc -l)" -lt 2 ] && [ $i -lt 60 ]; do sleep 0.05; i=$((i+1)); done;; esac')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [str(world.project / "bin" / "pod"), "run", "--known-hosts", str(world.known_hosts), *args(world), "--id", jid,
            "-d", world.pod.spec, "--", "sleep", marker]
    try:
        with launcher_trap(world, wait):
            procs = [subprocess.Popen(argv, cwd=world.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2)]
            outs = [p.communicate(timeout=120) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 2], outs
        refused = outs[[p.returncode for p in procs].index(2)][1]
        assert f"job {jid} exists (give another --id" in refused, refused
        assert wait_for(lambda: len(_sleeps(marker)) == 1, 10) and len(_sleeps(marker)) == 1, _sleeps(marker)
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}") + _sleeps(marker):
            os.kill(pid, signal.SIGKILL)


def _again(world) -> str:
    """The pod as a hint's next command must name it: HOST and the reach options these tests give (the CLI's
    PodArgs.again), without which that command would look in another directory, or not log in."""
    return shlex.join([world.pod.spec, "--key", str(world.pod.client_key), "--remote-dir", world.pod.remote_dir,
                       "--python", sys.executable, "--known-hosts", str(world.known_hosts)])


@pytest.mark.parametrize("how", ["launcher-killed", "id-taken"])
def test_a_failed_start_names_the_pod_as_reached_and_json_says_whether_it_started(world, how):
    """Review 2026-11-27: a failed start's hints read `bin/pod stop HOST <id>`, the word HOST, not the pod with the
    --remote-dir (or --key) without which that stop looks for the job elsewhere; and `run --json` printed the
    bad-input object, with neither the job's id nor whether it runs although its launcher failed."""
    jid, marker = f"failed-{how}-{uuid.uuid4().hex[:6]}", _marker()
    again = _again(world)
    run = ["run", *args(world), "--id", jid, "--json", world.pod.spec, "--", "sleep", marker]
    try:
        if how == "id-taken":
            assert cli(world, *run[:3], "-d", *run[3:]).returncode == 0
            failed = cli(world, *run)
        else:
            started = f"i=0; while [ ! -s logs/jobs/{jid}/pid ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"
            with launcher_trap(world, f'[ "$!" != "$__b" ] && {{ {started}; kill -KILL $BASHPID; }}'):  # once it runs
                failed = cli(world, *run)
        line = one_line_error(failed, notes_before=True)  # exit 2, as before: the object comes with the one line
        data = _strict(failed.stdout)
        assert "HOST" not in line and "HOST" not in data["error"]["fix"], line
        assert data["error"]["fix"] in line and data["error"]["problem"] in line
        assert {k: data[k] for k in ("ok", "job", "pod", "remote_dir", "log", "detached")} == {
            "ok": False, "job": jid, "pod": f"127.0.0.1-{world.pod.port}", "remote_dir": world.pod.remote_dir,
            "log": f"{world.pod.remote_dir}/logs/jobs/{jid}/output.log", "detached": True}, data
        if how == "id-taken":
            assert line.endswith(f"job {jid} exists (give another --id, or follow it: bin/pod attach {again} {jid})")
            assert (data["started"], data["start_state"], data["exit_code"]) == (False, "absent", None), data
        else:
            assert f"(its launcher was killed by signal 9); it started and runs" in line, line
            assert line.endswith(f"(check with: bin/pod jobs {again}; stop it with: bin/pod stop {again} {jid})"), line
            assert (data["started"], data["start_state"], data["exit_code"]) == (True, "running", None), data
        assert len(_sleeps(marker)) == 1, "the job that runs is the one the hint names"
        told = shlex.split(line.rsplit("bin/pod ", 1)[1].rstrip(")"))  # the hint's command reaches the job
        stopped = cli(world, "stop", *told[1:], "--grace", "2")
        assert stopped.returncode == 0 and wait_for(lambda: not _sleeps(marker), 10), stopped.stdout + stopped.stderr
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}") + _sleeps(marker):
            os.kill(pid, signal.SIGKILL)


def test_attach_and_stop_hints_name_the_pod_as_reached(world):
    """Review 2026-11-27: a job id that does not exist, or is no id, was answered with `bin/pod jobs HOST`."""
    again = _again(world)
    for command, said in ((["stop", world.pod.spec, *args(world), "no-such-job"], "no job 'no-such-job' on this pod"),
                          (["attach", world.pod.spec, *args(world), "no-such-job"], "no job 'no-such-job' on this pod"),
                          (["attach", world.pod.spec, *args(world), ".."], "job id '..' names a directory, not a job")):
        line = one_line_error(cli(world, *command))
        assert line == f"error: {said} (list {'the jobs' if '..' in command else 'them'} with: bin/pod jobs {again})"


@pytest.mark.parametrize("when", ["after-start", "before-start", "link-dropped"])
def test_a_start_cut_short_says_whether_the_job_started(world, when):
    """Review 2026-11-26: Ctrl-C while a job was starting said 're-run to continue', but the job had probably started,
    and a re-run started it a second time. Now the pod is asked: started and running (how to follow or stop it), or
    not started (its id free again); a dropped link says it may have started, and how to check."""
    jid, marker, hold = f"cut-{when}-{uuid.uuid4().hex[:6]}", _marker(), _marker()
    action = (f'case $BASH_COMMAND in "PODKIT_JOB_ID="*" env -u PODKIT_SESSION"*) sleep {hold};; esac' if when == "before-start" else
              f'[ "$!" != "$__b" ] && {{ __b=$!; sleep {hold}; }}')  # the launcher held just before / after the start
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [str(world.project / "bin" / "pod"), "run", "--known-hosts", str(world.known_hosts), *args(world), "--id", jid,
            "--json", world.pod.spec, "--", "sleep", marker]
    try:
        with launcher_trap(world, action):
            proc = subprocess.Popen(argv, cwd=world.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            try:
                assert wait_for(lambda: _sleeps(hold), 60), "the start never got there"
                if when == "link-dropped":
                    world.pod.drop_connections()
                else:
                    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
                out, err = proc.communicate(timeout=90)
            finally:
                if proc.poll() is None:
                    proc.kill()
        assert "re-run to continue" not in err and "Traceback" not in err, err
        d = Path(world.pod.remote_dir) / "logs" / "jobs" / jid
        again = f"--remote-dir {world.pod.remote_dir}"
        if when == "link-dropped":
            line = one_line_error(subprocess.CompletedProcess(argv, proc.returncode, out, err), notes_before=True)
            assert f"job {jid} may have started" in line and f"bin/pod jobs {world.pod.spec}" in line, line
            assert f"bin/pod stop {world.pod.spec}" in line and again in line and line.endswith(f"{jid})"), line
        elif when == "after-start":
            assert proc.returncode == 130, err
            assert f"job {jid} started on 127.0.0.1-{world.pod.port} and runs" in err, err
            assert f"bin/pod attach {world.pod.spec}" in err and f"bin/pod stop {world.pod.spec}" in err and again in err
            data = _strict(out)
            assert (data["job"], data["interrupted"], data["started"], data["exit_code"]) == (jid, True, True, None)
            assert _sleeps(marker), "the job was stopped"
        else:
            assert proc.returncode == 130, err
            assert f"job {jid} did not start" in err and "re-run to start it" in err, err
            assert _strict(out)["started"] is False and not _sleeps(marker)
            assert not d.exists(), "the id stays taken by what the start left"
            rerun = cli(world, "run", *args(world), "--id", jid, world.pod.spec, "--", "true")
            assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}") + _sleeps(marker) + _sleeps(hold):
            os.kill(pid, signal.SIGKILL)


def test_run_names_the_jobs_already_running_on_the_pod(world):
    """Review 2026-11-26: a second job started beside a running one without a word (they share the GPUs)."""
    jid, marker = f"busy-{uuid.uuid4().hex[:8]}", _marker()
    assert cli(world, "run", *args(world), "--id", jid, "-d", world.pod.spec, "--", "sleep", marker).returncode == 0
    try:
        beside = cli(world, "run", *args(world), world.pod.spec, "--", "true")
        assert beside.returncode == 0, beside.stdout + beside.stderr
        notes = [line for line in beside.stderr.splitlines() if "already runs" in line]
        assert len(notes) == 1 and f"{jid} (sleep {marker})" in notes[0], beside.stderr
        assert cli(world, "stop", world.pod.spec, *args(world), jid, "--grace", "2").returncode == 0
        after = cli(world, "run", *args(world), world.pod.spec, "--", "true")
        assert after.returncode == 0 and jid not in after.stderr, after.stderr
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}"):
            os.kill(pid, signal.SIGKILL)


def test_a_later_command_past_its_timeout_leaves_the_job_its_shell_started_running(world):
    """A command past its timeout is stopped on the pod by the tag of the shell that ran it (pods/connection.py);
    a job that same shell started before is detached, and that stop must not reach it."""
    from podkit.pods import jobs
    from podkit.pods.connection import PodConnection
    from podkit.pods.errors import PodError
    from podkit.pods.hosts import parse_host, resolve

    jid = f"outlive-{uuid.uuid4().hex[:8]}"
    endpoint = resolve(parse_host(world.pod.spec, key=str(world.pod.client_key)))
    try:
        with PodConnection(endpoint, known_hosts=world.known_hosts) as conn:
            conn.prelude = f"cd {shlex.quote(world.pod.remote_dir)}"
            jobs.start(conn, "sleep 600", jid, again=world.pod.spec)
            assert wait_for(lambda: len(with_env(f"PODKIT_JOB_ID={jid}")) >= 2, 10), "the job runs"
            running = set(with_env(f"PODKIT_JOB_ID={jid}"))
            with pytest.raises(PodError, match="ran past 1 s and was stopped"):
                conn.run("sleep 30", timeout=1)
            # alive, not still tagged: the output filter drops the tag when it execs python (jobs._REDACT), which
            # may come after `running` was read
            assert all(os.path.exists(f"/proc/{pid}") for pid in running), "the timed-out command's stop ended the job"
            assert jobs.start_state(conn, jid) == "running"
    finally:
        for pid in with_env(f"PODKIT_JOB_ID={jid}"):
            os.kill(pid, signal.SIGKILL)
