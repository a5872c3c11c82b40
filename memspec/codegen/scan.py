"""Emitter of the ``scan`` family: every state ``S <- a * S + b`` (elementwise, ``a`` and ``b``
token-local) through :func:`memspec.runtime.scan.chunk_scan`, one kernel call per state; the
read is then the spec's read over every token's state at once."""
from __future__ import annotations

from ..runtime.scan import chunk_scan
from ..schedule.algebra import simplify
from . import chunked
from .exprs import P_ATOM, P_MUL, ExprEmitter

KERNEL = chunk_scan


def emit(ctx, L) -> None:
    chunked.emit_forward(ctx, L, body, KERNEL)


def _lifted(w, e, rank: int, rows: bool = False):
    """Code of a token-local value lifted to broadcast against a state of ``rank`` axes after any
    prefix (singleton axes after the prefix; a row factor ``[..., d, 1]``); (code, is a number)."""
    c = w.em._emit(w.fold(e))
    if c.number:
        return c.text, True
    if rows:
        return f"{c.at(P_ATOM)}.unsqueeze(-1)", False
    return (ExprEmitter._lift(c, rank) if c.rank < rank else c.at(P_MUL)), False


def body(w, spec, plan, state_in, state_out, chunk, probe_names, probe_shapes) -> None:
    w.lines.append("# elementwise scan (exact): S <- a * S + b for every token, then the read of every token's state")
    first = w.first_view
    w.let_of += [(simplify(inl), n) for inl, n in w.let_of]   # the lets as the analysis simplified them
    for st in plan.states:
        S = st.name
        shape = tuple(spec.state[S].shape)
        full = f"[B, T, H{''.join(', ' + d for d in shape)}]"
        factors = [_lifted(w, f.value, len(shape), f.on == "rows") for f in st.decay]
        a = w.fresh(f"{S}_a")
        if not factors:
            code = f"{first}.new_ones(())"
        elif all(num for _, num in factors):
            code = f"{first}.new_tensor({' * '.join(c for c, _ in factors)})"
        else:
            code = " * ".join(c for c, _ in factors)
        tok = any(w.per_token(f.value) for f in st.decay)
        w.lines.append(f"{a} = {code}  # decay, broadcast to {full}" + ("" if tok else " (the same for every token)"))
        b = w.fresh(f"{S}_b")
        code, num = _lifted(w, st.increment, len(shape))
        if num or not w.per_token(st.increment) or w.em.shape(w.fold(st.increment)) != shape:
            code = (f"{first}.new_tensor({code})" if num else code) \
                + f".expand(*{first}.shape[:3], *{state_in[S]}.shape[2:])"
        w.lines.append(f"{b} = {code}  # {full} increment")
        seq = w.fresh(f"{S}_all")
        w.lines.append(f"{seq}, {state_out[S]} = chunk_scan({a}, {b}, {state_in[S]}, {chunk})  # {full}: every "
                       f"token's state")
        if not plan.inclusive:
            seen = w.fresh(f"{S}_before")
            w.lines.append(f"{seen} = torch.cat([{state_in[S]}.unsqueeze(1).to({seq}.dtype), {seq}[:, :-1]], dim=1)  "
                           f"# {full}: the state each token reads (before its write)")
            seq = seen
        probe_names[S] = seq
        probe_shapes[seq] = shape
