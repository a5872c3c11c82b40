"""The language's built-in functions in the reference interpreter: the elementwise table, the
reductions over named axes, the normalisers (with their epsilons), the binary helpers and
``attend`` -- one ``fn_<name>`` method each, on ``[B, H, ...]`` values."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..lang.expr import Call, Expr, Name, Num, unparse
from .values import EvalError, Scope, align, located, named_shape, reduce_dims

LAYERNORM_EPS = 1e-5   # layernorm(x[, w, b]): over the last axis
NORM_EPS = 1e-6        # rmsnorm / l2norm: inside the square root
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # newton_schulz: Muon's quintic iteration
NS_EPS = 1e-7          # newton_schulz: X / (|X|_F + NS_EPS)


def newton_schulz(X: torch.Tensor, steps) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon on the last two axes of ``X``:
    ``X_0 = X / (|X|_F + 1e-7)``, then ``steps`` times ``A = X X^T``,
    ``X <- a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``; or, with
    ``steps`` a coefficient schedule (a tuple of ``(a, b, c)`` triples), one step per triple.

    On ``X = U S V^T`` it maps each singular value ``s`` (of ``X_0``) through
    ``p(s) = a s + b s^3 + c s^5`` ``steps`` times and keeps ``U`` and ``V``: an approximate
    orthogonalisation ``~ U V^T`` (the singular values end up near 1, not at 1).

    A tall ``X`` (more rows than columns) is iterated as ``X^T`` and transposed back: the same
    map (``X X^T X = X (X^T X)``), on the smaller Gram matrix, as the compiled helper does --
    the iteration multiplies tiny singular values by up to 3.4 a step, so the two must
    round alike to agree in float32."""
    schedule = steps if isinstance(steps, tuple) else (NS_COEFFICIENTS,) * steps
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-1, -2)
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + NS_EPS)
    for a, b, c in schedule:
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.transpose(-1, -2) if tall else X


