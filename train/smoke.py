"""SmokeRun: the job's own configuration for N steps, profiled, ending in a verdict.

The training step in `_train` reads top to bottom like nanoGPT's loop. Memory is measured at
fixed points of step 2, the first step that starts with optimizer states, while the allocator
history (CUDA) or the tensor counter (CPU) records the first MEASURED_STEPS steps; after that
only the monitor's cheap samples run, every profile_every steps.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import logging
import math
import signal
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from podkit.checks import advisor, gpus, memory, rules, stacks
from podkit.checks import strict_json
from podkit.checks.command import stop_signals
from podkit.checks.config import JobConfig
from podkit.checks.errors import ConfigError
from podkit.train import data as data_mod
from podkit.train import model as model_mod
from podkit.train import optim as optim_mod
from podkit.train import parallel
from podkit.train import step as step_mod
from podkit.train.memprobe import OOM_ERROR, PhasePeaks, TensorCounter, is_out_of_memory, make_probe
from podkit.train.monitor import MemoryMonitor, flops_per_token
from podkit.train.outputs import RunDir, env_record, resolved_toml
from podkit.envsetup.secrets import SecretFilter
from podkit.train import plot
from podkit.train.verdict import Verdict, comparison, judge, prediction_warnings

log = logging.getLogger("podkit.smoke")
MEASURED_STEPS = 4  # steps 1..4 recorded in detail; step 3 is measured term by term
FLASH_ATTN_INSTALL = "make deploy installs flash-attn where the GPU supports it (sm80+); or set attention = 'sdpa'"


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


class Interrupted(KeyboardInterrupt):
    """SIGTERM (a pod being stopped, a job killed) or SIGHUP (its terminal closed) handled like Ctrl-C: the
    summary is still written."""


@dataclass
class Fault:
    """A failure injected on purpose (hidden --inject-fault), to test the failure paths end to end."""

    kind: str = ""  # nan | oom
    step: int = 0

    @classmethod
    def parse(cls, text: str) -> "Fault":
        if not text:
            return cls()
        kind, _, step = text.partition(":")
        if kind not in ("nan", "oom") or not step.isdigit():
            raise ConfigError("--inject-fault", f"{text!r} is not KIND:STEP", "e.g. nan:5 or oom:1")
        return cls(kind, int(step))


def pick_device(preference: str) -> torch.device:
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"cuda asked for, but torch {torch.__version__} sees no CUDA GPU "
                          f"(built for CUDA {torch.version.cuda})",
                          "run on a GPU pod (make deploy), or use --device cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_runnable(job: JobConfig, device: torch.device) -> None:
    """Everything that would fail minutes into a run, as one clear line up front."""
    t, c = job.train, job.cluster
    from podkit.train import sinks

    sinks.check(tuple(job.smoke.sinks))
    if t.dataset:  # the whole file, before a process is launched or a step is paid for
        data_mod.check_dataset(str(job.path(t.dataset)), job.shape.vocab, t.seq_len)
    if job.shape.arch != "llama":
        raise ConfigError("model", f"bin/smoke trains Llama-style decoders; {job.shape.name} is {job.shape.arch}",
                          "use a llama/mistral/qwen2 preset, hf_config or explicit dimensions")
    if job.shape.replica_gap:
        raise ConfigError("model", f"bin/smoke's replica is a dense Llama-style decoder; {job.shape.name} is a "
                          f"{job.shape.replica_gap} model", "predict it with bin/preflight")
    need = rules.required_packages(job)
    if "bitsandbytes" in need and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("train.optimizer" if t.base_quant == "none" else "train.base_quant",
                          "needs bitsandbytes, which is not installed here", optim_mod.BNB_INSTALL)
    if t.base_quant != "none" and device.type != "cuda":
        raise ConfigError("train.base_quant", f"{t.base_quant} base layers need a CUDA GPU (bitsandbytes)",
                          "run on a GPU pod, or set base_quant = 'none' for a CPU smoke run")
    if t.attention == "flash-attn":
        if device.type != "cuda":
            raise ConfigError("train.attention", "flash-attn runs on CUDA GPUs only", "use attention = 'sdpa' on CPU")
        if "flash-attn" in need and importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("train.attention", "flash-attn is not installed here", FLASH_ATTN_INSTALL)
    replica = job.as_replica()  # refuses an offload FSDP2's CPUOffloadPolicy cannot run (zero3 only)
    bnb = rules.bnb_sharding(job)
    if bnb.status == rules.FAIL:
        raise ConfigError("train.optimizer", bnb.message, bnb.fix)
    if job.facts.fsdp:
        parallel.fsdp_api()
    if job.shape.kv_heads != job.shape.heads and t.attention == "sdpa" and not _torch_at_least(2, 5):
        raise ConfigError("train.attention", f"torch {torch.__version__} SDPA lacks grouped-query attention",
                          "use torch >= 2.5, or attention = 'eager'")
    if device.type == "cpu":
        # Every process of a CPU run holds its own replica in host RAM: refuse up front what would get
        # a rank killed by the kernel's OOM killer minutes in (and starve the rest of the machine).
        procs = c.gpus_per_node  # torchrun's ranks on this node (one without a process group)
        need = memory.estimate(replica, device="cpu").allocated * procs  # per rank x this node's ranks
        free = host_ram_available()
        if free is not None and need > free:
            raise ConfigError("model", f"a CPU run of this job needs about {need / 2**30:.1f} GiB of RAM "
                              f"({procs} process(es)), and {free / 2**30:.1f} GiB is available here",
                              "run it on a GPU pod (make deploy), or smoke a smaller model or batch on CPU")
    if device.type == "cuda" and c.gpus_per_node > torch.cuda.device_count():
        raise ConfigError("cluster.gpus_per_node", f"{c.gpus_per_node} asked for, this machine has "
                          f"{torch.cuda.device_count()} GPU(s)", "lower cluster.gpus_per_node")


def host_ram_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux's estimate of what new allocations can take without
    swapping); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def installed_versions() -> dict[str, str]:
    """train.torch / train.bitsandbytes for the libraries this process runs (facts that changed
    between their releases, checks/stacks.py)."""
    out = {"torch": torch.__version__.split("+")[0]}
    try:
        out["bitsandbytes"] = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        pass
    return {k: v for k, v in out.items() if stacks.parse_version(v)}


@dataclass
class Measured:
    losses: list[float] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


class SmokeRun:
    def __init__(self, job: JobConfig, device: torch.device, world: parallel.World, run_dir: RunDir | None,
                 fault: Fault = Fault(), rank_metrics: Path | None = None):
        self.job, self.device, self.world, self.run_dir, self.fault = job, device, world, run_dir, fault
        # Ranks other than 0 write only their own records (metrics.rank<N>.jsonl): one memory plot per rank.
        self.rank_metrics = open(rank_metrics, "a") if rank_metrics is not None and run_dir is None else None
        self.t, self.c = job.train, job.cluster
        self.measured = Measured()
        self.verdict: Verdict | None = None
        self.in_lockstep = False
        """Every rank ran every step to the end (no error, OOM or signal): all of them reach the same collectives."""
        self.error = ""
        self.started = time.time()
        # The prediction for this machine: the GPU that is here, the world that runs.
        self.gpu = self._detect_gpu()
        # The job's own world when that is what runs (every node under bin/pod run --nodes), else
        # the processes that are here (one node's, or a torchrun the user sized differently).
        whole = world.size == job.cluster.world_size
        # What runs is podkit's replica with the job's stack facts it can reproduce (checks/stacks.py
        # replica_stack), on the torch and bitsandbytes installed here: that is what the run is compared
        # with, and what it leaves out of the user's stack is said once, in the log and the summary.
        self.left_out = stacks.left_out(job.train, job.cluster, job.facts)
        self.pred_job = job.as_replica().replace(
            cluster={"gpu": self.gpu.name, "nodes": job.cluster.nodes if whole else 1,
                     "gpus_per_node": job.cluster.gpus_per_node if whole else world.size},
            train=installed_versions())
        self.facts = self.pred_job.facts
        if self.left_out and world.rank == 0:
            log.warning("bin/smoke runs podkit's replica of stack %s, compared with the prediction for that "
                        "replica; it leaves out: %s", job.facts.stack.name, "; ".join(self.left_out))
        self.estimate = memory.estimate(self.pred_job, device=device.type)
        self.probe = make_probe(device)
        self.phases = PhasePeaks(self.probe)
        self.monitor: MemoryMonitor | None = None
        self.summary: dict = {}
        self.sinks = None  # train.sinks.Sinks on rank 0 when [smoke] sinks are on

    def _detect_gpu(self) -> gpus.GpuSpec:
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            try:
                return gpus.lookup(name)
            except ConfigError:
                log.warning("%s is not in podkit's GPU catalog: predicting for %s", name, self.c.gpu)
        return self.job.gpu

    # ------------------------------------------------------------------ building
    def _build(self):
        t, c, dev = self.t, self.c, self.device
        fsdp = self.facts.fsdp
        model = model_mod.build(self.job.shape, step_mod.model_options(self.pred_job), t.precision)
        if isinstance(self.probe, TensorCounter):
            self.probe.switch_on()  # count the weights as they are materialised
        if fsdp:
            mixed = model_mod.compute_dtype(t.precision) if self.facts.fsdp_param_cast else None
            parallel.shard(model, c.sharding, c.offload, mixed)
        # Each rank initialises its own shard; DDP then broadcasts rank 0's replica.
        model = model_mod.materialize(model, torch.device("cpu") if c.offload != "none" else dev,
                                      self.job.smoke.seed + (self.world.rank if fsdp else 0))
        self.phases.mark("materialized")
        self.raw_model = model
        if self.world.distributed and not fsdp:
            model = parallel.wrap_ddp(model, dev)
        self.phases.mark("wrapped")
        self.model = model
        total, trainable = model_mod.count_params(self.raw_model)
        self.params, self.trainable = total, trainable
        self.optimizer = optim_mod.build_optimizer(model, t.optimizer, t.lr, t.weight_decay, dev,
                                                   zero1=c.sharding == "zero1" and self.world.distributed,
                                                   impl=self.facts.optimizer_impl, block=self.facts.torchao_block)
        self.autocast = self.facts.autocast
        self.scaler = torch.amp.GradScaler(dev.type) if self.facts.grad_scaler else None
        dataset = str(self.job.path(t.dataset)) if t.dataset else ""
        self.data = data_mod.make_stream(dataset, self.job.shape.vocab, t.seq_len, t.micro_batch,
                                         self.job.smoke.seed, self.world.rank)
        if dev.type == "cuda" and t.precision == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 jobs run on TF32 tensor cores (the catalog's peak)
        log.info("model %s: %s params, %s trainable, on %s (%s)", self.job.shape.name, f"{total:,}",
                 f"{trainable:,}", dev, "FSDP2 " + c.sharding if fsdp else "DDP" if self.world.distributed else "1 process")

    def _amp(self):
        return step_mod.autocast_context(self.autocast, self.device.type, self.t.precision)

    def _batch(self):
        x, y = self.data.next_batch()
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    # ------------------------------------------------------------------ the loop
    def _train(self, steps: int) -> None:
        t = self.t
        model, opt, scaler, mon, phases = self.model, self.optimizer, self.scaler, self.monitor, self.phases
        warmup = min(t.warmup_steps, max(1, steps // 10))
        parts = step_mod.StepParts(model, self.raw_model, opt, scaler, [p for p in model.parameters() if p.requires_grad],
                                   self._amp, self._batch, t.grad_accum, t.grad_clip)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            # Step 3: optimizer states exist (step 1) and DDP has rebuilt its buckets (step 2).
            phases.enabled = step == MEASURED_STEPS - 1
            phases.mark("step_start")
            lr = t.lr * optim_mod.warmup_cosine(step - 1, warmup, steps)
            for group in opt.param_groups:
                group["lr"] = lr
            loss_sum, grad_norm = step_mod.optimizer_step(parts, phases, on_loss=partial(self._inject, step))
            # note: a CPU-GPU sync point, once per step: the NaN check and metrics.jsonl need the value.
            loss_value = parallel.all_reduce_mean(loss_sum.item(), self.device)
            dt = time.perf_counter() - t0
            self.measured.losses.append(loss_value)
            rec = {"step": step, "loss": loss_value, "lr": lr, "step_time": dt,
                   "tokens": t.micro_batch * t.seq_len * t.grad_accum * self.world.size}
            if grad_norm is not None:
                rec["grad_norm"] = float(grad_norm)
            self._record(rec)
            sample = mon.step(loss=loss_value)
            if sample is not None:
                self.measured.samples.append(sample)
                self._record({"profile": sample})
                if self.world.main:
                    log.info("step %d/%d loss %.4f %s", step, steps, loss_value, _brief(sample))
            elif self.world.main and (step == 1 or step == steps):
                log.info("step %d/%d loss %.4f (%.0f ms)", step, steps, loss_value, dt * 1e3)
            if step == MEASURED_STEPS and isinstance(self.probe, TensorCounter):
                self.probe.switch_off()  # its per-op cost would distort the speed figures
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}")

    def _record(self, rec: dict) -> None:
        if self.run_dir:
            self.run_dir.metric(rec)
            if self.sinks is not None:
                self.sinks.record(rec)
        elif self.rank_metrics is not None:
            self.rank_metrics.write(strict_json.dumps(rec) + "\n")
            self.rank_metrics.flush()

    def _inject(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.fault.kind == "nan" and step >= self.fault.step:
            loss = loss * float("nan")
        if self.fault.kind == "oom" and step == self.fault.step:
            raise OOM_ERROR("injected by --inject-fault: CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss

    # ------------------------------------------------------------------ run
    def run(self, steps: int) -> Verdict:
        oom = interrupted = False
        bad_input: ConfigError | None = None
        self._write_start()
        previous = {sig: signal.getsignal(sig) for sig in stop_signals()}
        for sig in previous:  # SIGTERM, and SIGHUP unless it came ignored (checks.command.stop_signals)
            signal.signal(sig, _raise_interrupted)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
        try:
            self._build()
            t = self.t
            tokens = t.micro_batch * t.seq_len * t.grad_accum
            peak_flops = self.gpu.peak_tflops(t.dtype) * 1e12 if self.device.type == "cuda" else 0.0
            embedding = 0 if self.job.shape.tie_embeddings else self.job.shape.vocab * self.job.shape.hidden
            self.monitor = MemoryMonitor(
                every=self.job.smoke.profile_every, device=self.device, tokens_per_step=tokens,
                flops_per_token=flops_per_token(self.job.shape.params, self.job.shape.layers, self.job.shape.q_dim,
                                                t.seq_len, embedding),
                peak_flops=peak_flops, warmup=MEASURED_STEPS, probe=self.probe,
                snapshot_path=self.run_dir.file("snapshot") if self.run_dir else None,
                snapshot_steps=MEASURED_STEPS,
            )
            with self.monitor:
                self._train(steps)
        except KeyboardInterrupt:
            interrupted = True
            self.error = "interrupted (Ctrl-C or SIGTERM)"
        except FloatingPointError as exc:
            self.error = str(exc)
        except ConfigError as exc:  # bad input found late: the run still ends with a final summary
            bad_input = exc
            self.error = str(exc)
        except (Exception, MemoryError) as exc:  # a crash still leaves the logs and a summary saying why
            if is_out_of_memory(exc):
                oom = True
                self.error = (str(exc).splitlines() or [type(exc).__name__])[0] or "MemoryError: out of host memory"
                self._oom_dump()
            elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                where = exc.filename or (self.run_dir.path if self.run_dir else "the output directory")
                self.error = f"disk full (ENOSPC) writing {where}: free space, or use --output-dir on a larger volume"
                log.error("run failed:\n%s", traceback.format_exc(), extra={"file_only": True})
            else:
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("run failed:\n%s", traceback.format_exc(), extra={"file_only": True})
        finally:
            # A second Ctrl-C must not cost the summary: ignore both signals while it is written.
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            if isinstance(self.probe, TensorCounter):
                self.probe.switch_off()
            if self.monitor is not None:
                self.monitor.dump_snapshot()  # a no-op once written
        try:
            try:
                verdict = self._finish(steps, oom, interrupted)
            except Exception as exc:  # never leave summary.json at "running"
                log.error("writing the results failed:\n%s", traceback.format_exc(), extra={"file_only": True})
                verdict = self._final_fallback(f"{self.error + '; ' if self.error else ''}"
                                               f"results not written: {type(exc).__name__}: {exc}", oom)
            if bad_input is not None:
                raise bad_input
            return verdict
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _final_fallback(self, reason: str, oom: bool) -> Verdict:
        """The smallest final summary, when building the full one failed (a full disk, a bug)."""
        verdict = Verdict(status="oom" if oom else "failed", reasons=[reason], checks={})
        self.verdict = verdict
        self.summary = SecretFilter().deep({"status": verdict.status, "reasons": verdict.reasons,
                                            "run_id": self.run_dir.run_id if self.run_dir else None,
                                            "steps": len(self.measured.losses), "predicted": self.estimate.allocated})
        if self.sinks is not None:
            try:
                self.sinks.close(self.summary)
            except Exception as exc:
                log.warning("metric sinks not closed: %s", exc)
        if self.run_dir:
            try:
                self.run_dir.close()
                self.run_dir.write_json("summary", self.summary)
            except OSError as exc:
                log.error("cannot write %s: %s", self.run_dir.file("summary"), exc)
        return verdict

    def _oom_dump(self) -> None:
        if self.monitor is not None:
            self.monitor.dump_snapshot()
        if self.device.type == "cuda" and self.run_dir:
            (self.run_dir.path / "memory_summary.txt").write_text(torch.cuda.memory_summary(self.device))

    def _write_start(self) -> None:
        if not self.run_dir:
            return
        self.run_dir.file("config").write_text(resolved_toml(self.job))
        if self.job.smoke.sinks:
            from podkit.train.sinks import Sinks

            job = {s: {f: getattr(getattr(self.job, s), f) for f in getattr(self.job, s).__dataclass_fields__}
                   for s in ("model", "train", "cluster", "smoke")}
            self.sinks = Sinks(tuple(self.job.smoke.sinks), self.run_dir.path, self.run_dir.run_id,
                               {"job": job, "toml": resolved_toml(self.job)}, self.job.smoke.wandb_project,
                               lambda text: log.warning("%s", text))
        self.run_dir.write_json("summary", {"status": "running", "run_id": self.run_dir.run_id,
                                            "predicted": self.estimate.allocated})

    # ------------------------------------------------------------------ results
    def _finish(self, steps: int, oom: bool, interrupted: bool) -> Verdict:
        if self.rank_metrics is not None:
            self.rank_metrics.close()
            self.rank_metrics = None
        mon = self.monitor.summary() if self.monitor else {}
        peak_alloc = mon.get("peak_allocated")
        peak_reserved = mon.get("peak_reserved")
        self.in_lockstep = not (self.error or oom or interrupted)
        if self.world.distributed and self.in_lockstep:  # a failed rank may not join
            peak_alloc = int(parallel.all_reduce_max(peak_alloc or 0, self.device)) or None
            peak_reserved = int(parallel.all_reduce_max(peak_reserved or 0, self.device)) or None
        limit = self._limit()
        checked_peak = peak_reserved if self.device.type == "cuda" else peak_alloc
        min_drop = self.job.smoke.min_loss_drop
        if self.t.lora_rank:
            # The smoke model is randomly initialised: adapters on a random frozen base (embeddings and
            # head frozen too) learn far more slowly than on a pretrained one.
            min_drop /= 4
        verdict = judge(self.measured.losses, min_drop, checked_peak, limit, steps)
        if oom:
            verdict.status, verdict.reasons = "oom", [self.error]
        elif interrupted:
            verdict.status, verdict.reasons = "interrupted", [self.error]
        elif self.error:
            verdict.status = "failed"
            if self.error not in verdict.reasons:  # judge may have found the same NaN: say it once
                verdict.reasons.insert(0, self.error)
        self.verdict = verdict
        rows = comparison(self.estimate, self.phases.marks, self.phases.peaks, self.phases.rises, peak_alloc,
                          mon.get("device_peak"), self.device.type, peak_reserved)
        off = prediction_warnings(rows)
        for line in off:
            log.warning("%s", line)
        losses = self.measured.losses
        self.summary = {
            "status": verdict.status,
            "reasons": verdict.reasons,
            "run_id": self.run_dir.run_id if self.run_dir else None,
            "steps": len(losses),
            "steps_planned": steps,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "loss_floor": data_mod.entropy_floor(self.job.shape.vocab) if not self.t.dataset else None,
            "peak_allocated": peak_alloc,
            "peak_reserved": peak_reserved,
            "device_peak": mon.get("device_peak"),
            "predicted": self.estimate.allocated,
            "predicted_reserved": self.estimate.reserved,
            "predicted_device": self.estimate.total,
            "predicted_phase": self.estimate.peak_phase,
            "stack": self.job.facts.stack.name,
            "replica_leaves_out": self.left_out,
            "limit": limit,
            "capacity": torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None,
            "tokens_per_s": mon.get("tokens_per_s") and mon["tokens_per_s"] * self.world.size,
            "tokens_per_s_scope": f"total of all {self.world.size} ranks" if self.world.size > 1 else "one process",
            "mfu": mon.get("mfu"),
            "step_time": mon.get("step_time"),
            "device": str(self.device) + (f" ({self.gpu.name})" if self.device.type == "cuda" else ""),
            "world_size": self.world.size,
            "nodes": self.pred_job.cluster.nodes,
            "params": getattr(self, "params", None),
            "trainable_params": getattr(self, "trainable", None),
            "checks": verdict.checks,
            "memory": [r.to_json() for r in rows],
            "measured_by": "torch.cuda.memory_stats" if self.device.type == "cuda" else "tensor counter (CPU)",
            "alloc_retries": mon.get("alloc_retries"),
            "ooms": mon.get("ooms"),
            "warnings": mon.get("warnings", []) + off,
            "prediction_error": next((r.to_json()["error"] for r in rows if r.name == "peak allocated"), None),
            "duration_s": round(time.time() - self.started, 2),
        }
        self.summary["null_reasons"] = self._null_reasons()
        if verdict.status == "oom":
            self.summary["suggestions"] = [
                {"changes": {name: [old, new] for name, old, new in s.changes}, "total": s.estimate.total,
                 "slowdown": round(s.slowdown, 2), "caveat": s.caveat}
                for s in advisor.advise(self.pred_job)
            ]
        # Its reasons and warnings carry errors' own text (an exception's message, a path): secrets stay out, as
        # in -- COMMAND's summary.
        self.summary = SecretFilter().deep(self.summary)
        if self.run_dir:
            self._write_outputs(rows)
        return verdict

    def _null_reasons(self) -> dict[str, str]:
        """Why each unknown value of the summary is null (strict JSON: null and a reason)."""
        cpu = self.device.type != "cuda"
        why = {
            "loss_first": "no step finished", "loss_last": "no step finished",
            "loss_floor": "train.dataset is real data: no known entropy floor",
            "peak_allocated": "no memory reading was taken", "peak_reserved":
                "a CPU run counts tensors: there is no caching allocator" if cpu else "no memory reading was taken",
            "device_peak": "a CPU run has no device memory (NVML)" if cpu
                else "NVML gave no reading (nvidia-ml-py missing, or no access to the device)",
            "limit": "no smoke.peak_limit_gb, and a CPU has no card capacity",
            "capacity": "a CPU run has no card capacity",
            "tokens_per_s": "no step was timed", "step_time": "no step was timed",
            "mfu": "no peak FLOPS to divide by on a CPU" if cpu
                else f"no peak FLOPS for {self.t.precision} on {self.gpu.name} in the GPU catalog",
            "prediction_error": "no measured peak to compare",
            "run_id": "no run directory (a rank other than 0)",
        }
        return strict_json.null_reasons(self.summary, why)

    def _limit(self) -> int | None:
        if self.job.smoke.peak_limit_gb:
            return int(self.job.smoke.peak_limit_gb * 1e9)
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return None

    def _write_outputs(self, rows) -> None:
        rd = self.run_dir
        nvml = self.monitor.nvml if self.monitor else None
        try:
            rd.write_json("env", env_record(self.device, self.world.size, nvml.driver() if nvml else None))
        except OSError as exc:  # a full disk must not cost the summary that follows
            log.warning("env.json not written: %s", exc)
        try:
            self._plot()
        except plot.PlotUnavailable as exc:
            log.warning("memory.png not drawn: %s; every other output is written", exc)
        except Exception as exc:  # the plot must never cost the summary
            log.warning("memory plot failed: %r", exc)  # repr: a MemoryError's str() is empty
        rd.close()
        if self.sinks is not None:
            self.sinks.close(self.summary)
            self.summary["sinks"] = list(self.job.smoke.sinks)
        self.summary["files"] = rd.present() | {"summary": "summary.json"}
        rd.write_json("summary", self.summary)

    def _plot(self) -> None:
        """memory.png for rank 0, memory.rank<N>.png for every other rank, from the run's metrics files."""
        path = self.run_dir.path
        for run in plot.read_run(path):
            rank = run.label.rsplit(" rank ", 1)[1] if " rank " in run.label else "0"
            out = self.run_dir.file("plot") if rank == "0" else path / f"memory.rank{rank}.png"
            run.status, run.capacity = self.summary["status"], self.summary.get("capacity")
            run.predicted, run.limit = self.summary.get("predicted"), self.summary.get("limit")
            run.predicted_reserved, run.steps_planned = self.summary.get("predicted_reserved"), self.summary["steps_planned"]
            plot.draw([run], out, f"{self.job.shape.name} on {self.summary['device']}"
                      + (f", rank {rank} of {self.world.size}" if self.world.size > 1 else ""))


def _brief(sample: dict) -> str:
    parts = []
    if sample.get("step_time"):
        parts.append(f"{sample['step_time'] * 1e3:.0f} ms/step")
    if sample.get("tokens_per_s"):
        parts.append(f"{sample['tokens_per_s']:,.0f} tok/s")
    if sample.get("mfu"):
        parts.append(f"MFU {sample['mfu']:.0%}")
    if sample.get("peak_allocated"):
        parts.append(f"peak {sample['peak_allocated'] / (1 << 20):,.0f} MiB")
    return ", ".join(parts)


def _raise_interrupted(signum, frame):
    raise Interrupted()
