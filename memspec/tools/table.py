"""The comparison table: one row per spec, every column derived from the spec's algebra.

``rows(specs)`` reads each spec the way the seed text reads the papers and never
looks at its name:

* **optimizer features** from the update program, expanded into a sum of terms:
  a term of ``X``'s update that has ``X`` itself as a factor *retains* the state
  (its coefficient, when not 1, is a decay); a term holding ``grad(...)`` is a
  gradient step (its other factors are the step size).  A state with a decayed
  update that feeds another state's update is **momentum**; a decayed state that is
  not momentum **forgets**.  A coefficient that depends on a gate or view is per
  token, else constant.
* **problem reached** and **main mechanism** from a ladder of derived features:
  a cache (retain entries, read by matching) -> an additive fixed-size summary
  (numerator matrix and normalisation vector when the read divides by a vector
  state) -> a gradient write into a model linear in its state (error-based write)
  -> a model non-linear in its state (an inner learner) -> extras: momentum,
  decay, a non-quadratic inner loss, an implicit key-dependent step, a wiring.
* **costs** per token and head of a write and a read, from the shapes (:mod:`.costs`).
* **schedule** from :func:`memspec.schedule.analyse`.

``render_table(rows, "markdown" | "text" | "csv")`` prints them.
"""
from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass, fields
from typing import Iterable, Optional

from .diff import WIRING_FIELDS, derived_schedule
from ..lang.errors import printable
from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, format_number, rewrite, substitute
from ..lang.normalize import canon
from ..lang.spec import Spec
from .costs import Coster, cost_text
from .mathtext import mname, render

# ------------------------------------------------------------------- algebra
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
        if e.op == "@" and _is_diag(e.left):   # a row scaling is a (per-channel) factor
            return [(c, (e.left,) + f) for c, f in terms(e.right)]
        if e.op == "@" and _is_diag(e.right):  # a column scaling too
            return [(c, f + (e.right,)) for c, f in terms(e.left)]
    if isinstance(e, Neg):
        return [(-c, f) for c, f in terms(e.operand)]
    if isinstance(e, Num):
        return [(float(e.value), ())]
    return [(1.0, (e,))]


def _is_diag(e: Expr) -> bool:
    return isinstance(e, Call) and e.fn == "diag"


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
        if e.fn == "solve":
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


def _per_channel(spec: Spec, factors: Iterable[Expr]) -> bool:
    """Does a coefficient scale channels one by one (a diag(...) factor or a vector gate or view)?"""
    vectors = {g for g, gt in spec.gates.items() if gt.shape}
    return any(_is_diag(f) or names(inline_lets(spec, f)) & vectors for f in factors)


def _feature(spec: Spec, factors, text_expr: Expr) -> Feature:
    factors = list(factors)
    return Feature(tuple(sorted(names(factors) & set(spec.gates))), _per_token(spec, factors),
                   render(_undiag(text_expr)), _per_channel(spec, factors))


def _undiag(e: Expr) -> Expr:
    """A coefficient with each diag(a) factor written as a (its per-channel values)."""
    return rewrite(e, lambda n: n.args[0] if _is_diag(n) else None)


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


