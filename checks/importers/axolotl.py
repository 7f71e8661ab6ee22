"""An axolotl YAML (axolotl docs/config-reference.qmd; src/axolotl/utils/schemas/config.py): axolotl
runs the HF Trainer with peft and bitsandbytes, so it maps onto stack "hf" (or "deepspeed")."""

from __future__ import annotations

from pathlib import Path

from podkit.checks.errors import ConfigError
from podkit.checks.importers import hf
from podkit.checks.importers.imported import (Imported, integer, linked_path, map_optimizer, model_ref,
                                              precision_from_flags, real, truthy)

MARKS = ("base_model", "sequence_len", "micro_batch_size", "lora_target_linear")
# src/axolotl/utils/schemas/enums.py LEGACY_ATTN_FLAG_TO_IMPL, in its priority order.
LEGACY_ATTN_FLAGS = {"xformers_attention": "xformers", "sage_attention": "sage", "flex_attention": "flex_attention",
                     "flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager"}


def looks_like(data: dict) -> bool:
    return any(k in data for k in MARKS)


def read(path: Path, data: dict) -> Imported:
    imp = Imported(path, "axolotl")
    handled = set()

    def take(key: str, section: str, job_key: str, convert) -> None:
        handled.add(key)
        if data.get(key) is not None:
            imp.set(key, data[key], section, job_key, convert(data[key]))

    if data.get("base_model"):
        imp.set_model("base_model", data["base_model"], model_ref(str(data["base_model"]), path.parent))
    handled |= {"base_model", "base_model_config", "model_type", "tokenizer_type"}
    take("micro_batch_size", "train", "micro_batch", lambda v: integer(path, "micro_batch_size", v))
    take("gradient_accumulation_steps", "train", "grad_accum", lambda v: integer(path, "gradient_accumulation_steps", v))
    take("sequence_len", "train", "seq_len", lambda v: integer(path, "sequence_len", v))
    take("learning_rate", "train", "lr", lambda v: real(path, "learning_rate", v))
    take("warmup_steps", "train", "warmup_steps", lambda v: integer(path, "warmup_steps", v))
    take("weight_decay", "train", "weight_decay", lambda v: real(path, "weight_decay", v))
    take("max_grad_norm", "train", "grad_clip", lambda v: real(path, "max_grad_norm", v))
    take("seed", "smoke", "seed", lambda v: integer(path, "seed", v))
    if data.get("sequence_len") and not truthy(data.get("sample_packing", False)):
        imp.warnings.append("sequence_len is the maximum: without sample_packing, shorter batches use less")
    handled.add("sample_packing")
    # axolotl loads the model in cfg.torch_dtype (bfloat16 when bf16 is true or auto, float16 for fp16:
    # src/axolotl/loaders/model.py _set_device_map_config, model_kwargs["torch_dtype"]): 16-bit weights, no
    # fp32 masters, so podkit's pure "bf16" / "fp16" (peft still keeps adapters in fp32).
    _precision(imp, data)
    handled |= {"bf16", "fp16", "tf32", "bfloat16", "float16", "float32"}
    if data.get("optimizer"):
        if map_optimizer(imp, "optimizer", str(data["optimizer"]), data.get("optim_args")):
            handled.add("optim_args")
    handled.add("optimizer")
    _checkpointing(imp, data)
    handled |= {"gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading"}
    # axolotl >= 0.16 names the kernel in attn_implementation; its legacy boolean flags map onto it, the
    # first set one of LEGACY_ATTN_FLAG_TO_IMPL winning (utils/schemas/config.py normalize_attn_implementation,
    # enums.py), and a file with both is refused there.
    handled |= {"attn_implementation", *LEGACY_ATTN_FLAGS}
    if data.get("attn_implementation"):
        hf.attention(imp, "attn_implementation", data["attn_implementation"])
    else:
        flag = next((f for f in LEGACY_ATTN_FLAGS if truthy(data.get(f) or False)), None)
        if flag:
            hf.attention(imp, flag, data[flag], LEGACY_ATTN_FLAGS[flag])
    adapter = data.get("adapter")
    handled |= {"adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
                "load_in_4bit", "load_in_8bit", "lora_modules_to_save"}
    if adapter in ("lora", "qlora"):
        targets = "all-linear" if truthy(data.get("lora_target_linear", False)) else data.get("lora_target_modules")
        hf._lora(imp, path, {"r": data.get("lora_r", 8), "target_modules": targets,
                             "lora_dropout": data.get("lora_dropout", 0.0)}, prefix="lora_")
        if data.get("lora_modules_to_save"):
            imp.warnings.append(f"lora_modules_to_save {data['lora_modules_to_save']}: trained in full; not predicted")
    elif adapter:
        imp.ignore(f"adapter = {adapter!r}", "only lora and qlora adapters are modelled")
    # src/axolotl/loaders/model.py _set_quantization_config: adapter qlora with load_in_4bit -> nf4 with
    # double quantization; adapter lora with load_in_8bit -> int8; nothing else quantizes.
    if adapter == "qlora" and truthy(data.get("load_in_4bit", False)):
        hf._quant(imp, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
                  double_key="adapter qlora (axolotl: double quant)")
    elif adapter == "lora" and truthy(data.get("load_in_8bit", False)):
        hf._quant(imp, {"load_in_8bit": True})
    elif truthy(data.get("load_in_4bit", False)) or truthy(data.get("load_in_8bit", False)):
        imp.warnings.append(f"load_in_4bit/8bit with adapter {adapter!r}: axolotl quantizes only qlora + 4-bit and "
                            "lora + 8-bit; predicted unquantized")
    ds = data.get("deepspeed")
    handled.add("deepspeed")
    if isinstance(ds, dict) and ds:
        # utils/schemas/config.py: deepspeed: str | dict[str, Any]; a dict is the DeepSpeed config inline.
        imp.set("deepspeed", "(inline)", "train", "stack", "deepspeed")
        imp.linked.append((path, ds))
    elif ds:
        imp.set("deepspeed", ds, "train", "stack", "deepspeed")
        linked = linked_path(path, str(ds))
        if linked.exists():
            imp.linked.append((linked, None))
        else:
            imp.warnings.append(f"deepspeed {ds!r} found neither beside {path.name} nor in the working directory "
                                "(axolotl ships deepspeed_configs/ in its repo: run from there): give it with --from")
    else:
        imp.set("(axolotl)", path.name, "train", "stack", "hf")
    handled |= {"fsdp", "fsdp_config", "fsdp_version"}
    if data.get("fsdp") or data.get("fsdp_config"):
        # FSDP is on with fsdp or fsdp_config (utils/trainer.py prepare_optim_env), read as the Trainer reads
        # them (core/builders/base.py passes both on); the version is fsdp_version, else fsdp_config's
        # fsdp_version / version, else 1, which axolotl pins (utils/schemas/validation.py
        # check_fsdp_version_in_fsdp_config).
        cfg = data.get("fsdp_config") or {}
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path.name}: fsdp_config", f"must be a mapping (axolotl's FSDPConfig), got {cfg!r}",
                              "write its keys under fsdp_config:, e.g. fsdp_version: 2")
        cfg = dict(cfg)
        if data.get("fsdp_version") is not None:
            cfg["version"] = data["fsdp_version"]
        hf._fsdp(imp, data.get("fsdp") or True, cfg, (1, ""))
    handled |= _plugins(imp, data)
    for key, why in UNMODELLED.items():
        value = data.get(key)
        if value and not (isinstance(value, int) and not isinstance(value, bool) and value <= 1):
            handled.add(key)
            imp.ignore(f"{key} = {value!r}", why)
            imp.warnings.append(f"{key} = {value!r}: {why}")
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp


