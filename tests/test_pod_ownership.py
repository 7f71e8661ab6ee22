"""Deploy owns only what it writes (issue 12, items 1, 5 and 8), against a real sshd on loopback.

A directory podkit did not create keeps its files; REMOTE_DIR is normalised before any check;
files are chosen as git chooses them, the same over rsync and SFTP; `run` refuses an undeployed
directory.
"""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from podkit.pods.connection import PodConnection
from podkit.pods.hosts import parse_host, resolve
from podkit.pods.ownership import claim
from podkit.pods.selection import chosen_files
from podkit.pods.sync import push
from sshd_harness import one_line_error, pod_cli, pod_world, sshd_available

pytestmark = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = pod_world(tmp_path_factory.mktemp("own"), "own")
    yield w
    w.pod.stop()


def cli(world, *args, **kw):
    return pod_cli(world.project, *args, known_hosts=world.known_hosts, **kw)


def args_for(world, remote_dir: str) -> list[str]:
    return ["--key", str(world.pod.client_key), "--remote-dir", remote_dir, "--python", sys.executable]


def connection(world) -> PodConnection:
    pod = world.pod
    return PodConnection(resolve(parse_host(pod.spec, key=str(pod.client_key))), known_hosts=world.known_hosts)


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("remote_dir", ["/tmp/.", "//tmp", "/root/.", "/home/ubuntu", "/etc", "/", "/usr/local/x",
                                        "/workspace/../etc"])
def test_system_and_home_directories_are_refused_after_normalising(world, remote_dir):
    line = one_line_error(cli(world, "deploy", world.pod.spec, *args_for(world, remote_dir)))
    assert "system" in line and "REMOTE_DIR" in line, line
    assert "//" not in line.split("REMOTE_DIR ", 1)[1].split()[0] and "/." not in line.split("REMOTE_DIR ", 1)[1].split()[0]


