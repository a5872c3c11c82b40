"""Schedule analysis: pick the fastest causal schedule a spec provably admits.

The analysis reads the spec's *algebra* -- is the update affine in the state, is
the increment independent of the state, is the inner model linear in the state,
is the loss quadratic in the model output -- and never the spec's name.  Lets and
the inner model are inlined into the update and read expressions first, so two
specs that differ only in names or in how an expression is written get the same
decision.

Families, in order of preference (all admitted ones are listed in ``admits``):

0. ``cache``     every state is a cache written by ``append``; the read is
                 ``attend`` of a token-local query over the caches (exact, SDPA);
1. ``additive``  every state update is ``S = g_t*S + A_t`` (scalar token-local
                 ``g_t``, increment ``A_t`` independent of all states) and the
                 read is a function of linear probes ``p_t @ S`` (exact chunk form);
2. ``delta``     linear model ``f(u) = u @ W``, loss quadratic in the model output,
                 one gradient step with token-local scalar step size and optional
                 scalar decays before / after it (exact WY / UT chunk form);
3. ``minibatch`` gradient writes whose update program, with each ``grad(...)``
                 held as a token-local input, is a set of linear recurrences with
                 token-local scalar coefficients (approximation of online learning);
4. ``online``    always admitted, exact.

``analyse(spec)`` returns a :class:`ScheduleDecision`; ``explain(spec)`` renders it.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from ..lang.errors import Diagnostic, SpecError
from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, rewrite, substitute, unparse

FAMILIES = ("cache", "additive", "delta", "minibatch", "online")
DEFAULT_CHUNK = 64


@dataclass(frozen=True)
class ScheduleDecision:
    family: str                 # one of FAMILIES
    exact: bool                 # equals online token-by-token learning exactly
    chunk: int | None           # chunk size (None for online / cache)
    reasons: tuple[str, ...] = ()   # the algebra behind the decision, one line each
    plan: Any = None            # family-specific plan consumed by codegen
    admits: tuple[str, ...] = ()    # every schedule this spec admits, e.g. ("delta", "online")
    plans: dict = field(default_factory=dict, compare=False)   # family -> plan, for every admitted family
    rejected: tuple[tuple[str, str], ...] = ()  # (family, why not) for the families not admitted


# ----------------------------------------------------------------- plans
@dataclass(frozen=True)
class Probe:
    """A linear probe ``vector @ state`` of the read, replaced by ``Name(name)`` in the plan's read."""

    name: str
    state: str
    vector: Expr


@dataclass(frozen=True)
class AdditiveState:
    """``S_t = gamma_t * S_{t-1} + sum_i outer(a_i, b_i)`` (matrix state) or
    ``z_t = gamma_t * z_{t-1} + sum_i b_i * a_i`` (vector state, ``b_i`` a scalar).

    ``gamma`` is None when the state does not decay (gamma = 1)."""

    name: str
    gamma: Expr | None
    terms: tuple[tuple[Expr, Expr], ...]
    vector: bool


@dataclass(frozen=True)
class AdditivePlan:
    states: tuple[AdditiveState, ...]
    probes: tuple[Probe, ...]
    read: Expr                  # the read with every probe replaced by Name(probe.name)
    inclusive: bool             # write_read: token t reads the state after its own write


@dataclass(frozen=True)
class DeltaPlan:
    """``W_t = gamma_t W_{t-1} + outer(k_t, beta_t (v_t - rho_t k_t @ W_{t-1}))``.

    ``rho`` is the decay the error term sees: ``gamma`` (gradient at the decayed
    memory, the gated delta rule) unless a decay is written in the same statement as
    the gradient; ``None`` means rho = gamma.  ``gamma`` None means no decay."""

    state: str
    k: Expr
    v: Expr
    beta: Expr
    gamma: Expr | None
    rho: Expr | None
    probes: tuple[Probe, ...]
    read: Expr
    inclusive: bool


@dataclass(frozen=True)
class MinibatchPlan:
    """The update program as linear recurrences: ``new[S] = sum_R coef[S][R] * old[R] + rest[S]``.

    ``grads`` maps the placeholder names used in ``rest`` to the original ``grad(...)`` calls
    (evaluated at the chunk-start states in the mini-batch schedule)."""

    coef: dict
    rest: dict
    grads: dict
    chunk: int


@dataclass(frozen=True)
class CachePlan:
    appends: tuple[tuple[str, Expr], ...]          # (cache, token-local vector)
    attends: tuple[tuple[str, Expr, str, str, Expr], ...]  # (placeholder, q, K, V, scale)
    read: Expr                                      # read with attend(...) replaced by placeholders
    windows: dict                                   # cache -> window (None: growing)
    inclusive: bool


class NotAdmitted(Exception):
    """One family does not apply; ``str(err)`` says why (one line of algebra)."""


# ---------------------------------------------------------- expressions
ZERO, ONE = Num(0), Num(1)

def _is_num(e: Expr, v: float | None = None) -> bool:
    return isinstance(e, Num) and (v is None or float(e.value) == v)


def _num(v: float) -> Num:
    return Num(int(v) if float(v).is_integer() and abs(v) < 1e15 else float(v))


