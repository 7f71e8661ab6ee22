"""The attention mask a transformers model hands SDPA for a padded batch (stacks.AttentionMask), priced and checked.

A batch padded to its longest sequence gives the model an attention_mask with zeros. transformers >= 4.53 then builds
a boolean (b, 1, s, s) mask (masking_utils.sdpa_mask); torch's SDPA converts it to an additive mask in the query's
dtype at every call, and the kernel saves that copy for backward; with a mask, k/v are repeated to every head
(sdpa_attention.py use_gqa_in_sdpa) and the flash kernel is out. Without padding the mask is skipped and, from 4.54,
grouped k/v go to SDPA unrepeated (enable_gqa). The real-model checks run transformers 5.23 tiny Llamas in pure bf16
on the CPU, whose SDPA kernel saves the converted mask as CUDA's memory-efficient kernel does (aten
ScaledDotProductEfficientAttentionBackward0 keeps attn_bias_).
"""

import gc
import json
import weakref

import pytest

from podkit.checks import activations as A
from podkit.checks.errors import ConfigError
from podkit.checks.gpus import lookup
from podkit.checks.kernels import attention_kernel, sdpa_backend
from podkit.checks.memory import estimate
from podkit.checks.stacks import AttentionMask
from tests.saved_bytes import saved_under

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 1000,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
BATCH, SEQ = 2, 64


