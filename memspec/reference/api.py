"""The reference interpreter's entry points: :func:`run` (a sequence, token by token) and
:func:`apply_model` (the inner model with a given state)."""
from __future__ import annotations

from typing import Any

import torch

from ..lang.spec import Spec
from .inputs import learned_params, with_dims
from .interpreter import Interpreter
from .packed import run_documents
from .tokens import run_sequence
from .values import Scope


def run(spec: Spec, *, state: dict | None = None, schedule: Any = "online",
        dims: dict | None = None, params: dict | None = None, cu_seqlens: torch.Tensor | None = None,
        **views_and_gates: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run ``spec`` over a sequence, token by token.

    Args:
        state: ``{name: [B, H, *shape]}`` initial state (missing entries from
            :func:`init_state`; a cache is ``[B, H, n, *shape]``).
        schedule: ``"online"`` (also ``"auto"``, ``"chunk(N)"``: the same numbers),
            ``("minibatch", C)`` / ``"minibatch(C)"``, ``("apply_update", C)`` /
            ``"apply_update(C)"``, or ``"spec"`` (the spec's own).
        dims: overrides of the spec's dims.
        params: learned params ``{name: [H, *shape]}`` and learned initial states.
        cu_seqlens: packed documents (flash-linear-attention's convention): B = 1 and integer
            offsets ``[N + 1]`` (0, ..., T); document i is tokens ``cu_seqlens[i]`` to
            ``cu_seqlens[i + 1] - 1`` and runs alone, from its own initial state (``state`` and
            the final state are then ``[N, H, *shape]``; a cache the documents leave at different
            lengths is left out of the final state), its blocks and chunks starting at its own
            first token.
        views_and_gates: each view ``[B, T, H, D]``, each gate ``[B, T, H]`` (``[B, T, H, d]``
            for a gate declared with a shape).

    The sequence starts at position 0 (blocks of ``every C`` states and ``apply_update(C)``
    chunks end at positions C - 1, 2C - 1, ...); the returned state holds each state's
    value, without the updates of a block not yet complete.

    Returns:
        ``(outputs [B, T, H, *read_shape], final_state {name: [B, H, *shape]})``.
    """
    spec = with_dims(spec, dims)
    if cu_seqlens is not None:
        return run_documents(spec, state, schedule, params, cu_seqlens, views_and_gates)
    return run_sequence(spec, state, schedule, params, views_and_gates)


def apply_model(spec: Spec, state: dict[str, torch.Tensor], u: torch.Tensor,
                dims: dict | None = None, params: dict | None = None) -> torch.Tensor:
    """The inner model ``f(u)`` with a given state (e.g. to measure retrieval MSE).

    ``u`` is ``[B, H, d_in]`` or ``[B, H, N, d_in]`` (N inputs, applied one by
    one); returns ``[B, H, *out]`` or ``[B, H, N, *out]``.
    """
    spec = with_dims(spec, dims)
    if spec.model is None:
        raise ValueError(f"spec {spec.name!r} has no model")
    if not isinstance(u, torch.Tensor) or u.dim() not in (3, 4):
        got = list(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"u must be [B, H, d_in] or [B, H, N, d_in], got {got}")
    missing = [n for n in spec.model_states() if n not in state]
    if missing:
        raise ValueError(f"state is missing {missing}, which the model reads")
    H = u.shape[1]
    params = learned_params(spec, params, H, u.dtype, u.device)
    needs_graph = torch.is_grad_enabled()
    interp = Interpreter(spec, params, u.dtype, u.device, needs_graph)
    scope = Scope(token={}, state=dict(state))
    if u.dim() == 3:
        return interp.apply_model(u, scope)
    return torch.stack([interp.apply_model(u[:, :, n], scope) for n in range(u.shape[2])], dim=2)
