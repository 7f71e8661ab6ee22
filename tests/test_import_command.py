"""bin/preflight -- COMMAND and bin/smoke -- COMMAND: the job read from the launch command the user runs.

Each argv below is a command from a library's own README or docs (cited beside it), with its config
files replaced by the verbatim upstream copies under tests/fixtures/ (their first line names repository,
path and commit); the job keys asserted are derived by hand from the command and those files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from podkit.checks.errors import ConfigError
from podkit.checks.importers import build_job
from podkit.checks.importers.command import Unreadable, hf_arguments, read_command

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
PREFLIGHT = ROOT / "bin" / "preflight"
SMOKE = ROOT / "bin" / "smoke"
ZERO3 = str(FIX / "accelerate" / "alignment-handbook-zero3.yaml")
DDP = str(FIX / "accelerate" / "alignment-handbook-ddp.yaml")
SFT_FULL = str(FIX / "trainer" / "zephyr-7b-beta-sft-config_full.yaml")
SFT_QLORA = str(FIX / "trainer" / "zephyr-7b-beta-sft-config_qlora.yaml")
TUNE_LORA = str(FIX / "torchtune" / "llama3_1-8B_lora_single_device.yaml")
TUNE_FULL = str(FIX / "torchtune" / "llama3_1-8B_full.yaml")
LITGPT_LORA = str(FIX / "litgpt" / "llama-3.2-1B-lora.yaml")
AXOLOTL = str(FIX / "axolotl" / "examples" / "qwen3-32b-qlora.yaml")
TITAN = str(FIX / "torchtitan" / "llama3_8b.toml")
ZERO2 = str(FIX / "axolotl" / "deepspeed_configs" / "zero2.json")


@pytest.fixture(autouse=True)
def _no_default_accelerate_config(tmp_path, monkeypatch):
    """accelerate launch reads ~/.cache/huggingface/accelerate/default_config.yaml when no --config_file is given;
    these tests must not read the developer's own."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def job(argv, model=None, specs=()):
    return build_job(None, list(specs), model, command=argv)


def keys(imported):
    t, c = imported.job.train, imported.job.cluster
    return {"stack": t.stack, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "seq_len": t.seq_len,
            "precision": t.precision, "checkpointing": t.checkpointing, "lora_rank": t.lora_rank,
            "base_quant": t.base_quant, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes, "sharding": c.sharding,
            "offload": c.offload}


def preflight(*args, cwd=None):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return subprocess.run([str(PREFLIGHT), "--no-probe", *args], capture_output=True, text=True, env=env,
                          timeout=60, cwd=cwd)


def test_alignment_handbook_sft_under_accelerate_deepspeed_zero3():
    # alignment-handbook recipes/zephyr-7b-beta/README.md @ 925acdfe: the full SFT run. The accelerate config
    # (zero3.yaml): DeepSpeed ZeRO-3, 8 processes, bf16; the TrlParser --config (config_full.yaml):
    # per_device_train_batch_size 16, gradient_accumulation_steps 1, max_seq_length 2048, gradient_checkpointing,
    # model mistralai/Mistral-7B-v0.1 loaded in bf16 (a full fine-tune: DeepSpeed keeps fp32 masters -> bf16-mixed).
    argv = ["ACCELERATE_LOG_LEVEL=info", "accelerate", "launch", "--config_file", ZERO3, "scripts/sft.py",
            "--config", SFT_FULL]
    imp = job(argv)
    assert imp.job.model.preset == "mistral-7b"
    assert keys(imp) == {"stack": "deepspeed", "micro_batch": 16, "grad_accum": 1, "seq_len": 2048,
                         "precision": "bf16-mixed", "checkpointing": "full", "lora_rank": 0, "base_quant": "none",
                         "gpus_per_node": 8, "nodes": 1, "sharding": "zero3", "offload": "none"}
    assert imp.job.train.attention == "flash-attn" and imp.unresolved == []
    trainer = next(f for f in imp.files if f.kind.startswith("TrainingArguments"))
    assert any("TrlParser" in m for m in trainer.mapped)
    assert {"hub_model_id", "report_to", "lr_scheduler_type"} <= set(trainer.ignored)


