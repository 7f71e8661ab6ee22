"""make deploy: probe, sync, envsetup, then preflight on the pod with its detected GPU.

One connection per pod for every command and for rsync. Several pods deploy
in parallel, each line of output prefixed with its pod's name, and a summary table ends the run.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from podkit.envsetup.envfile import EXTRA_NAMES_VAR, SECRET_NAMES, BadSecretName, secret_names
from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError, Unreachable
from podkit.pods.hosts import HostSpec, resolve
from podkit.pods.ownership import claim, normalise, refuse_unsafe, unclaim
from podkit.envsetup.fingerprint import Fingerprint
from podkit.pods.probe import probe
from podkit.pods.profiles import PodProfile, detect
from podkit.pods import progress as bars
from podkit.pods.sync import TheirFiles, ensure_rsync, push, refuse_theirs

ROOT = Path(__file__).resolve().parents[1]
PYTHON_FIX = ("name the pod's interpreter that has the image's torch with --python (PYTHON=, or python in pods.toml), "
              "or leave it out to detect it")


@dataclass
class PodOptions:
    """Settings shared by every pod command (the CLI's common options)."""

    known_hosts: Path | None = None
    accept_new: bool = False
    timeout: float = 10.0
    bwlimit: int | None = None
    project: Path = ROOT
    ssh_config: Path | None = None  # None: OpenSSH's defaults (~/.ssh/config, /etc/ssh/ssh_config)
    force: bool = False  # write into a non-empty REMOTE_DIR podkit did not create (never deleting its files)


@dataclass
class Outcome:
    pod: str
    exit_code: int = 0  # 0 ready, 1 envsetup or preflight failed, 2 connection/input fault
    profile: str = ""
    gpu: str = ""
    sync: str = ""
    envsetup: str = ""
    preflight: str = ""
    error: str = ""
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # probe/sync/envsetup/preflight seconds
    fingerprint: Fingerprint | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "fingerprint"}
        out["result"] = {0: "ready", 1: "failed", 2: "error"}.get(self.exit_code, "error")
        return out


class Printer:
    """Thread-safe line output with a [pod] prefix when several pods run at once."""

    def __init__(self, prefix: bool, err: bool = False):
        self.prefix, self.err = prefix, err  # err: stdout carries --json, progress goes to stderr
        self.lock = threading.Lock()

    def for_pod(self, name: str) -> Callable[[str], None]:
        def say(line: str) -> None:
            with self.lock:
                print(f"[{name}] {line}" if self.prefix else line, flush=True, file=sys.stderr if self.err else sys.stdout)
        return say


def connect(spec: HostSpec, opts: PodOptions, say: Callable[[str], None], *, for_rsync: bool = False) -> PodConnection:
    def open_(s: HostSpec) -> PodConnection:
        return PodConnection(resolve(s, opts.ssh_config), known_hosts=opts.known_hosts, accept_new=opts.accept_new,
                             timeout=opts.timeout, say=say).open()

    try:
        conn = open_(spec)
    except Unreachable as exc:
        if not spec.pod_id:
            raise
        from podkit.pods.provision import relocate  # the provider's API only for a pod `bin/pod up` recorded

        conn = open_(relocate(spec, exc, say))  # once: a second failure is reported as it is
    if for_rsync:
        conn.warm_spare()  # rsync's shell logs in on the pod while the probe runs
    return conn


def locate(conn: PodConnection, spec: HostSpec, project: Path) -> tuple[Fingerprint, PodProfile, str]:
    """Probe, pick the profile and the remote project directory, and set the command prelude."""
    fp = probe(conn, remote_dir=spec.remote_dir or "", python=spec.python)
    profile = detect(fp, spec.profile)
    remote_dir = normalise(spec.remote_dir or profile.remote_dir(project.name, fp.home), fp.home)
    refuse_unsafe(remote_dir, fp.home)
    conn.prelude = profile.shell_prelude(remote_dir)
    return fp, profile, remote_dir


