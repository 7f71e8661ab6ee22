"""A litgpt YAML (`litgpt finetune lora|finetune_full|pretrain --config FILE`) -> stack "litgpt".

litgpt's CLI (jsonargparse) reads the file as the keyword arguments of one script's setup(), so its keys
say which script runs it: lora_* only exist in finetune/lora.py, resume only in finetune/full.py and
pretrain.py, model_name / model_config only in pretrain.py. Read at litgpt v0.5.13 (Lightning-AI/litgpt
26857050fe3f, which requires lightning >= 2.6.1): litgpt/finetune/lora.py, full.py, adapter.py,
pretrain.py, args.py TrainArgs, utils.py, config.py; lightning 2.6 fabric/connector.py and
plugins/precision/{half,amp,fsdp,bitsandbytes}.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from podkit.checks.errors import ConfigError
from podkit.checks.importers.imported import OPTIMIZER_CLASSES, Imported, integer, model_ref, real, truthy

LORA_FLAGS = ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head")
# Which podkit (Llama) module names each flag adapts: lora.py Config.lora_* -> CausalSelfAttention's fused
# qkv (LoRAQKVLinear with enable_lora [q, k, v]), attn.proj, LLaMAMLP fc_1/fc_2/proj (gate, up, down) and
# GPT.lm_head (litgpt/lora.py).
LORA_TARGETS = {"lora_query": ("q_proj",), "lora_key": ("k_proj",), "lora_value": ("v_proj",),
                "lora_projection": ("o_proj",), "lora_mlp": ("gate_proj", "up_proj", "down_proj"),
                "lora_head": ("lm_head",)}
# finetune/lora.py setup() defaults (lora_query and lora_value on).
LORA_DEFAULTS = {"lora_r": 8, "lora_dropout": 0.05, "lora_query": True, "lora_key": False, "lora_value": True,
                 "lora_projection": False, "lora_mlp": False, "lora_head": False}
# The TrainArgs each script's setup() passes by default; jsonargparse fills the keys a file leaves out
# from it: finetune/lora.py and full.py TrainArgs(global_batch_size=16, micro_batch_size=1, ...),
# pretrain.py TrainArgs(global_batch_size=512, micro_batch_size=4, max_norm=1.0, tie_embeddings=False, ...).
TRAIN_DEFAULTS = {"finetune": {"global_batch_size": 16, "micro_batch_size": 1, "lr_warmup_steps": 100},
                  "pretrain": {"global_batch_size": 512, "micro_batch_size": 4, "lr_warmup_steps": 2000,
                               "max_norm": 1.0, "tie_embeddings": False}}
# Lightning Fabric precision strings (fabric/connector.py): -true converts the module to that dtype
# (HalfPrecision, torch.float16 for 16-true: no fp32 copy, no GradScaler), -mixed autocasts over fp32
# weights (MixedPrecision, 16-mixed with a GradScaler).
PRECISIONS = {"bf16-true": "bf16", "16-true": "fp16", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
              "32-true": "fp32"}
# quantize -> (base_quant, double_quant): lightning BitsandbytesPrecision modes (plugins/precision/
# bitsandbytes.py _NF4Linear compress_statistics=False, _NF4DQLinear True; fp4 alike).
QUANTIZE = {"bnb.nf4": ("nf4", False), "bnb.nf4-dq": ("nf4", True), "bnb.fp4": ("nf4", False),
            "bnb.fp4-dq": ("nf4", True)}
# litgpt checkpoint / config names whose Hub id is not a podkit preset's repo, -> (preset of that shape,
# display name). litgpt/config.py: "Meta-Llama-3.1-8B" etc. (hf_config org meta-llama), "tiny-llama-1.1b"
# (TinyLlama-1.1B: hidden 2048, 22 layers, 32 heads, 4 kv, ffn 5632, vocab 32000), "micro-llama-300M".
NAMES: dict[str, tuple[str, str]] = {
    # (The Hub ids meta-llama/Meta-Llama-3.1-* resolve through presets.HUB_ALIASES; litgpt's bare names here.)
    "meta-llama-3.1-8b": ("llama-3.1-8b", ""), "meta-llama-3.1-70b": ("llama-3.1-70b", ""),
    "meta-llama-3.1-405b": ("llama-3.1-405b", ""),
    "meta-llama/meta-llama-3-8b": ("llama-3.1-8b", "Meta-Llama-3-8B"), "meta-llama-3-8b": ("llama-3.1-8b", "Meta-Llama-3-8B"),
    "llama-3.2-1b": ("llama-3.2-1b", ""), "llama-3.2-3b": ("llama-3.2-3b", ""),
    "llama-3.1-8b": ("llama-3.1-8b", ""), "llama-2-7b-hf": ("llama-2-7b", ""), "llama-2-13b-hf": ("llama-2-13b", ""),
    "mistral-7b-v0.1": ("mistral-7b", ""), "unsloth/mistral-7b-v0.2": ("mistral-7b", "Mistral-7B-v0.2"),
    "mistral-7b-v0.2": ("mistral-7b", "Mistral-7B-v0.2"), "gemma-2b": ("gemma-2b", ""), "gemma-7b": ("gemma-7b", ""),
}
EXPLICIT = {
    "tinyllama/tinyllama-1.1b-intermediate-step-1431k-3t": dict(name="TinyLlama-1.1B", hidden=2048, layers=22,
                                                                heads=32, kv_heads=4, ffn=5632, vocab=32000),
    "tiny-llama-1.1b": dict(name="TinyLlama-1.1B", hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000),
    "micro-llama-300m": dict(name="micro-llama-300M", hidden=1024, layers=12, heads=16, kv_heads=4, ffn=5632,
                             vocab=32000),
}
# litgpt Config fields that change memory but have no podkit key (litgpt/config.py; model.py Block, CausalSelfAttention).
CONFIG_UNMODELLED = {
    "bias": "biases on every linear are not modelled (a little low)",
    "parallel_residual": "attention and MLP run side by side on one norm's output (model.py Block); priced as "
                         "sequential blocks",
    "shared_attention_norm": "one norm for attention and MLP; priced as two",
}
# setup() keys that do not change memory, and why.
NOT_MODELLED = {
    "out_dir": "where checkpoints go", "data": "the dataset (its longest sample bounds seq_len)",
    "eval": "validation runs under no_grad, below the training step", "log": "logger settings",
    "logger_name": "logger", "access_token": "a Hub token", "resume": "resuming restores the same state",
    "initial_checkpoint_dir": "weights to start from", "tokenizer_dir": "the tokenizer",
    "lora_alpha": "scales the adapters' output; no memory",
}
TRAIN_NOT_MODELLED = {
    "save_interval": "checkpoint cadence", "log_interval": "logging cadence", "epochs": "run length",
    "max_tokens": "run length", "max_steps": "run length", "max_time": "run length",
    "lr_warmup_fraction": "schedule shape", "min_lr": "schedule floor (podkit decays to lr / 10)",
}


def _put(imp: Imported, given: bool, their_key: str, value: Any, section: str, key: str, job_value: Any) -> None:
    """A value the file gives is set; one the script defaults to fills only what --config and the other files
    leave open (Imported.default)."""
    (imp.set if given else imp.default)(their_key, value, section, key, job_value)


def looks_like(data: dict) -> bool:
    train = data.get("train")
    return (isinstance(train, dict) and any(k in train for k in ("micro_batch_size", "global_batch_size"))
            and any(k in data for k in ("checkpoint_dir", "model_name", "model_config")))


def script(data: dict) -> str:
    """Which setup() the file is the arguments of (see the module docstring)."""
    if any(k in data for k in ("model_name", "model_config", "initial_checkpoint_dir", "tokenizer_dir")):
        return "pretrain"
    if any(k in data for k in ("lora_r", "lora_alpha", "lora_dropout", *LORA_FLAGS)) or data.get("quantize"):
        return "lora"
    return "full"


def read(path: Path, data: dict, kind: str = "") -> Imported:
    """`kind` ("lora", "full", "pretrain"): the script, where the command names it (`litgpt finetune_full`);
    else it follows from the file's keys (script)."""
    imp = Imported(path, "litgpt")
    named, kind = bool(kind), kind or script(data)
    imp.set("(litgpt " + {"lora": "finetune lora", "full": "finetune_full", "pretrain": "pretrain"}[kind] + ")",
            path.name, "train", "stack", "litgpt")
    if kind == "lora" and not named and not any(k.startswith("lora_") for k in data):
        imp.warnings.append("quantize without lora_* keys: read as `litgpt finetune lora` with its defaults "
                            "(finetune_adapter takes quantize too; adapters are not modelled)")
    if kind == "full" and not named and "resume" not in data:
        imp.warnings.append("no lora_* keys and no resume: read as `litgpt finetune_full`; for `litgpt finetune` "
                            "(LoRA by default) add lora_r")
    handled = {"precision", "quantize", "devices", "num_nodes", "train", "optimizer", "seed",
               "checkpoint_dir", "model_name", "model_config", *LORA_DEFAULTS, "lora_alpha"}
    train = data.get("train") or {}
    if not isinstance(train, dict):
        raise ConfigError(f"{path.name}: train", f"must be a mapping of TrainArgs, got {train!r}")
    given = train
    # An explicit null stays None (jsonargparse), a missing key takes the script's default.
    train = {**TRAIN_DEFAULTS["pretrain" if kind == "pretrain" else "finetune"], **given}
    _model(imp, path, data, kind, train)
    precision = _precision(imp, path, data, kind)
    world = _cluster(imp, path, data, kind, precision)
    _batch(imp, path, train, given, kind, world, "devices" in data or "num_nodes" in data)
    _train_ignored(imp, given)
    if kind == "lora":
        _lora(imp, path, data)
    else:
        # full.py and pretrain.py call model(input_ids) with no lm_head_chunk_size: the whole logits
        # tensor exists, and chunked_cross_entropy only splits the cross-entropy (utils.py), on logits
        # Fabric has cast to fp32 (checks/stacks.py LOSSES "native").
        imp.set("(litgpt full logits)", kind, "train", "loss", "native")
    if kind == "pretrain":
        imp.warnings.append("pretrain.py runs torch.compile(model): podkit prices eager PyTorch (compiled kernels "
                            "usually keep less)")
    _optimizer(imp, path, data, kind)
    if data.get("seed") is not None:
        imp.set("seed", data["seed"], "smoke", "seed", integer(path, "seed", data["seed"]))
    # litgpt's CausalSelfAttention calls F.scaled_dot_product_attention (litgpt/model.py).
    imp.set("(litgpt attention)", "scaled_dot_product_attention", "train", "attention", "sdpa")
    for key in data:
        if key in NOT_MODELLED:
            imp.ignore(key, NOT_MODELLED[key])
        elif key not in handled:
            imp.ignore(key)
    return imp


