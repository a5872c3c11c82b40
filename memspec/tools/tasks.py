"""Training tasks: multi-query associative recall (MQAR, Zoology; Arora et al. 2023), and
byte-level language modelling on real text (:class:`TextTask`, below).

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

import functools
import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

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


# ------------------------------------------------------------------ real text
TEXT_SUFFIXES = (".py",)          # the default corpus: the standard library's Python sources
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus() -> Path:
    """The folder of the running Python's standard library (``sysconfig``'s ``stdlib`` path):
    real text that every machine with Python has."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    """A regular file whose first 8 KiB hold no NUL byte (binary files have them)."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def corpus_files(data_dir: str | Path | None = None) -> list[str]:
    """The corpus's files as sorted POSIX paths relative to the folder: for the default corpus
    its ``*.py`` files, for a given folder every text file; either way outside hidden folders,
    ``__pycache__`` and installed packages (``site-packages``, ``dist-packages``)."""
    root = default_corpus() if data_dir is None else Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"--data {str(root)!r} is not a folder")
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(p.startswith(".") or p in SKIPPED_DIRS for p in rel.parts[:-1]) or rel.name.startswith("."):
            continue
        if not path.is_file() or path.is_symlink():
            continue
        if data_dir is None and path.suffix not in TEXT_SUFFIXES:
            continue
        if data_dir is not None and not _is_text(path):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def held_out(rel_path: str, percent: int) -> bool:
    """Is this file in the held-out split?  A fixed function of its relative path (SHA-256),
    so the split is the same on every machine and a file never changes sides when others
    are added or removed."""
    digest = hashlib.sha256(rel_path.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


@functools.lru_cache(maxsize=4)
def _split_bytes(root: str | None, percent: int) -> tuple[tuple[torch.Tensor, tuple[str, ...]], ...]:
    files = corpus_files(root)
    if len(files) < 2:
        raise ValueError(f"the corpus {root or default_corpus()} has {len(files)} text file(s): "
                         "the held-out split needs at least 2")
    test = [f for f in files if held_out(f, percent)]
    if not test:                                         # a small folder: hold out one file
        test = [min(files, key=lambda f: hashlib.sha256(f.encode("utf-8", "surrogateescape")).digest())]
    if len(test) == len(files):
        test = test[:-1] if len(test) > 1 else test
    train = [f for f in files if f not in set(test)]
    base = default_corpus() if root is None else Path(root)
    out = []
    for names in (train, test):
        data = b"\n".join((base / f).read_bytes() for f in names)
        out.append((torch.frombuffer(bytearray(data), dtype=torch.uint8), tuple(names)))
    return tuple(out)


@dataclass(frozen=True)
class TextTask:
    """Byte-level language modelling on the text files of a folder.

    ``data_dir=None`` is the running Python's standard library (its ``*.py`` files; see
    :func:`default_corpus`).  The files are split by file: a file is held out when
    :func:`held_out` says so (about ``heldout_percent`` % of them; at least one), so no
    training sequence shares a byte with a held-out one.  ``split`` is ``"train"`` or
    ``"test"``; each split is its files' bytes joined by newlines, in path order.

    ``batch(n, seed)``: ``n`` windows of ``seq_len + 1`` bytes at offsets drawn from
    ``seed`` (as :meth:`MQAR.batch`: deterministic in the seed); inputs are the first
    ``seq_len`` bytes, targets the next byte at each position (int64, vocabulary 256; no
    ignored targets).  The metric is bits per byte: the mean cross-entropy in nats over
    ``ln 2`` (:func:`bits_per_byte`).
    """

    data_dir: str | None = None
    seq_len: int = 256
    split: str = "train"
    heldout_percent: int = 5

    vocab_size = 256

    def __post_init__(self):
        if self.split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {self.split!r}")
        if self.seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        if not 0 < self.heldout_percent < 100:
            raise ValueError("heldout_percent must be in [1, 99]")
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(Path(self.data_dir).resolve()))
        if self.data.numel() < self.seq_len + 1:
            raise ValueError(f"the {self.split} split has {self.data.numel()} bytes: too few for "
                             f"sequences of {self.seq_len} (+1) bytes")

    @property
    def data(self) -> torch.Tensor:
        """The split's bytes ``[N]`` (uint8)."""
        return _split_bytes(self.data_dir, self.heldout_percent)[self.split == "test"][0]

    @property
    def files(self) -> tuple[str, ...]:
        """The split's files (relative POSIX paths)."""
        return _split_bytes(self.data_dir, self.heldout_percent)[self.split == "test"][1]

    @property
    def chance(self) -> float:
        """Next-byte accuracy of a uniform guess."""
        return 1.0 / self.vocab_size

    def batch(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences from ``seed``: (inputs ``[n, seq_len]`` int64, targets ``[n, seq_len]``)."""
        g = torch.Generator().manual_seed(seed32(seed))
        data, T = self.data, self.seq_len
        starts = torch.randint(0, data.numel() - T, (n,), generator=g)               # [n]
        window = data[starts.unsqueeze(1) + torch.arange(T + 1)].long()               # [n, T + 1]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def bits_per_byte(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean cross-entropy of the non-ignored targets in bits (nats / ln 2)."""
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             ignore_index=-100)
    return loss.item() / math.log(2)
