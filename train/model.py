"""The smoke model: a Llama-style decoder built from the job's ModelShape.

It is structured the way checks/memory.py counts it (HF modeling_llama): RMSNorm computed in
fp32, separate q/k/v/o and gate/up/down projections, RoPE, grouped-query attention without
repeating k/v for SDPA. Change one and the other must follow.

ModelOptions also emulates the memory-relevant choices of other training stacks, so that bin/smoke
and the traced estimate (train/traced.py) measure each of them: how the loss is computed
(`loss`), what activation checkpointing saves (`ac_policy`), which linears carry LoRA adapters, in
which dtype, and with what dropout.

The model is created on the meta device and materialised once, straight on the target device
(`materialize`), so a 7B model never passes through CPU RAM.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from podkit.checks.config import PRECISION
from podkit.checks.models import ModelShape
from podkit.checks.stacks import AC_POLICIES, BLOCK_KERNELS, LORA_DTYPES, LOSSES, liger_norm_in_place
from podkit.train import liger, losses

ROPE_THETA = 500000.0  # Llama 3
LORA_ALPHA = 16

ATTENTION = ("sdpa", "flash-attn", "eager")
SDPA_KERNELS = ("auto", "flash", "efficient", "math")
ATTN_MASKS = ("", "bool", "float", "single", "positions", "flat")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# torchtune CEWithChunkedOutputLoss(num_output_chunks=8) (torchtune/modules/loss/ce_chunked_output_loss.py).
DEFAULT_LOSS_CHUNKS = 8


def ac_policy_for(checkpointing: str) -> str:
    """podkit's own `checkpointing` key as an AC policy: selective keeps every matmul output, full
    recomputes each block."""
    return {"none": "none", "selective": "matmuls", "full": "block"}[checkpointing]


@dataclass(frozen=True)
class ModelOptions:
    attention: str = "sdpa"
    """sdpa | flash-attn | eager."""
    repeat_kv: bool = False
    """Copy k and v out to every query head before attention (transformers <= 4.53 repeat_kv,
    torchtune, litgpt) instead of SDPA's native grouped-query attention."""
    sdpa_kernel: str = "auto"
    """auto (torch's dispatch on this device) or the aten kernel to call: flash | efficient | math.
    The traced estimate sets the one the target GPU would pick (train/traced.py sdpa_backend)."""
    ac_policy: str = "none"
    """Activation checkpointing per block: none; matmuls (podkit's selective: keep every matmul and
    attention output); op-sac (torchtitan's op-level selective AC: keep attention and every second
    mm); block (full recompute of each block: HF gradient_checkpointing, torchtune, litgpt)."""
    loss: str = "fp32-upcast"
    """fp32-upcast (podkit: cross_entropy(logits.float())); fp32-logits-kept (HF transformers: fp32
    logits returned in the output and referenced until backward); chunked (torchtune/litgpt: head and
    cross-entropy per chunk of the sequence); fused (linear + cross-entropy in one autograd Function
    that recomputes each chunk's logits in backward, as Cut Cross-Entropy); liger (Liger's fused linear
    cross-entropy: the gradients made in forward and held until backward)."""
    loss_chunks: int = DEFAULT_LOSS_CHUNKS
    """Chunks along the sequence for the chunked and fused losses."""
    loss_upcast: bool = True
    """Cross-entropy on fp32 logits (podkit, torchtune, transformers) or on the compute dtype (litgpt)."""
    logits_kept: bool = False
    """The logits stay referenced until after backward (litgpt's fit keeps its chunk list)."""
    logits_fp32: bool = False
    """The logits are cast to fp32 before the loss, the 16-bit ones dropped, as Fabric's wrapper casts the
    model's outputs for litgpt's loop (checks/stacks.py JobFacts.logits_fp32)."""
    logit_softcap: float = 0.0
    """Soft-cap the head's logits as the model's forward does (checks/stacks.py JobFacts.logit_softcap): divide,
    tanh, multiply; 0: none."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS[:-1]
    """Linears that carry adapters (podkit: every block linear)."""
    lora_dropout: float = 0.0
    """peft's lora_dropout: > 0 saves a mask and the dropped input for each adapter."""
    lora_dtype: str = "param"
    """Adapter weights: param (podkit: the trainable dtype of the precision), fp32, or compute."""
    base_quant: str = "none"  # none | int8 | nf4
    max_seq_len: int = 2048
    reentrant: bool = False
    """Block checkpointing with use_reentrant=True (HF gradient_checkpointing's default): the forward
    runs under no_grad; op-level policies need the non-reentrant implementation."""
    adapter_input_cast: bool = False
    """peft's rule: cast the adapter's input to the adapter dtype whenever they differ, autocast or not
    (peft tuners_utils._cast_input_dtype); podkit's own casts only outside autocast."""
    block_kernels: str = "torch"
    """torch (transformers' RMSNorm, RoPE and SwiGLU in PyTorch ops) or liger (Liger-Kernel's Functions,
    emulated in train/liger.py: what they save and what they write in place)."""
    attn_mask: str = ""
    """The causal mask a transformers model hands SDPA (checks/stacks.py AttentionMask), built once per forward
    and passed to every block: "" (none: is_causal) | "bool" (>= 4.53's boolean mask, which SDPA converts in every
    layer) | "float" (an additive mask in the embeddings' dtype, which autocast casts in every layer when it is
    fp32) | "single" (one additive (s, s) mask expanded over the batch) | "positions" (4.38: an additive mask over
    attn_mask_positions that every layer indexes, a copy) | "flat" (padding-free batches: the micro-batch runs as
    one row of all its tokens, RoPE by each sequence's positions, under a boolean mask over the whole row)."""
    attn_mask_positions: int = 0
    """For "positions": max_position_embeddings, the side of the mask 4.38 builds."""
    attn_output_copy: bool = False
    """The attention output is copied into a new tensor before o_proj, as transformers' flash-attn path pads a
    padded batch's output back (checks/stacks.py JobFacts.flash_repad)."""
    sliding_layers: tuple = ()
    """The layers that attend within sliding_window (ModelShape.sliding_layers) and get their own mask, kernel and
    k/v repeat (checks/stacks.py JobFacts.sliding_own): sliding_mask, sliding_sdpa_kernel, sliding_repeat_kv."""
    sliding_window: int = 0
    sliding_mask: str = ""
    """The sliding layers' mask, as attn_mask's kinds: "" (none: is_causal), "bool" or "flat"."""
    sliding_repeat_kv: bool = False
    sliding_sdpa_kernel: str = "auto"
    qk_norm: str = ""
    """An RMSNorm of q and k before RoPE (ModelShape.qk_norm): "head" (over each head, Qwen3's and Gemma 3's
    q_norm/k_norm on q_proj(x).view(..., head_dim)), "full" (over the whole q and k, OLMoE) or ""."""

    def __post_init__(self):
        for name, value, choices in (("attention", self.attention, ATTENTION), ("loss", self.loss, LOSSES),
                                     ("ac_policy", self.ac_policy, AC_POLICIES),
                                     ("lora_dtype", self.lora_dtype, LORA_DTYPES),
                                     ("sdpa_kernel", self.sdpa_kernel, SDPA_KERNELS),
                                     ("block_kernels", self.block_kernels, BLOCK_KERNELS),
                                     ("attn_mask", self.attn_mask, ATTN_MASKS),
                                     ("sliding_mask", self.sliding_mask, ("", "bool", "flat")),
                                     ("sliding_sdpa_kernel", self.sliding_sdpa_kernel, SDPA_KERNELS),
                                     ("qk_norm", self.qk_norm, ("", "head", "full"))):
            if value not in choices:
                raise ValueError(f"ModelOptions.{name}: {value!r} is not one of {', '.join(choices)}")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"ModelOptions.lora_targets: unknown {sorted(unknown)}; known {', '.join(LORA_TARGETS)}")
        if self.lora_rank and not self.lora_targets:
            raise ValueError("ModelOptions.lora_targets: LoRA needs at least one target linear")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ValueError("ModelOptions.sliding_window: sliding layers need a positive window")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"ModelOptions.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.logit_softcap < 0:
            raise ValueError(f"ModelOptions.logit_softcap: must be 0 (none) or positive, got {self.logit_softcap}")
        if self.loss_chunks < 1:
            raise ValueError(f"ModelOptions.loss_chunks: must be at least 1, got {self.loss_chunks}")
        if self.reentrant and self.ac_policy in ("matmuls", "op-sac"):
            raise ValueError("ModelOptions.reentrant: op-level checkpoint policies need the non-reentrant checkpoint")
        if self.loss in ("fused", "liger") and self.lora_rank and "lm_head" in self.lora_targets:
            raise ValueError(f"ModelOptions.loss: the {self.loss} loss needs a plain head weight, not a LoRA lm_head")

    def for_layer(self, i: int) -> "ModelOptions":
        """The options layer i runs with: a sliding-window layer's own mask kind, kernel and k/v repeat."""
        if i not in self.sliding_layers:
            return self
        return dataclasses.replace(self, attn_mask=self.sliding_mask, sdpa_kernel=self.sliding_sdpa_kernel,
                                   repeat_kv=self.sliding_repeat_kv)


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale; GemmaRMSNorm (`gemma`): scale by (1 + weight) in
    fp32, then cast (ModelShape.gemma_norm); or Liger's LigerRMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-5, liger_kernel: bool = False, liger_in_place: bool = True,
                 gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.liger_kernel, self.liger_in_place, self.gemma = liger_kernel, liger_in_place, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger_kernel:
            return liger.RMSNormFunction.apply(x, self.weight, self.eps, self.liger_in_place, float(self.gemma))
        if self.gemma:
            out = x.float()
            out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
            out = out * (1.0 + self.weight.float())
            return out.type_as(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Dropout(nn.Module):
    """nn.Dropout as a GPU runs it, on every device: ATen's dropout takes the fused native_dropout, which
    saves a bool mask for backward, only for CUDA inputs (aten/src/ATen/native/Dropout.cpp,
    is_fused_kernel_acceptable); on a CPU it saves a mask in the input's dtype (4x the bytes for fp32).
    Calling native_dropout directly makes the CPU smoke and the fake-tensor trace keep what a GPU keeps."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, True)[0] if self.training else x


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update (Hu et al. 2021): W x + B A drop(x) * alpha/r.

    As peft's lora.Linear.forward (peft 0.13, tuners/lora/layer.py): the input is cast to the
    adapter's dtype when they differ, dropout (a mask and the dropped copy, both saved) comes before
    A, and the sum is cast back to the base output's dtype. peft casts under autocast too (an fp32 copy
    that autocast casts back for lora_A); podkit's own adapters (`cast_always` off) skip that copy.
    """

    def __init__(self, base: nn.Module, fan_in: int, fan_out: int, rank: int, dtype: torch.dtype,
                 dropout: float = 0.0, cast_always: bool = False):
        super().__init__()
        self.base = base
        self.cast_always = cast_always
        self.lora_A = nn.Linear(fan_in, rank, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(rank, fan_out, bias=False, dtype=dtype)
        self.dropout = Dropout(dropout) if dropout else nn.Identity()
        self.scale = LORA_ALPHA / rank

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        a = self.lora_A.weight
        if x.dtype != a.dtype and (self.cast_always or not torch.is_autocast_enabled(x.device.type)):
            x = x.to(a.dtype)
        return (result + self.lora_B(self.lora_A(self.dropout(x))) * self.scale).to(result.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, opts: ModelOptions, linear):
        super().__init__()
        self.heads, self.kv_heads, self.d_head = shape.heads, shape.kv_heads, shape.d_head
        self.softcap = shape.attn_softcap
        self.attention, self.kernel, self.repeat_kv = opts.attention, opts.sdpa_kernel, opts.repeat_kv
        self.liger_kernel = opts.block_kernels == "liger"
        self.index_mask = opts.attn_mask == "positions"
        self.qk_norm, self.output_copy = opts.qk_norm, opts.attn_output_copy
        if opts.qk_norm:
            q_w, k_w = (shape.d_head, shape.d_head) if opts.qk_norm == "head" else (shape.q_dim, shape.kv_dim)
            self.q_norm, self.k_norm = _rms_norm(shape, opts, q_w), _rms_norm(shape, opts, k_w)
        h = shape.hidden
        self.q_proj = linear("q_proj", h, shape.q_dim, bias=shape.qkv_bias)
        self.k_proj = linear("k_proj", h, shape.kv_dim, bias=shape.qkv_bias)
        self.v_proj = linear("v_proj", h, shape.kv_dim, bias=shape.qkv_bias)
        self.o_proj = linear("o_proj", shape.q_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, rows: int = 1) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.d_head)
        k = k.view(b, s, self.kv_heads, self.d_head)
        if self.qk_norm == "head":
            # Qwen3Attention: self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.d_head).transpose(1, 2)
        # A flattened row holds `rows` sequences, each from position 0 (padding-free batches' position_ids).
        row = s // rows
        cos, sin = cos[:row].to(q.dtype), sin[:row].to(q.dtype)
        if self.liger_kernel:
            if rows > 1:
                cos, sin = cos.repeat(rows, 1), sin.repeat(rows, 1)
            q, k = liger.RopeFunction.apply(q, k, cos, sin)
        elif rows > 1:
            q, k = (t.unflatten(2, (rows, row)) for t in (q, k))  # views: the same ops and bytes, per sequence
            q = (q * cos + rotate_half(q) * sin).flatten(2, 3)
            k = (k * cos + rotate_half(k) * sin).flatten(2, 3)
        else:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if self.attention == "flash-attn":
            from flash_attn import flash_attn_func  # (b, s, heads, d) layout; GQA native

            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            out = (out.clone() if self.output_copy else out).reshape(b, s, -1)
        else:
            if mask is not None and self.index_mask:
                # transformers 4.38: `causal_mask[:, :, cache_position, : key_states.shape[-2]]`, a copy per layer.
                mask = mask[:, :, torch.arange(s, device=mask.device), :s]
            if self.attention == "eager":
                out = _eager_attention(q, k, v, self.heads // self.kv_heads, self.softcap)
            elif self.repeat_kv and self.heads != self.kv_heads:
                # transformers' repeat_kv: expand then reshape, a full-width copy of k and of v.
                groups = self.heads // self.kv_heads
                k, v = (t[:, :, None].expand(b, self.kv_heads, groups, s, self.d_head).reshape(b, self.heads, s, -1)
                        for t in (k, v))
                out = _sdpa(q, k, v, self.kernel, False, mask)
            else:
                # The flash backend on CUDA (fp16/bf16), memory-efficient or math otherwise; no
                # s x s matrix is kept, and GQA needs no repeated k/v.
                out = _sdpa(q, k, v, self.kernel, self.heads != self.kv_heads, mask)
            if self.output_copy:
                out = out.clone()  # keeps the kernel's layout: the reshape below stays a view of the copy
            out = out.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


def _sdpa(q, k, v, kernel: str, gqa: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA through torch's dispatch, or straight through one aten kernel. The fused kernels
    save out and logsumexp; math saves the s x s attention weights. With a mask: is_causal off, as transformers
    calls it, and the mask in the query's dtype as torch's scaled_dot_product_attention hands it to a kernel
    (attention.cpp convert_boolean_attn_mask; autocast has cast a float one already)."""
    aten = torch.ops.aten
    if mask is not None:
        if mask.dtype not in (torch.bool, q.dtype):
            mask = mask.to(q.dtype)  # autocast's cast of an fp32 mask (scaled_dot_product_attention: lower_precision_fp)
        if kernel == "auto":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa)
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
        if kernel == "efficient" and (any(st % 8 for st in mask.stride()[:-1]) or mask.stride(-1) != 1):
            # aten attention.cpp preprocess_mask: pad_bias to rows of a multiple of 8, then a slice (a copy).
            n = mask.shape[-1]
            mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if kernel == "math":
            return aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, False, None, enable_gqa=gqa)[0]
        # The flash kernel takes no mask (sdp_utils.cpp check_for_attn_mask): the memory-efficient one runs it.
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, False)[0]
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    if kernel == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
    if kernel == "math":
        return aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, None, enable_gqa=gqa)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _eager_attention(q, k, v, groups: int, softcap: float = 0.0) -> torch.Tensor:
    """HF's eager path: repeat k/v to every head, fp32 softmax over the full s x s scores, soft-capped first where
    the model says (Gemma 2's attn_logit_softcapping: divide, tanh, multiply; tanh keeps its output)."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if softcap:
        scores = scores / softcap
        scores = torch.tanh(scores)
        scores = scores * softcap
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, linear, liger_kernel: bool = False):
        super().__init__()
        self.gate_proj = linear("gate_proj", shape.hidden, shape.ffn, bias=False)
        self.up_proj = linear("up_proj", shape.hidden, shape.ffn, bias=False)
        self.down_proj = linear("down_proj", shape.ffn, shape.hidden, bias=False)
        self.liger_kernel = liger_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger_kernel:  # LigerSwiGLUMLP
            return self.down_proj(liger.SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rms_norm(shape: ModelShape, opts: ModelOptions, dim: int) -> RMSNorm:
    return RMSNorm(dim, liger_kernel=opts.block_kernels == "liger", liger_in_place=liger_norm_in_place(shape.family),
                   gemma=shape.gemma_norm)


class Block(nn.Module):
    def __init__(self, shape: ModelShape, opts: ModelOptions, linear):
        super().__init__()
        self.input_layernorm = _rms_norm(shape, opts, shape.hidden)
        self.self_attn = Attention(shape, opts, linear)
        self.post_attention_layernorm = _rms_norm(shape, opts, shape.hidden)
        self.sandwich = shape.sandwich_norms
        if self.sandwich:
            # Gemma2DecoderLayer's names: post_attention_layernorm norms the attention's output, pre_ and
            # post_feedforward_layernorm the MLP's input and output.
            self.pre_feedforward_layernorm = _rms_norm(shape, opts, shape.hidden)
            self.post_feedforward_layernorm = _rms_norm(shape, opts, shape.hidden)
        self.mlp = MLP(shape, linear, opts.block_kernels == "liger")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, rows: int = 1) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, rows))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


# What the selective policies keep. matmuls (podkit): every matmul and attention output, recompute
# norms, activations, casts and RoPE. op-sac: torchtitan's _op_sac_save_list
# (torchtitan/models/llama3/infra/parallelize.py, 2025), saving all of these except every second
# aten.mm. Resolved lazily: some SDPA overloads only exist in some builds.
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
_MATMULS_SAVE = ("mm", "addmm") + _ATTENTION_OPS
_OP_SAC_SAVE = ("mm", "max", "_scaled_dot_product_attention_math") + _ATTENTION_OPS


def _ops(names) -> set:
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def _matmuls_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    save = _ops(_MATMULS_SAVE)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_policy():
    """torchtitan's _custom_policy: count mm calls separately in forward and in recompute, and
    recompute every second one."""
    from torch.utils.checkpoint import CheckpointPolicy

    save, mm = _ops(_OP_SAC_SAVE), torch.ops.aten.mm.default
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == mm:
            counts[mode] += 1
        keep = op in save and not (op == mm and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context(make_policy):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # A fresh policy (and mm count) per block call, as torchtitan builds one per checkpoint.
    return lambda: create_selective_checkpoint_contexts(make_policy())


class Decoder(nn.Module):
    def __init__(self, shape: ModelShape, opts: ModelOptions, linear):
        super().__init__()
        self.shape, self.opts = shape, opts
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape, opts.for_layer(i), linear) for i in range(shape.layers))
        self.norm = _rms_norm(shape, opts, shape.hidden)
        self.lm_head = None if shape.tie_embeddings else linear("lm_head", shape.hidden, shape.vocab, bias=False)
        # RoPE tables: recomputed by init_weights after materialisation, never saved.
        self.register_buffer("rope_cos", torch.empty(opts.max_seq_len, shape.d_head), persistent=False)
        self.register_buffer("rope_sin", torch.empty(opts.max_seq_len, shape.d_head), persistent=False)
        self.kept_logits: torch.Tensor | None = None
        self.on_blocks_backward: Callable[[], None] | None = None
        """Called when backward reaches the blocks (the loss's, the head's and the final norm's nodes done)."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss, computed as opts.loss says (train/losses.py)."""
        x = self.embed_tokens(tokens)
        if self.opts.reentrant and self.opts.ac_policy != "none" and not x.requires_grad:
            # A reentrant checkpoint only backpropagates into inputs that require grad: with a frozen
            # embedding (LoRA), HF's enable_input_require_grads marks the embedding output.
            x.requires_grad_(True)
        rows = 1
        if self.opts.attn_mask == "flat":
            # Padding-free batches: the micro-batch's sequences concatenated into one row (a view).
            rows = x.shape[0]
            x = x.reshape(1, -1, x.shape[-1])
        mask = self._attention_mask(x)
        sliding = self._sliding_mask(x) if self.opts.sliding_layers else None
        for i, block in enumerate(self.layers):
            x = self._run_block(block, x, sliding if i in self.opts.sliding_layers else mask, rows)
        del mask, sliding  # the decoder's forward returns here in transformers: what no node saved dies before the loss
        if rows > 1:
            x = x.reshape(rows, -1, x.shape[-1])
        if self.on_blocks_backward is not None and x.requires_grad:
            x.register_hook(self._blocks_backward)
        x = self.norm(x)
        loss = self.opts.loss
        if loss == "chunked":
            keep = [] if self.opts.logits_kept else None
            out = losses.chunked(x, self._head, targets, self.opts.loss_chunks, self.opts.loss_upcast, keep,
                                 self.opts.logits_fp32)
            self.kept_logits = keep
            return out
        if loss in ("fused", "liger"):
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            if loss == "liger":
                return losses.liger(x, weight, targets)
            return losses.fused(x, weight, targets, self.opts.loss_chunks)
        logits = self._head(x)
        if self.opts.logits_fp32:
            logits = logits.float()
        if loss == "fp32-upcast-shifted":
            return losses.shifted_copy(logits.float(), targets)  # the 16-bit logits stay in this frame
        if loss == "compute-shifted":  # GPT-2 before transformers 4.49
            out = losses.compute_shifted(logits, targets)
            if torch.is_autocast_enabled(logits.device.type):
                # accelerate's native AMP makes the forward's outputs fp32 (convert_outputs_to_fp32) while the
                # loss's saved tensors and the 16-bit logits live; the copy goes when compute_loss returns
                logits.float()
            return out
        if loss == "fp32-logits-kept":
            logits = logits.float()
            self.kept_logits = logits  # the caller's output object holds it until after backward
            # transformers <= 4.45 then cross-entropies a shifted .contiguous() copy (none of one sequence)
            return losses.shifted_copy(logits, targets)
        if self.opts.logits_kept:
            self.kept_logits = logits
        return losses.plain(logits, targets, upcast=loss != "native" and self.opts.loss_upcast)

    def _blocks_backward(self, grad: torch.Tensor) -> None:
        self.on_blocks_backward()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        cap = self.opts.logit_softcap
        if cap:
            # Gemma2ForCausalLM.forward's three statements, each rebinding `logits` (the quotient and the head's
            # output die as the next is made; tanh saves its output for backward)
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits

    def release_outputs(self) -> None:
        """Drop what the forward's output kept (the step calls this after backward)."""
        self.kept_logits = None

    def _attention_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The causal mask ModelOptions.attn_mask says the stack's model builds (True / 0.0: attend)."""
        kind = self.opts.attn_mask
        if not kind:
            return None
        b, s = x.shape[:2]
        n = max(self.opts.attn_mask_positions, s) if kind == "positions" else s
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if kind in ("bool", "flat"):
            # masking_utils.sdpa_mask: (b, 1, s, s) bool; a flattened row's is block-causal, the same bytes.
            return causal.expand(b, 1, n, n).clone()
        additive = torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill_(~causal, torch.finfo(x.dtype).min)
        return additive.expand(b, 1, n, n) if kind == "single" else additive.expand(b, 1, n, n).clone()

    def _sliding_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sliding-window layers' boolean mask (masking_utils sliding_window_causal_mask_function: a query attends
        to the sliding_window keys up to itself), as ModelOptions.sliding_mask says it is built."""
        kind = self.opts.sliding_mask
        if not kind:
            return None
        b, s = x.shape[:2]
        ones = torch.ones(s, s, dtype=torch.bool, device=x.device)
        window = ones.tril() & ones.triu(-(self.opts.sliding_window - 1))
        return window.expand(b, 1, s, s).clone()  # (b, 1, s, s): the padding mask folded in

    def _run_block(self, block: Block, x: torch.Tensor, mask: torch.Tensor | None = None, rows: int = 1) -> torch.Tensor:
        policy = self.opts.ac_policy
        extra = () if mask is None else (mask, rows)
        if policy == "none":
            return block(x, self.rope_cos, self.rope_sin, *extra)
        from torch.utils.checkpoint import checkpoint

        if self.opts.reentrant:
            return checkpoint(block, x, self.rope_cos, self.rope_sin, *extra, use_reentrant=True)
        kwargs = {}
        if policy == "matmuls":
            kwargs["context_fn"] = _selective_context(_matmuls_policy)
        elif policy == "op-sac":
            kwargs["context_fn"] = _selective_context(_op_sac_policy)
        # Non-reentrant: works with autocast, FSDP2 hooks and inputs that need no grad.
        return checkpoint(block, x, self.rope_cos, self.rope_sin, *extra, use_reentrant=False, **kwargs)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise in place on whatever device the model now lives on (deterministic per seed)."""
        gen = torch.Generator(device=self.rope_cos.device).manual_seed(seed)
        for name, p in self.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
            if local.dtype in (torch.uint8, torch.int8) or getattr(p, "bnb_quantized", False):
                continue
            if name.endswith("lora_B.weight"):
                local.zero_()  # LoRA starts as the identity update
            elif local.dim() == 1:
                # A norm's identity scale: 1, or 0 for GemmaRMSNorm, which scales by (1 + weight)
                local.fill_(float(not self.shape.gemma_norm)) if "norm" in name else local.zero_()
            else:
                local.normal_(0.0, 0.02, generator=_gen_for(local, gen))
        d = self.shape.d_head
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=self.rope_cos.device).float() / d))
        t = torch.arange(self.opts.max_seq_len, device=inv.device).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos.copy_(emb.cos())
        self.rope_sin.copy_(emb.sin())


