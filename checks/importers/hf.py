"""The Hugging Face family: TrainingArguments / TRL SFTConfig, a peft LoRA config, bitsandbytes settings.

Keys as documented by their dataclasses: transformers src/transformers/training_args.py
(TrainingArguments), trl/trainer/sft_config.py (SFTConfig: max_length, formerly max_seq_length) and
trl/trainer/model_config.py (ModelConfig: model_name_or_path, use_peft, lora_r, load_in_4bit, ...,
which HfArgumentParser scripts read from the same file), peft src/peft/tuners/lora/config.py
(LoraConfig, saved as adapter_config.json) and transformers utils/quantization_config.py
(BitsAndBytesConfig).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from podkit.checks import stacks
from podkit.checks.errors import ConfigError
from podkit.checks.importers import accelerate
from podkit.checks.importers.imported import (Imported, integer, linked_path, map_optimizer, model_ref,
                                              precision_from_flags, real, truthy)

# TrainingArguments / SFTConfig keys whose presence marks the file (any one is enough).
TRAINER_MARKS = ("per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "optim",
                 "gradient_checkpointing", "max_seq_length", "num_train_epochs", "learning_rate")
PEFT_MARKS = ("peft_type", "target_modules")
# Fields of TRL's SFTConfig that TrainingArguments lacks (trl/trainer/sft_config.py, v1.9): a file with one is
# an SFTConfig, whose defaults differ from TrainingArguments'.
TRL_SFT_MARKS = ("max_length", "max_seq_length", "packing", "packing_strategy", "dataset_text_field",
                 "completion_only_loss", "assistant_only_loss", "padding_free", "dataset_kwargs", "eval_packing")
BNB_MARKS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "quantization_config")


def looks_like_trainer(data: dict) -> bool:
    return any(k in data for k in TRAINER_MARKS) and "zero_optimization" not in data


def looks_like_peft(data: dict) -> bool:
    return any(k in data for k in PEFT_MARKS) and "r" in data


def looks_like_bnb(data: dict) -> bool:
    return any(k in data for k in BNB_MARKS) and not looks_like_trainer(data)


def _checkpointing(imp: Imported, data: dict, key: str = "gradient_checkpointing") -> None:
    if key not in data:
        return
    on = truthy(data[key])
    # transformers checkpoints each decoder layer whole (modeling_utils.gradient_checkpointing_enable):
    # podkit's "full" (per-block recompute).
    imp.set(key, data[key], "train", "checkpointing", "full" if on else "none")
    kwargs = data.get("gradient_checkpointing_kwargs") or {}
    if "gradient_checkpointing_kwargs" in data:
        reentrant = kwargs.get("use_reentrant", True)
        if on and not reentrant:
            imp.warnings.append("gradient_checkpointing_kwargs.use_reentrant = false: podkit models the release's "
                                "default (reentrant before transformers 5.0, train.transformers); the two differ only "
                                "for bitsandbytes < 0.43.2 (train.bitsandbytes)")
        imp.mapped.append(f"gradient_checkpointing_kwargs = {kwargs!r} (read: use_reentrant = {reentrant})")


def _fsdp_config(imp: Imported, path: Path, value: Any) -> dict:
    """TrainingArguments.fsdp_config: a mapping, or the path of a JSON file holding one (training_args.py
    _process_fsdp_args: `elif isinstance(self.fsdp_config, str): ... json.load(f)`), looked for as the Trainer
    opens it: from the working directory, or beside this file (linked_path)."""
    if value is None or isinstance(value, dict):
        return value or {}
    if not isinstance(value, str):
        raise ConfigError(f"{path.name}: fsdp_config", f"must be a mapping or the path of a JSON file, got {value!r}")
    linked = linked_path(path, value)
    try:
        loaded = json.loads(linked.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path.name}: fsdp_config", f"{value} found neither beside {path.name} nor in the working "
                          "directory", "give its path from the working directory, or write its keys inline") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path.name}: fsdp_config", f"cannot read {linked} as JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path.name}: fsdp_config", f"{linked} holds no JSON object")
    imp.mapped.append(f"fsdp_config = {value!r}: read {linked}")
    return loaded


def _fsdp(imp: Imported, value: Any, fsdp_config: Any, version_default: tuple[int, str] | None = None) -> None:
    """TrainingArguments.fsdp (true, or the legacy string / list of FSDPOption) with its fsdp_config, as
    transformers 5.23 training_args.py reads them (_process_fsdp_args): fsdp_config keys lose an "fsdp_"
    prefix; "version" (default 2) picks FSDP1 or FSDP2; reshard_after_forward (FSDP2: a bool, default true;
    FSDP1: a sharding strategy, default full_shard) is the sharding, which the legacy options only default
    (_apply_legacy_fsdp_to_config: full_shard -> true, shard_grad_op -> false, "offload" -> cpu_offload).
    axolotl hands its own fsdp / fsdp_config to the Trainer the same way (core/builders/base.py)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"  # HfArgumentParser's reading of a command-line "true"
    if not value:
        return  # FSDP off (_process_fsdp_args returns at once); axolotl's caller passes True for fsdp_config alone
    options = [] if value is True else value.split() if isinstance(value, str) else [str(o) for o in value]
    cfg = {(k[5:] if k.startswith("fsdp_") and k != "fsdp_version" else k): v
           for k, v in (fsdp_config if isinstance(fsdp_config, dict) else {}).items()}
    if "fsdp_version" in cfg:
        cfg.setdefault("version", cfg.pop("fsdp_version"))
    strategy, where = None, ""
    if "reshard_after_forward" in cfg:
        strategy, where = cfg["reshard_after_forward"], "fsdp_config.reshard_after_forward"
    elif any(o.upper() in accelerate.SHARDING for o in options):
        strategy, where = next(o for o in options if o.upper() in accelerate.SHARDING), "fsdp"
    elif "sharding_strategy" in cfg:  # accelerate's deprecated name for it (utils/dataclasses.py)
        strategy, where = cfg["sharding_strategy"], "fsdp_config.sharding_strategy"
    if strategy is None or isinstance(strategy, bool) or str(strategy).lower() in ("true", "false"):
        sharding = "zero3" if strategy is None or truthy(strategy) else "zero2"
    else:
        sharding = accelerate.SHARDING.get(str(strategy).upper(), "zero3")
    imp.set(where or "fsdp", strategy if where else value, "cluster", "sharding", sharding)
    imp.unresolved["cluster.gpus_per_node"] = "fsdp: the number of GPUs is the launcher's (give --from " \
                                              "accelerate.yaml, or --config with [cluster] gpus_per_node)"
    if str(strategy).lower().startswith("hybrid"):
        imp.warnings.append("fsdp hybrid sharding: shards within a node only; predicted as if over every GPU of a "
                            "node (set cluster.nodes = 1 for the per-node view)")
    if "version" in cfg:
        version = integer(imp.path, "fsdp_config.version", cfg["version"])
        if version not in (1, 2):
            raise ConfigError(f"{imp.path.name}: fsdp_config.version", f"must be 1 or 2, got {version}")
        imp.set("fsdp_config.version", cfg["version"], "cluster", "fsdp_version", version)
    elif version_default:
        imp.default("fsdp_config.version", version_default[0], "cluster", "fsdp_version", version_default[0])
        if version_default[1]:
            imp.warnings.append(version_default[1])
    offload = next((k for k in ("cpu_offload", "offload_params") if truthy(cfg.get(k, False))), None)
    if offload or "offload" in options:
        imp.set(f"fsdp_config.{offload}" if offload else "fsdp", True if offload else "offload", "cluster", "offload",
                "all" if sharding == "zero3" else "optimizer")
    if truthy(cfg.get("activation_checkpointing", False)):
        imp.set("fsdp_config.activation_checkpointing", True, "train", "checkpointing", "full")
    for key in cfg:
        if key not in ("version", "reshard_after_forward", "sharding_strategy", "cpu_offload", "offload_params",
                       "activation_checkpointing"):
            imp.ignore(f"fsdp_config.{key}", "wrapping and prefetch details are not modelled")


