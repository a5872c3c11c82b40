"""Window losses in the mini-batch schedule: the Omega rule of Atlas / OmegaNet.

A window loss reads caches of the last c keys and values (``K = append(K, kn)``, window c),
e.g. ``0.5 * sum(G @ (f(K) - V)^2)``.  When it is a sum over the cache's rows of one term per
row, ``loss = sum_r loss_r`` with ``loss_r`` a function of row r alone (and of the learned
states), every token's gradient in a mini-batch chunk, all taken at the chunk-start state,
is a banded sum of per-row gradients: token i sums the rows of its window,

    grad_i = sum_{r in window(i)} grad loss_r (W_0),

so each row's gradient is computed once per chunk (the chunk's C rows and the c - 1 rows
before it), and a [C, C + c - 1] band matrix makes the per-token gradients.
:func:`analyse_window` decides this and returns the row loss; :class:`NotAdmitted` says
why not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import ELEMENTWISE_FUNCTIONS, BinOp, Call, Expr, Name, Neg, Num, unparse
from ..lang.names import fresh
from ..lang.shapes import ShapeEnv
from .algebra import Algebra, NotAdmitted, drop_grads, grad_calls, is_num, names_in
from .backprop import ClosedGrad, NoClosedForm, closed_grad, spec_names

ROWWISE = ELEMENTWISE_FUNCTIONS | {"l2norm", "layernorm", "rmsnorm", "huber", "min", "max", "clamp"}


@dataclass(frozen=True)
class WindowDual:
    """The banded dual form of a window loss on a linear memory ``f(u) = u @ W`` updated as
    ``W <- decay * W - step * grad(loss, W)`` (token-local scalars): with ``delta_r`` the
    gradient of row r's loss with respect to ``K_r @ W`` at the chunk start, every state of
    the chunk is ``W_i = P_i W_0 + sum_r N[i, r] K_r^T delta_r`` with ``N = L diag(-step) band``
    (``L``, ``P`` the decay weights, ``band`` the [C, R] window of each token), so a read
    ``q_i @ W_i`` is a masked [C, R] product and no per-token state is formed."""

    state: str
    decay: Expr
    step: Expr

    def describe(self) -> list[str]:
        keep = self.state if is_num(self.decay, 1) else f"{unparse(self.decay)} * {self.state}"
        return [f"banded dual form: {self.state} enters the model as a linear layer and steps as {self.state} <- "
                f"{keep} - {unparse(self.step)} * grad, so each state of the chunk is a "
                f"decay- and window-weighted sum of the rows' outer products: reads are masked [C, C + c - 1] "
                f"products, no per-token state is materialised"]


@dataclass(frozen=True)
class WindowLoss:
    """``caches``: cache -> (the statement index of its append, the appended item);
    ``window``: c, the rows each token's loss reads (its own and the c - 1 before);
    ``rows``: cache -> the name of one of its rows in ``row_loss``; ``row_loss``: the loss of
    one row (a scalar of the rows, the learned states, params and constants)."""

    caches: dict
    window: int
    rows: dict
    row_loss: Expr
    dual: WindowDual | None = None
    closed: ClosedGrad | None = None   # the row loss's closed-form gradient (None: torch.func.grad)

    def describe(self) -> list[str]:
        how = "in closed form" if self.closed is not None else "with torch.func.grad"
        return [f"window loss: the loss is a sum over the rows of {', '.join(self.caches)} (window "
                f"{self.window}) of {unparse(self.row_loss)}, so each token's chunk-start gradient is a banded "
                f"sum of per-row gradients: each row's gradient is taken once per chunk, {how}"]


def analyse_window(alg: Algebra) -> WindowLoss:
    spec = alg.spec
    caches: dict = {}
    first_grad = min((i for i, st in enumerate(spec.update) if grad_calls(st.value)), default=None)
    for i, st in enumerate(spec.update):
        if st.target in alg.caches:
            v = st.value
            if not (isinstance(v, Call) and v.fn == "append") or st.target in caches:
                raise NotAdmitted(f"cache {st.target} is not written by one append")
            if first_grad is not None and i > first_grad:
                raise NotAdmitted(f"cache {st.target} is appended to after a gradient is taken (append first, so "
                                  "that each token's window ends at the token)")
            item = v.args[1]
            if alg.depends(alg.inline(item)):
                raise NotAdmitted(f"the item appended to {st.target} reads a state")
            caches[st.target] = (i, item)
    windows = {spec.state[c].window for c in caches}
    if None in windows:
        raise NotAdmitted(f"cache {', '.join(c for c in caches if spec.state[c].window is None)} has no window "
                          "(a chunk would need every past row)")
    if len(windows) != 1:
        raise NotAdmitted("the caches have different windows")
    if alg.spec.loss is None or not (set(caches) & names_in(alg.spec.loss)):
        raise NotAdmitted("the loss reads no cache")
    if names_in(spec.read) & set(caches):
        raise NotAdmitted("the read reads a cache")
    for st in spec.update:
        if st.target not in caches and names_in(drop_grads(st.value)) & set(caches):
            raise NotAdmitted(f"`{st}` reads a cache")
    env = ShapeEnv.from_spec(spec)
    taken = set(spec.state) | set(spec.views) | set(spec.gates) | set(spec.let) | set(spec.params) \
        | set(spec.dims) | set(spec.constants) | {st.target for st in spec.update}
    rows = {c: fresh(f"{c}_row", taken) for c in caches}
    local = set(spec.views) | set(spec.gates) | set(spec.let) | {st.target for st in spec.update
                                                                  if st.target not in spec.state}
    row = _Rows(alg, env, rows, local)
    loss = row.loss(spec.loss)
    targets = list(dict.fromkeys(c.args[1].id if len(c.args) == 2 else spec.model_states()[0]
                                 for st in spec.update for c in grad_calls(st.value)))
    scope = {rows[c]: tuple(spec.state[c].shape) for c in caches}
    try:
        closed = closed_grad(spec, loss, targets, spec_names(spec) | set(rows.values()), scope)
    except NoClosedForm:
        closed = None
    return WindowLoss(caches, windows.pop(), rows, loss, closed=closed)


class _Rows:
    """The row-by-row form of a window loss (raises NotAdmitted)."""

    def __init__(self, alg, env, rows, local):
        self.alg, self.env, self.rows, self.local = alg, env, rows, local
        self.axis = env.cache_axis

    def cached(self, e: Expr) -> bool:
        s = self.env.infer(e)
        return s is not None and len(s) >= 1 and s[0] == self.axis

    def loss(self, e: Expr) -> Expr:
        """``loss`` as the loss of one row: ``sum_r loss_r``."""
        if isinstance(e, BinOp) and e.op in "+-":
            return BinOp(e.op, self.loss(e.left), self.loss(e.right))
        if isinstance(e, Neg):
            return Neg(self.loss(e.operand))
        if isinstance(e, BinOp) and e.op in "*/":
            for c, x in ((e.left, e.right), (e.right, e.left)):
                if e.op == "/" and c is e.left:
                    continue
                if self.constant(c):
                    inner = self.loss(x)
                    return BinOp(e.op, inner, c) if c is e.right else BinOp(e.op, c, inner)
        if isinstance(e, Call) and e.fn == "sum" and len(e.args) == 1:
            x = e.args[0]
            if isinstance(x, BinOp) and x.op == "@" and (self.cached(x.left) and self.rank(x.left) == 1):
                return Call("sum", (BinOp("*", self.row(x.left), self.row(x.right)),))
            if isinstance(x, BinOp) and x.op == "@" and isinstance(x.left, Call) and x.left.fn == "diag" \
                    and self.cached(x.left.args[0]):
                return Call("sum", (BinOp("*", self.row(x.left.args[0]), self.row(x.right)),))
            if self.cached(x):
                return Call("sum", (self.row(x),))
        if isinstance(e, BinOp) and e.op == "@" and self.cached(e.left) and self.cached(e.right) \
                and self.rank(e.left) == 1 and self.rank(e.right) == 1:
            return BinOp("*", self.row(e.left), self.row(e.right))
        raise NotAdmitted(f"the loss is not a sum over the rows of its caches (`{unparse(e)}`)")

    def rank(self, e: Expr) -> int:
        return len(self.env.infer(e))

    def constant(self, e: Expr) -> bool:
        """A factor that is the same for every row and every token: no cache, no token value."""
        s = self.env.infer(e)
        return s == () and not (names_in(e) & (set(self.rows) | self.local)) and not self.alg.depends(e)

    def row(self, e: Expr) -> Expr:
        """Row r of a value with a leading cache axis."""
        if isinstance(e, Name) and e.id in self.rows:
            return Name(self.rows[e.id])
        if not self.cached(e):
            if names_in(e) & (self.local | set(self.rows)):
                raise NotAdmitted(f"`{unparse(e)}` in the window loss is a value of the token, not of the row")
            return e
        spec = self.alg.spec
        if isinstance(e, Call) and spec.model is not None and e.fn == spec.model.name:
            return Call(e.fn, (self.row(e.args[0]),))
        if isinstance(e, Neg):
            return Neg(self.row(e.operand))
        if isinstance(e, BinOp) and e.op in "+-*/^":
            return BinOp(e.op, self.row(e.left), self.row(e.right))
        if isinstance(e, BinOp) and e.op == "@" and not self.cached(e.right):
            return BinOp("@", self.row(e.left), self.row(e.right))
        if isinstance(e, Call) and e.fn in ROWWISE:
            return Call(e.fn, tuple(self.row(a) for a in e.args))
        if isinstance(e, Call) and e.fn in ("sum", "mean", "norm", "softmax") and len(e.args) == 2:
            return Call(e.fn, (self.row(e.args[0]), e.args[1]))
        raise NotAdmitted(f"`{unparse(e)}` does not act on the rows of a cache one by one")


def window_dual(alg: Algebra, window: WindowLoss, rec, sites: dict) -> tuple[WindowDual | None, str]:
    """The banded dual form of ``window`` (None and why not): one learned state W, the model
    ``u @ W``, read through it, and ``W <- a W - b grad(loss, W)`` with token-local scalars."""
    spec = alg.spec
    learned = [s for s in spec.state if s not in window.caches]
    if len(learned) != 1:
        return None, f"the memory has {len(learned)} learned states (the banded form takes one)"
    W = learned[0]
    m = spec.model
    if m is None or not (isinstance(m.body, BinOp) and m.body.op == "@" and isinstance(m.body.left, Name)
                         and m.body.left.id == m.arg and isinstance(m.body.right, Name) and m.body.right.id == W):
        return None, f"the model is not the linear layer {m.arg if m else 'u'} @ {W}"
    if not (isinstance(spec.read, Call) and spec.read.fn == m.name) or names_in(spec.read) & set(spec.state):
        return None, f"the read is not {m.name}(x)"
    if sum(1 for c in window.row_loss.walk() if isinstance(c, Call) and c.fn == m.name) != 1:
        return None, "the row loss does not apply the model once"
    if spec.order != "write_read":
        return None, "the read comes before the write"
    coeff = rec.coeff.get(W, {})
    if set(coeff) - {("prev", W)} or rec.inputs.get(W):
        return None, f"the update of {W} reads other states"
    decay = coeff.get(("prev", W), Num(0))
    rest = rec.rest.get(W)
    step = _step_of(rest, set(sites))
    if step is None:
        return None, f"the update of {W} is not {W} <- a * {W} - b * grad(loss, {W})"
    env = ShapeEnv.from_spec(spec)
    for e in (decay, step):
        if env.infer(e) != () or alg.depends(e):
            return None, f"`{unparse(e)}` is not a token-local scalar"
    return WindowDual(W, decay, step), ""


def _step_of(rest, placeholders: set):
    """``b`` in ``rest = -(b * g)`` / ``-b * g`` / ``-g`` (g a gradient placeholder), else None."""
    if isinstance(rest, Neg):
        inner = rest.operand
        if isinstance(inner, Name) and inner.id in placeholders:
            return Num(1)
        if isinstance(inner, BinOp) and inner.op == "*":
            for a, g in ((inner.left, inner.right), (inner.right, inner.left)):
                if isinstance(g, Name) and g.id in placeholders and not (names_in(a) & placeholders):
                    return a
    return None
