"""What one importer read from one file, and the vocabulary the Hugging Face family shares.

Each importer maps a user's own config file onto podkit's job keys (checks/config.py) and says,
line by line, what it mapped and what it left out: a key podkit does not model is never dropped
silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podkit.checks.errors import ConfigError


@dataclass
class Imported:
    """One file's contribution to the job: job keys by section, and the account of how."""

    path: Path
    kind: str
    sections: dict[str, dict[str, Any]] = field(default_factory=lambda: {"model": {}, "train": {}, "cluster": {}, "smoke": {}})
    mapped: list[str] = field(default_factory=list)
    """'their_key = value -> section.key = value' lines."""
    ignored: list[str] = field(default_factory=list)
    """Keys present in the file that podkit does not model."""
    warnings: list[str] = field(default_factory=list)
    """Approximations and unresolved values worth a look."""
    linked: list[tuple[Path, dict | None]] = field(default_factory=list)
    """Other DeepSpeed configs this one names (TrainingArguments.deepspeed: a path, or the dict inline),
    imported after it."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """section.key -> the library's default where the file is silent: used only when neither --config
    nor another file sets that key."""
    unresolved: dict[str, str] = field(default_factory=dict)
    """section.key -> why: values the file leaves to another ("auto" in a DeepSpeed JSON)."""
    weights_dtype: str = ""
    """bf16 | fp16 where a key loads the model's weights in 16 bits (TRL's torch_dtype, axolotl's bf16 / fp16):
    train.precision then depends on what the other files say runs the step (importers.weights_16bit)."""
    weights_key: str = ""
    """That key and its value, as the file says them."""

    def loads_weights(self, dtype: str, key: str) -> None:
        """The model is loaded in `dtype` (bf16 | fp16), as `key` says."""
        self.weights_dtype, self.weights_key = dtype, key

    def set(self, their_key: str, their_value: Any, section: str, key: str, value: Any) -> None:
        self.sections[section][key] = value
        self.mapped.append(f"{their_key} = {their_value!r} -> {section}.{key} = {value!r}")

    def default(self, their_key: str, value: Any, section: str, key: str, job_value: Any) -> None:
        self.defaults[f"{section}.{key}"] = job_value
        self.mapped.append(f"{their_key} unset: the default {value!r} -> {section}.{key} = {job_value!r} "
                           "(unless --config or another file sets it)")

    def set_model(self, their_key: str, ref: str, model: dict[str, Any]) -> None:
        """One model key (a preset, a config.json, a Hub id) or explicit dimensions."""
        self.sections["model"] = dict(model)
        self.mapped.append(f"{their_key} = {ref!r} -> {describe_model(model)}")

    def ignore(self, key: str, why: str = "") -> None:
        self.ignored.append(f"{key}" + (f" ({why})" if why else ""))

    def to_json(self) -> dict:
        return {"file": str(self.path), "kind": self.kind, "mapped": self.mapped, "ignored": self.ignored,
                "warnings": self.warnings, "unresolved": self.unresolved}


def describe_model(model: dict[str, Any]) -> str:
    """'model.preset = 'x'' for one key, the explicit dimensions on one line otherwise."""
    if len(model) == 1:
        (key, value), = model.items()
        return f"model.{key} = {value!r}"
    return "model = {" + ", ".join(f"{k} = {v!r}" for k, v in model.items()) + "}"


def truthy(value: Any) -> bool:
    """YAML/JSON booleans as the libraries read them (transformers and axolotl accept "true" strings)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "auto")
    return bool(value)


def integer(path: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or int(value) != value:
        raise ConfigError(f"{path.name}: {key}", f"must be a whole number, got {value!r}")
    return int(value)


def real(path: Path, key: str, value: Any) -> float:
    """A finite number; YAML and JSON writers sometimes quote them ("3e-4"), which the libraries accept."""
    try:
        if isinstance(value, bool):
            raise ValueError
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path.name}: {key}", f"must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise ConfigError(f"{path.name}: {key}", f"must be a finite number, got {value!r}")
    return out


