import pytest

from podkit.checks.config import EXAMPLE_JOB, load_job, parse_job
from podkit.checks.errors import ConfigError


def test_example_job_loads():
    job = load_job(EXAMPLE_JOB)
    assert job.shape.name == "llama-3.2-1b" and job.cluster.gpu == "A10G"


@pytest.mark.parametrize("text,field,needle", [
    ('[model]\npreset="llama-3.2-1b"\n[train]\nmicro_batch=0', "train.micro_batch", "at least 1"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\nmicro_batch=-4', "train.micro_batch", "at least 1"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\nprecision="bf32"', "train.precision", "unknown value"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\nmicro_bacth=2', "train.micro_bacth", "did you mean 'micro_batch'"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\nmicro_batch="2"', "train.micro_batch", "must be int"),
    ('[model]\npreset="llama-3.2-1b"\n[trian]\n', "[trian]", "did you mean 'train'"),
    ('[model]\npreset="lama-3.2-1b"', "model.preset", "did you mean 'llama-3.2-1b'"),
    ('[model]\npreset="llama-3.2-1b"\n[cluster]\ngpu="H1000"', "cluster.gpu", "unknown GPU"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\nbase_quant="nf4"', "train.base_quant", "lora_rank"),
    ('[model]\npreset="llama-3.2-1b"\n[cluster]\noffload="all"', "cluster.offload", "zero3"),
    ('[model]\npreset="llama-3.2-1b"\nparams=1e9', "model", "more than one"),
    ('[train]\nmicro_batch=1', "[model]", "missing"),
    ('[model]\nhidden=512\nlayers=2', "model", "lack heads, ffn, vocab"),
    ('[model]\npreset=', "", "not valid TOML"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\ntorch="nightly"', "train.torch", "not a version"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\ntransformers="main"', "train.transformers", "not a version"),
    ('[model]\npreset="llama-3.2-1b"\n[train]\ntransformers="4.28.0"', "train.transformers", "older than podkit models"),
])
def test_bad_config_names_field_and_fix(text, field, needle):
    with pytest.raises(ConfigError) as info:
        parse_job(text)
    assert info.value.field == field
    assert needle in str(info.value)


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "nope.toml")


def test_hf_config_path_is_relative_to_job_file(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,'
        ' "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": true,'
        ' "head_dim": 64}')
    job_file = tmp_path / "job.toml"
    job_file.write_text('[model]\nhf_config = "m/config.json"\n')
    assert load_job(job_file).shape.params == 1_235_814_400


def test_explicit_dimensions():
    job = parse_job("[model]\nhidden=2048\nlayers=16\nheads=32\nkv_heads=8\nffn=8192\nvocab=128256\n"
                    "tie_embeddings=true\nhead_dim=64\nname='mine'")
    assert job.shape.params == 1_235_814_400 and job.shape.name == "mine"


def test_replace_changes_fields_and_keeps_the_resolved_shape(job):
    j = job(train="micro_batch=4")
    k = j.replace(train={"micro_batch": 1}, cluster={"gpu": "H100"})
    assert (j.train.micro_batch, k.train.micro_batch, k.cluster.gpu) == (4, 1, "H100")
    assert k.shape is j.shape


def test_hf_hub_id_is_one_model_source_among_the_others():
    with pytest.raises(ConfigError, match="more than one of preset, hf_config, hf, params"):
        parse_job('[model]\npreset = "qwen3-8b"\nhf = "Qwen/Qwen3-8B"\n')


def test_a_value_that_starts_one_choice_is_pointed_at_it():
    """'fp16' is the start of 'fp16-mixed'; difflib alone suggested 'bf16' (QA, 2026-11-24)."""
    from podkit.checks.errors import closest

    assert closest("fp16", ("fp32", "bf16", "bf16-mixed", "fp16-mixed")) == "did you mean 'fp16-mixed'?"
    assert closest("bf16x", ("fp32", "bf16", "bf16-mixed")) == "did you mean 'bf16'?"
