"""What accelerate-style FSDP1 keeps through an HF Trainer LoRA step's backward, counted on CPU.

fms-acceleration's published 2-GPU FSDP1 LoRA/QLoRA peaks (transformers 4.48.1) sit one copy of every
block's input and one of its gradient above podkit's single-GPU accounting (benchmarks/published/
fms-acceleration/SOURCES.md). This runs the same step on a tiny Mistral in one process and wrapped in
FullyShardedDataParallel over 2 gloo ranks on CPU as accelerate wraps a peft model (peft's
fsdp_auto_wrap_policy: every LoRA Linear its own unit, each decoder layer one; FULL_SHARD, BACKWARD_PRE),
with transformers' reentrant gradient checkpointing, LoRA r16 on q/k/v/o with dropout 0.1, the model's own
loss. At the moment the first block's backward has handed its input gradient to the embedding it counts the
live bytes (podkit's TensorCounter: every storage an op creates, FSDP1's resize_-based frees included) and
how many of the recompute's leaf input copies (torch.utils.checkpoint.detach_variable) are still alive, and
with a .grad. The vocabulary is small so that the blocks, not the loss, set the backward's peak.

Run: .venv/bin/python benchmarks/hf_fsdp1_kept_inputs_cpu.py [--old-transformers DIR]
  DIR: a directory with transformers==4.48.1, peft==0.13.2, tokenizers==0.21.0, huggingface_hub==0.27.1
  (pip install --no-deps --target DIR ...), fms-acceleration's releases, whose decoder loop checkpoints
  `decoder_layer.__call__` around the FSDP unit; the installed transformers (>= 4.52 for this Mistral) checkpoints inside it.
Writes benchmarks/results/hf_fsdp1_kept_inputs_cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCHES, LAYERS, HIDDEN = 256, (2, 4), 8, 512


def measure() -> dict:
    """One process's (or rank 0's) live bytes and kept input copies per micro-batch."""
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint as ckpt
    import transformers
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from transformers import MistralConfig, MistralForCausalLM

    from podkit.train.memprobe import TensorCounter

    made: list = []  # weak references to every leaf copy the reentrant checkpoint's recompute makes
    detach = ckpt.detach_variable

    def watched(inputs):
        out = detach(inputs)
        made.extend(weakref.ref(t) for t in out if isinstance(t, torch.Tensor) and t.requires_grad)
        return out

    ckpt.detach_variable = watched  # CheckpointFunction.backward looks it up in the module at call time

    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=HIDDEN, intermediate_size=1792, num_hidden_layers=LAYERS, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=SEQ, sliding_window=None,
                        attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    embed = model.get_input_embeddings()
    if sharded:
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), sharding_strategy=ShardingStrategy.FULL_SHARD,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE, use_orig_params=False,
                     device_id=torch.device("cpu"))
    state: dict = {}

    def at_first_block_done(_grad):
        alive = [r() for r in made if r() is not None]
        state["live"] = state["counter"].allocated()
        state["kept"] = len(alive)
        state["kept_with_grad"] = sum(t.grad is not None for t in alive)

    def hook_output(_mod, _inp, out) -> None:  # returning None keeps the embedding's output
        out.register_hook(at_first_block_done)

    embed.register_forward_hook(hook_output)
    out = {"transformers": transformers.__version__}
    for b in BATCHES:
        ids = torch.randint(0, cfg.vocab_size, (b, SEQ))
        made.clear()
        counter = state["counter"] = TensorCounter(trace_limit=0)
        for p in model.parameters():  # storages made before counting: viewing them allocates nothing
            counter._sizes[id(p.untyped_storage())] = (0, 0, "params")
        counter.switch_on()
        loss = model(input_ids=ids, labels=ids).loss
        counter.reset_peak()
        loss.backward()
        backward = counter.window_peak()
        counter.switch_off()
        model.zero_grad(set_to_none=True)
        out[b] = {"backward_peak": backward, "first_block_done": state["live"], "kept": state["kept"],
                  "kept_with_grad": state["kept_with_grad"]}
    if sharded:
        # The FSDP model holds the process group: release it first, or the group's destructor may run in the
        # interpreter's teardown and abort the rank (tests/test_fsdp1_reentrant.py's worker).
        del model, loss
        gc.collect()
        dist.destroy_process_group()
    return out


def main() -> int:
    if os.environ.get("PODKIT_FSDP1_WORKER"):
        result = measure()
        if int(os.environ.get("RANK", "0")) == 0:
            Path(os.environ["PODKIT_FSDP1_WORKER"]).write_text(json.dumps(result))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-transformers", metavar="DIR", help="also run FSDP1 with the transformers/peft in DIR")
    args = ap.parse_args()
    import torch

    runs = [("one process", [sys.executable, __file__], ""),
            ("FSDP1, 2 gloo ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", "2", __file__], "")]
    if args.old_transformers:
        runs.append(("FSDP1, 2 gloo ranks", runs[1][1], str(Path(args.old_transformers).resolve())))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd, path in runs:
            out = Path(tmp) / "out.json"
            env = {**os.environ, "PODKIT_FSDP1_WORKER": str(out), "OMP_NUM_THREADS": "1"}
            if path:
                env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
            print(f"running {name}{' with ' + path if path else ''} ...", flush=True)
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = json.loads(out.read_text())
            b0, b1 = BATCHES
            tokens = (b1 - b0) * SEQ
            rows.append({"run": name, "transformers": r["transformers"],
                         **{f"{k}_mb{b}": r[str(b)][k] for b in BATCHES
                            for k in ("backward_peak", "first_block_done", "kept", "kept_with_grad")},
                         "first_block_done_slope": (r[str(b1)]["first_block_done"] - r[str(b0)]["first_block_done"])
                         / tokens})
    one_copy = LAYERS * HIDDEN * 2  # every block's bf16 input, per token
    header = ("| run | transformers | live at the first block's backward, mb 2 / 4 (MB) | B/token | "
              "input copies kept (with .grad), mb 4 | backward peak, mb 2 / 4 (MB) |\n"
              "| --- | --- | --- | --- | --- | --- |\n")
    lines = [f"| {r['run']} | {r['transformers']} | {r['first_block_done_mb2'] / 1e6:.2f} / "
             f"{r['first_block_done_mb4'] / 1e6:.2f} | {r['first_block_done_slope']:,.0f} | {r['kept_mb4']} "
             f"({r['kept_with_grad_mb4']}) | {r['backward_peak_mb2'] / 1e6:.2f} / {r['backward_peak_mb4'] / 1e6:.2f} |"
             for r in rows]
    date = datetime.date.today().isoformat()
    md = (f"# What FSDP1 keeps through a reentrant-checkpointed LoRA backward, counted on CPU ({date})\n\n"
          f"`benchmarks/hf_fsdp1_kept_inputs_cpu.py` on {platform.machine()}, torch {torch.__version__}: a tiny "
          f"Mistral (hidden {HIDDEN}, {LAYERS} layers, vocab 64) with peft LoRA r16 on q/k/v/o, reentrant "
          f"checkpointing, sequences of {SEQ}, micro-batches {BATCHES[0]} and {BATCHES[1]}.\n\n" + header
          + "\n".join(lines)
          + f"\n\nOne copy of every block's bf16 input is {one_copy:,} B per token. Where transformers checkpoints "
          "`decoder_layer.__call__` around the FSDP unit (before 4.52 for Mistral, 4.53 for Mixtral), FSDP1's "
          "reshard-only hook keeps each recomputed input copy and its gradient until backward ends (checks/stacks.py "
          "JobFacts.fsdp1_keeps_block_inputs); where the layer checkpoints itself inside the unit (from those "
          "releases, GradientCheckpointingLayer) none is kept.\n")
    print(md)
    out = ROOT / "benchmarks" / "results" / "hf_fsdp1_kept_inputs_cpu"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"date": date, "torch": torch.__version__, "rows": rows},
                                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
