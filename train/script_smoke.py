"""`bin/smoke -- COMMAND...`: the user's own training command, unchanged, for N optimizer steps.

The command runs with train/inject/ first on its PYTHONPATH, so every Python process it starts
(torchrun's or accelerate's workers included) loads train/rank_probe.py before the user's code:
each rank counts its optimizer steps, reads its loss from backward, measures memory and writes
runs/<id>/ranks/. This side runs the command in its own session, keeps its output in smoke.log,
stops it on --timeout or Ctrl-C, and then writes the same files as the built-in smoke run:
summary.json (status, verdict, per-rank peaks, predicted vs measured), metrics.jsonl (rank 0),
memory.png, and memory_snapshot.pickle where rank 0 got that far. A crash, an OOM or a hang
still leaves summary.json and smoke.log, with the command's exit code.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from podkit.checks import strict_json
from podkit.checks.command import stop_signals
from podkit.checks.errors import ConfigError
from podkit.train.outputs import RunDir, resolved_toml
from podkit.envsetup.secrets import SecretFilter
from podkit.train.verdict import EXIT_CODES, Row, judge, prediction_warnings

ROOT = Path(__file__).resolve().parent.parent
INJECT_DIR = Path(__file__).resolve().parent / "inject"
STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL for the command's process group (torchrun itself waits 30 s per worker)
POLL_S = 0.2
EXIT_TIMEOUT = 1  # a hang is a failed run (DESIGN.md: 0 ok, 1 failed, 3 OOM, 130 interrupted)


def check_command(command: tuple[str, ...], dashdash: bool) -> None:
    if not command:
        raise ConfigError("--", "no command after --" if dashdash else "no command",
                          "e.g. bin/smoke -- python train.py, or bin/smoke -- torchrun --nproc_per_node 2 train.py")
    exe = command[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise ConfigError("--", f"{exe} is not an executable file", "check the path, or run it with python")
    elif shutil.which(exe) is None:
        raise ConfigError("--", f"command not found: {exe}", "check the name, or give its full path")


def _not_started(command: tuple[str, ...], exc: OSError) -> ConfigError:
    """Why the kernel would not start the command (check_command saw an executable file): a script without a #!
    line, or a #! naming an interpreter that is not there."""
    exe, why = command[0], exc.strerror or str(exc)
    fix = f"or run it through its interpreter, e.g. bin/smoke -- {'python' if exe.endswith('.py') else 'bash'} {exe}"
    try:
        with open(shutil.which(exe) or exe, "rb") as f:
            first = f.readline(256)
    except OSError:
        first = b""
    if exc.errno == errno.ENOEXEC:
        return ConfigError("--", f"cannot start {exe}: {why} (not a program, and no #! line names its interpreter)",
                           f"add one, e.g. #!/usr/bin/env bash, {fix}")
    if exc.errno == errno.ENOENT and first.startswith(b"#!"):
        interpreter = first[2:].strip().decode(errors="replace").split(" ")[0]
        return ConfigError("--", f"cannot start {exe}: the interpreter its #! line names, {interpreter}, does not exist",
                           f"fix its first line, {fix}")
    return ConfigError("--", f"cannot start {exe}: {why}", "check the command")


def _child_env(run_path: Path, steps: int, every: int) -> dict:
    env = dict(os.environ)
    # bin/smoke put podkit's root on PYTHONPATH for itself; the command must not see podkit's
    # `train`/`checks` packages in place of its own modules, only the injection folder.
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT_DIR), *parts])
    env.update(PODKIT_ROOT=str(ROOT), PODKIT_SMOKE_DIR=str(run_path), PODKIT_SMOKE_STEPS=str(steps),
               PODKIT_SMOKE_EVERY=str(every), PYTHONUNBUFFERED="1")
    return env


