"""Every check, passing and failing. Host facts are plain data: the values NVML, the package
metadata and the environment give on the machines named in each test."""

import pytest

from podkit.checks import rules
from podkit.checks.advisor import advise
from podkit.checks.host import DetectedGpu, HostFacts
from podkit.checks.memory import estimate

OK_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TOKENIZERS_PARALLELISM": "false"}
ALL_PACKAGES = {"torch": "2.5.1", "bitsandbytes": "0.45.0", "flash-attn": "2.7.4", "nvidia-ml-py": "12.560"}
H100 = DetectedGpu("NVIDIA H100 80GB HBM3", 85_520_809_984, (9, 0))
RTX5090 = DetectedGpu("NVIDIA GeForce RTX 5090", 34_190_917_632, (12, 0))
A10G = DetectedGpu("NVIDIA A10G", 24_146_608_128, (8, 6))


def facts(**kw):
    base = dict(env=OK_ENV, packages=ALL_PACKAGES)
    base.update(kw)
    return HostFacts(**base)


def test_memory_fit_pass_warn_fail(job):
    fits = job(model='preset = "gpt2-124m"', train="seq_len = 512", cluster="gpu = 'H100'")
    assert rules.memory_fit(fits, estimate(fits), []).status == "pass"
    big = job(model='preset = "llama-3.1-8b"', train="micro_batch = 4\nseq_len = 4096", cluster="gpu = 'A100-80GB'")
    result = rules.memory_fit(big, estimate(big), advise(big))
    assert result.status == "fail" and result.fix.startswith("e.g. ")
    # Find a micro-batch that lands between 90% and 100% of the card: the warning band.
    for b in range(1, 64):
        j = job(train=f"micro_batch = {b}\nseq_len = 1024\noptimizer = 'adamw8bit'", cluster="gpu = 'A100-40GB'")
        est = estimate(j)
        if est.fits and est.headroom < 0.10:
            assert rules.memory_fit(j, est, []).status == "warn"
            break
    else:
        pytest.fail("no micro-batch landed in the 10% headroom band")


def test_host_ram(job):
    none = job()
    assert rules.host_ram(none, estimate(none)).status == "skip"
    small = job(model='preset = "llama-3.1-8b"', cluster="gpu = 'A100-80GB'\noffload = 'optimizer'\nhost_ram_gb = 64")
    assert rules.host_ram(small, estimate(small)).status == "fail"  # needs ~16 B/param = 128 GB
    big = job(model='preset = "llama-3.1-8b"', cluster="gpu = 'A100-80GB'\noffload = 'optimizer'\nhost_ram_gb = 512")
    assert rules.host_ram(big, estimate(big)).status == "pass"
    unknown = job(model='preset = "llama-3.1-8b"', cluster="gpu = 'A100-80GB'\noffload = 'optimizer'")
    assert rules.host_ram(unknown, estimate(unknown)).status == "warn"


def test_effective_batch(job):
    assert rules.effective_batch(job(train="micro_batch = 2\ngrad_accum = 4\nglobal_batch = 64",
                                     cluster="gpus_per_node = 8")).status == "pass"
    bad = rules.effective_batch(job(train="micro_batch = 2\ngrad_accum = 4\nglobal_batch = 128",
                                    cluster="gpus_per_node = 8"))
    assert bad.status == "fail" and bad.fix == "set grad_accum = 8"


def test_precision_vs_gpu(job):
    assert rules.precision_gpu(job(cluster="gpu = 'A10G'")).status == "pass"
    t4 = rules.precision_gpu(job(cluster="gpu = 'T4'"))
    assert t4.status == "fail" and "fp16-mixed" in t4.fix
    assert rules.precision_gpu(job(train="precision = 'fp16-mixed'", cluster="gpu = 'T4'")).status == "pass"
    assert rules.precision_gpu(job(train="precision = 'bf16'")).status == "warn"


