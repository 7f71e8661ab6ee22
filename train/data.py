"""Token batches for the smoke run: a learnable synthetic stream, or a local file of token ids.

The synthetic stream is a noisy walk over a fixed random permutation of an "active" vocabulary:
the next token is perm[token] with probability 1 - NOISE, otherwise uniform over the active
set. A model that learns the permutation drops from ln(vocab) towards the stream's entropy, so
the loss falls clearly within 100 steps for any model size, and the floor is known.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from checks.errors import ConfigError

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
        p = Path(path)
        if not p.is_file():
            raise ConfigError("train.dataset", f"{path} does not exist", "give a .bin file of token ids, or leave it empty")
        self.dtype = torch.uint16 if vocab <= 65536 else torch.uint32
        itemsize = 2 if self.dtype == torch.uint16 else 4
        n = p.stat().st_size // itemsize
        if n < seq_len + 2:
            raise ConfigError("train.dataset", f"{path} holds {n} tokens, fewer than one sequence of {seq_len + 1}",
                              "use a bigger file or a shorter train.seq_len")
        self.tokens = torch.from_file(str(p), shared=False, size=n, dtype=self.dtype)
        self.vocab, self.seq_len, self.batch = vocab, seq_len, batch
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        top = int(self.tokens[: min(n, 1 << 20)].long().max())  # uint16 has no max kernel
        if top >= vocab:
            raise ConfigError("train.dataset", f"token id {top} in {path} is outside the model's vocab of {vocab}",
                              "tokenize for this model, or fix model.vocab")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_len + 1
        starts = torch.randint(len(self.tokens) - s, (self.batch,), generator=self.gen)
        seq = torch.stack([self.tokens[i: i + s].long() for i in starts.tolist()])
        return seq[:, :-1], seq[:, 1:]


def make_stream(dataset: str, vocab: int, seq_len: int, batch: int, seed: int, rank: int):
    if dataset:
        return TokenFile(dataset, vocab, seq_len, batch, seed, rank)
    return SyntheticTokens(vocab, seq_len, batch, seed, rank)
