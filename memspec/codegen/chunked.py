"""What the exact chunked families (:mod:`.additive`, :mod:`.delta`) share: the
``_forward_chunk`` method around a family's body, and :class:`ChunkWriter`, which binds
the token-local values a plan needs (vectorised over time with the
:class:`~.exprs.ExprEmitter`) before the kernel calls.

Contract of the body lines (:func:`forward_lines`; they run inside ``forward``):

* in scope: every view ``[B, T, H, D]`` and gate ``[B, T, H]`` as a local of its spec
  name, ``self.<param>`` / ``self.<dim>`` as the emitter writes them, and the
  incoming state tensors ``[B, H, *shape]`` under the codes of ``state_in``;
* the lets ``[B, T, H, ...]`` are locals too (the module binds them first), or,
  with ``lets=True``, the emitted lines bind them;
* they bind the output ``out`` ``[B, T, H, *read_shape]`` and the final states under
  ``state_out`` (default ``<S>_new``) and, with ``ret=True`` (default), end with
  ``return o, {"S": S_new, ...}``.

A family module provides ``body(w, spec, plan, state_in, state_out, chunk, probe_names,
probe_shapes)`` (the kernel calls; each linear probe's output named in ``probe_names``)
and ``KERNEL`` (the :mod:`memspec.runtime` function its module carries).
"""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, rewrite
from ..lang.names import GENERATED_NAMES, fresh
from ..runtime.varlen import _DocumentChunks, _Documents
from ..schedule.decide import BY_NAME
from ..schedule.sides import transposed_spec
from ..schedule.algebra import is_num, simplify
from .calls import Code, KernelCall


def fmt_shape(shape) -> str:
    return "[" + ", ".join(("B", "T", "H") + tuple(shape)) + "]"


class ChunkWriter:
    """Lines of a chunked forward, the fresh names they bind, and token-local values."""

    def __init__(self, spec, emitter, taken, let_forms):
        self.spec = spec
        self.em = emitter
        self.lines: list[str] = []
        self.taken = set(taken)
        self.taken |= set(spec.views) | set(spec.gates) | set(spec.let) | set(spec.state) | set(spec.params)
        self.taken |= GENERATED_NAMES
        # the lets, inlined (as the analysis saw them), for folding plan expressions back into let names
        self.let_of = list(let_forms)
        self.first_view = next(iter(spec.views), None)
        # stabilised kernel calls: probe output -> its stabiliser m [B, T, H] (the output is exp(-m) p);
        # read_scale: (the scaled outputs, the name of exp(-m)) when the read is evaluated at that scale
        self.stab_of: dict[str, str] = {}
        self.read_scale: tuple[set, str] | None = None

    def fresh(self, base: str) -> str:
        return fresh(base, self.taken)

    def fold(self, e: Expr) -> Expr:
        """Replace subexpressions equal to a let's (inlined) value by the let's name."""
        def visit(n: Expr) -> Expr | None:
            for inl, name in self.let_of:
                if n == inl:
                    return Name(name)
            return None

        return rewrite(e, visit)

    def per_token(self, e: Expr) -> bool:
        """Does ``e`` vary per token (uses a view, gate or let)?"""
        tok = set(self.spec.views) | set(self.spec.gates) | set(self.spec.let)
        return any(isinstance(n, Name) and n.id in tok for n in e.walk())

    def value(self, e: Expr, base: str, *, vector: bool) -> str:
        """Code of a token-local value ``[B, T, H]`` (scalar) or ``[B, T, H, d]`` (vector);
        a plain name is used as is, anything else is bound to a fresh local."""
        e = self.fold(simplify(e))
        c = self.em._emit(e)
        code = c.text
        shape = self.em.shape(e)
        if not self.per_token(e):  # a number, a dim or a param [H, ...]: broadcast over [B, T, H]
            ref = self.first_view
            if vector:
                code = f"torch.as_tensor({code}, dtype={ref}.dtype).expand(*{ref}.shape[:3], -1)"
            elif c.number:
                code = f"torch.full_like({ref}[..., 0], {code})"
            else:
                code = f"{c.at(9)}.expand({ref}.shape[:3])"
        if isinstance(e, Name) and self.per_token(e):
            return code
        name = self.fresh(base)
        self.lines.append(f"{name} = {code}  # {fmt_shape(shape)}")
        return name

    def log_decay(self, gamma: Expr | None, base: str) -> str:
        """The log of a decay: ``[B, T, H]`` (a scalar per head) or ``[B, T, H, d]`` (per channel),
        in closed form where the decay's formula has one (:func:`closed_log`), else ``log`` of
        its value: a decay of exactly 0 gives -inf, which the kernels take (a negative one counts as 0)."""
        if gamma is None:
            return "None"
        gamma = simplify(gamma)
        shape = self.em.shape(self.fold(gamma))
        closed = closed_log(gamma)
        if closed is not None:
            return self.value(closed, base, vector=bool(shape))
        g = self.value(gamma, base.replace("log_", ""), vector=bool(shape))
        name = self.fresh(base)
        # a decay of 0: -inf, taken as it is; one below 0 (a gate outside its formula's range) counts
        # as 0: a NaN log would reach the earlier tokens of its chunk through the [C, C] products
        self.lines.append(f"{name} = torch.log({g}.clamp(min=0))  # {fmt_shape(shape)}")
        return name


