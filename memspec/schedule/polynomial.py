"""Polynomial structure of expressions in the state: degrees, linear forms with token-local
scalar coefficients, linear probes ``p @ S`` of a read, and the symbolic gradient of losses
quadratic (or linear) in a linear model's output.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose
from .algebra import ONE, ZERO, Algebra, NotAdmitted, add, is_num, mul, simplify, txt


@dataclass(frozen=True)
class Probe:
    """A linear probe ``vector @ state`` of the read, replaced by ``Name(name)`` in the plan's read."""

    name: str
    state: str
    vector: Expr


# ----------------------------------------------------- degree analysis
NONLIN = 99


def degree(alg: Algebra, e: Expr, X: set[str]) -> frozenset:
    """The polynomial degrees in which the names ``X`` occur in ``e`` (NONLIN: not polynomial).

    ``{0}``: independent of X; ``{1}``: linear; ``{0, 1}``: affine; ``{2}`` or ``{0, 1, 2}``:
    quadratic; anything containing NONLIN: not polynomial (e.g. inside ``gelu``)."""
    if isinstance(e, Num):
        return frozenset({0})
    if isinstance(e, Name):
        return frozenset({1 if e.id in X else 0})
    if isinstance(e, (Neg, Transpose)):
        return degree(alg, e.operand, X)
    if isinstance(e, BinOp):
        a, b = degree(alg, e.left, X), degree(alg, e.right, X)
        if e.op in "+-":
            return a | b
        if e.op in "*@":
            return frozenset(min(NONLIN, x + y) for x in a for y in b)
        if e.op == "/":
            return a if b == {0} else frozenset({NONLIN})
        if e.op == "^":
            if b != {0}:
                return frozenset({NONLIN})
            if a == {0}:
                return a
            if isinstance(e.right, Num) and float(e.right.value).is_integer() and e.right.value >= 0:
                n = int(e.right.value)
                out = {0}
                for _ in range(n):
                    out = {min(NONLIN, x + y) for x in out for y in a}
                return frozenset(out)
            return frozenset({NONLIN})
    if isinstance(e, Call):
        ds = [degree(alg, a, X) for a in e.args]
        if all(d == {0} for d in ds) and e.fn != "grad":
            return frozenset({0})
        if e.fn in ("sum", "mean") or e.fn == "outer":
            if e.fn == "outer":
                return frozenset(min(NONLIN, x + y) for x in ds[0] for y in ds[1])
            return ds[0]
        if e.fn == "grad":
            loss = alg.loss()
            t = alg.grad_target(e)
            if loss is None or t is None:
                return frozenset({NONLIN})
            dl = degree(alg, loss, X)
            if t not in X:
                return dl
            if NONLIN in dl:
                return frozenset({NONLIN})
            return frozenset({max(d - 1, 0) for d in dl}) or frozenset({0})
        return frozenset({NONLIN})
    return frozenset({NONLIN})


def nonlinear_site(alg: Algebra, e: Expr, X: set[str]) -> Expr | None:
    """The innermost subexpression where a name of X enters a non-polynomial operation."""
    for c in e.children():
        s = nonlinear_site(alg, c, X)
        if s is not None:
            return s
    if isinstance(e, Call) and e.fn not in ("sum", "mean", "outer", "grad"):
        if any(degree(alg, a, X) != {0} for a in e.args):
            return e
    if isinstance(e, BinOp) and e.op == "/" and degree(alg, e.right, X) != {0}:
        return e
    if isinstance(e, BinOp) and e.op == "^" and NONLIN in degree(alg, e, X):
        return e
    return None


def describe_degree(d: frozenset) -> str:
    if NONLIN in d:
        return "not polynomial"
    m = max(d)
    return {0: "independent", 1: "linear" if 0 not in d else "affine", 2: "quadratic"}.get(m, f"degree {m}")


