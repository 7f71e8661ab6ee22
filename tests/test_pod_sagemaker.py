"""The sagemaker profile on a loopback pod laid out like a SageMaker notebook instance, reached as
docs/sagemaker.md says: through a ProxyCommand (sagemaker-ssh-helper's `sm-ssh start-proxy %h`;
here tests/tcp_relay.py in its place), logged in as root, as that helper does.

The layout (tests/pod_image.py binds it over /home and /root in the pod's own mount namespace):
  /home/ec2-user/SageMaker                         the persistent EBS volume, with a user's notebook
  /home/ec2-user/anaconda3/bin/activate            conda's activate (its shape: source
  /home/ec2-user/anaconda3/etc/profile.d/conda.sh  etc/profile.d/conda.sh, then conda activate "$@")
  /home/ec2-user/anaconda3/envs/pytorch_p310       the kernel env with torch, an activate.d script
  /home/ec2-user/anaconda3/envs/python3            an env without torch (must not be chosen)
  /root                                            root's own home, no conda on its PATH
Sources: AWS SageMaker developer guide, notebook instances' lifecycle configuration best practices
(nbi-lifecycle-config-install: envs under /home/ec2-user/anaconda3/envs, activated with
`source /home/ec2-user/anaconda3/bin/activate ENV`; /home/ec2-user/SageMaker is the volume that
persists); conda's bin/activate as installed by Anaconda.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pod_image import ImagePod, fresh_home, laptop_venv, namespaces_available, python_with_torch
from smoke_helpers import tiny_job
from sshd_harness import project_copy, sshd_available

RELAY = Path(__file__).with_name("tcp_relay.py")
HOST = "my-nb.notebook.sagemaker"
ENV = "/home/ec2-user/anaconda3/envs/pytorch_p310"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available())),
    pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available())),
    pytest.mark.skipif(shutil.which("make") is None, reason="runs make deploy / make fetch-logs as docs/sagemaker.md does"),
]

# A stand-in for conda's shell function: what `conda activate PREFIX` does to the shell (CONDA_PREFIX,
# PATH, the env's activate.d scripts). Conda itself is not installed here; podkit calls bin/activate.
CONDA_SH = r'''conda() {
  [ "$1" = activate ] || return 1
  case "$2" in /*) prefix="$2";; *) prefix="$_CONDA_ROOT/envs/$2";; esac
  [ -d "$prefix" ] || { echo "EnvironmentNameNotFound: $2" >&2; return 1; }
  export CONDA_PREFIX="$prefix" CONDA_DEFAULT_ENV="$(basename "$prefix")" PATH="$prefix/bin:$PATH"
  for f in "$prefix"/etc/conda/activate.d/*.sh; do [ -r "$f" ] && . "$f"; done
  return 0
}
'''


def notebook_instance(home: Path) -> Path:
    """/home as a SageMaker notebook instance has it (see the module docstring)."""
    ec2 = home / "ec2-user"
    (ec2 / "SageMaker").mkdir(parents=True)
    (ec2 / "SageMaker" / "analysis.ipynb").write_text("{}\n")  # the user's own work, never touched
    conda = ec2 / "anaconda3"
    (conda / "etc" / "profile.d").mkdir(parents=True)
    (conda / "etc" / "profile.d" / "conda.sh").write_text(CONDA_SH)
    (conda / "bin").mkdir()
    (conda / "bin" / "activate").write_text(
        f'#!/bin/sh\n_CONDA_ROOT="{conda_path(home, conda)}"\n\\. "$_CONDA_ROOT/etc/profile.d/conda.sh" || return $?\n'
        'conda activate "$@"\n')
    env = conda / "envs" / "pytorch_p310"
    python_with_torch(env / "bin", "python")
    python_with_torch(env / "bin", "python3")
    (env / "etc" / "conda" / "activate.d").mkdir(parents=True)
    (env / "etc" / "conda" / "activate.d" / "env_vars.sh").write_text("export SM_KERNEL_ENV=pytorch_p310\n")
    plain = conda / "envs" / "python3" / "bin"  # a Python without torch
    plain.mkdir(parents=True)
    (plain / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    return ec2


def conda_path(home: Path, conda: Path) -> str:
    """`conda`'s path as the pod sees it (home is bound at /home)."""
    return "/home/" + str(conda.relative_to(home))