# transformers attn_implementation values (modeling_utils.py: "eager", "sdpa", "flash_attention_2/3",
# "flex_attention", or a Hub kernel repo such as "kernels-community/flash-attn3") -> train.attention.
ATTENTION = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn", "sdpa": "sdpa", "eager": "eager"}
# Kernels that, like SDPA's memory-efficient backend, keep the output and its log-sum-exp and no s x s scores
# (xformers memory_efficient_attention, torch flex_attention, SageAttention; axolotl enums.py
# CANONICAL_ATTN_IMPLS names them beside the above).
LIKE_SDPA = ("flex_attention", "xformers", "sage")


def attention(imp: Imported, key: str, value: Any, name: str = "") -> None:
    """The file's attention kernel (`name`, else the value itself) as train.attention."""
    name = name or str(value)
    if name in ATTENTION:
        imp.set(key, value, "train", "attention", ATTENTION[name])
    elif "/" in name and "flash" in name.split("/")[-1]:
        # A Hub kernel (transformers integrations/hub_kernels.py loads it with the `kernels` package):
        # FlashAttention's kernels built elsewhere keep what flash-attn keeps.
        imp.set(key, value, "train", "attention", "flash-attn")
        imp.warnings.append(f"{key} = {name!r}: a Hub build of FlashAttention, priced as the flash-attn package")
    elif name in LIKE_SDPA or ("/" in name and name.split("/")[-1].startswith("sage")):
        imp.set(key, value, "train", "attention", "sdpa")
        imp.warnings.append(f"{key} = {name!r}: keeps no s x s scores either; priced as SDPA's memory-efficient "
                            "kernel")
    else:
        imp.ignore(f"{key} = {name!r}", "not an attention kernel podkit prices: train.attention keeps its value")


