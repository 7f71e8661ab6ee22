"""Per-GPU training memory, term by term, for the job as podkit's smoke run trains it.

The peak is not the sum of everything that ever exists: it is the largest of three moments of a
training step, each the sum of what is live then (the usual "static + dynamic" split of Rajbhandari
et al., ZeRO, SC'20, with the dynamic part resolved in time):

  forward-end  end of forward, start of backward: every saved activation plus the loss spike
               (logits, their fp32 upcast, log-softmax and its gradient);
  backward     backward through the last block: saved activations, that block recomputed (when
               checkpointed) and its gradient intermediates, gradients accumulated so far;
  step         optimizer step: every gradient plus optimizer states and step temporaries.

Activations are counted tensor by tensor from what autograd saves for backward in a Llama block
(HF modeling_llama structure: fp32 RMSNorm, separate q/k/v/o and gate/up/down projections,
RoPE, SDPA with native GQA) or a GPT-2 block, after Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (34sbh + 5as^2b for GPT with fp16), but
with PyTorch's real dtypes: under autocast the residual stream stays fp32 and every linear
layer casts its input to bf16 separately.

`allocated` is the prediction of torch.cuda.max_memory_allocated; `total` adds what only the
device sees (CUDA context, NCCL, allocator fragmentation) and is compared with the card.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checks.config import JobConfig
from checks.gpus import GpuSpec
from checks.models import ModelShape, ParamGroup

GIB = 1 << 30
MIB = 1 << 20
TERMS = ("params", "grads", "optimizer", "activations", "loss", "overhead")

# Device-side constants. Rough by nature; each is what a bare PyTorch process shows on NVIDIA
# datacenter cards with CUDA 12 lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since
# CUDA 11.7 in PyTorch): nvidia-smi memory.used minus torch.cuda.memory_reserved().
CUDA_CONTEXT = 512 * MIB
# cuBLAS/cuBLASLt workspaces (CUBLAS_WORKSPACE_CONFIG default :4096:8 = 32 MiB on Hopper) and
# cuDNN scratch.
LIBRARY_WORKSPACES = 64 * MIB
# NCCL's communicator buffers (NCCL_BUFFSIZE = 4 MiB per channel, per peer, send and receive).
NCCL_BUFFERS = 384 * MIB
# The caching allocator reserves more than is live: blocks split by size class. With
# expandable_segments:True (podkit's env file sets it) the waste on transient tensors stays a few
# percent; applied to what is allocated and freed every step, not to the long-lived states.
FRAGMENTATION = 0.05
# Host RAM a training process needs besides offloaded tensors: CUDA/torch libraries, pinned
# staging buffers, the data pipeline.
HOST_PROCESS_BASELINE = 3 * GIB
# bitsandbytes 8-bit optimizers: one byte per state value plus an fp32 absmax per block of 256
# (bitsandbytes optimizer_update_8bit_blockwise); tensors under min_8bit_size = 4096 elements
# keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
# QLoRA NF4 with double quantization (Dettmers et al. 2023, section 3): 4 bits per weight plus
# 8-bit absmax per 64 weights plus fp32 per 256 absmax = 0.5 + 1/64 + 4/(64*256) bytes.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class Precision:
    param_bytes: int  # how trainable weights are stored
    grad_bytes: int
    compute_bytes: int  # matmul inputs and outputs
    autocast: bool  # fp32 weights cast to compute dtype per op


PRECISION = {
    "fp32": Precision(4, 4, 4, False),
    "fp16-mixed": Precision(4, 4, 2, True),
    "bf16-mixed": Precision(4, 4, 2, True),
    "bf16": Precision(2, 2, 2, False),
}


@dataclass(frozen=True)
class Part:
    """One named piece of memory: which term it belongs to, its size, and how it was derived."""

    term: str
    label: str
    bytes: int
    formula: str
    transient: bool = False  # allocated and freed within a step: subject to fragmentation


def total_bytes(parts: list[Part]) -> int:
    return sum(p.bytes for p in parts)


@dataclass
class MemoryEstimate:
    gpu: GpuSpec
    phase_parts: dict[str, list[Part]]  # what is live at each moment of the step
    peak_phase: str
    capacity: int
    host_needed: int  # per node, for offload; 0 without offload
    host_capacity: int
    approximate: bool
    notes: list[str] = field(default_factory=list)

    @property
    def parts(self) -> list[Part]:
        """What is live at the peak."""
        return self.phase_parts[self.peak_phase]

    @property
    def phases(self) -> dict[str, int]:
        return {name: total_bytes(parts) for name, parts in self.phase_parts.items()}

    def term(self, name: str, phase: str = "") -> int:
        return sum(p.bytes for p in self.phase_parts[phase or self.peak_phase] if p.term == name)

    @property
    def per_gpu(self) -> dict[str, int]:
        terms = {name: self.term(name) for name in TERMS}
        terms["total"] = self.total
        return terms

    @property
    def total(self) -> int:
        return total_bytes(self.parts)

    @property
    def allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: the tensors, without device-only overhead."""
        return self.total - self.term("overhead")

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def headroom(self) -> float:
        return 1 - self.total / self.capacity


