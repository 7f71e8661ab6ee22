"""bin/smoke -- COMMAND: the user's own script, unchanged, measured for N optimizer steps on CPU.

Every script here is a real torch program run for real (a plain loop, DDP under torchrun with gloo,
a transformers Trainer with a peft LoRA); the probe gets in through train/inject/sitecustomize.py only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.smoke_helpers import ROOT, USER_LOOP as LOOP

PY = sys.executable
SMOKE = ROOT / "bin" / "smoke"


def script(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name


def smoke_cmd(tmp_path: Path, *args: str, timeout: int = 300, run_id: str = "r"):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(SMOKE), "--output-dir", str(tmp_path / "runs"), "--run-id", run_id, *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    path = tmp_path / "runs" / run_id / "summary.json"
    return proc, (json.loads(path.read_text()) if path.exists() else None)


def test_plain_torch_loop_stops_after_n_steps_and_passes(tmp_path):
    # Named train.py, the commonest name: podkit's own `train` package must neither shadow nor be shadowed.
    name = script(tmp_path, "train.py", LOOP.format(extra=""))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name)
    assert proc.returncode == 0, proc.stderr
    assert s["status"] == "pass" and s["steps"] == 20 and s["exit_code"] == 0
    assert s["loss_last"] < s["loss_first"] and s["checks"] == {"finite_loss": True, "all_steps": True,
                                                                  "loss_fell": True}
    # parameters (1,153 fp32 = 4.6 KB) + the input batch and activations (>= 256 x 64 x 4 B) counted on CPU
    assert 60_000 < s["peak_allocated"] < 5_000_000
    nulls = {f"/{k}" for k, v in s.items() if v is None}  # strict JSON: each null says why
    assert {"/mfu", "/predicted", "/device_peak"} <= nulls <= set(s["null_reasons"]), s["null_reasons"]
    run = tmp_path / "runs" / "r"
    log = (run / "smoke.log").read_text()
    assert "SCRIPT RAN TO ITS END" not in log  # stopped at step 20 of 1000
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21)) and all(r["loss"] > 0 for r in lines)
    assert (run / "memory.png").read_bytes()[:4] == b"\x89PNG" and (run / "memory_snapshot.pickle").exists()
    env = json.loads((run / "env.json").read_text())
    assert env["device"] == "cpu" and env["versions"]["torch"] and env["command"][-1] == "train.py"


def test_predicted_vs_measured_with_config(tmp_path):
    name = script(tmp_path, "tiny_train.py", LOOP.format(extra=""))
    proc, s = smoke_cmd(tmp_path, "--steps", "5", "--json", "--config", str(ROOT / "checks/examples/tiny-cpu.toml"),
                        "--", PY, name)
    assert proc.returncode in (0, 1), proc.stderr
    assert s["predicted"]["allocated"] > 0 and s["memory"][0]["name"] == "peak allocated"
    assert s["memory"][0]["measured"] == s["peak_allocated"]
    assert json.loads(proc.stdout)["status"] == s["status"]


def test_torchrun_two_ranks_with_gloo(tmp_path):
    name = script(tmp_path, "ddp_train.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        torch.manual_seed(dist.get_rank())
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(128, 32); y = x[:, :4].sum(1, keepdim=True)
        for _ in range(500):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        del model, opt, loss  # DDP holds the process group: release it before the group goes (gloo teardown abort)
        dist.destroy_process_group()
    """)
    proc, s = smoke_cmd(tmp_path, "--steps", "15", "--", PY, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["status"] == "pass", s["reasons"]
    assert [(r["rank"], r["steps"], r["status"]) for r in s["ranks"]] == [(0, 15, "steps"), (1, 15, "steps")]
    assert all(r["peak_allocated"] > 0 for r in s["ranks"])


def test_a_rank_that_fails_is_named_not_the_peer_its_collective_broke(tmp_path):
    """QA 2026-11-25: rank 1 raised, rank 0's next all-reduce failed with gloo's 'Connection closed by peer', and
    the reason quoted rank 0's, the effect, not rank 1's cause."""
    name = script(tmp_path, "ddp_fail.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(16, 8)
        for step in range(50):
            if dist.get_rank() == 1 and step == 3:
                raise ValueError("rank1 dies")
            loss = model(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    """)
    proc, s = smoke_cmd(tmp_path, "--steps", "10", "--", PY, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", name)
    assert proc.returncode == 1 and s["status"] == "failed", s
    assert "ValueError: rank1 dies" in s["reasons"][0], s["reasons"]


def test_a_script_that_raises_leaves_a_failed_summary(tmp_path):
    name = script(tmp_path, "crash.py", LOOP.format(extra="if step == 4: raise RuntimeError('boom at step 5')"))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name)
    assert proc.returncode == 1
    assert s["status"] == "failed" and s["exit_code"] == 1 and s["steps"] == 5
    assert "RuntimeError: boom at step 5" in s["reasons"][0]
    assert "boom at step 5" in (tmp_path / "runs" / "r" / "smoke.log").read_text()


def test_an_out_of_memory_error_is_status_oom(tmp_path):
    # torch.OutOfMemoryError is what the CUDA allocator raises; raised here on CPU by the script itself.
    name = script(tmp_path, "oom.py", LOOP.format(extra="if step == 2: raise torch.OutOfMemoryError('CUDA out of "
                                                      "memory. Tried to allocate 2.00 GiB')"))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name)
    assert proc.returncode == 3 and s["status"] == "oom" and s["steps"] == 3


@pytest.mark.parametrize("extra, reason", [
    # torch's CPU allocator (1 PiB: past any machine's address space, whatever the overcommit setting)
    ("if step == 2: torch.empty(1 << 50, dtype=torch.uint8)", "can't allocate memory"),
    ("if step == 2: raise MemoryError()", "MemoryError: out of host memory"),  # Python's own, whose str() is empty
])
def test_host_memory_running_out_is_status_oom_as_in_the_builtin_run(tmp_path, extra, reason):
    """Review 2026-11-25: the built-in run calls host RAM running out oom/3; the user's command got failed/1
    and the reason 'MemoryError: ' with nothing after it."""
    name = script(tmp_path, "host_oom.py", LOOP.format(extra=extra))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name)
    assert proc.returncode == 3 and s["status"] == "oom" and s["steps"] == 3, s
    assert reason in s["reasons"][0], s["reasons"]


@pytest.mark.slow
def test_a_hang_past_the_timeout(tmp_path):
    name = script(tmp_path, "hang.py", LOOP.format(extra="if step == 2: import time; time.sleep(600)"))
    t0 = time.monotonic()
    # 20 s: the script must import torch and reach step 2 first, which takes seconds on a loaded 2-core machine.
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--timeout", "20", "--", PY, name)
    assert time.monotonic() - t0 < 90
    assert proc.returncode == 1 and s["status"] == "timeout" and s["steps"] == 3
    assert "--timeout 20" in s["reasons"][0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_ctrl_c_stops_the_command_and_leaves_an_interrupted_summary(tmp_path, sig):
    """SIGHUP is a closed terminal or SSH session: left to its default (QA 2026-11-25), bin/smoke died, the
    command trained on unattended and the summary said "running"."""
    name = script(tmp_path, "slow.py", LOOP.format(extra="import time; time.sleep(0.5); print('step', step, flush=True)"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(SMOKE), "--output-dir", str(tmp_path / "runs"), "--run-id", "r", "--steps", "500",
                             "--", PY, str(tmp_path / name)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            # SIGHUP at its default, as in a terminal's session; under nohup (this suite may run
                            # so) it comes ignored, and bin/smoke keeps it so (checks/command.stop_signals)
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    log = tmp_path / "runs" / "r" / "smoke.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "step 2" in log.read_text()):
        time.sleep(0.2)
    running = subprocess.run(["pgrep", "-f", str(tmp_path / name)], capture_output=True, text=True).stdout
    assert running.strip(), "the check below would find no script even while it runs"
    os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C (or its closing) sends: the whole foreground group
    _, err = proc.communicate(timeout=60)
    s = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert proc.returncode == 130, err
    assert s["status"] == "interrupted" and 2 <= s["steps"] < 500
    script_pids = subprocess.run(["pgrep", "-f", str(tmp_path / name)], capture_output=True, text=True).stdout
    assert script_pids.strip() == ""


def test_the_ranks_own_error_beats_an_oom_line_and_a_nan_loss_stays_strict_json(tmp_path):
    """QA 2026-11-25: a printed "CUDA out of memory" (a script that caught one and retried) made a later
    FileNotFoundError read as oom; a NaN loss was written bare into metrics.jsonl; a SIGKILL read 'exited -9'."""
    name = script(tmp_path, "retry.py", "print('batch 64 hit CUDA out of memory, retrying with 32', flush=True)\n"
                  + LOOP.format(extra="if step == 2: raise FileNotFoundError('data/shard-0003.bin')"))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name, run_id="retry")
    assert proc.returncode == 1 and s["status"] == "failed", s
    assert "FileNotFoundError: data/shard-0003.bin" in s["reasons"][0]
    name = script(tmp_path, "nan.py", LOOP.replace("loss = torch.nn", "loss = (float('nan') if step >= 3 else 1) * torch.nn")
                  .format(extra=""))
    proc, s = smoke_cmd(tmp_path, "--steps", "8", "--", PY, name, run_id="nan")
    assert proc.returncode == 1 and s["status"] == "failed" and "nan" in s["reasons"][0], s
    for f in ("metrics.jsonl", "ranks/metrics.rank0.jsonl", "ranks/rank0.json"):
        for line in (tmp_path / "runs" / "nan" / f).read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {f}"))
    assert s["files"]["ranks"] == "ranks/"
    name = script(tmp_path, "killed.py", LOOP.format(extra="if step == 2: import os; os.kill(os.getpid(), 9)"))
    proc, s = smoke_cmd(tmp_path, "--steps", "20", "--", PY, name, run_id="killed")
    assert proc.returncode == 1 and s["reasons"][0].startswith("the command was killed by SIGKILL (the kernel's OOM")


def test_a_signal_after_the_command_ended_still_leaves_its_final_summary(tmp_path):
    """QA 2026-11-25: a Ctrl-C in the second or two after the command ended (env.json, the plots) left the
    summary at "running". The signal arrives here while env.json is written: a real SIGINT to this process."""
    name = script(tmp_path, "quick.py", LOOP.format(extra="").replace("range(1000)", "range(3)"))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        from podkit.train import script_smoke
        def env_then_ctrl_c(run_dir, summary):
            os.kill(os.getpid(), signal.SIGINT)
        script_smoke._write_env = env_then_ctrl_c
        summary, path, code = script_smoke.run(({PY!r}, {name!r}), Path({str(tmp_path / "runs")!r}), "late", 3, 1,
                                               None, echo=False)
        sys.exit(code)
    """))
    proc = subprocess.run([PY, str(driver)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    s = json.loads((tmp_path / "runs" / "late" / "summary.json").read_text())
    assert s["status"] == "pass" and proc.returncode == 0, proc.stderr + json.dumps(s)
    assert any("SIGINT after the command ended" in w for w in s["warnings"])
    assert "writing its summary, then stopping" in proc.stderr


LEAKY = """
import os, sys, time
print("environment:", dict(os.environ), flush=True)
token = os.environ["HF_TOKEN"]
sys.stdout.write(token[:9]); sys.stdout.flush(); time.sleep(0.5)  # the token split across two reads of the pipe
sys.stdout.write(token[9:] + "\\n"); sys.stdout.flush()
""" + LOOP.format(extra="if step == 2: raise PermissionError(f'401 for {os.environ[\"HF_TOKEN\"]} and '"
                        "f'{os.environ[\"MYSERVICE_AUTH\"]}')").replace("import sys, torch", "import os, sys, torch")


def test_secrets_stay_out_of_the_log_the_summary_and_the_ranks_records(tmp_path, monkeypatch):
    """Review 2026-11-25: a script that printed its environment, or crashed with its token in the message, put
    HF_TOKEN's value into smoke.log, summary.json (reasons, ranks) and ranks/rank0.json; a token given on the
    command line was recorded as it was."""
    monkeypatch.setenv("HF_TOKEN", "hf_podkitTestSecret0123456789")
    monkeypatch.setenv("MYSERVICE_AUTH", "svc-podkit-test-secret")  # a name of the user's own, named for envsetup
    monkeypatch.setenv("PODKIT_SECRET_NAMES", "MYSERVICE_AUTH")
    name = script(tmp_path, "leaky.py", LEAKY)
    proc, s = smoke_cmd(tmp_path, "--steps", "10", "--json", "--", PY, name, "--token", "hf_podkitTestSecret0123456789")
    assert proc.returncode == 1 and s["status"] == "failed", proc.stderr[-3000:]
    assert "PermissionError: 401 for [HF_TOKEN redacted] and [MYSERVICE_AUTH redacted]" in s["reasons"][0], s
    assert s["command"][-1] == "[HF_TOKEN redacted]"
    run = tmp_path / "runs" / "r"
    assert (run / "smoke.log").read_text().count("[HF_TOKEN redacted]") >= 3  # argv, the environment, the split one
    files = [p for p in run.rglob("*") if p.is_file()]
    assert len(files) > 5, files
    for where, text in [(str(p), p.read_bytes()) for p in files] + [("stdout", proc.stdout.encode()),
                                                                      ("stderr", proc.stderr.encode())]:
        for secret in (b"podkitTestSecret", b"svc-podkit-test-secret"):
            assert secret not in text, f"{secret} in {where}"


def test_the_secret_filter_catches_a_value_split_across_reads():
    from podkit.envsetup.secrets import SecretFilter

    f = SecretFilter({"WANDB_API_KEY": "0123456789abcdef", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin",
                      "PODKIT_SECRET_NAMES": "MY_SERVICE_AUTH"})
    out = b"".join([f.feed(b"key=0123"), f.feed(b"4567"), f.feed(b"89abcdef done 01"), f.flush()])
    assert out == b"key=[WANDB_API_KEY redacted] done 01"
    # short values, other names, and podkit's own settings (a list of names): left
    assert f.feed(b"parallel: false, 50% MY_SERVICE_AUTH\r") == b"parallel: false, 50% MY_SERVICE_AUTH\r"


def test_a_token_the_script_prints_is_hidden_by_its_shape_wherever_the_reads_split_it():
    # A token in no environment variable (hard-coded in the script or its config) that the script prints: the
    # stream filter holds back a word that may still grow into a token (envsetup/secrets.py _token_tail) and
    # replaces every prefixed token shape, at whatever byte a read splits the stream.
    from podkit.envsetup.secrets import SecretFilter

    token = b"hf_" + b"a1B2" * 9
    line = b"login with " + token + b", then ghp_" + b"x" * 36 + b"\n"
    for cut in range(len(line) + 1):
        f = SecretFilter({})
        assert f.feed(line[:cut]) + f.feed(line[cut:]) + f.flush() == b"login with [redacted], then [redacted]\n"
    # Words that cannot become one are written at once: a progress bar is not held back.
    f = SecretFilter({})
    assert f.feed(b"the high loss 2.5 step") == b"the high loss 2.5 step"
    assert f.feed(b" hf") == b" " and f.feed(b"s ok") == b"hfs ok"
    assert SecretFilter({}).text("sk-" + "k" * 48 + " in a traceback") == "[redacted] in a traceback"
    # A run name that merely starts with sk- stays readable.
    assert SecretFilter({}).text("wandb: run sk-llama3-8b-lora-r16-lr2e-4-bs8 synced") == \
        "wandb: run sk-llama3-8b-lora-r16-lr2e-4-bs8 synced"


def test_the_log_gets_a_progress_bar_before_its_line_ends(tmp_path):
    import io
    import threading

    from podkit.train import script_smoke

    r, w = os.pipe()
    log, echo = open(tmp_path / "log", "wb"), io.BytesIO()
    tee = threading.Thread(target=script_smoke._tee, args=(os.fdopen(r, "rb"), log, echo))
    tee.start()
    os.write(w, b" 10%|#\r 20%|##\r")  # tqdm's redraws: no newline until the bar is done
    assert wait_until(lambda: (tmp_path / "log").read_bytes() == b" 10%|#\r 20%|##\r")
    os.write(w, b"100%\n")
    os.close(w)
    tee.join(timeout=10)
    assert (tmp_path / "log").read_bytes() == echo.getvalue() == b" 10%|#\r 20%|##\r100%\n"


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_script_that_ends_early_or_steps_by_hand_is_told_what_to_do(tmp_path):
    short = script(tmp_path, "short.py", LOOP.replace("range(1000)", "range(30)").format(extra=""))
    proc, s = smoke_cmd(tmp_path, "--steps", "100", "--", PY, short, run_id="short")
    assert proc.returncode == 1 and s["status"] == "failed" and s["steps"] == 30
    assert any("--steps 30" in r for r in s["reasons"]), s["reasons"]
    by_hand = script(tmp_path, "by_hand.py", """\
        import torch
        w = torch.zeros(4, requires_grad=True)
        for _ in range(20):
            loss = ((w - 1) ** 2).sum()
            loss.backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
                w.grad = None
    """)
    proc, s = smoke_cmd(tmp_path, "--steps", "10", "--", PY, by_hand, run_id="hand")
    assert proc.returncode == 1 and s["status"] == "failed" and s["steps"] == 0
    assert "no optimizer step was seen" in s["reasons"][0], s["reasons"]
    assert s["checks"]["finite_loss"] is False  # no loss was seen, so none is known to be finite


PREFETCHING = """
import queue, threading, torch
torch.manual_seed(0)  # the same start and batches every run: the smoke's loss check must not pass by chance
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
stop = threading.Event()
batches = queue.Queue(maxsize=4)
data = torch.Generator().manual_seed(0)
def prefetch():  # a loader thread the script stops after its loop, as many do
    batch = None
    while not stop.is_set():
        batch = torch.randn(8, 4, generator=data) + 1 if batch is None else batch  # kept until it is queued
        try:
            batches.put(batch, timeout=0.1)
            batch = None
        except queue.Full:
            pass
loader = threading.Thread(target=prefetch, name="prefetch")
loader.start()
for step in range(1000):
    loss = model(batches.get()).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
stop.set(); loader.join()
"""


def test_a_thread_the_script_stops_after_its_loop_does_not_hang_it_past_the_last_step(tmp_path):
    """Review 2026-11-25: the last step's SystemExit skips the code after the script's loop, so its loader
    thread was never stopped, Python waited for it forever, and bin/smoke with it (a Ctrl-C then read
    "interrupted" for a run that had done every step)."""
    name = script(tmp_path, "prefetching.py", PREFETCHING)
    t0 = time.monotonic()
    try:
        proc, s = smoke_cmd(tmp_path, "--steps", "5", "--", PY, str(tmp_path / name), timeout=120)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / name)])  # never left running, whatever failed
    assert proc.returncode == 0 and s["status"] == "pass" and s["exit_code"] == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    assert any("thread(s) prefetch kept the script (rank 0) from exiting" in w for w in s["warnings"]), s["warnings"]
    assert "keep pid" in (tmp_path / "runs" / "r" / "smoke.log").read_text()



