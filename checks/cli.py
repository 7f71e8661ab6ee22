"""`bin/preflight`: check a job and predict its per-GPU memory before renting anything.

Exit codes: 0 every check passed (warnings allowed), 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import shlex
import sys

import click

from podkit.checks import gpus as gpu_catalog, strict_json
from podkit.checks.config import EXAMPLE_JOB, load_job
from podkit.checks.command import MODEL_HELP, OneLineCommand
from podkit.checks.errors import ConfigError

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def run_preflight(config: str, gpu: str | None, probe: bool, job=None):
    """The library face of the command: returns a Preflight, raises ConfigError on bad input.
    `job` (an imported JobConfig, see checks.importers) replaces reading `config`."""
    from podkit.checks import advisor, gpus, memory, rules
    from podkit.checks.host import HostFacts
    from podkit.checks.report import Preflight

    job = job if job is not None else load_job(config)
    if gpu is not None:
        gpus.lookup(gpu)  # '' included: an empty --gpu is an error, not "the config's GPU"
        job = job.replace(cluster={"gpu": gpu})
    facts = HostFacts.probe(job.train.output_dir, gpu_probe=probe) if probe else HostFacts.unprobed()
    if probe and not gpu and facts.gpus:
        # On the pod itself, the GPU that is there beats the one the config names.
        try:
            job = job.replace(cluster={"gpu": gpus.lookup(facts.gpus[0].name).name})
        except ConfigError:
            pass  # not in the catalog: keep the configured one
    est = memory.estimate(job)
    suggestions = advisor.advise(job) if not est.fits or est.headroom < advisor.HEADROOM else []
    return Preflight(job, est, rules.run_checks(job, est, facts, suggestions), suggestions)


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "-c", "config", default=str(EXAMPLE_JOB), show_default="the bundled example job",
              help="Job TOML file (see checks/examples/).")
@click.option("--gpu", help=f"GPU to predict for, overriding [cluster].gpu: a catalog name ({gpu_catalog.catalog_names()}) "
                           f"or the name nvidia-smi shows; short names mean one card: {gpu_catalog.short_name_meanings()}.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--no-probe", is_flag=True,
              help="Skip looking at this machine: its checks (env, packages, GPU, driver, disk) report skip.")
@click.option("--traced", is_flag=True,
              help="Also run the training step at full size on fake tensors (needs torch; a CPU is enough; "
                   "tens of seconds) and show its phases beside the analytic ones.")
@click.option("--from", "from_files", multiple=True, metavar="[KIND:]FILE",
              help="Read the job from your own configs (repeatable): TrainingArguments/SFTConfig, peft, "
                   "bitsandbytes, DeepSpeed JSON, accelerate or axolotl YAML, torchtitan TOML, torchtune recipe YAML, "
                   "litgpt YAML; over --config if given, and beside -- COMMAND.")
@click.option("--model", "model_preset", default=None, help=MODEL_HELP)
@click.option("--emit-toml", is_flag=True, help="With --from or -- COMMAND: print the resulting job TOML and exit.")
@click.option("--rank-gpus", "rank_gpus", metavar="PRICES",
              help="Rank the GPU types in PRICES (bin/pod gpus --json; - for stdin) where the job fits, cheapest per hour first.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(config: str, gpu: str | None, as_json: bool, no_probe: bool, traced: bool, from_files=(),
         model_preset=None, emit_toml=False, rank_gpus: str | None = None, command=()) -> None:
    """Predict per-GPU training memory term by term and check a job before it runs.

    Reads the job config, predicts params, grads, optimizer states, activations, the loss
    spike and overhead at the step's peak, says whether it fits and which changes make it
    fit, and checks precision, kernels, sharding, the allocator env and this machine.

    With `bin/preflight [OPTIONS] -- COMMAND...` it predicts the job your own launch command
    runs, read from its launcher and trainer arguments and the config files they name
    (torchrun, accelerate launch, deepspeed; Hugging Face-style scripts, tune run, litgpt,
    axolotl, torchtitan), over --config and beside --from if given. The command is not run.

    Exit codes: 0 every check passed (warnings allowed), 1 a check failed, 2 bad input;
    with --rank-gpus, 0 when some offered GPU type fits the job and is for rent, 1 when none does.
    """
    imported = None
    try:
        _refuse_flag_clashes(config, gpu, as_json, traced, emit_toml, rank_gpus)
        if command or "--" in sys.argv[1:]:
            _check_command(command)
        if from_files or model_preset or emit_toml or command:
            imported = import_job(config, from_files, model_preset, emit_toml, quiet=as_json, command=command)
            if emit_toml:
                click.echo(imported.toml, nl=False)
                sys.exit(0)
        if rank_gpus is not None:
            sys.exit(run_ranking(config, rank_gpus, as_json, imported.job if imported else None))
        result = run_preflight(config, gpu, probe=not no_probe, job=imported.job if imported else None)
    except ConfigError as exc:
        _bad_input(exc, as_json)
    trace = replica_est = None
    if traced:
        # The trace runs the smoke step, podkit's replica of the job's stack: it is set beside the
        # analytic estimate of that replica, and what the replica leaves out is said with it.
        from podkit.checks import memory, stacks

        try:
            replica = result.job.as_replica()
            trace = run_traced(replica)
        except ConfigError as exc:
            _bad_input(exc, as_json)
        trace["replica_leaves_out"] = stacks.left_out(result.job.train, result.job.cluster, result.job.facts)
        replica_est = memory.estimate(replica)
    if as_json:
        data = result.to_json()
        if imported is not None:
            data["imported"] = imported.to_json()
        if trace is not None:
            from podkit.checks.traced_report import comparison

            data["traced"] = {**trace, "comparison": comparison(replica_est, trace)}
        click.echo(strict_json.dumps(data, indent=2))
    else:
        from rich.console import Console

        console = Console()
        result.render(console)
        if trace is not None:
            from podkit.checks.traced_report import render

            render(console, replica_est, trace)
    sys.exit(0 if result.ok else EXIT_FAILED)


def _refuse_flag_clashes(config: str, gpu, as_json: bool, traced: bool, emit_toml: bool, rank_gpus) -> None:
    """Flags that cannot both be honoured: refused, rather than one of them dropped without a word."""
    if emit_toml and as_json:
        raise ConfigError("--emit-toml", "prints TOML, so it cannot go with --json",
                          "drop --json, or drop --emit-toml for the JSON prediction")
    if emit_toml:
        for flag, given in (("--traced", traced), ("--gpu", gpu is not None), ("--rank-gpus", rank_gpus is not None)):
            if given:
                raise ConfigError("--emit-toml", f"prints the job and exits, so {flag} would do nothing",
                                  f"drop {flag}, or drop --emit-toml")
    if rank_gpus is not None:
        for flag, given in (("--gpu", gpu is not None), ("--traced", traced)):
            if given:
                raise ConfigError("--rank-gpus", f"predicts the job on each offered GPU type, so {flag} has no place "
                                  "beside it", f"drop {flag}, or drop --rank-gpus")
        if rank_gpus == "-" and config == "-":
            raise ConfigError("--rank-gpus", "and --config cannot both read stdin", "give one of them as a file")


def _check_command(command) -> None:
    """A command only after `--` (a stray word before it is a mistake, not a program to read)."""
    if "--" not in sys.argv[1:]:
        raise ConfigError("COMMAND", f"unexpected argument {command[0]!r}", "put your launch command after --")
    if not command:
        raise ConfigError("--", "no command after --",
                          "e.g. bin/preflight -- torchrun --nproc_per_node 8 train.py --deepspeed ds.json")


def import_job(config: str, from_files, model_preset, emit_toml: bool, quiet: bool, command=()):
    """--from / -- COMMAND / --model / --emit-toml: the job read from the user's own configs and launch command;
    says what it mapped."""
    from podkit.checks.importers import build_job
    from podkit.checks.importers.command import shown_argv

    if not from_files and not command:
        raise ConfigError("--from", "--model and --emit-toml go with --from FILE or -- COMMAND",
                          "add --from your config file, or your launch command after --")
    explicit = click.get_current_context().get_parameter_source("config").name != "DEFAULT"
    imported = build_job(config if explicit else None, list(from_files), model_preset, command=command)
    if command and not quiet:
        click.echo(f"preflight: reading the job from the command: {shlex.join(shown_argv(command))} (not run)", err=True)
    if not quiet:
        for f in imported.files:
            click.echo(f"preflight: from {f.path} ({f.kind}):", err=True)
            for line in f.mapped:
                click.echo(f"  mapped  {line}", err=True)
            if f.ignored:
                click.echo(f"  warning: ignored (not modelled): {', '.join(f.ignored)}", err=True)
            for w in f.warnings:
                click.echo(f"  warning: {w}", err=True)
        for u in imported.unresolved:
            click.echo(f"preflight: warning: {u}", err=True)
    return imported


def run_ranking(config: str, prices: str, as_json: bool, job=None) -> int:
    """--rank-gpus: 0 when some offered type fits the job, 1 when none does, 2 on bad input."""
    from podkit.checks.ranking import load_offers, rank

    try:
        ranked = rank(job or load_job(config), load_offers(prices))
    except ConfigError as exc:
        _bad_input(exc, as_json)
    if as_json:
        click.echo(strict_json.dumps([r.to_json() for r in ranked], indent=2))
    else:
        i = 0
        for r in ranked:
            if r.catalog is None:
                click.echo(f"   {r.offer.id:32} skipped: {r.note}")
                continue
            price = f"${r.job_price_per_hour:.2f}/h for {r.world_size} GPU(s)" if r.job_price_per_hour is not None else r.note
            verdict = "fits" if r.fits else "does not fit"
            i += 1
            free = 1 - r.total_bytes / max(1, r.capacity_bytes)
            click.echo(f"{i:2} {r.offer.id:32} {verdict:12} {r.total_bytes / 2**30:6.1f} of {r.capacity_bytes / 2**30:5.1f} GiB "
                       f"({free:4.0%} free)  {price}")
    return 0 if any(r.fits and r.job_price_per_hour is not None for r in ranked) else EXIT_FAILED


def _bad_input(exc: ConfigError, as_json: bool) -> None:
    """One line on stderr; with --json also the error as a JSON object on stdout, for scripts."""
    if as_json:
        click.echo(strict_json.dumps(exc.to_json(), indent=2))
    click.echo(f"preflight: {exc}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def run_traced(job) -> dict:
    """train.traced's estimate as JSON; torch is imported here only, when --traced asks for it."""
    try:
        from podkit.train.traced import trace
    except ImportError as exc:
        raise ConfigError("--traced", f"needs torch, which cannot be imported here ({exc})",
                          "install torch (make setup), or drop --traced for the analytic estimate") from None
    return trace(job).to_json()


if __name__ == "__main__":
    main(prog_name="bin/preflight")