def deploy_one(spec: HostSpec, opts: PodOptions, say: Callable[[str], None], config: str | None,
               single: bool, live: list[PodConnection] | None = None) -> Outcome:
    outcome = Outcome(pod=spec.name)
    start = time.monotonic()
    live = live if live is not None else []
    try:
        with connect(spec, opts, say, for_rsync=True) as conn:
            live.append(conn)
            try:
                _deploy(conn, spec, opts, say, config, single, outcome)
            finally:
                live.remove(conn)
    except PodError as exc:
        outcome.exit_code, outcome.error = 2, str(exc)
    outcome.seconds = time.monotonic() - start
    return outcome


def _deploy(conn: PodConnection, spec: HostSpec, opts: PodOptions, say, config, single, outcome: Outcome) -> None:
    clock = [time.monotonic()]

    def lap(phase: str) -> None:
        now = time.monotonic()
        outcome.phases[phase] = round(now - clock[0], 3)
        clock[0] = now

    fp, profile, remote_dir = locate(conn, spec, opts.project)
    outcome.fingerprint, outcome.profile = fp, profile.name
    outcome.gpu = f"{len(fp.gpus)}x {fp.gpus[0].name}" if fp.gpus else "none"
    say(f"probe: {fp.summary()}; profile {profile.name}; project {remote_dir}")
    fault = fp.python_fault(spec.python)
    if fault:
        raise PodError(f"python {spec.python} {fault} on the pod", PYTHON_FIX)
    state = claim(conn, remote_dir, force=opts.force)  # before anything is written there
    try:
        checked = refuse_theirs(conn, opts.project, remote_dir, first_writes=("logs/probe.json",))
    except TheirFiles:
        if state == "claimed":
            unclaim(conn, remote_dir)  # nothing was sent: the directory is not podkit's
        raise
    q = shlex.quote(remote_dir)
    made = conn.run(f"mkdir -p {q}/logs && cat > {q}/logs/probe.json", stdin=fp.to_json(), prelude=False)
    if not made.ok:
        detail = (made.stderr or made.stdout).strip().splitlines()
        if any("No space" in line for line in detail):
            raise PodError(f"the pod's disk is full at {remote_dir}", "free space, then re-run")
        raise PodError(f"cannot create {remote_dir}: {detail[-1] if detail else made.exit_code}", "set REMOTE_DIR= to a writable path")

    lap("probe")
    rsync_ok = ensure_rsync(conn, fp.tools, say)
    # One pod: a bar (plain lines off a terminal). Several: their bars would interleave; the summary says it.
    with (bars.transfer("sync", plain=say) if single else nullcontext()) as progress:
        stats = push(conn, opts.project, remote_dir, rsync_on_pod=rsync_ok, progress=progress, bwlimit=opts.bwlimit,
                     checked=checked)
    outcome.sync = f"{stats.files} files" + ("" if rsync_ok else " (SFTP)")
    say(f"sync: {stats}" + ("" if rsync_ok else " over SFTP"))
    lap("sync")

    if not fp.python:
        outcome.exit_code = 1
        outcome.envsetup = "no python"
        say("envsetup: skipped, the pod has no python3 (install python3 and python3-venv, then re-run)")
        return
    if not fp.gpus:
        say("envsetup: no GPU on this pod: GPU-only dependencies (flash-attn) are skipped")
    # The values travel on stdin (pods/shell.py: never in argv). envsetup keeps only the names it knows, so the
    # extra names go with it, in its environment: names are not secret. The pod's own extra names stay beside ours.
    values = _secrets()
    secrets = "".join(f"{n}={v}\n" for n, v in values.items())
    extra = ",".join(n for n in values if n not in SECRET_NAMES)
    cache = profile.caches(fp.home)
    cmd = ((f"{EXTRA_NAMES_VAR}={shlex.quote(extra)}${{{EXTRA_NAMES_VAR}:+,${EXTRA_NAMES_VAR}}} " if extra else "")
           + f"PODKIT_PYTHON={shlex.quote(fp.python)} bin/envsetup --project . --fingerprint logs/probe.json --secrets-stdin"
           + (f" --cache-dir {shlex.quote(cache)}" if cache else ""))
    # envsetup's own lines already start with "envsetup: " (its verdict): do not say it twice.
    said = lambda line: say(line.strip() if line.strip().startswith("envsetup: ") else f"envsetup: {line.strip()}")  # noqa: E731
    # One pod on a terminal: its "[k/n] step" lines drive an install bar; otherwise they are plain lines.
    steps = bars.Steps("install", said) if single and sys.stderr.isatty() else None
    result = None
    try:
        result = conn.run(cmd, stdin=secrets, out=steps or said, timeout=4 * 3600)
    finally:
        if steps is not None:
            steps.close(finished=result is not None and result.ok)
    outcome.envsetup = "ready" if result.ok else f"failed ({result.exit_code})"
    lap("envsetup")
    if not result.ok:
        outcome.exit_code = 1
        return

    args = ["bin/preflight"] + (["--config", config] if config else [])
    if fp.gpus:
        args += ["--gpu", fp.gpus[0].name]
    # One pod: its whole report. Several: only the verdict, the table would interleave.
    show = (lambda line: say(line if line.startswith("preflight: ") else f"preflight: {line}")) if single else None
    result = conn.run(shlex.join(args), out=show, timeout=600)
    lap("preflight")
    if not single:
        last = [line for line in result.stdout.splitlines() if line.strip()]
        say(f"preflight: {last[-1].strip() if last else result.exit_code}")
    say("deploy: " + ", ".join(f"{k} {v:.2f} s" for k, v in outcome.phases.items()))
    outcome.preflight = {0: "ready", 1: "check failed", 2: "bad input"}.get(result.exit_code, f"exit {result.exit_code}")
    if result.exit_code != 0:
        outcome.exit_code = 1