def test_pure_fp16_runs_on_t4_and_v100_without_loss_scaling(job):
    # No sm80 needed: fp16 tensor cores are Volta's and Turing's (bf16's start with Ampere).
    for gpu in ("T4", "V100"):
        r = rules.precision_gpu(job(train="precision = 'fp16'\noptimizer = 'adamw8bit'", cluster=f"gpu = '{gpu}'"))
        assert r.status == "warn" and "bf16" not in r.message, r
        assert "no loss scaling" in r.message and "6e-8" in r.message and "65504" in r.message
        assert r.fix.startswith("prefer fp16-mixed (fp32 masters and a GradScaler)") and "bf16-mixed" not in r.fix
    # Where bf16 exists the fix says so.
    a100 = rules.precision_gpu(job(train="precision = 'fp16'\noptimizer = 'adamw8bit'", cluster="gpu = 'A100-80GB'"))
    assert "bf16-mixed on this sm80 GPU" in a100.fix
    # Pure bf16 on a T4 still fails, as before.
    assert rules.precision_gpu(job(train="precision = 'bf16'", cluster="gpu = 'T4'")).status == "fail"
    # fp16 LoRA with a GradScaler over the fp32 adapters (precision.loss_scaling passes it): not "no loss scaling".
    lora = job(train="stack = 'hf'\nprecision = 'fp16'\nlora_rank = 8\ngrad_scaler = 'on'", cluster="gpu = 'T4'")
    r = rules.precision_gpu(lora)
    assert lora.facts.grad_scaler and rules.loss_scaling(lora).status == "pass"
    assert r.status == "warn" and "no loss scaling" not in r.message and "adapters" in r.message, r
    # A stack that has no pure fp16 (torchtune's recipes, fsdp_qlora's --precision) says so.
    for stack in ("torchtune", "fsdp_qlora"):
        r = rules.precision_gpu(job(train=f"stack = '{stack}'\nprecision = 'fp16'\nlora_rank = 8"))
        assert r.status == "warn" and f"{stack} cannot train in fp16" in r.message, r


def test_pure_fp16_adamw_fails_as_torch_runs_it(job):
    """torch's AdamW keeps exp_avg_sq in the parameter's dtype: in fp16 (1 - beta2) g^2 of a small gradient is 0."""
    import torch

    for impl, first in (({"foreach": True}, float("-inf")), ({"foreach": False}, float("-inf")),
                        ({"fused": True}, None)):
        w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
        opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, **impl)
        w.grad = torch.full_like(w, 1e-4)
        opt.step()
        assert opt.state[w]["exp_avg_sq"].eq(0).all()  # 0.05 x 1e-8 is under fp16's smallest value
        if first is not None:
            assert w[0].item() == first  # m / (0 + eps), and eps = 1e-8 is 0 in fp16 as well
    # ... and the fused kernel, finite at the first step, divides by the last gradient alone from then on:
    # tests/test_smoke.py runs the tiny job in pure fp16 with bitsandbytes' AdamW instead.
    podkit = rules.precision_gpu(job(train="precision = 'fp16'", cluster="gpu = 'T4'"))
    assert podkit.status == "fail" and "AdamW (fused) keeps exp_avg_sq in fp16" in podkit.message
    assert podkit.fix.startswith("use optimizer = 'adamw8bit'") and "fp16-mixed" in podkit.fix
    litgpt = rules.precision_gpu(job(train="stack = 'litgpt'\nprecision = 'fp16'", cluster="gpu = 'T4'"))
    assert litgpt.status == "fail" and "(foreach)" in litgpt.message and "eps (1e-8) is 0" in litgpt.message
    # peft's fp32 adapters keep fp32 states: only the frozen base is fp16.
    hf_lora = rules.precision_gpu(job(train="stack = 'hf'\nprecision = 'fp16'\nlora_rank = 8", cluster="gpu = 'T4'"))
    assert hf_lora.status == "warn" and "no loss scaling" in hf_lora.message