def test_a_stuck_exit_after_an_error_in_the_scripts_cleanup_is_not_a_pass(tmp_path):
    """Review 2026-11-25: the stuck-exit watcher ended the process with 0 whatever had happened, so a script whose
    cleanup raised after the last step (its loader thread still running) read "pass"; Python would have exited 1."""
    body = PREFETCHING.replace("for step in range(1000):", "try:\n  for step in range(1000):").replace(
        "    loss = model", "      loss = model").replace("    opt.zero_grad()", "      opt.zero_grad()").replace(
        "stop.set(); loader.join()", "finally:\n  raise RuntimeError('cleanup failed')")
    name = script(tmp_path, "cleanup_fails.py", body)
    try:
        proc, s = smoke_cmd(tmp_path, "--steps", "5", "--", PY, str(tmp_path / name), timeout=120)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / name)])  # never left running, whatever failed
    assert proc.returncode != 0 and s["status"] != "pass" and s["exit_code"] == 1, (s, proc.stderr[-3000:])
    assert any("cleanup failed" in r for r in s["reasons"]), s["reasons"]

STUBBORN = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


GRACE_DRIVER = """\
import json, os, signal, sys, threading, time
from pathlib import Path
from podkit.train import script_smoke
from podkit.train.outputs import RunDir

script_smoke.STOP_GRACE_S = 1.0
run_dir = RunDir(sys.argv[1], "g")

def interrupt_once_ready():
    log = run_dir.file("log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "ready" in log.read_text()):
        time.sleep(0.05)
    sent.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)

sent = []
threading.Thread(target=interrupt_once_ready, daemon=True).start()
code, how = script_smoke.run_command((sys.executable, sys.argv[2]), run_dir, steps=10, every=1, timeout=None,
                                     echo=False)
print(json.dumps({"code": code, "how": how, "after_signal_s": time.monotonic() - sent[0]}))
"""


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    # In a process of its own: run_command makes its caller a subreaper and stops every process below it.
    name = script(tmp_path, "stubborn.py", STUBBORN)
    try:
        out = subprocess.run([PY, "-c", GRACE_DRIVER, str(tmp_path / "runs"), str(tmp_path / name)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / name)])  # never left running, whatever failed
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # SIGTERM, which the command ignores, then SIGKILL at the end of the (1 s) grace, with no --timeout given.
    assert result["how"] == "interrupted" and result["code"] == -signal.SIGKILL, (result, out.stderr)
    assert result["after_signal_s"] < 10