def _model(imp: Imported, path: Path, data: dict, kind: str, train: dict) -> None:
    config = data.get("model_config")
    if isinstance(config, dict) and config:
        dims = _dims_from_config(imp, path, config, train)
        if dims:
            imp.set_model("model_config", config.get("name") or "(inline)", dims)
        if "model_name" in data:  # pretrain.py setup: Config.from_name(model_name) only when model_config is None
            imp.ignore("model_name", "model_config gives the model")
        return
    if "model_config" in data:
        imp.ignore("model_config", "empty: model_name names the model")
    key = "model_name" if kind == "pretrain" else "checkpoint_dir"
    ref = data.get(key)
    if not ref:
        if kind != "pretrain":
            raise ConfigError(f"{path.name}: checkpoint_dir", "is missing (litgpt finetune needs the base model)",
                              "set checkpoint_dir: checkpoints/<org>/<name>")
        imp.unresolved["model.preset"] = "model_name is empty"
        return
    ref = str(ref)
    local = Path(ref).expanduser()
    local = local if local.is_absolute() else path.parent / local
    if (local / "model_config.yaml").is_file():
        # A downloaded/converted checkpoint: litgpt builds GPT from its model_config.yaml (lora.py
        # Config.from_file(checkpoint_dir / "model_config.yaml")).
        import yaml

        try:
            config = yaml.safe_load((local / "model_config.yaml").read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path.name}: {key}", f"cannot read {local / 'model_config.yaml'}: {exc}") from None
        dims = _dims_from_config(imp, path, config if isinstance(config, dict) else {}, train)
        if dims:
            imp.set_model(key, ref, dims)
        return
    # checkpoints/<org>/<name> is where `litgpt download <org>/<name>` puts a model (utils.py
    # auto_download_checkpoint / extend_checkpoint_dir); the rest is the Hub id.
    hub = ref[len("checkpoints/"):] if ref.startswith("checkpoints/") else ref
    name = hub.lower()
    if name in EXPLICIT or name.split("/")[-1] in EXPLICIT:
        dims = dict(EXPLICIT.get(name) or EXPLICIT[name.split("/")[-1]], tie_embeddings=bool(train.get("tie_embeddings")))
        imp.set_model(key, ref, dims)
        return
    hit = NAMES.get(name) or NAMES.get(name.split("/")[-1])
    if hit:
        preset, display = hit
    else:
        try:
            found = model_ref(hub, path.parent)
        except ConfigError:
            found = {}
        if "preset" not in found:
            imp.unresolved["model.preset"] = (f"{key} {ref!r} is no podkit preset (litgpt builds its own GPT from its "
                                              "config.py entry)")
            return
        preset, display = found["preset"], ""
    imp.set_model(key, ref, _untied(imp, preset, display, tie=bool(train.get("tie_embeddings"))))


