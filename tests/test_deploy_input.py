"""bin/pod deploy's own input, against a real sshd on loopback: a bad job file is refused on the laptop
before the pod is touched (one line, exit 2), and the user's extra secrets (PODKIT_SECRET_NAMES) reach
the pod's env file through stdin only: never in a process's argv, the output or a log.
"""

import json
import os
import secrets
import socket
import sys
import threading
from pathlib import Path

import pytest

from sshd_harness import LoopbackPod, one_line_error, pod_cli, pod_world, sshd_available

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = pod_world(tmp_path_factory.mktemp("deploy-input"), "a")
    yield w
    w.pod.stop()


def cli(world, *args, **kw):
    return pod_cli(world.project, *args, known_hosts=world.known_hosts, **kw)


def pod_args(pod: LoopbackPod, remote_dir: str | None = None) -> list[str]:
    return ["--key", str(pod.client_key), "--remote-dir", remote_dir or pod.remote_dir, "--python", sys.executable]


def write_job(world, name: str, text: str) -> str:
    """A job file inside the project (deploy takes --config relative to it); its path as --config gives it."""
    path = world.project / "jobs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return f"jobs/{name}"


BAD_JOBS = [
    # (id, job TOML, what the one line says; the JSON error's field)
    ("micro-batch-0", '[model]\npreset = "tiny"\n[train]\nmicro_batch = 0\n',
     "jobs/micro-batch-0.toml: train.micro_batch: must be at least 1, got 0", "train.micro_batch"),
    ("unknown-key", '[model]\npreset = "tiny"\n[train]\nmicro_bacth = 2\n',
     "train.micro_bacth: unknown key (did you mean 'micro_batch'?)", "train.micro_bacth"),
    ("bad-toml", '[model\npreset = "tiny"\n', "jobs/bad-toml.toml is not valid TOML", "--config"),
    # a Hub model: its field is still checked here, without the network (HF_HUB_OFFLINE=1 below)
    ("hub-model-bad-field", '[model]\nhf = "podkit-test/no-such-model"\n[cluster]\ngpus_per_node = 0\n',
     "cluster.gpus_per_node: must be at least 1, got 0", "cluster.gpus_per_node"),
]


@pytest.mark.parametrize("case", BAD_JOBS, ids=[c[0] for c in BAD_JOBS])
def test_a_bad_job_is_refused_before_the_pod_is_touched(world, case):
    """It was only preflight on the pod, after the sync and the installs, that refused it (exit 1)."""
    name, text, expect, field = case
    config = write_job(world, f"{name}.toml", text)
    remote = Path(world.pod.base) / "remote" / f"untouched-{name}"
    env = {"HF_HUB_OFFLINE": "1"}
    line = one_line_error(cli(world, "deploy", world.pod.spec, *pod_args(world.pod, str(remote)), "--config", config,
                              env=env))
    assert expect in line and "Traceback" not in line, line
    assert "(" in line and line.endswith(")"), line  # what to do comes with it
    as_json = cli(world, "deploy", world.pod.spec, *pod_args(world.pod, str(remote)), "--config", config, "--json",
                  env=env)
    assert one_line_error(as_json) == line
    data = json.loads(as_json.stdout)  # the one object a script reads
    assert data["ok"] is False and data["exit_code"] == 2 and data["error"]["field"] == field
    assert line == f"error: {data['error']['problem']} ({data['error']['fix']})"
    assert not remote.exists()  # nothing was synced, installed or even probed there


def test_a_bad_job_is_refused_without_connecting(world):
    """The check comes before the connection: a port that accepts TCP sees no one arrive."""
    config = write_job(world, "mb0.toml", '[model]\npreset = "tiny"\n[train]\nmicro_batch = 0\n')
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        line = one_line_error(cli(world, "deploy", f"root@127.0.0.1:{listener.getsockname()[1]}", "--timeout", "2",
                                  "--config", config))
        assert "train.micro_batch: must be at least 1, got 0" in line
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@pytest.mark.parametrize("model", ['hf = "podkit-test/no-such-model"', 'hf_config = "/only/on/the/pod/config.json"'],
                         ids=["hub-id", "pod-path"])
def test_a_model_read_elsewhere_is_left_to_the_pods_preflight(world, model):
    """A Hub id needs the network, and an hf_config path may exist only on the pod: the laptop does not read
    them, so deploy goes on to connect (refused here: a closed port)."""
    config = write_job(world, "elsewhere.toml", f"[model]\n{model}\n")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    line = one_line_error(cli(world, "deploy", f"root@127.0.0.1:{port}", "--config", config,
                              env={"HF_HUB_OFFLINE": "1"}))
    assert "connection refused" in line, line