def test_alignment_handbook_qlora_with_launcher_and_script_overrides():
    # Same README: `accelerate launch --config_file ddp.yaml --num_processes=1 scripts/sft.py --config
    # config_qlora.yaml --load_in_4bit=true`. --num_processes=1 overrides ddp.yaml's 8 (launch.py: a config value
    # is used only where the option is not given); config_qlora.yaml: use_peft, lora_r 16 on seven projections,
    # 4-bit base, micro-batch 4 x accumulation 2, bf16 weights with LoRA -> pure bf16.
    argv = ["accelerate", "launch", "--config_file", DDP, "--num_processes=1", "scripts/sft.py", "--config", SFT_QLORA,
            "--load_in_4bit=true"]
    imp = job(argv)
    assert imp.job.model.preset == "mistral-7b"
    assert keys(imp) == {"stack": "hf", "micro_batch": 4, "grad_accum": 2, "seq_len": 2048, "precision": "bf16",
                         "checkpointing": "full", "lora_rank": 16, "base_quant": "nf4", "gpus_per_node": 1, "nodes": 1,
                         "sharding": "none", "offload": "none"}
    assert imp.job.train.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert any("--num_processes" in m and "ddp.yaml" in m for m in imp.files[0].mapped)


def test_hf_script_arguments_read_as_hf_argparser_reads_them(tmp_path):
    # transformers hf_argparser.py: --key value, --key=value, --key-name for key_name, a bare bool is True,
    # --no_key False, a list field takes every value to the next option.
    values, loose = hf_arguments(["extra.txt", "--per-device-train-batch-size", "2", "--bf16",
                                  "--no_gradient_checkpointing", "--lora_target_modules", "q_proj", "v_proj",
                                  "--learning_rate=2e-5", "--max_steps", "-1"])
    assert values == {"per_device_train_batch_size": 2, "bf16": True, "gradient_checkpointing": False,
                      "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 2e-5, "max_steps": -1}
    assert loose == ["extra.txt"]
    # The brief's own example: accelerate launch --config_file fsdp.yaml train_sft.py ... (alignment-handbook
    # fsdp.yaml: FULL_SHARD over 8 processes, bf16).
    argv = ["accelerate", "launch", "--config_file", str(FIX / "accelerate" / "alignment-handbook-fsdp.yaml"),
            "train_sft.py", "--model_name_or_path", "meta-llama/Llama-3.1-8B", "--per_device_train_batch_size", "2",
            "--bf16", "--gradient_checkpointing", "--my_own_flag", "7"]
    imp = job(argv)
    assert imp.job.model.preset == "llama-3.1-8b"
    k = keys(imp)
    del k["seq_len"]  # no --max_length: podkit's default
    assert k == {"stack": "hf", "micro_batch": 2, "grad_accum": 1, "precision": "bf16-mixed", "checkpointing": "full",
                 "lora_rank": 0, "base_quant": "none", "gpus_per_node": 8, "nodes": 1, "sharding": "zero3",
                 "offload": "none"}
    trainer = next(f for f in imp.files if f.kind.startswith("TrainingArguments"))
    assert "my_own_flag" in trainer.ignored  # the script's own flag: listed, not dropped


def test_a_single_json_argument_is_the_training_arguments_file(tmp_path):
    # transformers examples/pytorch/language-modeling/run_clm.py: `if len(sys.argv) == 2 and
    # sys.argv[1].endswith(".json")`: parse_json_file.
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"model_name_or_path": "meta-llama/Llama-3.2-1B", "output_dir": "o",
                                "per_device_train_batch_size": 3, "gradient_accumulation_steps": 4, "fp16": True}))
    imp = job(["python", "run_clm.py", str(args)])
    assert imp.job.model.preset == "llama-3.2-1b"
    assert (imp.job.train.micro_batch, imp.job.train.grad_accum, imp.job.train.precision) == (3, 4, "fp16-mixed")
    assert imp.files[0].path == args


