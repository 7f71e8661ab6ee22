"""Strict JSON for every --json and summary.json: no NaN or Infinity (json.dumps writes them bare,
which jq, JavaScript and most parsers refuse). A non-finite number becomes null, and the top-level
object says why under "null_reasons" (a JSON-pointer-like path -> "nan" | "inf" | "-inf")."""

from __future__ import annotations

import json
import math
from typing import Any


def clean(obj: Any, path: str = "", reasons: dict[str, str] | None = None) -> Any:
    """obj with every non-finite float replaced by None; each replacement recorded in reasons."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if reasons is not None:
            reasons[path or "/"] = "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        return None
    if isinstance(obj, dict):
        return {k: clean(v, f"{path}/{k}", reasons) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v, f"{path}/{i}", reasons) for i, v in enumerate(obj)]
    return obj


def null_reasons(obj: dict, why: dict[str, str]) -> dict[str, str]:
    """For each top-level key of obj that is null and has a reason in why: its path -> the reason."""
    return {f"/{k}": why[k] for k, v in obj.items() if v is None and k in why}


def dumps(obj: Any, **kwargs) -> str:
    """json.dumps that never writes NaN/Infinity: nulls, with the reasons beside them."""
    reasons: dict[str, str] = {}
    out = clean(obj, "", reasons)
    if reasons and isinstance(out, dict):
        out = {**out, "null_reasons": {**out.get("null_reasons", {}), **{p: f"was {r}" for p, r in reasons.items()}}}
    return json.dumps(out, allow_nan=False, **kwargs)


def restore(obj: dict) -> dict:
    """dumps' inverse for a record read back: each null that null_reasons says "was nan" / "was inf" /
    "was -inf" is that float again (what a reader that judges the values, such as a NaN loss, needs)."""
    values = {"was nan": math.nan, "was inf": math.inf, "was -inf": -math.inf}
    for path, reason in (obj.get("null_reasons") or {}).items():
        if reason not in values:
            continue
        *parents, last = path.strip("/").split("/")
        node: Any = obj
        try:
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if isinstance(node, list):
                node[int(last)] = values[reason]
            elif isinstance(node, dict) and node.get(last) is None:
                node[last] = values[reason]
        except (KeyError, IndexError, ValueError, TypeError):
            continue
    return obj
