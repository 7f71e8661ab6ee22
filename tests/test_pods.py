"""bin/pod against real sshd servers on loopback: deploy, host keys, faults, detached runs, fetch-logs.

The "pod" is this machine seen through its own sshd on 127.0.0.1 (a free port, a throwaway host
key and client key). Its image Python is the suite's interpreter, so envsetup reuses its torch.
Tests in this module share one pod and run in order: first deploy, then re-deploys.
"""

import hashlib
import json
import shlex
import os
import signal
import socket
import stat
import subprocess
import shutil
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from podkit.envsetup.resolve import torchao_release
from podkit.pods.connection import PodConnection
from podkit.pods.hosts import parse_host, resolve
from podkit.pods.sync import remote_disk_full
from pod_image import unusable_pythons
from sshd_harness import LoopbackPod, NamespacePod, keygen, one_line_error, pod_cli, pod_world, sshd_available, wait_for

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


def pod_args(pod: LoopbackPod) -> list[str]:
    return ["--key", str(pod.client_key), "--remote-dir", pod.remote_dir, "--python", sys.executable]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = pod_world(tmp_path_factory.mktemp("pods"), "a")
    yield w
    w.pod.stop()


def cli(world, *args, **kw):
    return pod_cli(world.project, *args, known_hosts=kw.pop("known_hosts", world.known_hosts), **kw)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_first_deploy_then_no_change_then_a_change(world):
    pod, remote = world.pod, Path(world.pod.remote_dir)
    first = cli(world, "deploy", pod.spec, *pod_args(pod), env={"HF_TOKEN": "hf_SECRETvalue123"})
    assert first.returncode == 0, first.stdout + first.stderr
    summary_row = [line for line in first.stdout.splitlines() if line.startswith("│ ")][-1]  # deploy's rich table
    assert "│ ready " in summary_row and "preflight: ready" in first.stdout
    assert (remote / "bin" / "smoke").exists() and (remote / ".venv" / "bin" / "python").exists()
    assert not (remote / ".git").exists() and not (remote / "pod-logs").exists()
    env_file = remote / ".podkit" / "env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    env_text = env_file.read_text()
    assert "expandable_segments:True" in env_text and "TOKENIZERS_PARALLELISM" in env_text
    assert "export HF_TOKEN=hf_SECRETvalue123" in env_text
    # the secret went through stdin into that file only: not in output, logs or the probe record
    assert "hf_SECRETvalue123" not in first.stdout + first.stderr
    for path in (remote / "logs").rglob("*"):
        if path.is_file():
            assert "hf_SECRETvalue123" not in path.read_text(errors="replace"), path
    probe = (remote / "logs" / "probe.json").read_text()
    assert '"python_version"' in probe and '"cpus"' in probe
    # torchao, like bitsandbytes: the release for the pod's torch, installed and then imported by verification
    report = json.loads((remote / "logs" / "envsetup" / "report.json").read_text())
    torchao = next(d for d in report["plan"] if d["name"] == "torchao")
    assert torchao["requirement"] == f"torchao=={torchao_release(version('torch'))}", torchao
    assert report["outcome"]["torchao"] == "installed", report["outcome"]
    assert report["verify"]["torchao"].startswith(f"ok {version('torchao')}"), report["verify"]

    # The pod's outputs are not code: a later sync must leave them alone.
    (remote / "runs" / "r0").mkdir(parents=True)
    (remote / "runs" / "r0" / "summary.json").write_text("{}")

    again = cli(world, "deploy", pod.spec, *pod_args(pod), "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    # --json: stdout is one JSON object; the progress lines went to stderr
    outcome = json.loads(again.stdout)
    assert outcome["ok"] is True and outcome["pods"][0]["result"] == "ready"
    assert outcome["pods"][0]["sync"] == "0 files" and outcome["pods"][0]["envsetup"] == "ready"
    assert "sync: 0 files changed" in again.stderr
    assert "requirements  unchanged" in again.stderr and "bitsandbytes  unchanged" in again.stderr
    assert "torchao       unchanged" in again.stderr
    assert "export HF_TOKEN=hf_SECRETvalue123" in env_file.read_text()  # kept without HF_TOKEN set locally

    (world.project / "README.md").write_text((world.project / "README.md").read_text() + "\nchanged\n")
    (world.project / "notes.txt").write_text("new file\n")
    (world.project / "tests" / "test_gpus.py").unlink()
    (world.project / ".podignore").write_text("scratch/\n")
    (world.project / "scratch").mkdir()
    (world.project / "scratch" / "huge.bin").write_bytes(b"x" * 1000)
    (world.project / "runs").mkdir(exist_ok=True)
    (world.project / "runs" / "local.txt").write_text("gitignored\n")
    changed = cli(world, "deploy", pod.spec, *pod_args(pod))
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "sync: 3 files changed" in changed.stdout  # README, notes.txt, .podignore
    assert (remote / "README.md").read_text().endswith("changed\n") and (remote / "notes.txt").exists()
    assert not (remote / "tests" / "test_gpus.py").exists()  # deleted locally -> deleted there
    assert not (remote / "scratch").exists() and not (remote / "runs" / "local.txt").exists()
    assert (remote / "runs" / "r0" / "summary.json").exists()


def test_unknown_host_key_is_refused_then_accepted_and_a_changed_key_refused(world):
    pod = world.pod
    known = world.base / "fresh_known_hosts"
    refused = cli(world, "probe", pod.spec, *pod_args(pod), known_hosts=known)
    line = one_line_error(refused)
    assert "is not in" in line and "--accept-new" in line and "SHA256:" in line
    assert not known.exists()
    accepted = cli(world, "probe", pod.spec, *pod_args(pod), "--accept-new", known_hosts=known)
    assert accepted.returncode == 0, accepted.stderr
    assert "recorded host key" in accepted.stdout and f"[127.0.0.1]:{pod.port} ssh-ed25519" in known.read_text()
    assert cli(world, "probe", pod.spec, *pod_args(pod), known_hosts=known).returncode == 0

    other = keygen(world.base / "other_host_key")
    pub = Path(f"{other}.pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{pod.port} {pub[0]} {pub[1]}\n")
    line = one_line_error(cli(world, "probe", pod.spec, *pod_args(pod), "--accept-new", known_hosts=known))
    assert "CHANGED" in line and "ssh-keygen -R" in line


def test_wrong_key_refused_port_refused_and_silent_server(world):
    pod = world.pod
    wrong = keygen(world.base / "wrong_key")
    args = ["--remote-dir", pod.remote_dir]
    assert "refused the key" in one_line_error(cli(world, "deploy", pod.spec, "--key", str(wrong), *args))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert "connection refused" in one_line_error(cli(world, "deploy", f"root@127.0.0.1:{port}", *args))
    with socket.socket() as silent:  # accepts TCP, never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        line = one_line_error(cli(world, "deploy", f"root@127.0.0.1:{silent.getsockname()[1]}", "--timeout", "2", *args))
    assert "did not answer" in line or "no answer" in line
    assert "not a number" in one_line_error(cli(world, "deploy", "root@host:abc"))
    assert "does not exist on the pod" in one_line_error(
        cli(world, "deploy", pod.spec, "--key", str(pod.client_key), "--python", "/nonexistent/python3", *args))


def test_deploy_with_a_python_that_cannot_serve_is_one_line_and_writes_nothing(world):
    """--python naming a file on the pod that exists but cannot be the image's python (execute bit off, a
    directory, a wrapper that fails, a Python without torch): one line saying what is wrong with it, exit 2,
    before anything is written there. It was "does not exist", or the probe traded it silently for another
    interpreter and deploy went on to fail in envsetup (exit 1)."""
    pod = world.pod
    remote = world.base / "pod-side" / "bad-python"
    for expect, python in unusable_pythons(world.base / "pod-pythons").items():
        line = one_line_error(cli(world, "deploy", pod.spec, "--key", str(pod.client_key), "--remote-dir", str(remote),
                                  "--python", str(python)))
        assert line.startswith(f"error: python {python} {expect}") and "on the pod" in line, line
        assert "--python" in line and "leave it out" in line, line
        assert not remote.exists()


def _partial(directory: Path, name: str) -> bool:
    if not directory.exists():
        return False
    return any(p.name.startswith(f".{name}.") or p.parent.name == ".rsync-partial" for p in directory.rglob("*"))


def test_dropped_connection_mid_sync_then_rerun_completes(world):
    pod, remote = world.pod, Path(world.pod.remote_dir)
    big = world.project / "data.bin"
    big.write_bytes(os.urandom(12 * 2**20))
    argv = [str(world.project / "bin" / "pod"), "deploy", "--known-hosts", str(world.known_hosts), "--bwlimit", "1500",
            pod.spec, *pod_args(pod)]
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: _partial(remote, "data.bin")), "the transfer never started"
    time.sleep(1.0)
    pod.drop_connections()
    out, err = proc.communicate(timeout=120)
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    assert "dropped" in one_line_error(result) and not (remote / "data.bin").exists()
    rerun = cli(world, "deploy", pod.spec, *pod_args(pod))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert sha(remote / "data.bin") == sha(big)
    assert not (remote / ".rsync-partial").exists()
    big.unlink()


