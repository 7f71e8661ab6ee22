"""MemoryMonitor as a transformers TrainerCallback (transformers is imported only here):

    from podkit.hf import MemoryMonitorCallback
    mem = MemoryMonitorCallback(every=10, log_path="memory.jsonl")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[mem])
    trainer.train()
    print(mem.summary)   # peaks, allocator retries, OOMs, step time

Hooks per transformers trainer_callback.py: on_train_begin, on_step_end (once per optimizer step,
after gradient accumulation), on_train_end.
"""

from __future__ import annotations

from transformers import TrainerCallback

from . import MemoryMonitor


class MemoryMonitorCallback(TrainerCallback):
    def __init__(self, every: int = 10, log_path: str | None = None, **monitor_kwargs):
        # Checked now, not as a traceback from inside trainer.train() after the model is set up: a monitor built
        # on the CPU opens nothing until it is entered.
        MemoryMonitor(every=every, log_path=log_path, **{**monitor_kwargs, "device": "cpu"})
        self.every, self.log_path, self.monitor_kwargs = every, log_path, monitor_kwargs
        self.monitor: MemoryMonitor | None = None
        self.summary: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        # Only the main process writes the log; every process measures its own device.
        log_path = self.log_path if state.is_world_process_zero else None
        self.monitor = MemoryMonitor(every=self.every, log_path=log_path, **self.monitor_kwargs)
        self.monitor.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step(global_step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
            self.summary = self.monitor.summary()
