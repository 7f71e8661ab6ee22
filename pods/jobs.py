"""Detached remote runs: a command started on the pod that outlives the SSH session.

The command runs under setsid/nohup with its output in logs/jobs/<id>/output.log and its exit
code written to logs/jobs/<id>/exit_code when it ends. Attaching streams that log (`tail -F`
until the process is gone); a dropped or killed client stops only the tail, never the job, and
`attach` picks it up again later. fetch-logs brings logs/jobs/ back with the runs.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from typing import Callable

from pods.connection import PodConnection
from pods.errors import PodError

JOBS_DIR = "logs/jobs"


@dataclass
class Job:
    id: str
    command: str
    state: str  # running | exited | lost (no process and no exit code: the pod restarted)
    exit_code: int | None = None


def new_id(command: str) -> str:
    words = [w for w in shlex.split(command) if not w.startswith("-")] or ["job"]
    word = re.sub(r"[^A-Za-z0-9_-]", "", words[0].rsplit("/", 1)[-1])[:20] or "job"
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{word}"


def start(conn: PodConnection, command: str, job_id: str | None = None) -> str:
    job_id = job_id or new_id(command)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", job_id):
        raise PodError(f"job id '{job_id}' may use only letters, digits, '.', '_' and '-'")
    d = f"{JOBS_DIR}/{job_id}"
    # The inner shell records the exit code; setsid puts it in its own session, so the SSH
    # session's hangup never reaches it.
    inner = f"{command}\nrc=$?; echo $rc > {d}/exit_code.tmp && mv {d}/exit_code.tmp {d}/exit_code"
    script = (
        f"mkdir -p {d} || exit 2\n"
        f"if [ -e {d}/pid ]; then echo 'job {job_id} exists' >&2; exit 2; fi\n"
        f"printf '%s\\n' {shlex.quote(command)} > {d}/command\n"
        f"date -u +%Y-%m-%dT%H:%M:%SZ > {d}/started\n"
        f"setsid nohup bash -c {shlex.quote(inner)} > {d}/output.log 2>&1 < /dev/null &\n"
        f"echo $! > {d}/pid\n"
    )
    result = conn.run(script)
    if not result.ok:
        raise PodError(f"could not start the job: {(result.stderr or result.stdout).strip()[:200]}")
    return job_id


def attach(conn: PodConnection, job_id: str, out: Callable[[str], None]) -> int:
    """Stream the job's output until it ends; return its exit code."""
    d = f"{JOBS_DIR}/{job_id}"
    script = (
        f"[ -r {d}/pid ] || {{ echo 'podkit: no job {job_id} on this pod' >&2; exit 3; }}\n"
        f"pid=$(cat {d}/pid)\n"
        f"if kill -0 $pid 2>/dev/null; then tail -n +1 -F --pid=$pid {d}/output.log 2>/dev/null; else cat {d}/output.log; fi\n"
        f"for i in 1 2 3 4 5 6 7 8 9 10; do [ -r {d}/exit_code ] && break; sleep 0.2; done\n"
        f"[ -r {d}/exit_code ] && exit $(cat {d}/exit_code)\n"
        f"echo 'podkit: job {job_id} ended without an exit code (killed or the pod restarted)' >&2; exit 4\n"
    )
    result = conn.run(script, out=out)
    if result.exit_code == 3:
        raise PodError(f"no job '{job_id}' on this pod", "list them with: bin/pod jobs HOST")
    return result.exit_code


def list_jobs(conn: PodConnection) -> list[Job]:
    script = (
        f"[ -d {JOBS_DIR} ] || exit 0\n"
        f"for d in {JOBS_DIR}/*/; do id=$(basename $d); pid=$(cat $d/pid 2>/dev/null)\n"
        f"  if [ -r $d/exit_code ]; then st=\"exited $(cat $d/exit_code)\"; elif [ -n \"$pid\" ] && kill -0 $pid 2>/dev/null; then st=running; else st=lost; fi\n"
        f"  printf '%s\\t%s\\t%s\\n' \"$id\" \"$st\" \"$(head -c 200 $d/command | head -n 1)\"; done\n"
    )
    jobs = []
    for line in conn.run(script).stdout.splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        state, _, code = parts[1].partition(" ")
        jobs.append(Job(parts[0], parts[2], state, int(code) if code.strip().lstrip("-").isdigit() else None))
    return jobs
