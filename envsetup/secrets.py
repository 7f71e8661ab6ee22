"""Secrets out of what podkit prints and records (beside envfile.py, which names them; bin/smoke's runs and
bin/preflight's echo of a launch command both read it). In a smoke run the values of HF_TOKEN, WANDB_API_KEY
and the like are replaced by "[HF_TOKEN redacted]" wherever podkit writes text it did not compose itself: the command's output in
smoke.log (and its echo), the command line, and the errors in summary.json and ranks/; in the built-in run
every line of smoke.log (and smoke.rank<N>.log, and their echo) and the text of summary.json. A detached job's
output (bin/pod run) passes through it on the pod (redact_stream.py) before logs/jobs/<id>/output.log, so what
`bin/pod attach` streams and fetch-logs copies has them replaced too. A user's script
that prints its environment, or an error (a traceback, a path) with a token in it, must not put the token into
files that fetch-logs copies to a laptop and people paste into issues.

Secrets are found by name: those envsetup forwards (envsetup/envfile.py SECRET_NAMES, plus PODKIT_SECRET_NAMES)
and any variable whose name says it is one. Only the exact value is matched, and only values of MIN_LEN
characters or more (TOKENIZERS_PARALLELISM=false names a TOKEN and is none).
"""

from __future__ import annotations

import logging
import os
import re

from podkit.envsetup.envfile import EXTRA_NAMES_VAR, SECRET_NAMES, BadSecretName, extra_secret_names

# A name with one of these as a word (HF_TOKEN, AWS_SECRET_ACCESS_KEY) or as its end (GITHUBTOKEN) is taken for a
# secret; env.json leaves such variables out too. Words, not substrings: TOKENIZERS_PARALLELISM, which envsetup
# exports and env.json must record, names no secret.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "CREDENTIALS")
MIN_LEN = 8


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(m in upper.split("_") or upper.endswith(m) for m in SECRET_MARKERS)


# Values shaped like the tokens users paste on command lines, whatever the option is called: Hugging Face user
# access tokens ("hf_" + 34 letters/digits, huggingface_hub's docs), GitHub's (ghp_/gho_/ghu_/ghs_/ghr_ +36,
# github_pat_), OpenAI-style "sk-" keys (48 characters after "sk-" and longer: a hyphenated run name such as
# sk-llama3-8b-lora-r16 is shorter), and W&B API keys (40 hex digits, wandb login).
TOKEN_SHAPE = re.compile(r"hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}|sk-[\w-]{40,}"
                         r"|[0-9a-f]{40}")


def looks_like_token(value: str) -> bool:
    return bool(TOKEN_SHAPE.fullmatch(value.strip()))


# The prefixed shapes, found inside text (an error that quotes a value); bare hex is left: commit ids look alike.
PREFIXED_TOKEN = re.compile(r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}"
                            r"|sk-[\w-]{40,})")


def without_tokens(text: str) -> str:
    return PREFIXED_TOKEN.sub("[redacted]", text)


_PREFIXED_TOKEN_B = re.compile(PREFIXED_TOKEN.pattern.encode())
# PREFIXED_TOKEN's prefixes, each with the characters its body may hold: what a word still being written must
# be to grow into one.
_TOKEN_BODIES_B = {**{p.encode(): re.compile(rb"[A-Za-z0-9]*") for p in ("hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_")},
                   b"github_pat_": re.compile(rb"\w*"), b"sk-": re.compile(rb"[\w-]*")}
_TRAILING_WORD_B = re.compile(rb"[\w-]{1,256}\Z")  # the longest token shape podkit knows is under 256 characters


def _may_grow_into_token(word: bytes) -> bool:
    return any(prefix.startswith(word) or (word.startswith(prefix) and body.fullmatch(word, len(prefix)))
               for prefix, body in _TOKEN_BODIES_B.items())


def _token_tail(data: bytes) -> int:
    """How many bytes at the end of `data` may be a prefixed token still being written (hf_ab|cd...): the
    trailing word from the first place a token can start (PREFIXED_TOKEN's look-behind) that could grow into one."""
    m = _TRAILING_WORD_B.search(data)
    if not m:
        return 0
    run, before = m.group(), data[m.start() - 1:m.start()]
    for j in range(len(run)):
        can_start = not (run[j - 1:j] if j else before).isalnum()
        if can_start and _may_grow_into_token(run[j:]):
            return len(run) - j
    return 0


