"""`bin/preflight -- CMD...` and `bin/smoke -- CMD...`: the job read from the command the user will run.

The command is peeled launcher by launcher, each read as its own argument parser reads it: `env`,
`python [-m MODULE]`, torchrun / `python -m torch.distributed.run` (torch distributed/run.py
get_args_parser, torch 2.13), `accelerate launch` (accelerate 1.15 commands/launch.py) and the `deepspeed`
launcher (DeepSpeed 0.19.6 launcher/runner.py). What is left is the trainer: `tune run`, `litgpt`,
`axolotl`, torchtitan's `-m torchtitan.train`, or a script with Hugging Face-style arguments. A trainer's
config file is loaded, the command's overrides are applied onto it as that library applies them, and the
result is read by that file's importer (checks/importers/*), so a command and a file say the same thing
alike; what the launcher says (processes per node, nodes, an accelerate config) is one more Imported
beside it. Launcher options podkit does not model and the script's own flags are listed as ignored, by
name: a value is shown only where it is mapped, never for a key named like a secret (shown_argv).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

from podkit.checks.errors import ConfigError
from podkit.checks.importers import accelerate, axolotl, hf, litgpt, torchtitan, torchtune
from podkit.checks.importers.imported import Imported

COMMAND = Path("the command")
"""Imported.path of what the command itself says: its messages read "the command: ...", and relative paths in
it (a --deepspeed JSON, a local model directory) are the working directory's, where the command runs."""
FILES_FIX = "give your config files with --from, or --config JOB.toml"


class Unreadable(ConfigError):
    """The command names no job podkit can read (an unknown program, a script without one argument podkit
    knows): bin/preflight says so (exit 2); bin/smoke runs it anyway, without a prediction."""

    def __init__(self, problem: str, fix: str = FILES_FIX):
        super().__init__("--", problem, fix)


