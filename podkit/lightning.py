"""MemoryMonitor as a Lightning Callback (lightning, or the older pytorch_lightning, imported only here):

    from podkit.lightning import MemoryMonitorCallback
    mem = MemoryMonitorCallback(every=10, log_path="memory.jsonl")
    trainer = lightning.Trainer(max_steps=1000, callbacks=[mem])
    trainer.fit(model, loader)
    print(mem.summary)   # status, peaks, allocator retries, OOMs, step time; also in memory.summary.json

Lightning calls on_train_batch_end once per micro-batch; trainer.global_step counts optimizer steps
(lightning/pytorch/loops/training_epoch_loop.py), so the monitor steps when global_step moves.
Each fit() is its own fit, with its own log (podkit/fits.py); one that raises ends in on_exception, which
Lightning calls for every exception out of fit(), KeyboardInterrupt included (lightning 2.6.0
pytorch/trainer/call.py, _call_and_handle_interrupt).
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package name before Lightning 2.0's unified one
    from pytorch_lightning import Callback

from . import MemoryMonitor
from .fits import FitsView, MonitoredFits

# Lightning calls on_exception for every exception out of fit(); a fit left open had neither (another callback's
# on_exception raised first, or fit_loop.run() was called directly, outside fit(); the tuners hand their trial
# runs no callbacks: lightning 2.6.0 pytorch/tuner/batch_size_scaling.py and lr_finder.py set trainer.callbacks).
ABANDONED = "a fit began before the previous one ended, and neither on_train_end nor on_exception came"


class MemoryMonitorCallback(FitsView, Callback):
    def __init__(self, every: int = 10, log_path: str | None = None, **monitor_kwargs):
        if "device" in monitor_kwargs:
            raise TypeError("MemoryMonitorCallback: the device is the LightningModule's; leave device out")
        # Checked now, not as a traceback from inside trainer.fit() (a CPU monitor opens nothing until entered).
        MemoryMonitor(every=every, log_path=log_path, device="cpu", **monitor_kwargs)
        self.fits = MonitoredFits(every, log_path, monitor_kwargs)
        self._seen_step = 0

    def on_train_start(self, trainer, pl_module):
        self.fits.begin(write=trainer.is_global_zero, abandoned=ABANDONED, device=pl_module.device)
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.fits.open:
            return
        while self._seen_step < trainer.global_step:  # an optimizer step happened after this micro-batch
            self._seen_step += 1
            self.fits.monitor.step(global_step=self._seen_step)

    def on_train_end(self, trainer, pl_module):
        self.fits.end()

    def on_exception(self, trainer, pl_module, exception):
        # A crashed fit (an OOM above all) still gets its summary and a closed log: on_train_end never runs then.
        self.fits.end(exception)
