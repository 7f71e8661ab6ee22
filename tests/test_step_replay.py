"""The single-GPU HF step replayed through the caching allocator (checks/step_replay.py)."""

import json

from podkit.checks import activations as A
from podkit.checks import step_replay
from podkit.checks.allocator import segment_size
from podkit.checks.memory import estimate, tensor_bytes

MIB = 1 << 20
GIB = 1 << 30
# Blocks so narrow that every activation is <= 1 MiB (the small pool), so the large pool holds the loss alone.
TINY = 'name = "tiny"\nhidden = 64\nlayers = 2\nheads = 2\nkv_heads = 2\nffn = 128\nvocab = 65536\narch = "llama"'
HF_LORA = ('stack = "hf"\ntransformers = "4.48.1"\nprecision = "bf16"\nmicro_batch = 8\nseq_len = 256\n'
           'checkpointing = "full"\nattention = "flash-attn"\nlora_rank = 8\nloss = "stack"')


def test_the_loss_keeps_one_more_fp32_logits_segment_than_its_peak_by_hand(job):
    j = job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"')
    replay = step_replay.segments(j)
    tokens, batch, vocab = 8 * 256, 8, 65536
    logits, full = 2 * vocab * tokens, 4 * vocab * tokens  # 256 and 512 MiB
    shifted = 4 * vocab * (tokens - batch)  # logits[..., :-1, :]: 2 MiB short of full
    assert segment_size(shifted) == full - 2 * MIB
    # Step 1, forward: logits, the fp32 copy, the shifted copy and log_softmax's output each get a segment.
    # Backward: nll_loss's zeros take the shifted copy's segment (best fit), log_softmax's input gradient
    # the fp32 copy's; SliceBackward0's full-size zeros fit neither the shifted copy's nor log_softmax's
    # (2 MiB short): a fifth segment. The 16-bit gradient takes the logits' segment, and the rest of the
    # step (blocks of <= 1 MiB) and step 2 find every block they need.
    assert replay.reserved_large == logits + 2 * full + 2 * segment_size(shifted)
    # ... while the most the loss holds at once is its forward: 2 + 4 + 4 + 4 B per logit.
    assert replay.peak_allocated >= logits + full + 2 * shifted
    assert replay.reserved_large - replay.peak_allocated > full - 4 * MIB  # about one fp32 logits tensor


def test_the_estimate_reserves_the_replayed_segments(job):
    j = job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"')
    est = estimate(j)
    replay = step_replay.segments(j)
    for phase, parts in est.phase_parts.items():
        pools = [p for p in parts if p.where == "pool"]
        assert [p.label for p in pools] == ["segments the step's activations and loss leave (cached)"]
        filled = sum(p.bytes for p in parts if p.where == "tensor" and p.term in ("activations", "loss"))
        assert est.phase_reserved(phase) == tensor_bytes(parts) + replay.reserved - filled


