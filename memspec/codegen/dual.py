"""Code generation for the dual form of the mini-batch schedule (see :mod:`memspec.schedule.dual`).

Writes two methods of the Memory class, in place of the materialising
``_token_grads`` / ``_chunk_step`` pair:

* ``_chunk_loss(taps..., states..., inputs...)``: the inner loss of every token of a
  chunk at once, at the chunk-start state, with each linear layer's output shifted by
  a zero *tap*; it returns the loss summed over tokens and the layers' inputs.  One
  ``torch.func.grad`` with respect to the taps gives every token's ``delta`` (gradient
  with respect to the layer output): the gradient of ``x @ W`` is ``x^T delta``.
* ``_chunk_step(starts..., states..., views..., gates...)`` (the same signature as the
  materialising one, so ``_forward_minibatch`` is shared): the recurrences of the update
  program are solved symbolically, each state after token i written as
  ``S_i = sum_R a[S, R]_i R_0 + sum_g sum_j M[S, g]_{i, j} grad_g_j`` with vectors ``a``
  ``[B, H, C]`` and lower-triangular matrices ``M`` ``[B, H, C, C]`` (products of decay
  matrices built by ``_decay_matrix``); the read then evaluates every linear layer as
  ``sum_R a_i (x_i @ R_0) + ((x x_g^T) * M) @ delta_g`` and the chunk's final state is
  row C of the same sums.

Layout: the spec's expressions are emitted in the usual ``[B, C, H, ...]`` prefix
layout; the [C, C] algebra runs head-major, ``[B, H, C, ...]``.  The algebra itself (the
recurrences over a chunk, the read, the state after the chunk) is :mod:`.dualchunk`, on the
term objects of :mod:`.dualterms`.
"""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Expr, Name, map_children, substitute
from ..lang.names import fresh
from ..schedule.dual import BLOCK
from .dualchunk import ChunkAlgebra, DualRead
from .dualterms import Ref
from .exprs import P_ATOM, ExprEmitter
from .prestep import expr_reads, split_pre
from .program import shadow_plan
from .text import Lines, shape_text, tuple_text