def closed_log(e: Expr) -> Expr | None:
    """``log(e)`` written without a ``log`` of the value where the formula allows (no rounding
    of the decay to 0 or 1 before the log): ``exp(x) -> x``, ``sigmoid(x) -> -softplus(-x)``,
    ``1 - sigmoid(x) -> -softplus(x)``, products, quotients and numeric powers of those term
    by term; None when no part has a closed form."""
    if isinstance(e, Call) and e.fn == "exp":
        return e.args[0]
    if isinstance(e, Call) and e.fn == "sigmoid":
        return Neg(Call("softplus", (Neg(e.args[0]),)))
    if isinstance(e, BinOp) and e.op == "-" and is_num(e.left, 1) and isinstance(e.right, Call) \
            and e.right.fn == "sigmoid":
        return Neg(Call("softplus", e.right.args))
    if isinstance(e, BinOp) and e.op == "^" and is_num(e.right):
        base = closed_log(e.left)
        return BinOp("*", e.right, base) if base is not None else None
    if isinstance(e, BinOp) and e.op in ("*", "/"):
        parts = [closed_log(e.left), closed_log(e.right)]
        if parts == [None, None]:
            return None
        left, right = (p if p is not None else Call("log", (x,)) for p, x in zip(parts, (e.left, e.right)))
        return BinOp("+" if e.op == "*" else "-", left, right)
    return None


def stabilised_read(read: Expr, scaled: set, inv: str) -> Expr:
    """The read of probes ``p = exp(m) p_s`` written in the stabilised outputs ``p_s`` (the names in
    ``scaled``; ``inv`` names ``exp(-m)``): a read homogeneous in the probes, of degree d, is
    ``exp(d m)`` times itself in ``p_s`` with each probe-free term of a sum or a ``max`` / ``min``
    scaled by ``exp(-d m)`` -- xLSTM's ``(q C) / max(|q n|, 1)`` becomes
    ``(q C_s) / max(|q n_s|, exp(-m))``, degree 0: no factor ``exp(m)`` is ever formed.  A read
    that is not homogeneous takes its probes at their true scale ``p_s / exp(-m)``."""
    def power(d):
        return Name(inv) if d == 1 else BinOp("^", Name(inv), Num(d))

    def scaled_by(e: Expr, d) -> Expr:  # e * exp(-d m)
        return e if d == 0 or is_num(e, 0) else power(d) if is_num(e, 1) else BinOp("*", e, power(d))

    def hom(e: Expr):  # (e in the scaled probes, its degree d), or None
        if not any(isinstance(n, Name) and n.id in scaled for n in e.walk()):
            return e, 0
        if isinstance(e, Name):
            return e, 1
        if isinstance(e, Neg) or (isinstance(e, Call) and e.fn == "abs" and len(e.args) == 1):
            x = hom(e.operand if isinstance(e, Neg) else e.args[0])
            return None if x is None else (Neg(x[0]) if isinstance(e, Neg) else Call("abs", (x[0],)), x[1])
        if isinstance(e, BinOp) or (isinstance(e, Call) and e.fn in ("max", "min") and len(e.args) == 2):
            pair = (e.left, e.right) if isinstance(e, BinOp) else e.args
            a, b = hom(pair[0]), hom(pair[1])
            if a is None or b is None:
                return None
            op = e.op if isinstance(e, BinOp) else e.fn
            if op in ("*", "/"):
                return BinOp(op, a[0], b[0]), a[1] + b[1] if op == "*" else a[1] - b[1]
            if op in ("+", "-", "max", "min") and (a[1] == b[1] or 0 in (a[1], b[1])):
                d = max(a[1], b[1], key=abs)
                x, y = scaled_by(a[0], d - a[1]), scaled_by(b[0], d - b[1])
                return (BinOp(op, x, y) if op in ("+", "-") else Call(op, (x, y))), d
        return None

    found = hom(read)
    if found is None:   # at the true scale
        return rewrite(read, lambda n: BinOp("/", n, Name(inv)) if isinstance(n, Name) and n.id in scaled else None)
    e, d = found
    return e if d == 0 else BinOp("/", e, power(d))


