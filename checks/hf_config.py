"""Hugging Face config.json -> ModelShape, from a local file or a Hub repo id.

Each family's tensors follow transformers 5.23.0's `models/<model_type>/modeling_<model_type>.py`,
and its defaults for keys a config.json may leave out follow `configuration_<model_type>.py` of the
same release. The keys that fix the size (hidden, layers, heads, intermediate, vocabulary, experts)
must be in the file: transformers would fill them with its defaults, which here would be a silently
wrong model. A model_type not listed in SUPPORTED is refused, never read as a Llama.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from podkit.checks.errors import ConfigError
from podkit.checks.models import MlaSpec, ModelShape, MoeSpec, VisionSpec

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3", "gpt2")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
SUPPORTED = DENSE + MOE

# Gemma3TextConfig's defaults (transformers 5.23.0 models/gemma3/configuration_gemma3.py): Google's
# multimodal Gemma 3 config.json files (4B, 12B, 27B) leave these out of text_config and rely on them.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
}


class _Keys:
    """Reads a config dict, collecting every missing required key so the error names them all."""

    def __init__(self, cfg: dict[str, Any], field: str, where: str):
        self.cfg, self.field, self.where = cfg, field, where
        self.missing: list[str] = []

    def need(self, key: str) -> Any:
        value = self.cfg.get(key)
        if value is None:
            self.missing.append(key)
            return 1  # a placeholder; check() raises before any shape is built from it
        return value

    def get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key)
        return default if value is None else value

    def check(self, model_type: str) -> None:
        if self.missing:
            raise ConfigError(
                self.field,
                f"{self.where} ({model_type}) lacks {', '.join(self.missing)}",
                "use the model's config.json from its Hugging Face repo, or give the dimensions explicitly",
            )


# The job keys a config.json's keys become (transformers' LlamaConfig / GPT2Config names).
_DECODER_KEYS = {"model.hidden": "hidden_size", "model.layers": "num_hidden_layers", "model.heads": "num_attention_heads",
                 "model.kv_heads": "num_key_value_heads", "model.ffn": "intermediate_size", "model.vocab": "vocab_size",
                 "model.head_dim": "head_dim"}
_GPT2_KEYS = {"model.hidden": "n_embd", "model.layers": "n_layer", "model.heads": "n_head", "model.kv_heads": "n_head",
              "model.ffn": "n_inner", "model.vocab": "vocab_size"}


def shape_from_config(cfg: Any, name: str, field: str = "model.hf_config", where: str = "config.json") -> ModelShape:
    """The ModelShape of a parsed config.json; `field` and `where` name it in errors."""
    if not isinstance(cfg, dict):
        raise ConfigError(field, f"{where} is not a JSON object", "give a model's config.json")
    model_type = cfg.get("model_type")
    if not model_type:
        raise ConfigError(field, f"{where} has no model_type", "give a model's config.json, which names its model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(
            field,
            f"model_type {model_type!r} is not supported",
            "podkit counts " + ", ".join(SUPPORTED) + "; for another decoder give explicit dimensions",
        )
    vision = None
    if model_type == "gemma3":
        text, vision_cfg = cfg.get("text_config"), cfg.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision_cfg, dict):
            bad = [k if k not in cfg else f"{k} as an object (it is {type(cfg[k]).__name__})"
                   for k in ("text_config", "vision_config") if not isinstance(cfg.get(k), dict)]
            raise ConfigError(field, f"{where} (gemma3) lacks {', '.join(bad)}", "use the model's config.json")
        vision = _siglip(_Keys(vision_cfg, field, f"{where} vision_config"))
        cfg = {**GEMMA3_TEXT_DEFAULTS, **text, "model_type": "gemma3_text",
               "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    keys = _Keys(cfg, field, where)
    try:
        if model_type == "gpt2":
            return _gpt2(keys, name)
        shape = _decoder(keys, cfg["model_type"], name)
    except ConfigError as exc:
        if exc.field == field or not exc.field.startswith("model"):
            raise
        # The shape's own checks name the job's keys (model.hidden), which a job given by its config.json lacks:
        # named here by the config.json key they were read from.
        key = (_GPT2_KEYS if model_type == "gpt2" else _DECODER_KEYS).get(exc.field, exc.field)
        raise ConfigError(field, f"{where}: {key} {exc.problem}", "use the model's own config.json") from None
    return dataclasses.replace(shape, family="gemma3", vision=vision) if vision else shape


def _siglip(k: _Keys) -> VisionSpec:
    """Gemma 3's vision tower: SiglipVisionConfig keys (vision_use_head defaults to True there)."""
    spec = (k.need("hidden_size"), k.need("intermediate_size"), k.need("num_hidden_layers"), k.need("patch_size"),
            k.need("image_size"))
    k.check("siglip_vision_model")
    return VisionSpec(*spec, channels=k.get("num_channels", 3), pooling_head=bool(k.get("vision_use_head", True)))