@pytest.mark.slow
def test_a_foreign_directory_is_refused_then_force_keeps_every_file_of_its_owner(world):
    theirs = world.base / "pod-side" / "existing"
    (theirs / "notes").mkdir(parents=True)
    (theirs / "thesis.txt").write_text("four years of work\n")
    (theirs / "notes" / "chapter1.md").write_text("draft\n")
    (theirs / "README.md").write_text("their readme, same name as one of ours\n")
    before = tree(theirs)

    refused = cli(world, "deploy", world.pod.spec, *args_for(world, str(theirs) + "/."))
    line = one_line_error(refused)
    assert str(theirs) in line and "--force" in line and "not created by podkit" in line
    assert tree(theirs) == before and not (theirs / ".podkit").exists()

    # --force adds podkit's files beside theirs, but never over one of theirs: their README.md is in the way.
    (theirs / "train").write_text("their file, where podkit needs a directory\n")
    line = one_line_error(cli(world, "deploy", world.pod.spec, *args_for(world, str(theirs)), "--force"))
    assert "README.md" in line and "train" in line and "did not send" in line and "never overwrites" in line, line
    assert (theirs / "README.md").read_text() == before["README.md"] and not (theirs / "bin").exists()
    assert not (theirs / ".podkit").exists() and not (theirs / "logs").exists()  # the refused claim is undone
    refused = one_line_error(cli(world, "deploy", world.pod.spec, *args_for(world, str(theirs))))
    assert "not created by podkit" in refused  # so a later deploy without --force is refused as before
    (theirs / "README.md").rename(theirs / "README.theirs.md")  # what the message asks for
    (theirs / "train").rename(theirs / "train.theirs")
    before = tree(theirs)

    forced = cli(world, "deploy", world.pod.spec, *args_for(world, str(theirs)), "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert (theirs / "bin" / "smoke").exists()
    assert (theirs / "README.theirs.md").read_text() == before["README.theirs.md"]
    assert (theirs / "thesis.txt").read_text() == before["thesis.txt"]
    assert (theirs / "notes" / "chapter1.md").read_text() == before["notes/chapter1.md"]

    # Later deploys delete only what podkit itself sent and the user removed locally.
    (theirs / "made-on-the-pod.txt").write_text("results\n")
    (world.project / "tests" / "test_gpus.py").unlink()
    # one more gone from the project that the user already removed on the pod: not counted as podkit's removal
    (world.project / "tests" / "test_plot.py").unlink()
    (theirs / "tests" / "test_plot.py").unlink()
    again = cli(world, "deploy", world.pod.spec, *args_for(world, str(theirs)))
    assert again.returncode == 0, again.stdout + again.stderr
    assert not (theirs / "tests" / "test_gpus.py").exists()
    assert "1 removed (gone from the project)" in again.stdout + again.stderr  # said, not done silently
    assert (theirs / "thesis.txt").exists() and (theirs / "notes" / "chapter1.md").exists()
    assert (theirs / "made-on-the-pod.txt").exists()


def test_run_in_a_directory_that_was_never_deployed_is_refused(world):
    never = world.base / "pod-side" / "never-deployed"
    line = one_line_error(cli(world, "run", *args_for(world, str(never)), world.pod.spec, "--", "true"))
    assert "never deployed" in line and "deploy" in line
    # the hint deploys where this run looked: its --remote-dir, not the profile's default
    assert f"bin/pod deploy {shlex.join([world.pod.spec, *args_for(world, str(never))])}" in line, line
    assert not never.exists()


def _git_project(root: Path) -> set[str]:
    """A repository using the rules rsync's filters got wrong; returns what git would commit."""
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    files = {
        ".gitignore": "*.log\n!keep.log\nbuild/\n",
        ".podignore": "data/\n!build/wanted.bin\n",
        "train.py": "print('hi')\n", "keep.log": "negated: git tracks it\n", "noise.log": "ignored\n",
        "sub/.gitignore": "local.txt\n", "sub/local.txt": "nested ignore\n", "sub/code.py": "x = 1\n",
        "secret.txt": "in .git/info/exclude\n", "data/big.bin": "podignored\n",
        "build/out.o": "ignored\n", "build/wanted.bin": "added back by .podignore\n",
        "runs/r0/summary.json": "{}\n", ".venv/bin/python": "#!\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / ".git" / "info" / "exclude").write_text("secret.txt\n")
    subprocess.run(["git", "-C", str(root), "add", "train.py", ".gitignore"], check=True)
    return {".gitignore", ".podignore", "train.py", "keep.log", "sub/.gitignore", "sub/code.py", "build/wanted.bin"}


def test_files_are_chosen_as_git_chooses_them_over_rsync_and_sftp(world):
    local = world.base / "gitproj"
    expected = _git_project(local)
    assert set(chosen_files(local)) == expected
    with connection(world) as conn:
        for name, rsync_on_pod in (("via-rsync", True), ("via-sftp", False)):
            remote = world.base / "pod-side" / name
            claim(conn, str(remote))
            push(conn, local, str(remote), rsync_on_pod=rsync_on_pod)
            sent = {k for k in tree(remote) if not k.startswith(".podkit/")}
            assert sent == expected, name
    # Outside git the same rules come from pathspec (.git/info/exclude then does not exist).
    subprocess.run(["rm", "-rf", str(local / ".git")], check=True)
    assert set(chosen_files(local)) == expected | {"secret.txt"}


def test_stale_removal_never_follows_a_symlinked_directory(world):
    """A file podkit sent and the project no longer has is removed on the next deploy, but not through a
    directory the user swapped for a symlink on the pod: that would remove their file elsewhere."""
    local, remote = world.base / "linkproj", world.base / "pod-side" / "linked"
    outside = world.base / "pod-side" / "their-data"
    for rel in ("train.py", "extra/f.txt", "gone.txt", "-/g.txt"):  # "-": a directory cd would read as $OLDPWD
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_text("ours\n")
    with connection(world) as conn:
        claim(conn, str(remote))
        push(conn, local, str(remote), rsync_on_pod=True)
        assert (remote / "extra" / "f.txt").exists() and (remote / "gone.txt").exists()
        # on the pod the user moves extra/ to their own place and links it back; here both files leave the project
        outside.parent.mkdir(parents=True, exist_ok=True)
        (remote / "extra").rename(outside)
        (remote / "extra").symlink_to(outside)
        (local / "extra" / "f.txt").unlink()
        (local / "gone.txt").unlink()
        (local / "-" / "g.txt").unlink()
        stats = push(conn, local, str(remote), rsync_on_pod=True)
    assert stats.deleted == 2 and not (remote / "gone.txt").exists() and not (remote / "-").exists()
    assert (outside / "f.txt").read_text() == "ours\n" and (remote / "extra").is_symlink()


def test_a_new_project_path_taken_on_the_pod_is_refused_wherever_it_sorts(world):
    """Review 2026-11-25: the existence check read its list pairwise with `read`, and the list's last line had no
    newline, so the last path in sorted order was never checked: a later deploy overwrote the user's file there
    (and removed it once the project dropped it), or replaced their file with a directory."""
    from podkit.pods.ownership import existing
    from podkit.pods.sync import TheirFiles, refuse_theirs

    local, remote = world.base / "takenproj", world.base / "pod-side" / "taken"
    (local / "train.py").parent.mkdir(parents=True, exist_ok=True)
    (local / "train.py").write_text("ours\n")
    with connection(world) as conn:
        claim(conn, str(remote))
        push(conn, local, str(remote), rsync_on_pod=True)
        # the user's own files, where the project later puts new paths: one sorting first, one last
        for rel in ("a_user.py", "z_user.py", "zzdata"):
            (remote / rel).write_text("theirs\n")
        assert existing(conn, str(remote), {"a_user.py", "z_user.py"}) == ["a_user.py", "z_user.py"]
        assert existing(conn, str(remote), {"z_user.py"}) == ["z_user.py"]
        assert existing(conn, str(remote), {"zzdata/tool.py"}) == ["zzdata"]  # a file where a directory goes
        for rel in ("z_user.py", "zzdata/tool.py"):
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_text("ours\n")
            with pytest.raises(TheirFiles):
                refuse_theirs(conn, local, str(remote))
            (local / rel).unlink()
    assert (remote / "z_user.py").read_text() == "theirs\n" and (remote / "zzdata").read_text() == "theirs\n"


def test_changes_since_deploy_count_what_each_transport_sent(world):
    """SFTP sends no symlinks, so a symlink of the project never counts as changed after an SFTP deploy; after an
    rsync deploy, which sent it, a new target does."""
    from podkit.pods.sync import changed_since_deploy

    local = world.base / "stampproj"
    (local / "pkg").mkdir(parents=True)
    (local / "pkg" / "train.py").write_text("x = 1\n")
    (local / "latest.py").symlink_to("pkg/train.py")
    with connection(world) as conn:
        for name, rsync_on_pod in (("stamps-sftp", False), ("stamps-rsync", True)):
            remote = str(world.base / "pod-side" / name)
            claim(conn, remote)
            push(conn, local, remote, rsync_on_pod=rsync_on_pod)
            assert (Path(remote) / "latest.py").is_symlink() == rsync_on_pod, name
            assert changed_since_deploy(conn, local, remote) == [], name
        (local / "latest.py").unlink()
        (local / "latest.py").symlink_to("pkg/other.py")  # a link's own size changes with its target's name
        assert changed_since_deploy(conn, local, str(world.base / "pod-side" / "stamps-rsync")) == ["latest.py"]
        assert changed_since_deploy(conn, local, str(world.base / "pod-side" / "stamps-sftp")) == []
