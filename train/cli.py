"""`bin/smoke`: N profiled training steps of a job, measured against preflight's prediction.

Exit codes: 0 pass, 1 the run failed (NaN, loss did not fall, over the peak limit, a crash),
2 bad input, 3 out of memory, 130 interrupted. With gpus_per_node > 1 (or FSDP sharding) it
relaunches itself under torchrun; rank 0 writes runs/<run-id>/ and the parent reports from it.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import click

from podkit.checks import strict_json
from podkit.checks.config import EXAMPLE_JOB, MAX_INT, load_job
from podkit.checks.command import MODEL_HELP, OneLineCommand, stop_signals
from podkit.checks.errors import ConfigError

TINY_CPU_JOB = Path(__file__).resolve().parent.parent / "checks" / "examples" / "tiny-cpu.toml"
EXIT_BAD_INPUT = 2


def default_job(device: str) -> Path:
    """No --config: the bundled 1B example on a GPU, the tiny CPU job elsewhere."""
    if device == "cpu":
        return TINY_CPU_JOB
    from podkit.checks.host import HostFacts

    facts = HostFacts(env={}, packages={})
    from podkit.checks.host import _probe_nvml

    _probe_nvml(facts)
    return EXAMPLE_JOB if facts.gpus else TINY_CPU_JOB


def _setup_logging(run_path: Path | None, rank: int) -> None:
    from podkit.envsetup.secrets import RedactingFormatter, SecretFilter

    root = logging.getLogger("podkit")
    root.setLevel(logging.INFO)
    root.handlers.clear()
    # Every line, its traceback included, without the environment's secret values (as -- COMMAND's log): a job
    # file's path, an error's message may hold one.
    secrets = SecretFilter()
    fmt = RedactingFormatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S", secrets)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(RedactingFormatter("smoke: %(message)s", secrets=secrets))
        console.addFilter(lambda record: not getattr(record, "file_only", False))  # tracebacks: smoke.log only
        root.addHandler(console)
    if run_path is not None:
        name = "smoke.log" if rank == 0 else f"smoke.rank{rank}.log"
        fh = logging.FileHandler(run_path / name)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False


def _fail(message: str | ConfigError, as_json: bool = False) -> None:
    """One line on stderr, exit 2; with --json also the error as a JSON object on stdout."""
    if as_json:
        error = message if isinstance(message, ConfigError) else ConfigError("", str(message))
        click.echo(strict_json.dumps(error.to_json(), indent=2))
    click.echo(f"smoke: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "-c", "config", default=None,
              help="Job TOML. Default: the bundled Llama 3.2 1B example on a GPU, a tiny model on CPU.")
@click.option("--steps", type=int, default=None, help="Override smoke.steps (default 100).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where to train; auto takes the GPU when there is one.")
@click.option("--output-dir", default=None, help="Where run directories go (default: the job's train.output_dir, runs/).")
@click.option("--run-id", default=None, help="Name of the run directory (default: time-job-random).")
@click.option("--json", "as_json", is_flag=True, help="Print summary.json to stdout at the end.")
@click.option("--sink", "sink", multiple=True, type=click.Choice(["tensorboard", "wandb"]),
              help="Also log metrics to TensorBoard (RUN_DIR/tensorboard) or W&B (key: WANDB_API_KEY from the "
                   "environment); repeatable; adds to [smoke] sinks.")
@click.option("--inject-fault", default="", hidden=True, help="Test hook: nan:STEP or oom:STEP.")
@click.option("--from", "from_files", multiple=True, metavar="[KIND:]FILE",
              help="Your own configs (as bin/preflight --from): the job whose replica is trained, or with -- COMMAND "
                   "part of the prediction your command is measured against (with what the command says).")
@click.option("--model", "model_preset", default=None, help=MODEL_HELP)
@click.option("--timeout", type=float, default=None, help="With -- COMMAND: stop it after this many seconds.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(config, steps, device, output_dir, run_id, as_json, sink, inject_fault, from_files=(), model_preset=None,
         timeout=None, command=()) -> None:
    """Train the job for smoke.steps (100) profiled steps and compare measured memory with the prediction.

    With `bin/smoke [OPTIONS] -- COMMAND...` it runs your own training command instead and
    measures it against the job read from the command itself, as bin/preflight -- COMMAND
    reads it (over --config / beside --from when given; a command podkit cannot read runs
    without a prediction); --timeout stops a hang.

    Ends with a verdict: pass when there was no OOM and no NaN, the loss fell by
    smoke.min_loss_drop of the first loss (0.2; a quarter of it for the built-in LoRA run; 0.05
    for your own command without a job) and the peak stayed under smoke.peak_limit_gb (default: the card). Everything lands in
    runs/<run-id>/: config.toml, env.json, metrics.jsonl, summary.json, memory.png,
    memory_snapshot.pickle and smoke.log.

    Exit codes: 0 pass, 1 failed (NaN, the loss did not fall, over the peak limit, a crash, a
    --timeout), 2 bad input, 3 out of memory, 130 interrupted.
    """
    from podkit.train import parallel

    try:
        _refuse_forgotten_values(click.get_current_context())
    except ConfigError as exc:
        from podkit.launch import wants_json

        _fail(exc, as_json or wants_json())  # `--output-dir --json`: the --json went to the option
    if command or "--" in sys.argv[1:]:
        if device != "auto":  # the command picks its own device; a --device beside it would be dropped unsaid
            _fail(ConfigError("--device", "goes with the built-in run: your command picks its own device",
                              "drop --device (set CUDA_VISIBLE_DEVICES= to keep a command off the GPU)"), as_json)
        sys.exit(_smoke_command(tuple(command), config, from_files, model_preset, steps, timeout, output_dir,
                                run_id, as_json, sink))
    try:
        _refuse_stdin(config)
        path = Path(config) if config else default_job(device)
        if timeout is not None:
            raise ConfigError("--timeout", "goes with -- COMMAND", "e.g. bin/smoke --timeout 900 -- python train.py")
        if model_preset and not from_files:  # as bin/preflight: a --model alone would train the default job
            raise ConfigError("--from", "--model goes with --from FILE", "add --from your config file")
        if from_files:  # podkit's replica of the job the user's own configs describe
            from podkit.checks.importers import build_job

            job = build_job(config, list(from_files), model_preset).job
            path = Path(job.source)
        else:
            job = load_job(path)
        if steps is not None:
            if not 0 < steps <= MAX_INT:
                raise ConfigError("--steps", f"must be at least 1, got {steps}" if steps <= 0 else
                                  f"{steps} is too large to be meant")
            job = job.replace(smoke={"steps": steps})
        if sink:
            job = job.replace(smoke={"sinks": list(job.smoke.sinks) + list(sink)})
        from podkit.train.smoke import Fault, check_runnable, pick_device

        fault = Fault.parse(inject_fault)
        target = pick_device(device)
        check_runnable(job, target)  # once, before any process is launched
        from podkit.train.outputs import check_output_root, decide_run_id

        if output_dir is not None and not output_dir.strip():
            raise ConfigError("--output-dir", "is empty", "give a directory, or leave it out for train.output_dir")
        field = "--output-dir" if output_dir else "train.output_dir"
        root = check_output_root(Path(output_dir or job.train.output_dir), field)
        nodes = _nodes(job)
        # torchrun's ranks all open the directory their launcher checked; the nodes of one run (bin/pod run
        # --nodes) may share an output directory that another node's ranks have made already.
        run_id = decide_run_id(root, run_id, job.source, shared=parallel.under_torchrun() or nodes > 1)
    except ConfigError as exc:
        _fail(exc, as_json)

    if job.facts.process_group and not parallel.under_torchrun():
        sys.exit(_launch_torchrun(job, root, run_id, as_json, nodes))
    sys.exit(_run(job, path, target, root, run_id, fault, as_json))


# What a value looks like, for the fix of an option whose value was forgotten.
_VALUE_EXAMPLES = {"--config": "job.toml", "--output-dir": "runs", "--run-id": "lr3e4", "--from": "training_args.json",
                   "--model": "llama-3.2-1b", "--inject-fault": "nan:5"}


def _refuse_forgotten_values(ctx: click.Context) -> None:
    """click gives an option that takes a value the next word, whatever it is: `--output-dir -- python x.py`
    ran the command into ./--/, and `--config --json` looked for a file named --json. A value of `--` or one of
    bin/smoke's own option names can only be a value left out; a path that starts with '-' is still taken."""
    params = ctx.command.get_params(ctx)
    names = {name for p in params for name in (*p.opts, *p.secondary_opts)}
    for p in params:
        if not isinstance(p, click.Option) or p.is_flag or p.type is not click.STRING:
            continue
        value = ctx.params.get(p.name)
        for v in (value if p.multiple else (value,)) or ():
            if v is not None and (v == "--" or v.split("=", 1)[0] in names):
                option = max(p.opts, key=len)
                what = "what starts your command" if v == "--" else "an option of bin/smoke"
                raise ConfigError(option, f"has no value: it took {v!r} ({what}) for one",
                                  f"give it one, e.g. {option} {_VALUE_EXAMPLES.get(option, 'VALUE')}, or leave it out")