def simplify(e: Expr) -> Expr:
    """Fold numbers and the neutral elements 0 and 1 (for readable plans and messages)."""
    if isinstance(e, BinOp):
        a, b = simplify(e.left), simplify(e.right)
        op = e.op
        if _is_num(a) and _is_num(b) and op in "+-*/" and not (op == "/" and _is_num(b, 0)):
            x, y = float(a.value), float(b.value)
            return _num({"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else 0}[op])
        if op == "+":
            if _is_num(a, 0):
                return b
            if _is_num(b, 0):
                return a
            if isinstance(b, Neg):
                return simplify(BinOp("-", a, b.operand))
            if isinstance(b, BinOp) and b.op in "*/" and isinstance(b.left, Neg):
                return BinOp("-", a, BinOp(b.op, b.left.operand, b.right))
            if isinstance(b, Num) and float(b.value) < 0:
                return BinOp("-", a, _num(-float(b.value)))
        if op == "-":
            if _is_num(b, 0):
                return a
            if _is_num(a, 0):
                return simplify(Neg(b))
            if isinstance(b, Neg):
                return simplify(BinOp("+", a, b.operand))
        if op == "*":
            if _is_num(a, 0) or _is_num(b, 0):
                return ZERO
            if _is_num(a, 1):
                return b
            if _is_num(b, 1):
                return a
            if _is_num(a, -1):
                return simplify(Neg(b))
            if _is_num(b, -1):
                return simplify(Neg(a))
            if isinstance(a, Neg) or isinstance(b, Neg):
                x = a.operand if isinstance(a, Neg) else a
                y = b.operand if isinstance(b, Neg) else b
                inner = simplify(BinOp("*", x, y))
                return inner if isinstance(a, Neg) and isinstance(b, Neg) else simplify(Neg(inner))
        if op == "/":
            if _is_num(b, 1):
                return a
            if isinstance(a, Neg):
                return simplify(Neg(BinOp("/", a.operand, b)))
            if _is_num(a, 0):
                return ZERO
        if op == "@" and (_is_num(a, 0) or _is_num(b, 0)):
            return ZERO
        return BinOp(op, a, b)
    if isinstance(e, Neg):
        a = simplify(e.operand)
        if isinstance(a, Neg):
            return a.operand
        if _is_num(a):
            return _num(-float(a.value))
        return Neg(a)
    if isinstance(e, Transpose):
        return Transpose(simplify(e.operand))
    if isinstance(e, Call):
        args = tuple(simplify(a) for a in e.args)
        if e.fn == "outer" and any(_is_num(a, 0) for a in args):
            return ZERO
        return Call(e.fn, args)
    return e


def _mul(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("*", a, b))


def _add(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("+", a, b))


def _names(e: Expr) -> set[str]:
    return {n.id for n in e.walk() if isinstance(n, Name)}


_SHOW_LETS: contextvars.ContextVar = contextvars.ContextVar("_SHOW_LETS", default=())


def _fold_lets(e: Expr, lets) -> Expr:
    """Write subexpressions equal to a let's inlined value as the let's name (for messages)."""
    for inl, n in lets:
        if e == inl:
            return Name(n)
    if isinstance(e, BinOp):
        return BinOp(e.op, _fold_lets(e.left, lets), _fold_lets(e.right, lets))
    if isinstance(e, (Neg, Transpose)):
        return type(e)(_fold_lets(e.operand, lets))
    if isinstance(e, Call):
        return Call(e.fn, tuple(_fold_lets(a, lets) for a in e.args))
    return e


def _txt(e: Expr) -> str:
    e = simplify(e)
    lets = _SHOW_LETS.get()
    return unparse(_fold_lets(e, lets) if lets else e)


# ------------------------------------------------------------- context
class Algebra:
    """A spec with lets and the model inlined, plus shape inference on named dims."""

    def __init__(self, spec):
        self.spec = spec
        self.states = dict(spec.state)
        self.caches = {n for n, s in spec.state.items() if s.cache}
        self.model = spec.model
        self.shapes: dict[str, tuple] = {}
        for n in spec.dims:
            self.shapes[n] = ()
        for n in spec.constants:
            self.shapes[n] = ()
        for n, v in spec.views.items():
            self.shapes[n] = (v.dim,)
        for n in spec.gates:
            self.shapes[n] = ()
        for n, p in spec.params.items():
            self.shapes[n] = tuple(p.shape)
        for n, s in spec.state.items():
            self.shapes[n] = (("n",) if s.cache else ()) + tuple(s.shape)
        self.lets: dict[str, Expr] = {}
        for n, e in spec.let.items():
            inl = self.inline(e)
            self.lets[n] = inl
            self.shapes[n] = self.shape(inl)

    # -- inlining
    def inline(self, e: Expr) -> Expr:
        """Substitute lets and apply the inner model (``f(x)`` -> body with ``u := x``)."""
        e = substitute(e, self.lets) if self.lets else e
        return self._apply_model(e)

    def _apply_model(self, e: Expr) -> Expr:
        if isinstance(e, Call):
            args = tuple(self._apply_model(a) for a in e.args)
            if self.model is not None and e.fn == self.model.name and len(args) == 1:
                body = substitute(self.model.body, {k: v for k, v in self.lets.items() if k != self.model.arg})
                return substitute(body, {self.model.arg: args[0]})
            if e.fn == "grad":
                return Call("grad", args)  # the loss is inlined where the gradient is derived
            return Call(e.fn, args, span=e.span)
        if isinstance(e, BinOp):
            return BinOp(e.op, self._apply_model(e.left), self._apply_model(e.right), span=e.span)
        if isinstance(e, Neg):
            return Neg(self._apply_model(e.operand), span=e.span)
        if isinstance(e, Transpose):
            return Transpose(self._apply_model(e.operand), span=e.span)
        return e

    def model_output(self, arg: Expr) -> Expr:
        return self.inline(Call(self.model.name, (arg,)))

    def loss(self) -> Expr | None:
        return self.inline(self.spec.loss) if self.spec.loss is not None else None

    def grad_target(self, call: Call) -> str | None:
        """The state a ``grad(...)`` call differentiates with respect to."""
        if len(call.args) == 2 and isinstance(call.args[1], Name):
            return call.args[1].id
        ms = self.spec.model_states()
        return ms[0] if len(ms) == 1 else None

    # -- shapes (tuples of dim names; () for scalars; None when unknown)
    def shape(self, e: Expr):
        if isinstance(e, Num):
            return ()
        if isinstance(e, Name):
            return self.shapes.get(e.id)
        if isinstance(e, Neg):
            return self.shape(e.operand)
        if isinstance(e, Transpose):
            s = self.shape(e.operand)
            return tuple(reversed(s)) if s is not None else None
        if isinstance(e, BinOp):
            a, b = self.shape(e.left), self.shape(e.right)
            if a is None or b is None:
                return None
            if e.op == "@":
                if len(a) == 1 and len(b) == 2:
                    return (b[1],)
                if len(a) == 2 and len(b) == 2:
                    return (a[0], b[1])
                if len(a) == 2 and len(b) == 1:
                    return (a[0],)
                if len(a) == 1 and len(b) == 1:
                    return ()
                return None
            if e.op == "^":
                return a
            return a if len(a) >= len(b) else b
        if isinstance(e, Call):
            args = [self.shape(a) for a in e.args]
            f = e.fn
            if f in ("sum", "mean", "norm"):
                return ()
            if f == "outer":
                return None if None in args else args[0] + args[1]
            if f == "eye":
                a = e.args[0]
                return (a.id, a.id) if isinstance(a, Name) else ("?", "?")
            if f == "grad":
                t = self.grad_target(e)
                return self.shapes.get(t) if t else None
            if f == "attend":
                v = args[2] if len(args) > 2 else None
                return v[1:] if v else None
            if f == "solve":
                return args[1] if len(args) > 1 else None
            if f in ("min", "max", "clamp"):
                known = [a for a in args if a is not None]
                return max(known, key=len) if known else None
            if f == "append":
                return args[0] if args else None
            return args[0] if args else None
        return None

    def is_scalar(self, e: Expr) -> bool:
        return self.shape(e) == ()

    def rank(self, e: Expr):
        s = self.shape(e)
        return None if s is None else len(s)

    def depends(self, e: Expr, on=None) -> bool:
        """Does ``e`` depend on a state (or on the names ``on``)?  ``grad`` depends on all states."""
        on = set(self.states) if on is None else set(on)
        for n in e.walk():
            if isinstance(n, Name) and n.id in on:
                return True
            if isinstance(n, Call) and n.fn == "grad" and (on & set(self.states)):
                return True
        return False


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
            out[k] = _add(out[k], v) if k in out else v
        return out, simplify(BinOp(e.op, ra, rb))
    if isinstance(e, BinOp) and e.op == "*":
        la, lb = alg.depends(e.left, X), alg.depends(e.right, X)
        if la and lb:
            raise NotAdmitted(f"{_txt(e)} multiplies {what} by {what} (not affine)")
        inner, factor = (e.left, e.right) if la else (e.right, e.left)
        if not alg.is_scalar(factor):
            raise NotAdmitted(f"{_txt(e)} scales {what} by {_txt(factor)}, which is not a scalar")
        c, r = linear_form(alg, inner, X, what)
        return {k: _mul(factor, v) for k, v in c.items()}, _mul(factor, r)
    if isinstance(e, BinOp) and e.op == "/" and not alg.depends(e.right, X):
        if not alg.is_scalar(e.right):
            raise NotAdmitted(f"{_txt(e)} divides {what} by {_txt(e.right)}, which is not a scalar")
        c, r = linear_form(alg, e.left, X, what)
        return ({k: simplify(BinOp("/", v, e.right)) for k, v in c.items()},
                simplify(BinOp("/", r, e.right)))
    d = degree(alg, e, X)
    if d <= {0, 1}:
        raise NotAdmitted(f"{_txt(e)} is linear in {what} but not a scalar multiple of it")
    site = nonlinear_site(alg, e, X)
    where = f" ({_txt(site)})" if site is not None and site != e else ""
    raise NotAdmitted(f"{_txt(e)} is {describe_degree(d)} in {what}{where}")


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
        return _mul(c[W], e.left), simplify(BinOp("@", e.left, r))
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
        site = _state_site(read, states)
        raise NotAdmitted(f"{err}" + (f": {_txt(site)}" if site is not None else "")) from None
    return out, probes


def _state_site(e: Expr, states: set[str]) -> Expr | None:
    """The smallest call / operation of the read whose arguments contain a state outside a probe."""
    for c in e.children():
        s = _state_site(c, states)
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
            split(e.right, _mul(c, e.left))
        elif isinstance(e, BinOp) and e.op == "*" and not alg.depends(e.right, {W}) and alg.is_scalar(e.right):
            split(e.left, _mul(c, e.right))
        elif isinstance(e, BinOp) and e.op == "/" and not alg.depends(e.right, {W}) and alg.is_scalar(e.right):
            split(e.left, simplify(BinOp("/", c, e.right)))
        else:
            terms.append((c, e))

    split(loss, ONE)
    p_all = None
    quad = None
    lin: Expr | None = None
    for c, core in terms:
        kind = _loss_core(alg, core, W)
        if kind is None:
            d = degree(alg, core, {W})
            site = nonlinear_site(alg, core, {W})
            extra = f" ({_txt(site)})" if site is not None else ""
            raise NotAdmitted(f"the loss {_txt(loss)} is {describe_degree(d)} in {W}, "
                              f"not quadratic in a linear model's output{extra}")
        tag, p, r, k = kind
        if p_all is not None and p != p_all:
            raise NotAdmitted(f"the loss probes {W} with two different inputs ({_txt(p_all)}, {_txt(p)})")
        p_all = p
        if tag == "quad":
            if quad is not None:
                raise NotAdmitted(f"the loss has two quadratic terms in {W}")
            quad = (_mul(c, k), r)
        else:
            term = _mul(c, r)
            lin = term if lin is None else _add(lin, term)
    if p_all is None:
        return GradForm(None, None, None, None, "0")
    if quad is None:
        text = f"outer({_txt(p_all)}, {_txt(lin)})"
        return GradForm(p_all, None, None, lin, text)
    scale, r = quad
    scale = simplify(BinOp("*", Num(2), scale))
    if lin is not None:  # fold linear terms into the quadratic one: outer(p, lin) = scale*outer(p, lin/scale)
        r = _add(r, simplify(BinOp("/", lin, scale)))
    resid = simplify(BinOp("+", BinOp("@", p_all, Name(W)), r))
    text = _txt(BinOp("*", scale, Call("outer", (p_all, resid))))
    return GradForm(p_all, scale, r, None, text)


def _loss_core(alg: Algebra, core: Expr, W: str):
    """Recognise ``sum(R^2)``, ``mean(R^2)``, ``sum(R*R)``, ``norm(R)^2``, ``R @ R`` (quadratic) and
    ``sum(R*y)``, ``R @ y`` (linear), with ``R = p @ W + r``.  Returns (tag, p, r_or_y, k)."""
    def sq_arg(e):
        if isinstance(e, BinOp) and e.op == "^" and _is_num(e.right, 2):
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
                        return ("lin", f[0], _mul(k, y), k)
        return None
    if isinstance(core, BinOp) and core.op == "^" and _is_num(core.right, 2) \
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


def grad_calls(e: Expr) -> list[Call]:
    return [n for n in e.walk() if isinstance(n, Call) and n.fn == "grad"]


def replace_grads(e: Expr, alg: Algebra, table: dict) -> Expr:
    """Replace each ``grad(...)`` call by a placeholder Name (same call, same placeholder)."""
    def visit(n: Expr) -> Expr | None:
        if not (isinstance(n, Call) and n.fn == "grad"):
            return None
        key = (unparse(n), alg.grad_target(n))
        if key not in table:
            table[key] = (f"_g{len(table)}", n)
        return Name(table[key][0])

    return rewrite(e, visit)


# ----------------------------------------------------------- value ranges
INF = float("inf")
_RANGES = {"sigmoid": (0.0, 1.0), "softplus": (0.0, INF), "relu": (0.0, INF), "abs": (0.0, INF),
           "sqrt": (0.0, INF), "norm": (0.0, INF), "tanh": (-1.0, 1.0), "sign": (-1.0, 1.0),
           "elu": (-1.0, INF), "gelu": (-0.2, INF), "silu": (-0.3, INF)}


def value_range(alg: Algebra, e: Expr, logit=(-INF, INF)) -> tuple[float, float]:
    """An interval containing every value of ``e`` (interval arithmetic; gates through their formula)."""
    def mul(a, b):
        prods = []
        for x in a:
            for y in b:
                prods.append(0.0 if (x == 0 or y == 0) else x * y)
        return min(prods), max(prods)

    if isinstance(e, Num):
        return float(e.value), float(e.value)
    if isinstance(e, Name):
        spec = alg.spec
        if e.id == "logit":
            return logit
        if e.id in spec.constants:
            return float(spec.constants[e.id]), float(spec.constants[e.id])
        if e.id in spec.dims:
            return 1.0, INF
        if e.id in spec.gates:
            return value_range(alg, spec.gates[e.id].formula)
        if e.id in alg.lets:
            return value_range(alg, alg.lets[e.id])
        return -INF, INF
    if isinstance(e, Neg):
        lo, hi = value_range(alg, e.operand, logit)
        return -hi, -lo
    if isinstance(e, BinOp):
        a, b = value_range(alg, e.left, logit), value_range(alg, e.right, logit)
        if e.op == "+":
            return a[0] + b[0], a[1] + b[1]
        if e.op == "-":
            return a[0] - b[1], a[1] - b[0]
        if e.op == "*":
            if e.left == e.right:
                lo, hi = mul(a, a)
                return max(lo, 0.0), hi
            return mul(a, b)
        if e.op == "/" and (b[0] > 0 or b[1] < 0):
            inv = (1.0 / b[1] if b[1] != INF else 0.0, 1.0 / b[0] if b[0] != -INF else 0.0)
            return mul(a, tuple(sorted(inv)))
        if e.op == "^" and isinstance(e.right, Num) and float(e.right.value) % 2 == 0:
            return 0.0, INF
        return -INF, INF
    if isinstance(e, Call):
        if e.fn == "exp":
            lo, hi = value_range(alg, e.args[0], logit)
            import math
            return (math.exp(lo) if lo != -INF else 0.0), (math.exp(hi) if hi < 700 else INF)
        if e.fn in ("sigmoid", "tanh"):
            return _RANGES[e.fn]
        if e.fn in _RANGES:
            return _RANGES[e.fn]
        if e.fn == "clamp":
            lo, hi = value_range(alg, e.args[1], logit)[0], value_range(alg, e.args[2], logit)[1]
            return lo, hi
        if e.fn in ("min", "max"):
            a, b = value_range(alg, e.args[0], logit), value_range(alg, e.args[1], logit)
            f = min if e.fn == "min" else max
            return f(a[0], b[0]), f(a[1], b[1])
        if e.fn in ("sum", "mean") and isinstance(e.args[0], BinOp) and e.args[0].op in "*^":
            inner = value_range(alg, e.args[0], logit)
            return (0.0, INF) if inner[0] >= 0 else (-INF, INF)
    return -INF, INF


def _check_decay(alg: Algebra, gamma: Expr | None, where: str) -> str | None:
    """A reason line when the decay is provably >= 0, else raise NotAdmitted (the chunk form takes its log)."""
    if gamma is None:
        return None
    lo, hi = value_range(alg, gamma)
    if lo < 0:
        raise NotAdmitted(f"the decay {_txt(gamma)} {where} is not provably >= 0 (the chunk form takes its log)")
    return f"the decay {_txt(gamma)} {where} lies in [{_fmt_bound(lo)}, {_fmt_bound(hi)}]"


def _fmt_bound(x: float) -> str:
    return "inf" if x == INF else format(x, "g")


# ------------------------------------------------------------- families
def _all_updates(alg: Algebra) -> list[tuple[str, Expr]]:
    """Every update statement (temporaries included), lets and the model inlined."""
    return [(s.target, alg.inline(s.value)) for s in alg.spec.update]


def _updates(alg: Algebra) -> list[tuple[str, Expr]]:
    """The state statements, with the per-token temporaries inlined into the statements
    that use them (``g = grad(loss, W); W = W - eta * g`` reads as ``W = W - eta * grad(loss, W)``).

    Inlining is exact when no state the temporary depends on (any state, for a value
    holding ``grad``, the model or a cache) is written between its statement and the use;
    otherwise the family needs the temporary's position and is not admitted."""
    temps: dict[str, tuple[Expr, int]] = {}
    out: list[tuple[str, Expr]] = []
    written: list[str] = []   # state targets in program order
    for tgt, e in _all_updates(alg):
        used = {t for t in _names(e) if t in temps}
        for t in sorted(used):
            value, at = temps[t]
            deps = _names(value) & set(alg.states)
            if any(isinstance(c, Call) and (c.fn == "grad" or c.fn == "attend") for c in value.walk()):
                deps = set(alg.states)
            changed = sorted(set(written[at:]) & deps)
            if changed:
                raise NotAdmitted(f"the temporary {t} is used after {', '.join(changed)} changed, which it "
                                  f"depends on (its value is taken before that write)")
        if used:
            e = substitute(e, {t: temps[t][0] for t in used})
        if tgt in alg.states:
            out.append((tgt, e))
            written.append(tgt)
        else:
            temps[tgt] = (e, len(written))
    return out


def _compose_all(alg: Algebra, updates: list[tuple[str, Expr]]) -> dict[str, Expr]:
    """:func:`_compose` over every statement, temporaries included: each temporary is
    expressed in the states before the token, like the states (exact whatever the order)."""
    cur: dict[str, Expr] = {}
    for tgt, e in updates:
        cur[tgt] = substitute(e, cur) if cur else e
    return {n: v for n, v in cur.items() if n in alg.states}


def analyse_cache(alg: Algebra) -> tuple[CachePlan, list[str]]:
    spec = alg.spec
    if not alg.states or alg.caches != set(alg.states):
        tensor = sorted(set(alg.states) - alg.caches)
        raise NotAdmitted(f"state {', '.join(tensor)} is a tensor, not a cache" if len(tensor) == 1 else
                          f"states {', '.join(tensor)} are tensors, not caches")
    appends = []
    for tgt, e in _updates(alg):
        if not (isinstance(e, Call) and e.fn == "append" and isinstance(e.args[0], Name) and e.args[0].id == tgt):
            raise NotAdmitted(f"the update of {tgt} is not {tgt} = append({tgt}, x)")
        if alg.depends(e.args[1]):
            raise NotAdmitted(f"the vector appended to {tgt} depends on a state")
        appends.append((tgt, e.args[1]))
    written = [t for t, _ in appends]
    if sorted(written) != sorted(alg.states) or len(set(written)) != len(written):
        raise NotAdmitted("every cache must be appended to exactly once per token")
    attends = []

    def walk(e: Expr) -> Expr:
        if isinstance(e, Call) and e.fn == "attend":
            q, K, V, scale = e.args
            if not (isinstance(K, Name) and isinstance(V, Name) and K.id in alg.caches and V.id in alg.caches):
                raise NotAdmitted("attend(...) must read two caches directly")
            if alg.depends(q) or alg.depends(scale):
                raise NotAdmitted("the query and scale of attend(...) must be token-local")
            if alg.states[K.id].window != alg.states[V.id].window:
                raise NotAdmitted(f"caches {K.id} and {V.id} have different windows")
            name = f"_a{len(attends)}"
            attends.append((name, q, K.id, V.id, scale))
            return Name(name)
        if isinstance(e, Name) and e.id in alg.caches:
            raise NotAdmitted(f"the read uses cache {e.id} outside attend(...)")
        if isinstance(e, BinOp):
            return BinOp(e.op, walk(e.left), walk(e.right))
        if isinstance(e, (Neg, Transpose)):
            return type(e)(walk(e.operand))
        if isinstance(e, Call):
            return Call(e.fn, tuple(walk(a) for a in e.args))
        return e

    read = walk(alg.inline(spec.read))
    if not attends:
        raise NotAdmitted("the read does not attend over the caches")
    windows = {c: alg.states[c].window for c in alg.caches}
    reasons = [
        f"every state ({', '.join(alg.states)}) is a cache written only by append of a token-local vector",
        "the read is " + ", ".join(f"attend({_txt(q)}, {K}, {V}, {_txt(s)})" for _, q, K, V, s in attends)
        + " of a token-local query over the caches: exact through scaled_dot_product_attention"
        + (f" with a causal window of {sorted(set(w for w in windows.values() if w))} tokens"
           if any(windows.values()) else " with a causal mask"),
    ]
    plan = CachePlan(tuple(appends), tuple(attends), read, windows, spec.order == "write_read")
    return plan, reasons


def _compose(alg: Algebra, updates: list[tuple[str, Expr]]) -> dict[str, Expr]:
    """The state after the whole update program, as expressions in the states before it."""
    cur: dict[str, Expr] = {}
    for tgt, e in updates:
        cur[tgt] = substitute(e, cur) if cur else e
    return cur


def _outer_terms(alg: Algebra, A: Expr, S: str) -> list[tuple[Expr, Expr]]:
    """Decompose a token-local increment into ``sum_i outer(a_i, b_i)`` (matrix) or ``b_i * a_i``."""
    rank = alg.rank(Name(S))
    if isinstance(A, BinOp) and A.op in "+-" and alg.rank(A.left) == rank and alg.rank(A.right) == rank:
        left = _outer_terms(alg, A.left, S)
        right = _outer_terms(alg, A.right, S)
        if A.op == "-":
            right = [(a, simplify(Neg(b))) for a, b in right]
        return left + right
    if isinstance(A, Neg) and rank == 2:
        return [(a, simplify(Neg(b))) for a, b in _outer_terms(alg, A.operand, S)]
    if _is_num(A, 0):
        return []
    if rank == 2:
        if isinstance(A, Call) and A.fn == "outer":
            return [(A.args[0], A.args[1])]
        if isinstance(A, BinOp) and A.op in "*/":
            inner, factor = A.left, A.right
            if A.op == "*" and alg.is_scalar(A.left):
                inner, factor = A.right, A.left
            if alg.is_scalar(factor):
                return [(a, simplify(BinOp("*", factor, b) if A.op == "*" else BinOp("/", b, factor)))
                        for a, b in _outer_terms(alg, inner, S)]
        raise NotAdmitted(f"the increment {_txt(A)} of {S} is not a sum of outer products")
    if rank == 1:
        if isinstance(A, BinOp) and A.op in "*/" and alg.rank(A) == 1:
            if A.op == "*" and alg.is_scalar(A.left) and alg.rank(A.right) == 1:
                return [(a, _mul(b, A.left)) for a, b in _outer_terms(alg, A.right, S)]
            if alg.is_scalar(A.right) and alg.rank(A.left) == 1:
                return [(a, simplify(BinOp(A.op, b, A.right))) for a, b in _outer_terms(alg, A.left, S)]
        if alg.rank(A) == 1:
            return [(A, ONE)]
    raise NotAdmitted(f"the increment {_txt(A)} of {S} has an unsupported shape")


def analyse_additive(alg: Algebra) -> tuple[AdditivePlan, list[str]]:
    spec = alg.spec
    if not alg.states:
        raise NotAdmitted("the spec has no state")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    for n, s in alg.states.items():
        if len(s.shape) not in (1, 2):
            raise NotAdmitted(f"state {n} has rank {len(s.shape)}; the chunk form needs a vector or a matrix")
    # gradients that do not depend on the state (losses linear in a linear model) are increments
    updates = []
    for tgt, e in _all_updates(alg):
        for g in grad_calls(e):
            W = alg.grad_target(g)
            loss = alg.loss()
            if W is None or loss is None:
                raise NotAdmitted(f"the update of {tgt} takes a gradient the analysis cannot derive")
            try:
                gf = symbolic_grad(alg, loss, W)
            except NotAdmitted as err:
                what = (f"the update of {tgt} is not affine in {tgt} with a state-independent increment"
                        if tgt in alg.states else f"the temporary {tgt} is not a state-independent increment")
                raise NotAdmitted(f"{what}: {unparse(g)} of a nonlinear model ({err})") from None
            if gf.scale is not None:
                what = f"the increment of {tgt}" if tgt in alg.states else f"the temporary {tgt}"
                raise NotAdmitted(f"{what} depends on the state: {unparse(g)} = {gf.text}")
            repl = Call("outer", (gf.p, gf.lin)) if gf.p is not None else ZERO
            e = _replace_call(e, g, repl)
        updates.append((tgt, e))
    final = _compose_all(alg, updates)
    reasons = []
    states = []
    for n, st in alg.states.items():
        if n not in final:
            raise NotAdmitted(f"state {n} is never written")
        coef, rest = linear_form(alg, final[n], set(alg.states), "the states")
        others = sorted(k for k, v in coef.items() if k != n and not _is_num(v, 0))
        if others:
            raise NotAdmitted(f"the update of {n} reads state {', '.join(others)} (not independent of the state)")
        gamma = simplify(coef.get(n, ZERO))
        if alg.depends(rest):
            raise NotAdmitted(f"the increment {_txt(rest)} of {n} depends on a state")
        if _is_num(gamma, 0):
            raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
        terms = _outer_terms(alg, rest, n)
        dr = _check_decay(alg, None if _is_num(gamma, 1) else gamma, f"of {n}")
        inc: Expr = ZERO
        for a, b in terms:
            inc = BinOp("+", inc, Call("outer", (a, b)) if len(st.shape) == 2 else BinOp("*", b, a))
        rec = _txt(BinOp("+", BinOp("*", gamma, Name(n)), inc))
        decay = "no decay" if _is_num(gamma, 1) else f"a token-local scalar decay {_txt(gamma)}"
        reasons.append(f"update of {n} is affine in {n}: {n} <- {rec}, with {decay} "
                       f"and an increment {_txt(inc)} independent of the state")
        if dr:
            reasons.append(dr)
        states.append(AdditiveState(n, None if _is_num(gamma, 1) else gamma, tuple(terms), len(st.shape) == 1))
    read, probes = find_probes(alg, alg.inline(spec.read), set(alg.states))
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(_txt(BinOp("@", p.vector, Name(p.state))) for p in probes)
                   + " of the states with token-local probe vectors" if probes
                   else "the read does not use the states")
    reasons.append("exact chunk form: intra-chunk masked decay-weighted products + inter-chunk state")
    return AdditivePlan(tuple(states), tuple(probes), read, spec.order == "write_read"), reasons


def _replace_call(e: Expr, target: Call, repl: Expr) -> Expr:
    if isinstance(e, Call) and e == target:
        return repl
    if isinstance(e, BinOp):
        return BinOp(e.op, _replace_call(e.left, target, repl), _replace_call(e.right, target, repl))
    if isinstance(e, (Neg, Transpose)):
        return type(e)(_replace_call(e.operand, target, repl))
    if isinstance(e, Call):
        return Call(e.fn, tuple(_replace_call(a, target, repl) for a in e.args))
    return e


def analyse_delta(alg: Algebra) -> tuple[DeltaPlan, list[str]]:
    spec = alg.spec
    if alg.model is None or spec.loss is None:
        raise NotAdmitted("the spec has no inner model and loss")
    ms = spec.model_states()
    if len(ms) != 1:
        raise NotAdmitted(f"the model reads {len(ms)} states ({', '.join(ms)}); the delta form needs one matrix")
    W = ms[0]
    if set(alg.states) != {W}:
        raise NotAdmitted(f"the spec has states besides the model's {W}: "
                          + ", ".join(sorted(set(alg.states) - {W})))
    if len(alg.states[W].shape) != 2 or alg.states[W].cache:
        raise NotAdmitted(f"the model's state {W} is not a matrix")
    reasons = []
    alg.shapes.setdefault(alg.model.arg, (alg.states[W].shape[0],))
    body = substitute(alg.model.body, {k: v for k, v in alg.lets.items() if k != alg.model.arg})
    d = degree(alg, body, {W})
    mtxt = str(alg.model)
    if d != {1} and d != {0, 1}:
        site = nonlinear_site(alg, body, {W})
        raise NotAdmitted(f"the model {mtxt} is {describe_degree(d)} in {W}"
                          + (f" ({_txt(site)})" if site is not None and NONLIN in d else ""))
    if probe_form(alg, body, W) in (None,) or probe_form(alg, body, W)[0] is None:
        raise NotAdmitted(f"the model {mtxt} is linear in {W} but not of the form p(u) @ {W} + r(u)")
    reasons.append(f"model {mtxt} is linear in {W}")
    loss = alg.loss()
    gf = symbolic_grad(alg, loss, W)
    if gf.scale is None:
        raise NotAdmitted(f"the loss {_txt(loss)} is not quadratic in {W}")
    reasons.append(f"loss is quadratic in the model output: {unparse(spec.loss)}, "
                   f"so grad(loss, {W}) = {gf.text}")
    # the update program: decays (c * W) and exactly one gradient step c * W + d * grad
    pre, post, step = [], [], None
    for tgt, e in _updates(alg):
        if tgt != W:
            raise NotAdmitted(f"the update writes {tgt}, not only {W}")
        table: dict = {}
        e2 = replace_grads(e, alg, table)
        gnames = {v[0] for v in table.values()}
        if any(alg.grad_target(call) != W for _, call in table.values()):
            raise NotAdmitted("a gradient is taken with respect to another state")
        coef, rest = linear_form(alg, e2, {W} | gnames, f"{W} and grad(loss, {W})")
        if not _is_num(simplify(rest), 0):
            raise NotAdmitted(f"the update of {W} adds {_txt(rest)} besides the gradient step")
        c = simplify(coef.get(W, ZERO))
        dg = ZERO
        for g in gnames:
            dg = _add(dg, coef.get(g, ZERO))
        if alg.depends(c) or alg.depends(dg) or not alg.is_scalar(c) or not alg.is_scalar(dg):
            raise NotAdmitted(f"the coefficients of the update of {W} are not token-local scalars")
        if _is_num(dg, 0):
            (post if step is not None else pre).append(c)
        elif step is not None:
            raise NotAdmitted(f"the update of {W} takes two gradient steps per token")
        else:
            step = (c, dg)
    if step is None:
        raise NotAdmitted(f"the update of {W} takes no gradient step")
    c, dg = step
    g_pre = ONE
    for x in pre:
        g_pre = _mul(g_pre, x)
    g_post = ONE
    for x in post:
        g_post = _mul(g_post, x)
    # W' = g_post * (c * g_pre * W + dg * scale * outer(p, g_pre * p@W + r))
    #    = gamma W + outer(p, beta (v - rho p@W)),  gamma = g_post c g_pre, rho = g_pre g_post,
    #      beta = -dg * scale, v = g_post * (-r)
    gamma = simplify(_mul(_mul(g_post, c), g_pre))
    rho = simplify(_mul(g_pre, g_post))
    beta = simplify(Neg(_mul(dg, gf.scale)))
    v = simplify(_mul(g_post, Neg(gf.r)))
    if _is_num(gamma, 0):
        raise NotAdmitted(f"the update of {W} has decay 0")
    decay_lines = [r for r in (_check_decay(alg, None if _is_num(gamma, 1) else gamma, f"of {W}"),
                               _check_decay(alg, None if rho in (gamma, ONE) else rho,
                                            "seen by the error term")) if r]
    btxt = _txt(beta)
    G = Call("grad", (Name("loss"), Name(W)))
    stmt = BinOp("+", BinOp("*", c, Name(W)), BinOp("*", dg, G))
    reasons.append(f"one gradient step {W} <- {_txt(stmt)} with a token-local scalar step size")
    if pre:
        reasons.append(f"decay {_txt(g_pre)} before the gradient step: the gradient is taken at the decayed memory")
    if post:
        reasons.append(f"decay {_txt(g_post)} after the gradient step: same recurrence with the target rescaled, "
                       f"v = {_txt(v)}")
    if not _is_num(c, 1):
        reasons.append(f"decay {_txt(c)} in the gradient statement: the gradient is taken at the undecayed memory")
    Wp = Name(f"{W}_prev")
    rec_e = BinOp("+", BinOp("*", gamma, Wp), Call("outer", (Name("k"), BinOp("*", Name("beta"), BinOp(
        "-", Name("v"), BinOp("*", rho, BinOp("@", Name("k"), Wp)))))))
    rec = f"{W} <- {_txt(rec_e)} with k = {_txt(gf.p)}, v = {_txt(v)}, beta = {btxt}"
    reasons.append(("gated delta rule: " if not _is_num(gamma, 1) else "delta rule: ") + rec)
    reasons += decay_lines
    read, probes = find_probes(alg, alg.inline(spec.read), {W})
    reasons.append("the read is a function of the linear probes "
                   + ", ".join(_txt(BinOp("@", p.vector, Name(p.state))) for p in probes) if probes
                   else "the read does not use the state")
    reasons.append("exact chunk form: WY / UT representation of the product of (I - beta_t k_t^T k_t), "
                   "one unit-lower-triangular solve per chunk")
    plan = DeltaPlan(W, gf.p, v, beta, None if _is_num(gamma, 1) else gamma,
                     None if rho == gamma else rho, tuple(probes), read, spec.order == "write_read")
    return plan, reasons


def analyse_minibatch(alg: Algebra, chunk: int) -> tuple[MinibatchPlan, list[str]]:
    table: dict = {}
    updates = [(t, replace_grads(e, alg, table)) for t, e in _all_updates(alg)]
    if not table:
        raise NotAdmitted("the update takes no gradient (mini-batch learning needs gradient writes)")
    if alg.caches:
        raise NotAdmitted(f"state {', '.join(sorted(alg.caches))} is a cache")
    final = _compose_all(alg, updates)
    coef, rest = {}, {}
    for n in alg.states:
        e = final.get(n, Name(n))
        c, r = linear_form(alg, e, set(alg.states), "the states")
        if any(alg.depends(x) for x in c.values()) or alg.depends(r):
            raise NotAdmitted(f"the update of {n} is not a linear recurrence with token-local coefficients")
        coef[n] = {k: simplify(v) for k, v in c.items() if not _is_num(simplify(v), 0)}
        rest[n] = simplify(r)
    # the scans solve the recurrences one state after another: off-diagonal dependencies must be acyclic
    done: list[str] = []
    pending = list(alg.states)
    while pending:
        ready = [n for n in pending if all(r == n or r in done for r in coef[n])]
        if not ready:
            raise NotAdmitted(f"the recurrences of {', '.join(pending)} feed each other's previous values "
                              f"(a coupled system, not a chain of scalar recurrences)")
        done.append(ready[0])
        pending.remove(ready[0])
    grads = {name: call for name, call in table.values()}
    reasons = []
    for n in alg.states:
        total: Expr = ZERO
        for k, v in coef[n].items():
            total = BinOp("+", total, BinOp("*", v, Name(k)))
        txt = _gtxt(simplify(BinOp("+", total, rest[n])), grads)
        reasons.append(f"update of {n} is a linear recurrence with token-local scalar coefficients "
                       f"when each grad(...) is held fixed: {n} <- {txt}")
    reasons.append("mini-batch: inside a chunk every grad(...) is taken at the chunk-start state, "
                   "the recurrences run token by token (an approximation of online learning; "
                   "chunk 1 equals online)")
    from .dual import NotDual, analyse_dual
    try:
        reasons += analyse_dual(alg.spec).describe()
    except NotDual as err:
        reasons.append(f"no dual form ({err}): each chunk materialises every token's state")
    return MinibatchPlan(coef, rest, grads, chunk), reasons


def _gtxt(e: Expr, grads: dict) -> str:
    return unparse(substitute(e, {k: v for k, v in grads.items()}))


# ------------------------------------------------------------- decision
def analyse(spec) -> ScheduleDecision:
    """Decide the schedule of a spec from its algebra; raise SpecError if a forced one is impossible."""
    try:
        alg = Algebra(spec)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError, RecursionError) as err:
        raise SpecError([Diagnostic("error", f"cannot analyse the schedule of {spec.name}: "
                                             f"{type(err).__name__}: {err}", spec.span("update"),
                                    hint="run `memspec check` on the spec", code="E-schedule")]) from None
    token = _SHOW_LETS.set(tuple((inl, n) for n, inl in alg.lets.items() if not isinstance(inl, Name)))
    try:
        return _analyse(spec, alg)
    finally:
        _SHOW_LETS.reset(token)