class DualWriter:
    """Emits ``_chunk_loss`` and ``_chunk_step`` for a :class:`memspec.schedule.dual.DualForm`."""

    def __init__(self, writer, form):
        self.w = writer
        self.form = form
        self.free: set = set()   # chunk-step locals with no batch axis (params, C, [C, C] constants)
        self.spec = writer.spec
        self.model = self.spec.model

    # ------------------------------------------------------------ lowering
    def _lower(self, L, em, e: Expr, scope: dict, taken: set, on_site, xbase: str = "x",
               layout: str = "B, H, C") -> Expr:
        """``e`` with the model applications inlined and every linear site replaced by a
        local that ``on_site(kind, state, x_name, a_expr)`` binds (it emits the lines)."""
        model, sites = self.model, self.form.sites

        def bind(x: Expr, base: str, comment: str) -> Name:
            if isinstance(x, Name):
                return x
            name = fresh(base, taken)
            shape = self.w.env.infer(x, scope=scope)
            sub = em.with_scope(**scope)
            L(f"{name} = {sub.emit(x)}", shape_text(layout, shape) + f": {comment}",
              targets=(name,), reads=expr_reads(sub, x))
            scope[name] = tuple(shape)
            return Name(name)

        def lower(n: Expr) -> Expr:
            if isinstance(n, Call) and n.fn == model.name:
                arg = bind(lower(n.args[0]), model.arg, f"the argument of {model.name}")
                return lower(substitute(model.body, {model.arg: arg}))
            if isinstance(n, BinOp) and n.op == "@" and isinstance(n.right, Name) \
                    and sites.get(n.right.id) == "matmul":
                x = bind(lower(n.left), f"{xbase}_{n.right.id}", f"the input of the layer @ {n.right.id}")
                return Name(on_site("matmul", n.right.id, x, None))
            if isinstance(n, BinOp) and n.op == "+":
                for side, other in ((n.right, n.left), (n.left, n.right)):
                    if isinstance(side, Name) and sites.get(side.id) == "bias":
                        return Name(on_site("bias", side.id, None, lower(other)))
            return map_children(n, lower)

        return lower(e)

    def _site_shape(self, s: str) -> tuple:
        return (self.spec.state[s].shape[-1],)

    # ------------------------------------------------------------ the tapped loss (no closed form)
    def loss_method(self, L):
        w, spec, form = self.w, self.spec, self.form
        taken = set(w.spec_names)
        taps = {s: fresh(f"z_{s}", taken) for s in form.sites}
        states = list(form.sites)
        inputs = w.loss_inputs()
        self.loss_inputs = inputs
        self.taps = taps
        L(f"def _chunk_loss(self, {', '.join(list(taps.values()) + states + inputs)}):")
        with L.indent():
            L('"""' + "The inner loss of all C tokens of a chunk at once (head-major), at the chunk-start state "
              + ", ".join(f"{s} [B, H, {', '.join(spec.state[s].shape)}]" for s in states) + ",")
            L("with each linear layer's output shifted by a tap " + ", ".join(
                f"{taps[s]} [B, H, C, {self._site_shape(s)[0]}]" for s in states) + " (zeros): the")
            L("gradient with respect to a tap is every token's gradient with respect to that layer's output.")
            L("Returns (the loss summed over tokens, batch and heads, the inputs of the layers " +
              ", ".join(f"@ {s}" for s in states if form.sites[s] == "matmul") + ").")
            L('"""')
            names = params_head_major(w, L, used_names(spec, spec.loss))
            em = w.emitter(names=names)
            scope: dict = {}
            xs: dict = {}

            def on_site(kind, s, x, a):
                y = fresh(f"y_{s}", taken)
                shape = self._site_shape(s)
                if kind == "matmul":
                    xs[s] = x.id
                    L(f"{y} = {x.id} @ {s} + {taps[s]}", shape_text("B, H, C", shape) + f": the layer @ {s}")
                else:
                    code = em.with_scope(**scope)._emit(a)
                    L(f"{y} = {code.text} + {s}.unsqueeze(-2) + {taps[s]}", shape_text("B, H, C", shape) + f": + {s}")
                scope[y] = shape
                return y

            e = self._lower(L, em, spec.loss, scope, taken, on_site, xbase="xk", layout="B, H, C")
            self.x_names = xs
            code = em.with_scope(**scope)._emit(e)
            aux = [xs[s] for s in states if s in xs and xs[s] not in inputs]
            L(f"return {code.at(P_ATOM)}.sum(), {tuple_text(aux)}")
        L()

    # ------------------------------------------------------------ the chunk's gradients
    def closed_grads(self, L, em, starts, taken) -> tuple[dict, dict]:
        """Every token's deltas at the chunk-start state from the plan's closed-form gradient
        program, head-major; returns (state -> layer input, state -> delta)."""
        cg = self.form.grad
        taken |= {st.name for st in cg.forward + cg.backward}
        names = dict(em.names)
        names.update({s: starts.get(s, s) for s in self.spec.state})
        scope: dict = {}
        L("# every token's gradient at the chunk-start state, in closed form (memspec.schedule.backprop)")
        for st in cg.forward + cg.backward:
            if st.kind in ("layer", "back"):
                x = names.get(st.value.id, st.value.id)
                S = names[st.state]
                text = f"{x} @ {S}" if st.kind == "layer" else f"{x} @ {S}.transpose(-2, -1)"
                what = f"the layer @ {st.state}" if st.kind == "layer" else f"the loss's gradient w.r.t. {st.like}"
                reads = {x, S}
            else:
                sub = ExprEmitter(self.spec, names=names, like=em.like, attr=self.w.attr,
                                  helpers=self.w.helpers, scope=scope)
                reads = expr_reads(sub, st.value)
                if st.kind == "bias":
                    text = f"{sub._emit(st.value).text} + {names[st.state]}.unsqueeze(-2)"
                    what = f"+ {st.state}"
                    reads.add(names[st.state])
                else:
                    code = sub._emit(st.value)
                    text = code.text if code.rank == len(st.shape) else \
                        f"{sub._lift(code, len(st.shape))}.expand_as({st.like})"
                    what = f"the loss's gradient w.r.t. {st.like}" if st.like else ""
                    if code.rank != len(st.shape):
                        reads.add(st.like)
            L(f"{st.name} = {text}", shape_text("B, H, C", st.shape) + (f": {what}" if what else ""),
              targets=(st.name,), reads=reads)
            scope[st.name] = st.shape
        xk = {site.state: site.input for site in cg.sites if site.input}
        dd = {site.state: site.delta for site in cg.sites}
        return xk, dd

    def tapped_grads(self, L, starts, taken, first) -> tuple[dict, dict]:
        """Every token's deltas by one torch.func.grad of ``_chunk_loss`` (no closed form)."""
        w, spec = self.w, self.spec
        states = list(self.form.sites)
        dz = {s: fresh(f"delta_{s}", taken) for s in states}
        xnames = {s: fresh(self.x_names[s], taken) for s in states
                  if s in self.x_names and self.x_names[s] not in self.loss_inputs}
        zeros = [f"{first}.new_zeros({first}.shape[:3] + ({w.dim_sizes([spec.state[s].shape[-1]])},))"
                 for s in states]
        argnums = tuple(range(len(states)))
        an = f"({argnums[0]},)" if len(argnums) == 1 else repr(argnums)
        lhs_d = ", ".join(dz[s] for s in states) + ("," if len(states) == 1 else "")
        lhs_x = ", ".join(xnames.values()) + ("," if len(xnames) == 1 else "")
        lhs = f"({lhs_d}), ({lhs_x})" if xnames else f"({lhs_d}), _"
        args = zeros + [starts.get(s, s) for s in states] + self.loss_inputs
        L(f"{lhs} = torch.func.grad(self._chunk_loss, argnums={an}, has_aux=True)(\n    {', '.join(args)})",
          "each token's gradient w.r.t. each layer's output, and the layers' inputs",
          targets=[*dz.values(), *(xnames.values() or ["_"])], reads=[first, *args[len(states):]])
        xk = {s: xnames.get(s, self.x_names[s]) for s in states if s in self.x_names}
        return xk, dz

    # ------------------------------------------------------------ the chunk step
    def chunk_step(self, L):
        """``_chunk_step``: the deltas, the recurrences solved over the chunk, the read in dual
        form and the state after the chunk; then its state-independent part split off
        (``self.pre``: :func:`memspec.codegen.prestep.split_pre`)."""
        w, spec, form = self.w, self.spec, self.form
        taken = set(w.spec_names) | set(getattr(self, "taps", {}).values())
        starts = {s: fresh(f"{s}_start", taken) for s in shadow_plan(w)[1]}
        inputs = chunk_inputs(w)
        first = inputs[0]   # a [B, H, C, ...] input: the batch, chunk length, dtype and device
        header = "    " * L.level + f"def _chunk_step(self, {', '.join(list(starts.values()) + w.states + inputs)}):"
        doc = Lines(level=L.level + 1)
        self.step_docstring(doc, starts, inputs)
        body = Lines(record=True, level=L.level + 1)   # each statement with what it binds and reads
        names = params_head_major(w, body, direct_names(spec))
        self.free |= set(names.values())
        em = w.emitter(names=names, like=first)
        if form.grad is not None:
            xk, dd = self.closed_grads(body, em, starts, taken)
        else:
            xk, dd = self.tapped_grads(body, starts, taken, first)
        if form.rows:   # a decay per channel: the chunk in blocks, the state carried between them
            self.blocked(body, names, taken, inputs, xk, dd)
        else:
            alg = ChunkAlgebra(self, body, em, taken, first, inputs)
            alg.solve()
            read = DualRead(alg, xk, dd)
            read.emit(self._lower, spec, list(form.sites))
            finals = read.finals()
            body(f"return o, {tuple_text(finals)}", reads=("o", *finals), returns=True)
        self.pre = split_pre(w, self.free, L, header, doc.lines, body, list(starts.values()) + w.states, inputs)

    def blocked(self, L, names: dict, taken: set, inputs: list, xk: dict, dd: dict) -> None:
        """The chunk in blocks of ``BLOCK`` tokens (one block when the chunk is not a multiple of it):
        every per-token value folded ``[B, H * nb, block, ...]``, the chunk algebra solved within each
        block from the block's start states, which the loop of :meth:`.dualchunk.DualRead.block_passing`
        carries from block to block; the read folded back ``[B, H, C, ...]``."""
        w, spec, first = self.w, self.spec, inputs[0]
        blk = fresh("block", taken)
        self.free.add(blk)
        L(f"{blk} = {BLOCK} if {first}.shape[2] % {BLOCK} == 0 else {first}.shape[2]",
          f"tokens per block (the decays of {', '.join(self.form.rows)} are per channel)", targets=(blk,),
          reads=(first,))
        folded = {}
        for x in list(inputs) + [v for v in list(xk.values()) + list(dd.values()) if v not in inputs]:
            if x in folded:
                continue
            folded[x] = fresh(f"{x}_blocks", taken)
            L(f"{folded[x]} = {x}.reshape({x}.shape[0], -1, {blk}, *{x}.shape[3:])",
              f"[B, H * nb, block, ...]: {x} in blocks", targets=(folded[x],), reads=(x, blk))
        fin = [folded[x] for x in inputs]
        em = w.emitter(names={**names, **{x: folded[x] for x in inputs}}, like=fin[0])
        alg = ChunkAlgebra(self, L, em, taken, fin[0], fin)
        alg.solve()
        read = DualRead(alg, {g: folded[x] for g, x in xk.items()}, {g: folded[x] for g, x in dd.items()})
        finals = read.block_passing(Ref(f"{first}.shape[1]", reads=frozenset({first})))
        ob = fresh("o_blocks", taken)
        read.emit(self._lower, spec, list(self.form.sites), out=ob)
        L(f"o = {ob}.reshape({first}.shape[:3] + {ob}.shape[3:])", shape_text("B, H, C", w.read_shape())
          + ": the blocks unfolded", targets=("o",), reads=(ob, first))
        L(f"return o, {tuple_text(finals)}", reads=("o", *finals), returns=True)

    def step_docstring(self, L, starts: dict, inputs: list) -> None:
        w = self.w
        L('"""' + "One mini-batch chunk of C tokens in the dual form, head-major: " + ", ".join(
            shape_text("B, H, C", w.shape(Name(x))) .replace("[", f"{x} [", 1) for x in inputs) + ";")
        if starts:
            L(", ".join(starts.values()) + ": the chunk-start state the gradients are taken at;")
        L(", ".join(w.states) + ": the state before the chunk's first token [B, H, ...].")
        L("Each state after token i is a combination of the states before the chunk and the")
        L("tokens' gradients (outer products x_j^T delta_j): no per-token state is formed.")
        if self.form.rows:
            L(f"The decays of {', '.join(self.form.rows)} are per channel: the chunk runs in blocks of {BLOCK}")
            L("tokens, folded [B, H * nb, block, ...] (in the blocks' shape comments H is H * nb and C")
            L("the block); each block from the states at its start, carried from block to block.")
        L("Returns (o " + shape_text("B, H, C", w.read_shape()) + ", the state after the chunk).")
        L('"""')