def _nodes(job) -> int:
    """How many nodes this run spans: PET_NNODES, torchrun's own variable, which `bin/pod run
    --nodes` sets on every node with the rest of the rendezvous (pods/nodes.py). The job must agree:
    its prediction and verdict are for cluster.nodes x gpus_per_node processes."""
    from podkit.train import parallel

    c = job.cluster
    raw = os.environ.get("PET_NNODES", "").strip()
    if not raw:
        if c.nodes > 1 and not parallel.under_torchrun():
            raise ConfigError("cluster.nodes", f"is {c.nodes}: that world spans {c.nodes} hosts, one bin/smoke runs on one",
                              "start it on every node at once: bin/pod run A,B --nodes -- bin/smoke --config JOB "
                              "(or set cluster.nodes = 1 to smoke one node's share)")
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError("PET_NNODES", f"is {raw!r}, not a number of nodes", "set it to the number of hosts, e.g. 2")
    if int(raw) != c.nodes:
        raise ConfigError("cluster.nodes", f"is {c.nodes}, but this run spans {raw} nodes (PET_NNODES)",
                          f"set cluster.nodes = {raw}, or run on {c.nodes} host(s)")
    nproc = os.environ.get("PET_NPROC_PER_NODE", "").strip()
    if nproc and nproc != str(c.gpus_per_node):
        raise ConfigError("cluster.gpus_per_node", f"is {c.gpus_per_node}, but {nproc} processes per node were asked "
                          "for (PET_NPROC_PER_NODE)", f"set cluster.gpus_per_node = {nproc}, or leave --nproc-per-node out")
    return int(raw)