# Optimizer classes by import path -> podkit train.optimizer, for configs that name the class (torchtune's
# optimizer._component_, litgpt's optimizer class_path). bitsandbytes optim/adamw.py, adam.py, lion.py: the 8bit
# classes keep blockwise 8-bit states, the Paged* ones page them, PagedAdamW / PagedAdamW32bit keep fp32
# states; torch.optim.Adam keeps AdamW's two states.
OPTIMIZER_CLASSES = {
    "torch.optim.AdamW": "adamw", "torch.optim.Adam": "adamw", "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.AdamW8bit": "adamw8bit", "bitsandbytes.optim.Adam8bit": "adamw8bit",
    "bitsandbytes.optim.PagedAdamW8bit": "paged_adamw8bit", "bitsandbytes.optim.PagedAdam8bit": "paged_adamw8bit",
    "bitsandbytes.optim.PagedAdamW": "paged_adamw", "bitsandbytes.optim.PagedAdamW32bit": "paged_adamw",
    "bitsandbytes.optim.PagedAdam": "paged_adamw", "bitsandbytes.optim.PagedAdam32bit": "paged_adamw",
    "bitsandbytes.optim.Lion": "lion", "bitsandbytes.optim.Lion32bit": "lion", "bitsandbytes.optim.Lion8bit": "lion8bit",
}

# transformers training_args.py OptimizerNames (v4.57) -> (podkit train.optimizer, train.optimizer_impl or "").
# "adamw_torch" is torch.optim.AdamW with torch's default kernel (foreach on CUDA), "adamw_torch_fused"
# passes fused=True (trainer.py get_optimizer_cls_and_kwargs); the bnb names build bitsandbytes' AdamW
# with optim_bits 8 or 32 and is_paged (same function); axolotl reuses these names.
HF_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_hf": ("adamw", "for-loop"),  # transformers' own AdamW: a Python loop over parameters
    "adamw_bnb_8bit": ("adamw8bit", ""),
    "adamw_8bit": ("adamw8bit", ""),
    "paged_adamw_8bit": ("paged_adamw8bit", ""),
    "paged_adamw_32bit": ("paged_adamw", ""),
    "paged_adamw": ("paged_adamw", ""),
    "adafactor": ("adafactor", ""),
    "sgd": ("sgd", ""),
    "lion_32bit": ("lion", ""),
    # trainer_optimizer.py _get_torchao_optimizer (5.23.0; trainer.py get_optimizer_cls_and_kwargs before):
    # torchao.optim AdamW4bit for adamw_torch_4bit, AdamW8bit for adamw_torch_8bit.
    "adamw_torch_4bit": ("torchao_adamw4bit", ""),
    "adamw_torch_8bit": ("torchao_adamw8bit", ""),
}
# The same function passes block_size=optim_args.get("block_size", 256) to both classes: 256 also for
# AdamW4bit, whose own default is 128.
HF_TORCHAO_BLOCK = 256


def map_optimizer(imp: Imported, key: str, name: str, optim_args: Any = None) -> bool:
    """An HF/axolotl optimizer name; `optim_args` (TrainingArguments.optim_args, "k=v,k=v", or a mapping) is
    read where it changes memory, torchao's block_size: True when it was read (else the caller lists it)."""
    if name not in HF_OPTIMIZERS:
        imp.ignore(f"{key} = {name!r}", "no podkit optimizer of that name: train.optimizer keeps its value; "
                   "known: " + ", ".join(HF_OPTIMIZERS))
        return False
    opt, impl = HF_OPTIMIZERS[name]
    imp.set(key, name, "train", "optimizer", opt)
    if impl:
        imp.sections["train"]["optimizer_impl"] = impl
        imp.mapped.append(f"{key} = {name!r} -> train.optimizer_impl = {impl!r}")
    if not opt.startswith("torchao_"):
        return False
    args = _optim_args(imp.path, optim_args)
    if "block_size" in args:
        imp.set("optim_args.block_size", args["block_size"], "train", "optimizer_block",
                integer(imp.path, "optim_args.block_size", int_text(args["block_size"])))
        if isinstance(args["block_size"], str):
            # _get_torchao_optimizer passes the text on; torchao's `numel % self.block_size` then raises.
            imp.warnings.append(f"optim_args block_size={args['block_size']}: the Trainer hands torchao the "
                                "text, not a number, and its first step fails (TypeError)")
    else:
        imp.default("optim_args.block_size", HF_TORCHAO_BLOCK, "train", "optimizer_block", HF_TORCHAO_BLOCK)
    others = sorted(set(args) - {"block_size"})
    if others:
        imp.ignore("optim_args: " + ", ".join(others), "optimizer hyperparameters (bf16_stochastic_round rounds "
                   "inside the compiled step): no change to memory")
    return True


