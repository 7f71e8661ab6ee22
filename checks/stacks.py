"""Training stacks, and the facts about a job that every part of podkit reads.

A stack is the library that runs the user's training step. It changes peak memory through a small
set of implementation facts: how the loss is computed, what "selective" checkpointing saves, which
linears LoRA adapts by default and in what dtype, and which optimizer kernel runs. Each fact below
cites the library source it comes from; every fact can be overridden by an explicit job key
(`train.loss`, `train.lora_targets`, `train.optimizer_impl`, ...).

`JobFacts` is the one place where a job's derived facts are decided (does it shard, autocast,
scale the loss, use a bitsandbytes optimizer): the memory model, the checks, the advisor and the
smoke run all read `job.facts`, so prediction and run cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

STACKS = ("podkit", "hf", "deepspeed", "torchtitan", "litgpt", "torchtune", "fsdp_qlora")

# How the loss turns the last hidden state into a scalar, and what it keeps alive:
#   fp32-upcast       cross_entropy(logits.float()): bf16 logits, an fp32 copy, fp32 log-softmax
#   fp32-logits-kept  the model upcasts logits to fp32 and returns them; the caller keeps them
#                     referenced until backward (transformers <= 4.45 LlamaForCausalLM under fsdp_qlora's loop)
#   fp32-upcast-shifted  loss_utils.ForCausalLMLoss of transformers 4.46-4.48: upcast inside the loss,
#                     then a shifted .contiguous() fp32 copy; the 16-bit logits die with `outputs`
#   chunked           head + cross-entropy in chunks along the sequence, upcast per chunk
#   fused             fused linear + cross-entropy that recomputes the logits block by block on chip in
#                     backward (Cut Cross-Entropy, apple ml-cross-entropy cce.py): no logits tensor at all;
#                     keeps the head's input and weight as autocast casts them, and a logsumexp per token
#   liger             Liger's fused linear + cross-entropy (HF Trainer use_liger_kernel): no full logits,
#                     the gradients made in forward and held until backward
#   native            cross_entropy on the logits as they are, no upcast of its own (litgpt full.py, whose
#                     logits Fabric hands over in fp32: Stack.outputs_fp32); on 16-bit logits under autocast
#                     CUDA's nll_loss saves an fp32 cast of the log-probabilities (JobFacts.loss_autocast)
#   compute-shifted   transformers < 4.49 GPT2LMHeadModel.forward: a shifted .contiguous() copy of the
#                     compute-dtype logits, CrossEntropyLoss on it, in fp32 only where autocast casts it
LOSSES = ("fp32-upcast", "fp32-logits-kept", "fp32-upcast-shifted", "chunked", "fused", "liger", "native",
          "compute-shifted")

# What activation checkpointing keeps:
#   none      everything autograd saves
#   matmuls   podkit's selective policy: matmul and attention outputs kept, the rest recomputed
#   op-sac    torchtitan's op-level selective AC: attention kept, every second matmul kept
#   block     per-block (per decoder layer) full recompute: only each block's input is kept
AC_POLICIES = ("none", "matmuls", "op-sac", "block")
OPTIMIZER_IMPLS = ("fused", "foreach", "for-loop")
LORA_DTYPES = ("param", "fp32", "compute")  # param: the precision's trainable dtype (podkit)
# What runs a decoder block's norms, rotary embedding and gated activation:
#   torch   the modules as transformers writes them in PyTorch ops (LlamaRMSNorm in fp32, rotate_half
#           RoPE, act_fn(gate) * up): what autograd saves for each op
#   liger   Liger-Kernel's Triton kernels (HF Trainer use_liger_kernel; liger_kernel/transformers/
#           monkey_patch.py apply_liger_kernel_to_llama: rope, rms_norm and swiglu on by default):
#           LigerRMSNormFunction keeps X and an fp32 rstd and writes dX into dY; LigerRopeFunction
#           rotates q and k in place; LigerSiLUMulFunction keeps gate and up and writes their
#           gradients into them (liger_kernel/ops/rms_norm.py, rope.py, swiglu.py)
BLOCK_KERNELS = ("torch", "liger")
# Model families whose Liger patch builds its RMSNorm with in_place=False, so that backward allocates dX
# (zeros_like(dY)) instead of writing into dY: Gemma 2 and 3 (monkey_patch.py apply_liger_kernel_to_gemma2,
# _gemma3: _patch_rms_norm_module(..., in_place=False); rms_norm.py LigerRMSNormForGemma2/3).
LIGER_NORM_COPIES = ("gemma2", "gemma3", "gemma3_text")


def liger_norm_in_place(family: str) -> bool:
    """Whether Liger's RMSNorm writes dX into dY for this model family."""
    return family not in LIGER_NORM_COPIES

# bitsandbytes' optimizers: (states per parameter, bits per state value) for tensors of at least
# min_8bit_size values (bitsandbytes optim/adamw.py, lion.py: Optimizer2State / Optimizer1State with
# optim_bits 8 or 32). Read by the job's facts, the smoke run's optimizer and the traced emulation.
BNB_OPTIMIZERS = {"adamw8bit": (2, 8), "paged_adamw8bit": (2, 8), "paged_adamw": (2, 32), "lion": (1, 32),
                  "lion8bit": (1, 8)}


@dataclass(frozen=True)
class LowBitAdam:
    """One of torchao's low-bit AdamW classes, as its states are made (torchao/optim/adam.py _AdamBase._new_buffer,
    v0.18.0; the same code as torchao.prototype.low_bit_optim before 0.11): exp_avg and exp_avg_sq of a
    tensor of at least TORCHAO_MIN_QUANT values whose count divides by the block size are tensor subclasses
    of codes, an fp32 scale per block and (8-bit, 4-bit) a per-state fp32 lookup table (subclass_8bit.py,
    subclass_4bit.py, subclass_fp8.py OptimState*.zeros); any other tensor gets torch.zeros_like(p): states in
    the parameter's own dtype. Under FSDP2 the test applies to each rank's local shard, and the state is a
    DTensor over it (`p.to_local()`, then DTensor.from_local with the parameter's placements)."""

    cls: str
    """The torchao.optim class."""
    code_bytes: float
    """Bytes per state value: a uint8 code (8-bit), two 4-bit codes packed in a uint8, a float8_e4m3fn."""
    block: int
    """The class's default block_size: values per fp32 scale."""
    qmap_values: int
    """fp32 entries of the lookup table each quantized state keeps its own copy of (torch.tensor(qmap_list)
    in OptimState*.zeros): 256 for 8-bit (create_dynamic_map), 16 for 4-bit, none for FP8 (a plain cast)."""

    def state_tensors(self, numel: int, param_bytes: int, block: int = 0) -> tuple[int, ...]:
        """Byte sizes of the tensors _new_buffer makes for one state of a tensor of `numel` values."""
        block = block or self.block
        if numel < TORCHAO_MIN_QUANT or numel % block:
            return (numel * param_bytes,)
        codes, scales = int(numel * self.code_bytes), numel // block * 4
        return (codes, scales, self.qmap_values * 4) if self.qmap_values else (codes, scales)


# "follow bitsandbytes, only quantize tensors >= 4096 values" (torchao/optim/adam.py _new_buffer).
TORCHAO_MIN_QUANT = 4096
# podkit's names for torchao.optim's low-bit AdamW (Adam8bit etc. differ only in how weight decay is applied).
TORCHAO_OPTIMIZERS = {"torchao_adamw8bit": LowBitAdam("AdamW8bit", 1, 256, 256),
                      "torchao_adamw4bit": LowBitAdam("AdamW4bit", 0.5, 128, 16),
                      "torchao_adamw_fp8": LowBitAdam("AdamWFp8", 1, 256, 0)}

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_LINEARS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")
# Phi-3's fused projections (ModelShape.fused_proj) as the linears of a model that splits them.
FUSED_SPLIT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_fused(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for name in names for n in FUSED_SPLIT.get(name, (name,))))