# ------------------------------------------------- linear decomposition
def linear_form(alg: Algebra, e: Expr, X: set[str], what: str = "the state") -> tuple[dict, Expr]:
    """Write ``e = sum_x coef[x] * x + rest`` with token-local *scalar* coefficients.

    Raises NotAdmitted (with the algebra that fails) when ``e`` is not of that form."""
    if not alg.depends(e, X):
        return {}, e
    if isinstance(e, Name) and e.id in X:
        return {e.id: ONE}, ZERO
    if isinstance(e, Neg):
        c, r = linear_form(alg, e.operand, X, what)
        return {k: simplify(Neg(v)) for k, v in c.items()}, simplify(Neg(r))
    if isinstance(e, BinOp) and e.op in "+-":
        ca, ra = linear_form(alg, e.left, X, what)
        cb, rb = linear_form(alg, e.right, X, what)
        out = dict(ca)
        for k, v in cb.items():
            v = v if e.op == "+" else simplify(Neg(v))
            out[k] = add(out[k], v) if k in out else v
        return out, simplify(BinOp(e.op, ra, rb))
    if isinstance(e, BinOp) and e.op == "*":
        la, lb = alg.depends(e.left, X), alg.depends(e.right, X)
        if la and lb:
            raise NotAdmitted(f"{txt(e)} multiplies {what} by {what} (not affine)")
        inner, factor = (e.left, e.right) if la else (e.right, e.left)
        if not alg.is_scalar(factor):
            raise NotAdmitted(f"{txt(e)} scales {what} by {txt(factor)}, which is not a scalar")
        c, r = linear_form(alg, inner, X, what)
        return {k: mul(factor, v) for k, v in c.items()}, mul(factor, r)
    if isinstance(e, BinOp) and e.op == "/" and not alg.depends(e.right, X):
        if not alg.is_scalar(e.right):
            raise NotAdmitted(f"{txt(e)} divides {what} by {txt(e.right)}, which is not a scalar")
        c, r = linear_form(alg, e.left, X, what)
        return ({k: simplify(BinOp("/", v, e.right)) for k, v in c.items()},
                simplify(BinOp("/", r, e.right)))
    d = degree(alg, e, X)
    if d <= {0, 1}:
        raise NotAdmitted(f"{txt(e)} is linear in {what} but not a scalar multiple of it")
    site = nonlinear_site(alg, e, X)
    where = f" ({txt(site)})" if site is not None and site != e else ""
    raise NotAdmitted(f"{txt(e)} is {describe_degree(d)} in {what}{where}")


def probe_form(alg: Algebra, e: Expr, W: str) -> tuple[Expr, Expr] | None:
    """Write a vector ``e = p @ W + r`` with token-local ``p`` and ``r``; None if impossible."""
    if not alg.depends(e, {W}):
        return None, e
    if isinstance(e, BinOp) and e.op == "@":
        if alg.depends(e.left, {W}):
            return None
        try:
            c, r = linear_form(alg, e.right, {W})
        except NotAdmitted:
            return None
        if set(c) != {W} or alg.rank(e.left) != 1 or alg.rank(e.right) != 2:
            return None
        return mul(c[W], e.left), simplify(BinOp("@", e.left, r))
    if isinstance(e, Neg):
        f = probe_form(alg, e.operand, W)
        return None if f is None else (simplify(Neg(f[0])), simplify(Neg(f[1])))
    if isinstance(e, BinOp) and e.op in "+-":
        fa, fb = probe_form(alg, e.left, W), probe_form(alg, e.right, W)
        if fa is None or fb is None:
            return None
        (pa, ra), (pb, rb) = fa, fb
        if pa is not None and pb is not None:
            if pa != pb:  # two different probes: not one rank-1 gradient
                return None
            p = simplify(BinOp("*", pa, Num(2))) if e.op == "+" else ZERO
            if e.op == "-":
                return None  # p - p: W cancels; leave it to the caller as not a probe form
            return p, simplify(BinOp("+", ra, rb))
        p = pa if pa is not None else (pb if e.op == "+" else simplify(Neg(pb)))
        return p, simplify(BinOp(e.op, ra, rb))
    if isinstance(e, BinOp) and e.op in "*/":
        inner, factor = (e.left, e.right)
        if e.op == "*" and alg.depends(e.right, {W}):
            inner, factor = e.right, e.left
        if alg.depends(factor, {W}) or not alg.is_scalar(factor):
            return None
        f = probe_form(alg, inner, W)
        if f is None or f[0] is None:
            return f
        return simplify(BinOp(e.op, f[0], factor)), simplify(BinOp(e.op, f[1], factor))
    return None


