"""Family ``oja``: a state transformed on its value side and read on its key side -- the gated Oja
rule (flash-linear-attention's ``gated_oja_rule``: ``S <- S Diag(g)``, then
``S + beta (k - S v) vᵀ``, read ``q @ S``).

The normal form (:mod:`.transition`) of one matrix state must be

    S <- S Diag(d) + c (S u) wᵀ + a wᵀ

every factor on the columns (the value side): a decay ``d`` (a scalar or one per value channel),
one rank-one correction ``c (S u) wᵀ`` built from token-local vectors, and writes ``outer(a_i, s_i w)``
along the same ``w``; the read takes the state only through probes ``p @ S`` (its rows, the key
side).  A decay that is a factor of ``u`` (a vector decay) or of ``c`` (a scalar one) means the
correction reads the state after the decay, as the Oja rule does.  No key-side family takes this
(the transition and the probes sit on opposite sides, :mod:`.sides`), but the algebra has an exact
chunked form: inside a chunk the corrections ``z_t = c_t (S_{t-1}' u_t) + a_t`` solve one triangular
system, the chunk's effect on the state is an affine map, and the outputs follow from the chunk's
start state (:mod:`memspec.runtime.oja`).

A spec written over ``Sᵀ`` (the transition on the rows, read ``Sᵀ``-side as ``S @ q``) is the same
algebra: it is analysed as :func:`.sides.transposed_spec` writes it, and the plan says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Expr, Name
from ..lang.normalize import canon
from .algebra import ZERO, Algebra, NotAdmitted, add, is_num, simplify, txt
from .delta import grad_reasons
from .linear import times
from .polynomial import Probe, find_probes
from .ranges import check_decay
from .sides import transposed_algebra
from .transition import (describe, normal_form, ratio, side_text, split_scalar, vec_text,
                         without_factor)


@dataclass(frozen=True)
class OjaPlan:
    """``S <- S Diag(decay) + z wᵀ`` with ``z = c (S' u) + a`` (``S'`` the state after the decay when
    ``read_after_decay``, else before it; ``u`` None: ``w``); ``decay`` None: 1, else a scalar or a
    ``[d_v]`` vector; ``transposed``: the spec declares the state as ``Sᵀ`` (the kernel runs on its
    transpose); ``probes`` the read's ``p @ S``."""

    state: str
    decay: Expr | None
    w: Expr
    u: Expr | None
    c: Expr
    a: Expr
    read_after_decay: bool
    transposed: bool
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool


# chunks of 32 tokens in sub-chunks of 8 (memspec.runtime.oja.chunk_oja's default) measured fastest on
# CPU with per-channel decays (the gated Oja rule, B=1 H=4 T=2048 D=64: 32 ms against 41-59 ms for
# chunks of 16 or 64)
CHANNEL_CHUNK = 32


def preferred_chunk(alg: Algebra, plan: OjaPlan):
    """(chunk, reason) for a decay; None (the default chunk) without one."""
    if plan.decay is None:
        return None
    return CHANNEL_CHUNK, (f"the decay acts on the value side: chunks of {CHANNEL_CHUNK} tokens in sub-chunks of 8 "
                           f"(ask for another size with schedule: chunk(N))")


def analyse_oja(alg: Algebra) -> tuple[OjaPlan, list[str]]:
    """The plan and its reasons for a value-side transition read on the key side; NotAdmitted with
    the algebra that fails otherwise (the declared orientation's reason when neither fits)."""
    try:
        return _analyse(alg, transposed=False)
    except NotAdmitted as declared:
        mats = [n for n, s in alg.states.items() if not s.cache and len(s.shape) == 2]
        if len(alg.states) != 1 or len(mats) != 1:
            raise
        try:
            return _analyse(transposed_algebra(alg, tuple(mats)), transposed=True)
        except NotAdmitted:
            raise declared from None