def test_ctrl_c_stops_the_command_even_when_nobody_reads_its_output(tmp_path):
    name = script(tmp_path, "slow.py", LOOP.format(extra="import time; time.sleep(0.2); print('step', step, flush=True)"))
    proc = subprocess.Popen([str(SMOKE), "--output-dir", str(tmp_path / "runs"), "--run-id", "r", "--steps", "500",
                             "--", PY, str(tmp_path / name)], cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    log = tmp_path / "runs" / "r" / "smoke.log"
    try:
        seen = b""
        while b"step 3" not in seen:  # the command's output, echoed on bin/smoke's stderr
            line = proc.stderr.readline()
            assert line, "bin/smoke ended before step 3"
            seen += line
        proc.stdout.close()
        proc.stderr.close()  # `bin/smoke -- CMD 2>&1 | head -N`: the reader has gone
        assert wait_until(lambda: "step 6" in log.read_text(), 60)  # still logged: the tee drains the pipe
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = subprocess.run(["pgrep", "-f", str(tmp_path / name)], capture_output=True, text=True).stdout.strip()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / name)])
    assert left == "", "the command outlived bin/smoke"
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["status"] == "interrupted"


def test_a_second_ctrl_c_kills_a_command_that_ignores_the_first(tmp_path):
    name = script(tmp_path, "stubborn.py", STUBBORN)
    proc = subprocess.Popen([str(SMOKE), "--output-dir", str(tmp_path / "runs"), "--run-id", "r", "--", PY, str(tmp_path / name)],
                            cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = tmp_path / "runs" / "r" / "smoke.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "ready" in log.read_text()):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None  # within its grace
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)  # well inside STOP_GRACE_S: the second Ctrl-C killed it
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / name)])  # never left running, whatever failed
    assert proc.returncode == 130, err
    assert "second Ctrl-C" in err
    s = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert s["status"] == "interrupted"
    assert subprocess.run(["pgrep", "-f", str(tmp_path / name)], capture_output=True, text=True).stdout.strip() == ""