def _untied(imp: Imported, preset: str, display: str, tie: bool = False) -> dict[str, Any]:
    """A preset as litgpt builds it: litgpt's GPT has its own lm_head, and convert_hf_checkpoint copies a tied
    embedding into it (scripts/convert_hf_checkpoint.py copy_weights_hf_llama: `state_dict["lm_head.weight"]
    = state_dict["transformer.wte.weight"]`), so a tied model trains two matrices. Explicit dimensions say
    so where they describe the preset fully."""
    from podkit.checks.models import preset as shape_of

    shape = shape_of(preset)
    if (shape.tie_embeddings == tie) and not display:
        return {"preset": preset}
    plain = not (shape.moe or shape.mla or shape.vision or shape.qk_norm or shape.fused_proj or shape.o_bias
                 or shape.mlp_bias or shape.logit_softcap or shape.attn_softcap or shape.norms_per_layer != 2
                 or shape.arch != "llama")
    if not plain:
        imp.warnings.append(f"{preset}: litgpt keeps a separate lm_head ({shape.vocab} x {shape.hidden}) that the "
                            "preset ties to the embedding: predicted tied (an under-estimate)")
        return {"preset": preset}
    if shape.family == "gemma":
        imp.warnings.append(f"{preset} as explicit Llama-style dimensions (an untied lm_head): Gemma's GeGLU and "
                            "scaled embeddings are priced as SwiGLU's (the same three matrices)")
    dims = {"name": display or f"{preset} (litgpt, untied lm_head)", "hidden": shape.hidden, "layers": shape.layers,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "ffn": shape.ffn, "vocab": shape.vocab,
            "tie_embeddings": tie}
    if shape.head_dim and shape.head_dim != shape.hidden // shape.heads:
        dims["head_dim"] = shape.head_dim
    if shape.qkv_bias:
        dims["qkv_bias"] = True
    return dims


