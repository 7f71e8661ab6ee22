"""Model shapes: exact public architectures, HF config.json, explicit dimensions, or a bare size.

Every count here is derived from the shapes, never typed in: the presets' totals are checked
against the published parameter counts in tests/test_models.py. The tensors of each family follow
transformers 5.23.0's modeling files (cited where each one differs from Llama's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from podkit.checks.errors import ConfigError, closest


EMBEDDING_GROUPS = ("embed_tokens", "wte", "wpe", "lm_head")
"""The token and position embeddings and the LM head, as param_groups names them."""


@dataclass(frozen=True)
class ParamGroup:
    """`count` identical parameter tensors of shape (rows, cols); cols == 1 for vectors."""

    name: str
    rows: int
    cols: int
    count: int
    linear: bool  # a matmul weight: LoRA-adaptable, quantizable, cast by autocast
    per_layer: bool  # lives in a transformer block (sharded/gathered block by block)
    expert: bool = False
    """A routed expert's weight: only top_k of the experts run for each token."""
    bank: bool = False
    """Not an nn.Linear but one 3-D Parameter holding a weight of every expert of a layer (of its one expert
    where `expert` is False: torchtitan's shared-expert bank, ModelShape.shared_bank), as
    transformers 5.x builds routed experts (MixtralExperts gate_up_proj / down_proj): bitsandbytes leaves it unquantized (5.23.0 integrations/bitsandbytes.py replace_with_bnb_linear
    converts `type(module) is nn.Linear` only) and peft adapts it only through ParamWrapper, where
    stacks.peft_bank_names says it does (no module-level LoRA)."""

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def total(self) -> int:
        return self.numel * self.count


