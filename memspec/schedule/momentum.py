"""Family ``momentum``: two matrix states coupled linearly, a memory ``S`` and a momentum ``U``
whose joint transition is a 2x2 upper-triangular block decay (x) I plus one rank one on the
key side -- the momentum delta rule (Titans' memory with a linear model, flash-linear-
attention's momentum delta rule), however it is written -- exact in the chunked form of
:func:`memspec.runtime.momentum.chunk_momentum_delta` (one triangular solve per chunk).

The kernel runs ``M_t = mu_t M + eta_t outer(k_t, p_t @ S_{t-1} - v_t)``, ``S_t = gamma_t S -
beta_t M_t``.  In the states before the token that is

    M <- mu M + eta k pᵀ S - eta k vᵀ
    S <- gamma S - beta mu M - beta eta k pᵀ S + beta eta k vᵀ

The spec's normal form (:mod:`.transition`, composed over the program) has the same shape with
its own coefficients, the momentum a constant multiple of the kernel's, ``M = lam U``:

    U <- mu' U + a_U u wᵀ S + outer(u, c_U x)
    S <- g S + m U + a_S u wᵀ S + outer(u, c_S x)

Matching the two (``U`` reads no ``U``-side rank one, ``S`` reads ``U`` through a scalar only):
``gamma = g``, ``mu = mu'``, ``k = u``, ``p = w``, ``eta = lam a_U``, ``v = -(c_U / a_U) x`` and
``beta`` from ``-lam beta = m / mu' = a_S / a_U = c_S / c_U`` -- three ratios that must agree (the
memory takes the momentum's *new* value, with all of it: its decayed part, its correction and
its write).  ``lam`` is +1 or -1, chosen so that ``beta`` is written without a leading minus
(``U = mu U - eta grad``, ``W = (1 - alpha) W + U`` is the kernel with ``M = -U`` and ``beta = 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num
from ..lang.normalize import canon
from .algebra import Algebra, NotAdmitted, is_num, mul, simplify, txt
from .delta import grad_reasons
from .polynomial import Probe, find_probes
from .ranges import check_decay
from .transition import Affine, describe, normal_form, ratio, side_text, split_scalar


@dataclass(frozen=True)
class MomentumPlan:
    """``M_t = mu M + eta outer(k, p @ S_{t-1} - v)``, ``S_t = gamma S - beta M_t`` on the spec's
    memory ``state`` and momentum ``momentum``, with the kernel's ``M = sign * momentum``
    (``sign`` +1 or -1).  ``gamma`` / ``mu`` None: no decay (1); ``p`` None: ``p = k`` (the
    symmetric rule: the error is read at the write key)."""

    state: str
    momentum: str
    sign: int
    k: Expr
    p: Expr | None
    v: Expr
    gamma: Expr | None
    mu: Expr | None
    beta: Expr
    eta: Expr
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool


@dataclass(frozen=True)
class _Parts:
    """One state's map split into the terms the momentum form has (None: absent)."""

    self_coef: Expr | None       # c I on its own state
    cross_coef: Expr | None      # c I on the other state
    rank1: object | None         # the one rank-one Term (on the memory)
    inc: tuple[Expr, Expr] | None


def analyse_momentum(alg: Algebra) -> tuple[MomentumPlan, list[str]]:
    """The momentum family from the composed normal form of two coupled matrix states."""
    spec = alg.spec
    states = list(alg.states)
    if len(states) != 2:
        raise NotAdmitted(f"the spec has {len(states)} state{'s' if len(states) != 1 else ''}; the momentum form "
                          f"couples two (a memory and its momentum)")
    nf = normal_form(alg)
    for n in states:
        m = nf.maps[n]
        if m.vector:
            raise NotAdmitted(f"state {n} is a vector; the momentum form needs two matrix states")
        for t in m.terms:
            if t.right.kind != "I":
                raise NotAdmitted(f"the transition of {n} acts on the columns of {t.state} ({t.state} "
                                  f"{side_text(t.right)}): the momentum form acts on the key side only")
            if t.left.kind == "diag":
                raise NotAdmitted(f"the transition of {n} scales {t.state} per channel ({side_text(t.left)}): the "
                                  f"momentum form has scalar decays")
    if not any(t.state != n for n in states for t in nf.maps[n].terms):
        raise NotAdmitted(f"the states {', '.join(states)} are not coupled: the momentum form couples two")
    read = alg.inline(spec.read)
    read_by = [n for n in states if alg.depends(read, {n})]
    # the kernel reads the memory only: a read of one state names the memory, else try both
    orders = [tuple(states), tuple(states[::-1])]
    if len(read_by) == 1:
        orders = [o for o in orders if o[0] == read_by[0]]
    errors = []
    for S, U in orders:
        try:
            plan_parts = _match(alg, nf.maps[S], nf.maps[U], S, U)
        except NotAdmitted as err:
            errors.append(str(err))
            continue
        return _plan(alg, nf, S, U, *plan_parts)
    if len(errors) == 1 or errors[0] == errors[1]:
        raise NotAdmitted(errors[0])
    raise NotAdmitted(f"as memory {orders[0][0]}: {errors[0]}; as memory {orders[1][0]}: {errors[1]}")