@dataclass(frozen=True)
class Stack:
    """A training library's memory-relevant defaults."""

    name: str
    loss: str
    """How the loss is computed by default (one of LOSSES)."""
    loss_chunk_tokens: int
    """For chunked losses: tokens per chunk (0: not chunked)."""
    loss_chunks: int
    """For chunked losses split into a fixed number of chunks (0: by tokens instead)."""
    loss_upcast: bool
    """The cross-entropy runs on fp32 logits (an fp32 copy and fp32 log-softmax) rather than 16-bit."""
    logits_kept: bool
    """The training loop keeps the logits referenced through backward."""
    selective: str
    """What checkpointing = "selective" means in this stack (one of AC_POLICIES)."""
    lora_targets: tuple[str, ...]
    """LoRA's default target modules, by Llama module name ("all" = every block linear)."""
    lora_dtype: str
    """Adapter weights' dtype: param (fp32 masters unless pure 16-bit), fp32 always, or the compute dtype."""
    adamw_impl: str
    """torch AdamW implementation the stack picks on CUDA (fused / foreach / for-loop)."""
    quantize_head: bool
    """A quantized (QLoRA) base quantizes the LM head too, not only the block linears."""
    repeat_kv: bool
    """Grouped-query attention copies k and v out to every head before SDPA (transformers <= 4.53
    repeat_kv in integrations/sdpa_attention.py, torchtitan <= 0.2.1, torchtune, litgpt) instead of
    passing enable_gqa: SDPA keeps full-width k and v, and sees plain multi-head attention."""
    reentrant: bool
    """Activation checkpointing runs torch.utils.checkpoint with use_reentrant=True (the forward under
    no_grad) rather than the non-reentrant saved-tensor hooks."""
    source: str
    """Where these facts come from."""
    previous_outputs_kept: bool = False
    """The training loop keeps the previous step's logits bound until the next forward returns, and
    with them that step's autograd graph and anything its nodes hold (litgpt finetune/lora.py fit:
    `logits = model(...)` rebinds only after the forward)."""
    fused_qkv: bool = False
    """q, k and v come out of one fused linear as views (litgpt CausalSelfAttention.attn): a v that is
    still a view (no k/v repeat) keeps the whole qkv output alive once SDPA saves it."""
    quant_from_fp16: bool = False
    """The 4-bit base was quantized from fp16 (lightning BitsandbytesPrecision quantizes from fp16),
    so dequantize_4bit returns fp16 and .to(bf16) makes a second copy of each weight."""
    fsdp2: bool = False
    """Sharding runs FSDP2's fully_shard (per-parameter DTensor shards, flat all-gather buffers on the
    copy-in stream) rather than FSDP1 flat parameters (accelerate's default fsdp_version 1, lightning's
    FSDPStrategy) or DeepSpeed ZeRO-3."""
    fsdp_init_on_device: bool = False
    """FSDP1 (FullyShardedDataParallel) wraps a model that starts on the CPU, moving each unit to the GPU
    (device_id, sync_module_states), and nothing calls empty_cache after wrapping: the segments the
    wrap left stay reserved through training (fsdp_qlora even resets the peak counters there)."""
    lora_units: bool = False
    """Each LoRA linear is its own FSDP unit (its flat parameter is the only one that trains), so a
    block's flat parameter holds only frozen weights and has no gradient."""
    quantized_load_on_gpu: bool = False
    """A 4-bit base is quantized on each rank's GPU while loading (transformers' bitsandbytes quantizer
    with FSDP CPU-efficient loading), which keeps every QuantState there, and before transformers 4.45 the
    16-bit parameters too (TransformersFacts.quantized_load_16bit_on_gpu)."""
    fsdp_no_sync: bool = False
    """Gradient accumulation runs every micro-step but the last under the FSDP root's no_sync(), so FSDP1
    keeps whole unsharded gradients between them (accelerate's accumulate() without sync_each_batch)."""
    rope_cache_buffers: bool = False
    """The stack's transformers (4.38-4.39) gives every attention layer cos/sin tables of
    max_position_embeddings x head_dim as buffers (LlamaRotaryEmbedding `_cos_cached`/`_sin_cached`
    "for BC", MistralRotaryEmbedding `cos_cached`/`sin_cached`, in torch.get_default_dtype() at
    construction): on the GPU of every rank, never sharded (FSDP moves buffers, it does not flatten them)."""
    expert_linears: bool = False
    """A MoE layer's routed experts are nn.Linear modules, one gated MLP per expert, and its router an
    nn.Linear (ModelShape.expert_linears): bitsandbytes quantizes them and all-linear adapts them.
    False: 3-D expert banks. The hf and deepspeed stacks take it from their transformers release."""
    adapter_input_cast: bool = False
    """peft's lora.Linear casts the adapter's input to the adapter dtype when they differ and no
    autocast is on (peft tuners/lora/layer.py Linear.forward `x = self._cast_input_dtype(x, ...)`)."""
    deepspeed_engine: bool = False
    """DeepSpeed's engine trains the module in 16 bits with the fp32 master copy inside its optimizer
    (runtime/bf16_optimizer.py, zero/stage_1_and_2.py, zero/stage3.py), 16-bit gradients, and its own
    ZeRO-3 gradient bucket."""
    kbit_prepare: bool = False
    """The stack trains with TRL's SFTTrainer: before TRL 0.26 a quantized base that each rank loads whole (not
    FSDP-sharded) goes through peft's prepare_model_for_kbit_training before the adapters are added
    (JobFacts.kbit_prepared); from 0.26 a quantized model's adapters are cast to bf16 instead (trl_prepares_kbit)."""
    checkpoint_around_unit: bool = False
    """Per-block activation checkpointing wraps the call of the block's FSDP unit (the model's loop runs
    checkpoint(decoder_layer.__call__, ...) on the wrapped layer), rather than running inside the unit's
    forward (FSDP's checkpoint_wrapper applied after wrapping; transformers' GradientCheckpointingLayer).
    The hf and deepspeed stacks take it from their transformers release (transformers_facts)."""
    loss_after_forward: bool = False
    """The loop computes the loss from what the model's forward returned, after binding it (litgpt fit():
    `logits = model(...)`, then chunked_cross_entropy), so the previous step's outputs it still held
    (previous_outputs_kept) are gone before the loss runs; elsewhere the loss is part of the forward."""
    outputs_fp32: bool = False
    """The loop calls the model through a wrapper that casts its floating outputs to fp32 when the forward
    returns, and computes the loss from them: Fabric's _FabricModule.forward runs `precision.convert_output`
    after leaving `forward_context`, and every 16-bit precision plugin converts to torch.get_default_dtype(),
    fp32 again by then (lightning 2.4 fabric/wrappers.py; plugins/precision/half.py HalfPrecision for
    bf16-true, amp.py MixedPrecision for bf16-mixed, bitsandbytes.py BitsandbytesPrecision for QLoRA). The
    16-bit logits die with the forward's frame (ToCopyBackward0 saves no tensor); the loss and what the loop
    keeps are fp32 (JobFacts.logits_fp32)."""
    logit_softcap: bool = True
    """The model soft-caps its logits where the model's config asks (ModelShape.logit_softcap, Gemma 2's
    final_logit_softcapping): `logits / cap`, `tanh`, `* cap` on the head's output, and TanhBackward0 saves
    its output (transformers 5.23 modeling_gemma2.py Gemma2ForCausalLM.forward, the same since 4.42; litgpt
    model.py GPT.forward `clamp_head` = do_softcapping per head chunk). False: torchtune caps the final norm's
    hidden-sized output instead, before the head (models/gemma2/_component_builders.py Gemma2FinalNorm,
    pytorch/torchtune@00c242b), and torchtitan has no Gemma."""
    softcap_attention_explicit: bool = False
    """The stack computes a soft-capped model's attention (ModelShape.attn_softcap, Gemma 2) as explicit s x s
    scores whatever train.attention: eager's (kernels.attention_run). litgpt model.py
    CausalSelfAttention.scaled_dot_product_attention ("with softcapping we cannot use SDPA": q @ k.mT,
    do_softcapping, softmax in fp32; Lightning-AI/litgpt@2685705), torchtune models/gemma2/_attention.py
    Gemma2Attention.forward (matmul, tanh soft-cap, softmax(output.float()))."""
    precisions: tuple[str, ...] = ()
    """The train.precision values the stack's loop can run (empty: all of config.PRECISIONS). torchtune's
    recipes build the model in cfg.dtype with no autocast (training/precision.py get_dtype) and refuse
    fp16 ("fp16 precision is not supported in this recipe. Please use fp32 or bf16.", recipes/
    full_finetune_single_device.py and the other recipes' __init__)."""
    transformers_release: bool = False
    """The model, its loss and gradient_checkpointing_enable are transformers' at the job's release
    (train.transformers): transformers_facts decides the loss path, the reentrant default and the rotary
    tables in place of this Stack's loss, reentrant and rope_cache_buffers (and, where the Trainer builds
    the optimizer, not DeepSpeed, its default AdamW kernel: Stack.deepspeed_engine)."""