def test_deepspeed_launcher_with_training_arguments_deepspeed():
    # transformers docs/source/en/deepspeed.md: `deepspeed --num_gpus=2 your_program.py <normal cl args>
    # --deepspeed ds_config.json`; axolotl's deepspeed_configs/zero2.json: stage 2, optimizer offloaded to CPU.
    argv = ["deepspeed", "--num_gpus=2", "run_clm.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B",
            "--per_device_train_batch_size", "4", "--bf16", "--deepspeed", ZERO2]
    imp = job(argv)
    k = keys(imp)
    assert (k["stack"], k["sharding"], k["offload"], k["gpus_per_node"], k["micro_batch"], k["precision"]) == \
        ("deepspeed", "zero2", "optimizer", 2, 4, "bf16-mixed")
    # DeepSpeed's own scripts (docs: `deepspeed --hostfile=myhostfile <client_entry.py> <client args> --deepspeed
    # --deepspeed_config ds_config.json`): the bare --deepspeed flag and the JSON it names; no model in either.
    own = job(["deepspeed", "--num_gpus", "4", "train.py", "--deepspeed", "--deepspeed_config", ZERO2],
              model="llama-3.2-1b")
    assert (own.job.train.stack, own.job.cluster.sharding, own.job.cluster.gpus_per_node) == ("deepspeed", "zero2", 4)


def test_tune_run_applies_key_value_overrides_onto_the_copied_config():
    # torchtune README.md (bd2a0fc7): `tune run lora_finetune_single_device --config llama2/7B_lora_single_device
    # batch_size=8 enable_activation_checkpointing=True max_steps_per_epoch=128`, on the copy of
    # llama3_1/8B_lora_single_device (`tune cp`), plus a component override as the README's QLoRA row
    # (loss=...): model=...qlora_llama3_1_8b sets model._component_ (config/_utils.py _merge_yaml_and_cli_args).
    argv = ["tune", "run", "lora_finetune_single_device", "--config", TUNE_LORA, "batch_size=8",
            "enable_activation_checkpointing=True", "max_steps_per_epoch=128",
            "model=torchtune.models.llama3_1.qlora_llama3_1_8b", "~seed"]
    imp = job(argv)
    k = keys(imp)
    assert imp.job.model.preset == "llama-3.1-8b"
    # The file: gradient_accumulation_steps 8, dtype bf16, lora_rank 8; the command: batch 8, checkpointing, NF4.
    assert (k["stack"], k["micro_batch"], k["grad_accum"], k["precision"], k["checkpointing"], k["lora_rank"],
            k["base_quant"], k["gpus_per_node"]) == ("torchtune", 8, 8, "bf16", "full", 8, "nf4", 1)
    recipe = imp.files[0]
    assert recipe.mapped[0].startswith("(tune run lora_finetune_single_device: batch_size=8")
    assert not any(i.startswith("seed") for i in recipe.ignored)  # ~seed removed it


def test_tune_run_distributed_takes_its_gpus_from_torchrun_options():
    # torchtune README.md: `tune run --nproc_per_node 2 full_finetune_distributed --config llama3_1/8B_full`, on
    # the copy of llama3_1/8B_full: FSDP2 over 2 GPUs (fsdp_cpu_offload false, reshard after forward).
    imp = job(["tune", "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", TUNE_FULL])
    k = keys(imp)
    assert (k["stack"], k["gpus_per_node"], k["sharding"], k["micro_batch"], k["lora_rank"]) == \
        ("torchtune", 2, "zero3", 2, 0)
    assert not any("gpus_per_node" in u for u in imp.unresolved)


