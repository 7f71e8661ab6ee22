"""model.hf = "owner/name": config.json through huggingface_hub's own cache, and its failures as one line.

No test reaches the Hub: the cached case lays out $HF_HOME/hub the way huggingface_hub 2.4.0 writes it
(models--owner--name/refs/main -> snapshots/<commit>/config.json, file_download.py), and the refusals
come from a local stand-in on 127.0.0.1 (HF_ENDPOINT) answering as the Hub documents its errors:
an X-Error-Code header of GatedRepo or RepoNotFound (huggingface_hub utils/_http.py hf_raise_for_status).
"""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub", reason="model.hf needs huggingface_hub (pip install huggingface_hub==2.4.0)")

ROOT = Path(__file__).resolve().parents[1]

# The size-fixing keys of Qwen/Qwen3-8B's config.json (huggingface.co/Qwen/Qwen3-8B/blob/main/config.json).
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}


def preflight(job: Path, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([str(ROOT / "bin" / "preflight"), "--config", str(job), "--json"], capture_output=True,
                          text=True, env={**clean, **env}, timeout=120)


def job_file(tmp_path: Path, repo: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nhf = "{repo}"\n[cluster]\ngpu = "H100-SXM"\n')
    return path


def _cache_qwen(home: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = home / "hub" / "models--Qwen--Qwen3-8B"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "snapshots" / commit).mkdir(parents=True)
    (repo_dir / "snapshots" / commit / "config.json").write_text(json.dumps(QWEN3_8B))


def test_a_cached_hub_id_is_read_without_asking_the_hub(tmp_path, hub):
    """QA 2026-11-25: online, huggingface_hub asked the Hub for the etag of a file it held, and over an unreachable
    Hub retried for 23 s before reading its cache: the preflight meant to take half a second took 24."""
    _cache_qwen(tmp_path / "hf")
    _Hub.requests.clear()
    out = preflight(job_file(tmp_path, "Qwen/Qwen3-8B"), {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub})
    assert out.returncode in (0, 1), out.stderr
    # (huggingface_hub 2.x may still fetch its agent-harness registry, once a day, with a 3 s timeout)
    assert json.loads(out.stdout)["model"]["params"] == 8_190_735_360
    assert not [r for r in _Hub.requests if "Qwen" in r], _Hub.requests


def test_hub_id_is_read_from_the_cache_offline(tmp_path):
    home = tmp_path / "hf"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = home / "hub" / "models--Qwen--Qwen3-8B"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_8B))
    out = preflight(job_file(tmp_path, "Qwen/Qwen3-8B"), {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode in (0, 1), out.stderr
    model = json.loads(out.stdout)["model"]
    assert model["params"] == 8_190_735_360  # Qwen3-8B model card: 8.2B
    assert "Qwen/Qwen3-8B" in model["name"]


def test_offline_and_not_cached_is_one_line(tmp_path):
    out = preflight(job_file(tmp_path, "Qwen/Qwen3-8B"), {"HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "model.hf: Qwen/Qwen3-8B config.json is not in the Hugging Face cache" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]


class _Hub(BaseHTTPRequestHandler):
    """Answers like huggingface.co for two repos: a gated one (401, GatedRepo) and a missing one."""

    requests: list = []

    def _answer(self):
        self.requests.append(self.path)
        if self.path.startswith("/meta-llama/"):
            status, code, message = 401, "GatedRepo", "Access to model meta-llama/Llama-3.1-8B is restricted."
        else:
            status, code, message = 404, "RepoNotFound", "Repository not found"
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("repo,needle", [
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B is gated: its files need an access token "
                                "(accept its license on huggingface.co/meta-llama/Llama-3.1-8B, then set HF_TOKEN)"),
    ("nobody/no-such-model", "nobody/no-such-model is not a Hub repo, or is private"),
])
def test_hub_refusals_are_one_line_naming_the_fix(tmp_path, hub, repo, needle):
    out = preflight(job_file(tmp_path, repo), {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_a_person_at_a_terminal_is_told_the_hub_is_being_asked(tmp_path, hub):
    """The Hub fetch is a preflight's one slow step (23 s over an unreachable Hub): at a terminal a line says so
    before it starts; the refusal still follows as its own line."""
    import pty

    controller, terminal = pty.openpty()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    out = subprocess.run([str(ROOT / "bin" / "preflight"), "--config", str(job_file(tmp_path, "nobody/no-such-model"))],
                         stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=120,
                         env={**clean, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub})
    os.close(terminal)
    err = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not chunk:
            break
        err += chunk
    os.close(controller)
    lines = err.decode().strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, lines
    assert lines[0].startswith("podkit: fetching nobody/no-such-model config.json from the Hugging Face Hub"), lines
    assert "not a Hub repo" in lines[1], lines


def test_missing_huggingface_hub_is_one_clear_error():
    # None in sys.modules makes `import huggingface_hub` raise ImportError, as when it is not installed.
    code = ("import sys; sys.modules['huggingface_hub'] = None\n"
            "from podkit.checks.errors import ConfigError\nfrom podkit.checks.models import from_hf_hub\n"
            "try:\n    from_hf_hub('Qwen/Qwen3-8B')\nexcept ConfigError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "model.hf: reading a Hub id needs huggingface_hub, which is not installed" in out.stdout, out.stderr
    assert "pip install huggingface_hub==2.4.0" in out.stdout


def test_bad_repo_id_is_one_line(tmp_path):
    out = preflight(job_file(tmp_path, "not a repo id!"), {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert out.stderr.strip() == ("preflight: model.hf: 'not a repo id!' is not a Hub repo id "
                                  "(write it as owner/name, e.g. Qwen/Qwen3-8B)")


@pytest.mark.slow
def test_an_unreachable_hub_is_one_line_after_its_retries(tmp_path):
    """huggingface_hub retries a refused connection five times (23 s), logging a warning each time: eleven
    lines of stderr before podkit's one (QA, 2026-11-24). A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: connections are refused
    out = preflight(job_file(tmp_path, "Qwen/Qwen3-8B"), {"HF_HOME": str(tmp_path / "hf"),
                                                           "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "the Hub cannot be reached" in out.stderr and json.loads(out.stdout)["error"]["field"] == "model.hf"
