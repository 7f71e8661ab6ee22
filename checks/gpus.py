"""GPU catalog: what the memory model, the checks and the MFU figure need to know about a card.

memory_mib is the card's total as nvidia-smi reports it (memory.total), the number a user sees;
TFLOP/s are NVIDIA's dense (no 2:4 sparsity) tensor-core peaks with fp32 accumulate, from the
architecture whitepapers and datasheets; bandwidth in GB/s from the same datasheets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from podkit.checks.errors import ConfigError, closest

MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_mib: int
    compute_capability: tuple[int, int]
    bf16_tflops: float  # 0 where the card has no bf16 tensor cores
    fp16_tflops: float
    bandwidth_gbs: float

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def sm(self) -> int:
        """Compute capability as torch's arch list spells it: (8, 6) -> 86."""
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    @property
    def supports_bf16(self) -> bool:
        # bf16 tensor cores and bf16 CUDA kernels start with Ampere (sm80).
        return self.compute_capability >= (8, 0)

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for a compute dtype (TrainConfig.dtype: fp32 | fp16 | bf16): what MFU is measured against."""
        if dtype == "bf16":
            return self.bf16_tflops
        if dtype == "fp16":
            return self.fp16_tflops
        return self.fp16_tflops / 2 if self.supports_bf16 else self.fp16_tflops / 8  # tf32 / fp32


CATALOG: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in [
        GpuSpec("T4", 15360, (7, 5), 0, 65, 320),
        GpuSpec("V100", 16160, (7, 0), 0, 125, 900),
        GpuSpec("V100-32GB", 32768, (7, 0), 0, 125, 900),
        # AWS's A10 variant: same 24 GB at 600 GB/s, fewer tensor FLOPs than the A10.
        GpuSpec("A10G", 23028, (8, 6), 70, 70, 600),
        GpuSpec("A10", 23028, (8, 6), 125, 125, 600),
        GpuSpec("L4", 23034, (8, 9), 121, 121, 300),
        # GeForce cards: fp16/bf16 with fp32 accumulate runs at half the fp16-accumulate rate.
        GpuSpec("RTX3090", 24576, (8, 6), 71, 71, 936),
        GpuSpec("RTX4090", 24564, (8, 9), 165, 165, 1008),
        GpuSpec("RTX5090", 32607, (12, 0), 209, 209, 1792),
        GpuSpec("A5000", 24564, (8, 6), 111, 111, 768),
        GpuSpec("A6000", 49140, (8, 6), 155, 155, 768),
        # Workstation and data-center GA10x/AD10x cards run fp16/bf16 with fp32 accumulate at the full rate (the
        # halving above is GeForce's: NVIDIA GA102 whitepaper v2, RTX A6000 "Peak BF16 Tensor TFLOPS with FP32
        # Accumulate" 154.8, the A6000 entry). Their datasheets quote tensor TFLOPS with 2:4 sparsity, halved
        # here (Ampere, FP16) or quartered (Ada, FP8); each figure checks against SMs x boost clock x 1024
        # dense FP16 FLOP/clk/SM. Compute capability: NVIDIA's CUDA GPUs list (Ampere GA10x 8.6, Ada 8.9).
        # Workstation cards run with ECC off or on, and nvidia-smi shows less with it on (an RTX A6000 with ECC on:
        # 46068 MiB, thamada/gls gls/RTX_A6000_x9_smi.py); like the A6000's, their memory_mib is the ECC-off total.
        # A40: datasheet BF16 tensor 149.7 (299.4 sparse), 696 GB/s; memory.total 46068 MiB with its default
        # ECC on (thamada/nvidia-smi nvsim/A40x10_smi.py; compute capability 8.6 in A40x10_deviceQuery.py).
        GpuSpec("A40", 46068, (8, 6), 149.7, 149.7, 696),
        # RTX A4000: datasheet tensor 153.4 sparse, 448 GB/s; 16376 MiB (geerlingguy/raspberry-pi-pcie-devices#791).
        GpuSpec("A4000", 16376, (8, 6), 76.7, 76.7, 448),
        # RTX A4500: 56 SMs (224 tensor cores) x 1650 MHz boost gives 94.6 dense (the datasheet's 189.2 is sparse),
        # 640 GB/s (320-bit GDDR6 at 16 Gbps); 20470 MiB, ECC off (an nvidia-smi line "NVIDIA RTX A4500,
        # 550.127.05, 20470 MiB" in a published diagnostic report).
        GpuSpec("A4500", 20470, (8, 6), 94.6, 94.6, 640),
        # RTX 6000 Ada: datasheet tensor 1457.0 (FP8, sparse; 142 SMs x 2505 MHz), 960 GB/s; 49140 MiB, ECC off
        # (thamada/nvidia-smi gls/RTX6000Ada_x8_smi.py; also ai-dynamo/dynamo deploy/dynamo_check.py's example).
        GpuSpec("RTX6000-Ada", 49140, (8, 9), 364.2, 364.2, 960),
        # RTX 4000 Ada: 48 SMs x 2175 MHz gives 106.9 dense (427.6 FP8 sparse; one transcription of the
        # datasheet reads 327.6), 360 GB/s; 20475 MiB, ECC off (thamada/nvidia-smi gls/RTX4000Ada_smi.py).
        GpuSpec("RTX4000-Ada", 20475, (8, 9), 106.9, 106.9, 360),
        # RTX 5000 Ada: 100 SMs (12,800 CUDA cores) x 2550 MHz gives 261.1 dense (the datasheet's 1,044.4 is FP8
        # sparse), 576 GB/s (256-bit GDDR6 at 18 Gbps); 32760 MiB, ECC off (nvidia-smi "NVIDIA RTX 5000 Ada
        # Generation, 560.28.03, 32760 MiB" in published cluster logs).
        GpuSpec("RTX5000-Ada", 32760, (8, 9), 261.1, 261.1, 576),
        # RTX 2000 Ada: datasheet tensor 191.9 (FP8, sparse; 22 SMs x 2130 MHz), 224 GB/s; 16380 MiB, ECC off
        # (thamada/nvidia-smi package/RTX200Ada_smi.py).
        GpuSpec("RTX2000-Ada", 16380, (8, 9), 48.0, 48.0, 224),
        GpuSpec("L40S", 46068, (8, 9), 362, 362, 864),
        # L40 (the L40S's AD102 board, 2490 MHz boost): NVIDIA's L40 datasheet gives BF16/FP16 tensor 181.05 dense
        # (362.1 sparse), half the L40S's 362.05, and 864 GB/s; memory.total 46068 MiB with its default ECC on
        # (nvidia-smi "NVIDIA L40, 595.91.07, 8.9, 46068 MiB"; 49140 MiB on a host that turned ECC off).
        GpuSpec("L40", 46068, (8, 9), 181.05, 181.05, 864),
        GpuSpec("A100-40GB", 40960, (8, 0), 312, 312, 1555),
        GpuSpec("A100-80GB", 81920, (8, 0), 312, 312, 2039),
        GpuSpec("H100-PCIe", 81559, (9, 0), 756, 756, 2000),
        GpuSpec("H100-SXM", 81559, (9, 0), 989, 989, 3350),
        # The H100 NVL is its own card, not an H100 PCIe: 94 GB HBM3 at 3.9 TB/s, BF16/FP16 tensor
        # 1,671 TFLOPS with sparsity (NVIDIA H100 datasheet, "H100 NVL" column), halved for dense;
        # nvidia-smi reports memory.total 95830 MiB.
        GpuSpec("H100-NVL", 95830, (9, 0), 835, 835, 3900),
        GpuSpec("H200", 143771, (9, 0), 989, 989, 4800),
        # H200 NVL (PCIe, NVLink bridge): the H200's 141 GB at 4.8 TB/s but BF16/FP16 tensor 1,671 TFLOPS
        # with sparsity, not the SXM's 1,979 (NVIDIA H200 datasheet, "H200 NVL" column); memory.total 143771 MiB.
        GpuSpec("H200-NVL", 143771, (9, 0), 835, 835, 4800),
        GpuSpec("B200", 183359, (10, 0), 2250, 2250, 8000),
    ]
}

# Names users type and names NVML reports ('NVIDIA A100-SXM4-40GB', 'NVIDIA GeForce RTX 4090'),
# matched on the lower-cased name with punctuation turned into spaces. First rule whose parts all occur wins,
# so the more specific rules come first (a10g before a10, l40s before l4).
_RULES: list[tuple[tuple[str, ...], str]] = [
    (("h100", "pcie"), "h100-pcie"),
    (("h100", "nvl"), "h100-nvl"),
    (("h100",), "h100-sxm"),
    (("h200", "nvl"), "h200-nvl"),
    (("h200",), "h200"),
    (("b200",), "b200"),
    (("a100", "40gb"), "a100-40gb"),
    (("a100",), "a100-80gb"),
    (("a10g",), "a10g"),
    (("a10",), "a10"),
    (("a6000",), "a6000"),
    (("a5000",), "a5000"),
    (("a4500",), "a4500"),
    (("a4000",), "a4000"),
    (("a40",), "a40"),
    # The RTX Ada workstation cards are 'RTX <n>000 Ada (Generation)'; a model number is a whole word, so
    # 'RTX A6000' is not '6000', and without 'ada' 'Quadro RTX 6000' (Turing, 24 GB) or 'RTX PRO 6000' match nothing.
    (("6000", "ada"), "rtx6000-ada"),
    (("5000", "ada"), "rtx5000-ada"),
    (("4000", "ada"), "rtx4000-ada"),
    (("2000", "ada"), "rtx2000-ada"),
    (("l40s",), "l40s"),
    (("l40",), "l40"),  # a whole word: 'l40s' is not 'l40'
    (("l4",), "l4"),
    (("t4",), "t4"),
    (("v100s",), "v100-32gb"),  # 'Tesla V100S-PCIE-32GB': the 32 GB V100 at a higher clock
    (("v100", "32gb"), "v100-32gb"),
    (("v100",), "v100"),
    (("3090",), "rtx3090"),
    (("4090",), "rtx4090"),
    (("5090",), "rtx5090"),
]


FAMILIES = ("H100", "A100", "RTX3090", "RTX4090", "RTX5090")
# Short names that stand for one card of several: --gpu's help says which.
SHORT_NAMES = ("H100", "A100", "V100")
# A stated size ('H100 96GB') must be the card's within this fraction, or the name is not that card.
_STATED_MEMORY_TOLERANCE = 0.10


def short_name_meanings() -> str:
    """'H100 = H100-SXM (80 GiB), ...': what each short name in SHORT_NAMES resolves to."""
    return ", ".join(f"{s} = {lookup(s).name} ({lookup(s).memory_mib / 1024:.0f} GiB)" for s in SHORT_NAMES)


def catalog_names() -> str:
    return ", ".join(g.name for g in CATALOG.values())


def _part_pattern(part: str) -> str:
    # A model number is a whole word: '6000' is not the tail of 'a6000' (the RTX 6000 Ada is not the RTX A6000).
    left = r"(?<![a-z])" if part[0].isalpha() else r"(?<![a-z0-9])"
    return left + re.escape(part) + r"(?![a-z0-9])"


def _words(key: str) -> str:
    """The name as space-separated lower-case words, with a size however it is written ('40G', '40 GiB',
    a bare '32' after the model) spelled '40gb', and a form factor run on to the model ('H100SXM') or a
    model number run on to 'RTX' ('RTX4090') split."""
    words = re.sub(r"[^a-z0-9]+", " ", key)
    words = re.sub(r"(\d)(sxm|pcie|nvl|hbm)", r"\1 \2", words)
    words = re.sub(r"(?<![a-z])rtx(?=\d)", "rtx ", words)
    return re.sub(r"(?<![a-z0-9])(\d{2,3}) ?(?:gb|gib|g)?(?![a-z0-9])", r"\1gb", words)


def lookup(name: str) -> GpuSpec:
    """Find a GPU by catalog name, a common spelling, or the name NVML reports."""
    key = name.strip().lower()
    if not key:
        raise ConfigError("cluster.gpu", "is empty", "give a catalog name: " + ", ".join(g.name for g in CATALOG.values()))
    if key in CATALOG:
        return CATALOG[key]
    words = _words(key)
    _check_one_card(name, words)
    for parts, target in _RULES:
        # A part is a whole word: 'a10' must match neither 'a1000' nor 'a10x', nor 'h200' the tail of 'gh200';
        # a card podkit does not know is refused, not predicted as its nearest name.
        if all(re.search(_part_pattern(part), words) for part in parts):
            spec = CATALOG[target]
            _check_stated_memory(name, words, spec)
            return spec
    names = [g.name for g in CATALOG.values()]
    # Family names too, so 'H1000' is close to 'H100' rather than to 'V100'.
    hint = closest(name, names + list(FAMILIES)) or "known: " + ", ".join(names)
    raise ConfigError("cluster.gpu", f"unknown GPU {name!r}", hint)


# Words that make a name another card than the catalog's of the same model number: the laptop parts
# have less memory (the RTX 4090 Laptop GPU 16 GB, NVIDIA's GeForce RTX 40 Series Laptop specifications).
_OTHER_CARD_WORDS = ("laptop", "mobile", "max q")
# The RTX 4000 SFF Ada (RunPod: 'NVIDIA RTX 4000 SFF Ada Generation') is a 70 W card with lower clocks than the
# RTX 4000 Ada (NVIDIA's RTX 4000 SFF Ada datasheet); it has no entry of its own, so it is refused, not predicted
# as the full-size card.
_SMALL_FORM_FACTOR_WORDS = ("sff",)


def _check_one_card(name: str, words: str) -> None:
    """A name is one card: a count ('8x H100': the count is [cluster] gpus_per_node), two model names ('A10G
    A100') or a laptop part is refused rather than read as whichever rule matches first."""
    if re.search(r"(?<![a-z0-9])(\d+ ?x|x ?\d+)(?![a-z0-9])", words):
        raise ConfigError("cluster.gpu", f"{name!r} is a count of cards, not one card",
                          "give the card alone (e.g. H100) and the count as [cluster] gpus_per_node")
    models = sorted({parts[0] for parts, _ in _RULES if re.search(_part_pattern(parts[0]), words)})
    if len(models) > 1:
        raise ConfigError("cluster.gpu", f"{name!r} names {len(models)} cards ({', '.join(models)})",
                          "give one: " + catalog_names())
    if any(re.search(rf"(?<![a-z]){w}(?![a-z])", words) for w in _OTHER_CARD_WORDS):
        raise ConfigError("cluster.gpu", f"{name!r} is a laptop part, not a catalog card", "known: " + catalog_names())
    if any(re.search(rf"(?<![a-z]){w}(?![a-z])", words) for w in _SMALL_FORM_FACTOR_WORDS):
        raise ConfigError("cluster.gpu", f"{name!r} is a small-form-factor card, not a catalog card",
                          "known: " + catalog_names())


def _check_stated_memory(name: str, words: str, spec: GpuSpec) -> None:
    """A name that states its memory ('H100 96GB', 'RTX 4090 48GB', 'A100 8GB') is refused when the matched
    card has another size: predicting for the catalog's card would mis-size it silently."""
    stated = re.search(r"(?<!\d)(\d{1,4}) ?gb\b", words)
    if not stated:
        return
    gb, card_gib = int(stated.group(1)), spec.memory_mib / 1024
    if abs(card_gib - gb) > _STATED_MEMORY_TOLERANCE * gb:
        raise ConfigError("cluster.gpu", f"{name!r} has {gb} GB, but the catalog's {spec.name} has {card_gib:.0f} GiB: "
                          "no catalog card of that size", "known: " + catalog_names())
