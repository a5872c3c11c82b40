"""Values linear in the state, structurally: a sum of terms ``c L S R`` plus a part independent
of every state.

``c`` is a token-local scalar; ``L`` is a factor on the state's rows (the key side), ``R`` on
its columns (the value side); a factor is the identity, a diagonal ``Diag(d)`` or a rank one
``u wᵀ``, and products of factors stay factors (``Diag(a) u wᵀ = (a * u) wᵀ``,
``u wᵀ y zᵀ = (w @ y) u zᵀ``).  A vector or scalar linear in the state is a term with one or
two axes consumed by a vector (``pᵀ S``, ``S q``).  :class:`Decomposer` reads any expression
of the language this way -- ``diag(d) @ S``, ``S * b``, ``(S.T * d).T``, ``k @ S``,
``outer(k, v - k @ S)``, ``(eye(d) - outer(k, k)) @ S`` and the symbolic gradient of a
quadratic loss of a linear model -- or raises :class:`~.algebra.NotAdmitted` with the algebra
that is not linear.  :mod:`.transition` builds the update program's normal form on it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, substitute
from .algebra import ONE, ZERO, Algebra, NotAdmitted, is_diag, is_num, mul, simplify, txt
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


def dot(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("@", a, b))


def times(a: Expr, b: Expr) -> Expr:
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
            return ONE, Side("vec", times(new.u, old.u))
        if new.kind == "outer":
            return dot(new.w, old.u), Side("vec", new.u)
    if new.kind == "vec":   # a vector applied to a factor: uᵀ Diag(d) = (u * d)ᵀ, uᵀ y zᵀ = (u @ y) zᵀ
        if old.kind == "diag":
            return ONE, Side("vec", times(new.u, old.u))
        if old.kind == "outer":
            return dot(new.u, old.u), Side("vec", old.w)
    if new.kind == "diag" and old.kind == "diag":
        return ONE, Side("diag", times(new.u, old.u))
    if new.kind == "diag" and old.kind == "outer":
        return ONE, Side("outer", times(new.u, old.u), old.w)
    if new.kind == "outer" and old.kind == "diag":
        return ONE, Side("outer", new.u, times(new.w, old.u))
    if new.kind == "outer" and old.kind == "outer":
        return dot(new.w, old.u), Side("outer", new.u, old.w)
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
