"""envsetup on this machine: the env file's mode and content, secrets, skipped steps, an interrupted run."""

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podkit.envsetup import envfile
from podkit.envsetup.fingerprint import parse_probe, probe_local

from pod_image import torchless_python, unusable_pythons
from sshd_harness import project_copy

FINGERPRINTS = Path(__file__).parent / "fingerprints"
ROOT = Path(__file__).resolve().parents[1]


def test_env_file_is_0600_and_settings_follow_the_pod(tmp_path):
    fp = parse_probe((FINGERPRINTS / "runpod-a100.txt").read_text())
    text = envfile.render(fp, tmp_path, "/workspace/.cache", "flash-attn", "wheel", {"HF_TOKEN": "hf_x y'z"})
    assert 'PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"' in text  # torch 2.4
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-16}"' in text and "HF_HOME=\"${HF_HOME:-/workspace/.cache/huggingface}\"" in text
    path = tmp_path / ".podkit" / "env"
    path.parent.mkdir()
    path.write_text("old")
    os.chmod(path, 0o644)  # a file left behind with a loose mode is tightened
    assert envfile.write(path, text) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not envfile.write(path, text)
    out = subprocess.run(["bash", "-c", f". {path}; printf %s \"$HF_TOKEN\""], capture_output=True, text=True)
    assert out.stdout == "hf_x y'z"
    assert envfile.existing_secrets(path, envfile.SECRET_NAMES) == {"HF_TOKEN": "hf_x y'z"}
    assert envfile.read_secrets("HF_TOKEN=a\nPATH=/evil\nWANDB_API_KEY=b\n", envfile.SECRET_NAMES) == {
        "HF_TOKEN": "a", "WANDB_API_KEY": "b"}


def test_extra_secret_names_are_checked_recorded_and_kept(tmp_path):
    assert envfile.extra_secret_names(" MY_TOKEN, ,_K2,MY_TOKEN,") == ("MY_TOKEN", "_K2")
    assert envfile.secret_names({"PODKIT_SECRET_NAMES": "HF_TOKEN,MY_TOKEN"}) == envfile.SECRET_NAMES + ("MY_TOKEN",)
    # A bad entry is named by position and length, never echoed: it may be a pasted secret (review 2026-11-25).
    for bad in ("MY-TOKEN", "2X", "X;rm -rf ~", "MY_TOKEN=hf_value", "0123abcdef0123abcdef-x"):
        with pytest.raises(envfile.BadSecretName) as exc:
            envfile.extra_secret_names(f"OK,{bad}")
        assert f"entry 2 ({len(bad)} characters)" in str(exc.value) and bad not in str(exc.value), str(exc.value)
        assert ("names only" in str(exc.value)) == ("=" in bad)
    # exported after the file's own settings, these would replace one or change every command: not secrets
    for taken in ("PATH", "LD_PRELOAD", "PODKIT_ROOT", "PYTHONPATH", "BASH_ENV", "HF_HOME", "PYTORCH_ALLOC_CONF"):
        with pytest.raises(envfile.BadSecretName, match=f"{taken} is not a secret to forward"):
            envfile.extra_secret_names(f"MY_TOKEN,{taken}")
    fp = parse_probe((FINGERPRINTS / "runpod-a100.txt").read_text())
    text = envfile.render(fp, tmp_path, None, "sdpa", "x", {"HF_TOKEN": "a", "MY_TOKEN": "b c", "ZZ": "d"})
    assert "export PODKIT_SECRET_NAMES=MY_TOKEN,ZZ\n" in text
    path = tmp_path / "env"
    envfile.write(path, text)
    # a later envsetup that is not told the extra names (a re-deploy without them set) keeps what the file recorded
    assert envfile.existing_secrets(path, envfile.SECRET_NAMES) == {"HF_TOKEN": "a", "MY_TOKEN": "b c", "ZZ": "d"}
    assert "PODKIT_SECRET_NAMES" not in envfile.render(fp, tmp_path, None, "sdpa", "x", {"HF_TOKEN": "a"})


