"""bin/preflight --from torchtune:RECIPE.yaml: torchtune's own recipe configs read into the job.

The files under tests/fixtures/torchtune/ are pytorch/torchtune's recipes/configs verbatim (the first
line names path and commit); each expected job below is read off the file by hand, with the torchtune
source that decides it (cited in checks/importers/torchtune.py).
"""

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from podkit.checks import memory
from podkit.checks.config import parse_job
from podkit.checks.errors import ConfigError
from podkit.checks.importers import build_job, torchtune

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "torchtune"
PREFLIGHT = ROOT / "bin" / "preflight"
LORA = FIXTURES / "llama3_1-8B_lora_single_device.yaml"
QLORA = FIXTURES / "llama3_1-8B_qlora_single_device.yaml"
FULL_1B = FIXTURES / "llama3_2-1B_full_single_device.yaml"
FULL_8B = FIXTURES / "llama3_1-8B_full.yaml"
FULL_70B = FIXTURES / "llama3_1-70B_full.yaml"
MULTINODE = FIXTURES / "llama3_3-70B_full_multinode.yaml"
QWEN = FIXTURES / "qwen2_5-7B_lora.yaml"
# The LoRA configs' lora_attn_modules ['q_proj', 'v_proj', 'output_proj'] with apply_lora_to_mlp: True.
QVO_MLP = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def preflight(*args):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return subprocess.run([str(PREFLIGHT), "--no-probe", *args], capture_output=True, text=True, env=env, timeout=60)


def variant(tmp_path: Path, base: Path, name: str = "recipe.yaml", drop=(), **changes) -> str:
    """A copy of a real config with some keys changed (a dotted key reaches into a section)."""
    data = yaml.safe_load(base.read_text())
    for key in drop:
        section, _, sub = key.partition(".")
        (data[section].pop(sub) if sub else data.pop(section))
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub:
            data[section][sub] = value
        else:
            data[section] = value
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(out)


# (fixture, model.preset, train keys, cluster keys), each value read off the file:
# batch_size -> micro_batch, gradient_accumulation_steps -> grad_accum, dtype bf16 -> pure bf16,
# optimizer._component_/fused -> optimizer/optimizer_impl, enable_activation_checkpointing -> full/none,
# clip_grad_norm null -> grad_clip 0, fsdp_* / custom_sharded_layers -> a distributed recipe (zero3).
CASES = [
    (LORA, "llama-3.1-8b",
     dict(stack="torchtune", lora_rank=8, lora_targets=QVO_MLP, micro_batch=2, grad_accum=8, precision="bf16",
          optimizer="adamw", optimizer_impl="fused", lr=3e-4, weight_decay=0.01, checkpointing="full",
          grad_clip=0.0, loss="chunked", base_quant="none"),
     dict(sharding="none", offload="none")),
    (QLORA, "llama-3.1-8b",
     dict(lora_rank=8, lora_targets=QVO_MLP, base_quant="nf4", double_quant=True, micro_batch=2, grad_accum=8,
          precision="bf16", optimizer="adamw", optimizer_impl="fused", checkpointing="full", loss="chunked"),
     dict(sharding="none")),
    (FULL_1B, "llama-3.2-1b",
     dict(lora_rank=0, micro_batch=4, grad_accum=1, precision="bf16", optimizer="paged_adamw8bit", lr=2e-5,
          checkpointing="none", loss="chunked"),
     dict(sharding="none")),
    (FULL_8B, "llama-3.1-8b",
     dict(lora_rank=0, micro_batch=2, grad_accum=1, precision="bf16", optimizer="adamw", optimizer_impl="fused",
          checkpointing="full"),
     dict(sharding="zero3", offload="none")),
    (FULL_70B, "llama-3.1-70b",
     dict(micro_batch=2, precision="bf16", optimizer="adamw", optimizer_impl="foreach", checkpointing="full"),
     dict(sharding="zero3", offload="all")),
    (MULTINODE, "llama-3.3-70b",
     dict(micro_batch=4, seq_len=1024, precision="bf16", optimizer_impl="fused", checkpointing="full"),
     dict(sharding="zero3", offload="none")),
    (QWEN, "qwen2.5-7b",
     dict(lora_rank=8, lora_targets=QVO_MLP, micro_batch=2, grad_accum=8, precision="bf16", optimizer_impl="fused",
          checkpointing="none", loss="chunked"),
     dict(sharding="none")),
]


@pytest.mark.parametrize("path, preset, train, cluster", CASES, ids=[c[0].name for c in CASES])
def test_recipe_config_maps_to_the_job(path, preset, train, cluster):
    imp = build_job(None, [str(path)])
    assert [f.kind for f in imp.files] == ["torchtune"]  # detected by its _component_ keys, not as TrainingArguments
    assert imp.job.model.preset == preset
    assert {k: getattr(imp.job.train, k) for k in train} == train
    assert {k: getattr(imp.job.cluster, k) for k in cluster} == cluster


