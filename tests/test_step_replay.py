"""The single-GPU HF step replayed through the caching allocator (checks/step_replay.py)."""

from podkit.checks import step_replay
from podkit.checks.allocator import segment_size
from podkit.checks.memory import estimate, tensor_bytes

MIB = 1 << 20
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
    assert step_replay.segments(job(model=TINY, train=HF_LORA.replace('"4.48.1"', '"4.44.2"'),
                                    cluster='gpu = "A100-80GB"')) is None  # fp32 logits kept in the model
    assert step_replay.segments(job(model=TINY, train=HF_LORA, cluster='gpu = "A100-80GB"'), device="cpu") is None
