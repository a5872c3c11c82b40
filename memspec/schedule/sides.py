"""Side symmetry: a matrix state read and updated on its value side is the same algebra transposed.

The normal form (:mod:`.transition`) writes every term of an update as ``c L S R`` -- ``L`` on
the state's rows (the key side), ``R`` on its columns (the value side) -- and the chunk
kernels take transitions on the key side and reads through probes ``p @ S``.  A memory
written in the column convention (``C <- C + outer(v, k)`` read ``C @ q``; the Oja rule
``S <- S Diag(g) + beta (k - S v) vᵀ``) has the same algebra on ``Cᵀ``: every right factor
``R`` is the left factor ``Rᵀ`` of ``Cᵀ``, an increment ``outer(a, b)`` is ``outer(b, a)`` and
a probe ``C @ q`` is ``q @ Cᵀ``.

:func:`orientation` decides from the normal form and the read which way the chunk families
see the states: as declared, or transposed when every side-specific use is on the value
side; a state used on both sides stays as declared, with the sites that disagree.
:func:`transposed_spec` writes the spec over ``Cᵀ`` (each state ``C`` replaced by ``Cᵀ``,
transposes pushed down to the leaves: ``(C Diag(g))ᵀ = Diag(g) Cᵀ``, ``Cᵀᵀ q = q @ Cᵀ``,
``outer(a, b)ᵀ = outer(b, a)``, ``grad(loss, C)ᵀ = grad(loss, Cᵀ)``); the code generator
keeps the user's layout and transposes the state into and out of the kernel call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..lang.expr import ELEMENTWISE_FUNCTIONS, Assign, BinOp, Call, Expr, FunDef, Name, Neg, Num, Transpose, \
    rewrite
from .algebra import Algebra, NotAdmitted, is_diag, txt
from .linear import Decomposer
from .transition import normal_form, side_text


@dataclass(frozen=True)
class Orientation:
    """How the chunk families see the matrix states."""

    transposed: tuple[str, ...]   # the states they see transposed (empty: as declared)
    text: str                     # explain's line ("" when no state has a side of its own)
    mixed: str | None = None      # why a state stays as declared although it is used on its value side


def orientation(alg: Algebra) -> Orientation:
    """The orientation of the spec's matrix states (computed once per Algebra)."""
    if "orientation" not in alg.memo:
        alg.memo["orientation"] = _orientation(alg)
    return alg.memo["orientation"]


def matrix_states(alg: Algebra) -> tuple[str, ...]:
    return tuple(n for n, s in alg.states.items() if not s.cache and len(s.shape) == 2)


def _orientation(alg: Algebra) -> Orientation:
    mats = matrix_states(alg)
    if not mats or alg.caches:
        return Orientation((), "")
    read_key, read_value = read_sites(alg, mats)
    upd_key, upd_value = update_sites(alg, mats, fallback=bool(read_value))   # (Sᵀ only for a read S @ q)
    key, value = read_key + upd_key, read_value + upd_value
    if value and not key:
        its = "its" if len(mats) == 1 else "their"
        what = []
        if read_value:
            what.append(f"read on {its} value side ({', '.join(read_value)})")
        if upd_value:
            what.append(f"updated on {its} value side ({', '.join(upd_value)})")
        elif read_value:
            what.append(f"updated on no side of {its} own")
        names = ", ".join(mats)
        return Orientation(mats, f"transposed ({'the state' if len(mats) == 1 else 'the states'} {names} "
                                 f"{'is' if len(mats) == 1 else 'are'} {' and '.join(what)}: the normal form and "
                                 f"the chunk kernels see {', '.join(n + 'ᵀ' for n in mats)}; the module keeps the "
                                 f"declared layout)")
    if value and key:
        why = (f"{'the state' if len(mats) == 1 else 'the states'} {', '.join(mats)} "
               f"{'is' if len(mats) == 1 else 'are'} used on the key side ({', '.join(key)}) and on the value "
               f"side ({', '.join(value)}): the key-side chunk kernels take the transitions and the probes on one "
               f"side, the key side of the state or of its transpose")
        return Orientation((), f"as declared ({why})", why)
    return Orientation((), "")   # as declared: explain has nothing to add


def shown(text: str, states) -> str:
    """A line of algebra about the transposed states with each name written ``Cᵀ``."""
    for n in states:
        text = re.sub(rf"(?<![\w.'\"]){re.escape(n)}(?=_prev|[^\wᵀ'\"]|$)", f"{n}ᵀ", text)
    return text


def read_sites(alg: Algebra, mats) -> tuple[list[str], list[str]]:
    """The probes of the read: ``p @ S`` (key side) and ``S @ q`` (value side), printed."""
    key: list[str] = []
    value: list[str] = []
    for e in alg.inline(alg.spec.read).walk():
        if not (isinstance(e, BinOp) and e.op == "@"):
            continue
        for mat, vec, side in ((e.right, e.left, key), (e.left, e.right, value)):
            if isinstance(mat, Transpose):   # p @ Sᵀ = S p, Sᵀ q = q @ S
                mat, side = mat.operand, (value if side is key else key)
            if isinstance(mat, Name) and mat.id in mats and alg.rank(vec) == 1:
                _add(side, txt(e))
    return key, value


