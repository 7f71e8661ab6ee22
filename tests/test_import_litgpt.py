"""bin/preflight --from litgpt:CONFIG.yaml: litgpt's own config_hub files (tests/fixtures/litgpt/, verbatim at
Lightning-AI/litgpt 26857050fe3f, v0.5.13) read into the job.

Each expected job below is derived by hand from the file and litgpt's source: finetune/lora.py, full.py and
pretrain.py setup(), args.py TrainArgs.gradient_accumulation_iters ((global // GPUs) // micro), config.py
(Meta-Llama-3.1-8B is Llama 3.1 8B's shape; litgpt's GPT keeps its own lm_head, so a tied Hub model is
trained untied), lightning's precision plugins (bf16-true: pure bf16) and BitsandbytesPrecision (nf4
without double quantization for bnb.nf4, PagedAdamW through utils.py instantiate_bnb_optimizer).
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from podkit.checks import memory
from podkit.checks.config import parse_job
from podkit.checks.errors import ConfigError
from podkit.checks.importers import KINDS, build_job, litgpt, read_data

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "litgpt"
EXAMPLES = ROOT / "checks" / "examples"
PREFLIGHT = ROOT / "bin" / "preflight"

LLAMA_32_1B_UNTIED = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256,
                      "tie_embeddings": False}
LORA_8B = {"precision": "bf16", "micro_batch": 1, "grad_accum": 8, "global_batch": 8, "seq_len": 512,
           "lora_rank": 32, "lora_targets": ["q_proj", "v_proj"], "lora_dropout": 0.05, "optimizer": "adamw",
           "optimizer_impl": "foreach", "base_quant": "none", "checkpointing": "none", "grad_clip": 0.0,
           "warmup_steps": 10, "weight_decay": 0.0, "loss": "stack"}
EXPECTED = {
    "llama-3.1-8b-lora.yaml": ({"preset": "llama-3.1-8b"}, LORA_8B, {"gpus_per_node": 1, "sharding": "none"}),
    "llama-3.1-8b-qlora.yaml": ({"preset": "llama-3.1-8b"},
                                {**LORA_8B, "micro_batch": 2, "grad_accum": 4, "base_quant": "nf4",
                                 "double_quant": False, "optimizer": "paged_adamw", "optimizer_impl": "stack"},
                                {"gpus_per_node": 1, "sharding": "none"}),
    # devices: 4 -> FSDPStrategy(FULL_SHARD, activation_checkpointing_policy={Block}); 64 // 4 // 4 = 4.
    "llama-3.1-8b-full.yaml": ({"preset": "llama-3.1-8b"},
                               {"precision": "bf16", "micro_batch": 4, "grad_accum": 4, "global_batch": 64,
                                "seq_len": 512, "lora_rank": 0, "checkpointing": "full", "loss": "native",
                                "optimizer": "adamw", "optimizer_impl": "foreach", "weight_decay": 0.1,
                                "grad_clip": 0.0, "warmup_steps": 25},
                               {"gpus_per_node": 4, "sharding": "zero3"}),
    "llama-3.2-1B-lora.yaml": (LLAMA_32_1B_UNTIED, LORA_8B, {"gpus_per_node": 1, "sharding": "none"}),
    # Every lora_* flag true: q, k, v, proj, the MLP's three linears and the head; 6 // 1 // 2 = 3.
    "gemma-2b-qlora.yaml": ({"hidden": 2048, "layers": 18, "heads": 8, "kv_heads": 1, "ffn": 16384, "vocab": 256000,
                             "tie_embeddings": False},
                            {"precision": "bf16", "micro_batch": 2, "grad_accum": 3, "global_batch": 6,
                             "seq_len": 512, "lora_rank": 16, "lora_dropout": 0.1, "base_quant": "nf4",
                             "double_quant": False, "optimizer": "paged_adamw", "warmup_steps": 200,
                             "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj", "lm_head"]},
                            {"gpus_per_node": 1, "sharding": "none"}),
    # model_name tiny-llama-1.1b (config.py: 2048 / 22 layers / 32 heads / 4 groups / 5632 / 32000); devices
    # 'auto' leaves the GPU count and so the accumulation open; pretrain.py passes fused=True on CUDA and
    # requires max_norm.
    "pretrain-tinyllama.yaml": ({"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632, "vocab": 32000,
                                 "tie_embeddings": False},
                                {"precision": "bf16-mixed", "micro_batch": 4, "seq_len": 2048, "lora_rank": 0,
                                 "loss": "native", "optimizer": "adamw", "optimizer_impl": "fused", "grad_clip": 1.0,
                                 "lr": 4e-4, "weight_decay": 0.1, "warmup_steps": 2000},
                                {}),
    # The inline model_config (Llama-style stories15M), its embedding tied to the head by train.tie_embeddings.
    "pretrain-tinystories.yaml": ({"hidden": 288, "layers": 6, "heads": 6, "kv_heads": 6, "ffn": 768, "vocab": 32000,
                                   "tie_embeddings": True},
                                  {"precision": "bf16-mixed", "micro_batch": 128, "seq_len": 256, "loss": "native",
                                   "optimizer_impl": "fused", "grad_clip": 1.0},
                                  {}),
}


def preflight(*args):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return subprocess.run([str(PREFLIGHT), "--no-probe", *args], capture_output=True, text=True, env=env, timeout=60)


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return str(p)


def test_fixtures_are_verbatim_and_named():
    assert sorted(p.name for p in FIXTURES.glob("*.yaml")) == sorted(EXPECTED)
    for p in FIXTURES.glob("*.yaml"):
        assert p.read_text().startswith("# Lightning-AI/litgpt config_hub/") and "26857050fe3f" in p.read_text()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_hub_file_maps_onto_the_job(name):
    model, train, cluster = EXPECTED[name]
    imp = build_job(None, [f"litgpt:{FIXTURES / name}"])
    job = imp.job
    for key, want in model.items():
        assert getattr(job.model, key) == want, key
    for key, want in train.items():
        got = getattr(job.train, key)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == want, key
    for key, want in cluster.items():
        assert getattr(job.cluster, key) == want, key
    assert job.train.stack == "litgpt" and job.train.attention == "sdpa"
    f = imp.files[0]
    assert f.kind == "litgpt"
    # Every key is mapped, listed as ignored or reported as left open, never dropped.
    data = read_data(FIXTURES / name)
    told = " ".join(f.mapped + f.ignored + list(f.unresolved.values()))
    for key in data:
        assert key in told, key
    for key in data["train"]:
        assert f"train.{key}" in told, key


def test_pretrain_with_devices_auto_reports_what_it_leaves_open(tmp_path):
    imp = build_job(None, [str(FIXTURES / "pretrain-tinyllama.yaml")])
    assert any("cluster.gpus_per_node" in u and "devices = 'auto'" in u for u in imp.unresolved)
    assert any("train.grad_accum" in u for u in imp.unresolved)
    assert any("torch.compile" in w for w in imp.files[0].warnings)
    # Given the GPU count, litgpt's accumulation follows: 512 // 8 // 4 = 16, sharded FSDP without checkpointing.
    data = (FIXTURES / "pretrain-tinyllama.yaml").read_text().replace("devices: auto", "devices: 8")
    imp = build_job(None, [write(tmp_path, "pretrain.yaml", data)])
    t, c = imp.job.train, imp.job.cluster
    assert (c.gpus_per_node, c.sharding, t.grad_accum, t.checkpointing) == (8, "zero3", 16, "none")


def test_seed_jobs_predicted_through_from_equal_the_ledger_jobs():
    """The config_hub files the accuracy ledger scores (benchmarks/published/litgpt/*-alpaca2k-1xa10g.toml, whose
    jobs were written by hand) predict the same memory through --from."""
    def total(name: str) -> int:
        out = preflight("--gpu", "A10G", "--json", "--from", f"litgpt:{FIXTURES / name}")
        assert out.returncode in (0, 1), out.stderr
        return json.loads(out.stdout)["memory"]["per_gpu"]["total"]

    qlora = parse_job(textwrap.dedent("""
        [model]
        preset = "llama-3.1-8b"
        [train]
        stack = "litgpt"
        precision = "bf16"
        optimizer = "paged_adamw"
        micro_batch = 2
        grad_accum = 4
        global_batch = 8
        seq_len = 512
        lora_rank = 32
        lora_targets = ["q_proj", "v_proj"]
        lora_dropout = 0.05
        base_quant = "nf4"
        double_quant = false
        [cluster]
        gpu = "A10G"
    """))
    assert total("llama-3.1-8b-qlora.yaml") == memory.estimate(qlora).total
    lora_1b = parse_job(textwrap.dedent("""
        [model]
        name = "Llama-3.2-1B (litgpt, untied lm_head copy)"
        hidden = 2048
        layers = 16
        heads = 32
        kv_heads = 8
        ffn = 8192
        vocab = 128256
        tie_embeddings = false
        head_dim = 64
        [train]
        stack = "litgpt"
        precision = "bf16"
        micro_batch = 1
        grad_accum = 8
        global_batch = 8
        seq_len = 512
        lora_rank = 32
        lora_targets = ["q_proj", "v_proj"]
        lora_dropout = 0.05
        optimizer_impl = "foreach"
        [cluster]
        gpu = "A10G"
    """))
    assert total("llama-3.2-1B-lora.yaml") == memory.estimate(lora_1b).total


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preflight_from_runs_end_to_end(name):
    out = preflight("--json", "--gpu", "H100-SXM", "--from", f"litgpt:{FIXTURES / name}")
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["params"] > 0 and data["memory"]["per_gpu"]["total"] > 0
    assert [f["kind"] for f in data["imported"]["files"]] == ["litgpt"]
    assert "Traceback" not in out.stderr


def test_multi_gpu_lora_is_fsdp2_with_checkpointing(tmp_path):
    # lora.py (>= 0.5.11): ModelParallelStrategy whose parallelize_fn checkpoint-wraps each Block and
    # fully_shards it; 8 // 2 // 1 = 4.
    text = (FIXTURES / "llama-3.1-8b-lora.yaml").read_text().replace("devices: 1", "devices: 2")
    imp = build_job(None, [write(tmp_path, "lora.yaml", text)])
    t, c = imp.job.train, imp.job.cluster
    assert (c.gpus_per_node, c.sharding, c.fsdp_version, t.checkpointing, t.grad_accum) == (2, "zero3", 2, "full", 4)
    mixed = text.replace("precision: bf16-true", "precision: bf16-mixed")
    imp = build_job(None, [write(tmp_path, "mixed.yaml", mixed)])
    assert imp.job.train.precision == "bf16-mixed"
    assert any("no MixedPrecisionPolicy" in w for w in imp.files[0].warnings)


def test_16_true_is_pure_fp16_and_runs_on_a_t4(tmp_path):
    """lightning's 16-true is HalfPrecision(torch.float16): the module in fp16, no fp32 copy, no GradScaler."""
    text = (FIXTURES / "llama-3.1-8b-lora.yaml").read_text().replace("precision: bf16-true", "precision: 16-true")
    path = write(tmp_path, "lora16.yaml", text)
    imp = build_job(None, [path])
    assert imp.job.train.precision == "fp16" and imp.job.train.pure_16bit
    assert not [w for w in imp.files[0].warnings if "16-true" in w]
    # The 2-byte job it was priced as before (pure bf16) holds the same bytes.
    bf16 = build_job(None, [str(FIXTURES / "llama-3.1-8b-lora.yaml")])
    assert memory.estimate(imp.job).per_gpu == memory.estimate(bf16.job).per_gpu
    # On a T4: no sm80 needed, SDPA's memory-efficient kernel (litgpt repeats k/v), and litgpt's torch AdamW
    # (foreach) on the fp16 adapters is the one thing that fails.
    out = preflight("--json", "--gpu", "T4", "--from", f"litgpt:{path}")
    checks = {c["id"]: c for c in json.loads(out.stdout)["checks"]}
    assert "needs bf16 support" not in checks["precision.gpu"]["message"]
    assert checks["precision.gpu"]["status"] == "fail" and "AdamW (foreach)" in checks["precision.gpu"]["message"]
    assert checks["attention.kernel"]["message"].startswith("sdpa: the efficient kernel on T4")
    eight_bit = path.replace("lora16", "lora16-8bit")
    Path(eight_bit).write_text(text.replace("class_path: torch.optim.AdamW", "class_path: bitsandbytes.optim.AdamW8bit"))
    out = preflight("--json", "--gpu", "T4", "--from", f"litgpt:{eight_bit}")
    check = {c["id"]: c for c in json.loads(out.stdout)["checks"]}["precision.gpu"]
    assert check["status"] == "warn" and "no loss scaling" in check["message"], check


def test_local_checkpoint_dir_reads_litgpt_model_config(tmp_path):
    """A downloaded checkpoint's model_config.yaml is the model litgpt builds (lora.py Config.from_file)."""
    ckpt = tmp_path / "checkpoints" / "me" / "tiny"
    ckpt.mkdir(parents=True)
    (ckpt / "model_config.yaml").write_text(textwrap.dedent("""
        name: tiny
        n_embd: 512
        n_layer: 4
        n_head: 8
        n_query_groups: 2
        intermediate_size: 1376
        padded_vocab_size: 32000
        norm_class_name: RMSNorm
        mlp_class_name: LLaMAMLP
        bias: false
    """))
    f = write(tmp_path, "lora.yaml", """
        checkpoint_dir: checkpoints/me/tiny
        lora_r: 4
        train:
          micro_batch_size: 2
          global_batch_size: 4
          max_seq_length: 256
    """)
    m = build_job(None, [f]).job.model
    assert (m.hidden, m.layers, m.heads, m.kv_heads, m.ffn, m.vocab, m.tie_embeddings) == (512, 4, 8, 2, 1376, 32000, False)


@pytest.mark.parametrize("edit, needle", [
    (("precision: bf16-true", "precision: bf16-maybe"), "precision: unknown litgpt precision 'bf16-maybe'"),
    (("quantize: bnb.nf4", "quantize: bnb.nf8"), "quantize: unknown value 'bnb.nf8'"),
    # lora.py setup: "Quantization and mixed precision is not supported."
    (("precision: bf16-true", "precision: bf16-mixed"), "litgpt refuses quantization with bf16-mixed"),
    # lora.py setup: NotImplementedError for quantize with devices * num_nodes > 1.
    (("devices: 1", "devices: 2"), "litgpt does not quantize for multi-GPU training"),
    (("devices: 1", "devices: 0"), "devices: must be 'auto' or a positive integer"),
    # args.py gradient_accumulation_iters asserts > 0.
    (("global_batch_size: 8", "global_batch_size: 1"), "1 is less than micro_batch_size 2 x 1 GPUs"),
    # finetune validate_args: max_norm unsupported.
    (("  max_norm:\n", "  max_norm: 1.0\n"), "train.max_norm: litgpt's finetune scripts refuse it"),
    (("lora_r: 32", "lora_r: .nan"), "lora_r: must be a whole number"),
    (("checkpoint_dir: checkpoints/meta-llama/Meta-Llama-3.1-8B", "checkpoint_dir: checkpoints/tiiuae/falcon-7b"),
     "checkpoint_dir 'checkpoints/tiiuae/falcon-7b' is no podkit preset"),
])
def test_bad_values_are_one_line_exit_2(tmp_path, edit, needle):
    text = (FIXTURES / "llama-3.1-8b-qlora.yaml").read_text()
    assert edit[0] in text
    f = write(tmp_path, "qlora.yaml", text.replace(edit[0], edit[1]))
    out = preflight("--json", "--from", f"litgpt:{f}")
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and json.loads(out.stdout)["status"] == "bad-input"


def test_a_model_podkit_cannot_resolve_asks_for_model_and_accepts_it(tmp_path):
    text = (FIXTURES / "llama-3.1-8b-lora.yaml").read_text().replace(
        "checkpoints/meta-llama/Meta-Llama-3.1-8B", "checkpoints/microsoft/phi-2")
    f = write(tmp_path, "phi.yaml", text)
    out = preflight("--from", f)
    assert out.returncode == 2 and "give --model PRESET" in out.stderr and "phi-2" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    # The file's model is still reported, beside the one priced in its place.
    assert imp.job.model.preset == "llama-3.2-1b"
    assert [u for u in imp.unresolved if "phi-2" in u and "model.preset = 'llama-3.2-1b' from --model" in u], imp.unresolved


def test_model_flag_against_explicit_dimensions_is_one_line(tmp_path):
    """--model beside a file that names the model as explicit dimensions (litgpt's untied Llama 3.2 1B)."""
    out = preflight("--from", str(FIXTURES / "llama-3.2-1B-lora.yaml"), "--model", "llama-3.2-1b")
    assert out.returncode == 2 and "names the model (model = {name = " in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_detection_keeps_to_litgpt_files(tmp_path):
    """litgpt's files match only litgpt; other kinds' files never match litgpt (an axolotl YAML has a top-level
    micro_batch_size, a torchtune YAML a nested checkpointer.checkpoint_dir and batch_size, TrainingArguments
    output_dir): none has litgpt's `train` mapping beside checkpoint_dir / model_name."""
    for p in FIXTURES.glob("*.yaml"):
        assert [k for k, (looks, _) in KINDS.items() if looks(read_data(p))] == ["litgpt"], p.name
    others = [p for d in EXAMPLES.iterdir() if d.is_dir() for p in d.iterdir() if p.suffix in (".json", ".yaml")]
    assert len(others) >= 6
    for p in others:
        assert not litgpt.looks_like(read_data(p)), p
    axolotl = {"base_model": "meta-llama/Llama-3.2-1B", "micro_batch_size": 2, "sequence_len": 2048,
               "adapter": "lora", "lora_r": 16, "output_dir": "./out"}
    torchtune = {"model": {"_component_": "torchtune.models.llama3_1.lora_llama3_1_8b", "lora_rank": 16},
                 "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                                  "checkpoint_dir": "/tmp/Meta-Llama-3.1-8B-Instruct/"},
                 "batch_size": 2, "gradient_accumulation_steps": 16, "epochs": 1, "output_dir": "/tmp/out",
                 "dtype": "bf16", "enable_activation_checkpointing": True}
    for data in (axolotl, torchtune):
        assert not litgpt.looks_like(data)
    with pytest.raises(ConfigError, match="does not look like a litgpt config"):
        build_job(None, [f"litgpt:{EXAMPLES / 'qwen2.5-7b-lora-r128-24gb' / 'training_args.json'}"])


def test_script_defaults_fill_only_what_the_base_leaves_open(tmp_path):
    """A key the file leaves out takes the script's default (finetune/lora.py setup: optimizer "AdamW", lora_r 8,
    q and v, devices 1; lora_alpha alone marks lora.py's file) unless --config sets it: litgpt would run the file's own, but podkit cannot tell a silent
    file from one that forgot."""
    f = write(tmp_path, "lora.yaml", """
        checkpoint_dir: checkpoints/meta-llama/Meta-Llama-3.1-8B
        precision: bf16-true
        lora_alpha: 32
        train:
          micro_batch_size: 2
          global_batch_size: 8
          max_seq_length: 1024
    """)
    alone = build_job(None, [f]).job
    assert (alone.train.optimizer, alone.facts.optimizer_impl, alone.train.lora_rank) == ("adamw", "foreach", 8)
    assert list(alone.train.lora_targets) == ["q_proj", "v_proj"] and alone.train.grad_accum == 4
    base = write(tmp_path, "base.toml", '[model]\npreset = "llama-3.1-8b"\n[train]\noptimizer = "adamw8bit"\n')
    over = build_job(base, [f]).job
    assert over.train.optimizer == "adamw8bit" and over.train.lora_rank == 8


@pytest.mark.parametrize("edit,needle", [
    (("micro_batch_size: 2", "micro_batch_size: 0"), "train.micro_batch_size: must be at least 1"),
    (("precision: bf16-true", "precision: [bf16-true]"), "precision: must be a string"),
    (("quantize: bnb.nf4", "quantize: [bnb.nf4]"), "quantize: must be a string"),
])
def test_odd_values_are_one_line_exit_2(tmp_path, edit, needle):
    text = (FIXTURES / "llama-3.1-8b-qlora.yaml").read_text()
    assert edit[0] in text
    out = preflight("--from", "litgpt:" + write(tmp_path, "q.yaml", text.replace(edit[0], edit[1])))
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_init_args_must_be_a_mapping(tmp_path):
    f = tmp_path / "l.yaml"
    data = yaml.safe_load((FIXTURES / "llama-3.1-8b-lora.yaml").read_text())
    data["optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": [1, 2]}
    f.write_text(yaml.safe_dump(data))
    out = preflight("--from", f"litgpt:{f}")
    assert out.returncode == 2 and "optimizer.init_args: must be a mapping" in out.stderr, out.stderr


def test_bitsandbytes_classes_map_as_torchtunes_do(tmp_path):
    # One class-path table for both importers: litgpt's Adam8bit was priced as fp32 AdamW.
    data = yaml.safe_load((FIXTURES / "llama-3.1-8b-lora.yaml").read_text())
    data["optimizer"] = {"class_path": "bitsandbytes.optim.Adam8bit", "init_args": {"lr": 2e-4}}
    f = tmp_path / "l.yaml"
    f.write_text(yaml.safe_dump(data))
    assert build_job(None, [f"litgpt:{f}"]).job.train.optimizer == "adamw8bit"


def test_pretrain_is_fused_whatever_init_args_say(tmp_path):
    # pretrain.py passes fused=(device is cuda) to instantiate_torch_optimizer, which updates init_args with it.
    data = yaml.safe_load((FIXTURES / "pretrain-tinyllama.yaml").read_text())
    data["optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 4e-4, "fused": False}}
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    assert build_job(None, [f"litgpt:{f}"], model_preset=None).job.train.optimizer_impl == "fused"


def test_model_config_keys_are_accounted_for(tmp_path):
    data = yaml.safe_load((FIXTURES / "pretrain-tinystories.yaml").read_text())
    assert isinstance(data.get("model_config"), dict)
    data["model_config"].update(bias=True, parallel_residual=True, rotary_percentage=1.0)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    imp = build_job(None, [f"litgpt:{f}"]).files[0]
    said = "\n".join(imp.mapped + imp.ignored + imp.warnings)
    assert "model_config.bias = True" in said and "model_config.parallel_residual = True" in said
    assert "model_config.rotary_percentage" in said
