"""Sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3): which layers slide, and the mask they get past their window.

transformers >= 4.53 builds a sliding layer's mask unless the keys are fewer than the window
(masking_utils._ignore_causal_mask_sdpa `kv_length < local_attention_size`), so past it those layers get a boolean
(b, 1, s, s) mask even when nothing is padded; SDPA converts it in each of them and its kernel keeps the copy, and
with a mask k/v are repeated to every head (stacks.sliding_attention_mask, JobFacts.layer). The real-model checks run
a transformers 5.23 tiny Gemma 3 in bf16 on the CPU, one sliding and one full layer in the same forward.
"""

import json

import pytest

from podkit.checks import activations as A
from podkit.checks.errors import ConfigError
from podkit.checks.hf_config import shape_from_config
from podkit.checks.memory import estimate
from podkit.checks.presets import PRESETS
from podkit.checks.rules import flash_attention
from podkit.checks.stacks import AttentionMask

BATCH, SEQ, WINDOW = 2, 64, 16
# Gemma3TextConfig with sliding_window_pattern 2: layer 0 slides, layer 1 attends to everything.
TINY = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 1000, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2,
        "max_position_embeddings": 512}
Q_DIM, KV_DIM = 4 * 16, 2 * 16


def _by_hand(batch, seq):
    """A sliding layer's extra over a full one, past the window: its bf16 mask copy and k, v repeated to every head."""
    return batch * seq * seq * 2 + 2 * batch * seq * (Q_DIM - KV_DIM) * 2


def _config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


@pytest.mark.parametrize("window", [WINDOW, 4 * SEQ])
def test_a_sliding_layer_saves_what_podkit_prices_past_its_window_and_below_it(job, tmp_path, window):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.saved_bytes import saved_under

    path = _config(tmp_path, sliding_window=window)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").train()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)  # the collators' attention_mask: nothing padded
    masks = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]) or None,
                                                    with_kwargs=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sliding, full = (saved_under(model.model.layers[i], params, lambda: model(input_ids=ids, attention_mask=ones))
                     for i in (0, 1))
    j = job(model=f'hf_config = "{path}"',
            train=f"stack = 'hf'\ntransformers = '5.23.0'\nprecision = 'bf16'\nseq_len = {SEQ}\n"
                  f"micro_batch = {BATCH}\npadding = 'none'")

    def podkit(kind_sliding):
        return sum(A.saved_per_token(A.block_facts(j, "cpu", kind_sliding), "none", False).values()) * BATCH * SEQ

    past = window <= SEQ
    assert sliding - full == podkit(True) - podkit(False) == (_by_hand(BATCH, SEQ) if past else 0)
    if past:
        # The all-ones attention_mask is folded in: one (b, 1, s, s) boolean mask, not a (1, 1, s, s) expanded.
        assert tuple(masks[0].shape) == (BATCH, 1, SEQ, SEQ) and masks[0].dtype == torch.bool
        assert masks[0].untyped_storage().nbytes() == BATCH * SEQ * SEQ
        assert j.facts.sliding_mask == AttentionMask(1, "batch", True) and j.facts.attn_mask is None
    else:
        assert masks[0] is None and j.facts.sliding_mask is None


def test_which_layers_slide_follows_each_config_class(tmp_path):
    bare = {k: v for k, v in TINY.items() if k not in ("sliding_window", "sliding_window_pattern")}

    def shape(**cfg):
        return shape_from_config({**bare, "num_hidden_layers": 12, **cfg}, "t")

    # Gemma3TextConfig: every sliding_window_pattern-th layer is full ((i + 1) % pattern == 0), 6 by default, over
    # 4096 tokens unless the file says.
    assert shape(sliding_window_pattern=4).sliding_layers == (0, 1, 2, 4, 5, 6, 8, 9, 10)
    assert shape().sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and shape().sliding_window == 4096
    # Gemma2Config: every other layer, from the first.
    assert shape(model_type="gemma2").sliding_layers == (0, 2, 4, 6, 8, 10)
    # layer_types, where the file lists them, are read as given.
    types = ["full_attention"] * 11 + ["sliding_attention"]
    assert shape(layer_types=types).sliding_layers == (11,)
    # Mistral: every layer once a window is set; the family default (4096) when the key is absent, none when null.
    mistral = {"model_type": "mistral"}
    assert shape(**mistral).sliding_layers == tuple(range(12)) and shape(**mistral).sliding_window == 4096
    assert shape(**mistral, sliding_window=None).sliding_layers == ()
    # Qwen2: only with use_sliding_window, from max_window_layers on.
    assert shape(model_type="qwen2").sliding_layers == ()
    assert shape(model_type="qwen2", use_sliding_window=True, max_window_layers=9).sliding_layers == (9, 10, 11)
    # Mixtral and Phi-3 default to no window; Llama has none at all.
    assert shape(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2).sliding_layers == ()
    assert shape(model_type="phi3").sliding_layers == ()
    assert shape(model_type="llama", sliding_window=8).sliding_layers == ()