def _split(alg: Algebra, m: Affine, own: str, other: str, memory: str) -> _Parts:
    own_c = cross_c = None
    rank1 = []
    for t in m.terms:
        if t.left.kind == "outer":
            if t.state != memory:
                raise NotAdmitted(f"{own}'s transition has a rank-one term on {t.state} ({side_text(t.left)} "
                                  f"{t.state}): the momentum form corrects through the memory only")
            rank1.append(t)
        elif t.state == own:
            own_c = t.coef
        else:
            cross_c = t.coef
    if len(rank1) > 1:
        raise NotAdmitted(f"{own}'s transition has {len(rank1)} rank-one terms per token: the momentum form has one")
    incs = _merged(alg, m.incs)
    if len(incs) > 1:
        raise NotAdmitted(f"the write of {own} is {len(incs)} outer products: the momentum form writes one")
    return _Parts(own_c, cross_c, rank1[0] if rank1 else None, incs[0] if incs else None)


def _merged(alg: Algebra, incs) -> list[tuple[Expr, Expr]]:
    """Outer products at the same key of the same vector (up to scalars) summed into one."""
    out: list[tuple[Expr, Expr, Expr]] = []    # (key, scalar, vector)
    for a, b in incs:
        c, x = split_scalar(alg, b)
        for i, (a2, c2, x2) in enumerate(out):
            if canon(a2) == canon(a) and canon(x2) == canon(x):
                out[i] = (a2, simplify(BinOp("+", c2, c)), x2)
                break
        else:
            out.append((a, c, x))
    return [(a, simplify(mul(c, x))) for a, c, x in out]


def _match(alg: Algebra, mS: Affine, mU: Affine, S: str, U: str):
    """(k, p, v, gamma, mu, eta, lam * beta) of memory S and momentum U, or NotAdmitted."""
    u_ = _split(alg, mU, U, S, S)
    s_ = _split(alg, mS, S, U, S)
    if u_.cross_coef is not None:
        raise NotAdmitted(f"{U} reads {S} through a scalar ({txt(u_.cross_coef)} {S}): the block decay is not "
                          f"triangular (a momentum sees its memory only through the error)")
    if u_.self_coef is None or is_num(simplify(u_.self_coef), 0):
        raise NotAdmitted(f"{U} keeps none of its own previous value: it is no momentum")
    if u_.rank1 is None or u_.inc is None:
        raise NotAdmitted(f"{U} takes no error step (a rank-one term on {S} and a write)")
    if s_.cross_coef is None:
        raise NotAdmitted(f"{S} does not take the momentum's previous value (no scalar term in {U})")
    mu = simplify(u_.self_coef)
    a_U = simplify(u_.rank1.coef)
    k, p = u_.rank1.left.u, u_.rank1.left.w
    x_k, b_U = u_.inc
    if canon(x_k) != canon(k):
        raise NotAdmitted(f"{U} writes at {txt(x_k)} but corrects at {txt(k)}: the momentum form writes at the key "
                          f"of its correction")
    c_U, x = split_scalar(alg, b_U)
    r = ratio(simplify(s_.cross_coef), mu)
    if r is None:
        raise NotAdmitted(f"the memory's step along the momentum ({txt(s_.cross_coef)}) is not a multiple of the "
                          f"momentum's decay ({txt(mu)}): {S} takes the momentum's previous value, not its new one")
    # S sees the new momentum: its correction and its write are the momentum's, times the same r
    if s_.rank1 is None or canon(s_.rank1.left.u) != canon(k) or canon(s_.rank1.left.w) != canon(p):
        raise NotAdmitted(f"{S} does not take the momentum's correction {side_text(u_.rank1.left)} {S}: it reads "
                          f"the momentum before its step")
    if s_.inc is None or canon(s_.inc[0]) != canon(k):
        raise NotAdmitted(f"{S} does not take the momentum's write at {txt(k)}")
    c_S, x_S = split_scalar(alg, s_.inc[1])
    r_rank1, r_inc = ratio(simplify(s_.rank1.coef), a_U), ratio(c_S, c_U)
    if canon(x_S) != canon(x) or r_rank1 is None or r_inc is None or len({canon(r), canon(r_rank1), canon(r_inc)}) > 1:
        raise NotAdmitted(f"{S} takes the momentum's decayed value, correction and write in different proportions "
                          f"({txt(r)}, {txt(r_rank1) if r_rank1 is not None else '?'}, "
                          f"{txt(r_inc) if r_inc is not None else '?'}): it is not S - beta M of the new momentum")
    gamma = simplify(s_.self_coef) if s_.self_coef is not None else Num(0)
    if is_num(gamma, 0):
        raise NotAdmitted(f"the update of {S} has decay 0")
    vscale = ratio(c_U, a_U)
    if vscale is None:
        raise NotAdmitted(f"the step size of {U}'s correction ({txt(a_U)}) and of its write ({txt(c_U)}) do not "
                          f"share a factor the analysis can divide out")
    v = simplify(mul(simplify(Neg(vscale)), x))
    return k, p, v, gamma, mu, a_U, r


