"""podkit as a library, importable in the user's own training directory:

    from podkit import MemoryMonitor            # any loop (see train/monitor.py)
    from podkit.hf import MemoryMonitorCallback  # transformers Trainer
    from podkit.lightning import MemoryMonitorCallback  # Lightning

podkit's internal packages are called train, checks and pods, and the user's directory very often
holds a train.py of its own. So this package never imports the top-level name `train`: it loads
podkit's train folder from beside itself under the private name `podkit._train` (train's modules
import each other relatively), and the user's `import train` still finds the user's file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_train():
    name = f"{__name__}._train"
    if name in sys.modules:
        return sys.modules[name]
    folder = ROOT / "train"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


MemoryMonitor = _load_train().MemoryMonitor

__all__ = ["MemoryMonitor"]
