"""bin/smoke's replica builds Qwen3's q/k norms (train/model.py ModelOptions.qk_norm), so its run measures what the
prediction prices for them (activations.Trace.rmsnorm on q and k, per head)."""

import json

import pytest

from podkit.checks import activations as A
from podkit.checks.config import parse_job
from tests.saved_bytes import saved_under

torch = pytest.importorskip("torch")

TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 344, "vocab_size": 512, "head_dim": 32, "max_position_embeddings": 512,
        "tie_word_embeddings": True}


def _replica_block_saved(tmp_path, model_type: str) -> tuple[float, float]:
    """(bytes per token the replica's last block saves, podkit's saved_per_token) for an hf LoRA job."""
    from podkit.train import model as model_mod
    from podkit.train import step as step_mod

    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({**TINY, "model_type": model_type}))
    job = parse_job(f'[model]\nhf_config = "{path}"\n[train]\nstack = "hf"\nprecision = "bf16"\nlora_rank = 8\n'
                    'micro_batch = 2\nseq_len = 128\npadding = "none"\n[cluster]\n').as_replica()
    model = model_mod.materialize(model_mod.build(job.shape, step_mod.model_options(job), "bf16"),
                                  torch.device("cpu"), 0)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 128))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = saved_under(model.layers[-1], skip, lambda: model(tokens, tokens))
    return saved / tokens.numel(), sum(A.saved_per_token(A.block_facts(job, "cpu"), "none", False).values())


def test_the_replica_saves_what_podkit_prices_for_q_k_norms(tmp_path):
    # Qwen3 against the same block without q/k norms (a Llama): each q_norm and k_norm keeps its fp32 upcast and an
    # fp32 rsqrt per head, 512 + 16 + 256 + 8 B per token here; the replica's difference is podkit's.
    qwen3, podkit_qwen3 = _replica_block_saved(tmp_path, "qwen3")
    llama, podkit_llama = _replica_block_saved(tmp_path, "llama")
    assert qwen3 - llama == podkit_qwen3 - podkit_llama == 4 * (128 + 4 + 64 + 2)
