"""The Hugging Face family: TrainingArguments / TRL SFTConfig, a peft LoRA config, bitsandbytes settings.

Keys as documented by their dataclasses: transformers src/transformers/training_args.py
(TrainingArguments), trl/trainer/sft_config.py (SFTConfig: max_length, formerly max_seq_length) and
trl/trainer/model_config.py (ModelConfig: model_name_or_path, use_peft, lora_r, load_in_4bit, ...,
which HfArgumentParser scripts read from the same file), peft src/peft/tuners/lora/config.py
(LoraConfig, saved as adapter_config.json) and transformers utils/quantization_config.py
(BitsAndBytesConfig).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from podkit.checks import stacks
from podkit.checks.errors import ConfigError
from podkit.checks.importers.imported import (Imported, integer, map_optimizer, real, model_ref, precision_from_flags,
                                       truthy)

# TrainingArguments / SFTConfig keys whose presence marks the file (any one is enough).
TRAINER_MARKS = ("per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "optim",
                 "gradient_checkpointing", "max_seq_length", "num_train_epochs", "learning_rate")
PEFT_MARKS = ("peft_type", "target_modules")
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


def _fsdp(imp: Imported, value: Any, fsdp_config: dict | None) -> None:
    """TrainingArguments.fsdp: a string or list of FSDPOption (transformers trainer_utils.py)."""
    options = value.split() if isinstance(value, str) else list(value or [])
    if not options:
        return
    if "full_shard" in options or "hybrid_shard" in options:
        sharding = "zero3"
    elif "shard_grad_op" in options or "hybrid_shard_zero2" in options:
        sharding = "zero2"
    else:
        sharding = "none"
    imp.set("fsdp", value, "cluster", "sharding", sharding)
    imp.unresolved["cluster.gpus_per_node"] = "fsdp: the number of GPUs is the launcher's (give --from " \
                                              "accelerate.yaml, or --config with [cluster] gpus_per_node)"
    if any(o.startswith("hybrid") for o in options):
        imp.warnings.append("fsdp hybrid sharding: shards within a node only; predicted as if over every GPU of a "
                            "node (set cluster.nodes = 1 for the per-node view)")
    if "offload" in options:
        imp.set("fsdp", "offload", "cluster", "offload", "all" if sharding == "zero3" else "optimizer")
    cfg = fsdp_config or {}
    if truthy(cfg.get("activation_checkpointing", False)):
        imp.set("fsdp_config.activation_checkpointing", True, "train", "checkpointing", "full")
    for key in cfg:
        if key != "activation_checkpointing":
            imp.ignore(f"fsdp_config.{key}", "wrapping and prefetch details are not modelled")


def read_trainer(path: Path, data: dict) -> Imported:
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
    if "bf16" not in data and "fp16" not in data and not data.get("torch_dtype") and not data.get("dtype"):
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
        map_optimizer(imp, "optim", str(data["optim"]))
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
            linked = Path(ds).expanduser()
            imp.linked.append((linked if linked.is_absolute() else path.parent / linked, None))
        else:
            imp.linked.append((path, ds))  # an inline DeepSpeed dict
    else:
        imp.set("(TrainingArguments)", path.name, "train", "stack", "hf")
    handled.add("deepspeed")
    if data.get("fsdp"):
        _fsdp(imp, data["fsdp"], data.get("fsdp_config"))
    handled |= {"fsdp", "fsdp_config"}
    # TRL ModelConfig / a script's ModelArguments, often in the same file.
    if data.get("model_name_or_path"):
        imp.set_model("model_name_or_path", data["model_name_or_path"], model_ref(data["model_name_or_path"], path.parent))
    handled.add("model_name_or_path")
    attn = data.get("attn_implementation")
    if attn:
        mapped = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn", "sdpa": "sdpa",
                  "eager": "eager"}.get(attn)
        if mapped:
            imp.set("attn_implementation", attn, "train", "attention", mapped)
        else:
            imp.ignore(f"attn_implementation = {attn!r}", "not a podkit attention kind")
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
    if dtype in ("bfloat16", "bf16"):
        # TRL ModelConfig.torch_dtype (dtype in trl >= 0.22): the weights are loaded in bf16, so the
        # Trainer's bf16 autocast runs over bf16 weights (no fp32 masters): podkit's pure "bf16";
        # peft still keeps adapters in fp32 (stack hf: lora_dtype fp32).
        imp.set(dtype_key, dtype, "train", "precision", "bf16")
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


def _targets(imp: Imported, key: str, value: Any) -> Any:
    """peft target_modules: a list of module-name suffixes, "all-linear", or a regex matched with
    re.fullmatch against each module's full name (peft tuners_utils.check_target_module_exists)."""
    if value is None:
        return "stack"
    if isinstance(value, str):
        if value == "all-linear":
            return "all-linear"
        names = [n for n in stacks.LLAMA_LINEARS
                 if re.fullmatch(value, f"model.layers.0.{'self_attn' if n[0] in 'qkvo' else 'mlp'}.{n}")]
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