def _plan(alg: Algebra, nf, S: str, U: str, k, p, v, gamma, mu, a_U, r) -> tuple[MomentumPlan, list[str]]:
    spec = alg.spec
    # -lam beta = r; lam = -1 keeps beta = r unless r is written negated
    neg = isinstance(r, Neg) or (isinstance(r, Num) and float(r.value) < 0)
    sign = 1 if neg else -1
    beta = simplify(Neg(r)) if neg else r
    eta = a_U if sign == 1 else simplify(Neg(a_U))
    reasons = grad_reasons(alg)
    reasons += ["normal form: " + line for line in describe(nf, alg)]
    decay_lines = [x for x in (check_decay(alg, None if is_num(gamma, 1) else gamma, f"of {S}"),
                               check_decay(alg, None if is_num(mu, 1) else mu, f"of the momentum {U}")) if x]
    Mk = f"{U}" if sign == 1 else f"-{U}"
    sym = canon(p) == canon(k)
    rec_M = BinOp("+", BinOp("*", mu, Name("M")), Call("outer", (Name("k"), BinOp("*", eta, BinOp(
        "-", BinOp("@", Name("p"), Name(S)), Name("v"))))))
    rec_S = BinOp("-", BinOp("*", gamma, Name(S)), BinOp("*", beta, Name("M")))
    reasons.append(f"momentum delta rule with M = {Mk}: M <- {txt(rec_M)}; {S} <- {txt(rec_S)} (the new M) with "
                   f"k = {txt(k)}, p = {txt(p)}{' (the key: symmetric)' if sym else ''}, v = {txt(v)}")
    bmu, beta_eta = (txt(simplify(Neg(mul(beta, x)))) for x in (mu, eta))
    reasons.append(f"the joint transition of ({S}, M) is [[{txt(gamma)}, {bmu}], [0, {txt(mu)}]] ⊗ I plus the rank "
                   f"one [{beta_eta}, {txt(eta)}] ⊗ k pᵀ on {S}: upper triangular, so every product of the 2x2 "
                   f"blocks is a 2x2 of scalars")
    reasons += decay_lines
    reasons.append("a departure the kernel makes: a log decay below -80 per token counts as -80 (the past then "
                   "weighs e^-80 = 2e-35 instead of less: different from online only where the state is over 1e28 "
                   "times the new terms)")
    read, probes = find_probes(alg, alg.inline(spec.read), {S, U})
    on_u = [pr for pr in probes if pr.state == U]
    if on_u:
        raise NotAdmitted(f"the read probes the momentum ({txt(BinOp('@', on_u[0].vector, Name(U)))}): the "
                          f"momentum kernel reads the memory {S} only")
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(txt(BinOp("@", pr.vector, Name(pr.state))) for pr in probes) if probes
                   else "the read does not use the state")
    reasons.append("exact chunk form: the 2x2 block products as masked decay matrices, one unit-lower-triangular "
                   "solve per chunk for the errors p_t @ S_{t-1} - v_t")
    plan = MomentumPlan(S, U, sign, k, None if sym else p, v, None if is_num(gamma, 1) else gamma,
                        None if is_num(mu, 1) else mu, beta, eta, tuple(probes), read, spec.order == "write_read")
    return plan, reasons