def _padding_free(imp: Imported, data: dict) -> None:
    """TRL's collator flattens each micro-batch into one row with position_ids and no attention_mask (train.padding
    'flattened') when `padding_free or (packing and packing_strategy in {"bfd", "bfd_split"})` (sft_trainer.py
    v1.0-v1.9; "bfd-requeue" becomes "bfd_split" in SFTConfig.__post_init__), `packing_strategy == "bfd"` in
    v0.20-v0.29 and `== "ffd"` in v0.19, each then the default strategy; 'wrapped' packing cuts full rows. The file
    does not say which TRL reads it: mapped as the current one, with what an older one does differently."""
    strategy = str(data.get("packing_strategy", "bfd"))
    if truthy(data.get("padding_free", False)):
        imp.set("padding_free", data["padding_free"], "train", "padding", "flattened")
    elif truthy(data.get("packing", False)):
        how = strategy if "packing_strategy" in data else f"{strategy}, SFTConfig's default"
        flattened = strategy in ("bfd", "bfd_split", "bfd-requeue", "ffd")
        imp.set(f"packing (packing_strategy {how})", data["packing"], "train", "padding",
                "flattened" if flattened else "none")
        if not flattened:
            return
        if "packing_strategy" not in data:
            # trl <= 0.14 ConstantLengthDataset, 0.15-0.18 pack_examples / pack_dataset: rows of max_length tokens.
            imp.warnings.append("packing without packing_strategy: padding-free rows as trl >= 0.19 packs them; trl "
                                "0.18 and older pack full rows of max_length (set train.padding = 'none')")
        elif strategy == "bfd-requeue":
            imp.warnings.append("packing_strategy = 'bfd-requeue': padding-free rows as trl >= 1.0 runs it "
                                "('bfd_split'); trl 0.29 pads its packed rows instead (set train.padding = 'stack')")
    else:
        return
    if not truthy(data.get("gradient_checkpointing", True)):
        # trl >= 0.22 SFTTrainer.compute_loss `inputs["use_cache"] = False`; before, the model's config.use_cache
        # holds, so without checkpointing transformers >= 4.54 makes a DynamicCache in training and skips the
        # packed-sequence mask (masking_utils _preprocess_mask_arguments: only `past_key_values is None`).
        imp.warnings.append("padding-free rows without gradient checkpointing: priced with the block-causal mask "
                            "trl >= 0.22 gets (it passes use_cache=False); under an older trl the model keeps a "
                            "cache and builds no mask (set train.padding = 'none')")


def read_trainer(path: Path, data: dict, sft: bool = False) -> Imported:
    """`sft`: the arguments are parsed as TRL's SFTConfig whatever fields they hold (`trl sft`, trl/scripts/sft.py)."""
    imp = Imported(path, "TrainingArguments")
    handled = set()

    def take(key: str, section: str, job_key: str, convert=lambda v: v) -> None:
        if key in data and data[key] is not None:
            imp.set(key, data[key], section, job_key, convert(data[key]))
        handled.add(key)

    num = lambda k: (lambda v: integer(path, k, v))
    # TrainingArguments' own defaults where the file is silent: they are what the Trainer runs.
    for key, job_key, default in (("per_device_train_batch_size", "micro_batch", 8),
                                  ("gradient_accumulation_steps", "grad_accum", 1),
                                  ("max_grad_norm", "grad_clip", 1.0)):
        if key not in data:
            imp.default(key, default, "train", job_key, default)
    trl = [k for k in TRL_SFT_MARKS if k in data] or (["trl sft"] if sft else [])
    if trl:
        # A TRL SFTConfig (its own fields: trl/trainer/sft_config.py) overrides three TrainingArguments defaults
        # that change memory: bf16 = not fp16 (trl >= 0.19, _BaseConfig.__post_init__), gradient_checkpointing
        # = True (trl >= 0.22) and max_length = 1024.
        if "bf16" not in data and not truthy(data.get("fp16") or False):
            imp.default("bf16 (SFTConfig: not fp16)", True, "train", "precision", "bf16-mixed")
        if "gradient_checkpointing" not in data:
            imp.default("gradient_checkpointing (SFTConfig)", True, "train", "checkpointing", "full")
        if "max_length" not in data and "max_seq_length" not in data:
            imp.default("max_length (SFTConfig)", 1024, "train", "seq_len", 1024)
        imp.warnings.append(f"{trl[0]}: a TRL SFTConfig, read with its own defaults (bf16 unless fp16 since trl 0.19, "
                            "gradient_checkpointing since trl 0.22, max_length 1024); set them explicitly for an "
                            "older trl")
    elif "bf16" not in data and "fp16" not in data and not data.get("torch_dtype") and not data.get("dtype"):
        imp.default("bf16/fp16", False, "train", "precision", "fp32")
    take("per_device_train_batch_size", "train", "micro_batch", num("per_device_train_batch_size"))
    take("gradient_accumulation_steps", "train", "grad_accum", num("gradient_accumulation_steps"))
    # SFTConfig.max_length (trl >= 0.16; max_seq_length before): the longest a sequence gets, which
    # is what every batch is with packing and the worst case without.
    for key in ("max_length", "max_seq_length"):
        take(key, "train", "seq_len", num(key))
    handled.add("packing")
    if data.get("max_length") is not None or data.get("max_seq_length") is not None:
        if not truthy(data.get("packing", False)):
            imp.warnings.append("seq_len is the maximum length: without packing, shorter batches use less")
    handled |= {"padding_free", "packing_strategy"}
    _padding_free(imp, data)
    take("learning_rate", "train", "lr", lambda v: real(path, "learning_rate", v))
    take("warmup_steps", "train", "warmup_steps", num("warmup_steps"))
    take("weight_decay", "train", "weight_decay", lambda v: real(path, "weight_decay", v))
    take("max_grad_norm", "train", "grad_clip", lambda v: real(path, "max_grad_norm", v))
    take("dataloader_num_workers", "train", "data_workers", num("dataloader_num_workers"))
    take("seed", "smoke", "seed", num("seed"))
    if truthy(data.get("bf16")) and truthy(data.get("fp16")):
        # transformers training_args.py TrainingArguments.__post_init__ raises "At most one of fp16 and bf16
        # can be True, but not both": the Trainer never runs such a file.
        raise ConfigError(f"{path.name}: bf16, fp16", "both are true; TrainingArguments allows at most one",
                          "keep bf16 (Ampere or newer) or fp16, not both")
    precision_from_flags(imp, data)
    handled |= {"bf16", "fp16"}
    if "optim" in data:
        if map_optimizer(imp, "optim", str(data["optim"]), data.get("optim_args")):
            handled.add("optim_args")
    else:
        # The Trainer's default optim depends on the release (training_args.py: "adamw_torch_fused" from
        # transformers 4.54 with torch >= 2.8, "adamw_torch" before), which the file does not record: the
        # kernel stays the hf stack's, which follows train.transformers and train.torch.
        imp.default("optim", "adamw_torch_fused", "train", "optimizer", "adamw")
        imp.warnings.append("optim not set: the Trainer's default, adamw_torch_fused with transformers >= 4.54 and "
                            "torch >= 2.8 (a current pair unless the job sets train.transformers / train.torch), "
                            "adamw_torch (foreach) before")
    handled.add("optim")
    _checkpointing(imp, data)
    handled |= {"gradient_checkpointing", "gradient_checkpointing_kwargs"}
    ds = data.get("deepspeed")
    if ds:
        imp.set("deepspeed", ds if isinstance(ds, str) else "{...}", "train", "stack", "deepspeed")
        if isinstance(ds, str):
            imp.linked.append((linked_path(path, ds), None))
        else:
            imp.linked.append((path, ds))  # an inline DeepSpeed dict
    else:
        imp.set("(TrainingArguments)", path.name, "train", "stack", "hf")
    handled.add("deepspeed")
    if data.get("fsdp"):
        # transformers >= 5.10 runs FSDP2 where fsdp_config names no version (training_args.py
        # _process_fsdp_args: fsdp_config.get("version", 2)); FSDP1 before, accelerate's default.
        _fsdp(imp, data["fsdp"], _fsdp_config(imp, path, data.get("fsdp_config")),
              (2, "fsdp_config.version not set: FSDP2, transformers' default from 5.10 (FSDP1 before: set "
                  "cluster.fsdp_version = 1 for an older release)"))
    handled |= {"fsdp", "fsdp_config"}
    # TRL ModelConfig / a script's ModelArguments, often in the same file.
    if data.get("model_name_or_path"):
        imp.set_model("model_name_or_path", data["model_name_or_path"], model_ref(data["model_name_or_path"], path.parent))
    handled.add("model_name_or_path")
    if data.get("attn_implementation"):
        attention(imp, "attn_implementation", data["attn_implementation"])
    handled.add("attn_implementation")
    if truthy(data.get("use_peft", False)):
        _lora(imp, path, {"r": data.get("lora_r", 16), "target_modules": data.get("lora_target_modules"),
                          "lora_dropout": data.get("lora_dropout", 0.05)}, prefix="lora_")
    handled |= {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_task_type",
                "use_rslora", "use_dora", "lora_modules_to_save"}
    if any(truthy(data.get(k, False)) for k in ("load_in_4bit", "load_in_8bit")):
        _quant(imp, {"load_in_4bit": data.get("load_in_4bit", False), "load_in_8bit": data.get("load_in_8bit", False),
                     "bnb_4bit_quant_type": data.get("bnb_4bit_quant_type", "nf4"),
                     "bnb_4bit_use_double_quant": data.get("use_bnb_nested_quant", False)},
               double_key="use_bnb_nested_quant")
    handled |= {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "torch_dtype", "dtype"}
    dtype_key = "dtype" if data.get("dtype") else "torch_dtype"
    dtype = data.get(dtype_key)
    if dtype in ("bfloat16", "bf16", "float16", "fp16"):
        # TRL ModelConfig.torch_dtype (dtype in trl >= 0.22): the weights are loaded in 16 bits. Whether
        # anything keeps fp32 masters of them depends on the engine another file may name (weights_16bit).
        imp.loads_weights("bf16" if dtype.startswith("b") else "fp16", f"{dtype_key} = {dtype!r}")
    elif dtype and dtype not in ("auto", "float32"):
        imp.warnings.append(f"{dtype_key} = {dtype!r}: not modelled; train.precision follows bf16/fp16")
    _liger(imp, data)
    handled |= {"use_liger_kernel", "use_liger", "liger_kernel_config"}
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp


