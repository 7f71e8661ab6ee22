"""An accelerate config YAML (`accelerate config` writes it; accelerate/commands/config/config_args.py
ClusterConfig: distributed_type, num_processes, num_machines, mixed_precision, fsdp_config,
deepspeed_config)."""

from __future__ import annotations

from pathlib import Path

from podkit.checks.importers import deepspeed
from podkit.checks.importers.imported import Imported, integer, linked_path, truthy

# FSDP1 sharding strategies by name or by their number (torch ShardingStrategy enum starts at 1),
# as accelerate's config writes either (utils/constants.py FSDP_SHARDING_STRATEGY).
SHARDING = {"FULL_SHARD": "zero3", "1": "zero3", "SHARD_GRAD_OP": "zero2", "2": "zero2", "NO_SHARD": "none",
            "3": "none", "HYBRID_SHARD": "zero3", "4": "zero3", "HYBRID_SHARD_ZERO2": "zero2", "5": "zero2"}


def looks_like(data: dict) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def read(path: Path, data: dict) -> Imported:
    imp = Imported(path, "accelerate config")
    handled = {"distributed_type", "num_processes", "num_machines", "mixed_precision", "fsdp_config",
               "deepspeed_config"}
    dist = str(data.get("distributed_type", "NO")).upper()
    machines = integer(path, "num_machines", data.get("num_machines", 1))
    if "num_processes" in data:
        procs = integer(path, "num_processes", data["num_processes"])  # total over every machine
        if procs % machines:
            imp.warnings.append(f"num_processes {procs} is not a multiple of num_machines {machines}")
        imp.set("num_processes", procs, "cluster", "gpus_per_node", max(1, procs // machines))
    if "num_machines" in data:
        imp.set("num_machines", machines, "cluster", "nodes", machines)
    mp = data.get("mixed_precision")
    if mp is not None:
        precision = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}.get(str(mp))
        if precision:
            imp.set("mixed_precision", mp, "train", "precision", precision)
        else:
            imp.ignore(f"mixed_precision = {mp!r}", "not modelled")
    if dist == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        if fsdp.get("fsdp_version") == 2 or str(fsdp.get("fsdp_version")) == "2":
            # FSDP2 (accelerate >= 1.6): fsdp_reshard_after_forward true = full shard, false = shard grad op.
            sharding = "zero3" if truthy(fsdp.get("fsdp_reshard_after_forward", True)) else "zero2"
            imp.set("fsdp_config.fsdp_reshard_after_forward", fsdp.get("fsdp_reshard_after_forward", True),
                    "cluster", "sharding", sharding)
            imp.set("fsdp_config.fsdp_version", 2, "cluster", "fsdp_version", 2)
        else:
            strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
            sharding = SHARDING.get(strategy, "zero3")
            imp.set("fsdp_config.fsdp_sharding_strategy", strategy, "cluster", "sharding", sharding)
        if truthy(fsdp.get("fsdp_offload_params", False)):
            imp.set("fsdp_config.fsdp_offload_params", True, "cluster", "offload",
                    "all" if sharding == "zero3" else "optimizer")
        if truthy(fsdp.get("fsdp_activation_checkpointing", False)):
            imp.set("fsdp_config.fsdp_activation_checkpointing", True, "train", "checkpointing", "full")
        for key in fsdp:
            if key not in ("fsdp_version", "fsdp_reshard_after_forward", "fsdp_sharding_strategy",
                           "fsdp_offload_params", "fsdp_activation_checkpointing"):
                imp.ignore(f"fsdp_config.{key}")
    elif dist == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        imp.set("distributed_type", dist, "train", "stack", "deepspeed")
        if ds.get("deepspeed_config_file"):
            imp.linked.append((linked_path(path, str(ds["deepspeed_config_file"])), None))
        if "zero_stage" in ds:
            # accelerate hands zero_stage to DeepSpeed's zero_optimization.stage (utils/dataclasses.py
            # DeepSpeedPlugin: "Possible options are 0,1,2,3; Default will be taken from environment variable").
            stage, sharding = deepspeed.zero_sharding(path, "deepspeed_config.zero_stage", ds["zero_stage"])
            imp.set("deepspeed_config.zero_stage", stage, "cluster", "sharding", sharding)
        if ds.get("offload_param_device") in ("cpu", "nvme"):
            imp.set("deepspeed_config.offload_param_device", ds["offload_param_device"], "cluster", "offload", "all")
        elif ds.get("offload_optimizer_device") in ("cpu", "nvme"):
            imp.set("deepspeed_config.offload_optimizer_device", ds["offload_optimizer_device"], "cluster", "offload",
                    "optimizer")
        if "gradient_accumulation_steps" in ds:
            imp.set("deepspeed_config.gradient_accumulation_steps", ds["gradient_accumulation_steps"], "train",
                    "grad_accum", integer(path, "gradient_accumulation_steps", ds["gradient_accumulation_steps"]))
        for key in ds:
            if key not in ("deepspeed_config_file", "zero_stage", "offload_param_device", "offload_optimizer_device",
                           "gradient_accumulation_steps"):
                imp.ignore(f"deepspeed_config.{key}")
    elif dist in ("NO", "MULTI_GPU"):
        imp.set("distributed_type", dist, "cluster", "sharding", "none")
    else:
        imp.ignore(f"distributed_type = {dist!r}", "not modelled (podkit models DDP, FSDP and DeepSpeed)")
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp
