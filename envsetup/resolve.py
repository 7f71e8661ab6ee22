"""Which dependency build a pod gets, decided from its fingerprint alone (pure; tested on recorded pods).

Rules, in short:
- torch: the image's build is reused, never reinstalled (a constraint pins it for every pip
  call). A CPU machine without torch gets the pinned CPU build, like `make setup`.
- bitsandbytes: through pip with torch constrained to the pod's build, so pip picks the newest
  release whose own Requires-Dist admits that torch (no release table to go stale).
- torchao: declares no torch requirement, so pip cannot choose: the release whose own torchao/__init__.py
  loads its C++ extensions with the pod's torch (TORCHAO_FOR_TORCH), pinned; none for a torch no release
  is built for (older than 2.8), with the reason.
- flash-attn: only on sm80+ GPUs that the image's torch has kernels for. A prebuilt wheel named
  as flash-attn's setup.py names them (envsetup/wheels.py) for the newest releases on the index,
  chosen only once it is seen to exist; else a ninja build with MAX_JOBS from free RAM and
  FLASH_ATTN_CUDA_ARCHS for this GPU; else SDPA, with the reason.

Pure given a `WheelSource` (the tests point one at a server on 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from podkit.envsetup.arch import version_tuple as _version_tuple
from podkit.envsetup.wheels import WheelSource, flash_attn_wheel_name
from podkit.envsetup.fingerprint import Fingerprint

TORCH_CPU = "torch==2.13.0"  # the same pin as the Makefile's TORCH_CPU
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# torchao's METADATA has no Requires-Dist on torch. Each release loads its C++ extensions only with the torch it
# names in its own torchao/__init__.py (else it warns and runs without them; a mismatched .so aborts the process,
# pytorch/ao#2919), read at each release's tag of github.com/pytorch/ao:
#   v0.13.0: built with torch 2.8.0, refuses 2.9+;
#   0.14.0 (its PyPI wheel's file is tag v0.14.0-rc3's): only 0.13.0 on 2.8.0, never itself, so 2.8.0 keeps 0.13.0;
#   v0.14.1: 2.9.0 and 2.10 nightlies;  v0.15.0: 2.9.1 and 2.10 nightlies;  v0.16.0: 2.10.0 and 2.11 nightlies;
#   v0.17.0, v0.18.0: any torch >= 2.11.0 (min_torch_version).
# Keys as torchao's _parse_version reads torch.__version__: (major, minor, patch), patch -1 for a dev/git build.
# Every release named is on PyPI (cp3x-abi3 x86_64 wheels, and a py3-none-any one for other machines).
# Here, not beside checks/stacks.py's TORCHAO_OPTIMIZERS: which build a machine's torch takes is a fact about the
# machine (envsetup), and envsetup runs on the standard library alone, before checks' imports exist.
TORCHAO_FOR_TORCH = {(2, 8, 0): "0.13.0", (2, 9, 0): "0.14.1", (2, 9, 1): "0.15.0", (2, 10, -1): "0.15.0",
                     (2, 10, 0): "0.16.0", (2, 11, -1): "0.16.0"}
TORCHAO_NEWEST, TORCHAO_NEWEST_TORCH = "0.18.0", (2, 11, 0)  # for every torch from 2.11.0 on

FLASH_ATTN_TRIED = 3  # newest releases checked for a wheel before building from source
BUILD_RAM_PER_JOB_MIB = 8 * 1024  # nvcc on flash-attn's kernels peaks at several GiB per job
BUILD_DISK_MIB = 10 * 1024


@dataclass(frozen=True)
class Dependency:
    name: str
    action: str  # reuse | pip | build | skip
    requirement: str = ""  # what pip installs: "pkg==ver" or a wheel URL
    pip_args: tuple[str, ...] = ()
    build_env: tuple[tuple[str, str], ...] = ()
    reason: str = ""

    def key(self, fp: Fingerprint) -> str:
        """Hash of everything that decides this install: re-run only when it changes."""
        torch = fp.torch
        inputs = {"dep": asdict(self), "python": fp.python_version, "torch": torch and torch.version,
                  "cuda": torch and torch.cuda, "abi": torch and torch.cxx11_abi,
                  "sm": sorted({g.sm for g in fp.gpus if g.sm})}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Plan:
    deps: list[Dependency]
    attention: str  # "flash-attn" | "sdpa"
    attention_reason: str
    constraints: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def dep(self, name: str) -> Dependency:
        return next(d for d in self.deps if d.name == name)


def resolve(fp: Fingerprint, requirements: list[str], wheels: WheelSource | None = None) -> Plan:
    wheels = wheels or WheelSource()
    warnings: list[str] = []
    torch = fp.torch
    sms = sorted({g.sm for g in fp.gpus if g.sm})
    py = _version_tuple(fp.python_version or "0.0")[:2]

    # torch
    if torch:
        where = "the project venv's build" if fp.torch_in_venv else "the image's build"
        deps = [Dependency("torch", "reuse", torch.version, reason=f"{where} (CUDA {torch.cuda or 'none'})")]
        constraints = [f"torch=={torch.version}"]
        if fp.gpus and not torch.cuda:
            warnings.append(f"torch {torch.version} is a CPU build on a GPU pod: use the image's CUDA torch")
    elif fp.gpus:
        deps = [Dependency("torch", "skip", reason="the image has no torch; use a PyTorch image "
                           "(podkit never installs CUDA torch over an image)")]
        constraints = []
    else:
        deps = [Dependency("torch", "pip", TORCH_CPU, ("--index-url", TORCH_CPU_INDEX), reason="CPU machine without torch")]
        constraints = [TORCH_CPU]
    unsupported = [sm for sm in sms if torch and torch.cuda and torch.supports(sm) is False]
    if unsupported:
        warnings.append(f"torch {torch.version} has no kernels for sm_{unsupported[0]} ({fp.gpus[0].name}): "
                        "use a newer torch built for it (sm_120 needs torch>=2.7 with CUDA 12.8)")

    # podkit's own runtime requirements (pure Python)
    deps.append(Dependency("requirements", "pip", ", ".join(requirements), reason="podkit runtime"))

    # bitsandbytes, torchao (the low-bit optimizers)
    deps.append(_bitsandbytes(fp, py))
    deps.append(_torchao(fp))

    # flash-attn
    fa = _flash_attn(fp, unsupported, wheels)
    deps.append(fa)
    attention = "flash-attn" if fa.action in ("pip", "build") else "sdpa"
    return Plan(deps, attention, fa.reason if attention == "sdpa" else f"flash-attn {fa.action}",
                constraints, warnings)


def _bitsandbytes(fp: Fingerprint, py: tuple[int, ...]) -> Dependency:
    torch = fp.torch
    if not torch:
        return Dependency("bitsandbytes", "skip", reason="no torch")
    cuda = _version_tuple(torch.cuda) if torch.cuda else None
    if cuda and cuda < (11, 8):
        return Dependency("bitsandbytes", "skip", reason=f"bitsandbytes ships kernels for CUDA 11.8+, torch has {torch.cuda}")
    tv = torch.major_minor
    return Dependency("bitsandbytes", "pip", "bitsandbytes",
                      reason=f"the newest release pip finds for torch {tv[0]}.{tv[1]} (pinned by constraint), "
                             f"Python {py[0]}.{py[1]}")


def torchao_release(torch_version: str) -> str | None:
    """The torchao release that loads its C++ extensions with this torch (TORCHAO_FOR_TORCH), or None."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version)
    if not m:
        return None
    major, minor, patch = map(int, m.groups())
    key = (major, minor, -1 if re.search(r"(git|dev)", torch_version) else patch)  # torchao's _parse_version
    return TORCHAO_NEWEST if key >= TORCHAO_NEWEST_TORCH else TORCHAO_FOR_TORCH.get(key)