# Keys that change per-GPU memory and have no podkit job key (src/axolotl/utils/schemas/config.py, trl.py).
UNMODELLED = {
    "rl": "the preference / RL trainer's reference model, rollouts and extra forwards are not predicted",
    "tensor_parallel_size": "tensor parallelism is not modelled: predicted as data parallel (an over-estimate)",
    "context_parallel_size": "context parallelism is not modelled: each GPU priced with the whole sequence "
                             "(an over-estimate)",
    "expert_parallel_size": "expert parallelism is not modelled: every expert priced on each GPU (an over-estimate)",
    # utils/trainer.py setup_parallelism_envs: PARALLELISM_CONFIG_DP_SHARD_SIZE / _DP_REPLICATE_SIZE (HSDP).
    "dp_shard_size": "the FSDP shard group's size is not modelled: predicted as sharded over every GPU",
    "dp_replicate_size": "HSDP replicas are not modelled: predicted as sharded over every GPU (an under-estimate)",
    "tiled_mlp": "tiled MLP is not modelled: the MLP's activations are priced whole (an over-estimate)",
    "layer_offloading": "layer offloading to CPU is not modelled: the weights are priced on the GPU",
    "lora_mlp_kernel": "axolotl's fused LoRA kernels are not modelled: priced as peft's modules",
    "lora_qkv_kernel": "axolotl's fused LoRA kernels are not modelled: priced as peft's modules",
    "lora_o_kernel": "axolotl's fused LoRA kernels are not modelled: priced as peft's modules",
}