def _liger(imp: Imported, data: dict) -> None:
    """TrainingArguments.use_liger_kernel (trl's older SFTConfig.use_liger): the Trainer patches the model with
    Liger's kernels (transformers trainer.py -> liger_kernel.transformers._apply_liger_kernel_to_instance,
    whose Llama defaults are rope, rms_norm, swiglu and fused_linear_cross_entropy on), optionally narrowed
    by liger_kernel_config."""
    key = "use_liger_kernel" if "use_liger_kernel" in data else "use_liger"
    if not truthy(data.get(key, False)):
        return
    config = data.get("liger_kernel_config") or {}
    if not truthy(config.get("fused_linear_cross_entropy", True)):
        imp.mapped.append(f"{key} = true with liger_kernel_config.fused_linear_cross_entropy = false: the loss "
                          "stays the stack's")
    else:
        imp.set(key, data[key], "train", "loss", "liger")
    off = [k for k in ("rms_norm", "rope", "swiglu") if not truthy(config.get(k, True))]
    if not off:
        imp.set(key, data[key], "train", "block_kernels", "liger")
    elif len(off) < 3:
        imp.warnings.append(f"{key} with liger_kernel_config {', '.join(k + ' = false' for k in off)}: podkit prices "
                            "Liger's block kernels all or none, so the blocks are priced as transformers' modules "
                            "(high when nothing is checkpointed)")


