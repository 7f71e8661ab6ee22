"""The dependency resolver on recorded pod fingerprints (tests/fingerprints/, parsed by the real probe parser)."""

from pathlib import Path

import pytest

from envsetup.cli import requirements
from envsetup.resolve import resolve
from pods.probe import parse_probe
from pods.profiles import detect

FINGERPRINTS = Path(__file__).parent / "fingerprints"


def load(name):
    return parse_probe((FINGERPRINTS / f"{name}.txt").read_text())


def test_runpod_a100_gets_the_matching_prebuilt_flash_attn_wheel():
    fp = load("runpod-a100")
    assert detect(fp).name == "runpod" and fp.gpus[0].sm == 80 and fp.torch.cxx11_abi is False
    plan = resolve(fp, requirements())
    assert plan.dep("torch").action == "reuse" and plan.constraints == ["torch==2.4.1+cu124"]
    fa = plan.dep("flash-attn")
    assert fa.action == "pip"
    assert fa.requirement.endswith("/v2.8.3/flash_attn-2.8.3+cu12torch2.4cxx11abiFALSE-cp311-cp311-linux_x86_64.whl")
    assert plan.dep("bitsandbytes").requirement == "bitsandbytes==0.50.2"
    assert plan.attention == "flash-attn" and not plan.warnings


def test_rtx4090_with_cuda11_torch_falls_back_to_sdpa_with_the_reason():
    plan = resolve(load("runpod-rtx4090"), requirements())
    assert plan.dep("bitsandbytes").requirement == "bitsandbytes==0.45.5"  # torch 2.1: the last release for it
    assert plan.dep("flash-attn").action == "skip"
    assert plan.attention == "sdpa" and "CUDA 12" in plan.attention_reason


def test_sagemaker_g5_torch22_uses_the_conda_env_and_an_older_wheel():
    fp = load("sagemaker-g5-torch22")
    profile = detect(fp)
    assert profile.name == "sagemaker"
    assert "activate /home/ec2-user/anaconda3/envs/pytorch_p310" in profile.prelude
    assert profile.remote_dir("proj", fp.home) == "/home/ec2-user/SageMaker/proj"
    plan = resolve(fp, requirements())
    assert plan.dep("bitsandbytes").requirement == "bitsandbytes==0.47.0"
    assert "v2.7.4.post1/flash_attn-2.7.4.post1+cu12torch2.2cxx11abiFALSE-cp310-cp310" in plan.dep("flash-attn").requirement


def test_t4_is_sm75_so_no_flash_attn():
    plan = resolve(load("t4"), requirements())
    assert plan.dep("flash-attn").action == "skip" and "sm_75" in plan.attention_reason
    assert plan.dep("bitsandbytes").action == "pip"  # 8-bit optimizers run on Turing


def test_rtx5090_with_old_torch_is_warned_and_gets_no_gpu_kernels_installed():
    fp = load("rtx5090-old-torch")
    assert fp.torch.supports(120) is False and fp.torch.supports(86) is True
    plan = resolve(fp, requirements())
    assert any("sm_120" in w and "torch>=2.7" in w for w in plan.warnings)
    assert plan.dep("flash-attn").action == "skip" and "sm_120" in plan.attention_reason


def test_build_path_sizes_jobs_from_free_ram_and_targets_the_detected_arch():
    fp = load("runpod-a100")
    fp.torch = type(fp.torch)("2.9.0+cu128", "12.8", "", ("sm_80", "sm_90", "sm_100", "sm_120"), True)
    fp.nvcc_version, fp.ram_available_mib, fp.cpus = "12.8", 40 * 1024, 32
    fa = resolve(fp, requirements()).dep("flash-attn")
    env = dict(fa.build_env)
    assert fa.action == "build" and env["MAX_JOBS"] == "5" and env["FLASH_ATTN_CUDA_ARCHS"] == "80"
    fp.ram_available_mib = 4 * 1024  # too little RAM to build at all
    assert resolve(fp, requirements()).dep("flash-attn").action == "skip"
    fp.nvcc_version = None
    assert "no nvcc" in resolve(fp, requirements()).dep("flash-attn").reason


def test_cpu_machine_without_torch_gets_the_pinned_cpu_build():
    fp = load("t4")
    fp.gpus, fp.torch = [], None
    plan = resolve(fp, requirements())
    assert plan.dep("torch").action == "pip" and plan.dep("torch").requirement == "torch==2.13.0"
    assert plan.dep("bitsandbytes").action == "skip"


def test_gpu_pod_without_torch_never_installs_torch():
    fp = load("runpod-a100")
    fp.torch = None
    plan = resolve(fp, requirements())
    assert plan.dep("torch").action == "skip" and "never installs CUDA torch" in plan.dep("torch").reason


@pytest.mark.parametrize("name", ["runpod-a100", "t4"])
def test_step_keys_change_exactly_when_their_inputs_do(name):
    fp = load(name)
    key = resolve(fp, requirements()).dep("bitsandbytes").key(fp)
    assert resolve(fp, requirements()).dep("bitsandbytes").key(fp) == key
    fp.torch = type(fp.torch)("2.6.0+cu124", fp.torch.cuda, fp.torch.path, fp.torch.arch_list, fp.torch.cxx11_abi)
    assert resolve(fp, requirements()).dep("bitsandbytes").key(fp) != key