def _gpt2(k: _Keys, name: str) -> ModelShape:
    hidden, layers, heads, vocab = k.need("n_embd"), k.need("n_layer"), k.need("n_head"), k.need("vocab_size")
    k.check("gpt2")
    # GPT2Config: n_inner None means 4 x n_embd, n_positions 1024, tie_word_embeddings True.
    return ModelShape(
        name, hidden, layers, heads, heads, k.get("n_inner", 4 * hidden), vocab,
        bool(k.get("tie_word_embeddings", True)), arch="gpt2", positions=k.get("n_positions", 1024), family="gpt2",
    )


def _decoder(k: _Keys, mt: str, name: str) -> ModelShape:
    hidden = k.need("hidden_size")
    layers = k.need("num_hidden_layers")
    heads = k.need("num_attention_heads")
    vocab = k.need("vocab_size")
    moe, mla = None, None
    if mt in ("qwen2_moe", "qwen3_moe"):
        moe = _qwen_moe(k, mt, layers)
    elif mt in ("mixtral", "olmoe"):
        # MixtralSparseMoeBlock / OlmoeSparseMoeBlock: every block's MLP is the MoE, experts of intermediate_size.
        moe = MoeSpec(k.need("num_local_experts" if mt == "mixtral" else "num_experts"),
                      k.need("num_experts_per_tok"), k.need("intermediate_size"))
    elif mt in ("deepseek_v2", "deepseek_v3"):
        moe, mla = _deepseek(k, mt)
    elif mt == "gpt_oss":
        # GptOssMLP (transformers 5.23 modeling_gpt_oss.py): every block's MLP is the MoE, a router with a bias and
        # num_local_experts experts of intermediate_size with biased gate_up and down banks, no shared expert.
        # swiglu_limit and swiglu_alpha shape the activation, not any tensor's size.
        moe = MoeSpec(k.need("num_local_experts"), k.need("num_experts_per_tok"), k.need("intermediate_size"),
                      biases=True)
    ffn = k.need("intermediate_size") if mt not in ("qwen2_moe", "qwen3_moe") else k.get("intermediate_size", 0)
    k.check(mt)
    if moe and not moe.dense_layers:
        ffn = moe.expert_ffn
    # Families whose configuration_*.py default head_dim is not hidden // heads.
    head_dim = k.get("head_dim", {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256,
                                  "gpt_oss": 64}.get(mt, 0))
    if mla:
        head_dim = mla.qk_head_dim
    # GptOssConfig's attention_bias defaults to True (q, k, v and o_proj), every other family's to False.
    attention_bias = bool(k.get("attention_bias", mt == "gpt_oss"))
    if mt == "qwen2":
        qkv_bias, o_bias = True, False  # Qwen2Attention: bias=True on q, k, v; none on o_proj
    elif mt == "qwen2_moe":
        qkv_bias, o_bias = bool(k.get("qkv_bias", True)), False
    elif mt in ("mistral", "mixtral", "phi3"):
        qkv_bias, o_bias = False, False  # their modeling files hard-code bias=False
    else:
        qkv_bias = o_bias = attention_bias
    gemma = mt.startswith("gemma")
    return ModelShape(
        name, hidden, layers, heads, k.get("num_key_value_heads", heads), ffn, vocab,
        # Each family's configuration_*.py: Gemma and GPT-2 default to tied, the rest to untied.
        bool(k.get("tie_word_embeddings", gemma)),
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        # LlamaMLP / DeepseekV2MLP take mlp_bias; DeepseekV3MLP and the others hard-code bias=False.
        mlp_bias=bool(k.get("mlp_bias", False)) and mt in ("llama", "deepseek_v2"),
        family=mt,
        fused_proj=mt == "phi3",
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmoe": "full"}.get(mt, ""),
        norms_per_layer=4 if mt in ("gemma2", "gemma3_text") else 2,
        logit_softcap=_softcap(k.cfg, "final_logit_softcapping", 30.0 if mt == "gemma2" else 0.0),
        attn_softcap=_softcap(k.cfg, "attn_logit_softcapping", 50.0 if mt == "gemma2" else 0.0),
        moe=moe,
        mla=mla,
        rope_positions=k.get("max_position_embeddings", 0),
        **_sliding(k.cfg, mt, layers),
    )


# configuration_*.py's sliding_window default where config.json leaves the key out (transformers 5.23.0: Mistral,
# Gemma 2, Gemma3TextConfig, Qwen2/Qwen3/their MoE 4096; GptOssConfig 128; Mixtral, Phi-3 None). A key given as null means no window.
_WINDOW_DEFAULT = {"mistral": 4096, "gemma2": 4096, "gemma3_text": 4096, "qwen2": 4096, "qwen3": 4096,
                   "qwen2_moe": 4096, "qwen3_moe": 4096, "gpt_oss": 128}