# Where a decoder's layers sit in the module tree peft walks: a causal LM (LlamaForCausalLM: model.layers),
# a vision/audio-language model's text decoder (transformers >= 4.52 Gemma3ForConditionalGeneration,
# Mistral3..., model.language_model.layers; Voxtral and older Llava, language_model.model.layers; Idefics3 /
# SmolVLM, model.text_model.layers). axolotl's multimodal examples write their regexes against these.
DECODER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers",
                 "model.text_model.layers")


def _targets(imp: Imported, key: str, value: Any) -> Any:
    """peft target_modules: a list of module-name suffixes, "all-linear", or a regex matched with
    re.fullmatch against each module's full name (peft tuners_utils.check_target_module_exists)."""
    if value is None:
        return "stack"
    if isinstance(value, str):
        if value == "all-linear":
            return "all-linear"
        try:
            names = [n for n in stacks.LLAMA_LINEARS
                     if any(re.fullmatch(value, f"{layers}.0.{'self_attn' if n[0] in 'qkvo' else 'mlp'}.{n}")
                            for layers in DECODER_PATHS)]
        except re.error as exc:
            raise ConfigError(f"{imp.path.name}: {key}", f"{value!r} is not a valid regular expression ({exc})",
                              "fix the pattern, or list the module names") from None
        if not names:
            raise ConfigError(f"{imp.path.name}: {key}", f"the pattern {value!r} matches no Llama-style linear",
                              "list the module names, e.g. [\"q_proj\", \"v_proj\"]")
        imp.warnings.append(f"{key} pattern {value!r} read as {names} (matched against Llama module names)")
        return names
    return [str(v).split(".")[-1] for v in value]