def update_sites(alg: Algebra, mats, fallback: bool = True) -> tuple[list[str], list[str]]:
    """The factors of the normal form on each side of the states (``Diag(g) S``, ``S k kᵀ``),
    printed in the declared orientation; with ``fallback``, read from the normal form of ``Sᵀ``
    when the update is linear only written that way (a gradient of a column model ``W @ u``)."""
    try:
        nf, flip = normal_form(alg), False
    except NotAdmitted:
        if not fallback:
            return [], []
        try:
            nf, flip = normal_form(transposed_algebra(alg, mats)), True
        except NotAdmitted:
            return [], []
    key: list[str] = []
    value: list[str] = []
    for n in mats:
        for t in nf.maps[n].terms:
            left, right = (t.right.transposed(), t.left.transposed()) if flip else (t.left, t.right)
            if left.kind in ("diag", "outer"):
                _add(key, f"{side_text(left)} {t.state}")
            if right.kind in ("diag", "outer"):
                _add(value, f"{t.state} {side_text(right)}")
    return key, value


def _add(xs: list[str], x: str) -> None:
    if x not in xs:
        xs.append(x)


# ------------------------------------------------------------------ the spec over Sᵀ
def transposed_algebra(alg: Algebra, states) -> Algebra:
    """The Algebra of :func:`transposed_spec` (computed once per Algebra and set of states)."""
    key = ("transposed", tuple(states))
    if key not in alg.memo:
        alg.memo[key] = Algebra(transposed_spec(alg.spec, states))
    return alg.memo[key]


def transposed_spec(spec, states):
    """``spec`` written over ``Sᵀ`` for every state in ``states`` (same names, shapes reversed):
    the same memory, every value unchanged, the named states stored transposed."""
    flip = set(states)
    if not flip:
        return spec
    sub = {n: Transpose(Name(n)) for n in flip}
    dec = Decomposer(Algebra(spec))

    def swap(e: Expr) -> Expr:   # S -> (Sᵀ)ᵀ; grad(loss, S) -> its derived value, else grad(loss over Sᵀ, Sᵀ)ᵀ
        def visit(n: Expr):
            if isinstance(n, Name) and n.id in flip:
                return sub[n.id]
            if isinstance(n, Call) and n.fn == "grad" and _grad_target(spec, n) in flip:
                try:
                    return swap(dec.gradient(n))
                except NotAdmitted:
                    return Transpose(n)
            return None
        return rewrite(e, visit)

    state = {n: (s.model_copy(update={"shape": list(reversed(s.shape))}) if n in flip else s)
             for n, s in spec.state.items()}
    raw = spec.model_copy(update={"state": state})
    let = {n: swap(e) for n, e in spec.let.items()}
    model = spec.model
    if model is not None:
        model = FunDef(model.name, model.arg, swap(model.body), model.span, model.name_span, model.arg_span)
    update = [Assign(s.target, Transpose(swap(s.value)) if s.target in flip else swap(s.value), s.span,
                     s.target_span) for s in spec.update]
    loss = swap(spec.loss) if spec.loss is not None else None
    raw = raw.model_copy(update={"let": let, "model": model, "update": update, "loss": loss,
                                 "read": swap(spec.read)})
    alg = Algebra(raw)   # shapes of the rewritten values (temporaries' too), to push the transposes down
    for st in update:
        if st.target not in alg.states and alg.shape(st.value) is not None:
            alg.shapes[st.target] = alg.shape(st.value)
    if model is not None:   # the model's argument: the shape it is applied to
        uses = [c.args[0] for e in [loss, raw.read, *let.values(), *(st.value for st in update)] if e is not None
                for c in e.walk() if isinstance(c, Call) and c.fn == model.name and len(c.args) == 1]
        shape = next((alg.shape(x) for x in uses if alg.shape(x) is not None), None)
        if shape is not None:
            alg.shapes[model.arg] = shape
    push = _Pusher(alg).push
    if model is not None:
        model = FunDef(model.name, model.arg, push(model.body), model.span, model.name_span, model.arg_span)
    new = raw.model_copy(update={
        "let": {n: push(e) for n, e in let.items()}, "model": model,
        "update": [Assign(s.target, push(s.value), s.span, s.target_span) for s in update],
        "loss": push(loss) if loss is not None else None, "read": push(raw.read)})
    new._spans, new._key_spans, new._path = spec._spans, spec._key_spans, spec._path
    return new