def test_the_replay_applies_only_where_its_order_is_the_codes(job):
    assert step_replay.segments(job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"')) is not None
    # Sharded, another stack, non-reentrant checkpointing's recompute, or a CPU run: the closed-form terms.
    assert step_replay.segments(job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"\ngpus_per_node = 2\n'
                                                                       'sharding = "zero3"')) is None
    assert step_replay.segments(job(model=TINY, train=HF_LORA.replace('"hf"', '"podkit"'),
                                    cluster='gpu = "A100-80GB"')) is None
    assert step_replay.segments(job(model=TINY, train=HF_LORA.replace('"4.48.1"', '"5.0.0"'),
                                    cluster='gpu = "A100-80GB"')) is None  # use_reentrant=False from 5.0
    assert step_replay.segments(job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"'), device="cpu") is None


def test_the_loss_in_the_model_frees_the_16_bit_logits_first_by_hand(job):
    """transformers <= 4.45: the model's `.float()` drops the 16-bit logits before the shifted copy, and the
    fp32 logits go when compute_loss returns, before backward."""
    j45 = job(model=TINY, train=HF_LORA.replace('"4.48.1"', '"4.45.2"'), cluster='gpu = "A100-80GB"')
    assert j45.facts.loss_in_model and j45.facts.loss == "fp32-upcast"
    r45 = step_replay.segments(j45)
    r48 = step_replay.segments(job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"'))
    tokens, batch, vocab = 8 * 256, 8, 65536
    logits, full, shifted = 2 * vocab * tokens, 4 * vocab * tokens, 4 * vocab * (tokens - batch)
    # Forward: the 16-bit logits' segment, then the fp32 logits'; the freed 16-bit block is too small for the
    # shifted copy and log_softmax's output: a segment each. Backward: nll_loss's zeros take the shifted copy's
    # segment, log_softmax's input gradient the fp32 logits' (freed with `outputs`), SliceBackward0's full-size
    # zeros a fifth. The same segments as 4.46-4.48 (which frees the 16-bit logits last) ...
    assert r45.reserved_large == r48.reserved_large == logits + 2 * full + 2 * segment_size(shifted)
    # ... but the forward's peak lacks the 16-bit logits: fp32 + shifted copy + log_softmax (and small blocks).
    assert r48.peak_allocated - r45.peak_allocated == logits
    assert 0 <= r45.peak_allocated - (full + 2 * shifted) <= 2 * MIB


def test_the_loss_without_a_shifted_copy_reserves_one_fp32_logits_less_by_hand(job):
    """transformers >= 4.49 pads the labels: the fp32 upcast and log_softmax span every position, no copy."""
    r = step_replay.segments(job(model=TINY, train=HF_LORA.replace('"4.48.1"', '"4.49.0"'),
                                 cluster='gpu = "A100-80GB"'))
    logits, full = 2 * 65536 * 8 * 256, 4 * 65536 * 8 * 256
    # Forward: 16-bit logits, fp32 copy, log_softmax; backward: nll_loss's zeros in the fp32 copy's segment,
    # log_softmax's input gradient a third full-size one; no slice, the 16-bit gradient in the logits'.
    assert r.reserved_large == logits + 3 * full


def test_gpt2s_own_loss_replays_in_the_compute_dtype_by_hand(job):
    """transformers < 4.49 GPT-2 (compute-shifted), as CUDA runs CrossEntropyLoss: the shifted copy and log_softmax
    in the compute dtype; under native AMP nll_loss's fp32 cast, saved, and the fp32 copy of the outputs."""
    tokens, batch, vocab = 8 * 256, 8, 65536
    logits, full = 2 * vocab * tokens, 4 * vocab * tokens  # 256 and 512 MiB
    shifted = 2 * vocab * (tokens - batch)  # 255 MiB
    train = HF_LORA + '\nloss = "compute-shifted"'
    train = train.replace('loss = "stack"\n', "")
    pure = step_replay.segments(job(model=TINY, train=train, cluster='gpu = "A100-80GB"'))
    # Forward: logits, the shifted copy and log_softmax a segment each (255 MiB rounds up to 256). Backward:
    # nll_loss's gradient takes the copy's segment, log_softmax's input gradient the logits'; SliceBackward0's
    # full-size zeros, already the 16-bit gradient (no cast back), the copy's again once nll's gradient is gone.
    assert segment_size(shifted) == logits
    assert pure.reserved_large == logits + 2 * segment_size(shifted)
    assert 0 <= pure.peak_allocated - (logits + 2 * shifted) <= 4 * MIB  # (and the blocks' small tensors)
    amp = step_replay.segments(job(model=TINY, train=train.replace('"bf16"', '"bf16-mixed"'),
                                   cluster='gpu = "A100-80GB"'))
    # Forward: + nll_loss's fp32 cast (510 MiB); the outputs' fp32 copy finds no free block that large: a fifth
    # segment. Backward's fp32 gradient takes the outputs' segment; everything after fits what is cached.
    assert amp.reserved_large == logits + 2 * segment_size(shifted) + segment_size(2 * shifted) + full
    # The most at once: the outputs' copy beside the 16-bit logits, log_softmax and the cast (the copy is gone).
    assert 0 <= amp.peak_allocated - (logits + shifted + 2 * shifted + full) <= 4 * MIB


# A Mixtral-shaped MoE small enough to walk in milliseconds, whose experts' tensors are large-pool blocks at
# 8 x 1024 tokens (4 experts, top-2: about 4096 rows each; the intermediates 4096 x 512 x 2 B = 4 MiB).
def tiny_mixtral(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
                                "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024,
                                "tie_word_embeddings": False}))
    return f'hf_config = "{path}"'


MOE_LORA = HF_LORA.replace("seq_len = 256", "seq_len = 1024")