def _smoke_command(command, config, from_files, model_preset, steps, timeout, output_dir, run_id, as_json,
                   sink: tuple[str, ...] = ()) -> int:
    """bin/smoke -- COMMAND...: the user's own script, measured (train/script_smoke.py)."""
    from podkit.train import script_smoke
    from podkit.envsetup.secrets import SecretFilter

    job = None
    try:
        script_smoke.check_command(command, "--" in sys.argv[1:])
        if "--" not in sys.argv[1:]:
            raise ConfigError("COMMAND", f"unexpected argument {command[0]!r}", "put your command after --")
        if steps is not None and not 0 < steps <= MAX_INT:  # as the built-in run
            raise ConfigError("--steps", f"must be at least 1, got {steps}" if steps <= 0 else
                              f"{steps} is too large to be meant")
        if timeout is not None and not (0 < timeout < math.inf):  # also NaN, which compares false to all
            raise ConfigError("--timeout", f"must be a positive number of seconds, got {timeout:g}")
        _refuse_stdin(config)
        job, predicted_from, no_prediction = _command_job(config, from_files, model_preset, command)
        given = job if config or from_files else None  # a job the user gave: its [smoke] settings and sinks count
        from podkit.train.outputs import check_output_root, command_stem, decide_run_id

        if output_dir is not None and not output_dir.strip():
            raise ConfigError("--output-dir", "is empty", "give a directory, or leave it out for train.output_dir")
        # Before the command starts, as the built-in run: a file or an unwritable place is bad input, said once.
        root = check_output_root(Path(output_dir or (given.train.output_dir if given else "runs")),
                                 "--output-dir" if output_dir or given is None else "train.output_dir")
        # As the built-in run: --run-id, else PODKIT_RUN_ID, else a fresh name. Never a shared directory: no
        # torchrun starts bin/smoke -- COMMAND as its worker, and bin/pod run --nodes refuses it (pods/nodes.py).
        run_id = decide_run_id(root, run_id, command_stem(command))
        # The same switch as the built-in run: [smoke] sinks of the job, plus --sink.
        sinks = tuple(dict.fromkeys([*(given.smoke.sinks if given else []), *sink]))
        if sinks:
            from podkit.train import sinks as metric_sinks

            metric_sinks.check(sinks)  # before the command runs: a missing package or W&B key is bad input
    except ConfigError as exc:
        _fail(exc, as_json)
    steps = steps or (given.smoke.steps if given else 100)
    every = given.smoke.profile_every if given else 10
    # Said once the command has started (a command that cannot start is one line of bad input, nothing more).
    announce = f"smoke: running {' '.join(SecretFilter().argv(command))} for {steps} optimizer steps -> {root / run_id}"
    if job is not None:
        announce += f"\nsmoke: predicted from {', '.join(predicted_from)}: {_describe(job)}"
    elif no_prediction:
        announce += f"\nsmoke: no prediction to measure against: {SecretFilter().text(no_prediction)}"
    try:
        summary, run_path, code = script_smoke.run(
            command, root, run_id, steps, every, timeout, job, min_drop=given.smoke.min_loss_drop if given else 0.05,
            sinks=sinks, announce=announce, predicted_from=predicted_from, no_prediction=no_prediction)
    except ConfigError as exc:  # the command could not be started (its summary.json says so too)
        _fail(exc, as_json)
    except OSError as exc:
        _fail(ConfigError("--output-dir", f"cannot write {root / run_id}: {exc}"), as_json)
    _report(summary, run_path, as_json)
    return code