# --- values -------------------------------------------------------------------------------------------------

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def scalar(text: str) -> Any:
    """A command-line word as the libraries type it: a YAML scalar (OmegaConf's from_dotlist, jsonargparse and
    axolotl's cli/config.py _coerce_value parse values as YAML; HfArgumentParser's int/float/bool fields and
    hf_argparser.py string_to_bool agree on these), with 1e-5 a float as Python reads it (PyYAML wants a dot)."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~"):
        return None
    if _INT.fullmatch(text.strip()):
        return int(text)
    if _FLOAT.fullmatch(text.strip()):
        return float(text)
    if text.strip()[:1] in "[{":  # a list or mapping written inline (lora_attn_modules=['q_proj','v_proj'])
        try:
            import yaml

            return yaml.safe_load(text)
        except Exception:
            return text
    return text


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _secret(name: str) -> bool:
    from podkit.envsetup.secrets import is_secret_name  # torch-free

    return is_secret_name(re.sub(r"[-.]", "_", name.lstrip("-~")))


def shown(name: str, value: Any) -> str:
    """`name=value` for the account of what the command said, the value hidden where the name says secret."""
    from podkit.envsetup.secrets import looks_like_token

    hide = (_secret(name.split(".")[-1]) and not isinstance(value, bool)) or looks_like_token(str(value))
    return f"{name}=[redacted]" if hide else f"{name}={value}"


def shown_argv(argv: Sequence[str]) -> list[str]:
    """The command with the environment's secret values and the value of every option named like a secret
    (`--hub_token X`, `--api-key=X`, `metric_logger.api_key=X`) replaced: what podkit may print of it."""
    from podkit.envsetup.secrets import SecretFilter

    return SecretFilter().argv(argv)


# --- launchers ----------------------------------------------------------------------------------------------

class Launcher:
    """One launcher's options, as its argparse parser reads them: `flags` take no value, every other option
    takes one (`--x v` or `--x=v`; dashes and underscores alike); the first word that is no option is the
    program it starts, and everything after it is that program's."""

    def __init__(self, tool: str, flags: set[str], aliases: dict[str, str] | None = None, clusters: bool = False):
        self.tool, self.flags, self.aliases = tool, flags, aliases or {}
        self.clusters = clusters
        """Short options as clap reads them: `-qm` two flags, `-p3.12` an option and its value."""

    def parse(self, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
        opts: dict[str, Any] = {}
        i = 0
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
            if argv[i] == "--":
                i += 1
                break
            word = argv[i]
            if self.clusters and not word.startswith("--") and len(word) > 2:
                i = self._cluster(argv, i, opts)
                continue
            name, eq, value = word.lstrip("-").partition("=")
            name = self.aliases.get(name, name).replace("-", "_")
            if name in self.flags:
                opts[name] = True
                i += 1
            elif eq:
                opts[name] = value
                i += 1
            elif i + 1 < len(argv):
                opts[name] = argv[i + 1]
                i += 2
            else:
                raise ConfigError("--", f"{self.tool} option {word} has no value", "give it one, as that launcher needs")
        return opts, argv[i:]

    def _cluster(self, argv: list[str], i: int, opts: dict[str, Any]) -> int:
        """`-abc`: flags until one that takes a value, which takes the rest of the word, else the next word."""
        word = argv[i]
        for k, letter in enumerate(word[1:], start=2):
            name = self.aliases.get(letter, letter).replace("-", "_")
            if name in self.flags:
                opts[name] = True
                continue
            rest = word[k:].removeprefix("=")
            if rest:
                opts[name] = rest
                return i + 1
            if i + 1 >= len(argv):
                raise ConfigError("--", f"{self.tool} option -{letter} (in {word}) has no value",
                                  "give it one, as that launcher needs")
            opts[name] = argv[i + 1]
            return i + 2
        return i + 1


# torch 2.13 distributed/run.py get_args_parser: its options without a value (python -m torch.distributed.launch,
# the deprecated spelling, adds --use-env).
TORCHRUN = Launcher("torchrun", {"standalone", "module", "no_python", "run_path", "virtual_local_rank", "use_env"},
                    {"m": "module"})
# accelerate 1.15 commands/launch.py launch_command_parser: its store_true options.
ACCELERATE = Launcher("accelerate launch", {
    "quiet", "cpu", "multi_gpu", "tpu", "enable_cpu_affinity", "dynamo_use_fullgraph", "dynamo_use_dynamic",
    "dynamo_use_regional_compilation", "use_deepspeed", "use_fsdp", "use_parallelism_config", "use_megatron_lm",
    "same_network", "module", "no_python", "tpu_cluster", "no_tpu_cluster", "tpu_use_sudo", "downcast_bf16",
    "fp8_use_autocast_during_eval", "debug"}, {"m": "module", "q": "quiet", "t": "tee"})
# DeepSpeed 0.19.6 launcher/runner.py parse_args: its store_true options.
DEEPSPEED = Launcher("deepspeed", {"module", "no_python", "no_local_rank", "no_ssh", "no_ssh_check", "force_multi",
                                   "save_pid", "elastic_training", "bind_cores_to_rank", "quiet"},
                     {"H": "hostfile", "i": "include", "e": "exclude", "q": "quiet", "num_accelerators": "num_gpus"})
# uv 0.12.5 crates/uv-cli/src/lib.rs RunArgs with the structs it flattens (dependency groups, resolver/installer,
# build, refresh), GlobalArgs and TopLevelArgs, and crates/uv-cache/src/cli.rs CacheArgs: every option whose
# field is a bool (clap's SetTrue) takes no value; every other option takes one (--with X, --python 3.12, ...).
UV_RUN = Launcher("uv run", {
    "active", "all_extras", "all_groups", "all_packages", "binary", "build", "build_isolation", "compile",
    "compile_bytecode", "dev", "editable", "exact", "force_reinstall", "frozen", "gui_script", "inexact", "isolated",
    "locked", "module", "no_active", "no_all_extras", "no_binary", "no_build", "no_build_isolation", "no_compile",
    "no_compile_bytecode", "no_default_groups", "no_dev", "no_editable", "no_env_file", "no_exact", "no_index",
    "no_project", "no_workspace", "no_refresh", "no_reinstall", "no_sources", "no_sync", "no_upgrade", "only_dev",
    "pre", "refresh", "reinstall", "script", "show_resolution", "upgrade", "allow_python_downloads",
    "managed_python", "native_tls", "no_color", "no_config", "no_installer_metadata", "no_managed_python",
    "no_native_tls", "no_offline", "no_preview", "no_progress", "no_python_downloads", "no_system_certs", "offline",
    "preview", "quiet", "show_settings", "system_certs", "verbose", "no_cache", "no_cache_dir"},
    {"m": "module", "s": "script", "q": "quiet", "v": "verbose", "n": "no_cache", "U": "upgrade", "w": "with",
     "p": "python", "C": "config_setting", "P": "upgrade_package", "f": "find_links", "i": "index_url"},
    clusters=True)
# CPython's own options that take a value (python -h): -m and -c end the interpreter's options.
PYTHON_VALUE_OPTIONS = ("-X", "-W", "--check-hash-based-pycs")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


def _count(key: str, value: Any, what: str) -> int:
    if isinstance(value, str) and _INT.fullmatch(value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"the command: {key}", f"must be a positive number of {what}, got {value!r}")
    return value


def _torchrun_facts(launch: Imported, opts: dict[str, Any], tool: str = "torchrun") -> None:
    """torchrun's --nproc_per_node (a count, or gpu/auto: every device there, distributed/run.py
    determine_local_world_size) and --nnodes (N, or MIN:MAX for an elastic job)."""
    nproc = opts.pop("nproc_per_node", None)
    if nproc is not None:
        if str(nproc).strip() in ("gpu", "auto", "cuda"):
            launch.unresolved["cluster.gpus_per_node"] = f"{tool} --nproc_per_node {nproc}: every GPU of the machine"
        else:
            launch.set("--nproc_per_node", nproc, "cluster", "gpus_per_node", _count("--nproc_per_node", nproc, "processes"))
    nnodes = opts.pop("nnodes", None)
    if nnodes is not None:
        low, _, high = str(nnodes).partition(":")
        if high and low != high:
            launch.unresolved["cluster.nodes"] = f"{tool} --nnodes {nnodes}: an elastic range of nodes"
        else:
            launch.set("--nnodes", nnodes, "cluster", "nodes", _count("--nnodes", low, "nodes"))
    for name in opts:
        launch.ignore(f"{tool} --{name}", "launcher detail, no memory")


def _deepspeed_facts(launch: Imported, opts: dict[str, Any]) -> None:
    """The DeepSpeed launcher's --num_gpus / --num_nodes (-1, the default: every GPU / host in the hostfile,
    runner.py main), or --include host:slots naming the GPUs of one host."""
    for key, job_key, what in (("num_gpus", "gpus_per_node", "GPUs"), ("num_nodes", "nodes", "nodes")):
        value = opts.pop(key, None)
        if value is not None and str(value).strip() != "-1":
            launch.set(f"--{key}", value, "cluster", job_key, _count(f"--{key}", value, what))
    include = opts.pop("include", None)
    if include:
        hosts = str(include).split("@")
        slots = hosts[0].partition(":")[2]
        if len(hosts) == 1 and slots and "gpus_per_node" not in launch.sections["cluster"]:
            launch.set("--include", include, "cluster", "gpus_per_node", len(slots.split(",")))
        else:
            launch.ignore(f"deepspeed --include {include}", "several hosts or every slot: give --num_gpus")
    if "gpus_per_node" not in launch.sections["cluster"] and "gpus_per_node" not in launch.unresolved:
        launch.unresolved["cluster.gpus_per_node"] = "the deepspeed launcher without --num_gpus: every GPU of the machine"
    for name in opts:
        launch.ignore(f"deepspeed --{name}", "launcher detail, no memory")


# accelerate launch options -> the config YAML key each overrides (commands/launch.py _validate_launch_command:
# a config value is taken only where the option was not given; fsdp_config.x is args.fsdp_x).
ACCELERATE_TOP = ("num_processes", "num_machines", "mixed_precision")
ACCELERATE_DEEPSPEED = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                        "gradient_accumulation_steps")
ACCELERATE_PARADIGMS = {"use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED", "multi_gpu": "MULTI_GPU"}


