"""Setup steps keyed by a hash of their inputs: a step whose key is unchanged is skipped.

The state file is written atomically after each step that succeeds, so an interrupted setup
re-runs exactly the steps that did not finish.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class StepState:
    def __init__(self, path: Path):
        self.path = path
        try:
            self.done: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.done = {}

    def unchanged(self, step: str, key: str) -> bool:
        return self.done.get(step, {}).get("key") == key

    def record(self, step: str, key: str, **result) -> None:
        self.done[step] = {"key": key, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
        self._save()

    def forget(self, step: str) -> None:
        if self.done.pop(step, None) is not None:
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.done, indent=2))
        os.replace(tmp, self.path)