@pytest.mark.parametrize("args, needle", [
    (["--"], "no command after --"),
    (["--", "no-such-command-podkit"], "command not found: no-such-command-podkit"),
    (["--", "./missing.sh"], "is not an executable file"),
    (["--timeout", "0", "--", "true"], "--timeout: must be a positive number of seconds"),
    (["--timeout", "nan", "--", "true"], "--timeout: must be a positive number of seconds, got nan"),
    (["--device", "cpu", "--", "true"], "--device: goes with the built-in run"),
    (["--config", "-"], "reads the job from a file, not stdin"),
    (["--config", "-", "--", "true"], "reads the job from a file, not stdin"),
    # said before the command starts, once: not "running ..." and then "cannot write" (review 2026-11-25)
    (["--output-dir", "/etc/passwd", "--", "true"], "--output-dir: /etc/passwd is a file"),
    (["--steps", "99999999999999999999", "--", "true"], "--steps: 99999999999999999999 is too large"),
])
def test_bad_command_is_one_line_exit_2(tmp_path, args, needle):
    proc, s = smoke_cmd(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert s is None


@pytest.mark.parametrize("first_line, needle", [
    ("echo hi\n", "cannot start ./job: Exec format error (not a program, and no #! line"),
    ("#!/nonexistent/python\n", "cannot start ./job: the interpreter its #! line names, /nonexistent/python, does not"),
])
def test_a_command_the_kernel_cannot_start_is_bad_input_with_a_final_summary(tmp_path, first_line, needle):
    """Review 2026-11-25: an executable script without a #! line (or with a wrong one) was reported as
    "--output-dir: cannot write ...", and its run directory kept a summary saying "running"."""
    job = tmp_path / "job"
    job.write_text(first_line + "echo hi\n")
    job.chmod(0o755)
    proc, s = smoke_cmd(tmp_path, "--json", "--", "./job")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and needle in proc.stderr, proc.stderr
    assert "--output-dir" not in proc.stderr
    assert json.loads(proc.stdout)["error"]["field"] == "--"
    assert s["status"] == "failed" and needle.split("./job: ")[1] in s["reasons"][0], s
    assert s["exit_code"] is None and s["null_reasons"]["/exit_code"] == "the command could not be started"
    # Review 2026-11-25: this summary alone had no `files`; every run's lists what it wrote.
    assert s["files"] == {"summary": "summary.json", "log": "smoke.log"}, s
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir()) == ["smoke.log", "summary.json"]


