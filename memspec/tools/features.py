"""What a spec's update program is, read from its algebra (never its name): the features
the comparison table's columns are derived from (:mod:`.table`).

* **optimizer features** from the update program, expanded into a sum of terms:
  a term of ``X``'s update that has ``X`` itself as a factor *retains* the state
  (its coefficient, when not 1, is a decay); a term holding ``grad(...)`` is a
  gradient step (its other factors are the step size).  A state with a decayed
  update that feeds another state's update is **momentum**; a decayed state that is
  not momentum **forgets**.  A coefficient that depends on a gate or view is per
  token, else constant.
* the **optimizer** (SGD, momentum, Muon, mirror), the **loss window** and the **update
  frequency**, from the shape of the program.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from ..lang.blocks import gradient_terms, mentions_gradient
from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, format_number, is_diag, rewrite, substitute
from ..lang.normalize import canon
from ..lang.spec import Spec
from .mathtext import mname, render


Term = tuple  # (coefficient: float, factors: tuple[Expr, ...])


def inline_lets(spec: Spec, e: Expr) -> Expr:
    """``e`` with every let replaced by its definition (lets never read state)."""
    for _ in range(len(spec.let) + 1):
        new = substitute(e, dict(spec.let))
        if new == e:
            return new
        e = new
    return e


def terms(e: Expr) -> list[Term]:
    """``e`` as a sum of products: ``*`` distributed over ``+``/``-``; ``@``, calls and
    powers stay whole factors; ``a / b`` is ``a * (1 / b)``."""
    if isinstance(e, BinOp):
        if e.op == "+":
            return terms(e.left) + terms(e.right)
        if e.op == "-":
            return terms(e.left) + [(-c, f) for c, f in terms(e.right)]
        if e.op == "*":
            return [(c1 * c2, f1 + f2) for c1, f1 in terms(e.left) for c2, f2 in terms(e.right)]
        if e.op == "/":
            if isinstance(e.right, Num) and float(e.right.value) != 0:
                return [(c / float(e.right.value), f) for c, f in terms(e.left)]
            return [(c, f + (BinOp("/", Num(1), e.right),)) for c, f in terms(e.left)]
        if e.op == "@" and is_diag(e.left):   # a row scaling is a (per-channel) factor
            return [(c, (e.left,) + f) for c, f in terms(e.right)]
        if e.op == "@" and is_diag(e.right):  # a column scaling too
            return [(c, f + (e.right,)) for c, f in terms(e.left)]
    if isinstance(e, Neg):
        return [(-c, f) for c, f in terms(e.operand)]
    if isinstance(e, Num):
        return [(float(e.value), ())]
    return [(1.0, (e,))]


def names(e: Expr | Iterable[Expr]) -> set[str]:
    es = [e] if isinstance(e, Expr) else list(e)
    return {n.id for x in es for n in x.walk() if isinstance(n, Name)}


def degree(e: Expr, var: str, spec: Spec) -> Optional[int]:
    """Polynomial degree of ``e`` in the name ``var``: 0, 1, or None (non-linear)."""
    if isinstance(e, Name):
        return 1 if e.id == var else 0
    if isinstance(e, Num):
        return 0
    if isinstance(e, (Neg, Transpose)):
        return degree(e.operand, var, spec)
    if isinstance(e, BinOp):
        a, b = degree(e.left, var, spec), degree(e.right, var, spec)
        if a is None or b is None:
            return None
        if e.op in "+-":
            return max(a, b)
        if e.op in "*@":
            return a + b if a + b <= 1 else None
        if e.op == "/":
            return a if b == 0 else None
        return 0 if a == b == 0 else None  # ^
    if isinstance(e, Call):
        ds = [degree(x, var, spec) for x in e.args]
        if any(d is None for d in ds):
            return None
        if e.fn in ("outer",) or e.fn in ("sum", "mean"):
            s = sum(ds)
            return s if s <= 1 else None
        if e.fn in ("solve", "cg"):
            return ds[1] if ds[0] == 0 else None
        if spec.model is not None and e.fn == spec.model.name:
            inner = substitute(spec.model.body, {spec.model.arg: e.args[0]})
            return degree(inner, var, spec)
        return 0 if all(d == 0 for d in ds) else None
    return None


def _is_state(f: Expr, x: str) -> bool:
    return isinstance(f, Name) and f.id == x


def _is_grad(f: Expr) -> bool:
    return isinstance(f, Call) and f.fn == "grad"


@dataclass(frozen=True)
class Feature:
    """An optimizer feature: which gates drive it and whether it varies per token."""

    names: tuple[str, ...]      # gates (or other names) in its coefficient
    per_token: bool
    text: str                   # the coefficient, as math
    per_channel: bool = False   # a vector coefficient (a per-channel gate, diag(...) @ S)


@dataclass
class Features:
    step: Optional[Feature] = None
    step_kind: str = ""          # "gradient" | "additive" | ""
    momentum: Optional[Feature] = None
    momentum_states: tuple[str, ...] = ()
    forget: Optional[Feature] = None
    forget_states: tuple[str, ...] = ()
    grad_write: bool = False
    implicit_step: bool = False   # the step size depends on a view (a closed-form step)
    additive: bool = False        # every increment is independent of the state, no grad
    cache: bool = False
    model_linear: Optional[bool] = None
    learned_init: bool = False
    loss_kind: str = ""
    ratio_read: bool = False      # the read divides by a vector state
    solve_read: bool = False
    cg_read: bool = False        # the solve is a fixed number of conjugate-gradient steps (cg)
    window: bool = False          # the loss reads caches of recent tokens (a window loss)


def _per_channel(spec: Spec, factors: Iterable[Expr]) -> bool:
    """Does a coefficient scale channels one by one (a diag(...) factor or a vector gate or view)?"""
    vectors = {g for g, gt in spec.gates.items() if gt.shape}
    return any(is_diag(f) or names(inline_lets(spec, f)) & vectors for f in factors)


def _feature(spec: Spec, factors, text_expr: Expr) -> Feature:
    factors = list(factors)
    return Feature(tuple(sorted(names(factors) & set(spec.gates))), _per_token(spec, factors),
                   render(_undiag(text_expr)), _per_channel(spec, factors))


def _undiag(e: Expr) -> Expr:
    """A coefficient with each diag(a) factor written as a (its per-channel values)."""
    return rewrite(e, lambda n: n.args[0] if is_diag(n) else None)


def _per_token(spec: Spec, factors: Iterable[Expr]) -> bool:
    ns = set()
    for f in factors:
        ns |= names(inline_lets(spec, f))
    return bool(ns & (set(spec.gates) | set(spec.views)))


def _coef_expr(c: float, factors: tuple[Expr, ...]) -> Expr:
    out: Expr | None = None
    for f in factors:
        out = f if out is None else BinOp("*", out, f)
    if out is None:
        return Num(_int(c))
    if c == -1:
        return Neg(out)
    if c != 1:
        return BinOp("*", Num(_int(c)), out)
    return out


def _sum_expr(ts: list[Term]) -> Expr:
    out: Expr | None = None
    for c, f in ts:
        e = _coef_expr(abs(c), f) if out is not None else _coef_expr(c, f)
        out = e if out is None else BinOp("-" if c < 0 else "+", out, e)
    return out if out is not None else Num(0)


def _simplify_coef(ts: list[Term]) -> list[Term]:
    """Combine constant terms: ``1 - alpha`` stays, ``1 + 0`` becomes ``1``."""
    const = sum(c for c, f in ts if not f)
    rest = [(c, f) for c, f in ts if f]
    return ([(const, ())] if const else []) + rest


def state_updates(spec: Spec) -> list[tuple[str, Expr]]:
    """The state statements with the per-token temporaries written into them
    (``g = grad(loss, W); W = W - eta * g`` reads as ``W = W - eta * grad(loss, W)``)."""
    temps: dict[str, Expr] = {}
    out = []
    for st in spec.update:
        v = substitute(st.value, temps) if temps else st.value
        if st.target in spec.state:
            out.append((st.target, v))
        else:
            temps.setdefault(st.target, v)
    return out


def _step(spec: Spec, ft: Features, increments: dict, states: set) -> None:
    """``ft.step`` and its kind: the gradient step's factors, or an additive write's gate."""
    # step: the factors multiplying grad(...) -- in a term of the update, or inside a call that
    # transforms the step (a normalisation, Newton-Schulz, a softmax): its gradient terms
    step_terms = [(c, tuple(y for y in f if not _is_grad(y)))
                  for ts in increments.values() for c, f in ts if any(_is_grad(y) for y in f)]
    # Muon: the step multiplies the orthogonalised momentum, W <- W - eta NS(S)
    muon = [(c, tuple(y for y in f if not (isinstance(y, Call) and y.fn == "newton_schulz")))
            for ts in increments.values() for c, f in ts
            if any(isinstance(y, Call) and y.fn == "newton_schulz" and not mentions_gradient(y.args[0])
                   for y in f)]
    if muon and all(not f for _, f in step_terms):
        step_terms = muon
    if not step_terms:
        for _, value in state_updates(spec):
            for t in gradient_terms(value, lambda a: not (names(a) & states) and not any(
                    _is_grad(n) for n in a.walk())):
                step_terms += [(c, tuple(y for y in f if not _is_grad(y))) for c, f in terms(t)
                               if any(_is_grad(y) for y in f)]
    ft.grad_write = bool(step_terms)
    if step_terms:
        c, f = step_terms[0]
        ft.step = _feature(spec, f, _coef_expr(abs(c), f))
        ft.step_kind = "gradient"
        ft.implicit_step = bool(names([inline_lets(spec, y) for y in f]) & set(spec.views))
    else:
        gated = [(c, f) for ts in increments.values() for c, f in ts
                 if names(f) & set(spec.gates) and not names(f) & states]
        if gated:
            c, f = gated[0]
            mult = tuple(y for y in f if names(y) & set(spec.gates))
            ft.step = _feature(spec, mult, _coef_expr(1.0, mult))
            ft.step_kind = "additive"


def features(spec: Spec) -> Features:
    ft = Features()
    caches = {n for n, s in spec.state.items() if s.cache}
    # a cache the read matches against (attention); a cache only the loss reads is its window
    ft.cache = bool(names(inline_lets(spec, spec.read)) & caches)
    ft.window = bool(spec.loss is not None and names(inline_lets(spec, spec.loss)) & caches)
    ft.learned_init = any(s.learned for s in spec.state.values())
    states = set(spec.state)
    retention: dict[str, list[list[Term]]] = {}
    increments: dict[str, list[Term]] = {}
    for x, value in state_updates(spec):
        ret, inc = [], []
        for c, f in terms(value):
            hits = [i for i, y in enumerate(f) if _is_state(y, x)]
            if len(hits) == 1:
                ret.append((c, f[: hits[0]] + f[hits[0] + 1:]))
            else:
                inc.append((c, f))
        retention.setdefault(x, []).append(_simplify_coef(ret))
        increments.setdefault(x, []).extend(inc)
    _step(spec, ft, increments, states)
    # decay: a retention coefficient other than exactly 1
    decayed: dict[str, list[Term]] = {}
    for x, rets in retention.items():
        for ts in rets:
            if ts and ts != [(1.0, ())]:
                decayed.setdefault(x, ts)
    readers: dict[str, set[str]] = {}
    for x, ts in increments.items():
        for c, f in ts:  # the state a grad(...) differentiates is not read as a value
            for n in names([y for y in f if not _is_grad(y)]) & states:
                if n != x:
                    readers.setdefault(n, set()).add(x)
    mom = [x for x in decayed if readers.get(x)]
    fgt = [x for x in decayed if not readers.get(x)]
    if mom:
        ts = decayed[mom[0]]
        ft.momentum = _feature(spec, [y for _, f in ts for y in f], _sum_expr(ts))
        ft.momentum_states = tuple(mom)
    if fgt:
        ts = decayed[fgt[0]]
        ft.forget = _feature(spec, [y for _, f in ts for y in f], _sum_expr(ts))
        ft.forget_states = tuple(fgt)
    ft.additive = not ft.grad_write and not caches and all(
        not (names(f) & states) for ts in increments.values() for _, f in ts)
    if spec.model is not None:
        used = spec.model_states()
        ft.model_linear = all(degree(spec.model.body, s, spec) in (0, 1) for s in used)
    ft.loss_kind = loss_kind(spec)
    read = inline_lets(spec, spec.read)
    for n in read.walk():
        if isinstance(n, BinOp) and n.op == "/":
            den = names(n.right) & states
            if any(len(spec.state[s].shape) == 1 for s in den):
                ft.ratio_read = True
        if isinstance(n, Call) and n.fn in ("solve", "cg"):
            ft.solve_read = True
            ft.cg_read = n.fn == "cg"
    return ft


def optimizer_kind(spec: Spec, ft: Features | None = None) -> str:
    """SGD, momentum, Muon or mirror, from the shape of the update program (never a name):
    ``mirror`` when a state steps as ``softmax(a log S + ...)`` (exponentiated gradient), or is
    ``softmax(Z)`` of logits ``Z`` that a gradient step moves (the same step written on the logits),
    ``Muon`` when a Newton-Schulz iteration orthogonalises a gradient or a momentum before it
    moves a state, ``momentum`` when a decayed state feeds another state's update, else
    ``SGD``; ``, renormalised`` when a step is followed by a normalisation of the state."""
    ft = ft or features(spec)
    if not ft.grad_write:
        return "—"
    states = set(spec.state)
    kinds: list[str] = []
    renorm = False
    stepped = {y for y, v in state_updates(spec) if mentions_gradient(v)}   # states a gradient step moves
    for x, value in state_updates(spec):
        for n in value.walk():
            if isinstance(n, Call) and n.fn == "softmax" and any(
                    isinstance(c, Call) and c.fn == "log" and c.args and _is_state(c.args[0], x) for c in n.args[0].walk()):
                kinds.append("mirror")
            elif isinstance(n, Call) and n.fn == "softmax" and names(n.args[0]) & (stepped - {x}):
                kinds.append("mirror")
            if isinstance(n, Call) and n.fn == "newton_schulz":
                inner = names(n.args[0]) & states
                kinds.append("Muon (on momentum)" if inner - {x} else "Muon")
            if isinstance(n, Call) and n.fn in ("l2norm", "norm", "rmsnorm", "layernorm") and \
                    x in names(n.args[0]) and mentions_gradient(n.args[0]):
                renorm = True
    if not kinds:
        kinds.append("momentum" if ft.momentum else "SGD")
    kind = kinds[0]
    return kind + (", renormalised" if renorm else "")


def loss_window(spec: Spec) -> str:
    """The tokens one token's inner loss sees: ``1 token``, or the window of the caches it reads
    (``last 8 tokens``, ``, weighted`` when a cache of scalars weighs the rows)."""
    if spec.loss is None or not any(_is_grad(n) for st in spec.update for n in st.value.walk()):
        return "—"
    caches = [n for n in names(inline_lets(spec, spec.loss)) if n in spec.state and spec.state[n].cache]
    if not caches:
        return "1 token"
    wins = {spec.state[c].window for c in caches}
    w = "all past tokens" if None in wins else f"last {max(wins)} tokens"
    weighted = any(not spec.state[c].shape for c in caches)
    return w + (", weighted" if weighted else "")


def update_frequency(spec: Spec) -> str:
    """How often each state updates: ``every token``, ``W₂ every 4, W₃ every 8`` (block updates,
    the others every token), or the chunks of the apply-then-update schedule."""
    if spec.schedule_kind == "apply_update":
        return f"once per chunk of {spec.schedule_size} (apply, then update)"
    slow = [(n, st.every) for n, st in spec.state.items() if st.every and st.every > 1]
    if not slow:
        return "every token"
    return ", ".join(f"{mname(n)} every {c}" for n, c in slow) + "; others every token"


def loss_kind(spec: Spec) -> str:
    """``squared error``, ``Huber``, ``lp (p = 3)``, ``dot product``, ``custom`` or ``""`` (no loss)."""
    if spec.loss is None:
        return ""
    t = canon(spec.loss, spec.model.name if spec.model else None)
    if t[0] == "prod":
        t = t[2][0] if len(t[2]) == 1 else t
    if t[0] == "call" and t[1] in ("sum", "mean") and len(t[2]) == 1:
        a = t[2][0]
        if a[0] == "pow" and a[2] == ("num", 2.0):
            return "squared error"
        if a[0] == "matmul" and len(a[1]) == 2 and a[1][1][0] == "pow" and a[1][1][2] == ("num", 2.0):
            return "weighted squared error"   # sum(G @ (f(K) - V)^2): rows weighted by a cache of scalars
        if a[0] == "call" and a[1] == "huber":
            return "Huber"
        if a[0] == "pow" and a[1][0] == "call" and a[1][1] == "abs":
            p = a[2]
            if p[0] == "name" and p[1] in spec.constants:
                return f"ℓp (p = {format_number(_int(spec.constants[p[1]]))})"
            if p[0] == "num":
                return f"ℓp (p = {format_number(_int(p[1]))})"
            return "ℓp"
    out = "__model_output__"
    if spec.model is not None:
        e = _replace_model_calls(spec.loss, spec.model.name, out)
        if degree(e, out, spec) == 1:
            return "dot product"
    return "custom"


def _int(v: float):
    return int(v) if float(v).is_integer() else v


def _replace_model_calls(e: Expr, fn: str, name: str) -> Expr:
    return rewrite(e, lambda n: Name(name) if isinstance(n, Call) and n.fn == fn else None)