STACK_FACTS: dict[str, Stack] = {
    s.name: s
    for s in [
        # podkit's own smoke loop: train/model.py (cross_entropy(logits.float())), train/optim.py
        # (AdamW(fused=True)), LoRA on every block linear in the optimizer's dtype.
        Stack("podkit", "fp32-upcast", 0, 0, True, False, "matmuls", ("all",), "param", "fused", False, False, False,
              "podkit train/model.py, train/optim.py, train/parallel.py (fully_shard per block)", fsdp2=True),
        # The loss, the Trainer's AdamW kernel, reentrancy and rotary buffers below are a current
        # transformers' and follow train.transformers (transformers_facts): >= 4.49 (LlamaForCausalLM.forward
        # -> self.loss_function = ForCausalLMLoss in loss/loss_utils.py: `logits = logits.float()` inside
        # the loss, labels shifted by padding, not the logits); Trainer's default optim "adamw_torch" =
        # torch.optim.AdamW with foreach picked on CUDA (torch/optim/optimizer.py
        # _default_to_fused_or_foreach), "adamw_torch_fused" from 4.54 with torch >= 2.8;
        # gradient_checkpointing is per decoder layer, reentrant before 5.0 unless
        # gradient_checkpointing_kwargs says otherwise, no op-level selective policy; peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: llama/mistral/qwen2 ->
        # ["q_proj", "v_proj"]; peft >= 0.12 LoraConfig/get_peft_model autocast_adapter_dtype=True
        # upcasts adapters of a bf16/fp16 base to fp32.
        # Its FSDP is accelerate's FullyShardedDataParallelPlugin, FSDP1 (FullyShardedDataParallel; the
        # only one before accelerate 1.6 and the default after): accelerator.py prepare_model (0.28.0
        # l.1406-1422) wraps with device_id=self.device and sync_module_states True by default
        # (utils/dataclasses.py 0.28.0 __post_init__: FSDP_SYNC_MODULE_STATES "True", then param_init_fn =
        # to_empty(device)); use_orig_params falls back to "False" there only when nothing set
        # FSDP_USE_ORIG_PARAMS, and `accelerate launch` sets it, "true" by default (accelerate 1.0.1
        # commands/launch.py l.564-565 --fsdp_use_orig_params, exported by utils/launch.py l.282); the Trainer does not
        # place an FSDP model on the GPU, so each unit's parameters are moved there by FSDP's
        # _move_module_to_device, unit by unit, and nothing calls empty_cache between that wrap and
        # training (Trainer._inner_training_loop frees memory before it, not after). With a LoRA
        # PeftModel, Trainer._fsdp_qlora_plugin_updates (transformers 4.39 trainer.py) replaces the wrap
        # policy by peft's fsdp_auto_wrap_policy (utils/other.py, v0.10.0 l.379-418): every leaf whose
        # weight trains (each lora_A / lora_B Linear) is its own unit, _or_ each decoder layer.
        # Trainer.training_step runs under accelerator.accumulate(model), which enters model.no_sync() on
        # every micro-step that does not sync (accelerate 0.28 accelerator.py l.1028-1033; sync_each_batch,
        # default False, is the opt-out).
        # A QLoRA base under FSDP is loaded by every rank, each 4-bit weight quantized on the GPU and its
        # packed data moved to the host (transformers 4.39 modeling_utils.py l.818-823, l.3951;
        # quantizers/quantizer_bnb_4bit.py update_device_map): checks/fsdp1.py quantized_load.
        Stack("hf", "fp32-upcast", 0, 0, True, False, "block", ("q_proj", "v_proj"), "fp32", "foreach", False, True, True,
              "transformers loss/loss_utils.py, trainer.py; peft utils/constants.py, tuners_utils.py, utils/other.py; "
              "accelerate utils/dataclasses.py, accelerator.py",
              fsdp_init_on_device=True, lora_units=True, fsdp_no_sync=True, quantized_load_on_gpu=True,
              adapter_input_cast=True, transformers_release=True,
              # TRL's SFTTrainer before 0.26 (0.13.0 sft_trainer.py l.182-233) calls prepare_model_for_kbit_training
              # on a model loaded in 4 or 8 bits unless its Params4bit sit on cpu/meta (an FSDP-sharded QLoRA),
              # then, with args.bf16, peft_module_casting_to_bf16 (trl/trainer/utils.py); from 0.26 it casts the
              # adapters of a quantized model to bf16 instead (trl_prepares_kbit).
              kbit_prepare=True),
        # DeepSpeed via the HF Trainer integration: the same transformers model, loss and checkpointing
        # (so the same train.transformers facts) and peft defaults; the step runs inside DeepSpeed's
        # optimizer wrapper on its flat fp32 partitions (FusedAdam / ZeRO), modelled by the sharding terms.
        Stack("deepspeed", "fp32-upcast", 0, 0, True, False, "block", ("q_proj", "v_proj"), "fp32", "fused", False, True, True,
              "transformers integrations/deepspeed.py; deepspeed runtime/zero",
              adapter_input_cast=True, deepspeed_engine=True, transformers_release=True),
        # torchtitan: activation_checkpoint.mode = "selective" with selective_ac_option = "op" saves
        # the ops in _save_list and every second mm (torchtitan/models/llama3/infra/parallelize.py
        # _apply_ac_to_transformer_block); loss = cross_entropy(pred.flatten(0, 1).float(), ...)
        # (torchtitan/components/loss.py); optimizer.implementation = "fused" by default.
        # Sharding is fully_shard per block and on the root (parallelize.py apply_fsdp).
        Stack("torchtitan", "fp32-upcast", 0, 0, True, False, "op-sac", ("all",), "compute", "fused", False, True, False,
              "torchtitan components/loss.py, models/llama3/infra/parallelize.py, config/job_config.py", fsdp2=True,
              logit_softcap=False),
        # litgpt finetune/lora.py: logits = model(input_ids, lm_head_chunk_size=128), a list of
        # 128-token chunks that fit() keeps referenced through fabric.backward, and
        # chunked_cross_entropy on the chunks without upcast (litgpt/utils.py), which Fabric's wrapper
        # has cast to fp32 on the way out of the forward (outputs_fp32);
        # lora_query + lora_value on by default; precision bf16-true keeps adapters in bf16;
        # torch.optim.AdamW built without fused= (foreach on CUDA); quantize="bnb.nf4" swaps every
        # nn.Linear, the LM head included, for bitsandbytes' 4-bit layer (lightning
        # BitsandbytesPrecision.convert_module, no ignore list); single-GPU fine-tuning does not
        # checkpoint, multi-GPU FSDP wraps each Block non-reentrantly.
        Stack("litgpt", "chunked", 128, 0, False, True, "block", ("q_proj", "v_proj"), "compute", "foreach", True, True, False,
              "litgpt finetune/lora.py, utils.py chunked_cross_entropy, lora.py Config", softcap_attention_explicit=True,
              previous_outputs_kept=True, loss_after_forward=True, outputs_fp32=True, fused_qkv=True, quant_from_fp16=True,
              # litgpt model.py LLaMAMoE: gate = nn.Linear(n_embd, n_expert), experts = nn.ModuleList of
              # LLaMAMLP (fc_1, fc_2, proj nn.Linear); lora.py LLaMAMoE gives gate and experts LoRA under
              # lora_mlp.
              expert_linears=True),
        # Answer.AI fsdp_qlora train.py (50efa1e, 2024-03-26): a transformers model of its time
        # (4.38/4.39: LlamaForCausalLM does `logits = logits.float()` and the loss on a shifted
        # .contiguous() copy, and the loop keeps `output` until after optimizer.step(); LlamaSdpaAttention
        # repeat_kv), peft LoRA on k,q,v,up,down,gate (`--lora_target_modules all`) in the base
        # weight's dtype, torch.optim.AdamW without fused= (foreach on CUDA); QLoRA replaces the
        # linears of `model.model` only (replace_linear, lm_head stays 16-bit); FSDP1 with
        # use_orig_params=False, limit_all_gathers=True, sync_module_states from rank 0's CPU copy
        # (low_memory default), an _or_policy that makes every trainable leaf (each lora_A/lora_B
        # Linear) and each decoder layer its own unit, and FSDP's checkpoint_wrapper per decoder
        # layer, reentrant as its README asks for bitsandbytes (`--reentrant_checkpointing True`), applied
        # after the wrap (l.704 FSDP(...), l.741 apply_activation_checkpointing), so inside each unit;
        # torch.cuda.reset_peak_memory_stats() right before the loop, no empty_cache after wrapping.
        Stack("fsdp_qlora", "fp32-logits-kept", 0, 0, True, True, "block",
              ("k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"), "compute", "foreach", False, True, True,
              "AnswerDotAI/fsdp_qlora train.py 50efa1e; transformers 4.39 modeling_llama.py; torch 2.2 FSDP1",
              fsdp_init_on_device=True, lora_units=True, rope_cache_buffers=True, adapter_input_cast=True,
              expert_linears=True,  # a transformers 4.39 model: experts are nn.Linear (transformers_facts)
              # --precision fp32 | bf16 | fp16_autocast | bf16_autocast | bf16_buffers_autocast; anything else
              # is "Invalid precision" (train.py 50efa1e): no pure fp16.
              precisions=("fp32", "fp16-mixed", "bf16-mixed", "bf16")),
        # torchtune: CEWithChunkedOutputLoss(num_output_chunks=8), upcast per chunk
        # (torchtune/modules/loss/ce_chunked_output_loss.py), and the recipes `del logits` before
        # backward (recipes/lora_finetune_single_device.py _loss_step); LoRA recipes target q, v, output_proj
        # and the MLP (recipes/configs/llama3_1/8B_lora_single_device.yaml); AdamW(fused=True);
        # enable_activation_checkpointing wraps each TransformerSelfAttentionLayer.
        Stack("torchtune", "chunked", 0, 8, True, False, "block",
              ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "compute", "fused", False, True, False,
              "torchtune modules/loss/ce_chunked_output_loss.py, recipes/configs/llama3_1; training/_distributed.py "
              "shard_model (fully_shard)", fsdp2=True, precisions=("bf16", "fp32"), logit_softcap=False,
              softcap_attention_explicit=True),
    ]
}