def test_routed_tokens_are_a_balanced_routers_counts_smallest_first_by_hand():
    # 16,384 tokens, top-2 of 8: each expert is picked with p = 1/4, binomial mean 4,096 and standard deviation
    # sqrt(16384 x 1/4 x 3/4) = 55.43. Blom's quantiles (j + 1/2) / 8 of the standard normal:
    # -1.534, -0.887, -0.489, -0.157 and their mirror images -> 4096 + 55.43 z, rounded.
    assert step_replay.routed_tokens(16384, 8, 2) == (4011, 4047, 4069, 4087, 4105, 4123, 4145, 4181)
    rows = step_replay.routed_tokens(8192, 64, 6)  # rounding away from the quantiles' symmetry is put back
    assert sum(rows) == 8192 * 6 and list(rows) == sorted(rows)


def test_each_routed_experts_tensors_follow_its_rows(job, tmp_path):
    j = job(model=tiny_mixtral(tmp_path), train=MOE_LORA, cluster='gpu = "A100-80GB"')
    bf = A.block_facts(j)
    assert bf.expert_loop == "index_add" and bf.moe.experts == 4
    tokens = 8 * 1024
    rows = step_replay.routed_tokens(tokens, 4, 2)
    walk = step_replay._block_walk(bf, True)
    fwd, experts = walk.forward, walk.forward_experts
    tr, _ = A._walk_block(bf, True)
    gathered = {id(t): tr.expert_of[id(t)] for op in tr.ops for t in op.outputs
                if t.label == "tokens gathered for an expert"}
    assert sorted(gathered.values()) == [0, 1, 2, 3]
    sizes = {ev[1][1]: ev[2] for ev in step_replay._scaled(fwd, 0, {}, tokens, set(), experts, rows) if ev[0] == "a"}
    # hidden_states[top_x]: the expert's rows x 256 x 2 B (bf16), not the even share (tokens x 2 / 4 rows).
    assert [sizes[t] for t in gathered] == [256 * 2 * rows[e] for e in gathered.values()]
    assert rows[0] < tokens * 2 // 4 < rows[-1]


def test_uneven_routing_reserves_segments_that_even_shares_reuse(job, tmp_path):
    j = job(model=tiny_mixtral(tmp_path), train=MOE_LORA, cluster='gpu = "A100-80GB"')
    bf, s = A.block_facts(j), j.shape
    args = (bf, s.layers, s.vocab, s.hidden, 2, 8, 8 * 1024, True)
    # Equal rows scale every expert's events by one: the replay of the walk's even share, to the byte.
    assert step_replay._replay(*args, ((4096,) * 4,) * 2) == step_replay._replay(*args)
    # fms-acceleration's Mixtral 8x7B QLoRA on one A100 at 4 x 4096 tokens (benchmarks/published): each expert's
    # intermediates are about 112 MiB, segments of their own. Each expert larger than the one before: best fit
    # finds none of the previous expert's freed blocks big enough, so the loop takes segments that even shares
    # (16.8 GiB for the step's activations and loss) reuse.
    mixtral = job(model='preset = "mixtral-8x7b"', train=MOE_LORA.replace("micro_batch = 8", "micro_batch = 4")
                  .replace("seq_len = 1024", "seq_len = 4096").replace('"bf16"', '"bf16-mixed"')
                  + '\nbase_quant = "nf4"\nlora_dtype = "compute"\nbitsandbytes = "0.43.3"\ntrl = "0.13.0"',
                  cluster='gpu = "A100-80GB"')
    bf, s = A.block_facts(mixtral), mixtral.shape
    even = step_replay._replay(bf, s.layers, s.vocab, s.hidden, 2, 4, 4 * 4096, True)
    routed = step_replay.segments(mixtral)
    assert routed.reserved_large > even.reserved_large + GIB
    assert abs(routed.peak_allocated - even.peak_allocated) < 0.01 * even.peak_allocated
    est = estimate(mixtral)
    pools = [p for p in est.phase_parts[est.peak_phase] if p.where == "pool"]
    assert "routed unevenly" in pools[0].formula


def test_the_replay_routes_only_a_loop_it_can_afford(job, tmp_path):
    gpu = 'gpu = "A100-80GB"'
    assert step_replay.segments(job(model='preset = "mixtral-8x7b"', train=MOE_LORA, cluster=gpu)) is not None
    # OLMoE's 64 experts x 16 layers: the loop's events would cost preflight seconds; the closed form prices it.
    olmoe = job(model='preset = "olmoe-1b-7b"', train=MOE_LORA, cluster=gpu)
    assert olmoe.shape.moe.experts * olmoe.shape.layers > step_replay.MAX_EXPERT_RUNS
    assert step_replay.segments(olmoe) is None
