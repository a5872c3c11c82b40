"""The reference interpreter's evaluator: a spec's expressions on ``[B, H, ...]`` tensors (names,
operators, model applications, ``grad``) and its update statements (block updates and cache
appends included).  The built-in functions are :class:`~memspec.reference.functions.Functions`."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..lang.errors import Collector, did_you_mean
from ..lang.expr import Assign, BinOp, Call, Expr, Name, Neg, Num, Transpose, is_diag, unparse
from ..lang.shapes import ShapeEnv
from ..lang.spec import Spec
from .functions import ELEMENTWISE, Functions
from .inputs import notation
from .values import Block, EvalError, Scope, align, located, named_shape


def named_axes(spec: Spec) -> tuple[dict[int, int], set[int]]:
    """From the shape rules: ``id(call) -> axis`` (a negative dim) of every ``softmax(x, d)`` and
    ``sum``/``mean``/``norm(x, d)``, and the ids of the model applications to a cache (row-wise)."""
    env = ShapeEnv.from_spec(spec)
    rec: dict = {}
    diags = Collector()
    exprs = [*spec.let.values(), spec.read] + ([spec.loss] if spec.loss is not None else [])
    for e in exprs:
        env.infer(e, record=rec, diags=diags)
    for i, st in enumerate(spec.update):
        env.infer(st.value, scope=env.temp_scope(i), record=rec, diags=diags)
        exprs.append(st.value)
    rowwise: set = set()
    model = spec.model
    if model is not None:
        arg = None
        for e in exprs:
            for c in e.walk():
                if isinstance(c, Call) and c.fn == model.name and c.args and rec.get(id(c.args[0])) is not None:
                    a = tuple(rec[id(c.args[0])])
                    if len(a) >= 2 and a[0] == env.cache_axis:
                        rowwise.add(id(c))
                        a = a[1:]
                    arg = arg if arg is not None else a
        if arg is not None:
            env.infer(model.body, scope={model.arg: arg}, record=rec, diags=diags)
            exprs.append(model.body)
    axes: dict = {}
    for e in exprs:
        for c in e.walk():
            if isinstance(c, Call) and len(c.args) == 2 and c.fn in ("softmax", "sum", "mean", "norm"):
                x, a = rec.get(id(c.args[0])), c.args[1]
                if x is not None and isinstance(a, Name) and list(x).count(a.id) == 1:
                    axes[id(c)] = list(x).index(a.id) - len(x)
    return axes, rowwise


class Interpreter(Functions):
    """Evaluates a spec's expressions on ``[B, H, ...]`` tensors."""

    def __init__(self, spec: Spec, params: dict[str, torch.Tensor], dtype, device,
                 needs_graph: bool):
        self.spec = spec
        self.dtype, self.device = dtype, device
        self.needs_graph = needs_graph
        self.params = {n: p.unsqueeze(0) for n, p in params.items() if n in spec.params}
        # (a coefficient schedule is no number: only newton_schulz reads it, from the spec)
        self.constants = {n: self.number(v) for n, v in spec.constants.items() if not isinstance(v, tuple)}
        self.dims = {n: self.number(v) for n, v in spec.dims.items()}
        self.axes, self.rowwise = named_axes(spec)
        self.terms: dict = {}   # statement index -> its gradient terms (block updates; set by run)

    def number(self, v: float) -> torch.Tensor:
        return torch.tensor(float(v), dtype=self.dtype, device=self.device).reshape(1, 1)

    # ------------------------------------------------------------ dispatch
    def eval(self, e: Expr, scope: Scope) -> torch.Tensor:
        if scope.terms is not None and id(e) in scope.terms:   # a gradient term's block sum
            return scope.terms[id(e)]
        method = getattr(self, "eval_" + type(e).__name__, None)
        if method is None:
            raise EvalError(f"{located(e)}cannot evaluate {e!r}")
        try:
            return method(e, scope)
        except (RuntimeError, IndexError) as err:
            raise EvalError(f"{located(e)}cannot evaluate `{unparse(e)}`: {err}") from None

    def eval_Num(self, e: Num, scope: Scope) -> torch.Tensor:
        return self.number(e.value)

    def eval_Name(self, e: Name, scope: Scope) -> torch.Tensor:
        n = e.id
        for table in (scope.local, scope.temp, scope.token, scope.state, self.params, self.constants, self.dims):
            if n in table:
                return table[n]
        if n == "loss" and self.spec.loss is not None:
            return self.eval(self.spec.loss, scope)
        known = [*scope.local, *scope.temp, *scope.token, *scope.state, *self.params, *self.constants, *self.dims]
        hint = did_you_mean(n, known)
        raise EvalError(f"{located(e)}unknown name {n!r}" + (f"; {hint}" if hint else ""))

    def eval_Neg(self, e: Neg, scope: Scope) -> torch.Tensor:
        return -self.eval(e.operand, scope)

    def eval_Transpose(self, e: Transpose, scope: Scope) -> torch.Tensor:
        x = self.eval(e.operand, scope)
        if len(named_shape(x)) != 2:
            raise EvalError(f"{located(e)}.T needs a matrix, got shape {list(named_shape(x))}")
        return x.transpose(-1, -2)

    def eval_BinOp(self, e: BinOp, scope: Scope) -> torch.Tensor:
        if e.op == "@" and (is_diag(e.left) or is_diag(e.right)):
            return self.diag_matmul(e, scope)
        a, b = self.eval(e.left, scope), self.eval(e.right, scope)
        if e.op == "@":
            return self.matmul(a, b, e)
        a, b = align(a, b)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "/":
            return a / b
        if e.op == "^":
            return torch.pow(a, b)
        raise EvalError(f"{located(e)}unknown operator {e.op!r}")

    def matmul(self, a: torch.Tensor, b: torch.Tensor, e: Expr) -> torch.Tensor:
        """Row-vector convention: [n]@[n,m]->[m], [m,n]@[n,p]->[m,p], [m,n]@[n]->[m], [n]@[n]->[]."""
        ra, rb = len(named_shape(a)), len(named_shape(b))
        if ra == 1 and rb == 2:
            return (a.unsqueeze(-2) @ b).squeeze(-2)
        if ra >= 2 and rb == 2:
            return a @ b
        if ra >= 2 and rb == 1:
            return (a @ b.unsqueeze(-1)).squeeze(-1)
        if ra == 1 and rb == 1:
            return (a * b).sum(-1)
        raise EvalError(f"{located(e)}@ needs vectors or matrices, got shapes "
                         f"{list(named_shape(a))} and {list(named_shape(b))}")

    def diag_matmul(self, e: BinOp, scope: Scope) -> torch.Tensor:
        """``diag(a) @ X`` scales the rows of X (its first named axis) by a, ``X @ diag(b)`` its
        columns (its last named axis); the diagonal matrix is never formed."""
        left = is_diag(e.left)
        d = self.eval((e.left if left else e.right).args[0], scope)
        x = self.eval(e.right if left else e.left, scope)
        if len(named_shape(d)) != 1 or len(named_shape(x)) not in (1, 2):
            raise EvalError(f"{located(e)}diag needs a vector and a vector or matrix operand, got shapes "
                             f"{list(named_shape(d))} and {list(named_shape(x))}")
        if left and len(named_shape(x)) == 2:
            return d.unsqueeze(-1) * x
        if not left and len(named_shape(x)) == 2:
            return x * d.unsqueeze(-2)
        return d * x

    def eval_Call(self, e: Call, scope: Scope) -> torch.Tensor:
        model = self.spec.model
        if model is not None and e.fn == model.name:
            if len(e.args) != 1:
                raise EvalError(f"{located(e)}{model.name} takes one argument")
            return self.apply_model(self.eval(e.args[0], scope), scope, rows=id(e) in self.rowwise)
        method = getattr(self, "fn_" + e.fn, None)
        if method is not None:
            return method(e, scope)
        if e.fn in ELEMENTWISE:
            return ELEMENTWISE[e.fn](self.eval(e.args[0], scope))
        raise EvalError(f"{located(e)}unknown function {e.fn!r}")

    def apply_model(self, u: torch.Tensor, scope: Scope, rows: bool = False) -> torch.Tensor:
        """``f(u)`` with the scope's current state; ``rows``: ``u`` is a cache ``[n, d]`` and
        ``f`` is applied to each of its rows (an empty cache gives an empty result)."""
        model = self.spec.model
        if rows:
            if u.shape[2] == 0:
                one = self.apply_model(u.new_zeros(u.shape[:2] + u.shape[3:]), scope)
                return one.new_zeros(one.shape[:2] + (0,) + one.shape[2:])
            return torch.stack([self.apply_model(u[:, :, r], scope) for r in range(u.shape[2])], dim=2)
        inner = replace(scope, local={model.arg: u}, temp={})
        return self.eval(model.body, inner)

    # ------------------------------------------------------------ grad
    def grad_target(self, e: Call) -> str:
        if len(e.args) == 2:
            t = e.args[1]
            if not isinstance(t, Name) or t.id not in self.spec.state:
                raise EvalError(f"{located(t)}grad(loss, W) needs a state W, got `{unparse(t)}`")
            return t.id
        used = self.spec.model_states()
        if len(used) != 1:
            raise EvalError(f"{located(e)}grad(loss) needs a model that reads exactly one state "
                             f"(it reads {used}); write grad(loss, W)")
        return used[0]

    def fn_grad(self, e: Call, scope: Scope) -> torch.Tensor:
        """d(loss)/dW at the scope's current state values.

        Under mini-batch the statement was first run on the shadow state (see
        :func:`token_step`), which recorded this gradient in ``scope.grad_memo``.  The
        loss of each (batch, head) is independent, so summing them before
        ``autograd.grad`` gives every (batch, head) its own gradient.
        """
        memo = scope.grad_memo
        if memo is not None and id(e) in memo:
            return memo[id(e)]
        g = self.gradient(e, scope)
        if memo is not None:
            memo[id(e)] = g
        return g

    def gradient(self, e: Call, scope: Scope) -> torch.Tensor:
        target = self.grad_target(e)
        base = scope.state
        with torch.enable_grad():
            w = base[target]
            # A fresh node for W: other states (written earlier in this token from W) keep
            # their own path to W, so this is the partial derivative the language defines.
            var = w.clone() if w.requires_grad else w.detach().requires_grad_(True)
            inner = replace(scope, state={**base, target: var}, grad_memo=None)
            loss = self.eval(e.args[0], inner)
            if named_shape(loss):
                raise EvalError(f"{located(e.args[0])}grad needs a scalar loss, got shape "
                                 f"{list(named_shape(loss))}")
            if not loss.requires_grad:
                return torch.zeros_like(w)
            (g,) = torch.autograd.grad(loss.sum(), var, create_graph=self.needs_graph,
                                       allow_unused=True)
        return torch.zeros_like(w) if g is None else g

    # ------------------------------------------------------- statements
    def step_statement(self, i: int, stmt: Assign, scope: Scope, block: Block | None,
                       commit: bool = True) -> None:
        """Statement ``i`` of this token: :meth:`assign`, or for a state updated every C > 1 tokens
        its gradient terms added to the open block's sums (kept when ``commit``) and, at the
        block's last token, the assignment with each term replaced by its sum."""
        every = block.every.get(stmt.target, 1) if block is not None else 1
        if every == 1:
            self.assign(stmt, scope)
            return
        terms = self.terms[i]
        sums = []
        for k, t in enumerate(terms):
            v = self.eval(t, scope)
            sums.append(v if (i, k) not in block.acc else block.acc[(i, k)] + v)
        last = (block.pos + 1) % every == 0
        if commit:
            for k, v in enumerate(sums):
                if last:
                    block.acc.pop((i, k), None)
                else:
                    block.acc[(i, k)] = v
        if last:
            self.assign(stmt, replace(scope, terms={id(t): v for t, v in zip(terms, sums)}))

    def assign(self, stmt: Assign, scope: Scope) -> None:
        """Run one update statement; it sees (and changes) ``scope.state``, or binds a
        temporary in ``scope.temp`` (a target that is no state)."""
        st = self.spec.state.get(stmt.target)
        if st is None:
            declared = (*self.spec.dims, *self.spec.constants, *self.spec.views, *self.spec.gates,
                        *self.spec.params, *self.spec.let)
            if stmt.target in declared or stmt.target in scope.temp:
                raise EvalError(f"{located(stmt)}update target {stmt.target!r} is not a state or a new temporary")
            scope.temp[stmt.target] = self.eval(stmt.value, scope)
            return
        old = scope.state[stmt.target]
        v = stmt.value
        if isinstance(v, Call) and v.fn == "append":
            scope.state[stmt.target] = self.append(st, old, v, scope)
            return
        new = self.eval(v, scope)
        if new.dim() < old.dim():
            new, _ = align(new, old)
        try:
            new = new.expand(old.shape) if new.shape != old.shape else new
        except RuntimeError:
            raise EvalError(f"{located(stmt)}`{stmt}` gives shape {list(named_shape(new))}, but state "
                             f"{stmt.target} is {notation(st.shape)} = {list(named_shape(old))}") from None
        scope.state[stmt.target] = new

    def append(self, st, cache: torch.Tensor, call: Call, scope: Scope) -> torch.Tensor:
        """``K = append(K, k)``: concatenate along the cache axis, keep the last ``window``."""
        if not st.cache:
            raise EvalError(f"{located(call)}append needs a cache state")
        item = self.eval(call.args[1], scope)
        item = item.expand(cache.shape[0], cache.shape[1], *cache.shape[3:])
        out = torch.cat([cache, item.unsqueeze(2)], dim=2)
        if st.window is not None and out.shape[2] > st.window:
            out = out[:, :, -st.window:]
        return out