def params_head_major(ctx, L, used) -> dict:
    """Bind each per-head param ``[H, *shape]`` the code uses as a local ``[H, 1, *shape]``
    (it then broadcasts against head-major ``[B, H, C, *shape]``); returns the emitter names."""
    names = {}
    for p, prm in ctx.spec.params.items():
        if p in used:
            r = len(prm.shape)
            L(f"{p} = self.{ctx.attr.get(p, p)}.unsqueeze({-r - 1})",
              f"[H, 1{''.join(', ' + str(d) for d in prm.shape)}]: per head, head-major", targets=(p,), reads=())
            names[p] = p
    return names


def used_names(spec, *exprs, follow_lets=True) -> set:
    """The names the expressions read (through the model's body, and the lets' values)."""
    seen, todo = set(), list(exprs)
    while todo:
        e = todo.pop()
        for n in e.walk():
            if isinstance(n, Name) and n.id not in seen:
                seen.add(n.id)
                if follow_lets and n.id in spec.let:
                    todo.append(spec.let[n.id])
            if isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
                todo.append(spec.model.body)
    return seen


def direct_names(spec) -> set:
    """The names the chunk step's own expressions read (the loss, the read, the update), lets not followed."""
    return used_names(spec, spec.loss, spec.read, *[st.value for st in spec.update], follow_lets=False)


