"""MemoryMonitor as a Lightning Callback (lightning, or the older pytorch_lightning, imported only here):

    from podkit.lightning import MemoryMonitorCallback
    mem = MemoryMonitorCallback(every=10, log_path="memory.jsonl")
    trainer = lightning.Trainer(max_steps=1000, callbacks=[mem])
    trainer.fit(model, loader)
    print(mem.summary)   # peaks, allocator retries, OOMs, step time

Lightning calls on_train_batch_end once per micro-batch; trainer.global_step counts optimizer steps
(lightning/pytorch/loops/training_epoch_loop.py), so the monitor steps when global_step moves.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package name before Lightning 2.0's unified one
    from pytorch_lightning import Callback

from . import MemoryMonitor


class MemoryMonitorCallback(Callback):
    def __init__(self, every: int = 10, log_path: str | None = None, **monitor_kwargs):
        if "device" in monitor_kwargs:
            raise TypeError("MemoryMonitorCallback: the device is the LightningModule's; leave device out")
        # Checked now, not as a traceback from inside trainer.fit() (a CPU monitor opens nothing until entered).
        MemoryMonitor(every=every, log_path=log_path, device="cpu", **monitor_kwargs)
        self.every, self.log_path, self.monitor_kwargs = every, log_path, monitor_kwargs
        self.monitor: MemoryMonitor | None = None
        self.summary: dict | None = None
        self._seen_step = 0

    def on_train_start(self, trainer, pl_module):
        log_path = self.log_path if trainer.is_global_zero else None
        self.monitor = MemoryMonitor(every=self.every, log_path=log_path, device=pl_module.device, **self.monitor_kwargs)
        self.monitor.__enter__()
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            return
        while self._seen_step < trainer.global_step:  # an optimizer step happened after this micro-batch
            self._seen_step += 1
            self.monitor.step(global_step=self._seen_step)

    def on_train_end(self, trainer, pl_module):
        if self.monitor is not None:
            self.monitor.close()
            self.summary = self.monitor.summary()

    def on_exception(self, trainer, pl_module, exception):
        # A crashed fit (an OOM above all) still gets its summary and a closed log: on_train_end never runs then.
        self.on_train_end(trainer, pl_module)
