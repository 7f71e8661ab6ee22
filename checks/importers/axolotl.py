"""An axolotl YAML (axolotl docs/config-reference.qmd; src/axolotl/utils/schemas/config.py): axolotl
runs the HF Trainer with peft and bitsandbytes, so it maps onto stack "hf" (or "deepspeed")."""

from __future__ import annotations

from pathlib import Path

from podkit.checks.importers import hf
from podkit.checks.importers.imported import Imported, integer, map_optimizer, model_ref, precision_from_flags, real, truthy

MARKS = ("base_model", "sequence_len", "micro_batch_size", "lora_target_linear")


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
    # axolotl loads the model in cfg.torch_dtype (bfloat16 when bf16 is true or auto: src/axolotl/loaders/
    # model.py _set_device_map_config, model_kwargs["torch_dtype"]): bf16 weights, no fp32 masters, so
    # podkit's pure "bf16" (peft still keeps adapters in fp32).
    precision_from_flags(imp, data)
    if imp.sections["train"].get("precision") == "bf16-mixed":
        imp.set("bf16 (axolotl loads the weights in bf16)", data.get("bf16"), "train", "precision", "bf16")
    handled |= {"bf16", "fp16", "tf32"}
    if data.get("optimizer"):
        map_optimizer(imp, "optimizer", str(data["optimizer"]))
    handled.add("optimizer")
    hf._checkpointing(imp, data)
    handled |= {"gradient_checkpointing", "gradient_checkpointing_kwargs"}
    for key, kind in (("flash_attention", "flash-attn"), ("sdp_attention", "sdpa"), ("eager_attention", "eager")):
        handled.add(key)
        if truthy(data.get(key, False)):
            imp.set(key, True, "train", "attention", kind)
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
    if ds:
        imp.set("deepspeed", ds, "train", "stack", "deepspeed")
        linked = Path(str(ds)).expanduser()
        if linked.is_absolute() or (path.parent / linked).exists():
            imp.linked.append((linked if linked.is_absolute() else path.parent / linked, None))
        else:
            imp.warnings.append(f"deepspeed {ds!r} not found beside {path.name} (axolotl ships deepspeed_configs/ "
                                "in its repo): give it with --from")
    else:
        imp.set("(axolotl)", path.name, "train", "stack", "hf")
    handled |= {"fsdp", "fsdp_config"}
    if data.get("fsdp"):
        hf._fsdp(imp, data["fsdp"], None)
        cfg = data.get("fsdp_config") or {}
        if truthy(cfg.get("fsdp_offload_params", False)):
            imp.set("fsdp_config.fsdp_offload_params", True, "cluster", "offload", "all")
        if truthy(cfg.get("fsdp_activation_checkpointing", False)):
            imp.set("fsdp_config.fsdp_activation_checkpointing", True, "train", "checkpointing", "full")
    handled |= _plugins(imp, data)
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp


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
