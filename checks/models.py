"""Model shapes: exact public architectures, HF config.json, explicit dimensions, or a bare size.

Every count here is derived from the shapes, never typed in: the presets' totals are checked
against the published parameter counts in tests/test_models.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from checks.errors import ConfigError, closest


@dataclass(frozen=True)
class ParamGroup:
    """`count` identical parameter tensors of shape (rows, cols); cols == 1 for vectors."""

    name: str
    rows: int
    cols: int
    count: int
    linear: bool  # a matmul weight: LoRA-adaptable, quantizable, cast by autocast
    per_layer: bool  # lives in a transformer block (sharded/gathered block by block)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def total(self) -> int:
        return self.numel * self.count


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, Llama-style (RMSNorm, RoPE, SwiGLU, GQA) or GPT-2-style."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tie_embeddings: bool
    arch: str = "llama"  # llama | gpt2
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False  # Qwen2 puts a bias on q, k and v
    positions: int = 0  # learned position embeddings (GPT-2); 0 for RoPE
    approximate: bool = False  # shapes inferred from a parameter count only
    params_override: int = 0  # the stated total when shapes are inferred

    def __post_init__(self):
        for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}", f"must be a positive integer, got {value!r}")
        if self.arch not in ("llama", "gpt2"):
            raise ConfigError("model.arch", f"unknown architecture {self.arch!r}", "use 'llama' or 'gpt2'")
        if self.heads % self.kv_heads:
            raise ConfigError(
                "model.kv_heads",
                f"{self.kv_heads} does not divide heads={self.heads}",
                "grouped-query attention needs heads to be a multiple of kv_heads",
            )
        if not self.head_dim and self.hidden % self.heads:
            raise ConfigError("model.heads", f"{self.heads} does not divide hidden={self.hidden}", "set model.head_dim")

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.d_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.d_head

    def param_groups(self) -> list[ParamGroup]:
        h, L = self.hidden, self.layers
        if self.arch == "gpt2":
            # GPT-2 (Radford et al. 2019; HF modeling_gpt2): LayerNorm with bias, fused c_attn,
            # biases on every linear, learned positions, 4h GELU MLP, tied head.
            groups = [
                ParamGroup("wte", self.vocab, h, 1, False, False),
                ParamGroup("wpe", self.positions, h, 1, False, False),
                ParamGroup("ln", h, 1, 4 * L + 2, False, True),
                ParamGroup("c_attn", h, 3 * h, L, True, True),
                ParamGroup("c_attn.bias", 3 * h, 1, L, False, True),
                ParamGroup("attn.c_proj", h, h, L, True, True),
                ParamGroup("c_fc", h, self.ffn, L, True, True),
                ParamGroup("c_fc.bias", self.ffn, 1, L, False, True),
                ParamGroup("mlp.c_proj", self.ffn, h, L, True, True),
                ParamGroup("c_proj.bias", h, 1, 2 * L, False, True),
            ]
        else:
            groups = [
                ParamGroup("embed_tokens", self.vocab, h, 1, False, False),
                ParamGroup("q_proj", h, self.q_dim, L, True, True),
                ParamGroup("k_proj", h, self.kv_dim, L, True, True),
                ParamGroup("v_proj", h, self.kv_dim, L, True, True),
                ParamGroup("o_proj", self.q_dim, h, L, True, True),
                ParamGroup("gate_proj", h, self.ffn, L, True, True),
                ParamGroup("up_proj", h, self.ffn, L, True, True),
                ParamGroup("down_proj", self.ffn, h, L, True, True),
                ParamGroup("norm", h, 1, 2 * L, False, True),
                ParamGroup("final_norm", h, 1, 1, False, False),
            ]
            if self.qkv_bias:
                groups.append(ParamGroup("qkv_bias", self.q_dim + 2 * self.kv_dim, 1, L, False, True))
        if not self.tie_embeddings:
            groups.append(ParamGroup("lm_head", self.vocab, h, 1, True, False))
        return [g for g in groups if g.total]

    @property
    def params(self) -> int:
        if self.params_override:
            return self.params_override
        return sum(g.total for g in self.param_groups())

    @property
    def params_per_layer(self) -> int:
        return sum(g.numel * g.count for g in self.param_groups() if g.per_layer) // self.layers

    @property
    def params_outside_layers(self) -> int:
        """Embeddings, final norm, LM head: FSDP's root module, kept unsharded through fwd+bwd."""
        return sum(g.total for g in self.param_groups() if not g.per_layer)

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the matmul weights inside one block: what LoRA adapts."""
        return [(g.name, g.rows, g.cols) for g in self.param_groups() if g.linear and g.per_layer]

    def lora_params(self, rank: int) -> int:
        """LoRA (Hu et al. 2021): A (in x r) and B (r x out) on every linear layer of every block."""
        return self.layers * sum(rank * (i + o) for _, i, o in self.linear_shapes())


# Published architectures, from each model's config.json on its model card.
PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("gpt2-124m", 768, 12, 12, 12, 3072, 50257, True, arch="gpt2", positions=1024),
        ModelShape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True, head_dim=64),
        ModelShape("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, True, head_dim=128),
        ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False),
        ModelShape("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, False),
        ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, False),
        ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, False),
        ModelShape("mistral-7b", 4096, 32, 32, 8, 14336, 32000, False),
        ModelShape("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True),
        ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True),
        ModelShape("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False, qkv_bias=True),
        # The smoke run's CPU default: small enough for 100 steps in seconds on 2 cores.
        ModelShape("tiny", 128, 2, 4, 2, 344, 512, True),
    ]
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        hint = closest(name, PRESETS) or "known: " + ", ".join(PRESETS)
        raise ConfigError("model.preset", f"unknown preset {name!r}", hint) from None


def from_hf_config(path: Path) -> ModelShape:
    """Read the shapes from a Hugging Face config.json (Llama, Mistral, Qwen2, GPT-2 families)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("model.hf_config", f"{path} does not exist", "give the path to a config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model.hf_config", f"cannot read {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("model.hf_config", f"{path} is not a JSON object")
    model_type = cfg.get("model_type", "")
    if model_type == "gpt2":
        keys = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "vocab": "vocab_size"}
    else:
        keys = {
            "hidden": "hidden_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "ffn": "intermediate_size",
            "vocab": "vocab_size",
        }
    missing = [v for v in keys.values() if v not in cfg]
    if missing:
        raise ConfigError(
            "model.hf_config",
            f"{path} lacks {', '.join(missing)}",
            "use the model's config.json from its Hugging Face repo, or give the dimensions explicitly",
        )
    dims = {k: cfg[v] for k, v in keys.items()}
    name = cfg.get("_name_or_path") or Path(path).parent.name or "hf-config"
    if model_type == "gpt2":
        return ModelShape(
            name, dims["hidden"], dims["layers"], dims["heads"], dims["heads"],
            cfg.get("n_inner") or 4 * dims["hidden"], dims["vocab"],
            cfg.get("tie_word_embeddings", True), arch="gpt2", positions=cfg.get("n_positions", 1024),
        )
    return ModelShape(
        name, dims["hidden"], dims["layers"], dims["heads"],
        cfg.get("num_key_value_heads") or dims["heads"], dims["ffn"], dims["vocab"],
        # transformers' PretrainedConfig defaults to tied; LlamaConfig and Qwen2Config to untied.
        bool(cfg.get("tie_word_embeddings", model_type not in ("llama", "mistral", "qwen2", "mixtral"))),
        head_dim=cfg.get("head_dim") or 0,
        qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
    )


