"""Block updates: what a state updated once every C tokens sums over its block.

A state declared with ``every C`` (``state W2 : [d, d] = zeros every 16``), and every state
under the ``apply_update(C)`` schedule, keeps its value for a block of C tokens.  Its update
statements run once, at the block's last token, with each **gradient term** replaced by the
sum of that term over the block's tokens (each token's term taken at the values that token
sees); everything else in the statement is evaluated at the last token.  C = 1 is the
token-by-token update.

A gradient term is a sub-expression linear in gradients with token-local coefficients:
``grad(...)``; a temporary holding one; ``-g``; ``g1 + g2``, ``g1 - g2``; ``a * g``,
``g * a``, ``g / a``, ``diag(a) @ g``, ``g @ diag(a)`` with ``a`` reading no state and no
gradient.  The *maximal* terms of a statement are summed: in
``W = l2norm((W - eta * grad(loss, W)).T).T`` that is ``eta * grad(loss, W)``, so a block
steps by the sum of its tokens' ``eta_t grad_t`` (LaCT's chunk update), and in
``W = W - newton_schulz(eta * grad(loss, W), 5)`` the Newton-Schulz iteration runs once, on
the block's summed gradient.  Nested Learning's continuum memory, a level that applies
its accumulated update every C tokens, is ``W = W - eta * grad(loss, W)`` with ``every C``.

:func:`block_statements` lists the block statements of a spec (the reference interpreter,
the checks and the schedules read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .expr import BinOp, Call, Expr, Name, Neg, is_diag


def gradient_terms(e: Expr, local: Callable[[Expr], bool], grad_temps: Iterable[str] = ()) -> list[Expr]:
    """The maximal gradient terms of ``e``, outermost first, left to right.

    ``local(a)``: is ``a`` token-local (no state, no gradient, no model application)?
    ``grad_temps``: temporaries whose value is itself a gradient term."""
    temps = set(grad_temps)

    def is_term(n: Expr) -> bool:
        if isinstance(n, Call) and n.fn == "grad":
            return True
        if isinstance(n, Name):
            return n.id in temps
        if isinstance(n, Neg):
            return is_term(n.operand)
        if isinstance(n, BinOp):
            if n.op in "+-":
                return is_term(n.left) and is_term(n.right)
            if n.op == "*":
                return (is_term(n.left) and local(n.right)) or (is_term(n.right) and local(n.left))
            if n.op == "/":
                return is_term(n.left) and local(n.right)
            if n.op == "@" and is_diag(n.left):
                return local(n.left.args[0]) and is_term(n.right)
            if n.op == "@" and is_diag(n.right):
                return local(n.right.args[0]) and is_term(n.left)
        return False

    out: list[Expr] = []

    def visit(n: Expr) -> None:
        if is_term(n):
            out.append(n)
            return
        for c in n.children():
            visit(c)

    visit(e)
    return out


def mentions_gradient(e: Expr, grad_temps: Iterable[str] = ()) -> bool:
    """Does ``e`` read a gradient (a ``grad(...)`` call or a temporary holding one)?"""
    temps = set(grad_temps)
    return any((isinstance(n, Call) and n.fn == "grad") or (isinstance(n, Name) and n.id in temps)
               for n in e.walk())


class NotBlockwise(ValueError):
    """A statement cannot be read as a block update: ``target`` (the state), ``problem`` (what is
    wrong) and ``hint`` (how to write it); ``str`` is ``"problem: hint"``."""

    def __init__(self, target: str, problem: str, hint: str):
        super().__init__(f"{problem}: {hint}")
        self.target, self.problem, self.hint = target, problem, hint


@dataclass(frozen=True)
class BlockStatement:
    """Update statement ``index`` assigns ``target`` once every ``every`` tokens; ``terms`` are its
    maximal gradient terms, each summed over the block's tokens."""

    index: int
    target: str
    every: int
    terms: tuple


def frequencies(spec) -> dict:
    """Each learned state's update frequency (1: every token)."""
    return {n: st.every or 1 for n, st in spec.state.items() if not st.cache}


def block_statements(spec, every: dict) -> tuple:
    """The statements of the states with ``every[s] > 1``, with their gradient terms.

    Raises :class:`NotBlockwise` when such a statement reads a temporary that mixes a state
    (or the model) with a gradient: its value would be the last token's, not a block sum."""
    states = set(spec.state)
    model = spec.model.name if spec.model is not None else None
    grad_temps: set = set()
    state_temps: set = set()

    def local(a: Expr) -> bool:
        for n in a.walk():
            if isinstance(n, Name) and n.id in states | grad_temps | state_temps:
                return False
            if isinstance(n, Call) and (n.fn == "grad" or n.fn == model):
                return False
        return True

    out = []
    for i, st in enumerate(spec.update):
        terms = gradient_terms(st.value, local, grad_temps)
        if st.target not in spec.state:
            if len(terms) == 1 and terms[0] is st.value:
                grad_temps.add(st.target)
            elif not local(st.value) or mentions_gradient(st.value, grad_temps):
                state_temps.add(st.target)
            continue
        c = every.get(st.target, 1)
        if c == 1:
            continue
        mixed = sorted({n.id for n in st.value.walk() if isinstance(n, Name) and n.id in state_temps
                        and mentions_gradient(spec.update[_assigned(spec, n.id)].value, grad_temps)})
        if mixed:
            raise NotBlockwise(st.target, f"{st.target} updates every {c} tokens but reads the temporary "
                               f"{', '.join(mixed)}, which mixes a state with a gradient",
                               "write the gradient into the statement so that the block sums it")
        out.append(BlockStatement(i, st.target, c, tuple(terms)))
    return tuple(out)


def _assigned(spec, temp: str) -> int:
    return next(i for i, st in enumerate(spec.update) if st.target == temp)
