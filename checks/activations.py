"""What a training step keeps for backward, per token, derived op by op.

Instead of one closed formula (Korthikanti et al. 2022's 34sbh + 5as^2b, which assumes fp16
everywhere and trainable weights), a decoder block is walked op by op as HF modeling_llama.py
writes it (LlamaRMSNorm, q/k/v/o and gate/up/down projections, RoPE, SDPA, SwiGLU), and each op
records what autograd saves given the job's facts. The rules that decide it are PyTorch's:

- an op saves an input only when the gradient of the *other* operand needs it: a frozen linear
  (LoRA's base) keeps no copy of its input (torch's autograd codegen saves `self` for mm only when
  mat2 requires grad), a trainable one does; bitsandbytes' MatMul4Bit keeps nothing since 0.43.2,
  but before it kept its input A as `ctx.tensors = (A, B)` (bitsandbytes/autograd/_functions.py;
  commit 9e753741, #1270), a plain attribute that checkpointing's hooks never see;
- autocast casts an fp32 input separately at every matmul call (only leaf weights are cached), so
  an fp32 residual stream costs one 16-bit copy per consuming linear;
- peft's LoRA Linear runs `lora_B(lora_A(dropout(x))) * scaling` beside the base: dropout keeps
  a 1-byte mask and its output, lora_A keeps its input, lora_B keeps lora_A's output; with fp32
  adapters over a 16-bit input peft first casts x to the adapter dtype (peft tuners/lora/layer.py
  `_cast_input_dtype`);
- checkpointing policies keep other sets: per-block checkpointing keeps the block input only;
  selective activation checkpointing (torch.utils.checkpoint.create_selective_checkpoint_contexts)
  keeps the outputs of the ops its policy marks MUST_SAVE, whatever autograd would have saved.

The same walk records each op's inputs, outputs and saved tensors, so a block's backward is replayed
too: its recompute (checkpointed blocks), then its nodes in reverse, each allocating its inputs'
gradients and then releasing what it saved, as autograd's engine does (backward_intermediates_per_token,
recompute_transient_per_token).

The result is bytes per token of one block (and of the head), which memory.py multiplies out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field

from podkit.checks.kernels import attention_kernel, attention_run
from podkit.checks.stacks import adapted_banks, liger_norm_in_place, parse_version, router_adapter_runs, targeted

QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(eq=False)
class Tensor:
    """A symbolic activation: bytes per token (width x dtype bytes)."""

    label: str
    bytes: float
    dtype_bytes: float = 0.0
    grad: bool = True
    """Backward computes a gradient for it (activations do; masks and statistics do not)."""


@dataclass(eq=False)
class Op:
    """One autograd node of the forward: the tensors it takes gradients for, its outputs, what it saves,
    and what its backward allocates and frees inside the call (beyond its inputs' gradients)."""

    inputs: tuple
    outputs: tuple
    saved: tuple
    scratch: float = 0.0
    grad_alias: bool = False
    """The output's gradient itself becomes an input's gradient (same dtype): AddBackward hands it on,
    and Liger's RMSNorm writes dX into dY's storage."""
    holds: tuple = ()
    """Tensors a Python local keeps alive until this op runs (the forward function has not returned)."""
    grads_in_saved: bool = False
    """The backward writes its inputs' gradients into the storage of the saved inputs themselves
    (Liger's SiLU-mul): no new buffer, the saved tensor becomes the gradient."""
    weight_grad: float = 0.0
    """Bytes (not per token) of the weight gradient this node's backward makes before its input's: a trained
    nn.Linear's, fan_in x fan_out in the compute dtype (MmBackward0 computes mat2's gradient, then self's:
    torchgen load_derivatives.py emits the formulas in sorted order)."""


@dataclass(frozen=True)
class BlockFacts:
    """What decides the saved set, resolved from the job once."""

    hidden: int
    q_dim: int
    kv_dim: int
    ffn: int
    heads: int
    seq_len: int  # tokens in one attention row: train.seq_len, or all the micro-batch's in a flattened one
    e: int  # compute dtype bytes: matmul inputs and outputs
    stream: int  # residual stream dtype bytes
    weights_trainable: bool  # full fine-tune: every linear and norm trains
    quantized: bool  # bitsandbytes base linears
    quant_saves_input: bool  # bitsandbytes < 0.43.2: each quantized matmul keeps its input
    autocast: bool  # 16-bit casts of fp32 inputs at each matmul
    norm_weight_bytes: int
    targets: frozenset
    lora_rank: int
    lora_dropout: bool
    adapter_bytes: int  # dtype of the adapter weights
    adapter_input_cast: bool  # peft casts x to the adapter dtype before lora_A
    moe: object  # checks.models.MoeSpec or None
    kernel: str  # flash | efficient | math | eager
    gqa: bool  # SDPA sees fewer kv heads than q heads (native GQA)
    repeat_kv: bool  # k/v copied out to every head before attention
    fused_qkv: bool  # q, k, v are views of one fused linear's output
    liger: bool = False  # Liger's RMSNorm, RoPE and SiLU-mul kernels (stacks.BLOCK_KERNELS)
    liger_norm_in_place: bool = True  # Liger's RMSNorm writes dX into dY (stacks.liger_norm_in_place)
    expert_linears: bool = False  # routed experts are nn.Linear modules, not 3-D banks (ModelShape.expert_linears)
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")  # a routed expert's gate, up, down
    router_name: str = "router"
    router_linear: bool = False  # the router is an nn.Linear (bitsandbytes and LoRA may take it)
    quant_4bit: bool = False  # bitsandbytes Linear4bit base linears: each returns its input's dtype
    peft_quant_clone: bool = False  # peft's LoRA wrapper of a Linear4bit clones the base output
    expert_loop: str = ""  # routed experts run one by one: "index_add" (transformers 4.x), "index_put" (litgpt)
    lora_banks: frozenset = frozenset()  # 3-D banks and bare router weights peft's ParamWrapper adapts (bank_targets)
    qk_norm: str = ""  # RMSNorm of q and k before RoPE: "head" (per head: Qwen3, Gemma 3), "full" (OLMoE), ""
    mask_values: int = 0  # values per token of the mask copy each layer's fused SDPA kernel keeps, or 0
    flash_repad: bool = False  # the attention output is padded back into a new tensor (JobFacts.flash_repad)
    attn_softcap: bool = False  # eager attention soft-caps its scores (ModelShape.attn_softcap): tanh keeps s x s
    norm_scaled_fp32: bool = False  # the norm scales in fp32, casts after: Gemma, GPT-OSS (ModelShape.norm_scaled_fp32)
    fused_proj: bool = False  # one qkv_proj and one gate_up_proj, sliced into views (JobFacts.fused_proj)
    v_copied: bool = False  # SDPA gets a contiguous copy of v (JobFacts.sdpa_contiguous), not a view of a fused qkv
    sandwich_norms: bool = False  # the attention's and the MLP's outputs normed before each residual add
    mla: object = None  # checks.models.MlaSpec: DeepSeek-V2/V3 latent attention, or None
    router_fp32: bool = False  # the router's linear runs on an fp32 copy of the hidden states (router_fp32)
    router_scores_bytes: int = 4  # dtype of the router scores it keeps: fp32 but for DeepSeek-V3 under autocast
    mla_value: str = ""  # what MLA's attention keeps for v (mla_value): "view" | "copy" | "padded"
    math_fp32: bool = False  # SDPA's math kernel runs 16-bit q, k and v in fp32 (math_upcast)
    attn_sinks: bool = False  # eager attention joins a learned sink logit to every row (ModelShape.attn_sinks)
    rope_cat: bool = False  # RoPE returns q and k as torch.cat outputs, (b, heads, s, d)-contiguous (GPT-OSS)
    clamped_swiglu: bool = False  # routed experts' clamped SwiGLU on one gate_up output (ModelShape.clamped_swiglu)
    router_topk_softmax: bool = False  # the router keeps a softmax over its top-k logits only, in their dtype
    bank_bytes: int = 0  # the dtype transformers 5.x experts' grouped matmuls run in (bank_dtype_bytes); 0: autocast's


def block_facts(job, device: str = "cuda", sliding: bool = False) -> BlockFacts:
    """What one block saves and makes, as the job's stack runs it; `sliding`: one of its sliding-window layers
    (ModelShape.sliding_layers), with that layer's own mask, kernel and k/v repeat (JobFacts.layer)."""
    t, f, shape = job.train, job.facts.layer(sliding), job.shape
    e = t.compute_bytes
    lora = f.lora
    # The residual stream is fp32 when the embedding weight is fp32 and nothing casts it down:
    # fp32 jobs, and mixed precision with fp32 weights on the GPU (autocast). LoRA bases, pure 16-bit (bf16, fp16)
    # and FSDP's bf16 gathered parameters give a 16-bit stream; a base prepared for k-bit training has
    # fp32 norms whose outputs the 4-bit linears return in fp32, added into the stream from the first
    # block's output on (JobFacts.kbit_prepared; the first block's input, the embedding, is 16-bit:
    # memory.estimate prices it so).
    stream = 4 if (f.autocast and not lora) or f.kbit_prepared else e
    adapter = f.adapter_compute_bytes or e
    # The stack's k/v repeat happens before SDPA and eager attention; the flash-attn package takes grouped
    # k/v as they are (transformers 4.48 integrations/flash_attention.py passes key/value to
    # _flash_attention_forward unrepeated; the 4.3x-4.47 *FlashAttention2 classes alike).
    repeat = shape.kv_heads != shape.heads and f.repeat_kv and attention_run(job) != "flash-attn"
    kernel = attention_kernel(job, device, sliding)
    # The mask copy a layer's fused kernel keeps for backward (the math kernel adds the mask to its scores and keeps
    # none of it).
    mask_values = (f.attn_mask.layer_values_per_token(t.seq_len, t.micro_batch, kernel)
                   if f.attn_mask and kernel in ("flash", "efficient") else 0)
    fp32_router = router_fp32(job)
    return BlockFacts(
        hidden=shape.hidden, q_dim=shape.q_dim, kv_dim=shape.kv_dim, ffn=shape.dense_ffn, heads=shape.heads,
        moe=shape.moe,
        seq_len=attention_row(job), e=e, stream=stream,
        weights_trainable=not lora, quantized=t.base_quant != "none",
        quant_saves_input=f.quant_saves_input, autocast=f.autocast,
        # The dtype the norm weight is used in: fp32 masters only where autocast runs on fp32 weights, or
        # where prepare_model_for_kbit_training made it fp32; FSDP's MixedPrecisionPolicy gathers it in
        # bf16, a LoRA base and pure bf16 or fp16 store it so.
        norm_weight_bytes=4 if f.kbit_prepared else stream,
        targets=frozenset(f.lora_targets), lora_rank=t.lora_rank, lora_dropout=f.lora_dropout > 0,
        adapter_bytes=adapter, adapter_input_cast=f.stack.adapter_input_cast,
        kernel=kernel, gqa=shape.kv_heads != shape.heads and not repeat,
        # transformers' eager_attention_forward (Gemma 2, 4.42-5.23) divides the scores by the cap, takes tanh and
        # multiplies back before the mask and softmax; litgpt's and torchtune's Gemma 2 attention do the same in
        # their explicit paths. flash-attn takes the cap inside its kernel; SDPA has none.
        attn_softcap=bool(shape.attn_softcap) and kernel == "eager",
        norm_scaled_fp32=shape.norm_scaled_fp32, sandwich_norms=shape.sandwich_norms, fused_proj=f.fused_proj,
        v_copied=f.sdpa_contiguous,
        repeat_kv=repeat,
        fused_qkv=f.stack.fused_qkv, liger=f.block_kernels == "liger",
        liger_norm_in_place=liger_norm_in_place(shape.family),
        expert_linears=shape.expert_linears, expert_names=shape.expert_names, router_name=shape.router_name,
        router_linear=shape.router_linear, quant_4bit=t.base_quant == "nf4",
        # adapter_input_cast marks peft's LoRA layers (hf, deepspeed, fsdp_qlora); its Linear4bit wrapper
        # clones the base output first (peft 0.10-0.13 tuners/lora/bnb.py Linear4bit.forward).
        peft_quant_clone=f.stack.adapter_input_cast and t.base_quant == "nf4",
        # Experts as nn.Linear modules run in a Python loop over the experts: transformers 4.x
        # MixtralSparseMoeBlock.forward (`for expert_idx in range(self.num_experts)`, index_add_ into
        # final_hidden_states; Qwen2/3-MoE, OLMoE, DeepSeek alike), litgpt model.py LLaMAMoE.forward
        # (`y[token_idx] += probs[...] * expert(x[token_idx])`). 5.x banks run grouped_mm over all at once.
        expert_loop="" if not shape.expert_linears else "index_put" if f.stack.name == "litgpt" else "index_add",
        lora_banks=bank_targets(job),
        qk_norm=qk_norm(job),
        mask_values=mask_values,
        flash_repad=f.flash_repad,
        mla=shape.mla,
        mla_value=mla_value(job, kernel) if shape.mla else "",
        router_fp32=fp32_router,
        # DeepseekV3TopkRouter's `router_logits.sigmoid()` (4.51-5.23) keeps its output in the logits' dtype, which
        # autocast's F.linear makes the compute dtype whatever the fp32 copies; the others' softmax is fp32
        # (`softmax(..., dtype=torch.float32)`, Mixtral's `router_logits.float()`).
        router_scores_bytes=e if fp32_router and f.autocast and shape.family == "deepseek_v3" else 4,
        math_fp32=kernel == "math" and math_upcast(job),
        # transformers 5.23 modeling_gpt_oss.py: eager_attention_forward's sink column, _apply_rotary_emb's
        # torch.cat((first_, second_), dim=-1), GptOssExperts._apply_gate, GptOssTopKRouter's
        # softmax(router_top_value, dim=1, dtype=router_top_value.dtype).
        attn_sinks=shape.attn_sinks, rope_cat=shape.rope_cat and not (kernel == "flash" and flash3_sinks(job)),
        clamped_swiglu=shape.clamped_swiglu,
        router_topk_softmax=shape.router_topk_softmax,
        bank_bytes=bank_dtype_bytes(job),
    )


def bank_dtype_bytes(job) -> int:
    """The dtype a transformers 5.x MoE's routed experts compute in: their 3-D banks' own. _grouped_mm (5.23
    integrations/moe.py) is not autocast-enabled and runs `input.to(weight.dtype)`, so fp32 banks compute in fp32:
    fp32 masters under autocast, and a base prepared for k-bit training (peft prepare_model_for_kbit_training casts
    every parameter but Params4bit to fp32, and bitsandbytes quantizes no 3-D bank). 0 where the experts are no
    transformers 5.x banks (nn.Linear experts, torchtitan's, which casts to bf16 itself): autocast rules."""
    f, shape = job.facts, job.shape
    if not (shape.moe and not shape.expert_linears and f.stack.transformers_release):
        return 0
    return 4 if (f.autocast and not f.lora) or f.kbit_prepared else job.train.compute_bytes


def flash3_sinks(job) -> bool:
    """Whether a GPT-OSS job's flash path runs kernels-community/vllm-flash-attn3: transformers 5.10+ lists it first in
    GptOssPreTrainedModel._compatible_flash_implementations and swaps flash_attention_2/3 for it on CUDA
    (modeling_utils.py _check_and_adjust_attn_implementation; read in 5.10, 5.11, 5.12 and 5.23, absent in 5.0). Its
    mha_fwd (kernels-community vllm-flash-attn3/flash-attn/flash_api.cpp) allocates the output as
    `torch::empty({batch_size, seqlen_q, num_heads, head_size_v})`, (b, s, heads, d)-contiguous whatever q's layout,
    so o_proj takes a view of it; the flash-attn package's empty_like(q) follows RoPE's torch.cat layout instead."""
    t = job.train
    return job.shape.attn_sinks and (not t.transformers or parse_version(t.transformers) >= (5, 10))


def math_upcast(job) -> bool:
    """Whether SDPA's math kernel computes in fp32 what reaches it in 16 bits: torch 2.5+
    _scaled_dot_product_attention_math (aten/src/ATen/native/transformers/attention.cpp, pytorch#128922) takes
    `query_.to(at::kFloat)`, key's and value's alike, unless allow_fp16_bf16_reduction_math_sdp (off by default), so
    it keeps fp32 q, k, v and attention weights (measured on a CPU: tests/test_hf_saved_tensors.py)."""
    t = job.train
    return t.compute_bytes == 2 and (not t.torch or parse_version(t.torch) >= (2, 5))


def router_fp32(job) -> bool:
    """transformers' DeepSeek routers score in fp32: `F.linear(hidden_states.type(torch.float32),
    self.weight.type(torch.float32))` (DeepseekV3TopkRouter.forward, 4.51.3 through 5.23.0; DeepseekV2MoEGate
    4.55-4.57; DeepseekV2Moe.forward on its nn.Linear gate's weight in 5.0 and 5.10; DeepseekV2TopkRouter 5.23).
    torchtitan's router runs its nn.Linear in the compute dtype and casts the scores after (models/moe.py
    TokenChoiceTopKRouter: `torch.sigmoid(scores.to(torch.float32))`)."""
    return (job.shape.moe is not None and job.shape.family in ("deepseek_v2", "deepseek_v3")
            and job.facts.stack.transformers_release)


def mla_value(job, kernel: str) -> str:
    """What a latent-attention layer's kernel keeps for v (transformers 5.23 DeepseekV3Attention.expand_kv: v is a
    split of kv_b_proj's (b, s, heads, nope + v) output, transposed; torchtitan's deepseek_v3 Attention alike).
    "padded": the flash-attn path pads v up to q's head dim, a new tensor (5.23 integrations/flash_attention.py
    `F.pad(value, ...)`; 4.51-5.x DeepseekV3Attention.forward itself). "copy": a contiguous heads x v_head_dim copy,
    made by transformers 4.48-4.55's sdpa_attention_forward (JobFacts.sdpa_contiguous), or by torch.matmul in eager
    (and the math kernel's) probs @ v, whose reshape of v to (b x heads, s, v) cannot view a batch of more than one
    row. "view": the kernel saves v as given (the memory-efficient kernel, derivatives.yaml
    _scaled_dot_product_efficient_attention: value; the reshape's view of one row), which keeps all of kv_b_proj's
    output, the no-RoPE keys' part too."""
    f, t = job.facts, job.train
    if attention_run(job) == "flash-attn" and job.shape.v_head_dim != job.shape.d_head:
        return "padded"
    if f.sdpa_contiguous and t.attention == "sdpa":
        return "copy"
    one_row = t.micro_batch == 1 or t.padding == "flattened"
    # The math kernel's own fp32 copy of a 16-bit v (math_upcast) is contiguous: its matmul then copies nothing.
    matmul_reshapes = kernel == "eager" or (kernel == "math" and not math_upcast(job))
    return "copy" if matmul_reshapes and not one_row else "view"


def main_block_facts(job, device: str = "cuda") -> BlockFacts:
    """The facts of most of the job's blocks, sliding-window or full attention: the block the allocator's replays
    walk (checks/step_replay.py)."""
    return block_facts(job, device, sliding=2 * len(job.shape.sliding_layers) > job.shape.layers)


def qk_norm(job) -> str:
    """The RMSNorm of q and k before RoPE, as the job's model has it: Qwen3Attention (transformers 5.23
    modeling_qwen3.py) q_norm(q_proj(x).view(..., head_dim)), the block's RMSNorm over each head ("head"); OLMoE's
    over the whole q and k ("full"). The podkit stack's own model (train/model.py) has none; bin/smoke's replica of
    another stack builds the job's (ModelOptions.qk_norm)."""
    return job.shape.qk_norm if job.facts.stack.name != "podkit" else ""


def attention_row(job) -> int:
    """Tokens one attention call spans per row. A padding-free batch (train.padding 'flattened': TRL's collator
    concatenates the micro-batch into one (1, b x s) row with position_ids) is attended as one row by SDPA and eager
    whatever mask keeps its sequences apart: eager's and the math kernel's scores, and the memory-efficient kernel's
    32-aligned logsumexp, span all T = b x s tokens (checked on a transformers 5.23 forward in
    tests/test_attention_mask.py). flash-attn runs each sequence alone (varlen from the position_ids), and nothing
    it keeps grows with the row."""
    t = job.train
    return t.seq_len * t.micro_batch if t.padding == "flattened" else t.seq_len


def bank_targets(job) -> frozenset:
    """The block's matmuls, as named here, whose 3-D bank or bare router weight peft adapts (JobFacts.peft_banks):
    the routed experts' gate and up (one fused gate_up_proj bank), their down, the router."""
    shape = job.shape
    gate_up, down, router = adapted_banks(shape.family, job.facts.peft_banks)
    router = router and router_adapter_runs(shape.family, job.train.transformers)
    gate, up, down_name = shape.expert_names
    return frozenset(([f"experts.{gate}", f"experts.{up}"] if gate_up else [])
                     + ([f"experts.{down_name}"] if down else []) + ([shape.router_name] if router else []))


@dataclass
class Trace:
    """The ops of one forward, with what each saves and which outputs a SAC policy could keep."""

    facts: BlockFacts
    saved: dict = field(default_factory=dict)  # id -> Tensor, what autograd keeps
    ctx_kept: dict = field(default_factory=dict)  # id -> Tensor, kept outside autograd's saved tensors
    matmuls: list = field(default_factory=list)  # mm / addmm outputs, in call order
    attention_out: list = field(default_factory=list)  # SDPA flash/efficient outputs
    ops: list = field(default_factory=list)  # autograd nodes in creation order
    output: Tensor | None = None  # the block's output (its gradient starts the block's backward)
    expert_of: dict = field(default_factory=dict)
    """In a loop over routed experts (BlockFacts.expert_loop), the expert each tensor (by id) and op (by
    ("op", index)) belongs to: their sizes follow that expert's share of the tokens, which only a routing
    decides (checks/step_replay.py routes them); everything here prices the even share."""
    expert: int = -1  # the routed expert whose tensors and ops are being made, or -1
    qkv_dropout: tuple | None = None
    """Under a fused qkv (BlockFacts.fused_qkv), the adapter's one dropout: (its input, its output)."""

    def new(self, label: str, width: float, dtype_bytes: float, grad: bool = True) -> Tensor:
        t = Tensor(label, width * dtype_bytes, dtype_bytes, grad)
        if self.expert >= 0:
            self.expert_of[id(t)] = self.expert
        return t

    def save(self, *tensors: Tensor) -> None:
        for t in tensors:
            self.saved[id(t)] = t

    def hold(self, *tensors: Tensor) -> None:
        """Keep tensors alive through the last op recorded: a function's argument lives until it returns."""
        last = self.ops[-1]
        self.ops[-1] = dataclasses.replace(last, holds=last.holds + tensors)

    def op(self, inputs, outputs, saved=(), scratch: float = 0.0, grad_alias: bool = False, holds=(),
           grads_in_saved: bool = False, weight_grad: float = 0.0) -> None:
        if self.expert >= 0:
            self.expert_of[("op", len(self.ops))] = self.expert
        # A tensor an op takes twice (views of one fused output: Phi-3's q, k and v) gets one gradient buffer here.
        inputs = tuple({id(t): t for t in inputs}.values())
        self.ops.append(Op(inputs, tuple(outputs), tuple(saved), scratch, grad_alias, tuple(holds),
                           grads_in_saved, weight_grad))
        self.save(*saved)

    # ---- ops -----------------------------------------------------------------------------
    def rmsnorm(self, x: Tensor, name: str, width: float = 0, rows: float = 1) -> Tensor:
        """LlamaRMSNorm: x.float(); x * rsqrt(mean(x^2) + eps); weight * x.to(input_dtype). `width`: values per token
        (the hidden size, or q's or k's for a q/k norm), normalised in `rows` rows of their own (heads)."""
        f = self.facts
        w = width or f.hidden
        if f.liger:
            # LigerRMSNormFunction (liger_kernel/ops/rms_norm.py): Y in X's dtype, an fp32 rstd per row,
            # ctx.save_for_backward(X, W, RSTD); backward with in_place=True (LigerRMSNorm's default, and
            # monkey_patch's for Llama/Mistral/Qwen) makes dX = dY: no new buffer; Gemma 2/3's in_place=False
            # allocates dX. Its fp32 dW partials (SMs x hidden) do not grow with tokens: < 5 MiB for a
            # hidden of 8192 on 132 SMs.
            out = self.new(f"{name}: output (Liger)", w, x.dtype_bytes)
            self.op([x], [out], saved=(x, self.new(f"{name}: rstd (Liger)", rows, 4, grad=False)),
                    grad_alias=f.liger_norm_in_place)
            return out
        # x.to(torch.float32) is x itself when x is fp32 already, a slice of a wider output too (MLA's kv latent):
        # pow then saves that view, which keeps the whole output.
        xf = x if x.dtype_bytes == 4 else self.new(f"{name}: fp32 upcast", w, 4)
        if xf is not x:
            self.op([x], [xf])
        xn = self.new(f"{name}: normalised", w, 4)
        # x * rsqrt(x.pow(2).mean() + eps): the product's and pow's backward each give x a gradient, one
        # alive beside the other until they are summed. At the most, PowBackward0 (torch/csrc/autograd/
        # FunctionsManual.cpp pow_backward: grad * (exponent * self.pow(exponent - 1))) makes three
        # x-sized tensors while MeanBackward's expanded gradient and the product's x-gradient live: five
        # x-sized tensors, two of which the replay counts (the output's gradient, then x's).
        self.op([xf], [xn], saved=(xf, self.new(f"{name}: rsqrt", rows, 4, grad=False)), scratch=12 * w)
        if f.norm_scaled_fp32:
            # GemmaRMSNorm: `output * (1.0 + self.weight.float())` in fp32, whose MulBackward0 saves the normalised
            # x for the weight's gradient, then `.type_as(x)` (a no-op for an fp32 input). GptOssRMSNorm alike:
            # `(self.weight * hidden_states).to(input_dtype)`, hidden_states the fp32 normalised x (a 16-bit weight
            # times it is promoted to fp32).
            xs = self.new(f"{name}: scaled in fp32", w, 4)
            self.op([xn], [xs], saved=(xn,) if f.weights_trainable else ())
            if x.dtype_bytes == 4:
                return xs
            out = self.new(f"{name}: output", w, x.dtype_bytes)
            self.op([xs], [out])
            return out
        # hidden_states.to(input_dtype): back to the input's dtype
        xc = xn if x.dtype_bytes == 4 else self.new(f"{name}: normalised, cast back", w, x.dtype_bytes)
        if xc is not xn:
            self.op([xn], [xc])
        out_bytes = max(x.dtype_bytes, f.norm_weight_bytes)  # type promotion of weight * x
        out = self.new(f"{name}: output", w, out_bytes)
        # weight * x saves x only for the weight's gradient; LlamaRMSNorm rebinds its local to the
        # normalised x, which lives until it returns.
        self.op([xc], [out], saved=(xc,) if f.weights_trainable else (), holds=(xn,))
        return out

    def linear(self, x: Tensor, fan_in: float, fan_out: float, name: str, copies: float = 1.0,
               module: bool = True, grouped: bool = False) -> Tensor:
        """`fan_in`/`fan_out`: widths per token (a routed expert's are top_k copies of its own, `copies`);
        `module`: an nn.Linear, which bitsandbytes may quantize and LoRA adapt (not a 3-D bank); `grouped`: a 3-D
        bank's grouped matmul, which runs in the bank's dtype where BlockFacts.bank_bytes says so."""
        f = self.facts
        inp = x
        out_bytes = f.e
        if grouped and f.bank_bytes:
            out_bytes = f.bank_bytes
            if x.dtype_bytes != out_bytes:  # _grouped_mm's input.to(weight.dtype)
                inp = self.new(f"{name}: input cast to the bank's dtype", fan_in, out_bytes)
                self.op([x], [inp])
        elif f.autocast and x.bytes == 4 * fan_in:  # autocast's per-call cast of an fp32 input
            inp = self.new(f"{name}: autocast input cast", fan_in, f.e)
            self.op([x], [inp])
        out = self.new(f"{name}: output", fan_out, out_bytes)
        trained = f.weights_trainable and module
        # A bank peft adapts is a new weight W + B A that requires grad: its matmul keeps its input for that.
        self.op([inp], [out], saved=(inp,) if f.weights_trainable or name in f.lora_banks else (),
                weight_grad=fan_in * fan_out / copies ** 2 * f.e if trained else 0.0)
        if f.quant_saves_input and module:
            self.save(inp)
            self.ctx_kept[id(inp)] = inp  # a ctx attribute: alive until the graph itself is freed
        self.matmuls.append(out)
        quant4 = module and f.quant_4bit
        if quant4 and x.dtype_bytes != out.dtype_bytes:
            # bitsandbytes Linear4bit.forward returns `out.to(inp_dtype)` (0.43.3 nn/modules.py): an fp32
            # input gets its (autocast, 16-bit) matmul output back as an fp32 copy.
            back = self.new(f"{name}: output in its input's dtype (bitsandbytes)", fan_out, x.dtype_bytes)
            self.op([out], [back])
            out = back
        if not module or not targeted(name, f.targets):
            return out
        peft4 = quant4 and f.peft_quant_clone
        if peft4:
            # peft lora/bnb.py Linear4bit.forward: `result = result.clone()` before adding the adapter.
            clone = self.new(f"{name}: base output clone (peft)", fan_out, out.dtype_bytes)
            self.op([out], [clone], grad_alias=True)
            out = clone
        a_in = x
        # The forward's argument and the cast copy peft rebinds its local x to live until it returns.
        cast_local = (x,)
        # peft's Linear4bit wrapper casts x to the adapter dtype only without autocast; lora.Linear always.
        input_cast = not f.autocast if peft4 else f.adapter_input_cast
        if input_cast and x.bytes != f.adapter_bytes * fan_in:
            a_in = self.new(f"{name}: input cast to adapter dtype", fan_in, f.adapter_bytes)
            self.op([x], [a_in])
            cast_local = (x, a_in)
        # litgpt's fused qkv (LoRAQKVLinear, litgpt lora.py at 5895df1): one adapter for the enabled ones of q, k
        # and v, so one dropout of the shared input (`F.linear(self.lora_dropout(x), self.lora_A)`).
        fused = f.fused_qkv and name in QKV
        shared = self.qkv_dropout if fused else None
        if f.lora_dropout and shared is not None and shared[0] is x:
            a_in = shared[1]
        elif f.lora_dropout:
            dropped = self.new(f"{name}: dropout output", fan_in, a_in.dtype_bytes)
            self.op([a_in], [dropped], saved=(self.new(f"{name}: dropout mask", fan_in, 1, grad=False),))
            if fused:
                self.qkv_dropout = (x, dropped)
            a_in = dropped
        if f.autocast and a_in.bytes == 4 * fan_in:
            cast = self.new(f"{name}: lora_A autocast cast", fan_in, f.e)
            self.op([a_in], [cast])
            a_in = cast
        ab = f.e if f.autocast else f.adapter_bytes
        a_out = self.new(f"{name}: lora_A output", f.lora_rank * copies, ab)
        self.op([a_in], [a_out], saved=(a_in,))
        self.matmuls.append(a_out)
        b_out = self.new(f"{name}: lora_B output", fan_out, ab)
        self.op([a_out], [b_out], saved=(a_out,))
        self.matmuls.append(b_out)
        if fused and not all(targeted(n, f.targets) for n in QKV):
            # LoRAQKVLinear.zero_pad when q, k or v has no adapter: the B output, reshaped (a copy of a transposed
            # conv1d output), goes into `new_zeros(...).index_copy(1, lora_ind, x)`, whose IndexCopyBackward0
            # saves its source whole (derivatives.yaml index_copy: `expand_as(source)`).
            source = self.new(f"{name}: lora_B output, zero_pad's index_copy source", fan_out, ab)
            self.op([b_out], [source])
            self.save(source)
        # peft: result = result + lora_B(lora_A(dropout(x))) * scaling, then result.to(the base's dtype)
        scaled = self.new(f"{name}: lora_B output x scaling", fan_out, ab)
        self.op([b_out], [scaled])
        if peft4 and not f.autocast and ab != out.dtype_bytes:
            # peft's Linear4bit wrapper: without autocast `output = output.to(expected_dtype)` first.
            conv = self.new(f"{name}: adapter output cast to the base's dtype", fan_out, out.dtype_bytes)
            self.op([scaled], [conv])
            scaled = conv
        # The sum in the promoted dtype; lora.Linear then casts it back to the base's, the 4-bit wrapper not.
        total_bytes = max(out.dtype_bytes, scaled.dtype_bytes) if peft4 else max(f.e, ab)
        total = self.new(f"{name}: base + adapter", fan_out, total_bytes)
        self.op([out, scaled], [total], grad_alias=True, holds=cast_local)
        if peft4 or total.dtype_bytes == f.e:
            return total
        back = self.new(f"{name}: base + adapter, cast back", fan_out, f.e)
        self.op([total], [back])
        return back

    def _cast(self, t: Tensor, width: float, label: str) -> Tensor:
        out = self.new(label, width, self.facts.e)
        self.op([t], [out])
        return out

    def attention(self, y: Tensor) -> Tensor:
        f = self.facts
        if f.mla:
            return self.latent_attention(y)
        h, qd, kvd = f.hidden, f.q_dim, f.kv_dim
        self.qkv_dropout = None  # (its input, its output): the fused qkv adapter's one dropout
        if f.fused_proj:
            # Phi3Attention (transformers 5.23 modeling_phi3.py): qkv = self.qkv_proj(x), and q, k, v are slices of it,
            # views of one storage (each slice's gradient a full-width SliceBackward0 zeros).
            q0 = k0 = v = self.linear(y, h, qd + 2 * kvd, "qkv_proj")
        else:
            q0 = self.linear(y, h, qd, "q_proj")
            k0 = self.linear(y, h, kvd, "k_proj")
            v = self.linear(y, h, kvd, "v_proj")
        if f.qk_norm:
            per_head = f.qk_norm == "head"
            d_head = qd / f.heads
            q0 = self.rmsnorm(q0, "q_norm", qd, f.heads if per_head else 1)
            k0 = self.rmsnorm(k0, "k_norm", kvd, kvd / d_head if per_head else 1)
        if f.liger and not (f.fused_qkv or f.fused_proj):
            # LigerRopeFunction (liger_kernel/ops/rope.py rope_forward): q.transpose(1, 2).contiguous() is
            # the projection's own (b, s, heads, d) storage, rotated in place and returned as a view;
            # backward rotates dq and dk in place too. (Only under the math and eager kernels is dq a
            # (b, heads, s, d) tensor that .contiguous() copies, beside that node's s x s scratch.)
            q, k = q0, k0
        else:
            # RoPE (q * cos + rotate_half(q) * sin) saves only cos/sin, shared buffers; its backward sums
            # two gradients of q. (Liger's .contiguous() copies views of a fused qkv output first: litgpt's, and
            # Phi-3's under liger_rotary_pos_emb.)
            q = self.new("q after RoPE", qd, q0.dtype_bytes)
            self.op([q0], [q], scratch=0 if f.liger else qd * q0.dtype_bytes)
            k = self.new("k after RoPE", kvd, k0.dtype_bytes)
            self.op([k0], [k], scratch=0 if f.liger else kvd * k0.dtype_bytes)
        if f.autocast and q.dtype_bytes == 4:
            # fp32 q, k, v (4-bit projections of fp32 norm outputs) reach the kernel in the compute dtype:
            # transformers' flash_attention_forward casts them to the autocast dtype (4.48 integrations/
            # flash_attention.py target_dtype), and autocast casts SDPA's and eager's matmul inputs.
            q, k, v = (self._cast(t, w, f"{n} cast to the compute dtype") for t, w, n in
                       ((q, qd, "q"), (k, kvd, "k"), (v, kvd, "v")))
        kept_v = v  # what the kernel's saved v keeps alive
        if f.repeat_kv:  # hidden_states[:, :, None].expand(...).reshape(...): a full-width copy each
            rk, rv = self.new("k repeated to every head", qd, f.e), self.new("v repeated to every head", qd, f.e)
            self.op([k], [rk])
            self.op([v], [rv])
            k, v, kept_v = rk, rv, rv
        elif f.fused_qkv:
            # v is still a view of the fused qkv output: saving it keeps the q and k parts alive too.
            kept_v = self.new("fused qkv output (v is a view of it)", qd + 2 * kvd, f.e, grad=False)
        elif f.fused_proj and f.v_copied:
            # transformers 4.48-4.55 sdpa_attention_forward: `value = value.contiguous()` copies Phi-3's v out of
            # the qkv output, which then dies with the attention's forward (q and k were made anew by RoPE).
            vc = self.new("v made contiguous (sdpa_attention_forward)", kvd, f.e)
            self.op([v], [vc])
            v = kept_v = vc
        return self._attend(y, q, k, v, kept_v, qd)

    def latent_attention(self, y: Tensor) -> Tensor:
        """Multi-head latent attention as transformers 5.23 DeepseekV3Attention runs it (DeepseekV2Attention, and
        torchtitan's deepseek_v3 Attention, alike): q through the q_lora_rank latent and its RMSNorm (or one q_proj),
        the kv latent plus one shared RoPE key from kv_a_proj_with_mqa, the latent's RMSNorm, kv_b_proj up to every
        head's no-RoPE key and value. RoPE turns the RoPE slices of q and of the shared key into new tensors (its
        cos/sin are shared by every layer); q is torch.cat of q's no-RoPE slice and its rotated one, k a new tensor
        the no-RoPE keys and the shared rotated key are copied into (expand_kv; 4.51-5.x torch.cat), both (b, heads,
        s, qk_head_dim)-contiguous; v stays a view of kv_b_proj's output (BlockFacts.mla_value)."""
        f, m = self.facts, self.facts.mla
        h, heads = f.hidden, f.heads
        qd, vd, rope = heads * m.qk_head_dim, heads * m.v_head_dim, m.qk_rope_head_dim
        if m.q_lora_rank:
            q_latent = self.linear(y, h, m.q_lora_rank, "q_a_proj")
            q0 = self.linear(self.rmsnorm(q_latent, "q_a_layernorm", m.q_lora_rank), m.q_lora_rank, qd, "q_b_proj")
        else:
            q0 = self.linear(y, h, qd, "q_proj")
        kv_latent = self.linear(y, h, m.kv_lora_rank + rope, "kv_a_proj_with_mqa")
        kv = self.linear(self.rmsnorm(kv_latent, "kv_a_layernorm", m.kv_lora_rank), m.kv_lora_rank,
                         heads * (m.qk_nope_head_dim + m.v_head_dim), "kv_b_proj")
        # The interleaved RoPE (apply_rotary_pos_emb_interleave): four products, a difference and a sum of half-width
        # slices, then their torch.cat; each product saves only cos or sin.
        q_rot = self.new("q's RoPE part, rotated", heads * rope, q0.dtype_bytes)
        self.op([q0], [q_rot], scratch=2 * heads * rope * q0.dtype_bytes)
        k_rot = self.new("shared RoPE key, rotated", rope, kv_latent.dtype_bytes)
        self.op([kv_latent], [k_rot], scratch=2 * rope * kv_latent.dtype_bytes)
        q = self.new("query (no-RoPE and rotated parts)", qd, f.e)
        self.op([q0, q_rot], [q])
        k = self.new("key (every head's no-RoPE part and the shared rotated key)", qd, f.e)
        self.op([kv, k_rot], [k])
        v = kv
        if f.mla_value == "copy":
            v = self.new("v made contiguous", vd, f.e)
            self.op([kv], [v])
        elif f.mla_value == "padded":
            v = self.new("v padded to the q/k head dim (flash-attn)", qd, f.e)
            self.op([kv], [v])
        return self._attend(y, q, k, v, v, qd, vd, out_width=qd if f.mla_value == "padded" else vd)

    def _attend(self, y: Tensor, q: Tensor, k: Tensor, v: Tensor, kept_v: Tensor, qd: float, vd: float = 0,
                out_width: float = 0) -> Tensor:
        """The attention kernel on q, k, v (`kept_v`: what its saved v keeps alive), then o_proj. `qd`: q's width per
        token, `vd`: the output's as o_proj takes it (0: qd), `out_width`: the kernel's (0: vd)."""
        f = self.facts
        h = f.hidden
        vd = vd or qd
        out_width = out_width or vd
        out = self.new("attention output", out_width, f.e)
        # The s x s weights' gradient and the scores' gradient computed from it (softmax backward).
        scores_grad = f.heads * f.seq_len * (4 + f.e)
        if f.kernel in ("flash", "efficient"):
            # The memory-efficient kernel's logsumexp is (b, heads, ceil(s / 32) * 32) fp32 (aten
            # _efficient_attention_forward's kAlignLSE; torch/_meta_registrations.py
            # meta__scaled_dot_product_efficient_attention: math.ceil(M / 32) * 32), flash's (b, heads, s).
            rows = -(-f.seq_len // 32) * 32 / f.seq_len if f.kernel == "efficient" and f.seq_len else 1
            lse = self.new("attention logsumexp", f.heads * rows, 4, grad=False)
            # flash-attn 2 mha_bwd (csrc/flash_attn/flash_api.cpp, vendored by torch) allocates softmax_d
            # (heads) and dq_accum (q width) in fp32, and under GQA dk/dv expanded to every query head.
            scratch = 4 * (f.heads + qd) + (2 * qd * f.e if f.gqa else 0) if f.kernel == "flash" else 0
            # A mask SDPA converts or autocast casts at this call is this layer's own, and the kernel keeps it
            # (stacks.AttentionMask.layer_copy): a row of the mask per token.
            mask = (self.new("attention mask in the query's dtype", f.mask_values, f.e, grad=False),) \
                if f.mask_values else ()
            self.op([q, k, v], [out], saved=(q, k, kept_v, out, lse) + mask, scratch=scratch)
            self.attention_out += [out, lse]
        elif f.kernel == "math":
            # aten _scaled_dot_product_attention_math: k/v repeated to every head for GQA, q and k
            # scaled by sqrt(scale), softmax(q k^T) kept for backward, then @ v; in fp32 where it casts 16-bit
            # q, k, v up first (BlockFacts.math_fp32), v's fp32 copy the one kept.
            ab = 4 if f.math_fp32 else f.e
            if f.math_fp32:
                rep_v = self.new("v in fp32 (math kernel)", vd, 4, grad=False)
            else:
                rep_v = self.new("v repeated to every head", vd, f.e, grad=False) if f.gqa else kept_v
            probs = self.new("attention weights s x s (math kernel)", f.heads * f.seq_len, ab, grad=False)
            self.op([q, k, v], [out], saved=(self.new("q scaled", qd, ab, grad=False),
                                             self.new("k scaled (repeated)", qd, ab, grad=False), rep_v, probs),
                    scratch=f.heads * f.seq_len * (4 + ab))
        else:  # eager: HF's repeat_kv, fp32 softmax, probabilities cast back for probs @ v
            rep_k = self.new("k repeated", qd, f.e, grad=False) if f.gqa else k
            rep_v = self.new("v repeated", vd, f.e, grad=False) if f.gqa else kept_v
            saved = [q, rep_k, rep_v]
            # The softmax's dtype and width: fp32 over s columns, or GPT-OSS's (modeling_gpt_oss.py
            # eager_attention_forward): torch.cat of the scores and the sinks' column, promoted to the sinks' dtype
            # (fp32 masters under autocast), minus its row max (MaxBackward0 keeps the int64 indices, one per head
            # and row), softmax in that dtype, kept s + 1 wide, sliced back to s; dropout at p=0 hands the slice on and
            # `.to(value_states.dtype)` copies it only where the dtypes differ, so probs @ v keeps a view of the whole
            # softmax output, or that copy.
            sm = max(f.e, f.norm_weight_bytes) if f.attn_sinks else 4
            if f.attn_sinks:
                saved += [self.new("row max indices of the scores and sink (int64)", f.heads, 8, grad=False),
                          self.new("softmax output with the sink column (s x s)", f.heads * (f.seq_len + 1), sm,
                                   grad=False)]
            else:
                saved.append(self.new("softmax output fp32 (s x s)", f.heads * f.seq_len, 4, grad=False))
            if f.attn_softcap:  # TanhBackward0 keeps its output; the scaled scores, quotient and product die
                saved.append(self.new("soft-capped scores' tanh (s x s)", f.heads * f.seq_len, f.e, grad=False))
            if f.e != sm:
                saved.append(self.new("attention weights cast back (s x s)", f.heads * f.seq_len, f.e, grad=False))
            self.op([q, k, v], [out], saved=saved, scratch=scores_grad)
        # flash and memory-efficient kernels allocate their output as (b, s, heads, d) and return a
        # transposed view, so out.transpose(1, 2).reshape(b, s, -1) (HF: .contiguous()) is a view;
        # the math and eager outputs are (b, heads, s, d) and get copied.
        o_in = out
        if f.flash_repad:  # pad_input's output is (b, s, heads, d)
            o_in = self.new("attention output padded back (flash-attn pad_input)", out_width, f.e)
            self.op([out], [o_in])
        # A flash kernel allocates its output like q (CUDA flash_api.cpp mha_fwd `out = at::empty_like(q_padded)`, the
        # CPU flash kernel alike): a q that torch.cat built (Phi3's apply_rotary_pos_emb, MLA's query, GPT-OSS's
        # _apply_rotary_emb: BlockFacts.rope_cat, but for its vllm-flash-attn3 kernel, flash3_sinks) is
        # (b, heads, s, d)-contiguous, so the output is too, and the copy back to (b, s, heads x d) is real. An
        # output cropped back to v's head dim (MLA's padded v) is copied whatever its layout.
        heads_first = f.kernel not in ("flash", "efficient") or (
            f.kernel == "flash" and (f.fused_proj or f.mla or f.rope_cat) and not f.flash_repad)
        if heads_first or out_width != vd:
            cont = self.new("attention output made contiguous", vd, f.e)
            self.op([o_in], [cont])
            o_in = cont
        res = self.linear(o_in, vd, h, "o_proj")
        self.hold(y)
        return res

    def mlp(self, y: Tensor, ffn: int = 0, prefix: str = "", per_token: float = 1.0,
            names: tuple = ("gate_proj", "up_proj", "down_proj"), module: bool = True) -> Tensor:
        """A gated MLP over `per_token` copies of each token (top_k for routed experts); `names`: its
        gate, up and down linears; `module`: nn.Linear modules (not routed experts' 3-D banks)."""
        f = self.facts
        ffn = ffn or f.ffn
        gate_name, up_name, down_name = names
        if f.clamped_swiglu and prefix == "experts.":
            return self._clamped_swiglu(y, ffn, prefix, per_token, down_name, module)
        if f.fused_proj and not prefix:
            # Phi3MLP: gate_up_proj's output chunked into gate and up, two views of one storage.
            gate = up = self.linear(y, f.hidden, 2 * ffn, "gate_up_proj")
        else:
            gate = self.linear(y, f.hidden * per_token, ffn * per_token, prefix + gate_name, per_token, module,
                               grouped=not module)
            up = self.linear(y, f.hidden * per_token, ffn * per_token, prefix + up_name, per_token, module,
                             grouped=not module)
        prod = self.new(prefix + "silu(gate) * up", ffn * per_token, max(gate.dtype_bytes, up.dtype_bytes))
        if f.liger:
            # LigerSiLUMulFunction (liger_kernel/ops/swiglu.py): c = empty_like(a), ctx.save_for_backward(a, b);
            # swiglu_backward stores da and db into a and b and returns them.
            self.op([gate, up], [prod], saved=(gate, up), grads_in_saved=True)
        else:
            act = self.new(prefix + "silu(gate)", ffn * per_token, gate.dtype_bytes)
            self.op([gate], [act], saved=(gate,))  # SiluBackward keeps its input
            self.op([act, up], [prod], saved=(act, up))  # the product keeps both factors
        out = self.linear(prod, ffn * per_token, f.hidden * per_token, prefix + down_name, per_token, module,
                          grouped=not module)
        self.hold(y)
        return out

    def _clamped_swiglu(self, y: Tensor, ffn: int, prefix: str, k: float, down_name: str, module: bool) -> Tensor:
        """GPT-OSS's routed experts (transformers 5.23 integrations/moe.py grouped_mm_experts_forward with
        GptOssExperts._apply_gate): gate_up (interleaved gate and up columns) with its gathered bias added in place,
        gate = gate_up[..., ::2].clamp(max=limit), up = gate_up[..., 1::2].clamp(-limit, limit), glu = gate *
        sigmoid(gate * alpha), (up + 1) * glu, then down. Each clamp keeps its input, a strided view that keeps the
        whole gate_up output; sigmoid keeps its output; each product keeps its factors (a number's product keeps
        nothing): 2 + 5 ffn values per routed row where silu(gate) * up keeps 4."""
        f = self.facts
        w = ffn * k
        gate_up = self.linear(y, f.hidden * k, 2 * w, prefix + "gate_up_proj", k, module, grouped=not module)
        e = gate_up.dtype_bytes
        gate = self.new(prefix + "gate, clamped", w, e)
        self.op([gate_up], [gate], saved=(gate_up,))
        scaled = self.new(prefix + "gate x alpha", w, e)
        self.op([gate], [scaled])
        sig = self.new(prefix + "sigmoid(gate x alpha)", w, e)
        self.op([scaled], [sig], saved=(sig,))
        glu = self.new(prefix + "gate x sigmoid", w, e)
        self.op([gate, sig], [glu], saved=(gate, sig))
        up = self.new(prefix + "up, clamped", w, e)
        self.op([gate_up], [up], saved=(gate_up,))
        up1 = self.new(prefix + "up + 1", w, e)
        self.op([up], [up1])
        prod = self.new(prefix + "(up + 1) x glu", w, e)
        self.op([up1, glu], [prod], saved=(up1, glu))
        out = self.linear(prod, w, f.hidden * k, prefix + down_name, k, module, grouped=not module)
        self.hold(y)
        return out

    def moe_mlp(self, y: Tensor) -> Tensor:
        """transformers' sparse MoE block (MixtralSparseMoeBlock, Qwen2/3MoeSparseMoeBlock, DeepSeek
        MoE): router logits, softmax in fp32 (kept), top-k; each token's hidden state gathered once
        per routed expert (hidden_states[top_x], kept by the expert's matmuls), the expert's gated MLP
        over its tokens, its output scaled by the routing weight (kept for that weight's gradient
        when the router trains); shared experts run on every token.

        Experts held as nn.Linear modules run one after another (BlockFacts.expert_loop), so forward and
        backward hold one expert's intermediates at a time, over its share of the routed tokens (an even
        share: top_k / experts rows per token); 3-D banks run as one grouped op over all of them."""
        f, m = self.facts, self.facts.moe
        router_in = y
        if f.router_fp32 and y.dtype_bytes != 4:
            # The copy the router's linear keeps where its weight trains (under autocast it casts it back down).
            router_in = self.new("router input in fp32", f.hidden, 4)
            self.op([y], [router_in])
        logits = self.linear(router_in, f.hidden, m.experts, f.router_name, module=f.router_linear)
        if f.router_topk_softmax:
            # GptOssTopKRouter: topk of the logits, then softmax over the top_k values in their dtype (kept).
            probs = self.new("router scores over the top-k (softmax)", m.top_k, logits.dtype_bytes)
        else:
            probs = self.new("router scores (softmax or sigmoid)", m.experts, f.router_scores_bytes)
        self.op([logits], [probs], saved=(probs,))
        if not f.expert_loop:
            routed = self.new("tokens gathered per expert", f.hidden * m.top_k, y.dtype_bytes)
            self.op([y], [routed])
            out = self.mlp(routed, m.expert_ffn, "experts.", m.top_k, f.expert_names, f.expert_linears)
            weighted = self.new("expert output x routing weight", f.hidden * m.top_k,
                                max(out.dtype_bytes, y.dtype_bytes))
            # The routing weights' gradient needs the expert output: it flows through the router to the
            # hidden states even when nothing in the router trains (transformers' Mixtral/Qwen MoE blocks
            # multiply by routing_weights without detaching them).
            self.op([out, probs], [weighted], saved=(out,))
            res = self.new("MoE output", f.hidden, y.dtype_bytes)
            self.op([weighted], [res])
        else:
            rows = m.top_k / m.experts
            # final_hidden_states = torch.zeros(..., dtype=hidden_states.dtype) before the loop; each expert's
            # output is added into it in place (one storage: the running sum is priced once, here).
            res = self.new("MoE output (zeros the experts are added into)", f.hidden, y.dtype_bytes, grad=False)
            self.op([], [res])
            acc = res
            for j in range(m.experts):
                self.expert = j
                routed = self.new("tokens gathered for an expert", f.hidden * rows, y.dtype_bytes)
                self.op([y], [routed])
                out = self.mlp(routed, m.expert_ffn, "experts.", rows, f.expert_names, f.expert_linears)
                weighted = self.new("expert output x routing weight", f.hidden * rows,
                                    max(out.dtype_bytes, y.dtype_bytes))
                self.op([out, probs], [weighted], saved=(out,))
                # transformers' final_hidden_states.index_add_(0, top_x, ...): IndexAddBackward0 saves its
                # source (derivatives.yaml index_add: `expand_as(source)`). litgpt's `y[token_idx] += ...`
                # indexes a copy of the rows, adds and writes them back (index_put_ saves only indices).
                summed = self.new("MoE output (added in place)", 0, y.dtype_bytes)
                if f.expert_loop == "index_put":
                    rows_copy = self.new("output rows indexed for +=", f.hidden * rows, y.dtype_bytes, grad=False)
                    self.op([], [rows_copy])
                    self.op([acc, weighted], [summed], grad_alias=True, holds=(rows_copy,))
                else:
                    self.op([acc, weighted], [summed], saved=(weighted,), grad_alias=True)
                acc = summed
            self.expert = -1
            self.hold(res)  # the zeros' storage is the sum's: alive to the end of the loop
            res = acc
        if m.shared_experts or m.shared_ffn:
            shared = self.mlp(y, m.shared_ffn, "shared_expert.")
            total = self.new("MoE output + shared experts", f.hidden, y.dtype_bytes)
            self.op([res, shared], [total], grad_alias=True)
            res = total
        return res


@functools.lru_cache(maxsize=256)
def _walk_block(facts: BlockFacts, moe_layer: bool = False) -> tuple[Trace, Tensor]:
    """One block's op walk (memoised: the saved set, the recompute and both replays read the same walk,
    and nothing mutates it afterwards)."""
    tr = Trace(facts)
    x = tr.new("block input (residual stream)", facts.hidden, facts.stream)
    attn = tr.attention(tr.rmsnorm(x, "input_layernorm"))
    if facts.sandwich_norms:  # Gemma2DecoderLayer: post_attention_layernorm on the attention's output
        attn = tr.rmsnorm(attn, "post_attention_layernorm")
    x2 = tr.new("residual stream after attention", facts.hidden, facts.stream)
    tr.op([x, attn], [x2], grad_alias=True)
    y2 = tr.rmsnorm(x2, "pre_feedforward_layernorm" if facts.sandwich_norms else "post_attention_layernorm")
    mlp = tr.moe_mlp(y2) if moe_layer else tr.mlp(y2)
    if facts.sandwich_norms:
        mlp = tr.rmsnorm(mlp, "post_feedforward_layernorm")
    tr.output = tr.new("block output (residual stream)", facts.hidden, facts.stream)
    tr.op([x2, mlp], [tr.output], grad_alias=True)
    return tr, x


def _policy_kept(tr: Trace, block_input: Tensor, policy: str, ctx: bool = True) -> list[Tensor]:
    """What a block keeps from its forward to its backward under a checkpointing policy."""
    if policy == "none":
        kept = list(tr.saved.values())
    elif policy == "block":
        kept = [block_input]  # the checkpoint keeps its inputs only
    elif policy == "matmuls":
        kept = [block_input] + tr.matmuls + tr.attention_out
    elif policy == "op-sac":
        # torchtitan _get_custom_policy: a per-block mm counter; every second mm recomputed.
        kept = [block_input] + [m for i, m in enumerate(tr.matmuls, start=1) if i % 2] + tr.attention_out
    else:
        raise ValueError(policy)
    if policy != "none" and ctx:
        kept += list(tr.ctx_kept.values())  # what no checkpoint hook can drop
    return kept


def saved_per_token(facts: BlockFacts, policy: str, moe_layer: bool = False) -> dict[str, float]:
    """Bytes per token one block keeps from its forward to its backward, by tensor, under a policy."""
    tr, block_input = _walk_block(facts, moe_layer)
    kept = _policy_kept(tr, block_input, policy)
    out: dict[str, float] = {}
    seen: set[int] = set()
    for t in kept:
        if id(t) not in seen:
            seen.add(id(t))
            out[t.label] = out.get(t.label, 0) + t.bytes
    return out


@functools.lru_cache(maxsize=1024)
def recomputed_per_token(facts: BlockFacts, policy: str, moe_layer: bool = False, ctx_kept: bool = True) -> float:
    """Bytes per token a checkpointed block's recompute saves again: what autograd saves in the block
    that the policy did not keep from the first forward (by tensor: a frozen linear's output that a
    selective policy keeps is not among autograd's saved tensors, and a block input that nothing saves
    is kept without being recomputed). `ctx_kept`: whether the first forward kept the nodes' ctx
    attributes too (bitsandbytes < 0.43.2 outside a reentrant checkpoint)."""
    tr, block_input = _walk_block(facts, moe_layer)
    kept = {id(t) for t in _policy_kept(tr, block_input, policy, ctx_kept)}
    return sum(t.bytes for k, t in tr.saved.items() if k not in kept)


@functools.lru_cache(maxsize=1024)
def sac_released_per_token(facts: BlockFacts, policy: str, moe_layer: bool = False) -> float:
    """Bytes per token of a block's selectively kept outputs that its recompute releases: torch's selective
    checkpoint (torch/utils/checkpoint.py _CachingTorchDispatchMode) stores every op the policy saves, needed
    by autograd or not (a frozen linear's output, lora_B's output), and the recompute takes each from its
    storage (_CachedTorchDispatchMode, marking the entry consumed) as the op comes round again. One that
    autograd does not save is then only a local of the recomputed forward, gone when that forward stops (early
    stopping ends it at the last saved tensor, unwinding its frames); one whose op is not reached before that
    stop stays stored until the block's backward is done. So while the block's backward runs,
    only the tensors autograd saves remain of what the policy kept."""
    if policy not in ("matmuls", "op-sac"):
        return 0.0
    tr, block_input = _walk_block(facts, moe_layer)
    # The stop fires while autograd packs the last saving op's inputs, before that op is dispatched
    # (torch/utils/checkpoint.py: the pack hook raises _StopRecomputationError), so its own outputs are
    # never taken from the storage, unless it saves an output of its own.
    last = _last_save(tr)
    reached = last  # the ops dispatched before the stop
    if last >= 0 and {id(t) for t in tr.ops[last].saved} & {id(o) for o in tr.ops[last].outputs}:
        reached = last + 1
    popped = {id(t) for op in tr.ops[:max(reached, 0)] for t in op.outputs}
    kept = {id(t): t for t in _policy_kept(tr, block_input, policy, ctx=False)}
    return sum(t.bytes for k, t in kept.items()
               if k in popped and k not in tr.saved and t is not block_input)


@functools.lru_cache(maxsize=1024)
def sac_recompute_transient_per_token(facts: BlockFacts, policy: str, moe_layer: bool = False) -> float:
    """recompute_transient_per_token for a selective policy: the most the block's recompute holds beyond what
    the policy kept and what the recompute saves again (recomputed_per_token), per token. The kept outputs
    are there from the start and come back from storage, not as new allocations; one autograd does not save
    dies after its last consumer (sac_released_per_token); early stopping ends the walk at the last saved
    tensor. May be negative: the releases can outweigh the recompute's own intermediates."""
    tr, x = _walk_block(facts, moe_layer)
    kept = {id(t): t.bytes for t in _policy_kept(tr, x, policy)}
    pinned = set(tr.saved) | set(tr.ctx_kept) | {id(x)}  # autograd's, a node's ctx, the checkpoint's input
    settled = sum(kept.values()) + sum(t.bytes for k, t in tr.saved.items() if k not in kept)
    return _live_peak(tr, tr.ops[:_last_save(tr) + 1], kept, pinned) - settled + tr.output.bytes


def ctx_kept_per_token(facts: BlockFacts, moe_layer: bool = False) -> float:
    """Bytes per token one block's graph holds outside autograd's saved tensors (bitsandbytes < 0.43.2)."""
    tr, _ = _walk_block(facts, moe_layer)
    return sum(t.bytes for t in tr.ctx_kept.values())


@functools.lru_cache(maxsize=1024)
def backward_intermediates_per_token(facts: BlockFacts, moe_layer: bool = False) -> float:
    """The most one block's backward holds beyond the saved tensors it starts with, per token: its ops
    replayed in reverse with autograd's engine rules (torch/csrc/autograd/engine.cpp, one device
    thread): nodes run in decreasing sequence number, i.e. the reverse of the forward's creation
    order; a node allocates its inputs' gradients while its output gradients and every unreleased
    saved tensor are alive, plus what its kernel allocates inside the call (Op.scratch); then it
    releases its saved tensors (release_variables(), no retain_graph) and its output gradients. A
    gradient reaching a tensor that already has one is summed into it (InputBuffer::accumulate, in
    place), and AddBackward hands the output's gradient itself to an input of the same dtype.
    Attributes a node keeps outside its saved tensors (bitsandbytes < 0.43.2's ctx.tensors) live
    until the graph is freed, after backward."""
    return _replay_backward(_walk_block(facts, moe_layer)[0])


def final_norm_backward_per_token(facts: BlockFacts) -> float:
    """The final norm's backward, replayed as a block's is (backward_intermediates_per_token): what it
    holds beyond its saved tensors, the gradient of its output (the head's input) included."""
    tr = Trace(facts)
    tr.output = tr.rmsnorm(tr.new("final residual stream", facts.hidden, facts.stream), "final norm")
    return _replay_backward(tr)


ALLOC, FREE, RENAME, ALLOC_FIXED = 0, 1, 2, 3
GRAD_OUT = "grad out"
WEIGHT_GRAD = "weight grad"
"""Events of a replayed backward: (ALLOC, key, bytes per token), (FREE, key, 0), (RENAME, key, new key),
(ALLOC_FIXED, (WEIGHT_GRAD, node), bytes). A saved tensor's key is id(tensor); GRAD_OUT is the gradient of the
trace's output, alive before the first node."""


def backward_events(tr: Trace, pinned_out: bool = False, weight_grads: bool = False,
                    owners: dict | None = None) -> tuple[tuple, dict]:
    """A trace's backward in autograd's engine order (backward_intermediates_per_token; engine.cpp
    evaluate_function): per node, its inputs' new gradients and its scratch (the call), its output gradients
    freed (the call's inputs die with it), the saved tensors it was the first op to save released
    (release_variables; bitsandbytes < 0.43.2's ctx attributes never), then each new gradient accumulated into
    an existing one (input_buffer.cpp accumulate) and freed. Returns the events and the keys of the gradients
    alive at the end, by tensor id.

    accumulate adds in place only into a buffer whose last reference it holds (`adjusted_use_count(old_var) ==
    1` and the storage's too), else `old_var + var` makes a new one. pinned_out: something outside the trace
    also holds the output's gradient, so a gradient reaching one that aliases it is summed out of place, and
    the output's gradient is never freed here: a reentrant checkpoint's CheckpointFunction.backward holds it
    (its `args`) through the block's inner backward, and FSDP1's kept inputs hold it to the end of backward
    (JobFacts.fsdp1_keeps_block_inputs); the caller frees it. weight_grads: each trained linear's weight
    gradient too (Op.weight_grad), which the caller frees: under FSDP1 the weights are views of the unit's
    flat parameter, so their gradients wait in the input buffer of the views' backward until it concatenates
    them, after the unit's whole backward. owners, when given, receives the tensor (by id) whose gradient each
    ("grad", n) key allocates."""
    owners = {} if owners is None else owners
    first_saver: dict[int, int] = {}
    for i, op in enumerate(tr.ops):
        for t in op.saved:
            first_saver.setdefault(id(t), i)
    saved = {k: t for k, t in tr.saved.items() if k not in tr.ctx_kept}
    ev: list = []
    ids = itertools.count(1)
    buffers: dict = {0: [GRAD_OUT, 1]}  # buffer -> [key, references]
    grad_of: dict[int, int] = {id(tr.output): 0}

    def drop(buf: int) -> None:
        buffers[buf][1] -= 1
        if buffers[buf][1] == 0:
            key = buffers.pop(buf)[0]
            if not (pinned_out and buf == 0):
                ev.append((FREE, key, 0))

    for i in range(len(tr.ops) - 1, -1, -1):
        op = tr.ops[i]
        outs = [grad_of[id(o)] for o in op.outputs if id(o) in grad_of]
        summed = []  # gradients summed into an existing one, freed after the accumulation
        replaced = []  # (new buffer, the pinned buffer it replaces, bytes) for out-of-place sums
        if outs:
            if weight_grads and op.weight_grad:  # before the input's gradient (Op.weight_grad)
                ev.append((ALLOC_FIXED, (WEIGHT_GRAD, i), op.weight_grad))
            for t in op.inputs:
                if not t.grad:
                    continue
                if op.grads_in_saved and id(t) in saved:
                    # The gradient is written into the saved input's storage: it becomes a gradient, or,
                    # summed into an existing one, is freed after the node.
                    del saved[id(t)]
                    if id(t) in grad_of:
                        summed.append(("moved", i, id(t)))
                        ev.append((RENAME, id(t), summed[-1]))
                    else:
                        n = next(ids)
                        buffers[n] = [("grad", n), 1]
                        grad_of[id(t)] = n
                        ev.append((RENAME, id(t), ("grad", n)))
                    continue
                alias = op.grad_alias and len(outs) == 1 and t.dtype_bytes == op.outputs[0].dtype_bytes
                if id(t) in grad_of:
                    # Summed into the gradient t has: the new one is a tensor of its own, or, aliased (an
                    # in-place kernel's dX written into dY), the output's gradient, freed with it below; into
                    # a pinned gradient the sum is out of place (input_buffer.cpp accumulate).
                    if not alias:
                        summed.append(("sum", i, id(t)))
                        ev.append((ALLOC, summed[-1], t.bytes))
                    if pinned_out and grad_of[id(t)] == 0:
                        n = next(ids)
                        buffers[n] = [("grad", n), 1]
                        owners[("grad", n)] = id(t)
                        replaced.append((n, grad_of[id(t)], t.bytes))
                        grad_of[id(t)] = n
                elif alias:
                    buffers[outs[0]][1] += 1
                    grad_of[id(t)] = outs[0]
                else:
                    n = next(ids)
                    buffers[n] = [("grad", n), 1]
                    grad_of[id(t)] = n
                    owners[("grad", n)] = id(t)
                    ev.append((ALLOC, ("grad", n), t.bytes))
            if op.scratch:
                ev += [(ALLOC, ("scratch", i), op.scratch), (FREE, ("scratch", i), 0)]
            for o in op.outputs:
                if id(o) in grad_of:
                    drop(grad_of.pop(id(o)))
        for t in op.saved:
            if first_saver[id(t)] == i and id(t) in saved:
                del saved[id(t)]
                ev.append((FREE, id(t), 0))
        for n, old, size in replaced:  # `old_var + var`
            ev.append((ALLOC, ("grad", n), size))
            drop(old)
        ev += [(FREE, key, 0) for key in summed]
    return tuple(ev), {k: buffers[b][0] for k, b in grad_of.items()}


def _replay_backward(tr: Trace) -> float:
    """The most backward_events holds beyond the saved tensors it starts with, per token."""
    size = {k: t.bytes for k, t in {**tr.ctx_kept, **tr.saved}.items()}
    start = sum(size.values())
    size[GRAD_OUT] = tr.output.bytes
    live = peak = start + tr.output.bytes
    for kind, key, arg in backward_events(tr)[0]:
        if kind == ALLOC:
            size[key] = arg
            live += arg
            peak = max(peak, live)
        elif kind == FREE:
            live -= size.pop(key)
        else:
            size[arg] = size.pop(key)
    return peak - start


@functools.lru_cache(maxsize=1024)
def forward_peak_per_token(facts: BlockFacts, moe_layer: bool = False, keep_saved: bool = True,
                           stop_after_last_save: bool = False) -> float:
    """The most one block's forward holds at once, per token, its input included. Each op's outputs
    (and the tensors it saves) are allocated while its inputs are alive; an intermediate dies after its
    last consumer unless autograd keeps it (`keep_saved`: no checkpointing, or a checkpoint's recompute)
    or a Python local or argument still holds it (Op.holds: peft's fp32 copy of a LoRA input lives
    until its forward returns). A checkpointed block's first forward keeps nothing of its own
    (`keep_saved=False`) but what a node holds outside its saved tensors (bitsandbytes < 0.43.2's
    ctx.tensors). `stop_after_last_save`: a recompute with early stopping (torch/utils/checkpoint.py,
    the default) stops once the last saved tensor is packed."""
    tr, x = _walk_block(facts, moe_layer)
    ops = tr.ops[:_last_save(tr) + 1] if stop_after_last_save else tr.ops
    kept = (set(tr.saved) if keep_saved else set(tr.ctx_kept)) | {id(x)}
    return _live_peak(tr, ops, {id(x): x.bytes}, kept)


def _last_save(tr: Trace) -> int:
    """The index of the last op that saves a tensor (where a recompute with early stopping ends), or -1."""
    return max((i for i, op in enumerate(tr.ops) if op.saved), default=-1)


def _live_peak(tr: Trace, ops: list, live: dict[int, float], pinned: set[int]) -> float:
    """The most bytes alive at once while `ops` (tr.ops or a prefix of them) run, starting from `live`: each
    op's outputs and saved tensors appear, and a tensor that is not `pinned` dies after its last use in
    the whole block (what a later op needs is alive at a stop). A running sum: a MoE walk has thousands
    of ops."""
    last_use: dict[int, int] = {}
    for i, op in enumerate(tr.ops):
        for t in (*op.inputs, *op.holds, *op.saved):
            last_use[id(t)] = i
    live = dict(live)
    total = peak = sum(live.values())
    for i, op in enumerate(ops):
        for t in (*op.outputs, *op.saved):
            if id(t) not in live:
                live[id(t)] = t.bytes
                total += t.bytes
        peak = max(peak, total)
        for t in (*op.inputs, *op.holds, *op.saved):
            if last_use[id(t)] == i and id(t) not in pinned and id(t) in live:
                total -= live.pop(id(t))
    return peak


@functools.lru_cache(maxsize=1024)
def recompute_transient_per_token(facts: BlockFacts, moe_layer: bool = False, reentrant: bool = False) -> float:
    """The most a checkpointed block's recompute holds beyond its saved tensors and its input, per token.
    The recompute runs the block's forward again with grad enabled (torch/utils/checkpoint.py,
    non-reentrant: every tensor autograd saves is kept for the backward that asked for it, and early
    stopping ends it after the last one; reentrant: CheckpointFunction.backward runs the whole forward,
    whose graph keeps them, then backpropagates through its outputs) (forward_peak_per_token); near its
    end almost every saved tensor exists beside the last ops' own intermediates, and beside the gradient
    of the block's output that set the recompute off."""
    tr, x = _walk_block(facts, moe_layer)
    peak = forward_peak_per_token(facts, moe_layer, keep_saved=True, stop_after_last_save=not reentrant)
    settled = x.bytes + sum(t.bytes for k, t in tr.saved.items() if k != id(x))
    return max(0.0, peak - settled) + tr.output.bytes


def block_forward_transient_per_token(facts: BlockFacts) -> float:
    """The most one block's forward holds at once beyond its saved tensors when nothing is saved (a
    checkpointed block runs its first forward under no_grad): inside the gated MLP, silu(gate) is
    alive while up_proj runs, and an adapted up_proj holds its base output, lora_B's output and that
    output times scaling at once (peft 0.10 tuners/lora/layer.py Linear.forward: `result = result +
    lora_B(lora_A(dropout(x))) * scaling`; lora/bnb.py Linear4bit clones the base output first, then
    the same); the MLP input and the attention residual are alive throughout."""
    f = facts
    up = 3 if "up_proj" in f.targets and f.lora_rank else 1
    return (1 + up) * f.ffn * f.e + 2 * f.hidden * f.stream


def head_saved_per_token(facts: BlockFacts, head_trainable: bool, quantized_head: bool = False,
                         input_saved: str = "for-grads") -> dict[str, float]:
    """The final norm and the LM head's input (the logits are the loss's). `input_saved`: "for-grads" (a
    matmul keeps its input only for its weight's gradient), "never" (Liger's fused loss runs the head itself
    and keeps gradients instead), "always" (Cut Cross-Entropy keeps the input, cast to the autocast dtype,
    to recompute the logits in backward, trained or not)."""
    tr = Trace(facts)
    x = tr.new("final residual stream", facts.hidden, facts.stream)
    y = tr.rmsnorm(x, "final norm")
    inp = y
    if facts.autocast and y.bytes == 4 * facts.hidden:
        inp = tr.new("lm_head: autocast input cast", facts.hidden, facts.e)
    needed = head_trainable or "lm_head" in facts.targets or (quantized_head and facts.quant_saves_input)
    if input_saved == "always" or (input_saved == "for-grads" and needed):
        tr.save(inp)
    return {t.label: t.bytes for t in tr.saved.values()}


@dataclass(frozen=True)
class LigerLoss:
    """Liger's fused linear cross-entropy (linkedin/Liger-Kernel src/liger_kernel/ops/
    fused_linear_cross_entropy.py, fused_linear_cross_entropy_forward), in bytes for one micro-batch."""

    held: int
    """grad_input = zeros_like(_input), grad_weight = zeros_like(weight) when the head trains, loss_1d in
    fp32: made in forward and kept on the ctx (save_for_backward) until backward hands them on."""
    transient: int
    """The last chunk's logits (the cross-entropy kernel overwrites them with their gradient in place),
    that chunk's rows of grad_input as the matmul makes them, and its input cast to the matmul dtype."""
    formula: str
    head_weight_grad: int
    """The part of `held` that is the head weight's gradient (0 for a frozen head)."""


def liger_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Liger's chunk of rows, sized so that one chunk's logits cost about what the input does:
    inc_factor = cdiv(V, H), chunk_size = next_power_of_2(cdiv(BT, inc_factor)), at most BT
    (fused_linear_cross_entropy_forward, chunk_mem_const 1). The smoke run's emulation uses it too."""
    inc = -(-vocab // hidden)
    want = max(1, -(-rows // inc))
    return min(1 << (want - 1).bit_length(), rows)


def liger_loss(job, tokens: int, stream_bytes: int) -> LigerLoss:
    """`stream_bytes`: BlockFacts.stream, the dtype of the final norm's output (grad_input's) and, when the
    head trains, of its weight as the forward sees it (grad_weight's): fp32 only over fp32 weights."""
    shape, e = job.shape, job.train.compute_bytes
    rows = liger_chunk_rows(tokens, shape.hidden, shape.vocab)
    x_bytes = stream_bytes
    w_bytes = stream_bytes if not job.facts.lora else 0
    held = tokens * shape.hidden * x_bytes + shape.vocab * shape.hidden * w_bytes + tokens * 4
    # While a chunk's rows of grad_input are made (grad_logits_chunk @ weight, then copied into grad_input):
    # the chunk's logits, that product, and the input chunk cast to the matmul dtype when it differs.
    transient = rows * shape.vocab * e + rows * shape.hidden * e * (2 if x_bytes != e else 1)
    formula = (f"{tokens:,} tokens x hidden {shape.hidden} x {x_bytes} B (input gradient)"
               + (f" + vocab x hidden x {w_bytes} B (head weight gradient)" if w_bytes else "")
               + f" + fp32 loss per token; chunk of {rows:,} rows x vocab x {e} B")
    return LigerLoss(held, transient, formula, shape.vocab * shape.hidden * w_bytes)


@dataclass(frozen=True)
class LossBytes:
    """Bytes per logit the loss holds: at its forward peak, at the start of backward, and what the
    training loop keeps referenced through the whole backward."""

    forward: float
    backward: float
    kept: float
    how: str
    hole: float = 0.0
    """Bytes per logit the caching allocator holds free but cannot use at the backward peak."""

    @property
    def peak(self) -> float:
        return max(self.forward, self.backward)


def shifted_copy_bytes(job) -> int:
    """Bytes per logit of the shifted fp32 copy transformers' loss makes (`logits[..., :-1, :].contiguous()`,
    <= 4.48). At micro-batch 1 the slice of a (1, s, vocab) tensor is already contiguous (a size-1 dimension's
    stride does not count: c10 TensorImpl compute_contiguous), so `.contiguous()` returns it and copies nothing."""
    return 4 if job.train.micro_batch > 1 else 0


def loss_bytes(job, tokens_per_sequence: int) -> LossBytes:
    """Per logit, from how the stack computes the loss (job.facts.loss), and the model's logit soft-cap."""
    lb = _loss_bytes(job, tokens_per_sequence)
    if not job.facts.logit_softcap:
        return lb
    # `logits / cap`, `tanh`, `* cap` on the head's output (JobFacts.logit_softcap): TanhBackward0 saves its
    # output, a compute-dtype tensor of every logit, which lives through the loss's forward and its backward
    # until TanhBackward0 runs, right after them (MulBackward0 and DivBackward0 by a number save nothing). The
    # logits the loss sees are the product; the head's output and the quotient are freed as each next op is
    # made, so the chain's own moment (two of them) stays under the loss's. Where the loop keeps logits, it
    # keeps the product: `kept` and the allocator hole are the loss's as before.
    e = job.train.compute_bytes
    return dataclasses.replace(lb, forward=lb.forward + e, backward=lb.backward + e,
                               how=lb.how + f", logits soft-capped (tanh's {e} B output saved)")


def _loss_bytes(job, tokens_per_sequence: int) -> LossBytes:
    f = job.facts
    e = job.train.compute_bytes
    if f.loss == "fused":
        # A fused linear + cross-entropy that recomputes (Cut Cross-Entropy): the logits chunk by chunk,
        # only a logsumexp per token kept; no full logits tensor survives.
        return LossBytes(0.0, 0.0, 0.0, "fused linear + cross-entropy: no full logits")
    if f.loss_chunk_tokens:
        n = max(1, -(-tokens_per_sequence // f.loss_chunk_tokens))
    else:
        n = max(1, f.loss_chunks)
    # What the loss sees: fp32 logits where the loop's wrapper cast the model's outputs (f.logits_fp32, its
    # 16-bit ones gone with the forward's frame), else the compute dtype's.
    lg = 4 if f.logits_fp32 else e
    lsm = 4 if f.loss_upcast else lg  # the log-softmax output autograd keeps
    copy = 4 / n if f.loss_upcast and lg != 4 else 0  # one chunk's fp32 copy, alive while its CE runs
    shift = shifted_copy_bytes(job)
    if f.loss == "fp32-logits-kept":
        # transformers <= 4.45: logits.float() in the model, shift_logits = logits[..., :-1, :]
        # .contiguous(), CrossEntropyLoss on it; the fp32 logits are returned and kept.
        kept = 4
        fwd = 4 + shift + 4
        bwd = kept + lsm + 2 * lsm
        # The 16-bit logits are freed by `.float()`; every later tensor of the loss (the shifted copy,
        # log-softmax, its gradient in and out) is 4 B per logit, so the caching allocator cannot hand
        # their block to any of them (best fit needs a block at least as big): it stays cached, empty.
        return LossBytes(fwd, bwd, kept, "fp32 logits kept, shifted copy, fp32 log-softmax", hole=e if e < 4 else 0)
    if f.loss == "compute-shifted":
        # transformers < 4.49 GPT2LMHeadModel.forward: the compute-dtype logits (alive in `outputs` until
        # compute_loss returns), their shifted .contiguous() copy (none of one sequence: shifted_copy_bytes), and
        # CrossEntropyLoss on it, which CUDA runs as nll_loss(log_softmax(x, dim, x.dtype)) (aten LossNLL.cpp
        # cross_entropy_loss; on no CUDA autocast list): log_softmax in the compute dtype, saved, and under
        # autocast (accelerate's native AMP: f.loss_upcast) nll_loss's fp32 cast of it (AT_FORALL_FP32), saved
        # too. Native AMP then makes the forward's outputs fp32 (accelerate convert_outputs_to_fp32): 4 B per
        # logit more, beside the 16-bit logits and both saved tensors, until compute_loss returns.
        shift = e if job.train.micro_batch > 1 else 0
        if f.loss_upcast and e != 4:
            fwd = max(e + shift + e + 4, e + e + 4 + 4)
            # NllLossBackward0's fp32 gradient beside both saved tensors; then ToCopyBackward0 and log_softmax's
            # in the compute dtype
            return LossBytes(fwd, e + 4 + 4, 0, "compute-dtype shifted copy and log-softmax, fp32 nll_loss (autocast)")
        return LossBytes(e + shift + e, 3 * e, 0, "compute-dtype shifted copy and cross-entropy")
    if f.loss == "fp32-upcast-shifted":
        # transformers 4.46-4.48 loss_utils.ForCausalLMLoss: `logits = logits.float()`, then
        # shift_logits = logits[..., :-1, :].contiguous(), cross_entropy on it. The model's 16-bit logits
        # live in `outputs` until compute_loss returns; the fp32 copy and the shifted copy die with the
        # loss function. At fp32 `.float()` is the tensor itself, no copy.
        fwd = e + (4 if e != 4 else 0) + shift + lsm
        bwd = 3 * lsm
        # Both 4 B blocks are free again before backward and take its two 4 B gradients; the 16-bit
        # logits' block cannot hold either (as for fp32-upcast below).
        return LossBytes(fwd, bwd, 0, "fp32 copy, shifted fp32 copy, fp32 log-softmax", hole=e if e < 4 else 0)
    kept = lg if f.logits_kept else 0
    if f.loss_autocast and lsm != 4:
        # Compute-dtype logits under autocast: CUDA's cross_entropy is nll_loss(log_softmax(x, dim, x.dtype))
        # (aten LossNLL.cpp), and nll_loss, on autocast's fp32 list, saves an fp32 cast of the compute-dtype
        # log-softmax beside it (f.loss_autocast). Backward: NllLossBackward0's fp32 gradient beside both saved
        # tensors, then its saved cast goes and ToCopyBackward0 and log_softmax's gradients are compute-dtype.
        how = (f"compute-dtype cross-entropy{f' in {n} chunks' if n > 1 else ''}, fp32 nll_loss (autocast)"
               + (", logits kept through backward" if kept else ""))
        return LossBytes(lg + lsm + 4, kept + lsm + 4 + 4 / n, kept, how)
    # Forward: every chunk's logits, every chunk's log-softmax output, one chunk's fp32 copy. Where the loop's
    # wrapper casts the logits, the 16-bit and the fp32 ones meet first (e + 4 B), less than this.
    fwd = lg + lsm + copy
    # Backward start: the kept logits, the saved log-softmax outputs, and one chunk's gradient in
    # and out of log_softmax.
    bwd = kept + lsm + 2 * lsm / n
    how = (f"{'fp32' if f.loss_upcast or f.logits_fp32 else 'compute-dtype'} cross-entropy"
           + (" on logits the loop cast to fp32" if f.logits_fp32 else "")
           + (f" in {n} chunks" if n > 1 else "") + (", logits kept through backward" if kept else ""))
    # One unchunked upcast whose compute-dtype logits die before backward (torchtitan `del pred`, the
    # HF Trainer dropping `outputs` when compute_loss returns, podkit's forward returning the loss): the
    # logits (e) and their fp32 copy (4, freed when the loss returns) were allocated back to back, so
    # their freed blocks coalesce into one hole of e + 4 B per logit. Backward allocates two 4 B
    # tensors (nll_loss's dense gradient, then log_softmax's input gradient) while the saved 4 B
    # log-softmax output lives; best fit puts one of them in that hole and the remaining e B per logit
    # cannot hold the other (c10/cuda/CUDACachingAllocator.cpp: best fit per stream, a block split
    # only from its start; expandable segments grow only at their end), so the segment grows past it.
    # This assumes no other free block fits a 4 B/logit tensor: the logits are the step's largest.
    hole = e if f.loss_upcast and e != 4 and n == 1 and not kept else 0
    return LossBytes(fwd, bwd, kept, how, hole)