@pytest.fixture
def world(tmp_path):
    sm_home = tmp_path / "image" / "home"
    ec2 = notebook_instance(sm_home)
    pod = ImagePod(tmp_path, "notebook", replace={"/home": sm_home, **fresh_home(tmp_path / "image" / "root", "/root")})
    try:
        pod.start()
        project = project_copy(tmp_path / "laptop" / "podkit")
        laptop_venv(project)
        tiny_job(project, smoke={"steps": 20}, name="my-job.toml")
        home = tmp_path / "laptop-home"
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        log = tmp_path / "relay.log"
        config = home / ".ssh" / "config"
        # sagemaker-ssh-helper's shape: its proxy writes a fresh key ~/.ssh/%h (its public half goes
        # to the instance through S3) and then relays the SSM session; the relay does both here.
        config.write_text("Host *.*.sagemaker\n  IdentityFile ~/.ssh/%h\n  ConnectTimeout 120\n  ServerAliveInterval 15\n"
                          f"  ProxyCommand {sys.executable} {RELAY} --log {log} --to {pod.port} --key {pod.client_key} "
                          "~/.ssh/%h %h %p\n  User root\n")
        yield pod, project, home, config, log, ec2
    finally:
        pod.stop()


def test_a_notebook_instance_through_the_proxy_deploys_runs_in_its_conda_env_and_fetches(world):
    pod, project, home, config, log, ec2 = world
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODKIT_") and k != "PYTHONPATH"}
    env["HOME"] = str(home)

    def run(*argv: str) -> subprocess.CompletedProcess:
        out = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0, f"{argv}\n{out.stdout}\n{out.stderr}"
        return out

    # ssh reads ~/.ssh/config from the passwd home, not $HOME: the test names its config
    deploy = run("make", "deploy", f"HOST={HOST}", f"SSH_CONFIG={config}", "CONFIG=my-job.toml", "ACCEPT_NEW=1")
    assert f"profile sagemaker; project /home/ec2-user/SageMaker/podkit" in deploy.stdout, deploy.stdout
    assert "preflight: ready" in deploy.stdout
    remote = ec2 / "SageMaker" / "podkit"
    assert json.loads((remote / "logs" / "probe.json").read_text())["python"] == f"{ENV}/bin/python"
    assert "/home/ec2-user/SageMaker/.cache" in (remote / ".podkit" / "env").read_text()  # caches on the volume
    assert (ec2 / "SageMaker" / "analysis.ipynb").read_text() == "{}\n"
    assert set(log.read_text().splitlines()) == {f"{HOST} 22"}  # every connection went through the proxy

    pod_args = ["--ssh-config", str(config)]
    shown = run("bin/pod", "run", HOST, *pod_args, "--",
                "sh", "-c", 'echo "conda=$CONDA_PREFIX kernel=$SM_KERNEL_ENV python=$(command -v python)"')
    assert (f"conda={ENV} kernel=pytorch_p310 python=/home/ec2-user/SageMaker/podkit/.venv/bin/python"
            in shown.stdout), shown.stdout

    run("bin/pod", "run", HOST, *pod_args, "--", "bin/smoke", "--config", "my-job.toml")
    run("make", "fetch-logs", f"HOST={HOST}", f"SSH_CONFIG={config}")
    summaries = list((project / "pod-logs" / HOST / "runs").glob("*/summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["status"] == "pass", summaries

    deadline = time.monotonic() + 20
    while pod.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pod.processes() == []


@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
@pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))
def test_a_training_containers_conda_python_is_found_off_the_ssh_path(tmp_path):
    """AWS's deep learning containers have torch in /opt/conda/bin/python, on PATH for PID 1 (the
    image's ENV) but not in an SSH session, whose python3 is the OS one, without torch."""
    opt = tmp_path / "image" / "opt"
    python_with_torch(opt / "conda" / "bin", "python")
    pod = ImagePod(tmp_path, "dlc", replace={"/opt": opt, **fresh_home(tmp_path / "image" / "root", "/root")})
    try:
        pod.start()
        project = project_copy(tmp_path / "laptop" / "podkit")
        known = tmp_path / "known_hosts"
        known.write_text(pod.known_hosts_line())
        out = subprocess.run([str(project / "bin" / "pod"), "probe", pod.spec, "--json", "--key", str(pod.client_key),
                              "--known-hosts", str(known), "--remote-dir", "/root/project"],
                             cwd=project, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        fp = json.loads(out.stdout)
        assert fp["python"] == "/opt/conda/bin/python" and fp["torch"]["version"], fp
        assert fp["sagemaker"] is None  # nothing persists in a training container: the generic profile
    finally:
        pod.stop()