@pytest.mark.slow
def test_a_silent_cut_mid_sync_is_noticed_then_a_rerun_completes(world):
    """No reset, no closed session: the pod's link just stops answering (a stopped pod, an outage).
    The kernel drops the connection after 3x --timeout of unacknowledged data, not TCP's ~15 min."""
    why = NamespacePod.available()
    if why:
        pytest.skip(why)
    pod = NamespacePod(world.base, "silent", subnet=7).start()
    try:
        with open(world.known_hosts, "a") as f:
            f.write(pod.known_hosts_line())
        big = world.project / "data.bin"
        big.write_bytes(os.urandom(12 * 2**20))
        remote = Path(pod.remote_dir)
        argv = [str(world.project / "bin" / "pod"), "deploy", "--known-hosts", str(world.known_hosts), "--bwlimit", "1500",
                "--timeout", "2", pod.spec, *pod_args(pod)]
        proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: _partial(remote, "data.bin")), "the transfer never started"
        time.sleep(1.0)
        pod.cut()
        cut_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        noticed = time.monotonic() - cut_at
        assert "dropped" in one_line_error(subprocess.CompletedProcess(argv, proc.returncode, out, err))
        assert noticed < 60, f"took {noticed:.0f} s to notice the dead link"
        pod.restore()
        rerun = cli(world, "deploy", pod.spec, *pod_args(pod), timeout=600)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert sha(remote / "data.bin") == sha(big)
    finally:
        pod.stop()
        (world.project / "data.bin").unlink(missing_ok=True)


def test_dropped_connection_mid_fetch_then_rerun_never_overwrites_newer_local(world):
    pod, remote = world.pod, Path(world.pod.remote_dir)
    run = remote / "runs" / "big-run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "memory_snapshot.pickle").write_bytes(os.urandom(12 * 2**20))
    (run / "summary.json").write_text('{"status": "failed"}')
    (remote / "runs" / "r0").mkdir(exist_ok=True)
    (remote / "runs" / "r0" / "summary.json").write_text('{"status": "remote"}')
    os.utime(remote / "runs" / "r0" / "summary.json", (time.time() - 3600, time.time() - 3600))
    local = world.project / "pod-logs" / f"127.0.0.1-{pod.port}"
    (local / "runs" / "r0").mkdir(parents=True, exist_ok=True)
    (local / "runs" / "r0" / "summary.json").write_text('{"status": "edited locally"}')

    argv = [str(world.project / "bin" / "pod"), "fetch-logs", "--known-hosts", str(world.known_hosts), "--bwlimit", "1500",
            pod.spec, *pod_args(pod)]
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: _partial(local / "runs" / "big-run", "memory_snapshot.pickle")), "the fetch never started"
    time.sleep(1.0)
    pod.drop_connections()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "dropped" in (out + err), out + err
    again = cli(world, "fetch-logs", pod.spec, *pod_args(pod))
    assert again.returncode == 0, again.stdout + again.stderr
    assert sha(local / "runs" / "big-run" / "memory_snapshot.pickle") == sha(run / "memory_snapshot.pickle")
    assert (local / "runs" / "big-run" / "summary.json").read_text() == '{"status": "failed"}'
    assert (local / "runs" / "r0" / "summary.json").read_text() == '{"status": "edited locally"}'
    assert (local / "logs" / "probe.json").exists() and not (local / ".podkit").exists()
    assert not list(local.rglob(".rsync-partial"))
    # an unchanged re-fetch moves nothing
    assert "0 files changed" in cli(world, "fetch-logs", pod.spec, *pod_args(pod)).stdout
    import shutil
    shutil.rmtree(run)