@dataclass(frozen=True)
class JobFacts:
    """Every derived fact about a job, decided once. Read by memory, rules, advisor and the smoke run."""

    stack: Stack
    loss: str
    loss_in_model: bool
    """transformers <= 4.45 under the hf stack's own loss: LlamaForCausalLM.forward upcasts the logits
    (`.float()`, the 16-bit ones freed at once), copies the shifted slice and runs CrossEntropyLoss, and the
    Trainer drops `outputs`, the fp32 logits with it, when compute_loss returns, before backward. Priced as
    fp32-upcast (the same bytes); the allocator replays follow this order (step_replay.head_events)."""
    loss_chunk_tokens: int
    loss_chunks: int
    loss_upcast: bool
    logits_kept: bool
    ac_policy: str
    lora: bool
    lora_targets: tuple[str, ...]
    """Resolved module names (Llama or GPT-2 names), possibly including lm_head."""
    lora_dtype: str
    adapter_bytes: int
    """Bytes per adapter weight (and its gradient and, for AdamW, each state); 0 without LoRA."""
    adapter_compute_bytes: int
    """Bytes per adapter weight as the adapter's matmuls see it, so the dtype of its input cast and outputs;
    0 without LoRA. FSDP's mixed-precision gather casts fp32 adapters to the compute dtype like every other
    parameter (FSDP2 MixedPrecisionPolicy param_dtype, FSDP1 MixedPrecision), and DeepSpeed's engine casts
    the module's parameters, peft's fp32 adapters included (runtime/engine.py _configure_distributed_model:
    `self.module.bfloat16()` through 0.19.1, then _cast_module_mixed_precision) - except, from 0.19.2
    (#8066), a model made under ZeRO-3's zero.Init, which the HF Trainer's ZeRO-3 always is: its fp32
    adapters stay fp32. podkit has no DeepSpeed release key and prices the current one (older releases
    ran ZeRO-3 adapters in bf16, so this errs high for them)."""
    lora_dropout: float
    optimizer_impl: str
    fsdp: bool
    """Parameters (and gradients) sharded FSDP-style: ZeRO-2 / ZeRO-3."""
    autocast: bool
    """fp32 weights on the GPU, cast per op to the compute dtype by torch.autocast."""
    grad_scaler: bool
    bnb_optimizer: bool
    paged_optimizer: bool
    torchao_block: int
    """A torchao low-bit AdamW (TORCHAO_OPTIMIZERS): its quantization block (train.optimizer_block, else the
    class's default); 0 for every other optimizer."""
    quantize_head: bool
    previous_outputs_kept: bool
    fsdp_version: int
    """The stack's FSDP where podkit models it by version: 2 (fully_shard), 1 (FullyShardedDataParallel,
    with its wrap replayed: fsdp_qlora, hf); 0 without FSDP or where the generic sharding model applies."""
    quant_saves_input: bool
    """bitsandbytes < 0.43.2: MatMul4Bit keeps its input A as a plain ctx attribute until backward,
    which checkpointing's saved-tensor hooks cannot drop (only a reentrant checkpoint's no_grad
    forward records no ctx at all)."""
    quant_input_in_recompute: bool
    """The same bitsandbytes < 0.43.2 ctx input during a checkpointed block's recompute in backward
    (which runs with grad enabled, reentrant or not): alive until that block's backward ends."""
    offloaded: bool
    """Optimizer states (and with 'all' parameters) live on the host."""
    fsdp_param_cast: bool = False
    """FSDP gathers the parameters cast to the compute dtype (FSDP2 MixedPrecisionPolicy param_dtype,
    FSDP1 MixedPrecision): fp32 shards of a -mixed precision under sharding."""
    process_group: bool = False
    """The run needs a process group: more than one rank, or sharding even on one GPU (FSDP needs one);
    bin/smoke then launches gpus_per_node ranks per node under torchrun."""
    rope_cache_bytes: int = 0
    """Bytes per value of the rotary cos/sin buffers every attention layer keeps (Stack.rope_cache_buffers,
    or the transformers release of the hf and deepspeed stacks: transformers_facts); 0: none."""
    reentrant: bool = False
    """Activation checkpointing runs with use_reentrant=True (Stack.reentrant, or the transformers
    release of the hf and deepspeed stacks: transformers_facts)."""
    block_kernels: str = "torch"
    """What runs the blocks' norms, RoPE and gated activation (one of BLOCK_KERNELS)."""
    peft_banks: tuple[str, ...] = ()
    """The 4.x expert and router names peft moved onto the model's 3-D expert banks and router weight
    (peft_bank_names): LoRA on every MoE layer's banks and router, through ParamWrapper."""
    expert_linears: bool = False
    """A MoE model's routed experts and router are nn.Linear modules in the job's code (Stack.expert_linears,
    or the transformers release of the hf and deepspeed stacks): JobConfig.shape is laid out so."""
    shared_bank: bool = False
    """A MoE layer's shared experts are one 3-D bank of a single expert (torchtitan < 0.2.0, train.torchtitan):
    JobConfig.shape is laid out so (ModelShape.shared_bank)."""
    kbit_prepared: bool = False
    """peft's prepare_model_for_kbit_training ran on the quantized base (peft 0.13.2 utils/other.py: every
    fp16/bf16 parameter that is not a Params4bit becomes fp32), then TRL's peft_module_casting_to_bf16
    (trl/trainer/utils.py: modules named *norm* to fp32, embed_tokens and lm_head back to bf16). So each
    RMSNorm multiplies an fp32 weight (an fp32 output); bitsandbytes' Linear4bit takes its compute dtype from
    its first input (0.43.3 nn/modules.py set_compute_type) and returns `out.to(inp_dtype)`, so a block's
    projections of fp32 norm outputs are fp32, and the block adds them into the residual stream: fp32 from the
    first block's output on (activations.block_facts). Modelled under autocast only (TRL's bf16=True)."""
    fsdp1_checkpoint_around_unit: bool = False
    """A reentrant checkpoint around each block's FSDP1 unit (Stack.checkpoint_around_unit): the unit's first
    forward runs under no_grad and registers no pre-backward hook, so backward gathers each unit twice (for its
    recompute, then in its pre-backward hook) and prefetches none (torch/distributed/fsdp/_runtime_utils.py
    _register_pre_backward_hooks: not when grad is disabled; _pre_backward_hook's prefetch follows
    _needs_pre_backward_unshard). Elsewhere BACKWARD_PRE prefetching lets the host run up to two blocks ahead
    of the GPU (the limiter's two all-gathers in flight)."""
    quantized_load_16bit_on_gpu: bool = False
    """Where the stack quantizes the 4-bit base on each rank's GPU while loading (Stack.quantized_load_on_gpu),
    the model's 16-bit parameters are loaded onto that GPU too, before the FSDP wrap (the hf stack's
    transformers before 4.45: TransformersFacts.quantized_load_16bit_on_gpu); else they reach it in the wrap."""
    fsdp1_keeps_block_inputs: bool = False
    """FSDP1 keeps every block's input and that input's gradient until backward ends. A block's FSDP unit
    holds only frozen weights (Stack.lora_units), so FSDP1's pre-forward registers a multi-grad hook on the
    unit's inputs that require grad, to reshard after their gradients exist, and stores its handle on the
    flat parameter until _finalize_params removes it when backward ends (torch/distributed/fsdp/
    _runtime_utils.py _register_post_backward_reshard_only_hook). register_multi_grad_hook keeps each
    input's grad_fn in the hooks' closure (torch/autograd/graph.py `grad_fns`); for a leaf that is its
    AccumulateGrad node, which holds the tensor. Under a reentrant checkpoint around the unit
    (Stack.checkpoint_around_unit) the unit first runs under no_grad, and in backward its recompute gets
    detach_variable's leaf copies of the inputs (torch/utils/checkpoint.py CheckpointFunction.backward),
    whose .grad the nested backward fills and the function returns: the input's storage and its gradient
    then stay alive, through a reference cycle across C++ (tensor, hook dict, closure, AccumulateGrad,
    tensor), until that removal. Counted on CPU: benchmarks/hf_fsdp1_kept_inputs_cpu.py."""
    logits_fp32: bool = False
    """The logits reach the loss as fp32 because the loop's wrapper casts the model's outputs
    (Stack.outputs_fp32), at a 16-bit compute dtype, for a loss the loop computes from them (chunked, native,
    fp32-upcast): the log-softmax is fp32, no per-chunk copy is made, and kept logits are 4 B."""
    fused_proj: bool = False
    """The model's fused projections run as such (ModelShape.fused_proj, Phi-3's qkv_proj and gate_up_proj): one
    adapter each, and q, k, v and gate, up are views of their outputs. Only a transformers model's (resolve:
    torchtune, litgpt, podkit's model and bin/smoke's replica run five linears)."""
    logit_softcap: float = 0.0
    """The cap the model's forward soft-caps the logits with before the loss (Stack.logit_softcap and the
    model's ModelShape.logit_softcap; 0: none). A fused or Liger loss takes the cap inside its kernel and makes
    no logits (Liger's LigerForCausalLMLoss `softcap`, Cut Cross-Entropy's `softcap`)."""
    loss_autocast: bool = False
    """The loss's cross-entropy runs under autocast: in the model's forward under accelerate's native AMP
    (a transformers model at a -mixed precision, DeepSpeed's engine aside: accelerate 1.0.1 accelerator.py
    l.506-514, l.1413-1424), elsewhere inside the job's autocast (podkit's loop computes the loss in the
    model's forward). On CUDA cross_entropy is on no autocast list and runs as nll_loss(log_softmax(x, dim,
    x.dtype)) (aten LossNLL.cpp cross_entropy_loss), and nll_loss is on the fp32 list (autocast_mode.h
    AT_FORALL_FP32): on 16-bit logits it saves an fp32 cast of the log-softmax output beside it."""
    repeat_kv: bool = False
    """Grouped-query k/v are copied out to every head before attention (Stack.repeat_kv, or the transformers
    release of the hf and deepspeed stacks and whether a mask reaches SDPA: repeats_kv)."""
    sdpa_contiguous: bool = False
    """transformers' SDPA path makes q, k and v contiguous before the kernel (4.48.0 to 4.55.x
    integrations/sdpa_attention.py `value = value.contiguous()`, 4.55.4 l.72-74; gone in 4.56.2): a v sliced
    from Phi-3's fused qkv output (fused_proj) is copied out, and the kernel keeps the copy, not the whole output."""
    attn_mask: AttentionMask | None = None
    """The attention mask the model builds for SDPA's full-attention layers (attention_mask); None: SDPA runs
    causal without one, or every layer slides (sliding_mask)."""
    sliding_own: bool = False
    """The model's sliding-window layers (ModelShape.sliding_layers) get a mask of their own, priced as such
    (sliding_attention_mask: transformers >= 4.53 under SDPA); elsewhere they are priced as the other layers."""
    sliding_mask: AttentionMask | None = None
    """With sliding_own, the mask the sliding-window layers get; None: they run causal without one."""
    sliding_repeat_kv: bool = False
    """repeat_kv as a sliding-window layer sees it (with a mask, SDPA gets k/v repeated to every head)."""
    flash_repad: bool = False
    """transformers' flash-attn path unpads a padded batch and pads the output back into a new tensor
    (modeling_flash_attention_utils._flash_attention_forward: `pad_fn(out, indices_q, batch_size, query_length)`,
    flash_attn.bert_padding.pad_input's IndexPutFirstAxis: zeros, then index_put): o_proj's input is a copy, not a
    view of what the varlen kernel saved."""
    rs_input_on_rs_stream: bool = False
    """FSDP2 before torch 2.5: foreach_reduce allocated the fp32 reduce-scatter input inside `with
    torch.cuda.stream(reduce_scatter_stream)`, so that stream's pool caches the largest inputs too."""

    def layer(self, sliding: bool) -> "JobFacts":
        """The facts as one kind of layer sees them: a sliding-window layer has its own mask and k/v repeat."""
        if not (sliding and self.sliding_own):
            return self
        return dataclasses.replace(self, attn_mask=self.sliding_mask, repeat_kv=self.sliding_repeat_kv)

    @property
    def masks(self) -> tuple[AttentionMask, ...]:
        """The attention masks the model builds once per forward: the full-attention layers', the sliding ones'."""
        return tuple(m for m in (self.attn_mask, self.sliding_mask if self.sliding_own else None) if m)

    @property
    def bnb_unsupported(self) -> bool:
        """bitsandbytes' blockwise 8-bit states cannot follow FSDP-sharded or CPU-offloaded parameters."""
        return self.bnb_optimizer and (self.fsdp or self.offloaded)


def targeted(module: str, targets) -> bool:
    """peft's rule for a target_modules list: a module is adapted when its name is a target or ends
    with "." + a target (peft tuners_utils check_target_module_exists)."""
    return any(module == t or module.endswith("." + t) for t in targets)


# peft moves LoRA on a transformers 5.x MoE's routed experts and router onto the 3-D expert banks and the router's
# weight (LoraConfig.target_parameters: tuners/lora/layer.py ParamWrapper) for the model types whose transformers
# weight-conversion pattern is mixtral or qwen2_moe (peft utils/transformers_weight_conversion.py
# _convert_peft_config_moe, _MOE_TARGET_MODULE_MAPPING; its _MODEL_TO_CONVERSION_PATTERN is transformers' own plus
# mixtral, and transformers 5.23 conversion_mapping.py maps qwen3_moe, olmoe, deepseek_v2/v3 to qwen2_moe but has
# no entry for qwen2_moe itself). The 4.x names it moves leave target_modules altogether, so a shared expert's or a
# dense block's gate/up/down_proj loses its adapter too. Listed names from peft 0.19, all-linear from 0.20 (the
# wheels); tests/test_lora_banks.py checks it on the installed peft and transformers.
PEFT_BANK_PATTERN = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "olmoe": "qwen2_moe", "deepseek_v2": "qwen2_moe",
                     "deepseek_v3": "qwen2_moe"}
PEFT_BANK_NAMES = {"mixtral": ("gate", "w1", "w3", "w2"), "qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj")}
PEFT_BANK_FUSED = {"mixtral": ("w1", "w3"), "qwen2_moe": ("gate_proj", "up_proj")}
"""Fused into gate_up_proj: peft adapts both (at twice the rank) or raises for one alone."""


def bank_name(family: str, target: str) -> str | None:
    """The 4.x name a target is moved onto the banks as, matched as peft matches it (_convert_peft_config_moe: the
    name itself or a dotted path ending in it, `mlp.gate_proj` too); None when it stays a module target."""
    names = PEFT_BANK_NAMES.get(PEFT_BANK_PATTERN.get(family, ""), ())
    return next((n for n in names if target == n or target.endswith("." + n)), None)


def peft_bank_names(family: str, value: str | list) -> tuple[str, ...]:
    """The 4.x expert and router names peft moves onto this model's banks for a lora_targets value; () for none."""
    pattern = PEFT_BANK_PATTERN.get(family)
    if not pattern:
        return ()
    names = PEFT_BANK_NAMES[pattern]
    if value == "all-linear":
        return names
    listed = {bank_name(family, t) for t in value} if isinstance(value, list) else set()
    moved = tuple(n for n in names if n in listed)
    fused = PEFT_BANK_FUSED[pattern]
    if moved and 0 < sum(n in moved for n in fused) < len(fused):
        from podkit.checks.errors import ConfigError

        raise ConfigError("train.lora_targets", f"peft adapts {' and '.join(fused)} of this transformers 5 model "
                          "together (fused into gate_up_proj) and refuses one alone", "list both, or neither")
    return moved


def adapted_banks(family: str, moved: tuple[str, ...]) -> tuple[bool, bool, bool]:
    """Which of a MoE layer's gate_up_proj bank, down_proj bank and router weight peft adapts, given the names it
    moved (JobFacts.peft_banks)."""
    if not moved:
        return False, False, False
    router, fused_first, _, down = PEFT_BANK_NAMES[PEFT_BANK_PATTERN[family]]
    return fused_first in moved, down in moved, router in moved


def trl_prepares_kbit(train) -> bool:
    """Whether the job's TRL (train.trl; "" = a current release) runs prepare_model_for_kbit_training on a quantized
    base: releases before 0.26.0. huggingface/trl 2af35fb0d (PR #4577, "Clean up model preparation", first in 0.26.0)
    removed the call from SFTTrainer."""
    return bool(train.trl) and parse_version(train.trl) < (0, 26)


