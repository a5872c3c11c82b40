"""The dual form of the mini-batch schedule (TTT's "dual form", derived from the spec's algebra).

In mini-batch learning every gradient of a chunk is taken at the chunk-start state.
When a state ``W`` enters the inner model only through a linear layer ``x @ W`` (or a
bias ``a + b``), the gradient of any per-token loss with respect to it is an outer
product, ``grad_j = x_j^T delta_j`` (``delta_j`` the gradient with respect to the layer's
output), or ``delta_j`` itself for a bias.  If, moreover, the update program is a set
of linear recurrences whose coefficients are token-local scalars (momentum, forgetting,
step sizes: :func:`.recurrence.minibatch_recurrence`), every state after token i
of the chunk is

    S_i = sum_R a[S, R]_i R_0 + sum_g sum_{j <= i} M[S, g]_{i, j} grad_g_j

with ``R_0`` the states before the chunk, ``a`` vectors ``[C]`` and ``M`` lower-triangular
``[C, C]`` matrices that are products of the recurrences' decay matrices.  A read through
the same linear layer then never needs the per-token states:

    x_i @ W_i = sum_R a_i (x_i @ R_0) + sum_g sum_j M_{i, j} (x_i . x_g_j) delta_g_j

which is a masked, attention-like product over the chunk ([C, C] scores times
[C, d_out]); the state after the chunk is the row i = C, ``x_g^T diag(M[C]) delta_g``.
Nothing of size ``C x d_in x d_out`` is ever formed.  The gradients themselves are one
backward pass of the chunk's summed loss with respect to each layer's output (its
*tap*), at the chunk-start state.

:func:`analyse_dual` decides whether a spec admits this form and returns the facts the
code generator needs (:mod:`memspec.codegen.dual`); :class:`NotDual` says why not (the
mini-batch schedule then materialises every token's state, which is exact too, but
C times larger).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, rewrite, unparse
from ..lang.names import fresh
from ..lang.shapes import ShapeEnv
from .backprop import ClosedGrad, NoClosedForm, closed_grad, spec_names
from .recurrence import NotRecurrence, minibatch_recurrence

BLOCK = 8   # tokens per block of a chunk whose states decay per channel (DualForm.rows)


class NotDual(Exception):
    """The spec does not admit the dual form (``str`` says why)."""


@dataclass(frozen=True)
class DualForm:
    """What the dual form of a spec's mini-batch schedule needs.

    sites: each state of the inner model -> ``"matmul"`` (enters as ``x @ W``, W a
        matrix, x a vector) or ``"bias"`` (enters as ``a + b``, both vectors).
    targets: the states that the update differentiates (``grad(loss, W)``), in state order.
    recurrence: :class:`.recurrence.Recurrence` of the update program, every
        ``grad(...)`` replaced by a placeholder name.
    grad_terms: state -> {target: token-local scalar coefficient of that target's
        gradient in the state's update}.
    grad: the deltas of every site in closed form (:class:`.backprop.ClosedGrad`), or
        None: ``no_grad`` says why, and the chunk step takes them by ``torch.func.grad``.
    rows: state -> its channel axis, for the states whose recurrence scales rows (``diag(c) @ R``,
        a decay per channel) or, for those in ``cols``, columns (``R @ diag(c)``): their weights
        have one factor per channel, and the chunk runs in blocks of ``BLOCK`` tokens with the
        state passed between them.
    cols: the states whose per-channel factors (their own, or those of the states that flow into
        them) scale their columns, the layer's output channels; the others' scale rows.
    """

    sites: dict
    targets: tuple
    recurrence: object
    grad_terms: dict
    grad: ClosedGrad | None = None
    no_grad: str | None = None
    rows: dict = field(default_factory=dict, repr=False)   # (said by describe, not printed in the plan)
    cols: frozenset = field(default=frozenset(), repr=False)

    def describe(self) -> list[str]:
        """Lines for ``memspec explain``."""
        lin = [f"{s} (linear layer x @ {s})" if k == "matmul" else f"{s} (bias a + {s})"
               for s, k in self.sites.items()]
        grads = self.grad.describe() if self.grad is not None else \
            [f"no closed-form gradient ({self.no_grad}): the deltas by one torch.func.grad per chunk"]
        return grads + [
            "dual form: the model's states enter only through " + ", ".join(lin)
            + ", so each token's gradient is an outer product x_j^T delta_j (a bias: delta_j) and every "
            "state of the chunk is a masked, decay-weighted sum of them: reads are attention-like "
            "[C, C] products, no per-token state is materialised",
        ] + ([
            "per-channel decays of " + ", ".join(f"{s} (one factor per {d}{', on its columns' if s in self.cols else ''})"
                                                 for s, d in self.rows.items())
            + ": the weights of each token's gradient in a later state carry one product of decays per channel "
            f"(accumulated token by token: exact products, no ratios of cumulative products); the chunk runs in "
            f"blocks of {BLOCK} tokens, [block, block] weights per channel inside a block and the states at the blocks' "
            "starts carried from block to block, so only C / block states per chunk are formed"] if self.rows else [])


def _sites(spec) -> dict:
    """state -> site kind, for every state of the model; raises NotDual."""
    model = spec.model
    env = ShapeEnv.from_spec(spec)
    states = spec.model_states()
    arg_shapes = [tuple(env.infer(c.args[0])) for e in _exprs(spec) for c in e.walk()
                  if isinstance(c, Call) and c.fn == model.name]
    scope = {model.arg: arg_shapes[0] if arg_shapes else ()}
    sites: dict = {}
    count = {s: 0 for s in states}
    claimed: set = set()

    def rank(e: Expr) -> int:
        shape = env.infer(e, scope=scope)
        return len(shape) if shape is not None else -1

    for node in model.body.walk():
        if isinstance(node, BinOp) and node.op == "@" and isinstance(node.right, Name) \
                and node.right.id in count:
            s = node.right.id
            if len(spec.state[s].shape) != 2 or rank(node.left) != 1 \
                    or any(isinstance(n, Name) and n.id == s for n in node.left.walk()):
                raise NotDual(f"`{unparse(node)}` is not a vector times the matrix {s}")
            sites[s] = "matmul"
            count[s] += 1
            claimed.add(id(node.right))
        elif isinstance(node, BinOp) and node.op == "+":
            for side, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(side, Name) and side.id in count and id(side) not in claimed:
                    s = side.id
                    if len(spec.state[s].shape) != 1 or rank(other) != 1:
                        raise NotDual(f"`{unparse(node)}` is not a vector plus the vector {s}")
                    sites[s] = "bias"
                    count[s] += 1
                    claimed.add(id(side))
                    break
    for node in model.body.walk():
        if isinstance(node, Name) and node.id in count and id(node) not in claimed:
            raise NotDual(f"state {node.id} enters the model other than through `x @ {node.id}` or `a + {node.id}`")
    for s, n in count.items():
        if n != 1:
            raise NotDual(f"state {s} enters the model {n} times (the dual form needs exactly one linear site)")
    return {s: sites[s] for s in states}


def _exprs(spec) -> list:
    return [spec.read] + ([spec.loss] if spec.loss is not None else []) + [st.value for st in spec.update]


def _states_outside_model(spec, e: Expr) -> set:
    """States that ``e`` reads other than as arguments of the model's states (lets inlined)."""
    out: set = set()
    seen: set = set()

    def visit(n: Expr):
        if isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
            for a in n.args:
                visit(a)
            return
        if isinstance(n, Name):
            if n.id in spec.state:
                out.add(n.id)
            elif n.id in spec.let and n.id not in seen:
                seen.add(n.id)
                visit(spec.let[n.id])
            return
        for c in n.children():
            visit(c)

    visit(e)
    return out


def _grad_terms(e, placeholders: set, local_scalar, local_vector=lambda e: False) -> dict:
    """``e`` as ``sum_p coeff_p * p`` over the placeholder names (a coefficient may be a vector,
    ``diag(c) @ p`` or ``p @ diag(c)``: a row or column scaling, which the recurrence's sides
    tell apart); raises NotDual."""
    if e is None:
        return {}
    if isinstance(e, Name) and e.id in placeholders:
        return {e.id: Num(1)}
    if isinstance(e, Neg):
        return {p: _neg(c) for p, c in _grad_terms(e.operand, placeholders, local_scalar, local_vector).items()}
    if isinstance(e, BinOp) and e.op in "+-":
        a = _grad_terms(e.left, placeholders, local_scalar, local_vector)
        b = _grad_terms(e.right, placeholders, local_scalar, local_vector)
        for p, c in b.items():
            c = _neg(c) if e.op == "-" else c
            a[p] = BinOp("+", a[p], c) if p in a else c
        return a
    if isinstance(e, BinOp) and e.op in "*/":
        for s, t, left in ((e.left, e.right, True), (e.right, e.left, False)):
            if e.op == "/" and left:
                continue
            if local_scalar(s) and not _mentions(s, placeholders):
                inner = _grad_terms(t, placeholders, local_scalar, local_vector)
                if e.op == "/":
                    return {p: BinOp("/", c, s) for p, c in inner.items()}
                return {p: (s if isinstance(c, Num) and c.value == 1 else BinOp("*", s, c)) for p, c in inner.items()}
    if isinstance(e, BinOp) and e.op == "@":
        for d, t in ((e.left, e.right), (e.right, e.left)):
            if isinstance(d, Call) and d.fn == "diag" and len(d.args) == 1 and local_vector(d.args[0]) \
                    and not _mentions(d.args[0], placeholders):
                c = d.args[0]
                inner = _grad_terms(t, placeholders, local_scalar, local_vector)
                return {p: (c if isinstance(k, Num) and k.value == 1 else BinOp("*", c, k)) for p, k in inner.items()}
    raise NotDual(f"`{unparse(e)}` is not a sum of token-local scalars times gradients")


def _neg(c: Expr) -> Expr:
    if isinstance(c, Num):
        return Num(-c.value)
    if isinstance(c, Neg):
        return c.operand
    return Neg(c)


def _mentions(e: Expr, names: set) -> bool:
    return any(isinstance(n, Name) and n.id in names for n in e.walk())


def analyse_dual(spec) -> DualForm:
    """The dual form of ``spec``'s mini-batch schedule, or raise :class:`NotDual`."""
    if spec.model is None or spec.loss is None:
        raise NotDual("the spec has no inner model and loss")
    if any(st.cache for st in spec.state.values()):
        raise NotDual("a state is a cache")
    model_states = spec.model_states()
    sites = _sites(spec)
    # the loss and the read see the states only through the model
    for what, e in (("the loss", spec.loss), ("the read", spec.read)):
        outside = _states_outside_model(spec, e)
        if outside:
            raise NotDual(f"{what} reads {', '.join(sorted(outside))} outside the model")
    n_loss_calls = sum(1 for c in spec.loss.walk() if isinstance(c, Call) and c.fn == spec.model.name)
    if n_loss_calls != 1:
        raise NotDual(f"the loss applies the model {n_loss_calls} times (the dual form needs one application)")
    for n in spec.let:
        if _mentions(spec.let[n], set(spec.state)):
            raise NotDual(f"let {n} reads a state")
    # gradients: all of the loss, all at the chunk-start state
    grad_calls = [(i, c) for i, st in enumerate(spec.update) for c in st.value.walk()
                  if isinstance(c, Call) and c.fn == "grad"]
    if not grad_calls:
        raise NotDual("the update takes no gradient")

    def target(c: Call) -> str:   # grad(loss, W), or grad(loss): the model's first state
        return c.args[1].id if len(c.args) == 2 else model_states[0]

    targets: list = []
    for _, c in grad_calls:
        if not (isinstance(c.args[0], Name) and c.args[0].id == "loss"):
            raise NotDual(f"`{unparse(c)}` is not a gradient of the spec's loss")
        t = target(c)
        if t not in sites:
            raise NotDual(f"`{unparse(c)}`: {t} is not a state of the model")
        if t not in targets:
            targets.append(t)
    last = max(i for i, _ in grad_calls)
    for j in range(last):
        if spec.update[j].target in model_states:
            raise NotDual(f"statement {j + 1} writes {spec.update[j].target} before a gradient is taken: "
                          "not every gradient is at the chunk-start state")
    targets = [s for s in spec.state if s in targets]
    # the update program with each gradient held fixed: linear recurrences
    taken = set(spec.state) | set(spec.views) | set(spec.gates) | set(spec.let) | set(spec.params) \
        | set(spec.dims) | set(spec.constants) | {st.target for st in spec.update}
    placeholders = {t: fresh(f"grad_{t}", taken) for t in targets}
    values = [rewrite(st.value, lambda c: Name(placeholders[target(c)])
                      if isinstance(c, Call) and c.fn == "grad" else None) for st in spec.update]
    scope = {placeholders[t]: tuple(spec.state[t].shape) for t in targets}
    try:
        rec = minibatch_recurrence(spec, values, scope)
    except NotRecurrence as err:
        raise NotDual(str(err)) from None
    env = ShapeEnv.from_spec(spec)
    grad_terms = _gradient_terms(spec, rec, placeholders, scope, env)
    for s in spec.state:
        for (_, r) in rec.coeff[s]:
            if tuple(spec.state[r].shape) != tuple(spec.state[s].shape):
                raise NotDual(f"the update of {s} adds {r}, of another shape")
    rows = _row_scalings(spec, rec, grad_terms, sites, env)
    try:
        grad, no_grad = closed_grad(spec, spec.loss, list(sites), spec_names(spec)), None
    except NoClosedForm as err:
        grad, no_grad = None, str(err)
    return DualForm(sites, tuple(targets), rec, grad_terms, grad, no_grad, rows, rec.cols)


def _gradient_terms(spec, rec, placeholders: dict, scope: dict, env: ShapeEnv) -> dict:
    """state -> {target: the coefficient of that target's gradient in the state's update} (a
    token-local scalar, or a vector for a row scaling); raises NotDual."""
    def local(e: Expr, rank: int) -> bool:
        shape = env.infer(e, scope=scope)
        return shape is not None and len(shape) == rank and not _mentions(e, set(spec.state))

    names = set(placeholders.values())
    by_name = {v: k for k, v in placeholders.items()}
    grad_terms = {s: {by_name[p]: c for p, c in _grad_terms(rec.rest[s], names, lambda e: local(e, 0),
                                                            lambda e: local(e, 1)).items()}
                  for s in spec.state}
    for s, terms in grad_terms.items():
        for t in terms:
            if tuple(spec.state[t].shape) != tuple(spec.state[s].shape):
                raise NotDual(f"the update of {s} adds the gradient of {t}, of another shape")
    return grad_terms


def _row_scalings(spec, rec, grad_terms: dict, sites: dict, env: ShapeEnv) -> dict:
    """state -> the channel axis of its per-channel coefficients (``diag(c) @ R``: a vector ``c``
    over the rows of the state, of a state or of a gradient; ``R @ diag(c)`` over its columns for
    the recurrence's ``cols``), for the states whose recurrence has one; raises NotDual."""
    rows: dict = {}
    for s in rec.order:
        coefs = [(r, c) for (_, r), c in rec.coeff[s].items()] + [(f"grad({t})", c) for t, c in grad_terms[s].items()]
        for r, c in coefs:
            shape = env.infer(c)
            if shape is None or len(shape) == 0:
                continue
            state_shape = tuple(spec.state[s].shape)
            axis, side = (1, "column") if s in rec.cols else (0, "row")
            if len(shape) != 1 or len(state_shape) != 2 or tuple(shape) != state_shape[axis:axis + 1]:
                raise NotDual(f"the coefficient {unparse(c)} of {r} in the update of {s} is not one factor per "
                              f"{side} of {s}")
            rows[s] = state_shape[axis]
    for s in rows:
        if sites.get(s) == "bias":
            raise NotDual(f"the bias {s} decays per channel (the dual form scales the rows or columns of matrices)")
    return rows