def _secrets() -> dict[str, str]:
    """The secrets deploy forwards, by name: those of envfile.SECRET_NAMES and the local PODKIT_SECRET_NAMES that
    are set here (a name set nowhere is not sent: it may be a token pasted where a name goes). PodError for a bad
    name, or for a value of several lines: envsetup reads NAME=value lines from stdin (envfile.read_secrets), so
    only the first line would arrive."""
    try:
        names = secret_names(os.environ)
    except BadSecretName as exc:
        raise PodError(str(exc), exc.fix, field=EXTRA_NAMES_VAR) from None
    values = {n: os.environ[n] for n in names if os.environ.get(n)}
    for name, value in values.items():
        if "\n" in value or "\r" in value:
            raise PodError(f"{name} holds a value of several lines; the pod's env file takes one-line secrets",
                           f"put it in a file on the pod and export its path instead (e.g. {name}_FILE)",
                           field=name)
    return values


def deploy(specs: list[HostSpec], opts: PodOptions, config: str | None = None, err: bool = False) -> list[Outcome]:
    _secrets()  # a bad name or value is bad input: refused before any pod is reached
    printer = Printer(prefix=len(specs) > 1, err=err)
    single = len(specs) == 1
    live: list[PodConnection] = []  # open connections, so Ctrl-C can stop their remote steps
    with ThreadPoolExecutor(max_workers=min(16, len(specs))) as pool:
        futures = [pool.submit(deploy_one, s, opts, printer.for_pod(s.name), config, single, live) for s in specs]
        try:
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            # Ctrl-C reaches this thread only: stop every pod's remote step (envsetup, pip,
            # preflight) now, instead of waiting for the workers to finish them.
            for conn in list(live):
                conn.cancel()
            for f in futures:
                f.cancel()
            raise