@pytest.mark.parametrize("preset, window, sliding", [
    ("gemma-3-27b", 1024, 52),  # 62 layers, every sixth full
    ("gemma-3-1b", 512, 22),
    ("gemma-2-9b", 4096, 21),
    ("mistral-7b", 4096, 32),  # Mistral-7B-v0.1
    ("phi-3-mini", 2047, 32),
    ("mistral-nemo-12b", 0, 0),  # sliding_window null
    ("mixtral-8x7b", 0, 0),
    ("qwen2.5-7b", 0, 0),  # use_sliding_window false
])
def test_presets_carry_their_configs_windows(preset, window, sliding):
    shape = PRESETS[preset]
    assert (shape.sliding_window, len(shape.sliding_layers)) == (window, sliding)


def test_a_window_over_no_layer_or_past_the_model_is_refused():
    with pytest.raises(ConfigError, match="sliding_window"):
        shape_from_config({**TINY, "layer_types": ["sliding_attention"] * 2, "sliding_window": -4,
                           "model_type": "gemma2"}, "t")
    from podkit.checks.models import ModelShape
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelShape("t", 64, 2, 4, 2, 96, 1000, False, sliding_window=8, sliding_layers=(2,))


def test_estimate_prices_the_sliding_layers_masks_by_hand(job):
    # Gemma 3 1B (26 layers, 22 sliding over 512 tokens; 4 heads and 1 kv head of 256) at 2 x 1024, unpadded, no
    # checkpointing: past the window each sliding layer keeps its bf16 mask copy and k, v repeated; below it (a 2048
    # window read off a config.json) none. The full layers get no mask either way.
    def saved(window, release="5.23.0"):
        cfg = {**json.loads(json.dumps(_gemma3_1b())), "sliding_window": window}
        est = estimate(job(model=f"hf_config = '{_write(cfg)}'",
                           train=f"stack = 'hf'\ntransformers = '{release}'\nprecision = 'bf16'\nlora_rank = 8\n"
                                 "micro_batch = 2\nseq_len = 1024\npadding = 'none'",
                           cluster="gpu = 'H100-80GB'"))
        [p] = [p for p in est.phase_parts["backward"] if p.label.startswith("blocks' saved activations")]
        return p.bytes, est.notes

    (past, notes), (below, _) = saved(512), saved(2048)
    b, s, q, kv = 2, 1024, 4 * 256, 256
    assert past - below == 22 * (b * s * s * 2 + 2 * b * s * (q - kv) * 2)
    assert any("sliding-window layers past their window" in n for n in notes)
    # Before masking_utils (4.53) the families built their sliding masks each in its own way: named, not priced.
    old_past, old_notes = saved(512, "4.52.4")
    assert old_past == saved(2048, "4.52.4")[0]
    assert any("sliding-window layers (22 of 26, window 512)" in n and "not priced" in n for n in old_notes)


def _gemma3_1b() -> dict:
    from podkit.checks.presets import CONFIGS

    return CONFIGS["gemma-3-1b"][1]


def _write(cfg: dict) -> str:
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("extra", ["padding = 'none'", "padding = 'none'\ncheckpointing = 'full'",
                                   "padding = 'padded'", "padding = 'flattened'"],
                         ids=["unpadded", "unpadded-checkpointed", "padded", "flattened"])
def test_the_replica_builds_the_sliding_mask_the_prediction_prices(tmp_path, extra):
    # bin/smoke's replica gives its sliding layers (ModelOptions.sliding_layers) their own mask, kernel and k/v repeat;
    # its traced step grows by what the prediction adds for a window the sequence outruns, to the byte. Three layers,
    # the first and last sliding (pattern 2), so backward starts in one, as the prediction assumes.
    pytest.importorskip("torch")
    from podkit.checks.config import parse_job
    from tests.saved_bytes import step_peaks

    def peaks(window):
        path = _config(tmp_path, num_hidden_layers=3, hidden_size=128, intermediate_size=344, vocab_size=512,
                       head_dim=32, sliding_window=window)
        return step_peaks(parse_job(f'[model]\nhf_config = "{path}"\n[train]\nstack = "hf"\nmicro_batch = 4\n'
                                    f'seq_len = 128\nprecision = "bf16"\nlora_rank = 8\n{extra}\n[cluster]\n'))

    (traced_in, analytic_in), (traced_past, analytic_past) = peaks(4096), peaks(64)
    grown = [p - q for p, q in zip(traced_past, traced_in)]
    assert grown == [p - q for p, q in zip(analytic_past, analytic_in)]
    if "none" in extra:  # padded and flattened batches get the mask at any window
        assert min(grown) > 0