def test_precision_the_stack_cannot_run(job):
    # torchtune's recipes train in cfg.dtype with no autocast and refuse fp16: bf16 or fp32 only.
    mixed = rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'bf16-mixed'"))
    assert mixed.status == "warn" and "torchtune cannot train in bf16-mixed" in mixed.message
    assert mixed.fix == "set precision = 'bf16'"
    assert rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'fp16-mixed'")).fix == "set precision = 'bf16'"
    # ... but never one the GPU cannot run: a T4 has no bf16, so torchtune's fp32.
    t4_mixed = rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'fp16-mixed'", cluster="gpu = 'T4'"))
    assert t4_mixed.fix == "set precision = 'fp32'"
    assert rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'fp32'")).status == "pass"
    # Its own pure bf16 is not told to use a mixed precision it does not have; nor, on a T4, fp16.
    pure = rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'bf16'"))
    assert pure.status == "warn" and "bf16-mixed" not in pure.fix and "fp32" in pure.fix
    t4 = rules.precision_gpu(job(train="stack = 'torchtune'\nprecision = 'bf16'", cluster="gpu = 'T4'"))
    assert t4.status == "fail" and "fp16" not in t4.fix and "'fp32'" in t4.fix
    # Every other stack runs every precision.
    assert rules.precision_gpu(job(train="stack = 'litgpt'\nprecision = 'bf16-mixed'")).status == "pass"


def test_loss_scaling(job):
    assert rules.loss_scaling(job(train="precision = 'fp16-mixed'")).status == "pass"
    assert rules.loss_scaling(job(train="precision = 'fp16-mixed'\ngrad_scaler = 'off'")).status == "fail"
    assert rules.loss_scaling(job(train="precision = 'bf16-mixed'\ngrad_scaler = 'on'")).status == "warn"
    pure = rules.loss_scaling(job(train="precision = 'fp16'"))
    assert pure.status == "pass" and "torch's GradScaler takes no fp16 gradients" in pure.message
    # torch/amp/grad_scaler.py refuses to unscale fp16 gradients; peft's fp32 adapters' gradients it takes.
    import torch

    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    w.grad = torch.ones_like(w)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.unscale_(torch.optim.SGD([w], lr=0.1))
    scaled = rules.loss_scaling(job(train="precision = 'fp16'\ngrad_scaler = 'on'"))
    assert scaled.status == "fail" and "Attempting to unscale FP16 gradients." in scaled.message
    lora = job(train="stack = 'hf'\nprecision = 'fp16'\nlora_rank = 8\ngrad_scaler = 'on'")
    assert rules.loss_scaling(lora).status == "pass"


def test_flash_attention(job):
    assert rules.flash_attention(job(train="attention = 'flash-attn'", cluster="gpu = 'H100'")).status == "pass"
    assert rules.flash_attention(job(train="attention = 'flash-attn'\nprecision = 'fp16-mixed'",
                                     cluster="gpu = 'T4'")).status == "fail"
    assert rules.flash_attention(job(train="attention = 'flash-attn'\nprecision = 'fp32'",
                                     cluster="gpu = 'H100'")).status == "fail"
    wide = job(model="hidden = 4096\nlayers = 2\nheads = 8\nffn = 11008\nvocab = 32000", train="attention = 'flash-attn'",
               cluster="gpu = 'H100'")
    assert wide.shape.d_head == 512 and rules.flash_attention(wide).status == "fail"
    assert rules.flash_attention(job(train="attention = 'eager'")).status == "warn"
    assert rules.flash_attention(job()).status == "pass"


def test_bnb_with_sharding_or_offload(job):
    assert rules.bnb_sharding(job()).status == "skip"
    assert rules.bnb_sharding(job(train="optimizer = 'adamw8bit'", cluster="gpus_per_node = 4\nsharding = 'zero1'")).status == "pass"
    assert rules.bnb_sharding(job(train="optimizer = 'adamw8bit'", cluster="gpus_per_node = 4\nsharding = 'zero3'")).status == "fail"
    assert rules.bnb_sharding(job(train="optimizer = 'paged_adamw8bit'", cluster="offload = 'optimizer'")).status == "fail"


