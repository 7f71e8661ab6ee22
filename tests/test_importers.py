"""bin/preflight --from: users' own config files read into the job, each kind on a realistic file.

Every file below is written with the keys its library documents (cited per test); the assertions
check the job podkit builds from it, and the seed jobs in checks/examples/ end to end.
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from podkit.checks import memory
from podkit.checks.config import load_job, parse_job
from podkit.checks.errors import ConfigError
from podkit.checks.importers import build_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "checks" / "examples"
PREFLIGHT = ROOT / "bin" / "preflight"


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return str(p)


def preflight(*args):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return subprocess.run([str(PREFLIGHT), "--no-probe", *args], capture_output=True, text=True, env=env, timeout=60)


def test_sft_config_yaml_maps_batch_precision_optimizer_and_checkpointing(tmp_path):
    # trl/trainer/sft_config.py SFTConfig (max_length, packing) over transformers TrainingArguments
    # (training_args.py: per_device_train_batch_size, optim, gradient_checkpointing_kwargs, fsdp).
    f = write(tmp_path, "sft.yaml", """
        model_name_or_path: meta-llama/Llama-3.1-8B
        output_dir: out
        per_device_train_batch_size: 2
        gradient_accumulation_steps: 8
        max_length: 4096
        packing: true
        bf16: true
        optim: paged_adamw_8bit
        gradient_checkpointing: true
        gradient_checkpointing_kwargs:
          use_reentrant: false
        fsdp: "full_shard auto_wrap"
        fsdp_config:
          transformer_layer_cls_to_wrap: LlamaDecoderLayer
        logging_steps: 5
    """)
    imp = build_job(None, [f])
    t, c = imp.job.train, imp.job.cluster
    assert imp.job.model.preset == "llama-3.1-8b"
    assert (t.micro_batch, t.grad_accum, t.seq_len) == (2, 8, 4096)
    assert (t.precision, t.optimizer, t.checkpointing, t.stack) == ("bf16-mixed", "paged_adamw8bit", "full", "hf")
    assert c.sharding == "zero3"
    # packing with TRL's default 'bfd' strategy: padding-free rows (sft_trainer.py padding_free)
    assert t.padding == "flattened"
    trainer = imp.files[0]
    assert any("logging_steps" in i for i in trainer.ignored)
    assert any("fsdp_config.transformer_layer_cls_to_wrap" in i for i in trainer.ignored)
    assert any("use_reentrant = false" in w for w in trainer.warnings)


def test_trainer_defaults_apply_where_the_file_is_silent(tmp_path):
    # TrainingArguments: per_device_train_batch_size=8, bf16=fp16=False, optim adamw_torch_fused with
    # torch >= 2.8 by default (transformers 5.23 training_args.py).
    f = write(tmp_path, "args.json", json.dumps({"output_dir": "o"}))
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    t = imp.job.train
    assert (t.micro_batch, t.grad_accum, t.precision) == (8, 1, "fp32")
    assert (t.optimizer, imp.job.facts.optimizer_impl) == ("adamw", "fused")
    assert any("adamw_torch_fused" in w for w in imp.files[0].warnings)
    explicit = write(tmp_path, "args2.json", json.dumps({"output_dir": "o", "optim": "adamw_torch"}))
    assert build_job(None, [explicit], model_preset="llama-3.2-1b").job.facts.optimizer_impl == "foreach"
    # The file does not say which transformers ran it: a job that does gets that release's default
    # (adamw_torch, foreach, before 4.54).
    old = write(tmp_path, "old.toml", '[model]\npreset = "llama-3.2-1b"\n[train]\ntransformers = "4.39.3"\n')
    assert build_job(str(old), [f]).job.facts.optimizer_impl == "foreach"


def test_trainer_torchao_optimizers(tmp_path):
    # transformers 5.23 trainer_optimizer.py _get_torchao_optimizer: adamw_torch_4bit builds torchao's AdamW4bit,
    # adamw_torch_8bit AdamW8bit, both with block_size=optim_args.get("block_size", 256).
    f = write(tmp_path, "a.json", json.dumps({"output_dir": "o", "optim": "adamw_torch_4bit", "bf16": True}))
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    assert (imp.job.train.optimizer, imp.job.facts.torchao_block) == ("torchao_adamw4bit", 256)
    f = write(tmp_path, "b.json", json.dumps({"output_dir": "o", "optim": "adamw_torch_8bit",
                                              "optim_args": "block_size=128, bf16_stochastic_round=True"}))
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    assert (imp.job.train.optimizer, imp.job.facts.torchao_block) == ("torchao_adamw8bit", 128)
    # optim_args values reach torchao as text: its `numel % block_size` fails; the other key is listed.
    assert any("TypeError" in w for w in imp.files[0].warnings)
    assert any("bf16_stochastic_round" in i for i in imp.files[0].ignored)
    bad = write(tmp_path, "c.json", json.dumps({"output_dir": "o", "optim": "adamw_torch_8bit", "optim_args": "x"}))
    with pytest.raises(ConfigError, match="optim_args"):
        build_job(None, [bad], model_preset="llama-3.2-1b")
    # Another optimizer leaves optim_args unread: listed as ignored, not dropped.
    other = write(tmp_path, "d.json", json.dumps({"output_dir": "o", "optim": "adamw_torch", "optim_args": "a=1"}))
    assert "optim_args" in build_job(None, [other], model_preset="llama-3.2-1b").files[0].ignored
    # axolotl passes its optimizer name to TrainingArguments.optim (the same names).
    ax = write(tmp_path, "ax.yaml", "base_model: meta-llama/Llama-3.2-1B\noptimizer: adamw_torch_8bit\nbf16: true\n")
    assert build_job(None, [f"axolotl:{ax}"]).job.train.optimizer == "torchao_adamw8bit"


def test_use_liger_kernel_selects_liger_s_loss_and_block_kernels(tmp_path):
    f = write(tmp_path, "args.json", json.dumps({"output_dir": "o", "bf16": True, "use_liger_kernel": True}))
    imp = build_job(None, [f], model_preset="llama-3.2-1b")
    assert imp.job.facts.loss == "liger" and imp.job.facts.block_kernels == "liger"
    assert not any("liger" in w.lower() for w in imp.files[0].warnings)
    # liger_kernel_config can switch the fused loss off (the Trainer passes it to Liger's patch).
    off = write(tmp_path, "off.json", json.dumps({"output_dir": "o", "use_liger_kernel": True,
                                                  "liger_kernel_config": {"fused_linear_cross_entropy": False}}))
    facts = build_job(None, [off], model_preset="llama-3.2-1b").job.facts
    assert facts.loss != "liger" and facts.block_kernels == "liger"
    # Some block kernels off: priced all or none, so transformers' modules, and said so.
    part = write(tmp_path, "part.json", json.dumps({"output_dir": "o", "use_liger_kernel": True,
                                                   "liger_kernel_config": {"rope": False}}))
    imp = build_job(None, [part], model_preset="llama-3.2-1b")
    assert imp.job.facts.loss == "liger" and imp.job.facts.block_kernels == "torch"
    assert any("rope = false" in w for w in imp.files[0].warnings)
    plain = write(tmp_path, "plain.json", json.dumps({"output_dir": "o"}))
    assert build_job(None, [plain], model_preset="llama-3.2-1b").job.facts.loss != "liger"


def test_peft_adapter_config_and_bnb_quantization(tmp_path):
    # peft src/peft/tuners/lora/config.py LoraConfig as saved in adapter_config.json;
    # transformers utils/quantization_config.py BitsAndBytesConfig.to_dict().
    lora = write(tmp_path, "adapter_config.json", json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 64, "lora_alpha": 16, "lora_dropout": 0.1,
        "target_modules": "model.*(q_proj|v_proj)$", "bias": "none", "modules_to_save": ["lm_head"],
        "base_model_name_or_path": "Qwen/Qwen3-8B", "use_dora": False}))
    bnb = write(tmp_path, "bnb.json", json.dumps({
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_threshold": 6.0}))
    imp = build_job(None, [lora, bnb])
    t, f = imp.job.train, imp.job.facts
    assert imp.job.model.preset == "qwen3-8b"
    assert (t.lora_rank, t.lora_dropout, f.lora_targets) == (64, 0.1, ("q_proj", "v_proj"))
    # BitsAndBytesConfig's bnb_4bit_use_double_quant defaults to False, unlike podkit's QLoRA default.
    assert (t.base_quant, t.double_quant) == ("nf4", False)
    assert any("modules_to_save" in w for w in imp.files[0].warnings)
    assert any("bnb_4bit_compute_dtype" in i for i in imp.files[1].ignored)


def test_deepspeed_offload_and_auto_values_left_to_training_arguments(tmp_path):
    # deepspeed.ai/docs/config-json: zero_optimization.stage, offload_optimizer / offload_param.device;
    # "auto" is filled by transformers integrations/deepspeed.py from TrainingArguments.
    ds = write(tmp_path, "ds.json", json.dumps({
        "fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu"}, "reduce_bucket_size": "auto"}}))
    args = write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                                                    "fp16": True, "deepspeed": ds}))
    imp = build_job(None, [args], model_preset="llama-3.1-8b")
    t, c = imp.job.train, imp.job.cluster
    assert (t.stack, t.precision, t.micro_batch, t.grad_accum) == ("deepspeed", "fp16-mixed", 2, 4)
    assert (c.sharding, c.offload) == ("zero3", "all")
    assert c.reduce_bucket == "auto"  # the Trainer fills it with hidden x hidden
    assert [f.kind for f in imp.files] == ["TrainingArguments", "DeepSpeed"]
    # Every "auto" is filled from TrainingArguments; only the GPU count is left to the launcher.
    assert len(imp.unresolved) == 1 and "gpus_per_node" in imp.unresolved[0]
    # Alone, the DeepSpeed file's "auto" micro-batch is reported, not guessed.
    alone = build_job(None, [ds], model_preset="llama-3.1-8b")
    assert any("train_micro_batch_size_per_gpu" in u for u in alone.unresolved)
    assert any("cluster.gpus_per_node keeps podkit's default" in u for u in alone.unresolved)
    assert alone.job.train.micro_batch == 1
    # A silent TrainingArguments still fills "auto": with its defaults (per_device_train_batch_size 8).
    silent = write(tmp_path, "args_silent.json", json.dumps({"output_dir": "o", "bf16": True, "deepspeed": ds}))
    filled = build_job(None, [silent], model_preset="llama-3.1-8b")
    assert filled.job.train.micro_batch == 8 and not any("micro_batch" in u for u in filled.unresolved)
    # A numeric train_batch_size = micro x accum x GPUs gives the GPU count.
    counted = write(tmp_path, "ds2.json", json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                                       "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}))
    job = build_job(None, [counted], model_preset="llama-3.2-1b").job
    assert (job.cluster.gpus_per_node, job.cluster.sharding, job.train.global_batch) == (8, "zero1", 64)


def test_conflicting_files_are_bad_input(tmp_path):
    ds = write(tmp_path, "ds.json", json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    args = write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 2, "deepspeed": ds}))
    with pytest.raises(ConfigError, match="train.micro_batch"):
        build_job(None, [args], model_preset="llama-3.2-1b")


def test_accelerate_fsdp_yaml(tmp_path):
    # accelerate/commands/config/config_args.py ClusterConfig, FSDP1 keys as `accelerate config` writes them.
    f = write(tmp_path, "accelerate.yaml", """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        mixed_precision: bf16
        num_machines: 2
        num_processes: 16
        fsdp_config:
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_offload_params: true
          fsdp_activation_checkpointing: true
          fsdp_state_dict_type: SHARDED_STATE_DICT
        main_training_function: main
    """)
    imp = build_job(None, [f], model_preset="llama-3.1-8b")
    c, t = imp.job.cluster, imp.job.train
    assert (c.gpus_per_node, c.nodes, c.sharding, c.offload) == (8, 2, "zero2", "optimizer")
    assert (t.precision, t.checkpointing) == ("bf16-mixed", "full")
    assert any("fsdp_state_dict_type" in i for i in imp.files[0].ignored)


def test_a_model_loaded_in_float16_is_the_fp16_twin_of_bf16(tmp_path):
    """transformers' Trainer over a model loaded with torch_dtype float16: no flag is pure fp16; fp16 = true puts
    a GradScaler over it, which takes peft's fp32 adapters' gradients but refuses fp16 ones (torch/amp/
    grad_scaler.py: "Attempting to unscale FP16 gradients."), unless an engine keeps fp32 masters."""
    base = textwrap.dedent("""
        model_name_or_path: meta-llama/Llama-3.2-1B
        torch_dtype: float16
        per_device_train_batch_size: 2
        optim: adamw_8bit
    """)
    pure = build_job(None, [write(tmp_path, "pure.yaml", base)])
    assert (pure.job.train.precision, pure.job.train.grad_scaler) == ("fp16", "auto")
    assert "torch_dtype = 'float16' -> train.precision = 'fp16' (fp16 weights, no fp32 masters)" in pure.files[0].mapped
    assert not [w for w in pure.files[0].warnings if "not modelled" in w]
    lora = build_job(None, [write(tmp_path, "lora.yaml", base + "fp16: true\nuse_peft: true\nlora_r: 8\n")])
    assert (lora.job.train.precision, lora.job.train.grad_scaler) == ("fp16", "on")
    assert lora.job.facts.adapter_bytes == 4  # peft's fp32 adapters: the GradScaler unscales them
    with pytest.raises(ConfigError, match="Attempting to unscale FP16 gradients"):
        build_job(None, [write(tmp_path, "full.yaml", base + "fp16: true\n")])
    fsdp = build_job(None, [write(tmp_path, "fsdp.yaml", base + "fp16: true\nfsdp: full_shard auto_wrap\n")])
    assert fsdp.job.train.precision == "fp16-mixed"  # accelerate's FSDP upcasts the trained weights to fp32
    # axolotl: float16 loads fp16 weights with no autocast; fp16 loads them in fp16 under the Trainer's fp16.
    axolotl = textwrap.dedent("""
        base_model: meta-llama/Llama-3.2-1B
        sequence_len: 1024
        micro_batch_size: 1
        optimizer: adamw_bnb_8bit
    """)
    job = build_job(None, [write(tmp_path, "float16.yml", axolotl + "float16: true\n")]).job
    assert job.train.precision == "fp16"
    job = build_job(None, [write(tmp_path, "fp16lora.yml", axolotl + "fp16: true\nadapter: lora\nlora_r: 8\n")]).job
    assert (job.train.precision, job.train.grad_scaler) == ("fp16", "on")
    with pytest.raises(ConfigError, match="fp16 = True .axolotl loads the weights in fp16. with fp16 autocast"):
        build_job(None, [write(tmp_path, "fp16full.yml", axolotl + "fp16: true\n")])


def test_axolotl_bfloat16_is_autocast_and_what_axolotl_refuses_is_refused(tmp_path):
    # axolotl core/builders/base.py _configure_precision_settings: TrainingArguments bf16 = cfg.bf16 or
    # cfg.bfloat16; utils/config resolve_dtype loads bf16 weights for either. Under FSDP a full fine-tune's
    # autocast makes accelerate upcast the trained weights to fp32 masters (bf16-mixed).
    axolotl = textwrap.dedent("""
        base_model: meta-llama/Llama-3.2-1B
        sequence_len: 1024
        micro_batch_size: 1
        fsdp_config:
          fsdp_version: 2
    """)
    alone = build_job(None, [write(tmp_path, "bfloat16.yml", axolotl + "bfloat16: true\n")])
    assert alone.job.train.precision == "bf16-mixed"
    assert any(m.startswith("bfloat16 = True -> train.precision") for m in alone.files[0].mapped)
    # LoRA over it: the frozen base stays bf16, pure bf16 as before.
    lora = build_job(None, [write(tmp_path, "lora.yml", axolotl + "bfloat16: true\nadapter: lora\nlora_r: 8\n")])
    assert lora.job.train.precision == "bf16"
    # utils/schemas/config.py: bf16 is Literal["auto"] | bool | None, so the docs' "full" fails validation; and
    # fp16 beside bfloat16 hands the Trainer both, which transformers refuses.
    with pytest.raises(ConfigError, match="'full' is refused by axolotl's config schema"):
        build_job(None, [write(tmp_path, "full.yml", axolotl + "bf16: full\n")])
    with pytest.raises(ConfigError, match="At most one of fp16 and bf16 can be True"):
        build_job(None, [write(tmp_path, "both.yml", axolotl + "fp16: true\nbfloat16: true\n")])
    both_ok = build_job(None, [write(tmp_path, "ok.yml", axolotl + "bf16: true\nfp16: true\nbfloat16: true\n")])
    assert both_ok.job.train.precision == "bf16-mixed"  # resolve_dtype: bf16 true turns fp16 off


def test_axolotl_qlora_yaml(tmp_path):
    # axolotl docs/config-reference.qmd: base_model, adapter, lora_r, lora_target_linear, sequence_len,
    # micro_batch_size, optimizer, flash_attention.
    f = write(tmp_path, "qlora.yml", """
        base_model: mistralai/Mistral-7B-v0.1
        model_type: MistralForCausalLM
        load_in_4bit: true
        adapter: qlora
        lora_r: 32
        lora_alpha: 16
        lora_dropout: 0.05
        lora_target_linear: true
        sequence_len: 4096
        sample_packing: true
        micro_batch_size: 2
        gradient_accumulation_steps: 4
        num_epochs: 1
        optimizer: paged_adamw_32bit
        learning_rate: 0.0002
        bf16: auto
        gradient_checkpointing: true
        flash_attention: true
        datasets:
          - path: mhenrichsen/alpaca_2k_test
            type: alpaca
    """)
    imp = build_job(None, [f])
    t, f_ = imp.job.train, imp.job.facts
    assert imp.job.model.preset == "mistral-7b"
    assert (t.lora_rank, t.base_quant, t.double_quant, t.optimizer) == (32, "nf4", True, "paged_adamw")
    assert (t.seq_len, t.micro_batch, t.grad_accum, t.attention, t.stack) == (4096, 2, 4, "flash-attn", "hf")
    assert t.precision == "bf16"  # axolotl loads the weights in bf16 (loaders/model.py torch_dtype)
    assert len(f_.lora_targets) == 7
    assert any(i == "datasets" for i in imp.files[0].ignored)


def test_axolotl_liger_and_cut_cross_entropy_plugins(tmp_path):
    # axolotl src/axolotl/integrations/liger/args.py, plugin.py; integrations/cut_cross_entropy/args.py:
    # the flags act only with their plugin listed; liger_swiglu is liger_glu_activation's old name.
    base = """
        base_model: meta-llama/Llama-3.1-8B
        adapter: lora
        lora_r: 16
        sequence_len: 2048
        micro_batch_size: 2
        bf16: true
    """
    liger = write(tmp_path, "liger.yml", base + """
        plugins:
          - axolotl.integrations.liger.LigerPlugin
        liger_rope: true
        liger_rms_norm: true
        liger_swiglu: true
        liger_fused_linear_cross_entropy: true
    """)
    facts = build_job(None, [liger]).job.facts
    assert (facts.loss, facts.block_kernels) == ("liger", "liger")
    cce = write(tmp_path, "cce.yml", base + """
        plugins:
          - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin
          - axolotl.integrations.liger.LigerPlugin
        liger_rms_norm: true
    """)
    imp = build_job(None, [cce])
    assert (imp.job.facts.loss, imp.job.facts.block_kernels) == ("fused", "torch")  # cut_cross_entropy defaults on
    assert any("all or none" in w for w in imp.files[0].warnings)
    unplugged = write(tmp_path, "unplugged.yml", base + """
        liger_fused_linear_cross_entropy: true
        cut_cross_entropy: true
    """)
    imp = build_job(None, [unplugged])
    assert imp.job.facts.loss != "liger" and imp.job.facts.loss != "fused"
    assert any("without axolotl.integrations.liger.LigerPlugin" in w for w in imp.files[0].warnings)


def test_torchtitan_toml(tmp_path):
    # torchtitan/config/job_config.py; torchtitan/models/llama3/train_configs/llama3_8b.toml's shape.
    f = write(tmp_path, "llama3_8b.toml", """
        [job]
        dump_folder = "./outputs"
        [model]
        name = "llama3"
        flavor = "8B"
        [optimizer]
        name = "AdamW"
        lr = 3e-4
        implementation = "fused"
        [training]
        local_batch_size = 1
        seq_len = 8192
        max_norm = 1.0
        steps = 1000
        [parallelism]
        data_parallel_replicate_degree = 1
        data_parallel_shard_degree = 8
        tensor_parallel_degree = 1
        [activation_checkpoint]
        mode = "selective"
        selective_ac_option = "op"
    """)
    imp = build_job(None, [f])
    t, c = imp.job.train, imp.job.cluster
    assert imp.job.model.preset == "llama-3.1-8b"
    assert (t.stack, t.seq_len, t.micro_batch, t.precision) == ("torchtitan", 8192, 1, "bf16-mixed")
    assert (c.sharding, c.gpus_per_node) == ("zero3", 8)
    assert imp.job.facts.ac_policy == "op-sac"
    assert "[job]" in imp.files[0].ignored and "training.steps" in imp.files[0].ignored


def test_torchtitan_expert_parallelism_is_said_not_modelled(tmp_path):
    # A DeepSeek-V3 16B run with ep 4 inside dp_shard 8 (torchtitan v0.2.2 efsdp = dp_shard x cp x tp / (etp x ep)):
    # still 8 GPUs, and a warning instead of a silent ep = 1.
    f = write(tmp_path, "dsv3.toml", """
        [model]
        name = "deepseek_v3"
        flavor = "16B"
        [training]
        local_batch_size = 1
        seq_len = 4096
        [parallelism]
        data_parallel_shard_degree = 8
        expert_parallel_degree = 4
    """)
    imp = build_job(None, [f])
    assert imp.job.cluster.gpus_per_node == 8
    assert any(w.startswith("parallelism.expert_parallel_degree = 4: expert parallelism is not modelled")
               for w in imp.files[0].warnings)


def test_config_is_the_base_and_files_override(tmp_path):
    args = write(tmp_path, "args.json", json.dumps({"per_device_train_batch_size": 3, "bf16": True}))
    imp = build_job(str(EXAMPLES / "llama-3.2-1b-a10g.toml"), [args])
    base = load_job(EXAMPLES / "llama-3.2-1b-a10g.toml")
    assert imp.job.model.preset == base.model.preset and imp.job.train.optimizer == base.train.optimizer
    assert imp.job.train.micro_batch == 3 and imp.job.cluster.host_ram_gb == base.cluster.host_ram_gb


SEED_DS = EXAMPLES / "hf-deepspeed-llama-3.2-1b-4xa10g"
SEED_LORA = EXAMPLES / "qwen2.5-7b-lora-r128-24gb"


def predicted(gpu: str, *files: Path) -> dict:
    """bin/preflight --json of the job imported from `files`, for `gpu` (exit 0 or 1: fits or not)."""
    out = preflight("--gpu", gpu, "--json", *(arg for f in files for arg in ("--from", str(f))))
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def test_seed_deepspeed_zero3_job_predicted_through_from():
    data = predicted("A10G", SEED_DS / "training_args.json", SEED_DS / "accelerate.yaml")
    assert [f["kind"] for f in data["imported"]["files"]] == ["TrainingArguments", "DeepSpeed", "accelerate config"]
    same = parse_job(textwrap.dedent("""
        [model]
        preset = "llama-3.2-1b"
        [train]
        stack = "deepspeed"
        precision = "bf16-mixed"
        micro_batch = 4
        grad_accum = 4
        seq_len = 2048
        checkpointing = "full"
        padding = "flattened"  # TRL packing ('bfd'): padding-free rows
        [cluster]
        gpu = "A10G"
        gpus_per_node = 4
        sharding = "zero3"
    """))
    assert data["memory"]["per_gpu"]["total"] == memory.estimate(same).total
    assert data["memory"]["fits"] is True


def test_seed_qwen_lora_job_predicted_through_from():
    data = predicted("A10G", SEED_LORA / "training_args.json", SEED_LORA / "adapter_config.json")
    same = parse_job(textwrap.dedent("""
        [model]
        preset = "qwen2.5-7b"
        [train]
        stack = "hf"
        precision = "bf16"
        micro_batch = 1
        grad_accum = 16
        seq_len = 2048
        checkpointing = "full"
        lora_rank = 128
        lora_targets = "all-linear"
        lora_dropout = 0.05
        [cluster]
        gpu = "A10G"
    """))
    assert data["memory"]["per_gpu"]["total"] == memory.estimate(same).total
    assert data["model"]["trainable_params"] < data["model"]["params"] / 10


SEED_LIGER = EXAMPLES / "llama-3.1-8b-lora-liger"


def test_seed_liger_job_predicted_through_from(tmp_path):
    """The README's Liger example: use_liger_kernel prices Liger's loss and block kernels; the same
    arguments without it price transformers' loss and modules, far above."""
    def total(args: Path) -> int:
        return predicted("H100-SXM", args, SEED_LIGER / "adapter_config.json")["memory"]["per_gpu"]["total"]

    same = parse_job(textwrap.dedent("""
        [model]
        preset = "llama-3.1-8b"
        [train]
        stack = "hf"
        precision = "bf16-mixed"
        micro_batch = 4
        seq_len = 2048
        lora_rank = 16
        lora_targets = ["q_proj", "v_proj"]
        loss = "liger"
        block_kernels = "liger"
        [cluster]
        gpu = "H100-SXM"
    """))
    liger = total(SEED_LIGER / "training_args.json")
    assert liger == memory.estimate(same).total
    args = json.loads((SEED_LIGER / "training_args.json").read_text())
    plain = tmp_path / "training_args.json"
    plain.write_text(json.dumps({**args, "use_liger_kernel": False}))
    assert total(plain) > 1.4 * liger


