"""Does accelerate-style FSDP1 add activation memory per token to an HF Trainer LoRA step? Counted on CPU.

fms-acceleration's published 2-GPU FSDP1 LoRA/QLoRA peaks grow 50-100 KB per token faster than its 1-GPU
runs of the same code (benchmarks/published/fms-acceleration/SOURCES.md). This runs the same step twice on a
tiny Mistral: in one process, and wrapped in FullyShardedDataParallel over 2 gloo ranks on CPU as accelerate
wraps a peft model (peft's fsdp_auto_wrap_policy: every LoRA Linear its own unit, each decoder layer one;
FULL_SHARD, BACKWARD_PRE, use_orig_params=False), with transformers' reentrant gradient checkpointing, LoRA
r16 on q/k/v/o with dropout 0.1, the model's own loss. podkit's TensorCounter counts every storage an op
creates (FSDP1's resize_-based frees included). The per-token slope between micro-batches 2 and 4 is what
matters: if FSDP1 itself held activations per token, the sharded slope would exceed the single one.

Run: .venv/bin/python benchmarks/hf_fsdp1_per_token_cpu.py   (uses the installed transformers and peft;
     PYTHONPATH=DIR with transformers==4.48.1 peft==0.13.2 in DIR reproduces fms-acceleration's releases)
Writes benchmarks/results/hf_fsdp1_per_token_cpu.{md,json}.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCHES = 256, (2, 4)


def measure() -> dict:
    """One process's (or rank 0's) peak live bytes per token, forward and backward, at each micro-batch."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from transformers import MistralConfig, MistralForCausalLM

    from podkit.train.memprobe import TensorCounter

    sharded = "WORLD_SIZE" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=4000, max_position_embeddings=SEQ, sliding_window=None,
                        attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    if sharded:
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), sharding_strategy=ShardingStrategy.FULL_SHARD,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE, use_orig_params=False,
                     device_id=torch.device("cpu"))
    out = {}
    for b in BATCHES:
        ids = torch.randint(0, cfg.vocab_size, (b, SEQ))
        counter = TensorCounter(trace_limit=0)
        for p in model.parameters():  # storages made before counting: viewing them allocates nothing
            counter._sizes[id(p.untyped_storage())] = (0, 0, "params")
        counter.switch_on()
        loss = model(input_ids=ids, labels=ids).loss
        forward = counter.window_peak()
        counter.reset_peak()
        loss.backward()
        backward = counter.window_peak()
        counter.switch_off()
        model.zero_grad(set_to_none=True)
        out[b] = {"forward": forward, "backward": backward}
    if sharded:
        dist.destroy_process_group()
    return out


def main() -> int:
    if os.environ.get("PODKIT_FSDP1_WORKER"):
        result = measure()
        if int(os.environ.get("RANK", "0")) == 0:
            Path(os.environ["PODKIT_FSDP1_WORKER"]).write_text(json.dumps(result))
        return 0
    import peft
    import torch
    import transformers

    tmp = ROOT / "benchmarks" / "results" / ".fsdp1_tmp.json"
    env = {**os.environ, "PODKIT_FSDP1_WORKER": str(tmp)}
    runs = {}
    for name, cmd in (("one process", [sys.executable, __file__]),
                      ("FSDP1, 2 gloo ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc_per_node", "2", __file__])):
        print(f"running {name} ...", flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs[name] = {int(k): v for k, v in json.loads(tmp.read_text()).items()}
        tmp.unlink()
    rows = []
    for name, r in runs.items():
        b0, b1 = BATCHES
        tokens = (b1 - b0) * SEQ
        rows.append({"run": name, **{f"{ph}_mb{b}": r[b][ph] for b in BATCHES for ph in ("forward", "backward")},
                     "forward_slope": (r[b1]["forward"] - r[b0]["forward"]) / tokens,
                     "backward_slope": (r[b1]["backward"] - r[b0]["backward"]) / tokens})
    header = ("| run | forward peak, mb 2 / 4 (MB) | backward peak, mb 2 / 4 (MB) | forward B/token | backward B/token |\n"
              "| --- | --- | --- | --- | --- |\n")
    lines = [f"| {r['run']} | {r['forward_mb2'] / 1e6:.2f} / {r['forward_mb4'] / 1e6:.2f} | "
             f"{r['backward_mb2'] / 1e6:.2f} / {r['backward_mb4'] / 1e6:.2f} | {r['forward_slope']:,.0f} | "
             f"{r['backward_slope']:,.0f} |" for r in rows]
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    date = datetime.date.today().isoformat()
    md = (f"# FSDP1 and per-token activation memory, counted on CPU ({date})\n\n"
          f"`benchmarks/hf_fsdp1_per_token_cpu.py` on {platform.machine()}, {versions}: a tiny Mistral (hidden 512, "
          f"4 layers, vocab 4000) with peft LoRA, reentrant checkpointing, sequences of {SEQ}.\n\n" + header
          + "\n".join(lines) + "\n\nThe slopes (bytes per extra token between micro-batches 2 and 4) are what FSDP1 "
          "would change if it held activations per token; the constant difference is its gathered units.\n")
    print(md)
    out = ROOT / "benchmarks" / "results" / "hf_fsdp1_per_token_cpu"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"date": date, "versions": versions, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