def test_podkit_run_id_names_the_run_directory_as_in_the_builtin_run(tmp_path):
    """Review 2026-11-25: -- COMMAND ignored PODKIT_RUN_ID (bin/pod run --nodes sets it) and made a time-stamped
    directory, where the built-in run writes runs/$PODKIT_RUN_ID/; --run-id still wins over it."""
    env = dict(os.environ, PODKIT_RUN_ID="from-env")
    made = []
    for extra, expect in (([], "from-env"), (["--run-id", "given"], "given")):
        proc = subprocess.run([str(SMOKE), "--output-dir", "runs", "--json", *extra, "--", "true"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 1 and json.loads(proc.stdout)["status"] == "failed", proc.stderr  # no torch step
        made.append(expect)
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == made, proc.stderr
        assert (tmp_path / "runs" / expect / "summary.json").exists()


TRAINER = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from peft import LoraConfig, get_peft_model

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                            task_type="CAUSAL_LM"))

class Repeat(torch.utils.data.Dataset):
    # one fixed pattern, so the adapters can learn it within a few steps
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        ids = torch.arange(32) % 7 + 3
        return {"input_ids": ids, "labels": ids.clone()}

args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         learning_rate=5e-3, max_steps=1000, logging_steps=1000, save_strategy="no",
                         report_to=[], use_cpu=True, dataloader_num_workers=0)
