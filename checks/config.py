"""The job config: one TOML file read once into typed, validated dataclasses.

Every command reads the same file. Unknown keys are errors (a typo such as `micro_bacth` must
not silently fall back to a default), and every error names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import stat
import sys
try:
    import tomllib
except ImportError:  # Python 3.10 (SageMaker's conda envs): the same parser, as a package
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podkit.checks import gpus, models, stacks
from podkit.checks.errors import ConfigError, closest


@dataclass(frozen=True)
class Precision:
    """What one train.precision stores and computes in, decided here once: prediction and run read it
    through TrainConfig (dtype, mixed, pure_16bit, param_bytes), never by testing the name."""

    dtype: str
    """The compute dtype, matmul inputs and outputs: fp32 | fp16 | bf16."""
    autocast: bool
    """fp32 master weights cast to the compute dtype op by op (torch.autocast): the -mixed precisions."""

    @property
    def pure_16bit(self) -> bool:
        """Weights, gradients and torch optimizers' states all in the 16-bit dtype: no fp32 master copy."""
        return self.dtype != "fp32" and not self.autocast


PRECISION = {
    "fp32": Precision("fp32", False),
    "fp16-mixed": Precision("fp16", True),
    "bf16-mixed": Precision("bf16", True),
    "bf16": Precision("bf16", False),
    # Pure fp16: lightning's 16-true (HalfPrecision), axolotl's float16, a model loaded in float16 and
    # trained without autocast; no sm80 needed, and no loss scaling (torch's GradScaler refuses fp16
    # gradients: torch/amp/grad_scaler.py _unscale_grads_, "Attempting to unscale FP16 gradients.").
    "fp16": Precision("fp16", False),
}
PRECISIONS = tuple(PRECISION)
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit", "paged_adamw", "lion", "lion8bit", "sgd", "adafactor",
              *stacks.TORCHAO_OPTIMIZERS)
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("sdpa", "flash-attn", "eager")
BASE_QUANT = ("none", "int8", "nf4")
SHARDING = ("none", "zero1", "zero2", "zero3")
OFFLOAD = ("none", "optimizer", "all")
GRAD_SCALER = ("auto", "on", "off")
# Keys whose value may be a TOML array of strings as well as a string.
LIST_KEYS = {"lora_targets", "sinks"}
COUNT_OR_WORD_KEYS = {"reduce_bucket", "fsdp_version"}  # a word ("default", "auto", "stack") or a whole number
SINKS = ("tensorboard", "wandb")

EXAMPLE_JOB = Path(__file__).parent / "examples" / "llama-3.2-1b-a10g.toml"


