"""The smoke run's parts, in process on CPU: model, data, optimizers, loop variants, the monitor."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from podkit.checks import memory
from podkit.checks.config import load_job
from podkit.train import MemoryMonitor
from podkit.train import data as data_mod
from podkit.train import model as model_mod
from podkit.train.memprobe import TensorCounter
from podkit.train.optim import optimizer_class, warmup_cosine
from podkit.train.outputs import RunDir
from podkit.train.parallel import World
from podkit.train.plot import curves, draw
from podkit.train.smoke import SmokeRun
from podkit.train.verdict import judge
from tests.smoke_helpers import tiny_job


def run_tiny(tmp_path, steps=30, **train):
    job = load_job(tiny_job(tmp_path, train={k: json.dumps(v) for k, v in train.items()}))
    run = SmokeRun(job, torch.device("cpu"), World(), RunDir(tmp_path / "runs", "r"))
    verdict = run.run(steps)
    return run, verdict, {r.name: r for r in _rows(run)}


def _rows(run):
    from podkit.train.verdict import comparison

    return comparison(run.estimate, run.phases.marks, run.phases.peaks, run.phases.rises,
                      run.summary["peak_allocated"], None, "cpu")


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b"])
def test_meta_model_has_the_shape_counts(preset):
    from podkit.checks.models import preset as shape_of

    shape = shape_of(preset)
    model = model_mod.build(shape, model_mod.ModelOptions(), "bf16-mixed")  # meta: no memory at all
    total, trainable = model_mod.count_params(model)
    assert total == shape.params and trainable == shape.params
    assert all(p.is_meta for p in model.parameters())


def test_lora_trains_only_adapters(job):
    j = job(model='preset = "tiny"', train="lora_rank = 4")
    model = model_mod.build(j.shape, model_mod.ModelOptions(lora_rank=4), "bf16-mixed")
    _, trainable = model_mod.count_params(model)
    assert trainable == memory.trainable_params(j) == j.shape.lora_params(4)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}  # no fp32 master copy of weights that never update


def test_materialize_is_deterministic_and_causal():
    from podkit.checks.models import preset as shape_of

    shape = shape_of("tiny")
    a = model_mod.materialize(model_mod.build(shape, model_mod.ModelOptions(max_seq_len=16), "fp32"), torch.device("cpu"), 3)
    b = model_mod.materialize(model_mod.build(shape, model_mod.ModelOptions(max_seq_len=16), "fp32"), torch.device("cpu"), 3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    x = torch.randint(512, (1, 16))
    # Changing the last token must not change the loss on earlier positions (causal mask).
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 512
    with torch.no_grad():
        per_pos = []
        for inp in (x, x2):
            h = a.embed_tokens(inp)
            for block in a.layers:
                h = block(h, a.rope_cos, a.rope_sin)
            per_pos.append(h)
    assert torch.allclose(per_pos[0][:, :-1], per_pos[1][:, :-1], atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_paths_agree(attention):
    from podkit.checks.models import preset as shape_of

    shape = shape_of("tiny")
    ref = model_mod.materialize(model_mod.build(shape, model_mod.ModelOptions(max_seq_len=32), "fp32"), torch.device("cpu"), 0)
    other = model_mod.materialize(model_mod.build(shape, model_mod.ModelOptions(attention=attention, max_seq_len=32), "fp32"),
                                  torch.device("cpu"), 0)
    x, y = torch.randint(512, (2, 32)), torch.randint(512, (2, 32))
    assert torch.allclose(ref(x, y), other(x, y), atol=1e-5)


# ---------------------------------------------------------------- data and optimizers


def test_synthetic_stream_is_learnable_and_deterministic():
    a, b = data_mod.SyntheticTokens(512, 64, 4, seed=1), data_mod.SyntheticTokens(512, 64, 4, seed=1)
    x, y = a.next_batch()
    assert torch.equal(x, b.next_batch()[0])
    follows = (y == a.perm[x]).float().mean().item()
    assert 0.85 < follows < 0.95  # the rule holds except for the 10% noise
    other_rank = data_mod.SyntheticTokens(512, 64, 4, seed=1, rank=1).next_batch()[0]
    assert not torch.equal(x, other_rank)


def test_token_file(tmp_path):
    ids = torch.arange(1000, dtype=torch.int64) % 300
    path = tmp_path / "tokens.bin"
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids.tolist()))  # nanoGPT's uint16 format
    stream = data_mod.TokenFile(str(path), 512, 16, 3)
    x, y = stream.next_batch()
    assert x.shape == (3, 16) and torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal((x + 1) % 300, y)  # consecutive ids, as written


def test_warmup_then_cosine():
    lrs = [warmup_cosine(s, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


@pytest.mark.parametrize("name", ["lion", "lion8bit"])
def test_bitsandbytes_lion_descends_and_keeps_the_predicted_state(name):
    pytest.importorskip("bitsandbytes", reason="Lion comes from bitsandbytes (a test extra)")
    from podkit.checks.memory import optimizer_bytes, trainable_groups
    from podkit.checks.config import parse_job

    cls, kwargs = optimizer_class(name, torch.device("cpu"))
    assert cls.__module__.startswith("bitsandbytes")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 128) * 3)  # 8192 values: 8-bit state for Lion8bit
    opt = cls([w], lr=0.1, **kwargs)
    start = w.detach().abs().mean().item()
    for step in range(200):
        opt.param_groups[0]["lr"] = 0.1 * 0.98 ** step  # sign updates need a decaying lr to settle
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    assert w.abs().mean().item() < 0.5 * start  # 8-bit momentum settles less tightly than 32-bit
    # The state is what checks/memory.py predicts for a tensor of this size (qmap shared, not counted).
    held = sum(v.numel() * v.element_size() for k, v in opt.state[w].items() if torch.is_tensor(v) and k != "qmap1")
    assert held == (8192 * 4 if name == "lion" else 8192 + 4 * 8192 // 256)
    job = parse_job(f"[model]\npreset = 'tiny'\n[train]\noptimizer = '{name}'\n")
    big = [g for g in trainable_groups(job) if g.numel >= 4096]
    per_value = optimizer_bytes(job, big, 4) / sum(g.numel * g.count for g in big)
    assert per_value == pytest.approx(held / 8192)


def test_a_missing_torchao_names_the_release_deploy_pins_for_this_torch(monkeypatch):
    """The hint was a second copy of the release table (0.18.0 only) and said deploy did not install torchao."""
    import sys

    from podkit.checks.errors import ConfigError
    from podkit.envsetup.resolve import torchao_release

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim: ImportError
    with pytest.raises(ConfigError) as exc:
        optimizer_class("torchao_adamw8bit", torch.device("cpu"))
    release = torchao_release(torch.__version__)
    assert f"pip install torchao=={release} (the release built for torch {torch.__version__})" in exc.value.fix
    assert exc.value.fix.startswith("make deploy installs it on a pod")


def test_checkpointing_saves_measured_memory(tmp_path):
    measured = {}
    for mode in ("none", "selective", "full"):
        run, verdict, r = run_tiny(tmp_path / mode, steps=30, checkpointing=mode)
        assert verdict.status == "pass", verdict.reasons
        measured[mode] = r["activations + loss"].measured
        assert abs(r["peak allocated"].error) < 0.25, (mode, r["peak allocated"])
    assert measured["full"] < measured["selective"] < measured["none"]


def test_accumulation_keeps_gradients_and_trains(tmp_path):
    run, verdict, r = run_tiny(tmp_path, steps=30, grad_accum=2)
    assert verdict.status == "pass"
    assert run.summary["loss_last"] < run.summary["loss_first"] / 2
    lines = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["tokens"] == 2 * 8 * 128
    assert abs(r["grads"].error) < 0.10


@pytest.mark.slow
def test_bf16_mixed_and_pure(tmp_path):
    for precision in ("bf16-mixed", "bf16"):
        run, verdict, r = run_tiny(tmp_path / precision, steps=30, precision=precision)
        assert verdict.status == "pass", (precision, verdict.reasons)
        assert abs(r["params"].error) < 0.10 and abs(r["optimizer"].error) < 0.10


def test_adamw8bit_on_cpu(tmp_path):
    run, verdict, r = run_tiny(tmp_path, steps=30, optimizer="adamw8bit")
    assert verdict.status == "pass", verdict.reasons
    states = [v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert any(v.dtype == torch.uint8 for v in states)  # really 8-bit states
    assert abs(r["optimizer"].error) < 0.10, r["optimizer"]


def test_lora_run(tmp_path):
    run, verdict, r = run_tiny(tmp_path, steps=30, lora_rank=8, lr=0.02)
    assert verdict.status == "pass", verdict.reasons
    assert run.trainable == run.job.shape.lora_params(8)


# ---------------------------------------------------------------- verdict and library face


def test_judge():
    assert judge([5.0, 4.0, 2.0], 0.2, 10, 100, 3).status == "pass"
    assert judge([5.0, 4.9, 4.8], 0.2, 10, 100, 3).status == "failed"
    assert judge([5.0, float("inf")], 0.2, 10, 100, 2).checks["finite_loss"] is False
    assert judge([5.0, 1.0], 0.2, 200, 100, 2).checks["under_limit"] is False
    assert judge([5.0, 1.0], 0.2, 10, 100, 5).checks["all_steps"] is False
    # no loss at all is never a pass, even where no step was planned (a library caller's 0)
    empty = judge([], 0.2, 10, 100, 0)
    assert empty.status == "failed" and empty.checks["finite_loss"] is False and "no loss was seen" in empty.reasons[0]


def test_memory_monitor_in_a_user_loop(tmp_path):
    """What a user with their own loop writes: the same samples and warnings, no podkit config."""
    torch.manual_seed(0)
    counter = TensorCounter()
    counter.switch_on()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = tmp_path / "mem.jsonl"
    with MemoryMonitor(every=5, device="cpu", tokens_per_step=32, probe=counter, log_path=log, warmup=2) as mon:
        for _ in range(23):
            x = torch.randn(32, 64)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step(loss=loss.item())
    counter.switch_off()
    assert [r["step"] for r in mon.records] == [5, 10, 15, 20, 23]
    params = sum(p.numel() * 4 for p in model.parameters())
    s = mon.summary()
    assert s["peak_allocated"] >= 4 * params  # weights, grads, two AdamW states
    assert s["tokens_per_s"] > 0 and s["step_time"] > 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 5 and "loss" in lines[0] and lines[-1]["host_rss"] > 0


def test_memory_monitor_rejects_bad_every():
    with pytest.raises(ValueError):
        MemoryMonitor(every=0, device="cpu")


def test_plot_is_a_png_with_units_and_the_rss_on_its_own_axis(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot is matplotlib's; `make setup` installs it ([plot] extra)")
    path = tmp_path / "p.png"
    records = [{"step": 1, "loss": 6.0}, {"step": 2, "loss": float("nan")},
               {"profile": {"step": 2, "peak_allocated": 30 << 20, "host_rss": 400 << 20}}]
    run = curves(records, {"device": "cpu", "predicted": 32 << 20, "status": "failed", "steps_planned": 3}, "r")
    assert run.loss == [(1, 6.0), (2, None)] and run.series == {"peak tensors": [(2, 30 << 20)]}
    labels = draw([run], path, "TEST")
    assert labels == ["tensor memory (MiB)", "process RSS (MiB)", "loss (nats/token)"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gpu = curves([{"profile": {"step": 10, "allocated": 5 << 30, "peak_reserved": 6 << 30}}],
                 {"device": "cuda:0 (H100-SXM)", "predicted": 7 << 30, "capacity": 80 << 30}, "g")
    assert draw([gpu], tmp_path / "g.png", "GPU") == ["GPU memory (GiB)", "loss (nats/token)"]
    assert gpu.capacity == 80 << 30


def test_report_prints_raw_error_text(capsys, tmp_path):
    """A reason holding gloo's "[/path/pair.cc:553]" must print as text, not crash rich's markup parser."""
    from podkit.train.cli import _report

    reason = "RuntimeError: [/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    _report({"memory": [], "status": "failed", "steps": 0, "reasons": [reason], "warnings": ["[/x] y"]},
            tmp_path, as_json=False)
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "pair.cc:553] Connection closed by peer" in err and "[/x] y" in err


@pytest.mark.parametrize("preset, kind", [("mixtral-8x7b", "mixture-of-experts"),
                                          ("deepseek-v2-lite", "mixture-of-experts"),
                                          ("gemma-3-4b", "vision-language")])
def test_tracer_refuses_models_its_dense_replica_cannot_build(preset, kind):
    from podkit.checks.config import parse_job
    from podkit.checks.errors import ConfigError
    from podkit.train.traced import check_traceable

    job = parse_job(f'[model]\npreset = "{preset}"\n[cluster]\ngpu = "H100-SXM"\n')
    with pytest.raises(ConfigError, match=f"is a {kind} model"):
        check_traceable(job)
    assert job.shape.replica_gap == kind
    assert parse_job('[model]\npreset = "qwen3-8b"\n').shape.replica_gap == ""