class ArgvWatch:
    """Every process's command line on this machine (laptop and loopback pod alike), read from /proc over and
    over while a command runs: which of them held `needle`, and whether the watch saw the pod's envsetup at all."""

    def __init__(self, needle: str):
        self.needle = needle.encode()
        self.leaks: set[str] = set()
        self.saw_envsetup = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read()
                except OSError:
                    continue
                if self.needle in argv:
                    self.leaks.add(argv.replace(b"\0", b" ").decode(errors="replace"))
                if b"podkit.envsetup.cli" in argv:
                    self.saw_envsetup = True


def test_extra_secret_names_reach_the_pods_env_file_through_stdin_only(world):
    """PODKIT_SECRET_NAMES was read on the laptop only: envsetup on the pod kept the names it knew and dropped
    MY_TOKEN. It arrives now, in no argv, output or log, and a re-deploy without it set keeps it."""
    pod, remote = world.pod, Path(world.pod.remote_dir)
    token = "s3cret-" + secrets.token_hex(8)
    with ArgvWatch(token) as watch:
        out = cli(world, "deploy", pod.spec, *pod_args(pod),
                  env={"PODKIT_SECRET_NAMES": "MY_TOKEN, OTHER_UNSET", "MY_TOKEN": token, "HF_TOKEN": "hf_" + token})
    assert out.returncode == 0, out.stdout + out.stderr
    env_file = (remote / ".podkit" / "env").read_text()
    assert f"export MY_TOKEN={token}" in env_file and f"export HF_TOKEN=hf_{token}" in env_file
    assert "OTHER_UNSET" not in env_file  # a name without a value adds nothing
    assert watch.saw_envsetup, "the watch never saw the pod's envsetup running"
    assert not watch.leaks, watch.leaks
    assert token not in out.stdout + out.stderr
    assert "secrets: HF_TOKEN, MY_TOKEN" in out.stdout  # envsetup names them, never their values
    for logs in (remote / "logs", remote / ".podkit" / "envsetup"):
        for path in logs.rglob("*"):
            if path.is_file():
                assert token not in path.read_text(errors="replace"), path

    again = cli(world, "deploy", pod.spec, *pod_args(pod), env={"PODKIT_SECRET_NAMES": "", "MY_TOKEN": ""})
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"export MY_TOKEN={token}" in (remote / ".podkit" / "env").read_text()  # kept, as HF_TOKEN is


def test_a_bad_secret_name_is_refused_before_connecting(world):
    """A name is written as `export NAME=...` into a file every command on the pod sources: it must be one.
    A NAME=value given by mistake is refused without repeating the value."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        host = f"root@127.0.0.1:{listener.getsockname()[1]}"
        for value, expect in (("MY-TOKEN", "entry 1 (8 characters) is not an environment variable name"),
                              ("MY_TOKEN=s3cret-value", "entry 1 (21 characters) is not an environment variable name"),
                              ("OK_NAME,$(touch /tmp/x)", "entry 2 (15 characters) is not")):
            out = cli(world, "deploy", host, "--timeout", "2", env={"PODKIT_SECRET_NAMES": value})
            line = one_line_error(out)
            assert "PODKIT_SECRET_NAMES" in line and expect in line, line
            assert "s3cret-value" not in out.stdout + out.stderr and "touch" not in line
            as_json = cli(world, "deploy", host, "--timeout", "2", "--json", env={"PODKIT_SECRET_NAMES": value})
            assert one_line_error(as_json) == line
            assert json.loads(as_json.stdout)["error"]["field"] == "PODKIT_SECRET_NAMES"
        # Review 2026-11-25: envsetup reads NAME=value lines, so a secret of several lines (a service account's
        # JSON) arrived cut to its first line. Refused before connecting, its value never shown.
        value = '{\n  "private_key": "s3cret-value"\n}'
        out = cli(world, "deploy", host, "--timeout", "2", env={"PODKIT_SECRET_NAMES": "GCP_SA_JSON",
                                                                  "GCP_SA_JSON": value})
        line = one_line_error(out)
        assert "GCP_SA_JSON holds a value of several lines" in line, line
        assert "s3cret-value" not in out.stdout + out.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()
