"""Values inside the reference interpreter: ``[B, H, ...]`` tensors whose named part is
``shape[2:]``, the scope of names one expression sees, where a token sits in the block updates,
and the located evaluation error."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..lang.expr import Expr


def named_shape(x: torch.Tensor) -> tuple[int, ...]:
    """The named part of a value's shape (everything after ``[B, H]``)."""
    return tuple(x.shape[2:])


@dataclass
class Scope:
    """Names visible while evaluating one expression."""

    token: dict[str, torch.Tensor]             # views, gates, lets of this token
    state: dict[str, torch.Tensor]             # current state values
    grad_memo: dict[int, torch.Tensor] | None = None  # mini-batch: grads taken on the shadow
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's argument
    temp: dict[str, torch.Tensor] = field(default_factory=dict)   # this token's temporaries so far
    terms: dict[int, torch.Tensor] | None = None   # a block update: id(gradient term) -> its block sum


class EvalError(ValueError):
    """An expression that cannot be evaluated, located at its span."""


def located(e: Expr) -> str:
    """``file:line:col: `` of ``e``'s span (empty when it has none)."""
    s = e.span
    return f"{s.file}:{s.line}:{s.col}: " if s is not None else ""


def align(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numpy trailing alignment of the named axes (after the leading [B, H])."""
    while a.dim() < b.dim():
        a = a.unsqueeze(2)
    while b.dim() < a.dim():
        b = b.unsqueeze(2)
    return a, b


def reduce_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim()))


@dataclass
class Block:
    """Where a token sits in the blocks of the block updates: its position, each learned
    state's frequency and the running sums of the open blocks' gradient terms."""

    pos: int
    every: dict
    acc: dict
