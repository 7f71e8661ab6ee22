"""The preflight report: one JSON object (DESIGN.md's shape) or a rich table for people."""

from __future__ import annotations

from dataclasses import dataclass

from podkit.checks.advisor import Suggestion
from podkit.checks.config import JobConfig
from podkit.checks.memory import GIB, TERMS, MemoryEstimate, trainable_params
from podkit.checks.rules import FAIL, CheckResult


@dataclass
class Preflight:
    job: JobConfig
    estimate: MemoryEstimate
    checks: list[CheckResult]
    suggestions: list[Suggestion]

    @property
    def trainable_params(self) -> int:
        return trainable_params(self.job)

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict:
        est, job = self.estimate, self.job
        return {
            "ok": self.ok,
            "model": {"name": job.shape.name, "params": job.shape.params, "trainable_params": self.trainable_params,
                      "active_params": job.shape.active_params, "family": job.shape.family or job.shape.arch,
                      "approximate": job.shape.approximate},
            "gpu": {"name": est.gpu.name, "count": job.cluster.world_size,
                    "compute_capability": ".".join(map(str, est.gpu.compute_capability))},
            "stack": {"name": job.facts.stack.name, "loss": job.facts.loss, "ac_policy": job.facts.ac_policy,
                      "lora_targets": list(job.facts.lora_targets), "optimizer_impl": job.facts.optimizer_impl,
                      "autocast": job.facts.autocast, "fsdp": job.facts.fsdp},
            "checks": [{"id": c.id, "status": c.status, "message": c.message, "fix": c.fix} for c in self.checks],
            "memory": {
                "per_gpu": est.per_gpu,
                "allocated": est.allocated,
                "reserved": est.reserved,
                "headroom_allocated": round(est.headroom_allocated, 4),
                "gpu_capacity": est.capacity,
                "fits": est.fits,
                "tensors_fit": est.tensors_fit,
                "headroom": round(est.headroom, 4),
                "peak_phase": est.peak_phase,
                "phases": est.phases,
                "parts": [{"term": p.term, "label": p.label, "bytes": p.bytes, "formula": p.formula}
                          for p in est.parts],
                "host": {"needed": est.host_needed, "capacity": est.host_capacity},
                "approximate": est.approximate,
                "notes": est.notes,
            },
            "suggestions": [
                {"changes": {name: [old, new] for name, old, new in s.changes},
                 "total": s.estimate.total, "headroom": round(s.estimate.headroom, 4),
                 "slowdown": round(s.slowdown, 2), "caveat": s.caveat}
                for s in self.suggestions
            ],
        }

    def render(self, console) -> None:
        from rich.table import Table

        job, est, t, c = self.job, self.estimate, self.job.train, self.job.cluster
        shape = job.shape
        trainable = self.trainable_params
        console.print(
            f"[bold]{shape.name}[/] {shape.params / 1e9:.2f}B params"
            f"{f', {shape.active_params / 1e9:.2f}B active per token' if shape.moe else ''}"
            f" ({trainable / 1e9:.3g}B trainable)"
            f"{' [yellow](shapes approximate)[/]' if shape.approximate else ''} on "
            f"[bold]{c.world_size} x {est.gpu.name}[/] — {t.precision}, {t.optimizer}, "
            f"micro-batch {t.micro_batch} x accum {t.grad_accum}, seq {t.seq_len}, checkpointing {t.checkpointing}"
            f"{f', LoRA r={t.lora_rank}' if t.lora_rank else ''}{f', {t.base_quant} base' if t.base_quant != 'none' else ''}"
            f"{f', {c.sharding}' if c.sharding != 'none' else ''}{f', offload {c.offload}' if c.offload != 'none' else ''}"
        )
        table = Table(title=f"Predicted memory per GPU at its peak ({est.peak_phase})", title_justify="left")
        table.add_column("term")
        table.add_column("what")
        table.add_column("GiB", justify="right")
        table.add_column("share", justify="right")
        for term in TERMS:
            for part in (p for p in est.parts if p.term == term):
                table.add_row(term, part.label, f"{part.bytes / GIB:.2f}", f"{part.bytes / est.total:.0%}")
        table.add_section()
        colour = "green" if est.fits and est.headroom >= 0.1 else "yellow" if est.fits else "red"
        table.add_row("[bold]total[/]", f"of {est.capacity / GIB:.1f} GiB on {est.gpu.name}",
                      f"[bold {colour}]{est.total / GIB:.2f}[/]", f"[{colour}]{est.total / est.capacity:.0%}[/]")
        console.print(table)
        phases = ", ".join(f"{name} {v / GIB:.1f}" for name, v in est.phases.items())
        console.print(f"phases (GiB): {phases}")
        console.print(f"torch peak allocated ≈ {est.allocated / GIB:.1f} GiB ({est.headroom_allocated:.0%} headroom), "
                      f"reserved ≈ {est.reserved / GIB:.1f} GiB; the fit is judged on reserved plus what only "
                      f"the device holds ({est.headroom:.0%} headroom); stack: {job.facts.stack.name}")
        if est.host_needed:
            console.print(f"host RAM for offload: {est.host_needed / GIB:.1f} GiB per node")
        for note in est.notes:
            console.print(f"[yellow]note:[/] {note}")

        checks = Table(title="Checks", title_justify="left")
        for col in ("status", "check", "finding (→ fix)"):
            # fold, not ellipsis: a fix is a command to copy, and must never lose its tail to the width.
            checks.add_column(col, overflow="fold")
        style = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
        for r in self.checks:
            finding = r.message + (f"\n[cyan]→ {r.fix}[/]" if r.fix else "")
            checks.add_row(f"[{style[r.status]}]{r.status}[/]", r.id, finding)
        console.print(checks)

        if self.suggestions:
            adv = Table(title="What makes it fit (10% headroom kept), cheapest first", title_justify="left")
            for col in ("change", "GiB", "step time", "caveat"):
                adv.add_column(col)
            for s in self.suggestions:
                adv.add_row(s.describe(), f"{s.estimate.total / GIB:.1f}", f"x{s.slowdown:.2f}", s.caveat)
            console.print(adv)
            console.print("[dim]step-time factors are rough, from published measurements; bin/smoke measures yours.[/]")
        verdict = "[bold green]ready[/]" if self.ok else "[bold red]not ready[/]: fix the failed checks above"
        console.print(f"preflight: {verdict}")