def find_probes(alg: Algebra, read: Expr, states: set[str], prefix: str = "_p") -> tuple[Expr, list[Probe]]:
    """Replace every linear probe ``p @ S`` (token-local vector p, state S) by a placeholder name.

    Raises NotAdmitted when a state is used in the read other than through such probes."""
    probes: list[Probe] = []

    def walk(e: Expr) -> Expr:
        if isinstance(e, BinOp) and e.op == "@":
            for vec, st in ((e.left, e.right), (e.right, e.left)):
                if isinstance(st, Name) and st.id in states and not alg.depends(vec, states):
                    rank_s = alg.rank(st)
                    if alg.rank(vec) == 1 and (rank_s == 1 or (rank_s == 2 and st is e.right)):
                        for p in probes:
                            if p.state == st.id and p.vector == vec:
                                return Name(p.name)
                        name = f"{prefix}{len(probes)}"
                        probes.append(Probe(name, st.id, vec))
                        return Name(name)
        if isinstance(e, Name) and e.id in states:
            raise NotAdmitted(f"the read uses the state {e.id} other than through a linear probe p @ {e.id}")
        if isinstance(e, BinOp):
            return BinOp(e.op, walk(e.left), walk(e.right))
        if isinstance(e, Neg):
            return Neg(walk(e.operand))
        if isinstance(e, Transpose):
            return Transpose(walk(e.operand))
        if isinstance(e, Call):
            if e.fn == "grad":
                raise NotAdmitted("the read takes a gradient of the state")
            return Call(e.fn, tuple(walk(a) for a in e.args))
        return e

    try:
        out = walk(read)
    except NotAdmitted as err:
        site = state_site(read, states)
        raise NotAdmitted(f"{err}" + (f": {txt(site)}" if site is not None else "")) from None
    return out, probes


def state_site(e: Expr, states: set[str]) -> Expr | None:
    """The smallest call / operation of the read whose arguments contain a state outside a probe."""
    for c in e.children():
        s = state_site(c, states)
        if s is not None:
            return s
    if isinstance(e, Call) and any(isinstance(a, Name) and a.id in states for a in e.args):
        return e
    return None


# ------------------------------------------------------------ gradients
@dataclass(frozen=True)
class GradForm:
    """``grad(loss, W) = scale * outer(p, p @ W + r) + outer(p, lin)`` (any part may be absent)."""

    p: Expr | None
    scale: Expr | None      # quadratic part (None: no quadratic part)
    r: Expr | None
    lin: Expr | None        # linear part's second factor (token-local)
    text: str