Trainer(model=model, args=args, train_dataset=Repeat()).train()
print("TRAINER RAN TO ITS END")
"""


def test_transformers_trainer_with_peft_lora_on_a_tiny_llama(tmp_path):
    pytest.importorskip("transformers", reason="the [test] extra installs transformers (pyproject.toml)")
    pytest.importorskip("peft", reason="the [test] extra installs peft (pyproject.toml)")
    name = script(tmp_path, "hf_train.py", TRAINER)
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                "max_length": 32}))
    proc, s = smoke_cmd(tmp_path, "--steps", "12", "--json", "--from", str(args), "--model", "tiny", "--", PY, name,
                        timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert s["steps"] == 12 and s["ranks"][0]["status"] == "steps", s["reasons"]
    assert s["checks"]["finite_loss"] and s["loss_last"] < s["loss_first"], s
    assert "TRAINER RAN TO ITS END" not in (tmp_path / "runs" / "r" / "smoke.log").read_text()
    assert s["predicted"] is not None and s["memory"][0]["measured"] == s["peak_allocated"]


def test_builtin_smoke_runs_the_replica_of_a_job_read_with_from(tmp_path):
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                                "max_length": 64, "bf16": False}))
    proc, s = smoke_cmd(tmp_path, "--steps", "3", "--device", "cpu", "--from", str(args), "--model", "tiny")
    assert proc.returncode in (0, 1), proc.stderr
    assert s["steps"] == 3
    config = (tmp_path / "runs" / "r" / "config.toml").read_text()
    assert "micro_batch = 2" in config and "seq_len = 64" in config and 'stack = "hf"' in config


def test_a_signal_before_the_command_starts_stops_it_rather_than_waiting_for_its_end(tmp_path):
    """Review 2026-11-25: a Ctrl-C while bin/smoke set up (its sinks can take seconds) was noted as 'after the
    command ended', and the command then ran to its natural end. The signal arrives here while the command is
    being started: a real SIGINT to this process."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from podkit.train import process_tree, script_smoke
        real = process_tree.become_subreaper
        def subreaper_then_ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)
            return real()
        process_tree.become_subreaper = subreaper_then_ctrl_c
        t0 = time.monotonic()
        summary, path, code = script_smoke.run(("sleep", "30"), Path({str(tmp_path / "runs")!r}), "early", 3, 1, None,
                                               echo=False)
        print(round(time.monotonic() - t0, 1))
        sys.exit(code)
    """))
    proc = subprocess.run([PY, str(driver)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    s = json.loads((tmp_path / "runs" / "early" / "summary.json").read_text())
    assert proc.returncode == 130 and s["status"] == "interrupted", proc.stderr + json.dumps(s)
    assert float(proc.stdout.split()[-1]) < 20 and "after the command ended" not in json.dumps(s["warnings"])


def test_a_run_named_after_its_command_takes_the_script_never_a_secret_argument(monkeypatch):
    """Review 2026-11-25: without --run-id a run was named after the command's last word, so
    `-- python train.py --hf_token $HF_TOKEN` put the token into the run directory's name, and from there into
    every path in smoke.log, the summary and fetch-logs' copy."""
    from podkit.train.outputs import command_stem, new_run_id

    secret = "hf_podkitTestSecret0123456789"
    monkeypatch.setenv("HF_TOKEN", secret)
    assert command_stem([PY, "/work/x/train.py", "--hf_token", secret]) == "train.py"
    assert command_stem(["torchrun", "--nproc-per-node=2", "finetune.py", "--lr", "1e-4"]) == "finetune.py"
    assert command_stem(["./launch.sh", secret]) == "launch.sh"
    assert command_stem([PY, "-c", "print(1)"]) == Path(PY).name  # no script: the program
    assert secret not in new_run_id(command_stem([secret]))  # a secret as the program itself: redacted
    assert "-train-" in new_run_id(command_stem([PY, "train.py", secret]))
