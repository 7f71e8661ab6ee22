"""The traced estimate: podkit's smoke step at full size, on a CPU, under fake tensors.

`trace(job)` builds the job's model on the meta device, materialises it as fake CPU tensors
(torch._subclasses.fake_tensor.FakeTensorMode: shapes, dtypes and storages, no data), and runs
`steps` optimizer steps of train/step.py, the very step bin/smoke runs, while a TensorCounter
(train/memprobe.py) counts every storage an op creates, rounded as the CUDA caching allocator
rounds it. The last step is measured: the peak during forward (with the loss), backward and the
optimizer step, and what is live at the boundaries, split into params / grads / optimizer /
activations (forward allocations, incl. the loss) / temporaries (backward and step allocations).

Why own code rather than torch.distributed._tools.mem_tracker.MemTracker (what torchtitan's
scripts/estimate/estimation.py uses): MemTracker rounds to 512 B only for storages on a "cuda"
device, and ours must live on the CPU (fake "cuda" tensors abort on a CPU-only torch build); the
phases and categories podkit compares with checks/memory.py are its own. Like MemTracker it
patches UntypedStorage.resize_, through which FSDP2 allocates and frees unsharded parameters.

What the CPU run changes and how it is put back to what the target GPU does:
- Autocast runs as torch.autocast("cpu"). CPU and CUDA autocast op lists differ (CUDA's fp32 list
  has softmax, log_softmax, cross_entropy, nll_loss, pow, rsqrt, sum; CPU's lower-precision list
  has more convolution and bmm variants), but every op of the smoke model whose dtype matters is
  cast explicitly or agrees in both lists: linear/matmul/mm run in the compute dtype in both, the
  RMSNorm, softmax (eager) and cross-entropy inputs are upcast with .float() in the model itself.
  Both cache casts of leaf fp32 weights that require grad (aten/src/ATen/autocast_mode.cpp
  cached_cast), so the weight cache is traced as CUDA keeps it.
- SDPA: the model calls the aten kernel the target GPU would pick (ModelOptions.sdpa_kernel from
  checks/kernels.py attention_kernel, the choice the analytic model makes, after
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); their meta kernels give the saved
  tensors' shapes, and flash attention's backward workspace
  (flash_api.cpp mha_bwd: dq_accum, softmax_d, expanded dk/dv under GQA) is added to the peak.
- FSDP2 (zero2/zero3): a fake process group (torch.testing._internal.distributed.fake_pg.FakeStore,
  backend "fake", rank 0) of the job's world size, fully_shard exactly as train/parallel.py does.
- DDP (world > 1, no FSDP): gradient_as_bucket_view=True makes every gradient a view into DDP's
  buckets, which exist from construction; emulated as one flat bucket per dtype.
- Autograd's input buffer adds a tied weight's two gradients in place only into a tensor it may
  steal, and never for a tensor subclass or under a dispatch mode (input_buffer.cpp
  can_accumulate_inplace): fake tensors always take `old_var + var`. On a GPU that is also what
  happens without autocast; with autocast the head's gradient is a fresh fp32 copy that the GPU
  sums in place, so the trace runs that one sum as add_ (_tied_gradient_sum).
- bitsandbytes' 8-bit AdamW calls C kernels through ctypes, which fake tensors cannot feed: its
  state layout (bitsandbytes/optim/optimizer.py Optimizer2State.init_state) is allocated by an
  emulation and its in-place kernel is a no-op here. torchao's low-bit AdamW compiles its step
  (torch.compile), which fake tensors here do not run: its states (stacks.LowBitAdam) are allocated
  the same way.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from podkit.checks.config import JobConfig
from podkit.checks.errors import ConfigError
from podkit.checks.stacks import BNB_OPTIMIZERS, TORCHAO_OPTIMIZERS, LowBitAdam
from podkit.checks.kernels import attention_kernel
from podkit.train import model as model_mod
from podkit.train import optim as optim_mod
from podkit.train import parallel
from podkit.train import step as step_mod
from podkit.train.memprobe import PhasePeaks, TensorCounter, cuda_block_bytes

PHASES = ("forward", "backward", "step")
MARKS = ("step_start", "forward_end", "grads_ready", "step_end")
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
aten = torch.ops.aten


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def flash_backward_workspace(func, args) -> int:
    """Bytes flash attention's backward allocates and frees inside the kernel call (flash-attn 2
    csrc/flash_attn/flash_api.cpp mha_bwd, vendored by torch): softmax_d (b, h, s_q rounded to 128)
    fp32, dq_accum (b, s_q rounded, h, d rounded to 32 (64 above 128)) fp32, and under GQA dk/dv
    expanded to every query head in the input dtype."""
    if func is not aten._scaled_dot_product_flash_attention_backward.default:
        return 0
    grad_out, q, k = args[0], args[1], args[2]
    b, h, s, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    s_r = _round_up(s, 128)
    d_r = _round_up(d, 32 if d <= 128 else 64)
    total = cuda_block_bytes(4 * b * h * s_r) + cuda_block_bytes(4 * b * s_r * h * d_r)
    if hk != h:
        total += 2 * cuda_block_bytes(q.element_size() * b * sk * h * d)
    return total


# ---------------------------------------------------------------- optimizers fake tensors can step


class _EmulatedStates(torch.optim.Optimizer):
    """An optimizer that makes its states on a parameter's first step (_init_state) as the library does, and
    stands for the library's in-place update with a plain SGD step: what is counted is the states."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                p.add_(p.grad, alpha=-group["lr"])
        return None

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError


