"""Schedule analysis: pick the fastest causal schedule a spec provably admits.

(Interface skeleton; the analysis itself is being written.)  The analysis reads the
spec's algebra -- is the update affine in the state, is the increment independent
of the state, is the model linear in the state, is the loss quadratic -- and never
the spec's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("cache", "additive", "delta", "minibatch", "online")


@dataclass(frozen=True)
class ScheduleDecision:
    family: str                 # one of FAMILIES
    exact: bool                 # equals online token-by-token learning exactly
    chunk: int | None           # chunk size (None for online / cache)
    reasons: tuple[str, ...] = ()   # the algebra behind the decision, one line each
    plan: Any = None            # family-specific plan consumed by codegen
    admits: tuple[str, ...] = ()    # every schedule this spec admits, e.g. ("delta", "online")
