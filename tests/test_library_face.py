"""podkit as a library: importable beside a user's own train.py, and the Trainer / Lightning callbacks
around MemoryMonitor, run for real on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_podkit_imports_beside_a_users_train_py_without_shadowing(tmp_path):
    (tmp_path / "train.py").write_text("WHOSE = 'the user'\n")
    (tmp_path / "checks.py").write_text("WHOSE = 'the user'\n")
    code = ("import sys; from podkit import MemoryMonitor; import podkit.checks.cli, podkit.pods.cli; "
            "import train, checks; "
            "print(train.WHOSE, checks.WHOSE, MemoryMonitor.__module__, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('pods', 'envsetup') or m.startswith(('train.', 'checks.'))))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The user's train.py and checks.py are the user's; podkit's packages came in only under podkit.
    assert out.stdout.split() == ["the", "user", "the", "user", "podkit.train.monitor", "[]"]


def test_an_installed_podkit_adds_only_podkit_to_the_environment(tmp_path):
    """The wheel pip would install: one top-level package, with the card's folders inside it."""
    import shutil

    # Built from a copy: pip builds in the source folder (build/, *.egg-info), and the tree is not the test's.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import zipfile

    (wheel,) = tmp_path.glob("podkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"podkit"}
    for module in ("checks/memory.py", "checks/importers/deepspeed.py", "train/monitor.py",
                   "train/inject/sitecustomize.py", "pods/cli.py", "envsetup/requirements.txt"):
        assert f"podkit/{module}" in names
    # Installed, it imports from site-packages without the source tree's folders.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import podkit.checks.cli, podkit; print(podkit.__path__ == [podkit.__path__[0]], podkit.checks.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(site / "podkit" / "checks" / "__init__.py")]


def _hf():
    pytest.importorskip("transformers", reason="the [test] extra installs transformers")
    from hf_helpers import hf_fit

    from podkit.hf import MemoryMonitorCallback

    return hf_fit, MemoryMonitorCallback


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_hf_trainer_callback_steps_once_per_optimizer_step(tmp_path):
    hf_fit, MemoryMonitorCallback = _hf()
    mem = MemoryMonitorCallback(every=2, log_path=str(tmp_path / "memory.jsonl"))
    hf_fit(mem, tmp_path / "out", gradient_accumulation_steps=3)
    assert mem.summary["steps"] == 6 and mem.summary["status"] == "ok"  # 18 micro-batches, 6 optimizer steps
    lines = _jsonl(tmp_path / "memory.jsonl")
    assert [r["global_step"] for r in lines] == [2, 4, 6] and all(r["host_rss"] > 0 for r in lines)
    assert json.loads((tmp_path / "memory.summary.json").read_text()) == mem.summary


@pytest.mark.parametrize("how", ["error", "sigint", "sigterm"])
def test_an_hf_fit_that_crashes_still_gets_its_summary(tmp_path, how):
    """Review 2026-11-26: transformers calls no callback when train() raises (no on_exception), so the monitor
    never closed and the run left no summary. An uncaught crash or Ctrl-C ends the process: the summary says how."""
    pytest.importorskip("transformers", reason="the [test] extra installs transformers")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "hf_helpers.py"), str(tmp_path / "memory.jsonl"),
                          str(tmp_path / "out"), how], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=300)
    if how == "sigterm":  # the process still dies of the signal, after the summary is written
        assert out.returncode == -signal.SIGTERM, (out.returncode, out.stderr)
    else:
        assert out.returncode != 0 and ("KeyboardInterrupt" if how == "sigint" else "step 3 failed") in out.stderr
    summary = json.loads((tmp_path / "memory.summary.json").read_text())
    expected = {"sigint": ("interrupted", "KeyboardInterrupt"), "sigterm": ("interrupted", "killed by SIGTERM"),
                "error": ("failed", "RuntimeError: step 3 failed (simulated)")}[how]
    assert (summary["status"], summary["error"]) == expected, out.stderr
    # Two optimizer steps finished before the third's forward; the log is closed with them in it.
    assert summary["steps"] == 2 and [r["step"] for r in _jsonl(tmp_path / "memory.jsonl")] == [1, 2]