def accelerate_default_config() -> Path:
    """Where `accelerate config` saves and `accelerate launch` looks without --config_file (accelerate 1.15
    commands/config/config_args.py: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface)."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(home).expanduser() / "accelerate" / "default_config.yaml"


def _accelerate(opts: dict[str, Any]) -> list[Imported]:
    """accelerate launch: its --config_file, else the default config where one exists here (launch.py
    _validate_launch_command reads it unless --cpu), with the options given on the command line over it, read by
    the accelerate importer."""
    from podkit.checks.importers import import_data

    config = opts.pop("config_file", None)
    default = accelerate_default_config()
    from_default = not config and not opts.get("cpu") and default.is_file()
    path = Path(config).expanduser() if config else default if from_default else COMMAND
    what = "accelerate launch --config_file" if config else f"accelerate's default config {path}"
    data = config_data(path, what) if path is not COMMAND else {}
    given = []
    for flag, dist in ACCELERATE_PARADIGMS.items():
        if opts.pop(flag, False):
            data["distributed_type"] = dist
            given.append(f"--{flag}")
    for key in ACCELERATE_TOP:
        if key in opts:
            data[key] = scalar(str(opts.pop(key)))
            given.append(f"--{key}")
    for key in [k for k in opts if k.startswith("fsdp_")]:
        data.setdefault("fsdp_config", {})[key] = scalar(str(opts.pop(key)))
        given.append(f"--{key}")
    for key in ACCELERATE_DEEPSPEED:
        if key in opts:
            data.setdefault("deepspeed_config", {})[key] = scalar(str(opts.pop(key)))
            given.append(f"--{key}")
    if opts.pop("cpu", False):
        data["distributed_type"] = "NO"
        given.append("--cpu")
    if not data:
        launch = Imported(COMMAND, "accelerate launch")
        launch.unresolved["cluster.gpus_per_node"] = (
            f"accelerate launch without --config_file, --num_processes or a default config ({default}): one process "
            "per GPU of the machine it runs on")
        imps = [launch]
    else:
        imps = import_data(path, data, accelerate.read)
        if given:
            over = f" over {path.name})" if path is not COMMAND else ")"
            imps[0].mapped.insert(0, f"(accelerate launch {' '.join(given)}" + over)
        if from_default:
            imps[0].warnings.append(f"accelerate launch has no --config_file: read the default config {path}, as "
                                    "accelerate does; the machine the job runs on may have another")
    for name in opts:
        imps[0].ignore(f"accelerate launch --{name}", "launcher detail, no memory")
    return imps


# --- programs -------------------------------------------------------------------------------------------------

class Launch(Imported):
    """The launcher's facts, and whether other sources (--config, --from) give the job: then a script whose
    arguments podkit cannot read adds only the launcher's facts (`torchrun --nproc_per_node 4 train.py` beside
    --from training_args.json)."""

    with_files: bool = False


def read_command(argv: Sequence[str], with_files: bool = False) -> list[Imported]:
    """What `argv` (as click gives it after `--`) says about the job: the trainer's config with the command's
    overrides, then the launcher's facts. Unreadable where it is no job podkit knows."""
    words = list(argv)
    if not words:
        raise ConfigError("--", "no command after --", "e.g. -- torchrun --nproc_per_node 8 train.py --deepspeed ds.json")
    launch = Launch(COMMAND, "launch command")
    launch.with_files = with_files
    imps = _program(words, launch)
    if launch.sections["cluster"] or launch.ignored or launch.unresolved or launch.mapped:
        imps.append(launch)
    return imps


