"""Collectives that carry gradients, for :mod:`memspec.parallel`.

* :func:`all_gather` -- every rank's tensor on every rank; backward: each rank's gradient is the
  sum over ranks of the gradients of its piece (one all-reduce: gloo has no reduce-scatter, and
  ``torch.distributed.nn.functional.all_gather`` is deprecated in torch 2.13).
* :func:`send` / :func:`recv` -- the state from one rank to the next; backward: its gradient back.
* :func:`attach` -- outputs that carry a collective's node into every rank's backward, so that each
  rank runs the backward collectives its peers wait for (with zero gradients where it used nothing).

Every rank must call backward when one does (as with any collective under autograd).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function


def rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank and the group's size; ``(0, 1)`` when no process group is initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _AllGather(Function):
    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack([x.contiguous() for x in grads])     # [P, ...]: this rank's use of each piece
        dist.all_reduce(g, group=ctx.group)                 # every rank's use of each piece
        return None, g[dist.get_rank(ctx.group)]


def all_gather(x: torch.Tensor, group=None) -> tuple[torch.Tensor, ...]:
    """Every rank's ``x`` (one shape on all ranks), in rank order; differentiable."""
    if torch.is_grad_enabled() and not x.requires_grad:   # every rank builds the node its peers reduce with
        x = x.detach().requires_grad_()
    return _AllGather.apply(group, x)


class _Attach(Function):
    @staticmethod
    def forward(ctx, n, *xs):
        ctx.n = n
        ctx.like = [(x.shape, x.dtype, x.device) for x in xs[n:]]
        return tuple(x.clone() for x in xs[:n])

    @staticmethod
    def backward(ctx, *grads):
        zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.like]
        return (None, *grads, *zeros)


def attach(outputs: list[torch.Tensor], carried: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` unchanged, with ``carried`` (which they may not depend on) in their graph."""
    carried = [c for c in carried if c.requires_grad]
    if not torch.is_grad_enabled() or not carried or not outputs:
        return outputs
    return list(_Attach.apply(len(outputs), *outputs, *carried))


class _Send(Function):
    @staticmethod
    def forward(ctx, dst, group, anchor, *xs):
        ctx.dst, ctx.group = dst, group
        ctx.like = [(x.shape, x.dtype, x.device, x.is_floating_point()) for x in xs]
        for x in xs:
            dist.send(x.contiguous(), _global(group, dst), group=group)
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads = []
        for shape, dtype, device, floating in ctx.like:
            if floating:
                g = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(g, _global(ctx.group, ctx.dst), group=ctx.group)
                grads.append(g)
            else:
                grads.append(None)
        return (None, None, None, *grads)


class _Recv(Function):
    @staticmethod
    def forward(ctx, src, group, like, anchor):
        ctx.src, ctx.group = src, group
        out = []
        for shape, dtype, device in like:
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, _global(group, src), group=group)
            out.append(x)
        ctx.mark_non_differentiable(*[x for x in out if not x.is_floating_point()])
        ctx.floating = [x.is_floating_point() for x in out]
        ctx.like = like
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        for g, floating, (shape, dtype, device) in zip(grads, ctx.floating, ctx.like):
            if floating:
                g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                dist.send(g, _global(ctx.group, ctx.src), group=ctx.group)
        return None, None, None, None


def send(xs: list[torch.Tensor], dst: int, group=None) -> torch.Tensor | None:
    """Send ``xs`` to rank ``dst`` of ``group``; under autograd returns a scalar to :func:`attach`
    to this rank's outputs (its backward receives the gradients of ``xs`` from ``dst``)."""
    if not torch.is_grad_enabled():
        for x in xs:
            dist.send(x.contiguous(), _global(group, dst), group=group)
        return None
    anchor = torch.zeros((), device=xs[0].device if xs else None, requires_grad=True)
    return _Send.apply(dst, group, anchor, *xs)


def recv(like: list[tuple], src: int, group=None) -> list[torch.Tensor]:
    """Receive tensors ``like = [(shape, dtype, device)]`` from rank ``src`` of ``group``;
    under autograd their gradients go back to ``src`` in backward."""
    if not torch.is_grad_enabled():
        out = []
        for shape, dtype, device in like:
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, _global(group, src), group=group)
            out.append(x)
        return out
    anchor = torch.zeros((), device=like[0][2] if like else None, requires_grad=True)
    return list(_Recv.apply(src, group, like, anchor))


def send_object(obj, dst: int, group=None) -> None:
    dist.send_object_list([obj], _global(group, dst), group=group)


def recv_object(src: int, group=None):
    box = [None]
    dist.recv_object_list(box, _global(group, src), group=group)
    return box[0]