# The families whose decoder picks each layer's mask by config.layer_types (modeling_*.py `causal_mask_mapping[
# self.config.layer_types[i]]`); Mistral, Mixtral, Phi-3 and Qwen3-MoE give every layer the sliding mask once a
# window is set (`mask_function = create_causal_mask if self.config.sliding_window is None else
# create_sliding_window_causal_mask`).
_LAYER_TYPED = ("gemma2", "gemma3_text", "qwen2", "qwen3", "qwen2_moe", "gpt_oss")


def _softcap(cfg: dict, key: str, family_default: float) -> float:
    """A soft-cap from config.json: an explicit null is none (the models test `is not None`), an absent key the
    configuration class's default (Gemma2Config: final_logit_softcapping=30.0, attn_logit_softcapping=50.0)."""
    return float(cfg[key] or 0.0) if key in cfg else family_default


def _sliding(cfg: dict, mt: str, layers: int) -> dict:
    """The sliding-window layers and their window, as transformers 5.23.0's configuration_*.py derives
    layer_types from config.json when the file does not list them."""
    if mt not in _WINDOW_DEFAULT and mt not in ("mixtral", "phi3"):
        return {}  # Llama, Gemma, OLMoE, DeepSeek: no sliding window in their modeling files
    window = cfg["sliding_window"] if "sliding_window" in cfg else _WINDOW_DEFAULT.get(mt)
    if mt.startswith("qwen") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen*Config: `self.sliding_window = self.sliding_window if self.use_sliding_window else None`
    if not window:
        return {}
    types = cfg.get("layer_types")
    mwl = cfg.get("max_window_layers", 28)
    if mt in _LAYER_TYPED and isinstance(types, list):
        sliding = [i for i, kind in enumerate(types[:layers]) if kind == "sliding_attention"]
    elif mt in ("gemma2", "gpt_oss"):
        sliding = [i for i in range(layers) if (i + 1) % 2]  # Gemma2Config, GptOssConfig: `bool((i + 1) % 2)`
    elif mt == "gemma3_text":
        # Gemma3TextConfig: `bool((i + 1) % self._sliding_window_pattern)`, the pattern 6 unless config.json says
        sliding = [i for i in range(layers) if (i + 1) % cfg.get("sliding_window_pattern", 6)]
    elif mt in ("qwen2", "qwen3"):
        sliding = [i for i in range(layers) if i >= mwl]  # `i >= self.max_window_layers`
    elif mt == "qwen2_moe":
        sliding = [i for i in range(layers) if (i + 1) % 2 and i < mwl]
    else:
        sliding = list(range(layers))
    return {"sliding_window": int(window), "sliding_layers": tuple(sliding)} if sliding else {}


def _qwen_moe(k: _Keys, mt: str, layers: int) -> MoeSpec | None:
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: a block is MoE unless listed in mlp_only_layers
    or off the decoder_sparse_step stride; Qwen2-MoE adds a gated shared expert to every MoE block."""
    experts = k.need("num_experts")
    top_k, expert_ffn = k.need("num_experts_per_tok"), k.need("moe_intermediate_size")
    only_dense = set(k.get("mlp_only_layers", []))
    step = k.get("decoder_sparse_step", 1)
    if k.missing or not isinstance(layers, int) or not isinstance(step, int) or step <= 0:
        return None
    dense = sum(1 for i in range(layers) if i in only_dense or (i + 1) % step)
    shared_ffn = k.need("shared_expert_intermediate_size") if mt == "qwen2_moe" else 0
    dense_ffn = k.need("intermediate_size") if dense else 0
    if k.missing or not experts:
        return None
    return MoeSpec(experts, top_k, expert_ffn, shared_experts=1 if shared_ffn else 0, shared_ffn=shared_ffn,
                   shared_gate=bool(shared_ffn), dense_layers=dense, dense_ffn=dense_ffn)


def _deepseek(k: _Keys, mt: str) -> tuple[MoeSpec | None, MlaSpec | None]:
    """DeepseekV2/V3DecoderLayer: the first first_k_dense_replace blocks keep a dense MLP; the others
    hold n_routed_experts routed experts plus n_shared_experts fused into one MLP. transformers does
    not build V3's multi-token-prediction layer (num_nextn_predict_layers), so it is not counted."""
    experts, top_k = k.need("n_routed_experts"), k.need("num_experts_per_tok")
    expert_ffn = k.need("moe_intermediate_size")
    shared = k.get("n_shared_experts", 0)
    kv_lora = k.need("kv_lora_rank")
    nope, rope, v = k.need("qk_nope_head_dim"), k.need("qk_rope_head_dim"), k.need("v_head_dim")
    if k.missing:
        return None, None
    dense = k.get("first_k_dense_replace", 0)
    moe = MoeSpec(experts, top_k, expert_ffn, shared_experts=shared,
                  shared_ffn=expert_ffn * shared if isinstance(expert_ffn, int) and isinstance(shared, int) else 0,
                  router_bias=mt == "deepseek_v3", dense_layers=dense,
                  dense_ffn=k.need("intermediate_size") if dense else 0)
    # q_lora_rank null (V2-Lite) means a plain q_proj.
    mla = MlaSpec(kv_lora, nope, rope, v, q_lora_rank=k.get("q_lora_rank", 0))
    return moe, mla