def test_litgpt_finetune_with_config_and_dotted_overrides():
    # litgpt README.md (v0.5.13): `litgpt finetune --config .../config_hub/finetune/llama-2-7b/lora.yaml --lora_r 4`,
    # here on config_hub/finetune/llama-3.2-1B/lora.yaml (global 8, micro 1, max_seq_length 512, bf16-true), with
    # --train.micro_batch_size 2: accumulation 8 // 1 GPU // 2 = 4 (args.py gradient_accumulation_iters).
    imp = job(["litgpt", "finetune", "--config", LITGPT_LORA, "--lora_r", "4", "--train.micro_batch_size", "2"])
    k = keys(imp)
    assert (k["stack"], k["lora_rank"], k["micro_batch"], k["grad_accum"], k["seq_len"], k["precision"]) == \
        ("litgpt", 4, 2, 4, 512, "bf16")
    # `litgpt finetune_full CHECKPOINT_DIR` (the positional): the full script, whatever the keys say.
    full = job(["litgpt", "finetune_full", "checkpoints/meta-llama/Llama-3.2-1B", "--train.micro_batch_size", "1",
                "--train.max_seq_length", "1024", "--precision", "bf16-true"])
    assert (full.job.train.lora_rank, full.job.train.seq_len, full.job.model.hidden) == (0, 1024, 2048)


def test_axolotl_train_with_overrides_and_launcher_arguments():
    # axolotl docs/cli.qmd (067b021c): `axolotl train config.yml --learning-rate 1e-4 --micro-batch-size 2
    # --num-epochs 3` and `axolotl train config.yml --launcher torchrun -- --nproc_per_node=2 --nnodes=1`, on
    # examples/qwen3/32b-qlora.yaml (gradient_accumulation_steps 2, sequence_len 2048, qlora r 16).
    argv = ["axolotl", "train", AXOLOTL, "--learning-rate", "1e-4", "--micro-batch-size", "2", "--num-epochs", "3",
            "--launcher", "torchrun", "--", "--nproc_per_node=2", "--nnodes=1"]
    imp = job(argv)
    k = keys(imp)
    assert imp.job.model.preset == "qwen3-32b"
    assert (k["micro_batch"], k["grad_accum"], k["seq_len"], k["lora_rank"], k["base_quant"], k["gpus_per_node"],
            k["nodes"]) == (2, 2, 2048, 16, "nf4", 2, 1)
    assert imp.job.train.lr == 1e-4
    # `python -m axolotl.cli.train config.yml --micro_batch_size=3` (fire) and accelerate's launcher arguments.
    fire = job(["accelerate", "launch", "--num_processes", "4", "-m", "axolotl.cli.train", AXOLOTL,
                "--micro_batch_size=3"])
    assert (fire.job.train.micro_batch, fire.job.cluster.gpus_per_node) == (3, 4)


def test_torchtitan_run_train_command_with_overrides():
    # torchtitan v0.2.2 run_train.sh: `torchrun --nproc_per_node=${NGPU} --rdzv_backend c10d
    # --rdzv_endpoint="localhost:0" --local-ranks-filter ${LOG_RANK} --role rank --tee 3 -m ${TRAIN_FILE}
    # --job.config_file ${CONFIG_FILE} "$@"` with NGPU=8, the README's llama3_8b.toml (local batch 1, seq 8192,
    # op-level selective AC) and "$@" overriding two keys.
    argv = ["torchrun", "--nproc_per_node=8", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "torchtitan.train",
            "--job.config_file", TITAN, "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"]
    imp = job(argv)
    k = keys(imp)
    assert imp.job.model.preset == "llama-3.1-8b"
    assert (k["stack"], k["micro_batch"], k["seq_len"], k["checkpointing"], k["gpus_per_node"], k["sharding"],
            k["precision"]) == ("torchtitan", 2, 8192, "full", 8, "zero3", "bf16-mixed")
    launch = imp.files[-1]
    assert "torchrun --rdzv_backend (launcher detail, no memory)" in launch.ignored


