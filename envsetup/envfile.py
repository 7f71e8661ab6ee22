"""The env file every remote command sources: allocator, tokenizers, threads, caches, secrets.

Written with mode 0600 from the start (it may hold HF_TOKEN), atomically. Settings are defaults
(`${VAR:-value}`): a value set for the pod itself wins. Secrets arrive on stdin or from the
environment, never as arguments, and are never printed.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from podkit.envsetup.fingerprint import Fingerprint

SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
EXTRA_NAMES_VAR = "PODKIT_SECRET_NAMES"  # more names, comma-separated: the user's own secrets
# A shell variable name (POSIX.1-2017 XBD 3.235 "Name"): each is written as `export NAME=...` into a file that
# every command sources.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names a secret must not take: the secrets are exported last (render), so one of these would override the env
# file's own settings (PATH, VIRTUAL_ENV, PODKIT_*, the allocator and cache settings) or change what every
# command runs (the loader's LD_*, Python's PYTHON*, bash's BASH_ENV/ENV/IFS, the shell's HOME/SHELL).
_NOT_SECRETS = frozenset({"PATH", "VIRTUAL_ENV", "HOME", "SHELL", "IFS", "ENV", "BASH_ENV", "PS4", "CDPATH",
                          "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TOKENIZERS_PARALLELISM",
                          "OMP_NUM_THREADS", "HF_HOME", "PIP_CACHE_DIR", "TORCH_HOME", "TRITON_CACHE_DIR"})
_NOT_SECRET_PREFIXES = ("PODKIT_", "LD_", "PYTHON")


class BadSecretName(ValueError):
    """PODKIT_SECRET_NAMES holds something that is not a variable name: str() is the problem, .fix what to do."""

    fix = (f"give names only, comma-separated: letters, digits and _, not starting with a digit, "
           f"e.g. {EXTRA_NAMES_VAR}=MY_TOKEN,MY_API_KEY")


def extra_secret_names(value: str) -> tuple[str, ...]:
    """The names in a PODKIT_SECRET_NAMES value (spaces around commas and empty entries ignored), in order, once each.
    A name that is not one raises BadSecretName; what follows a '=' is never repeated (it may be the secret)."""
    names = []
    for k, name in enumerate((e.strip() for e in value.split(",")), 1):
        if not name:
            continue
        if not _NAME.fullmatch(name):
            # Never echoed: a value pasted where a name goes may be the secret itself (NAME=value, or a bare token).
            raise BadSecretName(f"{EXTRA_NAMES_VAR}: entry {k} ({len(name)} characters) is not an environment "
                                "variable name" + ("; it takes names only, each value is read from the environment"
                                                   if "=" in name else ""))
        if name in _NOT_SECRETS or name.startswith(_NOT_SECRET_PREFIXES):
            raise BadSecretName(f"{EXTRA_NAMES_VAR}: {name} is not a secret to forward: it is exported after the env "
                                "file's own settings and would replace one, or change how every command on the pod "
                                "runs")
        if name not in names:
            names.append(name)
    return tuple(names)


def secret_names(environ=os.environ) -> tuple[str, ...]:
    """The secrets to forward: SECRET_NAMES and those PODKIT_SECRET_NAMES adds (BadSecretName for a bad one)."""
    extra = extra_secret_names(environ.get(EXTRA_NAMES_VAR, ""))
    return SECRET_NAMES + tuple(n for n in extra if n not in SECRET_NAMES)


def venv_dir(project: str | Path) -> str:
    """The project venv envsetup makes from the image's interpreter (the probe's choice, or --python's)."""
    return f"{str(project).rstrip('/')}/.venv"


def venv_python(project: str | Path) -> str:
    """The interpreter podkit's commands and jobs run on a machine envsetup set up: the project venv's. The env
    file below puts its bin first on PATH; where there is no venv, the image's interpreter itself is the one
    (`bin/pod run --nodes` launches with it)."""
    return f"{venv_dir(project)}/bin/python"


def alloc_conf_var(fp: Fingerprint) -> str:
    """torch 2.9 renamed PYTORCH_CUDA_ALLOC_CONF to PYTORCH_ALLOC_CONF (the old name still works)."""
    if fp.torch and fp.torch.major_minor >= (2, 9):
        return "PYTORCH_ALLOC_CONF"
    return "PYTORCH_CUDA_ALLOC_CONF"


def render(fp: Fingerprint, project: Path, cache_dir: str | None, attention: str, attention_reason: str,
           secrets: dict[str, str]) -> str:
    gpus = max(1, len(fp.gpus))
    threads = max(1, fp.cpus // gpus)  # one process per GPU: split the cores, don't oversubscribe
    venv = Path(venv_dir(project))
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
    extra = ",".join(sorted(n for n in secrets if n not in SECRET_NAMES))
    if extra:  # recorded, so that a later envsetup (a re-deploy without them set locally) keeps them: existing_secrets
        lines.append(f"export {EXTRA_NAMES_VAR}={shlex.quote(extra)}")
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
    """Secrets already in the env file, so a re-deploy without them set locally keeps them: those of `names`
    and those the file's own PODKIT_SECRET_NAMES line names."""
    out = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    exported = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line[7:].partition("=")
            try:
                parsed = shlex.split(value)
            except ValueError:  # not a line render() wrote
                continue
            if parsed:
                exported[name] = parsed[0]
    try:
        recorded = extra_secret_names(exported.get(EXTRA_NAMES_VAR, ""))
    except BadSecretName:  # an edited file: its own names are not trusted
        recorded = ()
    return {n: v for n, v in exported.items() if n in names or n in recorded}