def _choice(section: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest(str(value), choices)
        raise ConfigError(f"{section}.{key}", f"unknown value {value!r}", hint or "one of " + " | ".join(choices))


# The largest integer a job field takes: past it a count is no count (TOML allows 64 bits, and one past 2**53
# is no longer exact as the JSON double the reports and plots read: numpy gave up on 1e23 steps).
MAX_INT = 2**53


def _finite(section: str, obj) -> None:
    """TOML has nan and inf; no field of a job means either (a nan lr trains minutes, then fails), nor an
    integer past MAX_INT."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name}", f"must be a finite number, got {value}",
                              f"give a number, or drop the key for its default ({f.default})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ConfigError(f"{section}.{f.name}", f"{value} is too large to be meant",
                              f"give a realistic value, or drop the key for its default ({f.default})")


def _positive(section: str, key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{section}.{key}", f"must be at least 1, got {value}")


@dataclass
class ModelConfig:
    """Which model: a preset, a config.json, explicit dimensions, or only a parameter count."""

    preset: str = ""
    """Name of a published architecture (see `checks.models.PRESETS`)."""
    hf_config: str = ""
    """Path to a Hugging Face config.json, relative to the job file."""
    hf: str = ""
    """A Hugging Face Hub repo id, e.g. "Qwen/Qwen3-8B": its config.json, through huggingface_hub's cache."""
    params: float = 0.0
    """Total parameter count, for a model known only by size; shapes are then inferred."""
    hidden: int = 0
    """Explicit dimensions (all of hidden, layers, heads, ffn, vocab are needed together)."""
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means as many as heads."""
    ffn: int = 0
    vocab: int = 0
    tie_embeddings: bool = False
    """The LM head shares the embedding matrix."""
    head_dim: int = 0
    """0: hidden // heads."""
    qkv_bias: bool = False
    arch: str = "llama"
    """llama (RMSNorm, RoPE, SwiGLU, GQA) or gpt2 (LayerNorm, learned positions, GELU)."""
    name: str = ""
    """Display name for explicit dimensions."""
    max_position_embeddings: int = 0
    """With explicit dimensions: the config's max_position_embeddings (0: not given). Only the transformers
    releases that keep rotary cos/sin tables that long as buffers size memory by it (train.transformers)."""

    def __post_init__(self):
        _finite("model", self)
        dims = [k for k in ("layers", "heads", "kv_heads", "ffn", "vocab", "head_dim", "max_position_embeddings")
                if getattr(self, k)]
        for key in dims + ["hidden"] * bool(self.hidden):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}", f"must be a positive integer, got {getattr(self, key)}")
        if self.params < 0:
            raise ConfigError("model.params", f"must be a parameter count, got {self.params}", "e.g. 8.03e9")
        if dims and not self.hidden:
            raise ConfigError("model.hidden", f"explicit dimensions ({', '.join(dims)}) given without hidden",
                              "add model.hidden, or use a preset / hf_config instead")
        sources = [bool(self.preset), bool(self.hf_config), bool(self.hf), bool(self.params), bool(self.hidden)]
        if sum(sources) == 0:
            raise ConfigError(
                "model", "no model given",
                "set model.preset, model.hf_config, model.hf, model.params or explicit dimensions"
            )
        if sum(sources) > 1:
            raise ConfigError(
                "model", "more than one of preset, hf_config, hf, params and explicit dimensions given",
                "keep exactly one"
            )

    def shape(self, base_dir: Path = Path(".")) -> models.ModelShape:
        if self.preset:
            return models.preset(self.preset)
        if self.hf_config:
            path = Path(self.hf_config)
            return models.from_hf_config(path if path.is_absolute() else base_dir / path)
        if self.hf:
            return models.from_hf_hub(self.hf)
        if self.params:
            return models.from_param_count(self.params)
        missing = [k for k in ("layers", "heads", "ffn", "vocab") if not getattr(self, k)]
        if missing:
            raise ConfigError(
                "model", f"explicit dimensions lack {', '.join(missing)}", "give hidden, layers, heads, ffn and vocab"
            )
        return models.ModelShape(
            self.name or "custom", self.hidden, self.layers, self.heads, self.kv_heads or self.heads,
            self.ffn, self.vocab, self.tie_embeddings, arch=self.arch, head_dim=self.head_dim,
            qkv_bias=self.qkv_bias,
            # GPT-2's positions are a learned table (GPT2Config n_positions, default 1024, as hf_config reads it);
            # a RoPE model's max_position_embeddings only sizes the rotary caches some releases keep.
            **({"positions": self.max_position_embeddings or 1024} if self.arch == "gpt2"
               else {"rope_positions": self.max_position_embeddings}),
        )