def _gen_for(t: torch.Tensor, gen: torch.Generator) -> torch.Generator | None:
    return gen if gen.device == t.device else None


TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    return TORCH_DTYPES[PRECISION[precision].dtype]


def param_dtype(precision: str) -> torch.dtype:
    """How trainable weights are stored: fp32 masters for mixed precision, the 16-bit dtype for pure bf16/fp16."""
    return compute_dtype(precision) if PRECISION[precision].pure_16bit else torch.float32


def build(shape: ModelShape, opts: ModelOptions, precision: str) -> Decoder:
    """The model on the meta device: shapes and dtypes only, no memory anywhere."""
    if shape.arch != "llama":
        from podkit.checks.errors import ConfigError

        raise ConfigError("model", f"bin/smoke trains Llama-style decoders; {shape.name} is {shape.arch}",
                          "use a llama/mistral/qwen2 preset, hf_config or explicit dimensions")
    trainable = param_dtype(precision)
    frozen = compute_dtype(precision)  # LoRA's base never updates: no fp32 master copy
    adapter = {"param": trainable, "fp32": torch.float32, "compute": frozen}[opts.lora_dtype]
    with torch.device("meta"):
        def linear(name, fan_in, fan_out, bias=False):
            if opts.lora_rank and name in opts.lora_targets:
                base = _base_linear(fan_in, fan_out, bias, opts.base_quant if name != "lm_head" else "none", frozen)
                return LoRALinear(base, fan_in, fan_out, opts.lora_rank, adapter, opts.lora_dropout,
                                  opts.adapter_input_cast)
            if opts.lora_rank:
                return _base_linear(fan_in, fan_out, bias, opts.base_quant if name != "lm_head" else "none", frozen)
            return nn.Linear(fan_in, fan_out, bias=bias, dtype=trainable)

        model = Decoder(shape, opts, linear)
        if opts.lora_rank:
            for name, p in model.named_parameters():
                if "lora_" not in name:
                    p.requires_grad_(False)
                    if p.is_floating_point():
                        p.data = p.data.to(frozen)
        else:
            model.to(trainable)
    return model


