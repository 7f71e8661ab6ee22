"""podkit as a library, importable in the user's own training directory:

    from podkit import MemoryMonitor            # any loop (see train/monitor.py)
    from podkit.hf import MemoryMonitorCallback  # transformers Trainer
    from podkit.lightning import MemoryMonitorCallback  # Lightning

podkit's folders (checks, train, pods, envsetup) import only as podkit.checks, podkit.train, ...:
never as top-level names, so a user's own train.py (the commonest script name) neither shadows
podkit's nor is shadowed by it, and an installed podkit adds only `podkit` to the environment.
In the source tree the folders sit beside this one (the repository's layout); an installed podkit
has them inside it (pyproject's package-dir).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "checks").is_dir() and (_HERE.parent / "checks" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (a package's own __path__)

__all__ = ["MemoryMonitor"]


def __getattr__(name: str):
    # On first use: preflight imports podkit.checks, which must not pay for torch.
    if name == "MemoryMonitor":
        from podkit.train.monitor import MemoryMonitor
        return MemoryMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