@dataclass(frozen=True)
class _Layout:
    """Everything about the job the formulas need, resolved once."""

    shape: ModelShape
    prec: Precision
    world: int
    param_shards: int
    grad_shards: int
    optim_shards: int
    fsdp: bool
    lora: bool
    tokens: int  # per micro-batch per GPU
    act_bytes: int  # e: matmul outputs
    residual_bytes: int  # r: the residual stream
    autocast: bool  # fp32 trainable weights cast per op (the weight cache)
    fp32_stream: bool  # the residual stream is fp32 and each linear casts its own input


def _layout(job: JobConfig) -> _Layout:
    t, c = job.train, job.cluster
    prec = PRECISION[t.precision]
    fsdp = c.sharding in ("zero2", "zero3")
    world = c.world_size
    # Autocast only happens where fp32 weights sit on the GPU: FSDP's MixedPrecisionPolicy
    # gathers them in the compute dtype, and optimizer offload leaves only compute-dtype weights
    # on the GPU (ZeRO-Offload), so both compute like pure 16-bit with no per-op casts.
    autocast = prec.autocast and not fsdp and c.offload == "none"
    # With fp32 embeddings the stream stays fp32 (fp32 + bf16 promotes to fp32); LoRA's frozen
    # base is stored in bf16, so its stream is bf16 and autocast has nothing left to cast.
    fp32_stream = autocast and t.lora_rank == 0
    return _Layout(
        shape=job.shape,
        prec=prec,
        world=world,
        param_shards=world if fsdp else 1,
        grad_shards=world if fsdp else 1,
        optim_shards=world if c.sharding != "none" else 1,
        fsdp=fsdp,
        lora=t.lora_rank > 0,
        tokens=t.micro_batch * t.seq_len,
        act_bytes=prec.compute_bytes,
        residual_bytes=4 if fp32_stream or t.precision == "fp32" else prec.compute_bytes,
        autocast=autocast,
        fp32_stream=fp32_stream,
    )


# ---------------------------------------------------------------- trainable and frozen tensors


def trainable_groups(job: JobConfig) -> list[ParamGroup]:
    shape, r = job.shape, job.train.lora_rank
    if not r:
        return shape.param_groups()
    adapters = []
    for name, fan_in, fan_out in shape.linear_shapes():
        adapters.append(ParamGroup(f"{name}.lora_A", fan_in, r, shape.layers, True, True))
        adapters.append(ParamGroup(f"{name}.lora_B", r, fan_out, shape.layers, True, True))
    return adapters


