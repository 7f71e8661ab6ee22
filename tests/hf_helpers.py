"""A real transformers fit on the CPU for the callback tests: a tiny Llama built from its config (no Hub
download) and a real Trainer. Imported by tests, and run as a script by the ones whose process must die:

    python tests/hf_helpers.py LOG_PATH OUT_DIR error|sigint|sigterm    # the third micro-batch's forward raises
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def hf_fit(mem, out, crash_at: int | None = None, crash=None, **args):
    """Train with the callback `mem`; `crash()` is called in the model's forward at micro-batch `crash_at`."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    calls = []

    def forward_pre_hook(module, inputs):
        calls.append(1)
        if len(calls) == crash_at:
            crash()

    model.register_forward_pre_hook(forward_pre_hook)
    data = [{"input_ids": torch.arange(16) % 5, "labels": torch.arange(16) % 5} for _ in range(64)]
    args = TrainingArguments(**{"output_dir": str(out), "per_device_train_batch_size": 2, "max_steps": 6,
                                "save_strategy": "no", "report_to": [], "use_cpu": True, "logging_steps": 100,
                                **args})
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[mem]).train()


def step_fails():
    raise RuntimeError("step 3 failed (simulated)")


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: Python raises KeyboardInterrupt in the main thread


def terminated():
    os.kill(os.getpid(), signal.SIGTERM)  # bin/pod stop's first signal: at its default it skips atexit


if __name__ == "__main__":
    from podkit.hf import MemoryMonitorCallback

    log_path, out, how = sys.argv[1:]
    hf_fit(MemoryMonitorCallback(every=1, log_path=log_path), out, crash_at=3,
           crash={"error": step_fails, "sigint": ctrl_c, "sigterm": terminated}[how])
