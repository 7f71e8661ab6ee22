"""How much a MoE step reserves depends on how its router splits the tokens: the spread behind preflight's figure.

transformers 4.x runs a MoE block's nn.Linear experts in a loop, each over the rows routed to it, so the sizes the
caching allocator sees differ from expert to expert and the segments a step leaves depend on their order
(checks/step_replay.py). For the ledger's single-GPU Mixtral 8x7B QLoRA jobs (fms-acceleration, micro-batch 4 and
8 x 4096), this replays two steps' activations and loss through the allocator's rules with each block routed:

  even        every expert the same rows (what the closed form prices);
  descending  a balanced router's expected counts (step_replay.routed_tokens), largest first;
  ascending   the same counts smallest first: the order preflight replays;
  random      --draws routings of a balanced router, each block its own (binomial counts in random order).

and prints the reserved bytes of each, with the published nvidia-smi peak minus the published allocated peak for
scale (what the device held beyond the tensors, the CUDA context included).

    .venv/bin/python benchmarks/moe_routing.py     # writes benchmarks/results/moe_routing.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from accuracy import load_case  # noqa: E402  (the ledger's own reader: job, metric, bytes)

from podkit.checks import activations as A  # noqa: E402
from podkit.checks import step_replay  # noqa: E402

GIB = 1 << 30
PUBLISHED = ROOT / "benchmarks" / "published" / "fms-acceleration"
RESULTS = ROOT / "benchmarks" / "results"
CASES = ("mixtral-8x7b-qlora-r16-qkvo-1xa100-mb4-seq4096", "mixtral-8x7b-qlora-r16-qkvo-1xa100-mb8-seq4096")


def random_routing(tokens: int, experts: int, top_k: int, layers: int, rng: random.Random) -> tuple:
    """Per block, a balanced router's rows per expert: binomial counts (normal approximation) in random order."""
    p = top_k / experts
    out = []
    for _ in range(layers):
        rows = [max(0, round(rng.gauss(tokens * p, math.sqrt(tokens * p * (1 - p))))) for _ in range(experts)]
        rows[rng.randrange(experts)] += tokens * top_k - sum(rows)
        out.append(tuple(rows))
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=10, help="random routings per case")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()

    rows_out = []
    for name in CASES:
        case, device = load_case(PUBLISHED / f"{name}.toml"), load_case(PUBLISHED / f"{name}-nvidia-smi.toml")
        job = case.job
        t, s, bf = job.train, job.shape, A.block_facts(job)
        tokens, m = t.micro_batch * t.seq_len, s.moe
        replay_args = (bf, s.layers, s.vocab, s.hidden, t.compute_bytes, t.micro_batch, tokens,
                       A.shifted_copy_bytes(job) > 0)

        def reserved(routing) -> float:
            return step_replay._replay(*replay_args, routing).reserved / GIB

        ascending = step_replay.routed_tokens(tokens, m.experts, m.top_k)
        rng = random.Random(0)
        draws = [reserved(random_routing(tokens, m.experts, m.top_k, s.layers, rng)) for _ in range(args.draws)]
        row = {"case": name, "even": reserved(None), "descending": reserved((ascending[::-1],) * s.layers),
               "ascending": reserved((ascending,) * s.layers), "random_min": min(draws),
               "random_median": statistics.median(draws), "random_max": max(draws), "draws": args.draws,
               "published_device_minus_allocated": (device.measured - case.measured) / GIB}
        rows_out.append(row)
        print(f"{name}: even {row['even']:.2f}, ascending {row['ascending']:.2f}, random "
              f"{row['random_min']:.2f}-{row['random_max']:.2f} GiB", file=sys.stderr)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    table = ("| case | even | descending | ascending (preflight) | random min / median / max | published device - "
             "allocated |\n| --- | --- | --- | --- | --- | --- |\n" + "\n".join(
                 f"| {r['case']} | {r['even']:.2f} | {r['descending']:.2f} | {r['ascending']:.2f} | "
                 f"{r['random_min']:.2f} / {r['random_median']:.2f} / {r['random_max']:.2f} | "
                 f"{r['published_device_minus_allocated']:.2f} |" for r in rows_out))
    md = (f"# Reserved GiB of two replayed MoE steps' activations and loss, by routing ({stamp})\n\n"
          f"Produced by `benchmarks/moe_routing.py` ({args.draws} random routings per case, seed 0): what the "
          "caching allocator reserves for the activations and loss of the ledger's single-GPU Mixtral 8x7B QLoRA "
          "jobs, by how the router splits each block's rows among the experts. The last column is the published "
          "nvidia-smi peak minus the published allocated peak, for scale.\n\n" + table + "\n")
    print(md)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "moe_routing.md").write_text(md)
        (RESULTS / "moe_routing.json").write_text(json.dumps({"date": stamp, "rows": rows_out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