def forward_lines(spec, body, plan, emitter, let_forms, *, state_in: dict | None = None,
                  state_out: dict | None = None, out: str = "o", chunk: str = "self.chunk", lets: bool = False,
                  ret: bool = True, taken=(), flip=(), kernel_spec=None) -> list[str]:
    """Lines of the chunked forward over all tokens, the kernel calls written by ``body``;
    the states in ``flip`` (used on their value side) go into the kernels transposed and come
    back in the declared layout; ``kernel_spec``: the spec over their transposes, as the
    analysis wrote it (None: written here)."""
    state_in = {n: state_in[n] if state_in and n in state_in else f'state["{n}"]' for n in spec.state}
    w = ChunkWriter(spec, emitter, taken, let_forms)
    state_out = {n: (state_out or {}).get(n) or w.fresh(f"{n}_new") for n in spec.state}
    if lets and spec.let:
        w.lines.append("# token-local values of all tokens at once")
        for n, e in spec.let.items():
            w.lines.append(f"{n} = {emitter.emit(e)}  # {fmt_shape(emitter.shape(e))}")
    probe_names: dict[str, str] = {}
    probe_shapes: dict[str, tuple] = {}
    kernel_in, kernel_out = _transposed_in(w, spec, flip, state_in, state_out)
    body(w, kernel_spec if kernel_spec is not None else transposed_spec(spec, flip), plan, kernel_in, kernel_out,
         chunk, probe_names, probe_shapes)
    for n in flip:
        w.lines.append(f"{state_out[n]} = {kernel_out[n]}.transpose(-1, -2)  "
                       f"# [B, H, {', '.join(spec.state[n].shape)}]: the declared layout")
    read = rewrite(plan.read, lambda n: Name(probe_names.get(n.id, n.id)) if isinstance(n, Name) else None)
    if w.read_scale is not None:
        read = stabilised_read(read, *w.read_scale)
    read = w.fold(read)
    em = emitter.with_scope(**probe_shapes)
    w.lines.append(f"{out} = {em.emit(read)}  # {fmt_shape(em.shape(read))}")
    if ret:
        w.lines.append(f"return {out}, {{{', '.join(f'{n!r}: {state_out[n]}' for n in spec.state)}}}")
    return w.lines


def _transposed_in(w, spec, flip, state_in: dict, state_out: dict) -> tuple[dict, dict]:
    """The kernels' states: those in ``flip`` transposed (bound to fresh names), the others as they are."""
    kernel_in, kernel_out = dict(state_in), dict(state_out)
    for n in flip:
        rows, cols = spec.state[n].shape
        kernel_in[n], kernel_out[n] = w.fresh(f"{n}_t"), w.fresh(f"{n}_t_new")
        w.lines.append(f"# {n} [{rows}, {cols}] is read and updated on its value side: the kernel runs the "
                       f"same algebra on {n}ᵀ")
        w.lines.append(f"{kernel_in[n]} = {state_in[n]}.transpose(-1, -2)  # [B, H, {cols}, {rows}]")
    return kernel_in, kernel_out


def with_documents(line, docs: str):
    """A body line, a kernel call taking the packed documents ``docs`` (every kernel call does)."""
    return line.with_keywords(documents=Code(docs)) if isinstance(line, KernelCall) else line


def emit_forward(ctx, L, body, kernel) -> None:
    """``_forward_chunk``: the lets, then the family's ``body``; the module carries ``kernel``."""
    sv = ctx.views + ctx.gates
    docs = fresh("documents", set(ctx.spec_names))
    L(f"def _forward_chunk(self, {', '.join(sv + ['state'])}, {docs}=None):")
    with L.indent():
        L('"""' + f"The exact {ctx.default} chunked form over chunks of self.chunk tokens (`{docs}`: packed")
        L("documents, B = 1, state [N, H, ...]: each starts a chunk of the one kernel call)." + '"""')
        em = ctx.emitter()
        ctx.lets(L, em, "B, T, H")
        flip = ctx.decision.transposed if BY_NAME[ctx.default].sided else ()
        for line in forward_lines(ctx.spec, body, ctx.plans[ctx.default], em, ctx.decision.let_forms, lets=False,
                                  taken=tuple(sorted(ctx.spec_names)) + (docs,), flip=flip,
                                  kernel_spec=ctx.decision.transposed_spec if flip else None):
            L.block(with_documents(line, docs))
    L()
    ctx.need_kernel(kernel)
    ctx.need(_Documents)
    ctx.need(_DocumentChunks)