def _command_job(config, from_files, model_preset, command) -> tuple[object, list[str], str]:
    """The job `-- COMMAND` is measured against, the sources it came from, and why there is none: --config and
    --from as given with what the command says over them, read as bin/preflight -- COMMAND reads it. A command
    podkit cannot read as a job (or one at odds with the files) adds nothing: the files' job stands, and with
    none there is no prediction, said in one line; the command still runs. Bad --config / --from files stay
    bad input."""
    from podkit.checks.importers import build_job

    sources = [f"--config {config}"] * bool(config) + [f"--from {f}" for f in from_files]
    try:
        return build_job(config, list(from_files), model_preset, command=command).job, [*sources, "the command"], ""
    except ConfigError as exc:
        why = f"the command is not read as a job: {str(exc).removeprefix('--: ')}"
    if from_files:
        return build_job(config, list(from_files), model_preset).job, sources, why
    if model_preset:  # a --model that would name the model of no job
        raise ConfigError("--from", "--model goes with --from FILE or a command podkit reads as a job",
                          f"add --from your config file; {why}")
    if config:
        return load_job(config), sources, why
    return None, [], why


def _describe(job) -> str:
    t, c = job.train, job.cluster
    return (f"{job.shape.name}, {t.stack} stack, micro-batch {t.micro_batch} x accum {t.grad_accum} x seq {t.seq_len}, "
            f"{t.precision}, {c.gpus_per_node * c.nodes} GPU(s) (bin/preflight -- COMMAND shows how it was read)")


