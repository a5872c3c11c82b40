"""The reference interpreter: run a spec token by token with PyTorch.

This is the numerical oracle every compiled schedule is tested against, so it
favours clarity over speed: it walks the spec's expression AST directly, one token
at a time, with exactly the semantics of ``docs/language.md`` ("Semantics of one
token").  It never looks at the graph or shape modules; shapes are read off the
tensors as they flow.

Layout (shared by every phase)::

    views   [B, T, H, D]       one tensor per view, D = the view's dim
    gates   [B, T, H]          already computed gate values (not logits); [B, T, H, d] per channel
    state   [B, H, *shape]     a cache state is [B, H, n, *shape] (n grows)
    params  [H, *shape]        learned outer-loop tensors (and learned initial states)
    output  [B, T, H, *read_shape]

Inside the interpreter every value carries the leading ``[B, H]`` axes (numbers
are ``[1, 1]`` tensors, params ``[1, H, ...]``), so the *named* part of a value is
``tensor.shape[2:]`` and elementwise operators broadcast numpy-style on those
trailing named axes.

``grad(loss, W)`` is ``torch.autograd.grad`` with ``create_graph=True`` at the
current values of all states (under ``("minibatch", C)``: at the chunk-start
values, carried through the token's own earlier statements; see
:func:`~memspec.reference.tokens.token_step`),
inside ``torch.enable_grad()`` so that it also works under ``torch.no_grad()``.
The result stays differentiable for the outer loop: gradients flow into views,
gates, params and learned initial states.

Public API: :func:`run`, :func:`init_state`, :func:`apply_model`, :func:`document_bounds`,
:func:`newton_schulz`, :func:`conjugate_gradients` (``cg``) and the numerical constants of the
normalisers and of ``newton_schulz``.

Modules: :mod:`.inputs` (dims, params, initial states, views and gates, the schedule argument,
checked), :mod:`.values` (the ``[B, H, ...]`` values, the scope, the located error),
:mod:`.interpreter` (expressions, ``grad``, update statements), :mod:`.functions` (the built-in
functions), :mod:`.tokens` (one token; the schedules' token loop), :mod:`.packed` (``cu_seqlens``),
:mod:`.api` (:func:`run`, :func:`apply_model`).
"""
from __future__ import annotations

from .api import apply_model, run
from .functions import LAYERNORM_EPS, NORM_EPS, NS_COEFFICIENTS, NS_EPS, conjugate_gradients, newton_schulz
from .inputs import init_state
from .packed import document_bounds

__all__ = ["run", "init_state", "apply_model", "document_bounds", "newton_schulz", "conjugate_gradients",
           "LAYERNORM_EPS", "NORM_EPS", "NS_COEFFICIENTS", "NS_EPS"]
