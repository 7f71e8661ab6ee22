"""Deploy timings on loopback: first deploy and no-change re-deploy of a ~1,000-file project, next
to the same tree synced by plain rsync over the same sshd. One run measures all of them.

    .venv/bin/python benchmarks/deploy_sync.py [--repeats 5]

Needs sshd, ssh and rsync (as the test suite does). Writes benchmarks/results/deploy_sync.{md,json}.
The deploy numbers include everything `bin/deploy` does: connect, probe, sync, envsetup (the
first one creates the pod's venv), and preflight on the pod. Also measured: one OpenSSH login
running `true` (what each command costs a tool that logs in per command), and one new 64 MiB
file, through podkit's connection and through plain rsync.

Transport comparison: the same no-change deploy done the other way, over OpenSSH multiplexing
(ControlMaster) with deploy's remote steps batched: one ssh for probe + ownership check, rsync of
the same file list over the master, one ssh for envsetup + preflight. Timed with the master
opened in the run ("cold", as a first invocation) and kept from an earlier one ("warm",
ControlPersist). podkit's own transport (pods/shell.py, pods/rsh.py, pods/rsh_client.py) is
worth its code only if it beats these.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from sshd_harness import LoopbackPod, pod_cli, project_copy, sshd_available  # noqa: E402

TRANSPORT_FILES = ("pods/shell.py", "pods/rsh.py", "pods/rsh_client.py")


def openssh_mux_deploy(ssh: list[str], target: str, project: Path, remote_dir: str, control: Path, *,
                       warm: bool) -> float:
    """A no-change deploy over OpenSSH ControlMaster, remote steps batched; returns wall seconds."""
    from podkit.envsetup.fingerprint import PROBE_SCRIPT
    from podkit.pods.ownership import CLAIM_SCRIPT
    from podkit.pods.selection import chosen_files

    mux = [*ssh, "-o", f"ControlPath={control}"]
    q = shlex.quote(remote_dir)
    start = time.perf_counter()
    if not warm:
        subprocess.run([*mux, "-o", "ControlMaster=yes", "-o", "ControlPersist=120", "-fN", target], check=True)
    probe = (f"export PODKIT_PROBE_DIR={q} PODKIT_PYTHON={shlex.quote(sys.executable)}\n"
             + CLAIM_SCRIPT.format(d=q, force=0).replace("exit 0", ":") + "\nbash -s <<'PODKIT_PROBE'\n"
             + PROBE_SCRIPT + "\nPODKIT_PROBE\n")
    subprocess.run([*mux, target, "bash -s"], input=probe, text=True, check=True, capture_output=True)
    with tempfile.NamedTemporaryFile("w", suffix=".files") as listing:
        listing.write("\0".join(chosen_files(project)))
        listing.flush()
        subprocess.run(["rsync", "-lptz", "--files-from", listing.name, "--from0", "-e", shlex.join(mux),
                        f"{project}/", f"{target}:{remote_dir}/"], check=True, capture_output=True)
    steps = (f"cd {q} && . .podkit/env && PODKIT_PYTHON={shlex.quote(sys.executable)} bin/envsetup --project . "
             "--fingerprint logs/probe.json && bin/preflight")
    subprocess.run([*mux, target, steps], check=True, capture_output=True)
    return time.perf_counter() - start

RESULTS = ROOT / "benchmarks" / "results"


def make_tree(project: Path, target_files: int = 1000) -> int:
    existing = sum(1 for p in project.rglob("*") if p.is_file() and ".venv" not in p.parts)
    src = project / "src" / "model_zoo"
    for i in range(max(0, target_files - existing)):
        d = src / f"pkg{i // 50:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"module_{i:04d}.py").write_text(f'"""generated module {i}"""\n' + "x = 1\n" * (20 + i % 200))
    return sum(1 for p in project.rglob("*") if p.is_file() and ".venv" not in p.parts)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def phases(stdout: str) -> dict[str, float]:
    line = next((l for l in stdout.splitlines() if l.startswith("deploy: probe")), "")
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="no-change re-deploys to time (median reported)")
    args = parser.parse_args()
    why = sshd_available()
    if why:
        sys.exit(f"deploy_sync: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        pod = LoopbackPod(base, "bench").start()
        try:
            project = project_copy(base / "laptop" / "podkit")
            files = make_tree(project)
            known = base / "known_hosts"
            known.write_text(pod.known_hosts_line())
            common = ["--key", str(pod.client_key), "--remote-dir", pod.remote_dir, "--python", sys.executable]

            def deploy():
                out = pod_cli(project, "deploy", pod.spec, *common, known_hosts=known, timeout=900)
                if out.returncode != 0:
                    sys.exit(f"deploy failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
                return out

            first_s, first = timed(deploy)
            again = [timed(deploy) for _ in range(args.repeats)]

            ssh = ["ssh", "-F", "/dev/null", "-p", str(pod.port), "-o", f"UserKnownHostsFile={known}",
                   "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                   "-i", str(pod.client_key)]
            plain_dir = str(Path(pod.remote_dir).parent / "plain")
            rsync = ["rsync", "-rlptz", "--delete", "--filter=:- .gitignore", "--exclude=.git/", "--exclude=/.venv/",
                     "-e", shlex.join(ssh), f"{project}/", f"{pod.user}@127.0.0.1:{plain_dir}/"]

            def plain():
                subprocess.run(rsync, check=True, capture_output=True)

            plain_first, _ = timed(plain)
            plain_again = [timed(plain)[0] for _ in range(args.repeats)]
            # The floor for any tool that logs in per command: connect, auth, the login rc files.
            login = [timed(lambda: subprocess.run([*ssh, f"{pod.user}@127.0.0.1", "true"], check=True))[0]
                     for _ in range(args.repeats)]

            # The same no-change deploy over OpenSSH multiplexing, steps batched (see the docstring).
            control = base / "mux.sock"
            target = f"{pod.user}@127.0.0.1"
            sys.path.insert(0, str(project))
            mux_cold = []
            for _ in range(args.repeats):
                mux_cold.append(openssh_mux_deploy(ssh, target, project, pod.remote_dir, control, warm=False))
                subprocess.run([*ssh, "-o", f"ControlPath={control}", "-O", "exit", target], capture_output=True)
            subprocess.run([*ssh, "-o", f"ControlPath={control}", "-o", "ControlMaster=yes", "-o", "ControlPersist=120",
                            "-fN", target], check=True)
            mux_warm = [openssh_mux_deploy(ssh, target, project, pod.remote_dir, control, warm=True)
                        for _ in range(args.repeats)]
            subprocess.run([*ssh, "-o", f"ControlPath={control}", "-O", "exit", target], capture_output=True)
            # What a Python client pays before its first byte (both designs would be one).
            client_start = statistics.median(timed(lambda: subprocess.run(
                [sys.executable, "-c", "import podkit.pods.cli"], cwd=project, check=True))[0] for _ in range(args.repeats))

            # Throughput: one incompressible 64 MiB file, through podkit's connection and plain rsync.
            (project / "blob.bin").write_bytes(os.urandom(64 * 2**20))
            big_deploy = phases(deploy().stdout)
            big_plain, _ = timed(plain)
        finally:
            pod.stop()

    rows = [
        ("bin/deploy, first (venv + deps created)", first_s, phases(first.stdout)),
        ("bin/deploy, no change (median)", statistics.median(t for t, _ in again),
         phases(sorted(again, key=lambda x: x[0])[len(again) // 2][1].stdout)),
        ("plain rsync, first", plain_first, {}),
        ("plain rsync, no change (median)", statistics.median(plain_again), {}),
        ("ssh login + `true` (median)", statistics.median(login), {}),
        ("OpenSSH ControlMaster, batched, no change, master opened (median)", statistics.median(mux_cold), {}),
        ("OpenSSH ControlMaster, batched, no change, master kept (median)", statistics.median(mux_warm), {}),
        ("python client start (`import podkit.pods.cli`, median)", client_start, {}),
        ("bin/deploy, one new 64 MiB file", None, big_deploy),
        ("plain rsync, one new 64 MiB file", big_plain, {}),
    ]
    spread = sorted(t for t, _ in again)
    env = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
           "python": platform.python_version(), "files": files, "repeats": args.repeats,
           "transport": "OpenSSH sshd on 127.0.0.1 (loopback)",
           "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine skews every row
           "no_change_min_max_s": [round(spread[0], 3), round(spread[-1], 3)]}
    lines = [f"# Deploy on loopback: {files} files ({env['date']}, {env['machine']}, "
             f"load average {env['load_average_1m_at_end']} at the end)", "",
             "| what | wall s | probe | sync | envsetup | preflight |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, secs, ph in rows:
        cells = [f"{ph[k]:.2f}" if k in ph else "" for k in ("probe", "sync", "envsetup", "preflight")]
        lines.append(f"| {name} | {'' if secs is None else f'{secs:.2f}'} | " + " | ".join(cells) + " |")
    transport_lines = sum(len((ROOT / f).read_text().splitlines()) for f in TRANSPORT_FILES)
    podkit_s = statistics.median(t for t, _ in again)
    cold_s = statistics.median(mux_cold) + client_start
    warm_s = statistics.median(mux_warm) + client_start
    verdict = ("keep podkit's transport" if podkit_s < cold_s else "OpenSSH multiplexing is as fast: drop podkit's transport")
    env["transport_comparison"] = {"podkit_no_change_s": round(podkit_s, 3), "mux_cold_plus_client_s": round(cold_s, 3),
                                   "mux_warm_plus_client_s": round(warm_s, 3), "transport_lines": transport_lines,
                                   "verdict": verdict}
    lines += ["", f"Transport comparison, no-change deploy: podkit's own transport ({transport_lines} lines in "
              f"{', '.join(TRANSPORT_FILES)}) {podkit_s:.2f} s; OpenSSH ControlMaster with the steps batched "
              f"{cold_s:.2f} s with the master opened in the run, {warm_s:.2f} s with a master kept from an earlier "
              f"run (each plus {client_start:.2f} s for a Python client's start). Verdict: {verdict}"
              + ("" if podkit_s < warm_s else "; a persisted master is faster still, at the cost of a background "
                 "ssh process per pod left running between invocations") + "."]
    if env["load_average_1m_at_end"] > (os.cpu_count() or 1):
        lines += ["", f"Measured while other work loaded the machine (load {env['load_average_1m_at_end']} on "
                  f"{os.cpu_count()} CPUs): medians of {args.repeats}, and differences under ~0.5 s are within noise."]
    lines += ["", f"No-change re-deploys over {len(spread)} runs: {spread[0]:.2f} to {spread[-1]:.2f} s.",
              "", "Wall time includes the client's own start (Python, imports) and connecting. "
              "Phases are bin/deploy's own timings of each step; the probe phase includes the pod's login "
              "rc files, which run once per invocation (this machine's ~/.bashrc runs `pyenv init`). "
              "Rerun: `.venv/bin/python benchmarks/deploy_sync.py`."]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deploy_sync.md").write_text(table + "\n")
    (RESULTS / "deploy_sync.json").write_text(json.dumps(
        {"env": env, "rows": [{"what": n, "seconds": None if s is None else round(s, 3), "phases": p} for n, s, p in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