def _tee(stream, log_file, echo, secrets: SecretFilter | None = None) -> None:
    """The command's output into the log and onto `echo`, with the environment's secret values replaced (a
    script that prints its environment, or a traceback holding a token)."""
    secrets = SecretFilter() if secrets is None else secrets
    # Whatever has arrived, not whole lines: a progress bar redraws with \r and ends its line only when done.
    for chunk in itertools.chain(iter(lambda: stream.read1(1 << 16), b""), [None]):  # None: the end, flush
        data = secrets.flush() if chunk is None else secrets.feed(chunk)
        if not data:
            continue
        log_file.write(data)
        log_file.flush()
        if echo is not None:
            try:
                echo.write(data)
                echo.flush()
            except OSError:  # the terminal's reader is gone: keep draining the pipe into the log, or the command blocks
                echo = None


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def run_command(command: tuple[str, ...], run_dir: RunDir, steps: int, every: int, timeout: float | None,
                echo=True, early: list[int] | None = None, announce: str = "") -> tuple[int | None, str]:
    """Run the command to its end, a timeout or a signal. Returns (exit code or None, how it ended). `early`:
    signals that came before the command started (run's handler notes them): it is not started, or stopped at
    once if one comes while it starts. `announce`: a line for stderr once it has started. Raises ConfigError
    when it cannot be started."""
    from podkit.train import process_tree

    early = [] if early is None else early
    if early:
        return None, "interrupted"
    process_tree.become_subreaper()
    # What this process runs itself (W&B's service, started by its sink): not the command's, never stopped with it.
    own = frozenset(process_tree.descendants(os.getpid()))
    secrets = SecretFilter()
    log = open(run_dir.file("log"), "ab")
    log.write(f"$ {' '.join(secrets.argv(command))}\n".encode())
    log.flush()
    try:
        proc = subprocess.Popen(list(command), env=_child_env(run_dir.path, steps, every), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:  # bad input: no process to wait for, and no "--output-dir" to blame
        log.close()
        raise _not_started(command, exc) from None
    if announce:
        print(announce, file=sys.stderr, flush=True)
    reader = threading.Thread(target=_tee, args=(proc.stdout, log, sys.stderr.buffer if echo else None, secrets),
                              daemon=True)
    reader.start()
    stopped: list[int] = []

    def forward(signum, _frame):
        stopped.append(signum)
        _kill_group(proc.pid, signal.SIGTERM)  # first: a note that cannot be written must not keep it running
        if len(stopped) == 1:
            try:
                print(f"bin/smoke: stopping the command (SIGTERM to its process group); it is killed after "
                      f"{STOP_GRACE_S:.0f} s, or at once on a second Ctrl-C", file=sys.stderr, flush=True)
            except OSError:  # stderr's reader is gone (`2>&1 | head`)
                pass

    previous = {sig: signal.signal(sig, forward) for sig in stop_signals()}
    if early:  # came while the command was being started, before `forward` could see it
        forward(early[0], None)
    how = "exited"
    try:
        deadline = time.monotonic() + timeout if timeout else None
        kill_at = None
        while True:
            # A short wait, not a blocking one: a signal arriving inside waitpid() runs `forward` and the wait
            # resumes (PEP 475), so a blocking wait would never reach the SIGKILL below.
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if stopped:
                if kill_at is None:
                    kill_at = now + STOP_GRACE_S
                if now >= kill_at or len(stopped) > 1:  # past its grace, or asked twice (a second Ctrl-C)
                    _kill_group(proc.pid, signal.SIGKILL)
                    kill_at = now + STOP_GRACE_S
            elif deadline is not None and now >= deadline:
                how = "timeout"
                stopped.append(signal.SIGTERM)
                _kill_group(proc.pid, signal.SIGTERM)
        if stopped and how != "timeout":
            how = "interrupted"
        process_tree.stop_all_below(os.getpid(), grace=5.0 if stopped else 0.0, spare=own)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    reader.join(timeout=5)
    log.close()
    return code, how


def _ranks(run_path: Path) -> list[dict]:
    out = []
    for p in sorted((run_path / "ranks").glob("rank*.json")):
        try:
            out.append(strict_json.restore(json.loads(p.read_text())))  # a NaN loss is NaN again for the verdict
        except (OSError, json.JSONDecodeError):
            pass
    return sorted(out, key=lambda r: r.get("rank", 0))


def _oom_in_log(path: Path) -> bool:
    try:
        text = path.read_bytes()[-200_000:].decode(errors="replace")
    except OSError:
        return False
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


# What a rank's collective raises when a peer died first (gloo's pair.cc, ProcessGroupNCCL's watchdog, the
# c10d store): the peer's own error is the cause.
_PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
                  "DistBackendError", "Socket Timeout", "Broken pipe")


