"""~/.ssh/config as OpenSSH honours it, against real sshd servers on loopback (issue 12, item 7):
ProxyJump through a second sshd, and a passphrase-protected key served by a real ssh-agent."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sshd_harness import LoopbackPod, pod_cli, project_copy, sshd_available

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    base = tmp_path_factory.mktemp("ssh")
    jump, target = LoopbackPod(base, "jump").start(), LoopbackPod(base, "target").start()
    project = project_copy(base / "laptop" / "podkit")
    known = base / "known_hosts"
    known.write_text(jump.known_hosts_line() + target.known_hosts_line())
    config = base / "ssh_config"
    config.write_text(f"Host jumpbox\n  HostName 127.0.0.1\n  Port {jump.port}\n  User {jump.user}\n"
                      f"  IdentityFile {jump.client_key}\n"
                      f"Host behind-jump\n  HostName 127.0.0.1\n  Port {target.port}\n  User {target.user}\n"
                      f"  IdentityFile {target.client_key}\n  ProxyJump jumpbox\n")
    yield base, jump, target, project, known, config
    jump.stop()
    target.stop()


def test_proxyjump_goes_through_the_jump_host(pods):
    base, jump, target, project, known, config = pods
    args = ["--ssh-config", str(config), "--remote-dir", target.remote_dir, "--python", sys.executable]
    out = pod_cli(project, "probe", "behind-jump", *args, known_hosts=known)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "behind-jump:" in out.stdout and "Python" in out.stdout
    # the jump is really used: with it down, the target (still up) cannot be reached
    jump.stop()
    try:
        down = pod_cli(project, "probe", "behind-jump", *args, known_hosts=known)
        lines = [line for line in down.stderr.splitlines() if line.strip()]
        assert down.returncode == 2 and len(lines) == 1 and f"127.0.0.1:{jump.port}" in lines[0], down.stderr
    finally:
        jump.start()


def test_a_passphrase_key_is_used_through_ssh_agent_and_without_it_says_so(pods, tmp_path):
    base, _, target, project, known, _ = pods
    locked = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(locked)], check=True)
    with open(target.authorized, "a") as f:
        f.write(Path(f"{locked}.pub").read_text())
    args = ["--key", str(locked), "--remote-dir", target.remote_dir, "--python", sys.executable,
            "--ssh-config", str(tmp_path / "no-config")]
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    no_agent = subprocess.run([str(project / "bin" / "pod"), "probe", "--known-hosts", str(known), target.spec, *args],
                              cwd=project, capture_output=True, text=True, env=env, timeout=120)
    assert no_agent.returncode == 2 and "needs a passphrase" in no_agent.stderr and "ssh-add" in no_agent.stderr
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        askpass = tmp_path / "askpass"
        askpass.write_text("#!/bin/sh\necho 'a passphrase'\n")
        askpass.chmod(0o700)
        for _ in range(50):
            if sock.exists():
                break
            time.sleep(0.1)
        added = subprocess.run(["ssh-add", str(locked)], env={**env, "SSH_AUTH_SOCK": str(sock), "SSH_ASKPASS": str(askpass),
                                                               "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"},
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        assert added.returncode == 0, added.stderr
        with_agent = subprocess.run([str(project / "bin" / "pod"), "probe", "--known-hosts", str(known), target.spec, *args],
                                    cwd=project, capture_output=True, text=True, env={**env, "SSH_AUTH_SOCK": str(sock)},
                                    timeout=120)
        assert with_agent.returncode == 0, with_agent.stdout + with_agent.stderr
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=10)


def test_rsyncs_own_error_is_reported_as_rsyncs_not_as_a_dropped_link(pods, tmp_path):
    """rsync failing by itself while the link is up (here: a read-only runs/ to fetch into) is its own line, not
    "connection dropped". (A project directory missing on the pod, the case this used, is now podkit's own line
    before rsync runs: tests/test_pods.py.)"""
    base, _, target, project, known, _ = pods
    remote = tmp_path / "pod-side"
    (remote / "runs" / "r1").mkdir(parents=True)
    (remote / "runs" / "r1" / "summary.json").write_text("{}\n")
    dest = tmp_path / "fetched"
    readonly = dest / f"127.0.0.1-{target.port}" / "runs"
    readonly.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs (needs root and CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        out = pod_cli(project, "fetch-logs", target.spec, "--key", str(target.client_key), "--remote-dir", str(remote),
                      "--python", sys.executable, "--dest", str(dest), known_hosts=known)
    finally:
        subprocess.run(["umount", str(readonly)], check=False)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "error" in line]
    assert out.returncode == 2 and len(lines) == 1, out.stdout + out.stderr
    assert "Read-only file system" in lines[0] and "rsync: " in lines[0] and "dropped" not in lines[0], lines[0]