def test_fetch_never_replaces_a_local_file_podkit_did_not_fetch(world):
    """A fetched file the user then edited, or a file the user put there, stays as it is even when the pod's
    copy is newer (over rsync and over SFTP); podkit's own untouched copies keep updating; the report
    names what was kept."""
    from podkit.pods.fetch import RECORD, fetch_sftp, theirs

    pod, remote = world.pod, Path(world.pod.remote_dir)
    run = remote / "runs" / "keep-run"
    run.mkdir(parents=True, exist_ok=True)
    names = ["train.log", "notes [draft]*.txt", "grown.log", "café.log"]  # the user edits the first two
    for name in names:
        (run / name).write_text("pod v1\n")
    local = world.project / "pod-logs" / f"127.0.0.1-{pod.port}"
    mine = local / "runs" / "keep-run" / "mine.txt"  # the user's own, no pod copy
    first = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--json")
    assert first.returncode == 0, first.stderr
    assert (local / "runs" / "keep-run" / "train.log").read_text() == "pod v1\n"
    # runs/r0/ and its summary.json: the user's, there before podkit's first fetch (the test above)
    theirs_before = ["runs/r0/", "runs/r0/summary.json"]
    assert (local / RECORD).exists() and json.loads(first.stdout)["pods"][0]["kept"] == theirs_before

    # the user edits two fetched files (one with rsync's wildcard characters in its name) and adds one
    for name in names[:2]:
        (local / "runs" / "keep-run" / name).write_text("my notes\n")
    mine.write_text("mine\n")
    later = time.time() + 60  # the pod's copies all newer than the local edits: the old --update rule lets them in
    for name in names:
        (run / name).write_text("pod v2\n")
        os.utime(run / name, (later, later))
    (run / "mine.txt").write_text("pod's mine\n")
    os.utime(run / "mine.txt", (later, later))

    second = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--json")
    assert second.returncode == 0, second.stderr
    kept = json.loads(second.stdout)["pods"][0]["kept"]
    assert kept == sorted([*theirs_before, *(f"runs/keep-run/{n}" for n in [*names[:2], "mine.txt"])]), kept
    assert "kept 5 local path(s)" in second.stderr and "move them away" in second.stderr
    for name in names[:2]:
        assert (local / "runs" / "keep-run" / name).read_text() == "my notes\n", name
    assert mine.read_text() == "mine\n"
    for name in names[2:]:  # podkit's own copies, a name rsync prints escaped among them: updated
        assert (local / "runs" / "keep-run" / name).read_text() == "pod v2\n", name

    # the same rules without rsync on the pod
    (run / "grown.log").write_text("pod v3\n")
    os.utime(run / "grown.log", (later + 60, later + 60))
    with PodConnection(resolve(parse_host(pod.spec, key=str(pod.client_key))), known_hosts=world.known_hosts) as conn:
        stats = fetch_sftp(conn, pod.remote_dir, local, theirs(local))
    assert stats.files == 1 and (local / "runs" / "keep-run" / "grown.log").read_text() == "pod v3\n"
    assert (local / "runs" / "keep-run" / names[1]).read_text() == "my notes\n" and mine.read_text() == "mine\n"

    # moved away, the pod's copy comes back and is podkit's again
    mine.unlink()
    third = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--json")
    assert mine.read_text() == "pod's mine\n" and "runs/keep-run/mine.txt" not in json.loads(third.stdout)["pods"][0]["kept"]

    # a directory the user made where the pod has a file is theirs too: not replaced, named with a slash
    (run / "plots").write_text("pod's file\n")
    (local / "runs" / "keep-run" / "plots").mkdir()
    fourth = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--json")
    assert fourth.returncode == 0 and "runs/keep-run/plots/" in json.loads(fourth.stdout)["pods"][0]["kept"]
    assert (local / "runs" / "keep-run" / "plots").is_dir()

    # a damaged record, however it is damaged, is one clear line, exit 2, and nothing moves
    record = (local / RECORD).read_text()
    for damaged in ("{", '{"files": []}', '{"files": {"runs/x": 3}}', "[]"):
        (local / RECORD).write_text(damaged)
        broken = cli(world, "fetch-logs", pod.spec, *pod_args(pod))
        assert broken.returncode == 2 and "is damaged" in broken.stderr and "Traceback" not in broken.stderr, damaged
    (local / RECORD).write_text(record)
    # a record that cannot be written: the files still came back, the failure is one line and exit 2
    (local / (RECORD + ".tmp")).mkdir()
    unwritable = cli(world, "fetch-logs", pod.spec, *pod_args(pod))
    assert unwritable.returncode == 2 and "could not be written" in one_line_error(unwritable)
    (local / (RECORD + ".tmp")).rmdir()
    shutil.rmtree(run)


def test_fetch_keeps_an_edit_made_while_it_ran_and_refuses_a_symlinked_runs(world):
    """A file the user edits while a fetch is running is not adopted as podkit's (so the next fetch keeps it);
    a runs/ that is the user's symlink is refused in one line, and stays as it was."""
    from podkit.pods.fetch import RECORD

    pod, remote = world.pod, Path(world.pod.remote_dir)
    run = remote / "runs" / "race-run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "notes.log").write_text("pod v1\n")
    args = ["--dest", str(world.base / "race-logs"), *pod_args(pod)]
    dest = world.base / "race-logs" / f"127.0.0.1-{pod.port}"
    # runs/ here is the user's symlink to another disk: refused, left as it is
    elsewhere = world.base / "bigdisk-runs"
    elsewhere.mkdir(exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "runs").symlink_to(elsewhere)
    line = one_line_error(cli(world, "fetch-logs", pod.spec, *args))
    assert "is a symlink" in line and "--dest" in line, line
    assert (dest / "runs").is_symlink() and not any(elsewhere.iterdir())
    (dest / "runs").unlink()
    elsewhere = dest / "runs"  # a real directory from here on
    assert cli(world, "fetch-logs", pod.spec, *args).returncode == 0
    assert (elsewhere / "race-run" / "notes.log").read_text() == "pod v1\n"

    (run / "big.bin").write_bytes(os.urandom(3 * 2**20))
    argv = [str(world.project / "bin" / "pod"), "fetch-logs", "--known-hosts", str(world.known_hosts),
            "--bwlimit", "300", pod.spec, *args]
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: _partial(elsewhere / "race-run", "big.bin"), 60), "the slow fetch never started"
    (elsewhere / "race-run" / "notes.log").write_text("MY EDIT\n")  # while it runs
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert "runs/race-run/notes.log" not in json.loads((dest / RECORD).read_text())["files"]
    later = time.time() + 60
    (run / "notes.log").write_text("pod v2\n")
    os.utime(run / "notes.log", (later, later))
    again = cli(world, "fetch-logs", pod.spec, *args, "--json")
    assert "runs/race-run/notes.log" in json.loads(again.stdout)["pods"][0]["kept"]
    assert (elsewhere / "race-run" / "notes.log").read_text() == "MY EDIT\n"
    shutil.rmtree(run)


