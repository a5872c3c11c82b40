"""Synthetic tasks: multi-query associative recall (MQAR, Zoology; Arora et al. 2023).

A sequence of ``seq_len`` tokens: ``pairs`` key-value pairs ``k1 v1 k2 v2 ...``, then
``gap`` pad tokens (default 0), then a query region where some of those keys appear
again (each at most once) followed by their value; every other position of the query
region is the pad token 0.  The gap puts every query at least ``gap + 1`` tokens after
the last value: with a gap beyond a model's receptive field through its sliding-window
attention and short convolutions, only a memory can carry the association.  The
target at a query key's position is its value; every other target is ``-100``
(ignored by ``cross_entropy``).  Keys are distinct within a sequence and drawn from
``[1, 1 + n_keys)``, values from ``[1 + n_keys, vocab_size)``, so chance accuracy is
``1 / n_values`` for a model that has learned to answer with a value token.

Generation is vectorised and deterministic in the seed (a ``torch.Generator``), so
every process of a distributed run builds the same global batch.  torch's CPU generator
keeps only the low 32 bits of a seed, so :func:`seed32` folds the high bits in (the
training loop puts the run's seed there): seeds below 2^32 are used as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MQAR:
    """The task's sizes.  ``queries`` defaults to as many as fit (at most ``pairs``)."""

    seq_len: int = 64
    pairs: int = 8
    vocab_size: int = 64
    queries: int | None = None
    gap: int = 0

    def __post_init__(self):
        if self.pairs < 1:
            raise ValueError("pairs must be >= 1")
        if self.gap < 0:
            raise ValueError("gap must be >= 0")
        if self.seq_len < 2 * self.pairs + self.gap + 2:
            after = f"{self.pairs} pairs" + (f" and a gap of {self.gap}" if self.gap else "")
            raise ValueError(f"seq_len={self.seq_len} leaves no room for a query after {after} "
                             f"(need >= {2 * self.pairs + self.gap + 2})")
        if self.n_keys < self.pairs or self.n_values < 2:
            raise ValueError(f"vocab_size={self.vocab_size} is too small for {self.pairs} distinct keys "
                             f"(need >= {2 * self.pairs + 1})")
        if self.queries is not None and not 1 <= self.queries <= self.max_queries:
            raise ValueError(f"queries must be in [1, {self.max_queries}]")

    @property
    def n_keys(self) -> int:
        return (self.vocab_size - 1) // 2

    @property
    def n_values(self) -> int:
        return self.vocab_size - 1 - self.n_keys

    @property
    def max_queries(self) -> int:
        return min(self.pairs, (self.seq_len - 2 * self.pairs - self.gap) // 2)

    @property
    def n_queries(self) -> int:
        return self.queries or self.max_queries

    @property
    def chance(self) -> float:
        return 1.0 / self.n_values

    def batch(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences from ``seed``: (inputs ``[n, seq_len]`` int64, targets ``[n, seq_len]``)."""
        g = torch.Generator().manual_seed(seed32(seed))
        P, Q, T = self.pairs, self.n_queries, self.seq_len
        keys = torch.rand(n, self.n_keys, generator=g).argsort(1)[:, :P] + 1           # distinct keys
        values = torch.randint(0, self.n_values, (n, P), generator=g) + 1 + self.n_keys
        x = torch.zeros(n, T, dtype=torch.long)
        x[:, 0:2 * P:2], x[:, 1:2 * P:2] = keys, values
        start = 2 * P + self.gap                                                    # the query region
        slots = (T - start) // 2                                                    # query slots (pairs of positions)
        where = torch.rand(n, slots, generator=g).argsort(1)[:, :Q]                  # which slots hold a query
        which = torch.rand(n, P, generator=g).argsort(1)[:, :Q]                      # which pairs are queried
        pos = start + 2 * where                                                     # [n, Q] query key positions
        qk, qv = keys.gather(1, which), values.gather(1, which)
        x.scatter_(1, pos, qk)
        x.scatter_(1, pos + 1, qv)
        y = torch.full((n, T), -100, dtype=torch.long)
        y.scatter_(1, pos, qv)
        return x, y


def seed32(seed: int) -> int:
    """A 64-bit seed as the 32 bits torch's generator keeps: the low half, XOR the high half
    times an odd constant (Knuth's multiplicative hash), so that seeds differing only in
    their high bits give different streams; a seed below 2^32 is unchanged."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return (seed & 0xFFFFFFFF) ^ (((seed >> 32) * 0x9E3779B1) & 0xFFFFFFFF)


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of the non-ignored targets that are the argmax of the logits."""
    mask = targets != -100
    if not mask.any():
        return float("nan")
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
