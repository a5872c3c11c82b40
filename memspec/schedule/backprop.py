"""Closed-form gradients of the inner loss: reverse-mode differentiation at compile time.

A state that enters the loss only through linear *sites* -- ``x @ W`` (a vector times the
matrix W) or ``a + b`` (a vector plus the vector b) -- has the gradient

    grad(loss, W) = sum over its sites of outer(x, delta),    grad(loss, b) = sum of delta,

with ``delta`` the gradient of the loss with respect to the site's output.  The deltas are
found here once, symbolically: the loss (model inlined) is written as straight-line
steps (the sites, and every intermediate value a derivative needs), then its adjoints are
propagated backwards through the expression rules of the language -- sums, products,
powers, the elementwise functions, ``layernorm`` / ``rmsnorm`` / ``l2norm``, ``huber`` --
and through each site (``delta_x = delta_y @ W^T``).  The result (:class:`ClosedGrad`)
is two lists of steps that the code generator emits as plain tensor code, in place of a
``torch.func.grad`` (a second autograd graph per chunk or per token, and a double
backward when training).  A loss outside these rules (``min``, ``clamp``, a state used
other than through a site, ...) raises :class:`NoClosedForm`, and the generated code keeps
``torch.func.grad``.

Derivatives with no expression in the language (``gelu``, ``silu``, the norms) are calls
of runtime helpers named ``_<fn>_grad``, ``_gelu_backward`` and ``_silu_backward``
(:mod:`memspec.runtime.helpers`), which a spec cannot name.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, substitute, unparse
from ..lang.names import GENERATED_NAMES, LANGUAGE_NAMES, fresh
from ..lang.shapes import ShapeEnv
from .algebra import ONE, add, is_num, mul, simplify


class NoClosedForm(Exception):
    """The loss has no closed-form gradient by these rules (``str`` says why)."""


@dataclass(frozen=True)
class Step:
    """One line of the gradient program: ``name = ...`` of kind

    * ``expr``: ``value``, a token-local expression of earlier steps and the inputs;
    * ``layer``: ``value @ state`` (``value`` the name of the input vector);
    * ``bias``: ``value + state``;
    * ``back``: ``value @ state^T`` (the adjoint of a layer's input).

    ``shape`` is the named shape of one token's value; ``like`` (backward steps) the
    forward step whose shape the adjoint has."""

    name: str
    kind: str
    value: Expr
    state: str | None
    shape: tuple
    like: str | None = None


@dataclass(frozen=True)
class Site:
    """A linear site: ``state`` enters as ``input @ state`` (``input`` None: ``a + state``);
    ``output`` is the step of the site's value and ``delta`` the loss's gradient w.r.t. it
    (a step name, or an input name)."""

    state: str
    input: str | None
    output: str
    delta: str


@dataclass(frozen=True)
class ClosedGrad:
    """The loss's gradient with respect to each target state, in closed form: run
    ``forward`` then ``backward``; ``grad(loss, S)`` is ``sum over S's sites of
    outer(input, delta)`` (a bias: ``sum of delta``)."""

    forward: tuple
    backward: tuple
    sites: tuple

    def of(self, state: str) -> list:
        return [s for s in self.sites if s.state == state]

    def describe(self) -> list[str]:
        grads = []
        for st in dict.fromkeys(s.state for s in self.sites):
            terms = [f"outer({s.input}, {s.delta})" if s.input else s.delta for s in self.of(st)]
            grads.append(f"grad(loss, {st}) = {' + '.join(terms)}")
        body = "; ".join(f"{s.name} = {step_text(s)}" for s in self.forward + self.backward)
        return ["closed-form gradient (reverse mode at compile time, no torch.func.grad): "
                + ", ".join(grads) + f", with {body}"]


def step_text(s: Step) -> str:
    if s.kind == "layer":
        return f"{unparse(s.value)} @ {s.state}"
    if s.kind == "bias":
        return f"{unparse(s.value)} + {s.state}"
    if s.kind == "back":
        return f"{unparse(s.value)} @ {s.state}^T"
    return unparse(s.value)


# derivatives f'(x) of the elementwise functions, in the language (x: the argument)
def _elementwise_derivative(fn: str, x: Expr) -> Expr | None:
    f = Call(fn, (x,))
    table = {
        "exp": lambda: f,
        "log": lambda: BinOp("/", ONE, x),
        "sqrt": lambda: BinOp("/", Num(0.5), f),
        "abs": lambda: Call("sign", (x,)),
        "sigmoid": lambda: BinOp("*", f, BinOp("-", ONE, f)),
        "tanh": lambda: BinOp("-", ONE, BinOp("^", f, Num(2))),
        "softplus": lambda: Call("sigmoid", (x,)),
        "relu": lambda: Call("sign", (Call("relu", (x,)),)),
    }
    return table[fn]() if fn in table else None


# g * f'(x) as one runtime helper (aten's fused backward kernels)
_FUSED_BACKWARD = {"gelu": "_gelu_backward", "silu": "_silu_backward"}

# the functions whose derivative needs the value of their argument (bound as a step)
_NEEDS_ARG = {"exp", "log", "sqrt", "abs", "sigmoid", "tanh", "softplus", "relu", "gelu", "silu",
              "layernorm", "rmsnorm", "l2norm", "huber", "norm"}


def spec_names(spec) -> set:
    """The names a gradient program's steps avoid: the spec's, the generated code's, the language's."""
    names = set(spec.dims) | set(spec.constants) | set(spec.views) | set(spec.gates) | set(spec.params) \
        | set(spec.state) | set(spec.let) | {st.target for st in spec.update}
    if spec.model is not None:
        names |= {spec.model.name, spec.model.arg}
    return names | set(GENERATED_NAMES) | set(LANGUAGE_NAMES)


def closed_grad(spec, loss: Expr, targets, taken: set, scope: dict | None = None) -> ClosedGrad:
    """The closed-form gradient of ``loss`` (the spec's inner loss, or any scalar expression
    of it) with respect to the states ``targets``; new step names avoid ``taken``; ``scope``:
    the shapes of names the loss reads besides the spec's (e.g. a window's rows).
    Raises :class:`NoClosedForm`."""
    b = _Builder(spec, set(targets), set(taken))
    b.scope.update(scope or {})
    return b.build(loss)


class _Builder:
    def __init__(self, spec, targets: set, taken: set):
        self.spec = spec
        self.targets = targets
        self.taken = taken
        self.env = ShapeEnv.from_spec(spec)
        self.scope: dict = {}
        self.forward: list = []
        self.by_value: dict = {}    # (kind, unparse(value), state) -> step name
        self.sites: list = []
        self.active: set = set()    # step names that depend on a target state

    # ------------------------------------------------------------ shapes
    def shape(self, e: Expr) -> tuple:
        s = self.env.infer(e, scope=self.scope)
        if s is None:
            raise NoClosedForm(f"cannot infer the shape of `{unparse(e)}`")
        return tuple(s)

    def rank(self, e: Expr) -> int:
        return len(self.shape(e))

    def is_active(self, e: Expr) -> bool:
        return any(isinstance(n, Name) and n.id in self.active for n in e.walk())

    # ------------------------------------------------------------ forward: the loss as steps
    def bind(self, kind: str, value: Expr, state: str | None, base: str, active: bool) -> Name:
        if active and kind in ("expr", "bias"):
            value = self.anf(value, "err" if base == "err" else "u")
        key = (kind, unparse(value), state)
        if key in self.by_value:
            return Name(self.by_value[key])
        name = fresh(base, self.taken)
        if kind == "layer":
            shape = (self.spec.state[state].shape[-1],)
        elif kind == "bias":
            shape = tuple(self.spec.state[state].shape)
        else:
            shape = self.shape(value)
        self.scope[name] = shape
        self.forward.append(Step(name, kind, value, state, shape))
        self.by_value[key] = name
        if active:
            self.active.add(name)
        return Name(name)

    def lower(self, e: Expr) -> Expr:
        """``e`` with the model inlined and every site a step; states outside a site raise."""
        spec = self.spec
        model = spec.model
        if isinstance(e, Call) and model is not None and e.fn == model.name:
            arg = self.lower(e.args[0])
            return self.lower_body(substitute(model.body, {model.arg: arg}))
        return self.lower_body(e)

    def lower_body(self, e: Expr) -> Expr:
        spec = self.spec
        model = spec.model
        if isinstance(e, Call) and model is not None and e.fn == model.name:
            return self.lower(e)
        if isinstance(e, Name):
            if e.id in spec.let and any(isinstance(n, Name) and n.id in spec.state for n in self._let_walk(e.id)):
                raise NoClosedForm(f"let {e.id} reads a state")
            if e.id in self.targets:
                raise NoClosedForm(f"the loss uses {e.id} other than through `x @ {e.id}` or `a + {e.id}`")
            return e
        if isinstance(e, BinOp) and e.op == "@" and isinstance(e.right, BinOp) and e.right.op == "+":
            # x @ (A + W), A free of states (a residual layer x @ (eye + W)): x @ A + x @ W
            for w, a in ((e.right.right, e.right.left), (e.right.left, e.right.right)):
                if isinstance(w, Name) and w.id in spec.state and not any(
                        isinstance(n, Name) and (n.id in spec.state or n.id in spec.let) for n in a.walk()):
                    x = self.lower(e.left)
                    if not isinstance(x, Name):   # one step for both uses: their adjoints add up
                        x = self.bind("expr", x, None, f"xk_{w.id}", self.is_active(x))
                    fixed = x if isinstance(a, Call) and a.fn == "eye" else BinOp("@", x, a)
                    return self.lower(BinOp("+", fixed, BinOp("@", x, w)))
        if isinstance(e, BinOp) and e.op == "@" and isinstance(e.right, Name) and e.right.id in spec.state:
            s = e.right.id
            if len(spec.state[s].shape) != 2:
                raise NoClosedForm(f"`{unparse(e)}`: {s} is not a matrix")
            x = self.lower(e.left)
            if self.rank(x) != 1:
                raise NoClosedForm(f"`{unparse(e)}` is not a vector times the matrix {s}")
            if not isinstance(x, Name):
                x = self.bind("expr", x, None, f"xk_{s}", self.is_active(x))
            y = self.bind("layer", x, s, f"y_{s}", s in self.targets or x.id in self.active)
            if s in self.targets and all(y.id != out for _, _, out in self.sites):
                self.sites.append((s, x.id, y.id))
            return y
        if isinstance(e, BinOp) and e.op == "+":
            for side, other in ((e.right, e.left), (e.left, e.right)):
                if isinstance(side, Name) and side.id in self.targets:
                    s = side.id
                    a = self.lower(other)
                    if len(self.spec.state[s].shape) != 1 or self.rank(a) != 1:
                        raise NoClosedForm(f"`{unparse(e)}` is not a vector plus the vector {s}")
                    y = self.bind("bias", a, s, f"y_{s}", True)
                    if all(y.id != out for _, _, out in self.sites):
                        self.sites.append((s, None, y.id))
                    return y
        if isinstance(e, BinOp):
            return BinOp(e.op, self.lower(e.left), self.lower(e.right))
        if isinstance(e, (Neg, Transpose)):
            return type(e)(self.lower(e.operand))
        if isinstance(e, Call):
            if e.fn == "grad":
                raise NoClosedForm("the loss takes a gradient")
            return Call(e.fn, tuple(self.lower(a) for a in e.args))
        return e

    def _let_walk(self, n: str):
        seen, todo = set(), [self.spec.let[n]]
        while todo:
            e = todo.pop()
            for c in e.walk():
                yield c
                if isinstance(c, Name) and c.id in self.spec.let and c.id not in seen:
                    seen.add(c.id)
                    todo.append(self.spec.let[c.id])

    def anf(self, e: Expr, role: str = "u") -> Expr:
        """Bind every active subexpression whose value a derivative rule needs."""
        if not self.is_active(e) or isinstance(e, (Name, Num)):
            return e
        if isinstance(e, BinOp):
            if e.op == "^":
                if self.is_active(e.right):
                    raise NoClosedForm(f"`{unparse(e)}`: a power with an exponent that depends on the state")
                return BinOp("^", self.need(self.anf(e.left, "err"), "err"), e.right)
            left, right = self.anf(e.left, role), self.anf(e.right, role)
            if e.op in "*@" and self.is_active(left) and self.is_active(right):
                left, right = self.need(left, role), self.need(right, role)
            if e.op == "/" and self.is_active(right):
                left, right = self.need(left, role), self.need(right, role)
            return BinOp(e.op, left, right)
        if isinstance(e, Neg):
            return Neg(self.anf(e.operand, role))
        if isinstance(e, Call):
            if e.fn in ("huber", "layernorm", "rmsnorm", "l2norm") and any(self.is_active(a) for a in e.args[1:]):
                raise NoClosedForm(f"`{unparse(e)}`: a weight of {e.fn} depends on the state")
            inner = "err" if e.fn in ("abs", "huber") else role
            args = (self.anf(e.args[0], inner),) + tuple(e.args[1:])
            if e.fn in _NEEDS_ARG:
                args = (self.need(args[0], inner),) + args[1:]
            return Call(e.fn, args)
        raise NoClosedForm(f"`{unparse(e)}` has no derivative rule")

    def need(self, e: Expr, role: str) -> Expr:
        if isinstance(e, (Name, Num)) or not self.is_active(e):
            return e
        return self.bind("expr", e, None, role, True)

    # ------------------------------------------------------------ backward
    def build(self, loss: Expr) -> ClosedGrad:
        if loss is None:
            raise NoClosedForm("the spec has no loss")
        if self.shape(loss) != ():
            raise NoClosedForm("the loss is not a scalar")
        lowered = self.lower(loss)
        if not self.sites:
            raise NoClosedForm("the loss reads no target state through a linear site")
        final = self.anf(lowered, "u")   # the values the derivatives need, as steps
        self.adj: dict = {}
        self.backward: list = []
        self.back(final, ONE)
        deltas: dict = {}
        site_out = {y: s for s, _, y in self.sites}
        for st in reversed(list(self.forward)):
            if st.name not in self.adj:
                continue
            g = self.adj.pop(st.name)
            if not isinstance(g, Name) or self.grank(g) < len(st.shape):
                base = f"delta_{site_out[st.name]}" if st.name in site_out else f"d_{st.name}"
                g = self.emit_adjoint(base, g, st)
            deltas[st.name] = g.id
            if st.kind == "layer":
                x = st.value
                if x.id in self.active:
                    d = self.emit_back(f"d_{x.id}", g, st)
                    self.accumulate(x.id, d)
            elif st.kind == "bias":
                self.back(st.value, g)
            else:
                self.back(st.value, g)
        sites = []
        for s, x, y in self.sites:
            if y not in deltas:
                raise NoClosedForm(f"the loss does not depend on the site of {s}")
            sites.append(Site(s, x, y, deltas[y]))
        return ClosedGrad(tuple(self.forward), tuple(self.backward), tuple(sites))

    def emit_adjoint(self, base: str, g: Expr, like: Step) -> Name:
        name = fresh(base, self.taken)
        self.scope[name] = like.shape
        self.backward.append(Step(name, "expr", simplify(g), None, like.shape, like.name))
        return Name(name)

    def emit_back(self, base: str, g: Name, layer: Step) -> Name:
        name = fresh(base, self.taken)
        self.scope[name] = self.scope[layer.value.id]
        self.backward.append(Step(name, "back", g, layer.state, self.scope[name], layer.value.id))
        return Name(name)

    def accumulate(self, n: str, g: Expr) -> None:
        self.adj[n] = add(self.adj[n], g) if n in self.adj else g

    def reduce(self, g: Expr, x: Expr, out_rank: int) -> Expr:
        """The adjoint ``g`` of a broadcast result, summed down to ``x``'s rank."""
        rx = self.rank(x)
        if rx == out_rank:
            return g
        if rx == 0:
            return Call("sum", (g,)) if self.grank(g) > 0 else g
        raise NoClosedForm(f"`{unparse(x)}` is broadcast over more than a scalar")

    def grank(self, g: Expr) -> int:
        """The rank of an adjoint expression (which may call the derivative helpers)."""
        if isinstance(g, Num):
            return 0
        if isinstance(g, Name):
            return self.rank(g)
        if isinstance(g, (Neg, Transpose)):
            return self.grank(g.operand)
        if isinstance(g, BinOp):
            a, b = self.grank(g.left), self.grank(g.right)
            if g.op == "@":
                return {(1, 1): 0, (1, 2): 1, (2, 1): 1, (2, 2): 2}[(a, b)]
            return max(a, b)
        if isinstance(g, Call):
            if g.fn in ("sum", "mean", "norm"):
                return 0
            return max(self.grank(a) for a in g.args)
        return 0

    def back(self, e: Expr, g: Expr) -> None:
        """Propagate the adjoint ``g`` of ``e`` into the active names it reads."""
        if not self.is_active(e) or is_num(g, 0):
            return
        if isinstance(e, Name):
            self.accumulate(e.id, g)
            return
        if isinstance(e, Neg):
            self.back(e.operand, simplify(Neg(g)))
            return
        if isinstance(e, BinOp):
            a, b, op = e.left, e.right, e.op
            r = self.rank(e)
            if op in "+-":
                self.back(a, self.reduce(g, a, r))
                self.back(b, self.reduce(g if op == "+" else simplify(Neg(g)), b, r))
                return
            if op == "*":
                self.back(a, self.reduce(mul(g, b), a, r))
                self.back(b, self.reduce(mul(g, a), b, r))
                return
            if op == "/":
                self.back(a, self.reduce(simplify(BinOp("/", g, b)), a, r))
                if self.is_active(b):
                    self.back(b, self.reduce(simplify(Neg(BinOp("/", mul(g, a), BinOp("^", b, Num(2))))), b, r))
                return
            if op == "^":
                n = b
                lower = a if is_num(n, 2) else BinOp("^", a, simplify(BinOp("-", n, ONE)))
                self.back(a, mul(mul(g, n), lower))
                return
            if op == "@":
                ra, rb = self.rank(a), self.rank(b)
                if ra == 1 and rb == 1:       # a dot product: g is a scalar
                    self.back(a, mul(g, b))
                    self.back(b, mul(g, a))
                    return
                raise NoClosedForm(f"`{unparse(e)}`: a product with a matrix that is not a state")
        if isinstance(e, Call):
            fn, args = e.fn, e.args
            x = args[0]
            if fn == "sum":
                self.back(x, g)
                return
            if fn == "mean":
                size: Expr = ONE
                for d in self.shape(x):
                    size = mul(size, Name(d))
                self.back(x, simplify(BinOp("/", g, size)))
                return
            if fn == "norm":
                self.back(x, mul(g, BinOp("/", x, e)))
                return
            if fn == "layernorm":
                w = (args[1],) if len(args) > 1 else ()
                self.back(x, Call("_layernorm_grad", (x, g) + w))
                return
            if fn == "rmsnorm":
                w = (args[1],) if len(args) > 1 else ()
                self.back(x, Call("_rmsnorm_grad", (x, g) + w))
                return
            if fn == "l2norm":
                self.back(x, Call("_l2norm_grad", (x, g)))
                return
            if fn == "huber":
                self.back(x, mul(g, Call("clamp", (x, simplify(Neg(args[1])), args[1]))))
                return
            if fn == "sign":
                return
            if fn in _FUSED_BACKWARD:   # g * f'(x) in one fused op
                self.back(x, Call(_FUSED_BACKWARD[fn], (g, x)))
                return
            d = _elementwise_derivative(fn, x)
            if d is not None:
                self.back(x, mul(g, d))
                return
            raise NoClosedForm(f"`{fn}` has no derivative rule here")
        raise NoClosedForm(f"`{unparse(e)}` has no derivative rule")
