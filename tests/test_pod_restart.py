"""A restarted RunPod pod (issue 15 item 3): the fake maps a new public port, the loopback sshd moves
there, and `bin/pod` finds it through the API by pod id, updates pods.toml and checks the host key
against the one pinned to that pod id: the same key is accepted, another is refused."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podkit.pods.hosts import load_inventory
from runpod_fake import FakeRunPod
from sshd_harness import LoopbackPod, free_port, one_line_error, sshd_available

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))

ROOT = Path(__file__).resolve().parents[1]
KEY = "rp_test_key_restart_3c9b"


@pytest.fixture
def world(tmp_path):
    fake = FakeRunPod(key=KEY).start()
    sshd = LoopbackPod(tmp_path, "rp").start()
    fake.ssh_port = sshd.port
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    w = type("World", (), {})()
    w.fake, w.sshd, w.laptop, w.base, w.known_hosts, w.others = fake, sshd, laptop, tmp_path, tmp_path / "known_hosts", []
    yield w
    for pod in [w.sshd, *w.others]:
        pod.stop()
    fake.stop()


def pod(w, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RUNPOD_API_KEY", "PYTHONPATH")}
    env["RUNPOD_API_BASE_URL"] = w.fake.url
    if key:
        env["RUNPOD_API_KEY"] = key
    extra = [] if args[0] == "down" else ["--known-hosts", str(w.known_hosts)]
    out = subprocess.run([str(ROOT / "bin" / "pod"), args[0], *extra, *args[1:]],
                         cwd=w.laptop, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert KEY not in out.stdout + out.stderr
    return out


def probe(w, **kw) -> subprocess.CompletedProcess:
    return pod(w, "probe", "rp", "--python", sys.executable, **kw)


def recorded(w) -> tuple[str, int, str]:
    inv = load_inventory(w.laptop / "pods.toml")
    return inv.pods["rp"].host, inv.pods["rp"].port, inv.raw_pods["rp"]["pod_id"]


def up_and_pin(w) -> str:
    """bin/pod up with --accept-new: the first contact records the host key, pinned to the pod id."""
    up = pod(w, "up", "--gpu", "RTX 4090", "--name", "rp", "--key", str(w.sshd.client_key), "--remote-dir",
             w.sshd.remote_dir, "--poll", "0.05", "--accept-new")
    assert up.returncode == 0, up.stderr
    pod_id = recorded(w)[2]
    assert f"pinned host key ssh-ed25519 SHA256:" in up.stderr and f"podkit-runpod-{pod_id}" in up.stderr
    lines = w.known_hosts.read_text().splitlines()
    host_key = Path(f"{w.sshd.host_key}.pub").read_text().split()[1]
    assert f"[127.0.0.1]:{w.sshd.port} ssh-ed25519 {host_key}" in lines
    assert f"podkit-runpod-{pod_id} ssh-ed25519 {host_key}" in lines
    return pod_id


def move(w, sshd: LoopbackPod) -> int:
    """The pod restarts: its sshd comes back on a new port, which the API now reports."""
    sshd.stop()
    sshd.port = free_port()
    sshd.start()
    return sshd.port


def test_a_restarted_pod_is_found_by_id_and_its_pinned_key_accepted(world):
    pod_id = up_and_pin(world)
    old_port = world.sshd.port
    assert probe(world).returncode == 0
    known = world.known_hosts.read_text()

    new_port = move(world, world.sshd)
    world.fake.restart(pod_id, new_port)
    out = probe(world)  # no --accept-new: the new address is checked against the key pinned to the pod id
    assert out.returncode == 0, out.stderr
    assert f"rp: moved from 127.0.0.1:{old_port} to 127.0.0.1:{new_port} (RunPod re-mapped it after a restart)" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("rp: ")
    assert recorded(world) == ("127.0.0.1", new_port, pod_id)
    text = (world.laptop / "pods.toml").read_text()
    assert text.count("host = ") == 1 and "# bin/pod up" in text  # only the host line changed
    assert world.known_hosts.read_text() == known  # nothing new accepted, nothing rewritten
    # the next command goes straight to the new address
    again = probe(world)
    assert again.returncode == 0 and "moved" not in again.stdout + again.stderr


def test_a_different_host_key_at_the_new_address_is_refused(world):
    pod_id = up_and_pin(world)
    impostor = LoopbackPod(world.base, "impostor").start()  # its own host key, the same client key
    world.others.append(impostor)
    impostor.authorized.write_text(Path(f"{world.sshd.client_key}.pub").read_text())
    world.sshd.stop()
    world.fake.restart(pod_id, impostor.port)
    # even a known_hosts line for the new address does not override the pin (OpenSSH's HostKeyAlias)
    with world.known_hosts.open("a") as f:
        f.write(impostor.known_hosts_line())
    line = one_line_error(probe(world), notes_before=True)
    assert f"host key at 127.0.0.1:{impostor.port}" in line and f"is not the key pinned for podkit-runpod-{pod_id}" in line
    assert "refusing to connect" in line and f"ssh-keygen -R 'podkit-runpod-{pod_id}'" in line
    # and --accept-new does not turn a changed key into a new one
    assert "is not the key pinned" in one_line_error(pod(world, "probe", "rp", "--accept-new", "--python", sys.executable), notes_before=True)


def test_a_stopped_or_unknown_pod_is_one_line(world):
    pod_id = up_and_pin(world)
    world.sshd.stop()
    assert pod(world, "down", "rp").returncode == 0
    line = one_line_error(probe(world), notes_before=True)
    assert f"pod rp ({pod_id}) is EXITED on RunPod" in line and "resume it" in line

    line = one_line_error(probe(world, key=None), notes_before=True)  # unreachable, and no key to ask RunPod with
    assert "connection refused" in line and "could not ask RunPod" in line and "no RunPod API key" in line

    world.fake.pods.clear()  # terminated in the console
    line = one_line_error(probe(world), notes_before=True)
    assert f"RunPod has no pod {pod_id} any more" in line


def test_an_unreachable_pod_at_the_same_address_is_reported_as_it_is(world):
    pod_id = up_and_pin(world)
    world.sshd.stop()  # the API still maps the old port: nothing to re-resolve
    line = one_line_error(probe(world), notes_before=True)
    assert f"connection refused by 127.0.0.1:{world.sshd.port}" in line
    assert len(world.fake.ops("pod")) >= 2  # it did ask
    assert recorded(world)[1] == world.sshd.port