def test_torchao_optimizers_shard_and_need_torchao(job):
    fsdp2 = "gpus_per_node = 4\nsharding = 'zero3'"
    for opt in ("torchao_adamw8bit", "torchao_adamw4bit"):
        j = job(train=f"optimizer = '{opt}'", cluster=fsdp2)
        # FSDP2's DTensor states (torchao/optim/adam.py _new_buffer): no bitsandbytes refusal.
        assert rules.bnb_sharding(j).status == "pass" and not j.facts.bnb_unsupported
        assert "torchao" in rules.required_packages(j) and "bitsandbytes" not in rules.required_packages(j)
        assert rules.dependencies(j, facts(gpus=[H100])).status == "fail"  # ALL_PACKAGES has no torchao
        assert rules.dependencies(j, facts(gpus=[H100], packages={**ALL_PACKAGES, "torchao": "0.18.0"})).status == "pass"
    assert job(train="optimizer = 'torchao_adamw4bit'").facts.torchao_block == 128  # AdamW4bit's default
    # FP8 states need sm89+ (torchao/optim/README.md); DeepSpeed's flat partitions are warned about.
    assert rules.bnb_sharding(job(train="optimizer = 'torchao_adamw_fp8'", cluster="gpu = 'A100-80GB'")).status == "fail"
    assert rules.bnb_sharding(job(train="optimizer = 'torchao_adamw_fp8'", cluster="gpu = 'H100'")).status == "pass"
    assert rules.bnb_sharding(job(train="optimizer = 'torchao_adamw8bit'\nstack = 'deepspeed'",
                                  cluster="gpus_per_node = 4\nsharding = 'zero2'")).status == "warn"


def test_optimizer_block_is_torchaos_alone(job):
    from podkit.checks.errors import ConfigError

    with pytest.raises(ConfigError, match="not a torchao optimizer"):
        job(train="optimizer = 'adamw8bit'\noptimizer_block = 128")


def test_sharding_with_one_gpu(job):
    assert rules.sharding_world(job(cluster="sharding = 'zero3'")).status == "warn"
    assert rules.sharding_world(job(cluster="sharding = 'zero3'\ngpus_per_node = 2")).status == "pass"


@pytest.mark.parametrize("env,expected", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "pass"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}, "pass"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True"}, "pass"),
    ({}, "warn"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "warn"),  # parses, but no expandable segments
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "backend:native"}, "warn"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segment:True"}, "fail"),  # typo: torch raises at first alloc
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"}, "fail"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:1.5"}, "fail"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments"}, "fail"),
])
def test_alloc_conf(env, expected):
    assert rules.alloc_conf(facts(env=env)).status == expected


def test_tokenizers_parallelism(job):
    workers = job(train="data_workers = 4")
    assert rules.tokenizers(job(), facts(env={})).status == "skip"
    assert rules.tokenizers(workers, facts(env={})).status == "warn"
    assert rules.tokenizers(workers, facts()).status == "pass"


def test_dependencies(job):
    qlora = job(train="lora_rank = 16\nbase_quant = 'nf4'")
    assert rules.dependencies(qlora, facts()).status == "pass"
    no_bnb = {**ALL_PACKAGES, "bitsandbytes": None}
    assert rules.dependencies(qlora, facts(packages=no_bnb)).status == "warn"  # a laptop: fine
    on_pod = rules.dependencies(qlora, facts(packages=no_bnb, gpus=[A10G]))
    assert on_pod.status == "fail" and "bitsandbytes" in on_pod.message
    assert rules.dependencies(job(), facts(packages={**ALL_PACKAGES, "bitsandbytes": None})).status == "pass"


def test_gpu_arch():
    assert rules.gpu_arch(facts()).status == "skip"
    cu124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert rules.gpu_arch(facts(gpus=[H100], torch_archs=cu124)).status == "pass"
    # sm_89 (L4, RTX 4090) runs sm_86 cubins: same major, lower minor.
    ada = DetectedGpu("NVIDIA L4", 24_000_000_000, (8, 9))
    assert rules.gpu_arch(facts(gpus=[ada], torch_archs=["sm_80", "sm_86"])).status == "pass"
    trap = rules.gpu_arch(facts(gpus=[RTX5090], torch_archs=cu124))
    assert trap.status == "fail" and "cu128" in trap.fix  # the RTX 5090 sm_120 trap
    assert rules.gpu_arch(facts(gpus=[RTX5090], torch_archs=cu124 + ["sm_100", "sm_120"])).status == "pass"
    assert rules.gpu_arch(facts(gpus=[RTX5090], torch_archs=cu124 + ["compute_90"])).status == "warn"
    # Arch-specific entries as torch's CUDA 12 builds list them: read, never a crash (ValueError before).
    assert rules.gpu_arch(facts(gpus=[H100], torch_archs=["sm_80", "sm_90a", "compute_90a"])).status == "pass"
    assert rules.gpu_arch(facts(gpus=[RTX5090], torch_archs=["sm_80", "sm_90a", "compute_90a"])).status == "fail"