class EmulatedBnbAdamW(_EmulatedStates):
    """bitsandbytes AdamW's state, allocated as Optimizer2State.init_state does
    (bitsandbytes/optim/optimizer.py, 0.4x): 32-bit (paged_adamw) two fp32 states; 8-bit tensors
    under min_8bit_size = 4096 elements keep two fp32 states, larger ones two uint8 states, an fp32
    absmax per block of 256 and the shared 256-entry quantization maps. Paged: states of 1e5+
    elements live in CUDA managed memory, outside the allocator's statistics (get_state_buffer),
    so they are not counted. The update kernel works in place: no step temporaries."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, paged: bool = False, bits: int = 8,
                 states: int = 2):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.paged, self.bits = paged, bits
        self.states = states  # 2: AdamW (Optimizer2State); 1: Lion (Optimizer1State, same init_state rules)
        self.qmaps: dict[str, torch.Tensor] = {}

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        n = p.numel()
        state["step"] = 0
        paged_out = self.paged and n >= 1e5
        if n < 4096 or self.bits == 32:
            if not paged_out:
                state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                if self.states == 2:
                    state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if not self.qmaps:
            self.qmaps = {name: torch.zeros(256, dtype=torch.float32, device=p.device) for name in ("dynamic", "udynamic")}
        blocks = -(-n // 256)
        if not paged_out:
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self.qmaps["dynamic"]
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        if self.states == 2:
            if not paged_out:
                state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            state["qmap2"] = self.qmaps["udynamic"]
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)


class EmulatedTorchaoAdamW(_EmulatedStates):
    """torchao's low-bit AdamW state, allocated as _AdamBase._new_buffer does (torchao/optim/adam.py, v0.18.0):
    per state, codes, block scales and a lookup table for a local tensor (an FSDP2 DTensor's shard) that passes
    LowBitAdam's test, else zeros_like it. Its compiled update is a no-op stand-in (priced without temporaries,
    checks/memory.py _step_transient)."""

    def __init__(self, params, low_bit: LowBitAdam, block: int, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.low_bit, self.block = low_bit, block

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        for name in ("exp_avg", "exp_avg_sq"):
            state.update({f"{name}.{i}": t for i, t in enumerate(self._new_buffer(p))})

    def _new_buffer(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One state's tensors: (codes, scales[, lookup table]) as bytes, or (zeros_like the local tensor,)."""
        from torch.distributed.tensor import DTensor

        local = p.to_local() if isinstance(p, DTensor) else p
        sizes = self.low_bit.state_tensors(local.numel(), local.element_size(), self.block)
        if len(sizes) == 1:
            return (torch.zeros_like(local),)
        return tuple(torch.zeros(n, dtype=torch.uint8, device=local.device) for n in sizes)