def test_probe_reads_this_machine():
    fp = probe_local(python=sys.executable)
    assert fp.python == sys.executable and fp.torch and fp.torch.version.startswith("2.")
    assert fp.cpus >= 1 and fp.ram_total_mib > 0 and fp.disk_free_mib and fp.python_tag.startswith("cp3")


def test_probe_lists_the_optimizer_packages_envsetup_installs():
    """The probe's package list is what a re-deploy sees of the image: torchao was left out of it."""
    from importlib.metadata import version

    fp = probe_local(python=sys.executable)
    assert fp.packages.get("bitsandbytes") == version("bitsandbytes")
    assert fp.packages.get("torchao") == version("torchao")


def test_verify_imports_torchao_and_on_a_gpu_takes_an_8bit_adamw_step():
    """envsetup's verification of torchao, in this interpreter (torch and torchao installed): one line per
    dependency, "ok <version>" on a CPU, with the 8-bit AdamW step on a GPU."""
    import torch
    from importlib.metadata import version

    from podkit.envsetup.verify import VERIFY_SCRIPT

    out = subprocess.run([sys.executable, "-c", VERIFY_SCRIPT, "torchao"], capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(results) == ["torch", "torchao"], out.stdout + out.stderr
    expect = f"ok {version('torchao')}" + (", 8-bit AdamW step on GPU" if torch.cuda.is_available() else "")
    assert results["torchao"] == expect, results


def test_probe_finds_python3_in_a_path_with_a_space(tmp_path, monkeypatch):
    # The automatic search (no PODKIT_PYTHON) took `command -v python3` apart at the space and found no interpreter.
    bindir = tmp_path / "My Envs" / "bin"
    bindir.mkdir(parents=True)
    wrapper = bindir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/anaconda3 candidates
    monkeypatch.delenv("PODKIT_PYTHON", raising=False)
    fp = probe_local(str(tmp_path))
    assert fp.python == str(wrapper) and fp.torch is not None


@pytest.mark.slow
def test_local_envsetup_interrupted_then_rerun_then_skipped(tmp_path):
    project = project_copy(tmp_path / "proj")
    (project / ".venv").unlink()  # a machine without a venv yet
    cmd = [str(project / "bin" / "envsetup"), "--python", sys.executable]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (project / ".venv" / "bin").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # mid venv creation
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    # Review 2026-11-25: the report was the previous run's (none here), and the half-made venv (a python that
    # starts, ensurepip cut short) was kept and recorded as done.
    stopped = json.loads((project / "logs" / "envsetup" / "report.json").read_text())
    assert stopped["ok"] is False and stopped["status"] == "interrupted", stopped
    first = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "envsetup: ready" in first.stdout and "flash-attn    skip: no GPU" in first.stdout
    assert json.loads((project / "logs" / "envsetup" / "report.json").read_text())["status"] == "ok"
    assert subprocess.run([str(project / ".venv" / "bin" / "python"), "-m", "pip", "--version"], capture_output=True,
                          env=env).returncode == 0
    again = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "requirements  unchanged" in again.stdout and "env file unchanged" in again.stdout
    report = (project / "logs" / "envsetup" / "report.json").read_text()
    assert '"attention": "sdpa"' in report
    shutil.rmtree(project)


def test_a_rerun_waits_for_an_install_still_holding_the_lock(tmp_path):
    """A client killed mid-install leaves pip running on the pod; the next envsetup must wait for it."""
    import fcntl

    project = project_copy(tmp_path / "proj")
    (project / ".venv").unlink()
    (project / ".podkit" / "envsetup").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(project / ".podkit" / "envsetup" / "lock", "a+") as held:  # the leftover install's lock
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        proc = subprocess.Popen([str(project / "bin" / "envsetup"), "--python", sys.executable], cwd=project, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = proc.stdout.readline()
        while first and "waiting" not in first:
            first = proc.stdout.readline()
        assert "still running" in first, first
        time.sleep(1.0)
        assert proc.poll() is None and not (project / ".venv").exists()  # nothing touched meanwhile
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "envsetup: ready" in out, out
    shutil.rmtree(project)


def test_the_probe_and_the_plan_see_the_torch_in_the_project_venv(tmp_path, monkeypatch):
    """An image without torch: envsetup put torch into .venv, and the plan must see it there."""
    from podkit.envsetup.resolve import resolve

    # The probe also tries `command -v python3`: with the suite's venv activated that is a torch python.
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not p.startswith(sys.prefix)))

    image_python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if subprocess.run([image_python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{image_python} has torch: no torch-less image python to test with")
    project = tmp_path / "proj"
    project.mkdir()
    (project / ".venv").symlink_to(Path(sys.prefix))  # the suite's venv: has torch
    fp = probe_local(str(project), image_python)
    assert fp.python == image_python and fp.torch and fp.torch_in_venv
    plan = resolve(fp, [])
    assert plan.dep("torch").action == "reuse" and "venv" in plan.dep("torch").reason
    assert plan.dep("bitsandbytes").action == "pip", plan.dep("bitsandbytes")


def test_a_python_that_cannot_serve_is_one_line_naming_what_is_wrong(tmp_path):
    """Review 2026-11-26: --python naming a file that exists but cannot run was "does not exist" (execute bit
    off), or was silently traded for another interpreter (a failing wrapper, a Python without torch: python3 on
    PATH with torch won), or failed later in the venv step. Now one line, exit 2, saying what is wrong with it."""
    project = tmp_path / "proj"
    project.mkdir()
    # python3 on PATH is a Python with torch (the suite's): the interpreter the probe used to trade for.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODKIT_PYTHON")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for expect, python in unusable_pythons(tmp_path / "pythons").items():
        out = subprocess.run([str(ROOT / "bin" / "envsetup"), "--project", str(project), "--python", str(python),
                              "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (python, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"envsetup: python {python} {expect}"), out.stderr
        assert "leave --python out" in lines[0], lines[0]
    assert sorted(os.listdir(project)) == []  # nothing made


def test_a_named_python_without_torch_is_refused_only_where_torch_must_be_the_images(tmp_path):
    """Review 2026-11-25: a named Python without torch was refused on a CPU machine too, where envsetup installs
    the pinned CPU torch into the venv (resolve.py); on a GPU pod torch is the image's and podkit never installs it."""
    bare = torchless_python(tmp_path / "pythons")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODKIT_PYTHON")}
    out = subprocess.run([str(ROOT / "bin" / "envsetup"), "--project", str(tmp_path), "--python", str(bare),
                          "--dry-run", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    torch = next(d for d in json.loads(out.stdout)["plan"] if d["name"] == "torch")
    assert torch["action"] == "pip" and "CPU machine without torch" in torch["reason"], torch
    fp = parse_probe((FINGERPRINTS / "runpod-a100.txt").read_text())
    assert fp.gpus and fp.python_fault(str(bare)) is None  # this pod's probe found torch
    torchless = dataclasses.replace(fp, torch=None)
    assert torchless.python_fault(str(bare)).startswith("has no torch")
    assert torchless.python_fault(str(bare), torch_needed=False) is None
    assert dataclasses.replace(torchless, gpus=[]).python_fault(str(bare)) is None


def test_envsetup_knows_the_machine_without_pods():
    """Machine facts live in envsetup; pods only moves things (envsetup importing pods was a cycle)."""
    code = ("import sys, envsetup.cli, envsetup.resolve, envsetup.envfile, envsetup.fingerprint; "
            "print(sorted(m for m in sys.modules if m == 'pods' or m.startswith('pods.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