def _analyse(spec, alg: Algebra) -> ScheduleDecision:
    mb_chunk = spec.schedule_size if spec.schedule_kind == "minibatch" else DEFAULT_CHUNK
    ck_chunk = spec.schedule_size if spec.schedule_kind == "chunk" else DEFAULT_CHUNK
    plans: dict[str, Any] = {}
    whys: dict[str, list[str]] = {}
    rejected: list[tuple[str, str]] = []
    for fam, fn in (("cache", lambda: analyse_cache(alg)), ("additive", lambda: analyse_additive(alg)),
                    ("delta", lambda: analyse_delta(alg)), ("minibatch", lambda: analyse_minibatch(alg, mb_chunk))):
        try:
            plans[fam], whys[fam] = fn()
        except NotAdmitted as err:
            rejected.append((fam, str(err)))
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, RecursionError) as err:
            # a spec the checks would reject (wrong arity, unknown names): never a traceback here
            rejected.append((fam, f"the algebra cannot be read ({type(err).__name__}); run `memspec check`"))
    plans["online"], whys["online"] = None, ["online: one token at a time, always exact"]
    admits = tuple(f for f in FAMILIES if f in plans)
    kind = spec.schedule_kind
    rej = dict(rejected)
    if kind == "chunk":
        fam = next((f for f in ("additive", "delta") if f in plans), None)
        if fam is None:
            why = rej["delta"] if grad_calls_in_spec(spec) else rej["additive"]
            if "cache" in plans:
                why = "the spec is a cache read by attention: it is served exactly by scaled_dot_product_attention"
            raise SpecError([Diagnostic(
                "error", f"schedule {spec.schedule} needs an exact chunk form (additive or delta), "
                         f"and this spec admits none", spec.span("schedule"),
                hint=why + "; use " + ("minibatch(N) (approximate) or " if "minibatch" in plans else "")
                + "online or auto", code="E-schedule")])
        chunk = ck_chunk
    elif kind == "minibatch":
        if "minibatch" not in plans:
            raise SpecError([Diagnostic(
                "error", f"schedule {spec.schedule} needs gradient writes that form linear recurrences",
                spec.span("schedule"), hint=rej["minibatch"] + "; use auto, chunk(N) or online",
                code="E-schedule")])
        fam, chunk = "minibatch", mb_chunk
    elif kind == "online":
        fam, chunk = "online", None
    else:
        fam = admits[0]
        chunk = {"additive": ck_chunk, "delta": ck_chunk, "minibatch": mb_chunk}.get(fam)
    reasons = list(whys[fam])
    if fam == "online" and "additive" in rej and _additive_states_ok(alg):
        reasons.append(f"the updates of {', '.join(alg.states)} are additive running sums (S <- g*S + A, A "
                       f"independent of the state), but {rej['additive']}: the read needs the full state of every "
                       f"token, so a chunk form would only batch the state materialisation while the per-token "
                       f"read dominates")
    if kind != "auto":
        reasons.insert(0, f"forced by schedule {spec.schedule}")
    plan = plans[fam]
    if fam == "minibatch" and plan.chunk != chunk:
        plan = MinibatchPlan(plan.coef, plan.rest, plan.grads, chunk)
    return ScheduleDecision(fam, fam != "minibatch", chunk, tuple(reasons), plan, admits,
                            plans, tuple(rejected))