def chunk_inputs(ctx) -> list:
    """The chunk step's per-token inputs: the views and gates it reads itself, then the lets
    (computed once over the whole sequence by :func:`sequence_inputs`)."""
    used = direct_names(ctx.spec)
    return [x for x in ctx.views + ctx.gates if x in used] + [n for n in ctx.let_order() if n in used]


def sequence_inputs(ctx, L) -> list:
    """Emit the lets over the whole head-major sequence (token-local: the same numbers as per
    chunk, once); returns the chunk step's inputs (:func:`chunk_inputs`)."""
    spec = ctx.spec
    if ctx.let_order():
        names = params_head_major(ctx, L, used_names(spec, *[spec.let[n] for n in spec.let]))
        ctx.lets(L, ctx.emitter(names=names), "B, H, T")
    return chunk_inputs(ctx)


def emit(ctx, form, L) -> DualWriter:
    """Emit the dual-form ``_chunk_step`` (and ``_chunk_pre``, its state-independent part,
    when it has one; ``_chunk_loss`` when the plan has no closed-form gradient) of the Memory
    class; returns the writer (its ``pre``: see :meth:`DualWriter.chunk_step`)."""
    d = DualWriter(ctx, form)
    if form.grad is None:
        d.loss_method(L)
    d.chunk_step(L)
    return d
