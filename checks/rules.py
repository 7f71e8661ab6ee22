"""The preflight checks: each a pure function of the job, the memory estimate and the host facts.

Each returns a CheckResult with an id, a status (pass / warn / fail / skip), a message saying
what was found, and a fix saying what to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from podkit.checks import activations as A
from podkit.checks import ledger, stacks
from podkit.checks.advisor import HEADROOM, Suggestion
from podkit.checks.config import PRECISION, PRECISIONS, JobConfig
from podkit.checks.errors import ConfigError
from podkit.checks.host import HostFacts
from podkit.checks.kernels import attention_kernel, attention_run
from podkit.checks.memory import (GIB, KEPT_INPUTS, MemoryEstimate, nf4_bytes, optimizer_bytes, trainable_groups,
                                  trainable_param_bytes, trainable_params)
from podkit.envsetup import arch

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass(frozen=True)
class CheckResult:
    id: str
    status: str
    message: str
    fix: str = ""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_fit(job: JobConfig, est: MemoryEstimate, suggestions: list[Suggestion]) -> CheckResult:
    # Judged on what the device holds: reserved (what an OOM is about) plus what only the device sees.
    used = (f"{gib(est.total)} of {gib(est.capacity)} on {est.gpu.name} (peak at {est.peak_phase}; "
            f"allocated {gib(est.allocated)}, reserved {gib(est.reserved)})")
    fix = f"e.g. {suggestions[0].describe()}" if suggestions else ""
    if not est.fits:
        why = f"does not fit: {used}"
        if est.tensors_fit:  # say so: such jobs run on some cards, OOM on others, and step slowly
            why += (f"; the live tensors alone ({gib(est.allocated + est.device_only)}) would fit, so it can only "
                    "run by the allocator emptying its cache at every failed cudaMalloc (slow, and fragmentation "
                    "can still OOM it)")
        return CheckResult("memory.fit", FAIL, why, fix or "no lever found: use a larger GPU")
    if est.headroom < HEADROOM:
        return CheckResult("memory.fit", WARN, f"fits with only {est.headroom:.0%} headroom: {used}",
                           fix or "keep batches from growing: fragmentation alone can eat this")
    return CheckResult("memory.fit", PASS, f"fits: {used}, {est.headroom:.0%} headroom")


# Within this, a published peak agrees with the prediction: the ledger's goal (README, "How the prediction compares").
LEDGER_AGREES = 0.03


def ledger_margin(job: JobConfig, est: MemoryEstimate) -> CheckResult:
    """The fit again, at the worst miss the public ledger shows for this kind of job (checks/ledger.py)."""
    if not est.fits:
        return CheckResult("memory.ledger", SKIP, "does not fit even as predicted (memory.fit)")
    miss = ledger.worst(job)
    if miss is None:
        seen = ledger.measured(job)
        also = "; only allocated peaks, which do not bound the device's" if seen else ""
        return CheckResult("memory.ledger", SKIP, f"no published device or reserved peak of a job like this "
                                                  f"({ledger.kind(job)}) in benchmarks/published/{also}")
    if miss.error >= -LEDGER_AGREES:
        return CheckResult("memory.ledger", PASS, f"{miss.cases} published {miss.metric} peak(s) of {miss.kind} jobs "
                                                  f"read within {LEDGER_AGREES:.0%} of podkit's or below them")
    need = est.total * miss.ratio
    said = (f"published peaks of {miss.kind} jobs read up to {miss.above:.0%} above podkit's figure ({miss.metric}, "
            f"{miss.case}, worst of {miss.cases}); at that miss this job holds {gib(need)} of {gib(est.capacity)}")
    if need <= est.capacity:
        return CheckResult("memory.ledger", PASS, f"{said}: it still fits")
    return CheckResult("memory.ledger", WARN, f"{said}: it may not fit",
                       f"leave {miss.above:.0%} of the device total free (e.g. a smaller micro-batch), or prove the "
                       "peak with bin/smoke on the pod before the full run")


def host_ram(job: JobConfig, est: MemoryEstimate) -> CheckResult:
    if job.cluster.offload == "none":
        return CheckResult("memory.host_ram", SKIP, "no CPU offload")
    need = f"offload needs {gib(est.host_needed)} of host RAM per node"
    if not est.host_capacity:
        return CheckResult("memory.host_ram", WARN, f"{need}; host RAM unknown", "set cluster.host_ram_gb")
    if est.host_needed > est.host_capacity:
        return CheckResult("memory.host_ram", FAIL, f"{need}, the node has {gib(est.host_capacity)}",
                           "offload less (offload = 'optimizer'), shard over more nodes, or rent more RAM")
    return CheckResult("memory.host_ram", PASS, f"{need}, the node has {gib(est.host_capacity)}")


def effective_batch(job: JobConfig) -> CheckResult:
    t = job.train
    effective = t.micro_batch * t.grad_accum * job.cluster.world_size
    what = (f"{t.micro_batch} x {t.grad_accum} accum x {job.cluster.world_size} GPUs = {effective} sequences "
            f"({effective * t.seq_len:,} tokens) per optimizer step")
    if t.global_batch and t.global_batch != effective:
        want = t.global_batch / (t.micro_batch * job.cluster.world_size)
        fix = (f"set grad_accum = {int(want)}" if want == int(want) else
               "make global_batch a multiple of micro_batch x GPUs")
        return CheckResult("batch.effective", FAIL, f"{what}, but global_batch = {t.global_batch}", fix)
    return CheckResult("batch.effective", PASS, what)


def context_length(job: JobConfig) -> CheckResult:
    """seq_len against the positions the model has: GPT-2's learned position table has `n_positions` rows, so a
    longer sequence indexes past it (nn.Embedding: IndexError); a RoPE model runs past max_position_embeddings,
    but on positions it never saw in training."""
    shape, seq = job.shape, job.train.seq_len
    if shape.positions and seq > shape.positions:
        return CheckResult("model.context", FAIL, f"seq_len {seq:,} is longer than {shape.name}'s {shape.positions:,} "
                           "learned positions: the position embedding has no row past them",
                           f"set seq_len <= {shape.positions:,}")
    if shape.rope_positions and seq > shape.rope_positions:
        return CheckResult("model.context", WARN, f"seq_len {seq:,} is past {shape.name}'s max_position_embeddings "
                           f"{shape.rope_positions:,}: RoPE runs there, on positions the model was not trained on",
                           f"set seq_len <= {shape.rope_positions:,}, or use the model's long-context variant")
    limit = shape.positions or shape.rope_positions
    return CheckResult("model.context", PASS, f"seq_len {seq:,}" + (f" of {limit:,} positions" if limit else ""))


def precision_gpu(job: JobConfig) -> CheckResult:
    t, gpu, stack = job.train, job.gpu, job.facts.stack
    p = t.precision
    runs = stack.precisions or PRECISIONS
    if p not in runs:
        return CheckResult("precision.gpu", WARN, f"{stack.name} cannot train in {p} (it runs {' or '.join(runs)}): "
                           "the prediction is for a job that stack does not run",
                           f"set precision = {_closest_precision(p, runs, gpu.supports_bf16)!r}")
    if t.dtype == "bf16" and not gpu.supports_bf16:
        instead = "'fp16-mixed' (with loss scaling)" if "fp16-mixed" in runs else "'fp32'"
        return CheckResult("precision.gpu", FAIL,
                           f"{p} needs bf16 support (sm80+), {gpu.name} is sm{gpu.sm}",
                           f"use precision = {instead}, or an Ampere or newer GPU")
    if t.pure_16bit and t.dtype == "fp16":
        return _pure_fp16(job, runs)
    if t.pure_16bit and t.optimizer not in ("adamw8bit", "paged_adamw8bit"):
        fix = ("prefer bf16-mixed unless memory forces pure bf16" if "bf16-mixed" in runs else
               f"{stack.name} has no mixed precision: fp32 keeps fp32 weights, at twice their memory")
        return CheckResult("precision.gpu", WARN, "pure bf16 keeps no fp32 master weights: small updates round away",
                           fix)
    return CheckResult("precision.gpu", PASS, f"{p} on {gpu.name} (sm{gpu.sm})")


# fp16's range (IEEE binary16): the smallest subnormal is 2**-24 (6e-8), the largest finite value 65504.
FP16_TINY, FP16_MAX = "6e-8", "65504"


def _pure_fp16(job: JobConfig, runs: tuple[str, ...]) -> CheckResult:
    """Pure fp16 has fp16's range with no loss scaling (torch's GradScaler refuses fp16 gradients) and no fp32
    masters. torch's AdamW keeps exp_avg_sq in the parameter's dtype (torch/optim/adamw.py), where (1 - beta2) * g^2
    rounds to 0 below fp16's 6e-8 / 2 (a gradient under 7.7e-4 at beta2 = 0.95, podkit's; 5.5e-3 at torch's 0.999):
    its foreach and for-loop kernels then divide by eps = 1e-8, itself 0 in fp16, and step such a weight to inf
    (NaN where g is 0); the fused kernel computes in fp32 but stores the 0, so each update divides by the last
    gradient alone. bitsandbytes' optimizers do their arithmetic in fp32 and keep 8-bit blockwise or fp32 states.
    Measured with torch 2.13: tests/test_rules.py, tests/test_smoke.py."""
    t, f = job.train, job.facts
    if t.optimizer == "adamw" and not f.stack.deepspeed_engine and trainable_param_bytes(job) == 2:
        what = ("its eps (1e-8) is 0 in fp16 too: those weights step to inf" if f.optimizer_impl != "fused"
                else "each update then divides by the last gradient alone, and the loss diverges")
        return CheckResult("precision.gpu", FAIL,
                           f"pure fp16 AdamW ({f.optimizer_impl}) keeps exp_avg_sq in fp16, where (1 - beta2) * g^2 "
                           f"of a gradient under ~1e-3 is 0: {what}",
                           "use optimizer = 'adamw8bit' (bitsandbytes: fp32 arithmetic, 8-bit states)"
                           + (", or precision = 'fp16-mixed' (fp32 masters and a GradScaler)" if "fp16-mixed" in runs
                              else ""))
    better = "fp16-mixed (fp32 masters and a GradScaler)" if "fp16-mixed" in runs else "fp32"
    if job.gpu.supports_bf16 and "bf16-mixed" in runs:
        better += f", or bf16-mixed on this sm{job.gpu.sm} GPU (fp32's exponent range)"
    if f.grad_scaler:  # a GradScaler over fp32 adapters (precision.loss_scaling): only the frozen base is fp16
        return CheckResult("precision.gpu", WARN,
                           f"fp16 base weights and activations: values over {FP16_MAX} overflow to inf (the "
                           "GradScaler guards the fp32 adapters' gradients only)",
                           f"prefer {better} if the loss turns inf/NaN in bin/smoke")
    return CheckResult("precision.gpu", WARN,
                       f"pure fp16 has no loss scaling and no fp32 master weights: gradients under {FP16_TINY} "
                       f"flush to zero, values over {FP16_MAX} overflow to inf, small updates round away",
                       f"prefer {better} unless memory forces pure fp16; watch bin/smoke's loss for inf/NaN")


def _closest_precision(p: str, runs: tuple[str, ...], bf16: bool) -> str:
    """Of the precisions the stack runs and the GPU supports, the one of the same 16-bit type (bf16-mixed ->
    bf16), else the first (fp32 always runs)."""
    usable = [r for r in runs if bf16 or PRECISION[r].dtype != "bf16"] or ["fp32"]
    return next((r for r in usable if PRECISION[r].dtype == PRECISION[p].dtype), usable[0])


def loss_scaling(job: JobConfig) -> CheckResult:
    p, scaler = job.train.precision, job.train.grad_scaler
    if p == "fp16-mixed" and scaler == "off":
        return CheckResult("precision.loss_scaling", FAIL,
                           "fp16 without loss scaling: small gradients underflow to zero",
                           "set grad_scaler = 'auto' (a GradScaler for fp16)")
    if p == "fp16" and scaler == "on":
        if trainable_param_bytes(job) == 2:
            # torch/amp/grad_scaler.py _unscale_grads_(allow_fp16=False): "Attempting to unscale FP16 gradients."
            return CheckResult("precision.loss_scaling", FAIL,
                               "a GradScaler with pure fp16: torch refuses to unscale fp16 gradients "
                               "(\"Attempting to unscale FP16 gradients.\")",
                               "set grad_scaler = 'auto' (none for pure fp16), or precision = 'fp16-mixed'")
        return CheckResult("precision.loss_scaling", PASS, "fp16: GradScaler on the fp32 adapters' gradients")
    if p != "fp16-mixed" and scaler == "on":
        return CheckResult("precision.loss_scaling", WARN,
                           f"a GradScaler with {p} is needless: bf16/fp32 have fp32's exponent range",
                           "set grad_scaler = 'auto'")
    used = ("GradScaler on" if p == "fp16-mixed" else
            "no loss scaling (pure fp16: torch's GradScaler takes no fp16 gradients)" if p == "fp16" else
            "no loss scaling needed")
    return CheckResult("precision.loss_scaling", PASS, f"{p}: {used}")


def flash_attention(job: JobConfig) -> CheckResult:
    t, gpu, shape = job.train, job.gpu, job.shape
    if attention_run(job) == "eager":
        # What a block's eager attention saves per token for its s x s weights (activations: the fp32 softmax
        # output, its cast back, a soft-cap's tanh output), over the micro-batch's tokens.
        saved = A.saved_per_token(A.block_facts(job), "none")
        scores = sum(v for k, v in saved.items() if k.endswith("(s x s)")) * t.micro_batch * t.seq_len
        stack = job.facts.stack
        if shape.attn_softcap and stack.softcap_attention_explicit:
            return CheckResult("attention.kernel", WARN,
                               f"{stack.name} soft-caps {shape.family or 'this model'}'s attention in explicit s x s "
                               f"scores whatever train.attention: it stores s x s scores, {gib(scores)} per layer",
                               "use checkpointing = 'full' (one layer's scores at a time), or a shorter seq_len")
        return CheckResult("attention.kernel", WARN,
                           f"eager attention stores s x s scores: {gib(scores)} per layer",
                           # SDPA has no soft-cap: transformers before 5.21 drops it there, 5.21+ refuses SDPA;
                           # nor sinks (stacks.gpt_oss_runnable)
                           "use attention = 'flash-attn' (it soft-caps inside its kernel)" if shape.attn_softcap
                           else "use attention = 'flash-attn' (kernels-community/vllm-flash-attn3 takes the sinks "
                           "in its forward; its backward gives them no gradient)"
                           if shape.attn_sinks else "use attention = 'sdpa'")
    if (t.attention == "sdpa" and shape.attn_softcap and job.facts.stack.transformers_release
            and (stacks.parse_version(t.transformers) if t.transformers else (99,)) >= (5, 21)):
        # transformers 5.21.0 modeling_gemma2.py `_supports_sdpa = False  # sdpa does not support softcapping`
        # (5.20.0: True): from_pretrained(attn_implementation="sdpa") refuses the model.
        return CheckResult("attention.kernel", FAIL,
                           f"transformers {t.transformers or '5.21+'} runs {shape.family or 'this model'}'s attention "
                           "soft-capping only under eager or flash-attn: it refuses attn_implementation='sdpa'",
                           "use attention = 'eager' or 'flash-attn', or pin train.transformers before 5.21")
    if t.attention != "flash-attn":
        # Sliding-window layers may get a mask, and with it another kernel, where the others do not (JobFacts.layer).
        n_slide = len(shape.sliding_layers)
        kinds = [(s, n, attention_kernel(job, sliding=s))
                 for s, n in ((False, shape.layers - n_slide), (True, n_slide)) if n]
        kernel = "math" if any(k == "math" for *_, k in kinds) else max(kinds, key=lambda k: k[1])[2]
        if kernel == "math":
            # torch's SDPA falls back to its math kernel (sdp_utils.cpp): no flash for fp32 or
            # pre-sm80, no memory-efficient kernel for grouped-query attention.
            # In fp32 where it casts 16-bit inputs up (activations.math_upcast).
            weight = 4 if A.math_upcast(job) else t.compute_bytes
            scores = shape.heads * t.seq_len * t.seq_len * t.micro_batch * weight
            gqa = shape.kv_heads != shape.heads
            why = ("fp32 with grouped-query attention" if t.dtype == "fp32" and gqa
                   else f"{t.precision} with grouped-query attention on sm{gpu.sm}" if t.dtype == "fp16" and gqa
                   else f"{t.precision} on sm{gpu.sm}")
            return CheckResult("attention.kernel", WARN,
                               f"sdpa takes its math kernel on {gpu.name} ({why}): it keeps s x s attention "
                               f"weights, {gib(scores)} per layer",
                               "use precision = 'bf16-mixed' on sm80+ (flash kernel)" if gpu.supports_bf16
                               else "use a sm80+ GPU (flash kernel), or a model without GQA" if t.dtype == "fp16"
                               else "use precision = 'fp16-mixed' with a model without GQA, or a sm80+ GPU")
        # stacks.AttentionMask: SDPA converts (or autocast casts) the mask in every layer and the kernel keeps it.
        copies = [(s, n, k, job.facts.layer(s).attn_mask.layer_values_per_token(t.seq_len, t.micro_batch, k))
                  for s, n, k in kinds if job.facts.layer(s).attn_mask]
        copies = [c for c in copies if c[3]]
        if copies and job.facts.ac_policy == "none":
            sliding, n, k, values = copies[0]
            per_layer = values * t.seq_len * t.micro_batch * t.compute_bytes
            if sliding and not stacks.padded_batches(t) and t.padding != "flattened":
                return CheckResult("attention.kernel", WARN,
                                   f"sdpa in the {n} sliding-window layers, past their {shape.sliding_window}-token "
                                   f"window: each gets a mask, runs the {k} kernel on {gpu.name} and keeps its own "
                                   f"copy of the mask, {gib(per_layer)} per layer",
                                   "use attention = 'flash-attn' where the GPU has it (it takes the window without a "
                                   "mask), or checkpointing")
            # Past the window the sliding layers keep their copies with equal-length batches too.
            window_too = job.facts.sliding_own and stacks.past_window(t, shape)
            return CheckResult("attention.kernel", WARN,
                               f"sdpa with the {t.padding if t.padding != 'stack' else 'padded'} batches' attention "
                               f"mask: the {k} kernel on {gpu.name}, and every layer with a mask keeps its own copy "
                               f"of it, {gib(per_layer)} per layer",
                               "use attention = 'flash-attn' where the GPU has it (transformers unpads the batch for it)"
                               + (", or checkpointing" if window_too else ", or equal-length batches (padding = 'none')"))
        why = (" (a padding mask rules flash out)" if job.facts.attn_mask or stacks.padded_batches(t)
               else " (the sliding window's mask rules flash out)")
        return CheckResult("attention.kernel", PASS, f"sdpa: the {kernel} kernel on {gpu.name}, no s x s matrix"
                           + (why if job.facts.masks and kernel == "efficient" else ""))
    # flash-attn 2 ships kernels for Ampere, Ada and Hopper (its README: sm80 and newer).
    if gpu.compute_capability < (8, 0):
        return CheckResult("attention.kernel", FAIL,
                           f"flash-attn 2 needs sm80+ (Ampere or newer), {gpu.name} is sm{gpu.sm}",
                           "use attention = 'sdpa' (memory-efficient kernel)")
    if t.dtype == "fp32":
        return CheckResult("attention.kernel", FAIL, "flash-attn runs in fp16/bf16 only, precision is fp32",
                           "use precision = 'bf16-mixed', or attention = 'sdpa'")
    if shape.d_head > 256 or shape.d_head % 8:
        return CheckResult("attention.kernel", FAIL,
                           f"flash-attn supports head dims up to 256 in multiples of 8, model has {shape.d_head}",
                           "use attention = 'sdpa'")
    return CheckResult("attention.kernel", PASS, f"flash-attn on sm{gpu.sm}, head dim {shape.d_head}")


def bnb_sharding(job: JobConfig) -> CheckResult:
    t, c = job.train, job.cluster
    if job.facts.torchao_block:
        return _torchao_sharding(job)
    if not job.facts.bnb_optimizer:
        return CheckResult("optimizer.sharding", SKIP, f"{t.optimizer} is not a bitsandbytes optimizer")
    if job.facts.bnb_unsupported:
        how = f"sharding = {c.sharding}" if c.offload == "none" else f"offload = {c.offload}"
        return CheckResult("optimizer.sharding", FAIL,
                           f"bitsandbytes {t.optimizer} with {how} is not supported: its blockwise states "
                           "cannot follow FSDP-sharded or CPU-offloaded parameters",
                           "use optimizer = 'adamw' with FSDP/offload, or sharding = 'zero1'")
    return CheckResult("optimizer.sharding", PASS, f"{t.optimizer} with sharding = {c.sharding}")


def _torchao_sharding(job: JobConfig) -> CheckResult:
    """torchao's low-bit states follow FSDP2's DTensor shards (torchao/optim/adam.py _new_buffer wraps the local
    state in DTensor.from_local; test/test_low_bit_optim.py TestFSDP2 trains with fully_shard) and CPU offload
    (_new_buffer moves the state back to p.device). DeepSpeed's ZeRO hands the optimizer flat partitions
    instead, each quantized only when its size divides by the block. (torchao 0.18.0 skips that FSDP2 test on
    torch >= 2.11 as "Failing in CI".)"""
    t, c, f = job.train, job.cluster, job.facts
    if t.optimizer == "torchao_adamw_fp8" and job.gpu.sm < 89:
        # torchao/optim/README.md: "For FP8 optimizers on CUDA, PyTorch >= 2.4 and CUDA compute capability
        # >= 8.9 are required" (float8_e4m3fn casts).
        return CheckResult("optimizer.sharding", FAIL, f"torchao's FP8 AdamW needs sm89+ (Ada, Hopper), "
                           f"{job.gpu.name} is sm{job.gpu.sm}", "use optimizer = 'torchao_adamw8bit'")
    if c.sharding != "none" and f.stack.deepspeed_engine:
        return CheckResult("optimizer.sharding", WARN, f"DeepSpeed ZeRO hands {t.optimizer} flat fp32 partitions: "
                           f"torchao quantizes one only if its size divides by {f.torchao_block}, else keeps it fp32; "
                           "priced per tensor", "prefer FSDP2 (accelerate fsdp_version: 2) for torchao's optimizers")
    how = "FSDP2 DTensor shards" if f.fsdp_version == 2 else f"sharding = {c.sharding}"
    return CheckResult("optimizer.sharding", PASS, f"{t.optimizer} (torchao) with {how}")


def quantized_experts(job: JobConfig) -> CheckResult:
    """A 4-bit base of a MoE model: are its routed experts (most of its weights) quantized at all?"""
    t, shape = job.train, job.shape
    if t.base_quant == "none" or not t.lora_rank:
        return CheckResult("quant.experts", SKIP, "no quantized base")
    if not shape.moe:
        return CheckResult("quant.experts", SKIP, "a dense model: no routed experts")
    experts = shape.routed_params
    if shape.expert_linears:
        return CheckResult("quant.experts", PASS, f"bitsandbytes quantizes the routed experts' nn.Linear weights "
                           f"({experts / 1e9:.2f}B parameters)")
    # transformers >= 5.0 holds them as 3-D Parameters that replace_with_bnb_linear skips
    # (ModelShape.expert_linears); bitsandbytes issue #1849.
    # prepare_model_for_kbit_training casts them to fp32 (memory.frozen_groups).
    e, per = 4 if job.facts.kbit_prepared else t.compute_bytes, nf4_bytes(job) if t.base_quant == "nf4" else 1.0
    fix = ("run transformers 4.x and say so (train.transformers = '4.57.1'): it builds each expert as an "
           f"nn.Linear that bitsandbytes quantizes, {gib(experts * per)} instead"
           if job.facts.stack.transformers_release else "expect them in 16 bits")
    return CheckResult("quant.experts", WARN,
                       f"bitsandbytes leaves the routed experts in {8 * e}-bit: this stack holds each layer's "
                       f"experts as 3-D parameters, not nn.Linear: {gib(experts * e)}, "
                       f"{experts / shape.params:.0%} of the weights", fix)


def lora_experts(job: JobConfig) -> CheckResult:
    """LoRA on a transformers 5.x MoE model whose expert banks and router peft adapts (JobFacts.peft_banks)."""
    t, shape, f = job.train, job.shape, job.facts
    if not t.lora_rank or not shape.moe:
        return CheckResult("lora.experts", SKIP, "no LoRA on a MoE model")
    if not f.peft_banks:
        return CheckResult("lora.experts", PASS, "peft adapts no routed-expert bank or router of this job"
                           + ("" if shape.expert_linears or not f.stack.transformers_release
                              else f" (targets: {', '.join(f.lora_targets)})"))
    gate_up, down, router = stacks.adapted_banks(shape.family, f.peft_banks)
    what = ", ".join(n for n, on in (("gate_up_proj", gate_up), ("down_proj", down), ("the router", router)) if on)
    if f.lora_dropout:
        # tuners/lora/layer.py ParamWrapper.__init__: `if config.lora_dropout: raise ValueError(...)`.
        return CheckResult("lora.experts", FAIL, f"peft adapts {what} of every MoE layer through ParamWrapper, which "
                           f"raises for lora_dropout != 0 (lora_dropout = {t.lora_dropout})",
                           "set lora_dropout = 0, or target only the attention projections")
    return CheckResult("lora.experts", PASS,
                       f"peft (>= 0.20 for all-linear, 0.19 for listed names) moves {', '.join(f.peft_banks)} onto "
                       f"{what} of every MoE layer: priced with their adapters and the banks peft's ParamWrapper "
                       "rebuilds in every forward (peft >= 0.21; earlier releases also make a bank-sized delta)")


def fsdp1_kept_inputs(job: JobConfig, est: MemoryEstimate) -> CheckResult:
    """FSDP1's reshard hooks under a reentrant checkpoint around each unit (JobFacts.fsdp1_keeps_block_inputs)."""
    if not job.facts.fsdp1_keeps_block_inputs:
        return CheckResult("checkpointing.fsdp1_inputs", SKIP, "no FSDP1 frozen-unit hooks under a reentrant "
                           "checkpoint around the unit")
    kept = sum(p.bytes for p in est.phase_parts["backward-end"] if p.label == KEPT_INPUTS)
    release = "%d.%d.0" % stacks.checkpointing_layer_release(stacks.hf_family(job.shape))
    return CheckResult("checkpointing.fsdp1_inputs", WARN,
                       f"FSDP1 keeps every block's input and its gradient until backward ends ({gib(kept)} at the "
                       f"first block's backward): transformers {job.train.transformers} checkpoints each layer's "
                       "call around its FSDP unit, reentrant, and the unit's reshard hook holds the recompute's "
                       "input copies",
                       f"transformers >= {release} checkpoints inside the unit (train.transformers = '{release}'); "
                       "gradient_checkpointing_kwargs={'use_reentrant': False} avoids it too, though podkit prices "
                       "the release's reentrant default")


