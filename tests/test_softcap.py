"""Gemma 2's soft-caps: `x / cap`, `tanh`, `* cap`, on the head's output before the loss and on eager attention's scores.

TanhBackward0 saves its output. For the logits that is a compute-dtype tensor of every logit, which lives through the
loss's forward and its backward (JobFacts.logit_softcap, activations.loss_bytes): e B per logit more at both of the
loss's peaks. In eager attention it is an s x s tensor per head that every layer keeps for backward
(BlockFacts.attn_softcap). The real-model checks run a transformers 5.23 tiny Gemma2ForCausalLM on the CPU with and
without `final_logit_softcapping` and `attn_logit_softcapping`.
"""

import json

import pytest

from podkit.checks import activations as A
from podkit.checks.hf_config import shape_from_config

BATCH, SEQ, VOCAB = 2, 64, 4096
LOGITS = BATCH * SEQ * VOCAB
# Gemma2Config with one layer; its attention soft-cap off so that eager attention is all it asks for.
TINY = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "sliding_window": 4096, "attn_logit_softcapping": None,
        "tie_word_embeddings": False}


def _config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def _gemma2_peaks(cap, precision: str) -> tuple[int, int, int]:
    """A real Gemma2ForCausalLM's loss step counted by real torch on the CPU: the forward's peak, what the forward
    leaves, and the backward's peak, in bytes above the start. bf16-mixed: fp32 weights under bf16 autocast."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from podkit.train.memprobe import TensorCounter

    torch.manual_seed(0)
    config = Gemma2Config(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")},
                          final_logit_softcapping=cap, attn_implementation="eager")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = Gemma2ForCausalLM(config).to(dtype).train()
    ids = torch.randint(VOCAB, (BATCH, SEQ))
    counter = TensorCounter()
    counter.switch_on()
    try:
        counter.reset_peak()
        before = counter.allocated()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            out = model(input_ids=ids, labels=ids)
        forward, left = counter.window_peak() - before, counter.allocated() - before
        loss = out.loss
        del out  # the Trainer's compute_loss returns the loss alone
        counter.reset_peak()
        loss.backward()
        backward = counter.window_peak() - before
    finally:
        counter.switch_off()
    return forward, left, backward


@pytest.mark.parametrize("precision,e", [("bf16", 2), ("bf16-mixed", 2), ("fp32", 4)])
def test_a_real_gemma2_keeps_tanhs_output_as_podkit_prices_it(job, tmp_path, precision, e):
    pytest.importorskip("transformers")
    plain, capped = _gemma2_peaks(None, precision), _gemma2_peaks(30.0, precision)
    # tanh's output, e B per logit, at the forward's peak, after it, and at backward's peak
    assert [c - p for c, p in zip(capped, plain)] == [e * LOGITS] * 3

    def loss(cap):
        j = job(model=f'hf_config = "{_config(tmp_path, final_logit_softcapping=cap)}"',
                train=f"stack = 'hf'\nprecision = '{precision}'\nmicro_batch = {BATCH}\nseq_len = {SEQ}")
        return A.loss_bytes(j, SEQ)

    lb_plain, lb_capped = loss(None), loss(30.0)
    assert (lb_capped.forward - lb_plain.forward, lb_capped.backward - lb_plain.backward) == (e, e)
    assert (lb_capped.kept, lb_capped.hole) == (lb_plain.kept, lb_plain.hole)


def test_the_stacks_that_soft_cap_the_logits(job, tmp_path):
    def cap(model='preset = "gemma-2-9b"', train=""):
        return job(model=model, train=train).facts.logit_softcap

    for stack in ("hf", "deepspeed", "litgpt", "podkit"):
        assert cap(train=f"stack = '{stack}'") == 30.0, stack
    # torchtune caps the final norm's output (Gemma2FinalNorm), before the head; torchtitan has no Gemma
    assert cap(train="stack = 'torchtune'\nprecision = 'bf16'") == 0
    assert cap(train="stack = 'torchtitan'") == 0
    # Liger's and Cut Cross-Entropy's kernels take the cap inside and make no logits
    assert cap(train="stack = 'hf'\nloss = 'liger'") == 0
    assert cap(train="stack = 'hf'\nloss = 'fused'") == 0
    assert cap(model='preset = "gemma-3-4b"', train="stack = 'hf'") == 0
    # config.json: an explicit null is no cap (Gemma2ForCausalLM tests `is not None`), an absent key Gemma2Config's 30
    config = {k: v for k, v in TINY.items() if k != "attn_logit_softcapping"}
    assert shape_from_config({**config, "final_logit_softcapping": None}, "g").logit_softcap == 0
    assert shape_from_config(config, "g").logit_softcap == 30.0
    assert shape_from_config(config, "g").attn_softcap == 50.0
    assert shape_from_config({**config, "attn_logit_softcapping": None}, "g").attn_softcap == 0


def test_the_replica_soft_caps_as_the_model_does():
    """bin/smoke's replica makes the same three tensors (train/model.py Decoder._head), whole or per chunk of a
    chunked loss: e B per logit more at the loss's forward and backward peaks."""
    pytest.importorskip("torch")
    from podkit.train import model as model_mod
    from tests.saved_bytes import loss_peaks

    def peaks(cap, loss, precision):
        return loss_peaks(loss, precision, logit_softcap=cap)

    logits = 4 * 128 * 512
    for loss in ("fp32-upcast", "chunked"):
        for precision, e in (("bf16", 2), ("fp32", 4)):
            (f0, b0), (f1, b1) = peaks(0.0, loss, precision), peaks(30.0, loss, precision)
            assert f1 - f0 == e * logits, (loss, precision)
            # unchunked, backward peaks at the loss's start, beside every tanh output; chunked (fp32) it may peak
            # later, after some chunks' outputs went (the whole step's test below holds it to the estimate)
            assert b1 - b0 == e * logits if loss == "fp32-upcast" else 0 < b1 - b0 <= e * logits, (loss, precision)
    with pytest.raises(ValueError, match="logit_softcap"):
        model_mod.ModelOptions(logit_softcap=-1.0)