def test_an_hf_callback_reused_gives_each_fit_its_own_log_and_summary(tmp_path):
    """Review 2026-11-26: a second train() with the same callback appended to the first's log (its steps
    counted from 1 again) and replaced its summary. Also an auto_find_batch_size retry: one train(), two fits."""
    hf_fit, MemoryMonitorCallback = _hf()
    mem = MemoryMonitorCallback(every=1, log_path=str(tmp_path / "memory.jsonl"))
    hf_fit(mem, tmp_path / "out", max_steps=3)
    hf_fit(mem, tmp_path / "out", max_steps=4)
    assert [r["step"] for r in _jsonl(tmp_path / "memory.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in _jsonl(tmp_path / "memory.2.jsonl")] == [1, 2, 3, 4]
    assert [s["steps"] for s in mem.summaries] == [3, 4] and [s["status"] for s in mem.summaries] == ["ok", "ok"]
    for summary, name in zip(mem.summaries, ("memory", "memory.2")):
        assert json.loads((tmp_path / f"{name}.summary.json").read_text()) == summary
        assert summary["log_path"] == str(tmp_path / f"{name}.jsonl")
    # A new callback (the script run again) does not append to the earlier run's log either.
    hf_fit(MemoryMonitorCallback(every=1, log_path=str(tmp_path / "memory.jsonl")), tmp_path / "out", max_steps=2)
    assert [r["step"] for r in _jsonl(tmp_path / "memory.3.jsonl")] == [1, 2]
    assert len(_jsonl(tmp_path / "memory.jsonl")) == 3

    # accelerate's find_executable_batch_size catches the OOM at the third micro-batch and trains again with a
    # smaller batch: on_train_begin twice, on_train_end once. The first attempt ends as failed, in its own log.
    mem = MemoryMonitorCallback(every=1, log_path=str(tmp_path / "auto" / "memory.jsonl"))

    def oom():
        raise RuntimeError("CUDA out of memory. (simulated)")  # what should_reduce_batch_size looks for

    hf_fit(mem, tmp_path / "out", max_steps=4, auto_find_batch_size=True, crash_at=3, crash=oom)
    assert [(s["status"], s["steps"]) for s in mem.summaries] == [("failed", 2), ("ok", 4)]
    assert "auto_find_batch_size" in mem.summaries[0]["error"]
    assert [r["step"] for r in _jsonl(tmp_path / "auto" / "memory.2.jsonl")] == [1, 2, 3, 4]


def _lightning_fit(tmp_path, mem, crash_at: int | None = None, crash: BaseException | None = None, **trainer_kwargs):
    """A tiny Lightning regression fit on CPU with the callback `mem`; `crash_at`: training_step raises `crash` there
    (a simulated CUDA OOM unless given)."""
    lightning = pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    import torch

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            if self.global_step == crash_at:
                raise crash or RuntimeError("CUDA out of memory (simulated)")
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(64, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = lightning.Trainer(accelerator="cpu", callbacks=[mem], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                                **trainer_kwargs)
    trainer.fit(Regression(), loader)


def test_lightning_callback_steps_once_per_optimizer_step(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    from podkit.lightning import MemoryMonitorCallback

    mem = MemoryMonitorCallback(every=5)
    _lightning_fit(tmp_path, mem, max_steps=10, accumulate_grad_batches=2)
    assert mem.summary["steps"] == 10 and [r["global_step"] for r in mem.monitor.records] == [5, 10]


def test_bin_commands_run_from_a_directory_with_the_users_own_modules(tmp_path):
    # A project directory as users have them: train.py and checks.py of their own beside the configs.
    (tmp_path / "train.py").write_text("raise SystemExit('the user train.py was imported by podkit')\n")
    (tmp_path / "checks.py").write_text("raise SystemExit('the user checks.py was imported by podkit')\n")
    for tool in ("preflight", "smoke", "plot"):
        out = subprocess.run([str(ROOT / "bin" / tool), "--help"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and f"Usage: bin/{tool}" in out.stdout, out.stderr  # the command the user typed
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--no-probe", "--json"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1) and json.loads(out.stdout)["model"]["name"], out.stderr


def test_the_monitor_checks_its_arguments_and_logs_without_a_with_block(tmp_path):
    """Review 2026-11-25: without `with` the log was never written; every='10' was a comparison TypeError,
    tokens_per_step='x' crashed mid-training; step(loss=tensor) could not be written, step=99 overwrote the
    record's step; on CPU the summary dropped the keys the README lists; the callbacks checked nothing until
    training had started."""
    import torch

    from podkit import MemoryMonitor

    mon = MemoryMonitor(every=2, log_path=tmp_path / "m.jsonl")
    for _ in range(6):
        mon.step(loss=torch.tensor(1.5))
    mon.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 6] and lines[0]["loss"] == 1.5
    summary = mon.summary()
    assert summary["peak_allocated"] is None and "/peak_allocated" in summary["null_reasons"]
    # strict JSON's rule: every null says why, the device's peak too (no NVML reading on a CPU)
    nulls = {f"/{k}" for k, v in summary.items() if v is None}
    assert "/device_peak" in nulls and nulls == set(summary["null_reasons"]), summary
    assert summary["host_rss_peak"] > 0
    for bad in ({"every": "10"}, {"every": 2.5}, {"tokens_per_step": "x"}, {"log_path": 123}):
        with pytest.raises(TypeError, match="MemoryMonitor: "):
            MemoryMonitor(**bad)
    with pytest.raises(ValueError, match="step is the monitor's own record key"):
        MemoryMonitor(every=2).step(step=99)
    lightning = pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    from podkit.lightning import MemoryMonitorCallback

    with pytest.raises(ValueError, match="every must be at least 1"):
        MemoryMonitorCallback(every=0)
    with pytest.raises(TypeError, match="bogus"):
        MemoryMonitorCallback(every=10, bogus=1)


def test_a_lightning_fit_that_crashes_still_gets_its_summary(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    from podkit.lightning import MemoryMonitorCallback

    mem = MemoryMonitorCallback(every=5, log_path=str(tmp_path / "crash.jsonl"))
    with pytest.raises(RuntimeError, match="simulated"):
        _lightning_fit(tmp_path, mem, crash_at=7, max_steps=20)
    assert mem.summary is not None and mem.summary["steps"] == 7
    assert [json.loads(line)["step"] for line in (tmp_path / "crash.jsonl").read_text().splitlines()] == [5, 7]
    summary = json.loads((tmp_path / "crash.summary.json").read_text())
    assert summary == mem.summary and (summary["status"], summary["error"]) == \
        ("oom", "RuntimeError: CUDA out of memory (simulated)")


def test_a_lightning_fit_stopped_by_ctrl_c_says_interrupted(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    import signal

    from podkit.lightning import MemoryMonitorCallback

    mem = MemoryMonitorCallback(every=5, log_path=str(tmp_path / "memory.jsonl"))
    handler = signal.getsignal(signal.SIGINT)
    try:
        # lightning 2.6.0 trainer/call.py: on KeyboardInterrupt it calls on_exception, ignores SIGINT, sys.exit(1).
        with pytest.raises(SystemExit):
            _lightning_fit(tmp_path, mem, crash_at=3, crash=KeyboardInterrupt(), max_steps=20)
    finally:
        signal.signal(signal.SIGINT, handler)
    summary = json.loads((tmp_path / "memory.summary.json").read_text())
    assert (summary["status"], summary["error"], summary["steps"]) == ("interrupted", "KeyboardInterrupt", 3)


def test_a_lightning_callback_reused_gives_each_fit_its_own_log_and_summary(tmp_path):
    """Review 2026-11-26: a second fit() with the same callback appended to the first's log and replaced its
    summary; a failed fit followed by a good one left only the good one's."""
    pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    from podkit.lightning import MemoryMonitorCallback

    mem = MemoryMonitorCallback(every=2, log_path=str(tmp_path / "memory.jsonl"))
    with pytest.raises(RuntimeError, match="simulated"):
        _lightning_fit(tmp_path, mem, crash_at=3, crash=RuntimeError("bad batch (simulated)"), max_steps=8)
    _lightning_fit(tmp_path, mem, max_steps=4)
    assert [r["step"] for r in _jsonl(tmp_path / "memory.jsonl")] == [2, 3]
    assert [r["step"] for r in _jsonl(tmp_path / "memory.2.jsonl")] == [2, 4]
    assert [(s["status"], s["steps"]) for s in mem.summaries] == [("failed", 3), ("ok", 4)]
    assert json.loads((tmp_path / "memory.summary.json").read_text())["error"] == "RuntimeError: bad batch (simulated)"
    assert json.loads((tmp_path / "memory.2.summary.json").read_text()) == mem.summary == mem.summaries[1]


def test_a_fits_log_path_is_absolute_and_a_device_is_used_as_given(tmp_path, monkeypatch):
    """Review 2026-11-25: a relative log_path put the final summary in the directory of a later chdir, not beside
    its log; /dev/stdout was taken as an earlier fit's log, and podkit made files in /dev."""
    from podkit.fits import claim_log

    monkeypatch.chdir(tmp_path)
    log, summary = claim_log(Path("rel.jsonl"))
    assert (log, summary) == (tmp_path / "rel.jsonl", tmp_path / "rel.summary.json") and log.is_file()
    assert claim_log(Path("/dev/null")) == (Path("/dev/null"), None)
    assert not Path("/dev/null.2").exists() and not Path("/dev/null.summary.json").exists()