def _frozen_bytes(job: JobConfig, lay: _Layout) -> int:
    """LoRA's frozen base: stored in the compute dtype (no master copy is needed for weights that
    never update), the block linears quantized by bitsandbytes for QLoRA."""
    if not lay.lora:
        return 0
    quant = job.train.base_quant
    total = 0.0
    for g in lay.shape.param_groups():
        if quant != "none" and g.linear and g.per_layer:
            # LLM.int8 (Dettmers et al. 2022): int8 weights plus an fp32 scale per output row.
            per = NF4_BYTES if quant == "nf4" else 1 + 4 / g.rows
        else:
            per = lay.prec.compute_bytes
        total += g.total * per
    return int(total)


def trainable_params(job: JobConfig) -> int:
    return sum(g.total for g in trainable_groups(job))


def optimizer_bytes(job: JobConfig, groups: list[ParamGroup], state_bytes: int) -> int:
    opt = job.train.optimizer
    total = 0.0
    for g in groups:
        if opt == "adamw":
            per_tensor = 2 * state_bytes * g.numel  # exp_avg, exp_avg_sq in the parameter's dtype
        elif opt in ("adamw8bit", "paged_adamw8bit"):
            if g.numel >= BNB_MIN_8BIT_SIZE:
                per_tensor = 2 * g.numel * (1 + 4 / BNB_BLOCK)
            else:
                per_tensor = 2 * 4 * g.numel
        elif opt in ("lion", "sgd"):
            per_tensor = state_bytes * g.numel  # one momentum buffer
        else:  # adafactor (Shazeer & Stern 2018): factored second moment, no first moment
            per_tensor = 4 * (g.rows + g.cols) if g.cols > 1 else 4 * g.numel
        total += per_tensor * g.count
    return int(total)


def _step_transient(job: JobConfig, groups: list[ParamGroup], state_bytes: int) -> tuple[int, str]:
    """Temporaries of the optimizer step. Fused AdamW (podkit's choice on CUDA), bitsandbytes'
    kernels and foreach SGD update in place; Lion and Adafactor step tensor by tensor and
    allocate full-size intermediates of the tensor being updated."""
    largest = max(g.numel for g in groups)
    copies = {"lion": 1, "adafactor": 2}.get(job.train.optimizer, 0)
    return largest * state_bytes * copies, f"{copies} temporaries of the largest trainable tensor ({largest:,})"


# ---------------------------------------------------------------- activations, per token


def block_activations_per_token(lay: _Layout, attention: str, seq_len: int) -> dict[str, float]:
    """Bytes autograd saves per token in one block with no checkpointing, by tensor."""
    s, e, r = lay.shape, lay.act_bytes, lay.residual_bytes
    h, qd, kvd, f = s.hidden, s.q_dim, s.kv_dim, s.ffn
    parts: dict[str, float] = {"residual stream in, and after attention (saved by the norms)": 2 * r * h}
    if s.arch == "llama":
        # HF LlamaRMSNorm: x.float(); x * rsqrt(mean(x^2) + eps); weight * x.to(dtype). With an
        # fp32 stream only the normalised x is new; with bf16 the fp32 upcast and the cast back
        # are saved too.
        parts["RMSNorm fp32 intermediates (x2)"] = 2 * (4 * h if r == 4 else 6 * h)
        linear_inputs = 5 if lay.fp32_stream else 2  # autocast casts per consumer: q,k,v and gate,up
        parts["normed inputs to q/k/v and gate/up" + (" (one bf16 cast each)" if lay.fp32_stream else "")] = (
            linear_inputs * e * h
        )
        parts["q, k, v after RoPE"] = e * (qd + 2 * kvd)
        parts["SwiGLU: gate, up, silu(gate), product"] = 4 * e * f
    else:
        parts["LayerNorm statistics (x2)"] = 2 * 8
        parts["normed inputs to c_attn and c_fc"] = 2 * e * h
        parts["q, k, v (c_attn output)"] = e * 3 * h
        parts["GELU MLP: c_fc output, gelu output"] = 2 * e * f
    if attention == "eager":
        # softmax(scores.float()) saves its fp32 output; the bf16 copy feeds probs @ v.
        parts["attention probabilities, s x s per head"] = s.heads * seq_len * (4 + (e if e != 4 else 0))
        parts["k, v repeated to every head"] = 2 * e * (qd - kvd)
    else:
        # SDPA (flash / memory-efficient) and flash-attn save out and logsumexp, no s x s matrix.
        parts["attention output and logsumexp"] = e * qd + 4 * s.heads
    parts["attention output made contiguous for o_proj"] = e * qd
    return parts


