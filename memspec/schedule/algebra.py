"""The algebra every schedule family reads: a spec with its lets and inner model inlined,
named-dim shapes, expression simplification and the update program's normal forms.

Everything here is exact symbolic manipulation of :mod:`memspec.lang.expr` trees; the
families (:mod:`.cache`, :mod:`.additive`, :mod:`.delta`, :mod:`.minibatch`) build on it and
:mod:`.decide` lists them in order.  A family that does not apply raises
:class:`NotAdmitted` with one line of algebra; any other exception is a bug.
"""
from __future__ import annotations

import contextvars

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, rewrite, substitute, unparse


class NotAdmitted(Exception):
    """One family does not apply; ``str(err)`` says why (one line of algebra)."""


# ---------------------------------------------------------- expressions
ZERO, ONE = Num(0), Num(1)

def is_num(e: Expr, v: float | None = None) -> bool:
    return isinstance(e, Num) and (v is None or float(e.value) == v)


def num(v: float) -> Num:
    return Num(int(v) if float(v).is_integer() and abs(v) < 1e15 else float(v))


def simplify(e: Expr) -> Expr:
    """Fold numbers and the neutral elements 0 and 1 (for readable plans and messages)."""
    if isinstance(e, BinOp):
        a, b = simplify(e.left), simplify(e.right)
        op = e.op
        if is_num(a) and is_num(b) and op in "+-*/" and not (op == "/" and is_num(b, 0)):
            x, y = float(a.value), float(b.value)
            return num({"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else 0}[op])
        if op == "+":
            if is_num(a, 0):
                return b
            if is_num(b, 0):
                return a
            if isinstance(b, Neg):
                return simplify(BinOp("-", a, b.operand))
            if isinstance(b, BinOp) and b.op in "*/" and isinstance(b.left, Neg):
                return BinOp("-", a, BinOp(b.op, b.left.operand, b.right))
            if isinstance(b, Num) and float(b.value) < 0:
                return BinOp("-", a, num(-float(b.value)))
        if op == "-":
            if is_num(b, 0):
                return a
            if is_num(a, 0):
                return simplify(Neg(b))
            if isinstance(b, Neg):
                return simplify(BinOp("+", a, b.operand))
        if op == "*":
            if is_num(a, 0) or is_num(b, 0):
                return ZERO
            if is_num(a, 1):
                return b
            if is_num(b, 1):
                return a
            if is_num(a, -1):
                return simplify(Neg(b))
            if is_num(b, -1):
                return simplify(Neg(a))
            if isinstance(a, Neg) or isinstance(b, Neg):
                x = a.operand if isinstance(a, Neg) else a
                y = b.operand if isinstance(b, Neg) else b
                inner = simplify(BinOp("*", x, y))
                return inner if isinstance(a, Neg) and isinstance(b, Neg) else simplify(Neg(inner))
        if op == "/":
            if is_num(b, 1):
                return a
            if isinstance(a, Neg):
                return simplify(Neg(BinOp("/", a.operand, b)))
            if is_num(a, 0):
                return ZERO
        if op == "@" and (is_num(a, 0) or is_num(b, 0)):
            return ZERO
        return BinOp(op, a, b)
    if isinstance(e, Neg):
        a = simplify(e.operand)
        if isinstance(a, Neg):
            return a.operand
        if is_num(a):
            return num(-float(a.value))
        return Neg(a)
    if isinstance(e, Transpose):
        a = simplify(e.operand)
        if is_num(a):
            return a
        if isinstance(a, Transpose):
            return a.operand
        return Transpose(a)
    if isinstance(e, Call):
        args = tuple(simplify(a) for a in e.args)
        if e.fn == "outer" and any(is_num(a, 0) for a in args):
            return ZERO
        return Call(e.fn, args)
    return e


def is_diag(e: Expr) -> bool:
    """``diag(a)``: the diagonal matrix of a vector, only ever an operand of ``@``."""
    return isinstance(e, Call) and e.fn == "diag"


def mul(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("*", a, b))


def add(a: Expr, b: Expr) -> Expr:
    return simplify(BinOp("+", a, b))


def names_in(e: Expr) -> set[str]:
    return {n.id for n in e.walk() if isinstance(n, Name)}


def drop_grads(e: Expr) -> Expr:
    """``e`` with every ``grad(...)`` replaced by 0 (what it reads besides its gradients)."""
    return rewrite(e, lambda n: ZERO if isinstance(n, Call) and n.fn == "grad" else None)


SHOW_LETS: contextvars.ContextVar = contextvars.ContextVar("SHOW_LETS", default=())


def fold_lets(e: Expr, lets) -> Expr:
    """Write subexpressions equal to a let's inlined value as the let's name (for messages)."""
    for inl, n in lets:
        if e == inl:
            return Name(n)
    if isinstance(e, BinOp):
        return BinOp(e.op, fold_lets(e.left, lets), fold_lets(e.right, lets))
    if isinstance(e, (Neg, Transpose)):
        return type(e)(fold_lets(e.operand, lets))
    if isinstance(e, Call):
        return Call(e.fn, tuple(fold_lets(a, lets) for a in e.args))
    return e


def txt(e: Expr) -> str:
    e = simplify(e)
    lets = SHOW_LETS.get()
    return unparse(fold_lets(e, lets) if lets else e)


# ------------------------------------------------------------- context
class Algebra:
    """A spec with lets and the model inlined, plus shape inference on named dims."""

    def __init__(self, spec):
        self.spec = spec
        self.states = dict(spec.state)
        self.caches = {n for n, s in spec.state.items() if s.cache}
        self.model = spec.model
        self.memo: dict = {}            # analyses of this spec computed once per decision (normal_form)
        self.shapes: dict[str, tuple] = {}
        for n in spec.dims:
            self.shapes[n] = ()
        for n in spec.constants:
            self.shapes[n] = ()
        for n, v in spec.views.items():
            self.shapes[n] = (v.dim,)
        for n, g in spec.gates.items():
            self.shapes[n] = tuple(g.shape)   # () for a scalar gate, (d,) per channel
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
            if e.op == "@" and is_diag(e.left):    # diag(a) @ X: X with its rows scaled
                return b
            if e.op == "@" and is_diag(e.right):   # X @ diag(b): its columns
                return a
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
            if f == "diag":   # the diagonal matrix (only ever an operand of @, never formed)
                return None if args[0] is None else args[0] + args[0]
            if f == "eye":
                a = e.args[0]
                return (a.id, a.id) if isinstance(a, Name) else ("?", "?")
            if f == "grad":
                t = self.grad_target(e)
                return self.shapes.get(t) if t else None
            if f == "attend":
                v = args[2] if len(args) > 2 else None
                return v[1:] if v else None
            if f in ("solve", "cg"):
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


# ------------------------------------------------------- the update program
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


def all_updates(alg: Algebra) -> list[tuple[str, Expr]]:
    """Every update statement (temporaries included), lets and the model inlined."""
    return [(s.target, alg.inline(s.value)) for s in alg.spec.update]


def state_updates(alg: Algebra) -> list[tuple[str, Expr]]:
    """The state statements, with the per-token temporaries inlined into the statements
    that use them (``g = grad(loss, W); W = W - eta * g`` reads as ``W = W - eta * grad(loss, W)``).

    Inlining is exact when no state the temporary depends on (any state, for a value
    holding ``grad``, the model or a cache) is written between its statement and the use;
    otherwise the family needs the temporary's position and is not admitted."""
    temps: dict[str, tuple[Expr, int]] = {}
    out: list[tuple[str, Expr]] = []
    written: list[str] = []   # state targets in program order
    for tgt, e in all_updates(alg):
        used = {t for t in names_in(e) if t in temps}
        for t in sorted(used):
            value, at = temps[t]
            deps = names_in(value) & set(alg.states)
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


def compose_all(alg: Algebra, updates: list[tuple[str, Expr]]) -> dict[str, Expr]:
    """:func:`compose` over every statement, temporaries included: each temporary is
    expressed in the states before the token, like the states (exact whatever the order)."""
    cur: dict[str, Expr] = {}
    for tgt, e in updates:
        cur[tgt] = substitute(e, cur) if cur else e
    return {n: v for n, v in cur.items() if n in alg.states}


def compose(alg: Algebra, updates: list[tuple[str, Expr]]) -> dict[str, Expr]:
    """The state after the whole update program, as expressions in the states before it."""
    cur: dict[str, Expr] = {}
    for tgt, e in updates:
        cur[tgt] = substitute(e, cur) if cur else e
    return cur


def replace_call(e: Expr, target: Call, repl: Expr) -> Expr:
    if isinstance(e, Call) and e == target:
        return repl
    if isinstance(e, BinOp):
        return BinOp(e.op, replace_call(e.left, target, repl), replace_call(e.right, target, repl))
    if isinstance(e, (Neg, Transpose)):
        return type(e)(replace_call(e.operand, target, repl))
    if isinstance(e, Call):
        return Call(e.fn, tuple(replace_call(a, target, repl) for a in e.args))
    return e