def test_qlora_prices_the_head_and_embedding_unquantized():
    """torchtune's QLoRA quantizes every block linear with torchao's NF4 and leaves the head and
    embedding bf16: the torchtune stack's facts, and a warning that the quantizer is torchao's."""
    imp = build_job(None, [str(QLORA)])
    assert imp.job.facts.quantize_head is False and imp.job.facts.adapter_bytes == 2  # adapters in bf16
    assert any("torchao's NF4Tensor" in w for w in imp.files[0].warnings)


def test_unbounded_and_unsaid_values_are_unresolved_not_guessed():
    imp = build_job(None, [str(LORA)])
    text = "\n".join(imp.unresolved)
    assert "tokenizer.max_seq_len is null" in text and "train.seq_len keeps podkit's default" in text
    assert "cluster.gpus_per_node" in text and "_single_device" in text
    dist = "\n".join(build_job(None, [str(FULL_8B)]).unresolved)
    assert "--nproc_per_node" in dist
    # --config decides what the file does not say
    base = ROOT / "checks" / "examples" / "llama-3.2-1b-a10g.toml"
    assert build_job(str(base), [str(LORA)]).job.train.seq_len == parse_job(base.read_text()).train.seq_len


@pytest.mark.parametrize("path", [c[0] for c in CASES], ids=[c[0].name for c in CASES])
def test_every_top_level_key_is_mapped_ignored_or_warned(path):
    imp = build_job(None, [str(path)]).files[0]
    said = "\n".join(imp.mapped + imp.ignored + imp.warnings + list(imp.unresolved.values()))
    data = yaml.safe_load(path.read_text())

    def named(key):  # the key as a word of the account, not inside another (device in *_single_device)
        return re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", said) is not None

    silent = [k for k in data if not named(k)]
    assert not silent, silent
    silent = [k for k in data["model"] if k != "_component_" and not named(f"model.{k}") and not named(k)]
    assert not silent, silent


def test_approximations_are_warned():
    assert any("optimizer_in_bwd" in w for w in build_job(None, [str(FULL_1B)]).files[0].warnings)
    assert any("compile: True" in w for w in build_job(None, [str(MULTINODE)]).files[0].warnings)
    assert any("LinearCrossEntropyLoss" in w for w in build_job(None, [str(QWEN)]).files[0].warnings)
    assert any("custom_sharded_layers" in w for w in build_job(None, [str(FULL_70B)]).files[0].warnings)