def _root_cause(ranks: list[dict]) -> str:
    """The error to name for a failed multi-rank command: the first rank's that is not a peer's failure seen
    from a collective, else the first one."""
    errors = [r["error"] for r in ranks if r.get("error")]
    return next((e for e in errors if not any(p in e for p in _PEER_FAILURES)), errors[0] if errors else "")


def summarize(command, code: int | None, how: str, run_dir: RunDir, steps: int, timeout: float | None,
              job=None, min_drop: float = 0.05, not_started: str = "", predicted_from: list[str] | None = None,
              no_prediction: str = "") -> dict:
    """`how`: exited, timeout, interrupted, or "not started" (then `not_started` says why). `predicted_from`: where
    `job` came from (--config, --from, "the command"); `no_prediction`: why there is no job, where the command
    could not be read as one."""
    ranks = _ranks(run_dir.path)
    main = next((r for r in ranks if r.get("rank") == 0), ranks[0] if ranks else None)
    losses = [x for x in (main or {}).get("losses", []) if x is not None]
    cuda = bool(main and str(main.get("device", "")).startswith("cuda"))
    peak_key = "peak_reserved" if cuda else "peak_allocated"
    peak = max((r.get(peak_key) or 0 for r in ranks), default=None) or None
    limit = None
    if job is not None and job.smoke.peak_limit_gb:
        limit = int(job.smoke.peak_limit_gb * 1e9)
    elif cuda and main.get("capacity"):
        limit = main["capacity"]
    verdict = judge(losses, min_drop, peak, limit, steps)
    reasons = []
    if how == "not started":
        status = "failed"
        reasons.append(not_started)
    elif how == "interrupted":
        status = "interrupted"
        reasons.append("stopped by a signal (Ctrl-C, SIGTERM or a closed terminal) before the run finished")
    elif how == "timeout":
        status = "timeout"
        reasons.append(f"no end within --timeout {timeout:g} s (stopped at step {(main or {}).get('steps', 0)})")
    elif any(r.get("status") == "oom" for r in ranks) or (
            # the log's word only where no rank recorded an error of its own: a script that caught an OOM and
            # retried prints one, and a rank's FileNotFoundError is then the cause, not the OOM
            code not in (0, None) and not any(r.get("error") for r in ranks) and _oom_in_log(run_dir.file("log"))):
        status = "oom"
        reasons.append(next((r["error"] for r in ranks if r.get("status") == "oom"), "out of memory (see smoke.log)"))
    elif code != 0:
        status = "failed"
        error = _root_cause(ranks)
        if code is not None and code < 0:  # subprocess: killed by that signal
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            ended = f"the command was killed by {name}" + (
                " (the kernel's OOM killer sends it when host RAM runs out: see dmesg)" if -code == signal.SIGKILL else "")
        else:
            ended = f"the command exited {code}"
        reasons.append(ended + (f": {error}" if error else "; see smoke.log"))
    elif not ranks:
        status = "failed"
        reasons.append("no optimizer step was seen: the command ran no torch.optim step in a Python process podkit "
                       "could inject into")
    else:
        status = verdict.status
    reasons += verdict.reasons if status in ("pass", "failed") and code == 0 else []
    done = (main or {}).get("steps", 0)
    if ranks and code == 0 and how == "exited" and not done:
        reasons.insert(0, "no optimizer step was seen: podkit counts torch.optim optimizer steps, and the command "
                          "ran none (a loop that updates its weights by hand cannot be judged)")
    elif ranks and code == 0 and how == "exited" and 0 < done < steps:
        reasons.append(f"the command ended by itself after {done} optimizer steps: run it with --steps {done} "
                       f"(or fewer) to judge that many")
    secrets = SecretFilter()  # the ranks' errors are the script's own text: a token in a message stays out
    summary = {
        "status": status, "reasons": [secrets.text(r) for r in reasons], "checks": verdict.checks, "exit_code": code,
        "command": secrets.argv(command),
        "steps": done, "planned_steps": steps,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "loss_note": "the value each step passed to backward (the Trainer divides it by gradient accumulation)",
        "peak_allocated": max((r.get("peak_allocated") or 0 for r in ranks), default=0) or None,
        "peak_reserved": max((r.get("peak_reserved") or 0 for r in ranks), default=0) or None,
        "device_peak": max((r.get("device_peak") or 0 for r in ranks), default=0) or None,
        "step_time": (main or {}).get("step_time"), "tokens_per_s": None, "mfu": None,
        "ranks": [{k: secrets.text(r[k]) if k == "error" and r.get(k) else r.get(k)
                   for k in ("rank", "device", "status", "error", "steps", "peak_allocated", "peak_reserved",
                             "device_peak", "host_rss_peak")} for r in ranks],
        "warnings": sorted({secrets.text(w) for r in ranks for w in r.get("warnings", [])}),
        "predicted": None, "predicted_from": list(predicted_from or []) if job is not None else None, "memory": [],
    }
    if job is not None:
        from podkit.checks.memory import estimate

        est = estimate(job)
        summary["predicted"] = {"allocated": est.allocated, "reserved": est.reserved, "total": est.total}
        rows = [Row("peak allocated", est.allocated, summary["peak_allocated"],
                    "max over ranks: " + ("torch.cuda.max_memory_allocated" if cuda else "tensor counter (CPU)"))]
        if cuda:
            rows += [Row("peak reserved", est.reserved, summary["peak_reserved"], "torch.cuda.max_memory_reserved"),
                     Row("device (nvidia-smi)", est.total, summary["device_peak"], "incl. CUDA context, NCCL")]
        summary["memory"] = [r.to_json() for r in rows]
        if summary["step_time"]:
            # Tokens per optimizer step per rank by the job's shapes (the script's own batches may differ).
            tokens = job.train.micro_batch * job.train.grad_accum * job.train.seq_len
            summary["tokens_per_s"] = tokens / summary["step_time"]
        summary["warnings"] += prediction_warnings(rows)
    why = {  # strict JSON: every null says why
        "loss_first": "no optimizer step was seen", "loss_last": "no optimizer step was seen",
        "peak_allocated": "no rank reported a memory reading", "peak_reserved":
            "no caching allocator on a CPU run" if not cuda else "no rank reported a memory reading",
        "device_peak": "a CPU run has no device memory (NVML)" if not cuda else "NVML gave no reading",
        "step_time": "no optimizer step was timed",
        "tokens_per_s": "no job config (--from/--config) gives the tokens per step" if job is None
            else "no optimizer step was timed",
        "mfu": "your command's FLOPS per step are not known to podkit",
        "predicted": secrets.text(no_prediction) or "no job config (--from/--config) to predict from",
        "predicted_from": secrets.text(no_prediction) or "no job config (--from/--config) to predict from",
        "exit_code": "the command could not be started" if how == "not started" else "the command did not end by itself",
    }
    summary["null_reasons"] = strict_json.null_reasons(summary, why)
    return summary