def _precision(imp: Imported, data: dict) -> None:
    """The weights' dtype as src/axolotl/utils/config/__init__.py resolve_dtype picks it: bf16 ("auto" is
    false beside fp16: true) or bfloat16 -> bfloat16, else load_in_8bit / fp16 / float16 (no AMP) -> float16,
    else float32; the Trainer's autocast follows bf16 or bfloat16 / fp16 (core/builders/base.py
    _configure_precision_settings)."""
    flags = dict(data)
    name = imp.path.name
    if isinstance(flags.get("bf16"), str) and flags["bf16"] != "auto":
        # utils/schemas/config.py: `bf16: Literal["auto"] | bool | None`; validate_config refuses anything else
        # (the docs' "full" included) before core/builders/base.py could read it.
        raise ConfigError(f"{name}: bf16", f"{flags['bf16']!r} is refused by axolotl's config schema (auto, true or "
                          "false)", "use bf16: true")
    if truthy(flags.get("fp16") or False) and flags.get("bf16") in ("auto", None):
        flags["bf16"] = False
    if truthy(flags.get("fp16") or False) and not flags.get("bf16") and truthy(flags.get("bfloat16") or False):
        # resolve_dtype keeps fp16, then base.py passes fp16 = True and bf16 = cfg.bf16 or cfg.bfloat16 = True,
        # which transformers' TrainingArguments refuses.
        raise ConfigError(f"{name}: fp16", "fp16 and bfloat16 are both on: axolotl gives the Trainer fp16 and bf16, "
                          "and transformers refuses that (\"At most one of fp16 and bf16 can be True\")",
                          "drop one of them")
    if not truthy(flags.get("bf16") or False) and truthy(flags.get("bfloat16") or False):
        # base.py: TrainingArguments bf16 = cfg.bf16 or cfg.bfloat16, so bfloat16 alone is bf16 autocast too.
        imp.set("bfloat16", data["bfloat16"], "train", "precision", "bf16-mixed")
        imp.loads_weights("bf16", f"bfloat16 = {data['bfloat16']!r} (axolotl loads the weights in bf16, and the "
                                  "Trainer's bf16 follows cfg.bf16 or cfg.bfloat16)")
        return
    precision_from_flags(imp, flags)
    precision = imp.sections["train"].get("precision", "fp32")
    if precision in ("bf16-mixed", "fp16-mixed"):
        flag = precision[:4]
        imp.loads_weights(flag, f"{flag} = {data.get(flag)!r} (axolotl loads the weights in {flag})")
    elif precision == "fp32":
        no_amp = next((k for k in ("bfloat16", "float16") if truthy(data.get(k) or False)), None)
        if no_amp:
            # 16-bit weights without autocast: pure 16-bit.
            imp.set(no_amp, data[no_amp], "train", "precision", {"bfloat16": "bf16", "float16": "fp16"}[no_amp])
            imp.warnings[:] = [w for w in imp.warnings if not w.startswith("neither bf16 nor fp16")]


def _checkpointing(imp: Imported, data: dict) -> None:
    """gradient_checkpointing true/false, or "offload" / "offload_disk", which axolotl reads as checkpointing
    plus activation_offloading true / "disk" (utils/schemas/validation.py check_gradient_checkpointing_w_offload)."""
    gc = data.get("gradient_checkpointing")
    offload = data.get("activation_offloading")
    if gc in ("offload", "offload_disk"):
        imp.set("gradient_checkpointing", gc, "train", "checkpointing", "full")
        offload = offload or ("disk" if gc == "offload_disk" else True)
    else:
        hf._checkpointing(imp, data)
    if offload:  # true, "legacy", "disk" or "hidden_states" (utils/schemas/config.py activation_offloading)
        # loaders/model.py: the activations go to CPU (or disk) between forward and backward; podkit has no
        # key for it, so they are priced on the GPU.
        imp.warnings.append(f"activation_offloading {offload!r}: offloaded activations are not modelled; predicted "
                            "as if they stayed on the GPU (an over-estimate)")


LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
LIGER_BLOCK_KEYS = ("liger_rms_norm", "liger_rope", "liger_glu_activation")


def _plugins(imp: Imported, data: dict) -> set[str]:
    """axolotl's Liger and Cut Cross-Entropy integrations, which act only when listed in `plugins`.
    LigerPlugin.pre_model_load (src/axolotl/integrations/liger/plugin.py) passes each liger_* flag, None
    (off) unless set, to Liger's apply_liger_kernel_to_<model_type> (liger_glu_activation as its swiglu;
    liger_swiglu is its deprecated name). CutCrossEntropyPlugin.pre_model_load applies cce_patch when
    cut_cross_entropy, True by default (integrations/cut_cross_entropy/args.py)."""
    plugins = [str(p) for p in data.get("plugins") or []]
    keys = {"plugins", "cut_cross_entropy", "liger_fused_linear_cross_entropy", "liger_swiglu",
            "liger_cross_entropy", *LIGER_BLOCK_KEYS}
    flags = dict(data)
    if "liger_swiglu" in flags and flags.get("liger_glu_activation") is None:
        flags["liger_glu_activation"] = flags["liger_swiglu"]
    if LIGER_PLUGIN in plugins:
        if truthy(flags.get("liger_fused_linear_cross_entropy") or False):
            imp.set("liger_fused_linear_cross_entropy", True, "train", "loss", "liger")
        on = [k for k in LIGER_BLOCK_KEYS if truthy(flags.get(k) or False)]
        if len(on) == len(LIGER_BLOCK_KEYS):
            imp.set(", ".join(LIGER_BLOCK_KEYS), True, "train", "block_kernels", "liger")
        elif on:
            imp.warnings.append(f"{', '.join(on)} without {', '.join(k for k in LIGER_BLOCK_KEYS if k not in on)}: "
                                "podkit prices Liger's block kernels all or none, so the blocks are priced as "
                                "transformers' modules (high when nothing is checkpointed)")
    elif any(flags.get(k) for k in keys - {"plugins", "cut_cross_entropy"}):
        imp.warnings.append(f"liger_* flags without {LIGER_PLUGIN} in plugins: axolotl applies nothing; ignored")
    if CCE_PLUGIN in plugins and truthy(data.get("cut_cross_entropy", True)):
        if imp.sections["train"].get("loss") == "liger":
            imp.warnings.append("cut_cross_entropy and liger_fused_linear_cross_entropy both on: priced as Liger's")
        else:
            imp.set("cut_cross_entropy", data.get("cut_cross_entropy", True), "train", "loss", "fused")
    for other in plugins:
        if other not in (LIGER_PLUGIN, CCE_PLUGIN):
            imp.ignore(f"plugins: {other}", "not modelled")
    return keys