def _torchao(fp: Fingerprint) -> Dependency:
    torch = fp.torch
    if not torch:
        return Dependency("torchao", "skip", reason="no torch")
    release = torchao_release(torch.version)
    if not release:
        return Dependency("torchao", "skip", reason=f"no torchao release is built for torch {torch.version} "
                                                    "(torchao pairs its releases with torch 2.8.0 and newer)")
    return Dependency("torchao", "pip", f"torchao=={release}",
                      reason=f"the release whose C++ extensions load on torch {torch.version} "
                             "(torchao declares no torch requirement)")


def _fa_arch(sm: int) -> str:
    return {8: "80", 9: "90", 10: "100", 12: "120"}.get(sm // 10, str(sm))


def _flash_attn(fp: Fingerprint, unsupported: list[int], wheels: WheelSource) -> Dependency:
    torch = fp.torch
    sms = sorted({g.sm for g in fp.gpus if g.sm})

    def skip(reason: str) -> Dependency:
        return Dependency("flash-attn", "skip", reason=reason)

    if not fp.gpus:
        return skip("no GPU on this machine")
    if not sms:
        return skip("GPU compute capability unknown (nvidia-smi too old)")
    if min(sms) < 80:
        low = next(g for g in fp.gpus if g.sm == min(sms))
        return skip(f"flash-attn 2 needs sm80+ (Ampere or newer); {low.name} is sm_{min(sms)}")
    if not torch or not torch.cuda:
        return skip("no CUDA torch")
    if unsupported:
        return skip(f"torch {torch.version} cannot run on sm_{unsupported[0]}")
    cuda = _version_tuple(torch.cuda)
    if max(sms) >= 100 and cuda < (12, 8):
        return skip(f"sm_{max(sms)} needs CUDA 12.8+, torch has {torch.cuda}")
    tv = torch.major_minor
    releases = wheels.versions("flash-attn")
    if torch.cxx11_abi is not None and fp.python_tag:
        for version in releases[:FLASH_ATTN_TRIED]:
            name = flash_attn_wheel_name(version, torch.cuda, torch.version, torch.cxx11_abi, fp.python_tag,
                                         fp.machine or "x86_64")
            url = wheels.flash_attn_url(version, name)
            if wheels.exists(url):
                return Dependency("flash-attn", "pip", url, ("--no-deps",),
                                  reason=f"prebuilt wheel {version} for torch {tv[0]}.{tv[1]}, cu{cuda[0]}, {fp.python_tag}")
    source = releases[0] if releases else None
    # No wheel: build, if this pod can.
    nvcc = _version_tuple(fp.nvcc_version or "")
    if not nvcc:
        return skip(f"no prebuilt wheel for torch {torch.version} and no nvcc to build one")
    if cuda < (12, 0):
        return skip(f"no prebuilt wheel for torch {torch.version}, and flash-attn {source or ''} builds need CUDA 12+ "
                    f"(torch has {torch.cuda}): use a CUDA 12 image")
    if nvcc[0] != cuda[0]:
        return skip(f"nvcc {fp.nvcc_version} does not match torch's CUDA {torch.cuda}")
    jobs = min(fp.cpus, fp.ram_available_mib // BUILD_RAM_PER_JOB_MIB)
    if jobs < 1:
        return skip(f"building needs {BUILD_RAM_PER_JOB_MIB // 1024} GiB free RAM, the pod has {fp.ram_available_mib // 1024} GiB")
    if fp.disk_free_mib is not None and fp.disk_free_mib < BUILD_DISK_MIB:
        return skip(f"building needs {BUILD_DISK_MIB // 1024} GiB free disk, the pod has {fp.disk_free_mib // 1024} GiB")
    archs = ";".join(sorted({_fa_arch(sm) for sm in sms}))
    env = (("MAX_JOBS", str(jobs)), ("FLASH_ATTN_CUDA_ARCHS", archs), ("FLASH_ATTENTION_FORCE_BUILD", "TRUE"))
    return Dependency("flash-attn", "build", f"flash-attn=={source}" if source else "flash-attn",
                      ("--no-build-isolation", "--no-deps"), env,
                      reason=f"no wheel for torch {torch.version}: ninja build, MAX_JOBS={jobs}, FLASH_ATTN_CUDA_ARCHS={archs}")
