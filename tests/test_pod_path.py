"""Issue 15's path, end to end: README's five lines (bin/pod up -> make deploy -> bin/smoke on the
pod -> make fetch-logs -> bin/pod down), run as written, read from the README block itself.

The RunPod API is tests/runpod_fake.py (its documented GraphQL shapes on 127.0.0.1), which maps
the new pod's SSH port to a real sshd on loopback; that sshd is chrooted into a root laid out like
RunPod's PyTorch image (`/workspace` a volume, the image's python3 with torch first on PATH, root's
own home; tests/pod_image.py). The laptop is a copy of this project with its own HOME holding the
user's ~/.ssh/id_ed25519, the API key in .podkit/env and nothing on any command line.
"""

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pod_image import ImagePod, fresh_home, laptop_venv, mirror, namespaces_available, python_with_torch
from podkit.pods.hosts import load_inventory
from runpod_fake import FakeRunPod
from smoke_helpers import tiny_job
from sshd_harness import project_copy, sshd_available

ROOT = Path(__file__).resolve().parents[1]
KEY = "rp_e2e_" + secrets.token_hex(8)  # made here: the synced test file must not hold it
HEADING = "### The whole path: pod up, deploy, smoke, logs back, pod down"


def image_pod_test(fn):
    """The end-to-end test's needs: sshd, root for the image pod's mount namespace, make."""
    for mark in (pytest.mark.slow,
                 pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available())),
                 pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available())),
                 pytest.mark.skipif(shutil.which("make") is None, reason="the README path runs make deploy / make fetch-logs")):
        fn = mark(fn)
    return fn


def readme_path() -> list[str]:
    """The commands of the README's path section: the first ```bash block after its heading."""
    text = (ROOT / "README.md").read_text()
    assert HEADING in text, "the README lost its path section"
    block = re.search(r"```bash\n(.*?)```", text[text.index(HEADING):], re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_path_is_the_five_steps():
    steps = [line.split("#")[0].split()[:2] for line in readme_path()]
    assert steps == [["bin/pod", "up"], ["make", "deploy"], ["bin/pod", "run"], ["make", "fetch-logs"],
                     ["bin/pod", "down"]]


@pytest.fixture
def world(tmp_path):
    fake = FakeRunPod(key=KEY).start()
    workspace = tmp_path / "image" / "workspace"
    workspace.mkdir(parents=True)
    local_bin = mirror("/usr/local/bin", tmp_path / "image" / "usr-local-bin")
    python_with_torch(local_bin)  # the image's python3, first on sshd's PATH
    pod = ImagePod(tmp_path, "runpod", replace={
        "/workspace": workspace, "/usr/local/bin": local_bin, **fresh_home(tmp_path / "image" / "root", "/root")})
    try:
        pod.start()
        fake.ssh_port = pod.port  # the public port RunPod maps to the pod's 22
        project = project_copy(tmp_path / "laptop" / "podkit")
        laptop_venv(project)
        tiny_job(project, smoke={"steps": 30}, name="my-job.toml")  # the user's job: the tiny CPU one
        (project / ".podkit").mkdir()
        (project / ".podkit" / "env").write_text(f"RUNPOD_API_KEY={KEY}\n")
        (project / ".podkit" / "env").chmod(0o600)
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        shutil.copy(pod.client_key, home / ".ssh" / "id_ed25519")  # the key RunPod installed on the pod
        (home / ".ssh" / "id_ed25519").chmod(0o600)
        yield fake, pod, project, home, workspace
    finally:
        pod.stop()
        fake.stop()


@image_pod_test
def test_up_deploy_smoke_fetch_down_as_the_readme_says(world):
    fake, pod, project, home, workspace = world
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNPOD_", "PODKIT_")) and k != "PYTHONPATH"}
    env |= {"HOME": str(home), "RUNPOD_API_BASE_URL": fake.url}
    outputs = []

    def step(line: str) -> subprocess.CompletedProcess:
        out = subprocess.run(["bash", "-c", line], cwd=project, env=env, capture_output=True, text=True,
                             timeout=600, stdin=subprocess.DEVNULL)
        outputs.append(out.stdout + out.stderr)
        assert out.returncode == 0, f"{line}\n{out.stdout}\n{out.stderr}"
        return out

    up, deploy, smoke, fetch, down = readme_path()

    step(up)
    inv = load_inventory(project / "pods.toml")
    spec, raw = inv.pods["trainer"], inv.raw_pods["trainer"]
    assert (spec.user, spec.host, spec.port, spec.profile) == ("root", "127.0.0.1", pod.port, "runpod")
    assert raw["provider"] == "runpod" and raw["pod_id"] in fake.pods
    pod_id = raw["pod_id"]
    created = fake.ops("podFindAndDeployOnDemand")[0]["input"]
    assert created["gpuTypeId"] == "NVIDIA GeForce RTX 4090" and created["ports"] == "22/tcp"

    out = step(deploy)
    assert "recorded host key" in out.stdout and f"[127.0.0.1]:{pod.port}" in (home / ".ssh" / "known_hosts").read_text()
    assert "profile runpod; project /workspace/podkit" in out.stdout and "preflight: ready" in out.stdout
    remote = workspace / "podkit"  # the pod's /workspace/podkit, seen from outside its namespace
    assert (remote / "my-job.toml").is_file() and (remote / ".venv" / "bin" / "python").exists()

    out = step(smoke)
    assert "exited 0" in out.stderr

    step(fetch)
    summaries = list((project / "pod-logs" / "trainer" / "runs").glob("*/summary.json"))
    assert len(summaries) == 1, summaries
    summary = json.loads(summaries[0].read_text())
    assert summary["status"] == "pass" and summary["steps"] == 30, summary
    assert (project / "pod-logs" / "trainer" / "logs" / "probe.json").is_file()

    step(down)
    assert fake.ops("podTerminate") == [{"input": {"podId": pod_id}}] and fake.pods == {}
    assert "trainer" not in load_inventory(project / "pods.toml").pods

    # Nothing left running on the pod (its mount namespace holds only the listening sshd) ...
    deadline = time.monotonic() + 20
    while pod.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pod.processes() == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in pod.processes()]
    # ... and the API key went nowhere: not to the pod, not into any output
    assert KEY not in "".join(outputs)
    for path in remote.rglob("*"):
        if path.is_file() and not path.is_symlink() and ".venv" not in path.parts:
            assert KEY.encode() not in path.read_bytes(), path