def features(spec: Spec) -> Features:
    ft = Features()
    ft.cache = any(s.cache for s in spec.state.values())
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
    # step: the factors multiplying grad(...)
    step_terms = [(c, tuple(y for y in f if not _is_grad(y)))
                  for ts in increments.values() for c, f in ts if any(_is_grad(y) for y in f)]
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
    ft.additive = not ft.grad_write and not ft.cache and all(
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
        if isinstance(n, Call) and n.fn == "solve":
            ft.solve_read = True
    return ft


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


# ----------------------------------------------------- problem / mechanism
LEVELS = ("cache", "additive", "error", "learner")


def ladder(spec: Spec, ft: Features) -> tuple[str, str]:
    """(problem reached, main mechanism), from the derived features."""
    if ft.cache:
        level, problem = "cache", "Retain individual key/value entries and read them by matching"
        mech = "explicit key/value cache read by softmax matching"
        if any(s.window for s in spec.state.values()):
            mech += " over a sliding window"
    elif ft.grad_write and ft.model_linear:
        level, problem = "error", "Correct an existing association instead of only adding"
        mech = ("error-based write into fast weights" if ft.loss_kind == "squared error"
                else f"gradient write of a {ft.loss_kind or 'custom'} loss into fast weights")
    elif ft.grad_write:
        level, problem = "learner", "Choose a richer state and learn what its local task should be"
        parts = ["inner learner", "learned views"]
        if ft.learned_init or spec.params:
            parts.append("outer objective")
        mech = ", ".join(parts)
    elif ft.solve_read:
        level, problem = "additive", "Read the least-squares fit of all stored associations"
        mech = "key/value statistics read by an exact least-squares solve"
    else:
        level, problem = "additive", "Avoid scanning a growing list with a suitable similarity"
        ranks = sorted({len(s.shape) for s in spec.state.values()})
        mech = ("recurrent numerator matrix and normalisation vector" if ft.ratio_read and 1 in ranks and 2 in ranks
                else "recurrent additive summary")
    extras = []
    if ft.momentum:
        extras.append("momentum")
    if ft.forget:
        extras.append("decay")
    if ft.implicit_step:
        extras.append("implicit key-dependent step")
    if level == "learner" and ft.loss_kind not in ("", "squared error"):
        extras.append(f"{ft.loss_kind} inner loss")
    wired = spec.wiring.kind != "none"
    if wired:
        extras.append(f"memory-attention wiring ({spec.wiring.kind.upper()})")
    if not extras:
        return problem, _cap(mech)
    if ft.momentum or ft.forget:
        extra_problem = "manage continuing writes" + (" and combine history with local context" if wired else "")
    elif wired:
        extra_problem = "combine history with local context"
    elif ft.implicit_step:
        extra_problem = "keep each write stable whatever the key's norm"
    else:
        extra_problem = "choose what the inner objective penalises"
    if level == "learner":  # the extras are what is new beyond an inner learner
        return _cap(extra_problem), _cap(", ".join(extras))
    return f"{problem}; {extra_problem}", _cap(", ".join([mech] + extras))


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# -------------------------------------------------------------------- rows
COLUMNS = (
    ("spec", "spec"), ("problem", "problem reached"), ("mechanism", "main mechanism"),
    ("state", "state"), ("write", "write rule"), ("loss", "loss"),
    ("step", "step"), ("momentum", "momentum"), ("forget", "forget"),
    ("read", "read"), ("schedule", "schedule"), ("wiring", "wiring"),
    ("write_cost", "write cost"), ("read_cost", "read cost"), ("cite", "citation"),
)


@dataclass(frozen=True)
class Row:
    spec: str
    problem: str
    mechanism: str
    state: str
    write: str
    loss: str
    step: str
    momentum: str
    forget: str
    read: str
    schedule: str
    wiring: str
    write_cost: str
    read_cost: str
    cite: str


def _feature_text(f: Optional[Feature], states: tuple[str, ...] = ()) -> str:
    if f is None:
        return "—"
    s = f.text + (", per token" if f.per_token else ", constant") + (", per channel" if f.per_channel else "")
    if states:
        s += " (" + ", ".join(mname(x) for x in states) + ")"
    return s


def _state_text(spec: Spec, cache_axis: str) -> str:
    out = []
    for n, s in spec.state.items():
        if s.cache:
            shape = ([f"≤{s.window}"] if s.window else [cache_axis]) + list(s.shape)
            out.append(f"{mname(n)} cache [{', '.join(shape)}]")
        else:
            out.append(f"{mname(n)} [{', '.join(s.shape)}]" + (" learned init" if s.learned else ""))
    return ", ".join(out)


def _schedule_text(spec: Spec) -> str:
    d = derived_schedule(spec)
    s = d.family + (f" chunk {d.chunk}" if d.chunk else "")
    return s + (", exact" if d.exact else ", approximate")


def _wiring_text(spec: Spec) -> str:
    w = spec.wiring
    if w.kind == "none":
        return "none"
    def text(v):
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    return w.kind.upper() + " (" + ", ".join(f"{f} {text(getattr(w, f))}" for f in WIRING_FIELDS[w.kind]) + ")"


def _cite_text(spec: Spec) -> str:
    return spec.cite.split(";")[0].strip()


def row(spec: Spec) -> Row:
    ft = features(spec)
    problem, mech = ladder(spec, ft)
    coster = Coster(spec)
    write_cost: Counter = Counter()
    for st in spec.update:
        write_cost += coster.cost(inline_lets(spec, st.value))
    read_cost = coster.cost(inline_lets(spec, spec.read))
    axis = coster.env.cache_axis
    loss = "—"
    if spec.loss is not None:
        loss = f"{ft.loss_kind}: {render(spec.loss)}"
    step = _feature_text(ft.step)
    if ft.step is not None and ft.step.text in {mname(n) for n in spec.let}:
        name = next(n for n in spec.let if mname(n) == ft.step.text)
        step = f"{ft.step.text} = {render(spec.let[name])}" + step[len(ft.step.text):]
    if ft.step is not None and ft.step_kind == "additive":
        step += " (additive write)"
    return Row(
        spec=spec.name, problem=problem, mechanism=mech,
        state=_state_text(spec, axis),
        write="; ".join(f"{mname(s.target)} {'←' if s.target in spec.state else '='} {render(s.value)}"
                        for s in spec.update) or "—",
        loss=loss,
        step=step,
        momentum=_feature_text(ft.momentum, ft.momentum_states),
        forget=_feature_text(ft.forget, ft.forget_states),
        read=render(spec.read),
        schedule=_schedule_text(spec),
        wiring=_wiring_text(spec),
        write_cost=cost_text(write_cost, spec, axis),
        read_cost=cost_text(read_cost, spec, axis),
        cite=_cite_text(spec),
    )


def rows(specs: Iterable[Spec]) -> list[Row]:
    return [row(s) for s in specs]


# --------------------------------------------------------------- rendering
def render_table(rs: list[Row], fmt: str = "markdown") -> str:
    keys = [k for k, _ in COLUMNS]
    heads = [h for _, h in COLUMNS]
    # spec text (citations, names, formulas) is printed escaped: no terminal control characters
    rs = [Row(**{f.name: printable(getattr(r, f.name)) for f in fields(Row)}) for r in rs]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(heads)
        for r in rs:
            w.writerow([getattr(r, k) for k in keys])
        return buf.getvalue()
    if fmt == "text":
        width = max(len(h) for h in heads)
        blocks = []
        for r in rs:
            lines = [r.spec]
            for k, h in COLUMNS[1:]:
                lines.append(f"  {h.ljust(width)}  {getattr(r, k)}")
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks) + ("\n" if blocks else "")
    if fmt != "markdown":
        raise ValueError(f"unknown table format {fmt!r}: use markdown, text or csv")

    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rs:
        out.append("| " + " | ".join(cell(getattr(r, k)) for k in keys) + " |")
    return "\n".join(out) + "\n"