def conjugate_gradients(A: torch.Tensor, B: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` iterations of conjugate gradients (Hestenes and Stiefel 1952) on ``A X = B``
    from ``X = 0``, every column ``b`` of ``B`` (``[..., n, m]``) its own iteration::

        x = 0, r = b, p = r, rr = r . r
        repeat steps times, for a column with rr > eps^2 (b . b) (eps: the dtype's machine epsilon;
        a NaN column stays active, so its x is NaN):
            alpha = rr / (p . A p);  x += alpha p;  r -= alpha A p
            rr' = r . r;  p = r + (rr' / rr) p;  rr = rr'

    A column whose residual has reached the rounding level of its b (``||r|| <= eps ||b||``; a
    zero b at once) has converged and stops: in exact arithmetic its residual would be 0, and
    further steps would iterate on rounding error until it underflows (and their derivatives
    overflow).  For a symmetric positive definite ``A`` it is exact after ``n`` steps in exact
    arithmetic, and the iterate of step ``s`` minimises the A-norm of the error over the Krylov
    space of ``s`` dimensions.  Differentiable (autograd through the iterations; a stopped column's
    divisions are by 1, so no 0 / 0 enters its gradient)."""
    x = torch.zeros_like(B)
    r, p = B, B
    rr = (B * B).sum(-2, keepdim=True)                               # [..., 1, m]
    stop = rr * torch.finfo(B.dtype).eps ** 2                        # the rounding level of b
    for _ in range(steps):
        active = ~(rr <= stop)                                       # (a NaN column stays active)
        Ap = A @ p
        alpha = torch.where(active, rr, 0.0) / torch.where(active, (p * Ap).sum(-2, keepdim=True), 1.0)
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-2, keepdim=True)
        p = r + torch.where(active, rr_new, 0.0) / torch.where(active, rr, 1.0) * p
        rr = torch.where(active, rr_new, rr)
    return x


ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrt": torch.sqrt,
    "exp": torch.exp,
    "log": torch.log,
    "abs": torch.abs,
    "sign": torch.sign,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),   # erf form
    "silu": F.silu,
    "elu": lambda x: F.elu(x, alpha=1.0),
}


class Functions:
    """The ``fn_<name>`` methods of :class:`~memspec.reference.interpreter.Interpreter` (a mixin:
    it reads ``self.eval``, ``self.spec``, ``self.axes``, ``self.dtype`` and ``self.device``)."""

    def args(self, e: Call, scope: Scope) -> list[torch.Tensor]:
        return [self.eval(a, scope) for a in e.args]

    # ------------------------------------------------------- reductions
    def axis(self, e: Call) -> int:
        """The axis named by ``e``'s second argument, as a negative dim (from the shape rules)."""
        if id(e) not in self.axes:
            raise EvalError(f"{located(e)}cannot resolve the axis of `{unparse(e)}`")
        return self.axes[id(e)]

    def fn_sum(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return x.sum(dim=self.axis(e))
        return x.sum(dim=reduce_dims(x)) if x.dim() > 2 else x

    def fn_mean(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return x.mean(dim=self.axis(e))
        return x.mean(dim=reduce_dims(x)) if x.dim() > 2 else x

    def fn_norm(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(e.args) == 2:
            return torch.linalg.vector_norm(x, dim=self.axis(e))
        return torch.linalg.vector_norm(x, dim=reduce_dims(x)) if x.dim() > 2 else x.abs()

    def fn_softmax(self, e, scope):
        """``softmax(x, d)``: ``exp(x) / sum(exp(x), d)`` over the axis named ``d``."""
        return torch.softmax(self.eval(e.args[0], scope), dim=self.axis(e))

    def fn_newton_schulz(self, e, scope):
        x = self.eval(e.args[0], scope)
        if len(named_shape(x)) != 2:
            raise EvalError(f"{located(e)}newton_schulz needs a matrix, got shape {list(named_shape(x))}")
        steps = e.args[1]
        if isinstance(steps, Name) and isinstance(self.spec.constants.get(steps.id), tuple):
            return newton_schulz(x, self.spec.constants[steps.id])   # a coefficient schedule
        return newton_schulz(x, self.int_arg(steps))

    # ------------------------------------------------------ normalisers
    def fn_layernorm(self, e, scope):
        x, *wb = self.args(e, scope)
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + LAYERNORM_EPS)
        if len(wb) >= 1:
            y, w = align(y, wb[0])
            y = y * w
        if len(wb) == 2:
            y, b = align(y, wb[1])
            y = y + b
        return y

    def fn_rmsnorm(self, e, scope):
        x, *w = self.args(e, scope)
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS)
        if w:
            y, w0 = align(y, w[0])
            y = y * w0
        return y

    def fn_l2norm(self, e, scope):
        x = self.eval(e.args[0], scope)
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)

    # ---------------------------------------------------- binary helpers
    def fn_outer(self, e, scope):
        a, b = self.args(e, scope)
        if len(named_shape(a)) != 1 or len(named_shape(b)) != 1:
            raise EvalError(f"{located(e)}outer needs two vectors, got shapes "
                             f"{list(named_shape(a))} and {list(named_shape(b))}")
        return a.unsqueeze(-1) * b.unsqueeze(-2)

    def fn_min(self, e, scope):
        return torch.minimum(*align(*self.args(e, scope)))

    def fn_max(self, e, scope):
        return torch.maximum(*align(*self.args(e, scope)))

    def fn_clamp(self, e, scope):
        x, lo, hi = self.args(e, scope)
        x, lo = align(x, lo)
        x = torch.maximum(x, lo)
        x, hi = align(x, hi)
        return torch.minimum(x, hi)

    def fn_huber(self, e, scope):
        x, d = align(*self.args(e, scope))
        ax = x.abs()
        return torch.where(ax <= d, 0.5 * x * x, d * (ax - 0.5 * d))

    def fn_solve(self, e, scope):
        A, b = self.args(e, scope)
        if len(named_shape(A)) != 2:
            raise EvalError(f"{located(e)}solve needs a square matrix first, got {list(named_shape(A))}")
        if len(named_shape(b)) == 1:
            return torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)
        return torch.linalg.solve(A, b)

    def fn_cg(self, e, scope):
        """``cg(A, B, steps)``: :func:`conjugate_gradients` on every column of B."""
        A, b = self.args(e, scope)[:2]
        if len(named_shape(A)) != 2:
            raise EvalError(f"{located(e)}cg needs a square matrix first, got {list(named_shape(A))}")
        steps = e.args[2]
        n = steps.value if isinstance(steps, Num) else self.spec.constants[steps.id]
        if len(named_shape(b)) == 1:
            return conjugate_gradients(A, b.unsqueeze(-1), int(n)).squeeze(-1)
        return conjugate_gradients(A, b, int(n))

    def fn_diag(self, e, scope):
        raise EvalError(f"{located(e)}diag(a) is only allowed as an operand of @")

    def fn_eye(self, e, scope):
        d = self.int_arg(e.args[0])
        return torch.eye(d, dtype=self.dtype, device=self.device).reshape(1, 1, d, d)

    def int_arg(self, a: Expr) -> int:
        if isinstance(a, Num) and float(a.value).is_integer():
            return int(a.value)
        if isinstance(a, Name) and a.id in self.spec.dims:
            return self.spec.dims[a.id]
        raise EvalError(f"{located(a)}expected a dim or an integer, got `{unparse(a)}`")

    # --------------------------------------------------------- caches
    def fn_attend(self, e, scope):
        """``softmax(scale * K q) V``: q [d], K [n, d], V [n, e], scale [] -> [e]."""
        q, K, V, scale = self.args(e, scope)
        scores = (K @ q.unsqueeze(-1)).squeeze(-1)                  # [B, H, n]
        if torch.is_tensor(scale) and scale.dim() >= 2:              # per-head scale [B, H]
            scale = scale.unsqueeze(-1)
        scores = scores * scale
        weights = torch.softmax(scores, dim=-1)
        return (weights.unsqueeze(-2) @ V).squeeze(-2)

    def fn_append(self, e, scope):
        raise EvalError(f"{located(e)}append(K, k) is only allowed as a statement `K = append(K, k)`")
