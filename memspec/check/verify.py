"""The verifier: ``check(spec) -> (graph, diagnostics)``.

Lowering (:func:`memspec.graph.lower`) types every expression; this module adds the
checks that need the whole spec or the whole graph.  Every diagnostic is located
at the offending span and carries its own code:

=====================  =========================================================
``E-identifier``       a declared name is not a plain, safe identifier
``E-duplicate``        one name declared in two sections (a view and a state ``k``)
``E-shadow``           the model's argument or name hides another name
``E-unknown-dim``      a shape or view width names an undeclared dim
``E-unknown-name``     an expression uses an undeclared name (with did-you-mean)
``E-unknown-function`` a call to a function outside the whitelist (did-you-mean)
``E-arity``            a function called with the wrong number of arguments
``E-shape``            shapes do not fit (both shapes in ``[d_k, d_v]`` notation)
``E-grad``             grad of a non-scalar loss, w.r.t. a non-state, without a
                       loss, with a first argument other than ``loss``, ambiguous
                       ``grad(loss)``, or outside the update program
``E-cache``            ``append``/``attend`` misuse; a cache assigned otherwise
``E-target``           an update statement assigns a declared name that is not a
                       state (a view, gate, let, ...)
``E-temp-shadow``      a temporary named like the model, its argument, ``loss`` or
                       ``logit``
``E-temp-twice``       a temporary assigned twice in one token
``E-temp-later``       a temporary used before (or in) the statement that assigns it
``E-temp-scope``       a temporary used outside the update program (read, let, loss,
                       model, gate)
``E-cycle``            a cycle within one token step (lets using each other)
``E-order``            something that uses a value only available later (a gate
                       using anything but logit/constants/dims/params; a let
                       reading state, applying the model or using a later let;
                       a model using a view, gate or let: the model is f(u; state))
``E-state-unwritten``  a state no update statement assigns
``E-state-unread``     a state whose value never reaches the output
``E-limit``            an expression that grows past the limits once inlined
                       (:mod:`memspec.check.complexity`)
``E-size``             a parameter or state tensor (or all of them) too large to allocate
                       (:mod:`memspec.check.sizes`; the message gives the bytes)
``W-state-temporary``  (warning) a state always overwritten before it is read in a
                       step (a per-token temporary carried for nothing)
``W-unused``           (warning) a let/view/gate/param/constant/dim/model/loss
                       that nothing uses
``W-grad-zero``        (warning) grad(loss, W) where the loss does not depend on W
``W-temp-unused``      (warning) a temporary no later update statement uses
``E-every``            a state updated ``every C`` tokens reads a temporary that mixes a
                       state with a gradient (a block sums gradient terms, see
                       :mod:`memspec.lang.blocks`)
``W-log-state``        (warning) ``log(S)`` of a state whose init has zeros or negative
                       entries (``log`` gives -inf / NaN at the first token)
=====================  =========================================================
"""
from __future__ import annotations

from typing import Iterable

import networkx as nx

from ..lang.errors import Diagnostic, sorted_diagnostics
from ..lang.names import RESERVED_NAMES
from . import declarations, order, statements, usage
from .complexity import inlined_problems
from .context import CheckContext
from .declarations import identifier_problem
from .graph import lower


def check(spec) -> tuple[nx.DiGraph, list[Diagnostic]]:
    """Lower ``spec`` and verify it: the graph and every diagnostic (errors and
    warnings, sorted by position).  The spec is valid when no diagnostic is an error."""
    too_large = inlined_problems(spec)
    if too_large:   # checked first: lowering and every later phase inline
        return nx.DiGraph(), [Diagnostic("error", m, sp, "name fewer, smaller steps; memspec inlines lets, "
                                         "temporaries and the model", "E-limit") for m, sp in too_large]
    graph = lower(spec)
    return graph, _verify(CheckContext(spec, graph))


def _verify(cx: CheckContext) -> list[Diagnostic]:
    """Every check in order (the declaration checks first: the later ones read what they learn)."""
    declarations.identifiers(cx)
    declarations.dims_in_shapes(cx)
    cx.d.extend(cx.g.graph.get("diagnostics", []))
    order.gates(cx)
    order.model_scope(cx)
    order.lets(cx)
    order.cycles(cx)
    statements.updates(cx)
    statements.loss_scalar(cx)
    usage.states(cx)
    usage.sizes(cx)
    statements.blocks(cx)
    # warnings only for an otherwise valid spec: with errors they are mostly echoes
    if not cx.d.errors:
        statements.grad_dependence(cx)
        usage.unused(cx)
        usage.log_states(cx)
    return _dedupe(sorted_diagnostics(cx.d.items))


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    seen, out = set(), []
    for d in diags:
        key = (d.severity, d.message, d.span, d.code)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def errors_of(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    return [d for d in diags if d.severity == "error"]


__all__ = ["RESERVED_NAMES", "check", "errors_of", "identifier_problem"]
