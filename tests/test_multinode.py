"""bin/pod run A,B --nodes (issue 15 item 4): two pods in two network namespaces on one bridge,
a real sshd in each, deployed for real, one torchrun world across them over gloo.

The laptop is the root namespace; each pod's processes share this machine's PID space, so what a
node left running is found by its network namespace (`ip netns pids`) and by the job's tag.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podkit.pods.jobs import JOBS_DIR
from sshd_harness import BridgedNetwork, NamespacePod, free_port, one_line_error, pod_cli, project_copy, sshd_available, wait_for
from smoke_helpers import tiny_job


FULL_PARAMS_BYTES = 428_672 * 4  # the tiny preset's parameters in fp32 (tests/test_smoke.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = NamespacePod.available()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("multinode")
    net = BridgedNetwork(2).start()
    pods = []
    try:
        pods = [net.pod(base, i).start() for i in range(2)]
        project = project_copy(base / "laptop" / "podkit")
        known_hosts = base / "known_hosts"
        known_hosts.write_text("".join(p.known_hosts_line() for p in pods))
        (project / "pods.toml").write_text("".join(
            f'[pods.node{i}]\nhost = "{p.spec}"\nkey = "{p.client_key}"\nremote_dir = "{p.remote_dir}"\n'
            f'python = "{sys.executable}"\n' for i, p in enumerate(pods)))
        # The whole world: 2 nodes x 1 process, ZeRO-3, so each rank holds half the weights only
        # when both nodes' ranks are in one process group.
        tiny_job(project, cluster={"nodes": 2, "gpus_per_node": 1, "sharding": '"zero3"'}, smoke={"steps": 20},
                 name="two-nodes.toml")
        tiny_job(project, name="one-node.toml")
        deployed = pod_cli(project, "deploy", "node0,node1", known_hosts=known_hosts, timeout=600)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield net, pods, project, known_hosts
    finally:
        for p in pods:
            p.stop()
        net.stop()


def cli(cluster, *args, **kw):
    _, _, project, known_hosts = cluster
    return pod_cli(project, *args, known_hosts=known_hosts, **kw)


def tagged(entry: str) -> list[int]:
    """Live processes whose environment holds `entry` (NAME=value)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def only_sshd_left(net: BridgedNetwork, i: int) -> list[str]:
    """What runs in node i's namespace besides its sshd (empty once everything podkit started is gone)."""
    left = []
    for pid in net.pids(i):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "sshd":
            left.append(f"{pid} {comm}")
    return left


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_smoke_runs_one_world_across_two_pods_and_fetch_logs_brings_both_back(cluster):
    net, pods, project, _ = cluster
    out = cli(cluster, "run", "node0,node1", "--nodes", "--id", "mn1", "--", "bin/smoke", "--config", "two-nodes.toml",
              timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    # Every node's output, prefixed by its name.
    assert "[node0] smoke: launching 1 processes under torchrun on node 0 of 2" in out.stdout, out.stdout[-3000:]
    assert "[node1] smoke: launching 1 processes under torchrun on node 1 of 2" in out.stdout
    assert f"rendezvous c10d at {net.address(0)}:" in out.stderr

    runs = [Path(p.remote_dir) / "runs" / "mn1" for p in pods]
    # c10d ranks nodes by address: whichever node holds rank 0 writes the summary; the other its rank's files.
    main, other = (0, 1) if (runs[0] / "summary.json").exists() else (1, 0)
    s = json.loads((runs[main] / "summary.json").read_text())
    assert s["status"] == "pass" and s["world_size"] == 2 and s["nodes"] == 2 and s["steps"] == 20
    assert f"[node{main}] smoke: pass" in out.stdout
    assert not (runs[other] / "summary.json").exists()
    # Both nodes' ranks trained every step.
    steps0 = [json.loads(x) for x in (runs[main] / "metrics.jsonl").read_text().splitlines()]
    steps1 = [json.loads(x) for x in (runs[other] / "metrics.rank1.jsonl").read_text().splitlines()]
    assert [x["step"] for x in steps0 if "loss" in x] == list(range(1, 21))
    assert [x["step"] for x in steps1 if "loss" in x] == list(range(1, 21))
    # The prediction is for the job's world (2 nodes x 1), and ZeRO-3 really sharded over both pods.
    from podkit.checks.config import load_job
    from podkit.checks.memory import estimate

    job = load_job(project / "two-nodes.toml")
    assert s["predicted"] == estimate(job, device="cpu").allocated
    assert s["predicted"] < estimate(job.replace(cluster={"nodes": 1}), device="cpu").allocated
    params = {r["name"]: r for r in s["memory"]}["params"]
    assert params["measured"] < 0.6 * FULL_PARAMS_BYTES and abs(params["error"]) < 0.10

    fetched = cli(cluster, "fetch-logs", "node0,node1", timeout=300)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    local = project / "pod-logs"
    assert (local / f"node{main}" / "runs" / "mn1" / "summary.json").exists()
    assert (local / f"node{other}" / "runs" / "mn1" / "metrics.rank1.jsonl").exists()
    for i in range(2):
        assert "smoke:" in (local / f"node{i}" / "logs" / "jobs" / f"mn1-n{i}" / "output.log").read_text()
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_a_failing_node_stops_the_other_and_its_exit_code_is_the_runs(cluster):
    net, _, _, _ = cluster
    # Node 1's process fails at once; node 0's would sleep ten minutes outside any collective,
    # which torchrun's agent never notices: only podkit's stop ends it.
    script = ("import os, sys, time; print('up on node', os.environ['PODKIT_NODE_RANK'], flush=True); "
              "sys.exit(7) if os.environ['PODKIT_NODE_RANK'] == '1' else time.sleep(600)")
    started = time.monotonic()
    out = cli(cluster, "run", "node0,node1", "--nodes", "--id", "fail1", "--", "python", "-c", script, timeout=300)
    took = time.monotonic() - started
    assert "[node0] up on node 0" in out.stdout and "[node1] up on node 1" in out.stdout, out.stdout + out.stderr
    listed = {}
    for i in range(2):
        jobs = cli(cluster, "jobs", f"node{i}", "--json")
        assert jobs.returncode == 0, jobs.stderr
        listed[i] = {j["id"]: j for j in json.loads(jobs.stdout)["jobs"]}
    failed, stopped = listed[1]["fail1-n1"], listed[0]["fail1-n0"]
    assert failed["state"] == "exited" and failed["exit_code"] != 0
    assert out.returncode == failed["exit_code"], out.stderr  # torchrun's code for a failed worker
    assert stopped["state"] == "stopped", stopped
    assert "node 1 (node1) exited" in out.stderr and "stopping the others" in out.stderr
    assert took < 120, f"the sleeping node ran on for {took:.0f} s"
    assert not tagged("PODKIT_JOB_ID=fail1-n0") and not tagged("PODKIT_JOB_ID=fail1-n1")
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_a_node_whose_link_dies_mid_run_has_the_others_stopped(cluster):
    """Node 1's network goes silent (no reset: a dead pod, an outage) while both run: the run ends
    with one error line naming it, and node 0 is not left running without its peer."""
    import threading

    net, _, project, known_hosts = cluster
    script = "import os, time; print('up on node', os.environ['PODKIT_NODE_RANK'], flush=True); time.sleep(600)"
    argv = [str(project / "bin" / "pod"), "run", "--known-hosts", str(known_hosts), "--timeout", "2",
            "node0,node1", "--nodes", "--id", "cut1", "--", "python", "-c", script]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(argv, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    inner = net.interface(1)
    try:
        assert wait_for(lambda: {"[node0] up on node 0\n", "[node1] up on node 1\n"} <= set(lines), 120), lines
        subprocess.run(["ip", "netns", "exec", net.namespaces[1], "ip", "link", "set", inner, "down"], check=True)
        cut = time.monotonic()
        err = proc.stderr.read()
        proc.wait(timeout=120)
        took = time.monotonic() - cut
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["ip", "netns", "exec", net.namespaces[1], "ip", "link", "set", inner, "up"], check=True)
    assert proc.returncode == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: node1: ") and "cut1-n1 may still run there" in last, err
    assert "node 0 (node0): job cut1-n0 stopped" in err and took < 60, (err, took)
    assert not tagged("PODKIT_JOB_ID=cut1-n0")
    # Back on the network, node 1's job is the user's to stop, as the error says.
    assert wait_for(lambda: cli(cluster, "stop", "node1", "cut1-n1", "--grace", "5").returncode == 0, 60)
    assert not tagged("PODKIT_JOB_ID=cut1-n1")
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_a_node_whose_job_is_lost_fails_the_run_and_ctrl_c_under_json_still_prints_the_object(cluster):
    """Review 2026-11-25: a node's job killed with its wrapper (no exit code: the OOM killer, a restart) made the
    run exit 0 with ok true; and Ctrl-C under --json left stdout empty."""
    import signal as sig

    net, _, project, known_hosts = cluster
    script = "import os, time; print('up on node', os.environ['PODKIT_NODE_RANK'], flush=True); time.sleep(600)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(run_id: str) -> tuple[subprocess.Popen, list[str]]:
        import threading

        argv = [str(project / "bin" / "pod"), "run", "--known-hosts", str(known_hosts), "node0,node1", "--nodes",
                "--json", "--id", run_id, "--", "python", "-c", script]
        proc = subprocess.Popen(argv, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
        assert wait_for(lambda: sum("up on node" in line for line in lines) == 2, 120), lines
        return proc, lines

    proc, lines = run("lost1")
    try:
        for pid in tagged("PODKIT_JOB_ID=lost1-n1"):  # the job and its wrapper, as the OOM killer would
            os.kill(pid, sig.SIGKILL)
        out = json.loads(proc.stdout.read())
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and out["ok"] is False and out["exit_code"] == 1, (out, lines)
    assert any("node 1 (node1) lost its job" in line for line in lines), lines
    assert wait_for(lambda: not tagged("PODKIT_JOB_ID=lost1-n0"), 60)

    proc, lines = run("ctrlc1")
    try:
        proc.send_signal(sig.SIGINT)
        out = json.loads(proc.stdout.read())
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        for i in range(2):
            cli(cluster, "stop", f"node{i}", f"ctrlc1-n{i}", "--grace", "5")
    assert proc.returncode == 130 and out["interrupted"] and out["detached"] and out["exit_code"] is None, out
    assert [n["job"] for n in out["nodes"]] == ["ctrlc1-n0", "ctrlc1-n1"]
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


def sleeps(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"^sleep {re.escape(marker)}$"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def launchers(run_id: str) -> list[int]:
    """The launcher of node 1's job (bash -c with the launcher's script: what the trap holds), or its fork."""
    out = subprocess.run(["pgrep", "-f", f"PODKIT_JOB_ID={run_id}-n1 env"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
@pytest.mark.parametrize("how", ["launcher-killed", "link-dropped", "ctrl-c"])
def test_a_node_whose_start_fails_after_starting_its_job_is_left_with_nothing_running(cluster, how):
    """Review 2026-11-27: node 1's launcher failed after it had started the job (killed; or its link dropped while
    the launcher was held there): node 0's job was stopped, node 1's ran on, a rank of a world that would never
    form. Both are stopped now, node 1's over a fresh connection when its link is gone. Likewise a Ctrl-C while
    node 1's launcher is held after starting its job (2026-11-25: that job ran on, said to "may still start")."""
    net, pods, project, known_hosts = cluster
    run_id, hold = f"half-{how}", f"{600 + os.getpid() % 300}.{time.time_ns() % 10**6:06d}"
    # Node 1's env file, read before every command of a session, hands its launcher's bash (as BASH_ENV) a DEBUG
    # trap for this run's start alone: `action` once the launcher has started the job (`$!` set) and the job's
    # wrapper has recorded its pid (it runs).
    started = f"i=0; while [ ! -s logs/jobs/{run_id}-n1/pid ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"
    action = f"{started}; " + ("kill -KILL $BASHPID" if how == "launcher-killed" else f"sleep {hold}")
    guard = f'[ "$!" != "$__b" ] && {{ __b=$!; {action}; }}'
    trap = pods[1].base / f"trap-{how}"
    trap.write_text(f'case $BASH_EXECUTION_STRING in *"PODKIT_JOB_ID={run_id}-n1 env"*) __b=$!; set -T; '
                    f'trap {shlex.quote(guard)} DEBUG;; esac\n')
    env_file = Path(pods[1].remote_dir) / ".podkit" / "env"
    before = env_file.read_text()
    env_file.write_text(before + f"export BASH_ENV={trap}\n")
    argv = [str(project / "bin" / "pod"), "run", "--known-hosts", str(known_hosts), "node0,node1", "--nodes", "--id",
            run_id, "--", "python", "-c", "import time; time.sleep(600)"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        proc = subprocess.Popen(argv, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            if how in ("link-dropped", "ctrl-c"):
                assert wait_for(lambda: sleeps(hold), 120), "node 1's start never got there"
                assert tagged(f"PODKIT_JOB_ID={run_id}-n1"), "node 1's job did not start"
                if how == "ctrl-c":
                    proc.send_signal(signal.SIGINT)
                else:
                    pods[1].drop_connections()
            out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
            env_file.write_text(before)
        assert proc.returncode == (130 if how == "ctrl-c" else 2) and "Traceback" not in err, err
        for i in range(2):
            assert not tagged(f"PODKIT_JOB_ID={run_id}-n{i}"), (f"node {i}'s job runs on", err)
        assert not launchers(run_id), ("node 1's launcher runs on", err)
        for i in range(2):
            assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)
        # and the user is told: every job stopped, and why
        if how == "ctrl-c":
            for i in range(2):
                assert f"interrupted while starting: job {run_id}-n{i} on node{i} stopped" in err, err
            return
        assert err.strip().splitlines()[-1].startswith("error: node1: "), err
        assert f"node 1 (node1) could not start: job {run_id}-n0 on node0 stopped" in err, err
        why = "its launcher failed after starting the job" if how == "launcher-killed" else "its link failed during the start"
        assert f"node 1 (node1) could not start ({why}): job {run_id}-n1 on node1 stopped" in err, err
        # a run does not continue where it stopped, as a deploy does: re-running starts a new world
        assert "continues where it stopped" not in err.strip().splitlines()[-1], err
    finally:
        for pid in tagged(f"PODKIT_JOB_ID={run_id}-n0") + tagged(f"PODKIT_JOB_ID={run_id}-n1") + launchers(run_id):
            os.kill(pid, 9)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_detached_nodes_are_attached_and_stopped_one_by_one(cluster):
    net, _, _, _ = cluster
    script = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)"
    out = cli(cluster, "run", "node0,node1", "--nodes", "--detach", "--json", "--id", "det1", "--", "python", "-c", script)
    assert out.returncode == 0, out.stderr
    # each hint is a command that reaches the pod as this one did (its --known-hosts kept)
    assert re.search(r"bin/pod attach node0 --known-hosts \S+ det1-n0", out.stderr), out.stderr
    assert re.search(r"bin/pod attach node1 --known-hosts \S+ det1-n1", out.stderr), out.stderr
    started = json.loads(out.stdout)  # stdout is the one JSON object
    assert started["ok"] and started["detached"] and started["run_id"] == "det1" and started["exit_code"] is None
    assert [(n["pod"], n["job"], n["nproc"]) for n in started["nodes"]] == [("node0", "det1-n0", 1), ("node1", "det1-n1", 1)]
    assert started["rendezvous"].startswith(net.address(0) + ":")
    ranks = set()
    for i in range(2):
        attached = cli(cluster, "attach", f"node{i}", f"det1-n{i}", timeout=180)
        assert attached.returncode == 0, attached.stdout + attached.stderr
        ranks |= {line for line in attached.stdout.splitlines() if line.startswith("rank ")}
    assert ranks == {"rank 0 of 2", "rank 1 of 2"}  # one world of two, one rank on each pod
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_attaching_to_a_detached_run_follows_every_node_and_a_failing_one_stops_the_rest(cluster):
    net, pods, _, _ = cluster
    # Detached, nobody watching: node 1 fails at once, node 0 would sleep ten minutes. Attaching to the run (its
    # pods named in another order) finds each node's job by the run id, follows both, and does what the run's own
    # client would have done: stop node 0, exit with node 1's code.
    script = ("import os, sys, time; print('up on node', os.environ['PODKIT_NODE_RANK'], flush=True); "
              "sys.exit(7) if os.environ['PODKIT_NODE_RANK'] == '1' else time.sleep(600)")
    out = cli(cluster, "run", "node0,node1", "--nodes", "--detach", "--id", "att1", "--", "python", "-c", script)
    assert out.returncode == 0, out.stderr
    assert re.search(r"bin/pod attach node0,node1 --known-hosts \S+ att1", out.stderr), out.stderr
    # Each node's job keeps its place in the run, which attach checks: pods that are not the whole run (here the
    # record says three) are refused, like no run id and a run the pods do not have: one line each, nothing stopped.
    records = [Path(pods[i].remote_dir) / JOBS_DIR / f"att1-n{i}" / "run.json" for i in range(2)]
    assert [json.loads(r.read_text()) for r in records] == [{"run_id": "att1", "node": i, "nodes": 2} for i in range(2)]
    for r in records:
        r.write_text(r.read_text().replace('"nodes": 2', '"nodes": 3'))
    for args, needle in [(("node0,node1",), "attaching to them needs the run id"),
                         (("node0,node1", "nosuch"), "run nosuch: node0 has no job of it"),
                         (("node0,node1", "att1"), "run att1 has 3 nodes; node0,node1 holds its nodes [0, 1]")]:
        bad = cli(cluster, "attach", *args)
        assert bad.returncode == 2 and needle in one_line_error(bad), bad.stderr
    for r in records:
        r.write_text(r.read_text().replace('"nodes": 3', '"nodes": 2'))
    started = time.monotonic()
    attached = cli(cluster, "attach", "node1,node0", "att1", "--json", timeout=300)
    took = time.monotonic() - started
    result = json.loads(attached.stdout)
    jobs = {i: {j["id"]: j for j in json.loads(cli(cluster, "jobs", f"node{i}", "--json").stdout)["jobs"]}
            for i in range(2)}
    failed, stopped = jobs[1]["att1-n1"], jobs[0]["att1-n0"]
    assert failed["state"] == "exited" and failed["exit_code"] != 0
    assert attached.returncode == failed["exit_code"] == result["exit_code"], attached.stderr
    assert stopped["state"] == "stopped", stopped
    assert result["run_id"] == "att1" and not result["ok"]
    assert [(n["pod"], n["node"], n["job"]) for n in result["nodes"]] == [("node1", 1, "att1-n1"), ("node0", 0, "att1-n0")]
    assert "[node0] up on node 0" in attached.stderr and "[node1] up on node 1" in attached.stderr, attached.stderr
    assert "node 1 (node1) exited" in attached.stderr and "stopping the others" in attached.stderr
    assert took < 120, f"the sleeping node ran on for {took:.0f} s"
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


SHOW_RANK = ("import os, sys; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'on node',"
             " os.environ['PODKIT_NODE_RANK'], 'prefix', sys.prefix, 'args', sys.argv[1:], flush=True)")


def node_lines(out: str, i: int) -> list[str]:
    return [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith(f"[node{i}] rank ")]


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_a_users_torchrun_runs_under_the_nodes_venv_with_its_arguments(cluster):
    """Review 2026-11-26: `torchrun ...` ran as written. The venv deploy made reuses the image's torch, so its bin
    has no torchrun: here there is none on the pods' PATH at all (exit 127), and on an image whose torchrun is on
    PATH that script runs the image's interpreter, outside the venv deploy installed into. It now runs as the
    node's python -m torch.distributed.run, the user's arguments kept."""
    net, pods, _, _ = cluster
    for p in pods:  # the user's script, on each pod
        Path(p.remote_dir, "show_rank.py").write_text(SHOW_RANK + "\n")
    out = cli(cluster, "run", "node0,node1", "--nodes", "--id", "trun1", "--", "torchrun", "--max-restarts", "0",
              "show_rank.py", "--lr", "1e-4", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = set()
    for i, p in enumerate(pods):
        venv = Path(p.remote_dir) / ".venv"
        lines = node_lines(out.stdout, i)
        assert len(lines) == 1 and lines[0].endswith(f"on node {i} prefix {venv} args ['--lr', '1e-4']"), out.stdout
        ranks.add(lines[0].split(" on node")[0])
        listed = {j["id"]: j for j in json.loads(cli(cluster, "jobs", f"node{i}", "--json").stdout)["jobs"]}
        assert listed[f"trun1-n{i}"]["command"] == \
            f"{venv}/bin/python -m torch.distributed.run --max-restarts 0 show_rank.py --lr 1e-4"
    assert ranks == {"rank 0 of 2", "rank 1 of 2"}  # one world across both pods
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_a_node_without_the_venv_launches_with_the_interpreter_the_probe_chose(cluster):
    """A node whose deploy left no venv (envsetup could not make one: an image without python3-venv) and so no env
    file: `python` on its PATH is whatever the login put there, here pyenv's shim without torch (on many images,
    nothing: only python3), and `python -m torch.distributed.run` failed on it. The launch uses the interpreter the
    probe chose, the one pods.toml's python names; the other node keeps its venv."""
    net, pods, _, _ = cluster
    node1 = Path(pods[1].remote_dir)
    moved = [(node1 / ".venv", node1 / ".venv.away"), (node1 / ".podkit" / "env", node1 / ".podkit" / "env.away")]
    for path, away in moved:
        path.rename(away)
    try:
        out = cli(cluster, "run", "node0,node1", "--nodes", "--id", "novenv1", "--", "python3", "-c", SHOW_RANK,
                  "--x", timeout=300)
        listed = json.loads(cli(cluster, "jobs", "node1", "--json").stdout)["jobs"]
    finally:
        for path, away in moved:
            away.rename(path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert {node_lines(out.stdout, i)[0].split(" on node")[0] for i in range(2)} == {"rank 0 of 2", "rank 1 of 2"}
    # On node 0 the env file put the venv first on PATH: the user's own python3 is the venv's.
    assert node_lines(out.stdout, 0)[0].endswith(f"prefix {Path(pods[0].remote_dir) / '.venv'} args ['--x']"), out.stdout
    command = {j["id"]: j for j in listed}["novenv1-n1"]["command"]
    assert command.startswith(f"{sys.executable} -m torch.distributed.run --no-python python3 -c "), command
    for i in range(2):
        assert wait_for(lambda: not only_sshd_left(net, i), 30), only_sshd_left(net, i)


@pytest.mark.slow
@pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))
def test_bad_input_is_one_line_and_starts_nothing(cluster):
    net, pods, project, _ = cluster
    before = {i: {j["id"] for j in json.loads(cli(cluster, "jobs", f"node{i}", "--json").stdout)["jobs"]} for i in range(2)}
    assert "--nodes needs at least 2 hosts" in one_line_error(cli(cluster, "run", "node0", "--nodes", "--", "true"))
    assert "add --nodes" in one_line_error(cli(cluster, "run", "node0,node1", "--", "true"))
    assert "runs torchrun inside it" in one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--", "env",
                                                           "X=1", "torchrun", "t.py"))
    assert "goes with --nodes" in one_line_error(cli(cluster, "run", "node0", "--nproc-per-node", "2", "--", "true"))
    err = one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--", "bin/smoke", "--config", "one-node.toml"))
    assert "cluster.nodes = 1, but 2 hosts" in err
    err = one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--nproc-per-node", "2", "--",
                             "bin/smoke", "--config", "two-nodes.toml"))
    assert "--nproc-per-node 2 disagrees" in err
    assert "one-node default job" in one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--", "bin/smoke"))
    assert "named twice" in one_line_error(cli(cluster, "run", "node0,node0", "--nodes", "--", "true"))
    # --python naming what cannot launch torchrun there (checked as deploy checks it).
    err = one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--python", "/bin/false", "--", "true"))
    assert "python /bin/false does not run as Python 3 (exit 1" in err, err
    # A host that does not answer at all.
    dead = f"root@127.0.0.1:{free_port()}"
    assert "refused" in one_line_error(cli(cluster, "run", f"node0,{dead}", "--nodes", "--", "true"))
    # Both answer SSH, but node1 has no route to node0: the rendezvous could never form.
    subprocess.run(["ip", "netns", "exec", net.namespaces[1], "ip", "route", "add", "blackhole",
                    f"{net.address(0)}/32"], check=True)
    try:
        err = one_line_error(cli(cluster, "run", "node0,node1", "--nodes", "--", "true"))
        assert "cannot reach node0" in err and net.address(0) in err
    finally:
        subprocess.run(["ip", "netns", "exec", net.namespaces[1], "ip", "route", "del", "blackhole",
                        f"{net.address(0)}/32"], check=True)
    after = {i: {j["id"] for j in json.loads(cli(cluster, "jobs", f"node{i}", "--json").stdout)["jobs"]} for i in range(2)}
    assert after == before


def test_smoke_refuses_a_world_it_cannot_form(tmp_path):
    """bin/smoke alone with a 2-node job, or under a rendezvous of another size: one line, exit 2."""
    root = Path(__file__).resolve().parent.parent
    job = tiny_job(tmp_path, cluster={"nodes": 2}, smoke={"steps": 2})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    alone = subprocess.run([str(root / "bin" / "smoke"), "--config", str(job)], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120)
    assert alone.returncode == 2 and "bin/pod run A,B --nodes" in alone.stderr and "Traceback" not in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1, alone.stderr
    other = subprocess.run([str(root / "bin" / "smoke"), "--config", str(job)], capture_output=True, text=True,
                           env=dict(env, PET_NNODES="3"), cwd=tmp_path, timeout=120)
    assert other.returncode == 2 and "spans 3 nodes" in other.stderr and len(other.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_every_node_reads_one_rendezvous_through_torchruns_own_parser(monkeypatch):
    """The PET_* names are torchrun's (parsed here by torch's own argument parser, not a copy)."""
    from torch.distributed.run import get_args_parser

    from podkit.pods.nodes import Node, Rendezvous

    rdzv = Rendezvous("10.0.0.2", 29411, "run1", 2)
    nodes = [Node(0, "a", "10.0.0.2", "ens5", 4), Node(1, "b", "10.0.0.3", None, 4)]
    parsed = []
    for node in nodes:
        for k in [k for k in os.environ if k.startswith("PET_")]:
            monkeypatch.delenv(k)
        for k, v in rdzv.env(node).items():
            monkeypatch.setenv(k, v)
        parsed.append(get_args_parser().parse_args(["--no-python", "true"]))
    for args in parsed:
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == \
            ("2", "4", "c10d", "10.0.0.2:29411", "run1")
        assert not args.standalone
    assert (parsed[0].rdzv_conf, parsed[1].rdzv_conf) == ("is_host=1", "is_host=0")
    assert (parsed[0].local_addr, parsed[1].local_addr) == ("10.0.0.2", "10.0.0.3")
    assert rdzv.env(nodes[1])["PODKIT_RUN_ID"] == "run1" and rdzv.env(nodes[1])["PODKIT_NODE_RANK"] == "1"
    assert Rendezvous.env_defaults(nodes[0]) == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"}
    assert Rendezvous.env_defaults(nodes[1]) == {}


def test_what_each_node_runs():
    from podkit.pods.errors import PodError
    from podkit.pods.nodes import job_config, launch_command

    py = "/workspace/podkit/.venv/bin/python"  # the node's interpreter (pods/nodes.interpreter)
    assert launch_command(("bin/smoke", "--config", "j.toml"), py) == "bin/smoke --config j.toml"
    # torch's torchrun script would run the image's interpreter (or not be on PATH): its module under the node's
    assert launch_command(("torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1e-4"), py) == \
        f"{py} -m torch.distributed.run --nproc-per-node 2 train.py --lr 1e-4"
    assert launch_command(("python3", "-m", "torch.distributed.run", "train.py"), py) == \
        f"{py} -m torch.distributed.run train.py"
    # named by its path: the user's choice, as given
    assert launch_command(("/opt/conda/bin/torchrun", "train.py"), py) == "/opt/conda/bin/torchrun train.py"
    assert launch_command(("/opt/conda/bin/python", "-m", "torch.distributed.run", "t.py"), py) == \
        "/opt/conda/bin/python -m torch.distributed.run t.py"
    assert launch_command(("python", "train.py", "--lr", "1e-4"), py) == \
        f"{py} -m torch.distributed.run --no-python python train.py --lr 1e-4"
    with pytest.raises(PodError, match="does not run across nodes"):
        launch_command(("bin/smoke", "--", "python", "train.py"), py)
    # Review 2026-11-25: a launcher after the first word ran as a worker of podkit's torchrun, one launcher per
    # worker waiting on a world that never formed (a local 2-process run hung until killed). Refused, one line.
    for nested, named in ((("env", "X=1", "torchrun", "train.py"), "torchrun"),
                          (("python", "-u", "-m", "torch.distributed.run", "t.py"), "python -m torch.distributed.run"),
                          (("uv", "run", "torchrun", "t.py"), "torchrun"),
                          (("accelerate", "launch", "t.py"), "accelerate launch"),
                          (("deepspeed", "--num_gpus", "8", "t.py"), "deepspeed")):
        with pytest.raises(PodError, match=f"COMMAND runs {named} inside it"):
            launch_command(nested, py)
    # a script's own arguments are not launchers
    assert launch_command(("python", "train.py", "--backend", "deepspeed", "torchrun"), py).endswith(
        "--no-python python train.py --backend deepspeed torchrun")
    assert job_config(("bin/smoke", "-c", "a.toml")) == "a.toml"
    assert job_config(("bin/smoke", "--config=b.toml")) == "b.toml"
    assert job_config(("python", "train.py", "--config", "c.toml")) is None
