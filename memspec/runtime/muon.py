"""Muon's Newton-Schulz orthogonalisation (the language's ``newton_schulz(X, steps)``) with a
closed-form backward.

Carried into generated modules with ``inspect.getsource`` as the helpers are (torch only).
Autograd through the iterations replays each step's three products as six, with elementwise
passes for their coefficients (about 3x the forward); the backward here is the adjoint of each
step written as four batched products (see :class:`_NewtonSchulz`), from the iterates the
forward keeps -- the tensors autograd would keep through the plain iterations, no more.
"""
import torch


def newton_schulz(X, steps):
    """Muon's quintic Newton-Schulz iteration on the last two axes: X / (|X|_F + 1e-7), then
    `steps` times X <- a X + (b A + c A A) X with A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315);
    or, with `steps` a tuple of (a, b, c) triples (a coefficient schedule), one step per triple.
    Run on the smaller Gram matrix (X^T for a tall X: the same result, transposed back); each step
    is three batched products, the sums fused into them (baddbmm: no elementwise pass).  Under
    autograd the backward is the iteration's adjoint in closed form (_NewtonSchulz)."""
    schedule = steps if isinstance(steps, tuple) else ((3.4445, -4.7750, 2.0315),) * steps
    if torch.is_grad_enabled() and X.requires_grad:
        return _NewtonSchulz.apply(X, schedule)[0]
    return _ns_run(X, schedule)[0]


def _ns_run(G, schedule, kept=None):
    """The iteration on G [..., p, q] -> (the result [..., p, q], r = |G|_F [N, 1, 1]); with a list
    `kept`, each step's (X_k, A_k, B_k) [N, ...] is appended to it (see _ns_steps)."""
    tall = G.shape[-2] > G.shape[-1]
    X, r = _ns_start(G)
    X = _ns_steps(X, schedule, kept)
    X = X.reshape(G.shape[:-2] + X.shape[-2:])
    return (X.transpose(-2, -1) if tall else X), r


def _ns_start(G):
    """The iteration's start: G [..., p, q] -> (X0 = Y / (r + 1e-7) as [N, m, n], r = |Y|_F as [N, 1, 1]),
    the batch axes as one, with Y = G, or G^T when p > q (so that m <= n)."""
    Y = G.transpose(-2, -1) if G.shape[-2] > G.shape[-1] else G
    r = torch.linalg.matrix_norm(Y, keepdim=True)
    X = Y / (r + 1e-7)
    return X.reshape(-1, *X.shape[-2:]), r.reshape(-1, 1, 1)


def _ns_steps(X, schedule, kept=None):
    """The steps from X0 [N, m, n], one per (a, b, c) of `schedule`: X <- a X + B X with A = X X^T,
    B = b A + c A A -> X_K; with a list `kept`, each step's (X_k, A_k, B_k) is appended to it."""
    for a, b, c in schedule:
        A = torch.bmm(X, X.transpose(-2, -1))                 # [N, m, m]
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)           # b A + c A A
        if kept is not None:
            kept.append((X, A, B))
        X = torch.baddbmm(X, B, X, beta=a)                    # a X + (b A + c A A) X
    return X


class _NewtonSchulz(torch.autograd.Function):
    """``newton_schulz(G, schedule)`` with the adjoint of its iteration as the backward.

    One step, X' = a X + B X with A = X X^T, B = b A + c A^2 (A, B symmetric), given the
    gradient Gb of a loss with respect to X' (all [m, n], m <= n):

        dX' = a dX + B dX + (b dA + c (dA A + A dA)) X,   dA = dX X^T + X dX^T

    so, with M = Gb X^T and <P, Q> = trace(P^T Q),
        <Gb, (b dA + c dA A + c A dA) X> = <b M + c (M A + A M), dA>,
    and the symmetric dA = dX X^T + X dX^T takes a matrix R to (R + R^T) X.  Hence

        Ms = M + M^T,   S = b Ms + c (Ms A + A Ms) = Q + Q^T  with  Q = (b/2) Ms + c Ms A,
        gradient w.r.t. X = a Gb + B Gb + S X

    (four products a step: M, Ms A, (a I + B) Gb and S X).  The normalisation X0 = Y / s,
    s = r + eps, r = |Y|_F: d(Y / s) = dY / s - Y <Y, dY> / (r s^2), so

        gradient w.r.t. Y = Gb0 / s - Y <Gb0, Y> / (r s^2) = Gb0 / s - X0 <Gb0, X0> / r

    (at Y = 0, where r = 0, the second term is 0, as autograd's norm gives: Gb0 / eps).  A tall
    input is iterated transposed, so its gradient is transposed back.

    The forward returns each step's X_k, A_k, B_k besides the result (outputs marked
    non-differentiable: what autograd would keep through the plain iterations; measured faster
    than recomputing them from the input, which costs more products than autograd's own
    backward); a differentiable backward (create_graph, torch.func.grad) recomputes them from the
    input instead, so that they are in the graph and second derivatives are exact.  The backward
    is torch operations, none in place on a tensor it did not make here and none an in-place
    product (which vmap runs as a loop), so torch.func.grad and vmap run through it; forward-mode
    AD (jvp) is not defined.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(G, schedule):
        """-> (the result, |Y|_F [N, 1, 1], then each step's X_k, A_k, B_k [N, ...]) for the backward."""
        kept = []
        return _ns_run(G, schedule, kept) + tuple(t for step in kept for t in step)

    @staticmethod
    def setup_context(ctx, inputs, output):
        G, schedule = inputs
        ctx.schedule = schedule
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(G, *output[1:])

    @staticmethod
    def backward(ctx, grad, *_):
        if grad is None:
            return None, None
        G, r, *kept = ctx.saved_tensors
        if torch.is_grad_enabled():   # a differentiable backward: the iterates from G, in the graph
            steps = []
            r = _ns_run(G, ctx.schedule, steps)[1]
        else:
            steps = [tuple(kept[i:i + 3]) for i in range(0, len(kept), 3)]
        X0 = steps[0][0]
        tall = G.shape[-2] > G.shape[-1]
        Gb = (grad.transpose(-2, -1) if tall else grad).reshape(X0.shape)
        for (X, A, B), (a, b, c) in zip(reversed(steps), reversed(ctx.schedule)):
            M = torch.bmm(Gb, X.transpose(-2, -1))            # [N, m, m]
            Ms = M + M.transpose(-2, -1)
            Q = torch.baddbmm(Ms, Ms, A, beta=0.5 * b, alpha=c)   # (b/2) Ms + c Ms A
            P = B.clone()
            P.diagonal(dim1=-2, dim2=-1).add_(a)              # a I + B: no copy of Gb [N, m, n] for a Gb
            Gb = torch.baddbmm(torch.bmm(P, Gb), Q + Q.transpose(-2, -1), X)   # a Gb + B Gb + S X
        dot = (Gb * X0).sum((-2, -1), keepdim=True)           # <Gb0, X0> = <Gb0, Y> / s
        Gy = Gb / (r + 1e-7) - X0 * torch.where(r > 0, dot / torch.where(r > 0, r, 1), 0)
        Gy = Gy.reshape(G.shape[:-2] + Gy.shape[-2:])
        return (Gy.transpose(-2, -1) if tall else Gy), None
