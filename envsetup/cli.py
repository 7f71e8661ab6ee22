"""bin/envsetup: make this machine ready to run podkit jobs. Runs on the pod (deploy calls it there).

Steps, each skipped when the hash of its inputs is unchanged: the venv (reusing the image's
torch), podkit's requirements, bitsandbytes, torchao, flash-attn, verification; then the env file.
Everything it does is logged under logs/envsetup/, and report.json there says what it decided.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from podkit.envsetup import envfile
from podkit.envsetup.resolve import Dependency, Plan, resolve
from podkit.envsetup.state import StepState
from podkit.envsetup.verify import VERIFY_SCRIPT
from podkit.envsetup.fingerprint import Fingerprint, probe_local

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "envsetup" / "requirements.txt"
HEARTBEAT_S = 30
LOCK_WAIT_S = 2 * 3600  # a flash-attn source build can take this long; past it the holder is stuck


class SetupError(Exception):
    pass


_STDOUT_IS_JSON = False  # --json: stdout carries the one JSON object, progress goes to stderr


def echo(text: str, err: bool = False) -> None:
    print(text, file=sys.stderr if err or _STDOUT_IS_JSON else sys.stdout, flush=True)


class Setup:
    def __init__(self, project: Path, fp: Fingerprint, plan: Plan, say=echo):
        self.project, self.fp, self.plan, self.say = project, fp, plan, say
        self.dir = project / ".podkit" / "envsetup"  # state: stays on the pod
        self.logs = project / "logs" / "envsetup"  # logs and report: fetch-logs brings them back
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.state = StepState(self.dir / "state.json")
        self.venv = Path(envfile.venv_dir(project))
        self.python = Path(envfile.venv_python(project))
        self.outcome: dict[str, str] = {}
        self._lock = None  # see lock()

    # -- one envsetup at a time per project
    def lock(self) -> None:
        """Hold .podkit/envsetup/lock for this run. Every install command inherits it, so an
        install left running by a killed client keeps it too, and a re-run waits for that
        install instead of racing it into the same venv."""
        self._lock = open(self.dir / "lock", "a+")
        start = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            if not told or int(waited) % HEARTBEAT_S == 0:
                self.say(f"  another envsetup or its install is still running in {self.project}; "
                         f"waiting for it ({waited:.0f} s)")
                told = True
            if waited > LOCK_WAIT_S:
                raise SetupError(f"another envsetup has held {self.dir / 'lock'} for {waited:.0f} s; "
                                 "stop it (ps aux | grep pip) and re-run")
            time.sleep(1)

    # -- venv
    def venv_step(self) -> None:
        key = _hash([self.fp.python, self.fp.python_version, self.fp.python_site, str(self.venv)])
        # `-m venv` cut short (Ctrl-C in ensurepip) leaves a python that starts but no pip: a note written before
        # and removed after it says that this venv is podkit's and half-made, so it is rebuilt, not kept.
        creating = self.dir / "venv-creating"
        whole = _runs(self.python) and not creating.exists()
        if self.state.unchanged("venv", key) and whole:
            self.outcome["venv"] = "unchanged"
            return
        if whole:
            self.outcome["venv"] = "kept"
        else:
            # --clear: a venv left half-made by an interrupted run is rebuilt from scratch
            creating.write_text(f"{os.getpid()}\n")
            self._run("venv", [self.fp.python, "-m", "venv", "--system-site-packages", "--clear", str(self.venv)])
            creating.unlink()
            self.outcome["venv"] = "created"
        if self.fp.python_venv and self.fp.python_site:
            # The image's python is itself a venv: --system-site-packages would skip its packages
            # (torch among them), so point at them explicitly.
            site = subprocess.run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout.strip()
            Path(site, "_podkit_image.pth").write_text("\n".join(self.fp.python_site) + "\n")
        self.state.record("venv", key)

    # -- pip installs
    def install(self, dep: Dependency) -> bool:
        if dep.action in ("skip", "reuse"):
            self.outcome[dep.name] = f"{dep.action}: {dep.reason}" if dep.action == "skip" else f"reused {dep.requirement}"
            return True
        key = dep.key(self.fp)
        if self.state.unchanged(dep.name, key):
            self.outcome[dep.name] = "unchanged"
            return True
        constraints = self.dir / "constraints.txt"
        constraints.write_text("\n".join(self.plan.constraints) + "\n")
        target = ["-r", str(REQUIREMENTS)] if dep.name == "requirements" else [dep.requirement]
        argv = [str(self.python), "-m", "pip", "install", "--disable-pip-version-check",
                "-c", str(constraints), *dep.pip_args, *target]
        if dep.action == "build":
            self.say(f"  building flash-attn from source ({dep.reason}); this takes long, log: {self._log(dep.name)}")
            self._run("ninja", [str(self.python), "-m", "pip", "install", "--disable-pip-version-check", "ninja", "packaging", "wheel"],
                      check=False)
        ok = self._run(dep.name, argv, env=dict(dep.build_env), check=False)
        if not ok:
            self.outcome[dep.name] = f"failed (see {self._log(dep.name)})"
            return False
        self.state.record(dep.name, key)
        self.outcome[dep.name] = "installed"
        return True

    # -- verification
    def verify(self) -> dict[str, str]:
        names = [d.name for d in self.plan.deps if d.action in ("pip", "build", "reuse") and d.name != "requirements"]
        names = [n for n in names if n != "torch"] + ["nvidia-ml-py"]
        key = _hash([self.state.done.get(n, {}).get("key") for n in names] + [self.state.done.get("venv", {}).get("key")])
        if self.state.unchanged("verify", key):
            return self.state.done["verify"]["results"]
        out = subprocess.run([str(self.python), "-c", VERIFY_SCRIPT, *names], capture_output=True, text=True,
                             env=_child_env(), timeout=600, stdin=subprocess.DEVNULL)  # the secrets: see _run
        try:
            results = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            results = {"torch": "error: " + (out.stderr.strip().splitlines() or ["verification crashed"])[-1]}
        if all(v.startswith("ok") for v in results.values()):
            self.state.record("verify", key, results=results)
        return results

    def _log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def _run(self, name: str, argv: list[str], env: dict | None = None, check: bool = True) -> bool:
        """Run one install command, its output to .podkit/envsetup/<name>.log, a heartbeat meanwhile."""
        log = self._log(name)
        start = time.monotonic()
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(argv)}\n")
            f.flush()
            # stdin: nothing. Deploy pipes the secrets into this process's stdin, read after the installs: a child
            # that read stdin (pip, a build backend) would see them, and drain them from the env file.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    env=_child_env(env), pass_fds=(self._lock.fileno(),) if self._lock else ())
            while True:
                try:
                    proc.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    self.say(f"  {name}: still running ({time.monotonic() - start:.0f} s)")
        if proc.returncode != 0 and check:
            raise SetupError(f"{name} failed (exit {proc.returncode}); see {log}")
        return proc.returncode == 0


def _child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_NO_INPUT"] = "1"
    return {**env, **(extra or {})}


def _runs(python: Path) -> bool:
    if not python.exists():
        return False
    # -S: whether the interpreter starts (a moved base Python breaks a venv), without site-packages
    return subprocess.run([str(python), "-S", "-c", "pass"], capture_output=True).returncode == 0


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def requirements() -> list[str]:
    return [line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line naming the command, exit 2 (argparse's default is usage plus error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


MAX_FINGERPRINT_BYTES = 4 << 20  # a probe result is a few KiB; more is the wrong file (/dev/zero)


def parse_args(argv=None):
    parser = OneLineParser(
        prog="bin/envsetup",
        description="Install what this machine needs for podkit, reusing the image's torch, and write the env file. "
                    "Runs with the standard library only, before any venv exists.")
    parser.add_argument("--project", type=Path, default=ROOT, help="project directory for .venv and .podkit/ (default: %(default)s)")
    parser.add_argument("--fingerprint", dest="fingerprint_file", type=Path,
                        help="use this probe result (deploy passes it) instead of probing again")
    parser.add_argument("--python", help="the image's interpreter that has torch (default: detected)")
    parser.add_argument("--cache-dir", help="persistent directory for HF_HOME, pip, torch and triton caches")
    parser.add_argument("--secrets-stdin", action="store_true", help="read NAME=value secret lines from stdin (HF_TOKEN, WANDB_API_KEY)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    parser.add_argument("--json", dest="as_json", action="store_true",
                        help="print one JSON object (the plan with --dry-run, else report.json) on stdout; "
                             "progress goes to stderr")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    global _STDOUT_IS_JSON
    _STDOUT_IS_JSON = args.as_json
    try:
        run(args.project, args.fingerprint_file, args.python, args.cache_dir, args.secrets_stdin, args.dry_run,
            args.as_json)
    except SetupError as exc:
        _ended_early(args.project, "failed", str(exc), args.as_json, args.dry_run)
        print(f"envsetup: FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        _ended_early(args.project, "interrupted", "stopped by a signal before the last step", args.as_json,
                     args.dry_run)
        print("envsetup: interrupted; re-run to continue (finished steps are kept)", file=sys.stderr)
        sys.exit(130)


def _ended_early(project: Path, status: str, error: str, as_json: bool, dry_run: bool) -> None:
    """A run that stopped before its report: logs/envsetup/report.json says so (never the previous run's, which
    fetch-logs would bring back as this one's), and --json still prints its one object."""
    report = {"ok": False, "status": status, "error": error}
    if not dry_run and project.is_dir():  # never a project directory made here
        try:
            logs = project / "logs" / "envsetup"
            logs.mkdir(parents=True, exist_ok=True)
            (logs / "report.json").write_text(json.dumps(report, indent=2))
        except OSError:
            pass  # the reason it failed may be this very directory
    if as_json:
        try:
            print(json.dumps({**report, "failed": []}, indent=2))
        except OSError:
            pass


def _check_project(project: Path, writable: bool = True) -> Path:
    """--project: an existing, writable directory (.venv, .podkit/ and logs/ go in it)."""
    if not str(project).strip():
        _bad("--project is empty", "give the project directory, or leave it out")
    project = Path(os.path.normpath(project.absolute()))
    if not project.exists():
        _bad(f"--project {project} does not exist", "give the directory podkit was synced to")
    if not project.is_dir():
        _bad(f"--project {project} is not a directory", "give the directory podkit was synced to")
    if writable and not os.access(project, os.W_OK | os.X_OK):
        _bad(f"--project {project} is not writable (read-only mount or permission denied)",
             "sync podkit to a writable directory and run envsetup there")
    return project.resolve()


def _check_cache_dir(cache_dir: str) -> str:
    """--cache-dir: a directory, or one that can be made (not under a file); HF_HOME and pip's cache go there."""
    if not cache_dir.strip():
        _bad("--cache-dir is empty", "give a persistent directory, or leave it out")
    path = Path(os.path.normpath(Path(cache_dir).expanduser().absolute()))
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        _bad(f"--cache-dir {path}: {ancestor} is a file", "give a directory on the persistent volume")
    return str(path)


def _read_fingerprint(path: Path) -> Fingerprint:
    fix = "re-run deploy, or drop the option to probe here"
    try:
        if not path.is_file():
            _bad(f"--fingerprint {path}: {'does not exist' if not path.exists() else 'is not a regular file'}", fix)
        with open(path, "rb") as f:
            data = f.read(MAX_FINGERPRINT_BYTES + 1)
        if len(data) > MAX_FINGERPRINT_BYTES:
            _bad(f"--fingerprint {path}: over {MAX_FINGERPRINT_BYTES >> 20} MiB, not a probe result", fix)
        return Fingerprint.from_json(data.decode("utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _bad(f"--fingerprint {path}: cannot read it ({' '.join(str(exc).split())})", fix)


def run(project: Path, fingerprint_file, python, cache_dir, secrets_stdin: bool, dry_run: bool,
        as_json: bool = False) -> None:
    """Install what this machine needs for podkit, reusing the image's torch, and write the env file."""
    started = time.monotonic()
    project = _check_project(project, writable=not dry_run)  # a dry run writes nothing
    try:
        names = envfile.secret_names(os.environ)  # a bad name would be written into a file every command sources
    except envfile.BadSecretName as exc:
        _bad(str(exc), exc.fix)
    if cache_dir is not None:
        cache_dir = _check_cache_dir(cache_dir)
    if fingerprint_file:
        try:
            fp = _read_fingerprint(fingerprint_file)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _bad(f"--fingerprint {fingerprint_file}: cannot read it ({exc})", "re-run deploy, or drop the option to probe here")
    else:
        fp = probe_local(str(project), python)
        given = python or os.environ.get("PODKIT_PYTHON")  # what the probe was told to use, and only that
        fault = fp.python_fault(given)
        if fault:
            _bad(f"python {given} {fault}", "give --python the interpreter that has the image's torch, or leave "
                 "--python out and PODKIT_PYTHON unset to detect it")
    if not fp.python:
        _bad("no python3 on this machine", "install python3 with venv (e.g. apt-get install python3-venv), then re-run")
    plan = resolve(fp, requirements())
    if dry_run and as_json:
        print(json.dumps({"ok": True, "dry_run": True, "fingerprint": json.loads(fp.to_json()),
                          "plan": [dict(d.__dict__) for d in plan.deps], "warnings": plan.warnings,
                          "attention": plan.attention, "attention_reason": plan.attention_reason},
                         indent=2, default=list))
        return
    if dry_run:
        for dep in plan.deps:
            echo(f"{dep.name:13} {dep.action:6} {dep.requirement[:90]}  ({dep.reason})")
        echo(f"attention: {plan.attention} ({plan.attention_reason})")
        return
    for warning in plan.warnings:
        echo(f"  warning: {warning}")
    setup = Setup(project, fp, plan, say=echo)
    setup.lock()
    # "[k/n] name: action" before each step: the laptop's deploy draws its install bar from these
    # lines (pods/progress.py, STEP); n = venv + every dependency + verification.
    step = 1
    echo(f"  [{step}/{len(plan.deps) + 2}] venv")
    setup.venv_step()
    failed = []
    attention, attention_reason = plan.attention, plan.attention_reason
    pending = list(plan.deps)
    while pending:
        dep = pending.pop(0)
        step += 1
        echo(f"  [{step}/{step + len(pending) + 1}] {dep.name}: {dep.action}")
        if not setup.install(dep):
            failed.append(dep.name)
            if dep.name == "flash-attn":
                attention, attention_reason = "sdpa", f"flash-attn {dep.action} failed; see logs/envsetup/flash-attn.log"
        elif dep.name == "torch" and dep.action == "pip" and fp.torch is None:
            # torch is in the venv now: plan the rest (bitsandbytes, torchao, flash-attn) for that torch
            fp = probe_local(str(project), fp.python)
            plan = setup.plan = resolve(fp, requirements())
            setup.fp = fp
            done = {d.name for d in plan.deps[:plan.deps.index(plan.dep("torch")) + 1]}
            pending = [d for d in plan.deps if d.name not in done]
            attention, attention_reason = plan.attention, plan.attention_reason
    echo(f"  [{step + 1}/{step + 1}] verify")
    verify = setup.verify()
    if not verify.get("flash-attn", "ok").startswith("ok"):
        # A wheel that imports but cannot run on this GPU/driver is worse than none.
        subprocess.run([str(setup.python), "-m", "pip", "uninstall", "-y", "flash-attn"], capture_output=True)
        setup.state.forget("flash-attn")
        attention, attention_reason = "sdpa", f"flash-attn failed verification: {verify['flash-attn']}"
    secrets = envfile.existing_secrets(project / ".podkit" / "env", names)
    secrets |= {n: os.environ[n] for n in names if os.environ.get(n)}
    if secrets_stdin:
        secrets |= envfile.read_secrets(sys.stdin.read(), names)
    text = envfile.render(fp, project, cache_dir, attention, attention_reason, secrets)
    changed = envfile.write(project / ".podkit" / "env", text)
    bad = [n for n, v in verify.items() if not v.startswith("ok") and n != "flash-attn"]
    report = {
        "status": "failed" if "requirements" in failed or bad else "ok",
        "fingerprint": json.loads(fp.to_json()), "plan": [d.__dict__ for d in plan.deps], "warnings": plan.warnings,
        "outcome": setup.outcome, "verify": verify, "attention": attention, "attention_reason": attention_reason,
        "secrets": sorted(secrets), "env_file": str(project / ".podkit" / "env"), "seconds": round(time.monotonic() - started, 2),
    }
    (setup.logs / "report.json").write_text(json.dumps(report, indent=2, default=list))
    for dep in plan.deps:
        status = setup.outcome.get(dep.name, "")
        check = verify.get(dep.name)
        echo(f"  {dep.name:13} {status}" + (f" · verify {check}" if check else ""))
    if "nvidia-ml-py" in verify:
        echo(f"  {'nvidia-ml-py':13} verify {verify['nvidia-ml-py']}")
    echo(f"  attention: {attention}" + ("" if attention == "flash-attn" else f" ({attention_reason})"))
    echo(f"  env file {'written' if changed else 'unchanged'}: .podkit/env (0600)"
               + (f", secrets: {', '.join(sorted(secrets))}" if secrets else ""))
    if as_json:
        print(json.dumps({"ok": not ("requirements" in failed or bad), "failed": failed + bad, **report},
                         indent=2, default=list))
    if "requirements" in failed or bad:
        echo(f"envsetup: FAILED ({', '.join(failed + bad)}); logs in logs/envsetup/", err=True)
        sys.exit(1)
    echo(f"envsetup: ready in {time.monotonic() - started:.1f} s")


def _bad(problem: str, fix: str) -> None:
    if _STDOUT_IS_JSON:  # scripts get the error as a JSON object, like preflight's and smoke's --json
        print(json.dumps({"ok": False, "status": "bad-input", "exit_code": 2,
                          "error": {"problem": problem, "fix": fix}}, indent=2))
    echo(f"envsetup: {problem} ({fix})", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