def _run(job, path, device, root: Path, run_id: str, fault, as_json: bool) -> int:
    import torch

    from podkit.train import parallel
    from podkit.train.outputs import RunDir
    from podkit.train.smoke import SmokeRun

    try:
        run_dir = RunDir(root, run_id)
    except OSError as exc:
        _fail(ConfigError("--output-dir", f"cannot create {root / run_id}: {exc.strerror or exc}",
                          "point it at a directory you can write"), as_json)
    # Logging first (rank from torchrun's env), so a rank that fails to join the group says why in its log.
    _setup_logging(run_dir.path, int(os.environ.get("RANK", "0")))
    log = logging.getLogger("podkit.smoke")
    try:
        world = parallel.init_world(device.type)
    except Exception:
        log.error("joining the process group failed:\n%s", traceback.format_exc())
        raise
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    if world.main:
        log.info("run %s -> %s", run_id, run_dir.path)
        log.info("job %s: %s, %s, micro-batch %d x accum %d x seq %d, checkpointing %s on %s x %s",
                 path, job.train.precision, job.train.optimizer, job.train.micro_batch, job.train.grad_accum,
                 job.train.seq_len, job.train.checkpointing, world.size, device.type)
        if job.cluster.nodes > 1:
            log.info("world: %d processes on %d nodes (the job's %d x %d)", world.size, job.cluster.nodes,
                     job.cluster.nodes, job.cluster.gpus_per_node)
    try:
        # Only rank 0 writes the run's files; other ranks keep just their smoke.rank<N>.log.
        smoke = SmokeRun(job, device, world, run_dir if world.main else None, fault,
                         rank_metrics=None if world.main else run_dir.path / f"metrics.rank{world.rank}.jsonl")
        verdict = smoke.run(job.smoke.steps)
    except ConfigError as exc:
        parallel.shutdown()
        _fail(exc, as_json)
    summary, lockstep = smoke.summary, smoke.in_lockstep
    # The wrapped model (DDP, FSDP) holds the process group: released only at interpreter exit, the group's
    # destructor ran in the interpreter's teardown and a rank sometimes aborted there ("terminate called without
    # an active exception", exit -6, torchrun's traceback on the user's terminal; 1 of 30 two-rank CPU smokes
    # beside 4 busy processes). Let it go while the group is still up.
    del smoke
    gc.collect()
    # Only where every rank ran every step: an interrupted or failed peer may be inside another collective.
    parallel.shutdown(sync=lockstep)
    # The verdict is decided and summary.json written: another Ctrl-C (a user pressing again) must not
    # turn the run's exit code into a death by signal halfway through the report.
    for sig in stop_signals():
        signal.signal(sig, signal.SIG_IGN)
    if os.environ.get("PODKIT_LAUNCHER"):
        return 0  # our own torchrun parent reads summary.json and exits with the verdict's code
    if world.main:
        _report(summary, run_dir.path, as_json)
    return verdict.exit_code


def _refuse_stdin(config: str | None) -> None:
    """bin/preflight reads `-c -` from stdin; a smoke cannot: its torchrun ranks are this command again,
    each reading the job anew."""
    if config == "-":
        raise ConfigError("--config", "bin/smoke reads the job from a file, not stdin (its ranks read it again)",
                          "save it first: ... > job.toml; bin/smoke --config job.toml")