def int_text(value: Any) -> Any:
    """'128' (optim_args are text) as 128; anything else as given, for integer() to judge."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _optim_args(path: Path, value: Any) -> dict[str, Any]:
    """TrainingArguments.optim_args as the Trainer splits it (trainer_optimizer.py _parse_optim_args, 5.23.0:
    `.replace(" ", "").split(",")`, each `key=value`, values kept as text), or a mapping."""
    if value in (None, ""):
        return {}
    if isinstance(value, dict):
        return dict(value)
    out = {}
    for item in str(value).replace(" ", "").split(","):
        if "=" not in item:
            raise ConfigError(f"{path.name}: optim_args", f"{item!r} is not key=value", "e.g. \"block_size=128\"")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def linked_path(path: Path, ref: str) -> Path:
    """A DeepSpeed JSON that `path` names. The libraries open it as given, from the directory they run in
    (accelerate utils/deepspeed.py HfDeepSpeedConfig: os.path.exists(config_file_or_dict); axolotl
    utils/trainer.py prepare_optim_env: os.path.isfile(cfg.deepspeed)), which is usually where the config
    lives, or the repository root its examples are run from (axolotl's deepspeed_configs/): beside the
    file first, then the working directory."""
    linked = Path(ref).expanduser()
    if linked.is_absolute():
        return linked
    beside = path.parent / linked
    return beside if beside.exists() or not linked.exists() else linked


def model_ref(ref: str, base_dir: Path) -> dict[str, str]:
    """A model named the Hugging Face way (hub id or local directory) as a podkit [model] section:
    a preset when the id is that preset's Hub repo, a local config.json, or model.hf for the hub."""
    from podkit.checks.presets import CONFIGS, HUB_ALIASES

    for name, (repo, _) in CONFIGS.items():
        if repo.lower() == ref.lower():
            return {"preset": name}
    for repo, name in HUB_ALIASES.items():
        if repo.lower() == ref.lower():
            return {"preset": name}
    local = Path(ref).expanduser()
    if not local.is_absolute():
        local = base_dir / local
    if local.is_dir() and (local / "config.json").is_file():
        return {"hf_config": str((local / "config.json").resolve())}
    if local.is_file() and local.suffix == ".json":
        return {"hf_config": str(local.resolve())}
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        return {"hf": ref}
    raise ConfigError(f"model {ref!r}", "is neither a Hub id (owner/name) nor a local directory with a config.json",
                      "give --model PRESET, or fix the path")


def precision_from_flags(imp: Imported, data: dict, bf16_key: str = "bf16", fp16_key: str = "fp16") -> None:
    """HF-style bf16/fp16 switches: both drive torch.autocast over fp32 weights (transformers trainer.py
    sets up autocast for either; fp16 adds a GradScaler), i.e. podkit's *-mixed precisions."""
    if bf16_key not in data and fp16_key not in data:
        return
    bf16, fp16 = data.get(bf16_key), data.get(fp16_key)
    if truthy(bf16):
        imp.set(bf16_key, bf16, "train", "precision", "bf16-mixed")
        if bf16 == "auto":
            imp.warnings.append(f"{bf16_key}: 'auto' read as true (the GPU is assumed to support bf16)")
    elif truthy(fp16):
        imp.set(fp16_key, fp16, "train", "precision", "fp16-mixed")
    else:
        imp.set(f"{bf16_key}/{fp16_key}", False, "train", "precision", "fp32")
        imp.warnings.append("neither bf16 nor fp16: the Trainer keeps fp32 unless your script loads the model in "
                            "16 bits (then set train.precision = \"bf16\" or \"fp16\")")
