"""Detached remote runs: a command started on the pod that outlives the SSH session.

The command runs under setsid/nohup with its output in logs/jobs/<id>/output.log and its exit
code written to logs/jobs/<id>/exit_code when it ends; the output reaches that log through a filter of the
secrets the pod's env file exports (envsetup/redact_stream.py). Attaching streams that log (`tail -F`
until the process is gone); a dropped or killed client stops only the tail, never the job, and
`attach` picks it up again later. fetch-logs brings logs/jobs/ back with the runs.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import time
from dataclasses import dataclass
from typing import Callable

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError
from podkit.pods.remote_stop import owners_script, stop_script

JOBS_DIR = "logs/jobs"
# The job's output on its way to output.log (envsetup/redact_stream.py): secrets out of the log, attach's stream
# and fetch-logs' copy. It runs under the job's own `python3`, which the env file sourced just before makes the
# project venv's (envfile.render puts its bin first on PATH), with podkit found in the deployed project as
# bin/smoke finds it (PYTHONPATH). A pod with no python3 (deploy.py syncs, then skips envsetup) gets the output
# unfiltered, said at its top, rather than a job that cannot write. The filter ignores stop's signals (ignored
# stays ignored across exec: POSIX exec()) and ends at the end of its input, after the command's last words. It is
# untagged, so that `jobs` does not count it as left running beside what the command left writing into it; `stop`
# finds it by the job's session while the job runs.
_REDACT = ("unset PODKIT_JOB_ID; trap '' TERM INT HUP; export PYTHONPATH=\"$PWD${PYTHONPATH:+:$PYTHONPATH}\"; "
           "python3 -c 'import podkit.envsetup.redact_stream' 2>/dev/null && exec python3 -m podkit.envsetup.redact_stream; "
           "echo 'podkit: no python to filter secrets with; output is unfiltered'; exec cat")
_ID = re.compile(r"[A-Za-z0-9_.-]{1,100}")


@dataclass
class Job:
    id: str
    command: str
    state: str  # running | exited | stopped | lost (no process and no exit code: the pod restarted)
    exit_code: int | None = None
    started: str = ""  # UTC ISO time with nanoseconds: sorts as it happened
    left_running: int = 0
    """Processes of a job that is no longer running (exited, stopped, lost) still alive: what it started in the
    background, workers its killed launcher left behind. `stop` ends them."""


def new_id(command: str) -> str:
    try:
        split = shlex.split(command)
    except ValueError:  # unbalanced quotes: the pod's shell will say so; the id needs only a word
        split = command.split()
    words = [w for w in split if not w.startswith("-")] or ["job"]
    word = re.sub(r"[^A-Za-z0-9_-]", "", words[0].rsplit("/", 1)[-1])[:20] or "job"
    # A random tail (32 bits): jobs started within the same second (a loop of --detach runs) get ids of their own.
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{word}-{secrets.token_hex(4)}"


# `again` below: the pod as the user reaches it, HOST and the reach options given (cli.PodArgs.again), which every
# hint's next command starts with: without --remote-dir or --key it would look in another directory, or not log in.


def valid_id(job_id: str, again: str = "HOST", *, new: bool = False) -> str:
    """A job id is a directory name in every remote script: nothing else gets that far. (The CLI checks the id it
    was given with its `again`; the checks inside this module see ids already checked.) `new`: the id names a job
    to start (`run --id`, on one pod or several), so the fix is another id, not a listing of one pod's jobs."""
    fix = "give another --id" if new else f"list the jobs with: bin/pod jobs {again}"
    if job_id in (".", ".."):
        raise PodError(f"job id '{job_id}' names a directory, not a job", fix)
    if not _ID.fullmatch(job_id or ""):
        raise PodError(f"job id '{job_id}' may use only letters, digits, '.', '_' and '-'", fix)
    return job_id


class StartFailed(PodError):
    """The launcher on the pod failed; the message says whether the job started all the same, `state` says it as
    start_state does ("absent": it did not start)."""

    def __init__(self, problem: str, fix: str = "", *, state: str):
        super().__init__(problem, fix)
        self.state = state


