"""A torchtitan job TOML -> stack "torchtitan" (torchtitan/config/job_config.py: [model] name and
flavor, [training] local_batch_size (batch_size before 0.2) and seq_len, [optimizer], [activation_checkpoint]
mode and selective_ac_option, [parallelism] degrees)."""

from __future__ import annotations

from pathlib import Path

from podkit.checks.importers.imported import Imported, integer, real

# torchtitan model flavors (v0.2.2: torchtitan/models/llama3/__init__.py llama3_args, models/qwen3/__init__.py
# qwen3_args, models/deepseek_v3/__init__.py deepseekv3_args) -> podkit presets of the same shape. 8B_flex and
# 8B_varlen are 8B with another attention kernel; deepseek_v3's 16B and 236B are DeepSeek-V2-Lite and
# DeepSeek-V2 (vocab 102400, q_lora_rank 0 / 1536, 64 / 160 routed experts), its 671B DeepSeek-V3.
FLAVORS = {("llama3", "8B"): "llama-3.1-8b", ("llama3", "8B_flex"): "llama-3.1-8b",
           ("llama3", "8B_varlen"): "llama-3.1-8b", ("llama3", "70B"): "llama-3.1-70b",
           ("llama3", "405B"): "llama-3.1-405b", ("qwen3", "0.6B"): "qwen3-0.6b", ("qwen3", "1.7B"): "qwen3-1.7b",
           ("qwen3", "4B"): "qwen3-4b", ("qwen3", "8B"): "qwen3-8b", ("qwen3", "14B"): "qwen3-14b",
           ("qwen3", "32B"): "qwen3-32b", ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
           ("qwen3", "235B-A22B"): "qwen3-235b-a22b", ("deepseek_v3", "16B"): "deepseek-v2-lite",
           ("deepseek_v3", "236B"): "deepseek-v2", ("deepseek_v3", "671B"): "deepseek-v3"}


def looks_like(data: dict) -> bool:
    return "training" in data and ("parallelism" in data or "job" in data or "model" in data)