def _write_env(run_dir: RunDir, summary: dict) -> None:
    """env.json as the built-in run writes it, for the device rank 0 trained on (read after the run:
    this process never touched the GPU while the command held it)."""
    import torch

    from podkit.train.outputs import env_record

    ranks = summary["ranks"]
    device = torch.device(ranks[0]["device"]) if ranks and ranks[0].get("device") else torch.device("cpu")
    try:
        record = env_record(device, max(1, len(ranks)), None)
    except Exception as exc:  # e.g. the GPU is gone after a crash: still the versions and the env
        record = env_record(torch.device("cpu"), max(1, len(ranks)), None) | {"device_error": str(exc)}
    run_dir.write_json("env", record | {"command": summary["command"]})


def _plot(run_dir: RunDir, summary: dict) -> None:
    """memory.png for rank 0, memory.rank<N>.png for every other rank (train/plot.py, matplotlib)."""
    from podkit.train import plot

    devices = {r.get("rank"): r.get("device") for r in summary.get("ranks", [])}
    predicted = (summary.get("predicted") or {}).get("allocated")
    for path in sorted((run_dir.path / "ranks").glob("metrics.rank*.jsonl")):
        rank = int(path.stem.split(".rank")[-1])
        samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        curves = plot.curves([{"profile": s} for s in samples if "peak_allocated" in s]
                             + [{"step": s["step"], "loss": s["loss"]} for s in samples if "loss" in s],
                             {"device": devices.get(rank) or "cpu", "predicted": predicted,
                              "status": summary.get("status", ""), "steps_planned": summary.get("planned_steps", 0)},
                             f"rank {rank}")
        if not curves.series.get("peak tensors") and not curves.series.get("allocated"):
            curves.series["peak allocated"] = [(s["step"], s["peak_allocated"]) for s in samples
                                               if s.get("peak_allocated") is not None]
        out = run_dir.file("plot") if rank == 0 else run_dir.path / f"memory.rank{rank}.png"
        plot.draw([curves], out, f"your command: memory, rank {rank}")