@dataclass(frozen=True)
class MoeSpec:
    """A Mixture-of-Experts MLP (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3): what replaces the
    dense MLP in `ModelShape.moe_layers` of the blocks."""

    experts: int
    """Routed experts per MoE layer (num_local_experts / num_experts / n_routed_experts)."""
    top_k: int
    """Routed experts each token goes through (num_experts_per_tok)."""
    expert_ffn: int
    """Intermediate size of one routed expert (a gated MLP: gate, up, down)."""
    shared_experts: int = 0
    """Experts every token goes through besides the routed ones (DeepSeek n_shared_experts; Qwen2-MoE 1)."""
    shared_ffn: int = 0
    """Intermediate size of the shared experts as the one gated MLP transformers builds for them
    (DeepSeek: moe_intermediate_size x n_shared_experts; Qwen2-MoE: shared_expert_intermediate_size)."""
    shared_gate: bool = False
    """Qwen2-MoE: a sigmoid gate (hidden -> 1 linear) scales the shared expert's output."""
    router_bias: bool = False
    """DeepSeek-V3's e_score_correction_bias: a per-expert fp32 buffer added before top-k, not a parameter."""
    biases: bool = False
    """GPT-OSS: a bias Parameter on the router's linear and on every expert's gate_up and down banks
    (transformers 5.23 modeling_gpt_oss.py GptOssTopKRouter.bias, GptOssExperts.gate_up_proj_bias /
    down_proj_bias)."""
    dense_layers: int = 0
    """Blocks that keep a dense MLP instead (DeepSeek first_k_dense_replace, Qwen mlp_only_layers)."""
    dense_ffn: int = 0
    """Intermediate size of those dense MLPs (0 when there are none)."""

    def __post_init__(self):
        for key in ("experts", "top_k", "expert_ffn"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.moe.{key}", f"must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ConfigError("model.moe.top_k",
                              f"{self.top_k} routed experts per token, but only {self.experts} exist")
        if self.shared_experts and not self.shared_ffn:
            raise ConfigError("model.moe.shared_ffn", "shared experts need their intermediate size")
        if self.dense_layers and not self.dense_ffn:
            raise ConfigError("model.moe.dense_ffn", "dense layers need their intermediate size")


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek-V2/V3 Multi-head Latent Attention (DeepSeek-V2 paper, sec. 2.1): queries and keys/values
    pass through low-rank latents; each head's q/k is a no-RoPE part plus a RoPE part shared by k."""

    kv_lora_rank: int
    """Width of the compressed key/value latent (kv_a_proj_with_mqa's output, before the RoPE key)."""
    qk_nope_head_dim: int
    """Per-head query/key dimensions without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head query dimensions with rotary embedding; the key's RoPE part is one head shared by all."""
    v_head_dim: int
    """Per-head value dimension (the attention output is heads x v_head_dim)."""
    q_lora_rank: int = 0
    """Width of the compressed query latent; 0: a full hidden -> heads x qk_head_dim q_proj (V2-Lite)."""

    def __post_init__(self):
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.mla.{key}", f"must be a positive integer, got {value!r}")
        if self.q_lora_rank < 0:
            raise ConfigError("model.mla.q_lora_rank", f"must not be negative, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class VisionSpec:
    """A SigLIP vision encoder and the projector of its patches into the decoder: Gemma 3 4B-27B, which
    AutoModelForCausalLM loads as Gemma3ForConditionalGeneration (transformers 5.23.0
    models/siglip/modeling_siglip.py SiglipVisionModel, models/gemma3/modeling_gemma3.py
    Gemma3MultiModalProjector). Its tensors sit outside the decoder blocks (per_layer False)."""

    hidden: int
    ffn: int
    layers: int
    patch: int
    """Square patch side in pixels (a Conv2d of this kernel and stride embeds each patch)."""
    image: int
    """Square image side in pixels: (image // patch)^2 learned position embeddings."""
    channels: int = 3
    pooling_head: bool = False
    """SigLIP's attention-pooling head (vision_use_head); Gemma 3 turns it off."""

    def __post_init__(self):
        for key in ("hidden", "ffn", "layers", "patch", "image", "channels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.vision.{key}", f"must be a positive integer, got {value!r}")

    def param_groups(self, text_hidden: int) -> list[ParamGroup]:
        d, f, L = self.hidden, self.ffn, self.layers
        groups = [
            ParamGroup("vision.patch_embedding", self.channels * self.patch ** 2, d, 1, False, False),
            ParamGroup("vision.position_embedding", (self.image // self.patch) ** 2, d, 1, False, False),
            # Vectors of width d: the patch conv's bias; per layer the q, k, v, out_proj and fc2 biases and
            # two LayerNorms' weight and bias; the post-LayerNorm's weight and bias.
            ParamGroup("vision.attn_proj", d, d, 4 * L, True, False),
            ParamGroup("vision.fc1", d, f, L, True, False),
            ParamGroup("vision.fc2", f, d, L, True, False),
            ParamGroup("vision.bias,layer_norm", d, 1, 1 + 9 * L + 2, False, False),
            ParamGroup("vision.fc1.bias", f, 1, L, False, False),
            # Gemma3MultiModalProjector: mm_input_projection_weight and mm_soft_emb_norm.
            ParamGroup("vision.mm_input_projection", d, text_hidden, 1, True, False),
            ParamGroup("vision.mm_soft_emb_norm", d, 1, 1, False, False),
        ]
        if self.pooling_head:
            # SiglipMultiheadAttentionPoolingHead: probe, nn.MultiheadAttention (in_proj 3d x d, out_proj),
            # LayerNorm, and a SiglipMLP.
            groups += [
                ParamGroup("vision.head.attention", d, 4 * d, 1, True, False),
                ParamGroup("vision.head.mlp", d, 2 * f, 1, True, False),
                ParamGroup("vision.head.vectors", d, 1, 1 + 3 + 1 + 2 + 1, False, False),
                ParamGroup("vision.head.fc1.bias", f, 1, 1, False, False),
            ]
        return groups


QK_NORMS = ("", "head", "full")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: Llama-style blocks (RMSNorm, RoPE, gated MLP, GQA; arch "llama",
    which every family here but GPT-2 is) or GPT-2-style (LayerNorm, learned positions, GELU)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    """Intermediate size of the dense MLP; for a MoE model without dense layers, of one routed expert."""
    vocab: int
    tie_embeddings: bool
    arch: str = "llama"  # llama | gpt2
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False  # Qwen2 puts a bias on q, k and v
    positions: int = 0  # learned position embeddings (GPT-2); 0 for RoPE
    rope_positions: int = 0
    """max_position_embeddings of a RoPE model (0: not given). Only the transformers releases whose rotary
    embeddings keep cos/sin tables that long as buffers size memory by it (stacks.transformers_facts)."""
    approximate: bool = False  # shapes inferred from a parameter count only
    params_override: int = 0  # the stated total when shapes are inferred
    family: str = ""
    """The config's model_type (qwen3, gemma2, mixtral, deepseek_v3...); "" for explicit dimensions."""
    o_bias: bool = False
    """A bias on the attention output projection too (Llama/Qwen3/Gemma/OLMoE attention_bias=True)."""
    mlp_bias: bool = False
    """Biases on gate, up and down (Llama/DeepSeek mlp_bias=True)."""
    fused_proj: bool = False
    """Phi-3: one qkv_proj (hidden -> q + 2 kv) and one gate_up_proj (hidden -> 2 ffn) instead of five linears."""
    qk_norm: str = ""
    """RMSNorm on queries and keys before RoPE: "" none | "head" (one head_dim weight: Qwen3, Gemma 3) |
    "full" (over all heads: OLMoE's q_norm of heads x head_dim and k_norm of kv_heads x head_dim)."""
    norms_per_layer: int = 2
    """Hidden-size norms per block: 2 (input, post-attention); 4 for Gemma 2/3 (pre/post feed-forward too)."""
    logit_softcap: float = 0.0
    """Final logits soft-capped as cap * tanh(logits / cap) (Gemma 2: 30); 0: none."""
    attn_softcap: float = 0.0
    """Attention scores soft-capped the same way (Gemma 2: 50); SDPA cannot, so HF runs eager or flash-attn."""
    moe: MoeSpec | None = None
    """The Mixture-of-Experts MLP; None for a dense model."""
    mla: MlaSpec | None = None
    """Multi-head Latent Attention (DeepSeek-V2/V3); None for standard (grouped-query) attention."""
    vision: VisionSpec | None = None
    """A vision encoder loaded with the decoder (Gemma 3 4B-27B); None for a text-only model."""
    sliding_window: int = 0
    """Tokens a sliding-window layer attends back over (config.json sliding_window); 0: no such layer."""
    sliding_layers: tuple = ()
    """Which layers attend within sliding_window (transformers' config.layer_types "sliding_attention"): Gemma 2
    every other, Gemma 3 five in six, Mistral v0.1 all of them (hf_config._sliding)."""
    expert_linears: bool = False
    """How the code that runs the model builds a MoE layer, not a fact of its config: one nn.Linear per
    expert's gate, up and down and an nn.Linear router (transformers < 5.0, litgpt), or 3-D banks
    (transformers >= 5.0). Decided by the job's stack (stacks.resolve: JobFacts.expert_linears)."""

    shared_bank: bool = False
    """The shared experts as the code builds them: one 3-D bank of a single expert, (1, hidden, ffn) Parameters
    (torchtitan < 0.2.0: GroupedExperts(num_experts=1)), not a gated MLP of nn.Linear. Decided by the job's
    stack (stacks.resolve: JobFacts.shared_bank)."""

    def laid_out(self, expert_linears: bool, shared_bank: bool = False) -> "ModelShape":
        """This model as the job's code builds its experts (ModelShape.expert_linears, shared_bank)."""
        if not self.moe or (self.expert_linears, self.shared_bank) == (expert_linears, shared_bank):
            return self
        return dataclasses.replace(self, expert_linears=expert_linears, shared_bank=shared_bank)

    def __post_init__(self):
        if self.sliding_layers and (self.sliding_window <= 0 or max(self.sliding_layers) >= self.layers):
            raise ConfigError("model.sliding_window", f"{self.sliding_window!r} over layers {self.sliding_layers} "
                              f"of {self.layers}: needs a positive window and layers that exist")
        for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}", f"must be a positive integer, got {value!r}")
        if not isinstance(self.rope_positions, int) or isinstance(self.rope_positions, bool) or self.rope_positions < 0:
            raise ConfigError("model", f"max_position_embeddings must be a positive integer, got {self.rope_positions!r}",
                              "fix it in the model's config.json")
        if not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ConfigError("model.head_dim", f"must be a positive integer (0: hidden // heads), got {self.head_dim!r}")
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
        if self.qk_norm not in QK_NORMS:
            raise ConfigError("model.qk_norm", f"unknown value {self.qk_norm!r}", "one of '', 'head', 'full'")
        if self.moe and self.moe.dense_layers >= self.layers:
            raise ConfigError("model.moe.dense_layers", f"{self.moe.dense_layers} dense layers leave no MoE layer "
                              f"of {self.layers}")
        if self.mla and self.head_dim != self.mla.qk_head_dim:
            raise ConfigError("model.head_dim", f"MLA needs head_dim = qk_nope + qk_rope = {self.mla.qk_head_dim}")
        if self.arch == "gpt2" and (self.moe or self.mla or self.fused_proj or self.qk_norm):
            raise ConfigError("model.arch",
                              "GPT-2 blocks have no experts, latent attention, fused or q/k-normed projections")

    @property
    def replica_gap(self) -> str:
        """What podkit's own replica (train/model.py, a dense Llama-style text decoder, run by bin/smoke
        and --traced) cannot build: "mixture-of-experts", "latent-attention", "vision-language"; ""
        when it can. Measuring the replica of such a model would measure another model."""
        if self.moe:
            return "mixture-of-experts"
        if self.mla:
            return "latent-attention"
        return "vision-language" if self.vision else ""

    @property
    def d_head(self) -> int:
        """Per-head query/key width (MLA: qk_nope + qk_rope)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def v_head_dim(self) -> int:
        """Per-head value width: MLA's v_head_dim, else the query/key head dim."""
        return self.mla.v_head_dim if self.mla else self.d_head

    @property
    def q_dim(self) -> int:
        return self.heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """Keys' width (MLA: approximates values, which are heads x v_head_dim)."""
        return self.kv_heads * self.d_head

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is the Mixture-of-Experts one; 0 for a dense model."""
        return self.layers - self.moe.dense_layers if self.moe else 0

    @property
    def dense_mlp_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def dense_ffn(self) -> int:
        return self.moe.dense_ffn if self.moe else self.ffn

    def attention_groups(self) -> list[ParamGroup]:
        h, L = self.hidden, self.layers
        if self.mla:
            # transformers 5.23.0 models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention
            # (deepseek_v2 is the same): q through a q_lora_rank latent (or a plain q_proj),
            # kv_a_proj_with_mqa to the kv latent plus one shared RoPE key, kv_b_proj up to every
            # head's no-RoPE key and value, o_proj from heads x v_head_dim.
            m = self.mla
            groups = []
            if m.q_lora_rank:
                groups += [
                    ParamGroup("q_a_proj", h, m.q_lora_rank, L, True, True),
                    ParamGroup("q_a_layernorm", m.q_lora_rank, 1, L, False, True),
                    ParamGroup("q_b_proj", m.q_lora_rank, self.heads * m.qk_head_dim, L, True, True),
                ]
                if self.qkv_bias:
                    groups.append(ParamGroup("q_a_proj.bias", m.q_lora_rank, 1, L, False, True))
            else:
                groups.append(ParamGroup("q_proj", h, self.heads * m.qk_head_dim, L, True, True))
            groups += [
                ParamGroup("kv_a_proj_with_mqa", h, m.kv_lora_rank + m.qk_rope_head_dim, L, True, True),
                ParamGroup("kv_a_layernorm", m.kv_lora_rank, 1, L, False, True),
                ParamGroup("kv_b_proj", m.kv_lora_rank, self.heads * (m.qk_nope_head_dim + m.v_head_dim), L,
                           True, True),
                ParamGroup("o_proj", self.heads * m.v_head_dim, h, L, True, True),
            ]
            if self.qkv_bias:
                groups.append(ParamGroup("kv_a_proj_with_mqa.bias", m.kv_lora_rank + m.qk_rope_head_dim, 1, L,
                                         False, True))
            if self.o_bias:
                groups.append(ParamGroup("o_proj.bias", h, 1, L, False, True))
            return groups
        if self.fused_proj:
            # transformers 5.23.0 models/phi3/modeling_phi3.py Phi3Attention: qkv_proj, no biases.
            groups = [ParamGroup("qkv_proj", h, self.q_dim + 2 * self.kv_dim, L, True, True)]
        else:
            groups = [
                ParamGroup("q_proj", h, self.q_dim, L, True, True),
                ParamGroup("k_proj", h, self.kv_dim, L, True, True),
                ParamGroup("v_proj", h, self.kv_dim, L, True, True),
            ]
        groups.append(ParamGroup("o_proj", self.q_dim, h, L, True, True))
        if self.qkv_bias:
            groups.append(ParamGroup("qkv_bias", self.q_dim + 2 * self.kv_dim, 1, L, False, True))
        if self.o_bias:
            groups.append(ParamGroup("o_proj.bias", h, 1, L, False, True))
        if self.attn_sinks:
            # GptOssAttention.sinks: one learned logit per head, a bare Parameter (transformers 5.23 modeling_gpt_oss.py).
            groups.append(ParamGroup("sinks", self.heads, 1, L, False, True))
        if self.qk_norm == "head":
            # Qwen3Attention / Gemma3Attention: q_norm, k_norm = RMSNorm(head_dim), shared by all heads.
            groups.append(ParamGroup("q_norm,k_norm", self.d_head, 1, 2 * L, False, True))
        elif self.qk_norm == "full":
            # OlmoeAttention: q_norm = RMSNorm(hidden), k_norm = RMSNorm(head_dim x kv_heads).
            groups.append(ParamGroup("q_norm", self.q_dim, 1, L, False, True))
            groups.append(ParamGroup("k_norm", self.kv_dim, 1, L, False, True))
        return groups

    def _mlp_groups(self, prefix: str, ffn: int, count: int, expert: bool = False) -> list[ParamGroup]:
        """A gated MLP (SwiGLU, or Gemma's GeGLU): gate and up from hidden to ffn, down back."""
        if not count:
            return []
        h = self.hidden
        if expert and self.expert_linears:
            # transformers 4.57.1: one gated MLP of nn.Linear per expert in an nn.ModuleList
            # (MixtralBlockSparseTop2MLP w1 / w3 / w2, modeling_mixtral.py l.57-65; Qwen2MoeMLP,
            # Qwen3MoeMLP, OlmoeMLP, DeepseekV2MLP, DeepseekV3MLP gate_proj / up_proj / down_proj), as
            # litgpt's LLaMAMoE builds LLaMAMLP experts (model.py).
            gate, up, down = self.expert_names
            return [
                ParamGroup(f"{prefix}{gate}", h, ffn, count, True, True, expert=True),
                ParamGroup(f"{prefix}{up}", h, ffn, count, True, True, expert=True),
                ParamGroup(f"{prefix}{down}", ffn, h, count, True, True, expert=True),
            ]
        if expert:
            # transformers 5.x stores each MoE layer's experts as two 3-D parameters, gate_up_proj
            # (experts, 2 ffn, hidden) and down_proj (experts, hidden, ffn) (e.g. models/mixtral/
            # modeling_mixtral.py MixtralExperts); one group entry per expert keeps per-expert shapes.
            return [
                ParamGroup(f"{prefix}gate_up_proj", h, 2 * ffn, count, True, True, expert=True, bank=True),
                ParamGroup(f"{prefix}down_proj", ffn, h, count, True, True, expert=True, bank=True),
            ]
        if self.fused_proj:
            groups = [ParamGroup(f"{prefix}gate_up_proj", h, 2 * ffn, count, True, True)]
        else:
            groups = [
                ParamGroup(f"{prefix}gate_proj", h, ffn, count, True, True),
                ParamGroup(f"{prefix}up_proj", h, ffn, count, True, True),
            ]
        groups.append(ParamGroup(f"{prefix}down_proj", ffn, h, count, True, True))
        if self.mlp_bias:
            groups.append(ParamGroup(f"{prefix}mlp_bias", 2 * ffn + h, 1, count, False, True))
        return groups

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
            groups = [ParamGroup("embed_tokens", self.vocab, h, 1, False, False)]
            groups += self.attention_groups()
            if self.moe:
                m, Lm = self.moe, self.moe_layers
                groups += self._mlp_groups("mlp.", m.dense_ffn, m.dense_layers)
                # The router: a bare (experts, hidden) Parameter in transformers 5.x (MixtralTopKRouter
                # and its kin) and in DeepSeek's (4.57.1 DeepseekV2MoEGate, DeepseekV3TopkRouter), so
                # neither peft's all-linear nor bitsandbytes touches it; `gate = nn.Linear(hidden,
                # experts)` in 4.x Mixtral, Qwen2/3-MoE and OLMoE (4.57.1 modeling_mixtral.py l.95) and
                # in litgpt's LLaMAMoE.
                name, linear = self.router_name, self.router_linear
                groups.append(ParamGroup(name, h, m.experts, Lm, linear, True))
                groups += self._mlp_groups("experts.", m.expert_ffn, m.experts * Lm, expert=True)
                if m.biases:
                    # GptOssTopKRouter.bias (experts); GptOssExperts.gate_up_proj_bias (experts, 2 ffn) and
                    # down_proj_bias (experts, hidden): banks like the weights, one entry per expert.
                    groups += [
                        ParamGroup(f"{name}.bias", m.experts, 1, Lm, False, True),
                        ParamGroup("experts.gate_up_proj_bias", 2 * m.expert_ffn, 1, m.experts * Lm, False, True,
                                   expert=True, bank=True),
                        ParamGroup("experts.down_proj_bias", h, 1, m.experts * Lm, False, True, expert=True,
                                   bank=True),
                    ]
                if self.shared_bank and m.shared_ffn:
                    # torchtitan < 0.2.0 MoE.shared_expert = GroupedExperts(dim, hidden_dim * n_shared_experts,
                    # num_experts=1): w1, w3 (1, dim, ffn) and w2 (1, ffn, dim), a bank whose one expert every
                    # token runs (expert=False).
                    groups += [ParamGroup("shared_expert.w1,w3", h, m.shared_ffn, 2 * Lm, True, True, bank=True),
                               ParamGroup("shared_expert.w2", m.shared_ffn, h, Lm, True, True, bank=True)]
                else:
                    groups += self._mlp_groups("shared_expert.", m.shared_ffn, Lm if m.shared_ffn else 0)
                if m.shared_gate:
                    # Qwen2MoeSparseMoeBlock.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
                    groups.append(ParamGroup("shared_expert_gate", h, 1, Lm, True, True))
            else:
                groups += self._mlp_groups("", self.ffn, L)
            groups += [
                ParamGroup("norm", h, 1, self.norms_per_layer * L, False, True),
                ParamGroup("final_norm", h, 1, 1, False, False),
            ]
        if not self.tie_embeddings:
            groups.append(ParamGroup("lm_head", self.vocab, h, 1, True, False))
        if self.vision:
            groups += self.vision.param_groups(h)
        return [g for g in groups if g.total]

    @property
    def params(self) -> int:
        if self.params_override:
            return self.params_override
        return sum(g.total for g in self.param_groups())

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: everything but the routed experts it is not sent to
        (top_k of experts, plus shared experts and every dense part). Equals params for a dense model."""
        if not self.moe or self.params_override:
            return self.params
        routed = self.routed_params
        return self.params - routed + routed * self.moe.top_k // self.moe.experts

    @property
    def routed_params(self) -> int:
        """Every routed expert's weights (0 for a dense model)."""
        return sum(g.total for g in self.param_groups() if g.expert)

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embeddings, plus the LM head when untied."""
        return sum(g.total for g in self.param_groups() if g.name in EMBEDDING_GROUPS)

    @property
    def vision_params(self) -> int:
        """The vision encoder and its projector (0 for a text-only model)."""
        return sum(g.total for g in self.param_groups() if g.name.startswith("vision."))

    @property
    def params_per_layer(self) -> int:
        """Mean parameters per block (every expert included; DeepSeek's dense blocks are smaller)."""
        return sum(g.numel * g.count for g in self.param_groups() if g.per_layer) // self.layers

    @property
    def params_outside_layers(self) -> int:
        """Embeddings, final norm, LM head (and a vision encoder): FSDP's root module, kept unsharded
        through fwd+bwd."""
        return sum(g.total for g in self.param_groups() if not g.per_layer)

    def linear_groups(self) -> list[ParamGroup]:
        """The blocks' nn.Linear weights (what LoRA can adapt and bitsandbytes quantizes), with their
        exact counts (DeepSeek's dense MLP is in first_k_dense_replace blocks only, its shared experts in
        the others; routed experts x MoE layers when they are nn.Linear modules, none when banks)."""
        return [g for g in self.param_groups() if g.linear and g.per_layer and not g.bank]

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the nn.Linear weights inside one block: what LoRA adapts. Each is in every
        block except for DeepSeek's dense/MoE split: linear_groups() has the exact counts."""
        return [(g.name, g.rows, g.cols) for g in self.linear_groups()]

    def expert_linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of one routed expert's matmuls; each is in experts x moe_layers copies."""
        return [(g.name, g.rows, g.cols) for g in self.param_groups() if g.expert and g.cols > 1]

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """A routed expert's gate, up and down as the modeling file names them: Mixtral's nn.Linear w1 / w3 /
        w2 in 4.x (MixtralBlockSparseTop2MLP); gate_proj / up_proj / down_proj otherwise (banks included)."""
        mixtral = self.family == "mixtral" and self.expert_linears
        return ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    @property
    def gemma_norm(self) -> bool:
        """The RMSNorm scales in fp32 by (1 + weight) and casts after (GemmaRMSNorm, Gemma 1-3: `output * (1.0 +
        self.weight.float())`, then `.type_as(x)`), where LlamaRMSNorm casts back first and scales in the input's
        dtype (transformers 5.23 modeling_gemma.py / modeling_gemma2.py / modeling_gemma3.py)."""
        return self.family in ("gemma", "gemma2", "gemma3", "gemma3_text")

    @property
    def norm_scaled_fp32(self) -> bool:
        """The RMSNorm multiplies by its weight in fp32 and casts after: Gemma's (gemma_norm) and GptOssRMSNorm
        (transformers 5.23 modeling_gpt_oss.py: `(self.weight * hidden_states).to(input_dtype)`, hidden_states the
        fp32 normalised x), whose product keeps that fp32 x for the weight's gradient."""
        return self.gemma_norm or self.family == "gpt_oss"

    @property
    def attn_sinks(self) -> bool:
        """GPT-OSS's attention sinks: one learned logit per head joins every row's softmax and is dropped after it
        (modeling_gpt_oss.py eager_attention_forward; flash-attn 3's s_aux)."""
        return self.family == "gpt_oss"

    @property
    def rope_cat(self) -> bool:
        """RoPE returns q and k as torch.cat outputs, (b, heads, s, d)-contiguous: GPT-OSS's _apply_rotary_emb
        (`torch.cat((first_, second_), dim=-1)`, transformers 5.23 modeling_gpt_oss.py). Phi-3 (fused_proj) and MLA
        (mla) cat theirs too and are told apart by those facts."""
        return self.family == "gpt_oss"

    @property
    def router_topk_softmax(self) -> bool:
        """The router keeps a softmax over its top-k logits only, in their dtype: GptOssTopKRouter
        (`softmax(router_top_value, dim=1, dtype=router_top_value.dtype)`, transformers 5.23 modeling_gpt_oss.py)."""
        return self.family == "gpt_oss"

    @property
    def clamped_swiglu(self) -> bool:
        """GPT-OSS's experts: gate_up's interleaved gate and up columns clamped at swiglu_limit, then
        (up + 1) * gate * sigmoid(alpha * gate) (GptOssExperts._apply_gate), not silu(gate) * up."""
        return self.family == "gpt_oss"

    @property
    def sandwich_norms(self) -> bool:
        """The block norms the attention's and the MLP's outputs too, before each residual add (Gemma 2/3's
        post_attention_layernorm and post_feedforward_layernorm: norms_per_layer 4)."""
        return self.norms_per_layer == 4

    @property
    def moe_module(self) -> str:
        """The decoder layer's MoE module, its checkpoint keys' prefix: transformers 4.x MixtralDecoderLayer's
        `block_sparse_moe` (modeling_mixtral.py), `mlp` in Qwen2/3-MoE, OLMoE and DeepSeek layers."""
        return "block_sparse_moe" if self.family == "mixtral" and self.expert_linears else "mlp"

    @property
    def router_linear(self) -> bool:
        """The router is an nn.Linear named `gate` (ModelShape.expert_linears, not DeepSeek's)."""
        return self.expert_linears and not self.family.startswith("deepseek")

    @property
    def router_name(self) -> str:
        return "gate" if self.router_linear else "router"

    def lora_params(self, rank: int) -> int:
        """LoRA (Hu et al. 2021): A (in x r) and B (r x out) on every nn.Linear of every block."""
        return sum(rank * (g.rows + g.cols) * g.count for g in self.linear_groups())


def preset(name: str) -> ModelShape:
    from podkit.checks.presets import PRESETS

    try:
        return PRESETS[name.lower()]
    except KeyError:
        hint = closest(name, PRESETS) or "known: " + ", ".join(PRESETS)
        raise ConfigError("model.preset", f"unknown preset {name!r}", hint) from None


def __getattr__(name: str):
    # PEP 562: the presets are built by the config.json reader, which imports this module.
    if name == "PRESETS":
        from podkit.checks.presets import PRESETS

        return PRESETS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_hf_config(path: Path) -> ModelShape:
    """Read the shapes from a Hugging Face config.json (see checks.hf_config.SUPPORTED)."""
    from podkit.checks import hf_config

    return hf_config.from_file(Path(path))


def from_hf_hub(repo_id: str, revision: str = "") -> ModelShape:
    """Read the shapes from a Hugging Face Hub repo's config.json, through huggingface_hub's cache."""
    from podkit.checks import hf_config

    return hf_config.from_hub(repo_id, revision)


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
    shape = ModelShape(f"~{params / 1e9:.2f}B", hidden, layers, heads, heads, ffn, vocab, False, approximate=True)
    # The shape prices the activations and the gathered blocks; at either end of the search (one block of
    # hidden 128; hidden 65536) it stops tracking the count, and those terms would be off many times over.
    # Between, widths in steps of 128 land within a factor of two of any count (the small models' steps are
    # coarse: hidden 128 -> 256 doubles the embedding).
    inferred = shape.params
    if not 0.5 <= inferred / params <= 2:
        small, large = (_shape_params(128, vocab), _shape_params(65536, vocab))
        raise ConfigError("model.params", f"{params:.3g} is outside what a Llama-like shape can be inferred for "
                          f"(about {small / 2:.2g} to {large * 2:.2g} with a {vocab:,} vocabulary)",
                          "give the dimensions (hidden, layers, heads, ffn, vocab), a preset, or hf_config")
    return dataclasses.replace(shape, params_override=int(params))


def _shape_params(hidden: int, vocab: int) -> int:
    """Parameters of from_param_count's shape of this width: hidden / 128 blocks of ffn ~ 8h/3."""
    heads, ffn = hidden // 128, int(math.ceil(8 * hidden / 3 / 256)) * 256
    return ModelShape("", hidden, max(1, hidden // 128), heads, heads, ffn, vocab, False).params