def test_gpu_driver():
    assert rules.gpu_driver(facts()).status == "skip"
    assert rules.gpu_driver(facts(gpus=[H100], driver_cuda=(12, 8), torch_cuda=(12, 4))).status == "pass"
    assert rules.gpu_driver(facts(gpus=[H100], driver_cuda=(12, 2), torch_cuda=(12, 8))).status == "warn"
    old = rules.gpu_driver(facts(gpus=[H100], driver_cuda=(11, 8), torch_cuda=(12, 1)))
    assert old.status == "fail" and "driver" in old.fix


def test_disk_space(job):
    j = job(model='preset = "llama-3.1-8b"')
    need = rules.checkpoint_bytes(j)
    assert need == 8_030_261_248 * (2 + 8)  # bf16 weights + fp32 Adam m, v
    assert rules.disk_space(j, facts(disk_free=3 * need)).status == "pass"
    assert rules.disk_space(j, facts(disk_free=need + 1)).status == "warn"
    assert rules.disk_space(j, facts(disk_free=need - 1)).status == "fail"
    assert rules.disk_space(j, facts(disk_free=None)).status == "skip"


def test_dataset_path(job, tmp_path):
    assert rules.dataset(job()).status == "skip"
    assert rules.dataset(job(train=f"dataset = '{tmp_path / 'missing.bin'}'")).status == "fail"
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert rules.dataset(job(train=f"dataset = '{empty}'")).status == "fail"
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"\x01\x00" * 100)
    assert rules.dataset(job(train=f"dataset = '{data}'")).status == "pass"


MACHINE_CHECKS = ["env.alloc_conf", "env.tokenizers", "deps.installed", "deps.versions", "gpu.arch", "gpu.driver", "disk.free"]


def test_unprobed_machine_checks_skip_instead_of_judging_empty_facts(job):
    """--no-probe looked at nothing: 'missing here: torch' or 'not set' would be claims about this machine."""
    j = job(model='preset = "gpt2-124m"', train="data_workers = 2")
    results = {r.id: r for r in rules.run_checks(j, estimate(j), HostFacts.unprobed(), [])}
    assert all(results[i].status == "skip" and results[i].message == "not probed (--no-probe)" for i in MACHINE_CHECKS)
    # The job's own checks still run, and probed facts are still judged.
    assert results["memory.fit"].status == "pass"
    probed = {r.id: r for r in rules.run_checks(j, estimate(j), facts(packages={}), [])}
    assert probed["deps.installed"].status == "warn" and "missing here: torch" in probed["deps.installed"].message


def test_host_probe_reads_this_machine():
    probed = HostFacts.probe("runs")
    assert probed.packages["click"] and probed.disk_free and probed.disk_free > 0
    if not probed.gpus:  # a CPU machine: the reason is recorded, no arch list is read
        assert probed.nvml_status and probed.torch_archs == []


def test_preflight_reads_the_torchao_deploy_installs(job):
    """deps.installed asked for torchao in a package list that never read it: a torchao job was "missing
    torchao" on every pod, deploy's own preflight there included."""
    from importlib.metadata import version

    probed = HostFacts.probe("runs", gpu_probe=False)
    assert probed.packages["torchao"] == version("torchao")
    result = rules.dependencies(job(train="optimizer = 'torchao_adamw8bit'"), probed)
    assert f"torchao {version('torchao')}" in result.message and "missing here: torchao" not in result.message