def _selective_per_token(lay: _Layout) -> float:
    """torchtitan-style op-level selective checkpointing: keep the outputs of the matmuls and of
    attention, recompute norms, activations, casts and RoPE."""
    s, e, r = lay.shape, lay.act_bytes, lay.residual_bytes
    h, qd, kvd, f = s.hidden, s.q_dim, s.kv_dim, s.ffn
    mlp = 2 * e * f if s.arch == "llama" else e * f
    return r * h + e * (qd + 2 * kvd) + (e * qd + 4 * s.heads) + e * h + mlp + e * h


def _backward_transient_per_token(lay: _Layout, attention: str, seq_len: int) -> float:
    """Gradient intermediates of the block being backpropagated: the residual gradient in and
    out, and in SwiGLU's backward d(product), d(silu), d(up), d(gate) with three alive at once."""
    s, e, r = lay.shape, lay.act_bytes, lay.residual_bytes
    mlp = (3 if s.arch == "llama" else 2) * e * s.ffn
    eager = s.heads * seq_len * (4 + e) if attention == "eager" else 0
    return 2 * r * s.hidden + mlp + eager


def _head_activations_per_token(lay: _Layout) -> float:
    """Final norm and the LM head's input (the logits are the loss term)."""
    s, e, r = lay.shape, lay.act_bytes, lay.residual_bytes
    norm = (4 * s.hidden if r == 4 else 6 * s.hidden) if s.arch == "llama" else 8
    return r * s.hidden + norm + e * s.hidden


# ---------------------------------------------------------------- the estimate


