"""Token batches for the smoke run: a learnable synthetic stream, or a local file of token ids.

The synthetic stream is a noisy walk over a fixed random permutation of an "active" vocabulary:
the next token is perm[token] with probability 1 - NOISE, otherwise uniform over the active
set. A model that learns the permutation drops from ln(vocab) towards the stream's entropy, so
the loss falls clearly within 100 steps for any model size, and the floor is known.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from podkit.checks.errors import ConfigError

ACTIVE_VOCAB = 1024  # big vocabularies are restricted to this many tokens: learnable in 100 steps
NOISE = 0.1


def entropy_floor(vocab: int) -> float:
    """The best achievable mean loss on the synthetic stream (nats per token)."""
    n = min(vocab, ACTIVE_VOCAB)
    p_follow = 1 - NOISE + NOISE / n
    p_other = NOISE / n
    return -(p_follow * math.log(p_follow) + (n - 1) * p_other * math.log(p_other))


class SyntheticTokens:
    """Deterministic per (seed, rank): every run of the same job sees the same batches."""

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int = 0, rank: int = 0):
        self.seq_len, self.batch = seq_len, batch
        self.active = min(vocab, ACTIVE_VOCAB)
        g = torch.Generator().manual_seed(seed)  # the same rule on every rank
        perm = torch.randperm(self.active, generator=g)
        self.perm = perm
        # perm^j(x) in closed form from perm's cycles, so a batch is built without a Python loop
        # over positions: x sits at index pos[x] of a cycle of length clen[x] starting at base[x].
        order, base, pos, clen = [], torch.empty_like(perm), torch.empty_like(perm), torch.empty_like(perm)
        seen = torch.zeros(self.active, dtype=torch.bool)
        for start in range(self.active):
            if seen[start]:
                continue
            cycle, x = [], start
            while not seen[x]:
                seen[x] = True
                cycle.append(x)
                x = int(perm[x])
            for i, y in enumerate(cycle):
                base[y], pos[y], clen[y] = len(order), i, len(cycle)
            order.extend(cycle)
        self.order, self.base, self.pos, self.clen = torch.tensor(order), base, pos, clen
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)  # different samples per rank

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = self.batch, self.seq_len + 1
        restart = torch.rand(b, s, generator=self.gen) < NOISE
        restart[:, 0] = True
        fresh = torch.randint(self.active, (b, s), generator=self.gen)
        idx = torch.arange(s).expand(b, s)
        # For each position: where its segment began (the last restart) and the token drawn there.
        start = torch.where(restart, idx, torch.zeros_like(idx)).cummax(dim=1).values
        first = fresh.gather(1, start)
        steps = idx - start
        seq = self.order[self.base[first] + (self.pos[first] + steps) % self.clen[first]]
        return seq[:, :-1], seq[:, 1:]


class TokenFile:
    """A flat binary file of token ids, nanoGPT's format: uint16, or uint32 when vocab > 65536.

    Windows are drawn at random offsets (deterministic per seed and rank), memory-mapped, so a
    file larger than RAM works.
    """

    def __init__(self, path: str, vocab: int, seq_len: int, batch: int, seed: int = 0, rank: int = 0):
        n, itemsize = check_dataset(path, vocab, seq_len)
        self.dtype = torch.uint16 if itemsize == 2 else torch.uint32
        self.tokens = torch.from_file(str(path), shared=False, size=n, dtype=self.dtype)
        self.vocab, self.seq_len, self.batch = vocab, seq_len, batch
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_len + 1
        starts = torch.randint(len(self.tokens) - s, (self.batch,), generator=self.gen)
        seq = torch.stack([self.tokens[i: i + s].long() for i in starts.tolist()])
        return seq[:, :-1], seq[:, 1:]


def token_itemsize(vocab: int) -> int:
    """nanoGPT's prepare.py writes uint16 ids; a vocabulary past 65536 needs uint32."""
    return 2 if vocab <= 65536 else 4


def check_dataset(path: str, vocab: int, seq_len: int, scan: bool = True) -> tuple[int, int]:
    """(tokens, bytes per token) of a token file, refused with one line when it cannot train this model:
    not a file, a size that is not a whole number of ids, fewer tokens than one sequence, or (scan) any id
    at or past the vocabulary, looked for over the WHOLE file (a bad id at the end otherwise surfaces as an
    IndexError mid-run). numpy's memmap max reads a GB in about a second and keeps nothing resident."""
    import numpy as np

    field = "train.dataset"
    p = Path(path)
    if p.is_dir():
        raise ConfigError(field, f"{path} is a directory, not a file of token ids", "point it at the .bin file inside")
    if not p.exists():
        raise ConfigError(field, f"{path} does not exist", "give a .bin file of token ids, or leave it empty")
    if not p.is_file():
        raise ConfigError(field, f"{path} is not a regular file", "give a .bin file of token ids, or leave it empty")
    if not os.access(p, os.R_OK):
        raise ConfigError(field, f"{path} is not readable (permission denied)", "chmod u+r it")
    itemsize = token_itemsize(vocab)
    size = p.stat().st_size
    if size % itemsize:
        raise ConfigError(field, f"{path} is {size:,} bytes, not a whole number of {itemsize}-byte token ids",
                          f"write it as uint{itemsize * 8} (nanoGPT's format), or check it was fully copied")
    n = size // itemsize
    if n < seq_len + 2:
        raise ConfigError(field, f"{path} holds {n} tokens, fewer than one sequence of {seq_len + 1}",
                          "use a bigger file or a shorter train.seq_len")
    if scan:
        ids = np.memmap(p, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r")
        top = 0
        for start in range(0, n, CHUNK_TOKENS):  # chunks: the page cache can drop what was read
            top = max(top, int(ids[start:start + CHUNK_TOKENS].max()))
        if top >= vocab:
            where = _first_at_least(ids, vocab)
            raise ConfigError(field, f"token id {top} in {path} (first bad one at token {where:,}) is outside "
                              f"the model's vocab of {vocab}", "tokenize for this model, or fix model.vocab")
        del ids
    return n, itemsize


CHUNK_TOKENS = 1 << 26  # 128 MiB of uint16 per numpy reduction


def _first_at_least(ids, vocab: int) -> int:
    import numpy as np

    for start in range(0, len(ids), CHUNK_TOKENS):
        hit = np.flatnonzero(ids[start:start + CHUNK_TOKENS] >= vocab)
        if hit.size:
            return start + int(hit[0])
    return -1


def make_stream(dataset: str, vocab: int, seq_len: int, batch: int, seed: int, rank: int):
    if dataset:
        return TokenFile(dataset, vocab, seq_len, batch, seed, rank)
    return SyntheticTokens(vocab, seq_len, batch, seed, rank)
