"""bin/pod up/down/ls/gpus against tests/runpod_fake.py (RunPod's documented GraphQL shapes on
127.0.0.1), and the recorded pod reached for real through a loopback sshd."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from podkit.pods.hosts import load_inventory
from runpod_fake import FakeRunPod
from sshd_harness import LoopbackPod, one_line_error, sshd_available

ROOT = Path(__file__).resolve().parents[1]
KEY = "rp_test_key_5f2c9a"


@pytest.fixture
def fake():
    f = FakeRunPod(key=KEY).start()
    yield f
    f.stop()


def pod(cwd: Path, fake: FakeRunPod, *args: str, key: str | None = KEY, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RUNPOD_API_KEY", "PYTHONPATH")}
    env["RUNPOD_API_BASE_URL"] = fake.url
    if key is not None:
        env["RUNPOD_API_KEY"] = key
    out = subprocess.run([str(ROOT / "bin" / "pod"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    assert KEY not in out.stdout + out.stderr, "the API key was printed"
    return out


FAST = ("--poll", "0.05")


def _stop_with(proc: subprocess.Popen, sig: int, err: str) -> tuple[str, str]:
    """Send `sig` to a running bin/pod, collect its stdout and the rest of its stderr; never leave it running."""
    try:
        proc.send_signal(sig)
        out, rest = proc.communicate(timeout=90)
        return out, err + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_gpus_lists_memory_and_price_cheapest_first(tmp_path, fake):
    fake.out_of_stock.add("NVIDIA H200")
    out = pod(tmp_path, fake, "gpus")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("NVIDIA RTX A6000") and "48 GB" in lines[0] and "$0.49/h" in lines[0]
    assert "NVIDIA H200" in lines[-1] and "none free now" in lines[-1]
    rows = json.loads(pod(tmp_path, fake, "gpus", "--json").stdout)
    a100 = next(r for r in rows if r["id"] == "NVIDIA A100 80GB PCIe")
    assert a100["memory_gb"] == 80 and a100["price_per_hour"] == 1.64
    assert fake.keys_seen == {KEY}


def test_up_waits_for_a_slow_pod_records_it_then_ls_and_down(tmp_path, fake):
    fake.start_polls = 3  # runtime null for three polls: still pulling the image
    fake.flaky_polls = 2  # and two answers that are API errors: waited through, not a reason to terminate
    out = pod(tmp_path, fake, "up", "--gpu", "a100 pcie", "--count", "2", "--name", "trainer", "--volume-gb", "100", *FAST)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("pod up: waiting (container starting, no SSH port mapped yet)") == 3, out.stderr
    assert out.stderr.count("pod up: waiting (API: RunPod refused: Something went wrong") == 2, out.stderr
    assert fake.ops("podTerminate") == []
    assert "trainer is running" in out.stdout and "make deploy HOST=trainer" in out.stdout
    created = fake.ops("podFindAndDeployOnDemand")[0]["input"]
    assert created["gpuTypeId"] == "NVIDIA A100 80GB PCIe" and created["gpuCount"] == 2
    assert created["ports"] == "22/tcp" and created["volumeInGb"] == 100 and created["name"] == "trainer"
    # the inventory names it, so `make deploy HOST=trainer` resolves to the mapped public port
    inv = load_inventory(tmp_path / "pods.toml")
    spec = inv.pods["trainer"]
    assert (spec.host, spec.port, spec.user, spec.profile) == ("127.0.0.1", 22022, "root", "runpod")
    pod_id = inv.raw_pods["trainer"]["pod_id"]
    assert pod_id in fake.pods and inv.raw_pods["trainer"]["provider"] == "runpod"

    ls = pod(tmp_path, fake, "ls")
    assert ls.returncode == 0, ls.stderr
    row = next(line for line in ls.stdout.splitlines() if line.lstrip("│ ").startswith("trainer"))  # a rich table
    assert pod_id in row and "RUNNING" in row and "$3.28/h" in row
    assert "running now: $3.28/h" in ls.stdout

    stopped = pod(tmp_path, fake, "down", "trainer")
    assert stopped.returncode == 0 and "stopped trainer" in stopped.stdout and "volume is kept" in stopped.stdout
    assert fake.pods[pod_id]["desiredStatus"] == "EXITED" and "trainer" in load_inventory(tmp_path / "pods.toml").pods

    gone = pod(tmp_path, fake, "down", "trainer", "--terminate", "--json")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout) == {"name": "trainer", "id": pod_id, "action": "terminated", "volume_kept": False}
    assert fake.ops("podTerminate") == [{"input": {"podId": pod_id}}] and pod_id not in fake.pods
    assert "trainer" not in load_inventory(tmp_path / "pods.toml").pods


def test_ls_shows_pods_podkit_did_not_bring_up(tmp_path, fake):
    fake.pods["other1"] = {"id": "other1", "name": "console-pod", "desiredStatus": "RUNNING", "costPerHr": 0.69,
                           "gpuCount": 1, "runtime": None, "machine": {"gpuDisplayName": "RTX 4090"}, "_polls": 0}
    rows = json.loads(pod(tmp_path, fake, "ls", "--json").stdout)
    assert rows[0]["id"] == "other1" and rows[0]["inventory_name"] is None
    assert "console-pod (not podkit's)" in pod(tmp_path, fake, "ls").stdout
    # a pod podkit recorded that the account no longer has (terminated in the console) shows as GONE
    (tmp_path / "pods.toml").write_text('[pods.old]\nhost = "root@1.2.3.4:22"\nprovider = "runpod"\npod_id = "gone9"\n')
    assert any(line.lstrip("│ ").startswith("old ") and "gone9" in line and "GONE" in line for line in pod(tmp_path, fake, "ls").stdout.splitlines())
    rows = json.loads(pod(tmp_path, fake, "ls", "--json").stdout)  # rows as `up` prints a pod, inventory too
    assert [(r["inventory_name"], r["inventory"]) for r in rows] == [(None, None), ("old", "pods.toml")]
    # QA 2026-11-25: neither down nor down --terminate could remove such an entry ('RunPod refused: Pod not found')
    assert "is gone on RunPod" in one_line_error(pod(tmp_path, fake, "down", "old"), notes_before=True)
    forgot = pod(tmp_path, fake, "down", "old", "--terminate", "--json")
    assert forgot.returncode == 0 and json.loads(forgot.stdout)["action"] == "forgotten", forgot.stderr
    assert "old" not in load_inventory(tmp_path / "pods.toml").pods


def test_down_refuses_a_pod_podkit_did_not_bring_up(tmp_path, fake):
    (tmp_path / "pods.toml").write_text('[pods.mine]\nhost = "root@1.2.3.4:22"\n')
    assert "not brought up by bin/pod up" in one_line_error(pod(tmp_path, fake, "down", "mine"), notes_before=True)
    assert fake.calls == []


def test_a_pod_that_never_gets_ready_is_terminated(tmp_path, fake):
    fake.never_ready = True
    out = pod(tmp_path, fake, "up", "--gpu", "NVIDIA RTX A6000", "--deadline", "0.5", *FAST)
    line = one_line_error(out, notes_before=True)
    assert "not ready within" in line and "terminated" in line
    created = fake.ops("pod")[0]["input"]["podId"]
    assert fake.ops("podTerminate") == [{"input": {"podId": created}}] and fake.pods == {}
    assert not (tmp_path / "pods.toml").exists()


@pytest.mark.parametrize("fault, expect", [
    ("out_of_stock", "free to rent right now"),
    ("failed", "RunPod refused: Something went wrong"),
    ("quota", "RunPod refused: You have reached the spend limit"),
])
def test_creation_faults_are_one_line(tmp_path, fake, fault, expect):
    if fault == "out_of_stock":
        fake.out_of_stock.add("NVIDIA H100 80GB HBM3")
    elif fault == "failed":
        fake.create_error = "Something went wrong. Please try again later or contact support."
    else:  # illustrative wording; the client passes RunPod's message through whatever it says
        fake.create_error = "You have reached the spend limit for your account. Raise it in Settings > Billing."
    out = pod(tmp_path, fake, "up", "--gpu", "NVIDIA H100 80GB HBM3", *FAST)
    assert expect in one_line_error(out, notes_before=True)
    assert fake.pods == {} and not (tmp_path / "pods.toml").exists()


def test_unknown_gpu_suggests_the_closest(tmp_path, fake):
    line = one_line_error(pod(tmp_path, fake, "up", "--gpu", "H100 80GB"), notes_before=True)
    assert "unknown GPU type 'H100 80GB'" in line and "did you mean 'NVIDIA H100 80GB HBM3'" in line
    assert fake.ops("podFindAndDeployOnDemand") == []


def test_bad_key_and_no_key(tmp_path, fake):
    bad = one_line_error(pod(tmp_path, fake, "gpus", key="rp_wrong"), notes_before=True)
    assert "refused the API key (HTTP 401)" in bad and "rp_wrong" not in bad
    none = one_line_error(pod(tmp_path, fake, "ls", key=None), notes_before=True)
    assert "no RunPod API key" in none and "RUNPOD_API_KEY" in none
    assert fake.keys_seen == {"rp_wrong"}  # no request at all without a key


def test_key_from_the_env_file(tmp_path, fake):
    (tmp_path / ".podkit").mkdir()
    (tmp_path / ".podkit" / "env").write_text(f"# secrets\nexport HF_TOKEN='unbalanced\nexport RUNPOD_API_KEY='{KEY}'\n")
    out = pod(tmp_path, fake, "gpus", key=None)
    assert out.returncode == 0, out.stderr
    assert fake.keys_seen == {KEY}


def test_bad_input_is_one_line(tmp_path, fake):
    assert "Missing option '--gpu'" in one_line_error(pod(tmp_path, fake, "up"), notes_before=True)
    assert "'--count': 'abc' is not a valid integer" in one_line_error(pod(tmp_path, fake, "up", "--gpu", "x", "--count", "abc"), notes_before=True)
    assert "--count 0" in one_line_error(pod(tmp_path, fake, "up", "--gpu", "RTX A6000", "--count", "0"), notes_before=True)
    (tmp_path / "pods.toml").write_text('[pods.taken]\nhost = "root@1.2.3.4:22"\n')
    assert "already has a pod named 'taken'" in one_line_error(pod(tmp_path, fake, "up", "--gpu", "RTX A6000", "--name", "taken"), notes_before=True)
    assert "no pod named 'nope'" in one_line_error(pod(tmp_path, fake, "down", "nope"), notes_before=True)
    assert fake.ops("podFindAndDeployOnDemand") == []


def test_an_unwritable_inventory_terminates_the_new_pod(tmp_path, fake):
    out = pod(tmp_path, fake, "up", "--gpu", "RTX 4090", "--inventory", str(tmp_path / "no-such-dir" / "pods.toml"), *FAST)
    assert "cannot record the pod" in one_line_error(out, notes_before=True)
    assert len(fake.ops("podTerminate")) == 1 and fake.pods == {}


def test_unreachable_api_is_one_line(tmp_path, fake):
    fake.stop()
    line = one_line_error(pod(tmp_path, fake, "gpus"), notes_before=True)
    assert "cannot reach the RunPod API" in line and "api_key" not in line
    fake.start()  # the fixture stops it again


@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_the_recorded_pod_is_reachable_by_name(tmp_path, fake):
    """up -> pods.toml -> a pod command by NAME reaches the SSH endpoint the API mapped (a loopback sshd)."""
    sshd = LoopbackPod(tmp_path, "rp").start()
    try:
        fake.ssh_port = sshd.port
        project = tmp_path / "laptop"
        project.mkdir()
        up = pod(project, fake, "up", "--gpu", "RTX 4090", "--json", "--key", str(sshd.client_key), *FAST)
        assert up.returncode == 0, up.stderr
        name = json.loads(up.stdout)["inventory_name"]
        assert name == "rtx-4090"
        known = tmp_path / "known_hosts"
        known.write_text(sshd.known_hosts_line())
        assert load_inventory(project / "pods.toml").pods[name].key == str(sshd.client_key)
        probe = pod(project, fake, "probe", name, "--known-hosts", str(known),  # the key comes from pods.toml
                    "--python", sys.executable, "--remote-dir", sshd.remote_dir, timeout=120)
        assert probe.returncode == 0, probe.stderr
        # first verified contact with a pod bin/pod up recorded: its host key is pinned to the pod id
        assert probe.stdout.startswith("pinned host key ") and "to podkit-runpod-fake0001xyz" in probe.stdout
        assert probe.stdout.splitlines()[-1].startswith(f"{name}: ") and "profile runpod" in probe.stdout
    finally:
        sshd.stop()


def test_ctrl_c_while_waiting_terminates_the_pod(tmp_path, fake):
    import signal
    import time

    fake.never_ready = True
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY}
    proc = subprocess.Popen([str(ROOT / "bin" / "pod"), "up", "--gpu", "RTX 4090", *FAST], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(fake.ops("pod")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    created = fake.ops("pod")[0]["input"]["podId"]
    assert fake.ops("podTerminate") == [{"input": {"podId": created}}] and fake.pods == {}
    assert f"terminated {created}" in err and "Traceback" not in err


def _up_then_signal(tmp_path, fake, sig, ready_when) -> tuple[subprocess.Popen, str]:
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY}
    # SIGHUP at its default, as a terminal's session has it: under nohup (this suite's own parent may be) it comes
    # ignored, and bin/pod keeps it so.
    proc = subprocess.Popen([str(ROOT / "bin" / "pod"), "up", "--gpu", "RTX 4090", "--name", "cut", *FAST],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not ready_when() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert KEY not in err
    return proc, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_or_a_closed_terminal_while_waiting_terminates_the_pod(tmp_path, fake, sig):
    """QA 2026-11-25: only Ctrl-C was handled; SIGTERM or SIGHUP (the terminal or SSH session closed) ended
    bin/pod with the pod running and not in pods.toml."""
    import signal

    fake.never_ready = True
    proc, err = _up_then_signal(tmp_path, fake, getattr(signal, sig), lambda: len(fake.ops("pod")) >= 2)
    assert proc.returncode == 130, err
    created = fake.ops("pod")[0]["input"]["podId"]
    assert fake.ops("podTerminate") == [{"input": {"podId": created}}] and fake.pods == {}


def test_a_create_cut_short_terminates_the_pod_runpod_made_anyway(tmp_path, fake):
    """QA 2026-11-25: Ctrl-C while the create request was in flight (RunPod made the pod; its reply never came)
    left it billing, unrecorded, and `down` refused it as not podkit's. A pod of the same name made by hand
    before is not touched."""
    import signal

    fake.pods["hand0001xyz"] = {"id": "hand0001xyz", "name": "cut", "desiredStatus": "RUNNING", "costPerHr": 0.5,
                                "gpuCount": 1, "imageName": "mine", "runtime": None, "machine": None, "_polls": 0}
    fake.create_reply_delay = 10
    proc, err = _up_then_signal(tmp_path, fake, signal.SIGINT, lambda: len(fake.pods) == 2)
    assert proc.returncode == 130, err
    made = next(i for i in fake.pods if i != "hand0001xyz") if len(fake.pods) == 2 else None
    assert made is None and fake.ops("podTerminate") == [{"input": {"podId": "fake0002xyz"}}], err
    assert "hand0001xyz" in fake.pods and f"terminated fake0002xyz" in err
    assert not (tmp_path / "pods.toml").exists()


def test_two_ups_of_one_name_record_two_findable_pods(tmp_path, fake):
    """QA 2026-11-25: two `up` at once checked the name before creating and wrote it minutes later: two
    [pods.rtx-4090] tables, and every later command refused pods.toml. The second now records NAME-2."""
    from podkit.pods import provision
    from podkit.pods.runpod import Pod, RunPodClient

    inv, said = tmp_path / "pods.toml", []
    pods = [Pod.from_api({"id": f"p{i}", "name": "gpu", "desiredStatus": "RUNNING", "costPerHr": 1, "gpuCount": 1,
                          "runtime": {"ports": [{"ip": "1.2.3.4", "isIpPublic": True, "privatePort": 22,
                                                 "publicPort": 4000 + i, "type": "tcp"}]}}) for i in (1, 2)]
    client = RunPodClient(KEY, fake.url)
    names = [provision.record(p, "gpu", inv, client, said.append) for p in pods]
    assert names == ["gpu", "gpu-2"] and "this pod is 'gpu-2'" in said[0]
    assert {n: s.pod_id for n, s in load_inventory(inv).pods.items()} == {"gpu": "p1", "gpu-2": "p2"}


@pytest.mark.parametrize("args, env, needle", [
    (["up", "--gpu", "RTX A6000", "--name", "my.pod"], {}, "may use only letters, digits, '_' and '-'"),
    (["up", "--gpu", "RTX A6000", "--poll", "nan"], {}, "--deadline and --poll must be positive seconds"),
    (["up", "--gpu", "RTX A6000", "--deadline", "nan"], {}, "--deadline and --poll must be positive seconds"),
    (["up", "--gpu", "RTX A6000", "--idle-stop", "1e308", "--accept-new"], {}, "--idle-stop 1e+308 minutes is over 90 days"),
    (["up", "--gpu", "RTX A6000", "--image", ""], {}, "--image is empty"),
    (["gpus"], {"RUNPOD_API_BASE_URL": "localhost"}, "RUNPOD_API_BASE_URL 'localhost' is not an http(s) URL"),
    (["gpus"], {"RUNPOD_API_BASE_URL": "http://127.0.0.1:abc"}, "cannot reach the RunPod API"),
])
def test_bad_provisioning_input_is_one_line_and_never_shows_the_key(tmp_path, fake, args, env, needle):
    """QA 2026-11-25: a name with a dot broke pods.toml for every later command; NaN waits never ended; a
    1e308-minute guard printed Infinity in --json; an endpoint without a scheme was a traceback holding the key."""
    full = {k: v for k, v in os.environ.items() if k not in ("RUNPOD_API_KEY", "PYTHONPATH")}
    full |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY, **env}
    fast = FAST if args[0] == "up" and "--poll" not in args else ()
    out = subprocess.run([str(ROOT / "bin" / "pod"), *args, *fast], cwd=tmp_path, env=full, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert needle in one_line_error(out, notes_before=True) and KEY not in out.stdout + out.stderr
    assert fake.ops("podFindAndDeployOnDemand") == []


def test_a_create_that_times_out_and_a_check_that_fails_still_say_what_may_bill(tmp_path):
    """Review 2026-11-25: when listing the pods failed after a create cut short (the network that made it time
    out), the check returned None and `for pod_id in None` was a traceback, so nobody was told a pod may bill."""
    from podkit.pods import provision
    from podkit.pods.errors import PodError
    from podkit.pods.runpod import PodRequest, RunPodClient

    fake = FakeRunPod(key=KEY).start()
    fake.create_reply_delay = 3  # the pod is made; the reply comes after the client's 1 s timeout
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if "checking whether RunPod made" in line:
            fake.stop()  # and now the API cannot be reached at all

    try:
        with pytest.raises(PodError, match="cannot reach the RunPod API"):
            provision._create(RunPodClient(KEY, fake.url, timeout=1), PodRequest(name="slow", gpu="NVIDIA RTX A6000"),
                              say)
    finally:
        fake.stop()
    assert "stopped checking" in said[-1] and "terminate it at runpod.io/console/pods (it bills)" in said[-1], said


@pytest.mark.parametrize("guard", [(), ("--idle-stop", "30")])
def test_an_up_stopped_during_its_first_contact_says_the_pod_bills_or_stops_it(tmp_path, fake, guard):
    """Review 2026-11-25: `up --accept-new` interrupted while it waited for the new pod's sshd ("does not answer yet;
    trying again in 5 s") said only 'interrupted (... re-run to continue)': the pod ran on, billing, with no word of
    it (a re-run makes a second pod), and one that was asked for a guard billed without one. Its first contact
    failing for good was the bare SSH error, nothing saying the pod was up."""
    import signal
    import time

    from sshd_harness import free_port

    fake.ssh_port = free_port()  # RunPod mapped the port; the container's sshd is not listening yet
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY}
    proc = subprocess.Popen([str(ROOT / "bin" / "pod"), "up", "--gpu", "RTX 4090", "--name", "fc", "--accept-new",
                             "--known-hosts", str(tmp_path / "known_hosts"), *guard, *FAST], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    while "does not answer yet" not in err and proc.poll() is None:
        err += proc.stderr.readline()
    out, err = _stop_with(proc, signal.SIGINT, err)
    assert proc.returncode == 130 and "Traceback" not in err and "re-run" not in err, err
    assert "pod_id = \"fake0001xyz\"" in (tmp_path / "pods.toml").read_text()  # recorded: down finds it
    if guard:
        assert fake.ops("podStop") == [{"input": {"podId": "fake0001xyz"}}], err
        assert "stopped fc (fake0001xyz) so it does not bill unguarded" in err, err
    else:
        assert fake.ops("podStop") == [] and fake.pods["fake0001xyz"]["desiredStatus"] == "RUNNING"
        assert "fc (fake0001xyz) is running and billing" in err and "stop it: bin/pod down fc" in err, err


def test_a_first_contact_that_fails_says_the_new_pod_bills(tmp_path, fake, monkeypatch):
    """The same pod whose sshd never answers (or offers an unexpected key): one line, exit 2, naming the pod as up,
    billing and how to stop it (it was the bare SSH error)."""
    from click.testing import CliRunner

    from podkit.pods import cli
    from podkit.pods.errors import Unreachable

    def unreachable(*_a, **_k):
        raise Unreachable("connection refused by 127.0.0.1:1", "check the pod is running")

    monkeypatch.setattr(cli, "connect", unreachable)
    monkeypatch.setattr("time.sleep", lambda _s: None)
    monkeypatch.setenv("RUNPOD_API_BASE_URL", fake.url)
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.main, ["up", "--gpu", "RTX 4090", "--name", "fc", "--accept-new", *FAST])
    assert result.exit_code == 2, result.output
    line = [x for x in result.output.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and "fc (fake0001xyz) is up and billing" in line[0] and "connection refused" in line[0]
    assert "bin/pod down fc" in line[0] and fake.pods["fake0001xyz"]["desiredStatus"] == "RUNNING"


@pytest.mark.parametrize("when, sig", [("waiting", "SIGINT"), ("waiting", "SIGTERM"), ("create", "SIGINT"),
                                       ("first-contact", "SIGINT"), ("first-contact-guarded", "SIGTERM")])
def test_an_interrupted_up_json_prints_what_it_left(tmp_path, fake, when, sig):
    """Review 2026-11-26: `up --json` stopped part way (Ctrl-C, SIGTERM) printed nothing on stdout, where deploy, run and
    fetch-logs print their object: a script had no pod id, nor word of whether it bills. Exit 130 as before."""
    import signal
    import time

    from sshd_harness import free_port

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": KEY}
    argv = [str(ROOT / "bin" / "pod"), "up", "--gpu", "RTX 4090", "--name", "cut", "--json", *FAST]
    if when == "waiting":
        fake.never_ready = True
        ready = lambda err: len(fake.ops("pod")) >= 2  # noqa: E731
    elif when == "create":
        fake.create_reply_delay = 10  # RunPod makes the pod; its reply is still on the way
        ready = lambda err: len(fake.pods) == 1  # noqa: E731
    else:
        fake.ssh_port = free_port()  # RunPod mapped the port; the container's sshd is not listening yet
        argv += ["--accept-new", "--known-hosts", str(tmp_path / "known_hosts")]
        argv += ["--idle-stop", "30"] if when == "first-contact-guarded" else []
        ready = lambda err: "does not answer yet" in err  # noqa: E731
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    if when.startswith("first-contact"):
        while not ready(err) and proc.poll() is None:
            err += proc.stderr.readline()
    else:
        deadline = time.monotonic() + 30
        while not ready(err) and time.monotonic() < deadline:
            time.sleep(0.05)
    out, err = _stop_with(proc, getattr(signal, sig), err)
    assert proc.returncode == 130 and "Traceback" not in err and KEY not in out + err, err
    data = json.loads(out)
    made = "fake0001xyz"
    expect = {"ok": False, "interrupted": True, "exit_code": 130, "id": made}
    if when in ("waiting", "create"):
        expect |= {"status": "TERMINATED", "billing": False, "inventory_name": None, "inventory": None}
        assert made not in fake.pods, err
    elif when == "first-contact":
        expect |= {"status": "RUNNING", "billing": True, "inventory_name": "cut", "inventory": "pods.toml"}
        assert fake.pods[made]["desiredStatus"] == "RUNNING"
    else:
        expect |= {"status": "EXITED", "billing": False, "inventory_name": "cut", "inventory": "pods.toml"}
        assert fake.pods[made]["desiredStatus"] == "EXITED"
    assert data == expect, (data, err)
