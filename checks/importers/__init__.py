"""`bin/preflight --from FILE`: the configs users already have, read into podkit's job.

Each file's kind is recognised by its keys (or named: `--from deepspeed:ds.json`); its importer maps
what podkit models onto the job keys of checks/config.py and lists the rest. The files are merged
in order over the `--config` base (or podkit's defaults); two files that set one key to different
values are an error, as the HF Trainer refuses a DeepSpeed JSON that contradicts TrainingArguments
(transformers integrations/deepspeed.py fill_match). The merged job is emitted as TOML and parsed by
checks.config like any job file, so `--emit-toml` prints exactly what is predicted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from podkit.checks.config import JobConfig, load_job, parse_job
from podkit.checks.errors import ConfigError, closest
from podkit.checks.importers import accelerate, axolotl, deepspeed, hf, litgpt, torchtitan, torchtune
from podkit.checks.importers.imported import Imported, describe_model

# kind -> (recognises the data, reads it); the order decides ambiguous files.
KINDS: dict[str, tuple[Callable[[dict], bool], Callable[[Path, dict], Imported]]] = {
    "deepspeed": (deepspeed.looks_like, deepspeed.read),
    "accelerate": (accelerate.looks_like, accelerate.read),
    "torchtitan": (torchtitan.looks_like, torchtitan.read),
    # Before trainer: a torchtune recipe has output_dir and gradient_accumulation_steps too.
    "torchtune": (torchtune.looks_like, torchtune.read),
    "axolotl": (axolotl.looks_like, axolotl.read),
    "litgpt": (litgpt.looks_like, litgpt.read),
    "trainer": (hf.looks_like_trainer, hf.read_trainer),
    "peft": (hf.looks_like_peft, hf.read_peft),
    "bnb": (hf.looks_like_bnb, hf.read_bnb),
}
KNOWN = ("TrainingArguments/SFTConfig (trainer), peft LoraConfig (peft), BitsAndBytesConfig (bnb), DeepSpeed JSON "
         "(deepspeed), accelerate YAML (accelerate), axolotl YAML (axolotl), torchtitan TOML (torchtitan), torchtune "
         "recipe YAML (torchtune), litgpt finetune/pretrain YAML (litgpt)")
SECTION_ORDER = ("model", "train", "cluster", "smoke")


def read_data(path: Path) -> dict:
    """JSON, YAML or TOML by suffix (YAML also for unknown suffixes: JSON is YAML)."""
    fix = "give the path to a config file"
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError("--from", f"{path} does not exist", fix) from None
    except IsADirectoryError:
        raise ConfigError("--from", f"{path} is a directory", fix) from None
    except PermissionError:
        raise ConfigError("--from", f"{path} is not readable (permission denied)", "chmod u+r it, or copy it") from None
    except UnicodeDecodeError:
        raise ConfigError("--from", f"{path} is not UTF-8 text, so not a config file", fix) from None
    except OSError as exc:
        raise ConfigError("--from", f"cannot read {path}: {exc.strerror or exc}", fix) from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            try:
                import yaml
            except ImportError:
                raise ConfigError("--from", f"{path.name} is YAML, which needs PyYAML",
                                  "pip install PyYAML==6.0.3 (make setup installs it)") from None
            data = yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--from", f"{path} is not valid {path.suffix[1:].upper()}: {exc}") from None
    except Exception as exc:  # yaml.YAMLError: PyYAML is imported lazily
        if type(exc).__module__.startswith("yaml"):
            mark = getattr(exc, "problem_mark", None)  # yaml.MarkedYAMLError: where the parser stopped
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError("--from", f"{path} is not valid YAML: {problem}{where}", "fix the syntax there") from None
        raise
    if not isinstance(data, dict):
        raise ConfigError("--from", f"{path} holds no key-value mapping", "give a config file of a known kind: " + KNOWN)
    return data


def import_file(spec: str) -> list[Imported]:
    """One --from value ("FILE" or "KIND:FILE"), and the DeepSpeed files it names."""
    kind = ""
    prefix = spec.split(":", 1)[0] if ":" in spec else ""
    if prefix in KINDS:
        kind, spec = spec.split(":", 1)
    elif re.fullmatch(r"[A-Za-z][\w-]*", prefix) and not Path(spec).expanduser().exists():
        # 'foo:cfg.json' is a KIND:FILE with a misspelt kind, not a file named that ('a:b.json' that
        # exists is still read as a path).
        hint = closest(prefix, KINDS)
        raise ConfigError("--from", f"unknown kind {prefix!r} in {spec!r}",
                          (hint + " " if hint else "") + "known: " + ", ".join(KINDS))
    if not spec.strip():
        raise ConfigError("--from", "no file given" + (f" after '{kind}:'" if kind else ""),
                          "give the path to a config file, e.g. --from training_args.json")
    path = Path(spec).expanduser()
    data = read_data(path)
    if kind:
        looks, read = KINDS[kind]
        if not looks(data):
            raise ConfigError("--from", f"{path.name} does not look like a {kind} config (none of the keys that kind "
                              "documents)", "check the file, or drop the 'KIND:' prefix to detect it")
    else:
        matches = [k for k, (looks, _) in KINDS.items() if looks(data)]
        if not matches:
            raise ConfigError("--from", f"{path.name} is not a config podkit can read", "known kinds: " + KNOWN)
        kind = matches[0]
    return import_data(path, data, KINDS[kind][1])


def import_data(path: Path, data: dict, read: Callable[[Path, dict], Imported]) -> list[Imported]:
    """One config's data (a file's, or a file with a launch command's overrides on it) read by `read`, and the
    DeepSpeed files it names."""
    imp = read(path, data)
    out = [imp]
    for linked, inline in imp.linked:
        if inline is not None:
            # The DeepSpeed config inline (TrainingArguments.deepspeed or axolotl's deepspeed as a dict): named
            # after its file, apart from it, so build_job's de-duplication of files read twice keeps it.
            out.append(deepspeed.read(linked.with_name(f"{linked.name}#deepspeed"), inline))
        elif linked.exists():
            out.append(deepspeed.read(linked, read_data(linked)))
        else:
            imp.warnings.append(f"{linked} (named by {path.name}) does not exist here: give it with --from")
    return out


@dataclass
class ImportedJob:
    """The merged job and the account of every file that went into it."""

    job: JobConfig
    toml: str
    files: list[Imported] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    """The launch command read (`-- CMD...`), as it may be shown (command.shown_argv)."""

    def to_json(self) -> dict:
        out = {"files": [f.to_json() for f in self.files], "unresolved": self.unresolved}
        return {**out, "command": self.command} if self.command else out


def _base_sections(config: str | None) -> tuple[dict[str, dict[str, Any]], str]:
    if not config:
        return {name: {} for name in SECTION_ORDER}, ""
    job = load_job(config)  # validates the base the usual way first
    raw = tomllib.loads(Path(config).read_text())
    sections = {name: dict(raw.get(name, {})) for name in SECTION_ORDER}
    hf_config = sections["model"].get("hf_config")
    if hf_config:
        sections["model"]["hf_config"] = str(job.path(hf_config).resolve())
    return sections, config


def build_job(config: str | None, specs: list[str], model_preset: str | None = None,
              command: Sequence[str] = ()) -> ImportedJob:
    """The job of the --config base, the --from files (`specs`) and the launch `command` (`-- CMD...`, read by
    checks/importers/command.py) merged in that order."""
    sections, source = _base_sections(config)
    files: list[Imported] = []
    seen: set[Path] = set()
    read = [imp for spec in specs for imp in import_file(spec)]
    if command:
        from podkit.checks.importers.command import read_command

        read += read_command(command, with_files=bool(specs or config))
    for imp in read:
        key = imp.path.resolve()
        if key in seen and imp.kind == "DeepSpeed":
            continue  # the same DeepSpeed JSON given with --from and named by TrainingArguments (or the command)
        seen.add(key)
        files.append(imp)
    setters: dict[str, tuple[Any, str]] = {}
    for imp in files:
        if imp.sections["model"]:
            if "model" in setters and setters["model"][0] != imp.sections["model"]:
                raise ConfigError("--from", f"{imp.path.name} names the model {imp.sections['model']} but "
                                  f"{setters['model'][1]} names {setters['model'][0]}", "make the files name one model")
            setters["model"] = (imp.sections["model"], imp.path.name, imp.kind)
            sections["model"] = dict(imp.sections["model"])
        for name in ("train", "cluster", "smoke"):
            for key, value in imp.sections[name].items():
                dotted = f"{name}.{key}"
                if dotted in setters and setters[dotted][0] != value and dotted != "train.stack":
                    winner = _trainer_precision(dotted, imp, setters[dotted])
                    if winner == "kept":
                        continue
                    if winner is None:
                        deepspeed_hint = " (the HF Trainer refuses a DeepSpeed config that contradicts " \
                                         "TrainingArguments too)" if "DeepSpeed" in (imp.kind, setters[dotted][2]) else ""
                        raise ConfigError("the job's sources" if command else "--from",
                                          f"{imp.path.name} sets {dotted} = {value!r} but {setters[dotted][1]} set "
                                          f"{setters[dotted][0]!r}", "make them agree" + deepspeed_hint)
                if dotted == "train.stack" and setters.get(dotted, ("",))[0] == "deepspeed":
                    continue  # TrainingArguments with a DeepSpeed JSON: the DeepSpeed engine runs the step
                setters[dotted] = (value, imp.path.name, imp.kind)
                sections[name][key] = value
    for imp in files:  # library defaults fill only what neither the base nor any file set
        for dotted, value in imp.defaults.items():
            section, key = dotted.split(".")
            if dotted not in setters and key not in sections[section]:
                sections[section][key] = value
    loaded_16bit = next((f for f in files if f.weights_dtype), None)
    if loaded_16bit:
        weights_16bit(sections, loaded_16bit)
    if model_preset:
        if "model" in setters:
            # --model is for files that name no model (a DeepSpeed JSON, an accelerate YAML); one that
            # does is the job's model, and a preset in its place would predict another job.
            raise ConfigError("--model", f"{setters['model'][1]} names the model ({describe_model(setters['model'][0])}), "
                              f"--model says {model_preset!r}", "drop --model, or the model from that file")
        sections["model"] = {"preset": model_preset}
    if not sections["model"]:
        # A file that names a model podkit cannot resolve says which (Imported.unresolved "model.*").
        why = next((f"{imp.path.name}: {w}" for imp in files for d, w in imp.unresolved.items()
                    if d.startswith("model.")),
                   "neither the command nor the --from files name the model" if command
                   else "none of the --from files names the model")
        raise ConfigError("model", why, "give --model PRESET, or --config JOB.toml with a [model] section")
    unresolved = []
    for imp in files:
        for dotted, why in imp.unresolved.items():
            # The HF Trainer fills "auto" from its arguments, defaults included.
            if dotted not in setters and not any(dotted in f.defaults for f in files):
                section, key = dotted.split(".")
                if section == "model":  # a file's model podkit cannot place: the model is --model's or --config's
                    model = describe_model(sections["model"])
                    origin = "--model" if model_preset else setters["model"][1] if "model" in setters else "--config"
                    unresolved.append(f"{imp.path.name}: {why}; the model is {model} from {origin}")
                    continue
                now = sections[section].get(key)
                kept = f"{now!r} from --config" if now is not None else "podkit's default"
                nothing = "no --from file" + (" nor the command" if command else "")
                unresolved.append(f"{imp.path.name}: {why}; {nothing} sets it: {dotted} keeps {kept}")
    sources = list(dict.fromkeys(([source] if source else []) + [str(f.path) for f in files]))
    toml = emit_toml(sections, sources)
    job = parse_job(toml, source or str(files[0].path) if files else "<from>")
    shown = []
    if command:
        from podkit.checks.importers.command import shown_argv

        shown = shown_argv(command)
    return ImportedJob(job, toml, files, unresolved, shown)


def _trainer_precision(dotted: str, imp: Imported, earlier: tuple) -> str | None:
    """TrainingArguments' bf16 / fp16 over an accelerate config's mixed_precision: transformers training_args.py
    __post_init__ reads ACCELERATE_MIXED_PRECISION (what `accelerate launch` exports from its config) and then
    `if self.fp16: ... elif self.bf16: ...` replaces it. "kept" when the earlier (TrainingArguments) value stands,
    "replaced" when this file's does, None when the two are a real disagreement."""
    if dotted != "train.precision":
        return None
    kinds = (imp.kind.startswith("TrainingArguments"), earlier[2] == "accelerate config")
    if kinds == (True, True):
        imp.mapped.append(f"bf16/fp16 override {earlier[1]}'s mixed_precision (training_args.py __post_init__)")
        return "replaced"
    if imp.kind == "accelerate config" and earlier[2].startswith("TrainingArguments"):
        imp.mapped.append(f"mixed_precision: {earlier[1]}'s bf16/fp16 override it (training_args.py __post_init__)")
        return "kept"
    return None