MAX_CONFIG_BYTES = 16 << 20  # a config.json is KiBs; more is a device or the wrong file (/dev/zero)


def from_file(path: Path, field: str = "model.hf_config", name: str = "") -> ModelShape:
    try:
        p = Path(path)
        if p.exists() and not p.is_dir() and not p.is_file():
            raise ConfigError(field, f"{path} is not a regular file", "give the path to a config.json")
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(field, f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB, not a config.json",
                              "give the path to a config.json")
        cfg = json.loads(data.decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(field, f"{path} does not exist", "give the path to a config.json") from None
    except IsADirectoryError:
        raise ConfigError(field, f"{path} is a directory", "give the path to its config.json") from None
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path} is not UTF-8 text, so not a config.json", "give the path to a config.json") from None
    except json.JSONDecodeError as exc:
        where = "it is empty" if not data.strip() else f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise ConfigError(field, f"{path} is not valid JSON ({where})", "give the model's config.json") from None
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror or exc}", "give the path to a config.json") from None
    default = name or (cfg.get("_name_or_path") if isinstance(cfg, dict) else "") or Path(path).parent.name
    return shape_from_config(cfg, default or "hf-config", field, str(path))


def from_hub(repo_id: str, revision: str = "") -> ModelShape:
    """config.json of a Hub repo through huggingface_hub's own cache ($HF_HOME/hub): one download,
    then offline reads; HF_HUB_OFFLINE=1 reads the cache only. The token is huggingface_hub's
    (HF_TOKEN or `hf auth login`), never passed on a command line."""
    field = "model.hf"
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub import constants, errors
    except ImportError:
        raise ConfigError(field, "reading a Hub id needs huggingface_hub, which is not installed",
                          "pip install huggingface_hub==2.4.0, or set model.hf_config to a local config.json") from None
    at = f"@{revision}" if revision else ""
    # Its retries over an unreachable Hub (five, 23 s) each log a warning: quiet, so that the outcome is one line.
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        try:
            # The cache first: online, hf_hub_download asks the Hub for the file's etag even when it holds the
            # file, and over an unreachable Hub retries for 23 s before reading its cache. A preflight reads the
            # copy it has, as transformers would with HF_HUB_OFFLINE=1.
            path = hf_hub_download(repo_id, "config.json", revision=revision or None, local_files_only=True)
        except errors.LocalEntryNotFoundError:
            # The one slow step of a preflight (seconds; 23 s before it gives up on an unreachable Hub), said first
            # to a person at a terminal; a script's stderr keeps its one line.
            if sys.stderr.isatty() and not constants.HF_HUB_OFFLINE:
                print(f"podkit: fetching {repo_id}{at} config.json from the Hugging Face Hub (once: later runs read "
                      "its cache)", file=sys.stderr, flush=True)
            path = hf_hub_download(repo_id, "config.json", revision=revision or None)
    except errors.HFValidationError:
        raise ConfigError(field, f"{repo_id!r} is not a Hub repo id",
                          "write it as owner/name, e.g. Qwen/Qwen3-8B") from None
    except errors.GatedRepoError:
        raise ConfigError(field, f"{repo_id} is gated: its files need an access token",
                          f"accept its license on huggingface.co/{repo_id}, then set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(field, f"{repo_id} is not a Hub repo, or is private",
                          "check the id; for a private repo set HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(field, f"{repo_id} has no revision {revision!r}",
                          "use a branch, tag or commit it has") from None
    except errors.LocalEntryNotFoundError:
        # Offline (HF_HUB_OFFLINE=1, or no network) and not in the cache.
        raise ConfigError(field, f"{repo_id}{at} config.json is not in the Hugging Face cache and the Hub "
                          "cannot be reached", "run once online with HF_HUB_OFFLINE unset, "
                          "or set model.hf_config to a local config.json") from None
    except errors.EntryNotFoundError:
        raise ConfigError(field, f"{repo_id} has no config.json", "give a transformers model repo") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise ConfigError(field, f"cannot fetch {repo_id} config.json: {str(exc).splitlines()[0]}",
                          "check the network, or set model.hf_config to a local config.json") from None
    finally:
        hub_log.setLevel(level)
    return from_file(Path(path), field, name=repo_id)
