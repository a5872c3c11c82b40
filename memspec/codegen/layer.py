"""The generated ``<Name>Layer``: projections of ``x [B, T, d_model]`` into the views (and the
gates through their formulas), the Memory, the output projection; for a wired spec, the
bare layer is ``<Name>MemoryLayer`` and ``<Name>Layer`` is the wiring class
(:mod:`memspec.runtime.wiring`) around it."""
from __future__ import annotations

from ..lang.expr import unparse
from ..lang.names import fresh
from .exprs import ExprEmitter
from .text import inert, shape_text

def wiring_text(w) -> str:
    """What the spec's wiring computes, in words (lines for the generated docstrings)."""
    att = ("attention on l2-normalised queries and keys with a learned temperature" if w.qk_norm
           else "plain scaled dot-product attention")
    if w.kind == "mac":
        wrote = "the attention output y" if w.write == "attention" else "the segment input x"
        read = "memory(y)" if w.write == "attention" else "memory(x)"
        out = f"y * sigmoid({read})" if w.output == "gated" else f"y + {read}"
        return ("MAC, memory as context: per segment, retrieve, attend over [persistent | retrieved | segment],\n"
                f"write {wrote} into the memory, output {out};\n{att}")
    if w.kind == "mag":
        mix = ("RMSNorm(attention) * sigmoid(RMSNorm(memory))" if w.gate == "normalized"
               else "g * attention + (1 - g) * memory with a learned gate g")
        return f"MAG, memory as gate: sliding-window attention and the memory on the same input,\nmixed as {mix};\n{att}"
    form = "memory(x) + attention(memory(x))" if w.residual else "attention(memory(x))"
    return f"MAL, memory as layer: the memory layer, then sliding-window attention,\n{form};\n{att}"


def layer_class(ctx, L):
    spec = ctx.spec
    n = ctx.name
    rshape = ctx.read_shape()
    wired = spec.wiring.kind != "none"
    L(f"class {n}{'MemoryLayer' if wired else 'Layer'}(nn.Module):")
    with L.indent():
        L('"""' + f"x [B, T, d_model] -> projections into views (and gates) -> {n}Memory -> output projection.")
        L()
        for v in ctx.views:
            L(f"{v} = {v}_proj(x) viewed [B, T, H, {spec.views[v].dim}]")
        for g, gate in spec.gates.items():
            L(f"{g} = {inert(unparse(gate.formula), 'doc')} with logit = {g}_proj(x) "
              f"{ctx.gate_text(g, 'B, T, H')} (bias init {inert(float(gate.bias), 'doc')})")
        if wired:
            L(f"(The bare memory layer: {n}Layer wraps it in the spec's wiring, {spec.wiring.kind}.)")
        L('"""')
        L()
        sig = ctx.dims_signature()
        if "d_model" not in spec.dims:
            sig.insert(0, "d_model=64")
        L(f"def __init__(self, *, {', '.join(sig)}, chunk={ctx.default_chunk}, compile=False):")
        with L.indent():
            L("super().__init__()")
            L("self.d_model = d_model")
            L("self.heads = heads")
            for v in ctx.views:
                L(f"self.{v}_proj = nn.Linear(d_model, heads * {spec.views[v].dim}, bias=False)")
            for g, gate in spec.gates.items():
                width = " * ".join(["heads", *ctx.gate_shapes[g]])   # per head (and channel)
                L(f"self.{g}_proj = nn.Linear(d_model, {width})")
                L(f"nn.init.constant_(self.{g}_proj.bias, {inert(float(gate.bias))})")
            dims = [d for d in spec.dims]
            kw = ", ".join(([] if "heads" in spec.dims else ["heads=heads"]) + [f"{d}={d}" for d in dims])
            L(f"self.memory = {n}Memory({kw}, chunk=chunk, compile=compile)")
            out = " * ".join(["heads", *rshape]) if rshape else "heads"
            L(f"self.o_proj = nn.Linear({out}, d_model, bias=False)")
        L()
        L("def forward(self, x, state=None, return_state=False, cu_seqlens=None):")
        with L.indent():
            L('"""' + "x [B, T, d_model] -> y [B, T, d_model] (and the memory's final state if return_state).")
            L("`cu_seqlens`: packed documents (B = 1, int offsets [N + 1]; state [N, H, ...]), each alone.")
            L('"""')
            taken = set(ctx.spec_names)
            B, T = fresh("B", taken), fresh("T", taken)
            mem = "self.memory"
            layer_views(ctx, L, ctx.views, B, T)
            for g, gate in spec.gates.items():
                gshape = ctx.gate_shapes[g]
                em = ExprEmitter(spec, names={"logit": "logit"}, like=ctx.first, attr=ctx.attr,
                                 helpers=ctx.helpers, self_name=mem, scope={"logit": gshape})
                view = f".view({B}, {T}, self.heads, {ctx.dim_sizes(gshape, mem)})" if gshape else ""
                L(f"logit = self.{g}_proj(x){view}", ctx.gate_text(g, "B, T, H"))
                L(f"{g} = {em.emit(gate.formula)}", ctx.gate_text(g, "B, T, H"))
            kw = "".join(f"{g}={g}, " for g in ctx.gates)
            L(f"o, state = self.memory({', '.join(ctx.views)}, {kw}state=state, cu_seqlens=cu_seqlens)",
              shape_text("B, T, H", rshape))
            L("y = self.o_proj(o.flatten(2))", "[B, T, d_model]")
            L("return (y, state) if return_state else y")
        rviews = ctx.read_views()
        if rviews is not None:
            L()
            L("def read(self, x, state=None):")
            with L.indent():
                L('"""' + "x [B, T, d_model] -> y [B, T, d_model]: the memory read at a fixed state "
                  "(default: the initial one), with no write." + '"""')
                layer_views(ctx, L, rviews, B, T)
                L(f"o = self.memory.read({', '.join(rviews)}, state=state)", shape_text("B, T, H", rshape))
                L("return self.o_proj(o.flatten(2))", "[B, T, d_model]")
    if wired:
        L()
        L()
        wired_layer_class(ctx, L)