def from_param_count(params: float, vocab: int = 32000) -> ModelShape:
    """Infer a Llama-like shape for a model known only by its size.

    Llama-family models keep hidden/layers near 128 (4096/32, 5120/40) and ffn near 8h/3, so a
    block holds about 4h^2 + 3h(8h/3) = 12h^2 parameters: solve 12 L h^2 + 2 V h = P for h with
    L = h / 128. The total reported is the stated one; activation terms are approximate.
    """
    if not isinstance(params, (int, float)) or isinstance(params, bool) or params < 1e6:
        raise ConfigError("model.params", f"must be a parameter count of at least 1e6, got {params!r}")
    lo, hi = 64.0, 65536.0
    for _ in range(100):  # bisection: the left side is increasing in h
        h = (lo + hi) / 2
        if 12 * (h / 128) * h * h + 2 * vocab * h < params:
            lo = h
        else:
            hi = h
    hidden = max(128, int(round(lo / 128)) * 128)
    layers = max(1, int(round(hidden / 128)))
    heads = hidden // 128
    ffn = int(math.ceil(8 * hidden / 3 / 256)) * 256
    return ModelShape(
        f"~{params / 1e9:.2f}B", hidden, layers, heads, heads, ffn, vocab, False,
        approximate=True, params_override=int(params),
    )