def symbolic_grad(alg: Algebra, loss: Expr, W: str) -> GradForm:
    """Derive ``grad(loss, W)`` for losses quadratic (or linear) in a linear model's output."""
    terms: list[tuple[Expr, Expr]] = []  # (coefficient, core) with core = sum(...) / dot / norm^2

    def split(e: Expr, c: Expr):
        if not alg.depends(e, {W}):
            return
        if isinstance(e, BinOp) and e.op in "+-":
            split(e.left, c)
            split(e.right, c if e.op == "+" else simplify(Neg(c)))
        elif isinstance(e, Neg):
            split(e.operand, simplify(Neg(c)))
        elif isinstance(e, BinOp) and e.op == "*" and not alg.depends(e.left, {W}) and alg.is_scalar(e.left):
            split(e.right, mul(c, e.left))
        elif isinstance(e, BinOp) and e.op == "*" and not alg.depends(e.right, {W}) and alg.is_scalar(e.right):
            split(e.left, mul(c, e.right))
        elif isinstance(e, BinOp) and e.op == "/" and not alg.depends(e.right, {W}) and alg.is_scalar(e.right):
            split(e.left, simplify(BinOp("/", c, e.right)))
        else:
            terms.append((c, e))

    split(loss, ONE)
    p_all = None
    quad = None
    lin: Expr | None = None
    for c, core in terms:
        kind = loss_core(alg, core, W)
        if kind is None:
            d = degree(alg, core, {W})
            site = nonlinear_site(alg, core, {W})
            extra = f" ({txt(site)})" if site is not None else ""
            raise NotAdmitted(f"the loss {txt(loss)} is {describe_degree(d)} in {W}, "
                              f"not quadratic in a linear model's output{extra}")
        tag, p, r, k = kind
        if p_all is not None and p != p_all:
            raise NotAdmitted(f"the loss probes {W} with two different inputs ({txt(p_all)}, {txt(p)})")
        p_all = p
        if tag == "quad":
            if quad is not None:
                raise NotAdmitted(f"the loss has two quadratic terms in {W}")
            quad = (mul(c, k), r)
        else:
            term = mul(c, r)
            lin = term if lin is None else add(lin, term)
    if p_all is None:
        return GradForm(None, None, None, None, "0")
    if quad is None:
        text = f"outer({txt(p_all)}, {txt(lin)})"
        return GradForm(p_all, None, None, lin, text)
    scale, r = quad
    scale = simplify(BinOp("*", Num(2), scale))
    if lin is not None:  # fold linear terms into the quadratic one: outer(p, lin) = scale*outer(p, lin/scale)
        r = add(r, simplify(BinOp("/", lin, scale)))
    resid = simplify(BinOp("+", BinOp("@", p_all, Name(W)), r))
    text = txt(BinOp("*", scale, Call("outer", (p_all, resid))))
    return GradForm(p_all, scale, r, None, text)


def loss_core(alg: Algebra, core: Expr, W: str):
    """Recognise ``sum(R^2)``, ``mean(R^2)``, ``sum(R*R)``, ``norm(R)^2``, ``R @ R`` (quadratic) and
    ``sum(R*y)``, ``R @ y`` (linear), with ``R = p @ W + r``.  Returns (tag, p, r_or_y, k)."""
    def sq_arg(e):
        if isinstance(e, BinOp) and e.op == "^" and is_num(e.right, 2):
            return e.left
        if isinstance(e, BinOp) and e.op == "*" and e.left == e.right:
            return e.left
        return None

    def size(R):
        s = alg.shape(R)
        if s is None or len(s) != 1:
            return None
        return Name(s[0]) if s[0] in alg.spec.dims else None

    if isinstance(core, Call) and core.fn in ("sum", "mean") and len(core.args) == 1:
        inner = core.args[0]
        k: Expr = ONE
        if core.fn == "mean":
            R0 = sq_arg(inner) or (inner.left if isinstance(inner, BinOp) else inner)
            n = size(R0)
            if n is None:
                return None
            k = simplify(BinOp("/", ONE, n))
        R = sq_arg(inner)
        if R is not None:
            f = probe_form(alg, R, W)
            if f is None or f[0] is None or alg.rank(R) != 1:
                return None
            return ("quad", f[0], f[1], k)
        if isinstance(inner, BinOp) and inner.op == "*":
            for R, y in ((inner.left, inner.right), (inner.right, inner.left)):
                if not alg.depends(y, {W}) and alg.rank(y) == 1:
                    f = probe_form(alg, R, W)
                    if f is not None and f[0] is not None and alg.rank(R) == 1:
                        return ("lin", f[0], mul(k, y), k)
        return None
    if isinstance(core, BinOp) and core.op == "^" and is_num(core.right, 2) \
            and isinstance(core.left, Call) and core.left.fn == "norm":
        R = core.left.args[0]
        f = probe_form(alg, R, W)
        if f is None or f[0] is None or alg.rank(R) != 1:
            return None
        return ("quad", f[0], f[1], ONE)
    if isinstance(core, BinOp) and core.op == "@":
        if core.left == core.right:
            f = probe_form(alg, core.left, W)
            if f is not None and f[0] is not None and alg.rank(core.left) == 1:
                return ("quad", f[0], f[1], ONE)
            return None
        for R, y in ((core.left, core.right), (core.right, core.left)):
            if not alg.depends(y, {W}) and alg.rank(y) == 1:
                f = probe_form(alg, R, W)
                if f is not None and f[0] is not None and alg.rank(R) == 1:
                    return ("lin", f[0], y, ONE)
    return None