def grad_calls_in_spec(spec) -> bool:
    return any(grad_calls(s.value) for s in spec.update)


_FAMILY_TEXT = {
    "cache": "cache (softmax attention over the cache, exact, scaled_dot_product_attention)",
    "additive": "additive (exact chunked form: S <- g*S + A)",
    "delta": "delta (exact chunked form: WY / UT representation, triangular solve per chunk)",
    "minibatch": "mini-batch (approximate: gradients at the chunk-start state)",
    "online": "online (token by token, exact)",
}

_FASTER = {
    "additive": "write the update as S = g*S + A with A independent of every state "
                "(e.g. outer(k, v)) and read the state only through probes q @ S",
    "delta": "use a model linear in one matrix state (f(u) = u @ W), a loss quadratic in f(...) "
             "and one gradient step with a scalar step size and scalar decays",
    "minibatch": "write the update as linear recurrences with token-local scalar coefficients "
                 "around grad(...) (momentum, decay)",
}


def explain(spec) -> str:
    """Human-readable account of the schedule decision and the algebra behind it."""
    d = analyse(spec)
    lines = [f"{spec.name}: {_FAMILY_TEXT[d.family]}"]
    lines.append(f"  exact: {'yes' if d.exact else 'no (an approximation of online learning)'}")
    if d.chunk is not None:
        lines.append(f"  chunk: {d.chunk}" + ("  (chunk 1 equals online)" if d.family == "minibatch" else ""))
    lines.append(f"  admits: {', '.join(d.admits)}")
    lines.append("  because:")
    lines += [f"    - {r}" for r in d.reasons]
    rej = dict(d.rejected)
    better = [f for f in FAMILIES if FAMILIES.index(f) < FAMILIES.index(d.family) and f in rej
              and (f != "cache" or any(st.cache for st in spec.state.values()))]
    if better:
        lines.append("  not faster, because:")
        for f in better:
            lines.append(f"    - {f}: {rej[f]}")
    if d.family == "minibatch":
        lines.append("  note: mini-batch evaluates every grad(...) of a chunk at the chunk-start state;"
                     " it approximates online learning and equals it at chunk 1 (schedule minibatch(1))")
    relevant = {"additive": True, "delta": spec.model is not None, "minibatch": grad_calls_in_spec(spec)}
    hints = [f for f in ("additive", "delta", "minibatch") if FAMILIES.index(f) < FAMILIES.index(d.family)
             and f in rej and relevant[f]]
    if hints:
        lines.append("  for a faster schedule:")
        lines += [f"    - {f}: {_FASTER[f]}" for f in hints]
    return "\n".join(lines) + "\n"


def _additive_states_ok(alg: Algebra) -> bool:
    """Are all state updates additive (even if the read is not a probe)?"""
    try:
        final = _compose_all(alg, _all_updates(alg))
        for n in alg.states:
            if alg.states[n].cache or n not in final or grad_calls(final[n]):
                return False
            coef, rest = linear_form(alg, final[n], set(alg.states))
            if set(k for k, v in coef.items() if not _is_num(v, 0)) - {n} or alg.depends(rest):
                return False
        return True
    except NotAdmitted:
        return False