def test_memory_fit_says_when_only_the_cache_is_over(job):
    """A job over the card on reserved whose live tensors fit: still a fail (the fit is judged on reserved),
    and the line says the tensors alone fit; one whose tensors are over too does not say so."""
    for seq in range(256, 16384, 128):  # LoRA on a 1B: about 0.75 GiB of tensors more per 128 tokens
        j = job(train=f"micro_batch = 2\nseq_len = {seq}\nprecision = 'bf16-mixed'\nlora_rank = 16", cluster="gpu = 'A10G'")
        est = estimate(j)
        if not est.fits:
            break
    else:
        pytest.fail("no sequence length went over the card")
    assert est.allocated + est.device_only <= est.capacity < est.total  # the first length over: only the cache is
    assert est.tensors_fit
    result = rules.memory_fit(j, est, [])
    assert result.status == "fail" and f"live tensors alone ({rules.gib(est.allocated + est.device_only)}) would fit" in result.message
    far = job(model='preset = "llama-3.1-8b"', train="micro_batch = 8\nseq_len = 4096", cluster="gpu = 'A10G'")
    est = estimate(far)
    assert not est.tensors_fit and "live tensors" not in rules.memory_fit(far, est, []).message


def test_quantized_experts_warns_when_bitsandbytes_skips_expert_banks(job):
    qlora = "stack = 'hf'\nlora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'\n"
    moe = 'preset = "mixtral-8x7b"'
    assert rules.quantized_experts(job(train=qlora)).status == "skip"  # a dense model
    assert rules.quantized_experts(job(model=moe, train="lora_rank = 16")).status == "skip"  # nothing quantized
    assert rules.quantized_experts(job(model=moe, train=qlora + "transformers = '4.57.1'")).status == "pass"
    result = rules.quantized_experts(job(model=moe, train=qlora + "transformers = '5.0.0'"))
    # Mixtral 8x7B: 32 layers x 8 experts x 3 x 4096 x 14336 = 45.1B expert weights, 84.0 GiB in bf16.
    assert result.status == "warn" and "84.0 GiB, 97% of the weights" in result.message
    assert "train.transformers = '4.57.1'" in result.fix
    # Under autocast TRL's prepare_model_for_kbit_training (before TRL 0.26) casts them to fp32: twice that.
    result = rules.quantized_experts(job(model=moe, train=qlora.replace("'bf16'", "'bf16-mixed'")
                                         + "transformers = '5.0.0'\ntrl = '0.25.1'"))
    assert "32-bit" in result.message and "168.0 GiB" in result.message
    # A stack with no transformers release to change (torchtitan's GroupedExperts are 3-D too).
    assert rules.quantized_experts(job(model=moe, train=qlora.replace("'hf'", "'torchtitan'"))).fix == \
        "expect them in 16 bits"


def test_versions_warns_where_this_machines_release_changes_the_prediction(job):
    moe_qlora = job(model='preset = "mixtral-8x7b"',
                    train="stack = 'hf'\nlora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'")
    # transformers unset = a current (5.x) release: 4.57.1 builds the experts as nn.Linear, which changes
    # the job's facts; the check says so and which key to set, and the prediction stays the job file's.
    result = rules.versions(moe_qlora, facts(packages={**ALL_PACKAGES, "transformers": "4.57.1"}))
    assert result.status == "warn" and "train.transformers is unset" in result.message
    assert "train.transformers = '4.57.1'" in result.fix
    # bitsandbytes 0.45.0 against 0.42.0 in the job: the 4-bit matmul's kept input (fixed in 0.43.2).
    old_bnb = job(train="lora_rank = 16\nbase_quant = 'nf4'\nbitsandbytes = '0.42.0'")
    result = rules.versions(old_bnb, facts())
    assert result.status == "warn" and "train.bitsandbytes is '0.42.0', this machine has 0.45.0" in result.message
    # The same release, or one that changes nothing this job reads (a dense full fine-tune does not
    # care which bitsandbytes or transformers is installed): pass.
    same = job(train="lora_rank = 16\nbase_quant = 'nf4'\nbitsandbytes = '0.45.0'")
    assert rules.versions(same, facts()).status == "pass"
    dense = job(train="stack = 'podkit'")
    assert rules.versions(dense, facts(packages={**ALL_PACKAGES, "transformers": "4.39.3"})).status == "pass"
    # A dev build is not a release podkit knows: nothing to compare.
    # (torch 2.13 as current as an unset torch: the Trainer's fused AdamW from 2.8 on, FSDP2's stream from 2.5.)
    current = {**ALL_PACKAGES, "torch": "2.13.0+cu128", "transformers": "5.1.0.dev0"}
    assert rules.versions(moe_qlora, facts(packages=current)).status == "pass"
    # ... and that torch 2.5.1 is not current for this job: the hf Trainer's AdamW is foreach before torch 2.8.
    assert "train.torch is unset" in rules.versions(moe_qlora, facts()).message