def estimate(job: JobConfig, gpu: GpuSpec | None = None) -> MemoryEstimate:
    gpu = gpu or job.gpu
    t, c = job.train, job.cluster
    lay = _layout(job)
    shape, T = lay.shape, lay.tokens
    L = shape.layers
    e = lay.act_bytes
    trainable = trainable_groups(job)
    n_trainable = sum(g.total for g in trainable)
    notes: list[str] = []

    # ---- params -----------------------------------------------------------------------------
    offload = c.offload
    if offload == "all":
        resident_bytes = 0
    elif offload == "optimizer":
        resident_bytes = lay.prec.compute_bytes  # master copy lives on the host
    else:
        resident_bytes = lay.prec.param_bytes
    params_resident = Part(
        "params",
        "weights" + (f", sharded over {lay.param_shards} GPUs" if lay.param_shards > 1 else ""),
        (n_trainable * resident_bytes + _frozen_bytes(job, lay)) // lay.param_shards,
        f"{n_trainable:,} trainable x {resident_bytes} B"
        + (" + frozen base" if lay.lora else "")
        + (f" / {lay.param_shards}" if lay.param_shards > 1 else ""),
    )
    fwd_params: list[Part] = []
    gather_bytes = lay.prec.compute_bytes if lay.prec.autocast else lay.prec.param_bytes
    if lay.fsdp:
        per_layer = shape.params_per_layer
        if c.sharding == "zero2":
            # reshard_after_forward=False: every block stays gathered from its forward to its backward.
            n, why = L, "every block, gathered from forward until backward (reshard_after_forward=False)"
        else:
            # Current block plus the one prefetched (FSDP2 prefetches one block ahead in both passes).
            n, why = min(2, L), "current block + one prefetched"
        # The root module (embeddings, final norm, head) is not resharded after forward (FSDP2).
        gathered = (n * per_layer + shape.params_outside_layers) * gather_bytes
        fwd_params.append(Part("params", "unsharded weights being used", gathered,
                               f"{why}, plus the root module, at {gather_bytes} B", transient=True))
    if lay.autocast:
        cast = sum(g.total for g in trainable if g.linear)
        if shape.tie_embeddings and not lay.lora:
            cast += shape.vocab * shape.hidden  # the tied embedding is the head's matmul weight
        fwd_params.append(
            Part(
                "params",
                "autocast weight cache",
                cast * lay.prec.compute_bytes,
                f"{cast:,} matmul weights cast to {lay.prec.compute_bytes} B, cached for the autocast region "
                "and saved for backward (torch autocast caches casts of leaf weights that require grad)",
                transient=True,
            )
        )
    if t.base_quant != "none":
        biggest = max(i * o for _, i, o in shape.linear_shapes())
        fwd_params.append(
            Part("params", "dequantized weight (QLoRA)", biggest * lay.prec.compute_bytes,
                 "bitsandbytes dequantizes each quantized weight for its matmul, forward and backward",
                 transient=True)
        )

    # ---- grads ------------------------------------------------------------------------------
    grad_bytes = lay.prec.grad_bytes
    grads_all = n_trainable * grad_bytes // lay.grad_shards
    ddp = lay.world > 1 and not lay.fsdp
    grads_persist = ddp or t.grad_accum > 1
    grads_on_gpu = offload == "none"
    full_grads = Part(
        "grads",
        "gradients" + (", sharded" if lay.grad_shards > 1 else ""),
        grads_all if grads_on_gpu else 0,
        f"{n_trainable:,} x {grad_bytes} B" + (f" / {lay.grad_shards}" if lay.grad_shards > 1 else "")
        + (" (DDP buckets, gradient_as_bucket_view)" if ddp else "")
        + (" (on the host: offloaded)" if not grads_on_gpu else ""),
    )
    if grads_persist:
        bwd_grads = [full_grads]
    else:
        head = shape.vocab * shape.hidden if not lay.lora else 0
        block = shape.params_per_layer if not lay.lora else n_trainable // max(L, 1)
        bwd_grads = [Part("grads", "gradients so far (head + one block)", (head + block) * grad_bytes // lay.grad_shards,
                          "zero_grad(set_to_none=True): gradients appear as backward reaches each weight",
                          transient=True)]
    if lay.fsdp:
        block_bytes = (shape.params_per_layer if not lay.lora else n_trainable // max(L, 1)) * e
        bwd_grads.append(Part("grads", "unsharded block gradient + reduce-scatter input", 2 * block_bytes,
                              "the block's gradient in compute dtype before reduce-scatter", transient=True))
    if lay.autocast and not lay.lora:
        # The head is always a matmul, also when its weight is the tied embedding.
        biggest = max([g.numel for g in trainable if g.linear] + [shape.vocab * shape.hidden])
        bwd_grads.append(Part("grads", "weight gradient being accumulated", biggest * (e + grad_bytes),
                              "a matmul's gradient in compute dtype and its fp32 cast into .grad", transient=True))

    # ---- optimizer ----------------------------------------------------------------------------
    state_bytes = 2 if t.precision == "bf16" else 4
    opt_total = optimizer_bytes(job, trainable, state_bytes) // lay.optim_shards
    optimizer = Part(
        "optimizer",
        f"{t.optimizer} states" + (f", sharded over {lay.optim_shards}" if lay.optim_shards > 1 else ""),
        0 if offload != "none" else opt_total,
        "on the host (offloaded)" if offload != "none" else f"per trainable tensor, state dtype {state_bytes} B",
    )
    step_bytes, step_formula = _step_transient(job, trainable, state_bytes)
    step_temp = Part("optimizer", "step temporaries", step_bytes if offload == "none" else 0, step_formula,
                     transient=True)
    if t.optimizer == "paged_adamw8bit":
        notes.append("paged optimizer states live in CUDA unified memory: they page out to host RAM "
                     "under pressure instead of failing, at a speed cost.")

    # ---- activations and loss ------------------------------------------------------------------
    per_block = block_activations_per_token(lay, t.attention, t.seq_len)
    none_per_token = sum(per_block.values())
    stored_per_token = {"none": none_per_token, "selective": _selective_per_token(lay),
                        "full": lay.residual_bytes * shape.hidden}[t.checkpointing]
    head_per_token = _head_activations_per_token(lay)
    stored = int((L * stored_per_token + head_per_token) * T)
    activations = Part(
        "activations",
        f"saved activations ({t.checkpointing} checkpointing)",
        stored,
        f"({L} blocks x {stored_per_token:,.0f} B + head {head_per_token:,.0f} B) per token x {T:,} tokens",
        transient=True,
    )
    recompute = int((none_per_token - stored_per_token) * T)
    bwd_transient = int(_backward_transient_per_token(lay, t.attention, t.seq_len) * T)
    bwd_acts = [activations, Part("activations", "one block in backward",
                                  recompute + bwd_transient,
                                  (f"recomputed block {none_per_token - stored_per_token:,.0f} B + " if recompute else "")
                                  + f"gradient intermediates, per token x {T:,}", transient=True)]
    # cross_entropy(logits.float()): backward holds the log-softmax output, its incoming
    # gradient and its input gradient, 3 x 4 B per logit; forward peaks at e + 8 B (logits,
    # the fp32 upcast, log-softmax output), never more than 12.
    loss = Part("loss", "logits, fp32 upcast, log-softmax and its gradient", 12 * shape.vocab * T,
                f"12 B x vocab {shape.vocab:,} x {T:,} tokens", transient=True)

    # ---- overhead --------------------------------------------------------------------------------
    def overhead(dynamic: int) -> list[Part]:
        parts = [Part("overhead", "CUDA context", CUDA_CONTEXT, "driver context and kernels, lazy loading"),
                 Part("overhead", "cuBLAS / cuDNN workspaces", LIBRARY_WORKSPACES, "library scratch buffers")]
        if lay.world > 1:
            parts.append(Part("overhead", "NCCL buffers", NCCL_BUFFERS, "communicator buffers per GPU"))
        parts.append(Part("overhead", "allocator fragmentation", int(FRAGMENTATION * dynamic),
                          f"{FRAGMENTATION:.0%} of the memory allocated and freed each step"))
        return parts

    def phase(parts: list[Part]) -> list[Part]:
        dynamic = sum(p.bytes for p in parts if p.transient)
        return [p for p in parts + overhead(dynamic) if p.bytes or p.term == "params"]

    static = [params_resident, optimizer]
    fwd_grads = [full_grads] if grads_persist else []
    phases = {
        "forward-end": phase(static + fwd_params + fwd_grads + [activations, loss]),
        "backward": phase(static + fwd_params + bwd_grads + bwd_acts),
        "step": phase(static + [full_grads, step_temp]),
    }
    peak = max(phases, key=lambda name: total_bytes(phases[name]))

    # ---- host RAM for offload -------------------------------------------------------------------
    host = 0
    if offload != "none":
        # Optimizer states, fp32 gradients, and the weights the CPU step updates (ZeRO-Offload).
        per_param = opt_total * lay.optim_shards / n_trainable + 4 + lay.prec.param_bytes
        per_rank = n_trainable * per_param / lay.optim_shards
        if offload == "all":
            per_rank += _frozen_bytes(job, lay) / lay.param_shards
        host = int(c.gpus_per_node * (per_rank + HOST_PROCESS_BASELINE))
    if shape.approximate:
        notes.append("model known only by size: shapes inferred, activation and loss terms are approximate.")

    return MemoryEstimate(
        gpu=gpu,
        phase_parts=phases,
        peak_phase=peak,
        capacity=gpu.memory_bytes,
        host_needed=host,
        host_capacity=int(c.host_ram_gb * 1e9),
        approximate=shape.approximate,
        notes=notes,
    )
