"""ProxyCommand from the ssh config, as SageMaker is reached (SSM's `aws ssm start-session`,
sagemaker-ssh-helper's `sm-ssh start-proxy %h`): the tokens ssh would expand, and a real relay
process (tests/tcp_relay.py, what `nc %h %p` does) carrying podkit's connection to a loopback sshd."""

import subprocess
import sys
from pathlib import Path

import pytest

from podkit.pods.errors import PodError
from podkit.pods.hosts import expand_tokens, parse_host, resolve
from sshd_harness import LoopbackPod, keygen, pod_cli, project_copy, sshd_available

RELAY = Path(__file__).with_name("tcp_relay.py")

# sagemaker-ssh-helper's ssh config (its README, section "~/.ssh/config", v2.2.0)
SM_SSH_CONFIG = """Host *.studio.sagemaker
  User sagemaker-user

Host *.*.sagemaker
  IdentityFile ~/.ssh/%h
  PasswordAuthentication no
  ConnectTimeout 120
  ServerAliveInterval 15
  ServerAliveCountMax 8
  ProxyCommand sm-ssh start-proxy %h
  User root
"""


def test_proxycommand_and_identityfile_tokens_expand_as_ssh_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    key = keygen(tmp_path / ".ssh" / "my-nb.notebook.sagemaker")  # IdentityFile ~/.ssh/%h
    config = tmp_path / "config"
    config.write_text(SM_SSH_CONFIG)
    ep = resolve(parse_host("my-nb.notebook.sagemaker"), ssh_config=config)
    assert ep.proxy_command == "sm-ssh start-proxy my-nb.notebook.sagemaker"
    assert ep.key_files == (str(key),) and ep.user == "root" and ep.port == 22
    assert ep.connect_timeout == 120
    # no key file for that name yet: kept, the proxy writes it (sagemaker-ssh-helper's start-proxy does)
    studio = resolve(parse_host("d-abc.studio.sagemaker"), ssh_config=config)
    assert studio.user == "sagemaker-user" and studio.key_files == (str(tmp_path / ".ssh" / "d-abc.studio.sagemaker"),)

    # AWS's SSM line for instances (Systems Manager user guide, "Allow and control permissions for
    # SSH connections through Session Manager"), with every token ProxyCommand takes
    config.write_text("Host i-* mi-*\n  User ec2-user\n  ProxyCommand sh -c \"aws ssm start-session --target %h "
                      "--document-name AWS-StartSSHSession --parameters 'portNumber=%p'\" # %n %r 100%%\n")
    ep = resolve(parse_host("i-0123456789abcdef0"), ssh_config=config)
    assert ep.proxy_command == ("sh -c \"aws ssm start-session --target i-0123456789abcdef0 --document-name "
                                "AWS-StartSSHSession --parameters 'portNumber=22'\" # i-0123456789abcdef0 ec2-user 100%")


def test_an_unknown_token_is_one_line():
    with pytest.raises(PodError, match=r"ProxyCommand 'nc %z 22' has an unknown token %z.*takes %%, %h, %n, %p, %r"):
        expand_tokens("nc %z 22", {"h": "x"}, "hnpr", "ProxyCommand")
    with pytest.raises(PodError, match="ProxyCommand 'nc %' has a lone % at the end"):
        expand_tokens("nc %", {}, "hnpr", "ProxyCommand")


@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_podkit_connects_through_the_proxycommand(tmp_path):
    pod = LoopbackPod(tmp_path, "behind-proxy").start()
    try:
        project = project_copy(tmp_path / "laptop" / "podkit")
        log = tmp_path / "relay.log"
        config = tmp_path / "ssh_config"
        # The name is not a DNS name: only the proxy knows where it is (as with SSM targets).
        config.write_text(f"Host *.notebook.sagemaker\n  User {pod.user}\n  IdentityFile {pod.client_key}\n"
                          f"  ProxyCommand {sys.executable} {RELAY} --log {log} --to {pod.port} %h %p\n")
        known = tmp_path / "known_hosts"
        pub = Path(f"{pod.host_key}.pub").read_text().split()
        known.write_text(f"my-nb.notebook.sagemaker {pub[0]} {pub[1]}\n")  # keyed by the name, port 22, as ssh does
        args = ["--ssh-config", str(config), "--remote-dir", pod.remote_dir, "--python", sys.executable]
        out = pod_cli(project, "probe", "my-nb.notebook.sagemaker", *args, known_hosts=known)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("my-nb.notebook.sagemaker: ") and "Python" in out.stdout
        assert log.read_text() == "my-nb.notebook.sagemaker 22\n"
        relays = subprocess.run(["pgrep", "-f", str(log)], capture_output=True, text=True).stdout.split()
        assert relays == [], "the proxy process outlived podkit's connection"

        # As sagemaker-ssh-helper's proxy behaves: it writes the key ~/.ssh/%h itself, then takes
        # seconds to set up the session; the config's ConnectTimeout covers that, --timeout 1 does not.
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        config.write_text(f"Host *.notebook.sagemaker\n  User {pod.user}\n  IdentityFile ~/.ssh/%h\n  ConnectTimeout 30\n"
                          f"  ProxyCommand {sys.executable} {RELAY} --log {log} --to {pod.port} --delay 3 "
                          f"--key {pod.client_key} ~/.ssh/%h %h %p\n")
        out = pod_cli(project, "probe", "my-nb.notebook.sagemaker", *args, "--timeout", "1", known_hosts=known,
                      env={"HOME": str(home)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert (home / ".ssh" / "my-nb.notebook.sagemaker").read_bytes() == pod.client_key.read_bytes()

        # A proxy that fails (no aws CLI, no SSM plugin, a stopped instance) says so, in one line.
        config.write_text(f"Host *.notebook.sagemaker\n  User {pod.user}\n  IdentityFile {pod.client_key}\n"
                          "  ProxyCommand sh -c 'echo \"aws: command not found\" >&2; exit 127'\n")
        out = pod_cli(project, "probe", "my-nb.notebook.sagemaker", *args, known_hosts=known)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert "ProxyCommand for my-nb.notebook.sagemaker exited 127: aws: command not found" in lines[0], lines[0]
    finally:
        pod.stop()