@pytest.mark.parametrize("stack", ["hf", "litgpt"])
def test_the_traced_replica_and_the_estimate_grow_alike(tmp_path, stack):
    """A whole step of a Gemma 2 job: the replica traced on fake tensors and the estimate, with the cap and without;
    litgpt caps each 128-token chunk of the head's output."""
    pytest.importorskip("torch")
    from podkit.checks.config import parse_job
    from tests.saved_bytes import step_peaks

    def peaks(cap):
        path = _config(tmp_path, final_logit_softcapping=cap, vocab_size=512, num_hidden_layers=2)
        return step_peaks(parse_job(f'[model]\nhf_config = "{path}"\n[train]\nstack = "{stack}"\nmicro_batch = 4\n'
                                    f'seq_len = 512\nprecision = "bf16"\nlora_rank = 8\nattention = "eager"\n[cluster]\n'))

    (traced_plain, analytic_plain), (traced_capped, analytic_capped) = peaks(None), peaks(30.0)
    grown = [c - p for c, p in zip(traced_capped, traced_plain)]
    assert grown == [c - p for c, p in zip(analytic_capped, analytic_plain)]
    assert grown[0] == 2 * 4 * 512 * 512  # the forward's peak is the loss's


def test_the_allocator_replay_holds_tanhs_output(job, tmp_path):
    """The single-GPU replay (checks/step_replay.py) of a transformers 4.46 LoRA job walks the soft-cap too: its
    allocated peak, the loss's, grows by tanh's output."""
    from podkit.checks import step_replay

    def replayed(cap):
        path = _config(tmp_path, final_logit_softcapping=cap, hidden_size=256, num_hidden_layers=2)
        j = job(model=f'hf_config = "{path}"',
                train="stack = 'hf'\ntransformers = '4.46.0'\nprecision = 'bf16-mixed'\nmicro_batch = 2\n"
                      "seq_len = 512\nlora_rank = 16\ncheckpointing = 'full'\nattention = 'eager'")
        assert step_replay.applies(j) and j.facts.logit_softcap == (cap or 0)
        return step_replay.segments(j)

    capped, plain = replayed(30.0), replayed(None)
    assert capped.peak_allocated - plain.peak_allocated == 2 * 2 * 512 * VOCAB


