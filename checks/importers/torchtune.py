"""A torchtune recipe config (the YAML `tune run RECIPE --config FILE` reads) -> stack "torchtune".

Read from torchtune's source, release v0.6.1 (a6290a5b) unless a line says main (bd2a0fc7, 2026-04):
recipes/lora_finetune_single_device.py, lora_finetune_distributed.py, full_finetune_single_device.py
and full_finetune_distributed.py name every key they read (`cfg.batch_size`, `cfg.get("fsdp_cpu_offload",
False)`, ...); each `_component_` is a dotted path that torchtune's config.instantiate calls with the
section's other keys as keyword arguments. Command-line overrides (`key=value` after --config) are not
in the file: checks/importers/command.py applies them onto it from `bin/preflight -- tune run ...`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from podkit.checks.errors import ConfigError
from podkit.checks.importers.imported import OPTIMIZER_CLASSES, Imported, integer, real, truthy
from podkit.checks.presets import PRESETS

# torchtune model builders (torchtune/models/<family>/_model_builders.py) -> podkit presets of the same
# shape (vocab, layers, heads, kv heads, hidden, intermediate, head_dim, tied head: checked against
# checks/presets.py). lora_<name> and qlora_<name> build the same shape (qlora_* = partial(lora_*,
# quantize_base=True)). llama3_8b/70b are Llama 3.1's shapes (only RoPE scaling and max_seq_len differ);
# llama3_3_70b is llama3_1_70b (models/llama3_3/_model_builders.py); qwen3_* are on main only (added
# eb01f076, 2025-05-20). Reward models (a 1-wide head) and Qwen2.5 32B have no preset.
BUILDERS = {
    "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b",
    "llama3_8b": "llama-3.1-8b", "llama3_70b": "llama-3.1-70b",
    "llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b", "llama3_1_405b": "llama-3.1-405b",
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b", "llama3_3_70b": "llama-3.3-70b",
    "mistral_7b": "mistral-7b",
    "gemma_2b": "gemma-2b", "gemma_7b": "gemma-7b",
    "gemma2_2b": "gemma-2-2b", "gemma2_9b": "gemma-2-9b", "gemma2_27b": "gemma-2-27b",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b_base": "qwen2.5-1.5b", "qwen2_5_1_5b_instruct": "qwen2.5-1.5b",
    "qwen2_5_3b": "qwen2.5-3b", "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "qwen2.5-7b",
    "qwen2_5_14b_base": "qwen2.5-14b", "qwen2_5_14b_instruct": "qwen2.5-14b",
    "qwen2_5_72b_base": "qwen2.5-72b", "qwen2_5_72b_instruct": "qwen2.5-72b",
    "qwen3_0_6b_base": "qwen3-0.6b", "qwen3_0_6b_instruct": "qwen3-0.6b", "qwen3_1_7b_base": "qwen3-1.7b",
    "qwen3_1_7b_instruct": "qwen3-1.7b", "qwen3_4b_base": "qwen3-4b", "qwen3_4b_instruct": "qwen3-4b",
    "qwen3_8b_base": "qwen3-8b", "qwen3_8b_instruct": "qwen3-8b", "qwen3_14b_base": "qwen3-14b",
    "qwen3_14b_instruct": "qwen3-14b", "qwen3_32b": "qwen3-32b",
}

# torchtune's attention projections (modules/peft/_utils.py LORA_ATTN_MODULES) -> podkit's linear names;
# apply_lora_to_mlp adapts FeedForward's w1/w3/w2, built from gate_proj/up_proj/down_proj
# (models/llama3/_component_builders.py lora_llama3_mlp), apply_lora_to_output the head.
ATTN_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
# The lora_* builders' own defaults (e.g. models/llama3_1/_model_builders.py lora_llama3_1_8b:
# apply_lora_to_mlp=False, apply_lora_to_output=False, lora_rank=8, lora_alpha=16, lora_dropout=0.0);
# lora_attn_modules has none.
LORA_DEFAULTS = {"lora_rank": 8, "apply_lora_to_mlp": False, "apply_lora_to_output": False}

# torchao's low-bit Adam(W) (torchao/optim/adam.py v0.18.0, formerly torchao.prototype.low_bit_optim, the
# path torchtune's docs/source/tutorials/memory_optimizations.rst names) -> podkit's torchao optimizers
# (stacks.TORCHAO_OPTIMIZERS); Adam* and AdamW* keep the same states and differ only in weight decay.
TORCHAO = {"AdamW8bit": "torchao_adamw8bit", "Adam8bit": "torchao_adamw8bit",
           "AdamW4bit": "torchao_adamw4bit", "Adam4bit": "torchao_adamw4bit",
           "AdamWFp8": "torchao_adamw_fp8", "AdamFp8": "torchao_adamw_fp8"}
TORCHAO_PREFIXES = ("torchao.optim.", "torchao.prototype.low_bit_optim.")

# Keys the recipes read that do not change GPU memory.
NOT_MEMORY = {
    "output_dir": "where outputs go", "checkpointer": "checkpoint files", "resume_from_checkpoint": "resume",
    "save_adapter_weights_only": "what is saved", "shuffle": "data order", "lr_scheduler": "LR schedule",
    "epochs": "run length", "max_steps_per_epoch": "run length", "metric_logger": "logging",
    "log_every_n_steps": "logging", "log_peak_memory_stats": "logging", "log_level": "logging",
    "profiler": "the profiler", "low_cpu_ram": "host RAM while loading", "collate_fn": "padded batches, as priced",
    "cudnn_deterministic_mode": "determinism", "enable_async_checkpointing": "checkpoint writes",
    "run_val_every_n_steps": "validation", "dataset_val": "validation", "batch_size_val": "validation",
    "tokenizer": "the tokenizer: only its max_seq_len sizes memory",
}
DISTRIBUTED_KEYS = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "tensor_parallel_dim",
                    "tensor_parallel_plan", "ac_mode", "ac_option", "data_parallel_shard_dim",
                    "data_parallel_replicate_dim", "context_parallel_dim", "context_parallel_rotate_method",
                    "enable_fp8_training", "fp8_recipe_name")


def _component(section: Any) -> str:
    return str(section.get("_component_", "")) if isinstance(section, dict) else ""


def looks_like(data: dict) -> bool:
    """A top-level section built from torchtune (`_component_: torchtune.models...`, `torchtune.modules.loss...`,
    `torchtune.datasets...`): no other kind podkit reads has `_component_` keys."""
    return any(_component(v).startswith("torchtune.") for v in data.values())


def _resolved(data: dict, value: Any) -> Any:
    """OmegaConf's whole-value interpolation `${key}` or `${a.b}`, as torchtune's configs use it."""
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{([\w.]+)\}", value.strip())
        if m:
            node: Any = data
            for part in m.group(1).split("."):
                if not isinstance(node, dict) or part not in node:
                    return value
                node = node[part]
            return node
    return value


def _resolve_all(data: dict, node: Any) -> Any:
    """Every whole-value interpolation in the config, at any depth (OmegaConf resolves them all when the recipe
    reads a key), to a fixed point so that `${a}` naming `${b}` resolves too."""
    for _ in range(8):
        if isinstance(node, dict):
            new = {k: _resolve_all(data, v) for k, v in node.items()}
        elif isinstance(node, list):
            new = [_resolve_all(data, v) for v in node]
        else:
            new = _resolved(data, node)
        if new == node:
            return node
        node = new
    return node


def read(path: Path, data: dict) -> Imported:
    imp = Imported(path, "torchtune")
    imp.set("(torchtune recipe config)", path.name, "train", "stack", "torchtune")
    data = _resolve_all(data, data)
    for key in ("batch_size", "gradient_accumulation_steps", "optimizer", "loss"):
        if key in data and data[key] is None:
            raise ConfigError(f"{path.name}: {key}", f"is null, and torchtune's recipes need it (cfg.{key})",
                              "give it a value, or remove the key to keep the recipe's")

    def get(key: str) -> Any:
        return _resolved(data, data.get(key))

    handled = {"model", "dataset", "batch_size", "gradient_accumulation_steps", "dtype", "optimizer",
               "optimizer_in_bwd", "loss", "enable_activation_checkpointing", "enable_activation_offloading",
               "compile", "clip_grad_norm", "seed", "device", *DISTRIBUTED_KEYS}
    _model(imp, path, data.get("model"))
    for key, job_key in (("batch_size", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        if get(key) is not None:
            imp.set(key, data[key], "train", job_key, integer(path, key, get(key)))
    _seq_len(imp, path, data)
    _precision(imp, path, get("dtype"), "dtype" in data)
    _optimizer(imp, path, get("optimizer"), truthy(get("optimizer_in_bwd") or False))
    if "optimizer_in_bwd" in data and not truthy(get("optimizer_in_bwd") or False):
        imp.ignore("optimizer_in_bwd", "false: the step after backward, as podkit prices it")
    _loss(imp, get("loss"))
    _activations(imp, data)
    if truthy(get("compile") or False):
        imp.warnings.append("compile: True (torch.compile of the model and loss) is not modelled: predicted eager, "
                            "which torchtune's configs say uses more memory")
    elif "compile" in data:
        imp.ignore("compile", "false: eager, as podkit prices it")
    clip = get("clip_grad_norm")
    if "clip_grad_norm" in data:
        # recipes: `if self._clip_grad_norm is not None: clip_grad_norm_(...)`; null clips nothing.
        imp.set("clip_grad_norm", clip, "train", "grad_clip", 0.0 if clip is None else real(path, "clip_grad_norm", clip))
    if get("seed") is not None:
        imp.set("seed", data["seed"], "smoke", "seed", integer(path, "seed", get("seed")))
    elif "seed" in data:
        imp.ignore("seed", "null: a random seed")
    device = get("device")
    if device is not None and str(device) != "cuda":
        imp.warnings.append(f"device: {device!r}: podkit predicts CUDA GPU memory")
    elif "device" in data:
        imp.ignore("device", "cuda, as podkit predicts")
    _cluster(imp, data)
    if "dataset" in data:
        imp.ignore("dataset", "the data: its packed flag is read with tokenizer.max_seq_len")
    for key in data:
        if key in NOT_MEMORY:
            imp.ignore(key, NOT_MEMORY[key])
        elif key not in handled:
            imp.ignore(key, "not a key torchtune's recipes read for memory")
    return imp


def _model(imp: Imported, path: Path, model: Any) -> None:
    if not isinstance(model, dict) or not _component(model):
        raise ConfigError(f"{path.name}: model", "has no _component_ (every torchtune recipe builds its model from one)",
                          "set model._component_, e.g. torchtune.models.llama3_1.lora_llama3_1_8b")
    ref = _component(model)
    builder = ref.rsplit(".", 1)[-1]
    lora = builder.startswith(("lora_", "qlora_"))
    base = re.sub(r"^q?lora_", "", builder)
    preset = BUILDERS.get(base) if ref.startswith("torchtune.models.") else None
    if preset is None:
        # Not an error of the file: --model names the shape (build_job refuses a file with no model then).
        imp.unresolved["model.preset"] = (f"no podkit preset for model._component_ {ref!r} (known torchtune builders, "
                                          "each also as lora_ / qlora_: " + ", ".join(BUILDERS) + "): give --model PRESET")
    else:
        imp.set_model("model._component_", ref, {"preset": preset})
    handled = {"_component_"}
    if "tie_word_embeddings" in model:
        handled.add("tie_word_embeddings")
        # A builder ties its head as its preset does (BUILDERS maps shapes, tying included).
        if preset and PRESETS[preset].tie_embeddings and not truthy(model["tie_word_embeddings"]):
            imp.warnings.append(f"model.tie_word_embeddings: false: an untied head is not modelled for {preset}; "
                                "predicted tied (vocab x hidden parameters low)")
    if truthy(model.get("use_dora", False)):
        imp.warnings.append("model.use_dora: DoRA's magnitude vectors and weight norms are not modelled: predicted as "
                            "LoRA (low)")
    handled.add("use_dora")
    if lora:
        handled |= _lora(imp, path, model)
        quantize = builder.startswith("qlora_") or truthy(model.get("quantize_base", False))
        handled.add("quantize_base")
        if quantize:
            _qlora(imp, builder, model)
    else:
        extra = [k for k in model if k.startswith(("lora_", "apply_lora")) or k == "quantize_base"]
        if extra:
            raise ConfigError(f"{path.name}: model.{extra[0]}", f"is a LoRA argument, and {builder} builds the full "
                              "model (torchtune would refuse the keyword)", f"use lora_{builder}, or remove it")
    for key in model:
        if key not in handled:
            imp.ignore(f"model.{key}", "a builder argument podkit does not model")


def _lora(imp: Imported, path: Path, model: dict) -> set[str]:
    """lora_rank, lora_dropout and the targets of a lora_* / qlora_* builder."""
    if "lora_attn_modules" not in model:
        raise ConfigError(f"{path.name}: model.lora_attn_modules", "is missing, and torchtune's lora builders require "
                          "it", "e.g. lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']")
    rank = model.get("lora_rank", LORA_DEFAULTS["lora_rank"])
    rank = integer(path, "model.lora_rank", rank)
    if rank < 1:
        raise ConfigError(f"{path.name}: model.lora_rank", f"must be at least 1, got {rank}", "e.g. 8")
    # The builder fixes the rank when the file is silent: a default another file could override would
    # price a LoRA model as another job.
    imp.set("model.lora_rank" + ("" if "lora_rank" in model else " (the builder's default)"), rank,
            "train", "lora_rank", rank)
    if "lora_dropout" in model:
        imp.set("model.lora_dropout", model["lora_dropout"], "train", "lora_dropout",
                real(path, "model.lora_dropout", model["lora_dropout"]))
    attn = model["lora_attn_modules"]
    if not isinstance(attn, list) or not attn or not all(isinstance(m, str) for m in attn):
        raise ConfigError(f"{path.name}: model.lora_attn_modules", f"must be a non-empty list of names, got {attn!r}",
                          "e.g. ['q_proj', 'v_proj']; known: " + ", ".join(ATTN_TARGETS))
    unknown = [m for m in attn if m not in ATTN_TARGETS]
    if unknown:
        raise ConfigError(f"{path.name}: model.lora_attn_modules", f"{unknown[0]!r} is not an attention projection "
                          "torchtune adapts", "known: " + ", ".join(ATTN_TARGETS))
    targets = [ATTN_TARGETS[m] for m in attn]
    mlp = truthy(model.get("apply_lora_to_mlp", LORA_DEFAULTS["apply_lora_to_mlp"]))
    output = truthy(model.get("apply_lora_to_output", LORA_DEFAULTS["apply_lora_to_output"]))
    targets += MLP_TARGETS * mlp + ["lm_head"] * output
    imp.set("model.lora_attn_modules/apply_lora_to_mlp/apply_lora_to_output", f"{attn}/{mlp}/{output}",
            "train", "lora_targets", list(dict.fromkeys(targets)))
    imp.ignore("model.lora_alpha", "scales the update only")
    return {"lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "lora_alpha", "lora_dropout"}


def _qlora(imp: Imported, builder: str, model: dict) -> None:
    # modules/peft/lora.py LoRALinear(quantize_base=True) and modules/low_precision/nf4_linear.py
    # FrozenNF4Linear: torchao's to_nf4(weight), block_size 64, scaler_block_size 256 (torchao
    # dtypes/nf4tensor.py v0.10.0: 4-bit codes, an int8 scaler per 64 weights, a bf16 factor per 256
    # scalers): 0.516 B per weight, bitsandbytes' nf4 with double quantization. Every block linear is
    # quantized (the unadapted ones as FrozenNF4Linear); the embedding and the output head are not
    # (models/llama3_1/_component_builders.py lora_llama3_1: "The final output linear projection is not
    # supported for quantization"), as podkit's torchtune stack prices them (quantize_head off).
    # LinearNF4 saves only the NF4 weight for backward, not its input.
    key = "model._component_" if builder.startswith("qlora_") else "model.quantize_base"
    imp.set(key, builder if key == "model._component_" else model.get("quantize_base"), "train", "base_quant", "nf4")
    imp.sections["train"]["double_quant"] = True
    imp.mapped.append(f"{key} -> train.double_quant = True (torchao NF4Tensor: int8 scalers per 64 weights)")
    imp.warnings.append("QLoRA: torchtune quantizes with torchao's NF4Tensor, not bitsandbytes; the bytes are "
                        "the same (nf4, double-quantized scalers), but podkit's package check names bitsandbytes")


def _seq_len(imp: Imported, path: Path, data: dict) -> None:
    tokenizer = data.get("tokenizer") if isinstance(data.get("tokenizer"), dict) else {}
    datasets = data.get("dataset")
    datasets = datasets if isinstance(datasets, list) else [datasets] if isinstance(datasets, dict) else []
    packed = any(truthy(d.get("packed", False)) for d in datasets if isinstance(d, dict))
    seq = _resolved(data, tokenizer.get("max_seq_len"))
    if seq is None:
        if packed:
            # datasets/_alpaca.py (and every SFT builder): "PackedDataset requires a max_seq_len to be set
            # on the tokenizer."
            raise ConfigError(f"{path.name}: dataset.packed", "is true and tokenizer.max_seq_len is null: torchtune "
                              "refuses to pack without a length", "set tokenizer.max_seq_len, e.g. 4096")
        imp.unresolved["train.seq_len"] = ("tokenizer.max_seq_len is null: torchtune truncates nothing, so a batch "
                                           "is as long as the longest sample in it (the data decides)")
        return
    imp.set("tokenizer.max_seq_len", tokenizer["max_seq_len"], "train", "seq_len",
            integer(path, "tokenizer.max_seq_len", seq))
    if packed:
        imp.mapped.append("dataset.packed = True: every sequence is packed to tokenizer.max_seq_len")
    else:
        imp.warnings.append("tokenizer.max_seq_len is the maximum: without dataset.packed, batches are padded to "
                            "their longest sample and shorter ones use less")


def _precision(imp: Imported, path: Path, dtype: Any, present: bool) -> None:
    """Recipes build the model under training.set_default_dtype(get_dtype(cfg.dtype)) with no autocast, and the
    optimizer keeps its states in the parameters' dtype: pure bf16 (training/precision.py; recipes'
    docstrings: "When dtype=bf16, all activations, gradients and optimizer states are in bfloat16")."""
    if dtype is None:
        # training/precision.py get_dtype: "None defaults to float32"
        if present:
            imp.set("dtype", None, "train", "precision", "fp32")
        else:
            imp.default("dtype", None, "train", "precision", "fp32")
        return
    if dtype in ("bf16", "fp32"):
        imp.set("dtype", dtype, "train", "precision", {"bf16": "bf16", "fp32": "fp32"}[dtype])
    elif dtype == "fp16":
        raise ConfigError(f"{path.name}: dtype", "fp16 is refused by torchtune's recipes (\"fp16 precision is not "
                          "supported in this recipe\")", "use dtype: bf16, or fp32")
    else:
        raise ConfigError(f"{path.name}: dtype", f"unknown value {dtype!r}", "one of bf16 | fp32 (torchtune's "
                          "training/precision.py)")


def _optimizer(imp: Imported, path: Path, opt: Any, in_bwd: bool) -> None:
    if in_bwd:
        imp.warnings.append("optimizer_in_bwd: each parameter steps and frees its gradient during backward: not "
                            "modelled; predicted with every gradient held until the step (high for a full fine-tune)")
    if not isinstance(opt, dict):
        return
    name = _component(opt)
    handled = {"_component_"}
    offloaded = name.endswith(".CPUOffloadOptimizer") and name.startswith(TORCHAO_PREFIXES)
    if offloaded:
        # torchao optim/cpu_offload.py: optimizer states and the step on the CPU; the base optimizer is
        # optimizer_class (default torch.optim.AdamW, made fused=True); offload_gradients frees GPU grads.
        imp.set("optimizer._component_", name, "cluster", "offload", "optimizer")
        handled |= {"optimizer_class", "offload_gradients"}
        base = str(opt.get("optimizer_class", "torch.optim.AdamW"))
        if truthy(opt.get("offload_gradients", False)):
            imp.warnings.append("optimizer.offload_gradients: gradients leave the GPU as backward makes them: not "
                                "modelled (high)")
        name = base
    mapped = OPTIMIZER_CLASSES.get(name)
    short = name.rsplit(".", 1)[-1]
    if mapped is None and name.startswith(TORCHAO_PREFIXES) and short in TORCHAO:
        mapped = TORCHAO[short]
        handled |= {"block_size", "amsgrad"}
        if "block_size" in opt:  # the class's own default otherwise (stacks.LowBitAdam.block)
            imp.set("optimizer.block_size", opt["block_size"], "train", "optimizer_block",
                    integer(path, "optimizer.block_size", opt["block_size"]))
        if truthy(opt.get("amsgrad", False)):
            imp.warnings.append(f"optimizer.amsgrad: {short} keeps a third low-bit state (max_exp_avg_sq): not "
                                "modelled (low by a half of the states)")
    if mapped is None:
        imp.ignore(f"optimizer._component_ = {name!r}", "no podkit optimizer of that kind: train.optimizer keeps its "
                   "value; known: " + ", ".join(OPTIMIZER_CLASSES) + ", torchao " + ", ".join(TORCHAO))
    else:
        imp.set("optimizer._component_", name, "train", "optimizer", mapped)
    if name in ("torch.optim.AdamW", "torch.optim.Adam"):
        handled |= {"fused", "foreach"}
        # torch/optim/optimizer.py _default_to_fused_or_foreach: foreach on CUDA unless fused=True is
        # asked for; foreach=False is the per-tensor loop. CPUOffloadOptimizer asks for fused.
        if truthy(opt.get("fused", offloaded)):
            impl = "fused"
        elif opt.get("foreach") is False:
            impl = "for-loop"
        else:
            impl = "foreach"
        imp.set("optimizer.fused/foreach", f"{opt.get('fused')}/{opt.get('foreach')}", "train", "optimizer_impl", impl)
    if name == "torch.optim.SGD":
        handled.add("momentum")
        if not opt.get("momentum"):
            imp.warnings.append("torch.optim.SGD without momentum keeps no state; podkit's sgd prices a momentum "
                                "buffer (high)")
    for key, job_key in (("lr", "lr"), ("weight_decay", "weight_decay")):
        handled.add(key)
        if key in opt:
            imp.set(f"optimizer.{key}", opt[key], "train", job_key, real(path, f"optimizer.{key}", opt[key]))
    for key in opt:
        if key not in handled:
            imp.ignore(f"optimizer.{key}", "does not change memory")


def _loss(imp: Imported, loss: Any) -> None:
    name = _component(loss)
    if not name:
        return
    chunks = loss.get("num_output_chunks", 8) if isinstance(loss, dict) else 8
    if name == "torchtune.modules.loss.CEWithChunkedOutputLoss":
        # modules/loss/ce_chunked_output_loss.py: the recipe sets the model's num_output_chunks to the
        # loss's (default 8); each chunk's logits are upcast and cross-entropied.
        imp.set("loss._component_", name, "train", "loss", "chunked")
    elif name == "torchtune.modules.loss.LinearCrossEntropyLoss":
        # main: modules/loss/cross_entropy_loss.py: the head runs inside the loss, chunk by chunk (8), on
        # the tokens that are not ignored only, each chunk's logits upcast.
        imp.set("loss._component_", name, "train", "loss", "chunked")
        imp.warnings.append("LinearCrossEntropyLoss: priced as CEWithChunkedOutputLoss's chunks; it makes one chunk's "
                            "logits at a time and drops ignored tokens first (a little lower)")
    elif name in ("torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss"):
        # modules/transformer.py TransformerDecoder.unembed: without output chunks `self.output(h).float()`,
        # and the recipe's cross-entropy on those fp32 logits; `del logits` before backward.
        imp.set("loss._component_", name, "train", "loss", "fp32-upcast")
        return
    else:
        imp.ignore(f"loss._component_ = {name!r}", "not modelled (distillation and preference losses): priced as "
                   "torchtune's chunked cross-entropy")
        return
    if chunks != 8:
        imp.warnings.append(f"loss.num_output_chunks = {chunks}: podkit prices torchtune's 8 chunks")


def _activations(imp: Imported, data: dict) -> None:
    ac = data.get("enable_activation_checkpointing")
    mode = data.get("ac_mode")
    if "enable_activation_checkpointing" in data:
        # training/memory.py set_activation_checkpointing(auto_wrap_policy={TransformerSelfAttentionLayer}):
        # each decoder layer recomputed whole.
        imp.set("enable_activation_checkpointing", ac, "train", "checkpointing", "full" if truthy(ac) else "none")
    else:
        imp.default("enable_activation_checkpointing", False, "train", "checkpointing", "none")  # cfg.get(..., False)
    if mode is not None and truthy(ac):
        # full_finetune_distributed.py _setup_model: `if (not enable_activation_checkpointing) and (ac_mode is
        # not None)` applies selective AC, `if enable_activation_checkpointing and ac_mode is None` the per-layer
        # one: with both set, neither runs.
        imp.set("enable_activation_checkpointing + ac_mode", f"{ac} + {mode}", "train", "checkpointing", "none")
        imp.warnings.append("enable_activation_checkpointing and ac_mode are both set: torchtune's distributed recipes "
                            "then checkpoint nothing (each branch wants the other unset); predicted without "
                            "checkpointing. Drop one of them")
    if mode is not None and not truthy(ac):
        # full_finetune_distributed.py: ac_mode/ac_option apply only without enable_activation_checkpointing
        # (training/activations.py apply_selective_activation_checkpointing: "full" wraps every layer, as
        # does "selective" every 1st (or 0th) layer; "none" wraps none).
        option = data.get("ac_option")
        if mode == "full" or (mode == "selective" and str(option) in ("0", "1")):
            imp.set("ac_mode/ac_option", f"{mode}/{option}", "train", "checkpointing", "full")
        elif mode == "none":
            imp.set("ac_mode", mode, "train", "checkpointing", "none")
        else:
            imp.warnings.append(f"ac_mode {mode!r} / ac_option {option!r}: selective checkpointing is not modelled "
                                "for torchtune; predicted without it (high)")
    if truthy(data.get("enable_activation_offloading") or False):
        imp.warnings.append("enable_activation_offloading: the checkpointed layers' inputs go to the CPU "
                            "(training/_activation_offloading.py): podkit has no key for it; predicted on the GPU (high)")
    elif "enable_activation_offloading" in data:
        imp.ignore("enable_activation_offloading", "false")


def _cluster(imp: Imported, data: dict) -> None:
    """The YAML does not name its recipe. Keys only the distributed recipes read (lora_ and
    full_finetune_distributed.py: fsdp_cpu_offload, fsdp_reshard_after_forward, custom_sharded_layers,
    tensor parallel, ac_mode) mark it distributed: FSDP2 fully_shard on every decoder layer and the
    root (training/_distributed.py shard_model), reshard_after_forward True by default (FULL_SHARD,
    podkit's zero3; False is SHARD_GRAD_OP, zero2)."""
    present = [k for k in DISTRIBUTED_KEYS if k in data]
    if not present:
        imp.unresolved["cluster.gpus_per_node"] = (
            "the file does not say its recipe: one GPU for the *_single_device recipes; for a *_distributed one give "
            "--config with cluster.gpus_per_node = N and sharding = \"zero3\" (FSDP2 fully_shard)")
        return
    reshard = data.get("fsdp_reshard_after_forward", True)
    imp.set(f"{', '.join(present)} (a distributed recipe): fsdp_reshard_after_forward", reshard, "cluster",
            "sharding", "zero3" if truthy(reshard) else "zero2")
    if truthy(data.get("fsdp_cpu_offload") or False):
        # CPUOffloadPolicy: parameters, gradients and optimizer states on the CPU, the step there too.
        imp.set("fsdp_cpu_offload", True, "cluster", "offload", "all")
    tp = data.get("tensor_parallel_dim", 1)
    if tp not in (None, 1):
        imp.warnings.append(f"tensor_parallel_dim = {tp}: tensor parallelism is not modelled; predicted as FSDP over "
                            "every GPU (high)")
    if data.get("custom_sharded_layers"):
        imp.warnings.append(f"custom_sharded_layers {data['custom_sharded_layers']}: their own FSDP units are not "
                            "modelled (the embedding and head gathered with the root: a little high)")
    # main's distributed recipes: ParallelDims(dp_replicate=data_parallel_replicate_dim (1),
    # dp_shard=data_parallel_shard_dim (-1: inferred from the world), cp=context_parallel_dim (1), tp=...).
    replicate, cp = data.get("data_parallel_replicate_dim", 1), data.get("context_parallel_dim", 1)
    if replicate not in (None, 1):
        imp.warnings.append(f"data_parallel_replicate_dim = {replicate}: HSDP shards over data_parallel_shard_dim "
                            "GPUs only, not modelled; predicted as sharded over every GPU (low): set "
                            "cluster.gpus_per_node to the shard group's size")
    if cp not in (None, 1):
        imp.warnings.append(f"context_parallel_dim = {cp}: context parallelism splits each sequence, not modelled; "
                            "predicted with whole sequences on every GPU (high)")
    if truthy(data.get("enable_fp8_training") or False):
        imp.warnings.append("enable_fp8_training: float8 linears (torchao) are not modelled; predicted in the job's "
                            "precision")
    degrees = [data.get(k, d) for k, d in (("data_parallel_shard_dim", -1), ("data_parallel_replicate_dim", 1),
                                           ("tensor_parallel_dim", 1), ("context_parallel_dim", 1))]
    if all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in degrees):
        world = degrees[0] * degrees[1] * degrees[2] * degrees[3]
        imp.set("data_parallel_shard_dim x replicate x tensor x context", "x".join(map(str, degrees)), "cluster",
                "gpus_per_node", world)
        return
    imp.unresolved["cluster.gpus_per_node"] = ("a distributed recipe shards over the processes `tune run "
                                               "--nproc_per_node N` starts, which the file does not say")
