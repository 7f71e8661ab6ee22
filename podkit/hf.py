"""MemoryMonitor as a transformers TrainerCallback (transformers is imported only here):

    from podkit.hf import MemoryMonitorCallback
    mem = MemoryMonitorCallback(every=10, log_path="memory.jsonl")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[mem])
    trainer.train()
    print(mem.summary)   # status, peaks, allocator retries, OOMs, step time; also in memory.summary.json

Hooks per transformers trainer_callback.py: on_train_begin, on_step_end (once per optimizer step,
after gradient accumulation), on_train_end. Each train() is its own fit, with its own log (podkit/fits.py).

A crash has no event: TrainerCallback has no on_exception, and Trainer.train() calls on_train_end only after
its loop, with no try/finally around it (transformers 5.23.0 trainer_callback.py, trainer.py
_inner_training_loop). So an open fit is ended by what comes next: an uncaught exception at interpreter exit
(atexit, with the exception and its message), or the next on_train_begin (auto_find_batch_size retrying after
an OOM, or a crash caught around train()). atexit rather than wrapping trainer.train(): a callback is never
handed its Trainer, and finding it would mean walking the caller's stack frames.
"""

from __future__ import annotations

from transformers import TrainerCallback

from . import MemoryMonitor
from .fits import FitsView, MonitoredFits

# accelerate 1.15.0 utils/memory.py find_executable_batch_size catches an OOM and calls the inner loop again.
ABANDONED = ("train() began again before the previous fit ended: an exception inside it was caught, by "
             "auto_find_batch_size after an out-of-memory error or around trainer.train()")


class MemoryMonitorCallback(FitsView, TrainerCallback):
    def __init__(self, every: int = 10, log_path: str | None = None, **monitor_kwargs):
        # Checked now, not as a traceback from inside trainer.train() after the model is set up: a monitor built
        # on the CPU opens nothing until it is entered.
        MemoryMonitor(every=every, log_path=log_path, **{**monitor_kwargs, "device": "cpu"})
        self.fits = MonitoredFits(every, log_path, monitor_kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        # Only the main process writes the log; every process measures its own device.
        self.fits.begin(write=state.is_world_process_zero, abandoned=ABANDONED)

    def on_step_end(self, args, state, control, **kwargs):
        if self.fits.open:
            self.fits.monitor.step(global_step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.fits.end()