@dataclass
class TrainConfig:
    """How the model is trained: precision, optimizer, batch, memory-saving choices."""

    precision: str = "bf16-mixed"
    """fp32 | fp16-mixed (autocast + loss scaling) | bf16-mixed (autocast, fp32 master weights) | bf16 (pure:
    weights, gradients and optimizer states in bf16) | fp16 (pure fp16, no loss scaling: T4/V100 and older)."""
    optimizer: str = "adamw"
    """adamw | adamw8bit | paged_adamw8bit | paged_adamw (bitsandbytes 32-bit, paged) | lion | lion8bit
    (bitsandbytes' Lion, 32-bit or 8-bit blockwise state) | sgd (with momentum) | adafactor |
    torchao_adamw8bit | torchao_adamw4bit | torchao_adamw_fp8 (torchao.optim AdamW8bit, AdamW4bit, AdamWFp8:
    blockwise low-bit states, shardable by FSDP2; FP8 needs sm89+)."""
    micro_batch: int = 1
    """Sequences per GPU per forward/backward."""
    grad_accum: int = 1
    """Micro-batches accumulated before each optimizer step."""
    seq_len: int = 2048
    """Tokens per sequence."""
    checkpointing: str = "none"
    """Activation checkpointing: none | selective (keep matmul outputs, recompute the rest) | full."""
    attention: str = "sdpa"
    """sdpa (torch scaled_dot_product_attention) | flash-attn (the package) | eager (materialises s x s scores)."""
    lora_rank: int = 0
    """> 0: LoRA adapters of this rank on the targeted linears (`lora_targets`); the base is frozen."""
    lora_targets: str | list = "stack"
    """LoRA target modules: "stack" (the stack's default: peft and litgpt adapt q_proj and v_proj),
    "all-linear" (every block linear), or a list of names, e.g. ["q_proj", "v_proj", "lm_head"]."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout): saves a mask and the dropped input."""
    lora_dtype: str = "stack"
    """Adapter weights: "stack" | "param" (the precision's trainable dtype) | "fp32" (peft's
    autocast_adapter_dtype) | "compute"."""
    stack: str = "podkit"
    """The library that runs the training step: podkit | hf (transformers Trainer/TRL + peft +
    bitsandbytes) | deepspeed | torchtitan | litgpt | torchtune | fsdp_qlora (Answer.AI's FSDP1 +
    QLoRA train.py). Sets the defaults below."""
    loss: str = "stack"
    """Loss implementation: "stack" | fp32-upcast | fp32-logits-kept | fp32-upcast-shifted | chunked |
    fused | liger | native | compute-shifted (checks/stacks.py LOSSES says what each keeps)."""
    block_kernels: str = "torch"
    """What runs each block's RMSNorm, RoPE and SwiGLU: torch (transformers' modules in PyTorch ops) |
    liger (Liger-Kernel's Triton kernels, as TrainingArguments use_liger_kernel patches them in; pair it
    with loss = "liger" for Liger's fused loss). checks/stacks.py BLOCK_KERNELS says what each keeps."""
    bitsandbytes: str = ""
    """The bitsandbytes release the job runs, when it matters: before 0.43.2 its 4-bit matmul kept every
    input alive until backward (bitsandbytes commit 9e753741, #1270); "" = a current release."""
    torch: str = ""
    """The torch release the job runs, when it matters: before 2.5 FSDP2 allocated each reduce-scatter
    input on its reduce-scatter stream (moved to the default stream by pytorch PR #129721, after the 2.4
    branch cut); "" = a current release. A nightly is named by its release, e.g. "2.4.0"."""
    torchtitan: str = ""
    """The torchtitan release the torchtitan stack runs, when it matters ("" = a current release; a main-branch
    commit is named by the last release before it, e.g. "0.1.0" for July 2025): before 0.2.0 a MoE layer's shared
    experts were one GroupedExperts(num_experts=1), 3-D (1, dim, hidden) Parameters (torchtitan/models/moe.py,
    experiments/llama4/model/moe.py in 0.1.0, until pytorch/torchtitan 7354848d, PR #1561, which made them a
    FeedForward), whose dim 0 of size 1 FSDP2 cannot split (memory.fsdp2_stored)."""
    trl: str = ""
    """The TRL release the hf stack's SFTTrainer runs, when it matters ("" = a current release): before 0.26.0 it
    runs peft's prepare_model_for_kbit_training on a quantized base that is not FSDP-sharded (0.13.0
    sft_trainer.py l.182-233; 0.22-0.25 trl/models/utils.py prepare_peft_model), whose fp32 casts train.kbit_prepare
    describes; from 0.26.0 (huggingface/trl 2af35fb0d, PR #4577) it does not, and casts a quantized model's trainable
    parameters, the adapters, to bf16 instead (sft_trainer.py `param.data = param.data.to(torch.bfloat16)`)."""
    transformers: str = ""
    """The transformers release the hf and deepspeed stacks run, when it matters ("" = a current
    release): it decides the loss path (4.46-4.48 also copy the fp32 logits shifted), the Trainer's
    default AdamW kernel under hf (fused from 4.54 with torch >= 2.8, else foreach; DeepSpeed steps its
    own partitions), the checkpointing default (reentrant before 5.0), where the checkpoint sits (around
    each decoder layer's FSDP unit before 4.52 for Llama, Mistral, Qwen2/3, Gemma, Phi-3 and DeepSeek-V3,
    before 4.53 for Mixtral, the other MoE families, Gemma 2/3 and GPT-2, before 4.54 for DeepSeek-V2) and
    the per-layer rotary cos/sin buffers (Llama <= 4.40 but 4.38.0-4.38.1, Mistral <= 4.41,
    Qwen2 <= 4.44, Mixtral <= 4.47). checks/stacks.py transformers_facts cites each line."""
    previous_outputs: str = "stack"
    """Whether the previous step's outputs (and so its graph) are still bound during a forward:
    "stack" | "kept" (litgpt's fit) | "freed" (also when the peak is a first step, as lit-gpt 2023
    ran its longest batch first)."""
    kbit_prepare: str = "stack"
    """Whether peft's prepare_model_for_kbit_training runs on the quantized base: "stack" (hf: where TRL's
    SFTTrainer runs it, before TRL 0.26 (train.trl), a QLoRA base not sharded by FSDP, with bf16-mixed or
    fp16-mixed) | "on" (your own script calls it) | "off". It
    makes every 16-bit parameter fp32 and TRL casts the embeddings and head back under bf16, so the norms
    stay fp32 and the residual stream turns fp32 after the first block (stacks.JobFacts.kbit_prepared)."""
    padding: str = "stack"
    """Whether a batch's sequences are padded to its longest, so the model gets an attention mask with zeros
    (hf and deepspeed stacks: a transformers model under SDPA then builds a (batch, 1, seq, seq) mask and SDPA
    cannot run its flash kernel): "stack" (padded when micro_batch > 1: the Trainer's and TRL's collators pad
    to the longest) | "padded" | "none" (one sequence per batch, equal lengths, or packed rows with an all-ones
    attention_mask) | "flattened" (TRL's padding-free batches, padding_free or packing with its default 'bfd'
    strategy: the micro-batch flattened into one row with position_ids, for which transformers >= 4.54 builds a
    block-causal mask over all its tokens)."""
    optimizer_impl: str = "stack"
    """torch optimizer kernel: "stack" | fused | foreach | for-loop (foreach keeps full-size temporaries)."""
    optimizer_block: int = 0
    """torchao low-bit AdamW only: values per fp32 scale of its quantized states (the block_size argument);
    0: the class's default (256 for 8-bit and FP8, 128 for 4-bit; HF Trainer's adamw_torch_4bit passes 256)."""
    base_quant: str = "none"
    """Frozen base weights quantized by bitsandbytes (QLoRA): none | int8 | nf4. Needs lora_rank > 0."""
    double_quant: bool = True
    """nf4 with double quantization of the absmax (QLoRA's recipe, bnb_4bit_use_double_quant=True,
    litgpt's bnb.nf4-dq): 0.516 B per weight; false (transformers' default, litgpt's bnb.nf4): 0.5625."""
    grad_scaler: str = "auto"
    """Loss scaling: auto (on for fp16-mixed only) | on | off."""
    global_batch: int = 0
    """Optional: the sequences per optimizer step you intend; checked against micro_batch x grad_accum x GPUs."""
    data_workers: int = 0
    """DataLoader worker processes per GPU."""
    dataset: str = ""
    """Optional path to a local file of token ids; empty: synthetic data."""
    output_dir: str = "runs"
    """Where runs and checkpoints are written (checked for free disk)."""
    lr: float = 3e-4
    """Peak learning rate, reached after warmup_steps and then decayed by a cosine to lr / 10."""
    warmup_steps: int = 10
    """Linear warmup steps (capped at a tenth of the run by bin/smoke)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW, Lion) on matrices; norms and biases are not decayed."""

    def __post_init__(self):
        _finite("train", self)
        _choice("train", "precision", self.precision, PRECISIONS)
        _choice("train", "optimizer", self.optimizer, OPTIMIZERS)
        _choice("train", "checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("train", "attention", self.attention, ATTENTION)
        _choice("train", "base_quant", self.base_quant, BASE_QUANT)
        _choice("train", "grad_scaler", self.grad_scaler, GRAD_SCALER)
        _choice("train", "stack", self.stack, stacks.STACKS)
        _choice("train", "loss", self.loss, ("stack",) + stacks.LOSSES)
        _choice("train", "block_kernels", self.block_kernels, stacks.BLOCK_KERNELS)
        _choice("train", "optimizer_impl", self.optimizer_impl, ("stack",) + stacks.OPTIMIZER_IMPLS)
        _choice("train", "lora_dtype", self.lora_dtype, ("stack",) + stacks.LORA_DTYPES)
        _choice("train", "previous_outputs", self.previous_outputs, ("stack", "kept", "freed"))
        _choice("train", "kbit_prepare", self.kbit_prepare, ("stack", "on", "off"))
        _choice("train", "padding", self.padding, ("stack", "padded", "none", "flattened"))
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError("train.lora_dropout", f"must be in [0, 1), got {self.lora_dropout}", "e.g. 0.05")
        if self.bitsandbytes and not stacks.parse_version(self.bitsandbytes):
            raise ConfigError("train.bitsandbytes", f"{self.bitsandbytes!r} is not a version", "e.g. \"0.42.0\"")
        if self.torch and not stacks.parse_version(self.torch):
            raise ConfigError("train.torch", f"{self.torch!r} is not a version", "e.g. \"2.4.0\"")
        if self.torchtitan and not stacks.parse_version(self.torchtitan):
            raise ConfigError("train.torchtitan", f"{self.torchtitan!r} is not a version", "e.g. \"0.1.0\"")
        if self.trl and not stacks.parse_version(self.trl):
            raise ConfigError("train.trl", f"{self.trl!r} is not a version", "e.g. \"0.25.1\"")
        if self.transformers:
            release = stacks.parse_version(self.transformers)
            if not release:
                raise ConfigError("train.transformers", f"{self.transformers!r} is not a version", "e.g. \"4.39.3\"")
            if release < stacks.TRANSFORMERS_OLDEST:
                raise ConfigError("train.transformers", f"{self.transformers} is older than podkit models",
                                  "give 4.31.0 or later, or leave it empty for a current release")
        if isinstance(self.lora_targets, list) and not all(isinstance(n, str) for n in self.lora_targets):
            raise ConfigError("train.lora_targets", "must be a list of module names", "e.g. [\"q_proj\", \"v_proj\"]")
        for key in ("micro_batch", "grad_accum", "seq_len"):
            _positive("train", key, getattr(self, key))
        if self.lr <= 0:
            raise ConfigError("train.lr", f"must be positive, got {self.lr}")
        for key in ("lora_rank", "global_batch", "data_workers", "warmup_steps", "grad_clip", "weight_decay"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}", f"must not be negative, got {getattr(self, key)}")
        if self.base_quant != "none" and self.lora_rank == 0:
            raise ConfigError(
                "train.base_quant", f"{self.base_quant} base needs adapters to train", "set train.lora_rank, e.g. 16"
            )
        if self.lora_rank == 0:
            # Adapter settings on a full fine-tune were dropped without a word, and the job priced as full.
            for key, default in (("lora_targets", "stack"), ("lora_dropout", 0.0), ("lora_dtype", "stack")):
                if getattr(self, key) != default:
                    raise ConfigError(f"train.{key}", "applies to LoRA adapters, and lora_rank is 0 (a full fine-tune)",
                                      f"set train.lora_rank, e.g. 16, or remove train.{key}")
        if self.optimizer_block < 0:
            raise ConfigError("train.optimizer_block", f"must not be negative, got {self.optimizer_block}",
                              "e.g. 256, or 0 for the optimizer's default")
        if self.optimizer_block and self.optimizer not in stacks.TORCHAO_OPTIMIZERS:
            raise ConfigError("train.optimizer_block", f"sets torchao's block_size, and {self.optimizer} is not a "
                              "torchao optimizer", "remove it, or use " + " | ".join(stacks.TORCHAO_OPTIMIZERS))
        if self.kbit_prepare == "on" and self.base_quant == "none":
            raise ConfigError("train.kbit_prepare", "prepare_model_for_kbit_training prepares a quantized base, "
                              "and this job has none", "set train.base_quant, or leave kbit_prepare at 'stack'")

    @property
    def mixed(self) -> bool:
        return PRECISION[self.precision].autocast

    @property
    def dtype(self) -> str:
        """The compute dtype: fp32 | fp16 | bf16."""
        return PRECISION[self.precision].dtype

    @property
    def pure_16bit(self) -> bool:
        """bf16 or fp16: weights, gradients and optimizer states in the 16-bit dtype, no fp32 masters."""
        return PRECISION[self.precision].pure_16bit

    @property
    def param_bytes(self) -> int:
        """Bytes per trainable weight (and its gradient, and a torch optimizer's state): fp32 masters unless pure 16-bit."""
        return 2 if self.pure_16bit else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (matmul inputs and outputs): 4 for fp32, 2 for bf16/fp16."""
        return 4 if self.dtype == "fp32" else 2


@dataclass
class ClusterConfig:
    """Where it runs: the GPU, how many, how the model is sharded and offloaded."""

    gpu: str = "A10G"
    """GPU catalog name (see `checks.gpus.CATALOG`); on a pod preflight can use the detected one."""
    gpus_per_node: int = 1
    nodes: int = 1
    sharding: str = "none"
    """none (DDP: full replica per GPU) | zero1 (optimizer states) | zero2 (+ gradients) | zero3 (= FSDP full shard)."""
    offload: str = "none"
    """CPU offload: none | optimizer (states, master weights, step on CPU) | all (parameters too; needs zero3)."""
    host_ram_gb: float = 0.0
    """CPU RAM per node in GB; 0: unknown (the offload check is then skipped)."""
    reduce_bucket: str | int = "default"
    """DeepSpeed ZeRO-3 zero_optimization.reduce_bucket_size, in elements: "default" (DeepSpeed's 5e8,
    also what accelerate's generated DeepSpeed config gets), "auto" (the HF Trainer / accelerate fill:
    hidden x hidden) or a number. Stage 3 keeps one contiguous-gradients buffer of that size."""
    fsdp_version: str | int = "stack"
    """Which FSDP shards (sharding zero2/zero3): "stack" (the stack's own: FSDP1 for hf, i.e. accelerate's
    default, and fsdp_qlora; FSDP2 for podkit, torchtitan, torchtune), 1 or 2 (accelerate's
    fsdp_config.fsdp_version, >= 1.6)."""

    def __post_init__(self):
        _finite("cluster", self)
        if self.fsdp_version not in ("stack", 1, 2) or isinstance(self.fsdp_version, (bool, float)):
            raise ConfigError("cluster.fsdp_version", f"must be 'stack', 1 or 2, got {self.fsdp_version!r}",
                              "e.g. fsdp_version = 2 for accelerate's fsdp_version: 2")
        if not (self.reduce_bucket in ("default", "auto")
                or (isinstance(self.reduce_bucket, int) and not isinstance(self.reduce_bucket, bool)
                    and self.reduce_bucket >= 0)):
            raise ConfigError("cluster.reduce_bucket", f"must be 'default', 'auto' or a count of elements >= 0, "
                              f"got {self.reduce_bucket!r}", "e.g. reduce_bucket = 'auto'")
        _positive("cluster", "gpus_per_node", self.gpus_per_node)
        _positive("cluster", "nodes", self.nodes)
        _choice("cluster", "sharding", self.sharding, SHARDING)
        _choice("cluster", "offload", self.offload, OFFLOAD)
        if self.host_ram_gb < 0:
            raise ConfigError("cluster.host_ram_gb", f"must not be negative, got {self.host_ram_gb}")
        if self.offload == "all" and self.sharding != "zero3":
            raise ConfigError(
                "cluster.offload",
                "'all' offloads parameters, which only ZeRO-3/FSDP full sharding can gather back",
                "set cluster.sharding = 'zero3', or offload = 'optimizer'",
            )
        gpus.lookup(self.gpu)  # fail early, with a suggestion, on an unknown name

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class SmokeConfig:
    """The 100-step smoke run."""

    steps: int = 100
    profile_every: int = 10
    """Record memory and speed every this many steps."""
    peak_limit_gb: float = 0.0
    """Fail the verdict when the peak reserved memory exceeds this (GB, 1e9 B); 0: the GPU's memory."""
    min_loss_drop: float = 0.2
    """Pass only when the mean loss of the last tenth of the steps is this fraction below the first loss
    (a quarter of it for LoRA: adapters on the smoke run's random frozen base learn slowly)."""
    seed: int = 0
    sinks: str | list = ""
    """Metric sinks fed the same records as metrics.jsonl: "" (none), "tensorboard", "wandb", or a list
    of them. W&B's key comes from WANDB_API_KEY in the environment (the pod's env file), never the config."""
    wandb_project: str = "podkit"
    """The W&B project runs are logged to."""

    def __post_init__(self):
        _finite("smoke", self)
        names = self.sinks.split(",") if isinstance(self.sinks, str) else self.sinks
        if not all(isinstance(n, str) for n in names):
            raise ConfigError("smoke.sinks", "must be a list of sink names", 'e.g. ["tensorboard"]')
        names = [n.strip() for n in names if n.strip()]
        for name in names:
            _choice("smoke", "sinks", name, SINKS)
        self.sinks = list(dict.fromkeys(names))
        if not self.wandb_project.strip():
            raise ConfigError("smoke.wandb_project", "is empty", "e.g. \"podkit\"")
        _positive("smoke", "steps", self.steps)
        _positive("smoke", "profile_every", self.profile_every)
        if self.peak_limit_gb < 0:
            raise ConfigError("smoke.peak_limit_gb", f"must not be negative, got {self.peak_limit_gb}")
        if not 0 <= self.min_loss_drop < 1:
            raise ConfigError("smoke.min_loss_drop", f"must be in [0, 1), got {self.min_loss_drop}",
                              "e.g. 0.2 for a 20% drop")


@dataclass
class JobConfig:
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    source: str = ""
    """Where it was read from."""
    replica: bool = False
    """The job as bin/smoke's replica runs it (stacks.replica_stack): what its run is compared with."""
    shape: models.ModelShape = field(init=False, repr=False)
    facts: stacks.JobFacts = field(init=False, repr=False)
    """Derived facts (sharding, autocast, loss, checkpointing policy, LoRA targets): decided here once."""

    def __post_init__(self):
        self.shape = self.model.shape(self.base_dir)
        self.facts = stacks.resolve(self.train, self.cluster, self.shape, self.replica)
        self.shape = self.shape.laid_out(self.facts.expert_linears, self.facts.shared_bank)

    def as_replica(self) -> "JobConfig":
        """This job as bin/smoke's replica runs it; stacks.left_out(...) says what that leaves out."""
        if self.cluster.offload != "none" and self.cluster.sharding != "zero3":
            raise ConfigError("cluster.offload", "bin/smoke's replica offloads through FSDP2's CPUOffloadPolicy, which "
                              "moves the parameters too, and only zero3 gathers them back",
                              "set cluster.sharding = 'zero3' to smoke it (preflight predicts it as it is)")
        job = self.replace(cluster={"offload": "all"} if self.cluster.offload == "optimizer" else {})
        job.replica = True
        job.facts = stacks.resolve(job.train, job.cluster, job.shape, True)
        job.shape = job.shape.laid_out(job.facts.expert_linears, job.facts.shared_bank)
        return job

    @property
    def base_dir(self) -> Path:
        """Relative paths in a job file (hf_config, dataset) are relative to the file itself."""
        return Path(self.source).parent if self.source else Path(".")

    def path(self, value: str) -> Path:
        """A path as the job file means it."""
        p = Path(value)
        return p if p.is_absolute() else self.base_dir / p

    @property
    def gpu(self) -> gpus.GpuSpec:
        return gpus.lookup(self.cluster.gpu)

    def replace(self, **sections: dict[str, Any]) -> "JobConfig":
        """A copy with some fields changed, e.g. replace(train={"micro_batch": 1}); re-validated."""
        parts = {}
        for name in ("model", "train", "cluster", "smoke"):
            current = getattr(self, name)
            parts[name] = dataclasses.replace(current, **sections.get(name, {}))
        job = JobConfig.__new__(JobConfig)
        job.model, job.train, job.cluster, job.smoke = parts["model"], parts["train"], parts["cluster"], parts["smoke"]
        job.source, job.replica = self.source, self.replica
        # The model section is unchanged by every lever, so its shape carries over unresolved.
        job.shape = self.shape if "model" not in sections else job.model.shape(job.base_dir)
        job.facts = stacks.resolve(job.train, job.cluster, job.shape, job.replica)
        job.shape = job.shape.laid_out(job.facts.expert_linears, job.facts.shared_bank)
        return job


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "cluster": ClusterConfig, "smoke": SmokeConfig}


