"""The normal form of an update linear in its state: ``S_t = T_t(S_{t-1}) + W_t``.

Every state statement (lets, the model, temporaries and the symbolic gradient of a
quadratic loss inlined) is decomposed (:mod:`.linear`) into a sum of *terms* ``c L S R`` --
a token-local scalar ``c`` times a structured factor ``L`` acting on the rows (the key side)
of a state, times that state, times a factor ``R`` on its columns (the value side) -- plus a
sum of token-local outer products ``outer(a, b)`` (the increment).  A factor is the
identity, a diagonal ``Diag(d)`` (a per-channel gate, a view, any vector) or a rank one
``u wᵀ``; products of factors stay factors, so the normal form is closed under composing
statements.

Because the decomposition reads the algebra, not the syntax, the same transition written
any equivalent way has the same normal form: ``diag(d) @ S``, ``(S.T * d).T`` and
``S.T.T - diag(1 - d) @ S`` are the row scaling ``Diag(d)``; the explicit delta rule
``S + eta * outer(k, v - k @ S)`` and ``S - eta * grad(loss, S)`` of ``0.5 |k S - v|^2``
are both ``T = I - eta k kᵀ``, ``W = eta k vᵀ``.

:func:`normal_form` composes the statements into one transition per state (in the states
before the token; ``explain`` prints it) and keeps each statement's own map (the families
that run the program's sub-steps in order read those).  A value the decomposition cannot
write this way raises :class:`NotAdmitted` with the algebra that fails.

The chunk families take transitions on the key side; a state read and updated on its value
side (``C <- C Diag(g) + outer(v, k)`` read ``C @ q``) is the same algebra on ``Cᵀ``, which
:mod:`.sides` decides and writes (``describe`` then prints ``Cᵀ``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, unparse
from ..lang.normalize import canon
from .algebra import (ONE, SHOW_LETS, ZERO, Algebra, NotAdmitted, fold_lets, is_diag, is_num, mul, simplify,
                      state_updates, txt)
from .linear import I, Decomposer, Side, Term, after, dot, right_mul, times


# ------------------------------------------------------------------ the affine map of a statement
@dataclass(frozen=True)
class Affine:
    """``new = sum(terms) + sum_i outer(a_i, b_i)`` (``b_i`` a scalar for a vector state), every
    term a factor pair on one state (never transposed): the normal form of one value."""

    terms: tuple[Term, ...]
    incs: tuple[tuple[Expr, Expr], ...]
    vector: bool


def affine(dec: Decomposer, target: str, e: Expr) -> Affine:
    """The normal form of a state statement ``target = e``."""
    alg = dec.alg
    x = dec.lin(e)
    vector = target in dec.vector_states
    want = 1 if vector else 2
    if x.terms and x.rank != want:
        raise NotAdmitted(f"the update of {target} has rank {x.rank}, its state rank {want}")
    terms = []
    for t in x.terms:
        if t.t:
            raise NotAdmitted(f"the update of {target} transposes the state {t.state}")
        if vector != (t.state in dec.vector_states):
            raise NotAdmitted(f"the update of {target} mixes vector and matrix states")
        if vector and t.axis != "key":   # pragma: no cover - a vector state's value runs over its rows
            raise AssertionError("a vector state read along its columns")
        terms.append(t)
    incs = tuple(increments(alg, x.rest, target, vector))
    return Affine(tuple(terms), incs, vector)


def increments(alg: Algebra, A: Expr, S: str, vector: bool) -> list[tuple[Expr, Expr]]:
    """A token-local increment as ``sum_i outer(a_i, b_i)`` (matrix) or ``sum_i b_i * a_i`` (vector)."""
    A = simplify(A)
    if is_num(A, 0):
        return []
    if isinstance(A, BinOp) and A.op in "+-" and alg.rank(A.left) == alg.rank(A.right):
        right = increments(alg, A.right, S, vector)
        if A.op == "-":
            right = [(a, simplify(Neg(b))) for a, b in right]
        return increments(alg, A.left, S, vector) + right
    if isinstance(A, Neg):
        return [(a, simplify(Neg(b))) for a, b in increments(alg, A.operand, S, vector)]
    if not vector:
        if isinstance(A, Call) and A.fn == "outer":
            return [(A.args[0], A.args[1])]
        if isinstance(A, Transpose):   # (sum_i a_i b_iᵀ)ᵀ = sum_i b_i a_iᵀ
            return [(b, a) for a, b in increments(alg, A.operand, S, vector)]
        if isinstance(A, BinOp) and A.op == "@" and (is_diag(A.left) or is_diag(A.right)):
            d = (A.left if is_diag(A.left) else A.right).args[0]
            inner = increments(alg, A.right if is_diag(A.left) else A.left, S, vector)
            return [(times(d, a), b) if is_diag(A.left) else (a, times(b, d)) for a, b in inner]
        if isinstance(A, BinOp) and A.op in "*/":
            for m, f in ((A.left, A.right), (A.right, A.left)) if A.op == "*" else ((A.left, A.right),):
                sf = alg.shape(f)
                if sf is not None and len(sf) <= 1 and alg.rank(m) == 2:
                    f = f if A.op == "*" else simplify(BinOp("/", ONE, f))
                    return [(a, times(f, b) if len(sf) == 0 else times(b, f))
                            for a, b in increments(alg, m, S, vector)]
        raise NotAdmitted(f"the increment {txt(A)} of {S} is not a sum of outer products")
    if isinstance(A, BinOp) and A.op in "*/":
        for m, f in ((A.left, A.right), (A.right, A.left)) if A.op == "*" else ((A.left, A.right),):
            if alg.rank(f) == 0 and alg.rank(m) == 1:
                f = f if A.op == "*" else simplify(BinOp("/", ONE, f))
                return [(a, mul(b, f)) for a, b in increments(alg, m, S, vector)]
    if alg.rank(A) == 1:
        return [(A, ONE)]
    raise NotAdmitted(f"the increment {txt(A)} of {S} has an unsupported shape")


def apply(terms: tuple[Term, ...], env: dict[str, Affine], vector: bool) -> Affine:
    """``sum(terms)`` with each state replaced by its affine map ``env[state]``: a composition
    ``c L (c' L' S R' + sum outer(a, b)) R = c c' (L L') S (R' R) + sum outer(L a, Rᵀ b)``."""
    out_terms, out_incs = [], []
    for t in terms:
        m = env[t.state]
        for u in m.terms:
            c1, left = after(t.left, u.left)
            c2, right = (ONE, u.right) if vector else right_mul(u.right, t.right)
            out_terms.append(Term(mul(mul(t.coef, u.coef), mul(c1, c2)), u.state, left, right))
        for a, b in m.incs:
            a2, s1 = _side_vec(t.left, a)
            b2, s2 = (b, ONE) if vector else _side_vec(t.right.transposed(), b)
            scale = mul(t.coef, mul(s1, s2))
            out_incs.append((a2, mul(scale, b2) if vector else times(scale, b2)))
    return Affine(tuple(out_terms), tuple(out_incs), vector)


def _side_vec(f: Side, x: Expr) -> tuple[Expr, Expr]:
    """``f x`` for a token-local vector ``x``, as (a vector, a scalar factor)."""
    if f.kind == "I":
        return x, ONE
    if f.kind == "diag":
        return times(f.u, x), ONE
    if f.kind == "outer":
        return f.u, dot(f.w, x)
    raise AssertionError(f"a {f.kind} factor on an increment")  # pragma: no cover


# ------------------------------------------------------------------ the program
@dataclass(frozen=True)
class Statement:
    """One state statement of the program in normal form, in the states *it* sees."""

    target: str
    value: Affine


@dataclass(frozen=True)
class NormalForm:
    """Every state's affine map over the token, in the states before it, and the statements."""

    maps: dict = field(compare=False)          # state -> Affine in the states before the token
    statements: tuple[Statement, ...] = ()


def normal_form(alg: Algebra) -> NormalForm:
    """The update program as ``S_t = T_t(S_{t-1}) + W_t`` for every state (see the module
    docstring); raises NotAdmitted when a statement is not affine in the states.  Computed once
    per Algebra (every family that asks gets the same result or the same reason)."""
    if "normal_form" not in alg.memo:
        try:
            alg.memo["normal_form"] = _normal_form(alg)
        except NotAdmitted as err:    # "does not apply" is remembered; a bug propagates, uncached
            alg.memo["normal_form"] = err
    got = alg.memo["normal_form"]
    if isinstance(got, NotAdmitted):
        raise NotAdmitted(str(got))
    return got


def _normal_form(alg: Algebra) -> NormalForm:
    if not alg.states:
        raise NotAdmitted("the spec has no state")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    dec = Decomposer(alg)
    env = {n: Affine((Term(ONE, n, I, Side("vec", ONE) if n in dec.vector_states else I),), (),
                     n in dec.vector_states) for n in alg.states}
    statements = []
    for target, e in state_updates(alg):
        m = collect(alg, affine(dec, target, e))
        statements.append(Statement(target, m))
        composed = apply(m.terms, env, m.vector)
        env[target] = Affine(composed.terms, composed.incs + m.incs, m.vector)
    return NormalForm({n: collect(alg, env[n]) for n in alg.states}, tuple(statements))


def collect(alg: Algebra, m: Affine) -> Affine:
    """The canonical form of a map: scalar factors moved out of every factor and increment
    vector into the coefficients (``(eta k) kᵀ`` is ``eta k kᵀ``; ``outer(eta k, v)`` is
    ``outer(k, eta v)``), the diagonal factors of a state on the same value-side factor summed
    into one (``I - Diag(alpha)`` is ``Diag(1 - alpha)``), and equal factors' coefficients added."""
    out: dict = {}
    diag: dict = {}
    for t in m.terms:
        t = _pull_scalars(alg, t)
        if t.left.kind in ("I", "diag"):
            diag.setdefault((t.state, _side_key(t.right)), []).append(t)
            continue
        key = (t.state, _side_key(t.left), _side_key(t.right))
        out[key] = replace(out[key], coef=simplify(BinOp("+", out[key].coef, t.coef))) if key in out else t
    terms = []
    for (state, _), ts in diag.items():
        if all(t.left.kind == "I" for t in ts):
            coef = simplify(sum_of([t.coef for t in ts]))
            terms.append(replace(ts[0], coef=coef))
        else:
            d = diagonal(ts)
            terms.append(_pull_scalars(alg, replace(ts[0], coef=ONE, left=Side("diag", d))))
    terms += list(out.values())
    terms = tuple(t for t in terms if not is_num(simplify(t.coef), 0))
    incs = []
    for a, b in m.incs:
        s, x = split_scalar(alg, a)
        incs.append((x, simplify(mul(s, b)) if m.vector else times(s, b)))
    return Affine(terms, tuple(incs), m.vector)


def sum_of(xs: list[Expr]) -> Expr:
    out: Expr = ZERO
    for x in xs:
        out = BinOp("+", out, x)
    return out


def _pull_scalars(alg: Algebra, t: Term) -> Term:
    coef = t.coef
    sides = []
    for side in (t.left, t.right):
        if side.kind == "outer":
            su, u = split_scalar(alg, side.u)
            sw, w = split_scalar(alg, side.w)
            coef = mul(coef, mul(su, sw))
            side = Side("outer", u, w)
        elif side.kind == "diag":
            s, d = split_scalar(alg, side.u)
            if not is_num(d, 1):
                coef = mul(coef, s)
                side = Side("diag", d)
        sides.append(side)
    return replace(t, coef=simplify(coef), left=sides[0], right=sides[1])


def _side_key(s: Side):
    return (s.kind, canon(s.u) if s.u is not None else None, canon(s.w) if s.w is not None else None)


# ------------------------------------------------------------------ diagonal and rank-one parts
def diagonal(terms) -> Expr | None:
    """The one diagonal factor of key-side terms ``c I`` / ``c Diag(d)`` of a state: ``sum c d`` (a
    scalar when every term is ``c I``), or None when there is none."""
    total: Expr | None = None
    for t in terms:
        if t.left.kind not in ("I", "diag"):
            continue
        part = t.coef if t.left.kind == "I" else times(t.coef, t.left.u)
        total = part if total is None else simplify(BinOp("+", total, part))
    return total


def split_scalar(alg: Algebra, e: Expr) -> tuple[Expr, Expr]:
    """``e = s * x`` with ``s`` the product of the scalar factors of ``e`` (1 if none) and ``x`` the
    rest (the vector factors, in order)."""
    scalars: list[Expr] = []
    vectors: list[Expr] = []

    def walk(x: Expr) -> None:
        if alg.rank(x) == 0:   # a scalar factor stays whole (a let keeps its name in messages)
            scalars.append(x)
        elif isinstance(x, Neg):
            scalars.append(Num(-1))
            walk(x.operand)
        elif isinstance(x, BinOp) and x.op == "*":
            walk(x.left)
            walk(x.right)
        elif isinstance(x, BinOp) and x.op == "/" and alg.rank(x.right) == 0:
            walk(x.left)
            scalars.append(BinOp("/", ONE, x.right))
        else:
            vectors.append(x)

    walk(simplify(e))
    s: Expr = ONE
    for f in scalars:
        s = mul(s, f)
    x: Expr | None = None
    for f in vectors:
        x = f if x is None else BinOp("*", x, f)
    return simplify(s), (x if x is not None else ONE)


def as_expr(m: Affine, states: dict | None = None) -> Expr:
    """The normal form written back as an expression of the language (``diag(d) @ S``,
    ``outer(u, w @ S)``, ``outer(S @ u, w)``, ``outer(a, b)``); ``states`` renames the states."""
    out: Expr = ZERO
    for t in m.terms:
        x: Expr = Name((states or {}).get(t.state, t.state))
        if t.right.kind == "diag":
            x = BinOp("@", x, Call("diag", (t.right.u,)))
        elif t.right.kind == "outer":
            x = Call("outer", (BinOp("@", x, t.right.u), t.right.w))
        if t.left.kind == "diag":
            x = BinOp("@", Call("diag", (t.left.u,)), x)
        elif t.left.kind == "outer":
            x = Call("outer", (t.left.u, BinOp("@", t.left.w, x))) if not m.vector \
                else BinOp("*", t.left.u, BinOp("@", t.left.w, x))
        out = BinOp("+", out, BinOp("*", t.coef, x))
    for a, b in m.incs:
        out = BinOp("+", out, BinOp("*", b, a) if m.vector else Call("outer", (a, b)))
    return simplify(out)


def one_state(alg: Algebra, nf: NormalForm, family: str, value_diag: bool = False) -> tuple[str, Affine]:
    """The single matrix state of a transition acting on the key side only, and its map
    (NotAdmitted otherwise, with the algebra: coupled states, a value-side factor, ...);
    ``value_diag``: a rank-one term may carry a diagonal on the value side (``k kᵀ S Diag(d)``)."""
    states = list(alg.states)
    if len(states) != 1:
        links = [line for n in states for line in transition_text(nf.maps[n], n, states)
                 if not line.startswith((f"T[{n} <- {n}]", "T =", f"T({n})"))]
        if links:
            raise NotAdmitted(f"the states {', '.join(states)} are coupled linearly ({'; '.join(links)}): the "
                              f"{family} form has one state")
        raise NotAdmitted(f"the spec has {len(states)} states ({', '.join(states)}); the {family} form has one")
    S = states[0]
    m = nf.maps[S]
    if m.vector:
        raise NotAdmitted(f"state {S} is a vector; the {family} form needs a matrix")
    for t in m.terms:
        if t.right.kind != "I" and not (value_diag and t.right.kind == "diag" and t.left.kind == "outer"):
            raise NotAdmitted(f"the transition of {S} acts on its columns ({S} {side_text(t.right)}): the chunk "
                              f"kernels need a transition on the key side only")
    return S, m


def scalar_factors(e: Expr) -> tuple[float, list[Expr]]:
    """``e`` as a number times a product of factors (``x / y`` is ``x * (1 / y)``)."""
    num, out = 1.0, []

    def walk(x: Expr, power: int) -> None:
        nonlocal num
        x = simplify(x)
        if isinstance(x, Num):
            num = num * float(x.value) if power > 0 else num / float(x.value)
        elif isinstance(x, Neg):
            num = -num
            walk(x.operand, power)
        elif isinstance(x, BinOp) and x.op == "*":
            walk(x.left, power)
            walk(x.right, power)
        elif isinstance(x, BinOp) and x.op == "/" and not (isinstance(simplify(x.right), Num) and
                                                          float(simplify(x.right).value) == 0):
            walk(x.left, power)
            walk(x.right, -power)
        else:
            out.append(x if power > 0 else BinOp("/", ONE, x))

    walk(e, 1)
    return num, out


def ratio(a: Expr, b: Expr) -> Expr | None:
    """``a / b`` when every factor of ``b`` is a factor of ``a`` (compared by meaning): the product
    of the factors left; None when they do not cancel."""
    na, fa = scalar_factors(a)
    nb, fb = scalar_factors(b)
    if nb == 0:
        return None
    if not fb and nb == 1:
        return simplify(a)   # nothing to divide: a as written
    left = list(fa)
    keys = [canon(f) for f in left]
    for f in fb:
        k = canon(f)
        if k not in keys:
            return None
        i = keys.index(k)
        del keys[i], left[i]
    out: Expr = Num(na / nb) if (na / nb) != int(na / nb) else Num(int(na / nb))
    for f in left:
        out = mul(out, f)
    return simplify(out)


def without_factor(x: Expr, d: Expr) -> Expr | None:
    """``x / d`` when ``d`` is one of the factors of the product ``x`` (vectors elementwise, compared
    by meaning): the product of the others; None when it is not."""
    factors: list[Expr] = []

    def walk(e: Expr) -> None:
        e = simplify(e)
        if isinstance(e, BinOp) and e.op == "*":
            walk(e.left)
            walk(e.right)
        elif isinstance(e, Neg):
            factors.append(Num(-1))
            walk(e.operand)
        else:
            factors.append(e)

    walk(x)
    keys = [canon(f) for f in factors]
    if canon(simplify(d)) not in keys:
        return None
    del factors[keys.index(canon(simplify(d)))]
    out: Expr = ONE
    for f in factors:
        out = mul(out, f)
    return simplify(out)


# ------------------------------------------------------------------ printing
def side_text(s: Side) -> str:
    if s.kind == "I":
        return "I"
    if s.kind == "diag":
        return f"Diag({txt(s.u)})"
    if s.kind == "outer":
        return f"{vec_text(s.u)} {vec_text(s.w)}ᵀ"
    return vec_text(s.u)   # pragma: no cover - a consumed axis is never printed as an operator


def vec_text(e: Expr) -> str:
    folded = fold_lets(simplify(e), SHOW_LETS.get())
    t = unparse(folded)
    return t if isinstance(folded, (Name, Call)) else f"({t})"


def _coef_sign(c: Expr) -> tuple[int, Expr]:
    c = simplify(c)
    if isinstance(c, Neg):
        return -1, c.operand
    if isinstance(c, Num) and float(c.value) < 0:
        return -1, Num(-c.value)
    return 1, c


def join_terms(parts: list[tuple[int, str]]) -> str:
    out = ""
    for i, (sign, text) in enumerate(parts):
        if i == 0:
            out = ("-" if sign < 0 else "") + text
        else:
            out += (" - " if sign < 0 else " + ") + text
    return out or "0"


def scaled_text(c: Expr, op: str) -> tuple[int, str]:
    sign, mag = _coef_sign(c)
    if is_num(mag, 1):
        return sign, op
    ct = txt(mag)
    if isinstance(simplify(mag), BinOp) and simplify(mag).op in "+-":
        ct = f"({ct})"
    return sign, f"{ct} {op}"


def transition_text(m: Affine, state: str, states: list[str], shown: dict | None = None) -> list[str]:
    """``T = ...`` of a state's map: operator form when every factor acts on the key side
    (``T = (1 - alpha) I - eta k kᵀ``), else the map applied (``T(S) = ... S Diag(b)``); one line
    per state read when the map reads several (``T[W <- U] = mu I``).  ``shown``: how to print
    some states' names (``Cᵀ`` for a state the analysis reads transposed)."""
    shown = shown or {}
    state = shown.get(state, state)
    by_state: dict[str, list[Term]] = {}
    for t in m.terms:
        by_state.setdefault(t.state, []).append(t)
    lines = []
    for n in states:
        ts = by_state.get(n)
        if not ts:
            continue
        src = shown.get(n, n)
        name = "T" if src == state and len(by_state) == 1 else f"T[{state} <- {src}]"
        if all(t.right.kind in ("I", "vec") for t in ts):
            lines.append(f"{name} = {join_terms([scaled_text(t.coef, side_text(t.left)) for t in ts])}")
        else:
            parts = []
            for t in ts:
                left = "" if t.left.kind == "I" else side_text(t.left) + " "
                right = "" if t.right.kind == "I" else " " + side_text(t.right)
                parts.append(scaled_text(t.coef, f"{left}{src}{right}"))
            lines.append(f"{name}({src}) = {join_terms(parts)}")
    return lines


def increment_text(alg: Algebra, m: Affine) -> str:
    parts = []
    for a, b in m.incs:
        if m.vector:
            parts.append(scaled_text(b, vec_text(a)))
        else:
            s, x = split_scalar(alg, b)
            parts.append(scaled_text(s, f"{vec_text(a)} {vec_text(x)}ᵀ"))
    return join_terms(parts)


def increment_name(alg: Algebra) -> str:
    """The name of the increment in printed normal forms (``W``, unless a state has that name)."""
    return next(n for n in ("W", "A", "B", "C", "W_inc") if n not in alg.states)


def coupling(nf: NormalForm, alg: Algebra) -> str | None:
    """For states whose maps read each other: the block structure of their joint transition,
    ``[[1 - alpha, mu], [0, mu]] ⊗ I + rank one`` when every cross term is a scalar identity,
    in words; None when the states are independent."""
    states = list(alg.states)
    if not any(t.state != n for n in states for t in nf.maps[n].terms):
        return None
    rows, rank1 = [], 0
    for n in states:
        row = []
        for src in states:
            diag = [t for t in nf.maps[n].terms if t.state == src and t.left.kind in ("I", "diag")]
            if any(t.left.kind == "diag" or t.right.kind not in ("I", "vec") for t in diag):
                return f"the states {', '.join(states)} are coupled linearly through per-channel factors"
            row.append(txt(sum_of([t.coef for t in diag])) if diag else "0")
        rows.append("[" + ", ".join(row) + "]")
        rank1 += sum(t.left.kind == "outer" for t in nf.maps[n].terms)
    block = "[" + ", ".join(rows) + "]"
    return (f"the states ({', '.join(states)}) have one joint transition {block} ⊗ I"
            + (" plus rank-one terms" if rank1 else "") + ": a block decay that is not diagonal")


def describe(nf: NormalForm, alg: Algebra, shown: dict | None = None) -> list[str]:
    """The normal form in the spec's own names, one line per state:
    ``S <- T(S) + W with T = Diag(1 - alpha); W = k vᵀ`` (``shown``: as in :func:`transition_text`)."""
    states = list(alg.states)
    inc = increment_name(alg)
    out = []
    for n in states:
        m = nf.maps[n]
        ts = transition_text(m, n, states, shown) or ["T = 0"]
        s = (shown or {}).get(n, n)
        out.append(f"{s} <- T({s}) + {inc} with " + "; ".join(ts + [f"{inc} = {increment_text(alg, m)}"]))
    return out
