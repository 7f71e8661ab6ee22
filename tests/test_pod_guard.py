"""The cost guard (issue 15 item 2), for real: `bin/pod up` on tests/runpod_fake.py, a loopback sshd
as the pod, the watchdog (pods/guard.py) running on it detached, and the stop arriving at the fake
as RunPod's podStop for that pod id. The pod's environment is RunPod's (RUNPOD_POD_ID and a pod
key, here set by sshd's SetEnv) with RUNPOD_API_BASE_URL pointing at the fake. Timings are seconds."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podkit.pods.hosts import load_inventory
from runpod_fake import FakeRunPod
from sshd_harness import LoopbackPod, one_line_error, sshd_available, wait_for

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))

ROOT = Path(__file__).resolve().parents[1]
KEY = "rp_test_key_guard_7d1e"
POD_ID = "fake0001xyz"  # the id tests/runpod_fake.py gives the first pod it creates
FAST = ("--poll", "0.05")


class World:
    def __init__(self, base: Path, pod_id_on_pod: str = POD_ID, pod_key: str = KEY):
        self.fake = FakeRunPod(key=KEY).start()
        self.sshd = LoopbackPod(base, "rp", extra_config=(
            f"SetEnv RUNPOD_POD_ID={pod_id_on_pod} RUNPOD_API_KEY={pod_key} RUNPOD_API_BASE_URL={self.fake.url}\n")).start()
        self.fake.ssh_port = self.sshd.port
        self.laptop = base / "laptop"
        self.laptop.mkdir()
        self.known_hosts = base / "known_hosts"
        self.remote_dir = self.sshd.remote_dir

    def pod(self, *args: str, key: str | None = KEY, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("RUNPOD_API_KEY", "PYTHONPATH")}
        env["RUNPOD_API_BASE_URL"] = self.fake.url
        if key:
            env["RUNPOD_API_KEY"] = key
        extra = ["--known-hosts", str(self.known_hosts)] if args[0] in ("up", "ls", "guard", "run", "probe") else []
        out = subprocess.run([str(ROOT / "bin" / "pod"), args[0], *extra, *args[1:]], cwd=self.laptop, env=env,
                             capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert KEY not in out.stdout + out.stderr, "the API key was printed"
        return out

    def up(self, *args: str) -> subprocess.CompletedProcess:
        return self.pod("up", "--gpu", "RTX 4090", "--name", "g", "--key", str(self.sshd.client_key),
                        "--remote-dir", self.remote_dir, *FAST, *args)

    @property
    def guard_dir(self) -> Path:
        return Path(self.remote_dir) / ".podkit" / "guard"

    def guard_pid(self) -> int:
        return int((self.guard_dir / "pid").read_text())

    def state(self) -> dict:
        return json.loads((self.guard_dir / "state.json").read_text())

    def fired_state(self) -> dict:
        """The guard's state once it has recorded its stop: it calls podStop first and writes "fired" after, so
        a loaded machine can show the stop at the fake API before the state says so."""
        assert wait_for(lambda: self.state().get("status") == "fired", 10), self.state()
        return self.state()

    def ls_row(self) -> dict:
        out = self.pod("ls", "--json")
        assert out.returncode == 0, out.stderr
        return next(r for r in json.loads(out.stdout) if r["inventory_name"] == "g")

    def stop(self):
        try:  # never leave a watchdog behind a failed test
            pid = self.guard_pid()
            if b"guard.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        except (OSError, ValueError):
            pass
        self.sshd.stop()
        self.fake.stop()


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path)
    yield w
    w.stop()


def alive(pid: int) -> bool:
    try:
        return b"guard.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.slow
def test_idle_stop_waits_for_the_job_then_stops_the_pod_through_runpod(world):
    # Armed by `up` with an idle time no test machine can reach, so the job below is running before the
    # short guard exists: a loaded machine that takes seconds to start `pod run` cannot make it fire early.
    up = world.up("--idle-stop", "30", "--accept-new", "--json")
    assert up.returncode == 0, up.stderr
    guard = json.loads(up.stdout)["guard"]
    assert guard["alive"] and guard["status"] == "watching" and guard["conditions"] == "idle-stop 30 min"
    first = world.guard_pid()
    run = world.pod("run", "g", "--detach", "--id", "busy", "--", "sleep", "12")
    assert run.returncode == 0, run.stderr
    rearm = world.pod("guard", "g", "--idle-stop", "0.2", "--json")  # 12 s without a podkit job; replaces the first
    assert rearm.returncode == 0, rearm.stderr
    assert json.loads(rearm.stdout)["guard"]["conditions"] == "idle-stop 0.2 min"
    assert wait_for(lambda: not alive(first), 10), "the replaced watchdog kept running"
    pid = world.guard_pid()
    assert pid != first
    # a listed, stoppable process with the key in its environment, never in its argv
    assert KEY not in Path(f"/proc/{pid}/cmdline").read_text()
    assert f"PODKIT_GUARD={POD_ID}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    row = world.ls_row()
    assert row["guard"]["alive"] and row["guard"]["idle_minutes"] == pytest.approx(0.2) and row["guard"]["kinds"] == ["idle-stop"]
    assert "idle-stop 0.2 min (alive)" in world.pod("ls").stdout  # the table's guard column

    exit_code = Path(world.remote_dir) / "logs" / "jobs" / "busy" / "exit_code"
    assert wait_for(exit_code.exists, 60), "the job never ended"
    assert world.fake.ops("podStop") == [], "stopped while a podkit job was running"
    job_end = exit_code.stat().st_mtime
    assert wait_for(lambda: world.fake.ops("podStop"), 60), (world.guard_dir / "guard.log").read_text()
    assert world.fake.ops("podStop") == [{"input": {"podId": POD_ID}}]
    state = world.fired_state()
    # idle counted from the job's end (seen within one 1.2 s tick), and not long after 12 s either
    assert 12 - 1.5 <= state["fired"] - job_end <= 12 + 10, state
    assert state["status"] == "fired" and state["reason"].startswith("idle-stop") and state["how"].startswith("podStop")
    assert wait_for(lambda: not alive(pid), 10), "the watchdog outlived its job"
    for f in world.guard_dir.iterdir():
        assert KEY not in f.read_text(), f"the key was written to {f.name}"
    row = world.ls_row()
    assert row["status"] == "EXITED" and row["guard"] == {"unknown": "pod is EXITED"}


def test_ls_shows_the_guard_off_cancels_it_and_a_new_deadline_fires(world):
    up = world.up("--stop-after", "1", "--accept-new")
    assert up.returncode == 0, up.stderr
    assert "guard: stop-after 1 h (by " in up.stdout and "Z) (alive)" in up.stdout
    pid = world.guard_pid()
    row = world.ls_row()["guard"]
    deadline = time.mktime(time.strptime(row["deadline"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert abs(deadline - (time.time() + 3600)) < 60 and row["alive"] and row["status"] == "watching"

    off = world.pod("guard", "g", "--off")
    assert off.returncode == 0, off.stderr
    assert "guard on g: cancelled" in off.stderr and "g: guard: off (was stop-after 1 h)" in off.stdout
    assert wait_for(lambda: not alive(pid), 10) and not (world.guard_dir / "pid").exists()
    assert world.ls_row()["guard"]["status"] == "off"
    assert "off (was stop-after 1 h)" in world.pod("ls").stdout

    armed = world.pod("guard", "g", "--stop-after", "0.001", "--json")  # 3.6 s from now
    assert armed.returncode == 0, armed.stderr
    view = json.loads(armed.stdout)
    assert view["id"] == POD_ID and view["guard"]["alive"] and view["guard"]["conditions"] == "stop-after 0.001 h"
    assert wait_for(lambda: world.fake.ops("podStop"), 60), (world.guard_dir / "guard.log").read_text()
    assert world.fake.ops("podStop") == [{"input": {"podId": POD_ID}}]
    assert world.fired_state()["reason"].startswith("stop-after: deadline")


def test_stop_after_smoke_waits_for_the_first_new_run_to_finish(world, tmp_path):
    assert world.up("--accept-new").returncode == 0
    old = Path(world.remote_dir) / "runs" / "before"
    old.mkdir(parents=True)
    (old / "summary.json").write_text('{"status": "pass"}')  # a run from before the guard: not the one it waits for
    armed = world.pod("guard", "g", "--stop-after-smoke")
    assert armed.returncode == 0, armed.stderr
    assert "guard: after-smoke (alive)" in armed.stdout
    time.sleep(3)
    assert world.fake.ops("podStop") == []

    # the real bin/smoke, as a podkit job on the pod, on the bundled tiny CPU job
    run = world.pod("run", "g", "--id", "smoke", "--", str(ROOT / "bin" / "smoke"), "--config",
                    str(ROOT / "checks" / "examples" / "tiny-cpu.toml"), "--steps", "5", "--run-id", "first", timeout=300)
    summary = json.loads((Path(world.remote_dir) / "runs" / "first" / "summary.json").read_text())
    assert run.returncode in (0, 1), run.stdout + run.stderr
    assert summary["status"] != "running"
    assert wait_for(lambda: world.fake.ops("podStop"), 30), (world.guard_dir / "guard.log").read_text()
    assert world.fake.ops("podStop") == [{"input": {"podId": POD_ID}}]
    assert world.fired_state()["reason"] == f"after-smoke: run first ({summary['status']}) finished"


def test_a_guard_that_cannot_be_armed_stops_the_new_pod(tmp_path):
    w = World(tmp_path, pod_id_on_pod="someone-else")  # the pod answering is not the one RunPod created
    try:
        out = w.up("--idle-stop", "30", "--accept-new")
        line = one_line_error(out, notes_before=True)
        assert "RUNPOD_POD_ID is 'someone-else', not 'fake0001xyz'" in line and "stopped g" in line
        assert w.fake.ops("podStop") == [{"input": {"podId": POD_ID}}]
        assert not (w.guard_dir / "pid").exists()
    finally:
        w.stop()


def test_bad_guard_input_is_one_line(world):
    for args, expect in [
        (("--stop-after", "-2", "--accept-new"), "--stop-after -2 is not a positive number of hours"),
        (("--idle-stop", "nan", "--accept-new"), "--idle-stop nan is not a positive number of minutes"),
        (("--stop-after-smoke",), "add --accept-new"),
    ]:
        assert expect in one_line_error(world.up(*args), notes_before=True)
    assert "no RunPod API key" in one_line_error(world.pod("up", "--gpu", "RTX 4090", "--stop-after", "1", "--accept-new", key=None), notes_before=True)
    assert world.fake.ops("podFindAndDeployOnDemand") == [], "a pod was created for bad input"
    (world.laptop / "pods.toml").write_text(f'[pods.mine]\nhost = "{world.sshd.spec}"\n')
    assert "not brought up by bin/pod up" in one_line_error(world.pod("guard", "mine", "--stop-after", "1"), notes_before=True)
    assert world.up("--accept-new").returncode == 0
    assert "takes no condition" in one_line_error(world.pod("guard", "g", "--off", "--stop-after", "1"), notes_before=True)
    assert "--stop-after 0 is not a positive" in one_line_error(world.pod("guard", "g", "--stop-after", "0"), notes_before=True)
    assert "no pod named 'nope'" in one_line_error(world.pod("guard", "nope", "--off"), notes_before=True)
    assert not (world.guard_dir / "pid").exists()


def test_a_stop_that_fails_keeps_retrying_and_shows_in_ls(tmp_path):
    w = World(tmp_path, pod_key="rp_revoked_pod_key")  # RunPod answers 401 to the pod's key
    try:
        up = w.up("--stop-after", "0.0005", "--accept-new")  # 1.8 s
        assert up.returncode == 0, up.stderr
        assert wait_for(lambda: w.state().get("status") == "stop-failing", 60), (w.guard_dir / "guard.log").read_text()
        guard = w.ls_row()["guard"]
        assert guard["alive"] and guard["status"] == "stop-failing" and "401" in guard["error"]
        assert "NOT" not in w.pod("ls").stdout and "stop-failing: stop-after: deadline" in w.pod("ls").stdout
        assert "rp_revoked_pod_key" in w.fake.keys_seen and w.fake.ops("podStop") == []  # tried, refused (401)
        pid = w.guard_pid()
        off = w.pod("guard", "g", "--off")
        assert off.returncode == 0 and "cancelled" in off.stderr
        assert wait_for(lambda: not alive(pid), 10)
    finally:
        w.stop()


def test_a_runpodctl_that_hangs_is_a_stop_to_retry_not_the_end_of_the_guard(tmp_path, monkeypatch):
    """Review 2026-11-25: with the API out of reach from the pod (a network outage: the likeliest reason a stop
    fails), the fallback `runpodctl stop pod` can hang on that same network; past its timeout subprocess raised
    TimeoutExpired, which nothing caught: the watchdog died and the pod billed on unguarded. It is now one more
    failed attempt, retried like the others."""
    from podkit.pods import guard

    ctl = tmp_path / "runpodctl"
    ctl.write_text("#!/bin/sh\nexec sleep 5\n")  # then exits 0: a stop that 'succeeds' long after the timeout
    ctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    monkeypatch.setattr(guard, "pid1_env", lambda _name: "")
    monkeypatch.setattr(guard, "RUNPODCTL_TIMEOUT_S", 0.5, raising=False)
    with pytest.raises(RuntimeError, match=r"runpodctl stop pod: .*timed out after 0.5 seconds"):
        guard.stop_pod("fake0001xyz")


def test_a_later_command_past_its_timeout_leaves_the_guard_its_shell_started_running(world):
    """A command past its timeout is stopped on the pod by the tag of the shell that ran it (pods/connection.py);
    the guard that same shell started before is detached, and that stop must not reach it."""
    from podkit.pods import cost_guard
    from podkit.pods.connection import PodConnection
    from podkit.pods.errors import PodError
    from podkit.pods.hosts import parse_host, resolve

    world.known_hosts.write_text(world.sshd.known_hosts_line())
    endpoint = resolve(parse_host(world.sshd.spec, key=str(world.sshd.client_key)))
    with PodConnection(endpoint, known_hosts=world.known_hosts) as conn:
        plan = cost_guard.plan_from_options(False, 1, None)
        assert cost_guard.install(conn, world.remote_dir, plan, POD_ID, sys.executable)["alive"]
        pid = world.guard_pid()
        with pytest.raises(PodError, match="ran past 1 s and was stopped"):
            conn.run("sleep 30", timeout=1)
        assert alive(pid), "the timed-out command's stop ended the guard"
        assert cost_guard.cancel(conn, world.remote_dir)