class StartRefused(StartFailed):
    """The pod refused to start the job (its id is taken, its directory cannot be made): nothing started."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem, fix, state="absent")


TAKEN = 3
"""The launcher's exit when the job's id is taken (2: it could not make the job's directory)."""


def start(conn: PodConnection, command: str, job_id: str | None = None, *, again: str,
          env: dict[str, str] | None = None, env_defaults: dict[str, str] | None = None,
          run: dict | None = None) -> str:
    """Start `command` detached; `env` is exported after the env file (it wins), `env_defaults`
    only where neither the env file nor the pod set that name (the user's choice wins). `run`: the job's place in
    a run of several nodes (run_id, node, nodes), kept beside it as run.json for attaching to that run again."""
    job_id = valid_id(job_id or new_id(command), again)
    d = f"{JOBS_DIR}/{job_id}"
    exports = "".join(f"export {_name(k)}={shlex.quote(v)}\n" for k, v in (env or {}).items())
    exports += "".join(f"[ -n \"${{{_name(k)}:-}}\" ] || export {k}={shlex.quote(v)}\n" for k, v in (env_defaults or {}).items())
    # The wrapper's first act is to record its own pid (written aside, then renamed: a reader never sees half a
    # file), before the env file or the command: from its first moment the job is one `stop`, `attach` and `jobs`
    # find, whatever becomes of the launcher below (a Ctrl-C or a dropped link right after it started the wrapper
    # left a job running that no pid file named, which `stop` could not find).
    # The inner shell sources the env file itself, after whatever BASH_ENV or rc files did
    # (pyenv or conda shims), so the project's venv is first on PATH; then it records the exit
    # code. setsid puts it in its own session, so the SSH session's hangup never reaches it.
    # PODKIT_JOB_ID tags the job's whole process tree for `stop`; PODKIT_SESSION is dropped so
    # a Ctrl-C of this client (PodConnection.stop_remote) never stops the job, and PODKIT_SHELL so a
    # later command of the same shell that runs past its timeout (PodConnection.run) does not either.
    # The command runs in a subshell, which sees every variable the env file set: its `cd`, `exec` or
    # `exit` end or move that subshell only, so the wrapper still records the code, at an absolute path. It is
    # eval'd from the file written below, not pasted into this script: a syntax error or an unterminated
    # heredoc in it is the command's failure (exit 2), not the wrapper's.
    # `stop` signals the job's whole tree, this subshell too: its TERM trap (a command, not an ignore, so the
    # command's processes still get the default) lets it wait for the command and pass on the command's own exit
    # code (bin/smoke's 130), not bash's 143.
    # A wrapper that cannot record its pid (a full disk) does not run the command: `stop` could not find that job.
    # The command's output reaches output.log through _REDACT, in a process substitution (of a `{ }` group: a
    # subshell's own redirection would be made in its child, and leave the wrapper no $! to wait for) so that `rc`
    # stays the command's own. The wrapper waits for the filter to end, i.e. to have written all the command's
    # output, before it records the code and exits (attach's `tail --pid` reads on until then); 2 s at most: a
    # process the command left running in the background (`server &`) keeps the filter's input open, and the job
    # has exited all the same. ($! names the process substitution here, checked on bash 5.2.15; where a bash leaves
    # it empty, the wrapper does not wait.)
    inner = (f'jobdir="$PWD/{d}"\n{{ echo $$ > "$jobdir/pid.wrapper" && mv -f "$jobdir/pid.wrapper" "$jobdir/pid"; }} '
             '|| { echo "podkit: cannot record the job\'s pid in $jobdir: not starting it" >&2; exit 1; }\n'
             f'[ -r .podkit/env ] && . .podkit/env\n{exports}'
             f'{{ ( trap : TERM; eval "$(cat "$jobdir/command")" ); }} > >({_REDACT}) 2>&1\n'
             f'rc=$? redact=$!; i=0; while kill -0 "$redact" 2>/dev/null && [ $i -lt 40 ]; do sleep 0.05; i=$((i+1)); done\n'
             'echo $rc > "$jobdir/exit_code.tmp" && mv "$jobdir/exit_code.tmp" "$jobdir/exit_code"')
    wrapper_start = (
        # The tag before `env` too: the wrapper's own environment carries it from its first exec (attach waits for it)
        f"PODKIT_JOB_ID={job_id} env -u PODKIT_SESSION -u PODKIT_SHELL setsid nohup bash --noprofile --norc -c {shlex.quote(inner)} "
        f"> {d}/output.log 2>&1 < /dev/null &\n"
        # The wrapper records its pid itself; waiting for that record here makes the job findable the moment this
        # returns. One that died before it could (its shell missing) is recorded by the pid it had, so that attach
        # shows what it said.
        f"w=$!; i=0; while [ ! -s {d}/pid ] && kill -0 $w 2>/dev/null && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n"
        f"[ -s {d}/pid ] || {{ echo $w > {d}/pid.launcher && mv -f {d}/pid.launcher {d}/pid; }}\n"
    )
    run_file = (f"printf '%s\\n' {shlex.quote(json.dumps(run))} > {d}/run.json || "
                f"{{ rm -f {d}/command {d}/run.json; rmdir {d}; exit 2; }}\n") if run else ""
    launcher = (
        f"mkdir -p {JOBS_DIR} || exit 2\n"
        # A plain mkdir claims the id: of two starts of one id at once, exactly one makes the directory (a test
        # for an existing pid file after `mkdir -p` let both through, and both started). A taken id is told by its
        # exit code: its message and hint are made below, with the `again` the pod's shell has no use for.
        f"made=$(mkdir {d} 2>&1) || {{ [ -e {d} ] && exit {TAKEN}; printf '%s\\n' \"$made\" >&2; exit 2; }}\n"
        f"printf '%s\\n' {shlex.quote(command)} > {d}/command || {{ rm -f {d}/command; rmdir {d}; exit 2; }}\n"
        f"{run_file}"
        f"date -u +%Y-%m-%dT%H:%M:%S.%NZ > {d}/started\n"
        # Claimed: the launcher goes on as a bash exec'd with the job's tag (the same pid, so a kill of it is still
        # its exit), which its fork for the wrapper inherits: a launcher killed between that fork and the fork's
        # exec of `env` (the OOM killer) leaves a process start_state finds by the tag, so it says "running" rather
        # than removing the directory of a job about to start (and stop stops it). Only after the claim: a start
        # refused for a taken id must not pass, even for a moment, for a process of that other job.
        f"exec env PODKIT_JOB_ID={job_id} bash --noprofile --norc -c {shlex.quote(wrapper_start)}\n"
    )
    # The launcher's environment carries the connection's PODKIT_SESSION tag: a Ctrl-C of this client (stop_remote)
    # ends it, and a child of it not yet the wrapper, before the client asks the pod whether the job started;
    # running on, it could start the job after the pod had been found without it. The shared shell is exec'd with
    # the tag (pods/shell.py), so its subshell has it too; this bash of its own (exec'd) has it whatever shell runs it.
    result = conn.run(f"exec bash --noprofile --norc -c {shlex.quote(launcher)}")
    said_last = ((result.stderr or result.stdout).strip().splitlines() or [""])[-1][:200]  # after what rc files said
    if result.exit_code == TAKEN:
        raise StartRefused(f"could not start the job: job {job_id} exists",
                           f"give another --id, or follow it: bin/pod attach {again} {job_id}")
    if result.exit_code == 2:
        raise StartRefused(f"could not start the job: {said_last}")
    if not result.ok:  # the launcher itself failed (killed?), perhaps after the wrapper started: say which
        why = (f"its launcher was killed by signal {result.exit_code - 128}" if result.exit_code > 128 else
               said_last or f"its launcher exited {result.exit_code}")
        state = start_state(conn, job_id)
        fix = "re-run" if state == "absent" else f"check with: bin/pod jobs {again}; stop it with: bin/pod stop {again} {job_id}"
        raise StartFailed(f"could not start job {job_id} ({why}); {said(state)}", fix, state=state)
    return job_id


_STATE_WORDS = {
    "absent": "it did not start",
    "running": "it started and runs",
    "exited": "it started and has already {state}",
    "lost": "it started, but no longer runs and left no exit code",
}


def said(state: str) -> str:
    """A start_state in words: "it did not start", "it started and runs", ..."""
    return _STATE_WORDS[state.split(" ")[0]].format(state=state)


def start_state(conn: PodConnection, job_id: str) -> str:
    """After a start that was cut short (Ctrl-C, its launcher killed): did the job start? "running", "exited CODE",
    "lost" (it started and ended without a code), or "absent" (it did not start). A directory the start left
    with nothing started in it (no pid, no output, no process of the job) is removed, so the id can be used again.
    Raises PodError when the pod cannot be asked."""
    d = f"{JOBS_DIR}/{valid_id(job_id)}"
    script = (
        f"[ -d {d} ] || {{ echo absent; exit 0; }}\n"
        f"[ -r {d}/exit_code ] && {{ echo \"exited $(cat {d}/exit_code)\"; exit 0; }}\n"
        f"{_OURS}pid=$(cat {d}/pid 2>/dev/null)\n"
        # its wrapper (by the pid it recorded), or any process of the job: one that has not recorded its pid yet
        f"if ours \"$pid\" {job_id} || grep -qzxF PODKIT_JOB_ID={job_id} /proc/[0-9]*/environ 2>/dev/null; then echo running; exit 0; fi\n"
        f"if [ ! -e {d}/pid ] && [ ! -s {d}/output.log ]; then rm -f {d}/command {d}/run.json {d}/started {d}/output.log\n"
        f"  rmdir {d} 2>/dev/null && {{ echo absent; exit 0; }}; fi\n"
        "echo lost\n"
    )
    result = conn.run(script, timeout=60)
    state = result.stdout.strip().splitlines()[-1:] or [""]
    if not result.ok or state[0].split(" ")[0] not in _STATE_WORDS:
        raise PodError(f"could not tell whether job {job_id} started: {(result.stderr or result.stdout).strip()[:200]}")
    return state[0]


def run_of(conn: PodConnection, job_id: str) -> dict | None:
    """The job's place in a run of several nodes (start's `run`), or None for a job started without one."""
    result = conn.run(f"cat {JOBS_DIR}/{valid_id(job_id)}/run.json 2>/dev/null", timeout=60)
    try:
        run = json.loads(result.stdout) if result.ok else None
    except ValueError:
        return None
    return run if isinstance(run, dict) else None


def _name(key: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ValueError(f"not an environment variable name: {key!r}")
    return key


class NoSuchJob(PodError):
    """The pod has no job of that id."""


def require(conn: PodConnection, job_id: str, *, again: str) -> None:
    """Raise NoSuchJob unless the pod has a job of that id: one a start claimed (its command written), whether or
    not its wrapper has recorded its pid yet (start_state says "running" from the job's tag alone)."""
    if conn.run(f"[ -r {JOBS_DIR}/{valid_id(job_id, again)}/command ]").exit_code != 0:
        raise NoSuchJob(f"no job '{job_id}' on this pod", f"list them with: bin/pod jobs {again}")


# Shell defining `ours PID ID`: PID is alive and is job ID's wrapper. A pid file outlives its process: after the pod
# restarts, the pid it names may be any other process (the next job's worker, the user's notebook), which `kill -0`
# alone took for the job (listed running, attach waiting on it forever, stop killing it).
_OURS = ('ours() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null && '
         'grep -qzxF "PODKIT_JOB_ID=$2" /proc/$1/environ 2>/dev/null; }\n')


LOST = 4
"""attach's remote exit when the job left no exit code; a job's own 4 is told apart by its exit_code file."""


def attach(conn: PodConnection, job_id: str, out: Callable[[str], None], *, again: str) -> int | None:
    """Stream the job's output until it ends; return its exit code, None when it ended without one (killed
    with its wrapper, or the pod restarted: `jobs` lists it as lost)."""
    d = f"{JOBS_DIR}/{valid_id(job_id, again)}"
    require(conn, job_id, again=again)  # on its own: the stream below exits with the job's code, which may be any number
    script = (
        # A start whose wrapper has not recorded its pid yet (its launcher killed between its fork and the fork's
        # exec): wait for the record while a process of the job lives, 5 s at most.
        f"n=0; while [ $n -lt 100 ] && ! [ -r {d}/pid ] && grep -qzxF PODKIT_JOB_ID={job_id} /proc/[0-9]*/environ "
        f"2>/dev/null; do sleep 0.05; n=$((n + 1)); done\n"
        f"{_OURS}pid=$(cat {d}/pid 2>/dev/null)\n"
        # A pid file that names a live process not (yet) tagged: a job started by an older podkit, whose pid file
        # held $!, or one the pod reused after a restart. Wait for the tag (5 s at most), or attach would print an
        # output.log the job has not written yet and miss the rest. (The wrapper now records its own, tagged pid.)
        f"n=0; while [ $n -lt 100 ] && ! [ -r {d}/exit_code ] && kill -0 \"$pid\" 2>/dev/null && ! ours $pid {job_id}; "
        f"do sleep 0.05; n=$((n + 1)); done\n"
        f"if ours $pid {job_id}; then tail -n +1 -F --pid=$pid {d}/output.log 2>/dev/null; else cat {d}/output.log; fi\n"
        f"for i in 1 2 3 4 5 6 7 8 9 10; do [ -r {d}/exit_code ] && break; sleep 0.2; done\n"
        f"[ -r {d}/exit_code ] && exit $(cat {d}/exit_code)\n"
        f"echo 'podkit: job {job_id} ended without an exit code (killed or the pod restarted)' >&2; exit {LOST}\n"
    )
    code = conn.run(script, out=out).exit_code
    if code == LOST and conn.run(f"[ -r {d}/exit_code ]").exit_code != 0:
        return None
    return code


def stop(conn: PodConnection, job_id: str, grace: float = 30.0, *, again: str) -> str:
    """Stop the job's whole process tree (SIGTERM, SIGKILL after `grace` s); its wrapper shell is
    spared so it still records the exit code. Returns what happened, in words."""
    d = f"{JOBS_DIR}/{valid_id(job_id, again)}"
    script = (
        f"[ -r {d}/command ] || {{ echo 'podkit: no job {job_id} on this pod' >&2; exit 3; }}\n"
        # An exited job may have left processes running (started in the background, workers of a killed
        # launcher): they carry its tag still, and are stopped as a running job's are.
        f"if [ -r {d}/exit_code ]; then code=$(cat {d}/exit_code)\n"
        f"  left=$( ({stop_script(f'PODKIT_JOB_ID={job_id}', grace)}) )\n"
        f"  if [ \"$left\" = 'stopped 0' ]; then echo \"already exited $code\"; "
        f"else echo \"already exited $code; of what it left running: $left\"; fi; exit 0; fi\n"
        # No pid yet (a start cut short before its wrapper recorded it): every process of the job is stopped.
        f"{_OURS}wrapper=$(cat {d}/pid 2>/dev/null); ours \"$wrapper\" {job_id} || wrapper=\n"
        f"({stop_script(f'PODKIT_JOB_ID={job_id}', grace, spare_var='wrapper')})\n"
        # Marked once the stop has run its course: one cut short (a Ctrl-C ends its loop on the pod too) leaves a
        # job that, exiting later on its own, `jobs` lists as exited, not stopped.
        f"touch {d}/stopped"
    )
    result = conn.run(script + f"\nfor i in 1 2 3 4 5 6 7 8 9 10; do [ -r {d}/exit_code ] && break; sleep 0.2; done\n"
                      f"ours \"$wrapper\" {job_id} && kill -KILL $wrapper 2>/dev/null; true\n", timeout=grace + 60)
    if result.exit_code == 3:
        raise NoSuchJob(f"no job '{job_id}' on this pod", f"list them with: bin/pod jobs {again}")
    return (result.stdout.strip().splitlines() or ["stopped"])[0]


def newest(conn: PodConnection, running: bool = False) -> Job | None:
    """The job started last (by its start time, not its name); with `running`, the last of those still running
    when any is."""
    jobs = list_jobs(conn)
    if running and any(j.state == "running" for j in jobs):
        jobs = [j for j in jobs if j.state == "running"]
    return max(jobs, key=lambda j: j.started) if jobs else None


def list_jobs(conn: PodConnection) -> list[Job]:
    script = (
        f"[ -d {JOBS_DIR} ] || exit 0\n{_OURS}"
        # every live process's tags, once, by stop's rule (its own, or its parent's where it cleared its
        # environment): what a job that no longer runs left running is what `stop` ends
        f"tags=$( ({owners_script()}) )\n"
        f"for d in {JOBS_DIR}/*/; do id=$(basename $d); pid=$(cat $d/pid 2>/dev/null)\n"
        f"  if [ -r $d/exit_code ] && [ -e $d/stopped ]; then st=\"stopped $(cat $d/exit_code)\"; elif [ -r $d/exit_code ]; then st=\"exited $(cat $d/exit_code)\"; elif ours \"$pid\" \"$id\"; then st=running; else st=lost; fi\n"
        f"  n=0; [ \"$st\" = running ] || n=$(printf '%s\\n' \"$tags\" | grep -cxF \"PODKIT_JOB_ID=$id\")\n"
        f"  printf '%s\\t%s\\t%s\\t%s\\t%s\\n' \"$id\" \"$st\" \"$n\" \"$(cat $d/started 2>/dev/null)\" \"$(head -c 200 $d/command | head -n 1)\"; done\n"
    )
    jobs = []
    for line in conn.run(script).stdout.splitlines():
        parts = line.split("\t", 4)
        if len(parts) != 5 or not _ID.fullmatch(parts[0]):
            continue
        state, _, code = parts[1].partition(" ")
        jobs.append(Job(parts[0], parts[4], state, int(code) if code.strip().lstrip("-").isdigit() else None, parts[3],
                        int(parts[2]) if parts[2].isdigit() else 0))
    return jobs
