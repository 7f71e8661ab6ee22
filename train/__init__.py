"""The smoke run: model, data, optimizer, step loop, memory/speed profiler, run outputs.

The library face is MemoryMonitor: `from train import MemoryMonitor`.
"""

from train.monitor import MemoryMonitor

__all__ = ["MemoryMonitor"]