def _launch_torchrun(job, root: Path, run_id: str, as_json: bool, nodes: int = 1) -> int:
    """Run this same command as `torchrun --standalone --nproc-per-node N`, then report rank 0's summary.
    Across nodes, torchrun takes its rendezvous from the PET_* variables `bin/pod run --nodes` set."""
    nproc = job.cluster.gpus_per_node
    # Workers start as bin/smoke does (`python -c`, the cwd dropped from sys.path), not `-m podkit.train.cli`:
    # a user's own train.py in the current directory would shadow podkit's package in every worker.
    cmd = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if nodes == 1 else []),
           f"--nproc-per-node={nproc}", "--no-python", sys.executable, "-c", WORKER_BOOT, *sys.argv[1:],
           "--run-id", run_id, "--output-dir", str(root)]
    env = dict(os.environ, PODKIT_RUN_ID=run_id, PODKIT_LAUNCHER="1", OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    where = (f" on node {os.environ.get('PODKIT_NODE_RANK', '?')} of {nodes} (rendezvous "
             f"{os.environ.get('PET_RDZV_ENDPOINT', '?')})" if nodes > 1 else "")
    click.echo(f"smoke: launching {nproc} processes under torchrun{where} (run {run_id})", err=True)
    code, stopped = _supervise(cmd, env, as_json)
    summary_path = root / run_id / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError):
        summary = None
    if nodes > 1 and summary is None and not stopped:
        # c10d ranks nodes by address: global rank 0, which writes the summary, ran on another node.
        click.echo(f"smoke: this node's {nproc} process(es) ended (torchrun exit {code}); rank 0 ran on another "
                   f"node and wrote the run's summary.json there; ranks' logs: {root / run_id}", err=True)
        return 0 if code == 0 else 1
    from podkit.envsetup.secrets import SecretFilter

    if stopped:
        # Rank 0 may have been killed before it wrote its summary: the run was still interrupted.
        if summary is not None and summary.get("status") != "interrupted":
            summary = dict(summary, status="interrupted",
                           reasons=[f"stopped by {signal.Signals(stopped).name} before rank 0 finished"])
            summary_path.write_text(strict_json.dumps(summary, indent=2))
        click.echo(f"smoke: interrupted ({signal.Signals(stopped).name}); every process of the run stopped", err=True)
        if summary is not None and "steps" in summary:
            _report(summary, root / run_id, as_json)
        return 130
    if summary is None:
        click.echo(f"smoke: torchrun exited {code} without a summary; see {root / run_id}", err=True)
        return 1
    if summary.get("status") == "running" or (summary.get("status") in ("interrupted", "failed") and code != 0):
        summary = SecretFilter().deep(_failed_under_torchrun(summary, code, root / run_id))  # its reasons name paths
        summary_path.write_text(strict_json.dumps(summary, indent=2))
    _report(summary, root / run_id, as_json)
    from podkit.train.verdict import EXIT_CODES

    return EXIT_CODES.get(summary.get("status"), 1)


def _failed_under_torchrun(summary: dict, code: int, run_path: Path) -> dict:
    """Rank 0's summary once torchrun failed and nobody signalled this launcher: another rank died and
    torchrun stopped the rest (rank 0 then reads SIGTERM, or a peer's broken connection). A rank whose log
    ends without an error or a stop was killed from outside, most often by the kernel's OOM killer. Rank 0
    may itself have been stopped before it wrote its results (its summary still says "running", also when
    torchrun exited 0): the run still ends with a final status and a reason."""
    status = summary.get("status")
    # After a clean exit every rank's log ends without an error: none of them was killed.
    killed = _ranks_killed_outright(run_path) if code != 0 else []
    if status == "failed" and not killed:
        return summary  # rank 0 said why itself
    if killed:
        first = (f"rank {', '.join(map(str, killed))} died without an error in its log (smoke.rank<N>.log): "
                 "killed from outside (SIGKILL), most often by the kernel's out-of-memory killer; see `dmesg`")
    elif status == "running":
        first = f"torchrun exited {code} before rank 0 wrote its results; see {run_path}/smoke.log"
    else:
        first = f"another rank died and torchrun (exit {code}) stopped the rest; see {run_path}"
    rest = summary.get("reasons", []) if status == "failed" else []
    out = dict(summary, status="failed", reasons=[first, *rest])
    if status == "running":
        out["steps"] = _steps_logged(run_path)
    return out


