"""Emitter of the ``scan`` family: every state ``S <- a * S + b`` (elementwise, ``a`` and ``b``
token-local) and the read.

* Vector states (no larger than a view): the decays and increments of all tokens, every token's
  state by :func:`memspec.runtime.scan.chunk_scan`, then the read over all tokens at once.
* A matrix state: through :func:`memspec.runtime.scan.chunk_scan_read`, with two local functions
  of one position of every chunk -- the decays and increments of the states, and the read -- that
  the kernel runs chunk-parallel, so no tensor of every token's state, decay or increment is ever
  formed (Mamba-1's ``[N, d_v]`` state per token would be T times the state)."""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Name, Neg, Transpose
from ..lang.names import GENERATED_NAMES, fresh
from ..runtime.scan import chunk_scan, chunk_scan_read
from ..schedule.algebra import names_in, simplify
from .calls import KernelCall
from .exprs import P_ATOM, P_MUL, ExprEmitter
from .context import Emitter

KERNEL = chunk_scan_read


def _fold(e, lets):
    """Subexpressions equal to a let's value (inlined, as written or simplified) as the let's name."""
    for inl, n in lets:
        if e == inl or e == simplify(inl):
            return Name(n)
    if isinstance(e, BinOp):
        return BinOp(e.op, _fold(e.left, lets), _fold(e.right, lets))
    if isinstance(e, (Neg, Transpose)):
        return type(e)(_fold(e.operand, lets))
    if isinstance(e, Call):
        return Call(e.fn, tuple(_fold(a, lets) for a in e.args))
    return e


def _lifted(em, e, rank: int, rows: bool = False) -> str:
    """Code of a token-local value lifted to broadcast against a state of ``rank`` axes after any
    prefix (singleton axes after the prefix; a row factor ``[..., d, 1]``)."""
    c = em._emit(e)
    if c.number:
        return c.text
    if rows:
        return f"{c.at(P_ATOM)}.unsqueeze(-1)"
    return ExprEmitter._lift(c, rank) if c.rank < rank else c.at(P_MUL)


def _coefficients(ctx, em, spec, st, lets, like) -> tuple[str, str]:
    """Code of a state's decay (broadcastable to the state) and increment (the state's shape,
    after the prefix of ``like``)."""
    shape = tuple(spec.state[st.name].shape)
    a = " * ".join(_lifted(em, _fold(f.value, lets), len(shape), f.on == "rows") for f in st.decay) or "1.0"
    inc = _fold(st.increment, lets)
    b = _lifted(em, inc, len(shape))
    if em.shape(inc) != shape or not names_in(inc) & (set(spec.views) | set(spec.gates) | set(spec.let)):
        dims = ", ".join(f"self.{ctx.attr.get(d, d)}" for d in shape)   # broadcast to the state's shape
        b = f"{like}.new_full((*{like}.shape[:3], {dims}), {b})" if em._emit(inc).number \
            else f"{b}.expand(*{like}.shape[:3], {dims})"
    return a, b


def _bound(L, code: str, name: str, comment: str) -> str:
    """``code`` itself when it is a name, else a new local ``name`` bound to it."""
    if code.isidentifier():
        return code
    L(f"{name} = {code}", comment)
    return name


def emit(ctx, L) -> None:
    spec, plan = ctx.spec, ctx.plans["scan"]
    sv = ctx.views + ctx.gates
    L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}):")
    with L.indent():
        vector = all(len(spec.state[st.name].shape) <= 1 for st in plan.states)
        L('"""' + "The exact scan over chunks of self.chunk tokens: every state S <- a * S + b, "
          + ("then the read of every token's state." if vector else "read as it is made.") + '"""')
        em = ctx.emitter()
        top = len(L.lines)
        ctx.lets(L, em, "B, T, H")
        lets = list(ctx.decision.let_forms)
        taken = set(ctx.spec_names) | GENERATED_NAMES
        # a vector state's decay and increment are no larger than a view: computed for all tokens at once
        whole = {}
        for st in plan.states:
            if len(spec.state[st.name].shape) <= 1:
                codes = _coefficients(ctx, em, spec, st, lets, sv[0])
                shape = f"[B, T, H, {', '.join(spec.state[st.name].shape)}]"
                whole[st.name] = tuple(_bound(L, code, fresh(f"{st.name}_{ab}", taken), f"{shape}: {what}")
                                       for code, ab, what in zip(codes, "ab", (f"decay of {st.name}, every token",
                                                                               f"increment of {st.name}, every token")))
        coef_exprs = [f.value for st in plan.states if st.name not in whole for f in st.decay] \
            + [st.increment for st in plan.states if st.name not in whole]
        order = sv + ctx.let_order()

        def names(exprs):
            used = set().union(set(), *(names_in(_fold(e, lets)) for e in exprs))
            return [n for n in order if n in used]

        inputs = list(dict.fromkeys([n for ab in whole.values() for n in ab] + names(coef_exprs)))
        read_inputs = names([plan.read]) or ([] if inputs else [ctx.first])   # (an input gives T)
        if vector:
            _whole(ctx, L, em, plan, whole, lets, taken)
            return
        if len(L.lines) > top:
            L()
        coef, read = fresh("coefficients", taken), fresh("read_states", taken)
        L(f"def {coef}({', '.join(inputs)}):")
        with L.indent():
            L('"""' + "One position of every chunk ([B, N, H, ...]): (decay, increment) of each state." + '"""')
            pairs = [f"({whole[st.name][0]}, {whole[st.name][1]})" if st.name in whole
                     else "({}, {})".format(*_coefficients(ctx, em, spec, st, lets, (inputs + read_inputs)[0]))
                     for st in plan.states]
            L(f"return ({', '.join(pairs)},)")
        L()
        states = [st.name for st in plan.states]
        L(f"def {read}({', '.join(states + read_inputs)}):")
        with L.indent():
            L('"""' + f"The read of the states ({', '.join(states)}) at one position of every chunk." + '"""')
            L(f"return {em.emit(_fold(plan.read, lets))}")
        L()
        outs = [fresh(f"{s}_new", taken) for s in states]
        xs, ys = (f"({', '.join(x)}{',' if len(x) == 1 else ''})" for x in (inputs, read_inputs))
        h0 = f"({', '.join(f'state[{s!r}]' for s in states)}{',' if len(states) == 1 else ''})"
        L.block(KernelCall.of(f"o, ({', '.join(outs)}{',' if len(outs) == 1 else ''})", chunk_scan_read,
                              [coef, read, xs, ys, h0, "self.chunk"], dict(inclusive=plan.inclusive),
                              comment=f"[B, T, H{''.join(', ' + d for d in ctx.read_shape())}]"))
        rest = [f"{n!r}: state[{n!r}]" for n in spec.state if n not in states]
        L(f"return o, {{{', '.join([f'{s!r}: {o}' for s, o in zip(states, outs)] + rest)}}}")
    L()
    ctx.need_kernel(chunk_scan)
    ctx.need_kernel(chunk_scan_read)


def _whole(ctx, L, em, plan, whole, lets, taken) -> None:
    """Vector states: every token's state by :func:`chunk_scan`, then the read over all tokens."""
    spec = ctx.spec
    names = {}
    for st in plan.states:
        shape = f"[B, T, H, {', '.join(spec.state[st.name].shape)}]"
        seq, new = fresh(f"{st.name}_all", taken), fresh(f"{st.name}_new", taken)
        L.block(KernelCall.of(f"{seq}, {new}", chunk_scan,
                              [whole[st.name][0], whole[st.name][1], f"state[{st.name!r}]", "self.chunk"],
                              comment=f"{shape}: every token's state"))
        if not plan.inclusive:
            before = fresh(f"{st.name}_before", taken)
            L(f"{before} = torch.cat([state[{st.name!r}].unsqueeze(1).to({seq}.dtype), {seq}[:, :-1]], dim=1)",
              f"{shape}: the state each token reads (before its write)")
            seq = before
        names[st.name] = (seq, new)
    read = ExprEmitter(spec, names={n: seq for n, (seq, _) in names.items()}, like=em.like, attr=em.attr,
                       helpers=em.helpers)
    L(f"o = {read.emit(_fold(plan.read, lets))}", f"[B, T, H{''.join(', ' + d for d in ctx.read_shape())}]")
    rest = [f"{n!r}: state[{n!r}]" for n in spec.state if n not in names]
    L(f"return o, {{{', '.join([f'{s!r}: {new}' for s, (_, new) in names.items()] + rest)}}}")
    L()
    ctx.need_kernel(chunk_scan)


EMITTER = Emitter(family="scan", emit=emit, forward_method="_forward_chunk",
                  schedule_text="elementwise scan (h <- a * h + b, every token's state), chunk {chunk} (exact)",
                  kernel=True)
