"""Facts about the machine preflight runs on, gathered without initialising CUDA.

Package versions come from installed metadata, torch's CUDA version from torch/version.py read
on its own (importing torch costs seconds), GPUs from NVML. torch itself is imported only on a
machine where NVML sees a GPU, to read the architectures the build ships kernels for.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from podkit.envsetup.fingerprint import Gpu

# Distribution name -> import name, for the packages a job may need.
PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
    "bitsandbytes": "bitsandbytes",
    "torchao": "torchao",
    "flash-attn": "flash_attn",
    "nvidia-ml-py": "pynvml",
    "click": "click",
    "rich": "rich",
}


# One model of a GPU for preflight and the pod probe (envsetup/fingerprint.py).
DetectedGpu = Gpu


@dataclass
class HostFacts:
    env: dict[str, str]
    packages: dict[str, str | None]  # distribution -> version, None when missing
    gpus: list[DetectedGpu] = field(default_factory=list)
    nvml_status: str = "not probed"  # why there is no GPU information, when there is none
    driver_cuda: tuple[int, int] | None = None  # highest CUDA version the driver supports
    torch_cuda: tuple[int, int] | None = None  # CUDA version torch was built with
    torch_archs: list[str] = field(default_factory=list)  # e.g. ["sm_80", "sm_90"]
    disk_free: int | None = None  # bytes free where runs are written
    disk_blocked: str = ""  # why runs cannot be written there at all (an ancestor is a file, read-only)
    cpu_count: int = 1
    probed: bool = True  # False: nothing was looked at (preflight --no-probe), so no machine check can judge

    @classmethod
    def unprobed(cls) -> "HostFacts":
        return cls(env={}, packages={}, probed=False)

    @classmethod
    def probe(cls, output_dir: str = "runs", gpu_probe: bool = True) -> "HostFacts":
        facts = cls(env=dict(os.environ), packages=_package_versions(), cpu_count=os.cpu_count() or 1)
        facts.torch_cuda = _torch_cuda_version()
        facts.disk_free = _free_disk(Path(output_dir))
        facts.disk_blocked = _blocked(Path(output_dir))
        if gpu_probe:
            _probe_nvml(facts)
            if facts.gpus and facts.packages.get("torch"):
                facts.torch_archs = _torch_archs()
        return facts


def _package_versions() -> dict[str, str | None]:
    import importlib.metadata  # here: it costs preflight ~30 ms of imports, and --no-probe never asks

    versions: dict[str, str | None] = {}
    for dist, module in PACKAGES.items():
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown" if importlib.util.find_spec(module) else None
    return versions


def _torch_cuda_version() -> tuple[int, int] | None:
    spec = importlib.util.find_spec("torch")
    if not spec or not spec.submodule_search_locations:
        return None
    version_file = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    scope: dict = {}
    try:
        exec(compile(version_file.read_text(), str(version_file), "exec"), scope)
    except (OSError, SyntaxError):
        return None
    return _major_minor(scope.get("cuda"))


def _major_minor(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def _blocked(path: Path) -> str:
    """Why no run directory can be made under path ('' when one can): the nearest existing ancestor
    is a file (output_dir = "/etc/passwd/runs") or not writable."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is a file"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return ""


def _free_disk(path: Path) -> int | None:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _probe_nvml(facts: HostFacts) -> None:
    try:
        import pynvml
    except ImportError:
        facts.nvml_status = "nvidia-ml-py is not installed"
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        facts.nvml_status = f"no NVIDIA driver ({exc})"
        return
    try:
        version = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
        facts.driver_cuda = (version // 1000, (version % 1000) // 10)
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            cc = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            facts.gpus.append(DetectedGpu(name, memory, tuple(cc)))
        facts.nvml_status = f"{len(facts.gpus)} GPU(s)"
    except pynvml.NVMLError as exc:
        facts.nvml_status = f"NVML error: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _torch_archs() -> list[str]:
    # get_arch_list reads the build's compiled arch flags; it does not create a CUDA context.
    import torch

    return list(torch.cuda.get_arch_list())