def _updated_then_all_fetched(world, args: list[str], run: Path, here: Path, summary: str, big: str) -> None:
    """The pod updates the run's `summary` after a cut fetch: the rerun keeps nothing as the user's, brings the
    update and the rest (`big`) whole."""
    later = time.time() + 60
    (run / summary).write_text('{"status": "pass"}\n')
    os.utime(run / summary, (later, later))
    again = cli(world, "fetch-logs", world.pod.spec, *args, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["pods"][0]["kept"] == [], again.stdout
    assert (here / summary).read_text() == '{"status": "pass"}\n'
    assert (here / big).read_bytes() == (run / big).read_bytes()


def test_fetch_review_2026_11_25(world):
    """Review 2026-11-25 of fetch-logs, each against this loopback pod: a user's file where runs/ or DEST/<pod> goes
    was replaced (or a traceback); two fetches at once lost the record of what the first brought; SIGTERM mid-fetch
    left what had arrived unrecorded, so the next fetch kept it as the user's and never brought its update; Ctrl-C
    under --json printed no object; over SFTP a pod's symlink was followed (its target copied); a name that is a
    file on the pod and a directory here failed every fetch with rsync's summary line only."""
    from podkit.pods.fetch import RECORD, fetch

    pod, remote = world.pod, Path(world.pod.remote_dir)
    base = world.base / "fetch-review"
    args = ["--dest", str(base), *pod_args(pod)]
    local = base / f"127.0.0.1-{pod.port}"
    run = remote / "runs" / "rv"
    run.mkdir(parents=True, exist_ok=True)
    (run / "a_summary.json").write_text('{"status": "running"}\n')
    (run / "b_big.bin").write_bytes(os.urandom(3 * 2**20))

    # a user's file where runs/ goes, or where DEST/<pod> goes: refused before connecting, left as it was
    local.mkdir(parents=True)
    (local / "runs").write_text("MY NOTES\n")
    assert "is a file of yours where the pod's runs/ directory goes" in one_line_error(cli(world, "fetch-logs",
                                                                                          pod.spec, *args))
    assert (local / "runs").read_text() == "MY NOTES\n"
    (local / "runs").unlink()
    local.rmdir()
    local.write_text("mine\n")
    out = cli(world, "fetch-logs", pod.spec, *args, "--json")
    assert "is a file, not a directory" in one_line_error(out) and json.loads(out.stdout)["ok"] is False
    local.unlink()

    # SIGTERM mid-fetch: what arrived is recorded as podkit's; the rerun brings the rest and the summary's update
    argv = [str(world.project / "bin" / "pod"), "fetch-logs", "--known-hosts", str(world.known_hosts),
            "--bwlimit", "300", pod.spec, *args]
    proc = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: _partial(local / "runs" / "rv", "b_big.bin"), 60), "the slow fetch never started"
    # a second fetch of the same pod meanwhile is refused, and leaves the first's record alone
    assert "another fetch-logs is writing" in one_line_error(cli(world, "fetch-logs", pod.spec, *args))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130, proc.returncode
    assert "runs/rv/a_summary.json" in json.loads((local / RECORD).read_text())["files"]
    _updated_then_all_fetched(world, args, run, local / "runs" / "rv", "a_summary.json", "b_big.bin")

    # Ctrl-C under --json: the one object still comes, saying so
    (run / "c_big.bin").write_bytes(os.urandom(3 * 2**20))
    proc = subprocess.Popen([*argv, "--json"], cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert wait_for(lambda: _partial(local / "runs" / "rv", "c_big.bin"), 60), "the slow fetch never started"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and json.loads(out)["interrupted"] is True, out + err

    # over SFTP a pod's symlink comes back as a link, its target (outside the project) never read
    secret = world.base / "outside-secret.txt"
    secret.write_text("SECRET\n")
    (run / "link").symlink_to(secret)
    with PodConnection(resolve(parse_host(pod.spec, key=str(pod.client_key))), known_hosts=world.known_hosts) as conn:
        fetch(conn, pod.remote_dir, local, rsync_on_pod=False)
    assert (local / "runs" / "rv" / "link").is_symlink()
    assert os.readlink(local / "runs" / "rv" / "link") == str(secret)
    (run / "link").unlink()

    # a fetched directory that is a file on the pod now: named, not rsync's summary line
    (run / "sub").mkdir()
    (run / "sub" / "a.txt").write_text("x\n")
    assert cli(world, "fetch-logs", pod.spec, *args).returncode == 0
    shutil.rmtree(run / "sub")
    (run / "sub").write_text("now a file\n")
    (remote / "logs" / "after-blocked.log").write_text("still fetched\n")  # "the rest was": logs/ too
    line = one_line_error(cli(world, "fetch-logs", pod.spec, *args))
    assert "runs/rv/sub is a file on one side and a directory on the other" in line, line
    assert (local / "logs" / "after-blocked.log").read_text() == "still fetched\n"
    (remote / "logs" / "after-blocked.log").unlink()
    shutil.rmtree(run)


def test_fetch_onto_a_full_disk_still_records_what_came_back(world, tmp_path):
    """Review 2026-11-25: a fetch stopped by a full disk could not write its record either (rsync's partial file
    held the space), so after freeing space the rerun kept what had come back as the user's and never fetched the
    rest or its updates. The partial files are dropped to make room for the record."""
    from podkit.pods.fetch import RECORD

    pod, remote = world.pod, Path(world.pod.remote_dir)
    dest = tmp_path / "small-disk"
    dest.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(dest)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 3 MiB tmpfs to fill (needs root and CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    run = remote / "runs" / "full"
    try:
        run.mkdir(parents=True, exist_ok=True)
        (run / "a1.json").write_text('{"status": "running"}\n')
        (run / "z_big.bin").write_bytes(os.urandom(5 * 2**20))
        args = ["--dest", str(dest), *pod_args(pod)]
        local = dest / f"127.0.0.1-{pod.port}"
        full = cli(world, "fetch-logs", pod.spec, *args)
        assert "the disk is full" in one_line_error(full)
        assert "runs/full/a1.json" in json.loads((local / RECORD).read_text())["files"]
        subprocess.run(["mount", "-o", "remount,size=16m", str(dest)], check=True)
        _updated_then_all_fetched(world, args, run, local / "runs" / "full", "a1.json", "z_big.bin")
    finally:
        subprocess.run(["umount", str(dest)], check=False)
        shutil.rmtree(run, ignore_errors=True)


def _pod_with_linked_runs(world, name: str) -> tuple[Path, Path]:
    """A project directory on the pod whose runs/ is a symlink to a directory outside it, as RunPod users link
    runs/ to the /workspace volume: one run with two files, a symlink to the project's .podkit/env (secrets) and
    a relative one; logs/ a real directory with one log. Its own directory, so the module's pod is left alone."""
    remote, volume = world.base / "pod-side" / name, world.base / "volume" / name / "runs"
    run = volume / "r1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "pass"}\n')
    (run / "notes.log").write_text("pod v1\n")
    (remote / ".podkit").mkdir(parents=True)
    (remote / ".podkit" / "env").write_text("export HF_TOKEN=hf_LINKEDsecret\n")
    (run / "env").symlink_to(remote / ".podkit" / "env")
    (run / "latest").symlink_to("summary.json")
    (remote / "runs").symlink_to(volume)
    (remote / "logs").mkdir()
    (remote / "logs" / "job.log").write_text("ran\n")
    return remote, volume


def _fetch_args(world, remote: Path, dest: Path, pod: LoopbackPod | None = None) -> list[str]:
    return ["--key", str((pod or world.pod).client_key), "--remote-dir", str(remote), "--python", sys.executable,
            "--dest", str(dest)]


@pytest.fixture(scope="module")
def no_rsync_pod(world):
    """A second loopback pod whose PATH holds every command but rsync (links in a directory of its own, set by
    BASH_ENV, which every non-interactive bash there reads): fetch-logs goes over SFTP to it, as to an image
    without rsync. Trusted in world's known_hosts."""
    base = world.base / "no-rsync"
    tools = base / "bin"
    tools.mkdir(parents=True)
    for directory in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if name != "rsync" and not (tools / name).exists():
                (tools / name).symlink_to(Path(directory) / name)
    rc = base / "rc"
    rc.write_text(f"PATH={tools}; export PATH\n")
    pod = LoopbackPod(base, "pod", extra_config=f"SetEnv BASH_ENV={rc}\n").start()
    with open(world.known_hosts, "a") as known:
        known.write(pod.known_hosts_line())
    with PodConnection(resolve(parse_host(pod.spec, key=str(pod.client_key))), known_hosts=world.known_hosts) as conn:
        assert not conn.run("command -v rsync").ok, "rsync still reachable on the SFTP pod"
    yield pod
    pod.stop()


def _followed(local: Path, remote: Path) -> None:
    """What came back of _pod_with_linked_runs: runs/ a real directory of regular files, its links still links
    (the secret's never followed), logs/ too; each recorded as podkit's."""
    from podkit.pods.fetch import RECORD

    r1 = local / "runs" / "r1"
    assert not (local / "runs").is_symlink() and r1.is_dir() and not r1.is_symlink()
    for name, text in (("summary.json", '{"status": "pass"}\n'), ("notes.log", "pod v1\n")):
        assert not (r1 / name).is_symlink() and (r1 / name).read_text() == text, name
    assert (r1 / "env").is_symlink() and os.readlink(r1 / "env") == str(remote / ".podkit" / "env")
    assert (r1 / "latest").is_symlink() and os.readlink(r1 / "latest") == "summary.json"
    assert (local / "logs" / "job.log").read_text() == "ran\n"
    for dirpath, _, filenames in os.walk(local):
        for name in filenames:
            path = Path(dirpath) / name
            assert path.is_symlink() or "hf_LINKEDsecret" not in path.read_text(errors="replace"), path
    record = json.loads((local / RECORD).read_text())["files"]
    assert {"runs/r1", "runs/r1/summary.json", "runs/r1/notes.log", "runs/r1/env", "runs/r1/latest",
            "logs/job.log"} <= set(record), sorted(record)


@pytest.mark.parametrize("rsync_on_pod", [True, False], ids=["rsync", "sftp"])
def test_fetch_follows_a_runs_that_is_a_symlink_on_the_pod(world, rsync_on_pod):
    """runs/ on the pod a symlink to a directory outside the project: its files come back as regular files under
    pod-logs/<pod>/runs/, a link inside it as a link. rsync's one transfer of the project directory matched
    /runs/*** only as a directory, so it skipped the link, brought nothing of the runs, and reported success.
    SFTP already followed it; both now say in one line when runs/ is a symlink to nothing, after logs/ came back."""
    from podkit.pods.errors import PodError
    from podkit.pods.fetch import fetch

    name = "linked-" + ("rsync" if rsync_on_pod else "sftp")
    remote, volume = _pod_with_linked_runs(world, name)
    local = world.base / f"{name}-logs" / "pod"
    with PodConnection(resolve(parse_host(world.pod.spec, key=str(world.pod.client_key))),
                       known_hosts=world.known_hosts) as conn:
        stats = fetch(conn, str(remote), local, rsync_on_pod=rsync_on_pod)
        assert stats.files == (3 if rsync_on_pod else 5), stats  # rsync counts regular files only, SFTP links too
        _followed(local, remote)
        assert fetch(conn, str(remote), local, rsync_on_pod=rsync_on_pod).files == 0  # nothing moves again

        # the volume not mounted: runs/ a symlink to nothing. One line, after logs/ came back; the local copy stays
        (remote / "runs").unlink()
        (remote / "runs").symlink_to(world.base / "volume" / name / "not-mounted")
        (remote / "logs" / "later.log").write_text("later\n")
        with pytest.raises(PodError) as raised:
            fetch(conn, str(remote), local, rsync_on_pod=rsync_on_pod)
    assert "runs on the pod is a symlink to" in str(raised.value) and "does not exist" in str(raised.value)
    assert "(logs/ did)" in str(raised.value), str(raised.value)
    assert (local / "logs" / "later.log").read_text() == "later\n"
    assert (local / "runs" / "r1" / "summary.json").read_text() == '{"status": "pass"}\n'


def test_fetch_of_a_pod_runs_that_is_a_symlink_to_nothing_or_a_file_is_one_line(world):
    """bin/pod fetch-logs when runs/ on the pod is not a directory: one line naming it and what it points to,
    exit 2, --json's ok false, and logs/ still fetched; runs/ missing altogether is nothing to fetch, exit 0."""
    remote, volume = _pod_with_linked_runs(world, "linked-broken")
    dest = world.base / "linked-broken-logs"
    args = _fetch_args(world, remote, dest)
    local = dest / f"127.0.0.1-{world.pod.port}"
    (remote / "runs").unlink()
    (remote / "runs").symlink_to(volume / "gone")
    line = one_line_error(cli(world, "fetch-logs", world.pod.spec, *args))
    assert f"{remote}/runs on the pod is a symlink to {volume / 'gone'}, which does not exist" in line, line
    assert "(logs/ did)" in line and (local / "logs" / "job.log").read_text() == "ran\n"
    (remote / "runs").unlink()
    (remote / "runs").symlink_to(volume / "r1" / "summary.json")
    out = cli(world, "fetch-logs", world.pod.spec, *args, "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is False and "which is not a directory" in report["pods"][0]["error"], report
    (remote / "runs").unlink()
    (remote / "runs").write_text("not a directory\n")
    assert "runs on the pod is a file, not a directory" in one_line_error(cli(world, "fetch-logs", world.pod.spec,
                                                                                 *args))
    (remote / "runs").unlink()
    missing = cli(world, "fetch-logs", world.pod.spec, *args)
    assert missing.returncode == 0 and "0 files changed" in missing.stdout, missing.stdout + missing.stderr
    assert not (local / "runs").exists()


@pytest.mark.parametrize("transport", ["rsync", "sftp"])
def test_fetch_json_says_what_came_back_when_the_other_top_is_not_a_directory(world, no_rsync_pod, transport):
    """logs/ on the pod a symlink to nothing, runs/ fine: runs/ comes back, then the one error line and exit 2;
    --json's object held only the error, so a script could not tell that runs/ was here. Now it carries what came
    back (files, bytes, kept, dest) beside the error, over rsync and over SFTP."""
    pod = world.pod if transport == "rsync" else no_rsync_pod
    remote, volume = _pod_with_linked_runs(world, f"half-{transport}")
    shutil.rmtree(remote / "logs")
    (remote / "logs").symlink_to(world.base / "volume" / "never-mounted")
    dest = world.base / f"half-{transport}-logs"
    local = dest / f"127.0.0.1-{pod.port}"
    out = cli(world, "fetch-logs", pod.spec, *_fetch_args(world, remote, dest, pod), "--json")
    line = one_line_error(out, notes_before=True)  # under --json, stderr carries the progress lines too
    assert f"{remote}/logs on the pod is a symlink to" in line and "(runs/ did)" in line, line
    report = _strict(out.stdout)
    assert report["ok"] is False and len(report["pods"]) == 1, report
    one = report["pods"][0]
    assert one["ok"] is False and one["error"] == line[len("error: "):], one
    # rsync counts regular files only, SFTP the links too (summary.json, notes.log; env, latest)
    assert one["files"] == (2 if transport == "rsync" else 4) and one["bytes"] > 0, one
    assert one["dest"] == str(local) and one["kept"] == [] and one["seconds"] >= 0, one
    assert one["fetched"] == ["runs"], one  # which top the figures are of
    assert (local / "runs" / "r1" / "summary.json").read_text() == '{"status": "pass"}\n'
    # runs/ dangling too: nothing came back, and the object says only the error (no figures of nothing)
    (remote / "runs").unlink()
    (remote / "runs").symlink_to(world.base / "volume" / "never-mounted")
    none = _strict(cli(world, "fetch-logs", pod.spec, *_fetch_args(world, remote, dest, pod), "--json").stdout)["pods"][0]
    assert none["ok"] is False and "error" in none and not {"fetched", "files", "dest"} & none.keys(), none


@pytest.mark.parametrize("transport", ["rsync", "sftp"])
def test_fetch_from_a_project_directory_the_pod_lacks_is_one_line_on_both_transports(world, no_rsync_pod, transport):
    """--remote-dir naming nothing on the pod (never deployed there, a typo), a symlink to nothing or a file: over
    SFTP the fetch brought nothing and exited 0; over rsync it was rsync's own line about runs/. Both now say which
    directory and what to do, exit 2; --json's pod object has the same error."""
    pod = world.pod if transport == "rsync" else no_rsync_pod
    side = world.base / "pod-side" / f"no-project-{transport}"
    side.mkdir(parents=True)
    (side / "a-file").write_text("not a project\n")
    (side / "a-link").symlink_to(side / "gone")
    dest = world.base / f"no-project-{transport}-logs"
    for name, what in (("never-deployed", "does not exist"), ("a-link", f"is a symlink to {side / 'gone'}, which "
                                                                        "does not exist"),
                       ("a-file", "is a file, not a directory")):
        args = _fetch_args(world, side / name, dest, pod)
        line = one_line_error(cli(world, "fetch-logs", pod.spec, *args))
        assert f"the project directory {side / name} on the pod {what}" in line and "--remote-dir" in line, line
        out = cli(world, "fetch-logs", pod.spec, *args, "--json")
        assert one_line_error(out) == line
        report = _strict(out.stdout)
        assert report["ok"] is False and report["pods"] == [{"pod": f"127.0.0.1-{pod.port}", "ok": False,
                                                             "error": line[len("error: "):]}], report
    assert not list((dest / f"127.0.0.1-{pod.port}").rglob("runs")), "nothing to fetch, nothing made"


def test_fetch_rerun_keeps_a_users_file_inside_a_runs_linked_on_the_pod(world):
    """The user's edit of a fetched file under a runs/ that is a symlink on the pod (and one under logs/) is kept
    when the pod's copy is newer; podkit's own copies next to it update. Each top is its own transfer, so the rule
    that keeps the file is anchored at that top."""
    remote, volume = _pod_with_linked_runs(world, "linked-kept")
    dest = world.base / "linked-kept-logs"
    args = _fetch_args(world, remote, dest)
    local = dest / f"127.0.0.1-{world.pod.port}"
    odd = "notes [v1]*.log"  # rsync's wildcard characters: the re-anchored rule must still match it alone
    (volume / "r1" / odd).write_text("pod v1\n")
    first = cli(world, "fetch-logs", world.pod.spec, *args, "--json")
    assert first.returncode == 0 and json.loads(first.stdout)["pods"][0]["kept"] == [], first.stdout + first.stderr
    _followed(local, remote)

    for path in (local / "runs" / "r1" / "notes.log", local / "runs" / "r1" / odd, local / "logs" / "job.log"):
        path.write_text("MY EDIT\n")
    later = time.time() + 60
    for path in (volume / "r1" / "notes.log", volume / "r1" / odd, volume / "r1" / "summary.json",
                 remote / "logs" / "job.log"):
        path.write_text("pod v2\n")
        os.utime(path, (later, later))
    again = cli(world, "fetch-logs", world.pod.spec, *args, "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout)["pods"][0]["kept"] == ["logs/job.log", f"runs/r1/{odd}", "runs/r1/notes.log"]
    assert (local / "runs" / "r1" / "summary.json").read_text() == "pod v2\n"
    for path in (local / "runs" / "r1" / "notes.log", local / "runs" / "r1" / odd, local / "logs" / "job.log"):
        assert path.read_text() == "MY EDIT\n", path


def test_run_says_which_local_files_changed_since_the_last_deploy(world):
    """The job runs the pod's deployed copy: bin/pod run names the files changed here since that deploy."""
    pod = world.pod
    assert cli(world, "deploy", pod.spec, *pod_args(pod)).returncode == 0
    clean = cli(world, "run", pod.spec, *pod_args(pod), "--json", "--", "true")
    assert clean.returncode == 0 and json.loads(clean.stdout)["changed_since_deploy"] == [], clean.stderr
    assert "since the last deploy" not in clean.stderr
    added = world.project / "my_new_script.py"
    added.write_text("print('not on the pod yet')\n")
    try:
        stale = cli(world, "run", pod.spec, *pod_args(pod), "--json", "--", "true")
        assert stale.returncode == 0, stale.stderr
        assert json.loads(stale.stdout)["changed_since_deploy"] == ["my_new_script.py"]
        assert "1 file(s) of this project changed here since the last deploy (my_new_script.py)" in stale.stderr
        # the hint reaches the pod as this run did: its --remote-dir and --key (PodArgs.again)
        assert f"bin/pod deploy {shlex.join([pod.spec, *pod_args(pod)])} " in stale.stderr, stale.stderr
    finally:
        added.unlink()
    # gone again: nothing differs from what was sent
    again = cli(world, "run", pod.spec, *pod_args(pod), "--json", "--", "true")
    assert json.loads(again.stdout)["changed_since_deploy"] == []

    # where it cannot be told, the job still runs and the answer is null, not []: a damaged record on the pod,
    # a deploy from another checkout, a git index broken here
    sent = Path(pod.remote_dir) / ".podkit" / "sent.json"
    good = sent.read_text()
    checkout = world.project / ".podkit" / "checkout-id"
    broken_git = world.project / ".git"  # a repository whose index git cannot read: `git ls-files` fails
    for case in ("damaged", "elsewhere", "git"):
        if case == "damaged":
            sent.write_text('{"files": [], "origin": null}')
        elif case == "elsewhere":
            sent.write_text(good.replace(checkout.read_text().strip(), "another-checkout"))
        else:
            subprocess.run(["git", "init", "-q", str(world.project)], check=True)
            (broken_git / "index").write_bytes(b"not an index")
        try:
            unknown = cli(world, "run", pod.spec, *pod_args(pod), "--json", "--", "true")
        finally:
            shutil.rmtree(broken_git, ignore_errors=True)
        assert unknown.returncode == 0 and "Traceback" not in unknown.stderr, (case, unknown.stderr)
        assert json.loads(unknown.stdout)["changed_since_deploy"] is None, case
        sent.write_text(good)


def _with_tty_stderr(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run argv with stderr on a pseudo-terminal (where rich draws its bars) and stdout on a pipe."""
    master, slave = os.openpty()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TERM": "xterm-256color", "COLUMNS": "120"}
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(30)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_progress_is_a_rich_bar_on_a_terminal_and_plain_lines_in_a_pipe(world):
    """sync, fetch and install: rich bars on a terminal's stderr, a line per tenth in a pipe; stdout
    holds only --json's object either way."""
    import re

    pod, remote = world.pod, Path(world.pod.remote_dir)
    run = remote / "runs" / "progress-run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "blob.bin").write_bytes(os.urandom(4 * 2**20))
    piped = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--bwlimit", "2000", "--json")
    assert piped.returncode == 0, piped.stderr
    assert _strict(piped.stdout)["pods"][0]["files"] >= 1
    plain = [line for line in piped.stderr.splitlines() if re.match(rf"fetch 127.0.0.1-{pod.port}: +\d+%", line)]
    assert 2 <= len(plain) <= 11 and " 100%" in plain[-1], piped.stderr
    assert all(" runs/ " in line for line in plain), plain  # logs/'s rsync, counting from 0 again, adds no lines
    assert "\r" not in piped.stderr and "\x1b[" not in piped.stderr

    # one rsync per top, each from 0%: on a terminal each is a row of the one fetch, named, never a bar restarting
    (run / "blob.bin").write_bytes(os.urandom(4 * 2**20))
    (remote / "logs").mkdir(exist_ok=True)
    (remote / "logs" / "progress.log").write_text("a job's output\n" * 1000)
    argv = [str(world.project / "bin" / "pod"), "fetch-logs", "--known-hosts", str(world.known_hosts),
            "--bwlimit", "2000", "--json", pod.spec, *pod_args(pod)]
    code, out, tty = _with_tty_stderr(argv, world.project)
    assert code == 0, tty
    assert _strict(out)["pods"][0]["ok"] is True
    assert "━" in tty and "100%" in tty and f"fetch 127.0.0.1-{pod.port}" in tty, tty
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty)
    for top in ("runs/", "logs/"):
        rows = re.findall(rf"fetch 127\.0\.0\.1-{pod.port} {top} .*?(\d+)%", drawn)
        assert rows and rows[-1] == "100", (top, rows, drawn)
    (remote / "logs" / "progress.log").unlink()

    # deploy on a terminal: the sync bar and the pod's install bar (envsetup's [k/n] step lines)
    (world.project / "notes-progress.txt").write_text(os.urandom(2**20).hex())
    argv = [str(world.project / "bin" / "pod"), "deploy", "--known-hosts", str(world.known_hosts), "--json",
            pod.spec, *pod_args(pod)]
    code, out, tty = _with_tty_stderr(argv, world.project)
    assert code == 0, tty
    assert _strict(out)["pods"][0]["result"] == "ready"
    tty = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty)  # rich's colours and cursor moves
    assert re.search(r"sync\s+━+", tty) and re.search(r"install: done\s+━+\s+100%", tty), tty
    assert "[1/" not in tty  # the step lines became the bar, not text
    assert "envsetup: ready in" in tty
    shutil.rmtree(run)
    (world.project / "notes-progress.txt").unlink()


def test_detached_smoke_survives_the_client_being_killed_and_is_fetched(world):
    pod = world.pod
    argv = [str(world.project / "bin" / "pod"), "run", "--known-hosts", str(world.known_hosts), *pod_args(pod),
            "--id", "smoke-1", pod.spec, "--", "bin/smoke", "--steps", "40", "--run-id", "detached-smoke"]
    client = subprocess.Popen(argv, cwd=world.project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(client.stdout), daemon=True)
    reader.start()
    assert wait_for(lambda: any("smoke" in line for line in seen), 60), "no output streamed: " + "".join(seen)
    client.send_signal(signal.SIGKILL)  # the laptop's client dies...
    client.wait()
    pod.drop_connections()  # ...and its SSH session with it
    log = Path(pod.remote_dir) / "logs" / "jobs" / "smoke-1"
    assert not (log / "exit_code").exists(), "the run should still be going"
    attached = cli(world, "attach", pod.spec, *pod_args(pod), "smoke-1", timeout=300)
    assert attached.returncode == 0, attached.stdout[-2000:] + attached.stderr
    assert "pass" in attached.stdout
    listed = cli(world, "jobs", pod.spec, *pod_args(pod))
    assert "smoke-1" in listed.stdout and "exited 0" in listed.stdout
    as_json = json.loads(cli(world, "jobs", pod.spec, *pod_args(pod), "--json").stdout)
    assert any(j["id"] == "smoke-1" and j["exit_code"] == 0 for j in as_json["jobs"]), as_json
    fetched = cli(world, "fetch-logs", pod.spec, *pod_args(pod), "--json")
    assert fetched.returncode == 0, fetched.stderr
    report = json.loads(fetched.stdout)
    assert report["ok"] is True and report["pods"][0]["files"] > 0 and "fetch-logs:" in fetched.stderr
    local = world.project / "pod-logs" / f"127.0.0.1-{pod.port}"
    summary = (local / "runs" / "detached-smoke" / "summary.json").read_text()
    assert '"status": "pass"' in summary
    assert (local / "logs" / "jobs" / "smoke-1" / "exit_code").read_text().strip() == "0"
    assert "pass" in (local / "logs" / "jobs" / "smoke-1" / "output.log").read_text()


def test_a_failing_detached_command_reports_its_exit_code(world):
    pod = world.pod
    out = cli(world, "run", *pod_args(pod), pod.spec, "--", "bash", "-c", "echo about to fail; exit 7")
    assert out.returncode == 7 and "about to fail" in out.stdout


def test_two_pods_at_once_from_an_inventory_group(world):
    b = LoopbackPod(world.base, "b").start()
    try:
        with open(world.known_hosts, "a") as f:
            f.write(b.known_hosts_line())
        inventory = world.project / "pods.toml"
        inventory.write_text(
            f'[pods.a]\nhost = "{world.pod.spec}"\nkey = "{world.pod.client_key}"\nremote_dir = "{world.pod.remote_dir}"\n'
            f'python = "{sys.executable}"\n'
            f'[pods.b]\nhost = "ssh {b.user}@127.0.0.1 -p {b.port} -i {b.client_key}"\nremote_dir = "{b.remote_dir}"\n'
            f'python = "{sys.executable}"\n[groups]\nboth = ["a", "b"]\n')
        out = cli(world, "deploy", "both")
        assert out.returncode == 0, out.stdout + out.stderr
        assert any(line.startswith("[a] ") for line in out.stdout.splitlines())
        assert any(line.startswith("[b] ") for line in out.stdout.splitlines())
        table = out.stdout.split("\n\n")[-1]
        assert table.count("ready") >= 2 and "a " in table and "b " in table
        assert (Path(b.remote_dir) / "bin" / "smoke").exists()
    finally:
        b.stop()
        (world.project / "pods.toml").unlink(missing_ok=True)


def test_remote_disk_full_is_one_line_and_a_rerun_after_freeing_space_completes(world, tmp_path):
    pod = world.pod
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]).returncode:
        pytest.skip("needs root and tmpfs mounts to make a small disk")
    try:
        args = ["--key", str(pod.client_key), "--remote-dir", str(mount / "project"), "--python", sys.executable]
        line = one_line_error(cli(world, "deploy", pod.spec, *args))
        assert "disk is full" in line
        # the check deploy falls back on when rsync's own message is lost
        with PodConnection(resolve(parse_host(pod.spec, key=str(pod.client_key))), known_hosts=world.known_hosts) as conn:
            assert remote_disk_full(conn, str(mount / "project")) and not remote_disk_full(conn, pod.remote_dir)
        subprocess.run(["mount", "-o", "remount,size=512m", str(mount)], check=True)
        rerun = cli(world, "deploy", pod.spec, *args)
        # set up completely; preflight then rightly says 512 MiB cannot hold a checkpoint
        assert "envsetup: ready in" in rerun.stdout and "envsetup: envsetup:" not in rerun.stdout, rerun.stdout + rerun.stderr
        assert rerun.returncode == 1 and "disk.free" in rerun.stdout, rerun.stdout + rerun.stderr
        assert (mount / "project" / "bin" / "smoke").exists() and (mount / "project" / ".venv" / "bin" / "python").exists()
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_generated_job_ids_differ_within_one_second():
    from podkit.pods import jobs

    ids = {jobs.new_id("python train.py --steps 10") for _ in range(20)}
    assert len(ids) == 20, ids  # a loop of `bin/pod run --detach` starts several in the same second
    assert all(jobs.valid_id(i) and "-python-" in i for i in ids)
