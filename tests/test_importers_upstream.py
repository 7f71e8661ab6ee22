"""bin/preflight --from on real upstream configs, kept verbatim under tests/fixtures/<kind>/ (each names its
repository, path and commit on its first line, or in a SOURCES.md beside a JSON). Each test states the job
keys derived by hand from the file and the library source that decides them.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from podkit.checks.errors import ConfigError
from podkit.checks.importers import build_job

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
AXOLOTL = FIXTURES / "axolotl"
PREFLIGHT = ROOT / "bin" / "preflight"


def preflight(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(PREFLIGHT), "--no-probe", *args], capture_output=True, text=True, env=env, timeout=60,
                          cwd=cwd)


def end_to_end(*args, cwd=None) -> dict:
    """--json runs through: exit 0 (fits) or 1 (does not), one JSON document, the model resolved."""
    out = preflight(*args, "--json", cwd=cwd)
    assert out.returncode in (0, 1), out.stderr
    report = json.loads(out.stdout)
    assert "Traceback" not in out.stderr
    return report


def test_axolotl_attn_implementation_and_checkpointing_offload():
    # axolotl examples/qwen3/32b-qlora.yaml: attn_implementation (axolotl >= 0.16's key; enums.py
    # CANONICAL_ATTN_IMPLS), gradient_checkpointing: offload = checkpointing + activation_offloading
    # (validation.py check_gradient_checkpointing_w_offload); qlora + load_in_4bit = nf4 double quant; bf16 auto
    # loads bf16 weights (config/__init__.py resolve_dtype), adapters only: pure bf16.
    f = AXOLOTL / "examples" / "qwen3-32b-qlora.yaml"
    imp = build_job(None, [str(f)])
    t = imp.job.train
    assert imp.job.model.preset == "qwen3-32b"
    assert (t.micro_batch, t.grad_accum, t.seq_len, t.lora_rank) == (1, 2, 2048, 16)
    assert t.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj"]
    assert (t.attention, t.checkpointing) == ("flash-attn", "full")
    assert (t.precision, t.base_quant, t.double_quant, t.loss, t.stack) == ("bf16", "nf4", True, "fused", "hf")
    account = imp.files[0]
    assert any(w.startswith("activation_offloading True") for w in account.warnings)
    assert any(w.startswith("lora_mlp_kernel = True") for w in account.warnings)
    # adamw_torch_4bit: torchao's AdamW4bit at the Trainer's block_size=256 (trainer_optimizer.py _get_torchao_optimizer).
    assert (t.optimizer, imp.job.facts.torchao_block) == ("torchao_adamw4bit", 256)
    assert not any(i == "attn_implementation" for i in account.ignored)
    end_to_end("--from", f"axolotl:{f}")


def test_axolotl_fsdp_config_without_fsdp_list_is_fsdp2_full_shard():
    # axolotl examples/distributed-parallel/llama-3_1-8b-hsdp-tp.yaml: no `fsdp`, only fsdp_version: 2 and
    # fsdp_config (un-prefixed keys, reshard_after_forward: true), which turn FSDP on (utils/trainer.py
    # prepare_optim_env). A full fine-tune under bf16 autocast: accelerate's FSDP upcasts the trained bf16
    # weights to fp32 masters (accelerate utils/fsdp_utils.py fsdp2_prepare_model), so bf16-mixed.
    f = AXOLOTL / "examples" / "llama-3_1-8b-hsdp-tp.yaml"
    imp = build_job(None, [str(f)])
    t, c = imp.job.train, imp.job.cluster
    assert imp.job.model.preset == "llama-3.1-8b"
    assert (c.sharding, c.fsdp_version, c.offload) == ("zero3", 2, "none")
    assert (t.precision, t.attention, t.loss, t.micro_batch, t.seq_len) == ("bf16-mixed", "flash-attn", "fused", 1,
                                                                           2048)
    account = imp.files[0]
    assert any(w.startswith("tensor_parallel_size = 2") for w in account.warnings)
    assert any(i.startswith("fsdp_config.transformer_layer_cls_to_wrap") for i in account.ignored)
    end_to_end("--from", str(f))


def test_axolotl_deepspeed_json_named_from_the_repository_root(monkeypatch):
    # axolotl examples/mistral/mixtral/mixtral.yml names deepspeed_configs/zero2.json from the repository root,
    # where axolotl opens it (utils/trainer.py: os.path.isfile(cfg.deepspeed)): ZeRO-2 with the optimizer
    # offloaded to CPU; its "auto" values come from the YAML.
    monkeypatch.chdir(AXOLOTL)
    imp = build_job(None, ["examples/mixtral.yml"])
    t, c = imp.job.train, imp.job.cluster
    assert [f.kind for f in imp.files] == ["axolotl", "DeepSpeed"]
    assert imp.job.model.preset == "mixtral-8x7b"
    assert (t.stack, c.sharding, c.offload) == ("deepspeed", "zero2", "optimizer")
    assert (t.lora_rank, t.lora_targets, t.base_quant, t.precision) == (32, "all-linear", "nf4", "bf16")
    assert (t.attention, t.checkpointing, t.optimizer) == ("flash-attn", "full", "adamw8bit")
    assert not any("deepspeed" in w for w in imp.files[0].warnings)
    end_to_end("--from", "examples/mixtral.yml", cwd=AXOLOTL)


def test_axolotl_multimodal_lora_regex_and_instruct_hub_id():
    # axolotl examples/gemma3/gemma-3-4b-vision-qlora.yml: lora_target_modules is a regex over
    # model.language_model.layers (transformers' Gemma3ForConditionalGeneration), which peft fullmatches
    # against each module name; google/gemma-3-4b-it has gemma-3-4b-pt's sizes (presets.HUB_ALIASES).
    f = AXOLOTL / "examples" / "gemma-3-4b-vision-qlora.yml"
    imp = build_job(None, [str(f)])
    t = imp.job.train
    assert imp.job.model.preset == "gemma-3-4b"
    assert t.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (t.lora_rank, t.base_quant, t.precision, t.attention) == (32, "nf4", "bf16", "flash-attn")
    end_to_end("--from", str(f))


@pytest.mark.parametrize("launcher, stack, sharding, precision", [
    # DeepSpeed's bf16 / ZeRO optimizers keep fp32 partitions of the trained bf16 weights.
    ("zero3", "deepspeed", "zero3", "bf16-mixed"),
    # accelerate's FSDP upcasts trained low-precision parameters to fp32 under mixed precision.
    ("fsdp", "hf", "zero3", "bf16-mixed"),
    # DDP: autocast over the bf16 weights the script loaded, no fp32 copy anywhere.
    ("ddp", "hf", "none", "bf16"),
])
def test_alignment_handbook_recipe_with_its_accelerate_config(launcher, stack, sharding, precision):
    # alignment-handbook recipes/zephyr-7b-beta/sft/config_full.yaml (torch_dtype: bfloat16, bf16: true, a full
    # fine-tune) launched with recipes/accelerate_configs/<launcher>.yaml (mixed_precision: bf16, 8 processes),
    # as its README runs them: the two files agree, and the engine decides whether fp32 masters exist.
    recipe = FIXTURES / "trainer" / "zephyr-7b-beta-sft-config_full.yaml"
    accel = FIXTURES / "accelerate" / f"alignment-handbook-{launcher}.yaml"
    imp = build_job(None, [str(recipe), str(accel)])
    t, c = imp.job.train, imp.job.cluster
    assert imp.job.model.preset == "mistral-7b"
    assert (t.stack, c.sharding, t.precision, c.gpus_per_node) == (stack, sharding, precision, 8)
    assert (t.micro_batch, t.grad_accum, t.seq_len, t.attention) == (16, 1, 2048, "flash-attn")
    end_to_end("--from", f"trainer:{recipe}", "--from", f"accelerate:{accel}")


def test_torchtitan_flavor_without_a_preset_is_left_to_model():
    # torchtitan v0.2.2 models/llama3/train_configs/debug_model.toml: flavor "debugmodel" has no preset; the
    # rest of the file still maps, and --model gives the model (it was refused beside a file naming one).
    f = FIXTURES / "torchtitan" / "llama3-debug_model.toml"
    out = preflight("--from", str(f))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "llama3 flavor 'debugmodel' is no podkit preset" in last and "give --model PRESET" in last
    imp = build_job(None, [str(f)], model_preset="tiny")
    t = imp.job.train
    assert (imp.job.model.preset, t.stack, t.micro_batch, t.seq_len, t.lr) == ("tiny", "torchtitan", 8, 2048, 8e-4)
    assert imp.job.cluster.sharding == "zero3"
    # The file's flavor is still reported, beside the model priced in its place.
    assert [u for u in imp.unresolved if "debugmodel" in u and "model.preset = 'tiny' from --model" in u], imp.unresolved
    end_to_end("--from", f"torchtitan:{f}", "--model", "tiny")


def test_torchtitan_deepseek_v3_16b_is_deepseek_v2_lite():
    # torchtitan v0.2.2 models/deepseek_v3/__init__.py "16B": dim 2048, 27 layers, 64 routed + 2 shared experts
    # (top 6), q_lora_rank 0, kv_lora_rank 512, vocab 102400: DeepSeek-V2-Lite's config.
    f = FIXTURES / "torchtitan" / "deepseek_v3_16b.toml"
    imp = build_job(None, [str(f)])
    assert imp.job.model.preset == "deepseek-v2-lite"
    end_to_end("--from", str(f))


def test_training_arguments_fsdp_true_reads_fsdp_config(tmp_path):
    # transformers 5.23 training_args.py: fsdp=True with everything in fsdp_config ("fsdp_" prefixes dropped;
    # version default 2; reshard_after_forward false = shard grad op; cpu_offload). Written by hand: no
    # upstream example uses the form yet. list(True) was a TypeError before.
    f = tmp_path / "args.yaml"
    f.write_text("model_name_or_path: meta-llama/Llama-3.2-1B\noutput_dir: o\nbf16: true\nfsdp: true\n"
                 "fsdp_config:\n  fsdp_reshard_after_forward: false\n  cpu_offload: true\n"
                 "  activation_checkpointing: true\n")
    imp = build_job(None, [str(f)])
    c, t = imp.job.cluster, imp.job.train
    assert (c.sharding, c.offload, c.fsdp_version, t.checkpointing) == ("zero2", "optimizer", 2, "full")
    assert any("FSDP2, transformers' default" in w for w in imp.files[0].warnings)
    f.write_text("output_dir: o\nfsdp: full_shard\nfsdp_config:\n  version: 3\n")
    with pytest.raises(ConfigError, match="must be 1 or 2"):
        build_job(None, [str(f)], model_preset="tiny")


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _dump(path: Path, data: dict) -> str:
    import yaml

    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_axolotl_hsdp_sizes_are_warned():
    # axolotl utils/trainer.py setup_parallelism_envs: dp_shard_size / dp_replicate_size become HSDP's
    # PARALLELISM_CONFIG_DP_* sizes; podkit prices FSDP over every GPU, so it says so.
    imp = build_job(None, [str(AXOLOTL / "examples" / "llama-3_1-8b-hsdp-tp.yaml")]).files[0]
    assert any(w.startswith("dp_shard_size = 4:") for w in imp.warnings), imp.warnings
    assert any(w.startswith("dp_replicate_size = 2:") for w in imp.warnings), imp.warnings


@pytest.mark.parametrize("kind", ["axolotl", "trainer"])
def test_an_inline_deepspeed_config_is_read(tmp_path, kind):
    # axolotl utils/schemas/config.py `deepspeed: str | dict[str, Any]`; TrainingArguments.deepspeed takes a dict
    # too (training_args.py: "an already loaded json file as a dict"). The inline ZeRO-3 shards the job.
    if kind == "axolotl":
        data = _yaml(AXOLOTL / "examples" / "qwen3-32b-qlora.yaml")
        data.pop("deepspeed", None)
        data.pop("fsdp", None), data.pop("fsdp_config", None), data.pop("fsdp_version", None)
        data.update(adapter="lora", load_in_4bit=False)
    else:
        data = {"output_dir": "o", "per_device_train_batch_size": 2, "bf16": True}
    data["deepspeed"] = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    f = _dump(tmp_path / ("cfg.yaml" if kind == "axolotl" else "args.yaml"), data)
    imp = build_job(None, [f], model_preset=None if kind == "axolotl" else "llama-3.2-1b")
    assert (imp.job.train.stack, imp.job.cluster.sharding) == ("deepspeed", "zero3")
    assert [f.path.name for f in imp.files][-1].endswith("#deepspeed")


def test_training_arguments_fsdp_config_as_a_json_path(tmp_path):
    # transformers training_args.py _process_fsdp_args: a str fsdp_config is json.load(open(...)).
    (tmp_path / "fsdp.json").write_text(json.dumps({"version": 1, "reshard_after_forward": "shard_grad_op"}))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "o", "fsdp": "full_shard", "fsdp_config": "fsdp.json"}))
    job = build_job(None, [str(args)], model_preset="llama-3.2-1b").job
    assert (job.cluster.sharding, job.cluster.fsdp_version) == ("zero2", 1)
    args.write_text(json.dumps({"output_dir": "o", "fsdp": "full_shard", "fsdp_config": "missing.json"}))
    out = preflight("--from", str(args), "--model", "llama-3.2-1b")
    assert out.returncode == 2 and "fsdp_config: missing.json found neither" in out.stderr, out.stderr


def test_axolotl_fsdp_config_that_is_not_a_mapping_is_one_line(tmp_path):
    data = _yaml(AXOLOTL / "examples" / "llama-3_1-8b-hsdp-tp.yaml")
    data["fsdp_config"] = "fsdp.json"
    out = preflight("--from", _dump(tmp_path / "cfg.yaml", data))
    assert out.returncode == 2 and "fsdp_config: must be a mapping" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
