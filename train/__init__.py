"""The smoke run: model, data, optimizer, step loop, memory/speed profiler, run outputs.

The library face is MemoryMonitor: `from train import MemoryMonitor`.
"""

from .monitor import MemoryMonitor  # relative: also loads as podkit._train (podkit/__init__.py)

__all__ = ["MemoryMonitor"]