def test_context_length_is_checked_against_the_positions_the_model_has(job):
    """QA 2026-11-25: GPT-2 (1,024 learned positions) at seq_len 4,096 was 'ready', though its position
    embedding has no row past 1,023 (nn.Embedding raises IndexError there)."""
    check = lambda j: next(c for c in rules.run_checks(j, estimate(j), HostFacts.unprobed(), []) if c.id == "model.context")
    gpt2 = check(job(model='preset = "gpt2-124m"', train="seq_len = 4096"))
    assert gpt2.status == rules.FAIL and "1,024 learned positions" in gpt2.message and "seq_len <= 1,024" in gpt2.fix
    assert check(job(model='preset = "gpt2-124m"', train="seq_len = 1024")).status == rules.PASS
    # RoPE runs past max_position_embeddings (Mistral 7B v0.1's 32,768): a warning, not a failure.
    rope = check(job(model='preset = "mistral-7b"', train="seq_len = 65536"))
    assert rope.status == rules.WARN and "32,768" in rope.message
    assert check(job(model='preset = "mistral-7b"', train="seq_len = 32768")).status == rules.PASS


def test_a_gpt2_given_by_dimensions_has_learned_positions_too(job):
    """Review 2026-11-25: with arch = "gpt2" and explicit dimensions, max_position_embeddings was read as a RoPE
    limit (a warning), and the position table was not counted; it is GPT2Config's n_positions (default 1024)."""
    dims = 'hidden = 256\nlayers = 4\nheads = 4\nffn = 1024\nvocab = 1000\narch = "gpt2"'
    check = lambda j: next(c for c in rules.run_checks(j, estimate(j), HostFacts.unprobed(), []) if c.id == "model.context")
    given = job(model=dims + "\nmax_position_embeddings = 512", train="seq_len = 1024")
    assert check(given).status == rules.FAIL and "512 learned positions" in check(given).message
    default = job(model=dims, train="seq_len = 1024")
    assert default.shape.positions == 1024 and check(default).status == rules.PASS
    assert default.shape.params - job(model=dims + "\nmax_position_embeddings = 512").shape.params == 512 * 256


def test_lora_experts_says_what_peft_adapts_and_fails_on_dropout(job):
    mixtral, tf5 = 'preset = "mixtral-8x7b"', "stack = 'hf'\ntransformers = '5.0.0'\nlora_rank = 16\n"
    assert rules.lora_experts(job(train="lora_rank = 16")).status == "skip"  # a dense model
    # transformers 4.x: the experts are nn.Linear modules, adapted and priced as named.
    assert rules.lora_experts(job(model=mixtral, train=tf5.replace("5.0.0", "4.57.1")
                                  + "lora_targets = 'all-linear'")).status == "pass"
    result = rules.lora_experts(job(model=mixtral, train=tf5 + "lora_targets = 'all-linear'"))
    assert result.status == "pass" and "moves gate, w1, w3, w2 onto gate_up_proj, down_proj, the router" in \
        result.message
    # ParamWrapper raises for any lora_dropout.
    failed = rules.lora_experts(job(model=mixtral, train=tf5 + "lora_targets = 'all-linear'\nlora_dropout = 0.05"))
    assert failed.status == "fail" and "lora_dropout = 0.05" in failed.message
    # The stack's q_proj, v_proj and Qwen2-MoE (no conversion pattern in transformers 5.23): no bank adapted.
    assert "no routed-expert bank" in rules.lora_experts(job(model=mixtral, train=tf5)).message
    assert "no routed-expert bank" in rules.lora_experts(job(model='preset = "qwen1.5-moe-a2.7b"',
                                                             train=tf5 + "lora_targets = 'all-linear'")).message