def _steps_logged(run_path: Path) -> int:
    """Steps rank 0 logged before it stopped: metrics.jsonl's step lines (its profile lines say "profile")."""
    try:
        lines = (run_path / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    steps = 0
    for line in lines:
        try:
            steps += "loss" in json.loads(line)
        except (json.JSONDecodeError, TypeError):  # a last line cut short by the kill
            continue
    return steps


def _ranks_killed_outright(run_path: Path) -> list[int]:
    """Ranks (> 0) whose log has neither a Python error nor a stop: they ended without a word."""
    killed = []
    for log_file in sorted(run_path.glob("smoke.rank*.log")):
        text = log_file.read_text(errors="replace")
        if not any(mark in text for mark in ("Traceback", "run failed", "interrupted", "out of memory")):
            try:
                killed.append(int(log_file.name[len("smoke.rank"):-len(".log")]))
            except ValueError:
                continue
    return killed


WORKER_BOOT = ('import sys; sys.path[:1] = [] if sys.path[:1] == [""] else sys.path[:1]; '
               'from podkit.train.cli import main; main(prog_name="smoke")')

# torchrun gives its workers 30 s after SIGTERM before SIGKILL (torch/distributed/elastic/
# multiprocessing/api.py, PContext.close timeout=30, torch 2.13); a little more for itself.
TORCHRUN_GRACE_S = 40.0


def _supervise(cmd: list[str], env: dict, as_json: bool) -> tuple[int, int]:
    """Run torchrun in its own session; SIGTERM/SIGINT here stop it and every worker (even one
    re-parented after torchrun died), then wait. Returns (torchrun's exit code, the signal or 0)."""
    from podkit.train import process_tree

    process_tree.become_subreaper()
    # Own session: a terminal's Ctrl-C reaches only this launcher, which stops the rest in order.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if as_json else None, start_new_session=True)
    stopped: list[int] = []

    def forward(signum, _frame):
        stopped.append(signum)
        try:  # SIGTERM whatever came: torchrun may have inherited SIGINT ignored (a background job)
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in stop_signals()}
    try:
        while True:
            try:
                code = proc.wait(timeout=TORCHRUN_GRACE_S if stopped else None)
                break
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # past its grace: nothing more to save
        # Workers left behind (torchrun killed before it stopped them) are ours now: stop them too.
        process_tree.stop_all_below(os.getpid(), grace=10.0 if stopped else 0.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, (stopped[0] if stopped else 0)


def _report(summary: dict, run_path: Path, as_json: bool) -> None:
    if as_json:
        click.echo(strict_json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 110)
    mib = 1 << 20
    table = Table(title="Memory: predicted vs measured (per GPU)", title_justify="left")
    for col, justify in (("term", "left"), ("predicted MiB", "right"), ("measured MiB", "right"),
                         ("error", "right"), ("how", "left")):
        table.add_column(col, justify=justify)
    for row in summary.get("memory", []):
        p, m, e = row["predicted"], row["measured"], row["error"]
        colour = "green" if e is not None and abs(e) <= 0.1 else "yellow" if e is not None and abs(e) <= 0.25 else "red"
        table.add_row(row["name"], "-" if p is None else f"{p / mib:,.1f}", "-" if m is None else f"{m / mib:,.1f}",
                      "-" if e is None else f"[{colour}]{e:+.1%}[/]", row["note"])
    if summary.get("memory"):
        console.print(table)
    speed = []
    if summary.get("step_time"):
        speed.append(f"{summary['step_time'] * 1e3:,.1f} ms/step")
    if summary.get("tokens_per_s"):
        ranks = summary.get("world_size") or 1
        speed.append(f"{summary['tokens_per_s']:,.0f} tokens/s" + (f" (total of all {ranks} ranks)" if ranks > 1 else ""))
    if summary.get("mfu") is not None:
        speed.append(f"MFU {summary['mfu']:.1%}")
    lf, ll = summary.get("loss_first"), summary.get("loss_last")
    if lf is not None and ll is not None:
        floor = summary.get("loss_floor")
        speed.append(f"loss {lf:.3f} -> {ll:.3f}" + (f" (floor {floor:.2f})" if floor else ""))
    if speed:
        console.print("; ".join(speed))
    for w in summary.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(w)}")
    for s in summary.get("suggestions", []) or []:
        change = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in s["changes"].items())
        console.print(f"[cyan]would fit:[/] {change} ({s['total'] / (1 << 30):.1f} GiB, step time x{s['slowdown']})")
    status = summary["status"]
    colour = {"pass": "bold green", "oom": "bold red", "failed": "bold red"}.get(status, "yellow")
    # Reasons carry raw error text (gloo's "[/path/pair.cc:553]" looks like a closing markup tag).
    why = escape("; ".join(summary.get("reasons", [])))
    console.print(f"smoke: [{colour}]{status}[/]{': ' + why if why else ''} ({summary['steps']} steps) -> "
                  f"{escape(str(run_path))}")


if __name__ == "__main__":
    main(prog_name="bin/smoke")