def test_preflight_warns_of_the_sliding_layers_copies_and_not_below_the_window(job):
    j = job(model='preset = "gemma-3-27b"',
            train="stack = 'hf'\ntransformers = '5.23.0'\nmicro_batch = 2\nseq_len = 4096\nlora_rank = 16\n"
                  "padding = 'none'", cluster="gpu = 'H100-80GB'")
    check = flash_attention(j)
    per_layer = 2 * 4096 * 4096 * 2
    assert check.status == "warn" and "52 sliding-window layers" in check.message
    assert f"{per_layer / 2**30:.1f} GiB per layer" in check.message and "flash-attn" in check.fix
    assert flash_attention(j.replace(train={"seq_len": 1024 - 1})).status == "pass"
    assert flash_attention(j.replace(train={"checkpointing": "full"})).status == "pass"


def test_gemma2_under_sdpa_is_refused_by_transformers_5(job):
    # transformers 5.23 modeling_gemma2.py `_supports_sdpa = False  # sdpa does not support softcapping` (and
    # integrations/sdpa_attention.py raises on a softcap): from_pretrained(attn_implementation="sdpa") raises, so
    # preflight cannot price Gemma 2's sliding masks under SDPA there, nor offer checkpointing as the way out.
    # (4.57.1 still loads it and silently drops the soft-capping.)
    j = job(model='preset = "gemma-2-9b"',
            train="stack = 'hf'\ntransformers = '5.23.0'\nmicro_batch = 2\nseq_len = 8192\nlora_rank = 16\n"
                  "padding = 'none'", cluster="gpu = 'H100-80GB'")
    assert flash_attention(j).status == "fail"


@pytest.mark.parametrize("padding", ["padded", "flattened"])
def test_equal_length_batches_are_offered_only_where_they_avoid_the_copies(job, padding):
    # Gemma 3 27B at 4096 tokens is past its 1024-token window: with padding = 'none' its 52 sliding layers still get
    # a mask each and keep a copy, so neither the check nor the estimate's note may offer equal-length batches as
    # what avoids the copies.
    j = job(model='preset = "gemma-3-27b"',
            train=f"stack = 'hf'\ntransformers = '5.23.0'\nmicro_batch = 2\nseq_len = 4096\nlora_rank = 16\n"
                  f"padding = '{padding}'", cluster="gpu = 'H100-80GB'")
    equal = j.replace(train={"padding": "none"})
    assert flash_attention(equal).status == "warn"  # the sliding layers' copies stay
    assert "padding = 'none'" not in flash_attention(j).fix
    assert not [n for n in estimate(j).notes if "copy of the" in n and "padding = 'none'" in n]


def test_a_checkpointed_unpadded_job_is_not_told_of_a_padding_mask(job):
    # Past the window an unpadded Gemma 3 job's sliding layers take the efficient kernel for their window's mask:
    # nothing is padded.
    j = job(model='preset = "gemma-3-27b"',
            train="stack = 'hf'\ntransformers = '5.23.0'\nmicro_batch = 2\nseq_len = 4096\nlora_rank = 16\n"
                  "padding = 'none'\ncheckpointing = 'full'", cluster="gpu = 'H100-80GB'")
    check = flash_attention(j)
    assert check.status == "pass" and "padding mask" not in check.message


def _qwen2_moe(tmp_path, **changes):
    cfg = {"model_type": "qwen2_moe", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
           "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_qwen2_moe_before_transformers_5_is_not_priced_by_5_23s_layer_types(job, tmp_path):
    # transformers 4.53-4.57 modeling_qwen2_moe.py builds no masking_utils mask and has no layer_types: its
    # _update_causal_mask makes one additive mask for every layer (the window folded in by
    # _prepare_4d_causal_attention_mask_with_cache_position), and only flash-attn slides, from max_window_layers on.
    # 5.23's rule (every other layer below max_window_layers, a boolean mask of their own) does not apply.
    j = job(model=f"hf_config = '{_qwen2_moe(tmp_path)}'",
            train="stack = 'hf'\ntransformers = '4.57.1'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 256\n"
                  "padding = 'none'", cluster="gpu = 'H100-80GB'")
    assert not j.facts.sliding_own


def test_every_sliding_layer_is_priced_where_dense_and_moe_blocks_mix(job, tmp_path):
    # One sliding layer (layer 0) in 4 blocks, 2 dense (mlp_only_layers) and 2 MoE: splitting the sliding share
    # round(2 x 1 / 4) per kind rounds it away in both, and its mask copy goes unpriced.
    j = job(model=f"hf_config = '{_qwen2_moe(tmp_path, mlp_only_layers=[0, 1])}'",
            train="stack = 'hf'\ntransformers = '5.23.0'\nprecision = 'bf16'\nmicro_batch = 2\nseq_len = 256\n"
                  "padding = 'none'", cluster="gpu = 'H100-80GB'")
    assert j.shape.sliding_layers == (0,) and j.facts.sliding_mask is not None
    assert any("over 1 layers" in n for n in estimate(j).notes)
