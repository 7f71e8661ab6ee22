import json
import subprocess
from pathlib import Path

import pytest

from podkit.checks.errors import ConfigError
from podkit.checks.gpus import CATALOG, lookup

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = ["T4", "V100", "A10G", "L4", "RTX3090", "RTX4090", "RTX5090", "A5000", "A6000", "L40S",
            "A100-40GB", "A100-80GB", "H100-PCIe", "H100-SXM", "H200", "B200"]


@pytest.mark.parametrize("name", REQUIRED)
def test_required_gpus_are_catalogued(name):
    gpu = lookup(name)
    assert gpu.memory_mib > 10_000 and gpu.fp16_tflops > 0 and gpu.bandwidth_gbs > 0
    assert gpu.supports_bf16 == (gpu.compute_capability >= (8, 0))
    assert (gpu.bf16_tflops > 0) == gpu.supports_bf16


@pytest.mark.parametrize("nvml_name,expected", [
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 NVL", "H100-NVL"),
    ("H100 NVL", "H100-NVL"),
    ("NVIDIA H200 NVL", "H200-NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("NVIDIA GeForce RTX 5090", "RTX5090"),
    ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("Tesla V100S-PCIE-32GB", "V100-32GB"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA RTX A6000", "A6000"),
])
def test_nvml_names_resolve(nvml_name, expected):
    assert lookup(nvml_name).name == expected


def test_rtx5090_is_blackwell_sm120():
    assert lookup("RTX5090").sm == 120


def test_unknown_gpu_is_refused_not_guessed():
    with pytest.raises(ConfigError, match="unknown GPU 'A1000'"):
        lookup("A1000")  # must not silently become an A10
    with pytest.raises(ConfigError, match="did you mean 'H200'"):
        lookup("H20O")


def test_catalog_names_are_unique_keys():
    assert all(key == gpu.name.lower() for key, gpu in CATALOG.items())


def test_h100_nvl_is_its_own_94gb_card():
    """The review found 'H100 NVL' predicted as an 80 GB H100 PCIe. NVIDIA's H100 datasheet: 94 GB
    HBM3, 3.9 TB/s, 1,671 BF16 TFLOPS with sparsity (835 dense), Hopper sm90."""
    nvl, pcie = lookup("H100 NVL"), lookup("H100 PCIe")
    assert nvl.memory_mib == 95830 and nvl.memory_mib > pcie.memory_mib
    assert nvl.sm == 90 and nvl.bf16_tflops == 835 and nvl.bandwidth_gbs == 3900
    assert lookup("H200 NVL").bf16_tflops < lookup("H200").bf16_tflops  # the NVL runs at a lower power limit


@pytest.mark.parametrize("name", ["H100 96GB", "H100 94GB", "H100 80GB NVL", "RTX 4090 48GB",
                                  "A100 32GB", "A100 8GB", "A100 0GB", "H100 1000GB"])
def test_a_stated_size_the_matched_card_lacks_is_refused(name):
    with pytest.raises(ConfigError, match="no catalog card of that size"):
        lookup(name)


@pytest.mark.parametrize("name, problem", [
    # QA 2026-11-25: each was predicted for one card without a word (the count dropped, the first rule's model)
    ("8x H100", "is a count of cards"), ("2x A100-80GB", "is a count of cards"), ("H100 x8", "is a count of cards"),
    ("A10G A100", "names 2 cards"), ("H100 or A100", "names 2 cards"), ("H100\nA100", "names 2 cards"),
    ("RTX 4090 Laptop", "is a laptop part"), ("RTX 4090 Mobile", "is a laptop part"),
])
def test_a_name_that_is_not_one_catalog_card_is_refused(name, problem):
    with pytest.raises(ConfigError, match=problem):
        lookup(name)


@pytest.mark.parametrize("name, card", [  # what NVML and RunPod call the cards: still one card each
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("Tesla V100-SXM2-16GB", "V100"), ("NVIDIA GeForce RTX 3090 Ti", "RTX3090"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("Tesla V100S-PCIE-32GB", "V100-32GB")])
def test_vendor_names_with_sizes_and_form_factors_are_one_card(name, card):
    assert lookup(name).name == card


def test_short_names_say_which_card_they_mean():
    from podkit.checks.gpus import short_name_meanings

    assert "H100 = H100-SXM (80 GiB)" in short_name_meanings() and "A100 = A100-80GB" in short_name_meanings()


@pytest.mark.parametrize("name,expected", [
    ("A100 40G", "A100-40GB"), ("A100-40G", "A100-40GB"), ("A100 40 GiB", "A100-40GB"),
    ("V100-32G", "V100-32GB"), ("V100 32", "V100-32GB"), ("H100SXM", "H100-SXM")])
def test_a_size_written_without_gb_picks_that_card(name, expected):
    """'A100 40G' used to skip the 40 GB rule and the stated-size check both, and predict for the 80 GB card:
    a false "fits"."""
    assert lookup(name).name == expected


@pytest.mark.parametrize("name,hint", [("A10X", "A10"), ("H100X", "H100"), ("T4X", "T4")])
def test_a_model_name_with_letters_run_on_is_refused(name, hint):
    with pytest.raises(ConfigError, match=f"unknown GPU '{name}' \\(did you mean '{hint}'"):
        lookup(name)


# Cards RunPod rents (docs.runpod.io/references/gpu-types: its GPU ID is the name NVML reports, beside a
# display name): each resolves from what a user types, the NVML name / RunPod id and RunPod's display name.
RUNPOD_CARDS = [
    ("A40", "NVIDIA A40", "A40", ["a40", "A40 48GB"], 86),
    ("A4000", "NVIDIA RTX A4000", "RTX A4000", ["A4000", "rtx a4000", "RTX A4000 16GB"], 86),
    ("RTX6000-Ada", "NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", ["RTX6000 Ada", "RTX 6000 Ada 48GB", "rtx6000-ada"], 89),
    ("RTX4000-Ada", "NVIDIA RTX 4000 Ada Generation", "RTX 4000 Ada", ["RTX4000 Ada", "RTX 4000 Ada 20GB"], 89),
    ("RTX2000-Ada", "NVIDIA RTX 2000 Ada Generation", "RTX 2000 Ada", ["RTX 2000 Ada 16GB"], 89),
    ("A4500", "NVIDIA RTX A4500", "RTX A4500", ["A4500", "rtx a4500", "RTX A4500 20GB"], 86),
    ("RTX5000-Ada", "NVIDIA RTX 5000 Ada Generation", "RTX 5000 Ada", ["RTX5000 Ada", "RTX 5000 Ada 32GB"], 89),
    ("L40", "NVIDIA L40", "L40", ["l40", "L40 48GB"], 89),
]


@pytest.mark.parametrize("card, runpod_id, display, typed, sm", RUNPOD_CARDS)
def test_runpod_cards_resolve_from_every_name(card, runpod_id, display, typed, sm):
    for name in [card, runpod_id, display, *typed]:
        assert lookup(name).name == card, name
    gpu = lookup(card)
    assert gpu.sm == sm and gpu.supports_bf16 and gpu.bf16_tflops == gpu.fp16_tflops > 0
    # the stated sizes above ('48GB', '16GB') passed the size check against the nvidia-smi total
    assert gpu.memory_mib > 15_000 and gpu.bandwidth_gbs > 0


@pytest.mark.parametrize("name, card", [
    # a model number is a whole word: the Ampere 'RTX A<n>000' is not the Ada 'RTX <n>000 Ada'
    ("NVIDIA RTX A6000", "A6000"), ("RTX A6000", "A6000"), ("A6000", "A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX6000-Ada"),
    ("NVIDIA RTX A4000", "A4000"), ("NVIDIA RTX 4000 Ada Generation", "RTX4000-Ada"),
    ("NVIDIA A40", "A40"), ("NVIDIA A10", "A10"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"), ("NVIDIA L4", "L4"),
    ("NVIDIA RTX A4500", "A4500"), ("NVIDIA RTX A5000", "A5000"), ("NVIDIA RTX 5000 Ada Generation", "RTX5000-Ada"),
    ("RTX4090 24GB", "RTX4090"),  # 'RTX' run on to the number still names the card
])
def test_near_miss_names_are_each_their_own_card(name, card):
    assert lookup(name).name == card


@pytest.mark.parametrize("name, problem", [
    ("Quadro RTX 6000", "unknown GPU"),  # Turing, 24 GB: not the 48 GB RTX 6000 Ada
    ("Quadro RTX 5000", "unknown GPU"),  # Turing, 16 GB: not the 32 GB RTX 5000 Ada
    ("NVIDIA RTX A4500 Laptop GPU", "laptop part"),  # 16 GB GA104, not the 20 GB desktop card
    ("RTX 6000", "unknown GPU"),  # Quadro RTX 6000, RTX 6000 Ada or RTX PRO 6000: no card picked for the user
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "unknown GPU"),
    ("NVIDIA RTX A2000", "unknown GPU"),  # 6 GB Ampere, not the RTX 2000 Ada
    ("NVIDIA RTX 4000 SFF Ada Generation", "small-form-factor"),  # RunPod's id; display name below
    ("RTX 4000 Ada SFF", "small-form-factor"),
    ("AMD Instinct MI300X OAM", "unknown GPU"),  # podkit is CUDA-only
    ("RTX 6000 Ada 24GB", "no catalog card of that size"),
])
def test_cards_that_look_like_catalog_cards_are_refused(name, problem):
    with pytest.raises(ConfigError, match=problem):
        lookup(name)


def test_preflight_predicts_for_an_a40():
    """`bin/preflight --gpu A40` predicts for the card: 46068 MiB is 45.0 GiB."""
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--gpu", "A40", "--no-probe"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "of 45.0 GiB on A40" in out.stdout
    data = json.loads(subprocess.run([str(ROOT / "bin" / "preflight"), "--gpu", "NVIDIA A40", "--no-probe", "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    assert data["memory"]["gpu_capacity"] == 46068 * 2**20
