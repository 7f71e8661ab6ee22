"""The smoke run: model, data, optimizer, step loop, memory/speed profiler, run outputs.

The library face is MemoryMonitor (`from podkit import MemoryMonitor`), imported on first use, so
`podkit.train.plot`, which bin/plot runs on a laptop, does not pay for torch.
"""

__all__ = ["MemoryMonitor"]


def __getattr__(name: str):
    if name == "MemoryMonitor":
        from .monitor import MemoryMonitor

        return MemoryMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
