"""The normal form of an update linear in its state: ``S_t = T_t(S_{t-1}) + W_t``.

Every state statement (lets, the model, temporaries and the symbolic gradient of a
quadratic loss inlined) is decomposed into a sum of *terms* ``c L R_cur Rt`` -- a
token-local scalar ``c`` times a structured factor ``L`` acting on the rows (the key side)
of a state, times that state, times a factor ``Rt`` on its columns (the value side) -- plus
a sum of token-local outer products ``outer(a, b)`` (the increment).  A factor is the
identity, a diagonal ``Diag(d)`` (a per-channel gate, a view, any vector) or a rank one
``u wᵀ``; products of factors stay factors (``Diag(a) u wᵀ = (a * u) wᵀ``,
``u wᵀ y zᵀ = (w @ y) u zᵀ``), so the normal form is closed under composing statements.

Because the decomposition reads the algebra, not the syntax, the same transition written
any equivalent way has the same normal form: ``diag(d) @ S``, ``(S.T * d).T`` and
``S.T.T - diag(1 - d) @ S`` are the row scaling ``Diag(d)``; the explicit delta rule
``S + eta * outer(k, v - k @ S)`` and ``S - eta * grad(loss, S)`` of ``0.5 |k S - v|^2``
are both ``T = I - eta k kᵀ``, ``W = eta k vᵀ``.

:func:`normal_form` composes the statements into one transition per state (in the states
before the token; ``explain`` prints it); :func:`substeps` keeps the program's own order as
rank-one sub-steps ``S <- Diag(d) S + a (bᵀ S) + outer(k, v)`` (what the chunked kernels
run).  A value the decomposition cannot write this way raises :class:`NotAdmitted` with
the algebra that fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, substitute, unparse
from ..lang.normalize import canon
from .algebra import (ONE, SHOW_LETS, ZERO, Algebra, NotAdmitted, fold_lets, is_diag, is_num, mul, simplify,
                      state_updates, txt)
from .polynomial import describe_degree, degree, nonlinear_site, symbolic_grad


# ------------------------------------------------------------------ factors
@dataclass(frozen=True)
class Side:
    """A factor on one axis of a state: ``I``, ``Diag(u)``, ``u wᵀ`` (``outer``), or -- once a
    value is a vector -- the vector ``u`` that consumed that axis (``vec``: ``uᵀ S`` on the
    key side, ``S u`` on the value side)."""

    kind: str                 # "I" | "diag" | "outer" | "vec"
    u: Expr | None = None
    w: Expr | None = None

    def transposed(self) -> "Side":
        return Side("outer", self.w, self.u) if self.kind == "outer" else self


I = Side("I")


def _dot(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("@", a, b))


def _times(a: Expr, b: Expr) -> Expr:
    """The elementwise product of two vectors (or a vector and a scalar)."""
    if is_num(a, 1):
        return b
    if is_num(b, 1):
        return a
    return mul(a, b)


def after(new: Side, old: Side) -> tuple[Expr, Side]:
    """``new · old`` (the factor ``old`` first, then ``new``) as (a scalar, a factor)."""
    if new.kind == "I":
        return ONE, old
    if old.kind == "I":
        return ONE, new
    if old.kind == "vec":   # old is a vector (a consumed axis): new acts on it
        if new.kind == "diag":
            return ONE, Side("vec", _times(new.u, old.u))
        if new.kind == "outer":
            return _dot(new.w, old.u), Side("vec", new.u)
    if new.kind == "vec":   # a vector applied to a factor: uᵀ Diag(d) = (u * d)ᵀ, uᵀ y zᵀ = (u @ y) zᵀ
        if old.kind == "diag":
            return ONE, Side("vec", _times(new.u, old.u))
        if old.kind == "outer":
            return _dot(new.u, old.u), Side("vec", old.w)
    if new.kind == "diag" and old.kind == "diag":
        return ONE, Side("diag", _times(new.u, old.u))
    if new.kind == "diag" and old.kind == "outer":
        return ONE, Side("outer", _times(new.u, old.u), old.w)
    if new.kind == "outer" and old.kind == "diag":
        return ONE, Side("outer", new.u, _times(new.w, old.u))
    if new.kind == "outer" and old.kind == "outer":
        return _dot(new.w, old.u), Side("outer", new.u, old.w)
    raise AssertionError(f"no product of factors {new.kind} · {old.kind}")  # pragma: no cover


def right_mul(r: Side, f: Side) -> tuple[Expr, Side]:
    """``r · f`` on the value side (``r`` first): ``(fᵀ · rᵀ)ᵀ``; ``f`` a vector consumes the axis."""
    c, side = after(f.transposed(), r.transposed())
    return c, side.transposed()


@dataclass(frozen=True)
class Term:
    """``coef · left · state · right`` (``(...)ᵀ`` when ``t``): one linear piece of a value.

    ``left`` acts on the state's rows (the key side), ``right`` on its columns (the value
    side); a ``vec`` side has consumed that axis, so a term with one ``vec`` side is a vector
    (of the other axis) and one with two is a scalar.  Only matrix terms are ever transposed."""

    coef: Expr
    state: str
    left: Side = I
    right: Side = I
    t: bool = False

    @property
    def rank(self) -> int:
        return (self.left.kind != "vec") + (self.right.kind != "vec")

    @property
    def axis(self) -> str:
        """For a vector term: ``key`` (its entries run over the state's rows) or ``value``."""
        return "value" if self.left.kind == "vec" else "key"

    def scaled(self, c: Expr) -> "Term":
        return replace(self, coef=mul(c, self.coef))

    def _with(self, c: Expr, **kw) -> "Term":
        return replace(self, coef=mul(c, self.coef), **kw)

    def on_left(self, f: Side) -> "Term":
        """``f · value`` (for a vector, ``f`` applied to its entries)."""
        if self.t:   # f (L S R)ᵀ = (L S R fᵀ)ᵀ
            c, r = right_mul(self.right, f.transposed())
            return self._with(c, right=r)
        if self.rank == 1 and self.axis == "value":   # f (pᵀ S R)ᵀ = (pᵀ S R fᵀ)ᵀ
            c, r = right_mul(self.right, f.transposed())
            return self._with(c, right=r)
        c, side = after(f, self.left)
        return self._with(c, left=side)

    def on_right(self, f: Side) -> "Term":
        """``value · f`` (for a vector, its entries times ``f``: ``fᵀ`` applied to them)."""
        if self.t:   # (L S R)ᵀ f = (fᵀ L S R)ᵀ
            c, side = after(f.transposed(), self.left)
            return self._with(c, left=side)
        if self.rank == 1 and self.axis == "key":      # (L S q)ᵀ f = (fᵀ L S q)ᵀ
            c, side = after(f.transposed(), self.left)
            return self._with(c, left=side)
        c, r = right_mul(self.right, f)
        return self._with(c, right=r)

    def untransposed(self) -> "Term":
        return replace(self, t=False)


@dataclass(frozen=True)
class Lin:
    """A value affine in the states: ``sum(terms) + rest`` (``rest`` independent of every state)."""

    terms: tuple[Term, ...]
    rest: Expr
    rank: int        # rank of the value's named shape: 0, 1 or 2

    def map(self, f) -> "Lin":
        return replace(self, terms=tuple(f(t) for t in self.terms))


def _neg(x: Lin) -> Lin:
    return replace(x.map(lambda t: t.scaled(Num(-1))), rest=simplify(Neg(x.rest)))


# ------------------------------------------------------------------ decomposition
class Decomposer:
    """Decomposes expressions of one spec into :class:`Lin` values (see the module docstring)."""

    def __init__(self, alg: Algebra):
        self.alg = alg
        self.states = set(alg.states)
        self.vector_states = {n for n, s in alg.states.items() if len(s.shape) == 1}

    def depends(self, e: Expr) -> bool:
        return self.alg.depends(e, self.states)

    def shape(self, e: Expr):
        s = self.alg.shape(e)
        if s is None:
            raise NotAdmitted(f"the shape of {txt(e)} is not known")
        return s

    def lin(self, e: Expr) -> Lin:
        if not self.depends(e):
            return Lin((), e, len(self.shape(e)))
        if isinstance(e, Name):
            if e.id in self.vector_states:   # a vector state z: a vector over its rows
                return Lin((Term(ONE, e.id, I, Side("vec", ONE)),), ZERO, 1)
            if len(self.alg.states[e.id].shape) != 2:
                raise NotAdmitted(f"state {e.id} is not a vector or a matrix")
            return Lin((Term(ONE, e.id),), ZERO, 2)
        if isinstance(e, Neg):
            return _neg(self.lin(e.operand))
        if isinstance(e, BinOp):
            if e.op in "+-":
                a, b = self.lin(e.left), self.lin(e.right)
                if e.op == "-":
                    b = _neg(b)
                if a.terms and b.terms and a.rank != b.rank:
                    raise NotAdmitted(f"{txt(e)} broadcasts a value that depends on the state")
                rank = max(a.rank, b.rank)
                if (a.terms and a.rank < rank) or (b.terms and b.rank < rank):
                    raise NotAdmitted(f"{txt(e)} broadcasts a value that depends on the state")
                return Lin(a.terms + b.terms, simplify(BinOp("+", a.rest, b.rest)), rank)   # b negated above
            if e.op == "@":
                return self.matmul(e)
            if e.op in "*/":
                return self.product(e)
            raise NotAdmitted(self._nonlinear(e))
        if isinstance(e, Transpose):
            x = self.lin(e.operand)
            if x.rank != 2:
                raise NotAdmitted(f"{txt(e)} transposes a vector")
            return replace(x.map(lambda t: replace(t, t=not t.t)), rest=simplify(Transpose(x.rest)))
        if isinstance(e, Call):
            return self.call(e)
        raise NotAdmitted(f"{txt(e)} is not affine in the state")  # pragma: no cover - all nodes above

    def product(self, e: BinOp) -> Lin:
        dl, dr = self.depends(e.left), self.depends(e.right)
        if e.op == "/" and dr:
            raise NotAdmitted(f"{txt(e)} divides by a value that depends on the state")
        if dl and dr:
            raise NotAdmitted(f"{txt(e)} multiplies the state by the state (not affine)")
        x_e, f = (e.left, e.right) if dl else (e.right, e.left)
        x = self.lin(x_e)
        sf = self.shape(f)
        if e.op == "/":
            f = simplify(BinOp("/", ONE, f))
        rest = simplify(BinOp("*", x.rest, f))
        if len(sf) == 0:
            return replace(x.map(lambda t: t.scaled(f)), rest=rest)
        if len(sf) == 1:
            if x.rank == 0:   # a scalar linear in the state times a vector: a (pᵀ S q) = (a pᵀ) S q
                return Lin(tuple(replace(t, left=Side("outer", f, t.left.u)) for t in x.terms), rest, 1)
            d = Side("diag", f)
            if x.rank == 2:   # a vector broadcasts on the trailing axis: it scales the columns
                return replace(x.map(lambda t: t.on_right(d)), rest=rest)
            return replace(x.map(lambda t: t.on_left(d)), rest=rest)   # the entries of a vector
        raise NotAdmitted(f"{txt(e)} multiplies the state elementwise by the matrix {txt(f)}")

    def matmul(self, e: BinOp) -> Lin:
        L, R = e.left, e.right
        if is_diag(L) or is_diag(R):
            d_e = (L if is_diag(L) else R).args[0]
            if self.depends(d_e):
                raise NotAdmitted(f"{txt(e)} scales by a value that depends on the state (not affine)")
            x = self.lin(R if is_diag(L) else L)
            d = Side("diag", d_e)
            rest = simplify(BinOp("@", L, x.rest) if is_diag(L) else BinOp("@", x.rest, R))
            if x.rank == 2 and not is_diag(L):
                return replace(x.map(lambda t: t.on_right(d)), rest=rest)
            return replace(x.map(lambda t: t.on_left(d)), rest=rest)   # rows, or a vector's entries
        dl, dr = self.depends(L), self.depends(R)
        if dl and dr:
            raise NotAdmitted(f"{txt(e)} multiplies the state by the state (not affine)")
        if dr:   # M @ x
            x, M = self.lin(R), L
            rest = simplify(BinOp("@", M, x.rest))
            if len(self.shape(M)) == 1:   # pᵀ x
                return Lin(tuple(self.probe(t, M, side="left") for t in x.terms), rest, x.rank - 1)
            ops = self.matrix(M)
            return Lin(tuple(t.on_left(s).scaled(c) for t in x.terms for c, s in ops), rest, x.rank)
        x, N = self.lin(L), R   # x @ N
        rest = simplify(BinOp("@", x.rest, N))
        if len(self.shape(N)) == 1:   # x q
            return Lin(tuple(self.probe(t, N, side="right") for t in x.terms), rest, x.rank - 1)
        ops = self.matrix(N)
        if x.rank == 1:   # a vector times a matrix: Nᵀ applied to its entries
            return Lin(tuple(t.on_left(s.transposed()).scaled(c) for t in x.terms for c, s in ops), rest, 1)
        return Lin(tuple(t.on_right(s).scaled(c) for t in x.terms for c, s in ops), rest, 2)

    def probe(self, t: Term, p: Expr, side: str) -> Term:
        """``p @ value`` (``side="left"``) or ``value @ p`` (``"right"``): one axis consumed by ``p``."""
        vec = Side("vec", p)
        if t.rank == 1:   # a dot product with a vector: consume its remaining axis
            if t.axis == "key":
                c, s = after(vec, t.left)
                return t._with(c, left=s)
            c, s = right_mul(t.right, vec)
            return t._with(c, right=s)
        if (side == "left") != t.t:   # pᵀ (L S R), or (L S R)ᵀ p = (pᵀ L S R)ᵀ
            c, s = after(vec, t.left)
            return t.untransposed()._with(c, left=s)
        c, s = right_mul(t.right, vec)   # (L S R) q, or pᵀ (L S R)ᵀ = (L S R p)ᵀ
        return t.untransposed()._with(c, right=s)

    def matrix(self, M: Expr) -> list[tuple[Expr, Side]]:
        """A token-local matrix as a sum of factors ``c F`` (identity, diagonal, rank one)."""
        if isinstance(M, Call) and M.fn == "eye":
            return [(ONE, I)]
        if isinstance(M, Call) and M.fn == "outer":
            return [(ONE, Side("outer", M.args[0], M.args[1]))]
        if isinstance(M, Neg):
            return [(mul(Num(-1), c), s) for c, s in self.matrix(M.operand)]
        if isinstance(M, BinOp) and M.op in "+-":
            right = self.matrix(M.right)
            if M.op == "-":
                right = [(mul(Num(-1), c), s) for c, s in right]
            return self.matrix(M.left) + right
        if isinstance(M, BinOp) and M.op in "*/":
            pairs = ((M.left, M.right), (M.right, M.left)) if M.op == "*" else ((M.left, M.right),)
            for m, f in pairs:
                if len(self.shape(f)) == 0:
                    c = f if M.op == "*" else simplify(BinOp("/", ONE, f))
                    return [(mul(c, c0), s) for c0, s in self.matrix(m)]
        if isinstance(M, BinOp) and M.op == "@":
            if is_diag(M.left) or is_diag(M.right):
                d = Side("diag", (M.left if is_diag(M.left) else M.right).args[0])
                out = []
                for c0, s in self.matrix(M.right if is_diag(M.left) else M.left):
                    c, side = after(d, s) if is_diag(M.left) else after(s, d)
                    out.append((mul(c, c0), side))
                return out
            out = []
            for ca, sa in self.matrix(M.left):
                for cb, sb in self.matrix(M.right):
                    c, side = after(sa, sb)
                    out.append((mul(mul(ca, cb), c), side))
            return out
        if isinstance(M, Transpose):
            return [(c, s.transposed()) for c, s in self.matrix(M.operand)]
        raise NotAdmitted(f"the state is multiplied by the matrix {txt(M)}, which is not a sum of a scaled "
                          f"identity, diagonals and rank-one outer products")

    def call(self, e: Call) -> Lin:
        if e.fn == "grad":
            return self.lin(self.gradient(e))
        if e.fn == "outer":
            a_e, b_e = e.args
            da, db = self.depends(a_e), self.depends(b_e)
            if da and db:
                raise NotAdmitted(f"{txt(e)} is the outer product of two values that depend on the state")
            if db:   # outer(a, x) = a xᵀ
                a, x = a_e, self.lin(b_e)
                out = []
                for t in x.terms:
                    if t.axis == "value":    # x = pᵀ S R: (a pᵀ) S R
                        out.append(replace(t, left=Side("outer", a, t.left.u)))
                    else:                    # x = L S q: a qᵀ Sᵀ Lᵀ = (L S q aᵀ)ᵀ
                        if t.state in self.vector_states:
                            raise NotAdmitted(f"{txt(e)} writes a vector state into a matrix")
                        out.append(replace(t, right=Side("outer", t.right.u, a), t=True))
                return Lin(tuple(out), simplify(Call("outer", (a, x.rest))), 2)
            x, b = self.lin(a_e), b_e    # outer(x, b) = x bᵀ
            out = []
            for t in x.terms:
                if t.axis == "key":          # x = L S q: L S (q bᵀ)
                    if t.state in self.vector_states:
                        raise NotAdmitted(f"{txt(e)} writes a vector state into a matrix")
                    out.append(replace(t, right=Side("outer", t.right.u, b)))
                else:                        # x = pᵀ S R: Rᵀ Sᵀ p bᵀ = (b pᵀ S R)ᵀ
                    out.append(replace(t, left=Side("outer", b, t.left.u), t=True))
            return Lin(tuple(out), simplify(Call("outer", (x.rest, b))), 2)
        raise NotAdmitted(self._nonlinear(e))

    def gradient(self, g: Call) -> Expr:
        """``grad(loss, W)`` of a loss quadratic (or linear) in a linear model: ``scale * outer(p,
        p @ W + r)`` (+ ``outer(p, lin)``), derived symbolically."""
        alg = self.alg
        W, loss = alg.grad_target(g), alg.loss()
        if W is None or loss is None:
            raise NotAdmitted("a gradient the analysis cannot derive")
        model = alg.model
        if model is not None and W in alg.spec.model_states():   # the model's own algebra first
            body = substitute(model.body, {k: v for k, v in alg.lets.items() if k != model.arg})
            d = degree(alg, body, {W})
            if not d <= {0, 1}:
                site = nonlinear_site(alg, body, {W})
                raise NotAdmitted(f"the model {model} is {describe_degree(d)} in {W}"
                                  + (f" ({txt(site)})" if site is not None else ""))
        gf = symbolic_grad(alg, loss, W)
        if gf.p is None:
            return ZERO
        if gf.scale is None:
            return Call("outer", (gf.p, gf.lin))
        return BinOp("*", gf.scale, Call("outer", (gf.p, BinOp("+", BinOp("@", gf.p, Name(W)), gf.r))))

    def _nonlinear(self, e: Expr) -> str:
        d = degree(self.alg, e, self.states)
        site = nonlinear_site(self.alg, e, self.states)
        where = f" ({txt(site)})" if site is not None and site != e else ""
        return f"{txt(e)} is {describe_degree(d)} in the state{where}"


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
        if isinstance(A, BinOp) and A.op == "@" and (is_diag(A.left) or is_diag(A.right)):
            d = (A.left if is_diag(A.left) else A.right).args[0]
            inner = increments(alg, A.right if is_diag(A.left) else A.left, S, vector)
            return [(_times(d, a), b) if is_diag(A.left) else (a, _times(b, d)) for a, b in inner]
        if isinstance(A, BinOp) and A.op in "*/":
            for m, f in ((A.left, A.right), (A.right, A.left)) if A.op == "*" else ((A.left, A.right),):
                sf = alg.shape(f)
                if sf is not None and len(sf) <= 1 and alg.rank(m) == 2:
                    f = f if A.op == "*" else simplify(BinOp("/", ONE, f))
                    return [(a, _times(f, b) if len(sf) == 0 else _times(b, f))
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
            out_incs.append((a2, mul(scale, b2) if vector else _times(scale, b2)))
    return Affine(tuple(out_terms), tuple(out_incs), vector)


def _side_vec(f: Side, x: Expr) -> tuple[Expr, Expr]:
    """``f x`` for a token-local vector ``x``, as (a vector, a scalar factor)."""
    if f.kind == "I":
        return x, ONE
    if f.kind == "diag":
        return _times(f.u, x), ONE
    if f.kind == "outer":
        return f.u, _dot(f.w, x)
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
    docstring); raises NotAdmitted when a statement is not affine in the states."""
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
        incs.append((x, simplify(mul(s, b)) if m.vector else _times(s, b)))
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
        part = t.coef if t.left.kind == "I" else _times(t.coef, t.left.u)
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


def one_state(alg: Algebra, nf: NormalForm, family: str) -> tuple[str, Affine]:
    """The single matrix state of a transition acting on the key side only, and its map
    (NotAdmitted otherwise, with the algebra: coupled states, a value-side factor, ...)."""
    states = list(alg.states)
    if len(states) != 1:
        links = [line for n in states for line in transition_text(nf.maps[n], n, states)
                 if not line.startswith((f"T[{n} <- {n}]", "T ="))]
        if links:
            raise NotAdmitted(f"the states {', '.join(states)} are coupled linearly ({'; '.join(links)}): the "
                              f"{family} form has one state")
        raise NotAdmitted(f"the spec has {len(states)} states ({', '.join(states)}); the {family} form has one")
    S = states[0]
    m = nf.maps[S]
    if m.vector:
        raise NotAdmitted(f"state {S} is a vector; the {family} form needs a matrix")
    for t in m.terms:
        if t.right.kind != "I":
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


# ------------------------------------------------------------------ printing
def side_text(s: Side) -> str:
    if s.kind == "I":
        return "I"
    if s.kind == "diag":
        return f"Diag({txt(s.u)})"
    if s.kind == "outer":
        return f"{_vec_text(s.u)} {_vec_text(s.w)}ᵀ"
    return _vec_text(s.u)   # pragma: no cover - a consumed axis is never printed as an operator


def _vec_text(e: Expr) -> str:
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


def _join(parts: list[tuple[int, str]]) -> str:
    out = ""
    for i, (sign, text) in enumerate(parts):
        if i == 0:
            out = ("-" if sign < 0 else "") + text
        else:
            out += (" - " if sign < 0 else " + ") + text
    return out or "0"


def _scaled(c: Expr, op: str) -> tuple[int, str]:
    sign, mag = _coef_sign(c)
    if is_num(mag, 1):
        return sign, op
    ct = txt(mag)
    if isinstance(simplify(mag), BinOp) and simplify(mag).op in "+-":
        ct = f"({ct})"
    return sign, f"{ct} {op}"


def transition_text(m: Affine, state: str, states: list[str]) -> list[str]:
    """``T = ...`` of a state's map: operator form when every factor acts on the key side
    (``T = (1 - alpha) I - eta k kᵀ``), else the map applied (``T(S) = ... S Diag(b)``); one line
    per state read when the map reads several (``T[W <- U] = mu I``)."""
    by_state: dict[str, list[Term]] = {}
    for t in m.terms:
        by_state.setdefault(t.state, []).append(t)
    lines = []
    for src in states:
        ts = by_state.get(src)
        if not ts:
            continue
        name = "T" if src == state and len(by_state) == 1 else f"T[{state} <- {src}]"
        if all(t.right.kind in ("I", "vec") for t in ts):
            lines.append(f"{name} = {_join([_scaled(t.coef, side_text(t.left)) for t in ts])}")
        else:
            parts = []
            for t in ts:
                left = "" if t.left.kind == "I" else side_text(t.left) + " "
                right = "" if t.right.kind == "I" else " " + side_text(t.right)
                parts.append(_scaled(t.coef, f"{left}{src}{right}"))
            lines.append(f"{name}({src}) = {_join(parts)}")
    return lines


def increment_text(alg: Algebra, m: Affine) -> str:
    parts = []
    for a, b in m.incs:
        if m.vector:
            parts.append(_scaled(b, _vec_text(a)))
        else:
            s, x = split_scalar(alg, b)
            parts.append(_scaled(s, f"{_vec_text(a)} {_vec_text(x)}ᵀ"))
    return _join(parts)


def increment_name(alg: Algebra) -> str:
    """The name of the increment in printed normal forms (``W``, unless a state has that name)."""
    return next(n for n in ("W", "A", "B", "C", "W_inc") if n not in alg.states)


def describe(nf: NormalForm, alg: Algebra) -> list[str]:
    """The normal form in the spec's own names, one line per state:
    ``S <- T(S) + W with T = Diag(1 - alpha); W = k vᵀ``."""
    states = list(alg.states)
    inc = increment_name(alg)
    out = []
    for n in states:
        m = nf.maps[n]
        ts = transition_text(m, n, states) or ["T = 0"]
        out.append(f"{n} <- T({n}) + {inc} with " + "; ".join(ts + [f"{inc} = {increment_text(alg, m)}"]))
    return out