class MetricsFollower(threading.Thread):
    """Feeds the metric sinks each record of rank 0's metrics file as the command writes it, so
    TensorBoard / W&B show the run live. It runs here, in bin/smoke's process: the user's command
    never gets a sink (nor a second wandb.init beside its own)."""

    POLL_S = 0.5

    def __init__(self, path: Path, sinks):
        super().__init__(daemon=True)
        self.path, self.sinks = path, sinks
        self.offset, self.done = 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.POLL_S):
            self.drain()

    def drain(self) -> None:
        from podkit.train.sinks import from_rank_record

        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return  # not written yet: rank 0 has not reached its first step
        end = data.rfind(b"\n") + 1  # complete lines only; a line being written is read next time
        self.offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            for rec in from_rank_record(record):
                self.sinks.record(rec)

    def finish(self) -> None:
        self.done.set()
        self.join(timeout=10)
        self.drain()  # what the last steps wrote


def _start_sinks(names: tuple[str, ...], run_dir: RunDir, command, job):
    from podkit.train.sinks import Sinks

    job_fields = {} if job is None else {
        s: {f: getattr(getattr(job, s), f) for f in getattr(job, s).__dataclass_fields__}
        for s in ("model", "train", "cluster", "smoke")}
    config = {"job": {**job_fields, "command": SecretFilter().argv(command)}, "toml": resolved_toml(job) if job is not None else ""}
    return Sinks(names, run_dir.path, run_dir.run_id, config, job.smoke.wandb_project if job is not None else "podkit",
                 lambda text: print(f"smoke: warning: {text}", file=sys.stderr, flush=True))


def _rank_files(run_dir: RunDir) -> dict[str, str]:
    """What the ranks wrote beside the run's own files: their records and every other rank's plot."""
    out = {"ranks": "ranks/"} if (run_dir.path / "ranks").is_dir() else {}
    return out | {p.stem.replace(".", "_"): p.name for p in sorted(run_dir.path.glob("memory.rank*.png"))}