def test_from_files_and_a_command_merge_and_disagreements_are_refused(tmp_path):
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "output_dir": "o"}))
    imp = job(["torchrun", "--nproc_per_node", "4", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B",
               "--bf16"], specs=[str(args)])
    assert (imp.job.train.micro_batch, imp.job.cluster.gpus_per_node, imp.job.train.precision) == (2, 4, "bf16-mixed")
    with pytest.raises(ConfigError, match="per_device_train_batch_size|train.micro_batch"):
        job(["python", "train.py", "--per_device_train_batch_size", "8"], model="llama-3.2-1b", specs=[str(args)])
    # A script whose arguments podkit does not read adds the launcher's facts to the files' job (alone it is
    # refused: test_a_command_podkit_cannot_read_is_one_line_exit_2).
    launcher_only = job(["torchrun", "--nproc_per_node", "4", "train.py", "--epochs", "3"], model="llama-3.2-1b",
                        specs=[str(args)])
    assert (launcher_only.job.train.micro_batch, launcher_only.job.cluster.gpus_per_node) == (2, 4)
    assert "train.py's arguments (none is one podkit reads: the job is --config's and --from's)" in \
        launcher_only.files[-1].ignored


@pytest.mark.parametrize("argv, needle", [
    # torchtune README.md: the built-in config name, not a file.
    (["tune", "run", "lora_finetune_single_device", "--config", "llama3_1/8B_lora_single_device"],
     "copy it with `tune cp llama3_1/8B_lora_single_device my_config.yaml`"),
    (["make", "train"], "make is no launcher or trainer podkit reads"),
    (["python", "train.py", "--epochs", "3"], "train.py: none of its arguments is one podkit reads"),
    (["torchrun", "--nproc_per_node", "lots", "train.py", "--per_device_train_batch_size", "2"],
     "--nproc_per_node: must be a positive number of processes, got 'lots'"),
    (["python", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B", "--per_device_train_batch_size",
      "two"], "per_device_train_batch_size: must be a whole number, got 'two'"),
    # litgpt README.md gives --config as a URL: podkit never fetches one.
    (["litgpt", "finetune", "--config",
      "https://raw.githubusercontent.com/Lightning-AI/litgpt/main/config_hub/finetune/llama-2-7b/lora.yaml"],
     "podkit reads local files only"),
    (["tune", "run", "lora_finetune_single_device", "--config", TUNE_LORA, "batch_size"], "is not key=value"),
    (["python", "-c", "print(1)"], "not inline code"),
    (["accelerate", "launch", "--config_file", "missing.yaml", "train.py", "--bf16"],
     "--: accelerate launch --config_file: missing.yaml does not exist"),
])
def test_a_command_podkit_cannot_read_is_one_line_exit_2(argv, needle):
    proc = preflight("--", *argv)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_preflight_json_predicts_the_job_a_command_runs():
    proc = preflight("--json", "--", "torchrun", "--nproc_per_node", "8", "-m", "torchtitan.train",
                     "--job.config_file", TITAN, "--training.local_batch_size", "2")
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"]["name"] == "llama-3.1-8b" and data["memory"]["per_gpu"]["total"] > 0
    assert data["imported"]["command"][:3] == ["torchrun", "--nproc_per_node", "8"]
    assert [f["kind"] for f in data["imported"]["files"]] == ["torchtitan", "launch command"]
    assert proc.stderr == ""  # --json: the account is in the object, not on stderr
    # Without --json the command and what was read from it are said on stderr; --emit-toml keeps the job.
    toml = preflight("--emit-toml", "--", "torchrun", "--nproc_per_node", "8", "-m", "torchtitan.train",
                     "--job.config_file", TITAN)
    assert toml.returncode == 0 and "gpus_per_node = 8" in toml.stdout and 'stack = "torchtitan"' in toml.stdout
    assert "preflight: reading the job from the command: torchrun" in toml.stderr


def test_a_word_before_the_dashes_is_no_command():
    proc = preflight("train.py")
    assert proc.returncode == 2 and "unexpected argument 'train.py' (put your launch command after --)" in proc.stderr