def read(path: Path, data: dict) -> Imported:
    imp = Imported(path, "torchtitan")
    imp.set("(torchtitan job)", path.name, "train", "stack", "torchtitan")
    model = data.get("model") or {}
    name, flavor = model.get("name"), model.get("flavor")
    if name or flavor:
        preset = FLAVORS.get((str(name), str(flavor)))
        if preset is None:
            # Left to --model (refused beside a file that names the model): the rest of the file still counts.
            imp.unresolved["model.preset"] = f"torchtitan {name} flavor {flavor!r} is no podkit preset (known: " \
                                             + ", ".join(f"{n} {f}" for n, f in FLAVORS) + ")"
            imp.ignore(f"model.name/flavor = {name} {flavor}", "no podkit preset of that shape: give --model PRESET")
        else:
            imp.set_model("model.name/flavor", f"{name} {flavor}", {"preset": preset})
    for key in model:
        if key not in ("name", "flavor"):
            imp.ignore(f"model.{key}")
    training = data.get("training") or {}
    for key, job_key in (("local_batch_size", "micro_batch"), ("batch_size", "micro_batch"), ("seq_len", "seq_len")):
        if key in training:
            imp.set(f"training.{key}", training[key], "train", job_key, integer(path, f"training.{key}", training[key]))
    if "max_norm" in training:
        imp.set("training.max_norm", training["max_norm"], "train", "grad_clip", real(path, "training.max_norm", training["max_norm"]))
    # FSDP's MixedPrecisionPolicy(param_dtype=mixed_precision_param, reduce_dtype=float32) over fp32
    # sharded masters: podkit's bf16-mixed (the default "bfloat16").
    mp = training.get("mixed_precision_param", "bfloat16")
    imp.set("training.mixed_precision_param", mp, "train", "precision",
            {"bfloat16": "bf16-mixed", "float16": "fp16-mixed", "float32": "fp32"}.get(mp, "bf16-mixed"))
    for key in training:
        if key not in ("local_batch_size", "batch_size", "seq_len", "max_norm", "mixed_precision_param"):
            imp.ignore(f"training.{key}")
    opt = data.get("optimizer") or {}
    if opt:
        if str(opt.get("name", "AdamW")).lower() in ("adamw", "adam"):
            imp.set("optimizer.name", opt.get("name", "AdamW"), "train", "optimizer", "adamw")
        else:
            imp.ignore(f"optimizer.name = {opt.get('name')!r}", "not modelled")
        if opt.get("implementation") in ("fused", "foreach", "for-loop"):
            imp.set("optimizer.implementation", opt["implementation"], "train", "optimizer_impl", opt["implementation"])
        for key, job_key in (("lr", "lr"), ("weight_decay", "weight_decay")):
            if key in opt:
                imp.set(f"optimizer.{key}", opt[key], "train", job_key, real(path, f"optimizer.{key}", opt[key]))
        for key in opt:
            if key not in ("name", "implementation", "lr", "weight_decay"):
                imp.ignore(f"optimizer.{key}")
    ac = data.get("activation_checkpoint") or {}
    if "mode" in ac:
        mode = ac["mode"]
        option = str(ac.get("selective_ac_option", "2"))
        if mode == "selective" and option != "op":
            # Layer SAC: every Nth block recomputed whole (parallelize.py _apply_ac_to_transformer_block).
            imp.set("activation_checkpoint.mode", f"selective/{option}", "train", "checkpointing",
                    "full" if option == "1" else "none")
            if option != "1":
                imp.warnings.append(f"layer-selective AC every {option} blocks is not modelled: predicted without "
                                    "checkpointing (an over-estimate); use selective_ac_option = \"op\" or mode = \"full\"")
        else:
            imp.set("activation_checkpoint.mode", mode, "train", "checkpointing",
                    {"none": "none", "full": "full", "selective": "selective"}.get(mode, "none"))
    par = data.get("parallelism") or {}
    degrees = {k: par.get(k, 1) for k in ("data_parallel_shard_degree", "data_parallel_replicate_degree",
                                          "tensor_parallel_degree", "pipeline_parallel_degree",
                                          "context_parallel_degree")}
    shard = degrees["data_parallel_shard_degree"]
    # -1 (the default): FSDP over every GPU the launcher gives; fully_shard reshards after forward.
    imp.set("parallelism.data_parallel_shard_degree", shard, "cluster", "sharding", "none" if shard == 1 else "zero3")
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        if degrees[key] not in (1, -1):
            imp.warnings.append(f"parallelism.{key} = {degrees[key]}: tensor/pipeline/context parallelism is not "
                                "modelled; predicted as data parallel only (an over-estimate)")
    # Expert parallelism splits the routed experts over ranks the other degrees already count (v0.2.2
    # distributed/parallel_dims.py: efsdp = dp_shard x cp x tp / (etp x ep)), so it adds no GPUs; each rank then runs its own experts on
    # tokens sent to it by all-to-all (models/moe, distributed/expert_parallel.py), which podkit does not model.
    for key in ("expert_parallel_degree", "expert_tensor_parallel_degree"):
        if par.get(key, 1) not in (1, -1):
            imp.warnings.append(f"parallelism.{key} = {par[key]}: expert parallelism is not modelled; predicted as "
                                "FSDP over every rank, each block's experts gathered whole, and without the "
                                "all-to-all token buffers")
    if all(isinstance(v, int) and v > 0 for v in degrees.values()):
        world = 1
        for v in degrees.values():
            world *= v
        imp.set("parallelism degrees", "x".join(str(v) for v in degrees.values()), "cluster", "gpus_per_node", world)
    else:
        imp.unresolved["cluster.gpus_per_node"] = "data_parallel_shard_degree = -1 (torchtitan uses every GPU " \
                                                  "torchrun gives it: NGPU)"
    for section in data:
        if section not in ("model", "training", "optimizer", "activation_checkpoint", "parallelism"):
            imp.ignore(f"[{section}]")
    return imp
