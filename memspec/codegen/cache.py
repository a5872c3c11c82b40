"""Emitter of the ``cache`` family: ``_forward_cache``, softmax attention over [cached | new]
keys and values at once through ``scaled_dot_product_attention`` with a causal
(windowed) mask (``_masked_attention``: a non-finite key or value reaches only the outputs
that attend to it); the new state is the cache trimmed to its window.  A scale that is not a
number (a learned per-head temperature, a gate) multiplies the query, and SDPA's scale is 1."""
from __future__ import annotations

from ..lang.expr import Call, unparse
from ..lang.names import fresh
from ..runtime.helpers import _causal_mask, _masked_attention
from .exprs import P_ATOM, P_MUL, ExprEmitter
from .text import dims_text, shape_text
from .context import Emitter


def emit(ctx, L) -> None:
    spec = ctx.spec
    plan = ctx.plans["cache"]
    taken = ctx.taken()
    sv = ctx.views + ctx.gates
    L(f"def _forward_cache(self, {', '.join(sv + ['state'])}):")
    with L.indent():
        L('"""' + "Softmax attention over [cached | new] keys and values at once: scaled_dot_product_attention")
        L("with a causal (windowed) mask; the new state is the cache trimmed to its window." + '"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, T, H")
        T = fresh("T", taken)
        L(f"{T} = {ctx.first}.shape[1]")
        full = {}
        for s, item in plan.appends:
            st = spec.state[s]
            full[s] = fresh(f"{s}_all", taken)
            L(f"{full[s]} = torch.cat([state[{s!r}], {em._emit(item).at(P_ATOM)}.transpose(1, 2)], dim=2)",
              f"[B, H, n + T, {dims_text(st.shape)}]")
        pre = {}
        for c in spec.read.walk():
            if isinstance(c, Call) and c.fn == "attend" and unparse(c) not in pre:
                q, K, V, scale = c.args
                win = spec.state[K.id].window
                mask = fresh("mask", taken)
                L(f"{mask} = _causal_mask({T}, {full[K.id]}.shape[2], {win}, {ctx.first}.device)", "[T, n + T]")
                name = fresh("attended", taken)
                sc = em._emit(scale)
                if sc.number:
                    query, sdpa_scale = em._emit(q).at(P_ATOM), sc.text
                else:                                  # softmax(s K q) = softmax(K (s q)): s into the query
                    query, sdpa_scale = f"({em._emit(q).at(P_MUL)} * {sc.at(P_ATOM)}.unsqueeze(-1))", "1.0"
                L(f"{name} = _masked_attention({query}.transpose(1, 2), {full[K.id]}, "
                  f"{full[V.id]}, {mask}, {sdpa_scale}, {win}).transpose(1, 2)",
                  shape_text("B, T, H", ctx.shape(c)))
                pre[unparse(c)] = name
        ctx.need(_causal_mask)
        ctx.need(_masked_attention)
        rd = ExprEmitter(spec, grads=pre, like=ctx.first, attr=ctx.attr, helpers=ctx.helpers)
        L(f"o = {rd.emit(spec.read)}", shape_text("B, T, H", ctx.read_shape()))
        items = []
        for s, st in spec.state.items():
            trim = f"[:, :, -{st.window}:]" if st.window else ""
            items.append(f"{s!r}: {full[s]}{trim}")
        L(f"return o, {{{', '.join(items)}}}")
    L()


EMITTER = Emitter(
    family="cache", emit=emit, forward_method="_forward_cache",
    schedule_text="cache: scaled_dot_product_attention over [past cache | new tokens] with a causal{window} mask "
                  "(exact)")
