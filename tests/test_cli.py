"""bin/preflight as a user runs it: exit codes, one-line errors, the JSON shape, no torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFLIGHT = ROOT / "bin" / "preflight"
EXAMPLES = ROOT / "checks" / "examples"


def preflight(*args, env=None):
    full_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **(env or {})}
    return subprocess.run([str(PREFLIGHT), *args], capture_output=True, text=True, env=full_env, timeout=60)


def test_default_example_is_ready():
    out = preflight()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "llama-3.2-1b" in out.stdout and "Predicted memory per GPU" in out.stdout
    assert "preflight: ready" in out.stdout


def test_json_shape_follows_design():
    out = preflight("--json")
    assert out.returncode == 0
    data = json.loads(out.stdout)
    assert set(data) >= {"ok", "model", "checks", "memory", "suggestions"}
    assert data["model"]["params"] == 1_235_814_400 and data["model"]["trainable_params"] == 1_235_814_400
    per_gpu = data["memory"]["per_gpu"]
    assert set(per_gpu) == {"params", "grads", "optimizer", "activations", "loss", "overhead", "total"}
    assert per_gpu["total"] == sum(v for k, v in per_gpu.items() if k != "total")
    assert data["memory"]["fits"] is True and data["memory"]["gpu_capacity"] == 23028 * 2**20
    for check in data["checks"]:
        assert set(check) == {"id", "status", "message", "fix"}
        assert check["status"] in ("pass", "warn", "fail", "skip")


def test_failing_job_exits_1_with_suggestions():
    out = preflight("--config", str(EXAMPLES / "llama-3.1-70b-8xh100.toml"), "--json")
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert not data["ok"] and not data["memory"]["fits"]
    fit = next(c for c in data["checks"] if c["id"] == "memory.fit")
    assert fit["status"] == "fail" and fit["fix"]
    assert data["suggestions"] and all(s["total"] < data["memory"]["gpu_capacity"] for s in data["suggestions"])


def test_gpu_override():
    data = json.loads(preflight("--gpu", "H100", "--json").stdout)
    assert data["gpu"]["name"] == "H100-SXM" and data["memory"]["gpu_capacity"] == 81559 * 2**20


def test_no_probe_reports_machine_checks_as_skipped():
    """It used to say deps.installed 'missing here: torch, ...' and env.alloc_conf 'not set' having looked at nothing."""
    data = json.loads(preflight("--no-probe", "--json").stdout)
    checks = {c["id"]: c for c in data["checks"]}
    for check_id in ("env.alloc_conf", "deps.installed", "gpu.arch", "gpu.driver", "disk.free"):
        assert checks[check_id]["status"] == "skip" and checks[check_id]["message"] == "not probed (--no-probe)"
    assert checks["memory.fit"]["status"] == "pass"
    probed = {c["id"]: c for c in json.loads(preflight("--json").stdout)["checks"]}
    assert probed["env.alloc_conf"]["status"] == "pass" and probed["disk.free"]["status"] != "skip"


def test_h100_nvl_in_the_config_is_predicted_for_its_94gb(tmp_path):
    """It was mapped silently to the 80 GB H100 PCIe (the review's finding 4)."""
    job = tmp_path / "nvl.toml"
    job.write_text('[model]\npreset = "llama-3.2-1b"\n[cluster]\ngpu = "H100 NVL"\n')
    data = json.loads(preflight("--config", str(job), "--json", "--no-probe").stdout)
    assert data["gpu"]["name"] == "H100-NVL" and data["memory"]["gpu_capacity"] == 95830 * 2**20


@pytest.mark.parametrize("args,needle", [
    (["--config", "/nonexistent/job.toml"], "does not exist"),
    (["--gpu", "H1OO"], "unknown GPU 'H1OO'"),
    (["--config", "{bad_toml}"], "not valid TOML"),
    (["--config", "{bad_preset}"], "did you mean 'llama-3.1-8b'"),
    (["--config", "{zero_batch}"], "train.micro_batch: must be at least 1"),
    (["--config", "{bad_precision}"], "train.precision: unknown value 'fp8'"),
    (["--config", "{bad_hf}"], "lacks num_hidden_layers"),
    (["--config", "{bert}"], "model_type 'bert' is not supported (podkit counts llama, mistral"),
    (["--config", "{no_type}"], "has no model_type"),
    (["--config", "{directory}"], "is a directory"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    files = {
        "bad_toml": "[model\npreset = 1",
        "bad_preset": '[model]\npreset = "llama-3.1-8"',
        "zero_batch": '[model]\npreset = "llama-3.2-1b"\n[train]\nmicro_batch = 0',
        "bad_precision": '[model]\npreset = "llama-3.2-1b"\n[train]\nprecision = "fp8"',
        "bad_hf": '[model]\nhf_config = "config.json"',
        "bert": '[model]\nhf_config = "bert.json"',
        "no_type": '[model]\nhf_config = "untyped.json"',
    }
    for name, text in files.items():
        (tmp_path / f"{name}.toml").write_text(text)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 10}')
    (tmp_path / "bert.json").write_text('{"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12}')
    (tmp_path / "untyped.json").write_text('{"hidden_size": 10}')
    paths = {name: str(tmp_path / f"{name}.toml") for name in files} | {"directory": str(tmp_path)}
    out = preflight(*[a.format(**paths) for a in args])
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_help_explains():
    out = preflight("--help")
    assert out.returncode == 0 and "--config" in out.stdout and "--json" in out.stdout


def test_preflight_never_imports_torch():
    code = ("import sys; from podkit.checks.cli import run_preflight; from podkit.checks.config import EXAMPLE_JOB;"
            "r = run_preflight(str(EXAMPLE_JOB), None, probe=True); r.to_json();"
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_every_bundled_example_runs(example):
    out = preflight("--config", str(EXAMPLES / example), "--json")
    assert out.returncode in (0, 1) and json.loads(out.stdout)["memory"]["per_gpu"]["total"] > 0


def test_moe_reports_total_and_active_parameters(tmp_path):
    job = tmp_path / "moe.toml"
    job.write_text('[model]\npreset = "qwen3-30b-a3b"\n[cluster]\ngpu = "H100-SXM"\n')
    out = preflight("--config", str(job), "--json")
    model = json.loads(out.stdout)["model"]
    # Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated.
    assert model["params"] == 30_532_122_624 and model["active_params"] == 3_353_032_704
    assert model["family"] == "qwen3_moe"
    text = preflight("--config", str(job))
    assert "30.53B params, 3.35B active per token" in " ".join(text.stdout.split())


def _description(tool: str, *args: str) -> str:
    """A command's --help up to its options: the part that says what it does."""
    out = subprocess.run([str(ROOT / "bin" / tool), *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    words = lambda text: " ".join(text.split())  # click wraps lines: compare across them
    return words(out.stdout.split("\nOptions:")[0]), words(out.stdout)


def test_help_texts_name_every_mode_and_exit_code():
    from podkit.train.verdict import EXIT_CODES

    pod, _ = _description("pod")
    for sub in ("up ", "down ", "ls ", "gpus ", "guard ", "deploy", "fetch-logs", "Exit codes"):
        assert sub in pod, sub
    smoke, full = _description("smoke")
    assert "-- COMMAND" in smoke and "smoke.min_loss_drop" in smoke
    # The exit codes the help lists are the ones the verdict uses (train/verdict.py EXIT_CODES).
    assert all(f"{code} {'out of memory' if s == 'oom' else s}" in smoke for s, code in EXIT_CODES.items()), smoke
    assert "2 bad input" in smoke and "the job whose replica is trained" in full  # --from works without a command
    preflight_help, full = _description("preflight")
    assert "Exit codes: 0 every check passed" in preflight_help and "1 a check failed, 2 bad input" in preflight_help
    assert "H100 = H100-SXM" in full and "H100-NVL" in full


def test_a_job_on_stdin_is_read_like_a_file_byte_order_mark_and_all(tmp_path):
    """`-c -` was refused as a missing file, and a UTF-8 byte-order mark (Windows editors) as invalid TOML."""
    text = (EXAMPLES / "tiny-cpu.toml").read_bytes()
    want = json.loads(preflight("--config", str(EXAMPLES / "tiny-cpu.toml"), "--no-probe", "--json").stdout)
    for data in (text, b"\xef\xbb\xbf" + text):
        out = subprocess.run([str(PREFLIGHT), "-c", "-", "--no-probe", "--json"], input=data, capture_output=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["memory"] == want["memory"]
        bom = tmp_path / "bom.toml"
        bom.write_bytes(data)
        assert json.loads(preflight("-c", str(bom), "--no-probe", "--json").stdout)["memory"] == want["memory"]


@pytest.mark.parametrize("args, needle", [
    (["--config", ""], "--config: is empty"),
    (["--rank-gpus", ""], "--rank-gpus: is empty"),
    (["--rank-gpus", "-", "--gpu", "H100"], "--gpu has no place beside it"),
    (["--rank-gpus", "-", "--traced"], "--traced has no place beside it"),
    (["--rank-gpus", "-", "-c", "-"], "cannot both read stdin"),
    (["--from", str(EXAMPLES / "qwen2.5-7b-lora-r128-24gb" / "training_args.json"), "--emit-toml", "--json"],
     "cannot go with --json"),
    (["--from", str(EXAMPLES / "qwen2.5-7b-lora-r128-24gb" / "training_args.json"), "--emit-toml", "--traced"],
     "so --traced would do nothing"),
])
def test_flags_that_cannot_both_be_honoured_are_refused(args, needle):
    """QA 2026-11-25: each of these ran with one flag silently dropped (--emit-toml --json printed TOML on a
    --json stdout; --rank-gpus '' ran a plain preflight; --gpu and --traced were ignored beside --rank-gpus)."""
    out = subprocess.run([str(PREFLIGHT), *args], input="[]", capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