def _files(run_dir: RunDir) -> dict[str, str]:
    """summary.json's `files`: what the run directory holds, the summary itself included."""
    return run_dir.present() | _rank_files(run_dir) | {"summary": "summary.json"}


def run(command: tuple[str, ...], root: Path, run_id: str, steps: int, every: int, timeout: float | None,
        job=None, min_drop: float = 0.05, echo: bool = True, sinks: tuple[str, ...] = (),
        announce: str = "", predicted_from: list[str] | None = None, no_prediction: str = "") -> tuple[dict, Path, int]:
    """`sinks`: metric sinks (train/sinks.py), already checked with sinks.check, fed rank 0's records. Raises
    ConfigError when the command cannot be started (its summary.json says so first)."""
    run_dir = RunDir(root, run_id)
    run_dir.write_json("summary", {"status": "running", "command": SecretFilter().argv(command), "steps": 0,
                                   "planned_steps": steps})
    if job is not None:
        run_dir.file("config").write_text(resolved_toml(job))
    follower = None
    # Once the command has ended, a signal must not cost the summary: it is noted, the summary written first,
    # and the extras (env.json's torch import, the plots: a second or two) skipped. run_command puts its own
    # handlers in place while the command runs and these back after.
    # Before the command starts (the sinks' setup can take seconds), a signal is noted for run_command, which then
    # does not start it, or stops it at once.
    early: list[int] = []
    late: list[int] = []
    ended = False

    def defer(signum, _frame):
        (late if ended else early).append(signum)
        try:
            print("bin/smoke: the command has ended; writing its summary, then stopping" if ended else
                  "bin/smoke: stopping before the command runs", file=sys.stderr, flush=True)
        except OSError:
            pass

    previous = {sig: signal.signal(sig, defer) for sig in stop_signals()}
    try:
        if sinks:
            follower = MetricsFollower(run_dir.path / "ranks" / "metrics.rank0.jsonl",
                                       _start_sinks(sinks, run_dir, command, job))
            follower.start()
        not_started = None
        try:
            code, how = run_command(command, run_dir, steps, every, timeout, echo=echo, early=early, announce=announce)
        except ConfigError as exc:  # the kernel would not start it: bad input, yet the run directory gets its end
            not_started, code, how = exc, None, "not started"
        finally:
            ended = True
            if follower is not None:
                follower.finish()
        summary = summarize(command, code, how, run_dir, steps, timeout, job, min_drop,
                            not_started=f"{not_started.problem} ({not_started.fix})" if not_started else "",
                            predicted_from=predicted_from, no_prediction=no_prediction)
        if not_started is not None:  # the final shape at once: nothing more is written (smoke.log has the $ line)
            summary["files"] = _files(run_dir)
        run_dir.write_json("summary", summary)  # the final status, before anything that may be cut short
        if not_started is not None:
            if follower is not None:
                follower.sinks.close(summary)
            raise not_started
        if follower is not None:
            follower.sinks.close(summary)
            summary["sinks"] = list(sinks)
        main_metrics = run_dir.path / "ranks" / "metrics.rank0.jsonl"
        if main_metrics.exists():
            shutil.copyfile(main_metrics, run_dir.file("metrics"))
        if not late:
            _write_env(run_dir, summary)
        try:
            if not late:
                _plot(run_dir, summary)
        except Exception as exc:  # the plot must never cost the summary
            summary["warnings"].append(f"memory plot failed: {exc}")
        if late:
            summary["warnings"].append(f"{signal.Signals(late[0]).name} after the command ended: env.json and the "
                                       "memory plot were skipped")
        summary["files"] = _files(run_dir)
        run_dir.write_json("summary", summary)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    exit_code = EXIT_TIMEOUT if summary["status"] == "timeout" else EXIT_CODES.get(summary["status"], 1)
    return summary, run_dir.path, exit_code