def _analyse(alg: Algebra, transposed: bool) -> tuple[OjaPlan, list[str]]:
    spec = alg.spec
    nf = normal_form(alg)
    states = list(alg.states)
    if len(states) != 1:
        raise NotAdmitted(f"the spec has {len(states)} states ({', '.join(states)}); the oja form has one")
    S = states[0]
    m = nf.maps[S]
    if m.vector:
        raise NotAdmitted(f"state {S} is a vector; the oja form transforms a matrix on its value side")
    rows = [t for t in m.terms if t.left.kind != "I"]
    if rows:
        raise NotAdmitted(f"the transition of {S} acts on its rows ({side_text(rows[0].left)} {S}): the oja form "
                          f"transforms the value side only")
    rank1 = [t for t in m.terms if t.right.kind == "outer"]
    if not rank1:
        raise NotAdmitted(f"the transition of {S} has no rank-one term on its value side (a decay alone is "
                          f"additive)")
    if len(rank1) > 1:
        raise NotAdmitted(f"the transition of {S} has {len(rank1)} rank-one terms on its value side; the oja "
                          f"form takes one")
    decay: Expr | None = ZERO
    for t in m.terms:
        if t.right.kind == "I":
            decay = add(decay, t.coef)
        elif t.right.kind == "diag":
            decay = add(decay, times(t.coef, t.right.u))
    decay = simplify(decay)
    if is_num(decay, 0):
        raise NotAdmitted(f"the update of {S} has decay 0 on its value side")
    decay = None if is_num(decay, 1) else decay
    r = rank1[0]
    c, u, w = r.coef, r.right.u, r.right.w
    a = _write(alg, S, m.incs, w)
    after = True
    if decay is not None:   # the correction reads S Diag(d): d is a factor of u (per channel) or of c (scalar)
        if alg.rank(decay) == 1:
            u_after = without_factor(u, decay)
            after = u_after is not None
            u = u_after if after else u
        else:
            c_after = ratio(c, decay)
            after = c_after is not None
            c = c_after if after else c
    reasons = grad_reasons(alg)
    reasons.append("normal form: " + describe(nf, alg, {S: f"{S}ᵀ"} if transposed else None)[0])
    reasons.append(_step_text(alg, S, decay, c, u, w, a, after)
                   + (" (the spec declares the state transposed: the module transposes it into and out of the "
                      "kernel)" if transposed else ""))
    if decay is not None:
        reasons.append(check_decay(alg, decay, f"of {S}"))
    read, probes = find_probes(alg, alg.inline(spec.read), {S})
    reasons.append("the read is a function of the key-side probes "
                   + ", ".join(txt(BinOp("@", p.vector, Name(p.state))) for p in probes) if probes
                   else "the read does not use the state")
    reasons.append(f"the state is transformed on its value side and read on its key side, which no key-side "
                   f"kernel takes; exact chunk form: the corrections z of a chunk solve one triangular system "
                   f"from the chunk's start state, the chunk's effect on {S} is an affine map {S} <- {S} M + D "
                   f"(the only sequential part), and every output follows from its chunk's start state")
    same_u = canon(u) == canon(w)
    return OjaPlan(S, decay, w, None if same_u else u, simplify(c), a, after, transposed, tuple(probes), read,
                   spec.order == "write_read"), reasons


def _write(alg: Algebra, S: str, incs, w: Expr) -> Expr:
    """The write ``a`` of ``sum_i outer(a_i, b_i)`` with every ``b_i`` a scalar times ``w``: ``sum_i s_i a_i``."""
    if not incs:
        raise NotAdmitted(f"the update of {S} writes nothing: the oja form writes along the vector of its "
                          f"rank-one term")
    sw, w_vec = split_scalar(alg, w)
    total: Expr = ZERO
    for a_i, b_i in incs:
        s, vec = split_scalar(alg, b_i)
        if canon(vec) != canon(w_vec):
            raise NotAdmitted(f"the write {vec_text(a_i)} {vec_text(b_i)}ᵀ of {S} is not along {vec_text(w)}, the "
                              f"vector its transition acts with: the oja form writes along that vector")
        scale = s if is_num(sw, 1) else BinOp("/", s, sw)
        total = add(total, times(simplify(scale), a_i))
    return simplify(total)


def _step_text(alg: Algebra, S: str, decay, c, u, w, a, after: bool) -> str:
    d = "" if decay is None else (f" Diag({txt(decay)})" if alg.rank(decay) == 1 else f" {vec_text(decay)}")
    seen = f"{S}{d}" if after else S
    coef = "" if is_num(simplify(c), 1) else f"{vec_text(c)} "
    return (f"a transition on the value side only, diagonal plus one rank-one correction: {S} <- {S}{d} + z "
            f"{vec_text(w)}ᵀ with z = {coef}({seen}) {vec_text(u)} + {vec_text(a)} (the correction reads the "
            f"state {'after' if after else 'before'} the decay)")