def _build(section: str, cls, raw: Any):
    if not isinstance(raw, dict):
        raise ConfigError(section, "must be a table", f"write it as [{section}]")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            elsewhere = [f"[{name}]" for name, other in SECTIONS.items()
                         if name != section and key in {f.name for f in dataclasses.fields(other)}]
            if elsewhere:  # the right key in the wrong table: say where it goes, not every key of this one
                raise ConfigError(f"{section}.{key}", f"unknown key: `{key}` is a {' / '.join(elsewhere)} key",
                                  f"move it under {elsewhere[0]}")
            hint = closest(key, fields)
            raise ConfigError(f"{section}.{key}", "unknown key", hint or "known: " + ", ".join(fields))
        expected = type(fields[key].default)
        if key in LIST_KEYS and isinstance(value, list):
            expected = list
        if key in COUNT_OR_WORD_KEYS:
            expected = type(value)  # the section's own check names the words and the counts it takes
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not expected:
            raise ConfigError(
                f"{section}.{key}", f"must be {expected.__name__}, got {type(value).__name__} {value!r}"
            )
        kwargs[key] = value
    return cls(**kwargs)


# Keys that describe a model given by its dimensions; a preset, config.json, Hub id or parameter count gives them
# itself, so beside one they would be read by nobody (checked on the keys written: `false` is a key too).
SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tie_embeddings", "head_dim", "qkv_bias", "arch",
              "name", "max_position_embeddings")


