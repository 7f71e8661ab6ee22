"""Host specs as users type them: user@host:port, ssh config aliases, pasted RunPod lines, inventories."""

import subprocess
from pathlib import Path

import pytest

from podkit.pods.errors import PodError
from podkit.pods.hosts import load_inventory, parse_host, resolve, select_hosts, Inventory


def test_user_host_port():
    spec = parse_host("root@1.2.3.4:22022")
    assert (spec.user, spec.host, spec.port, spec.name) == ("root", "1.2.3.4", 22022, "1.2.3.4-22022")
    assert parse_host("[::1]:2222").host == "::1" and parse_host("[::1]:2222").port == 2222
    assert parse_host("gpu-box").port is None and parse_host("gpu-box").user is None


def test_pasted_runpod_line(tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("x")
    spec = parse_host(f"ssh root@194.68.245.12 -p 22022 -i {key}")
    assert (spec.user, spec.host, spec.port, spec.key) == ("root", "194.68.245.12", 22022, str(key))
    assert spec.name == "194.68.245.12-22022"
    assert parse_host("ssh -o StrictHostKeyChecking=no -p 40 root@h").port == 40


@pytest.mark.parametrize("text,needle", [
    ("root@1.2.3.4:port", "not a number"),
    ("root@1.2.3.4:70000", "out of range"),
    ("@host", "empty user"),
    ("root@bad host", "contains spaces"),
    ("ssh -L 8080:localhost:80 root@h", "not understood"),
    ("ssh -p", "needs a value"),
    ("ssh root@h ls", "remote command"),
    ("", "empty host"),
    ("root@h;rm", "not a valid host name"),
    ("root@..", "not a valid host name"),  # its pod name would be '..': fetch-logs' DEST/.. (review 2026-11-25)
])
def test_malformed_hosts_give_one_line(text, needle):
    with pytest.raises(PodError) as err:
        parse_host(text)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _key(path, passphrase=""):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True)
    return path


def test_ssh_config_alias_is_resolved_like_openssh(tmp_path):
    key = _key(tmp_path / "k")
    config = tmp_path / "config"
    config.write_text(f"Host my-a100\n  HostName 10.1.2.3\n  User ubuntu\n  Port 2200\n  IdentityFile {key}\n")
    ep = resolve(parse_host("my-a100"), ssh_config=config)
    assert (ep.hostname, ep.port, ep.user, ep.key_files) == ("10.1.2.3", 2200, "ubuntu", (str(key),))
    assert ep.known_hosts_name == "[10.1.2.3]:2200"
    # an explicit user/port beats the config, like ssh's command line does
    ep = resolve(parse_host("root@my-a100:22"), ssh_config=config)
    assert (ep.user, ep.port) == ("root", 22) and ep.known_hosts_name == "10.1.2.3"


def test_include_match_and_bad_values_are_read_as_openssh_reads_them(tmp_path):
    key = _key(tmp_path / "k")
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "pods.conf").write_text(f"Host inc-pod\n  HostName 10.9.9.9\n  Port 2201\n  IdentityFile {key}\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/conf.d/*.conf\n"
                      "Match originalhost matched-pod\n  HostName 10.8.8.8\n  User trainer\n"
                      "Host *\n  Port 2222\n")
    ep = resolve(parse_host("inc-pod"), ssh_config=config)
    assert (ep.hostname, ep.port, ep.key_files) == ("10.9.9.9", 2201, (str(key),))
    ep = resolve(parse_host("matched-pod"), ssh_config=config)
    assert (ep.hostname, ep.user, ep.port) == ("10.8.8.8", "trainer", 2222)
    config.write_text("Host bad\n  Port abc\n")
    with pytest.raises(PodError, match="Bad port 'abc'"):
        resolve(parse_host("bad"), ssh_config=config)


def test_openssh_key_checks_give_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    loose = _key(tmp_path / "loose")
    loose.chmod(0o644)
    with pytest.raises(PodError, match="chmod 600"):
        resolve(parse_host("root@h", key=str(loose)), ssh_config=tmp_path / "none")
    locked = _key(tmp_path / "locked", passphrase="correct horse")
    with pytest.raises(PodError, match="needs a passphrase.*ssh-add"):
        resolve(parse_host("root@h", key=str(locked)), ssh_config=tmp_path / "none")
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 4)
    binary.chmod(0o600)
    with pytest.raises(PodError, match="not a private key"):
        resolve(parse_host("root@h", key=str(binary)), ssh_config=tmp_path / "none")


