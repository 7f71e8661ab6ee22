"""A DeepSpeed config JSON -> stack "deepspeed".

Keys as documented at deepspeed.ai/docs/config-json and read by deepspeed/runtime/config.py and
runtime/zero/config.py (DeepSpeedZeroConfig: stage, offload_optimizer, offload_param). "auto" is
the HF Trainer's placeholder, filled from TrainingArguments (transformers integrations/deepspeed.py
HfTrainerDeepSpeedConfig.trainer_config_process): it is left to the other --from files here too,
and reported when none of them sets it.
"""

from __future__ import annotations

from pathlib import Path

from podkit.checks.errors import ConfigError
from podkit.checks.importers.imported import Imported, integer, real, truthy

MARKS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer")
# What the HF Trainer fills each "auto" from (integrations/deepspeed.py trainer_config_process).
AUTO_SOURCES = {"train.micro_batch": "per_device_train_batch_size", "train.grad_accum": "gradient_accumulation_steps",
                "train.precision": "bf16 / fp16", "train.grad_clip": "max_grad_norm"}


# deepspeed/runtime/zero/config.py ZeroStageEnum: disabled 0, optimizer_states 1, gradients 2, weights 3;
# DeepSpeedZeroConfig(stage=...) refuses any other value.
ZERO_SHARDING = ("none", "zero1", "zero2", "zero3")


def zero_sharding(path: Path, key: str, value) -> tuple[int, str]:
    """A ZeRO stage as DeepSpeed reads it, and podkit's cluster.sharding for it."""
    stage = integer(path, key, value)
    if not 0 <= stage < len(ZERO_SHARDING):
        raise ConfigError(f"{path.name}: {key}", f"must be 0, 1, 2 or 3 (DeepSpeed's ZeroStageEnum), got {stage}",
                          "set the ZeRO stage you run")
    return stage, ZERO_SHARDING[stage]


def looks_like(data: dict) -> bool:
    return any(k in data for k in MARKS)


def read(path: Path, data: dict) -> Imported:
    imp = Imported(path, "DeepSpeed")
    imp.set("(DeepSpeed config)", path.name, "train", "stack", "deepspeed")
    handled = set()

    def number(key: str, section: str, job_key: str, convert=None) -> None:
        handled.add(key)
        if key not in data:
            return
        if data[key] == "auto":
            imp.unresolved[f"{section}.{job_key}"] = f"{key} = \"auto\" (the HF Trainer fills it from " \
                                                    f"{AUTO_SOURCES.get(f'{section}.{job_key}', 'TrainingArguments')})"
            return
        imp.set(key, data[key], section, job_key, (convert or integer)(path, key, data[key]))

    number("train_micro_batch_size_per_gpu", "train", "micro_batch")
    number("gradient_accumulation_steps", "train", "grad_accum")
    handled.add("train_batch_size")
    if data.get("train_batch_size") not in (None, "auto"):
        # = micro-batch x accumulation x GPUs (deepspeed runtime/config.py _batch_assertion)
        imp.set("train_batch_size", data["train_batch_size"], "train", "global_batch",
                integer(path, "train_batch_size", data["train_batch_size"]))
    number("gradient_clipping", "train", "grad_clip", real)
    # bf16 / fp16 sections: DeepSpeed keeps 16-bit module weights and an fp32 master copy in the
    # optimizer (runtime/bf16_optimizer.py, fp16/fused_optimizer.py): podkit's *-mixed under stack deepspeed.
    for name, precision in (("bf16", "bf16-mixed"), ("fp16", "fp16-mixed")):
        handled.add(name)
        section = data.get(name)
        if isinstance(section, dict) and "enabled" in section:
            if section["enabled"] == "auto":
                imp.unresolved.setdefault("train.precision", f"{name}.enabled = \"auto\" (filled from "
                                          "TrainingArguments' bf16 / fp16)")
            elif truthy(section["enabled"]):
                imp.set(f"{name}.enabled", True, "train", "precision", precision)
    zero = data.get("zero_optimization") or {}
    handled.add("zero_optimization")
    if zero:
        stage = zero.get("stage", 0)
        if stage == "auto":
            imp.unresolved["cluster.sharding"] = "zero_optimization.stage = \"auto\""
        else:
            stage, sharding = zero_sharding(path, "zero_optimization.stage", stage)
            imp.set("zero_optimization.stage", stage, "cluster", "sharding", sharding)
        opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none")
        par_dev = (zero.get("offload_param") or {}).get("device", "none")
        if par_dev in ("cpu", "nvme"):
            imp.set("zero_optimization.offload_param.device", par_dev, "cluster", "offload", "all")
        elif opt_dev in ("cpu", "nvme"):
            imp.set("zero_optimization.offload_optimizer.device", opt_dev, "cluster", "offload", "optimizer")
        if "nvme" in (opt_dev, par_dev):
            imp.warnings.append("offload to nvme: predicted as CPU offload; the host-RAM check over-counts")
        if "reduce_bucket_size" in zero:
            value = zero["reduce_bucket_size"]
            imp.set("zero_optimization.reduce_bucket_size", value, "cluster", "reduce_bucket",
                    "auto" if value == "auto" else integer(path, "zero_optimization.reduce_bucket_size", value))
        for key in zero:
            if key not in ("stage", "offload_optimizer", "offload_param", "reduce_bucket_size"):
                imp.ignore(f"zero_optimization.{key}", "buckets, prefetch and live-parameter caches are not modelled")
    # The number of GPUs is the launcher's, not the JSON's; train_batch_size, when it is a number
    # beside the micro-batch and accumulation, gives it (micro x accum x world).
    micro, accum, total = (data.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                  "train_batch_size"))
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (micro, accum, total)) \
            and total % (micro * accum) == 0:
        imp.set("train_batch_size / (micro x accum)", total, "cluster", "gpus_per_node", total // (micro * accum))
    else:
        imp.unresolved["cluster.gpus_per_node"] = "the number of GPUs is the launcher's (give --from accelerate.yaml, " \
                                                  "or --config with [cluster] gpus_per_node)"
    opt = data.get("optimizer")
    handled.add("optimizer")
    if isinstance(opt, dict):
        kind = str(opt.get("type", "")).lower()
        if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
            imp.set("optimizer.type", opt.get("type"), "train", "optimizer", "adamw")
        else:
            imp.ignore(f"optimizer.type = {opt.get('type')!r}", "not modelled: train.optimizer keeps its value")
        params = opt.get("params") or {}
        for key, job_key in (("lr", "lr"), ("weight_decay", "weight_decay")):
            if key in params and params[key] != "auto":
                imp.set(f"optimizer.params.{key}", params[key], "train", job_key, real(path, f"optimizer.params.{key}", params[key]))
    if "activation_checkpointing" in data:
        imp.ignore("activation_checkpointing", "DeepSpeed's partitioned checkpointing applies only to models that "
                   "call deepspeed.checkpointing; the Trainer's gradient_checkpointing decides train.checkpointing")
    handled.add("activation_checkpointing")
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp
