"""Deploy timings on loopback: first deploy and no-change re-deploy of a ~1,000-file project, next
to the same tree synced by plain rsync over the same sshd. One run measures all of them.

    .venv/bin/python benchmarks/deploy_sync.py [--repeats 5]

Needs sshd, ssh and rsync (as the test suite does). Writes benchmarks/results/deploy_sync.{md,json}.
The deploy numbers include everything `bin/deploy` does: connect, probe, sync, envsetup (the
first one creates the pod's venv), and preflight on the pod. Also measured: one OpenSSH login
running `true` (what each command costs a tool that logs in per command), and one new 64 MiB
file, through podkit's connection and through plain rsync.
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
        ("bin/deploy, one new 64 MiB file", None, big_deploy),
        ("plain rsync, one new 64 MiB file", big_plain, {}),
    ]
    spread = sorted(t for t, _ in again)
    env = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
           "python": platform.python_version(), "files": files, "repeats": args.repeats,
           "transport": "OpenSSH sshd on 127.0.0.1 (loopback)",
           "no_change_min_max_s": [round(spread[0], 3), round(spread[-1], 3)]}
    lines = [f"# Deploy on loopback: {files} files ({env['date']}, {env['machine']})", "",
             "| what | wall s | probe | sync | envsetup | preflight |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, secs, ph in rows:
        cells = [f"{ph[k]:.2f}" if k in ph else "" for k in ("probe", "sync", "envsetup", "preflight")]
        lines.append(f"| {name} | {'' if secs is None else f'{secs:.2f}'} | " + " | ".join(cells) + " |")
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
