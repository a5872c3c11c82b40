"""Family ``apply_update``: LaCT's large-chunk test-time training, asked for with
``schedule: apply_update(C)``.

Every state updates once per chunk of C tokens (a block update, :mod:`memspec.lang.blocks`):
each token of a chunk reads the state the previous chunk left (*apply*), and at the chunk's
last token the update statements run once with each gradient term replaced by its sum over
the chunk (*update*), e.g. ``W <- renorm(W - sum_t eta_t grad_t)``, or with Muon
``W <- W - NS5(sum_t eta_t grad_t)``.  An approximation of the token-by-token spec (every
gradient of a chunk is taken at its start) that equals it at C = 1.

The chunk step is exact for these semantics and cheap: the reads are one batched
application of the model at the held state, and every sum of gradient terms
``sum_t c_t grad(loss, W)_t`` with a token-local scalar ``c`` is one gradient of the chunk's
weighted loss ``sum_t c_t loss_t`` (one backward pass per distinct coefficient), so no
per-token gradient is formed.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.blocks import NotBlockwise, block_statements, mentions_gradient
from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, unparse
from .algebra import Algebra, NotAdmitted, grad_calls, simplify
from .online import loss_states, written_before_a_gradient


@dataclass(frozen=True)
class WeightedGrad:
    """``sum_t weight_t grad(loss, target)_t`` over a chunk: one gradient of the chunk's loss
    weighted by the token-local scalar ``weight``."""

    weight: Expr
    targets: tuple


@dataclass(frozen=True)
class ApplyUpdatePlan:
    """``blocks``: every state statement, updating once per chunk, with its gradient terms;
    ``terms``: (statement index, term index) -> the term as ``((sign, weight index, target), ...)``,
    a signed sum of the chunk sums ``weights[i]`` computes; ``weights``: the weighted gradients."""

    chunk: int
    blocks: tuple
    terms: dict
    weights: tuple


def analyse_apply_update(alg: Algebra, chunk: int) -> tuple[ApplyUpdatePlan, list[str]]:
    spec = alg.spec
    if not any(grad_calls(s.value) for s in spec.update):
        raise NotAdmitted("the update takes no gradient (a chunk update sums gradient terms)")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    own = {n: st.every for n, st in spec.state.items() if st.every}
    if own:
        raise NotAdmitted(", ".join(f"{n} has its own frequency (every {c})" for n, c in own.items())
                          + ": apply_update sets one for every state")
    try:
        blocks = block_statements(spec, {n: max(chunk, 2) for n in spec.state})
    except NotBlockwise as err:
        raise NotAdmitted(str(err)) from None
    reads = set(loss_states(spec))
    hit = written_before_a_gradient(spec, reads)
    if hit is not None:
        i = hit[1]
        changed = sorted({st.target for st in spec.update[:i]} & reads)
        raise NotAdmitted(f"statement {i + 1} takes a gradient after {', '.join(changed)} "
                          "changed within the token: take every gradient first (temporaries) so that the "
                          "chunk's gradients are all at its start")
    temps = {st.target: st.value for st in spec.update if st.target not in spec.state}
    for b in blocks:
        inside = {id(n) for t in b.terms for n in t.walk()}
        outside = {n.id for n in spec.update[b.index].value.walk()
                   if isinstance(n, Name) and n.id in temps and id(n) not in inside}
        if outside:
            raise NotAdmitted(f"the update of {b.target} reads the temporary {', '.join(sorted(outside))} outside "
                              "its gradient terms")
    weights: dict = {}
    terms: dict = {}
    for b in blocks:
        for k, t in enumerate(b.terms):
            parts = []
            for sign, w, target in _linear_grads(alg, t, temps):
                key = unparse(w)
                if key not in weights:
                    weights[key] = (w, [])
                if target not in weights[key][1]:
                    weights[key][1].append(target)
                parts.append((sign, list(weights).index(key), target))
            terms[(b.index, k)] = tuple(parts)
    wg = tuple(WeightedGrad(w, tuple(s for s in spec.state if s in ts)) for w, ts in weights.values())
    why = [f"apply_update({chunk}): each token of a chunk reads the state the previous chunk left, then every "
           "state updates once at the chunk's last token, its gradient terms summed over the chunk (chunk 1 "
           "equals online)"]
    for b in blocks:
        why.append(f"{b.target} <- {unparse(spec.update[b.index].value)} once per chunk, with "
                   + ", ".join(f"sum_t {unparse(t)}" for t in b.terms))
    why.append("each sum of gradient terms is the gradient of the chunk's weighted loss "
               + ", ".join(f"sum_t {unparse(w.weight)} * loss_t (for {', '.join(w.targets)})" for w in wg)
               + ": one backward pass each, no per-token gradient")
    return ApplyUpdatePlan(chunk, blocks, terms, wg), why


def _linear_grads(alg: Algebra, t: Expr, temps: dict, sign: int = 1, weight: Expr = Num(1)) -> list:
    """A gradient term as ``[(sign, weight, target), ...]`` with token-local scalar weights."""
    if isinstance(t, Call) and t.fn == "grad":
        return [(sign, simplify(weight), alg.grad_target(t))]
    if isinstance(t, Name) and t.id in temps:
        return _linear_grads(alg, temps[t.id], temps, sign, weight)
    if isinstance(t, Neg):
        return _linear_grads(alg, t.operand, temps, -sign, weight)
    if isinstance(t, BinOp) and t.op in "+-":
        right = _linear_grads(alg, t.right, temps, -sign if t.op == "-" else sign, weight)
        return _linear_grads(alg, t.left, temps, sign, weight) + right
    if isinstance(t, BinOp) and t.op in "*/":
        for a, g in ((t.left, t.right), (t.right, t.left)):
            if t.op == "/" and g is t.right:
                continue
            if mentions_gradient(g, temps):
                if not alg.is_scalar(alg.inline(a)):
                    raise NotAdmitted(f"`{unparse(t)}`: the coefficient {unparse(a)} of a gradient is not a scalar "
                                      "(a chunk's sum of it is no weighted loss)")
                w = BinOp("/", weight, a) if t.op == "/" else BinOp("*", weight, a)
                return _linear_grads(alg, g, temps, sign, w)
    raise NotAdmitted(f"`{unparse(t)}` is not a sum of scalar multiples of gradients")