def test_other_components_and_switches(tmp_path):
    # torch.nn.CrossEntropyLoss: TransformerDecoder.unembed returns `self.output(h).float()`.
    ce = variant(tmp_path, LORA, "ce.yaml", loss={"_component_": "torch.nn.CrossEntropyLoss"})
    assert build_job(None, [ce]).job.train.loss == "fp32-upcast"
    # torchao's CPUOffloadOptimizer: states and step on the CPU, fused AdamW underneath.
    off = variant(tmp_path, FULL_1B, "off.yaml", optimizer={"_component_": "torchao.optim.CPUOffloadOptimizer",
                                                            "offload_gradients": False, "lr": 2e-5})
    job = build_job(None, [off]).job
    assert (job.cluster.offload, job.train.optimizer, job.train.optimizer_impl) == ("optimizer", "adamw", "fused")
    ao = variant(tmp_path, FULL_1B, "ao.yaml", optimizer={"_component_": "torchao.optim.AdamW8bit", "lr": 2e-5})
    assert build_job(None, [ao]).job.train.optimizer == "torchao_adamw8bit"
    # torchao's own optimizers, not bitsandbytes' (torchao/optim/adam.py): the class's block unless given.
    ao4 = variant(tmp_path, FULL_1B, "ao4.yaml", optimizer={"_component_": "torchao.optim.AdamW4bit", "lr": 2e-5,
                                                            "block_size": 64, "bf16_stochastic_round": True})
    imp = build_job(None, [ao4])
    assert (imp.job.train.optimizer, imp.job.facts.torchao_block, imp.job.facts.bnb_optimizer) == (
        "torchao_adamw4bit", 64, False)
    assert not any("bitsandbytes" in w for w in imp.files[0].warnings)
    fp8 = variant(tmp_path, FULL_1B, "fp8.yaml", optimizer={"_component_": "torchao.prototype.low_bit_optim.AdamFp8"})
    assert build_job(None, [fp8]).job.train.optimizer == "torchao_adamw_fp8"
    # AdamW without fused: torch's default kernel on CUDA is foreach.
    fe = variant(tmp_path, LORA, "fe.yaml", optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-4})
    assert build_job(None, [fe]).job.train.optimizer_impl == "foreach"
    # SHARD_GRAD_OP, a QLoRA via quantize_base, a packed dataset, fp32 and apply_lora_to_output.
    dist = variant(tmp_path, FULL_8B, "zero2.yaml", fsdp_reshard_after_forward=False)
    assert build_job(None, [dist]).job.cluster.sharding == "zero2"
    q = variant(tmp_path, QWEN, "q.yaml", model__quantize_base=True, model__apply_lora_to_output=True,
                dataset={"_component_": "torchtune.datasets.alpaca_dataset", "packed": True},
                tokenizer={"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "max_seq_len": 2048},
                dtype="fp32")
    t = build_job(None, [q]).job.train
    assert (t.base_quant, t.seq_len, t.precision, t.lora_targets[-1]) == ("nf4", 2048, "fp32", "lm_head")


def test_predicted_end_to_end_as_the_same_job_written_by_hand():
    out = preflight("--from", f"torchtune:{QLORA}", "--gpu", "A10G", "--json")
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["name"] == "llama-3.1-8b" and data["imported"]["files"][0]["kind"] == "torchtune"
    same = parse_job(textwrap.dedent("""
        [model]
        preset = "llama-3.1-8b"
        [train]
        stack = "torchtune"
        precision = "bf16"
        micro_batch = 2
        grad_accum = 8
        checkpointing = "full"
        lora_rank = 8
        lora_targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        base_quant = "nf4"
        optimizer_impl = "fused"
        grad_clip = 0.0
        [cluster]
        gpu = "A10G"
    """))
    assert data["memory"]["per_gpu"]["total"] == memory.estimate(same).total


@pytest.mark.parametrize("path", [c[0] for c in CASES], ids=[c[0].name for c in CASES])
def test_each_fixture_runs_end_to_end(path):
    out = preflight("--from", str(path), "--gpu", "H100-SXM", "--json")
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    assert data["model"]["name"] == build_job(None, [str(path)]).job.model.preset


@pytest.mark.parametrize("changes, needle", [
    (dict(dtype="fp16"), "dtype: fp16 is refused by torchtune's recipes"),
    (dict(dtype="bf15"), "dtype: unknown value 'bf15'"),
    (dict(model__lora_attn_modules=["q_proj", "qkv_proj"]), "'qkv_proj' is not an attention projection"),
    (dict(model__lora_rank="eight"), "model.lora_rank: must be a whole number"),
    (dict(batch_size="two"), "batch_size: must be a whole number, got 'two'"),
    (dict(dataset={"_component_": "torchtune.datasets.alpaca_dataset", "packed": True}),
     "dataset.packed: is true and tokenizer.max_seq_len is null"),
    (dict(model={"_component_": "torchtune.models.llama3_1.llama3_1_8b", "lora_rank": 8}),
     "model.lora_rank: is a LoRA argument"),
    (dict(model={"_component_": "torchtune.models.phi3.lora_phi3_mini", "lora_attn_modules": ["q_proj"]}),
     "no podkit preset for model._component_ 'torchtune.models.phi3.lora_phi3_mini' (known torchtune builders"),
])
def test_bad_values_are_one_line_exit_2(tmp_path, changes, needle):
    f = variant(tmp_path, LORA, **changes)
    out = preflight("--from", f"torchtune:{f}", "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    assert needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert json.loads(out.stdout)["status"] == "bad-input"


def test_an_unknown_builder_takes_its_shape_from_model(tmp_path):
    f = variant(tmp_path, LORA, model={"_component_": "torchtune.models.phi3.lora_phi3_mini",
                                       "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 16})
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    assert (imp.job.model.preset, imp.job.train.lora_rank, imp.job.train.lora_targets) == (
        "llama-3.2-1b", 16, ["q_proj", "v_proj"])
    assert any("lora_phi3_mini" in u and "from --model" in u for u in imp.unresolved)


def test_detection_takes_torchtune_and_nothing_else():
    assert torchtune.looks_like(yaml.safe_load(LORA.read_text()))
    # The other YAML kinds podkit reads carry no `_component_`.
    for other in ({"base_model": "meta-llama/Llama-3.1-8B", "micro_batch_size": 2, "output_dir": "out"},
                  {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "output_dir": "out"},
                  {"distributed_type": "FSDP", "num_processes": 8},
                  {"model": {"name": "llama3", "flavor": "8B"}, "training": {"seq_len": 8192}}):
        assert not torchtune.looks_like(other)
    with pytest.raises(ConfigError, match="does not look like a torchtune config"):
        build_job(None, [f"torchtune:{ROOT / 'checks/examples/llama-3.1-8b-lora-liger/training_args.json'}"])


def test_the_ledger_rows_recipe_prices_as_its_hand_written_job(tmp_path):
    # The ledger's torchtune rows (benchmarks/published/torchtune/) were written by hand from the README's
    # 'Optimization flags' table: recipe llama3_2/3B_full_single_device with its optimisations turned off and
    # packed 4096-token batches of 2. The same recipe, read by the importer with those `tune run` overrides
    # applied, must price as the same job: the importer and the hand-written rows decide each fact alike.
    from test_published_cases import accuracy

    case = accuracy.load_case(ROOT / "benchmarks" / "published" / "torchtune" / "llama3.2-3b-full-packed4096-bs2-a100.toml")
    recipe = variant(tmp_path, FIXTURES / "llama3_2-3B_full_single_device.yaml", batch_size=2,
                     optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
                     loss={"_component_": "torch.nn.CrossEntropyLoss"}, optimizer_in_bwd=False,
                     enable_activation_checkpointing=False, dataset__packed=True, tokenizer__max_seq_len=4096)
    job = build_job(None, [recipe]).job.replace(cluster={"gpu": "A100-80GB"})
    t, hand = job.train, case.job.train
    fields = ("stack", "precision", "optimizer", "optimizer_impl", "micro_batch", "grad_accum", "seq_len",
              "checkpointing", "loss", "attention")
    assert {f: getattr(t, f) for f in fields} == {f: getattr(hand, f) for f in fields}
    assert job.model.preset == case.job.model.preset == "llama-3.2-3b"
    mine, theirs = memory.estimate(job), memory.estimate(case.job)
    assert (mine.allocated, mine.reserved, mine.total) == (theirs.allocated, theirs.reserved, theirs.total)


def test_checkpointing_with_both_switches_set_is_none(tmp_path):
    # full_finetune_distributed.py _setup_model: selective AC runs only when enable_activation_checkpointing is
    # false, the per-layer AC only when ac_mode is None: with both set, nothing is checkpointed.
    both = variant(tmp_path, FULL_8B, enable_activation_checkpointing=True, ac_mode="full")
    imp = build_job(None, [both])
    assert imp.job.train.checkpointing == "none"
    assert any("both set" in w and "checkpoint nothing" in w for w in imp.files[0].warnings)
    assert build_job(None, [variant(tmp_path, FULL_8B, enable_activation_checkpointing=False, ac_mode="full")]) \
        .job.train.checkpointing == "full"


def test_main_parallelism_keys_mark_a_distributed_recipe_and_size_it(tmp_path):
    # main's ParallelDims(dp_replicate, dp_shard, cp, tp): explicit positive degrees give the world size; HSDP and
    # context parallelism are warned about, not priced.
    f = variant(tmp_path, LORA, data_parallel_shard_dim=4, data_parallel_replicate_dim=2, context_parallel_dim=1)
    imp = build_job(None, [f])
    assert (imp.job.cluster.sharding, imp.job.cluster.gpus_per_node) == ("zero3", 8)
    assert any("data_parallel_replicate_dim = 2" in w for w in imp.files[0].warnings)
    assert not any("gpus_per_node" in u for u in imp.unresolved)
    cp = build_job(None, [variant(tmp_path, LORA, context_parallel_dim=2, enable_fp8_training=True)])
    assert cp.job.cluster.sharding == "zero3" and any("gpus_per_node" in u for u in cp.unresolved)
    assert {"context_parallel_dim", "enable_fp8_training"} <= {w.split(" ")[0].rstrip(":") for w in cp.files[0].warnings}


@pytest.mark.parametrize("key", ["batch_size", "gradient_accumulation_steps", "optimizer", "loss"])
def test_a_null_the_recipe_needs_is_one_line_exit_2(tmp_path, key):
    out = preflight("--from", variant(tmp_path, LORA, **{key: None}))
    assert out.returncode == 2 and f"{key}: is null" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_nested_interpolations_resolve(tmp_path):
    # OmegaConf resolves ${...} at any depth, and one naming another.
    f = variant(tmp_path, LORA, rank=32, my_rank="${rank}",
                model={**yaml.safe_load(LORA.read_text())["model"], "lora_rank": "${my_rank}"})
    assert build_job(None, [f]).job.train.lora_rank == 32


def test_an_untied_head_of_a_tied_builder_is_warned(tmp_path):
    # llama3_2_1b ties its head (its preset does: tie_embeddings); tie_word_embeddings: false is not priced.
    imp = build_job(None, [variant(tmp_path, FULL_1B, model={"_component_": "torchtune.models.llama3_2.llama3_2_1b",
                                                                 "tie_word_embeddings": False})]).files[0]
    assert any(w.startswith("model.tie_word_embeddings: false") for w in imp.warnings), imp.warnings
    untied = build_job(None, [variant(tmp_path, FULL_8B, model={"_component_": "torchtune.models.llama3_1.llama3_1_8b",
                                                                    "tie_word_embeddings": False})]).files[0]
    assert not any("tie_word_embeddings" in w for w in untied.warnings)