@pytest.mark.parametrize("precision,e", [("bf16", 2), ("bf16-mixed", 2), ("fp32", 4)])
def test_eager_attention_keeps_the_capped_scores_tanh(job, tmp_path, precision, e):
    """transformers' eager_attention_forward soft-caps the scores before the mask and the fp32 softmax: the layer saves
    tanh's (b, heads, s, s) output more, as podkit's eager block says."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.saved_bytes import saved_under

    def saved(cap):
        path = _config(tmp_path, attn_logit_softcapping=cap, final_logit_softcapping=None, num_attention_heads=4,
                       num_key_value_heads=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent), attn_implementation="eager",
                                                 dtype=torch.bfloat16 if precision == "bf16" else torch.float32).train()
        ids = torch.randint(VOCAB, (BATCH, SEQ))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                model(input_ids=ids, labels=ids)

        j = job(model=f'hf_config = "{path}"', train=f"stack = 'hf'\nprecision = '{precision}'\nseq_len = {SEQ}\n"
                                                     f"micro_batch = {BATCH}\nattention = 'eager'")
        podkit = sum(A.saved_per_token(A.block_facts(j, "cpu"), "none", False).values()) * BATCH * SEQ
        return saved_under(model.model.layers[0].self_attn, params, run), podkit

    (real_plain, podkit_plain), (real_capped, podkit_capped) = saved(None), saved(50.0)
    assert real_capped - real_plain == podkit_capped - podkit_plain == e * BATCH * 4 * SEQ * SEQ


def test_the_replicas_eager_attention_soft_caps_and_the_trace_matches_the_estimate(tmp_path):
    """bin/smoke's replica caps its eager scores as the model does (train/model.py _eager_attention): the traced step
    and the estimate grow alike, by every layer's tanh output at the forward's end."""
    pytest.importorskip("torch")
    from podkit.checks.config import parse_job
    from tests.saved_bytes import step_peaks

    def peaks(cap):
        path = _config(tmp_path, attn_logit_softcapping=cap, final_logit_softcapping=None, vocab_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        return step_peaks(parse_job(f'[model]\nhf_config = "{path}"\n[train]\nstack = "hf"\nmicro_batch = 2\n'
                                    f'seq_len = 256\nprecision = "bf16"\nlora_rank = 8\nattention = "eager"\n[cluster]\n'))

    (traced_plain, analytic_plain), (traced_capped, analytic_capped) = peaks(None), peaks(50.0)
    grown = [c - p for c, p in zip(traced_capped, traced_plain)]
    assert grown == [c - p for c, p in zip(analytic_capped, analytic_plain)]
    assert grown[0] == 2 * 2 * 2 * 4 * 256 * 256  # two layers' bf16 (2, 4, 256, 256) tanh outputs


def test_the_eager_warning_counts_the_tanh_and_points_to_flash_attn(job):
    from podkit.checks.rules import flash_attention, gib

    train = "stack = 'hf'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\nattention = 'eager'"
    gemma2, llama = (flash_attention(job(model=f'preset = "{p}"', train=train)) for p in ("gemma-2-9b", "llama-3.2-1b"))
    s2 = 2 * 4096 * 4096
    # fp32 softmax output + its bf16 cast (+ the bf16 tanh): Gemma 2 9B has 16 heads, Llama 3.2 1B 32
    assert f"{gib(16 * s2 * (4 + 2 + 2))} per layer" in gemma2.message and "flash-attn" in gemma2.fix
    assert f"{gib(32 * s2 * (4 + 2))} per layer" in llama.message and llama.fix == "use attention = 'sdpa'"


@pytest.mark.parametrize("stack", ["litgpt", "torchtune"])
def test_litgpt_and_torchtune_soft_cap_gemma2s_attention_explicitly_whatever_the_attention_setting(job, stack):
    """Review 2026-11-26: litgpt (model.py CausalSelfAttention.scaled_dot_product_attention, "with softcapping we
    cannot use SDPA": q @ k.mT, do_softcapping, fp32 softmax; Lightning-AI/litgpt@2685705) and torchtune
    (models/gemma2/_attention.py Gemma2Attention.forward: matmul, tanh soft-cap, softmax(output.float())) take no
    kernel for Gemma 2's soft-capped attention: the s x s scores, tanh's output and the fp32 softmax are kept whatever
    train.attention says. podkit priced them under the default 'sdpa' as SDPA's flash kernel (no s x s matrix: 4 GiB
    less per layer for Gemma 2 9B at 2 x 4096 in bf16), its check said so, and its eager warning pointed to flash-attn,
    which these stacks do not use for it."""
    from podkit.checks.rules import WARN, flash_attention
    from podkit.train.step import model_options

    gemma2 = 'preset = "gemma-2-9b"'
    train = f"stack = '{stack}'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 4096\n"
    eager = A.saved_per_token(A.block_facts(job(model=gemma2, train=train + "attention = 'eager'")), "none")
    assert "soft-capped scores' tanh (s x s)" in eager
    for attention in ("sdpa", "flash-attn", "eager"):
        j = job(model=gemma2, train=train + f"attention = '{attention}'")
        assert A.saved_per_token(A.block_facts(j), "none") == eager, attention
        assert model_options(j.as_replica()).attention == "eager", attention  # bin/smoke's replica runs it so too
        check = flash_attention(j)
        assert check.status == WARN and "s x s scores" in check.message and "flash-attn" not in check.fix, check
    # a model without the cap runs the setting's kernel (Gemma 1: torchtune's and litgpt's SDPA)
    assert A.attention_kernel(job(model='preset = "gemma-2b"', train=train + "attention = 'sdpa'")) != "eager"