def sharding_world(job: JobConfig) -> CheckResult:
    c = job.cluster
    if c.sharding != "none" and c.world_size == 1:
        return CheckResult("sharding.world_size", WARN,
                           f"sharding = {c.sharding} on 1 GPU shards nothing and only adds overhead",
                           "set sharding = 'none', or gpus_per_node > 1")
    return CheckResult("sharding.world_size", PASS, f"{c.sharding} over {c.world_size} GPU(s)")


# PyTorch's allocator settings (c10 CUDAAllocatorConfig / AcceleratorAllocatorConfig). An unknown
# key makes the first CUDA allocation raise, i.e. the run dies at step 0.
ALLOC_KEYS = {
    "max_split_size_mb": "mb", "max_non_split_rounding_mb": "mb", "garbage_collection_threshold": "fraction",
    "roundup_power2_divisions": "divisions", "expandable_segments": "bool", "release_lock_on_cudamalloc": "bool",
    "pinned_use_cuda_host_register": "bool", "pinned_num_register_threads": "int",
    "pinned_use_background_threads": "bool", "backend": "backend", "per_process_memory_fraction": "fraction",
    "graph_capture_record_stream_reuse": "bool", "pinned_reserve_segment_size_mb": "mb",
}


def parse_alloc_conf(text: str) -> dict[str, str]:
    """'k:v,k:v' with bracketed lists allowed as values; raises ValueError on a bad entry."""
    entries, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += ch
    entries.append(current)
    parsed = {}
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        key, sep, value = entry.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"'{entry}' is not key:value")
        kind = ALLOC_KEYS.get(key)
        if kind is None:
            raise ValueError(f"unknown key '{key}' (known: {', '.join(ALLOC_KEYS)})")
        ok = {
            "mb": value.isdigit(),
            "int": value.isdigit(),
            "bool": value in ("True", "False", "true", "false"),
            "fraction": bool(re.fullmatch(r"0?\.\d+|1(\.0*)?", value)),
            "backend": value in ("native", "cudaMallocAsync"),
            "divisions": value.isdigit() or bool(re.fullmatch(r"\[[\d>:,\s]+\]", value)),
        }[kind]
        if not ok:
            raise ValueError(f"bad value '{value}' for {key}")
        parsed[key] = value
    return parsed