def _refuse_shape_beside_a_source(model: Any) -> None:
    if not isinstance(model, dict):
        return  # _build says it must be a table
    source = next((k for k in ("preset", "hf_config", "hf", "params") if model.get(k)), None)
    shape = [k for k in SHAPE_KEYS if k in model]
    if source and shape:
        raise ConfigError(f"model.{shape[0]}", f"goes with explicit dimensions, but model.{source} gives the model "
                          "(its own shape is used)", f"drop {', '.join(shape)}, or drop {source} and give hidden, "
                          "layers, heads, ffn and vocab")


def parse_job(text: str, source: str = "<string>") -> JobConfig:
    return JobConfig(**_sections(text, source), source=source)


def _sections(text: str, source: str) -> dict[str, Any]:
    """The TOML read into the four section dataclasses, each field checked; nothing outside the text is read."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{source} is not valid TOML: {exc}", "fix the syntax at that line") from None
    for section in raw:
        if section not in SECTIONS and not isinstance(raw[section], dict):
            owners = [f"[{name}]" for name, cls in SECTIONS.items() if section in {f.name for f in dataclasses.fields(cls)}]
            raise ConfigError(section, "is a key outside any section",
                              f"move it under {owners[0]}" if owners else "put it under [model], [train], [cluster] or [smoke]")
        if section not in SECTIONS:
            hint = closest(section, SECTIONS)
            raise ConfigError(f"[{section}]", "unknown section", hint or "known: " + ", ".join(SECTIONS))
    if "model" not in raw:
        raise ConfigError("[model]", "missing", "add a [model] section, e.g. preset = \"llama-3.2-1b\"")
    _refuse_shape_beside_a_source(raw["model"])
    return {name: _build(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}


# A job file is a few KiB; reading more would be a device or the wrong file (--config /dev/zero).
MAX_JOB_BYTES = 1 << 20


def load_job(path: str | Path) -> JobConfig:
    """A job TOML file, or standard input for `-`."""
    return parse_job(_read_job(path), "<stdin>" if str(path) == "-" else str(path))


def check_job(path: str | Path, source: str = "") -> None:
    """What load_job refuses, less what needs more than this file: a ConfigError for bad TOML, an unknown
    section or key, a bad value. The model is resolved (and with it the stack's facts) only when the job
    gives its shape itself (preset, params, dimensions): a Hub id needs the network (hf_config.from_hub),
    and an hf_config path may name a file only the machine that runs the job has. bin/pod deploy checks
    a job so on the laptop before it touches a pod; the pod's preflight reads the rest.
    `source`: the name messages give the file (default: the path)."""
    source = source or str(path)
    parts = _sections(_read_job(path), source)
    if not (parts["model"].hf or parts["model"].hf_config):
        JobConfig(**parts, source=source)


def _read_job(path: str | Path) -> str:
    """The text of a job file (or of stdin for `-`), refused as one ConfigError when it is none."""
    fix = "give the path to a job TOML file, or - for stdin"
    if not str(path).strip():  # before Path(), which reads '' as '.'
        raise ConfigError("--config", "is empty", fix)
    if str(path) == "-":
        data = sys.stdin.buffer.read(MAX_JOB_BYTES + 1)
        if len(data) > MAX_JOB_BYTES:
            raise ConfigError("--config", f"stdin holds over {MAX_JOB_BYTES >> 20} MiB, not a job file", fix)
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise ConfigError("--config", "stdin is not UTF-8 text", fix) from None
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError("--config", f"{path} is a directory", fix)
        if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
            raise ConfigError("--config", f"{path} is not a regular file", fix)
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_BYTES + 1)
        if len(data) > MAX_JOB_BYTES:
            raise ConfigError("--config", f"{path} is over {MAX_JOB_BYTES >> 20} MiB, not a job file", fix)
        text = data.decode("utf-8-sig")  # a byte-order mark, as Windows editors write, is not the job's
    except UnicodeDecodeError:
        raise ConfigError("--config", f"{path} is not UTF-8 text", fix) from None
    except PermissionError:
        raise ConfigError("--config", f"{path} is not readable (permission denied)", "chmod u+r it, or copy it") from None
    except FileNotFoundError:
        raise ConfigError("--config", f"{path} does not exist", "give the path to a job TOML file") from None
    except IsADirectoryError:
        raise ConfigError("--config", f"{path} is a directory", "give the path to a job TOML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc}") from None
    return text
