"""The public accuracy ledger (benchmarks/published/): every case parses as a job, names its source
and metric as the format requires, and is scored by benchmarks/accuracy.py."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted((ROOT / "benchmarks" / "published").glob("*/*.toml"))


def _accuracy():
    spec = importlib.util.spec_from_file_location("podkit_accuracy", ROOT / "benchmarks" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


accuracy = _accuracy()


def test_ledger_has_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_case_is_a_valid_job_with_a_sourced_peak(path):
    case = accuracy.load_case(path)  # parse_job validates the job part like any job file
    raw = accuracy.tomllib.loads(path.read_text())["published"]
    assert raw["project"] == path.parent.name, "the folder is the project that measured the peak"
    assert raw["source"].strip() and raw["url"].startswith("https://")
    assert raw["commit"] == "" or re.fullmatch(r"[0-9a-f]{40}", raw["commit"])
    assert raw["metric_evidence"].strip()
    assert raw["assumptions"] and all(a.strip() for a in raw["assumptions"])
    assert case.measured > 0
    assert "excluded" not in raw or raw["excluded"].strip(), "a case left out of the score says why"


def test_every_case_is_scored_or_excluded_with_its_reason():
    res = accuracy.run()
    assert res["cases"] == len(CASES)
    scored = [r for r in res["rows"] if not r["excluded"]]
    assert res["scored"] == len(scored)
    for metric, s in res["by_metric"].items():
        assert s["n"] == sum(r["metric"] == metric for r in scored)
    assert all(r["predicted"] > 0 for r in res["rows"])