def _program(words: list[str], launch: Imported) -> list[Imported]:
    while words and (words[0] == "env" or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
        words = words[1:]  # `env X=1 ...`: the environment, not the job
    if not words:
        raise Unreadable("the command is only environment settings")
    exe = Path(words[0]).name
    rest = words[1:]
    if PYTHON.fullmatch(exe):
        return _python(rest, launch)
    if exe == "torchrun":
        return _torchrun(rest, launch)
    if exe == "accelerate" and rest[:1] == ["launch"] or exe == "accelerate-launch":
        return _accelerate_launch(rest[1:] if exe == "accelerate" else rest, launch)
    if exe == "deepspeed":
        opts, program = DEEPSPEED.parse(rest)
        module = opts.pop("module", False)
        opts.pop("no_python", None)
        _deepspeed_facts(launch, opts)
        return _target(program, launch, module)
    if exe == "uv":
        return _uv(rest, launch)
    if exe == "tune":
        return _tune(rest, launch)
    if exe == "litgpt":
        return _litgpt(rest)
    if exe == "axolotl":
        return _axolotl_cli(rest, launch)
    if exe == "trl" and rest[:1] == ["sft"]:  # trl/cli.py: `trl sft` runs trl/scripts/sft.py's main
        return _script("trl sft", rest[1:], launch, sft=True)
    if exe.endswith(".py"):
        return _script(words[0], rest, launch)
    raise Unreadable(f"{exe} is no launcher or trainer podkit reads (it reads python, uv run, torchrun, accelerate "
                     "launch, deepspeed, tune run, litgpt, axolotl and Hugging Face-style scripts)")


def _python(args: list[str], launch: Imported) -> list[Imported]:
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c", "-"):
        i += 2 if args[i] in PYTHON_VALUE_OPTIONS else 1
    if i >= len(args):
        raise Unreadable("python runs no script here")
    if args[i] == "-c" or args[i] == "-":
        raise Unreadable("python -c / stdin: podkit reads a script file or a module, not inline code")
    if args[i] == "-m":
        if i + 1 >= len(args):
            raise Unreadable("python -m names no module")
        return _target(args[i + 1:], launch, module=True)
    return _target(args[i:], launch, module=False)


def _torchrun(args: list[str], launch: Imported, tool: str = "torchrun") -> list[Imported]:
    opts, program = TORCHRUN.parse(args)
    module = opts.pop("module", False)
    opts.pop("no_python", None)
    _torchrun_facts(launch, opts, tool)
    return _target(program, launch, module)


def _accelerate_launch(args: list[str], launch: Imported) -> list[Imported]:
    opts, program = ACCELERATE.parse(args)
    module = opts.pop("module", False)
    opts.pop("no_python", None)
    return _accelerate(opts) + _target(program, launch, module)


def _uv(args: list[str], launch: Imported) -> list[Imported]:
    """`uv [GLOBAL OPTIONS] run [OPTIONS] CMD`: the project environment, then CMD; `uv run x.py` (or `--script
    x`) is `python x.py`, `-m M` is `python -m M` (uv's run.rs). uv's options say nothing about memory and are
    listed as ignored."""
    opts, rest = UV_RUN.parse(args)  # the global options before the subcommand (GlobalArgs are in UV_RUN)
    if rest[:1] != ["run"]:
        raise Unreadable(f"uv {rest[0] if rest else ''}".strip() + " is no launcher podkit reads (of uv, it reads "
                         "`uv run COMMAND`)")
    run_opts, program = UV_RUN.parse(rest[1:])
    opts.update(run_opts)
    if "directory" in opts:
        raise Unreadable(f"uv --directory {opts['directory']} runs the command from another directory",
                         "run bin/preflight from that directory, without --directory")
    module = opts.pop("module", False)
    script = any([opts.pop("script", False), opts.pop("gui_script", False)])
    for name in opts:
        launch.ignore(f"uv run --{name}", "environment, no memory")
    if not program:
        raise Unreadable("uv run starts no command")
    if module or script or program[0].endswith(".py"):
        return _target(program, launch, module)
    return _program(program, launch)


# python -m MODULE: the launchers and trainers that run as modules.
MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
           "accelerate.commands.launch": "accelerate", "torchtitan.train": "torchtitan", "litgpt": "litgpt",
           "litgpt.__main__": "litgpt", "axolotl.cli.train": "axolotl", "axolotl.cli.preprocess": "axolotl"}