class TracedGradScaler(torch.amp.GradScaler):
    """GradScaler whose step skips the found-inf check: reading it (`.item()`) needs data that fake
    tensors do not have. unscale_ and update run unchanged, so their tensors are counted."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


# ---------------------------------------------------------------- the estimate


@dataclass
class PhaseTrace:
    peak: int
    terms: dict[str, int]  # live bytes by category at the peak


@dataclass
class TracedEstimate:
    job: str
    gpu: str
    device_kind: str  # cuda: 512-byte blocks and the GPU's SDPA kernel; cpu: what this CPU allocates
    phases: dict[str, PhaseTrace]
    marks: dict[str, dict[str, int]]  # boundary -> live bytes by category
    sdpa: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].peak)

    def to_json(self) -> dict:
        return {
            "peak": self.peak,
            "peak_phase": self.peak_phase,
            "phases": {name: {"peak": p.peak, "terms": p.terms} for name, p in self.phases.items()},
            "marks": {name: {"total": sum(terms.values()), "terms": terms} for name, terms in self.marks.items()},
            "sdpa": self.sdpa,
            "device_kind": self.device_kind,
            "seconds": round(self.seconds, 2),
            "notes": self.notes,
        }


class TracedPhases(PhasePeaks):
    """PhasePeaks that also sorts live bytes by category: what each phase allocates is counted as
    activations (forward) or temporaries (backward, step) until reclassified."""

    def __init__(self, counter: TensorCounter):
        super().__init__(counter)
        self.splits: dict[str, dict[str, int]] = {}
        self.mark_splits: dict[str, dict[str, int]] = {}

    def mark(self, name: str) -> None:
        if self.enabled and name not in self.marks:
            self.mark_splits[name] = _nonzero(self.probe.by_category)
        super().mark(name)

    def fold_into(self, name: str) -> None:
        if self.enabled and self.probe.window_peak() > self.peaks.get(name, 0):
            self.splits[name] = _nonzero(self.probe.window_split())
        super().fold_into(name)

    def phase(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def run():
            previous = self.probe.category
            self.probe.category = "activations" if name == "forward" else "temporaries"
            try:
                with PhasePeaks.phase(self, name):
                    yield
            finally:
                self.probe.category = previous
                if self.enabled and self.peaks.get(name) == self.probe.window_peak():
                    self.splits[name] = _nonzero(self.probe.window_split())

        return run()


def _nonzero(terms: dict[str, int]) -> dict[str, int]:
    return {k: terms[k] for k in CATEGORIES if terms.get(k)}


def check_traceable(job: JobConfig) -> None:
    """What the tracer cannot run, as one line each."""
    t, c = job.train, job.cluster
    if job.shape.arch != "llama":
        raise ConfigError("model", f"--traced runs the Llama-style smoke model; {job.shape.name} is {job.shape.arch}",
                          "use a llama/mistral/qwen2 preset, hf_config or explicit dimensions")
    if job.shape.replica_gap:
        raise ConfigError("model", f"--traced runs the dense Llama-style smoke model; {job.shape.name} "
                          f"is a {job.shape.replica_gap} model",
                          "use the analytic estimate (bin/preflight without --traced)")
    if t.base_quant != "none":
        raise ConfigError("train.base_quant", f"--traced cannot run bitsandbytes' {t.base_quant} layers on fake tensors",
                          "trace the LoRA twin (base_quant = 'none'), or use the analytic estimate")
    if c.offload != "none":
        raise ConfigError("cluster.offload", "--traced keeps every fake tensor on the CPU, so it cannot tell "
                          "offloaded tensors from GPU ones", "trace with offload = 'none'")


def _fake_world(size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise ConfigError("--traced", "a real process group is already initialised in this process",
                              "run the trace in a process of its own (bin/preflight --traced)")
        if dist.get_world_size() == size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())


def _release_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def _ddp_buckets(model: torch.nn.Module, counter: TensorCounter) -> list:
    """DDP with gradient_as_bucket_view=True: one flat bucket per dtype holds every gradient from
    construction on; each gradient autograd produces is copied into its view and then dropped."""
    params = [p for p in model.parameters() if p.requires_grad]
    handles, buckets = [], []
    for dtype in {p.dtype for p in params}:
        group = [p for p in params if p.dtype == dtype]
        bucket = torch.zeros(sum(p.numel() for p in group), dtype=dtype)
        counter.reclassify(bucket, "grads")
        buckets.append(bucket)
        offset = 0
        for p in group:
            view = bucket[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

            def hook(param, view=view):
                if param.grad is not view:
                    view.copy_(param.grad)
                    param.grad = view
            handles.append(p.register_post_accumulate_grad_hook(hook))
    return buckets


def trace(job: JobConfig, steps: int = 2, device_kind: str = "cuda",
          options: model_mod.ModelOptions | None = None, optimizer_impl: str | None = None) -> TracedEstimate:
    """Run `steps` optimizer steps of the job at full size on fake tensors and measure the last.

    The steps before the last only create the optimizer states (from zero gradients: their forward
    and backward would be the measured step's again), so steps=2 costs one forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if steps < 1:
        raise ConfigError("--steps", f"must be at least 1, got {steps}")
    if device_kind not in ("cuda", "cpu"):
        raise ValueError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    check_traceable(job)
    started = time.perf_counter()
    t, c = job.train, job.cluster
    opts = options or step_mod.model_options(job)
    notes = []
    cuda = device_kind == "cuda"
    sdpa = {}
    if cuda and opts.attention == "flash-attn":
        # The flash-attn package runs the same mha_fwd/mha_bwd kernels as torch's flash backend.
        opts = _replace(opts, attention="sdpa", sdpa_kernel="flash")
        sdpa = {"flash": "attention = flash-attn"}
    elif cuda and opts.attention == "sdpa" and opts.sdpa_kernel == "auto":
        # The kernel the prediction assumes, decided once (checks/kernels.py, after sdp_utils.cpp).
        kernel = attention_kernel(job)
        opts = _replace(opts, sdpa_kernel=kernel, sliding_sdpa_kernel=attention_kernel(job, sliding=True))
        sdpa = {kernel: f"{t.precision} on {job.gpu.name} (sm{job.gpu.sm}), head_dim {job.shape.d_head}"
                + (", k/v repeated" if opts.repeat_kv and job.shape.kv_heads != job.shape.heads else
                   ", grouped-query" if job.shape.kv_heads != job.shape.heads else "")}
    fsdp, world = job.facts.fsdp, c.world_size
    ddp = world > 1 and not fsdp
    counter = TensorCounter(trace_limit=0, block_bytes=cuda_block_bytes if cuda else None,
                            classify=_fsdp_aware if fsdp else _weight_copies, scratch=flash_backward_workspace if cuda else None,
                            substitute=_tied_gradient_sum(job))
    phases = TracedPhases(counter)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as torchtitan's estimation.py: no collector passes in the middle of the count
    try:
        if fsdp or (ddp and c.sharding == "zero1"):
            _fake_world(world)
        model = model_mod.build(job.shape, opts, t.precision)  # meta, outside the fake mode
        if fsdp:
            mixed = model_mod.compute_dtype(t.precision) if job.facts.fsdp_param_cast else None
            parallel.shard(model, c.sharding, "none", mixed)

        counter.category = "params"
        with fake:
            counter.switch_on()
            model.to_empty(device="cpu")  # values are never read: init_weights is not needed
            for tensor in list(model.parameters()) + list(model.buffers()):
                counter.reclassify(tensor, "params")
            buckets = _ddp_buckets(model, counter) if ddp else []
            counter.switch_off()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(lambda q: counter.reclassify(q.grad, "grads") if counter.active else None)
        optimizer = _optimizer(model, job, optimizer_impl or job.facts.optimizer_impl, zero1=ddp and c.sharding == "zero1")
        scaler = TracedGradScaler("cpu") if job.facts.grad_scaler else None
        autocast = job.facts.autocast

        def next_batch():
            shape = (t.micro_batch, t.seq_len)
            return torch.randint(0, job.shape.vocab, shape), torch.randint(0, job.shape.vocab, shape)

        parts = step_mod.StepParts(model, model, optimizer, scaler, params,
                                   lambda: step_mod.autocast_context(autocast, "cpu", t.precision),
                                   next_batch, 1, t.grad_clip)
        with fake:
            counter.switch_on()
            try:
                # Warm-up steps only create the optimizer states: their forward and backward would
                # repeat the measured step's, so the states are made from zero gradients instead.
                counter.category = "optimizer"
                for _ in range(steps - 1):
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                _reclassify_states(optimizer, counter)
                # The measured step. Micro-steps after the second repeat the second exactly
                # (gradients exist and accumulate in place): trace min(2, grad_accum) of them.
                parts.grad_accum = min(2, t.grad_accum)
                counter.category = "activations"
                counter.reset_peak()
                phases.mark("step_start")
                step_mod.optimizer_step(parts, phases)
                _reclassify_states(optimizer, counter)
            finally:
                counter.switch_off()
        del buckets
    finally:
        counter.switch_off()  # a no-op unless the trace failed while counting: leaves resize_ as torch's
        if gc_was_enabled:
            gc.enable()
        if fsdp or ddp:
            _release_world()
    if ddp:
        notes.append(f"DDP over {world} ranks emulated: gradients are views into buckets allocated at construction")
    if job.facts.paged_optimizer:
        notes.append("paged optimizer states (tensors of 1e5+ elements) live in CUDA managed memory, outside these counts")
    phases_out = {name: PhaseTrace(phases.peaks.get(name, 0), phases.splits.get(name, {})) for name in PHASES}
    return TracedEstimate(job=job.shape.name, gpu=job.gpu.name, device_kind=device_kind, phases=phases_out,
                          marks={name: phases.mark_splits[name] for name in MARKS if name in phases.mark_splits},
                          sdpa=sdpa, seconds=time.perf_counter() - started,
                          notes=notes)


def _tied_gradient_sum(job: JobConfig):
    """The in-place sum of a tied weight's two gradients, where a GPU run makes it.

    Autograd's input buffer adds the embedding's gradient into the head's in place when it can steal
    the head's (input_buffer.cpp accumulate, can_accumulate_inplace), which under autocast is
    ToCopyBackward's fresh fp32 tensor; a fake tensor, or any tensor under a dispatch mode, makes it
    take `old_var + var` instead. Only that sum has this signature: two vocab x hidden tensors of the
    parameter dtype added, with grad mode off, while autograd's engine runs a backward (a graph task;
    the optimizer step, also without grad, is left as called)."""
    s = job.shape
    if not (s.tie_embeddings and job.facts.autocast) or job.train.lora_rank:
        return None
    shape, dtype = (s.vocab, s.hidden), torch.float32  # autocast's jobs keep fp32 parameters

    def substitute(func, args, kwargs):
        if (func is aten.add.Tensor and not kwargs and not torch.is_grad_enabled() and len(args) == 2
                and torch._C._current_graph_task_id() != -1
                and all(isinstance(a, torch.Tensor) and tuple(a.shape) == shape and a.dtype == dtype for a in args)):
            return args[0].add_(args[1])
        return None

    return substitute


def _reclassify_states(optimizer, counter: TensorCounter) -> None:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                counter.reclassify(value, "optimizer")


def _weight_copies(func, args, counter: TensorCounter) -> str | None:
    """A dtype copy of a parameter (autocast's weight cache) is parameter memory."""
    if func is aten._to_copy.default and args and isinstance(args[0], torch.Tensor):
        if counter.category_of(args[0].untyped_storage()) == "params":
            return "params"
    return None


# FSDP2's functions (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, _fsdp_param.py)
# whose allocations are gathered parameters, or gradients on their way to the reduce-scatter.
_FSDP_PARAMS = frozenset({"foreach_all_gather", "foreach_all_gather_copy_out", "init_all_gather_outputs",
                          "init_unsharded_param", "all_gather_copy_in_meta", "all_gather_copy_in_cuda"})
_FSDP_GRADS = frozenset({"foreach_reduce", "foreach_reduce_scatter_copy_in"})


def _fsdp_aware(func, args, counter: TensorCounter) -> str | None:
    """_weight_copies, plus FSDP2's buffers by the function that allocates them."""
    import sys

    frame = sys._getframe(2)
    for _ in range(30):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in _FSDP_PARAMS:
            return "params"
        if name in _FSDP_GRADS:
            return "grads"
        frame = frame.f_back
    return _weight_copies(func, args, counter)


def _optimizer(model, job: JobConfig, impl: str, zero1: bool):
    t = job.train
    if job.facts.bnb_optimizer:
        groups = optim_mod.param_groups(model, t.weight_decay)
        states, bits = BNB_OPTIMIZERS[t.optimizer]
        return EmulatedBnbAdamW(groups, lr=t.lr, paged=job.facts.paged_optimizer, bits=bits, states=states)
    if job.facts.torchao_block:
        groups = optim_mod.param_groups(model, t.weight_decay)
        return EmulatedTorchaoAdamW(groups, TORCHAO_OPTIMIZERS[t.optimizer], job.facts.torchao_block, lr=t.lr)
    return optim_mod.build_optimizer(model, t.optimizer, t.lr, t.weight_decay, torch.device("cpu"),
                                     zero1=zero1, impl=impl)


def _replace(opts: model_mod.ModelOptions, **changes) -> model_mod.ModelOptions:
    import dataclasses

    return dataclasses.replace(opts, **changes)


def gib(n: int) -> float:
    return n / (1 << 30) if n else 0.0

