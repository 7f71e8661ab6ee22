"""Per-GPU training memory, term by term, for the job as podkit's smoke run trains it.

The peak is not the sum of everything that ever exists: it is the largest of three moments of a
training step, each the sum of what is live then (the usual "static + dynamic" split of Rajbhandari
et al., ZeRO, SC'20, with the dynamic part resolved in time):

  forward-end  end of forward, start of backward: every saved activation plus the loss spike
               (logits, their fp32 upcast, log-softmax and its gradient);
  backward     backward through the last block: the blocks' saved activations (the head's are
               released by then), that block recomputed (when checkpointed) and the most its
               recompute and its nodes in reverse order hold at once, gradients accumulated so far;
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

import dataclasses
from dataclasses import dataclass, field

from podkit.checks import activations as A
from podkit.checks import device_overhead
from podkit.checks import fsdp1, step_replay
from podkit.checks.allocator import round_size, segment_size
from podkit.checks.config import JobConfig
from podkit.checks.gpus import GpuSpec
from podkit.checks.models import EMBEDDING_GROUPS, ParamGroup
from podkit.checks.stacks import (TORCHAO_OPTIMIZERS, adapted_banks, padded_batches, parse_version, past_window,
                                  targeted)

GIB = 1 << 30
MIB = 1 << 20
TERMS = ("params", "grads", "optimizer", "activations", "loss", "overhead")

# What the process holds besides its training tensors (CUDA context, cuBLAS workspaces, NCCL):
# checks/device_overhead.py, each figure with its source.
# Host RAM a training process needs besides offloaded tensors: CUDA/torch libraries, pinned
# staging buffers, the data pipeline.
HOST_PROCESS_BASELINE = 3 * GIB
# bitsandbytes 8-bit optimizers: one byte per state value plus an fp32 absmax per block of 256
# (bitsandbytes optimizer_update_8bit_blockwise); tensors under min_8bit_size = 4096 elements
# keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
PAGED_MIN_NUMEL = 100_000
# QLoRA NF4 with double quantization (Dettmers et al. 2023, section 3): 4 bits per weight plus
# 8-bit absmax per 64 weights plus fp32 per 256 absmax = 0.5 + 1/64 + 4/(64*256) bytes; without it
# an fp32 absmax per 64 weights (bitsandbytes functional.quantize_4bit, blocksize 64).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_BYTES_NO_DQ = 0.5 + 4 / 64


# The Part of JobFacts.fsdp1_keeps_block_inputs, by which rules.py finds its bytes.
KEPT_INPUTS = "blocks' inputs and their gradients, kept by FSDP1's reshard hooks"


def nf4_bytes(job: JobConfig) -> float:
    return NF4_BYTES if job.train.double_quant else NF4_BYTES_NO_DQ


@dataclass(frozen=True)
class Part:
    """One named piece of memory: which term it belongs to, its size, and how it was derived.

    `where` says who sees it: "tensor" (torch's allocator counts it: max_memory_allocated),
    "pool" (held by the caching allocator but not by a tensor: max_memory_reserved only) or
    "device" (outside the allocator: CUDA context, NCCL, CUDA managed memory; only nvidia-smi).
    """

    term: str
    label: str
    bytes: int
    formula: str
    transient: bool = False  # allocated and freed within a step
    where: str = "tensor"


def total_bytes(parts: list[Part]) -> int:
    return sum(p.bytes for p in parts)


def tensor_bytes(parts: list[Part]) -> int:
    """What torch's allocator counts at a moment (its allocated bytes)."""
    return sum(p.bytes for p in parts if p.where == "tensor")


def reserved_bytes(parts: list[Part]) -> int:
    """Tensors plus the allocator's cached pools (its reserved bytes)."""
    return sum(p.bytes for p in parts if p.where in ("tensor", "pool"))


PHASES = ("forward-end", "backward", "backward-end", "step")
ROOT_RS_INPUT = "the root's reduce-scatter input"
EMBEDDING_GRAD = "the input embedding's gradient, being made"
BLOCK_RS_INPUT = "the first block's reduce-scatter input, kept until the root's post-backward"
RS_INPUTS = (ROOT_RS_INPUT, BLOCK_RS_INPUT)


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
        """Device total at each moment."""
        return {name: total_bytes(parts) for name, parts in self.phase_parts.items()}

    def phase_allocated(self, phase: str) -> int:
        return tensor_bytes(self.phase_parts[phase])

    def phase_reserved(self, phase: str) -> int:
        return reserved_bytes(self.phase_parts[phase])

    def term(self, name: str, phase: str = "") -> int:
        return sum(p.bytes for p in self.phase_parts[phase or self.peak_phase] if p.term == name)

    @property
    def per_gpu(self) -> dict[str, int]:
        terms = {name: self.term(name) for name in TERMS}
        terms["total"] = self.total
        return terms

    @property
    def total(self) -> int:
        """What the device holds at the peak: reserved plus what only the device sees."""
        return total_bytes(self.parts)

    @property
    def allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: the largest tensor total of any moment."""
        return max(self.phase_allocated(p) for p in self.phase_parts)

    @property
    def reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved: tensors plus the allocator's cached pools."""
        return max(self.phase_reserved(p) for p in self.phase_parts)

    @property
    def device_only(self) -> int:
        """What the device holds outside torch's allocator at the peak (context, NCCL, managed memory)."""
        return sum(p.bytes for p in self.parts if p.where == "device")

    @property
    def floor(self) -> int:
        """A lower bound on `total` that the allocator's pools cannot lower: the largest tensor and
        device-only total of any moment (pools only add)."""
        return max(sum(p.bytes for p in parts if p.where != "pool") for parts in self.phase_parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def tensors_fit(self) -> bool:
        """The live tensors alone fit: the caching allocator frees its cached blocks and retries when a
        cudaMalloc fails (c10/cuda/CUDACachingAllocator.cpp, malloc: release_cached_blocks), so a job
        over on reserved can still run, slower, unless fragmentation leaves no block big enough."""
        return self.allocated + self.device_only <= self.capacity

    @property
    def headroom(self) -> float:
        return 1 - self.total / self.capacity

    @property
    def headroom_allocated(self) -> float:
        return 1 - self.allocated / self.capacity


# ---------------------------------------------------------------- trainable and frozen tensors


def trainable_groups(job: JobConfig) -> list[ParamGroup]:
    """The trained tensors: every weight, or LoRA's A (in x r) and B (r x out) on each target."""
    shape, r = job.shape, job.train.lora_rank
    if not r:
        return shape.param_groups()
    targets = job.facts.lora_targets
    adapters = []
    linears = shape.linear_groups()  # exact counts (DeepSeek's dense and MoE blocks differ)
    if shape.fused_proj and not job.facts.fused_proj:
        # A stack (or bin/smoke's replica) that splits Phi-3's qkv_proj and gate_up_proj adapts its five linears.
        linears = dataclasses.replace(shape, fused_proj=False).linear_groups()
    for g in linears:
        if targeted(g.name, targets):
            adapters.append(ParamGroup(f"{g.name}.lora_A", g.rows, r, g.count, True, True))
            adapters.append(ParamGroup(f"{g.name}.lora_B", r, g.cols, g.count, True, True))
    if "lm_head" in targets:
        adapters.append(ParamGroup("lm_head.lora_A", shape.hidden, r, 1, True, False))
        adapters.append(ParamGroup("lm_head.lora_B", r, shape.vocab, 1, True, False))
    return adapters + _bank_adapters(job)


def _bank_adapters(job: JobConfig) -> list[ParamGroup]:
    """peft's LoRA on each MoE layer's 3-D expert banks and router weight (JobFacts.peft_banks), as
    tuners/lora/layer.py ParamWrapper.update_layer makes it (peft 0.21.2): lora_A = nn.Linear(in, r x experts),
    lora_B = nn.Linear(r x experts, out), each a weight (out, in), listed here dim 0 first (they are cast, not
    autocast: linear=False); gate_up_proj at twice the rank (gate and up fused: _convert_peft_config_moe's
    rank_pattern); the router's 2-D (experts, hidden) weight as one expert (in hidden, out experts)."""
    s, r = job.shape, job.train.lora_rank
    gate_up, down, router = adapted_banks(s.family, job.facts.peft_banks)
    if not (gate_up or down or router):
        return []
    m, n = s.moe, s.moe_layers
    h, ffn, e = s.hidden, m.expert_ffn, m.experts
    groups = []
    if gate_up:
        groups += [ParamGroup("experts.gate_up_proj.lora_A", 2 * r * e, h, n, False, True),
                   ParamGroup("experts.gate_up_proj.lora_B", 2 * ffn, 2 * r * e, n, False, True)]
    if down:
        groups += [ParamGroup("experts.down_proj.lora_A", r * e, ffn, n, False, True),
                   ParamGroup("experts.down_proj.lora_B", h, r * e, n, False, True)]
    if router:
        groups += [ParamGroup("router.lora_A", r, h, n, False, True), ParamGroup("router.lora_B", e, r, n, False, True)]
    return groups


def trainable_params(job: JobConfig) -> int:
    return sum(g.total for g in trainable_groups(job))


def frozen_groups(job: JobConfig) -> list[tuple[ParamGroup, float]]:
    """LoRA's frozen base with bytes per value: the compute dtype (no master copy for weights that
    never update), the block linears quantized by bitsandbytes for QLoRA."""
    if not job.train.lora_rank:
        return []
    quant, e = job.train.base_quant, job.train.compute_bytes
    out = []
    head_too = job.facts.quantize_head
    for g in job.shape.param_groups():
        # Expert banks stay 16-bit: transformers 5.x keeps routed experts as 3-D parameters, which
        # replace_with_bnb_linear (integrations/bitsandbytes.py) does not swap for 4-bit layers.
        if quant != "none" and g.linear and not g.bank and (g.per_layer or head_too):
            # LLM.int8 (Dettmers et al. 2022): int8 weights plus an fp32 scale per output row.
            per = nf4_bytes(job) if quant == "nf4" else 1 + 4 / g.rows
        elif job.facts.kbit_prepared and g.name not in EMBEDDING_GROUPS:
            # prepare_model_for_kbit_training (peft utils/other.py) casts every fp16/bf16 parameter that is not a
            # Params4bit to fp32: the norms, biases, routers and a transformers 5.x MoE's expert banks; TRL's
            # peft_module_casting_to_bf16 casts only embed_tokens and lm_head back (JobFacts.kbit_prepared).
            per = 4
        else:
            per = e
        out.append((g, per))
    return out



FOLDED_BANKS = "expert banks rebuilt with their LoRA (peft ParamWrapper)"
FOLDED_NOTE = ("W' = baddbmm(W, B, A) per adapted bank, in the bank's dtype, kept by the experts' matmul for backward; "
               "its backward makes a W'-sized weight gradient")


def _bank_folds(job: JobConfig, ac: str) -> dict[str, int]:
    """Bytes of the expert banks peft rebuilds with their adapters (JobFacts.peft_banks), at each moment of the step.

    ParamWrapper._activate_lora (peft 0.21.2 tuners/lora/layer.py) registers a parametrization that returns
    W' = torch.baddbmm(W, lhs, rhs, alpha=scaling) (_LoraFactorsProxy), cached for the module's forward
    (nn.utils.parametrize.cached): one bank-sized tensor in W's dtype per adapted bank, which the experts'
    grouped matmul keeps for backward since W' requires grad. That matmul's backward makes dW', W'-sized, which
    baddbmm's backward reduces to the adapters' gradients. A layer's banks, in units of experts x ffn x hidden:
    gate_up_proj 2, down_proj 1; backward runs down's node first (W'_gate_up + W'_down + dW'_down alive), then
    gate_up's (W'_gate_up + dW'_gate_up). Without checkpointing every MoE layer keeps its W' until its backward;
    with it only the block being recomputed has them (its first forward keeps none of them for backward).
    Moments: fwd/head_bwd/blocks (before backward reaches the blocks), last (the last block's forward), bwd (a
    block in backward), end (the first block's backward). peft 0.19-0.20 fold through an einsum delta in the
    adapters' dtype first, a larger forward transient not priced here."""
    gate_up, down, _ = adapted_banks(job.shape.family, job.facts.peft_banks)
    if not (gate_up or down):
        return {}  # the router's rebuilt (experts, hidden) weight is a few KiB
    s = job.shape
    e = A.bank_dtype_bytes(job) or job.train.compute_bytes  # W's dtype: fp32 where k-bit preparation cast it
    unit = s.moe.experts * s.moe.expert_ffn * s.hidden * e
    # get_delta_factors hands baddbmm the adapters `.to(W.dtype)`, which baddbmm keeps: copies when they differ.
    # (FSDP's mixed-precision gather and DeepSpeed's engine already hand them over in the compute dtype).
    casts = sum(g.numel for g in _bank_adapters(job) if g.name.startswith("experts.")) * e \
        if (job.facts.adapter_compute_bytes or job.facts.adapter_bytes) != e else 0
    layer = (2 * gate_up + down) * unit + casts
    in_backward = max(2 * gate_up + 2 * down, 4 * gate_up) * unit + casts
    # The first block's backward ends the step's: DeepSeek's first_k_dense_replace blocks, dense, come first.
    end = 0 if s.family.startswith("deepseek") and s.moe.dense_layers else in_backward
    if ac == "none":
        saved = s.moe_layers * layer
        return {"fwd": saved, "head_bwd": saved, "blocks": saved, "last": saved,
                "bwd": saved - layer + in_backward, "end": end}
    return {"bwd": in_backward, "end": end, "last": layer}


ROUTER_CASTS = "routers' weights cast for their fp32 matmul (transformers' DeepSeek)"
ROUTER_NOTE = ("F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32)): each MoE layer's matmul "
               "keeps its router weight's cast (fp32, or autocast's 16-bit one) for the input's gradient, until that "
               "layer's backward")


def _router_casts(job: JobConfig, ac: str) -> dict[str, int]:
    """Bytes of the router weight casts transformers' DeepSeek MoE layers keep (activations.router_fp32), at each
    moment of the step (as _bank_folds). Without autocast `self.weight.type(torch.float32)` copies a 16-bit weight
    (a LoRA base, pure 16-bit, FSDP's or DeepSpeed's 16-bit weights) and an fp32 one is used as it is. Under
    autocast F.linear casts the weight to the compute dtype, and that 16-bit cast is the one kept: from an fp32
    master, a 16-bit base's fp32 copy, or the frozen fp32 weight of a base prepared for k-bit training
    (prepare_model_for_kbit_training casts every non-4-bit parameter to fp32). The router is no nn.Linear, so the
    autocast weight cache priced beside it leaves it out; autocast caches the cast of an fp32 master that trains
    for its whole region (aten autocast_mode.cpp cached_cast: `arg.requires_grad() && arg.is_leaf()`), every MoE
    layer's, checkpointed or not, and casts the others anew at each call. A checkpointed block keeps none in its
    first forward, only while it is recomputed. Verified on a tiny real DeepSeek-V3 (tests/test_hf_saved_tensors.py)."""
    f, s, t = job.facts, job.shape, job.train
    if not A.router_fp32(job) or (not f.autocast and t.compute_bytes == 4):
        return {}
    layer = s.moe.experts * s.hidden * (t.compute_bytes if f.autocast else 4)
    saved = s.moe_layers * layer
    # The first block's backward ends the step's; DeepSeek's first_k_dense_replace blocks, dense, come first.
    end = 0 if s.moe.dense_layers else layer
    if ac == "none":
        return {"fwd": saved, "head_bwd": saved, "blocks": saved, "last": saved, "bwd": saved, "end": end}
    if f.autocast and not f.lora:  # cached while the forward's autocast region lasts
        return {"fwd": saved, "last": saved, "bwd": layer, "end": end}
    return {"bwd": layer, "end": end, "last": layer}


def _frozen_bytes(job: JobConfig, stored: bool = False) -> int:
    """The frozen base's bytes; stored=True: as sharded storage holds them (fsdp2_stored)."""
    return int(sum(g.total * per for g, per, _ in _frozen_storage(job, stored)))


def _frozen_storage(job: JobConfig, stored: bool = False) -> list[tuple[ParamGroup, float, bool]]:
    """frozen_groups with whether each is a 4-bit packed parameter (0.5 B per weight) plus a QuantState;
    stored=True: each group as sharded storage holds it (fsdp2_stored)."""
    nf4 = job.train.base_quant == "nf4"
    frozen = frozen_groups(job)
    groups = fsdp2_stored(job, [g for g, _ in frozen]) if stored else [g for g, _ in frozen]
    return [(g, per, nf4 and per == nf4_bytes(job)) for g, (_, per) in zip(groups, frozen)]


def _quant_state_bytes(job: JobConfig) -> int:
    """The nf4 base's quantization state: absmax per 64 weights (uint8 plus fp32 per 256 with double
    quantization, fp32 without), bitsandbytes functional.quantize_4bit."""
    return int(sum(g.total * (per - 0.5) for g, per, q in _frozen_storage(job) if q))


def trainable_param_bytes(job: JobConfig) -> int:
    """How trainable weights are stored: fp32 masters unless pure 16-bit (bf16, fp16); LoRA adapters by the stack."""
    if job.train.lora_rank:
        return job.facts.adapter_bytes
    return job.train.param_bytes


def optimizer_bytes(job: JobConfig, groups: list[ParamGroup], state_bytes: int, shards: int = 1) -> int:
    """The states of these parameters on one of `shards` ranks that share them out (under FSDP2 rank 0's
    whole rows of dim 0: fsdp2_stored)."""
    if shards > 1:
        groups = fsdp2_stored(job, groups)
    # _fsdp1_first_step makes these states tensor by tensor for the FSDP1 replay: keep the two in step.
    opt = job.train.optimizer
    if opt in TORCHAO_OPTIMIZERS:
        return _torchao_state_bytes(job, groups, state_bytes, shards)
    total = 0.0
    for g in groups:
        if opt == "adamw":
            per_tensor = 2 * state_bytes * g.numel  # exp_avg, exp_avg_sq in the parameter's dtype
        elif opt in ("adamw8bit", "paged_adamw8bit"):
            if g.numel >= BNB_MIN_8BIT_SIZE:
                per_tensor = 2 * g.numel * (1 + 4 / BNB_BLOCK)
            else:
                per_tensor = 2 * 4 * g.numel
        elif opt == "paged_adamw":
            per_tensor = 2 * 4 * g.numel  # bitsandbytes' 32-bit optimizers keep fp32 states for any param dtype
        elif opt == "lion":
            # bitsandbytes Lion (optim/lion.py: Optimizer1State, optim_bits=32): one state, and
            # Optimizer1State.init_state (optim/optimizer.py, 0.50.2) makes it fp32 for any param dtype.
            per_tensor = 4 * g.numel
        elif opt == "lion8bit":
            # Lion8bit: the same init_state with optim_bits=8: tensors of >= min_8bit_size (4096) values
            # keep one uint8 state and an fp32 absmax per block of 256; smaller ones one fp32 state.
            per_tensor = g.numel * (1 + 4 / BNB_BLOCK) if g.numel >= BNB_MIN_8BIT_SIZE else 4 * g.numel
        elif opt == "sgd":
            per_tensor = state_bytes * g.numel  # one momentum buffer
        else:  # adafactor (Shazeer & Stern 2018): factored second moment, no first moment
            per_tensor = 4 * (g.rows + g.cols) if g.cols > 1 else 4 * g.numel
        total += per_tensor * g.count
    return int(total) // shards


def _torchao_state_bytes(job: JobConfig, groups: list[ParamGroup], state_bytes: int, shards: int) -> int:
    """torchao's two states per tensor (stacks.LowBitAdam). Under FSDP2 torchao quantizes each rank's local
    shard, rank 0's whole rows of dim 0 (optimizer_bytes passes the groups as fsdp2_stored lays them out,
    so numel / shards is that piece): a tensor may stay in its own dtype once sharded (a 4096-value norm over 2 ranks).
    Elsewhere the optimizer sees whole tensors (DDP, ZeRO-1's whole parameters per rank, FSDP1's
    use_orig_params views, which on rank 0 are whole but for one piece: checks/fsdp1.py shard_pieces),
    shared out evenly."""
    low_bit, block = TORCHAO_OPTIMIZERS[job.train.optimizer], job.facts.torchao_block
    local = job.facts.fsdp_version == 2
    total = 0
    for g in groups:
        numel = -(-g.numel // shards) if local else g.numel
        total += 2 * sum(low_bit.state_tensors(numel, state_bytes, block)) * g.count
    return total if local else total // shards


def fsdp2_stored(job: JobConfig, groups: list[ParamGroup]) -> list[ParamGroup]:
    """The groups as FSDP2 stores them over the job's ranks, so that a group's total / world is one rank's
    piece. fully_shard splits dim 0 of each parameter into world chunks of ceil(dim0 / world) whole rows
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py _init_sharded_param: _chunk_with_empty, i.e.
    torch.chunk) and every rank keeps a shard padded to chunk 0's size (`padded_sharded_param =
    param_data.new_zeros(padded_sharded_size)`, "0th always padded"); the all-gather output and the
    reduce-scatter's input and output are padded alike (_fsdp_collectives.py foreach_reduce:
    _get_dim0_padded_size), and rank 0's optimizer states are zeros_like its whole chunk. A routed-expert
    bank's dim 0 is the expert count: 8 experts over 16 ranks are one expert per rank, ranks 8-15 holding
    padding, so each rank stores twice its even share. A shared-expert bank's (torchtitan < 0.2.0) is 1:
    every rank stores the whole weight, and rank 0 its states. Other jobs: the groups as they are (FSDP1 pads its
    flat parameters, checks/fsdp1.py; DeepSpeed partitions flat, evenly).

    An nn.Linear weight is (out, in), and a ParamGroup of a block linear is (in, out) (models.py), so dim 0
    is its cols, as is a router's, an nn.Linear or a bare (experts, hidden) Parameter (transformers 5.x
    MixtralTopKRouter.weight) listed (hidden, experts); the head, the embedding and vectors are listed dim 0
    first; a bank's group is one expert's weight, `count` of them: experts x MoE layers. Takes the groups
    as the model lists them (not idempotent)."""
    f = job.facts
    if not (f.fsdp and f.fsdp_version == 2):
        return groups
    world = job.cluster.world_size
    experts = job.shape.moe.experts if job.shape.moe else 1
    out = []
    for g in groups:
        if g.bank:
            n = experts if g.expert else 1  # the bank's dim 0
            out.append(dataclasses.replace(g, count=g.count // n * -(-n // world) * world))
        elif (g.linear or g.name == job.shape.router_name) and g.cols > 1 and g.name != "lm_head":
            out.append(dataclasses.replace(g, cols=-(-g.cols // world) * world))
        else:
            out.append(dataclasses.replace(g, rows=-(-g.rows // world) * world))
    return out


def _step_transient(job: JobConfig, groups: list[ParamGroup], state_bytes: int, shards: int) -> tuple[int, str]:
    """Temporaries of the optimizer step, from each implementation's code (torch/optim/*.py):

    fused AdamW, bitsandbytes' 8-bit kernels: in place, none;
    foreach AdamW (_multi_tensor_adamw): exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs), one
      temporary the size of every state of the device/dtype group at once;
    for-loop AdamW (_single_tensor_adamw): denom = (exp_avg_sq.sqrt() / bc2).add_(eps), two
      temporaries of the tensor being updated;
    foreach SGD with weight decay (_multi_tensor_sgd): grads = torch._foreach_add(grads, params,
      alpha=weight_decay), a copy of every decayed gradient;
    bitsandbytes Lion/Lion8bit (optimizer_update_32bit / _8bit_blockwise): in place, none;
    torchao's low-bit AdamW (torchao/optim/adam.py): torch.compile(single_param_adam, fullgraph=True) per
      tensor, its fp32 dequantized states and update fused into generated kernels; priced as none on CUDA,
      as torchao's published peaks bear out (torchao/optim/README.md, Llama2-7B full bf16 on an A100 through
      torchtune: ao 8-bit 39.1 GB beside bitsandbytes' in-place 8-bit 39.3 GB with the same state bytes;
      ao 4-bit 33.2 GB, 6.1 GB under bitsandbytes where the states alone differ by 6.5 GB, so less than one
      fp32 copy of the 131M-value embedding, 0.52 GB, is left for temporaries). The CPU backend's kernels
      are not so fused: torch 2.13's C++ inductor code for torchao 0.18 keeps two fp32 copies of the
      tensor (8-bit) and more (4-bit: also int64 code indices), not priced here;
    Adafactor: temporaries of the tensor being updated."""
    opt, impl = job.train.optimizer, job.facts.optimizer_impl
    # A layer's routed experts are one 3-D parameter in transformers 5.x: the largest tensor is the bank. Under
    # FSDP2 the step runs on each rank's local piece (a DTensor's local tensor: rank 0's whole rows of dim 0, the
    # groups as fsdp2_stored pads them, so a bank holds ceil(experts / world) experts).
    experts = job.shape.moe.experts if job.shape.moe else 1
    local = job.facts.fsdp_version == 2 and shards > 1
    if local:
        largest = max(g.numel * -(-(experts if g.expert else 1) // shards) if g.bank else -(-g.numel // shards)
                      for g in groups)
    else:
        largest = max(g.numel * (experts if g.bank and g.expert else 1) for g in groups)
    decayed = sum(g.total for g in groups if g.cols > 1) // shards
    everything = sum(g.total for g in groups) // shards
    if opt == "adamw" and impl == "foreach":
        return everything * state_bytes, f"foreach sqrt of every exp_avg_sq ({everything:,} x {state_bytes} B)"
    if opt == "adamw" and impl == "for-loop":
        return 2 * largest * state_bytes, f"2 temporaries of the largest tensor ({largest:,})"
    if opt == "sgd" and job.train.weight_decay and impl != "fused":
        return decayed * state_bytes, f"foreach SGD copies every decayed gradient ({decayed:,} x {state_bytes} B)"
    copies = {"adafactor": 2}.get(opt, 0)  # bitsandbytes' Lion kernels update in place, like its AdamW
    return largest * state_bytes * copies, f"{copies} temporaries of the largest trainable tensor ({largest:,})"


def _rounding(sizes: list[tuple[float, int]]) -> int:
    """Bytes the caching allocator adds to live blocks of these (size, count): sizes are rounded
    up to 512 B, and an allocation over 10 MiB gets its own segment rounded to 2 MiB
    (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kMinLargeAlloc, kRoundLarge; smaller ones
    share 2 MiB / 20 MiB segments, whose tail is reused)."""
    extra = 0.0
    for size, count in sizes:
        if size <= 0:
            continue
        rounded = -(-size // 512) * 512
        if rounded > 10 * MIB:
            rounded = -(-rounded // (2 * MIB)) * (2 * MIB)
        extra += (rounded - size) * count
    return int(extra)


# ---------------------------------------------------------------- the estimate


def estimate(job: JobConfig, gpu: GpuSpec | None = None, device: str = "cuda", *,
             replay: bool = True) -> MemoryEstimate:
    """Per-GPU memory at each moment of a training step, for the job as its stack trains it.

    device = "cpu" predicts the tensors of the same step run on a CPU (bin/smoke's CPU mode): the
    same terms, with the kernels torch picks there. replay=False skips the allocator replays
    (checks/fsdp1.py, checks/step_replay.py), which decide only pool parts: its `floor` is the full
    estimate's, for a quick screen (checks/advisor.py)."""
    gpu = gpu or job.gpu
    if gpu is not job.gpu:
        job = job.replace(cluster={"gpu": gpu.name})  # the SDPA kernel depends on the card
    t, c, f = job.train, job.cluster, job.facts
    shape = job.shape
    T, L = t.micro_batch * t.seq_len, shape.layers
    e = job.train.compute_bytes
    world = c.world_size
    param_shards = world if f.fsdp else 1
    optim_shards = world if c.sharding != "none" else 1
    fsdp2 = f.fsdp and f.fsdp_version != 1
    trainable = trainable_groups(job)
    n_trainable = sum(g.total for g in trainable)
    # What sharded storage holds: FSDP2 pads each rank's shard to whole rows of dim 0 (fsdp2_stored).
    shard_groups = fsdp2_stored(job, trainable)
    n_stored = sum(g.total for g in shard_groups)
    lora = f.lora
    # FSDP1 wraps each LoRA linear as its own unit (the stack's policy) only when there are adapters.
    lora_units = f.stack.lora_units and lora
    offload = c.offload
    notes: list[str] = []
    bf = A.block_facts(job, device)

    # ---- params -----------------------------------------------------------------------------
    param_bytes = trainable_param_bytes(job)
    if offload == "all":
        resident_bytes = 0  # parameters live on the host; FSDP gathers them per block
    elif offload == "optimizer" or (f.stack.deepspeed_engine and t.mixed):
        # ZeRO-Offload / DeepSpeed's 16-bit engine: the GPU holds the 16-bit weights, the fp32
        # master copy lives with the optimizer (on the host for offload, in its states otherwise).
        resident_bytes = e
    else:
        resident_bytes = param_bytes
    qstate = _quant_state_bytes(job)
    frozen = 0 if offload == "all" else _frozen_bytes(job, stored=True) - qstate
    # The resident weights as the allocator holds them: one block per tensor (per shard under FSDP2 or
    # ZeRO-3), trainable tensors at their resident dtype, the frozen base at its stored bytes.
    weight_tensors = [(g.numel * resident_bytes / param_shards, g.count) for g in shard_groups] + (
        [(g.numel * (0.5 if q else per) / param_shards, g.count) for g, per, q in _frozen_storage(job, stored=True)]
        if frozen else [])
    padded = n_stored > n_trainable
    experts = shape.moe.experts if shape.moe else 1
    if f.fsdp and f.fsdp_version == 2 and any(g.bank and g.expert for g in shape.param_groups()) and experts % world:
        experts_here = -(-experts // world)
        notes.append(f"FSDP2 shards each expert bank by whole experts: {experts} experts over {world} GPUs "
                     f"leave {experts_here} on each GPU, {experts_here * world / experts:.2g} x an even "
                     "share of the experts' memory; a world size that divides the expert count avoids it"
                     + (" (torchtitan after v0.2.2 shards experts on dim 1 when GPUs outnumber them, "
                        "pytorch/torchtitan#2668)" if world > experts else "") + ".")
    params_resident = Part(
        "params",
        "weights" + (f", sharded over {param_shards} GPUs" if param_shards > 1 else ""),
        (n_stored * resident_bytes + frozen) // param_shards,
        f"{n_trainable:,} trainable x {resident_bytes} B"
        + (" + frozen base" if lora and frozen else "")
        + (f" / {param_shards}" if param_shards > 1 else "")
        + (" (offloaded to the host)" if offload == "all" else "")
        + (" (FSDP2: each shard padded to whole rows of dim 0)" if padded or frozen > _frozen_bytes(job) - qstate
           else ""),
    )
    # bitsandbytes keeps each 4-bit layer's QuantState (absmax, its second-level absmax and code) on the
    # module, outside the parameter: Params4bit._quantize sets `self.module.quant_state` and
    # Linear4bit.forward restores it onto the weight "for example for fsdp" (nn/modules.py, 0.43.0
    # l.288-290, l.410-417). FSDP1/FSDP2 and ZeRO-3 shard or offload only the packed parameter, so every
    # rank holds every layer's quantization state on the GPU.
    quant_state = [Part("params", "4-bit quantization state (absmax), on every GPU", qstate,
                        "bitsandbytes QuantState per quantized weight: not a parameter, never sharded")] if qstate else []
    rope = _rope_cache_bytes(job)
    rope_caches = [Part("params", "rotary cos/sin caches (buffers), on every GPU", rope,
                        f"{L} layers x 2 x {shape.rope_positions} positions x {shape.d_head} x {f.rope_cache_bytes} B: "
                        "the stack's transformers keeps them as buffers, FSDP never shards buffers")] if rope else []
    master = []
    if f.stack.deepspeed_engine and c.sharding == "zero3":
        # DeepSpeedZeroOptimizer_Stage3.__init__ (deepspeed/runtime/zero/stage3.py, v0.14.0 l.488-492):
        # with contiguous_gradients (default True, runtime/zero/config.py l.94) it keeps
        # torch.empty(reduce_bucket_size, dtype=self.dtype) on the GPU for the whole run. The bucket
        # defaults to 5e8 elements (config.py l.105); accelerate (0.28 accelerator.py l.1561-1593) and the
        # HF Trainer replace it by hidden x hidden only where the config says "auto".
        bucket = (500_000_000 if c.reduce_bucket == "default" else shape.hidden ** 2 if c.reduce_bucket == "auto"
                  else int(c.reduce_bucket))
        master.append(Part("grads", "DeepSpeed ZeRO-3 gradient bucket (contiguous_gradients)", bucket * e,
                           f"reduce_bucket_size {bucket:,} x {e} B"))
    if f.stack.deepspeed_engine and t.mixed and offload == "none":
        master.append(Part("optimizer", "fp32 master weights (DeepSpeed optimizer)", n_trainable * 4 // optim_shards,
                           f"{n_trainable:,} x 4 B / {optim_shards}"))
    fwd_params: list[Part] = []
    end_params = None
    if f.fsdp:
        per_layer = _layer_stored_bytes(job, e)
        if c.sharding == "zero2":
            n, why = L, "every block, gathered from forward until backward (reshard_after_forward=False)"
        elif f.fsdp_version == 1:
            # FSDP1's backward prefetch targets the handle that ended its forward just before this block:
            # with LoRA units that is one of this block's adapters; without, the block before.
            n = min(1, L) if lora_units else min(2, L)
            why = "the block in backward" + ("" if lora_units else " + the one prefetched")
        else:
            n, why = min(2, L), "current block + one prefetched"
        # The root module (embeddings, final norm, head) is not resharded after forward (FSDP2).
        root = _root_stored_bytes(job, e)
        fwd_params.append(Part("params", "unsharded weights being used", int(n * per_layer + root),
                               f"{why}, plus the root module, as gathered", transient=True))
        if f.fsdp_version != 1:
            # FSDP2 reshards each block after its backward (reshard_after_backward defaults to True:
            # _fsdp_param_group.py post_backward), and the first block has no block before it to prefetch.
            end_params = Part("params", "unsharded weights being used", int(min(1, L) * per_layer + root),
                              "the first block, plus the root module, as gathered", transient=True)
        if c.sharding == "zero3" and f.fsdp_version == 1:
            # FSDP1 gathers the last block for backward only when its pre-backward hook fires, after
            # the loss and the head have been backpropagated: at the loss only the root is gathered.
            at_loss = Part("params", "unsharded weights being used", int(root),
                           "the root module (not resharded after forward)", transient=True)
        elif c.sharding == "zero3":
            # At the loss the last block has resharded and nothing is prefetched yet: root + one block.
            at_loss = Part("params", "unsharded weights being used", int(min(1, L) * per_layer + root),
                           "the block gathered for backward, plus the root module", transient=True)
        else:
            at_loss = fwd_params[0]
    cache_fwd = cache_head_bwd = cache_bwd = cache_end = 0
    if f.autocast:
        cast_block = sum(g.total for g in trainable if g.linear and g.per_layer)
        cast_head = sum(g.total for g in trainable if g.linear and not g.per_layer)
        if shape.tie_embeddings and not lora:
            cast_head += shape.vocab * shape.hidden  # the tied embedding is the head's matmul weight
        cache_fwd = (cast_block + cast_head) * e
        if f.loss == "liger":
            cast_head = 0  # Liger's loss saves gradients, not the cast head weight: it dies with the cache
        # The cache is cleared when the autocast region ends, before backward: only casts that
        # autograd saved survive. Checkpointed blocks saved none (recompute casts again), so only
        # the head's cast outlives forward; without checkpointing every block's does, until that
        # block's backward frees it.
        # The head's cast is saved by the head's matmul alone, whose backward node runs (and releases it)
        # before backward reaches the blocks (engine.cpp: release_variables() right after a node runs).
        cache_head_bwd = cache_fwd if f.ac_policy == "none" else cast_head * e
        cache_bwd = cast_block * e if f.ac_policy == "none" else cast_block // max(L, 1) * e
        cache_end = cast_block // max(L, 1) * e
    cache_note = ("torch autocast caches casts of leaf weights that require grad for the autocast region; "
                  "afterwards only the casts saved for backward live")
    folds = _bank_folds(job, f.ac_policy)
    router_casts = _router_casts(job, f.ac_policy)
    if t.base_quant != "none":
        biggest = max([i * o for _, i, o in shape.linear_shapes()]
                      + ([shape.vocab * shape.hidden] if f.quantize_head else []))
        # dequantize_4bit returns the dtype the weight was quantized from; .to(compute dtype) copies
        # again when they differ (fp16 under lightning's plugin, bf16 compute): both alive at once.
        per = e + (2 if f.stack.quant_from_fp16 and e == 2 and t.dtype == "bf16" else 0)
        if f.kbit_prepared:
            # An fp32 input: MatMul4Bit.forward (0.43.3 autograd/_functions.py) makes the dequantized weight
            # .to(A.dtype), fp32, and autocast casts that back to the compute dtype for F.linear: 4 + e B.
            per = 4 + e
        fwd_params.append(
            Part("params", "dequantized weight (QLoRA)", biggest * per,
                 f"bitsandbytes dequantizes each quantized weight for its matmul, forward and backward, "
                 f"{per} B per weight", transient=True)
        )

    # ---- grads ------------------------------------------------------------------------------
    grad_bytes = param_bytes if not f.stack.deepspeed_engine else e
    grads_all = n_stored * grad_bytes // param_shards if f.fsdp else n_trainable * grad_bytes // (
        optim_shards if f.stack.deepspeed_engine and c.sharding in ("zero2",) else 1)
    ddp = world > 1 and not f.fsdp
    # The root module's trained tensors (embeddings, final norm, head: what fully_shard(model) holds),
    # and those whose gradients exist before the blocks' backward (all but an untied input embedding).
    root_trainable = sum(g.total for g in trainable if not g.per_layer)
    root_stored = sum(g.total for g in shard_groups if not g.per_layer)
    root_early_numel = max(0, root_trainable - (0 if lora else _embedding_only(job)))
    grads_persist = ddp or t.grad_accum > 1
    grads_on_gpu = offload == "none"
    # An FSDP1 root unit that trains (a full fine-tune), its gradients on the GPU: they stay unsharded until
    # the root's backward ends (step_replay.backward_events root_grads).
    fsdp1_root = f.fsdp_version == 1 and root_trainable > 0 and grads_on_gpu
    full_grads = Part(
        "grads",
        "gradients" + (", sharded" if f.fsdp else ""),
        grads_all if grads_on_gpu else 0,
        f"{n_trainable:,} x {grad_bytes} B" + (f" / {param_shards}" if f.fsdp else "")
        + (" (DDP buckets, gradient_as_bucket_view)" if ddp else "")
        + (" (on the host: offloaded)" if not grads_on_gpu else ""),
    )
    head_grad = sum(g.total for g in trainable if not g.per_layer and g.linear) if lora else (
        shape.vocab * shape.hidden)
    block_grad = sum(g.total for g in trainable if g.per_layer) // max(L, 1)
    block_stored = sum(g.total for g in shard_groups if g.per_layer) // max(L, 1)
    if grads_persist and f.fsdp_version == 1 and offload == "all":
        # FSDP1 CPU offload: _offload_grad copies each reduce-scattered shard to flat_param._cpu_grad, but
        # the GPU shard stays referenced as flat_param._saved_grad_shard until the post-backward callback
        # (_finalize_params -> prepare_gradient_for_optim sets .grad = _cpu_grad and deletes it):
        # torch/distributed/fsdp/_runtime_utils.py _accumulate_sharded_grad, _offload_grad.
        start_grads = end_grads = [Part("grads", "sharded gradients, on the GPU until backward ends",
                                        grads_all, f"{n_trainable:,} x {grad_bytes} B / {param_shards}: each "
                                        "shard is copied to the host and kept until the post-backward callback",
                                        transient=True)]
    elif fsdp2 or fsdp1_root:
        # FSDP1 concatenates and reduce-scatters the root unit's gradients when its backward ends (the head's
        # waits in the views' input buffer from the head's backward on: step_replay.backward_events). FSDP2
        # reduce-scatters the root module (embeddings, final norm, head) in its post-backward, which
        # the root's final callback runs when backward ends (torch/distributed/fsdp/_fully_shard/
        # _fsdp_state.py _root_post_backward_final_callback): until then its gradients stay unsharded, in
        # the gathered dtype, the head's from its backward on. A block's are sharded by its post-backward.
        blocks_so_far = [full_grads] if grads_persist else [
            Part("grads", "gradients so far (last block)", block_stored * grad_bytes // param_shards if grads_on_gpu
                 else 0, "zero_grad(set_to_none=True): each block's sharded gradients after its post-backward",
                 transient=True)]
        blocks_all = [full_grads] if grads_persist else [
            Part("grads", "gradients so far (every block)", (n_stored - root_stored) * grad_bytes
                 // param_shards if grads_on_gpu else 0, "at the first block's backward", transient=True)]
        root_early = [Part("grads", "unsharded root gradients (head, final norm)", root_early_numel * e,
                           f"{root_early_numel:,} x {e} B until the root's post-backward", transient=True)]
        start_grads = blocks_so_far + root_early
        end_grads = blocks_all + root_early
    elif grads_persist:
        start_grads = end_grads = [full_grads]
    else:
        start_grads = [Part("grads", "gradients so far (head + last block)",
                            (head_grad + block_grad) * grad_bytes // param_shards,
                            "zero_grad(set_to_none=True): gradients appear as backward reaches each weight",
                            transient=True)]
        end_grads = [Part("grads", "gradients so far (all but the embedding)",
                          max(0, n_trainable - (0 if lora else _embedding_only(job))) * grad_bytes // param_shards,
                          "at the first block's backward nearly every gradient exists", transient=True)]
    if grads_persist and not f.fsdp and shape.tie_embeddings and not lora:
        # The tied weight's AccumulateGrad waits for both its inputs (torch/csrc/autograd/engine.cpp counts
        # dependencies; input_buffer.cpp sums them): the head's gradient is held in autograd's input buffer
        # until the embedding's backward, the last node, beside the .grad that accumulation keeps.
        waiting = Part("grads", "the head's gradient, waiting for the tied embedding's", head_grad * grad_bytes,
                       f"vocab x hidden x {grad_bytes} B in autograd's input buffer", transient=True)
        start_grads = start_grads + [waiting]
        end_grads = end_grads + [waiting]
    no_sync = f.fsdp_version == 1 and f.stack.fsdp_no_sync and t.grad_accum > 1 and n_trainable > 0
    if no_sync:
        # Every micro-step but the last runs under the root's no_sync(): FSDP1's post-backward hook returns
        # before reduce-scattering (`if not state._sync_gradients: ... return`, _runtime_utils.py), so each
        # flat parameter keeps its whole unsharded .grad, on the GPU even with CPU offload, until the
        # synchronising micro-step's reduce-scatter (FullyShardedDataParallel.no_sync docstring: "FSDP will
        # accumulate the full model gradients (instead of gradient shards) until the eventual sync").
        unsynced = Part("grads", "unsharded gradients, accumulated under no_sync", n_trainable * grad_bytes,
                        f"{n_trainable:,} x {grad_bytes} B, not divided by the {param_shards} ranks", transient=True)
        start_grads = end_grads = [unsynced]
    elif f.fsdp and f.fsdp_version == 1:
        # A unit's weights are views of its flat parameter: their gradients wait in the input buffer of the views'
        # backward, which concatenates them into the flat gradient (split_with_sizes_backward: at::cat) while
        # they are alive; FSDP1 _reduce_grad then reduce-scatters that .grad itself (F.pad copies it only when
        # its numel does not divide by the world size). checks/step_replay.py backward_events.
        # With LoRA units (Stack.lora_units) each adapter is a unit of its own, concatenated alone.
        copies = 1 if lora_units else 2
        rs = Part("grads", "unsharded block gradient", copies * block_grad * grad_bytes,
                  "the block's weight gradients" + (" beside their concatenation" if copies == 2 else "")
                  + ", reduce-scattered in place", transient=True)
        start_grads = start_grads + [rs]
        end_grads = end_grads + [rs]
    elif f.fsdp:
        rs = Part("grads", "unsharded block gradient + reduce-scatter input", (block_grad + block_stored) * e,
                  "the block's gradient in compute dtype, and its fp32 copy for reduce-scatter"
                  + (" (padded to whole rows of dim 0)" if block_stored > block_grad else ""), transient=True)
        start_grads = start_grads + [rs]
        end_grads = end_grads + [rs]
    head_accum = None
    if f.autocast and not lora:
        # Once backward reaches the blocks, the weight gradient being made is a block linear's. The head's
        # (also when its weight is the tied embedding) is made before, right after the loss's backward:
        # that moment is a forward-end candidate below.
        biggest = max([g.numel for g in trainable if g.linear and g.per_layer], default=0)
        start_grads = start_grads + [Part("grads", "weight gradient being accumulated", biggest * (e + grad_bytes),
                                          "a block matmul's gradient in compute dtype and its fp32 cast into .grad",
                                          transient=True)]
        head_accum = Part("grads", "the head's weight gradient being accumulated",
                          shape.vocab * shape.hidden * (e + grad_bytes),
                          "vocab x hidden in compute dtype and its fp32 cast into .grad", transient=True)

    # ---- optimizer ----------------------------------------------------------------------------
    state_bytes = param_bytes  # torch optimizers keep states in the parameter's dtype
    opt_total = optimizer_bytes(job, trainable, state_bytes, optim_shards)
    # bitsandbytes pages (cudaMallocManaged, outside torch's allocator) only the states of tensors
    # of at least 1e5 values (bitsandbytes/optim/optimizer.py get_state_buffer: `if not
    # self.is_paged or p.numel() < 1e5: return torch.zeros_like(p)`).
    paged_groups = [g for g in trainable if f.paged_optimizer and g.numel >= PAGED_MIN_NUMEL]
    paged_total = optimizer_bytes(job, paged_groups, state_bytes, optim_shards) if paged_groups else 0
    optimizer = Part(
        "optimizer",
        f"{t.optimizer} states" + (f", sharded over {optim_shards}" if optim_shards > 1 else ""),
        0 if offload != "none" else opt_total - paged_total,
        "on the host (offloaded)" if offload != "none" else f"per trainable tensor, state dtype {state_bytes} B",
    )
    paged_part = [Part("optimizer", f"{t.optimizer} paged states (CUDA managed memory)",
                       paged_total if offload == "none" else 0,
                       "tensors of >= 1e5 values: cudaMallocManaged, outside torch's allocator", where="device")]
    paged = bool(paged_total)
    step_bytes, step_formula = _step_transient(job, shard_groups, state_bytes, optim_shards)
    step_temp = Part("optimizer", "step temporaries", step_bytes if offload == "none" else 0, step_formula,
                     transient=True)
    if paged:
        notes.append("paged optimizer states live in CUDA managed memory: nvidia-smi counts them, "
                     "torch.cuda.max_memory_allocated does not; under pressure they page out to host RAM.")

    # ---- activations and loss ------------------------------------------------------------------
    # All blocks' saved activations: per block, averaged over the model's dense and MoE blocks. One block
    # on its own (the first block's saved set, the block in backward) is taken at the larger kind: the
    # config gives how many blocks are dense, not always where (DeepSeek's first_k_dense_replace are the
    # first, Qwen's mlp_only_layers any), as for the last block's forward below.
    # Sliding-window layers (ModelShape.sliding_layers) are a kind of their own where they get a mask the others do
    # not (JobFacts.layer): their mask copy, kernel and k/v repeat. Where a model has both, the sliding share of each
    # dense/MoE kind is taken as the model's (Qwen2-MoE's use_sliding_window alone mixes them). The block in backward
    # is taken at the larger kind with every block's input still held, as if backward began in it: where the last
    # layer attends fully (Gemma 2; Gemma 3 12B's 48th), the first sliding one comes a block later, with what that
    # block kept freed, so the backward peak reads high by at most the sliding kind's extra (a checkpointed block: one
    # block input less; tests/test_sliding_window.py checks it exact with a sliding last layer).
    n_moe = shape.moe_layers
    bf_slide = A.block_facts(job, device, sliding=True) if shape.sliding_layers else bf
    n_slide = len(shape.sliding_layers) if bf_slide != bf else 0
    # The MoE blocks' sliding share, rounded, within what each kind can hold; the dense blocks take the rest.
    slid_moe = min(n_moe, n_slide, max(n_slide - (L - n_moe), round(n_moe * n_slide / L)))
    kinds = []  # (the block's facts, MoE?, blocks of that kind)
    for m, count, slid in ((False, L - n_moe, n_slide - slid_moe), (True, n_moe, slid_moe)):
        kinds += [(kbf, m, n) for kbf, n in ((bf, count - slid), (bf_slide, slid)) if n]
    bf_main = A.main_block_facts(job, device)  # for the allocator's replays of one block
    stored = {}
    one_block_pt = 0.0
    for kbf, moe_layer, count in kinds:
        saved = A.saved_per_token(kbf, f.ac_policy, moe_layer)
        one_block_pt = max(one_block_pt, sum(saved.values()))
        for label, b in saved.items():
            stored[label] = stored.get(label, 0) + b * count / L
    stored_pt = sum(stored.values())
    # A base prepared for k-bit training turns the stream fp32 only from the first block's output on: that
    # block's checkpointed input is the 16-bit embedding (activations.block_facts).
    first_input_pt = -(bf.stream - e) * shape.hidden if f.kbit_prepared and f.ac_policy != "none" else 0
    # The attention mask the model builds once per forward (stacks.AttentionMask), shared by every layer. It
    # lives through the blocks' forward, and on through backward where a checkpoint keeps it as a block input
    # or each layer's kernel saves it itself (no per-layer copy); a boolean mask nothing saves dies with the
    # decoder's forward, before the loss (transformers' ForCausalLM computes it after self.model returns).
    # A model with sliding-window layers builds their mask too (JobFacts.sliding_mask).
    am, sm = f.attn_mask, f.sliding_mask

    def shared_pt(m) -> float:
        return m.shared_bytes_per_token(t.seq_len, t.micro_batch, shape.rope_positions) if m else 0.0

    def kept_pt(m, kbf) -> float:
        # Without checkpointing a shared mask outlives the forward only where the kernels save it themselves: the
        # fused kernels with no copy of their own (the math kernel adds it to the scores, which saves nothing of it).
        kernels_keep_it = not kbf.mask_values and kbf.kernel in ("flash", "efficient")
        return shared_pt(m) if m and (f.ac_policy != "none" or kernels_keep_it) else 0.0

    mask_pt = shared_pt(am) + shared_pt(sm)
    mask_kept_pt = kept_pt(am, bf) + kept_pt(sm, bf_slide)
    mask_text = f" + attention mask {mask_kept_pt:,.0f} B" if mask_kept_pt else ""
    # transformers 4.53-4.57 checkpoint each layer reentrantly (the Trainer's default use_reentrant=True) through
    # GradientCheckpointingLayer, which hands the mask over as a keyword: `partial(super().__call__, **kwargs)`
    # (4.57.1 modeling_layers.py). CheckpointFunction keeps that partial as ctx.run_function, which no node's
    # release frees, so the mask outlives the blocks' backward until the graph goes with the loss (measured in
    # tests/test_attention_mask.py). 4.38-4.52 pass it positionally (save_for_backward: released with the first
    # block's node), a non-reentrant checkpoint drops it with its frame, and FSDP1's checkpoint_wrapper around the
    # unit packs keywords into positional inputs.
    mask_held = [Part("activations", "attention mask held by the reentrant checkpoints' partial", int(mask_pt * T),
                      f"{mask_pt:,.0f} B per token x {T:,} (4.53+ GradientCheckpointingLayer keyword)",
                      transient=True)] if (
        f.masks and f.stack.transformers_release and f.ac_policy == "block" and f.reentrant
        and not f.fsdp1_checkpoint_around_unit and (not t.transformers or parse_version(t.transformers) >= (4, 53))
    ) else []
    if (shape.sliding_layers and f.stack.transformers_release and t.attention == "sdpa" and t.transformers
            and parse_version(t.transformers) < (4, 53)):
        # Before masking_utils (4.53) each family built its sliding mask its own way (Gemma 2's decoder layer
        # `torch.where(sliding_window_mask, min_dtype, attention_mask)`, Mistral's _update_causal_mask): not modelled.
        notes.append(f"sliding-window layers ({len(shape.sliding_layers)} of {L}, window {shape.sliding_window}): "
                     f"transformers {t.transformers} builds their mask in its own way, not priced here; 4.53 and "
                     "later are.")
    masked = [(kbf, n) for kbf, _, n in kinds if kbf.mask_values]
    if masked and f.ac_policy == "none":
        copies = T * e * sum(kbf.mask_values * n for kbf, n in masked)
        layers = sum(n for _, n in masked)
        flat = (am or sm).shape == "flat"
        padded = padded_batches(t) or am is not None  # 4.38-4.39's always-built mask reads as padded
        why = ("padding-free (flattened) batches" if flat else "padded batches" if padded
               else f"sliding-window layers past their window ({shape.sliding_window} tokens)")
        notes.append(f"{why}: every layer with a mask keeps its own {e}-byte copy of the "
                     f"{'(1, 1, tokens, tokens)' if flat else '(batch, 1, seq, seq)'} attention mask for "
                     f"backward, {copies / 2**30:.2f} GiB over {layers} layers; "
                     + ("attention = 'flash-attn' (which TRL asks for with padding-free batches) or checkpointing "
                        "avoid it." if flat else
                        "checkpointing or attention = 'flash-attn' avoid it."
                        if not padded or (f.sliding_own and past_window(t, shape)) else
                        "equal-length batches (padding = 'none'), checkpointing, or attention = 'flash-attn' avoid it."))
    # A checkpointed block recomputes its forward with grad enabled: bitsandbytes < 0.43.2 then keeps
    # every 4-bit matmul's input on its ctx (MatMul4Bit.forward `ctx.tensors = (A, B)`, 0.43.0
    # autograd/_functions.py l.522-523) until the block's backward is done, reentrant or not.
    def bf_re(kbf):
        return dataclasses.replace(kbf, quant_saves_input=True) if f.quant_input_in_recompute else kbf

    # What the recompute saves again: autograd's saved set less what the policy kept (by tensor).
    recompute_by_kind = [A.recomputed_per_token(bf_re(kbf), f.ac_policy, m, ctx_kept=bf.quant_saves_input)
                         if f.ac_policy != "none" else 0.0 for kbf, m, _ in kinds]
    head = A.head_saved_per_token(bf, not lora, f.quantize_head,
                                  input_saved={"liger": "never", "fused": "always"}.get(f.loss, "for-grads"))
    head_pt = sum(head.values())
    activations = Part(
        "activations",
        f"saved activations ({t.checkpointing} checkpointing"
        + (f": {f.ac_policy}" if t.checkpointing != "none" else "") + ")",
        int((L * stored_pt + first_input_pt + head_pt + mask_kept_pt) * T),
        f"({L} blocks x {stored_pt:,.0f} B" + (f" - {-first_input_pt:,.0f} B (first block's 16-bit input)"
                                               if first_input_pt else "")
        + f" + head {head_pt:,.0f} B{mask_text}) per token x {T:,} tokens",
        transient=True,
    )
    # Once backward reaches the blocks, the head's and the final norm's nodes have run and released
    # their saved tensors (torch/csrc/autograd/engine.cpp: without retain_graph, a node's
    # release_variables() runs right after it): only the blocks' remain.
    block_activations = Part("activations", "blocks' saved activations",
                             int((L * stored_pt + first_input_pt + mask_kept_pt) * T),
                             f"({L} blocks x {stored_pt:,.0f} B{mask_text}) per token x {T:,} tokens "
                             "(the head's were released by its backward)", transient=True)
    first_block = Part("activations", "first block's saved activations",
                       int((one_block_pt + first_input_pt + mask_kept_pt) * T),
                       f"({one_block_pt:,.0f} B{mask_text}) per token x {T:,}", transient=True)
    # A checkpointed block's backward starts with its recompute, whose last ops hold their own
    # intermediates beside nearly every saved tensor; then the backward itself (gradients), by which time a
    # selective policy's outputs that autograd does not save are gone (activations.sac_released_per_token).
    released = [A.sac_released_per_token(kbf, f.ac_policy, m) for kbf, m, _ in kinds]
    released_pt = max(released)
    sac = f.ac_policy in ("matmuls", "op-sac")

    def recompute_transient(kbf, m: bool) -> float:
        if f.ac_policy == "none":
            return 0.0
        if sac:
            return A.sac_recompute_transient_per_token(bf_re(kbf), f.ac_policy, m)
        return A.recompute_transient_per_token(bf_re(kbf), m, f.reentrant)

    def in_backward_pt(i: int) -> tuple[float, float]:
        kbf, m, _ = kinds[i]
        return recompute_by_kind[i], max(A.backward_intermediates_per_token(kbf, m) - released[i],
                                         recompute_transient(kbf, m))

    recompute_pt, grad_inter_pt = max((in_backward_pt(i) for i in range(len(kinds))), key=sum)
    in_backward = Part("activations", "one block in backward", int((recompute_pt + grad_inter_pt) * T),
                       (f"recomputed block {recompute_pt:,.0f} B + " if recompute_pt else "")
                       + f"gradient intermediates {grad_inter_pt:,.0f} B, per token x {T:,}"
                       + (f" (its selectively kept outputs autograd does not save, {released_pt:,.0f} B per token, "
                          "released by the recompute)" if released_pt else ""), transient=True)
    lb = A.loss_bytes(job, t.seq_len)
    logits = shape.vocab * T
    lg = A.liger_loss(job, T, bf.stream) if f.loss == "liger" else None
    if lg:
        loss = Part("loss", "loss: Liger's fused linear cross-entropy, gradients made in forward",
                    lg.held + lg.transient, lg.formula, transient=True)
    else:
        loss = Part("loss", "loss: " + lb.how, int(lb.forward * logits),
                    f"{lb.forward:g} B x vocab {shape.vocab:,} x {T:,} tokens (its forward)", transient=True)
        loss_bwd = Part("loss", "loss: " + lb.how, int(lb.backward * logits),
                        f"{lb.backward:g} B x vocab {shape.vocab:,} x {T:,} tokens (its backward)", transient=True)
    kept_logits = [Part("loss", "logits kept through backward", int(lb.kept * logits),
                        f"{lb.kept:g} B x {logits:,}", transient=True)] if lb.kept else []
    loss_hole = [Part("overhead", "freed logits' slot (allocator hole)", int(lb.hole * logits),
                      f"{lb.hole:g} B x {logits:,}: the loss backward's 4 B gradients cannot use it",
                      transient=True, where="pool")] if lb.hole else []
    # The previous step's outputs, still bound during this forward, keep its graph: its logits and
    # whatever its nodes hold outside saved tensors (bitsandbytes < 0.43.2's ctx.tensors inputs).
    previous = []
    if f.previous_outputs_kept:
        ctx_held = sum(A.ctx_kept_per_token(kbf, m) * n for kbf, m, n in kinds)
        if f.quantize_head:
            ctx_held += shape.hidden * e  # the 4-bit LM head's input (its chunks are views of it)
        held = lb.kept * logits + (ctx_held * T if f.quant_saves_input else 0)
        previous.append(Part("loss", "previous step's logits and graph, still bound", int(held),
                             "the loop rebinds its outputs only after this forward", transient=True))

    # ---- overhead and allocator pools -----------------------------------------------------------
    # A CPU run calls no cuBLAS: its tensors are the step's alone.
    device_only = [Part("overhead", o.label, o.bytes, o.formula, where=o.where)
                   for o in device_overhead.overheads(gpu, c.gpus_per_node, c.nodes)
                   if device == "cuda" or o.where == "device"]
    # FSDP2 allocates all-gather outputs on its all-gather stream and the reduce-scatter output, which
    # becomes the sharded .grad, on its reduce-scatter stream (torch/distributed/fsdp/_fully_shard/
    # _fsdp_collectives.py: only the reduce-scatter *input* moved to the default stream, PR #129721).
    # The caching allocator keeps a pool per stream, so each stream's peak stays reserved all step
    # and the default stream cannot reuse it: at any moment, reserved holds the pool's peak minus
    # what that stream's tensors use then.
    ag_pool = rs_pool = init_pool = 0
    replayed = "first forward"
    if f.fsdp:
        ag_pool = _all_gather_pool(job, e)
        rs_pool = max((block_grad + block_stored) * e, full_grads.bytes)
        if f.rs_input_on_rs_stream:
            rs_pool = full_grads.bytes + _rs_input_segments(block_stored, n_stored - L * block_stored,
                                                            grad_bytes, param_shards)
    if f.fsdp_version == 1:
        # The unshard stream's pool holds the root, the block in use and the block freed just before
        # it, whose block is reusable only once the compute stream has passed record_stream's event
        # (limit_all_gathers waits on the free before last, not the last): the gathered weights live
        # inside this pool, not beside it. Sharded gradients are reduce-scatter outputs of the
        # post-backward stream.
        ag_pool = int(_root_stored_bytes(job, e) + min(2, L) * _layer_stored_bytes(job, e))
        rs_pool = grads_all if offload == "all" else full_grads.bytes
        # fsdp1._block walks a Llama block's q/k/v_proj attention, not DeepSeek's latent attention.
        if (replay and f.stack.fsdp_init_on_device and offload in ("none", "all") and shape.arch == "llama"
                and not shape.mla and step_replay.blocks_replayable(job)
                and f.loss in ("fp32-logits-kept", "fp32-upcast-shifted", "fp32-upcast")):
            # Replay the wrap and two whole steps (forward, loss, each block's recompute and backward, with
            # FSDP1's kept inputs where it keeps them) through the caching allocator's rules: the default
            # stream's large pool never shrinks. Where the optimizer's first step makes large states on the
            # GPU (a full fine-tune), they fill the freed activation blocks between the two steps. MoE blocks
            # are walked as on one GPU, a loop's experts routed as there (step_replay.block_routing).
            units = _fsdp1_units(job, e)
            step = _fsdp1_first_step(job, units, e, param_shards, state_bytes) if not f.lora and offload == "none" \
                else ((), ())
            # A full fine-tune's weight gradients and flat gradients (step_replay.backward_events).
            trained = bf.weights_trainable
            block = step_replay.backward_replay(bf_main, f.reentrant, trained) if f.ac_policy == "block" else None
            vocab_grad = shape.vocab * shape.hidden * e  # the head's weight gradient, and the embedding's
            unit_grad, root_grads = ((sum(units[0][0]), (vocab_grad, vocab_grad, sum(units[-1][0]))) if trained
                                     else (0, (0, 0, 0)))
            moe = None
            if shape.moe:
                routing = step_replay.block_routing(job, bf_main)
                moe = (bf_main, step_replay.backward_experts(bf_main, f.reentrant, trained) if block and routing else (),
                       routing)
            if block:
                replayed = "first two steps" + (" and the optimizer step between them" if step[0] else "")
            elif step[0]:
                replayed = "first step's forward, optimizer step and the second forward"
            _, init_pool = fsdp1.step_reserved(units, param_shards, shape, T, e,
                                               f.lora_targets, t.base_quant == "nf4", 4 if f.loss_upcast else e,
                                               offload=offload == "all", flash=t.attention == "flash-attn",
                                               loss=step_replay.head_loss(f), load=_quantized_load_order(job),
                                               buffers_share_dtype=f.rope_cache_bytes == e,
                                               shift_copy=A.shifted_copy_bytes(job) > 0, step=step,
                                               block=block,
                                               kept=f.fsdp1_keeps_block_inputs, batch=t.micro_batch,
                                               norm_trains=trained, unit_grad=unit_grad,
                                               root_grads=root_grads,
                                               around_unit=f.fsdp1_checkpoint_around_unit, moe=moe,
                                               load_root=f.quantized_load_16bit_on_gpu, softcap=f.logit_softcap > 0)
    # FSDP1 makes the shard it all-gathers inside `with stream(pre_unshard_stream)` (_runtime_utils.py
    # _unshard -> FlatParamHandle.pre_unshard) when it is not the resident one: CPU offload copies it to
    # the GPU (flat_param_to(device)), mixed precision casts an fp32 shard to the compute dtype
    # (_use_low_precision_shard allocates _mp_shard). Either is record_stream()ed to the unshard stream
    # and freed once gathered (_all_gather_flat_param; post_unshard _free_low_precision_sharded_param).
    # That stream's pool holds the root's shard (gathered first, never resharded after forward), which
    # every smaller block shard then reuses; a block shard larger than the root's needs its own segment.
    pre_unshard_pool = 0
    cast_shard = f.fsdp_param_cast and param_bytes != e
    if f.fsdp_version == 1 and (offload == "all" or cast_shard):
        root_shard = _round_segment(_root_stored_bytes(job, e) / param_shards)
        block_shard = _round_segment(_layer_stored_bytes(job, e) / param_shards)
        pre_unshard_pool = root_shard + (block_shard if block_shard > root_shard else 0)
    # FSDP1 shards each unit's flat parameter: a LoRA unit's shard, its AdamW states and the step's
    # temporaries are tensors of the shard's size; those of <= 1 MiB live in the small pool.
    small_static = small_step = 0
    if f.fsdp_version == 1 and lora_units and n_trainable:
        small = [g for g in trainable if -(-g.numel // param_shards) * resident_bytes <= MIB]
        share = sum(g.total for g in small) / n_trainable
        small_static = int(share * (n_trainable * resident_bytes // param_shards + optimizer.bytes))
        small_step = int(share * step_temp.bytes)
    if f.fsdp_version == 1:
        # bitsandbytes' absmax tensors and the rotary buffers of <= 1 MiB are small-pool blocks too.
        small_static += _small_state_bytes(job)
    # Reserved but empty at the loss: segments too small for any logits tensor. A checkpointed block's
    # first forward runs under no_grad, so its temporaries are freed, and their blocks are smaller than
    # the loss's (best fit cannot hand a block to a bigger request); likewise the loss's own hole.
    # (The loss's own hole is loss_hole above.)
    holes_pt = 0.0
    if f.ac_policy == "block" and f.loss not in ("chunked", "fused", "liger"):
        holes_pt = A.block_forward_transient_per_token(bf_main)
    holes = Part("overhead", "freed blocks too small for the logits (cached, empty)", int(holes_pt * T),
                 f"{holes_pt:,.0f} B per token: the checkpointed blocks' no-grad temporaries", where="pool")

    def phase(name: str, parts: list[Part]) -> list[Part]:
        tensors = [p for p in parts if p.bytes or p.term == "params"]
        sizes = _allocation_sizes(job, name, tensors, stored, head, T, shard_groups, weight_tensors)
        rounding = Part("overhead", "allocator rounding", _rounding(sizes),
                        "each block rounded to 512 B, allocations over 10 MiB to 2 MiB segments", where="pool")
        held = []
        if f.fsdp_version == 1 and init_pool:
            # The replay already holds the loss's hole and the blocks' temporaries.
            tensors = [p for p in tensors if not p.label.startswith("freed logits' slot")]
        if f.fsdp_version == 1:
            gathered = sum(p.bytes for p in tensors if p.label.startswith("unsharded weights"))
            sharded_grads = sum(p.bytes for p in tensors if _reduce_scattered(p))
            # Tensors of 1 MiB or less live in the small pool, which the wrap's large segments cannot serve.
            small = small_static + (small_step if step_temp in tensors else 0)
            default_stream = tensor_bytes(tensors) - gathered - sharded_grads - small
            at_loss = [holes] if name == "forward-end" and holes.bytes and not init_pool else []
            init_left = max(0, init_pool - default_stream - sum(p.bytes for p in at_loss))
            held = at_loss + [
                Part("overhead", "FSDP1 pre-unshard stream pool (cached)", pre_unshard_pool,
                     "the root's shard as all-gathered (copied from the host, or cast to the compute dtype); "
                     "block shards reuse its block", where="pool"),
                Part("overhead", "FSDP1 unshard-stream pool (cached)", max(0, ag_pool - gathered),
                     "the root and two blocks' flat parameters; the gathered weights above live in it", where="pool"),
                Part("overhead", "FSDP1 post-backward stream pool (cached)", max(0, rs_pool - sharded_grads),
                     "every sharded gradient is a reduce-scatter output of that stream", where="pool"),
                Part("overhead", f"default-stream segments of the wrap and the {replayed} (cached)", init_left,
                     f"replaying FSDP1's wrap and the {replayed} through the allocator's rules "
                     f"reserves {init_pool:,} B (checks/fsdp1.py); what this moment's tensors do not fill",
                     where="pool"),
                Part("overhead", "small-pool segments of the optimizer step (cached)",
                     0 if step_temp in tensors else small_step,
                     "the step's temporaries of LoRA shards are under 1 MiB each: small-pool segments, "
                     "kept from the first step on", where="pool")]
            held = [p for p in held if p.bytes]
        elif f.fsdp:
            sharded_grads = sum(p.bytes for p in tensors if _reduce_scattered(p) and p.label not in RS_INPUTS)
            if f.rs_input_on_rs_stream:
                # The block's reduce-scatter input counted among the tensors lives in that stream's pool.
                sharded_grads += sum(block_stored * e for p in tensors if p.label.endswith("+ reduce-scatter input"))
                sharded_grads += sum(p.bytes for p in tensors if p.label in RS_INPUTS)
            # The all-gather lands in flat output buffers that copy-out then splits into the unsharded
            # parameters (foreach_all_gather_copy_out): the cached flat buffers come on top of them.
            held = [Part("overhead", "FSDP all-gather stream pool (cached)", ag_pool,
                         "the copy-in stream's segments: the root module's flat input and output, then the "
                         "first block's input (in the root input's freed segment) and output",
                         where="pool"),
                    Part("overhead", "FSDP reduce-scatter stream pool (cached)", max(0, rs_pool - sharded_grads),
                         "every sharded gradient is a reduce-scatter output, held by that stream"
                         + ("; before torch 2.5 also the fp32 inputs: one block's segment and the root's"
                            if f.rs_input_on_rs_stream else ""), where="pool")]
            held = [p for p in held if p.bytes]
        if f.fsdp_version != 1 and name == "forward-end" and holes.bytes:
            held = held + [holes]
        return tensors + held + ([rounding] if rounding.bytes else []) + device_only

    def window(moments: list[list[Part]]) -> list[Part]:
        """A phase's parts from its moments: the one with the most tensor bytes (allocated); and since the
        caching allocator releases no segment, the phase reserves the most any of its moments does."""
        best = max(moments, key=tensor_bytes)
        gap = max(map(reserved_bytes, moments)) - reserved_bytes(best)
        return best + ([Part("overhead", "segments another moment of this phase reserves (cached)", gap,
                             "the caching allocator keeps every segment until empty_cache()", where="pool")]
                       if gap > 0 else [])

    def cache(label_bytes: int, moment: str) -> list[Part]:
        """The autocast casts alive at a moment, peft's rebuilt expert banks (_bank_folds) and DeepSeek's fp32 router
        weights (_router_casts)."""
        fold = [Part("params", FOLDED_BANKS, folds[moment], FOLDED_NOTE, transient=True)] if folds.get(moment) else []
        fold += ([Part("params", ROUTER_CASTS, router_casts[moment], ROUTER_NOTE, transient=True)]
                 if router_casts.get(moment) else [])
        return ([Part("params", "autocast weight cache", label_bytes, cache_note, transient=True)]
                if label_bytes else []) + fold

    static = [params_resident] + quant_state + rope_caches + [optimizer] + paged_part + master
    fwd_grads = [unsynced] if no_sync else [full_grads] if grads_persist else []
    handoff = None
    if f.fsdp_version == 1 and c.sharding == "zero3" and lora_units and L > 1 and not f.fsdp1_keeps_block_inputs:
        # FSDP1 registers a block's pre-backward hook (which gathers it) on its output in post-forward,
        # before the next block's pre-forward registers its reshard-only hook on that same tensor as its
        # input (_register_post_backward_reshard_only_hook): tensor hooks run in that order, so when the
        # gradient reaches it the block is gathered while the next one is still gathered, with only that
        # gradient left of the next block's backward. Not under a reentrant checkpoint around the unit
        # (fsdp1_keeps_block_inputs): both hooks are then registered in backward's recompute, the reshard-only
        # one on the recompute's leaf copy of the input, which is not the tensor the previous block's
        # recompute later outputs; each block is resharded when its own input's gradient exists, before
        # CheckpointFunction.backward returns and the previous block's recompute gathers that one.
        both = Part("params", "unsharded weights being used", int(2 * _layer_stored_bytes(job, e) + root),
                    "the block being gathered for backward and the one just backpropagated, plus the root",
                    transient=True)
        grad_in = Part("activations", "gradient of the block's input", T * shape.hidden * bf.stream,
                       f"{shape.hidden} x {bf.stream} B per token x {T:,}", transient=True)
        candidate = phase("backward", static + [both] + fwd_params[1:] + cache(cache_bwd, "bwd") + start_grads
                          + kept_logits + [block_activations, grad_in])
        in_block = phase("backward", static + fwd_params + cache(cache_bwd, "bwd") + start_grads + kept_logits
                         + [block_activations, in_backward])
        handoff = candidate if tensor_bytes(candidate) > tensor_bytes(in_block) else None
    # Where the loop computes the loss after the model's forward returns (Stack.loss_after_forward: litgpt's
    # `logits = model(...)`, then chunked_cross_entropy), the previous step's outputs are released when that
    # assignment rebinds them: they meet the forward's moments (the last block's, its returning logits) but
    # not the loss's or backward's.
    at_loss_previous = [] if f.stack.loss_after_forward else previous
    # forward-end is the largest of the moments before backward reaches the blocks (the first listed wins
    # a tie): the loss's forward and backward, and those below.
    # The loss's forward runs inside the autocast region, beside its whole weight cache; its backward
    # after the region has ended, beside only the casts autograd saved (cache_head_bwd), and leaves the
    # allocator's hole. (Liger's loss makes its gradients in forward: one moment.)
    at_the_loss = static + ([at_loss] + fwd_params[1:] if f.fsdp else fwd_params) + fwd_grads
    forward_ends = [phase("forward-end", at_the_loss + cache(cache_fwd, "fwd") + [activations, loss] + at_loss_previous
                          + (loss_hole if lg else []))]
    if previous and f.stack.loss_after_forward and not lg:
        # The forward returning: its logits, and where the loop's wrapper casts them (f.logits_fp32) the fp32
        # copies made beside the 16-bit ones (Fabric's convert_output), with the previous step's still bound.
        per = e + (4 if f.logits_fp32 else 0)
        returning = Part("loss", "the forward's logits as it returns" + (", cast to fp32" if f.logits_fp32 else ""),
                         int(per * logits), f"{per:g} B x {logits:,}", transient=True)
        forward_ends.append(phase("forward-end", at_the_loss + cache(cache_fwd, "fwd") + [activations, returning]
                                  + previous))
    if not lg:
        # The casts freed when autocast's region ended stay cached in segments of a weight's size, which
        # none of the loss's logits-sized gradients fits (best fit: a block at least as big).
        freed_casts = cache_fwd - cache_head_bwd
        biggest_cast = max([g.numel for g in trainable if g.linear] + [0]) * e
        unusable = [Part("overhead", "autocast casts freed at the region's end (cached)", freed_casts,
                         "weight-sized blocks, smaller than the loss's 4 B gradients", where="pool")] \
            if freed_casts and 4 * logits > biggest_cast else []
        forward_ends.append(phase("forward-end", at_the_loss + cache(cache_head_bwd, "head_bwd") + [activations, loss_bwd]
                                  + at_loss_previous + loss_hole + unusable))
    # The blocks' casts saved in forward, once the head's matmul node has released its own (none yet
    # when checkpointed: no recompute has run).
    blocks_cast = cache_bwd if f.ac_policy == "none" else 0
    # The head's backward, right after the loss's. Its matmul node makes the weight's gradient in compute
    # dtype beside the logits' gradient (what the loss backward leaves) and its own saved tensors, the
    # head's cast among them; then it releases those (engine.cpp: the node's inputs and
    # release_variables()), and ToCopyBackward casts that gradient to fp32 for .grad. Every saved
    # activation of the blocks is still there.
    if head_accum is not None and not f.fsdp and f.loss not in ("liger", "fused"):  # no logits' gradient there
        logits_grad = Part("loss", "the logits' gradient", int(e * shape.vocab * T),
                           f"{e} B x vocab {shape.vocab:,} x {T:,} tokens", transient=True)
        head_mm = Part("grads", "the head's weight gradient being made", shape.vocab * shape.hidden * e,
                       f"vocab x hidden x {e} B", transient=True)
        forward_ends.append(phase("forward-end", static + fwd_params + cache(cache_head_bwd, "head_bwd")
                                  + fwd_grads + kept_logits
                                  + [activations, logits_grad, head_mm] + at_loss_previous))
        forward_ends.append(phase("forward-end", static + fwd_params + cache(blocks_cast, "blocks")
                                  + fwd_grads + kept_logits
                                  + [block_activations, head_accum] + at_loss_previous))
    # Cut Cross-Entropy's backward (cut_cross_entropy/cce_backward.py cce_backward_kernel) recomputes the
    # logits block by block on chip: de = zeros_like(e) and, when the head trains, dc = zeros_like(c), in
    # the dtypes of the casts cce.py saved (the autocast dtype), then dc.to(the weight's dtype) beside them.
    head_trains = not lora
    if f.loss == "fused":
        ce = e if f.autocast else bf.stream
        dc = shape.vocab * shape.hidden * ce if head_trains else 0
        dc_cast = shape.vocab * shape.hidden * grad_bytes if head_trains and grad_bytes != ce else 0
        cce_bwd = Part("loss", "the loss's backward (Cut Cross-Entropy)", T * shape.hidden * ce + dc + dc_cast,
                       f"{T:,} tokens x hidden x {ce} B (input gradient)"
                       + (f" + vocab x hidden x {ce} B (head gradient)" if dc else "")
                       + (f" + its cast to {grad_bytes} B" if dc_cast else ""), transient=True)
        forward_ends.append(phase("forward-end", static + fwd_params + cache(cache_head_bwd, "head_bwd")
                                  + fwd_grads + kept_logits
                                  + [activations, cce_bwd] + at_loss_previous))
    # With Liger's loss the gradient of the head's input is made in forward (with Cut Cross-Entropy's, in
    # the loss's backward); the final norm's backward then runs beside every saved activation (the head's
    # weight gradient, once handed to AccumulateGrad, is the new .grad, or is summed into the one
    # gradient accumulation keeps, and freed).
    if lg or f.loss == "fused":
        norm_bwd = Part("activations", "the final norm's backward", int(A.final_norm_backward_per_token(bf) * T),
                        "its gradient intermediates and the gradient of the head's input, per token "
                        f"x {T:,}", transient=True)
        head_grad = lg.head_weight_grad if lg else shape.vocab * shape.hidden * grad_bytes * head_trains
        new_head_grad = [Part("grads", "the head's weight gradient", head_grad,
                              "made by the fused loss, now the head's .grad", transient=True)] \
            if head_grad and not grads_persist else []
        forward_ends.append(phase("forward-end", static + fwd_params + cache(blocks_cast, "blocks")
                                  + fwd_grads + new_head_grad
                                  + [activations, norm_bwd] + at_loss_previous))
    # The last block's own forward holds more than the loss spike when the loss is small (fused or
    # chunked): the other blocks' saved activations beside that block's forward peak, its input included
    # (activations.forward_peak_per_token; a checkpointed block's first forward keeps nothing of its own).
    if f.ac_policy in ("none", "block") and not f.fsdp:
        block_pt = max(A.forward_peak_per_token(kbf, m, keep_saved=f.ac_policy == "none") for kbf, m, _ in kinds)
        last_block = Part("activations", "the last block's forward",
                          int(((L - 1) * stored_pt + block_pt + mask_pt) * T),
                          f"{L - 1} blocks x {stored_pt:,.0f} B + that block's peak {block_pt:,.0f} B"
                          + (f" + attention mask {mask_pt:,.0f} B" if mask_pt else "") + f", per token x {T:,}",
                          transient=True)
        forward_ends.append(phase("forward-end", static + fwd_params + cache(cache_fwd, "last") + fwd_grads
                                  + [last_block] + previous))
    # backward-end is the largest of the moments after backward leaves the last block: the first block's
    # backward, and the two below.
    # FSDP1 keeps each block's input and its gradient once that block's backward is done
    # (JobFacts.fsdp1_keeps_block_inputs): at the first block's backward, the other L - 1 blocks' inputs,
    # and the gradients of all but the second block's, which is the first block's output gradient, already
    # counted in its backward.
    kept_inputs = [Part("activations", KEPT_INPUTS,
                        (2 * L - 3) * T * shape.hidden * bf.stream,
                        f"({L - 1} inputs + {L - 2} gradients) x {shape.hidden} x {bf.stream} B per token x {T:,}",
                        transient=True)] if f.fsdp1_keeps_block_inputs and L > 1 else []
    backward_ends = [phase("backward-end", static + ([end_params] if end_params else fwd_params[:1])
                           + cache(cache_end, "end") + end_grads + kept_logits + [first_block, in_backward] + kept_inputs)]
    # The input embedding's backward, the last node: embedding_dense_backward makes a dense vocab x hidden
    # gradient beside every other, which becomes the .grad or is summed into the one accumulation keeps
    # (AccumulateGrad). A tied head's gradient waits in the weight's input buffer, and the engine adds the
    # two in place only into a tensor it can steal (input_buffer.cpp accumulate, can_accumulate_inplace):
    # under autocast the head's is ToCopyBackward's fresh fp32 tensor; otherwise it is the linear's
    # weight gradient, which it cannot steal, so `old_var + var` makes a third (measured on torch 2.13
    # with profile_memory: aten::add allocates vocab x hidden, aten::add_ under autocast nothing).
    # Under FSDP2 the root is still gathered then and its gradients unsharded.
    if not lora and shape.vocab:
        emb_bytes = e if f.fsdp_version in (1, 2) else grad_bytes
        emb_grad = shape.vocab * shape.hidden * emb_bytes
        emb_parts = [Part("grads", EMBEDDING_GRAD, emb_grad,
                          f"vocab x hidden x {emb_bytes} B (embedding_dense_backward)", transient=True),
                     Part("activations", "gradient of the embedding's output", T * shape.hidden * bf.stream,
                          f"{shape.hidden} x {bf.stream} B per token x {T:,}", transient=True)]
        if shape.tie_embeddings and not f.autocast:
            emb_parts.append(Part("grads", "the tied weight's two gradients, summed out of place", emb_grad,
                                  "the head's is not stealable: old_var + var", transient=True))
        if fsdp2:
            # The last reduce-scatter's input stays referenced until the next module's post-backward
            # (_fsdp_param_group.py post_backward: reduce_scatter_states, reduce_scatter_max_input_buffers 1).
            grads_now = blocks_all + root_early + [
                Part("params", "unsharded weights being used", int(_root_stored_bytes(job, e)),
                     "the root module, as gathered", transient=True),
                Part("grads", BLOCK_RS_INPUT, block_stored * grad_bytes, f"{block_stored:,} x {grad_bytes} B",
                     transient=True)]
        elif fsdp1_root and not grads_persist:
            grads_now = blocks_all + root_early  # every block's gradient reduce-scattered by then
        else:
            grads_now = [g for g in end_grads if g.label != "weight gradient being accumulated"]
        backward_ends.append(phase("backward-end", static + grads_now + kept_logits + emb_parts + mask_held))
        if fsdp1_root:
            # split_with_sizes_backward concatenates the root's weight gradients into its flat gradient while
            # they are alive (the embedding's, the head's, the final norm's).
            root_flat = Part("grads", "unsharded root flat gradient (its weights' gradients concatenated)",
                             root_trainable * e, f"{root_trainable:,} x {e} B", transient=True)
            backward_ends.append(phase("backward-end", static + grads_now + kept_logits + emb_parts[:1]
                                       + emb_parts[2:] + [root_flat] + mask_held))
    # FSDP2's root post-backward, when backward ends: the root resharded, its unsharded gradients copied
    # into the reduce-scatter input, in the reduce dtype (fp32 under mixed precision), and freed only
    # after that copy (_fsdp_collectives.py foreach_reduce: foreach_reduce_scatter_copy_in, then
    # unsharded_grads.clear()); every block's gradients are sharded by then.
    if fsdp2 and root_trainable:
        backward_ends.append(phase("backward-end", static + blocks_all + kept_logits + mask_held + [
            Part("grads", "unsharded root gradients", root_trainable * e, f"{root_trainable:,} x {e} B",
                 transient=True),
            Part("grads", ROOT_RS_INPUT, root_stored * grad_bytes,
                 f"{root_stored:,} x {grad_bytes} B (the reduce dtype)", transient=True)]))
    phases = {
        "forward-end": window(forward_ends),
        "backward": phase("backward", static + fwd_params + cache(cache_bwd, "bwd") + start_grads + kept_logits
                          + [block_activations, in_backward]),
        **({"backward": handoff} if handoff else {}),
        "backward-end": window(backward_ends),
        "step": phase("step", static + [full_grads, step_temp]),
    }
    replayed = step_replay.segments(job, device) if replay else None
    if replayed:
        # The step's activation and loss segments, replayed through the allocator's rules
        # (checks/step_replay.py), replace the closed-form pool terms: at each moment, reserved holds those
        # segments less what the moment's activations and loss fill of them.
        act_reserved = replayed.reserved
        for name, parts in phases.items():
            kept = [p for p in parts if p.where != "pool"]
            filled = sum(p.bytes for p in kept if p.where == "tensor" and p.term in ("activations", "loss"))
            phases[name] = kept + [Part(
                "overhead", "segments the step's activations and loss leave (cached)", max(0, act_reserved - filled),
                f"two steps replayed through the caching allocator's rules reserve {act_reserved:,} B for them "
                + ("(each MoE block's experts routed unevenly: step_replay.routed_tokens) " if bf.expert_loop else "")
                + "(checks/step_replay.py); what this moment's activations do not fill", where="pool")]
    peak = max(phases, key=lambda name: total_bytes(phases[name]))

    # ---- host RAM for offload -------------------------------------------------------------------
    host = 0
    if offload != "none":
        # Optimizer states, fp32 gradients, and the weights the CPU step updates (ZeRO-Offload).
        per_param = opt_total * optim_shards / max(n_stored, 1) + 4 + param_bytes
        per_rank = n_stored * per_param / optim_shards
        if offload == "all":
            per_rank += _frozen_bytes(job, stored=True) / param_shards  # the frozen base, once, on the host
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


def _reduce_scattered(p: Part) -> bool:
    """A gradient FSDP has reduce-scattered (a sharded .grad, made on its reduce-scatter stream), not one on the
    default stream: unsharded ones and the input embedding's, being made."""
    return p.term == "grads" and not p.label.startswith("unsharded") and p.label != EMBEDDING_GRAD


def _round_segment(size: float) -> int:
    """The cudaMalloc size of a request no cached block serves: 512 B rounding, then a 2 MiB (<= 1 MiB),
    20 MiB (< 10 MiB) or 2 MiB-rounded segment (c10/cuda/CUDACachingAllocator.cpp get_allocation_size)."""
    return segment_size(round_size(int(size)))


def _embedding_only(job: JobConfig) -> int:
    """The input embedding's gradient is produced last (embedding backward), unless tied to the head."""
    s = job.shape
    return 0 if s.tie_embeddings else s.vocab * s.hidden


def _packed_bytes(job: JobConfig) -> float:
    """Bytes per weight of a quantized base's data alone: 4 bits, or LLM.int8's int8."""
    return 0.5 if job.train.base_quant == "nf4" else 1.0


def _stored_per_value(job: JobConfig, g: ParamGroup, e: int) -> float:
    """Bytes per value of a parameter as FSDP gathers it: the compute dtype for trainable or 16-bit
    frozen weights, the quantized storage for a QLoRA base (gathered packed, dequantized per matmul;
    bitsandbytes' quantization state is not a parameter and is not gathered)."""
    t = job.train
    if t.lora_rank and t.base_quant != "none" and g.linear and g.per_layer and not g.bank:
        # Only the packed 4-bit parameter is gathered; its QuantState stays on the module.
        return 0.5 if t.base_quant == "nf4" else 1 + 4 / g.rows
    return e


def _fsdp1_first_step(job: JobConfig, units, e: int, world: int, state_bytes: int) -> tuple[tuple, tuple]:
    """Byte sizes of the first optimizer step's states, in the order torch.optim makes them, and of its
    temporaries, on rank 0's shard of a fully trained FSDP1 model (fsdp1.first_step): each parameter's
    piece (fsdp1.shard_pieces) gets the optimizer's states (optimizer_bytes: AdamW exp_avg and exp_avg_sq;
    bitsandbytes' 8-bit ones a byte each, its Lion one fp32; paged states live in managed memory, outside
    the allocator), and the temporaries are those _step_transient prices, tensor by tensor."""
    opt, impl = job.train.optimizer, job.facts.optimizer_impl
    pieces = fsdp1.shard_pieces(tuple(units), world, e)
    per_value = {"adamw": (state_bytes, state_bytes), "sgd": (state_bytes,), "adamw8bit": (1, 1), "lion": (4,),
                 "lion8bit": (1,)}.get(opt, ())
    states = tuple(n * b for n in pieces for b in per_value)
    if opt in TORCHAO_OPTIMIZERS:
        # use_orig_params hands torchao each piece as a plain tensor: quantized only if it passes its test.
        low_bit = TORCHAO_OPTIMIZERS[opt]
        states = tuple(b for n in pieces for _ in range(2)
                       for b in low_bit.state_tensors(n, state_bytes, job.facts.torchao_block))
    if (opt == "adamw" and impl == "foreach") or (opt == "sgd" and job.train.weight_decay and impl != "fused"):
        temps = tuple(n * state_bytes for n in pieces)
    elif opt == "adamw" and impl == "for-loop":
        temps = (max(pieces, default=0) * state_bytes,) * 2
    else:
        temps = ()
    return states, temps


def _fsdp1_units(job: JobConfig, e: int) -> list[tuple[list[int], list[int]]]:
    """FSDP1 units in wrap order with their parameters' and buffers' byte sizes: per block, each LoRA
    linear's lora_A and lora_B (when they are units of their own), then the block's other parameters
    and its rotary buffers (inv_freq, cos, sin, in registration order); the root (embedding, final
    norm, head) last (torch/distributed/fsdp/wrap.py _recursive_wrap wraps children before their
    parent)."""
    s, r = job.shape, job.train.lora_rank
    adapter = job.facts.adapter_bytes or e
    block: list[int] = []
    lora: list[int] = []
    for g in s.param_groups():
        if not g.per_layer:
            continue
        per = g.count // s.layers
        if g.linear and not g.bank and job.train.base_quant != "none" and r:
            size = int(g.rows * g.cols * _packed_bytes(job))
        else:
            size = g.rows * g.cols * e
        block += [size] * per
        if r and job.facts.stack.lora_units and g.linear and targeted(g.name, job.facts.lora_targets):
            lora += [g.rows * r * adapter, r * g.cols * adapter] * per
    rb = job.facts.rope_cache_bytes
    buffers = [s.d_head // 2 * rb] + [s.rope_positions * s.d_head * rb] * 2 if _rope_cache_bytes(job) else []
    units = ([([n], []) for n in lora] + [(block, buffers)]) * s.layers
    root = [g.rows * g.cols * e for g in s.param_groups()
            if not g.per_layer]
    return units + [(root, [])]


def _rope_cache_bytes(job: JobConfig) -> int:
    """The rotary cos/sin buffers of every layer (JobFacts.rope_cache_bytes): transformers 4.39
    LlamaRotaryEmbedding.__init__ registers `_cos_cached` and `_sin_cached` of (max_position_embeddings,
    head_dim) per attention layer (modeling_llama.py l.104-113), MistralRotaryEmbedding `cos_cached`
    and `sin_cached` (modeling_mistral.py l.104-116); the releases that do are in
    stacks.transformers_facts."""
    s = job.shape
    return s.layers * 2 * s.rope_positions * s.d_head * job.facts.rope_cache_bytes


def _small_state_bytes(job: JobConfig) -> int:
    """Bytes of the static non-parameter tensors that the caching allocator serves from its small pool
    (<= 1 MiB each): bitsandbytes' absmax (uint8 per 64 weights) and nested absmax (fp32 per 256 of
    those) per quantized weight, and the rotary cos/sin buffers."""
    small = 0
    for g, _, quantized in _frozen_storage(job):
        if quantized and job.train.base_quant == "nf4":
            per_tensor = [g.numel // 64, -(-g.numel // (64 * 256)) * 4]
            small += g.count * sum(n for n in per_tensor if n <= MIB)
    s, rb = job.shape, job.facts.rope_cache_bytes
    if rb and s.rope_positions * s.d_head * rb <= MIB:
        small += _rope_cache_bytes(job)
    return small


def _quantized_load_order(job: JobConfig) -> tuple[int, ...]:
    """The 4-bit weights' element counts in checkpoint order when the stack quantizes them on the GPU
    while loading (empty otherwise): block by block, each block's keys sorted as safetensors stores them
    (mlp.down/gate/up_proj, then self_attn.k/o/q/v_proj; a MoE block's under its MoE module, each routed
    expert's as `experts.{i}.` with i sorted as text, e.g. Mixtral's block_sparse_moe.experts.0.w1 ...
    block_sparse_moe.gate, then self_attn.*)."""
    if not (job.facts.stack.quantized_load_on_gpu and job.train.base_quant == "nf4" and job.train.lora_rank):
        return ()
    s = job.shape
    # Every block alike: all dense or all MoE (the FSDP1 replay's scope, step_replay.blocks_replayable), not
    # DeepSeek's dense first blocks.
    attention = {g.name for g in s.attention_groups()}
    mlp = s.moe_module + "." if s.moe else "mlp."
    keys = []
    for g in s.linear_groups():
        if g.expert:  # one group entry per kind of expert weight, named experts.<name>
            keys += [(f"{mlp}experts.{i}.{g.name.removeprefix('experts.')}", g.rows * g.cols)
                     for i in range(s.moe.experts)]
        elif g.count == s.layers:
            keys.append((("self_attn." if g.name in attention else mlp) + g.name, g.rows * g.cols))
    return tuple(n for _, n in sorted(keys)) * s.layers


def _layer_stored_bytes(job: JobConfig, e: int) -> float:
    """A block's weights as FSDP gathers them (FSDP2: padded to whole rows of dim 0, fsdp2_stored)."""
    s = job.shape
    base = sum(g.total * _stored_per_value(job, g, e) for g in fsdp2_stored(job, s.param_groups()) if g.per_layer)
    adapters = sum(g.total for g in fsdp2_stored(job, trainable_groups(job)) if g.per_layer) * e \
        if job.train.lora_rank else 0
    return (base + adapters) / s.layers


def _root_stored_bytes(job: JobConfig, e: int) -> float:
    """The root module's weights (embeddings, final norm, head) as FSDP gathers them."""
    return sum(g.total * _stored_per_value(job, g, e) for g in fsdp2_stored(job, job.shape.param_groups())
               if not g.per_layer)


def _rs_input_segments(block_params: int, root_params: int, reduce_bytes: int, world: int) -> int:
    """Bytes the reduce-scatter stream's pool caches for FSDP2's inputs before torch 2.5, on top of the
    sharded gradients (the outputs). foreach_reduce (torch 2.4 _fsdp_collectives.py) allocates, inside
    `with torch.cuda.stream(reduce_scatter_stream)`, the flat input (unsharded numel in reduce_dtype),
    then the output (input / world) while the input lives, and frees the input on return. Caching
    allocator rules (best fit per stream, a free block split only from its start, segments never
    released): each block's input reuses the previous block's freed segment, so every block output gets
    a segment of its own; the root module reduce-scatters last (its post-backward runs at the end of
    backward) and its input, bigger than a block's, takes a new segment; its output then fits in the
    freed block-input segment when it is no bigger. The peak stays reserved from the first step on."""
    block_in, root_in = block_params * reduce_bytes, root_params * reduce_bytes
    if root_in <= block_in:
        return block_in  # the root's input splits the block-input segment; its output is a new one
    root_out = root_in // world
    return block_in + root_in - (root_out if root_out <= block_in else 0)


def _all_gather_pool(job: JobConfig, e: int) -> int:
    """High-water of FSDP2's all-gather copy-in stream pool (torch/distributed/fsdp/_fully_shard, torch
    2.13): foreach_all_gather allocates, inside `with stream(all_gather_copy_in_stream)`, the flat
    copy-in input (_get_param_all_gather_inputs: one torch.empty of the rank's shard in param_dtype, made
    when the MixedPrecisionPolicy casts fp32 shards - _fsdp_param.py init_dtype_attrs clamps param_dtype
    to None when it equals the stored dtype - or when shards come from the host) and then the
    flat output of world x shard (all_gather_copy_in: the input is a narrow() view of the output), and
    drops the input at `del param_all_gather_inputs`. In forward, wait_for_unshard keeps the previous
    group's result in comm_ctx.all_gather_state and frees it only after the next group's all-gather
    (_fsdp_param_group.py wait_for_unshard, "Defer free to allow for overlap"): the root module's
    output is still held while the first block's input and output are allocated."""
    world = job.cluster.world_size
    root, block = _root_stored_bytes(job, e), _layer_stored_bytes(job, e)
    if job.facts.fsdp_version != 2:
        # FSDP1 flat parameters and DeepSpeed ZeRO-3 gather differently; not derived from their source
        # here: the root module's and two blocks' gathered bytes.
        return int(root + min(2, job.shape.layers) * block)
    cast = job.facts.fsdp_param_cast or job.cluster.offload == "all"
    root_in, block_in = (root / world, block / world) if cast else (0.0, 0.0)
    # Reserved is the pool's segments, not its live peak: the caching allocator never releases a
    # segment, and best fit reuses a freed block only for a request it can hold, split from its start.
    # The root's input and output take the first two segments; the input is freed (del) before block 0's
    # copy-in, which then splits that segment; block 0's output (the root's is still held) goes in what
    # is left of it if it fits, else in a new segment. Later groups fit in these: the root's output is
    # freed in block 0's wait_for_unshard, before block 1's all-gather.
    segments = root_in + root
    left = root_in
    if block_in <= left:
        left -= block_in
    else:
        segments += block_in
        left = 0.0
    if block > left:
        segments += block
    return int(segments)


def _allocation_sizes(job: JobConfig, phase: str, parts: list[Part], stored: dict, head: dict, T: int,
                      trainable: list[ParamGroup], weights: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The live allocations behind a phase's parts, as (bytes, count), for the allocator's rounding."""
    L = job.shape.layers
    sizes: list[tuple[float, int]] = []
    for p in parts:
        if p.where != "tensor" or not p.bytes:
            continue
        if p.label.startswith("saved activations"):
            sizes += [(b * T, L) for b in stored.values()] + [(b * T, 1) for b in head.values()]
        elif p.label.startswith("first block"):
            sizes += [(b * T, 1) for b in stored.values()]
        elif p.term == "params" and not p.transient and job.facts.fsdp_version == 1:
            continue  # flat shards, one per unit: their segments are in the wrap's replay
        elif p.term == "params" and p.label.startswith("weights"):
            # Not the trainable tensors' shapes alone: a LoRA job's frozen base is most of these bytes.
            sizes += weights
        elif p.term in ("params", "grads", "optimizer") and not p.transient and trainable:
            # One allocation per parameter tensor (and per state tensor, per gradient).
            share = p.bytes / max(1, sum(g.total for g in trainable))
            opt = job.train.optimizer
            copies = 2 if p.term == "optimizer" and (opt.startswith("adamw") or opt in TORCHAO_OPTIMIZERS) else 1
            sizes += [(g.numel * share / copies, g.count * copies) for g in trainable]
        else:
            sizes.append((p.bytes, 1))
    return sizes
