"""Family ``online``: one token at a time -- always admitted, always exact.

The plan says which gradients the per-token step computes together: each ``grad(...)``
is taken at the state values its statement sees, and every later gradient that sees the
same values (up to the first statement that writes a state the loss reads) is computed
in the same ``torch.func.grad`` call -- or, where the loss has one (:mod:`.backprop`), in one
closed-form gradient program, which the per-token step emits as plain tensor code.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.blocks import block_statements, frequencies
from ..lang.expr import Call, Name, unparse
from .algebra import Algebra, grad_calls, txt
from .backprop import NoClosedForm, closed_grad, spec_names
from .stabiliser import Stabiliser, find_stabiliser


@dataclass(frozen=True)
class OnlinePlan:
    """``loss_states``: the states the loss reads, in state order; ``grad_groups``: for each
    update statement, the ``grad(...)`` calls to compute just before it (empty: none);
    ``closed``: for each group, its :class:`.backprop.ClosedGrad` (None: no group, or no
    closed form, and the step calls ``torch.func.grad``).
    ``blocks``: the statements of states updated once every C > 1 tokens
    (:class:`memspec.lang.blocks.BlockStatement`), whose gradient terms the step sums.
    ``stabiliser``: the states' shared exponential input weight and decay when the step carries
    them scaled by exp(-m) with xLSTM's max stabiliser m (:mod:`.stabiliser`), else None."""

    loss_states: tuple
    grad_groups: tuple
    closed: tuple = ()
    blocks: tuple = ()
    stabiliser: Stabiliser | None = None


def loss_states(spec) -> tuple:
    """The states the inner loss reads (directly or through the model), in state order."""
    if spec.loss is None:
        return ()
    used = {n.id for n in spec.loss.walk() if isinstance(n, Name)}
    if spec.model is not None and any(isinstance(c, Call) and c.fn == spec.model.name for c in spec.loss.walk()):
        used |= set(spec.model_states())
    return tuple(s for s in spec.state if s in used)


def written_before_a_gradient(spec, states) -> tuple[int, int] | None:
    """The first statement ``j`` that assigns one of ``states`` while a later statement ``i``
    takes a gradient, as ``(j, i)`` with ``i`` the first such gradient; None when every gradient
    of the token is taken before any of ``states`` changes (a chunk's gradients can then all be
    taken at its start)."""
    grads = [i for i, st in enumerate(spec.update) if grad_calls(st.value)]
    for j, st in enumerate(spec.update):
        later = [i for i in grads if i > j]
        if st.target in states and later:
            return j, later[0]
    return None


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


def closed_grads(spec, groups: tuple) -> tuple[tuple, list[str]]:
    """Each gradient group's closed-form gradient (None where it has none), and the reasons."""
    taken = spec_names(spec)
    out, reasons = [], []
    for group in groups:
        if not group:
            out.append(None)
            continue
        targets = [spec.model_states()[0] if len(c.args) == 1 else c.args[1].id for c in group]
        try:
            cg = closed_grad(spec, spec.loss, targets, taken)
        except NoClosedForm as err:
            out.append(None)
            reasons.append(f"no closed-form gradient of {', '.join(unparse(c) for c in group)} ({err}): "
                           "torch.func.grad")
            continue
        out.append(cg)
        reasons += cg.describe()
    return tuple(out), reasons


def analyse_online(alg: Algebra) -> tuple[OnlinePlan, list[str]]:
    spec = alg.spec
    reads = loss_states(spec)
    groups = grad_groups(spec, reads)
    closed, reasons = closed_grads(spec, groups)
    blocks = block_statements(spec, frequencies(spec))
    why = ["online: one token at a time, always exact"] + reasons
    for b in blocks:
        why.append(f"{b.target} updates every {b.every} tokens: the step adds "
                   + ", ".join(unparse(t) for t in b.terms) + f" to a running sum and applies "
                   f"`{unparse(spec.update[b.index].value)}` with the sum at each block's last token")
    stab, _ = find_stabiliser(alg) if not groups or not any(groups) else (None, "")
    if stab is not None:
        why.append(f"every state has the exponential input weight exp({txt(stab.log_input)}) and the decay "
                   f"{txt(stab.gamma)}: the step carries the states as exp(-m) times their value with the max "
                   f"stabiliser m <- max(log({txt(stab.gamma)}) + m, {txt(stab.log_input)}) (xLSTM), so that no "
                   f"exp overflows; the state goes out at its true scale")
    return OnlinePlan(reads, groups, closed, blocks, stab), why
