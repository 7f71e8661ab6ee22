"""bin/preflight --rank-gpus: the price list from bin/pod gpus --json (served by the RunPod fake),
each type predicted with the same estimate preflight prints, fitting ones cheapest first."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from podkit.checks import gpus, memory
from podkit.checks.config import load_job
from runpod_fake import FakeRunPod

ROOT = Path(__file__).resolve().parents[1]
QLORA = ROOT / "checks" / "examples" / "llama-3.1-8b-qlora-a10g.toml"


@pytest.fixture
def fake():
    f = FakeRunPod(key="rp_rank_key").start()
    f.out_of_stock.add("NVIDIA H200")
    yield f
    f.stop()


def job_file(tmp_path: Path, micro_batch: int, gpus_per_node: int = 1) -> Path:
    text = QLORA.read_text().replace("micro_batch = 1", f"micro_batch = {micro_batch}")
    text = text.replace('gpu = "A10G"', f'gpu = "A10G"\ngpus_per_node = {gpus_per_node}')
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def ranked(tmp_path, fake, job: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"RUNPOD_API_BASE_URL": fake.url, "RUNPOD_API_KEY": fake.key}
    pipeline = f"'{ROOT}/bin/pod' gpus --json | '{ROOT}/bin/preflight' --config '{job}' --rank-gpus - {' '.join(extra)}"
    return subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_fitting_types_cheapest_first_then_the_rest(tmp_path, fake):
    job = job_file(tmp_path, micro_batch=4)  # ~34 GiB per GPU: too big for a 24 GB card
    out = ranked(tmp_path, fake, job, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    order = [r["id"] for r in rows]
    assert order == ["NVIDIA RTX A6000", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H200",
                     "NVIDIA GeForce RTX 4090"]
    assert [r["fits"] for r in rows] == [True, True, True, True, False]
    assert rows[3]["price_per_hour"] is None  # out of stock: fits, but not for rent now
    # the same number preflight predicts for that card
    expect = memory.estimate(load_job(str(job)), gpus.lookup("A6000")).total / 2**30
    assert rows[0]["predicted_gib"] == round(expect, 2) and rows[0]["catalog"] == "A6000"
    text = ranked(tmp_path, fake, job)
    assert text.stdout.splitlines()[0].split()[:5] == ["1", "NVIDIA", "RTX", "A6000", "fits"]


def test_the_hourly_price_is_for_every_gpu_of_the_job(tmp_path, fake):
    rows = json.loads(ranked(tmp_path, fake, job_file(tmp_path, micro_batch=2, gpus_per_node=2), "--json").stdout)
    a100 = next(r for r in rows if r["id"] == "NVIDIA A100 80GB PCIe")
    assert a100["gpus"] == 2 and a100["price_per_hour"] == pytest.approx(2 * a100["price_per_gpu_hour"])


def test_an_unknown_card_is_skipped_and_a_bad_list_is_one_line(tmp_path):
    prices = tmp_path / "prices.json"
    # RunPod's AMD card: podkit is CUDA-only, so it is listed last, unpredicted
    prices.write_text(json.dumps([{"id": "AMD Instinct MI300X OAM", "display_name": "MI300X", "memory_gb": 192,
                                   "price_per_hour": 2.49},
                                  {"id": "NVIDIA RTX A6000", "display_name": "RTX A6000", "memory_gb": 48, "price_per_hour": 0.49}]))
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--config", str(QLORA), "--rank-gpus", str(prices)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[:3] == ["AMD", "Instinct", "MI300X"]
    assert "not in podkit's GPU catalog" in out.stdout
    prices.write_text("{not json")
    bad = subprocess.run([str(ROOT / "bin" / "preflight"), "--rank-gpus", str(prices)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert "is not a GPU price list" in bad.stderr


# RunPod's gpuTypes rows (id, displayName, memoryInGb from docs.runpod.io/references/gpu-types) for cards the
# catalog gained: each is predicted, not refused, and RunPod's whole-GB size agrees with the catalog's.
RUNPOD_ROWS = [("NVIDIA A40", "A40", 48, "A40"), ("NVIDIA RTX A4000", "RTX A4000", 16, "A4000"),
               ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 48, "RTX6000-Ada"),
               ("NVIDIA RTX 4000 Ada Generation", "RTX 4000 Ada", 20, "RTX4000-Ada"),
               ("NVIDIA RTX 2000 Ada Generation", "RTX 2000 Ada", 16, "RTX2000-Ada")]


def test_runpod_cards_the_catalog_knows_are_predicted(tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps([{"id": i, "display_name": d, "memory_gb": m, "price_per_hour": 0.5}
                                  for i, d, m, _ in RUNPOD_ROWS]))
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--config", str(QLORA), "--rank-gpus", str(prices), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    catalog = {r["id"]: r["catalog"] for r in json.loads(out.stdout)}
    assert catalog == {i: c for i, _, _, c in RUNPOD_ROWS}


def test_a_job_read_with_from_is_the_one_ranked(tmp_path):
    from podkit.checks.importers import build_job

    d = ROOT / "checks" / "examples" / "qwen2.5-7b-lora-r128-24gb"
    files = [str(d / "training_args.json"), str(d / "adapter_config.json")]
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps([{"id": "NVIDIA RTX A6000", "display_name": "RTX A6000", "memory_gb": 48, "price_per_hour": 0.49}]))
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--from", files[0], "--from", files[1], "--rank-gpus", str(prices),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expect = memory.estimate(build_job(None, files, None).job, gpus.lookup("A6000")).total / 2**30
    assert json.loads(out.stdout)[0]["predicted_gib"] == round(expect, 2)


@pytest.mark.parametrize("content,problem", [
    ("{}", "a JSON dict, not a list"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 80, "price_per_hour": NaN}]', "NaN is not a price"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 80, "price_per_hour": -1}]', "not an offer"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 80, "price_per_hour": "nan"}]', "is not a number or null"),
    (None, "cannot read"),
    # QA 2026-11-25: each of these was a traceback, an exit 1 with no output, or a size read as another.
    ("[]", "lists no GPU types"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 1e400, "price_per_hour": 1}]', "not a whole number of GB"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": true, "price_per_hour": 1}]', "not a whole number of GB"),
    ('[{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 80.9, "price_per_hour": 1}]', "not a whole number of GB"),
    ('[{"memory_gb": 80}]', "a row has no id"),
    ("[1]", "not an object"),
    (b"\xdf\xff[]", "not UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_a_price_list_that_is_not_one_is_bad_input_with_json_for_scripts(tmp_path, content, problem):
    """QA 2026-11-24: '{}' ranked as no offers (exit 1), NaN counted as for rent and a negative price was
    taken; and with --json no object reached stdout."""
    prices = tmp_path / "prices.json"
    if isinstance(content, bytes):
        prices.write_bytes(content)
    elif content is not None:
        prices.write_text(content)
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--rank-gpus", str(prices), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and problem in out.stderr, out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is False and data["error"]["field"] == "--rank-gpus" and problem in data["error"]["problem"]


def test_a_type_without_a_memory_size_is_still_ranked(tmp_path):
    """bin/pod gpus writes memory_gb 0 where RunPod gives none (pods/runpod.py): such a row is no reason to
    refuse the list (review of the stricter checks)."""
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps([{"id": "NVIDIA A100 80GB PCIe", "memory_gb": 0, "price_per_hour": 1.19}]))
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--config", str(QLORA), "--rank-gpus", str(prices), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    assert json.loads(out.stdout)[0]["catalog"] == "A100-80GB"