def _base_linear(fan_in: int, fan_out: int, bias: bool, quant: str, dtype: torch.dtype) -> nn.Module:
    if quant == "none":
        return nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype)
    import bitsandbytes as bnb

    if quant == "nf4":
        # QLoRA: NF4 with double quantization, bf16 compute (Dettmers et al. 2023).
        return bnb.nn.Linear4bit(fan_in, fan_out, bias=bias, compute_dtype=dtype, compress_statistics=True,
                                 quant_type="nf4")
    return bnb.nn.Linear8bitLt(fan_in, fan_out, bias=bias, has_fp16_weights=False)


def materialize(model: Decoder, device: torch.device, seed: int) -> Decoder:
    """Allocate every (local) tensor once on `device` and initialise it there.

    With bitsandbytes bases, each weight is initialised in the compute dtype on the GPU and
    quantized there, one layer at a time.
    """
    if model.opts.base_quant == "none":
        model.to_empty(device=device)
        model.init_weights(seed)
        return model
    return _materialize_quantized(model, device, seed)


def _materialize_quantized(model: Decoder, device: torch.device, seed: int) -> Decoder:
    import bitsandbytes as bnb

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dtype = compute_dtype("bf16")
    # Every bitsandbytes base, adapted or not (bnb's Linear4bit/Linear8bitLt subclass nn.Linear).
    for base in model.modules():
        if isinstance(base, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            w = torch.empty(base.out_features, base.in_features, device=device, dtype=dtype)
            w.normal_(0.0, 0.02, generator=gen)
            if isinstance(base, bnb.nn.Linear4bit):
                base.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                                compress_statistics=True).to(device)
            else:
                base.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False).to(device)
            if base.bias is not None:
                base.bias = nn.Parameter(torch.zeros(base.out_features, device=device, dtype=dtype),
                                         requires_grad=False)
    # Everything still on meta (embeddings, norms, adapters, RoPE tables) is allocated now.
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
    model.init_weights(seed)
    return model


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, trainable), counting each shared tensor once and quantized weights by their element count."""
    total = trainable = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if getattr(p, "quant_state", None) is not None:  # Params4bit packs two weights per byte
            n = p.quant_state.shape.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