def _dims_from_config(imp: Imported, path: Path, config: dict, train: dict) -> dict[str, Any]:
    """pretrain.py's inline model_config (litgpt/config.py Config) as explicit dimensions, where it is a
    Llama-style model (RMSNorm, LLaMAMLP/GemmaMLP, no experts)."""
    where = f"{path.name}: model_config"
    if (config.get("mlp_class_name", "GptNeoxMLP") not in ("LLaMAMLP", "GemmaMLP")
            or config.get("norm_class_name", "LayerNorm") != "RMSNorm" or config.get("n_expert")):
        imp.unresolved["model.preset"] = (f"model_config {config.get('name', '')!r} is not a Llama-style model "
                                          "(Config defaults to GptNeoxMLP and LayerNorm)")
        return {}
    n = {k: integer(path, f"model_config.{k}", config[k]) for k in
         ("n_embd", "n_layer", "n_head", "n_query_groups", "intermediate_size", "padded_vocab_size", "vocab_size",
          "padding_multiple", "head_size") if config.get(k) is not None}
    missing = [k for k in ("n_embd", "n_layer", "intermediate_size") if k not in n]
    if missing:
        raise ConfigError(where, f"gives no {', '.join(missing)}", "give the model's dimensions, or model_name")
    heads = n.get("n_head", 32)  # Config defaults: n_head 32, vocab_size 50254 padded to a multiple of 512
    vocab = n.get("padded_vocab_size") or -(-n.get("vocab_size", 50254) // n.get("padding_multiple", 512)) \
        * n.get("padding_multiple", 512)
    dims = {"name": str(config.get("name") or "litgpt model_config"), "hidden": n["n_embd"], "layers": n["n_layer"],
            "heads": heads, "kv_heads": n.get("n_query_groups", heads), "ffn": n["intermediate_size"],
            "vocab": vocab, "tie_embeddings": bool(train.get("tie_embeddings"))}
    if n.get("head_size") and n["head_size"] != n["n_embd"] // heads:
        dims["head_dim"] = n["head_size"]
    if truthy(config.get("attn_bias", False)):
        dims["qkv_bias"] = True
    read = {"name", "mlp_class_name", "norm_class_name", "n_expert", "attn_bias", *n}
    for key, why in CONFIG_UNMODELLED.items():
        if truthy(config.get(key, False)):
            imp.warnings.append(f"model_config.{key} = {config[key]!r}: {why}")
            read.add(key)
    for key in config:
        if key not in read:
            imp.ignore(f"model_config.{key}", "not modelled")
    return dims


def _precision(imp: Imported, path: Path, data: dict, kind: str) -> str:
    value = data.get("precision")
    quantize = data.get("quantize")
    for key, given in (("precision", value), ("quantize", quantize)):
        if given is not None and not isinstance(given, str):
            raise ConfigError(f"{path.name}: {key}", f"must be a string, got {given!r}",
                              "e.g. precision: bf16-true, quantize: bnb.nf4")
    if value is None:
        # utils.py get_default_supported_precision(training=True): bf16-mixed where the GPU has bf16,
        # 16-mixed where it does not (T4, V100).
        value = "bf16-mixed"
        imp.default("precision", "bf16-mixed (get_default_supported_precision)", "train", "precision", "bf16-mixed")
        imp.warnings.append("precision unset: litgpt picks bf16-mixed, or 16-mixed on a GPU without bf16 (T4, V100)")
    elif value not in PRECISIONS:
        raise ConfigError(f"{path.name}: precision", f"unknown litgpt precision {value!r}",
                          "one of " + ", ".join(PRECISIONS))
    else:
        imp.set("precision", value, "train", "precision", PRECISIONS[value])
    if quantize is None:
        if "quantize" in data:
            imp.set("quantize", None, "train", "base_quant", "none")
        return value
    if quantize == "bnb.int8-training":
        # lightning _Linear8bitLt keeps bnb's has_fp16_weights=True: fp16 weights, int8 only inside the
        # matmul; BitsandbytesPrecision refuses int8 modes with any dtype but float16.
        if value != "16-true":
            raise ConfigError(f"{path.name}: quantize", "bnb.int8-training works only with precision 16-true "
                              "(lightning BitsandbytesPrecision)", "set precision: 16-true, or another quantize")
        imp.ignore("quantize = 'bnb.int8-training'", "its layers keep fp16 weights; priced as a 16-bit base")
        return value
    if quantize not in QUANTIZE:
        raise ConfigError(f"{path.name}: quantize", f"unknown value {quantize!r}",
                          "one of " + ", ".join([*QUANTIZE, "bnb.int8-training"]))
    if "mixed" in value:
        # finetune/lora.py setup: `raise ValueError("Quantization and mixed precision is not supported.")`.
        raise ConfigError(f"{path.name}: quantize", f"litgpt refuses quantization with {value} precision",
                          "set precision: bf16-true")
    base, dq = QUANTIZE[quantize]
    imp.set("quantize", quantize, "train", "base_quant", base)
    imp.set("quantize", quantize, "train", "double_quant", dq)
    if quantize.startswith("bnb.fp4"):
        imp.warnings.append(f"quantize {quantize}: fp4 is stored like nf4 (4 bits + an absmax per 64), priced as nf4")
    return value


def _devices(imp: Imported, path: Path, data: dict, kind: str) -> int | None:
    """devices as utils.py parse_devices reads it: a positive count, or -1 / 'auto' for every GPU torch sees
    (pretrain.py's default; the finetune scripts default to 1)."""
    value = data.get("devices", "auto" if kind == "pretrain" else 1)
    if value in (-1, "auto"):
        imp.unresolved["cluster.gpus_per_node"] = f"devices = {value!r} (litgpt uses every GPU torch sees)"
        return None
    count = integer(path, "devices", value)
    if count < 1:
        raise ConfigError(f"{path.name}: devices", f"must be 'auto' or a positive integer, got {value!r}")
    _put(imp, "devices" in data, "devices", value, "cluster", "gpus_per_node", count)
    return count


def _cluster(imp: Imported, path: Path, data: dict, kind: str, precision: str) -> int | None:
    """GPUs, and the strategy each script builds for more than one (devices * num_nodes > 1)."""
    devices = _devices(imp, path, data, kind)
    nodes = integer(path, "num_nodes", data.get("num_nodes", 1))
    if nodes < 1:
        raise ConfigError(f"{path.name}: num_nodes", f"must be a positive integer, got {nodes}")
    if "num_nodes" in data:
        imp.set("num_nodes", data["num_nodes"], "cluster", "nodes", nodes)
    if devices is None:
        imp.warnings.append("devices 'auto': with more than one GPU litgpt shards with FSDP; give devices to "
                            "predict that")
        return None
    world = devices * nodes
    given = "devices" in data or "num_nodes" in data
    if world == 1:
        _put(imp, given, "devices x num_nodes", 1, "cluster", "sharding", "none")
        _put(imp, given, "(litgpt, one GPU: strategy 'auto')", "no checkpointing", "train", "checkpointing", "none")
        return world
    if data.get("quantize"):
        raise ConfigError(f"{path.name}: quantize", "litgpt does not quantize for multi-GPU training",
                          "set devices: 1 and num_nodes: 1, or drop quantize")
    if kind == "lora":
        # lora.py (>= 0.5.11): ModelParallelStrategy(parallelize_fn): checkpoint_wrapper on every Block, then
        # fully_shard (FSDP2) on each Block and trainable Linear and on the root, with no MixedPrecisionPolicy.
        if precision == "16-mixed":
            raise ConfigError(f"{path.name}: precision", "lightning's ModelParallelStrategy refuses 16-mixed "
                              "(fabric/connector.py)", "use bf16-true, bf16-mixed, 16-true or 32-true")
        imp.set("devices x num_nodes", world, "cluster", "sharding", "zero3")
        imp.set("(lora.py parallelize_fn: fully_shard)", world, "cluster", "fsdp_version", 2)
        imp.set("(lora.py parallelize_fn: checkpoint_wrapper per Block)", world, "train", "checkpointing", "full")
        if precision == "bf16-mixed":
            imp.warnings.append("bf16-mixed over several GPUs: lora.py's fully_shard has no MixedPrecisionPolicy, so "
                                "it gathers fp32 weights and autocasts; podkit prices sharded -mixed as gathered in "
                                "bf16 (an under-estimate)")
    elif kind == "full":
        # full.py / adapter.py: FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
        # with FULL_SHARD; lightning >= 2.6.0 (#21361) gathers bf16-mixed in bf16 (plugins/precision/fsdp.py).
        imp.set("devices x num_nodes", world, "cluster", "sharding", "zero3")
        imp.set("(FSDPStrategy activation_checkpointing_policy={Block})", world, "train", "checkpointing", "full")
    else:
        # pretrain.py: FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD"), no checkpointing.
        imp.set("devices x num_nodes", world, "cluster", "sharding", "zero3")
        imp.set("(pretrain.py FSDPStrategy: no activation checkpointing)", world, "train", "checkpointing", "none")
        if nodes > 1:
            imp.warnings.append("HYBRID_SHARD shards within a node and replicates across nodes: podkit shards over "
                                "every GPU (an under-estimate)")
    return world


def _batch(imp: Imported, path: Path, train: dict, given: dict, kind: str, world: int | None,
           devices_given: bool) -> None:
    micro = integer(path, "train.micro_batch_size", train["micro_batch_size"])
    glob = integer(path, "train.global_batch_size", train["global_batch_size"])
    for key, value in (("micro_batch_size", micro), ("global_batch_size", glob)):
        if value < 1:
            raise ConfigError(f"{path.name}: train.{key}", f"must be at least 1, got {value}")
    _put(imp, "micro_batch_size" in given, "train.micro_batch_size", micro, "train", "micro_batch", micro)
    batch_given = devices_given or any(k in given for k in ("micro_batch_size", "global_batch_size"))
    if world is not None:
        # args.py TrainArgs.gradient_accumulation_iters: (global // (devices * num_nodes)) // micro, floored.
        accum = glob // world // micro
        if accum < 1:
            raise ConfigError(f"{path.name}: train.global_batch_size", f"{glob} is less than micro_batch_size "
                              f"{micro} x {world} GPUs (litgpt asserts gradient_accumulation_iters > 0)")
        _put(imp, batch_given, "train.global_batch_size", glob, "train", "grad_accum", accum)
        _put(imp, batch_given, "train.global_batch_size", glob, "train", "global_batch", glob)
    else:
        imp.unresolved["train.grad_accum"] = (f"train.global_batch_size = {glob}: // (devices x num_nodes) // "
                                              "micro_batch_size needs devices")
    seq = train.get("max_seq_length")
    if seq is None:
        why = ("train.max_seq_length is unset: litgpt trains at the data's longest sample "
               "(fit(): model.max_seq_length = longest sequence)" if kind != "pretrain" else
               "train.max_seq_length is unset: pretrain uses the model's block_size")
        imp.unresolved["train.seq_len"] = why
    else:
        imp.set("train.max_seq_length", seq, "train", "seq_len", integer(path, "train.max_seq_length", seq))
        if kind != "pretrain":
            imp.warnings.append("train.max_seq_length is a cap: litgpt pads each batch to its longest sample, "
                                "so the peak is that of the longest batch, at most this")
    if train.get("lr_warmup_steps") is not None:
        _put(imp, "lr_warmup_steps" in given, "train.lr_warmup_steps", train["lr_warmup_steps"], "train", "warmup_steps",
                integer(path, "train.lr_warmup_steps", train["lr_warmup_steps"]))
    max_norm = train.get("max_norm")
    if kind == "pretrain":
        if max_norm is None:  # pretrain.py validate_args requires it
            raise ConfigError(f"{path.name}: train.max_norm", "litgpt pretrain requires it", "set e.g. max_norm: 1.0")
        imp.set("train.max_norm", max_norm, "train", "grad_clip", real(path, "train.max_norm", max_norm))
    else:
        for key in ("max_norm", "tie_embeddings"):
            if train.get(key) is not None:  # validate_args lists both as unsupported
                raise ConfigError(f"{path.name}: train.{key}", "litgpt's finetune scripts refuse it (validate_args)",
                                  "leave it empty")
        imp.set("train.max_norm (the finetune scripts never clip)", None, "train", "grad_clip", 0.0)
    if kind == "pretrain":
        # pretrain.py main: `if train.tie_embeddings: model.transformer.wte.weight = model.lm_head.weight`.
        tied = bool(train.get("tie_embeddings"))
        imp.mapped.append(f"train.tie_embeddings = {train.get('tie_embeddings')!r} -> model.tie_embeddings = {tied!r}")
    elif "tie_embeddings" in train:
        imp.ignore("train.tie_embeddings", "empty, as the finetune scripts require")


def _train_ignored(imp: Imported, given: dict) -> None:
    handled = {"micro_batch_size", "global_batch_size", "max_seq_length", "lr_warmup_steps", "max_norm",
               "tie_embeddings"}
    for key in given:
        if key in TRAIN_NOT_MODELLED:
            imp.ignore(f"train.{key}", TRAIN_NOT_MODELLED[key])
        elif key not in handled:
            imp.ignore(f"train.{key}")


def _lora(imp: Imported, path: Path, data: dict) -> None:
    get = {k: data.get(k) if data.get(k) is not None else v for k, v in LORA_DEFAULTS.items()}
    rank = integer(path, "lora_r", get["lora_r"])
    if rank < 1:
        raise ConfigError(f"{path.name}: lora_r", f"must be positive, got {rank}")
    _put(imp, "lora_r" in data, "lora_r", get["lora_r"], "train", "lora_rank", rank)
    targets = [name for flag in LORA_FLAGS if truthy(get[flag]) for name in LORA_TARGETS[flag]]
    if not targets:
        raise ConfigError(path.name, "every lora_* flag is false, so nothing trains", "set lora_query: true")
    _put(imp, any(f in data for f in LORA_FLAGS), ", ".join(LORA_FLAGS), [f for f in LORA_FLAGS if truthy(get[f])],
         "train", "lora_targets", targets)
    _put(imp, "lora_dropout" in data, "lora_dropout", get["lora_dropout"], "train", "lora_dropout",
         real(path, "lora_dropout", get["lora_dropout"]))


def _optimizer(imp: Imported, path: Path, data: dict, kind: str) -> None:
    value = data.get("optimizer", "AdamW")  # every setup() defaults to "AdamW"
    given = "optimizer" in data
    if isinstance(value, str):
        class_path, init = (value if "." in value else f"torch.optim.{value}"), {}
    elif isinstance(value, dict) and value.get("class_path"):
        class_path, init = str(value["class_path"]), value.get("init_args") or {}
        if not isinstance(init, dict):
            raise ConfigError(f"{path.name}: optimizer.init_args", f"must be a mapping of keyword arguments, got "
                              f"{init!r}", "e.g. init_args: {lr: 0.0002, weight_decay: 0.0}")
    else:
        raise ConfigError(f"{path.name}: optimizer", f"must be a class name or a class_path/init_args mapping, "
                          f"got {value!r}")
    if str(data.get("quantize") or "") in QUANTIZE:
        # lora.py: with BitsandbytesPrecision, utils.py instantiate_bnb_optimizer builds bnb.optim.PagedAdamW
        # (32-bit states, paged) from the AdamW's init_args, and refuses any other class.
        if "AdamW" not in class_path:
            raise ConfigError(f"{path.name}: optimizer", f"litgpt quantized fine-tuning supports only AdamW, got "
                              f"{class_path!r}", "use torch.optim.AdamW")
        _put(imp, given, "optimizer (quantize: bnb.optim.PagedAdamW)", class_path, "train", "optimizer", "paged_adamw")
    elif class_path in OPTIMIZER_CLASSES:  # utils.py instantiate_torch_optimizer: a bare name is torch.optim's
        _put(imp, given, "optimizer", class_path, "train", "optimizer", OPTIMIZER_CLASSES[class_path])
        if class_path == "torch.optim.SGD" and not init.get("momentum"):
            imp.warnings.append("SGD without momentum keeps no state; podkit prices SGD with momentum (an over-estimate)")
        if OPTIMIZER_CLASSES[class_path] in ("adamw", "sgd"):
            # pretrain.py passes fused=(device is cuda) to utils.py instantiate_torch_optimizer, which updates
            # init_args with it (a file's fused: false is overridden); the finetune scripts pass nothing: torch
            # picks foreach on CUDA (torch/optim/optimizer.py _default_to_fused_or_foreach).
            impl = ("fused" if kind == "pretrain" or truthy(init.get("fused", False))
                    else "for-loop" if init.get("foreach") is False else "foreach")
            _put(imp, given, "optimizer" + (" (pretrain.py: fused=True on CUDA)" if kind == "pretrain" else ""),
                 class_path, "train", "optimizer_impl", impl)
    else:
        imp.ignore(f"optimizer = {class_path!r}", "no podkit optimizer of that class: train.optimizer keeps its "
                   "value; known: " + ", ".join(OPTIMIZER_CLASSES))
    for key, job_key in (("lr", "lr"), ("weight_decay", "weight_decay")):
        if init.get(key) is not None:
            imp.set(f"optimizer.init_args.{key}", init[key], "train", job_key,
                    real(path, f"optimizer.init_args.{key}", init[key]))
    for key in init:
        if key not in ("lr", "weight_decay", "fused", "foreach", "momentum"):
            imp.ignore(f"optimizer.init_args.{key}", "no memory" if key in ("betas", "eps") else "")