def _tiny(tmp_path, checkpointing=False, attention="sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.bfloat16,
                                             attn_implementation=attention).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _batch(padded: bool):
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[1, SEQ // 2:] = 0  # the second sequence right-padded to the first's length
    return ids, mask


def _flattened_batch():
    """TRL's padding-free batch of the same sequences: one row, position_ids restarting at each, no attention_mask."""
    ids, _ = _batch(False)
    return ids.reshape(1, -1), torch.arange(SEQ).repeat(BATCH)[None]


def _last_layer_saved(model, padded: bool, flattened: bool = False) -> int:
    """Bytes autograd saves under the last decoder layer in one forward, parameters aside, once per storage (the
    rotary cos/sin, shared by every layer, are first saved by the first)."""
    ids, mask = _batch(padded)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if flattened:
        ids, positions = _flattened_batch()
        # TRL's SFTTrainer.compute_loss passes use_cache=False (sft_trainer.py `inputs["use_cache"] = False`)
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return saved_under(model.model.layers[-1], params, lambda: model(**inputs))


def _podkit_block(job, tmp_path, padding: str, attention: str = "sdpa") -> float:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    j = job(model=f'hf_config = "{tmp_path / "config.json"}"',
            train=f"stack = 'hf'\ntransformers = '5.23.0'\nprecision = 'bf16'\nseq_len = {SEQ}\n"
                  f"micro_batch = {BATCH}\npadding = '{padding}'\nattention = '{attention}'")
    bf = A.block_facts(j, device="cpu")
    return sum(A.saved_per_token(bf, "none", False).values()) * BATCH * SEQ


@pytest.mark.parametrize("padding", ["none", "padded", "flattened"])
def test_a_block_saves_what_podkit_prices_padded_or_not(job, tmp_path, padding):
    # Padded: k and v repeated to every head, and the layer's own bf16 (b, 1, s, s) mask, which SDPA made from the
    # boolean one. Unpadded: no mask, k and v unrepeated (enable_gqa). Flattened (padding-free): one row of b x s
    # tokens under a block-causal (1, 1, b s, b s) mask read off the position_ids, copied in bf16 by every layer.
    model = _tiny(tmp_path)
    measured = _last_layer_saved(model, padding == "padded", padding == "flattened")
    assert _podkit_block(job, tmp_path, padding) == measured


def test_eager_attention_over_a_flattened_row_spans_all_its_tokens(job, tmp_path):
    # A padding-free batch is one row of b x s tokens: eager's fp32 softmax and its bf16 cast are (1, heads, T, T),
    # heads x T values per token, not heads x s (activations.attention_row).
    model = _tiny(tmp_path, attention="eager")
    measured = _last_layer_saved(model, False, flattened=True)
    assert _podkit_block(job, tmp_path, "flattened", "eager") == measured
    tokens, heads = BATCH * SEQ, 4
    assert measured - _last_layer_saved(model, False) == tokens * heads * (tokens - SEQ) * (4 + 2)


def test_padding_costs_the_mask_copy_and_the_repeated_kv_by_hand(job, tmp_path):
    model = _tiny(tmp_path)
    extra = _last_layer_saved(model, True) - _last_layer_saved(model, False)
    q_dim, kv_dim = 64, 32  # 4 heads and 2 kv heads of 16
    by_hand = BATCH * SEQ * SEQ * 2 + 2 * BATCH * SEQ * (q_dim - kv_dim) * 2
    assert extra == by_hand == _podkit_block(job, tmp_path, "padded") - _podkit_block(job, tmp_path, "none")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_boolean_mask_lives_as_long_as_podkit_says(tmp_path, checkpointing):
    # Nothing saves the boolean mask without checkpointing (each layer keeps its own converted copy), so it dies
    # when the decoder's forward returns; a checkpointed layer keeps its inputs, the mask among them, until
    # backward (memory.estimate's mask_kept_pt).
    model = _tiny(tmp_path, checkpointing)
    refs = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: refs.append(weakref.ref(kw["attention_mask"])) or None, with_kwargs=True)
    ids, mask = _batch(True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    hook.remove()
    gc.collect()
    assert refs[0]() is not None if checkpointing else refs[0]() is None
    if checkpointing:
        assert refs[0]().dtype == torch.bool and tuple(refs[0]().shape) == (BATCH, 1, SEQ, SEQ)
    out.loss.backward()
    del out
    gc.collect()
    assert refs[0]() is None


@pytest.mark.parametrize("reentrant, transformers_release", [(True, "4.57.1"), (False, "5.23.0")])
def test_a_reentrant_checkpoint_holds_the_keyword_mask_past_the_blocks_backward(job, tmp_path, reentrant,
                                                                                transformers_release):
    # GradientCheckpointingLayer (4.53-4.57 and 5.23 alike) checkpoints `partial(forward, **kwargs)`, the mask among
    # the keywords. A reentrant CheckpointFunction keeps that partial as ctx.run_function, so the mask is still alive
    # when backward reaches the embedding (4.x's default use_reentrant=True: 4.57.1); a non-reentrant one (5.x's
    # default) has dropped it by then. Measured on a real 5.23 model with each kind, then podkit's embedding-backward
    # moment for the release that runs it: padded grows by the bool (b, 1, s, s) mask exactly where it is held.
    model = _tiny(tmp_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    refs, at_embedding = [], []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: refs.append(weakref.ref(kw["attention_mask"])) or None, with_kwargs=True)
    model.model.embed_tokens.register_forward_hook(
        lambda m, a, out: out.register_hook(lambda g: at_embedding.append(refs[0]() is not None)) and None)
    ids, mask = _batch(True)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    [held] = at_embedding
    assert held == reentrant

    def backward_end(padding):
        est = estimate(job(model='preset = "llama-3.2-1b"',
                           train=f"stack = 'hf'\ntransformers = '{transformers_release}'\nprecision = 'bf16'\n"
                                 f"micro_batch = {BATCH}\nseq_len = {SEQ}\ncheckpointing = 'full'\npadding = '{padding}'",
                           cluster="gpu = 'H100-80GB'"))
        parts = est.phase_parts["backward-end"]
        assert any(p.label.startswith("gradient of the embedding's output") for p in parts)  # the moment measured
        return sum(p.bytes for p in parts if p.term != "overhead")

    assert backward_end("padded") - backward_end("none") == BATCH * SEQ * SEQ * held


def _saved(est, label, phase):
    [p] = [p for p in est.phase_parts[phase] if p.label.startswith(label)]
    return p.bytes


# Llama 2 7B: 32 heads = 32 kv heads (padding does not change the k/v repeat), L = 32.
@pytest.mark.parametrize("transformers_release, precision, lora, checkpointing, blocks_extra, kept_extra", [
    # >= 4.53: a bool mask; each layer saves a bf16 copy (2 B x s per token); the bool one is kept only by a
    # checkpoint (1 B x s per token).
    ("5.23.0", "bf16", True, "none", 32 * 2, 0),
    ("5.23.0", "bf16", True, "full", 0, 1),
    # 4.40-4.52: an additive mask in the embeddings' dtype, shared; every layer's kernel saves that one tensor.
    ("4.52.4", "bf16", True, "none", 0, 2),
    # ... in fp32 under autocast (a full fine-tune's fp32 embedding): each layer saves autocast's bf16 cast.
    ("4.52.4", "bf16-mixed", False, "none", 32 * 2, 0),
])
def test_estimate_prices_the_mask_by_hand(job, transformers_release, precision, lora, checkpointing, blocks_extra,
                                          kept_extra):
    def est(padding):
        return estimate(job(model='preset = "llama-2-7b"',
                            train=f"stack = 'hf'\ntransformers = '{transformers_release}'\nprecision = '{precision}'\n"
                                  f"micro_batch = 4\nseq_len = 1024\ncheckpointing = '{checkpointing}'\n"
                                  f"padding = '{padding}'\n" + ("lora_rank = 16\n" if lora else ""),
                            cluster="gpu = 'H100-80GB'"))

    T, s = 4 * 1024, 1024
    padded, plain = est("padded"), est("none")
    label = "blocks' saved activations"
    assert _saved(padded, label, "backward") - _saved(plain, label, "backward") == (blocks_extra + kept_extra) * s * T
    if checkpointing != "none":
        # The block in backward recomputes its forward: its own bf16 copy of the mask.
        in_bwd = "one block in backward"
        assert _saved(padded, in_bwd, "backward") - _saved(plain, in_bwd, "backward") == 2 * s * T


def test_a_flattened_batch_costs_a_mask_over_all_its_tokens_by_hand(job, tmp_path):
    model = _tiny(tmp_path)
    extra = _last_layer_saved(model, False, flattened=True) - _last_layer_saved(model, False)
    tokens, q_dim, kv_dim = BATCH * SEQ, 64, 32
    by_hand = tokens * tokens * 2 + 2 * tokens * (q_dim - kv_dim) * 2  # the bf16 mask copy; k and v repeated
    assert extra == by_hand == _podkit_block(job, tmp_path, "flattened") - _podkit_block(job, tmp_path, "none")


def test_flattened_batches_get_their_mask_from_transformers_4_54_and_torch_2_6(job):
    def mask(release, torch_release=""):
        return job(model='preset = "llama-3.1-8b"',
                   train=f"stack = 'hf'\ntransformers = '{release}'\ntorch = '{torch_release}'\nmicro_batch = 4\n"
                         "padding = 'flattened'").facts.attn_mask

    assert mask("4.57.1") == AttentionMask(1, "flat", True)
    assert mask("4.57.1").shared_elems_per_token(2048, 4, 0) == 4 * 2048
    assert mask("4.53.3") is None and mask("4.57.1", "2.5.1") is None


def test_stack_default_pads_batches_of_more_than_one(job):
    def facts(micro_batch, transformers_release="4.57.1"):
        return job(model='preset = "llama-3.1-8b"', train=f"stack = 'hf'\ntransformers = '{transformers_release}'\n"
                                                          f"micro_batch = {micro_batch}").facts

    assert facts(1).attn_mask is None and not facts(1).repeat_kv  # enable_gqa from 4.54
    assert facts(4).attn_mask == AttentionMask(1, "batch", True) and facts(4).repeat_kv
    assert facts(1, "4.53.3").repeat_kv  # enable_gqa came in 4.54
    # 4.38-4.39 Llama builds its mask whether or not a token is padded; 4.38 from its P x P buffer, copied per layer.
    # bf16-mixed full fine-tune: fp32 embeddings, so an fp32 mask that autocast casts to bf16 in every layer.
    assert facts(1, "4.39.3").attn_mask == AttentionMask(4, "batch", True)
    assert facts(1, "4.38.2").attn_mask.shape == "positions"


def test_fsdp_qlora_passes_no_attention_mask_but_gets_one_causal_mask(job):
    # fsdp_qlora's loop calls the model with attention_mask=None; transformers 4.39 still builds one (s, s) mask.
    j = job(model='preset = "llama-2-7b"', train="stack = 'fsdp_qlora'\nprecision = 'bf16'\nlora_rank = 8\n"
                                                 "micro_batch = 4\nseq_len = 2048")
    assert j.facts.attn_mask == AttentionMask(2, "single", False)
    assert j.facts.attn_mask.shared_elems_per_token(2048, 4, 4096) == 2048 / 4


def test_fsdp_qlora_mistral_gets_no_mask_and_the_flash_kernel(job):
    # transformers 4.39's MistralModel goes through _prepare_4d_causal_attention_mask_for_sdpa, which returns None for
    # attention_mask=None at equal query and key lengths: SDPA runs causal, on the flash kernel of an RTX 3090.
    j = job(model='preset = "mistral-7b"', train="stack = 'fsdp_qlora'\nprecision = 'bf16'\nlora_rank = 8\n"
                                                  "micro_batch = 4\nseq_len = 2048", cluster="gpu = 'RTX3090'")
    assert j.facts.attn_mask is None
    assert attention_kernel(j) == "flash"


def test_a_mask_keeps_sdpa_off_the_flash_kernel(job):
    h100 = lookup("H100-80GB")
    assert sdpa_backend(h100, 2, 128, gqa=False) == "flash"
    assert sdpa_backend(h100, 2, 128, gqa=False, masked=True) == "efficient"
    padded = job(model='preset = "llama-3.1-8b"', train="stack = 'hf'\nmicro_batch = 2", cluster="gpu = 'H100-80GB'")
    unpadded = job(model='preset = "llama-3.1-8b"', train="stack = 'hf'\nmicro_batch = 2\npadding = 'none'",
                   cluster="gpu = 'H100-80GB'")
    assert (attention_kernel(padded), attention_kernel(unpadded)) == ("efficient", "flash")


def test_padding_on_a_stack_without_a_mask_is_refused(job):
    with pytest.raises(ConfigError, match="train.padding"):
        job(train="stack = 'litgpt'\npadding = 'padded'").facts


@pytest.mark.parametrize("train, padding", [
    ("transformers = '5.23.0'\nprecision = 'bf16'\nlora_rank = 8", "padded"),  # bool mask, a bf16 copy per layer
    ("transformers = '5.23.0'\nprecision = 'bf16'\nlora_rank = 8\ncheckpointing = 'full'", "padded"),  # kept by the
    # checkpoint
    ("transformers = '4.52.4'\nprecision = 'bf16-mixed'", "padded"),  # an fp32 mask, autocast's bf16 cast per layer
    ("transformers = '4.52.4'\nprecision = 'bf16'\nlora_rank = 8", "padded"),  # one bf16 mask every layer saves
    ("transformers = '5.23.0'\nprecision = 'bf16'\nlora_rank = 8", "flattened"),  # one row, a T x T mask
], ids=["bool", "bool-checkpointed", "fp32-autocast", "shared", "flattened"])
def test_the_replica_builds_the_mask_the_prediction_prices(train, padding):
    # bin/smoke's replica (train/model.py ModelOptions.attn_mask) builds the job's mask and calls SDPA with it; its
    # traced step (fake tensors, counted per storage) grows by what the prediction adds for padding, to the byte.
    from podkit.checks.config import parse_job
    from tests.saved_bytes import step_peaks

    def peaks(padding):
        return step_peaks(parse_job(f'[model]\npreset = "tiny"\n[train]\nstack = "hf"\nmicro_batch = 4\n'
                                    f'seq_len = 128\n{train}\npadding = "{padding}"\n[cluster]\n'))

    (traced_plain, analytic_plain), (traced_masked, analytic_masked) = peaks("none"), peaks(padding)
    grown = [p - q for p, q in zip(traced_masked, traced_plain)]
    assert grown == [p - q for p, q in zip(analytic_masked, analytic_plain)]
    assert min(grown) > 0


def test_transformers_4_38_copies_its_position_sized_mask_in_every_layer():
    # 4.38's Llama builds its mask over max_position_embeddings whether or not a token is padded, and every layer
    # indexes it with cache_position (a copy): the replica does the same, and its trace grows as the prediction.
    from podkit.checks.config import parse_job
    from podkit.train.traced import trace

    def peaks(release):
        j = parse_job('[model]\nhidden = 128\nlayers = 2\nheads = 4\nkv_heads = 2\nffn = 344\nvocab = 512\n'
                      'max_position_embeddings = 256\n[train]\nstack = "hf"\nprecision = "bf16"\nlora_rank = 8\n'
                      f'micro_batch = 2\nseq_len = 128\ntransformers = "{release}"\n[cluster]\n')
        est = estimate(j, device="cpu")
        return trace(j, device_kind="cpu").phases["forward"].peak, \
            sum(p.bytes for p in est.phase_parts["forward-end"] if p.term != "overhead"), j.facts.attn_mask

    traced_39, analytic_39, mask_39 = peaks("4.39.3")
    traced_38, analytic_38, mask_38 = peaks("4.38.2")
    assert mask_38 == AttentionMask(2, "positions", True) and mask_39 == AttentionMask(2, "batch", False)
    assert traced_38 - traced_39 == analytic_38 - analytic_39 > 0


def test_preflight_warns_and_the_advisor_offers_flash_attn_for_a_padded_sdpa_job(job):
    from podkit.checks.advisor import advise
    from podkit.checks.rules import flash_attention

    padded = job(model='preset = "llama-3.1-8b"', train="stack = 'hf'\nmicro_batch = 4\nseq_len = 4096\nlora_rank = 16",
                 cluster="gpu = 'H100-80GB'")
    check = flash_attention(padded)
    per_layer = 4 * 4096 * 4096 * 2  # the (b, 1, s, s) bf16 copy every layer keeps
    assert check.status == "warn" and f"{per_layer / 2**30:.1f} GiB per layer" in check.message
    [first, *_] = advise(padded)
    assert ("train.attention", "sdpa", "flash-attn") in first.changes
    assert "flash_attention_2" in first.describe()
    # Unpadded: no mask, nothing to warn of; flash-attn is no lever there (nor on a GPU without it).
    assert flash_attention(padded.replace(train={"padding": "none"})).status == "pass"
    t4 = padded.replace(cluster={"gpu": "T4"})
    assert all(c[0] != "train.attention" for s in advise(t4) for c in s.changes)


@pytest.mark.parametrize("seq_len", [100, 128])
def test_cuda_pads_a_mask_whose_rows_are_not_8_aligned_in_every_layer(job, seq_len):
    # torch's scaled_dot_product_attention hands the memory-efficient kernel a mask padded to rows of a multiple of
    # 8 when they are not (attention.cpp preprocess_mask: pad_bias), a copy per layer that the kernel saves; so even
    # 4.40-4.52's shared bf16 mask costs a copy per layer at 100 tokens (rows of 104), none at 128. The replica pads
    # alike, and its traced step on the H100's kernels grows as the prediction does.
    from podkit.checks.config import parse_job
    from podkit.train.traced import trace

    def run(padding):
        j = parse_job(f'[model]\npreset = "tiny"\n[train]\nstack = "hf"\nprecision = "bf16"\nlora_rank = 8\n'
                      f'micro_batch = 4\nseq_len = {seq_len}\ntransformers = "4.52.4"\npadding = "{padding}"\n'
                      '[cluster]\ngpu = "H100-80GB"\n')
        est = estimate(j)
        analytic = sum(p.bytes for p in est.phase_parts["forward-end"] if p.term != "overhead")
        return j, trace(j).phases["forward"].peak, analytic

    padded, traced_padded, analytic_padded = run("padded")
    _, traced_plain, analytic_plain = run("none")
    assert attention_kernel(padded) == "efficient"
    assert A.block_facts(padded).mask_values == (104 if seq_len == 100 else 0)
    assert traced_padded - traced_plain == analytic_padded - analytic_plain > 0


@pytest.mark.parametrize("seq_len", [40, 104])
def test_a_flattened_rows_efficient_logsumexp_is_aligned_over_all_its_tokens(seq_len):
    # The memory-efficient kernel's logsumexp is (1, heads, ceil(T / 32) * 32) for a flattened row of T = b x s
    # tokens (4 x 40 = 160 and 4 x 104 = 416, both 32-aligned), not ceil(s / 32) * 32 per sequence. Every tensor
    # here is a whole number of 512-byte blocks, so the replica's traced step (which runs the row as one) grows by
    # the prediction's bytes exactly.
    from podkit.checks.config import parse_job
    from podkit.train.traced import trace

    def run(padding):
        j = parse_job(f'[model]\npreset = "tiny"\n[train]\nstack = "hf"\nprecision = "bf16"\nlora_rank = 8\n'
                      f'micro_batch = 4\nseq_len = {seq_len}\ntransformers = "5.23.0"\npadding = "{padding}"\n'
                      '[cluster]\ngpu = "H100-80GB"\n')
        analytic = sum(p.bytes for p in estimate(j).phase_parts["forward-end"] if p.term != "overhead")
        return j, trace(j).phases["forward"].peak, analytic

    flat, traced_flat, analytic_flat = run("flattened")
    _, traced_plain, analytic_plain = run("none")
    assert attention_kernel(flat) == "efficient" and A.block_facts(flat).seq_len == 4 * seq_len
    assert traced_flat - traced_plain == analytic_flat - analytic_plain > 0


def test_the_single_gpu_step_replay_holds_the_mask_through_the_step(job):
    # checks/step_replay.py replays an hf LoRA step under reentrant checkpointing through the allocator; the mask the
    # model builds after the embedding is every block's checkpointed input, alive through backward. 4.52 in pure bf16
    # at 4 x 1024 tokens: one (4, 1, 1024, 1024) bf16 mask and no per-layer copy, so the replay's allocated peak grows
    # by exactly its bytes.
    from podkit.checks import step_replay

    def replay(padding):
        j = job(model='preset = "llama-3.2-1b"', train="stack = 'hf'\ntransformers = '4.52.4'\nprecision = 'bf16'\n"
                f"lora_rank = 16\ncheckpointing = 'full'\nmicro_batch = 4\nseq_len = 1024\npadding = '{padding}'",
                cluster="gpu = 'H100-80GB'")
        assert step_replay.applies(j) and A.block_facts(j).mask_values == 0
        return step_replay.segments(j)

    padded, plain = replay("padded"), replay("none")
    assert padded.peak_allocated - plain.peak_allocated == 4 * 1024 * 1024 * 2
    assert padded.reserved >= plain.reserved + 4 * 1024 * 1024 * 2


def test_sliding_window_masks_are_named_as_not_priced(job):
    # Gemma 3's sliding layers get a mask past their window whatever the padding (masking_utils
    # _ignore_causal_mask_sdpa: kv_length < local_size); podkit does not price it and says so.
    def notes(preset, checkpointing):
        return estimate(job(model=f'preset = "{preset}"', train=f"stack = 'hf'\ncheckpointing = '{checkpointing}'\n"
                                                                 "padding = 'none'")).notes

    assert any("sliding-window layers" in n for n in notes("gemma-3-1b", "none"))
    assert not any("sliding-window layers" in n for n in notes("gemma-3-1b", "full"))
    assert not any("sliding-window layers" in n for n in notes("llama-3.2-1b", "none"))


def test_flash_attn_pads_a_padded_batchs_output_back_into_a_copy(job):
    # transformers' flash-attn path unpads a padded batch for the varlen kernel, which saves its (total, heads, d)
    # output, and pads that back into a new zeros tensor for o_proj (_pad_input; flash_attn.bert_padding.pad_input
    # alike): o_proj keeps that copy where its weight trains. The replica copies alike; its traced step on the
    # H100's kernels grows as the prediction does.
    from transformers.modeling_flash_attention_utils import _pad_input

    from podkit.checks.config import parse_job
    from podkit.train.traced import trace

    out = torch.randn(6, 4, 8)
    padded_back = _pad_input(out, torch.tensor([0, 1, 2, 4, 5, 6]), 2, 4)
    assert padded_back.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()

    def run(padding):
        j = parse_job('[model]\npreset = "tiny"\n[train]\nstack = "hf"\nprecision = "bf16"\nattention = "flash-attn"\n'
                      f'micro_batch = 4\nseq_len = 128\npadding = "{padding}"\n[cluster]\ngpu = "H100-80GB"\n')
        est = estimate(j)
        analytic = sum(p.bytes for p in est.phase_parts["forward-end"] if p.term != "overhead")
        block = sum(A.saved_per_token(A.block_facts(j), "none", False).values())
        return j, trace(j).phases["forward"].peak, analytic, block

    padded, traced_padded, analytic_padded, block_padded = run("padded")
    _, traced_plain, analytic_plain, block_plain = run("none")
    assert padded.facts.flash_repad and padded.facts.attn_mask is None
    assert block_padded - block_plain == padded.shape.q_dim * 2  # o_proj's bf16 input, a copy of its own
    assert traced_padded - traced_plain == analytic_padded - analytic_plain > 0
