"""Family ``online``: one token at a time -- always admitted, always exact.

The plan says which gradients the per-token step computes together: each ``grad(...)``
is taken at the state values its statement sees, and every later gradient that sees the
same values (up to the first statement that writes a state the loss reads) is computed
in the same ``torch.func.grad`` call.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.blocks import block_statements, frequencies
from ..lang.expr import Call, Name, unparse
from .algebra import Algebra


@dataclass(frozen=True)
class OnlinePlan:
    """``loss_states``: the states the loss reads, in state order; ``grad_groups``: for each
    update statement, the ``grad(...)`` calls to compute just before it (empty: none);
    ``blocks``: the statements of states updated once every C > 1 tokens
    (:class:`memspec.lang.blocks.BlockStatement`), whose gradient terms the step sums."""

    loss_states: tuple
    grad_groups: tuple
    blocks: tuple = ()


def loss_states(spec) -> tuple:
    """The states the inner loss reads (directly or through the model), in state order."""
    if spec.loss is None:
        return ()
    used = {n.id for n in spec.loss.walk() if isinstance(n, Name)}
    if spec.model is not None and any(isinstance(c, Call) and c.fn == spec.model.name for c in spec.loss.walk()):
        used |= set(spec.model_states())
    return tuple(s for s in spec.state if s in used)


def grad_groups(spec, loss_reads: tuple) -> tuple:
    """For each update statement, the grad calls to compute just before it: those it needs
    that are not yet known at the current state values, jointly with every later grad
    that sees the same values (up to and including the first statement that writes a
    state the loss reads)."""
    stmts = spec.update

    def calls(stmt):
        return [c for c in stmt.value.walk() if isinstance(c, Call) and c.fn == "grad"]

    groups: list = [() for _ in stmts]
    known: set = set()
    for i, stmt in enumerate(stmts):
        if any(unparse(c) not in known for c in calls(stmt)):
            group: dict = {}
            for j in range(i, len(stmts)):
                for c in calls(stmts[j]):
                    group.setdefault(unparse(c), c)
                if stmts[j].target in loss_reads:
                    break
            groups[i] = tuple(group.values())
            known = set(group)
        if stmt.target in loss_reads:
            known = set()
    return tuple(groups)


def analyse_online(alg: Algebra) -> tuple[OnlinePlan, list[str]]:
    spec = alg.spec
    reads = loss_states(spec)
    blocks = block_statements(spec, frequencies(spec))
    why = ["online: one token at a time, always exact"]
    for b in blocks:
        why.append(f"{b.target} updates every {b.every} tokens: the step adds "
                   + ", ".join(unparse(t) for t in b.terms) + f" to a running sum and applies "
                   f"`{unparse(spec.update[b.index].value)}` with the sum at each block's last token")
    return OnlinePlan(reads, grad_groups(spec, reads), blocks), why