def weights_16bit(sections: dict[str, dict[str, Any]], imp: Imported) -> None:
    """A model loaded in bf16 or fp16 trains in that pure 16-bit precision (autocast over 16-bit weights, no fp32
    masters; peft keeps its adapters fp32) unless an engine makes fp32 masters of the trained weights, which both
    do under autocast for a full fine-tune: DeepSpeed (its bf16 / fp16 optimizers' fp32 partitions, runtime/
    bf16_optimizer.py, fp16/fused_optimizer.py) and accelerate's FSDP (utils/fsdp_utils.py fsdp2_prepare_model:
    "FSDP upcast of low precision parameters to fp32 (since mixed_precision != 'no')", trainable parameters
    only). Without one, fp16 autocast over fp16 weights is refused for a full fine-tune: the Trainer's GradScaler
    unscales before clipping and stepping, and torch refuses fp16 gradients (torch/amp/grad_scaler.py
    _unscale_grads_: "Attempting to unscale FP16 gradients."). peft's fp32 adapters it scales: a LoRA job keeps
    its GradScaler."""
    train, cluster = sections["train"], sections["cluster"]
    dtype, precision = imp.weights_dtype, train.get("precision")
    mixed = f"{dtype}-mixed"
    if precision not in (None, mixed, "fp32"):
        imp.warnings.append(f"{imp.weights_key}: {dtype} weights under {precision} are not modelled; "
                            f"train.precision stays {precision!r}")
        return
    engine = "DeepSpeed" if train.get("stack") == "deepspeed" else \
        "accelerate's FSDP" if cluster.get("sharding") in ("zero2", "zero3") and train.get("stack") == "hf" else ""
    lora = bool(train.get("lora_rank"))
    if precision == mixed and not lora and engine:
        imp.mapped.append(f"{imp.weights_key}: {dtype} weights, given fp32 masters by {engine} under {dtype} "
                          f"autocast -> train.precision stays {mixed!r}")
        return
    if precision == "fp16-mixed" and not lora:
        raise ConfigError(imp.path.name, f"{imp.weights_key} with fp16 autocast trains fp16 weights, and the Trainer's "
                          "GradScaler refuses fp16 gradients (\"Attempting to unscale FP16 gradients.\")",
                          "load the model in float32 for fp16 mixed precision, or turn fp16 off to train in pure fp16")
    train["precision"] = dtype
    if precision == "fp16-mixed":
        train["grad_scaler"] = "on"  # the Trainer's GradScaler, over peft's fp32 adapters
    imp.mapped.append(f"{imp.weights_key} -> train.precision = {dtype!r} ({dtype} weights"
                      + (", frozen but the adapters" if lora and engine else "")
                      + ", no fp32 masters" + (", a GradScaler on the adapters" if precision == "fp16-mixed" else "")
                      + ")")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(str(v))


def emit_toml(sections: dict[str, dict[str, Any]], sources: list[str]) -> str:
    lines = ["# podkit job imported by bin/preflight --from", *(f"#   {s}" for s in sources)]
    for name in SECTION_ORDER:
        if not sections.get(name) and name != "model":
            continue
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in sections[name].items()]
    return "\n".join(lines) + "\n"