# litgpt's scripts run directly (python litgpt/finetune/lora.py --config ...: each ends in CLI(setup)).
LITGPT_SCRIPTS = {"finetune/lora.py": "lora", "finetune/full.py": "full", "pretrain.py": "pretrain"}


def _target(program: list[str], launch: Imported, module: bool) -> list[Imported]:
    """What a launcher starts: a module (-m) or a script, and its arguments."""
    if not program:
        raise Unreadable("the launcher starts no program")
    name, args = program[0], program[1:]
    if not module:
        posix = Path(name).as_posix()
        if posix.endswith("torchtitan/train.py"):
            return _torchtitan(args)
        for tail, kind in LITGPT_SCRIPTS.items():
            if posix.endswith("litgpt/" + tail):
                return _litgpt_script(kind, args)
        if not name.endswith(".py") and Path(name).name in ("tune", "litgpt", "axolotl"):
            return _program(program, launch)  # torchrun --no-python litgpt ...: a console script
        return _script(name, args, launch)
    kind = MODULES.get(name)
    if kind == "torchrun":
        return _torchrun(args, launch, "python -m " + name)
    if kind == "accelerate":
        return _accelerate_launch(args, launch)
    if kind == "torchtitan":
        return _torchtitan(args)
    if kind == "litgpt":
        return _litgpt(args)
    if kind == "axolotl":
        return _axolotl(args)
    return _script(f"-m {name}", args, launch)


# --- Hugging Face-style scripts ---------------------------------------------------------------------------------

TRL_SFT = ("-m trl.scripts.sft", "trl sft")

# Arguments that make a script one podkit reads as HfArgumentParser(TrainingArguments / TRL's SFTConfig and
# ModelConfig): any one of them (hf.TRAINER_MARKS and the keys read_trainer maps).
HF_KEYS = (*hf.TRAINER_MARKS, "model_name_or_path", "deepspeed", "bf16", "fp16", "fsdp", "max_length", "use_peft",
           "lora_r", "load_in_4bit", "load_in_8bit", "torch_dtype", "dtype", "attn_implementation",
           "use_liger_kernel")