def _lora(imp: Imported, path: Path, data: dict, prefix: str = "") -> None:
    rkey = f"{prefix}r" if prefix else "r"
    imp.set(rkey, data["r"], "train", "lora_rank", integer(path, rkey, data["r"]))
    tkey = f"{prefix}target_modules" if prefix else "target_modules"
    imp.set(tkey, data.get("target_modules"), "train", "lora_targets", _targets(imp, tkey, data.get("target_modules")))
    if data.get("lora_dropout") is not None:
        imp.set("lora_dropout", data["lora_dropout"], "train", "lora_dropout", real(path, "lora_dropout", data["lora_dropout"]))


def read_peft(path: Path, data: dict) -> Imported:
    imp = Imported(path, "peft LoraConfig")
    ptype = str(data.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise ConfigError(f"{path.name}: peft_type", f"{ptype} adapters are not modelled", "podkit models LoRA only")
    _lora(imp, path, data)
    handled = {"r", "target_modules", "lora_dropout", "peft_type"}
    if data.get("base_model_name_or_path"):
        imp.set_model("base_model_name_or_path", data["base_model_name_or_path"],
                      model_ref(data["base_model_name_or_path"], path.parent))
    handled.add("base_model_name_or_path")
    if data.get("modules_to_save"):
        imp.warnings.append(f"modules_to_save {data['modules_to_save']}: trained in full besides the adapters; "
                            "not in the prediction")
    if truthy(data.get("use_dora", False)):
        imp.warnings.append("use_dora: DoRA's magnitude vectors and weight norms are not in the prediction")
    if data.get("bias") not in (None, "none"):
        imp.warnings.append(f"bias = {data['bias']!r}: trained biases are not in the prediction")
    if data.get("layers_to_transform") is not None:
        imp.warnings.append("layers_to_transform: predicted as if every layer had adapters (an over-estimate)")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if data.get(pattern):
            imp.warnings.append(f"{pattern}: per-module ranks are not modelled; every adapter predicted at r")
    handled |= {"modules_to_save", "use_dora", "bias", "layers_to_transform", "rank_pattern", "alpha_pattern"}
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp


def _quant(imp: Imported, data: dict, double_key: str = "bnb_4bit_use_double_quant") -> None:
    if truthy(data.get("load_in_4bit", False)):
        qtype = data.get("bnb_4bit_quant_type", "fp4")  # BitsAndBytesConfig's default is fp4
        imp.set("load_in_4bit", True, "train", "base_quant", "nf4")
        if qtype != "nf4":
            imp.warnings.append(f"bnb_4bit_quant_type = {qtype!r}: stored like nf4 (4 bits + absmax per 64), "
                                "predicted as nf4")
        # BitsAndBytesConfig(bnb_4bit_use_double_quant=False) by default, unlike podkit's QLoRA default.
        dq = truthy(data.get("bnb_4bit_use_double_quant", False))
        imp.set(double_key, data.get("bnb_4bit_use_double_quant", False), "train", "double_quant", dq)
    elif truthy(data.get("load_in_8bit", False)):
        imp.set("load_in_8bit", True, "train", "base_quant", "int8")


def read_bnb(path: Path, data: dict) -> Imported:
    imp = Imported(path, "BitsAndBytesConfig")
    if isinstance(data.get("quantization_config"), dict):  # a saved model's config.json
        data = data["quantization_config"]
    method = data.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise ConfigError(f"{path.name}: quant_method", f"{method!r} is not modelled", "podkit models bitsandbytes")
    if not (truthy(data.get("load_in_4bit", False)) or truthy(data.get("load_in_8bit", False))):
        raise ConfigError(path.name, "neither load_in_4bit nor load_in_8bit is true", "nothing to quantize")
    _quant(imp, data)
    handled = {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "quant_method"}
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp
