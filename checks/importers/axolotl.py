"""An axolotl YAML (axolotl docs/config-reference.qmd; src/axolotl/utils/schemas/config.py): axolotl
runs the HF Trainer with peft and bitsandbytes, so it maps onto stack "hf" (or "deepspeed")."""

from __future__ import annotations

from pathlib import Path

from checks.importers import hf
from checks.importers.imported import Imported, integer, map_optimizer, model_ref, precision_from_flags, truthy

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
    take("learning_rate", "train", "lr", float)
    take("warmup_steps", "train", "warmup_steps", lambda v: integer(path, "warmup_steps", v))
    take("weight_decay", "train", "weight_decay", float)
    take("max_grad_norm", "train", "grad_clip", float)
    take("seed", "smoke", "seed", lambda v: integer(path, "seed", v))
    if data.get("sequence_len") and not truthy(data.get("sample_packing", False)):
        imp.warnings.append("sequence_len is the maximum: without sample_packing, shorter batches use less")
    handled.add("sample_packing")
    precision_from_flags(imp, data)
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
    if adapter == "qlora" or truthy(data.get("load_in_4bit", False)):
        # axolotl's qlora loads nf4 with double quantization (src/axolotl/loaders/model.py: BitsAndBytesConfig
        # bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4").
        hf._quant(imp, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
                  double_key="adapter qlora (axolotl: double quant)")
    elif truthy(data.get("load_in_8bit", False)):
        hf._quant(imp, {"load_in_8bit": True})
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
    for key in data:
        if key not in handled:
            imp.ignore(key)
    return imp
