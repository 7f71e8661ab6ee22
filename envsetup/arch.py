"""Versions and CUDA architectures, parsed one way for the whole project (standard library only:
envsetup runs before any venv exists, and checks/ reads torch's arch list without importing torch).

torch.cuda.get_arch_list() holds "sm_XY" (cubins) and "compute_XY" (PTX) entries, with an "a"
or "f" suffix for arch-specific features (sm_90a, compute_90a, sm_100f: CUDA 12.0 / 12.9 docs,
"GPU feature list"). A cubin runs on the same major architecture at an equal or higher minor; PTX
is JIT-compiled for any newer GPU; the suffixed (arch-specific) kind runs only on its own GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'2.4.1+cu124' -> (2, 4, 1); '12.8' -> (12, 8); '2.7.4.post1' -> (2, 7, 4); '' -> ()."""
    out = []
    for part in (text or "").split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break  # '4rc1', '4post1': the number is the last part that counts
    return tuple(out)


def major_minor(text: str | None) -> tuple[int, int] | None:
    v = version_tuple(text)
    return (v[0], v[1]) if len(v) >= 2 else None


@dataclass(frozen=True)
class Arch:
    kind: str  # "sm" (cubin) | "compute" (PTX)
    sm: int  # 90 for sm_90a
    specific: bool  # the 'a'/'f' suffix

    @classmethod
    def parse(cls, text: str) -> "Arch | None":
        m = _ARCH.match(text.strip())
        return cls(m.group(1), int(m.group(2)), bool(m.group(3))) if m else None


def supports(arch_list, sm: int) -> bool | None:
    """Whether a build with `arch_list` runs kernels on a GPU of compute capability `sm` (e.g. 86);
    None when the list is empty (unknown, or a CPU build)."""
    archs = [a for a in (Arch.parse(x) for x in arch_list or ()) if a]
    if not archs:
        return None
    for a in archs:
        if a.specific and a.sm != sm:
            continue
        if a.kind == "sm" and a.sm // 10 == sm // 10 and a.sm <= sm:
            return True
        if a.kind == "compute" and a.sm <= sm:
            return True
    return False


def ptx_only(arch_list, sm: int) -> bool:
    """True when only PTX (JIT at start, slow first steps) covers `sm`."""
    cubin = supports([a for a in arch_list or () if a.startswith("sm_")], sm)
    return not cubin and bool(supports(arch_list, sm))