def test_emit_toml_round_trips(tmp_path):
    out = preflight("--emit-toml", "--from", str(SEED_LORA / "training_args.json"),
                    "--from", str(SEED_LORA / "adapter_config.json"))
    assert out.returncode == 0, out.stderr
    assert "mapped  r = 128 -> train.lora_rank = 128" in out.stderr
    job_file = tmp_path / "job.toml"
    job_file.write_text(out.stdout)
    a = json.loads(preflight("--json", "--config", str(job_file)).stdout)
    b = json.loads(preflight("--json", "--from", str(SEED_LORA / "training_args.json"),
                             "--from", str(SEED_LORA / "adapter_config.json")).stdout)
    assert a["memory"]["per_gpu"] == b["memory"]["per_gpu"]


@pytest.mark.parametrize("args, needle", [
    (["--from", "{tmp}/notes.json"], "not a config podkit can read"),
    (["--from", "deepspeed:{seed}/training_args.json"], "does not look like a deepspeed config"),
    (["--from", "{tmp}/missing.json"], "does not exist"),
    (["--from", "{tmp}/bad.json"], "not valid JSON"),
    (["--from", "{seed_ds}/ds_config.json"], "none of the --from files names the model"),
    (["--emit-toml"], "go with --from"),
    # QA 2026-11-25: these read '.' or printed Python's errno and parser text
    (["--from", ""], "--from: no file given"),
    (["--from", "deepspeed:"], "no file given after 'deepspeed:'"),
    (["--from", "{tmp}"], "is a directory"),
    (["--from", "{tmp}/bad.yaml"], "is not valid YAML: expected the node content, but found '<stream end>' (line 2, column 1)"),
    (["--from", "{tmp}/latin1.json"], "is not UTF-8 text"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    (tmp_path / "notes.json").write_text(json.dumps({"title": "my notes"}))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "latin1.json").write_bytes('{"caf\u00e9": 1}'.encode("latin-1"))
    args = [a.format(tmp=tmp_path, seed=SEED_LORA, seed_ds=SEED_DS) for a in args]
    out = preflight(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("name, text, needle", [
    # QA 2026-11-25: int(inf) / int(nan) / float("abc") were tracebacks (exit 1, nothing on stdout under --json).
    ("ta.json", '{"gradient_accumulation_steps": 1e400}',
     "gradient_accumulation_steps: must be a whole number, got inf"),
    ("ta.json", '{"per_device_train_batch_size": NaN}', "per_device_train_batch_size: must be a whole number, got nan"),
    ("ds.json", '{"zero_optimization": {"stage": 1e400}}', "zero_optimization.stage: must be a whole number"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "gradient_clipping": "x"}', "gradient_clipping: must be a number"),
    ("ds.json", '{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "abc"}}}',
     "optimizer.params.lr: must be a number, got 'abc'"),
    ("adapter_config.json", '{"peft_type": "LORA", "r": NaN, "target_modules": ["q_proj"]}', "r: must be a whole number"),
    ("adapter_config.json", '{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], "lora_dropout": "x"}',
     "lora_dropout: must be a number"),
    ("ta.yaml", "per_device_train_batch_size: .inf\n", "per_device_train_batch_size: must be a whole number"),
    ("ta.json", '{"learning_rate": "fast"}', "learning_rate: must be a number"),
    ("axolotl.yml", "base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: .nan\n", "micro_batch_size: must be a whole"),
    ("axolotl.yml", "base_model: meta-llama/Llama-3.2-1B\nlearning_rate: abc\n", "learning_rate: must be a number"),
    ("torchtitan.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nmax_norm = "x"\n',
     "training.max_norm: must be a number"),
])
def test_a_number_that_is_not_one_is_bad_input(tmp_path, name, text, needle):
    f = tmp_path / name
    f.write_text(text)
    model = [] if "base_model" in text else ["--model", "llama-3.2-1b"]
    out = preflight("--from", str(f), *model, "--json")
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and json.loads(out.stdout)["status"] == "bad-input"


def test_a_path_with_a_colon_that_exists_is_still_a_file(tmp_path):
    """'foo:FILE' with an unknown kind is refused as one, but a file really named so is read."""
    odd = tmp_path / "run:3.json"
    odd.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert build_job(None, [str(odd)], model_preset="llama-3.2-1b").job.cluster.sharding == "zero3"
    with pytest.raises(ConfigError, match="unknown kind 'dpsd'"):
        build_job(None, [f"dpsd:{odd}"], model_preset="llama-3.2-1b")


def test_a_trl_sftconfig_gets_its_own_defaults(tmp_path):
    # trl/trainer/sft_config.py (v1.9): SFTConfig overrides TrainingArguments' bf16 (not fp16; trl >= 0.19),
    # gradient_checkpointing (True; trl >= 0.22) and has max_length = 1024. A file with an SFTConfig-only field
    # and none of the three is trained so; plain TrainingArguments keep fp32 and no checkpointing.
    def job(**args):
        f = tmp_path / "args.json"
        f.write_text(json.dumps({"output_dir": "o", **args}))
        return build_job(None, [str(f)], model_preset="llama-3.2-1b")

    sft = job(packing=True)
    t = sft.job.train
    assert (t.precision, t.checkpointing, t.seq_len) == ("bf16-mixed", "full", 1024)
    assert any("a TRL SFTConfig" in w for w in sft.files[0].warnings)
    t = job(dataset_text_field="text", gradient_checkpointing=False, fp16=True, max_length=512).job.train
    assert (t.precision, t.checkpointing, t.seq_len) == ("fp16-mixed", "none", 512)
    plain = job(per_device_train_batch_size=2).job.train
    assert (plain.precision, plain.checkpointing) == ("fp32", "none")
    # Padding-free batches (TRL's collator: padding_free, or packing with a 'bfd' strategy) vs 'wrapped' packing's
    # full rows vs the Trainer's padded batches.
    assert job(padding_free=True).job.train.padding == "flattened"
    assert job(packing=True, packing_strategy="wrapped").job.train.padding == "none"
    assert plain.padding == "stack"


def test_trl_padding_free_rows_by_release(tmp_path):
    # trl/trainer/sft_trainer.py: padding-free when `packing_strategy == "ffd"` (v0.19, its default), `== "bfd"`
    # (v0.20-v0.29), `in {"bfd", "bfd_split"}` (v1.0 on, where "bfd-requeue" is renamed "bfd_split"); before v0.19
    # packing cut full rows. compute_loss passes use_cache=False from v0.22 only: without checkpointing an older
    # trl leaves the model a cache, and transformers then builds no packed-sequence mask.
    def imported(**args):
        f = tmp_path / "args.json"
        f.write_text(json.dumps({"output_dir": "o", **args}))
        built = build_job(None, [str(f)], model_preset="llama-3.2-1b")
        return built.job.train.padding, " ".join(built.files[0].warnings)

    padding, warned = imported(packing=True, packing_strategy="ffd")
    assert padding == "flattened" and "trl 0.18 and older" not in warned
    padding, warned = imported(packing=True)
    assert padding == "flattened" and "trl 0.18 and older pack full rows" in warned
    padding, warned = imported(packing=True, packing_strategy="bfd-requeue")
    assert padding == "flattened" and "trl 0.29 pads its packed rows" in warned
    padding, warned = imported(padding_free=True, gradient_checkpointing=False)
    assert padding == "flattened" and "use_cache=False" in warned
    padding, warned = imported(padding_free=True)
    assert padding == "flattened" and "use_cache=False" not in warned
    padding, warned = imported(packing=True, packing_strategy="wrapped", gradient_checkpointing=False)
    assert padding == "none" and "use_cache=False" not in warned


def test_training_arguments_precision_overrides_accelerates(tmp_path):
    # transformers training_args.py __post_init__: mixed_precision is read from ACCELERATE_MIXED_PRECISION (what
    # accelerate launch exports from its config) and then replaced by fp16 / bf16 when either is set. So the two
    # files do not disagree: TrainingArguments' bf16 wins, whichever is given first; a silent one leaves accelerate's.
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 2\n")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2, "bf16": True}))
    for order in ([str(acc), str(args)], [str(args), str(acc)]):
        assert build_job(None, order, model_preset="llama-3.2-1b").job.train.precision == "bf16-mixed"
    args.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2}))
    assert build_job(None, [str(args), str(acc)], model_preset="llama-3.2-1b").job.train.precision == "fp16-mixed"