def hf_arguments(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """HfArgumentParser's reading of a script's arguments (transformers 5.23 hf_argparser.py
    _parse_dataclass_field): `--key value` or `--key=value`, `--key-name` for `--key_name`; a bool field given
    bare is True (nargs="?", const=True); `--no_key` is False (the complement it adds to a bool field that
    defaults to True, e.g. TRL SFTConfig.gradient_checkpointing); a list field takes every value up to the next
    option (nargs="+"). Returns the values by field name and the words that belong to no option."""
    values: dict[str, Any] = {}
    loose: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if not (word.startswith("--") and len(word) > 2):
            loose.append(word)
            i += 1
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("-", "_")
        if eq:
            given, i = [value], i + 1
        else:
            j = i + 1
            while j < len(args) and not _is_option(args[j]):
                j += 1
            given, i = args[i + 1:j], j
        if not given:
            if name.startswith("no_"):
                values[name[3:]] = False
            else:
                values[name] = True
        else:
            values[name] = scalar(given[0]) if len(given) == 1 else [scalar(g) for g in given]
    return values, loose


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _FLOAT.fullmatch(word)


def _script(name: str, args: list[str], launch: Launch, sft: bool = False) -> list[Imported]:
    """A training script: HfArgumentParser-style arguments read as TrainingArguments (trainer importer). A
    single .json/.yaml argument is the file the transformers examples give parse_json_file / parse_yaml_file
    (`if len(sys.argv) == 2 and sys.argv[1].endswith(".json")`); `--config FILE` is TRL's TrlParser
    (trl/scripts/utils.py parse_args_and_config: the YAML's values are defaults the arguments override);
    DeepSpeed's own `--deepspeed --deepspeed_config ds.json` (deepspeed/__init__.py add_config_arguments)
    names the DeepSpeed JSON."""
    from podkit.checks.importers import deepspeed, import_data

    if len(args) == 1 and args[0].endswith((".json", ".yaml", ".yml")):
        path = Path(args[0]).expanduser()
        return import_data(path, config_data(path, Path(name).name), hf.read_trainer)
    values, loose = hf_arguments(args)
    out: list[Imported] = []
    ds_config = values.pop("deepspeed_config", None)
    if isinstance(ds_config, str):
        if values.get("deepspeed") is True:  # the bare flag of add_config_arguments, not TrainingArguments'
            values.pop("deepspeed")
        ds_path = Path(ds_config).expanduser()
        out += import_data(ds_path, config_data(ds_path, "--deepspeed_config"), deepspeed.read)
    base, config = {}, values.pop("config", None)
    if isinstance(config, str) and config.endswith((".yaml", ".yml", ".json")):
        base = config_data(Path(config).expanduser(), "--config")
    shown_name = Path(name).name if not name.startswith("-m ") else name
    if not base and not any(k in values for k in HF_KEYS):
        if out:
            return out
        if launch.with_files:
            launch.ignore(f"{shown_name}'s arguments", "none is one podkit reads: the job is --config's and --from's")
            return []
        raise Unreadable(f"{shown_name}: none of its arguments is one podkit reads (TrainingArguments / TRL keys such "
                         "as --per_device_train_batch_size, --model_name_or_path)")
    data = {**{k: v for k, v in base.items() if k != "env"}, **values}
    # TRL's SFT entry point parses SFTConfig (trl/scripts/sft.py: TrlParser((ScriptArguments, SFTConfig, ModelConfig))).
    sft = sft or name in TRL_SFT or Path(name).as_posix().endswith("trl/scripts/sft.py")
    imps = import_data(COMMAND, data, lambda path, d: hf.read_trainer(path, d, sft=sft))
    trainer = imps[0]
    trainer.kind = f"TrainingArguments (from {shown_name}'s arguments)"
    if base:
        trainer.mapped.insert(0, f"--config {config} (TrlParser: its values are the defaults the command's "
                                 "arguments override)")
        if "env" in base:
            trainer.ignore(f"{Path(config).name}: env", "environment variables TrlParser sets")
    for word in loose:
        trainer.ignore(f"argument {shown_argv([word])[0]!r}", "the script's own")
    return out + imps


# --- tune run ---------------------------------------------------------------------------------------------

# torchtune's recipes that train one model (torchtune/_recipe_registry.py); the others add a teacher, a
# reference or a policy model podkit does not price, or do not train.
TUNE_TRAINING = re.compile(r"(lora|full)_finetune_(single_device|distributed)|qat_(lora_finetune_)?distributed"
                           r"|qat_single_device")
TUNE_NOT_TRAINING = ("generate", "eleuther_eval", "quantize", "dev/generate_v2", "dev/generate_v2_distributed")


def _tune(args: list[str], launch: Imported) -> list[Imported]:
    """`tune run [TORCHRUN-OPTIONS] RECIPE --config FILE [key=value | ~key ...]` (torchtune _cli/run.py: a
    recipe run under torchrun when any torchrun option is given, else in this process)."""
    if args[:1] != ["run"]:
        raise Unreadable(f"tune {args[0] if args else ''}".strip() + " trains nothing (podkit reads `tune run`)")
    opts, program = TORCHRUN.parse(args[1:])
    if not program:
        raise ConfigError("--", "tune run names no recipe", "e.g. tune run lora_finetune_single_device --config my.yaml")
    recipe, recipe_args = program[0], program[1:]
    if recipe in TUNE_NOT_TRAINING:
        raise Unreadable(f"tune run {recipe} trains nothing")
    distributed = bool(opts)
    _torchrun_facts(launch, opts, "tune run")
    if not distributed:
        launch.set(f"tune run {recipe} (no torchrun option: one process)", 1, "cluster", "gpus_per_node", 1)
    config, overrides = _tune_config(recipe_args)
    path = _tune_config_path(config)
    from podkit.checks.importers import import_data

    data = config_data(path, "tune run --config")
    shown_overrides = _apply_tune_overrides(path, data, overrides)
    imps = import_data(path, data, torchtune.read)
    recipe_imp = imps[0]
    if shown_overrides:
        recipe_imp.mapped.insert(0, f"(tune run {recipe}: {' '.join(shown_overrides)} over {path.name})")
    name = Path(recipe).name
    if name.endswith("_distributed") and "sharding" not in recipe_imp.sections["cluster"]:
        # The distributed recipes shard with FSDP2 (training/_distributed.py shard_model), resharding after
        # forward unless fsdp_reshard_after_forward says not (recipe default True).
        reshard = data.get("fsdp_reshard_after_forward", True)
        recipe_imp.set(f"tune run {name}: fsdp_reshard_after_forward", reshard, "cluster", "sharding",
                       "zero3" if reshard in (True, None, "true", "True") else "zero2")
    if not TUNE_TRAINING.fullmatch(name.removesuffix(".py")):
        recipe_imp.warnings.append(f"recipe {recipe}: priced as the fine-tune of the config's model; a teacher, "
                                   "reference or policy model it adds is not in the prediction")
    return imps


def _tune_config(recipe_args: list[str]) -> tuple[str, list[str]]:
    config, overrides = None, []
    i = 0
    while i < len(recipe_args):
        word = recipe_args[i]
        if word == "--config" and i + 1 < len(recipe_args):
            config, i = recipe_args[i + 1], i + 2
            continue
        if word.startswith("--config="):
            config = word.split("=", 1)[1]
        elif word.startswith("--"):
            # config/_parse.py TuneRecipeArgumentParser: "Additional flag arguments not supported".
            raise ConfigError("--", f"tune run takes no {word.split('=')[0]} after the recipe", "use key=value overrides")
        else:
            overrides.append(word)
        i += 1
    if not config:
        raise ConfigError("--", "tune run needs --config (torchtune: \"The '--config' argument is required.\")",
                          "give --config my_config.yaml")
    return config, overrides


def _tune_config_path(config: str) -> Path:
    path = Path(config).expanduser()
    if path.is_file():
        return path
    if not path.suffix and re.fullmatch(r"[\w.-]+(/[\w.-]+)*", config):
        # _cli/run.py _get_config: a name such as llama3_1/8B_lora is a config inside the torchtune package.
        raise ConfigError("--", f"tune run --config {config} names one of torchtune's built-in configs, which is "
                                "not a file here", f"copy it with `tune cp {config} my_config.yaml` and give the copy")
    raise ConfigError("--", f"tune run --config {config} does not exist", "give the path to your recipe config")


def _apply_tune_overrides(path: Path, data: dict, overrides: list[str]) -> list[str]:
    """torchtune config/_utils.py _merge_yaml_and_cli_args: `~a.b` removes a key; `a.b=v` sets it (an OmegaConf
    dotlist value); `model=torchtune.models.x` on a section with a _component_ sets that component; "None" is
    null. Returns the overrides as they may be shown."""
    out = []
    for word in overrides:
        if word.startswith("~"):
            parts = word[1:].split("=")[0].split(".")
            node = data
            for part in parts[:-1]:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or parts[-1] not in node:
                raise ConfigError("--", f"tune run {word}: no key {word[1:]} in {path.name} to remove")
            del node[parts[-1]]
            out.append(word)
            continue
        if word.count("=") != 1:
            raise ConfigError("--", f"tune run override {word.split('=')[0]!r} is not key=value",
                              "write overrides as key=value (one '=')")
        key, value = word.split("=")
        if key in data and isinstance(data[key], dict) and "_component_" in data[key]:
            key += "._component_"
        parsed = None if value == "None" else scalar(value)
        _set_dotted(data, key, parsed)
        out.append(shown(key, value))
    return out


# --- litgpt -----------------------------------------------------------------------------------------------------

# litgpt 0.5.13 __main__.py PARSER_DATA: the training subcommands -> the setup() they run; `finetune` is
# finetune_lora. Before 0.4 (the "New CLI", 3fa17fb7) they were `litgpt finetune lora|full|adapter`.
LITGPT_COMMANDS = {"finetune": "lora", "finetune_lora": "lora", "finetune_full": "full", "pretrain": "pretrain",
                   "finetune_adapter": "adapter", "finetune_adapter_v2": "adapter"}
LITGPT_OLD = {"lora": "lora", "full": "full", "adapter": "adapter", "adapter_v2": "adapter"}


def _litgpt(args: list[str]) -> list[Imported]:
    sub = args[0] if args else ""
    if sub not in LITGPT_COMMANDS:
        raise Unreadable(f"litgpt {sub}".strip() + " trains nothing (podkit reads finetune, finetune_lora, finetune_full "
                         "and pretrain)")
    kind, rest = LITGPT_COMMANDS[sub], args[1:]
    if sub == "finetune" and rest[:1] and rest[0] in LITGPT_OLD:
        kind, rest = LITGPT_OLD[rest[0]], rest[1:]
    return _litgpt_script(kind, rest)


def _litgpt_script(kind: str, args: list[str]) -> list[Imported]:
    """jsonargparse's reading of setup()'s arguments: `--config FILE` merged where it stands, `--a.b v` /
    `--a.b=v` over it in order, the finetune scripts' checkpoint_dir also as the first positional."""
    from podkit.checks.importers import import_data

    if kind == "adapter":
        raise Unreadable("litgpt's adapter fine-tuning is not modelled (podkit prices LoRA, full and pretrain)",
                         "use finetune_lora for a LoRA prediction")
    data: dict[str, Any] = {}
    path, given = COMMAND, []
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--"):
            # The first positional is the setup()'s first parameter: checkpoint_dir (finetune), model_name
            # (pretrain; README: `litgpt pretrain EleutherAI/pythia-160m`).
            first = "model_name" if kind == "pretrain" else "checkpoint_dir"
            if first in data:
                raise ConfigError("--", f"litgpt takes one positional argument ({first}), got a second: "
                                        f"{shown_argv([word])[0]!r}")
            data[first] = word
            given.append(word)
            i += 1
            continue
        name, eq, value = word[2:].partition("=")
        if not eq:
            value, i = (args[i + 1], i + 2) if i + 1 < len(args) and not _is_option(args[i + 1]) else ("true", i + 1)
        else:
            i += 1
        if name == "config":
            path = local_config(value, "litgpt --config")
            _merge(data, config_data(path, "litgpt --config"))
            continue
        _set_dotted(data, name, scalar(value))
        given.append(shown(name, value))
    imps = import_data(path, data, lambda p, d: litgpt.read(p, d, kind))
    if given:
        imps[0].mapped.insert(0, f"(the command: {' '.join(given)}" + (f" over {path.name})" if path != COMMAND else ")"))
    return imps


def config_data(path: Path, what: str) -> dict:
    """A config file the command names, read as --from reads one; its errors name the command's option."""
    from podkit.checks.importers import read_data

    try:
        return read_data(path)
    except ConfigError as exc:
        if exc.field != "--from":
            raise
        raise ConfigError("--", f"{what}: {exc.problem}", exc.fix) from None


def local_config(ref: str, what: str) -> Path:
    """A config the command names. litgpt (__main__.py set_config_read_mode(urls_enabled=True)) and axolotl
    (cli/config.py check_remote_config) also fetch one from a URL; podkit reads local files only."""
    if re.match(r"https?://", ref):
        raise ConfigError("--", f"{what} is a URL ({ref}); podkit reads local files only",
                          "download it (curl -LO URL) and give the file in the command")
    return Path(ref).expanduser()


def _merge(into: dict, data: dict) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


# --- axolotl ----------------------------------------------------------------------------------------------------

# axolotl cli/main.py: the options of `axolotl train` / `preprocess` that are not config keys (cli/args.py
# TrainerCliArgs, PreprocessCliArgs, and --launcher / --cloud / --sweep).
AXOLOTL_CLI = {"launcher", "cloud", "sweep", "debug", "debug_text_only", "debug_num_examples", "prompter", "shard",
               "download", "iterable"}


def _axolotl_cli(args: list[str], launch: Imported) -> list[Imported]:
    """`axolotl train|preprocess CONFIG [--key value ...] [-- LAUNCHER-ARGS]`: the launcher (accelerate by
    default, or --launcher torchrun / python) gets the words after `--` (cli/main.py train: ctx.args)."""
    if args[:1] not in (["train"], ["preprocess"]):
        raise Unreadable(f"axolotl {args[0] if args else ''}".strip() + " trains nothing (podkit reads axolotl train)")
    own = args[1:]
    launcher_args: list[str] = []
    if "--" in own:
        own, launcher_args = own[:own.index("--")], own[own.index("--") + 1:]
    imps = _axolotl(own)
    launcher = str(hf_arguments(own[1:])[0].get("launcher", "accelerate"))
    if launcher == "torchrun":
        opts, _ = TORCHRUN.parse(launcher_args)
        _torchrun_facts(launch, opts)
    elif launcher == "accelerate":
        opts, _ = ACCELERATE.parse(launcher_args)
        imps += _accelerate(opts)
    else:
        launch.set(f"axolotl --launcher {launcher}", launcher, "cluster", "gpus_per_node", 1)
    return imps


def _axolotl(args: list[str]) -> list[Imported]:
    """axolotl's config YAML with the command's `--key value` over it (cli/config.py load_cfg: flat keys set, a
    `--parent.child` key set inside parent, values coerced as YAML; click's `--flag/--no-flag` for booleans;
    `python -m axolotl.cli.train` reads them with fire: --key=value)."""
    from podkit.checks.importers import import_data

    if not args or args[0].startswith("-"):
        raise ConfigError("--", "axolotl names no config file", "e.g. axolotl train config.yml")
    path = local_config(args[0], "axolotl's config")
    data = config_data(path, "axolotl's config")
    given, cli = [], []
    values, loose = hf_arguments(args[1:])
    for name, value in values.items():
        if name in AXOLOTL_CLI:
            cli.append(name)
            continue
        _set_dotted(data, name, value)
        given.append(shown(name, value))
    imps = import_data(path, data, axolotl.read)
    if given:
        imps[0].mapped.insert(0, f"(the command: {' '.join(given)} over {path.name})")
    for name in cli:
        imps[0].ignore(f"axolotl --{name}", "a CLI option, not the job")
    for word in loose:
        imps[0].ignore(f"argument {shown_argv([word])[0]!r}", "not an axolotl option")
    return imps


# --- torchtitan ---------------------------------------------------------------------------------------------------

def _torchtitan(args: list[str]) -> list[Imported]:
    """torchtitan v0.2.2 config/manager.py ConfigManager.parse_args: the TOML of `--job.config_file` (or
    --job.config-file, found anywhere among the arguments) is the base; tyro then applies every
    `--section.key value` over it (a bool field given bare is True, `--section.no-key` False)."""
    from podkit.checks.importers import import_data

    values, loose = hf_arguments(args)
    config = values.pop("job.config_file", None)
    path = Path(str(config)).expanduser() if config else COMMAND
    data = config_data(path, "--job.config_file") if config else {}
    given = []
    for name, value in values.items():
        if "." not in name:
            continue
        section, _, key = name.partition(".")
        if key.startswith("no_") and value is True:
            key, value = key[3:], False
        _set_dotted(data, f"{section}.{key}", value)
        given.append(shown(f"{section}.{key}", value))
    if not data:
        raise Unreadable("torchtitan without --job.config_file or --section.key options: nothing to read")
    imps = import_data(path, data, torchtitan.read)
    if given:
        imps[0].mapped.insert(0, f"(the command: {' '.join(given)}" + (f" over {path.name})" if config else ")"))
    for name in [n for n in values if "." not in n] + loose:
        imps[0].ignore(f"argument {shown_argv([name])[0]!r}", "not a torchtitan --section.key option")
    return imps
