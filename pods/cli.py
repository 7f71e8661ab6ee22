"""bin/pod (and bin/deploy, bin/fetch-logs): thin click commands over pods.*.

Commands: deploy, run (detached jobs), attach, stop, jobs, probe, fetch-logs; up, down, ls, gpus (RunPod's API);
guard (a pod's cost guard).

Exit codes: 0 ok, 1 envsetup/preflight or the remote command failed, 2 bad input or a connection
fault (one line saying what and how to fix it), 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NoReturn

import click

from podkit.checks.command import stop_signals, wants_json
from podkit.checks.errors import ConfigError
from podkit.pods import jobs as remote_jobs
from podkit.pods.connection import PodConnection
from podkit.pods.deploy import Outcome, PodOptions, Printer, connect, deploy, locate
from podkit.pods.errors import OutputClosed, PodError
from podkit.pods.fetch import PartlyFetched
from podkit.pods.fetch import check_target as check_fetch_target
from podkit.pods.fetch import fetch as fetch_logs
from podkit.pods.hosts import HostSpec, load_inventory, select_hosts
from podkit.pods.ownership import deployed as is_deployed
from podkit.envsetup.fingerprint import Fingerprint
from podkit.pods.profiles import PodProfile
from podkit.pods.sync import changed_note, changed_since_deploy
from podkit.pods import progress as bars
from podkit.pods.tables import deploy_table, jobs_table, pods_table, print_table

EXIT_FAILED = 1  # the module doc's "the remote command failed": also a job lost without an exit code of its own


def pod_options(fn, *, transfer: bool = False):
    """Options every command that reaches a pod shares (SkyPilot style: defined once); `transfer` adds
    the options only the commands that move files take (deploy's sync, fetch-logs)."""
    options = [
        # No envvar: an unrelated KEY in the environment is not a key path (the Makefile passes KEY= on).
        click.option("--key", help="Private key file (identity)."),
        click.option("--ssh-config", type=click.Path(dir_okay=False, path_type=Path),
                     help="ssh config file, read as OpenSSH reads it (default ~/.ssh/config and the system one)."),
        click.option("--profile", type=click.Choice(["auto", "runpod", "sagemaker", "generic"]), default=None,
                     help="Pod profile; detected when left out."),
        click.option("--remote-dir", help="Project directory on the pod (default: the profile's, e.g. /workspace/<project>)."),
        click.option("--python", "python", help="Interpreter on the pod that has the image's torch (default: detected)."),
        click.option("--inventory", "inventory", type=click.Path(dir_okay=False), help="pods.toml with named pods (default ./pods.toml)."),
        click.option("--accept-new", is_flag=True, help="Record an unknown host key in known_hosts (like ssh's accept-new)."),
        click.option("--known-hosts", type=click.Path(dir_okay=False, path_type=Path), help="known_hosts file (default ~/.ssh/known_hosts)."),
        click.option("--timeout", type=click.FloatRange(1, 300), default=10.0, show_default=True, help="Connect timeout, seconds; a link silent for 3x this is dropped."),
    ]
    if transfer:
        options.append(click.option("--bwlimit", type=click.IntRange(1), help="Transfer limit for sync/fetch, KiB/s."))

    @functools.wraps(fn)
    def wrapper(*args, key, ssh_config, profile, remote_dir, python, inventory, accept_new, known_hosts, timeout, bwlimit=None,
                **kwargs):
        pods = PodArgs(key, profile, remote_dir, python, inventory,
                       PodOptions(known_hosts=known_hosts, accept_new=accept_new, timeout=timeout, bwlimit=bwlimit,
                                  ssh_config=ssh_config))
        return fn(*args, pods=pods, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def transfer_pod_options(fn):
    """pod_options plus --bwlimit: for deploy and fetch-logs only."""
    return pod_options(fn, transfer=True)


@dataclass(frozen=True)
class PodArgs:
    """The shared options, gathered: which pods, and how to reach them."""

    key: str | None
    profile: str | None
    remote_dir: str | None
    python: str | None
    inventory: str | None
    opts: PodOptions

    def specs(self, host: str) -> list[HostSpec]:
        return select_hosts(host, load_inventory(self.inventory), key=self.key, profile=self.profile,
                            remote_dir=self.remote_dir, python=self.python)

    def again(self, host: str) -> str:
        """HOST and the reach options given, quoted for a shell: the start of a hint's next command, which
        without --remote-dir or --key would look for the job in another directory, or fail to log in."""
        import shlex

        given = [("--key", self.key), ("--profile", self.profile), ("--remote-dir", self.remote_dir),
                 ("--python", self.python), ("--inventory", self.inventory),
                 ("--ssh-config", self.opts.ssh_config), ("--known-hosts", self.opts.known_hosts)]
        return shlex.join([host] + [w for flag, value in given if value for w in (flag, str(value))])

    @contextmanager
    def one(self, host: str, *, deployed: bool = False, err: bool = False) -> Iterator[tuple[PodConnection, HostSpec, Fingerprint, PodProfile, str]]:
        """Exactly one pod, connected and located: (conn, spec, fingerprint, profile, remote dir).
        With `deployed`, the project directory must hold a deploy (jobs run and log there).
        With `err`, the connection's notes go to stderr (stdout carries --json)."""
        specs = self.specs(host)
        if len(specs) != 1:
            raise PodError(f"'{host}' names {len(specs)} pods", "give exactly one")
        with connect(specs[0], self.opts, lambda line: click.echo(line, err=err)) as conn:
            located = locate(conn, specs[0], self.opts.project)
            if deployed and not is_deployed(conn, located[2]):
                raise PodError(f"{located[2]} on {specs[0].name} was never deployed",
                               f"run: bin/pod deploy {self.again(host)}, then re-run")
            yield (conn, specs[0], *located)


def _bad_input_json(problem: str, fix: str = "", host: str = "", field: str = "") -> None:
    """What --json prints on stdout for bad input: preflight's and smoke's object, with the pod it concerns."""
    data = ConfigError(field, problem, fix).to_json()
    data["error"]["host"] = host
    click.echo(json.dumps(data, indent=2))


def _error_json(exc: PodError) -> dict:
    """The bad-input object's "error", for a job's object that carries one (a start that failed, a follow cut)."""
    return {**ConfigError(exc.field, exc.problem, exc.fix).to_json()["error"], "host": exc.host}


def guarded(fn):
    """One line and exit 2 for PodError; 130 for Ctrl-C; never a traceback for expected faults."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PodError as exc:
            if kwargs.get("as_json"):  # scripts get the error as the object they asked for
                _bad_input_json(exc.problem, exc.fix, exc.host, exc.field)
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("\ninterrupted (anything finished is kept; re-run to continue)", err=True)
            sys.exit(130)
        except (OutputClosed, BrokenPipeError):  # the remote's output or podkit's own lines
            _quiet_closed()
            _note("output closed by its reader; stopped")
            sys.exit(141)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Pods: rent them on RunPod, deploy code and environment, run commands detached, fetch logs back.

    \b
    RunPod (key: RUNPOD_API_KEY or .podkit/env):
      up      create a pod, wait for SSH, record it in pods.toml
      down    stop it (volume kept) or --terminate it
      ls      the account's pods, with each podkit pod's cost guard
      gpus    GPU types, memory and price per hour
    Any SSH host: deploy, run (detached), attach, stop, jobs, probe, fetch-logs.
    Cost: guard shows, arms or cancels the watchdog that stops a pod (after
      a smoke run, after HOURS, or when idle).

    Exit codes: 0 ok, 1 envsetup/preflight or the remote command failed, 2 bad input or a
    connection fault, 130 interrupted; run (without --detach) and attach exit with the
    job's own code (1 for a job lost without one).
    """


@main.command("deploy")
@click.argument("host", metavar="HOST")
@click.option("--config", help="Job TOML to preflight on the pod (path inside the project).")
@click.option("--force", is_flag=True,
              help="Deploy into a non-empty REMOTE_DIR that podkit did not create (its files are kept: never overwritten or deleted).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every pod's outcome); progress goes to stderr.")
@transfer_pod_options
@guarded
def deploy_cmd(host, config, force, as_json, pods: PodArgs):
    """Probe, sync, set up the environment and preflight on HOST (several in parallel).

    HOST is user@host[:port], an ~/.ssh/config alias, the pasted RunPod line
    'ssh root@IP -p PORT -i KEY', or a pods.toml name or group; several separated by commas.
    """
    if config:  # before connecting: a typo is bad input, not a pod's
        config = _check_job_path(config, pods.opts.project)
        _check_job(config, pods.opts.project)
    specs = pods.specs(host)
    try:
        outcomes: list[Outcome] = deploy(specs, dataclasses.replace(pods.opts, force=force), config, err=as_json)
    except KeyboardInterrupt:
        if as_json:  # scripts get their one object on a Ctrl-C too, as bin/pod run prints it
            click.echo(json.dumps({"ok": False, "interrupted": True, "exit_code": 130,
                                   "pods": [{"pod": s.name, "result": "interrupted"} for s in specs]}, indent=2))
        raise
    if as_json:
        click.echo(json.dumps({"ok": all(o.exit_code == 0 for o in outcomes),
                               "pods": [o.to_json() for o in outcomes]}, indent=2))
        for o in outcomes:
            if o.error:
                click.echo(f"error: {o.error}", err=True)
        sys.exit(max(o.exit_code for o in outcomes))
    if len(outcomes) == 1 and outcomes[0].error:
        raise PodError(outcomes[0].error)
    click.echo()
    print_table(deploy_table(outcomes))
    for o in outcomes:
        if o.error:
            click.echo(f"{o.pod}: {o.error}")
    sys.exit(max(o.exit_code for o in outcomes))


@main.command("fetch-logs")
@click.argument("host", metavar="HOST")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=Path("pod-logs"), show_default=True,
              help="Local directory; each pod's files go to DEST/<pod>/.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (what came back from each pod).")
@transfer_pod_options
@guarded
def fetch_cmd(host, dest, as_json, pods: PodArgs):
    """Bring every run directory and log from HOST back to pod-logs/<pod>/ (incremental, resumable)."""
    _check_dest(dest)
    specs, opts = pods.specs(host), pods.opts
    for spec in specs:  # before connecting: a file where DEST/<pod> or its runs/ goes is the user's
        check_fetch_target(dest / spec.name)
    printer = Printer(prefix=len(specs) > 1, err=as_json)
    results: list[dict] = []
    try:
        # SIGTERM/SIGHUP as Ctrl-C: the fetch then records what already arrived as podkit's (fetch.py); killed at
        # their default, the next fetch took it for the user's and never fetched its updates.
        with _stops_like_ctrl_c():
            worst = _fetch_each(specs, opts, dest, printer, results)
    except KeyboardInterrupt:
        if as_json:  # scripts get their one object on a Ctrl-C too, as deploy and run print it
            done = {r["pod"] for r in results}
            click.echo(json.dumps({"ok": False, "interrupted": True, "exit_code": 130, "pods": results + [
                {"pod": s.name, "ok": False, "result": "interrupted"} for s in specs if s.name not in done]}, indent=2))
        raise
    if as_json:
        click.echo(json.dumps({"ok": worst == 0, "pods": results}, indent=2))
    sys.exit(worst)


def _fetch_each(specs, opts, dest: Path, printer, results: list[dict]) -> int:
    """Fetch each pod in turn into DEST/<pod>, appending each one's result; the worst exit code."""
    worst = 0
    for spec in specs:  # sequential: fetches share the local disk and are usually small
        say = printer.for_pod(spec.name)
        try:
            with connect(spec, opts, say, for_rsync=True) as conn:
                fp, _, rdir = locate(conn, spec, opts.project)
                target = dest / spec.name
                with bars.transfer(f"fetch {spec.name}", plain=say) as progress:
                    stats = fetch_logs(conn, rdir, target, rsync_on_pod="rsync" in fp.tools, progress=progress,
                                       bwlimit=opts.bwlimit)
                say(f"fetch-logs: {stats} -> {target}/")
                results.append({"pod": spec.name, "ok": True, **_fetched(target, stats)})
        except PodError as exc:
            # errors on stderr (they were on stdout, mixed into the progress a script reads)
            message = str(exc.on(spec.name) if not exc.host else exc)
            click.echo(f"[{spec.name}] error: {message}" if len(specs) > 1 else f"error: {message}", err=True)
            # a top that failed after the other came back: which came back, and its figures, so a script knows
            # runs/ is here; none where none did
            came = ({"fetched": exc.fetched, **_fetched(dest / spec.name, exc.stats)}
                    if isinstance(exc, PartlyFetched) and exc.fetched else {})
            results.append({"pod": spec.name, "ok": False, **came, "error": message})
            worst = 2
    return worst


def _fetched(target: Path, stats) -> dict:
    """--json's figures for what a fetch brought into `target` (a TransferStats)."""
    return {"dest": str(target), "files": stats.files, "bytes": stats.bytes, "seconds": round(stats.seconds, 2),
            "kept": stats.kept}


def _check_dest(dest: Path) -> None:
    """--dest: a directory that exists or can be made, writable; checked before any pod is reached."""
    if not str(dest).strip():
        raise PodError("--dest is empty", "give a local directory, e.g. pod-logs")
    path = Path(os.path.normpath(dest.absolute()))
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise PodError(f"--dest {dest}: {ancestor} is a file", "give a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PodError(f"--dest {dest}: {ancestor} is not writable", "give a writable directory")


class CommandAfterHost(click.Command):
    """`run HOST COMMAND...`: every word from COMMAND's first on is the pod's, even without `--`, so
    `bin/pod run a100 bin/smoke --json -d` passes --json and -d to bin/smoke (click's interspersed
    parsing would otherwise take them as run's own)."""

    def parse_args(self, ctx, args):
        takes_value = {name: not (p.is_flag or p.count) for p in self.get_params(ctx) if isinstance(p, click.Option)
                       for name in p.opts + p.secondary_opts}
        positionals, i, start = 0, 0, None
        while i < len(args) and args[i] != "--":  # the user's own `--` already ends run's options
            word = args[i]
            if word.startswith("-") and word != "-":
                if word.split("=", 1)[0] not in takes_value and positionals:  # an option of COMMAND's, not run's
                    start = i
                    break
                i += 2 if takes_value.get(word.split("=", 1)[0]) and "=" not in word else 1
                continue
            positionals += 1
            if positionals == 2:  # COMMAND's first word
                start = i
                break
            i += 1
        if start is not None:
            args = [*args[:start], "--", *args[start:]]
        return super().parse_args(ctx, args)


@main.command("run", cls=CommandAfterHost, context_settings={"ignore_unknown_options": True})
@click.argument("host", metavar="HOST")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--detach", "-d", is_flag=True, help="Start it and return; attach later with `bin/pod attach`.")
@click.option("--id", "job_id", help="Job id (default: time and command name); with --nodes, the run id.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: the job, pod and log (detached), or also its exit code; its output goes to stderr.")
@click.option("--nodes", is_flag=True, help="HOST names several pods: run COMMAND across them as one torchrun world "
              "(c10d rendezvous on the first).")
@click.option("--nproc-per-node", type=click.IntRange(1), default=None,
              help="With --nodes: processes per node (default: the job's cluster.gpus_per_node, else one per GPU).")
@pod_options
@guarded
def run_cmd(host, command, detach, job_id, as_json, nodes, nproc_per_node, pods: PodArgs):
    """Run COMMAND on HOST detached from SSH (it survives a dropped connection), streaming its output.

    Options go before COMMAND; every word from COMMAND on is the pod's.
    Example: bin/pod run my-pod -- bin/smoke --config job.toml

    Several nodes: bin/pod run a,b --nodes -- bin/smoke --config job.toml (every node's output
    prefixed by its name; a node that fails stops the others; the exit code is the failing node's).
    """
    if job_id:
        remote_jobs.valid_id(job_id, new=True)
    if nodes:
        sys.exit(_run_nodes(host, command, detach, job_id, nproc_per_node, as_json, pods))
    if nproc_per_node is not None:
        raise PodError("--nproc-per-node goes with --nodes", "add --nodes, or leave it out")
    if len(specs := pods.specs(host)) > 1:
        raise PodError(f"'{host}' names {len(specs)} pods", "give one, or add --nodes to run one torchrun world across them")
    again = pods.again(host)
    with pods.one(host, deployed=True, err=as_json) as (conn, spec, _, _, rdir):
        changed = changed_since_deploy(conn, pods.opts.project, rdir)
        if changed:
            click.echo(changed_note(changed, again), err=True)
        line = _command_line(command)
        jid = job_id or remote_jobs.new_id(line)  # known before the start: a start cut short names it
        job = {"job": jid, "pod": spec.name, "host": spec.host, "remote_dir": rdir,
               "log": f"{rdir}/{remote_jobs.JOBS_DIR}/{jid}/output.log", "changed_since_deploy": changed}
        _note_running(conn, spec, again)
        try:
            remote_jobs.start(conn, line, jid, again=again)
        except KeyboardInterrupt:
            _start_interrupted(conn, again, job, as_json)
        except remote_jobs.StartFailed as exc:  # it says whether the job started
            _start_failed(job, exc.state, exc, as_json)
        except PodError as exc:  # the link failed while the start was in flight: it may have started
            _start_failed(job, None, PodError(
                f"{exc.problem}; job {jid} may have started on {spec.name}", f"check with: bin/pod jobs {again}; "
                f"follow it: bin/pod attach {again} {jid}; stop it: bin/pod stop {again} {jid}", exc.host, exc.field),
                as_json)
        click.echo(f"job {jid} started on {spec.name}; output: {remote_jobs.JOBS_DIR}/{jid}/output.log", err=True)
        if detach:
            click.echo(f"attach with: bin/pod attach {again} {jid}", err=True)
            if as_json:
                click.echo(json.dumps({"ok": True, **job, "detached": True, "exit_code": None}, indent=2))
            return
        code = _follow(conn, again, jid, as_json, job)
    click.echo(f"job {jid} exited {code}" if code is not None else f"job {jid} is lost: it left no exit code",
               err=True)
    if as_json:
        click.echo(json.dumps({"ok": code == 0, **job, "detached": False, "exit_code": code}, indent=2))
    sys.exit(EXIT_FAILED if code is None else code)


def _note_running(conn: PodConnection, spec: HostSpec, again: str) -> None:
    """One line on stderr naming the detached jobs already running on the pod: a second job beside them shares its
    GPUs (and their memory). A note, never a refusal: running two at once may be what the user wants."""
    running = sorted((j for j in remote_jobs.list_jobs(conn) if j.state == "running"), key=lambda j: j.started)
    if not running:
        return
    named = ", ".join(f"{j.id} ({j.command[:60]})" for j in running[:3])
    more = f" and {len(running) - 3} more" if len(running) > 3 else ""
    one = len(running) == 1
    click.echo(f"note: {spec.name} already runs {'job' if one else f'{len(running)} jobs:'} {named}{more}; this one starts "
               f"beside {'it' if one else 'them'}, on the same GPUs (list them: bin/pod jobs {again})", err=True)


def _start_interrupted(conn: PodConnection, again: str, job: dict, as_json: bool) -> NoReturn:
    """Ctrl-C while the job was being started: it may well have started, and a re-run would start it a second time.
    Ask the pod (the link may still allow it) and say which, how to follow or stop it; where the pod cannot be
    asked, say so. Exit 130."""
    jid, pod = job["job"], job["pod"]
    _note(f"\ninterrupted while starting job {jid} on {pod}; asking the pod whether it started (Ctrl-C again to stop "
          "asking)")
    try:
        state = remote_jobs.start_state(conn, jid)
    except (PodError, KeyboardInterrupt):
        state = None
    follow = f"follow it: bin/pod attach {again} {jid}; stop it: bin/pod stop {again} {jid}"
    if state is None:
        _note(f"could not ask {pod} whether job {jid} started: it may be running; check with: bin/pod jobs {again}; "
              f"{follow}")
    elif state == "absent":
        _note(f"job {jid} did not start on {pod}; re-run to start it")
    elif state == "running":
        _note(f"job {jid} started on {pod} and runs (a re-run would start it again); {follow}")
    else:
        _note(f"job {jid} on {pod}: {remote_jobs.said(state)}; its output: bin/pod attach {again} {jid}")
    if as_json:
        try:
            click.echo(json.dumps(_start_json(job, state, interrupted=True), indent=2))
        except OSError:
            pass
    sys.exit(130)


def _start_failed(job: dict, state: str | None, fault: PodError, as_json: bool) -> NoReturn:
    """A start that failed (its launcher, the pod's refusal, the link): `fault` as `guarded` gives any PodError, one
    line and exit 2; under --json the run's job object before it, saying whether the job started (`state`:
    jobs.start_state's, None: not known), so that a script has the id to follow or stop (`guarded`'s bad-input
    object named it only in prose, and not whether it runs)."""
    if not as_json:
        raise fault from None
    click.echo(json.dumps(_start_json(job, state, error=_error_json(fault)), indent=2))
    click.echo(f"error: {fault}", err=True)
    sys.exit(2)


def _start_json(job: dict, state: str | None, **extra) -> dict:
    """The run's job object for a start cut short or failed: "started" (None: not known), "start_state" as
    jobs.start_state words it (running, exited, lost; absent: this start started nothing, whatever runs under a taken
    id; None: not known), and the job's exit code if it has one."""
    word, _, code = (state or "").partition(" ")
    return {"ok": False, **job, "detached": True, "started": None if state is None else state != "absent",
            "start_state": word or None, "exit_code": int(code) if code.lstrip("-").isdigit() else None, **extra}


def _run_nodes(host: str, command: tuple[str, ...], detach: bool, run_id: str | None, nproc: int | None,
               as_json: bool, pods: PodArgs) -> int:
    """bin/pod run A,B --nodes: one torchrun world across the pods (pods/nodes.py)."""
    from podkit.pods import nodes

    specs = pods.specs(host)
    if len(specs) < 2:
        raise PodError(f"--nodes needs at least 2 hosts, '{host}' names {len(specs)}",
                       "name them comma-separated (A,B), or leave --nodes out for one pod")
    nproc = nodes.check_job(command, len(specs), nproc) or nproc
    run_id = run_id or remote_jobs.new_id(_command_line(command))
    printer = Printer(prefix=True, err=as_json)  # with --json, stdout carries only the object
    say = lambda text: click.echo(f"pod run: {text}", err=True)  # noqa: E731
    members = nodes.connect_all(specs, pods.opts, printer.for_pod, pods.again)
    try:
        rdzv = nodes.plan(members, run_id, nproc)
        say(f"run {run_id}: {len(members)} nodes, rendezvous c10d at {rdzv.endpoint} ({specs[0].name})")
        nodes.start(members, rdzv, command, say, pods.again, pods.opts)
        if detach:
            say(f"attach with: bin/pod attach {pods.again(host)} {run_id} (or one node: "
                + ", ".join(f"bin/pod attach {pods.again(m.spec.reach)} {m.job_id}" for m in members) + ")")
            if as_json:
                click.echo(json.dumps(_nodes_json(run_id, True, None, rdzv, members, ok=True), indent=2))
            return 0
        return _follow_nodes(host, run_id, members, pods, printer, say, as_json,
                             lambda code, ok, interrupted=False: _nodes_json(run_id, interrupted, code, rdzv, members,
                                                                             ok=ok, interrupted=interrupted))
    finally:
        for m in members:
            m.conn.close()


def _follow_nodes(host: str, run_id: str, members, pods: PodArgs, printer, say, as_json: bool, result) -> int:
    """Follow every node of a run (pods/nodes.follow: a failing node stops the others) and end as a run ends:
    its exit code, the first failing node's; `result(code, ok=..., interrupted=...)` is its --json object."""
    from podkit.pods import nodes

    try:
        code, error = nodes.follow(members, pods.opts, printer.for_pod, say, again=pods.again)
    except KeyboardInterrupt:
        say("detached; the jobs keep running: re-attach with bin/pod attach " + f"{pods.again(host)} {run_id}; stop "
            + ", ".join(f"bin/pod stop {pods.again(m.spec.reach)} {m.job_id}" for m in members))
        if as_json:  # as a single pod's run: the object, interrupted
            click.echo(json.dumps(result(None, ok=False, interrupted=True), indent=2))
        return 130
    if as_json:
        click.echo(json.dumps(result(code, ok=code == 0), indent=2))
    if error:
        fault = PodError(error, f"the other nodes were stopped; fetch what ran with: bin/pod fetch-logs {pods.again(host)}")
        if as_json:  # the object above already carries the outcome: one line, and no second object
            click.echo(f"error: {fault}", err=True)
            return 2
        raise fault
    say(f"run {run_id} exited {code}" + (" (the first node to fail)" if code else "")
        + f"; its logs: bin/pod fetch-logs {pods.again(host)}")
    return code


def _attach_nodes(host: str, run_id: str | None, as_json: bool, pods: PodArgs) -> int:
    """bin/pod attach A,B RUN: every node's job of one `run --nodes` run (RUN-n0, RUN-n1, ... as nodes.start names
    them), followed as the run itself follows them: prefixed output, a failing node stops the others."""
    from podkit.pods import nodes

    if not run_id:
        raise PodError(f"'{host}' names several pods: attaching to them needs the run id",
                       f"give it: bin/pod attach {pods.again(host)} RUN_ID (bin/pod run --nodes printed it)")
    remote_jobs.valid_id(run_id, pods.again(host))
    specs = pods.specs(host)
    printer = Printer(prefix=True, err=as_json)
    say = lambda text: click.echo(f"pod attach: {text}", err=True)  # noqa: E731
    members = nodes.connect_all(specs, pods.opts, printer.for_pod, pods.again)
    try:
        sizes = set()
        for m in members:
            m.job_id, m.node, size = nodes.run_member(m, run_id, pods.again)
            sizes.add(size)
        indexes = sorted(m.node.index for m in members)
        size = max((n for n in sizes if n), default=len(members))  # the run's own record, where its jobs kept one
        if indexes != list(range(size)):
            raise PodError(f"run {run_id} has {size} nodes; {host} holds its nodes {indexes}",
                           "name every pod of the run, each once (bin/pod run --nodes printed them)")
        say(f"run {run_id}: following {len(members)} nodes")
        return _follow_nodes(host, run_id, members, pods, printer, say, as_json,
                             lambda code, ok, interrupted=False: {
                                 "ok": ok, "run_id": run_id, "detached": interrupted,
                                 **({"interrupted": True} if interrupted else {}), "exit_code": code,
                                 "nodes": [{"node": m.node.index, "pod": m.spec.name, "job": m.job_id}
                                           for m in members]})
    finally:
        for m in members:
            m.conn.close()


def _nodes_json(run_id: str, detached: bool, code, rdzv, members, ok: bool, interrupted: bool = False) -> dict:
    return {"ok": ok, "run_id": run_id, "detached": detached, **({"interrupted": True} if interrupted else {}),
            "exit_code": code, "rendezvous": rdzv.endpoint,
            "nodes": [{"node": m.node.index, "pod": m.spec.name, "job": m.job_id, "address": m.node.address,
                       "nproc": m.node.nproc, "changed_since_deploy": m.changed} for m in members]}


def _check_job_path(config: str, project: Path) -> str:
    """--config names a job TOML among the files deploy sends (pods/selection.py); returns its path relative to the
    project, which is how the pod's preflight finds it."""
    from podkit.pods.selection import chosen_files

    root = project.resolve()
    path = (root / config).resolve()
    if not path.is_relative_to(root):
        raise PodError(f"--config {config} is outside the project, which is what deploy sends",
                       "give a path inside the project, e.g. checks/examples/...")
    if not path.is_file():
        raise PodError(f"--config {config}: no such file in the project ({root})", "check the path (it is relative "
                       "to the project root)")
    rel = path.relative_to(root).as_posix()
    if rel not in chosen_files(root):
        raise PodError(f"--config {config} is not among the files deploy sends (ignored by .gitignore or .podignore)",
                       "un-ignore it, or put the job TOML elsewhere in the project")
    return rel


def _check_job(config: str, project: Path) -> None:
    """The job file's own syntax and fields, read by the loader the pod's preflight uses (checks.config.check_job:
    no torch, no network), so a bad key is refused before any sync or install, not by preflight at the end."""
    from podkit.checks.config import check_job

    try:
        check_job(project / config, source=config)
    except ConfigError as exc:
        named = "" if exc.field in ("", "--config") else f"{config}: {exc.field}: "  # the others name the file
        fix = exc.fix or f"fix it, then check it here: bin/preflight --config {config}"
        raise PodError(f"{named}{exc.problem}", fix, field=exc.field or "--config") from None


def _follow(conn: PodConnection, again: str, job_id: str, as_json: bool, job: dict) -> int | None:
    """Stream a detached job's output until it ends (its output on stderr under --json); return its exit code
    (None for a job lost without one). `again`: PodArgs.again, for the hints.
    A dropped link, Ctrl-C or a closed stdout ends the following only: the job runs on."""
    try:
        return remote_jobs.attach(conn, job_id, lambda line: click.echo(line, err=as_json), again=again)
    except remote_jobs.NoSuchJob:
        raise
    except PodError as exc:
        fault = PodError(f"{exc.problem}; job {job_id} keeps running on the pod",
                         f"re-attach: bin/pod attach {again} {job_id} (its output again from the start)")
        if not as_json:
            raise fault from None
        # --json: the job's object, as on a Ctrl-C, so a script has the id to re-attach to (the bad-input object
        # alone named it only in prose)
        click.echo(json.dumps({"ok": False, **job, "detached": True, "exit_code": None, "error": _error_json(fault)},
                              indent=2))
        click.echo(f"error: {fault}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        _left_running(again, job_id, as_json, job)
    except OutputClosed:
        _left_running(again, job_id, as_json, job, closed=True)


def _left_running(again: str, job_id: str, as_json: bool, job: dict, closed: bool = False) -> NoReturn:
    """Ctrl-C while following a job, or the reader of our output going away (`| head`), ends the following, not
    the job (it runs detached): say so, and how to get back to it or stop it; exit 130 (141 for a closed pipe)."""
    if closed:
        _quiet_closed()
    why = "output closed by its reader" if closed else "detached"
    _note(f"\n{why}: job {job_id} keeps running on the pod; re-attach: bin/pod attach {again} {job_id}; "
          f"stop it: bin/pod stop {again} {job_id}")
    if as_json:
        try:
            click.echo(json.dumps({"ok": False, **job, "detached": True, "interrupted": True, "exit_code": None},
                                  indent=2))
        except OSError:
            pass
    sys.exit(141 if closed else 130)


def _note(text: str) -> None:
    """A line on stderr, if anyone still reads it."""
    try:
        click.echo(text, err=True)
    except OSError:
        pass


def _quiet_closed() -> None:
    """Point whichever of stdout and stderr lost its reader at /dev/null (a pipe whose reader is gone polls as an
    error), so later lines and the interpreter's final flush do not fail again."""
    import select

    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError):
            continue


def _command_line(command: tuple[str, ...]) -> str:
    import shlex

    return shlex.join(command) if len(command) > 1 else command[0]


@main.command("attach")
@click.argument("host", metavar="HOST")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (the job and its exit code); its output goes to stderr.")
@pod_options
@guarded
def attach_cmd(host, job_id, as_json, pods: PodArgs):
    """Stream a detached job's output (from the start) until it ends; exit with its code. Default: the newest job.

    Several pods (A,B) and a run id: every node of that `bin/pod run --nodes` run, prefixed, a failing node
    stopping the others, as the run itself does.
    """
    if len(pods.specs(host)) > 1:
        sys.exit(_attach_nodes(host, job_id, as_json, pods))
    again = pods.again(host)
    if job_id:
        remote_jobs.valid_id(job_id, again)  # before connecting: an id never reaches a shell unchecked
    with pods.one(host, err=as_json) as (conn, spec, _, _, rdir):
        job_id = job_id or _newest(conn, spec, again)
        job = {"job": job_id, "pod": spec.name, "host": spec.host,
               "log": f"{rdir}/{remote_jobs.JOBS_DIR}/{job_id}/output.log"}
        code = _follow(conn, again, job_id, as_json, job)
    if as_json:
        click.echo(json.dumps({"ok": code == 0, **job, "exit_code": code}, indent=2))
    sys.exit(EXIT_FAILED if code is None else code)  # a lost job: no code of its own to pass on


@main.command("stop")
@click.argument("host", metavar="HOST")
@click.argument("job_id", required=False)
@click.option("--grace", type=click.FloatRange(0, 600), default=30.0, show_default=True,
              help="Seconds between SIGTERM (the run writes its summary) and SIGKILL.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the job and what stopping it did.")
@pod_options
@guarded
def stop_cmd(host, job_id, grace, as_json, pods: PodArgs):
    """Stop a detached job and every process it started (workers included). Default: the newest running job
    (the newest job when none runs)."""
    again = pods.again(host)
    if job_id:
        remote_jobs.valid_id(job_id, again)
    with pods.one(host, err=as_json) as (conn, spec, *_):
        job_id = job_id or _newest(conn, spec, again, running=True)
        remote_jobs.require(conn, job_id, again=again)  # before saying it stops one
        click.echo(f"stopping job {job_id} on {spec.name}: SIGTERM to its processes, SIGKILL to what is left after "
                   f"{grace:g} s", err=True)
        try:
            what = remote_jobs.stop(conn, job_id, grace, again=again)
        except KeyboardInterrupt:
            # the stop's own wait on the pod ends with this Ctrl-C (PodConnection.stop_remote): what was not yet
            # SIGKILLed runs on
            click.echo(f"\ninterrupted: job {job_id} may still run (the stop did not finish); check with bin/pod jobs "
                       f"{again}, or re-run bin/pod stop {again} {job_id}", err=True)
            sys.exit(130)
    stopped = re.search(r"(^|: )left \d", what) is None  # pids still alive after SIGKILL
    if as_json:
        click.echo(json.dumps({"ok": stopped, "job": job_id, "pod": spec.name, "host": spec.host, "result": what}, indent=2))
    else:
        click.echo(f"job {job_id} on {spec.name}: {what}")
    sys.exit(0 if stopped else 1)


def _newest(conn: PodConnection, spec: HostSpec, again: str, running: bool = False) -> str:
    """The newest job's id; with `running`, the newest of those still running, if any: `bin/pod stop HOST` after a
    quick `bin/pod run HOST -- nvidia-smi` beside a training job stops the training, not the finished check."""
    job = remote_jobs.newest(conn, running=running)
    if job is None:
        raise PodError(f"no jobs on {spec.name}", f"start one with: bin/pod run {again} -- COMMAND")
    return job.id


@main.command("jobs")
@click.argument("host", metavar="HOST")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as one JSON object.")
@pod_options
@guarded
def jobs_cmd(host, as_json, pods: PodArgs):
    """List detached jobs on HOST: id, state, command."""
    with pods.one(host, err=as_json) as (conn, *_):
        if as_json:
            click.echo(json.dumps({"ok": True, "jobs": [{"id": j.id, "state": j.state, "exit_code": j.exit_code,
                                                          "left_running": j.left_running, "command": j.command}
                                                         for j in remote_jobs.list_jobs(conn)]}, indent=2))
            return
        print_table(jobs_table(remote_jobs.list_jobs(conn)))


@main.command("probe")
@click.argument("host", metavar="HOST")
@click.option("--json", "as_json", is_flag=True, help="Print the whole fingerprint as JSON.")
@pod_options
@guarded
def probe_cmd(host, as_json, pods: PodArgs):
    """Fingerprint HOST in one round trip: OS, Python, GPUs, torch build, disk, CPUs, RAM."""
    with pods.one(host, err=as_json) as (_, spec, fp, prof, rdir):
        click.echo(fp.to_json() if as_json else f"{spec.name}: {fp.summary()}; profile {prof.name}; project {rdir}")


# ---------------------------------------------------------------- provisioning (RunPod's API)

def _inventory_path(inventory: str | None) -> Path:
    return Path(inventory) if inventory else Path("pods.toml")


def _client():
    from podkit.pods.runpod import RunPodClient, api_key

    return RunPodClient(api_key())


def _default_name(gpu, inventory: Path) -> str:
    from podkit.pods.hosts import load_inventory

    taken = set(load_inventory(inventory).pods) if inventory.exists() else set()
    base = re.sub(r"[^a-z0-9]+", "-", gpu.display_name.lower()).strip("-") or "pod"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


@main.command("up")
@click.option("--gpu", required=True, help="GPU type: its id or display name (bin/pod gpus lists them).")
@click.option("--count", type=int, default=1, show_default=True, help="GPUs in the pod.")
@click.option("--image", default=None, help="Container image (default: RunPod's PyTorch image).")
@click.option("--volume-gb", type=int, default=50, show_default=True, help="Pod volume at /workspace (kept by `down`, deleted by `down --terminate`).")
@click.option("--disk-gb", type=int, default=40, show_default=True, help="Container disk (wiped when the pod stops).")
@click.option("--name", help="Name in pods.toml (default: from the GPU type).")
@click.option("--key", type=click.Path(dir_okay=False, exists=True), help="Private key for the pod, recorded in pods.toml "
              "(default: ssh's own; RunPod installs the public keys of your account settings).")
@click.option("--deadline", type=float, default=600.0, show_default=True, help="Seconds to wait for SSH; then the pod is terminated.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Seconds between status checks.")
@click.option("--inventory", type=click.Path(dir_okay=False), help="pods.toml to record the pod in (default ./pods.toml).")
@click.option("--stop-after-smoke", is_flag=True, help="Cost guard: the pod stops itself when the first bin/smoke run on it ends.")
@click.option("--stop-after", "stop_after_h", type=float, metavar="HOURS", help="Cost guard: the pod stops itself HOURS after it is up.")
@click.option("--idle-stop", "idle_min", type=float, metavar="MINUTES",
              help="Cost guard: the pod stops itself when no podkit job (bin/pod run) has run for MINUTES.")
@click.option("--accept-new", is_flag=True, help="Contact the new pod now and record its host key, pinned to its pod id "
              "(a guard is armed over that first contact, so a guard needs it).")
@click.option("--known-hosts", type=click.Path(dir_okay=False, path_type=Path), help="known_hosts file (default ~/.ssh/known_hosts).")
@click.option("--remote-dir", help="Project directory on the pod, recorded in pods.toml (default: the profile's, /workspace/<project>).")
@click.option("--json", "as_json", is_flag=True, help="Print the pod as JSON.")
@guarded
def up_cmd(gpu, count, image, volume_gb, disk_gb, name, key, deadline, poll, inventory, stop_after_smoke, stop_after_h,
           idle_min, accept_new, known_hosts, remote_dir, as_json):
    """Create a RunPod pod (TCP 22 exposed), wait until SSH is mapped, record it in pods.toml.

    The API key is read from RUNPOD_API_KEY or .podkit/env, never from the command line.
    With a cost guard (--stop-after-smoke, --stop-after, --idle-stop; any together, the first met
    wins) a watchdog on the pod stops it through RunPod, laptop closed or not; see bin/pod guard.
    Then: make deploy HOST=NAME.
    """
    from podkit.pods import cost_guard, provision
    from podkit.pods.runpod import PodRequest

    inv = _inventory_path(inventory)
    wait = provision.Wait(deadline_s=deadline, poll_s=poll)
    plan = cost_guard.plan_from_options(stop_after_smoke, stop_after_h, idle_min)
    if plan and not accept_new:
        raise PodError("a cost guard is armed over SSH right after the pod is up, and its host key is not known yet",
                       "add --accept-new to record it on that first contact")
    if image is not None and not image.strip():
        raise PodError("--image is empty", "give an image reference, or leave --image out for RunPod's PyTorch image")
    client = _client()
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    made = provision.Made()
    try:
        with _stops_like_ctrl_c():  # a pod whose `up` is stopped is terminated, whatever stopped it
            gpu_type = provision.resolve_gpu(gpu, client.gpu_types())
            name = name or _default_name(gpu_type, inv)
            provision.check_new_name(name, inv)
            request = PodRequest(name=name, gpu=gpu_type.id, count=count, volume_gb=volume_gb, disk_gb=disk_gb,
                                 **({"image": image} if image else {}))
            pod = provision.up(client, request, wait, say, made)
            name = provision.record(pod, name, inv, client, say, key=str(Path(key).resolve()) if key else None,
                                    remote_dir=remote_dir, made=made)
            # ... and one stopped during its first contact is said to be billing (or, asked for a guard, stopped)
            guard = _first_contact(name, inv, pod.id, plan, known_hosts, client, say, made) if accept_new else None
    except KeyboardInterrupt:
        _up_interrupted(made, inv, as_json)
    if as_json:
        click.echo(json.dumps({**pod.to_json(), "inventory_name": name, "inventory": str(inv), "guard": guard}))
    else:
        click.echo(f"pod up: {name} is running ({pod.id}, {pod.gpu_count}x {gpu_type.id}, ${pod.cost_per_hour:.2f}/h); "
                   f"ssh root@{pod.ssh_host} -p {pod.ssh_port}; recorded in {inv}")
        if plan:
            from podkit.pods.cost_guard import line as guard_line

            click.echo(guard_line(guard))
        click.echo(f"next: make deploy HOST={name}{'' if accept_new else ' ACCEPT_NEW=1'}   (stop billing: bin/pod down {name})")


def _up_interrupted(made, inv: Path, as_json: bool) -> NoReturn:
    """`up` stopped part way (Ctrl-C, SIGTERM, SIGHUP): what it leaves, said on stderr unless said already and, under
    --json, as the one object on stdout that the other commands print when interrupted; exit 130."""
    from podkit.pods import provision

    say = provision.quiet_on_hangup(lambda line: click.echo(line, err=True))
    if made.said:
        pass
    elif made.billing and made.inventory_name:  # recorded, and stopped before (or without) a first contact
        say(f"\npod up: interrupted; {made.inventory_name} ({made.pod_id}) is running and billing, recorded in {inv}; "
            f"stop it: bin/pod down {made.inventory_name}")
    elif made.billing is False:
        say("\ninterrupted (anything finished is kept; re-run to continue)")
    else:  # the lines above say what may bill, and where to stop it: no re-run, which makes another pod
        say("\npod up: interrupted")
    if as_json:
        try:
            click.echo(json.dumps({"ok": False, "interrupted": True, "exit_code": 130, "id": made.pod_id,
                                   "status": made.status, "billing": made.billing,
                                   "inventory_name": made.inventory_name,
                                   "inventory": str(inv) if made.inventory_name else None}))
        except OSError:  # the terminal hung up (SIGHUP)
            pass
    sys.exit(130)


@contextmanager
def _stops_like_ctrl_c():
    """SIGTERM and SIGHUP (a closed terminal or SSH session) raise KeyboardInterrupt here, as Ctrl-C does, so the
    code that terminates a half-made pod on Ctrl-C runs for them too; left to their default, the process died and
    the pod billed on, unrecorded. A SIGHUP that came ignored (nohup) stays ignored."""
    import signal

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Ctrl-C itself already raises KeyboardInterrupt: the others of stop_signals() are made to as well.
    previous = {sig: signal.signal(sig, interrupt) for sig in stop_signals() if sig != signal.SIGINT}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _first_contact(name, inv: Path, pod_id: str, plan, known_hosts, client, say, made) -> dict | None:
    """SSH to the new pod (recording and pinning its host key) and arm the guard. A guard that cannot
    be armed stops the pod (volume kept): it was asked not to bill unguarded."""
    import time

    from podkit.pods import cost_guard, provision
    from podkit.pods.errors import Unreachable
    from podkit.pods.ownership import claim

    spec = load_inventory(inv).pods[name]
    opts = PodOptions(known_hosts=known_hosts, accept_new=True)
    try:
        for attempt in range(12):  # the port is mapped a moment before the container's sshd listens
            try:
                conn = connect(spec, opts, say)
                break
            except Unreachable:
                if attempt == 11:
                    raise
                say(f"pod up: {name}'s sshd does not answer yet; trying again in 5 s ({attempt + 1} of 11)")
                time.sleep(5)
        with conn:
            _, _, rdir = located = locate(conn, spec, opts.project)
            if plan is None:
                return None
            claim(conn, rdir)  # the guard's files go in the project's .podkit/, with deploy's rules
            return cost_guard.install(conn, rdir, plan, pod_id, located[0].python)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (_stops_like_ctrl_c) while the new pod was reached
        say = provision.quiet_on_hangup(say)
        if plan is None:
            say(f"\npod up: interrupted before the first contact; {name} ({pod_id}) is running and billing, recorded "
                f"in {inv}; record its host key with: bin/pod probe {name} --accept-new; stop it: bin/pod down {name}")
        else:
            try:
                client.stop(pod_id)
                made.status, made.billing = "EXITED", False
                say(f"\npod up: interrupted before its cost guard was armed; stopped {name} ({pod_id}) so it does not "
                    f"bill unguarded (its volume is kept); resume it in the RunPod console, then: bin/pod guard {name} ...")
            except PodError as stop_exc:
                say(f"\npod up: interrupted before its cost guard was armed, and stopping {name} ({pod_id}) failed "
                    f"({stop_exc}): it is running and billing without a guard; stop it: bin/pod down {name}, or at "
                    "runpod.io/console/pods")
        made.said = True  # not `re-run to continue`: a second `up` makes a second pod
        raise
    except PodError as exc:
        if plan is None:  # no guard asked for: the pod stays up, recorded; the error says it bills
            raise PodError(f"{name} ({pod_id}) is up and billing, recorded in {inv}, but the first contact failed: "
                           f"{exc.problem}", f"{exc.fix + '; ' if exc.fix else ''}then: bin/pod probe {name} --accept-new; "
                           f"or stop it: bin/pod down {name}") from None
        try:
            client.stop(pod_id)
        except PodError as stop_exc:
            raise PodError(f"the cost guard could not be armed ({exc}), and stopping {name} failed too ({stop_exc}): "
                           f"it is running and billing without a guard", f"stop it: bin/pod down {name}, or at "
                           "runpod.io/console/pods") from None
        raise PodError(f"the cost guard could not be armed ({exc}); stopped {name} so it does not bill unguarded "
                       "(its volume is kept)", f"fix that, resume it in the RunPod console, then: bin/pod guard {name} ...") from None


@main.command("down")
@click.argument("name")
@click.option("--terminate", is_flag=True, help="Delete the pod and its volume (default: stop it, keeping the volume).")
@click.option("--inventory", type=click.Path(dir_okay=False), help="pods.toml (default ./pods.toml).")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@guarded
def down_cmd(name, terminate, inventory, as_json):
    """Stop the pod NAME that bin/pod up brought up (its volume is kept), or --terminate it."""
    from podkit.pods import provision

    inv = _inventory_path(inventory)
    pod_id = provision.recorded(name, inv)
    client = _client()
    gone = False
    try:
        (client.terminate if terminate else client.stop)(pod_id)
    except PodError:
        if client.pod(pod_id) is not None:
            raise  # RunPod has the pod and refused: its message stands
        gone = True  # terminated in the console, or by its own guard's owner: nothing to stop
    if gone and not terminate:
        raise PodError(f"pod {name} ({pod_id}) is gone on RunPod (terminated in its console?)",
                       f"remove it from {inv}: bin/pod down {name} --terminate")
    if terminate:
        provision.forget(name, inv)
        line = (f"pod down: {name} ({pod_id}) was already gone on RunPod; removed from {inv}" if gone else
                f"pod down: terminated {name} ({pod_id}); its volume is deleted, nothing bills; removed from {inv}")
    else:
        line = (f"pod down: stopped {name} ({pod_id}); its volume is kept (storage still bills); "
                f"delete it with: bin/pod down {name} --terminate")
    if as_json:
        click.echo(json.dumps({"name": name, "id": pod_id, "action": "forgotten" if gone else
                               "terminated" if terminate else "stopped", "volume_kept": not terminate}))
    else:
        click.echo(line)


@main.command("ls")
@click.option("--inventory", type=click.Path(dir_okay=False), help="pods.toml (default ./pods.toml).")
@click.option("--known-hosts", type=click.Path(dir_okay=False, path_type=Path), help="known_hosts file (default ~/.ssh/known_hosts).")
@click.option("--timeout", type=click.FloatRange(1, 300), default=10.0, show_default=True, help="SSH connect timeout for reading guards, seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the pods as JSON.")
@guarded
def ls_cmd(inventory, known_hosts, timeout, as_json):
    """List the account's RunPod pods: podkit's by their pods.toml name, others marked; status, $/h,
    and each running podkit pod's cost guard (read from the pod: what it waits for, alive or not)."""
    from concurrent.futures import ThreadPoolExecutor

    from podkit.pods import provision
    from podkit.pods.cost_guard import line as guard_line

    inv = _inventory_path(inventory)
    names = provision.inventory_ids(inv)
    pods = _client().pods()
    rows = [{**p.to_json(), "inventory_name": names.get(p.id), "inventory": str(inv) if p.id in names else None}
            for p in pods]
    listed = {p.id for p in pods}
    rows += [{"id": i, "inventory_name": n, "inventory": str(inv), "status": "GONE", "cost_per_hour": 0.0,
              "gpu_count": 0, "gpu": "", "ssh_host": None, "ssh_port": None, "name": ""}
             for i, n in names.items() if i not in listed]
    opts = PodOptions(known_hosts=known_hosts, timeout=timeout)
    with ThreadPoolExecutor(max_workers=8) as pool:  # one SSH round trip per running podkit pod, at once
        guards = list(pool.map(lambda r: _guard_of(r, inv, opts), rows))
    for r, g in zip(rows, guards):
        r["guard"] = g
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:  # the guard column: podkit's running pods only (the others have none to read)
        r["guard_text"] = guard_line(r["guard"]).removeprefix("guard: ") if r["inventory_name"] and r["status"] == "RUNNING" else "-"
    print_table(pods_table(rows))
    running = sum(r["cost_per_hour"] for r in rows if r["status"] == "RUNNING")
    click.echo(f"{len(rows)} pod(s); running now: ${running:.2f}/h")


def _guard_of(row: dict, inv: Path, opts: PodOptions) -> dict | None:
    """The guard on a running podkit pod (None: none armed); {"unknown": why} when it cannot be read."""
    from podkit.pods import cost_guard

    if not row["inventory_name"]:
        return None
    if row["status"] != "RUNNING":
        return {"unknown": f"pod is {row['status']}"}
    try:
        spec = load_inventory(inv).pods[row["inventory_name"]]
        with connect(spec, opts, lambda line: click.echo(f"[{spec.name}] {line}", err=True)) as conn:
            return cost_guard.status(conn, locate(conn, spec, opts.project)[2])
    except PodError as exc:
        return {"unknown": str(exc)}


@main.command("guard")
@click.argument("name")
@click.option("--stop-after-smoke", is_flag=True, help="Stop the pod when the next bin/smoke run on it ends.")
@click.option("--stop-after", "stop_after_h", type=float, metavar="HOURS", help="Stop the pod HOURS from now.")
@click.option("--idle-stop", "idle_min", type=float, metavar="MINUTES", help="Stop the pod when no podkit job has run for MINUTES.")
@click.option("--off", is_flag=True, help="Cancel the guard: stop its watchdog on the pod.")
@click.option("--json", "as_json", is_flag=True, help="Print the guard as JSON.")
@pod_options
@guarded
def guard_cmd(name, stop_after_smoke, stop_after_h, idle_min, off, as_json, pods: PodArgs):
    """Show, arm (replacing the one there) or cancel (--off) the cost guard of pod NAME from bin/pod up.

    The guard is a small watchdog on the pod (<project>/.podkit/guard/) that stops the pod through
    RunPod's API with the pod's own key when a condition is met; the first met wins.
    """
    from podkit.pods import cost_guard, provision

    pod_id = provision.recorded(name, _inventory_path(pods.inventory))
    plan = cost_guard.plan_from_options(stop_after_smoke, stop_after_h, idle_min)
    if off and plan:
        raise PodError("--off cancels the guard; it takes no condition", "give --off alone, or the conditions alone")
    with pods.one(name, err=as_json) as (conn, spec, fp, _, rdir):
        if off:
            what = "cancelled" if cost_guard.cancel(conn, rdir) else "no guard was running"
            click.echo(f"guard on {name}: {what}", err=True)
        elif plan:
            cost_guard.install(conn, rdir, plan, pod_id, fp.python)
        view = cost_guard.status(conn, rdir)
    click.echo(json.dumps({"name": name, "id": pod_id, "guard": view}) if as_json else f"{name}: {cost_guard.line(view)}")


@main.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print the GPU types as JSON (bin/preflight --rank-gpus - reads it).")
@guarded
def gpus_cmd(as_json):
    """GPU types RunPod offers: memory and on-demand price per GPU-hour, cheapest first."""
    types = sorted(_client().gpu_types(), key=lambda g: (g.price_per_hour is None, g.price_per_hour or 0.0, g.id))
    if as_json:
        click.echo(json.dumps([g.to_json() for g in types]))
        return
    for g in types:
        price = f"${g.price_per_hour:.2f}/h" if g.price_per_hour is not None else "none free now"
        click.echo(f"{g.id:36} {g.memory_gb:4d} GB  {price}")


def run() -> None:
    """main, with click's usage errors (a missing or malformed option) as one line and exit 2."""
    try:
        # click would name the completion variable after prog_name, and '/' is not valid in one.
        main(prog_name="bin/pod", standalone_mode=False, complete_var="_PODKIT_POD_COMPLETE")
    except click.UsageError as exc:
        if exc.format_message().startswith("Usage:"):  # `bin/pod` alone: click's help, as it shows it
            click.echo(exc.format_message(), err=True)
            sys.exit(2)
        where = f"bin/pod {exc.ctx.info_name} --help" if exc.ctx and exc.ctx.parent else "bin/pod --help"
        if wants_json():
            _bad_input_json(exc.format_message(), f"see {where}")
        click.echo(f"error: {exc.format_message()} (see {where})", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    run()
