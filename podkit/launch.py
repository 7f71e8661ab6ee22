"""How bin/preflight, bin/smoke, bin/plot and bin/pod start their CLI: standard library only, so that a
machine where `make setup` never ran gets one line naming what is missing, not an import traceback.

The commands run under .venv's python, or python3 where there is no .venv (bin/*); a python3 without
podkit's dependencies then failed on its first import of one, anywhere in the CLI (torch is imported
only once smoke starts its run).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(target: str, prog: str) -> None:
    """Import "module:function" and call it (a click group, given prog_name=`prog`, or pods.cli's wrapper `run`,
    which names itself); a dependency missing from this interpreter is one line and exit 2."""
    module, function = target.split(":")
    try:
        entry = getattr(importlib.import_module(module), function)
        entry() if function == "run" else entry(prog_name=prog)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if not top or top == "podkit":
            raise  # podkit's own layout is broken: a bug to see whole, not a set-up step
        problem, fix = not_set_up(top)
        if wants_json():
            from podkit.checks.errors import ConfigError

            print(json.dumps(ConfigError("", problem, fix).to_json(), indent=2))
        print(f"{prog}: {problem} ({fix})", file=sys.stderr)
        sys.exit(2)


def wants_json(args=None) -> bool:
    """--json among the command's own arguments (not those of a command after --)."""
    argv = list(sys.argv[1:] if args is None else args)
    return "--json" in (argv[:argv.index("--")] if "--" in argv else argv)


def not_set_up(top: str) -> tuple[str, str]:
    """What is missing, for which interpreter, and what to run."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        return (f"podkit is not set up in {ROOT}: no .venv, and {sys.executable} has no module {top!r}",
                "run `make setup` there first")
    return (f"{sys.executable} has no module {top!r}",
            f"run `make setup` in {ROOT} again; for an optional part of podkit, install its extra from "
            f"pyproject.toml's optional-dependencies into .venv")