def _grad_target(spec, call: Call) -> str | None:
    if len(call.args) == 2 and isinstance(call.args[1], Name):
        return call.args[1].id
    ms = spec.model_states()
    return ms[0] if len(ms) == 1 else None


class _Pusher:
    """Pushes transposes down to the leaves, keeping every value: ``(A + B)ᵀ = Aᵀ + Bᵀ``,
    ``(A B)ᵀ = Bᵀ Aᵀ``, ``(A * b)ᵀ = Diag(b) Aᵀ`` (``b`` broadcast over the columns),
    ``outer(a, b)ᵀ = outer(b, a)``, ``Aᵀ q = q @ A``, ``Diag(d)ᵀ = Diag(d)``, ``f(A)ᵀ = f(Aᵀ)``
    for elementwise ``f``; what has no such form keeps its transpose."""

    def __init__(self, alg: Algebra):
        self.alg = alg

    def rank(self, e: Expr) -> int | None:
        return self.alg.rank(e)

    def push(self, e: Expr, t: bool = False) -> Expr:
        """``e`` (``eᵀ`` when ``t``) with transposes pushed down."""
        if isinstance(e, Transpose):
            return self.push(e.operand, not t)
        if t and self.rank(e) in (0, 1):   # a scalar or a vector is its own transpose
            t = False
        if isinstance(e, (Name, Num)):
            return Transpose(e) if t else e
        if isinstance(e, Neg):
            return Neg(self.push(e.operand, t), span=e.span)
        if isinstance(e, BinOp):
            return self._binop(e, t)
        if isinstance(e, Call):
            return self._call(e, t)
        return Transpose(e) if t else e   # pragma: no cover - every node above

    def _binop(self, e: BinOp, t: bool) -> Expr:
        L, R = e.left, e.right
        rl, rr = self.rank(L), self.rank(R)
        if e.op == "@":
            if is_diag(L) or is_diag(R):
                d = L if is_diag(L) else R
                x = self.push(R if is_diag(L) else L, t)
                d = Call("diag", (self.push(d.args[0]),), fn_span=d.fn_span, span=d.span)
                return BinOp("@", d, x) if is_diag(L) != t else BinOp("@", x, d)
            if rl == 2 and rr == 2:
                return BinOp("@", self.push(R, True), self.push(L, True)) if t \
                    else BinOp("@", self.push(L), self.push(R))
            if rl == 1 and rr == 2:   # p @ M = Mᵀ p
                return self._probe(L, R, vec_left=True)
            if rl == 2 and rr == 1:   # M q = q @ Mᵀ
                return self._probe(R, L, vec_left=False)
            out = BinOp("@", self.push(L), self.push(R), span=e.span)
            return Transpose(out) if t else out
        if e.op in "+-^" or (e.op in "*/" and (rl == rr or 0 in (rl, rr))):
            if e.op == "^" or rl == rr or not t or 0 in (rl, rr):
                return BinOp(e.op, self.push(L, t), self.push(R, t), span=e.span)
        if e.op in "*/" and t and {rl, rr} == {1, 2}:   # (A * b)ᵀ = Diag(b) Aᵀ: b scales the columns
            m, b = (L, R) if rl == 2 else (R, L)
            b = self.push(b)
            if e.op == "/":
                if rl != 2:
                    return Transpose(BinOp(e.op, self.push(L), self.push(R), span=e.span))
                b = BinOp("/", Num(1), b)
            return BinOp("@", Call("diag", (b,)), self.push(m, True))
        out = BinOp(e.op, self.push(L), self.push(R), span=e.span)
        return Transpose(out) if t else out

    def _probe(self, vec: Expr, mat: Expr, *, vec_left: bool) -> Expr:
        """``vec @ mat`` (``vec_left``) or ``mat @ vec``, written without a transpose on ``mat``
        when it has one."""
        m = self.push(mat)
        if isinstance(m, Transpose):   # p @ Xᵀ = X p, Xᵀ q = q @ X
            return BinOp("@", m.operand, self.push(vec)) if vec_left else BinOp("@", self.push(vec), m.operand)
        return BinOp("@", self.push(vec), m) if vec_left else BinOp("@", m, self.push(vec))

    def _call(self, e: Call, t: bool) -> Expr:
        if e.fn == "outer":
            a, b = (self.push(x) for x in e.args)
            return Call("outer", (b, a) if t else (a, b), fn_span=e.fn_span, span=e.span)
        if e.fn in ("diag", "eye"):
            return Call(e.fn, tuple(self.push(x) for x in e.args), fn_span=e.fn_span, span=e.span)
        if e.fn == "grad":
            return Transpose(e) if t else e
        if e.fn in ELEMENTWISE_FUNCTIONS:
            return Call(e.fn, tuple(self.push(x, t) for x in e.args), fn_span=e.fn_span, span=e.span)
        out = Call(e.fn, tuple(self.push(x) for x in e.args), fn_span=e.fn_span, span=e.span)
        return Transpose(out) if t else out