def test_missing_key_file_is_bad_input(tmp_path):
    with pytest.raises(PodError, match="does not exist"):
        resolve(parse_host("root@h", key=str(tmp_path / "nope")), ssh_config=tmp_path / "none")
    with pytest.raises(PodError, match="is a directory"):
        resolve(parse_host("root@h", key=str(tmp_path)), ssh_config=tmp_path / "none")


def test_a_public_key_given_as_the_key_is_named_so_before_any_advice_on_its_mode(tmp_path):
    """Review 2026-11-25: KEY=id.pub (mode 0644, as ssh-keygen writes it) was told to chmod 600 the public key."""
    pub = Path(str(_key(tmp_path / "k")) + ".pub")
    with pytest.raises(PodError, match=r"is a public key \(give KEY=path to your private key \(the file without .pub\)\)"):
        resolve(parse_host("root@h", key=str(pub)), ssh_config=tmp_path / "none")


def test_inventory_names_groups_and_overrides(tmp_path):
    inv = tmp_path / "pods.toml"
    inv.write_text('[pods.a100]\nhost = "ssh root@1.2.3.4 -p 22022"\nprofile = "runpod"\n'
                   '[pods.box]\nhost = "ubuntu@box.lan"\nremote_dir = "/data/proj"\n'
                   '[groups]\ntrain = ["a100", "box"]\n')
    inventory = load_inventory(inv)
    specs = select_hosts("train", inventory)
    assert [s.name for s in specs] == ["a100", "box"]
    assert specs[0].port == 22022 and specs[0].profile == "runpod" and specs[1].remote_dir == "/data/proj"
    assert [s.name for s in select_hosts("a100,root@5.6.7.8:2", inventory)] == ["a100", "5.6.7.8-2"]
    assert select_hosts("a100", inventory, profile="generic")[0].profile == "generic"
    with pytest.raises(PodError, match="named twice"):
        select_hosts("a100,train", inventory)


@pytest.mark.parametrize("text", ["root@10.0.0.1:2222", "mypod", "ubuntu@box.lan", "root@[::1]:2200",
                                  "ssh root@1.2.3.4 -p 22022"])
def test_reach_names_a_raw_host_so_bin_pod_reaches_it_again(text):
    """A hint's next command names the pod by `reach`: a raw host's `name` is a label ('root@10.0.0.1:2222' is
    '10.0.0.1-2222'), which would be read back as a host of that name on port 22."""
    spec = parse_host(text)
    back = parse_host(spec.reach)
    assert (back.user, back.host, back.port) == (spec.user, spec.host, spec.port), spec.reach


def test_reach_of_an_inventory_pod_is_its_name(tmp_path):
    inv = tmp_path / "pods.toml"
    inv.write_text('[pods.a100]\nhost = "ssh root@1.2.3.4 -p 22022"\n')
    assert select_hosts("a100", load_inventory(inv))[0].reach == "a100"


@pytest.mark.parametrize("text,needle", [
    ('[pods.a]\nhots = "x"\n', "needs host"),
    ('[pods.a]\nhost = "x"\nprofil = "runpod"\n', "unknown key"),
    ('[groups]\ng = ["missing"]\n', "must list pod names"),
    ('[pod.a]\nhost = "x"\n', "unknown section"),
])
def test_bad_inventory(tmp_path, text, needle):
    inv = tmp_path / "pods.toml"
    inv.write_text(text)
    with pytest.raises(PodError, match=needle):
        load_inventory(inv)


def test_no_host_given():
    with pytest.raises(PodError, match="no host given"):
        select_hosts(" ", Inventory())


def test_a_pod_named_only_dots_is_refused(tmp_path):
    """Review 2026-11-25: [pods.".."] fetched into DEST/.., outside pod-logs (runs/ landing in the project's own)."""
    for name in ("..", "."):
        inv = tmp_path / "pods.toml"
        inv.write_text(f'[pods."{name}"]\nhost = "root@127.0.0.1:2222"\n')
        with pytest.raises(PodError, match="not only dots"):
            select_hosts(name, load_inventory(inv))