def router_adapter_runs(family: str, transformers: str) -> bool:
    """Whether peft's adapter on a MoE router's weight takes part in the forward. DeepSeek-V2 in transformers 5.0 to
    5.12 keeps its router an nn.Linear `gate` whose weight DeepseekV2Moe.forward reads itself
    (`nn.functional.linear(hidden_states.type(torch.float32), self.gate.weight.type(torch.float32))`, 5.12.0
    modeling_deepseek_v2.py): peft's ParamWrapper adds W + BA only inside its own forward, so the router stays
    frozen and its adapter gets no gradient (measured with peft 0.21.2). 5.13.0 made it DeepseekV2TopkRouter, whose
    forward reads its own weight."""
    if family != "deepseek_v2" or not transformers:
        return True
    return not ((5, 0) <= parse_version(transformers) < (5, 13))


def resolve_targets(value: str | list, linears: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    """The LoRA module target list: "stack" (its default), "all-linear" (peft: every block nn.Linear but the
    head; 3-D expert banks are no modules: peft_bank_names), or names matched as peft matches them."""
    from podkit.checks.errors import ConfigError, closest

    known = linears + ("lm_head",)
    if value == "stack":
        names = linears if default == ("all",) else tuple(t for t in default if any(targeted(m, [t]) for m in linears))
        if not names:
            raise ConfigError("train.lora_targets", f"this model has none of the stack's default targets "
                              f"({', '.join(default)})", "list them, e.g. lora_targets = 'all-linear'")
    elif value == "all-linear":
        names = linears
    elif isinstance(value, list):
        names = tuple(value)
    else:
        raise ConfigError("train.lora_targets", f"unknown value {value!r}",
                          "'stack', 'all-linear' or a list such as [\"q_proj\", \"v_proj\"]")
    if not names:
        raise ConfigError("train.lora_targets", "is empty", "name at least one linear, e.g. [\"q_proj\", \"v_proj\"]")
    for name in names:
        if not any(targeted(m, [name]) for m in known):
            hint = closest(name, known)
            raise ConfigError("train.lora_targets", f"{name!r} is not a linear of this model",
                              hint or "known: " + ", ".join(known))
    return tuple(dict.fromkeys(names))


def lora_on_banks(stack: Stack, train, shape, expert_linears: bool, replica: bool) -> bool:
    """peft's LoRA on a model whose routed experts are 3-D banks (transformers 5.x under the hf/deepspeed stacks)."""
    return (train.lora_rank > 0 and stack.transformers_release and not replica and shape.moe is not None
            and not expert_linears)


def parse_version(text: str) -> tuple[int, ...]:
    """'0.43.2' -> (0, 43, 2); () when it is not a dotted release number."""
    parts = text.strip().split("+")[0].split(".")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return ()


# The oldest transformers release train.transformers accepts: Llama 2's (4.31.0). Before it Llama's
# rotary tables were built in fp32 whatever the model's dtype (4.28-4.30 modeling_llama.py: no .to(dtype)).
TRANSFORMERS_OLDEST = (4, 31)


# The families whose 4.38-4.39 model builds its SDPA mask whatever the attention_mask (LlamaModel and GemmaModel
# _update_causal_mask; "" is a model of explicit dimensions, built as a Llama). Mistral, Mixtral and Qwen2 of those
# releases go through _prepare_4d_causal_attention_mask_for_sdpa, which skips an unpadded or absent one.
MASK_ALWAYS_4_38 = ("", "llama", "gemma")


@dataclass(frozen=True)
class AttentionMask:
    """The attention mask a transformers model builds for SDPA, and what it costs (JobFacts.attn_mask)."""

    elem_bytes: int
    """Bytes per value of the mask built once per forward: 1 for transformers >= 4.53's boolean mask
    (masking_utils.py sdpa_mask: a (b, 1, q, kv) bool tensor), else the embeddings' dtype (the additive mask
    of min_dtype values: 4.40-4.52 _update_causal_mask / modeling_attn_mask_utils.py
    _prepare_4d_causal_attention_mask_for_sdpa, `dtype=inputs_embeds.dtype`)."""
    shape: str
    """"batch": (b, 1, s, s), the padding folded in; "flat": (1, 1, T, T) over the micro-batch's T = b x s tokens
    flattened into one row (padding-free batches: a block-causal mask from the position_ids); "positions": (b, 1, P, P) over max_position_embeddings P
    (4.38's LlamaModel._update_causal_mask: `self.causal_mask[None, None, :, :].repeat(batch_size, 1, 1, 1)
    .to(dtype) * min_dtype` from a P x P bool buffer); "single": one (s, s) mask expanded over the batch, no
    attention_mask given (fsdp_qlora's loop passes attention_mask=None; 4.39's _update_causal_mask then builds
    `torch.full((sequence_length, target_length), ...)` and only expands it)."""
    layer_copy: bool
    """Every layer's SDPA call makes its own (b, 1, s, s) copy in the query's dtype and its kernel saves it
    for backward: torch converts a boolean mask to an additive one at every call (aten attention.cpp
    scaled_dot_product_attention: convert_boolean_attn_mask, `at::where(mask, 0.0, -inf)` in the query's
    dtype), autocast casts an fp32 mask to the compute dtype at every call (scaled_dot_product_attention is
    on autocast's lower_precision_fp list), and 4.38 indexes the mask with cache_position in each layer
    (`causal_mask[:, :, cache_position, : key_states.shape[-2]]`, a copy). The memory-efficient kernel
    saves it (derivatives.yaml _scaled_dot_product_efficient_attention: attn_bias), as the CPU's flash
    kernel does (checked in tests/test_attention_mask.py)."""

    def shared_elems_per_token(self, seq_len: int, micro_batch: int, positions: int) -> float:
        """Values of the once-per-forward mask per token of the micro-batch."""
        if self.shape == "positions":
            p = max(positions, seq_len)
            return p * p / seq_len
        return {"single": seq_len / micro_batch, "flat": seq_len * micro_batch}.get(self.shape, seq_len)

    def shared_bytes_per_token(self, seq_len: int, micro_batch: int, positions: int) -> float:
        """Bytes of the once-per-forward mask per token of the micro-batch."""
        return self.shared_elems_per_token(seq_len, micro_batch, positions) * self.elem_bytes

    def row(self, seq_len: int, micro_batch: int) -> int:
        """Values per token of the (b, 1, s, s) mask SDPA sees in a layer: one row (of a flattened row's T tokens)."""
        return seq_len * micro_batch if self.shape == "flat" else seq_len

    def layer_values_per_token(self, seq_len: int, micro_batch: int, kernel: str = "") -> int:
        """Values per token of the mask copy each layer's SDPA keeps, 0 for none: its own conversion or cast
        (layer_copy), or, on CUDA's memory-efficient kernel, a copy padded to rows of a multiple of 8 values where
        the mask's rows are not (aten attention.cpp preprocess_mask: `if (!aligned_tensor<8>(mask)) pad_bias`, an
        at::pad then a slice, made inside scaled_dot_product_attention and saved as the kernel's attn_bias)."""
        row = self.row(seq_len, micro_batch)
        if kernel == "efficient" and row % 8:
            return row + (-row % 8)
        return row if self.layer_copy else 0


def attention_mask(stack: Stack, train, family: str, arch: str, autocast: bool, lora: bool) -> AttentionMask | None:
    """The mask the job's transformers model hands SDPA; None where SDPA runs causal without one (is_causal).

    Only the stacks that run a transformers model build one (hf, deepspeed, fsdp_qlora); podkit's replica,
    torchtitan, litgpt and torchtune call SDPA with is_causal and no padding mask. A transformers model skips
    the mask when no token is padded (4.40-4.52 AttentionMaskConverter._ignore_causal_mask_sdpa, >= 4.53
    masking_utils._ignore_causal_mask_sdpa: `padding_mask is None or padding_mask.all()`, query length equal
    to the key length) and builds it otherwise. Llama and Gemma of 4.38-4.39 build it always
    (_update_causal_mask has no skip before 4.40). Sliding-window masks (Mistral v0.1 past 4096 tokens) and
    the eager path's are not modelled; GPT-2 keeps its own mask buffer.
    """
    if train.attention != "sdpa" or arch != "llama" or not (stack.transformers_release or stack.name == "fsdp_qlora"):
        return None
    e = train.compute_bytes
    emb = 4 if autocast and not lora else e  # inputs_embeds' dtype: fp32 weights under autocast, else the model's
    if stack.name == "fsdp_qlora":
        # fsdp_qlora train.py 50efa1e l.824 `model(batch['input_ids'], labels=..., attention_mask=None)` on
        # transformers 4.39 (its Stack): Llama's _update_causal_mask builds one (s, s) mask and expands it; Mistral's
        # model (train.py wraps MistralDecoderLayer too) calls _prepare_4d_causal_attention_mask_for_sdpa, which
        # returns None for attention_mask=None at equal query and key lengths (4.39.3 modeling_attn_mask_utils.py
        # l.319-356, modeling_mistral.py l.1004): SDPA runs causal.
        return AttentionMask(emb, "single", emb != e) if family in MASK_ALWAYS_4_38 else None
    v = parse_version(train.transformers) if train.transformers else (99,)
    if train.padding == "flattened":
        # TRL's padding-free collator (sft_trainer.py DataCollatorForLanguageModeling padding_free: one row, position_ids,
        # no attention_mask) and SFTTrainer.compute_loss's use_cache=False: >= 4.54 masking_utils
        # _preprocess_mask_arguments then reads the packed sequences off the position_ids (find_packed_sequence_indices)
        # and create_causal_mask builds their block-causal mask with allow_is_causal_skip=False, on torch >= 2.6 (which
        # and_masks needs). Before, SDPA runs causal over the whole row.
        t = parse_version(train.torch) if train.torch else (99,)
        return AttentionMask(1, "flat", True) if v >= (4, 54) and t >= (2, 6) else None
    padded = padded_batches(train)
    always = (4, 38) <= v < (4, 40) and family in MASK_ALWAYS_4_38
    if not (padded or always):
        return None
    if v >= (4, 53):
        return AttentionMask(1, "batch", True)
    if (4, 38) <= v < (4, 39) and always:
        return AttentionMask(emb, "positions", True)
    return AttentionMask(emb, "batch", emb != e)


def sliding_own_mask(stack: Stack, train, shape) -> bool:
    """Whether the job's sliding-window layers get a mask of their own as modelled here (JobFacts.sliding_own):
    transformers >= 4.53 under SDPA. flash-attn takes the window as an argument, no mask; eager's full-size mask
    is not priced either way; podkit's, litgpt's, torchtune's and torchtitan's models are run without a window."""
    if not shape.sliding_layers or train.attention != "sdpa" or shape.arch != "llama" or not stack.transformers_release:
        return False
    # Qwen2-MoE moved to masking_utils and layer_types only in 5.0.0 (4.53-4.57 modeling_qwen2_moe.py builds one
    # additive mask for every layer, the window folded in, in its own _update_causal_mask).
    first = (5, 0) if shape.family == "qwen2_moe" else (4, 53)
    return (parse_version(train.transformers) if train.transformers else (99,)) >= first


def past_window(train, shape) -> bool:
    """The sequence reaches the sliding window, where a sliding layer gets a mask even unpadded (sliding_attention_mask);
    read with JobFacts.sliding_own."""
    return bool(shape.sliding_layers) and train.seq_len >= shape.sliding_window


def sliding_attention_mask(train, shape) -> AttentionMask | None:
    """The mask a transformers >= 4.53 model builds for its sliding-window layers (ModelShape.sliding_layers), where
    sliding_own_mask; None where they run causal without one.

    masking_utils.create_sliding_window_causal_mask hands sdpa_mask local_size=sliding_window, and
    _ignore_causal_mask_sdpa skips the mask only while `kv_length < local_attention_size` (4.53.0 l.214 through
    5.23.0 l.301): from seq_len = window on, a sliding layer gets a boolean (b, 1, s, s) mask even when nothing is
    padded: the collators' all-ones attention_mask is folded in (sdpa_mask: `and_masks(mask_function,
    padding_mask_function(padding_mask))`), measured in tests/test_sliding_window.py. A batch given no attention_mask at
    all gets one (1, 1, s, s) mask expanded over the batch instead, priced here as the larger. A padding-free row gets
    it over all its T tokens. SDPA converts it in every layer that takes it (AttentionMask.layer_copy). Releases
    before 4.53 (Gemma 2's own sliding mask in its decoder layer, Mistral's _update_causal_mask with sliding_window)
    are not modelled here: memory.estimate says so."""
    v = parse_version(train.transformers) if train.transformers else (99,)
    if train.padding == "flattened":
        t = parse_version(train.torch) if train.torch else (99,)
        # >= 4.54 with torch >= 2.6 reads the packed sequences off position_ids and builds the mask with
        # allow_is_causal_skip=False; before, the row of T tokens is one sequence to it, masked past the window.
        if (v >= (4, 54) and t >= (2, 6)) or train.seq_len * train.micro_batch >= shape.sliding_window:
            return AttentionMask(1, "flat", True)
        return None
    return AttentionMask(1, "batch", True) if padded_batches(train) or past_window(train, shape) else None


def padded_batches(train) -> bool:
    """The micro-batch's sequences are padded to its longest (train.padding; "stack": the Trainer's and TRL's
    collators pad a batch of more than one)."""
    return train.padding == "padded" or (train.padding == "stack" and train.micro_batch > 1)


def repeats_kv(stack: Stack, train, mask: AttentionMask | None) -> bool:
    """Whether grouped-query k/v are copied out to every head before attention. transformers >= 4.54 hands SDPA
    the grouped k/v with enable_gqa=True when there is no mask and torch >= 2.5 (integrations/sdpa_attention.py
    use_gqa_in_sdpa, PR #39412); with a mask, on older releases and on the eager path it repeats them (repeat_kv)."""
    if not stack.transformers_release:
        return stack.repeat_kv
    v = parse_version(train.transformers) if train.transformers else (99,)
    t = parse_version(train.torch) if train.torch else (99,)
    return not (train.attention == "sdpa" and v >= (4, 54) and t >= (2, 5) and mask is None)


@dataclass(frozen=True)
class TransformersFacts:
    """The facts of the hf and deepspeed stacks that changed between transformers releases, each read
    in that release's own source (its PyPI wheel); the lines are cited in transformers_facts."""

    loss: str
    adamw_impl: str
    reentrant: bool
    rope_buffers: bool
    expert_linears: bool
    checkpoint_around_unit: bool
    quantized_load_16bit_on_gpu: bool
    loss_in_model: bool = False
    """The model's forward upcasts the logits and computes the loss itself (<= 4.45), so their order of
    allocation and freeing differs from ForCausalLMLoss's though the bytes price alike (JobFacts.loss_in_model)."""


def transformers_facts(version: str, torch: str, family: str) -> TransformersFacts:
    """The facts of a transformers release ("" = a current one) under a torch release ("" = current),
    for a model of this model_type ("" = explicit dimensions, a Llama)."""
    v = parse_version(version) if version else (99,)
    # Loss. <= 4.45 LlamaForCausalLM.forward: `logits = logits.float()`, shift_logits = logits[..., :-1, :]
    # .contiguous(), CrossEntropyLoss (4.45.0 modeling_llama.py l.1219-1229), and the Trainer drops
    # `outputs` when compute_loss returns: per logit 4 (fp32 logits, the 16-bit ones freed by .float())
    # + 4 (shifted copy) + 4 (log-softmax) at the forward peak, 3 x 4 at log_softmax's backward: the
    # same 12 B allocated and 2 + 3 x 4 B of segments as fp32-upcast (max(2 + 4 + 4, 3 x 4)), so it is
    # priced as that. 4.46.0 moved the loss to loss/loss_utils.py ForCausalLMLoss (l.36-46: upcast, then
    # the shifted copy, while the 16-bit logits live on in `outputs`): 2 + 4 + 4 + 4 = 14 B. 4.49.0 pads
    # the labels instead (l.39 `labels = nn.functional.pad(labels, (0, 1), value=ignore_index)`).
    loss = "fp32-upcast-shifted" if (4, 46) <= v < (4, 49) else "fp32-upcast"
    # GPT-2 kept its own loss through 4.48: `shift_logits = lm_logits[..., :-1, :].contiguous()` and
    # CrossEntropyLoss on the compute-dtype copy, no upcast (4.45.2 modeling_gpt2.py l.1338-1349, the same in
    # 4.48.1 l.1090-1094); 4.49.0 calls self.loss_function (ForCausalLMLoss, l.1089).
    if family == "gpt2" and v < (4, 49):
        loss = "compute-shifted"
    # Trainer's default optim: "adamw_hf" (transformers' own AdamW, a Python loop over parameters) until
    # PR #25109 made it "adamw_torch" in 4.32.0; PR #37358 (4.54.0 training_args.py l.1286-1291):
    # "adamw_torch_fused" when is_torch_greater_or_equal_than_2_8 (pytorch_utils.py: "2.8", accept_dev).
    # "adamw_torch" is torch.optim.AdamW without foreach/fused arguments: foreach on CUDA. adamw_hf is
    # priced as torch's for-loop (the importers' mapping): it makes one temporary per tensor (4.31.0
    # optimization.py l.468 `denom = exp_avg_sq.sqrt().add_(eps)`), torch's two, so one largest tensor high.
    t = parse_version(torch) if torch else (99,)
    impl = "for-loop" if v < (4, 32) else "fused" if v >= (4, 54) and t >= (2, 8) else "foreach"
    # gradient_checkpointing_enable's default kwargs: {} in 4.37.2 (torch's checkpoint default, which is
    # use_reentrant=True through torch 2.13), {"use_reentrant": True} in 4.39.3 (modeling_utils.py l.2115)
    # through 4.57.1, {"use_reentrant": False} from 5.0.0 (l.3099).
    reentrant = v < (5,)
    # Rotary cos/sin tables of max_position_embeddings x head_dim registered as non-persistent buffers
    # by every attention layer's rotary module, in torch.get_default_dtype() at construction:
    #   Llama  cos_cached/sin_cached (4.37.2 modeling_llama.py l.145-146); none in 4.38.0-4.38.1; _cos_cached/
    #          _sin_cached "for BC" in 4.38.2-4.40.x (4.39.3 modeling_llama.py l.104-113); none from 4.41.0
    #   Mistral cos_cached/sin_cached through 4.41.x (4.41.2 modeling_mistral.py l.104-115), none from 4.42.0
    #   Qwen2  cos_cached/sin_cached through 4.44.x (4.44.2 modeling_qwen2.py l.150-161), none from 4.45.0
    #   Mixtral cos_cached/sin_cached through 4.47.x (4.47.1 modeling_mixtral.py l.200-201), none from 4.48.0
    # Other model types keep only inv_freq (Gemma's 4.38-4.39 rotary has no table).
    if family in ("", "llama"):
        rope = v < (4, 38) or (4, 38, 2) <= v < (4, 41)
    elif family == "mistral":
        rope = v < (4, 42)
    elif family == "qwen2":
        rope = v < (4, 45)
    elif family == "mixtral":
        rope = v < (4, 48)
    else:
        rope = False
    # Routed experts: an nn.ModuleList of gated MLPs of nn.Linear and an nn.Linear router `gate` through
    # 4.57.1 (modeling_mixtral.py l.57-97 MixtralBlockSparseTop2MLP w1/w2/w3; qwen2_moe, qwen3_moe, olmoe,
    # deepseek_v2/v3 the same, DeepSeek's router a bare Parameter); 5.0.0 holds them as 3-D Parameters
    # (modeling_mixtral.py l.63-72 MixtralExperts gate_up_proj / down_proj, l.102-108 MixtralTopKRouter).
    experts = v < (5,)
    # Where the checkpoint sits. Through 4.51.3 every decoder model's loop checkpoints the layer's call
    # (modeling_mistral.py 4.48.1 l.548-559 `self._gradient_checkpointing_func(decoder_layer.__call__, ...)`),
    # so an FSDP unit around the layer runs inside the checkpoint. PR #37223 (4.52.0, modeling_layers.py
    # GradientCheckpointingLayer.__call__ l.45-48: `self._gradient_checkpointing_func(partial(super().__call__,
    # **kwargs), *args)`) moved it into the layer, under FSDP's forward, for the families in
    # CHECKPOINTING_LAYER_4_52 (read in the 4.52.1 wheel); PR #38913 (4.53.0) for the others but DeepSeek-V2,
    # which transformers builds only from 4.54.0 (modeling_deepseek_v2.py l.403 `class
    # DeepseekV2DecoderLayer(GradientCheckpointingLayer)`): before that it runs the hub's own modeling code,
    # whose loop checkpoints the layer's call.
    around = v < checkpointing_layer_release(family)
    # A quantized model loaded under FSDP's CPU-efficient loading: its 16-bit parameters (embedding, head,
    # norms) go where the bitsandbytes quantizer's device map ({"": current device}) puts them, the GPU,
    # through 4.44.2 (modeling_utils.py _load_state_dict_into_meta_model l.952-961: set_module_tensor_to_device
    # with param_device); 4.45.0 sends them to the CPU on local rank 0 and to meta elsewhere first (4.45.2
    # l.969-970 `if is_fsdp_enabled(): param_device = "cpu" if is_local_dist_rank_0() else "meta"`), and the
    # FSDP wrap moves them.
    load_16bit_on_gpu = v < (4, 45)
    # <= 4.45 Llama-style models compute the loss in their forward (above); GPT-2's own loss is compute-shifted.
    in_model = v < (4, 46) and family != "gpt2"
    return TransformersFacts(loss, impl, reentrant, rope, experts, around, load_16bit_on_gpu, in_model)


# The model families whose decoder layer is a GradientCheckpointingLayer in transformers 4.52 (each
# modeling_<type>.py of the 4.52.1 wheel; "" = explicit dimensions, built as a Llama). Mixtral, Qwen2-MoE,
# Qwen3-MoE, OLMoE, Gemma 2 and 3 and GPT-2 followed in 4.53.0.
CHECKPOINTING_LAYER_4_52 = ("", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "deepseek_v3")


def checkpointing_layer_release(family: str) -> tuple[int, int]:
    """The first transformers release whose decoder layer of this family (as `hf_family` names it) checkpoints
    inside itself (see transformers_facts)."""
    return (4, 52) if family in CHECKPOINTING_LAYER_4_52 else (4, 54) if family == "deepseek_v2" else (4, 53)


def hf_family(shape) -> str:
    """The model_type whose transformers code the hf and deepspeed stacks run: a model of explicit dimensions
    is built as a Llama, or as GPT-2 when its arch says so."""
    return shape.family if shape.arch == "llama" else "gpt2"



# What bin/smoke's replica (train/model.py, step.py, parallel.py) cannot reproduce of a stack: each
# Stack field it leaves out, and what the replica does instead. Everything else (loss, checkpointing
# policy, LoRA targets/dtype/dropout, optimizer kernel, k/v repeat, reentrant recompute, peft's input
# cast) it has an option for, so its run measures those facts as the prediction prices them.
REPLICA_LEAVES_OUT = {
    "previous_outputs_kept": "the previous step's outputs are not kept bound into the next forward",
    "fused_qkv": "q, k and v are three linears, not views of one fused output",
    "quant_from_fp16": "the 4-bit base is quantized from the compute dtype, not from fp16",
    "quantize_head": "the LM head stays 16-bit",
    "fsdp_init_on_device": "sharding is FSDP2's fully_shard per block, not FSDP1's wrap",
    "lora_units": "LoRA weights shard inside their block, not as their own FSDP units",
    "quantized_load_on_gpu": "the 4-bit base is not loaded through transformers' quantizer",
    "fsdp_no_sync": "gradient accumulation reduce-scatters every micro-step (no no_sync)",
    "rope_cache_buffers": "no rotary cos/sin buffers",
    "deepspeed_engine": "fp32 weights and gradients with torch's optimizer, not DeepSpeed's 16-bit engine",
    "kbit_prepare": "the quantized base's norms stay in the compute dtype (no prepare_model_for_kbit_training)",
    "checkpoint_around_unit": "blocks' inputs and their gradients are freed after each block's backward (FSDP2, not "
                              "FSDP1's reshard hooks under a checkpoint around the unit)",
}


def replica_stack(stack: Stack) -> Stack:
    """The stack as bin/smoke's replica runs it: its model- and loop-level facts, podkit's FSDP2."""
    return dataclasses.replace(stack, fsdp2=True, **{name: False for name in REPLICA_LEAVES_OUT})


def left_out(train, cluster, facts: JobFacts) -> list[str]:
    """What the replica's run of this job does not reproduce, where it matters to this job."""
    stack = STACK_FACTS[train.stack]
    fsdp_only = ("fsdp_init_on_device", "lora_units", "fsdp_no_sync")
    quant_only = ("quant_from_fp16", "quantize_head", "quantized_load_on_gpu")
    out = []
    for name, text in REPLICA_LEAVES_OUT.items():
        on = (facts.previous_outputs_kept if name == "previous_outputs_kept" else facts.rope_cache_bytes
              if name == "rope_cache_buffers" else facts.kbit_prepared if name == "kbit_prepare"
              else facts.fsdp1_keeps_block_inputs if name == "checkpoint_around_unit"
              else getattr(stack, name))
        if not on or (name in fsdp_only and facts.fsdp_version != 1) or (
                name in quant_only and train.base_quant == "none") or (name == "lora_units" and not facts.lora) or (
                name == "fsdp_no_sync" and train.grad_accum == 1):
            continue
        out.append(f"{name}: {text}")
    if facts.fused_proj:
        out.append("fused_proj: Phi-3's qkv_proj and gate_up_proj run as five linears, each with its own adapter")
    if cluster.offload == "optimizer":
        out.append("offload 'optimizer': FSDP2's CPUOffloadPolicy offloads the parameters too (run as 'all')")
    return out


def gpt_oss_runnable(train, stack: Stack) -> None:
    """GPT-OSS is priced as transformers 5.x runs it (modeling_gpt_oss.py, read in 5.23): refused where podkit would
    price something else. No torch SDPA kernel takes its sinks: GptOssPreTrainedModel._supports_sdpa = False, so
    from_pretrained(attn_implementation="sdpa") raises and a load that names none runs eager. transformers 4.55-4.57
    ran its experts in a loop over the hit experts in training (GptOssExperts.forward), with no grouped_mm."""
    from podkit.checks.errors import ConfigError

    if not stack.transformers_release:
        raise ConfigError("train.stack", f"podkit prices GPT-OSS as transformers runs it, not as {stack.name!r} "
                          "builds it", "use stack = 'hf' or 'deepspeed'")
    if train.transformers and parse_version(train.transformers) < (5,):
        raise ConfigError("train.transformers", f"GPT-OSS under transformers {train.transformers} (its 4.x experts "
                          "loop) is not modelled", "leave it unset or give a 5.x release (read in 5.23)")
    if train.attention == "sdpa":
        raise ConfigError("train.attention", "transformers has no SDPA path for GPT-OSS's attention sinks "
                          "(GptOssPreTrainedModel._supports_sdpa = False: attn_implementation='sdpa' raises; "
                          "a load that names none runs eager)",
                          "set attention = 'eager' (its default) or 'flash-attn' (kernels-community/vllm-flash-attn3, "
                          "whose backward leaves the sinks untrained)")


def resolve(train, cluster, shape, replica: bool = False) -> JobFacts:
    """Derive the job's facts from its train and cluster sections (already validated) and the model;
    `replica`: as bin/smoke's replica runs it (replica_stack)."""
    stack = replica_stack(STACK_FACTS[train.stack]) if replica else STACK_FACTS[train.stack]
    arch = shape.arch
    stack_loss, stack_impl, reentrant = stack.loss, stack.adamw_impl, stack.reentrant
    loss_in_model = False
    rope_buffers, expert_linears = stack.rope_cache_buffers, stack.expert_linears
    around_unit = stack.checkpoint_around_unit
    load_16bit_on_gpu = stack.quantized_load_on_gpu
    if stack.transformers_release:
        # The transformers model and Trainer facts of the job's release (train.transformers).
        tf = transformers_facts(train.transformers, train.torch, hf_family(shape))
        stack_loss, reentrant, rope_buffers, expert_linears = tf.loss, tf.reentrant, tf.rope_buffers, tf.expert_linears
        loss_in_model = tf.loss_in_model
        around_unit = tf.checkpoint_around_unit
        load_16bit_on_gpu = load_16bit_on_gpu and tf.quantized_load_16bit_on_gpu
        if not stack.deepspeed_engine:
            stack_impl = tf.adamw_impl
    if shape.family == "gpt_oss" and not replica:
        gpt_oss_runnable(train, stack)
    rope_buffers = rope_buffers and not replica  # the replica has none, whichever release decided them
    expert_linears = expert_linears and shape.moe is not None
    # torchtitan before 0.2.0 (pytorch/torchtitan 7354848d, PR #1561) built the shared experts as a
    # GroupedExperts with num_experts=1; the replica runs podkit's model.
    shared_bank = (train.stack == "torchtitan" and not replica and bool(shape.moe and shape.moe.shared_ffn)
                   and bool(train.torchtitan) and parse_version(train.torchtitan) < (0, 2))
    shape = shape.laid_out(expert_linears, shared_bank)
    # The block linears LoRA can adapt as modules, as named in the model (routed experts held as 3-D banks are
    # not nn.Linear modules: peft adapts those through ParamWrapper, peft_bank_names below).
    linears = tuple(dict.fromkeys(g.name for g in shape.linear_groups())) or (
        GPT2_LINEARS if arch == "gpt2" else LLAMA_LINEARS)
    # Phi-3's qkv_proj and gate_up_proj run fused only in a transformers model: torchtune splits both on load
    # (models/phi3/_convert_weights.py phi3_hf_to_tune), litgpt gate_up_proj (scripts/convert_hf_checkpoint.py
    # copy_weights_phi; its qkv is its own, Stack.fused_qkv), podkit's model builds five linears. Such a stack's
    # targets name its five; the replica of a transformers job takes the job's targets, split onto its five.
    runs_fused = shape.fused_proj and (STACK_FACTS[train.stack].transformers_release or train.stack == "fsdp_qlora")
    if shape.fused_proj and not runs_fused:
        linears = split_fused(linears)
    default_targets = stack.lora_targets
    if arch == "gpt2" and default_targets != ("all",):
        default_targets = ("c_attn",)  # peft's mapping for gpt2
    # peft's LoRA on a transformers 5.x MoE's banks and router (peft_bank_names): the targets it moves there are no
    # module targets any more.
    peft_banks = (peft_bank_names(shape.family, train.lora_targets)
                  if lora_on_banks(stack, train, shape, expert_linears, replica) else ())
    value = train.lora_targets
    if peft_banks and isinstance(value, list):
        value = [t for t in value if not bank_name(shape.family, t)]
    if not train.lora_rank or (peft_banks and value == []):
        lora_targets = ()  # no LoRA, or every listed target went to the banks
    else:
        lora_targets = resolve_targets(value, linears, default_targets)
    if peft_banks:
        lora_targets = tuple(t for t in lora_targets if not bank_name(shape.family, t))
    if runs_fused and replica:
        lora_targets = split_fused(lora_targets)
    lora = train.lora_rank > 0
    fsdp = cluster.sharding in ("zero2", "zero3")
    mixed = train.mixed
    # Autocast only happens where fp32 weights sit on the GPU: FSDP's MixedPrecisionPolicy gathers
    # them in the compute dtype, optimizer offload leaves only compute-dtype weights on the GPU
    # (ZeRO-Offload), and DeepSpeed's bf16/fp16 engine keeps 16-bit module weights with the fp32
    # master copy inside the optimizer (deepspeed/runtime/bf16_optimizer.py).
    autocast = mixed and not fsdp and cluster.offload == "none" and not stack.deepspeed_engine
    if train.checkpointing == "none":
        ac = "none"
    elif train.checkpointing == "full":
        ac = "block"
    else:
        ac = stack.selective
    loss = stack_loss if train.loss == "stack" else train.loss
    native = stack_loss == loss  # the stack's own loss: its chunking, upcast and lifetime
    chunk_tokens = stack.loss_chunk_tokens if loss == "chunked" else 0
    # A chunked loss asked of a stack that has none: torchtune's 8 chunks, upcast per chunk.
    chunks = (stack.loss_chunks or (0 if chunk_tokens else 8)) if loss == "chunked" else 0
    upcast = stack.loss_upcast if native else loss in ("fp32-upcast", "fp32-logits-kept", "fp32-upcast-shifted",
                                                       "chunked")
    kept = stack.logits_kept if native else loss == "fp32-logits-kept"
    # Where the loss runs under autocast (JobFacts.loss_autocast): a transformers model computes it in its
    # forward, which accelerate's native AMP wraps in autocast whenever the precision is mixed, DeepSpeed's
    # engine aside (accelerate 1.0.1 accelerator.py l.506-514 `self.native_amp`, l.1413-1424 prepare_model);
    # elsewhere the job's own autocast, unless the loop casts the logits to fp32 first (Stack.outputs_fp32).
    loss_autocast = ((mixed and not stack.deepspeed_engine) if stack.transformers_release and not replica
                     else autocast and not stack.outputs_fp32)
    logits_fp32 = stack.outputs_fp32 and train.compute_bytes != 4 and loss in ("chunked", "native", "fp32-upcast")
    if loss == "compute-shifted":
        # Its cross_entropy upcasts only through nll_loss under autocast (loss_bytes: compute-shifted).
        upcast = loss_autocast
        kept = False
    # The stack's AdamW kernel; torch SGD defaults to foreach on CUDA (torch/optim/optimizer.py
    # _default_to_fused_or_foreach: fused only when asked for), as podkit's train/optim.py also asks.
    default_impl = stack_impl if train.optimizer == "adamw" else "foreach"
    impl = default_impl if train.optimizer_impl == "stack" else train.optimizer_impl
    lora_dtype = stack.lora_dtype if train.lora_dtype == "stack" else train.lora_dtype
    # FSDP by version where podkit models it: the stack's own, or the one the job names (accelerate's
    # fsdp_version). FSDP1 needs the stack's wrap facts (fsdp_init_on_device: fsdp_qlora, hf).
    fsdp_version = (2 if stack.fsdp2 else 1 if stack.fsdp_init_on_device else 0)
    if cluster.fsdp_version != "stack" and not replica:
        from podkit.checks.errors import ConfigError

        if cluster.fsdp_version == 1 and not stack.fsdp_init_on_device:
            raise ConfigError("cluster.fsdp_version", f"stack {stack.name!r} does not shard with FSDP1 here",
                              "leave it at 'stack' (FSDP1 is modelled for the hf and fsdp_qlora stacks)")
        if cluster.fsdp_version == 2 and stack.name in ("deepspeed", "fsdp_qlora"):
            raise ConfigError("cluster.fsdp_version", f"stack {stack.name!r} has no FSDP2",
                              "leave it at 'stack'")
        fsdp_version = cluster.fsdp_version
    if train.block_kernels == "liger" and arch == "gpt2":
        from podkit.checks.errors import ConfigError

        raise ConfigError("train.block_kernels", "Liger patches Llama-style blocks (RMSNorm, RoPE, SwiGLU); a GPT-2 "
                          "block has none of them", "leave it at 'torch'")
    if train.block_kernels == "liger" and ac in ("matmuls", "op-sac"):
        from podkit.checks.errors import ConfigError

        # torch.utils.checkpoint's selective policy caches the matmul outputs and hands the same storage
        # back in recompute; LigerRopeFunction rotates q and k inside them (Triton stores, no version bump),
        # so the recompute would rotate them a second time.
        raise ConfigError("train.block_kernels", "Liger's RoPE rotates q and k in place inside the matmul outputs "
                          "a selective checkpoint caches, so its recompute would rotate them twice",
                          "use checkpointing = 'full' or 'none' with Liger's kernels")
    # The stack's default applies where podkit models it: under autocast (TRL's bf16=True, which casts the
    # embeddings and head back). Without it the prepared model runs every matmul in fp32: not modelled.
    kbit = (train.kbit_prepare == "on" or (train.kbit_prepare == "stack" and stack.kbit_prepare and autocast
                                           and train.base_quant != "none" and trl_prepares_kbit(train)))
    if kbit and not autocast and not replica:
        from podkit.checks.errors import ConfigError

        raise ConfigError("train.kbit_prepare", "podkit models prepare_model_for_kbit_training as TRL runs it, with "
                          "autocast (bf16-mixed or fp16-mixed, the whole base on each GPU, nothing offloaded)",
                          "use precision 'bf16-mixed' without FSDP sharding, or set kbit_prepare = 'off'")
    old_bnb_4bit = (train.base_quant != "none" and bool(train.bitsandbytes)
                    and parse_version(train.bitsandbytes) < (0, 43, 2))
    around = fsdp and fsdp_version == 1 and ac == "block" and reentrant and around_unit
    adapter = (0 if not lora else 4 if lora_dtype == "fp32" or train.compute_bytes == 4
               else 2 if lora_dtype == "compute" or train.pure_16bit else 4)
    if (lora and stack.kbit_prepare and train.lora_dtype == "stack" and train.base_quant != "none"
            and not trl_prepares_kbit(train) and not replica):
        # TRL >= 0.26 SFTTrainer: `if is_loaded_in_4bit or is_loaded_in_8bit: for param in model.parameters():
        # if param.requires_grad: param.data = param.data.to(torch.bfloat16)` (v0.26.0 sft_trainer.py l.715-718).
        adapter = 2
    if train.padding != "stack" and not stack.transformers_release and not replica:
        from podkit.checks.errors import ConfigError

        raise ConfigError("train.padding", f"stack {stack.name!r} calls attention without a padding mask "
                          "(is_causal), so padding does not change its memory",
                          "remove it (it applies to the hf and deepspeed stacks)")
    mask = attention_mask(stack, train, hf_family(shape), arch, autocast, lora)
    sliding_own = sliding_own_mask(stack, train, shape)
    sliding = sliding_attention_mask(train, shape) if sliding_own else None
    if sliding_own and len(shape.sliding_layers) == shape.layers:
        mask = None  # Mistral-style: every layer takes the sliding mask (or none below the window), no full one
    return JobFacts(
        stack=stack,
        loss=loss,
        loss_in_model=loss_in_model and native,
        loss_chunk_tokens=chunk_tokens,
        loss_chunks=chunks,
        loss_upcast=upcast,
        logits_kept=kept,
        ac_policy=ac,
        lora=lora,
        lora_targets=lora_targets,
        peft_banks=peft_banks,
        lora_dtype=lora_dtype,
        adapter_bytes=adapter,
        adapter_compute_bytes=(train.compute_bytes if adapter and ((fsdp and mixed) or stack.deepspeed_engine)
                               and not (stack.deepspeed_engine and cluster.sharding == "zero3") else adapter),
        lora_dropout=train.lora_dropout if lora else 0.0,
        optimizer_impl=impl,
        fsdp=fsdp,
        autocast=autocast,
        grad_scaler=train.grad_scaler == "on" or (train.grad_scaler == "auto" and train.precision == "fp16-mixed"),
        bnb_optimizer=train.optimizer in BNB_OPTIMIZERS,
        torchao_block=(train.optimizer_block or TORCHAO_OPTIMIZERS[train.optimizer].block
                       if train.optimizer in TORCHAO_OPTIMIZERS else 0),
        paged_optimizer=train.optimizer.startswith("paged_"),
        quantize_head=stack.quantize_head and train.base_quant != "none",
        previous_outputs_kept=not replica and (stack.previous_outputs_kept if train.previous_outputs == "stack"
                                               else train.previous_outputs == "kept"),
        # bitsandbytes commit 9e753741 "fix QLoRA mem bug: delete useless buffered activation" (#1270),
        # first in 0.43.2; under a reentrant checkpoint the forward runs in no_grad and keeps nothing.
        # FSDP1's replay and pools (checks/fsdp1.py) apply to the stacks whose wrap facts are known from
        # source (fsdp_qlora, hf via accelerate); other FSDP1 stacks (litgpt's lightning FSDPStrategy)
        # keep the generic model until they are.
        fsdp_version=fsdp_version if fsdp else 0,
        quant_saves_input=(old_bnb_4bit and not (ac != "none" and reentrant)),
        quant_input_in_recompute=old_bnb_4bit and ac != "none",
        offloaded=cluster.offload != "none",
        fsdp_param_cast=fsdp and mixed,
        process_group=cluster.world_size > 1 or cluster.sharding != "none",
        # The default dtype when the model was built: fsdp_qlora train.py 50efa1e builds a QLoRA model
        # with AutoModelForCausalLM.from_config(cfg) (no torch_dtype: float32) and a LoRA/full one with
        # from_pretrained(torch_dtype=...), bfloat16 for --precision bf16 (transformers sets it as the
        # default dtype while the model is constructed, modeling_utils _set_default_torch_dtype).
        # The hf stack loads with from_pretrained(torch_dtype=...): a LoRA/QLoRA base in the compute dtype
        # (podkit's frozen base, memory.frozen_groups), a full fine-tune in its parameters' dtype (fp32
        # masters unless pure 16-bit). DeepSpeed's 16-bit engine holds the module in the compute dtype,
        # buffers included (runtime/engine.py _configure_distributed_model: module.bfloat16() / .half()).
        rope_cache_bytes=(0 if not rope_buffers or not shape.rope_positions
                          else (4 if train.base_quant != "none" or not train.pure_16bit else 2)
                          if not stack.transformers_release
                          else train.compute_bytes if lora or stack.deepspeed_engine
                          else train.param_bytes),
        reentrant=reentrant,
        block_kernels=train.block_kernels,
        expert_linears=expert_linears,
        shared_bank=shared_bank,
        kbit_prepared=kbit and not replica,
        # pytorch PR #129721 "[FSDP2] Ran reduce-scatter copy-in in default stream" (2024-06-27, after
        # the 2.4 branch cut) moved the input's allocation out of the reduce-scatter stream.
        rs_input_on_rs_stream=(fsdp and fsdp_version == 2 and bool(train.torch)
                               and parse_version(train.torch) < (2, 5)),
        # pytorch PR #101982 "[FSDP] Reshard frozen params in backward" (2023-06, first in 2.1.0) added the
        # reshard-only hook; before it a frozen unit stayed gathered through backward instead.
        fsdp1_checkpoint_around_unit=around,
        quantized_load_16bit_on_gpu=load_16bit_on_gpu and train.base_quant == "nf4",
        logits_fp32=logits_fp32,
        logit_softcap=shape.logit_softcap if stack.logit_softcap and loss not in ("fused", "liger") else 0.0,
        fused_proj=runs_fused and not replica,
        loss_autocast=loss_autocast and train.compute_bytes != 4,
        fsdp1_keeps_block_inputs=(around and lora and stack.lora_units
                                  and (not train.torch or parse_version(train.torch) >= (2, 1))),
        repeat_kv=repeats_kv(stack, train, mask),
        sdpa_contiguous=(stack.transformers_release and train.attention == "sdpa" and bool(train.transformers)
                         and (4, 48) <= parse_version(train.transformers) < (4, 56)),
        attn_mask=mask,  # the replica builds it too (train/model.py ModelOptions.attn_mask)
        sliding_own=sliding_own,
        sliding_mask=sliding,
        sliding_repeat_kv=repeats_kv(stack, train, sliding),
        flash_repad=(stack.transformers_release and train.attention == "flash-attn" and padded_batches(train)),
    )
