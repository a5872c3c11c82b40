"""The reference interpreter's token loop: one token's lets, read and update statements, and the
schedules that run them over a sequence (online, ``minibatch(C)``, ``apply_update(C)``)."""
from __future__ import annotations

from typing import Any

import torch

from ..lang.blocks import block_statements
from ..lang.expr import Call, Expr
from ..lang.spec import Spec
from .inputs import check_inputs, full_state, learned_params, schedule_mode, state_frequencies
from .interpreter import Interpreter
from .values import Block, Scope


def run_sequence(spec: Spec, state: dict | None, schedule: Any, params: dict | None,
                 inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~memspec.reference.run` over one batch of sequences (no packing): the schedule's
    token loop -- online, ``minibatch(C)`` (gradients at the chunk-start values, through a
    shadow state) or ``apply_update(C)`` (every state a block update of C tokens)."""
    mode = schedule_mode(schedule, spec)
    chunk = mode[1] if mode[0] == "minibatch" else None
    every = state_frequencies(spec, mode)
    B, T, H, dtype, device = check_inputs(spec, inputs)
    params = learned_params(spec, params, H, dtype, device)
    cur = full_state(spec, state, B, H, dtype, device, params)
    tensors = [*inputs.values(), *params.values(), *cur.values()]
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    interp = Interpreter(spec, params, dtype, device, needs_graph)
    interp.terms = {b.index: list(b.terms) for b in block_statements(spec, every)}
    caches = [n for n, st in spec.state.items() if st.cache]

    outputs: list[torch.Tensor] = []
    chunk_start: dict[str, torch.Tensor] = {}
    acc: dict = {}   # block updates: (statement, term) -> the sum so far of the open block
    for t in range(T):
        if chunk is not None and t % chunk == 0:
            chunk_start = dict(cur)
        token = token_inputs(spec, inputs, t)
        # mini-batch: gradients at the chunk-start values of the learned states; the caches
        # (the recent keys and values a window loss reads) are always up to date
        shadow = {**chunk_start, **{c: cur[c] for c in caches}} if chunk is not None else None
        outputs.append(token_step(interp, token, cur, shadow, B, H, Block(t, every, acc)))
    return torch.stack(outputs, dim=1), dict(cur)


def token_inputs(spec: Spec, inputs: dict, t: int) -> dict[str, torch.Tensor]:
    """Views ``[B, H, D]`` and gates ``[B, H, *shape]`` of token ``t``."""
    return {n: inputs[n][:, t] for n in (*spec.views, *spec.gates)}


def token_step(interp: Interpreter, token: dict, state: dict, shadow: dict | None,
               B: int, H: int, block: Block | None = None) -> torch.Tensor:
    """One token: lets, (read), update statements in order, (read).  Mutates ``state``.

    A statement whose target is no state binds a temporary of this token, visible to
    the later statements only (the read, the lets and the next token never see it).

    Online (``shadow is None``) every ``grad`` is taken at the current state.
    Mini-batch: ``shadow`` starts as the chunk-start state and the token's
    statements are replayed on it first; each ``grad`` is taken there (so at the
    chunk-start values, carried through this token's own earlier statements, e.g.
    a decay written before the gradient) and reused by the real statement.  With
    C = 1 the shadow equals the state, so mini-batch(1) is online learning exactly.

    A statement of a state updated every C > 1 tokens (``block``) adds its gradient terms to
    the block's sums and assigns only at the block's last token, with each term replaced by
    its sum (:mod:`memspec.lang.blocks`).
    """
    spec = interp.spec
    scope = Scope(token=token, state=state)
    for name, expr in spec.let.items():
        token[name] = interp.eval(expr, scope)
    out = None
    if spec.order == "read_write":
        out = interp.eval(spec.read, scope)
    last_grad = max((i for i, st in enumerate(spec.update) if has_grad(st.value)), default=-1)
    temps: dict = {}          # this token's temporaries (never carried to the next token) ...
    shadow_temps: dict = {}   # ... and those of the replay on the chunk-start state
    for i, stmt in enumerate(spec.update):
        memo = None
        if shadow is not None and i <= last_grad:
            memo = {}
            interp.step_statement(i, stmt, Scope(token=token, state=shadow, grad_memo=memo, temp=shadow_temps),
                                  block, commit=False)
        interp.step_statement(i, stmt, Scope(token=token, state=state, grad_memo=memo, temp=temps), block)
    if spec.order == "write_read":
        out = interp.eval(spec.read, scope)
    return out.expand(B, H, *out.shape[2:])


def has_grad(e: Expr) -> bool:
    """Whether ``e`` takes a ``grad``."""
    return any(isinstance(n, Call) and n.fn == "grad" for n in e.walk())