def alloc_conf(facts: HostFacts) -> CheckResult:
    names = [n for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if facts.env.get(n)]
    if not names:
        return CheckResult("env.alloc_conf", WARN, "PYTORCH_CUDA_ALLOC_CONF is not set: fragmentation can OOM a "
                           "job that fits", "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                           "(make deploy writes it to the pod's env file)")
    values = {}
    for name in names:
        try:
            values[name] = parse_alloc_conf(facts.env[name])
        except ValueError as exc:
            return CheckResult("env.alloc_conf", FAIL, f"{name}: {exc}", f"fix {name}; torch rejects it at the first "
                               "CUDA allocation")
    if len(values) == 2 and values["PYTORCH_ALLOC_CONF"] != values["PYTORCH_CUDA_ALLOC_CONF"]:
        return CheckResult("env.alloc_conf", WARN, "PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF differ; "
                           "torch reads PYTORCH_ALLOC_CONF", "set only one of them")
    chosen = values[names[0]]
    if chosen.get("expandable_segments", "").lower() != "true":
        return CheckResult("env.alloc_conf", WARN, f"{names[0]} parses, but expandable_segments is off",
                           "add expandable_segments:True")
    return CheckResult("env.alloc_conf", PASS, f"{names[0]}={facts.env[names[0]]}")


def tokenizers(job: JobConfig, facts: HostFacts) -> CheckResult:
    if job.train.data_workers == 0:
        return CheckResult("env.tokenizers", SKIP, "no DataLoader workers")
    if facts.env.get("TOKENIZERS_PARALLELISM") is None:
        return CheckResult("env.tokenizers", WARN,
                           f"{job.train.data_workers} data workers fork after the tokenizer's threads start: "
                           "HF tokenizers warns and disables itself, or deadlocks",
                           "export TOKENIZERS_PARALLELISM=false")
    return CheckResult("env.tokenizers", PASS, f"TOKENIZERS_PARALLELISM={facts.env['TOKENIZERS_PARALLELISM']}")


def required_packages(job: JobConfig) -> list[str]:
    t = job.train
    need = ["torch", "nvidia-ml-py"]
    if job.facts.bnb_optimizer or t.base_quant != "none":
        need.append("bitsandbytes")
    if job.facts.torchao_block:
        need.append("torchao")
    if t.attention == "flash-attn":
        need.append("flash-attn")
    return need


def dependencies(job: JobConfig, facts: HostFacts) -> CheckResult:
    need = required_packages(job)
    missing = [p for p in need if not facts.packages.get(p)]
    found = ", ".join(f"{p} {facts.packages[p]}" for p in need if facts.packages.get(p))
    if not missing:
        return CheckResult("deps.installed", PASS, found)
    message = f"missing here: {', '.join(missing)}" + (f" (found {found})" if found else "")
    fix = "make deploy installs them on the pod; locally: make setup"
    # Preflight also runs on a laptop, where the GPU packages are not needed: only a GPU machine fails.
    return CheckResult("deps.installed", FAIL if facts.gpus else WARN, message, fix)


# The releases a prediction reads (train.<key>): each changes facts of some jobs (stacks.resolve).
VERSION_KEYS = ("transformers", "bitsandbytes", "torch", "trl")


def versions(job: JobConfig, facts: HostFacts) -> CheckResult:
    """Does this machine run the releases the prediction assumed? Each train.<key> release that changes
    one of this job's facts (stacks.resolve), compared with the one installed here; the prediction
    itself follows the job file, never the machine (config -> checks)."""
    differ, same = [], []
    for key in VERSION_KEYS:
        installed = facts.packages.get(key)
        if not installed or installed == "unknown":
            continue
        stated = getattr(job.train, key)
        local = installed.split("+")[0]
        if stated and stacks.parse_version(stated) == stacks.parse_version(local):
            same.append(f"{key} {local}")
            continue
        if not stacks.parse_version(local):
            continue  # a dev or local build: not a release whose facts podkit knows
        try:
            other = job.replace(train={key: local})
        except ConfigError:
            continue  # a release older than podkit models (stacks.TRANSFORMERS_OLDEST)
        if other.facts == job.facts:
            continue  # this job's prediction reads nothing that differs between the two releases
        differ.append((key, stated, local))
    if differ:
        said = "; ".join(f"train.{k} is {s!r}, this machine has {v}" if s else
                         f"train.{k} is unset (priced as a current release), this machine has {v}"
                         for k, s, v in differ)
        return CheckResult("deps.versions", WARN, f"{said}: the prediction follows the job file",
                           "if this machine runs the job, set " + ", ".join(f"train.{k} = {v!r}" for k, _, v in differ))
    if same:
        return CheckResult("deps.versions", PASS, "the job's releases are installed here: " + ", ".join(same))
    return CheckResult("deps.versions", PASS, "no installed release changes this job's prediction")


def gpu_arch(facts: HostFacts) -> CheckResult:
    if not facts.gpus:
        return CheckResult("gpu.arch", SKIP, f"no GPU here: {facts.nvml_status}")
    if not facts.torch_archs:
        return CheckResult("gpu.arch", SKIP, "torch not installed, or a CPU build: no CUDA architectures")
    gpu = facts.gpus[0]
    major, minor = gpu.compute_capability
    sm = major * 10 + minor
    # one reading of torch's arch list for the project (envsetup/arch.py): sm_90a, compute_90a too
    if arch.supports(facts.torch_archs, sm) and not arch.ptx_only(facts.torch_archs, sm):
        return CheckResult("gpu.arch", PASS, f"{gpu.name} sm_{major}{minor} is in torch's arch list")
    if arch.ptx_only(facts.torch_archs, sm):
        ptx = [a for a in facts.torch_archs if a.startswith("compute_")]
        return CheckResult("gpu.arch", WARN, f"{gpu.name} sm_{major}{minor} runs only through PTX JIT ({ptx[-1]}): "
                           "slow first steps", "install a torch build that lists this architecture")
    return CheckResult("gpu.arch", FAIL,
                       f"{gpu.name} is sm_{major}{minor}, torch ships kernels for {' '.join(facts.torch_archs)}: "
                       "'no kernel image is available for execution on the device'",
                       "install a torch build for this GPU (Blackwell sm_120 needs a CUDA 12.8+ build, cu128)")


def gpu_driver(facts: HostFacts) -> CheckResult:
    if not facts.gpus or facts.driver_cuda is None:
        return CheckResult("gpu.driver", SKIP, f"no GPU here: {facts.nvml_status}")
    if facts.torch_cuda is None:
        return CheckResult("gpu.driver", SKIP, "torch not installed, or a CPU build")
    drv, built = facts.driver_cuda, facts.torch_cuda
    text = f"driver supports CUDA {drv[0]}.{drv[1]}, torch is built for CUDA {built[0]}.{built[1]}"
    if drv[0] < built[0]:
        return CheckResult("gpu.driver", FAIL, text, f"update the NVIDIA driver to a CUDA {built[0]} driver, "
                           f"or install torch built for CUDA {drv[0]}.x")
    if drv < built:
        return CheckResult("gpu.driver", WARN, text + ": runs on CUDA minor-version compatibility (no PTX JIT)",
                           "update the driver, or use a torch build for the driver's CUDA version")
    return CheckResult("gpu.driver", PASS, text)


def checkpoint_bytes(job: JobConfig) -> int:
    """A resumable checkpoint: weights in bf16 (or the trainable adapters) plus fp32 optimizer states."""
    weights = trainable_params(job) * job.train.compute_bytes
    return weights + optimizer_bytes(job, trainable_groups(job), 4)


def disk_space(job: JobConfig, facts: HostFacts) -> CheckResult:
    if facts.disk_blocked:
        return CheckResult("disk.free", FAIL, f"train.output_dir {job.train.output_dir}: {facts.disk_blocked}",
                           "point train.output_dir at a writable directory")
    if facts.disk_free is None:
        return CheckResult("disk.free", SKIP, f"cannot stat {job.train.output_dir}")
    need = checkpoint_bytes(job)
    text = f"{gib(facts.disk_free)} free for {job.train.output_dir}/, one checkpoint is about {gib(need)}"
    if facts.disk_free < need:
        return CheckResult("disk.free", FAIL, text, "free disk, or point train.output_dir at a larger volume")
    if facts.disk_free < 2 * need:
        return CheckResult("disk.free", WARN, text + ": room for only one", "keep at most one checkpoint")
    return CheckResult("disk.free", PASS, text)


def dataset(job: JobConfig) -> CheckResult:
    path = job.train.dataset
    if not path:
        return CheckResult("data.path", SKIP, "synthetic data (no train.dataset)")
    p = job.path(path)
    if p.is_dir():
        return CheckResult("data.path", FAIL, f"{p} is a directory, not a file of token ids",
                           "point train.dataset at the .bin file inside it")
    if not p.is_file():
        return CheckResult("data.path", FAIL, f"{p} {'is not a regular file' if p.exists() else 'does not exist'}",
                           "point train.dataset at a file of token ids")
    if p.stat().st_size == 0:
        return CheckResult("data.path", FAIL, f"{p} is empty", "point train.dataset at a file of token ids")
    return CheckResult("data.path", PASS, f"{p} ({p.stat().st_size:,} bytes)")


def machine_checks(job: JobConfig, facts: HostFacts) -> list[CheckResult]:
    """The checks that judge this machine; skipped, not judged on empty facts, when it was not looked at."""
    checks = [("env.alloc_conf", lambda: alloc_conf(facts)), ("env.tokenizers", lambda: tokenizers(job, facts)),
              ("deps.installed", lambda: dependencies(job, facts)), ("deps.versions", lambda: versions(job, facts)),
              ("gpu.arch", lambda: gpu_arch(facts)),
              ("gpu.driver", lambda: gpu_driver(facts)), ("disk.free", lambda: disk_space(job, facts))]
    if not facts.probed:
        return [CheckResult(check_id, SKIP, "not probed (--no-probe)") for check_id, _ in checks]
    return [check() for _, check in checks]


def run_checks(job: JobConfig, est: MemoryEstimate, facts: HostFacts,
               suggestions: list[Suggestion]) -> list[CheckResult]:
    return [
        memory_fit(job, est, suggestions),
        ledger_margin(job, est),
        host_ram(job, est),
        effective_batch(job),
        context_length(job),
        precision_gpu(job),
        loss_scaling(job),
        flash_attention(job),
        bnb_sharding(job),
        quantized_experts(job),
        lora_experts(job),
        fsdp1_kept_inputs(job, est),
        sharding_world(job),
        *machine_checks(job, facts),
        dataset(job),
    ]