def _secret_option(name: str) -> bool:
    """An option or dotted key whose last part is named like a secret (--hub-token, trainer.wandb_api_key)."""
    last = name.lstrip("-~").rsplit(".", 1)[-1]
    return bool(last) and is_secret_name(last.replace("-", "_"))


def _hides(shown: str, raw: str) -> bool:
    """Whether a secret option's value is still to be hidden: not a boolean, and not already an environment
    secret's "[NAME redacted]" (which says more)."""
    return bool(raw) and shown == raw and raw.lower() not in ("true", "false")


def _names(environ) -> set[str]:
    try:
        extra = extra_secret_names(environ.get(EXTRA_NAMES_VAR, ""))
    except BadSecretName:  # envsetup refuses it, loudly; here the other names still count
        extra = ()
    # podkit's own variables hold names and paths (PODKIT_SECRET_NAMES=MY_TOKEN names a secret, it is none).
    return {*SECRET_NAMES, *extra, *(k for k in environ if is_secret_name(k) and not k.startswith("PODKIT_"))}


class SecretFilter:
    """Replaces the environment's secret values and anything shaped like a prefixed token (a Hugging Face,
    GitHub or sk- key a script prints that is in no variable) in text, or in a byte stream fed in chunks (`feed`,
    then `flush` at its end): a value split across two chunks is still caught."""

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        values = {environ[n]: n for n in sorted(_names(environ)) if len(environ.get(n, "")) >= MIN_LEN}
        # Longest first: one secret may contain another.
        self._pairs = sorted(((v, f"[{n} redacted]") for v, n in values.items()), key=lambda p: -len(p[0]))
        self._bytes = [(v.encode(errors="surrogateescape"), r.encode()) for v, r in self._pairs]
        self._pending = b""

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def text(self, s: str) -> str:
        for value, replacement in self._pairs:
            s = s.replace(value, replacement)
        return without_tokens(s)

    def argv(self, command) -> list[str]:
        """A command line with the environment's secret values replaced, the value of every option or override
        named like a secret (`--hub_token X`, `--api-key=X`, `metric_logger.api_key=X`: a token typed on the
        command line is in no variable podkit can match), and any word shaped like a token (TOKEN_SHAPE)."""
        out = [self.text(a) for a in command]
        for i, word in enumerate(out):
            name, eq, value = word.partition("=")
            if looks_like_token(word) or (eq and looks_like_token(value)):  # a token under any name, or none
                out[i] = f"{name}=[redacted]" if eq and not looks_like_token(word) else "[redacted]"
                continue
            if eq and _hides(value, command[i].partition("=")[2]) and _secret_option(name):
                out[i] = f"{name}=[redacted]"
            elif (not eq and word.startswith("-") and _secret_option(word) and i + 1 < len(out)
                  and not out[i + 1].startswith("-") and _hides(out[i + 1], command[i + 1])):
                out[i + 1] = "[redacted]"
        return out

    def deep(self, obj):
        """A JSON-shaped value (summary.json) with every string in it, keys included, passed through `text`."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {self.deep(k): self.deep(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.deep(v) for v in obj)
        return obj

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can be written: all but a tail that may be the start of a secret."""
        data = self._pending + chunk
        for value, replacement in self._bytes:
            data = data.replace(value, replacement)
        keep = _token_tail(data)
        for value, _ in self._bytes:
            for k in range(min(len(value) - 1, len(data)), keep, -1):
                if data.endswith(value[:k]):
                    keep = k
                    break
        self._pending = data[len(data) - keep:] if keep else b""
        return _PREFIXED_TOKEN_B.sub(b"[redacted]", data[:len(data) - keep])

    def flush(self) -> bytes:
        out, self._pending = self._pending, b""
        return _PREFIXED_TOKEN_B.sub(b"[redacted]", out)


class RedactingFormatter(logging.Formatter):
    """A log formatter whose whole output (the message, its arguments, a traceback) has the secrets replaced."""

    def __init__(self, fmt=None, datefmt=None, secrets: SecretFilter | None = None):
        super().__init__(fmt, datefmt)
        self.secrets = SecretFilter() if secrets is None else secrets

    def format(self, record: logging.LogRecord) -> str:
        return self.secrets.text(super().format(record))