def layer_views(ctx, L, views, B, T):
    """The Layer's check of x [B, T, d_model] and its projections into ``views``."""
    spec = ctx.spec
    L("if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:")
    L("    got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__")
    L("    raise ValueError(f\"x: expected [B, T, d_model] = [B, T, {self.d_model}], got {got}\")")
    L(f"{B}, {T}, _ = x.shape")
    for v in views:
        dim = spec.views[v].dim
        L(f"{v} = self.{v}_proj(x).view({B}, {T}, self.heads, self.memory.{ctx.attr.get(dim, dim)})",
          f"[B, T, H, {dim}]")


def wired_layer_class(ctx, L):
    """``<Name>Layer``: the wiring class of the spec around ``<Name>MemoryLayer``."""
    spec, n, w = ctx.spec, ctx.name, ctx.spec.wiring
    base = w.kind.upper()
    sig = ctx.dims_signature()
    if "d_model" not in spec.dims:
        sig.insert(0, "d_model=64")
    inner = ", ".join(p.split("=")[0] + "=" + p.split("=")[0] for p in sig)
    extent = f"segment={w.segment}" if w.kind == "mac" else f"window={w.window}"
    L(f"class {n}Layer({base}):")
    with L.indent():
        L('"""' + f"x [B, T, d_model] -> y [B, T, d_model]: {base} around {n}MemoryLayer.")
        L()
        for line in f"{wiring_text(w)}.".split("\n"):
            L(line)
        L()
        L(f"{n}MemoryLayer (projections, {n}Memory, output projection) is ``self.layer``;")
        L(f"``self.memory`` is its {n}Memory.  Attention: ``attn_heads`` heads (default: ``heads``")
        L(f"when it divides d_model, else 1) and {w.persistent} persistent tokens.")
        L("forward(x, state=None, return_state=False); the state carries the memory's state and")
        L("the attention's keys/values (see the wiring class above).")
        L('"""')
        L()
        opts = w.options()
        L(f"def __init__(self, *, {', '.join(sig)}, chunk={ctx.default_chunk}, compile=False,")
        L(f"             {extent}, persistent={w.persistent}, attn_heads=None,")
        L(f"             {', '.join(f'{k}={inert(v)}' for k, v in opts.items())}):")
        with L.indent():
            L(f"layer = {n}MemoryLayer({inner}, chunk=chunk, compile=compile)")
            L("if attn_heads is None:")
            L("    attn_heads = heads if d_model % heads == 0 else 1")
            L(f"super().__init__(layer, d_model, {extent.split('=')[0]}={extent.split('=')[0]}, "
              "persistent=persistent, heads=attn_heads,")
            L(f"                 {', '.join(f'{k}={k}' for k in opts)})")
            L("self.d_model = d_model")
            L("self.heads = heads")
        L()
        L("@property")
        L("def memory(self):")
        with L.indent():
            L('"""' + f"The {n}Memory module (inside the memory layer)." + '"""')
            L("return self.layer.memory")
