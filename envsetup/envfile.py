"""The env file every remote command sources: allocator, tokenizers, threads, caches, secrets.

Written with mode 0600 from the start (it may hold HF_TOKEN), atomically. Settings are defaults
(`${VAR:-value}`): a value set for the pod itself wins. Secrets arrive on stdin or from the
environment, never as arguments, and are never printed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from podkit.envsetup.fingerprint import Fingerprint

SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


def alloc_conf_var(fp: Fingerprint) -> str:
    """torch 2.9 renamed PYTORCH_CUDA_ALLOC_CONF to PYTORCH_ALLOC_CONF (the old name still works)."""
    if fp.torch and fp.torch.major_minor >= (2, 9):
        return "PYTORCH_ALLOC_CONF"
    return "PYTORCH_CUDA_ALLOC_CONF"


def render(fp: Fingerprint, project: Path, cache_dir: str | None, attention: str, attention_reason: str,
           secrets: dict[str, str]) -> str:
    gpus = max(1, len(fp.gpus))
    threads = max(1, fp.cpus // gpus)  # one process per GPU: split the cores, don't oversubscribe
    venv = project / ".venv"
    settings = {
        alloc_conf_var(fp): "expandable_segments:True",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
    }
    if cache_dir:
        settings |= {"HF_HOME": f"{cache_dir}/huggingface", "PIP_CACHE_DIR": f"{cache_dir}/pip",
                     "TORCH_HOME": f"{cache_dir}/torch", "TRITON_CACHE_DIR": f"{cache_dir}/triton"}
    lines = [
        "# Written by podkit envsetup; sourced by every podkit command on this machine. Mode 0600.",
        f"export PODKIT_ROOT={shlex.quote(str(project))}",
        # Always first, even when already on PATH: a pyenv or conda shim put before it by an rc
        # file would otherwise win (`python` resolving to the shim, without the venv's packages).
        f"if [ -x {shlex.quote(str(venv))}/bin/python ]; then export VIRTUAL_ENV={shlex.quote(str(venv))}; "
        f"export PATH=\"$VIRTUAL_ENV/bin:$PATH\"; fi",
    ]
    lines += [f"export {k}=\"${{{k}:-{v}}}\"" for k, v in settings.items()]
    lines += [f"export PODKIT_ATTENTION={attention}", f"export PODKIT_ATTENTION_REASON={shlex.quote(attention_reason)}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(secrets.items())]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> bool:
    """Write atomically with mode 0600; False when the content was already there."""
    try:
        if path.read_text() == text and (path.stat().st_mode & 0o777) == 0o600:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode does not apply to a file left by a crash
        f.write(text)
    os.replace(tmp, path)
    return True


def read_secrets(lines: str, names: tuple[str, ...]) -> dict[str, str]:
    """NAME=value lines (from stdin) for the allowed secret names; anything else is ignored."""
    out = {}
    for line in lines.splitlines():
        name, sep, value = line.partition("=")
        if sep and name in names and value:
            out[name] = value
    return out


def existing_secrets(path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Secrets already in the env file, so a re-deploy without them set locally keeps them."""
    out = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line[7:].partition("=")
            if name in names:
                parsed = shlex.split(value)
                if parsed:
                    out[name] = parsed[0]
    return out