def test_secrets_in_the_command_never_reach_any_output(monkeypatch):
    secret, typed = "hf_podkitEnvSecret0123456789", "hf_typedOnTheCommandLine42"
    argv = ["python", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B", "--per_device_train_batch_size",
            "2", "--hub_token", typed, "--report_to", "wandb", "--push_to_hub", secret]
    env = {**os.environ, "HF_TOKEN": secret}
    for extra in ([], ["--json"]):
        proc = subprocess.run([str(PREFLIGHT), "--no-probe", *extra, "--", *argv], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode in (0, 1), proc.stderr
        out = proc.stdout + proc.stderr
        assert secret not in out and typed not in out, out
    data = json.loads(proc.stdout)
    assert "--hub_token" in data["imported"]["command"] and "[redacted]" in data["imported"]["command"]
    trainer = data["imported"]["files"][0]
    assert "hub_token" in trainer["ignored"] and "report_to" in trainer["ignored"]
    from podkit.envsetup.secrets import SecretFilter

    assert SecretFilter({}).argv(["--api-key=abcdefgh123", "metric_logger.api_key=zzz", "--lora_key", "true",
                                  "--hf_token", "t0ken"]) == \
        ["--api-key=[redacted]", "metric_logger.api_key=[redacted]", "--lora_key", "true", "--hf_token", "[redacted]"]


def test_uv_run_is_stepped_over_as_uv_reads_its_options():
    # uv's docs (concepts/projects/run.md): `uv run [OPTIONS] CMD`, uv's options before the command, `--` to mark
    # where it starts; `uv run x.py` is `uv run python x.py`, `-m M` is `python -m M`. --with and --python take a
    # value, -qq and --no-sync none (uv-cli lib.rs RunArgs): the command is torchrun's, with its 4 processes.
    argv = ["uv", "run", "--with", "liger-kernel", "-qq", "--no-sync", "--python", "3.12", "torchrun",
            "--nproc_per_node", "4", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B",
            "--per_device_train_batch_size", "2", "--bf16"]
    imp = job(argv)
    assert imp.job.model.preset == "llama-3.2-1b"
    assert (imp.job.cluster.gpus_per_node, imp.job.train.micro_batch) == (4, 2)
    launch = imp.files[-1]
    assert {"uv run --with (environment, no memory)", "uv run --python (environment, no memory)",
            "uv run --quiet (environment, no memory)", "uv run --no_sync (environment, no memory)"} <= set(launch.ignored)
    # `uv run -m trl.scripts.sft` and `uv run -- python -m ...` are the module; `uv run train.py` the script.
    for head in (["uv", "run", "-m"], ["uv", "run", "--", "python", "-m"]):
        sft = job([*head, "trl.scripts.sft", "--model_name_or_path", "meta-llama/Llama-3.2-1B"])
        assert (sft.job.train.precision, sft.job.train.seq_len) == ("bf16-mixed", 1024)  # SFTConfig's defaults
    script = job(["uv", "run", "--frozen", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B", "--fp16"])
    assert script.job.train.precision == "fp16-mixed"
    with pytest.raises(Unreadable, match="--directory"):
        read_command(["uv", "run", "--directory", "proj", "train.py", "--bf16"])
    # clap's short options: -p3.12 an option with its value, -qm two flags, -qwX flags then a value; uv's global
    # options before `run`; --no-cache-dir (CacheArgs' alias of --no-cache) a flag; --script a script of any name.
    tail = argv[argv.index("torchrun"):]
    for head in (["uv", "run", "-p3.12"], ["uv", "run", "--no-cache-dir"], ["uv", "-q", "run", "-qwliger-kernel"]):
        assert job(head + tail).job.cluster.gpus_per_node == 4, head
    assert job(["uv", "run", "-qm", "trl.scripts.sft", "--model_name_or_path", "meta-llama/Llama-3.2-1B"]
               ).job.train.seq_len == 1024
    named = job(["uv", "run", "--script", "train", "--model_name_or_path", "meta-llama/Llama-3.2-1B", "--fp16"])
    assert named.job.train.precision == "fp16-mixed"
    with pytest.raises(Unreadable, match="uv pip is no launcher podkit reads"):
        read_command(["uv", "-q", "pip", "install", "x"])


def test_accelerate_launch_without_a_config_file_reads_the_default_config(tmp_path, monkeypatch):
    # accelerate commands/launch.py _validate_launch_command: with no --config_file it loads default_config_file
    # ($HF_HOME/accelerate/default_config.yaml, commands/config/config_args.py) when it exists, options given on
    # the command line over it. alignment-handbook's zero3.yaml saved as the default: ZeRO-3 over 8 processes.
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(Path(ZERO3).read_text())
    monkeypatch.setenv("HF_HOME", str(home))
    argv = ["accelerate", "launch", "train_sft.py", "--model_name_or_path", "meta-llama/Llama-3.1-8B",
            "--per_device_train_batch_size", "2", "--bf16"]
    imp = job(argv)
    assert (imp.job.cluster.sharding, imp.job.cluster.gpus_per_node) == ("zero3", 8)
    default = imp.files[0]
    assert default.path == home / "accelerate" / "default_config.yaml"
    assert any("no --config_file: read the default config" in w for w in default.warnings)
    assert imp.unresolved == []
    # --num_processes over it, as launch.py applies a config value only where the option was not given.
    assert job(argv[:2] + ["--num_processes", "2"] + argv[2:]).job.cluster.gpus_per_node == 2
    # No default config: one process per GPU of the machine it runs on, which preflight cannot count.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    bare = job(argv)
    assert any("one process per GPU of the machine" in u for u in bare.unresolved), bare.unresolved


def test_read_command_lists_what_each_launcher_does_not_model():
    imps = read_command(["python", "-m", "torch.distributed.run", "--standalone", "--nnodes=1:2",
                         "--nproc-per-node", "gpu", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B"])
    launch = imps[-1]
    assert launch.unresolved == {"cluster.gpus_per_node": "python -m torch.distributed.run --nproc_per_node gpu: every "
                                                          "GPU of the machine",
                                 "cluster.nodes": "python -m torch.distributed.run --nnodes 1:2: an elastic range of "
                                                  "nodes"}
    assert launch.ignored == ["python -m torch.distributed.run --standalone (launcher detail, no memory)"]
    with pytest.raises(Unreadable):
        read_command(["bash", "run.sh"])


# --- bin/smoke -- COMMAND: the prediction derived from the command -------------------------------------------------

TINY_SFT = """
import torch
from dataclasses import dataclass, field
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

@dataclass
class ModelArguments:
    model_name_or_path: str = field()
    max_length: int = 32

model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_args.model_name_or_path))

class Repeat(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        ids = torch.arange(model_args.max_length) % 7 + 3
        return {"input_ids": ids, "labels": ids.clone()}

Trainer(model=model, args=args, train_dataset=Repeat()).train()
"""
# A tiny Llama's config.json, as `--model_name_or_path DIR` names it (podkit reads it as model.hf_config).
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def smoke_cmd(tmp_path, *args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PODKIT_RUN_ID", None)
    proc = subprocess.run([str(SMOKE), "--output-dir", str(tmp_path / "runs"), "--run-id", "r", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    path = tmp_path / "runs" / "r" / "summary.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def test_smoke_predicts_from_the_command_it_runs(tmp_path):
    pytest.importorskip("transformers", reason="the [test] extra installs transformers (pyproject.toml)")
    (tmp_path / "tiny_sft.py").write_text(textwrap.dedent(TINY_SFT))
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(TINY_CONFIG))
    proc, s = smoke_cmd(tmp_path, "--steps", "3", "--json", "--", sys.executable, "tiny_sft.py",
                        "--model_name_or_path", "tiny-llama", "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "1", "--max_length", "32", "--output_dir", "out",
                        "--max_steps", "1000", "--learning_rate", "5e-3", "--report_to", "none", "--save_strategy", "no",
                        "--use_cpu", "--logging_steps", "1000")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert s["steps"] == 3 and s["ranks"][0]["status"] == "steps", s["reasons"]
    assert s["predicted"] is not None and s["predicted_from"] == ["the command"], s
    assert s["memory"][0]["measured"] == s["peak_allocated"]
    config = (tmp_path / "runs" / "r" / "config.toml").read_text()
    assert "micro_batch = 2" in config and "seq_len = 32" in config and 'stack = "hf"' in config
    assert json.loads(proc.stdout)["predicted_from"] == ["the command"]
    said = [line for line in proc.stderr.splitlines() if "predicted from the command:" in line]
    assert len(said) == 1 and not said[0].split("predicted from the command:")[1].startswith(" ,"), said  # names the model


def test_smoke_runs_a_command_it_cannot_read_without_a_prediction(tmp_path):
    from tests.smoke_helpers import USER_LOOP

    (tmp_path / "loop.py").write_text(USER_LOOP.format(extra=""))
    proc, s = smoke_cmd(tmp_path, "--steps", "3", "--", sys.executable, "loop.py", "--epochs", "3")
    assert proc.returncode == 0, proc.stderr
    assert s["status"] == "pass" and s["predicted"] is None and s["predicted_from"] is None
    why = s["null_reasons"]["/predicted"]
    assert why.startswith("the command is not read as a job: loop.py: none of its arguments"), why
    lines = [line for line in proc.stderr.splitlines() if "no prediction" in line]
    assert lines == [f"smoke: no prediction to measure against: {why}"], proc.stderr


@pytest.mark.parametrize("argv", [["python", "-m", "trl.scripts.sft"], ["trl", "sft"]])
def test_trls_sft_entry_points_take_sftconfigs_defaults(argv):
    # trl/scripts/sft.py parses SFTConfig (TrlParser((ScriptArguments, SFTConfig, ModelConfig))), whose defaults
    # are bf16 (not fp16), gradient_checkpointing and max_length 1024 (trl/trainer/sft_config.py, v1.9), even
    # when no SFTConfig-only field is on the command line.
    out = preflight("--emit-toml", "--", *argv, "--model_name_or_path", "meta-llama/Llama-3.2-1B",
                    "--dataset_name", "trl-lib/Capybara")
    assert out.returncode == 0, out.stderr
    assert 'precision = "bf16-mixed"' in out.stdout and 'checkpointing = "full"' in out.stdout, out.stdout
    assert "seq_len = 1024" in out.stdout


def test_a_token_under_no_secret_name_is_still_hidden():
    # A token pasted as a bare word, under an option not named like a secret, as an axolotl override, or folded
    # into another option's value that an error then quotes: hidden by its shape (envsetup/secrets.py TOKEN_SHAPE).
    token = "hf_" + "a1B2" * 9
    fixture = str(ROOT / "tests" / "fixtures" / "axolotl" / "examples" / "mixtral.yml")
    for argv in (["python", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B", "--per_device_train_batch_size",
                  "2", "--report_to", "none", f"--weird={token}", "--push_to_hub", "--", token],
                 ["python", "train.py", "--model_name_or_path", "meta-llama/Llama-3.2-1B",
                  "--per_device_train_batch_size", "2", token],  # folded into the batch size: exit 2, quoted
                 ["axolotl", "train", fixture, "--unknownflag", token]):
        for extra in ([], ["--json"]):
            proc = subprocess.run([str(PREFLIGHT), "--no-probe", *extra, "--", *argv], capture_output=True, text=True,
                                  timeout=60)
            assert proc.returncode in (0, 1, 2) and "Traceback" not in proc.stderr, proc.stderr
            assert token not in proc.stdout + proc.stderr, (argv, proc.stdout + proc.stderr)
    from podkit.envsetup.secrets import SecretFilter

    # Commit ids are 40 hex digits too: a whole word of them is hidden, the same inside a sentence is not.
    assert SecretFilter({}).argv(["0123456789abcdef0123456789abcdef01234567"]) == ["[redacted]"]
