"""Injected by `bin/smoke -- COMMAND` (this folder is put first on PYTHONPATH, and holds nothing
else, so it shadows no module of the user's): every Python process of the command starts podkit's
per-rank probe (train/rank_probe.py) before the user's code runs, then the sitecustomize this file
hides, if the environment has one, runs as it would have.
"""

import os
import sys


def _start_probe():
    root = os.environ.get("PODKIT_ROOT")
    if not root or not os.environ.get("PODKIT_SMOKE_DIR"):
        return
    try:
        import importlib.util

        if "podkit" not in sys.modules:
            # By file: putting podkit's root on sys.path would expose its `train` folder to the user's imports.
            spec = importlib.util.spec_from_file_location(
                "podkit", os.path.join(root, "podkit", "__init__.py"),
                submodule_search_locations=[os.path.join(root, "podkit")])
            module = importlib.util.module_from_spec(spec)
            sys.modules["podkit"] = module
            spec.loader.exec_module(module)
        from podkit.train.rank_probe import install_from_env

        install_from_env()
    except ImportError as exc:  # a Python of the command without torch (a helper tool): nothing to measure
        if "torch" not in str(exc):
            print(f"podkit smoke: monitor not injected in pid {os.getpid()}: {exc}", file=sys.stderr)
    except Exception as exc:  # never break the user's command for the monitor's sake
        print(f"podkit smoke: monitor not injected in pid {os.getpid()}: {exc!r}", file=sys.stderr)


def _chain():
    """Run the next sitecustomize on sys.path (a distribution's), which this one shadows."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
_start_probe()
