"""The generated module: header, imports, the runtime pieces its code calls, the
``<Name>Memory`` class (constructor, state, input checks, forward dispatch, decoding step,
model, inner loss, read-only call) with one method group per schedule it carries, written
by that family's emitter, and the ``<Name>Layer`` (:mod:`.layer`).

``<Name>Memory.forward(*views, **gates, state=None, schedule="auto")`` validates its
inputs and dispatches to the schedule's ``_forward_<family>`` method; the schedules are the
decision's (:attr:`~memspec.schedule.ScheduleDecision.schedules`).
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable

from ..lang.expr import Name, unparse
from ..lang.fmt import to_yaml
from ..lang.spec import parse_init
from ..lang.names import fresh
from ..runtime.helpers import _check, _Compiled, _in_slices
from ..runtime.varlen import _by_document, _by_length, _document_bounds, _shrinking, _stack_finals
from ..runtime.wiring import source as wiring_source
from ..schedule import decide
from ..schedule.decide import ScheduleDecision
from . import additive, apply_update, cache, chained, delta, dplr, layer, minibatch, momentum, oja, online, scan, \
    solve
from .context import Context, Emitter, kernel_functions, phase_sources, runtime_source
from .exprs import P_ATOM, CodegenError, ExprEmitter
from .layout import layout
from .calls import Placed, bound_constants
from .specialise import specialise_calls
from .text import Lines, dims_text, inert, shape_text, string_pieces

SLICE_CHUNKS = 8   # compile=True: chunks per compiled call of an exact chunked forward

# one emitter per schedule family (the rows of memspec.schedule.decide.FAMILIES), in the order the
# families' methods appear in the generated class; every other table of the frame is derived from it
EMITTERS: dict[str, Emitter] = {}
CHUNKED: set = set()   # the families with one exact chunked kernel call


def check_families() -> None:
    """Every row of :data:`memspec.schedule.decide.FAMILIES` has an emitter and every emitter a row,
    with one token-by-token family; a kernel family's row is exact and chunked."""
    rows = decide.BY_NAME   # (kept with FAMILIES by memspec.schedule.decide.register)
    missing = [n for n in rows if n not in EMITTERS]
    unknown = [n for n in EMITTERS if n not in rows]
    if missing or unknown:
        why = ([f"no emitter for {', '.join(missing)}"] if missing else []) \
            + ([f"no row in FAMILIES for {', '.join(unknown)}"] if unknown else [])
        raise CodegenError(f"the schedule families and their emitters differ: {'; '.join(why)} "
                           f"(memspec.codegen.register adds an emitter)")
    if sum(f.token for f in rows.values()) != 1:
        raise CodegenError("FAMILIES needs exactly one token-by-token family (token=True)")
    wrong = [n for n, e in EMITTERS.items() if e.kernel and not (rows[n].exact and rows[n].chunked)]
    if wrong:
        raise CodegenError(f"kernel emitters of families that are not exact and chunked: {', '.join(wrong)}")


def register(emitter: Emitter) -> Callable[[], None]:
    """Add ``emitter`` (its family's methods last in the class) for a row already in
    :data:`memspec.schedule.decide.FAMILIES` (:func:`memspec.schedule.decide.register`);
    returns the function that takes it out again."""
    if emitter.family not in decide.BY_NAME:
        raise CodegenError(f"an emitter for {emitter.family!r}, which is not a row of FAMILIES "
                           f"(memspec.schedule.decide.register adds one)")
    if emitter.family in EMITTERS:
        raise CodegenError(f"schedule family {emitter.family!r} already has an emitter")
    EMITTERS[emitter.family] = emitter
    CHUNKED.update([emitter.family] if emitter.kernel else [])

    def unregister() -> None:
        if EMITTERS.get(emitter.family) is emitter:
            del EMITTERS[emitter.family]
            CHUNKED.discard(emitter.family)

    return unregister


for _module in (online, minibatch, apply_update, cache, additive, delta, dplr, momentum, scan, chained, oja, solve):
    register(_module.EMITTER)
check_families()


def token_family() -> Emitter:   # the token-by-token family's emitter: forward's fallback
    return next(e for n, e in EMITTERS.items() if decide.BY_NAME[n].token)


def carried(ctx) -> list:   # the emitters of the schedules this module carries, in the class's order
    return [e for n, e in EMITTERS.items() if n in ctx.schedules]


def recomputes(ctx) -> bool:
    """Does the module take the `checkpoint` option (a carried family's chunk step materialises
    per-token states and can run under ``torch.utils.checkpoint``)?"""
    return any(e.recomputes is not None and e.recomputes(ctx, ctx.plans.get(e.family)) for e in carried(ctx))


def compiles_chunked(ctx) -> bool:
    """Does ``compile=True`` compile this module's exact chunked forward (slice by slice)?  Yes for
    every kernel family but one whose emitter says its kernel stays eager for this plan (e.g. a decay
    per key channel: :data:`memspec.codegen.additive.EMITTER`)."""
    eager = [e for n, e in EMITTERS.items() if e.stays_eager is not None and n in ctx.plans]
    return bool(set(ctx.schedules) & CHUNKED) and not any(e.stays_eager(ctx, ctx.plans[e.family]) for e in eager)


def generate(spec, decision: ScheduleDecision, *, source_path=None, source_text=None) -> str:
    """The full text of ``compiled/<spec.name>.py`` (deterministic) for ``decision``
    (from :func:`memspec.schedule.analyse`); ``source_path`` (as written in the header) and
    ``source_text`` (hashed into the header) describe the spec file."""
    check_families()
    ctx = Context(spec, decision, source_path=source_path, source_text=source_text)
    L = Lines()
    header(ctx, L)
    body = Lines()
    memory_class(ctx, body)
    while body.lines and body.lines[-1] == "":
        body.lines.pop()
    body()
    body()
    layer.layer_class(ctx, body)
    # the runtime pieces the code calls (only those), then the imports they and the code use
    wiring = []
    if ctx.spec.wiring.kind != "none":
        wiring = ["# ---- wiring (memspec.wiring, Titans §4): attention around the memory layer ----\n"
                  + wiring_source(ctx.spec.wiring.kind)]
    placed = [x for x in body.lines if isinstance(x, Placed)]
    runtime = []
    for part in ctx.parts:
        if callable(part):   # a kernel: specialised to the constant arguments of its calls, written without them
            calls = [p for p in placed if p.call.fn is part]
            consts = bound_constants(part, [p.call for p in calls])
            for p in calls:
                p.bound = frozenset(consts)
            # and the functions of its module it calls (unless the emitter asked for them itself),
            # specialised to the constant arguments they are passed
            src, *own = specialise_calls(part, consts, lambda text, part=part: [
                fn for fn in kernel_functions(part, text) if runtime_source(fn) not in ctx.parts])
            runtime += [src] + [f for f in own if f not in runtime]
        else:
            runtime.append(part)
    code = "\n".join(x.text() if isinstance(x, Placed) else x for x in body.lines)
    runtime = phase_sources(runtime) + runtime   # the shared kernel phases they call
    parts = Lines()
    sliced = [runtime_source(_in_slices)] if compiles_chunked(ctx) else []
    packed = [runtime_source(f) for f in (_document_bounds, _by_document, _by_length, _shrinking, _stack_finals)]
    for part in ctx.helper_sources() + [runtime_source(_check), runtime_source(_Compiled)] + sliced + packed \
            + runtime + wiring:
        parts.block(part)
        parts()
        parts()
    code = "\n".join(parts.lines) + "\n" + code
    for module in ("math", "time", "warnings"):
        if re.search(rf"\b{module}\.", code):
            L(f"import {module}")
    L()
    L("import torch")
    if re.search(r"\bF\.", code):
        L("import torch.nn.functional as F")
    L("from torch import nn")
    L()
    L()
    return layout("\n".join(L.lines).rstrip("\n") + "\n\n\n" + code.rstrip("\n") + "\n")


def header(ctx, L):
    from .. import __version__

    spec, d = ctx.spec, ctx.decision
    src = inert(ctx.source_path or spec.path or "<memory>", "comment")
    L(f"# Generated by memspec {__version__} from {src} -- do not edit.")
    L(f"# Regenerate with: memspec compile {src}")
    canonical = to_yaml(spec)
    L("# hashes: the spec's canonical resolved form (`memspec fmt --to yaml`), and the file")
    L(f"# spec sha256: {hashlib.sha256(canonical.encode('utf-8')).hexdigest()}")
    if ctx.source_text is not None:
        L(f"# file sha256: {hashlib.sha256(ctx.source_text.encode('utf-8')).hexdigest()}")
    text = EMITTERS[ctx.default].schedule_text.format(chunk=ctx.default_chunk, window=window_text(ctx))
    L(f"# schedule: {text}")
    for e in carried(ctx):
        note = e.header(ctx, ctx.plans[e.family]) if e.header is not None else None
        if note:
            L(f"# {note}")
    exact = "exact" if d.exact else f"approximate ({EMITTERS[d.family].approximation})"
    L(f"# derived by memspec.schedule.analyse: {d.family}, {exact}; admits {', '.join(d.admits)}")
    L(f"# schedules of this module: {', '.join(ctx.schedules)}")
    if spec.wiring.kind != "none":
        w = spec.wiring
        L(f"# wiring: {w.kind}(segment={w.segment}, persistent={w.persistent}, window={w.window}); options: "
          + ", ".join(f"{k}={inert(v)}" for k, v in w.options().items()))
        L(f"# built here: {ctx.name}Layer is {w.kind.upper()} around {ctx.name}MemoryLayer")
    summary = spec.description.split(". ")[0].strip().rstrip(".") + "." if spec.description else "a memspec memory."
    L('"""' + inert(f"{spec.name}: {summary}", "doc"))
    L()
    if spec.cite:
        L(inert(f"Cite: {spec.cite}", "doc"))
        L()
    gates = "gates [B, T, H] or [B, T, H, d]" if ctx.vector_gates else "gates [B, T, H]"
    L(f"{ctx.name}Memory: the memory (views [B, T, H, D], {gates}, state {{name: [B, H, ...]}}).")
    if spec.wiring.kind == "none":
        L(f"{ctx.name}Layer: projections of x [B, T, d_model] into views and gates, the memory, the output projection.")
    else:
        L(f"{ctx.name}MemoryLayer: projections of x [B, T, d_model] into views and gates, the memory, "
          "the output projection.")
        for i, line in enumerate(f"{layer.wiring_text(spec.wiring)}.".split("\n")):
            L(f"{ctx.name}Layer: the spec's wiring, {line}" if i == 0 else f"    {line}")
    L('"""')


def window_text(ctx) -> str:
    ws = {st.window for st in ctx.spec.state.values() if st.cache}
    w = next(iter(ws), None) if ws else None
    return f" (window {w})" if w else ""


def memory_class(ctx, L):
    spec = ctx.spec
    n = ctx.name
    L(f"class {n}Memory(nn.Module):")
    L.indent()
    L('"""' + f"The {spec.name} memory: one spec step per token, or a chunked schedule.")
    L()
    L("Shapes:")
    for v in ctx.views:
        L(f"    {v}: [B, T, H, {spec.views[v].dim}]")
    for g in ctx.gates:
        L(f"    {g}: {ctx.gate_text(g, 'B, T, H')}")
    for s, st in spec.state.items():
        shp = ("n",) + tuple(st.shape) if st.cache else tuple(st.shape)
        extra = " (a cache" + (f" of at most {st.window} entries)" if st.window else ")") if st.cache else ""
        init = " (learned initial value)" if st.learned else ""
        L(f"    state[{s!r}]: [B, H, {dims_text(shp)}]{extra}{init}")
    L(f"    output: [B, T, H{''.join(', ' + x for x in ctx.read_shape())}]")
    L()
    L(f"Schedules: {', '.join(repr(s) for s in ctx.schedules)}; \"auto\" is {ctx.default!r}.")
    L('"""')
    L()
    L(f"VIEWS = {{{', '.join(f'{v!r}: {spec.views[v].dim!r}' for v in ctx.views)}}}")
    # name -> the dims of a per-channel gate (() for a scalar one)
    L(f"GATES = {{{', '.join(f'{g!r}: {tuple(ctx.gate_shapes[g]) if ctx.vector_gates else ()!r}' for g in ctx.gates)}}}")
    state_items = ", ".join(f"{s!r}: ({''.join(f'{x!r}, ' for x in st.shape)})" for s, st in spec.state.items())
    L(f"STATE = {{{state_items}}}")
    caches = {s: st.window for s, st in spec.state.items() if st.cache}
    if caches:
        L(f"CACHES = {caches!r}")
    L(f"LOSS_STATES = ({''.join(f'{s!r}, ' for s in ctx.loss_states)})")
    L(f"SCHEDULES = ({''.join(f'{s!r}, ' for s in ctx.schedules)})")
    L(f"DEFAULT_SCHEDULE = {ctx.default!r}")
    L(f"STEP_SCHEDULE = {ctx.step_schedule!r}")
    L()
    memory_init(ctx, L)
    init_state(ctx, L)
    forward(ctx, L)
    work_dtype(L)
    step(ctx, L)
    validation(ctx, L)
    if spec.model is not None:
        model_method(ctx, L)
    if spec.loss is not None and ctx.loss_states is not None and ctx.has_grads():
        loss_method(ctx, L)
    if ctx.read_views() is not None:
        read_method(ctx, L)
    for e in carried(ctx):
        e.emit(ctx, L)
    L.dedent()


def read_method(ctx, L):
    """``read(views..., state=None)``: the read at a fixed state, with no write."""
    spec = ctx.spec
    views = ctx.read_views()
    used = ctx.read_names()
    states = [s for s in ctx.states if s in used]
    rshape = ctx.read_shape()
    L(f"def read(self, {', '.join(views)}, *, state=None):")
    with L.indent():
        L('"""' + f"The read {inert(unparse(spec.read), 'doc')} of a fixed state, with no write (e.g. Titans' retrieval")
        L("M*(q) in MAC): " + ", ".join(f"{v} [B, T, H, {spec.views[v].dim}]" for v in views)
          + "; state {name: [B, H, ...]} (default: init_state).")
        L(f"Every token reads the same state.  Returns {shape_text('B, T, H', rshape)}.")
        L('"""')
        taken = set(ctx.spec_names)
        B, T = fresh("B", taken), fresh("T", taken)
        in_state_dtype(ctx, L, "read", views, [], [])
        L(f"{B}, {T} = self._check_inputs({{{', '.join(f'{v!r}: {v}' for v in views)}}}, {{}})")
        L(f"state = self._check_state(state, {B}, {views[0]})")
        names = {}
        for st in states:
            names[st] = fresh(f"{st}_all", taken)
            L(f"{names[st]} = state[{st!r}].unsqueeze(1)",
              shape_text("B, 1, H", spec.state[st].shape) + ": the same state for every token")
        em = ExprEmitter(spec, names=names, like=views[0], attr=ctx.attr, helpers=ctx.helpers)
        for n in ctx.let_order():
            if n in used:
                L(f"{n} = {em.emit(spec.let[n])}", shape_text("B, T, H", ctx.shape(Name(n))))
        L(f"return {em.emit(spec.read)}", shape_text("B, T, H", rshape))
    L()


def memory_init(ctx, L):
    spec = ctx.spec
    sig = ctx.dims_signature()
    ck = recomputes(ctx)
    L(f"def __init__(self, *, {', '.join(sig)}, chunk={ctx.default_chunk}, compile=False, state_dtype=None"
      + (", checkpoint=None):" if ck else "):"))
    with L.indent():
        L('"""' + "Dims as keywords (defaults from the spec); `chunk`: the chunk size of chunked schedules;")
        L("`state_dtype`: the dtype of the states and their sums (None: float32 for float16 / bfloat16")
        L("inputs or under autocast, else the inputs' dtype; the output is in the inputs' dtype);")
        has_cache = any(st.cache for st in spec.state.values())   # a growing cache: no static shapes per token
        steps = ([] if has_cache else ["per-token step"]) + [f"{e.family} chunk step" for e in carried(ctx)
                                                             if e.chunk_step]
        steps += [what for _, _, dynamic, what in more_compiled(ctx) if dynamic is False]
        if compiles_chunked(ctx):
            steps.append(f"exact chunked forward (over slices of {SLICE_CHUNKS} chunks: one graph, compiled once)")
        if not steps:
            L("`compile`: no effect (the state holds a cache that grows by a token per step: no static shapes).")
        else:
            L(f"`compile`: torch.compile the {', the '.join(steps)}, with static shapes.")
        for _, _, dynamic, what in more_compiled(ctx):
            if dynamic is None:
                L(f"It also compiles the {what}, specialised to the first sizes and symbolic once they change.")
        if set(ctx.schedules) & CHUNKED and not compiles_chunked(ctx):
            L("The exact chunked forward stays eager (with per-channel decays it takes minutes to compile).")
        if ck:
            L("`checkpoint`: the backward recomputes each chunk (torch.utils.checkpoint) instead of")
            L("keeping its per-token states for autograd: peak memory of one chunk's states, not the")
            L("sequence's; None: when training on more than 256 tokens; False: memory growing with T")
            L("times the state (and gradients through torch.autograd.grad, which a recomputed chunk")
            L("whose inputs require grad does not support: use .backward()).")
        L('"""')
        L("super().__init__()")
        names = list(spec.dims) if "heads" in spec.dims else ["heads", *spec.dims]
        for dname in names:
            L(f"self.{ctx.attr.get(dname, dname)} = {dname}")
        L("self.chunk = chunk")
        L("self.compile = compile")
        L("self.state_dtype = state_dtype")
        if ck:
            L("self.checkpoint = checkpoint")
        H = f"self.{ctx.attr.get('heads', 'heads')}"
        for p, prm in spec.params.items():
            dims = [f"self.{ctx.attr.get(x, x)}" for x in prm.shape]
            L(f"self.{ctx.attr[p]} = nn.Parameter({init_code(prm.init, [H], dims)})",
              f"[H{''.join(', ' + x for x in prm.shape)}]")
        for s, st in spec.state.items():
            if st.learned:
                dims = [f"self.{ctx.attr.get(x, x)}" for x in st.shape]
                inner = st.init[len("learned("):-1]
                L(f"self.{ctx.init_attr[s]} = nn.Parameter({init_code(inner, [H], dims)})",
                  f"learned initial {s}: [H{''.join(', ' + x for x in st.shape)}]")
        tok = "compile and not self.CACHES" if has_cache else "compile"
        L(f"self._token_fn = _Compiled(self._token_step) if {tok} else self._token_step")
        if compiles_chunked(ctx):
            L("self._chunked_fn = _Compiled(self._forward_chunk) if compile else self._forward_chunk")
        for e in carried(ctx):   # each its own methods: a module may carry several
            if e.chunk_step:
                fn, method = e.chunk_step
                L(f"self.{fn} = _Compiled(self.{method}) if compile else self.{method}")
        for fn, method, dynamic, _ in more_compiled(ctx):
            dyn = "" if dynamic is False else f", dynamic={dynamic}"
            L(f"self.{fn} = _Compiled(self.{method}{dyn}) if compile else self.{method}")
    L()


def more_compiled(ctx) -> list:
    """[(attribute, method, dynamic, what)]: the carried emitters' further compiled methods
    (dynamic: torch.compile's argument, False for static shapes)."""
    return [c for e in carried(ctx) if e.compiled is not None for c in e.compiled(ctx, ctx.plans.get(e.family))]


def init_code(init, lead: list, dims: list, kw: str = "", generator: str = "") -> str:
    """Code of a tensor [*lead, *dims] for an init: zeros, ones, eye, normal(std) or a number."""
    sizes = ", ".join(lead + dims)
    if isinstance(init, (int, float)):
        return f"torch.full(({sizes},), {inert(float(init))}{kw})"
    if init in ("zeros", "ones"):
        return f"torch.{init}({sizes}{kw})"
    if init == "eye":
        d = dims[-1]
        return f"torch.eye({d}{kw}).expand({', '.join(lead)}, {d}, {d}).clone()"
    d = parse_init(init)
    if d["kind"] == "normal":
        return f"torch.randn({sizes}{kw}{generator}) * {inert(d['std'])}"
    if d["kind"] == "uniform":
        return f"{inert(d['lo'])} + {inert(d['hi'] - d['lo'])} * torch.rand({sizes}{kw}{generator})"
    raise CodegenError(f"unknown init {init!r}")


def init_state(ctx, L):
    spec = ctx.spec
    L("def init_state(self, batch, device=None, dtype=None, generator=None):")
    with L.indent():
        L('"""' + "The initial state {name: [batch, H, ...]} (learned initial values are parameters;")
        L("caches start empty [batch, H, 0, d]).  `generator` seeds random (normal) inits.")
        L('"""')
        H = f"self.{ctx.attr.get('heads', 'heads')}"
        L("state = {}")
        for s, st in spec.state.items():
            dims = [f"self.{ctx.attr.get(x, x)}" for x in st.shape]
            if st.cache:
                code = f"torch.zeros(batch, {H}, 0{''.join(', ' + d for d in dims)}, device=device, dtype=dtype)"
            elif st.learned:
                code = f"self.{ctx.init_attr[s]}.to(device=device, dtype=dtype).expand(batch, {H}{''.join(', ' + x for x in dims)})"
            else:
                code = init_code(st.init, ["batch", H], dims, ", device=device, dtype=dtype",
                                       ", generator=generator")
            L(f"state[{s!r}] = {code}", shape_text("B, H", (("n",) if st.cache else ()) + tuple(st.shape)))
        L("return state")
    L()


def forward(ctx, L):
    spec = ctx.spec
    views, gates = ctx.signature()
    L(f"def forward(self, {views}, *, {gates}state=None, schedule=\"auto\", cu_seqlens=None, **unknown):")
    with L.indent():
        L('"""' + "Run the memory over a sequence.")
        L()
        L("Args:")
        for v in ctx.views:
            L(f"    {v}: [B, T, H, {spec.views[v].dim}]")
        for g in ctx.gates:
            L(f"    {g}: {ctx.gate_text(g, 'B, T, H')} (gate value, after its formula)")
        L("    state: {name: [B, H, ...]} to continue from (default: init_state).")
        L(f"    schedule: \"auto\" ({ctx.default}) or one of {', '.join(ctx.schedules)}.")
        L("    cu_seqlens: packed documents: B = 1, int offsets [N + 1] (0, ..., T); each document")
        L("        runs alone from its own state row (state and the final state: [N, H, ...]).")
        L(f"Returns: (o [B, T, H{''.join(', ' + x for x in ctx.read_shape())}], the final state).")
        L('"""')
        L("if unknown:")
        takes = (f"{ctx.name}Memory.forward takes views {', '.join(ctx.views)}"
                 + (f", gates {', '.join(ctx.gates)}" if ctx.gates else "") + ", state, schedule, cu_seqlens")
        L("    raise ValueError(f\"unknown argument(s) {', '.join(sorted(unknown))}: \"")
        for piece in string_pieces(takes, 4 * L.level + len("    raise ValueError(") + 1):   # + the ")"
            L("                     " + piece)
        L.lines[-1] += ")"
        in_state_dtype(ctx, L, "forward", ctx.views, ctx.gates, ["schedule", "cu_seqlens"])
        L(f"{ctx.locals_bt()} = self._check_inputs({{{', '.join(f'{v!r}: {v}' for v in ctx.views)}}}, "
          f"{{{', '.join(f'{g!r}: {g}' for g in ctx.gates)}}})")
        B = ctx.locals_bt().split(",")[0]
        args = ", ".join(ctx.views + ctx.gates + ["state"])
        L("if cu_seqlens is not None:", "packed documents, each from its own state row")
        L(f"    return self._forward_documents({args}, schedule, cu_seqlens)")
        L(f"state = self._check_state(state, {B}, {ctx.first})")
        L("if schedule == \"auto\":")
        L("    schedule = self.DEFAULT_SCHEDULE")
        L("if schedule not in self.SCHEDULES:")
        L("    raise ValueError(f\"schedule {schedule!r} is not admitted by \"")
        for piece in string_pieces(f"{spec.name}: use \"auto\" or one of {', '.join(ctx.schedules)}",
                                   4 * L.level + len("    raise ValueError(") + 1):   # + the ")"
            L("                     " + piece)
        L.lines[-1] += ")"
        T = ctx.locals_bt().split(",")[1].strip()
        out_dims = "".join(f", self.{ctx.attr.get(x, x)}" for x in ctx.read_shape())
        L(f"if {T} == 0:", "no tokens: every schedule returns an empty output and the state as it was")
        L(f"    return {ctx.first}.new_zeros({B}, 0, {ctx.first}.shape[2]{out_dims}), state")
        fallback = token_family()
        for e in carried(ctx):
            fam = e.family
            if e is not fallback:
                L(f"if schedule == {fam!r}:")
                if e.kernel and compiles_chunked(ctx):
                    tensors = ", ".join(ctx.views + ctx.gates) + ("," if len(ctx.views + ctx.gates) == 1 else "")
                    L("    if self.compile:", f"slices of {SLICE_CHUNKS} chunks, one compiled graph; the tail eager")
                    L(f"        return _in_slices(self._chunked_fn, self._forward_chunk, {SLICE_CHUNKS} * self.chunk, "
                      f"({tensors}), state)")
                L(f"    return self.{e.forward_method}({args})")
        L(f"return self.{fallback.forward_method}({args})")
    L()
    forward_documents(ctx, L)


def forward_documents(ctx, L):
    """``_forward_documents``: packed documents.  An exact chunked kernel takes the packed row in one
    call (every document starts a chunk: :class:`memspec.runtime.varlen._Documents`); any other
    schedule splits the row at the offsets and runs the documents through ``forward`` (so its chunks
    and blocks restart at each document): online as one batch that shrinks as documents end, the
    others the documents of one length as one batch."""
    args = ", ".join(ctx.views + ctx.gates + ["state"])
    L(f"def _forward_documents(self, {args}, schedule, cu_seqlens):")
    with L.indent():
        L('"""' + "Packed documents (B = 1, offsets cu_seqlens [N + 1]), each alone from its row of state")
        L("[N, H, ...]: an exact chunked kernel takes the row in one call; the online schedule runs the")
        L("documents as one batch that shrinks as they end, any other the documents of each length as")
        L("one batch.  Returns (o [1, T, ...], the final state [N, H, ...]; an entry the documents")
        L("cannot share in one tensor is left out).")
        L('"""')
        L(f"bounds = _document_bounds(cu_seqlens, {ctx.first}.shape[0], {ctx.first}.shape[1])")
        L(f"state = self._check_state(state, len(bounds), {ctx.first})")
        L("schedule = self.DEFAULT_SCHEDULE if schedule == \"auto\" else schedule")
        packed = [e for e in carried(ctx) if e.packed]
        if packed:   # (at most one exact chunked family per module)
            L(f"if schedule == {packed[0].family!r}:", "one kernel call over the packed row")
            L(f"    return self.{packed[0].forward_method}({args}, _Documents(cu_seqlens))")
        L()
        L(f"def run({args}):")
        gate_kw = "".join(f"{g}={g}, " for g in ctx.gates)
        L(f"    return self.forward({', '.join(ctx.views)}, {gate_kw}state=state, schedule=schedule)")
        L()
        tensors = ", ".join(ctx.views + ctx.gates) + ("," if len(ctx.views + ctx.gates) == 1 else "")
        L("# a token loop: one batch that shrinks as documents end; chunks: the documents of one length")
        token = token_family().family
        L(f"return _by_document(run, ({tensors}), state, bounds, shrink=schedule == \"{token}\")")
    L()


def in_state_dtype(ctx, L, method: str, views: list, gates: list, keywords: list) -> None:
    """The prologue of ``forward`` / ``read``: float16 / bfloat16 inputs (or autocast) run again in
    ``self._work_dtype`` (float32 by default) with autocast off, so that states and their sums stay
    in it (fla's convention); the output comes back in the inputs' dtype, the state in the work dtype.
    ``keywords``: the method's other keyword arguments, passed through as they are."""
    taken = set(ctx.spec_names)
    work, out, like = fresh("work", taken), fresh("out", taken), fresh("like", taken)
    tensors = ", ".join(views + gates) + ("," if len(views + gates) == 1 else "")
    L(f"{work} = self._work_dtype({views[0]})")
    L(f"if {work} is not None:", f"states and sums in {work}, the output in the inputs' dtype")
    with L.indent():
        L(f"{like} = {views[0]}")
        L(f"{tensors} = (t.to({work}) if torch.is_tensor(t) else t for t in ({tensors}))")
        L("if isinstance(state, dict):")
        L(f"    state = {{n: s.to({work}) if torch.is_tensor(s) and s.is_floating_point() else s "
          "for n, s in state.items()}")
        args = ", ".join(views + [f"{g}={g}" for g in gates] + ["state=state"] + [f"{k}={k}" for k in keywords])
        L(f"with torch.autocast({like}.device.type, enabled=False):")
        if method == "forward":
            L(f"    {out}, state = self.forward({args})")
            L(f"return {out}.to({like}.dtype), state")
        else:
            L(f"    return self.read({args}).to({like}.dtype)")


def work_dtype(L):
    """``_work_dtype(x)``: the dtype a call with inputs like ``x`` runs its states in, when not x's own."""
    L("def _work_dtype(self, x):")
    with L.indent():
        L('"""' + "The dtype of the states and their sums for inputs like x (`state_dtype`, else float32 for")
        L("float16 / bfloat16), or None when the call runs as it is (that dtype is x's, no autocast).")
        L('"""')
        L("if not torch.is_tensor(x):")
        L("    return None")
        L("work = self.state_dtype or (torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)")
        L("return work if work != x.dtype or torch.is_autocast_enabled(x.device.type) else None")
    L()


def step(ctx, L):
    views, gates = ctx.signature()
    L(f"def step(self, {views}, *, {gates}state=None, **unknown):")
    with L.indent():
        gates = "gates [B, H] or [B, H, d] (or with the 1)" if ctx.vector_gates else "gates [B, H] (or [B, 1, H])"
        L('"""' + f"One token (decoding): views [B, H, D] (or [B, 1, H, D]), {gates}.")
        L()
        L(f"Runs the {ctx.step_schedule} schedule (the same numbers as forward over the whole sequence).")
        L(f"Returns: (o [B, H{''.join(', ' + x for x in ctx.read_shape())}], the new state).")
        L('"""')
        for v in ctx.views:
            L(f"{v} = {v}.unsqueeze(1) if isinstance({v}, torch.Tensor) and {v}.dim() == 3 else {v}")
        for g in ctx.gates:
            rank = 2 + len(ctx.gate_shapes[g])
            L(f"{g} = {g}.unsqueeze(1) if isinstance({g}, torch.Tensor) and {g}.dim() == {rank} else {g}")
        gate_kw = "".join(f"{g}={g}, " for g in ctx.gates)
        o = fresh("out", set(ctx.spec_names))
        L(f"{o}, state = self.forward({', '.join(ctx.views)}, {gate_kw}state=state, schedule=self.STEP_SCHEDULE, **unknown)")
        L(f"return {o}[:, 0], state")
    L()


def validation(ctx, L):
    H = f"self.{ctx.attr.get('heads', 'heads')}"
    L("def _check_inputs(self, views, gates):")
    with L.indent():
        gates = "gates [B, T, H, *shape]" if ctx.vector_gates else "gates [B, T, H]"
        L('"""' + f"Views [B, T, H, D] and {gates}: shapes, dtypes and devices agree; returns (B, T)." + '"""')
        L("ref = None")
        L("B = T = None")
        L("for name, t in views.items():")
        L("    dim = self.VIEWS[name]")
        L(f"    _check(name, t, [\"B\", \"T\", \"H\", dim], [B, T, {H}, getattr(self, dim)], ref)")
        L("    B, T = t.shape[0], t.shape[1]")
        L("    ref = ref or (name, t)")
        if ctx.vector_gates:
            L("for name, t in gates.items():")
            L("    dims = self.GATES[name]")
            L(f"    axes, sizes = [\"B\", \"T\", \"H\", *dims], [B, T, {H}, *(getattr(self, d) for d in dims)]")
            L("    if t is None:")
            L("        raise ValueError(f\"missing gate {name}: expected [{', '.join(axes)}] = {sizes}\")")
            L("    _check(name, t, axes, sizes, ref)")
        elif ctx.gates:
            L("for name, t in gates.items():")
            L("    if t is None:")
            L("        raise ValueError(f\"missing gate {name}: expected [B, T, H] \"")
            L(f"                         f\"= [{{B}}, {{T}}, {{{H}}}]\")")
            L(f"    _check(name, t, [\"B\", \"T\", \"H\"], [B, T, {H}], ref)")
        L("return B, T")
    L()
    L("def _check_state(self, state, B, like):")
    with L.indent():
        L('"""' + "The state dict (default: init_state): every entry [B, H, ...] of the views' dtype." + '"""')
        L("if state is None:")
        L("    return self.init_state(B, device=like.device, dtype=like.dtype)")
        L("if not isinstance(state, dict):")
        L("    raise ValueError(\"state: expected a dict of tensors {name: [B, H, ...]}, \"")
        L("                     f\"got {type(state).__name__}\")")
        own = [f'"{e.state_prefix}"' for e in EMITTERS.values() if e.state_prefix]   # a family's own entries
        if ctx.accs or any(e.block_sums for e in carried(ctx)):   # block sums ride along in the state
            prefixes = ", ".join(own + ['"every."'])
            L("extra = [k for k in state if k not in self.STATE")
            L(f"         and not str(k).startswith(({prefixes}))]")
        else:
            L(f"extra = [k for k in state if k not in self.STATE and not str(k).startswith({', '.join(own)})]")
        L("missing = [k for k in self.STATE if k not in state]")
        L("if extra or missing:")
        L("    raise ValueError(f\"state: expected the entries {', '.join(self.STATE)}\"")
        L("                     + (f\"; missing {', '.join(missing)}\" if missing else \"\")")
        L("                     + (f\"; unknown {', '.join(map(str, extra))}\" if extra else \"\"))")
        L("for name, shape in self.STATE.items():")
        if any(st.cache for st in ctx.spec.state.values()):
            L("    cache = [\"n\"] if name in self.CACHES else []")
            L("    sizes = [None] if cache else []")
            L("    _check(f\"state[{name!r}]\", state[name], [\"B\", \"H\", *cache, *shape],")
            L(f"           [B, {H}, *sizes, *(getattr(self, d) for d in shape)], (\"the views\", like))")
        else:
            L("    _check(f\"state[{name!r}]\", state[name], [\"B\", \"H\", *shape],")
            L(f"           [B, {H}, *(getattr(self, d) for d in shape)], (\"the views\", like))")
        L("return state")
    L()


def model_method(ctx, L):
    spec = ctx.spec
    m = spec.model
    states = spec.model_states()
    arg = ctx.model_arg_shape()
    em = ctx.emitter(like=m.arg).with_scope(**{m.arg: arg})
    out = tuple(ctx.env.model_output(arg) or ())
    L(f"def {ctx.attr[m.name]}(self, {m.arg}, {', '.join(states)}):")
    with L.indent():
        L('"""' + f"The inner model {m}: {m.arg} [..., H, {dims_text(arg)}] -> [..., H{''.join(', ' + x for x in out)}]")
        L("with the state " + ", ".join(f"{s} [..., H, {dims_text(spec.state[s].shape)}]" for s in states) + ".")
        L('"""')
        L(f"return {em.emit(m.body)}")
    L()


def loss_method(ctx, L):
    spec = ctx.spec
    em = ctx.emitter()
    L(f"def inner_loss(self, {', '.join(ctx.loss_args)}):")
    with L.indent():
        L('"""' + f"The inner loss {inert(unparse(spec.loss), 'doc')}, summed over batch and heads: one token's")
        L("[B, H, ...] tensors -> a scalar.  Each (b, h) term depends only on its own state, so the")
        L("gradient of the sum is every (b, h)'s own gradient.")
        L('"""')
        code = em._emit(spec.loss)
        L(f"return {code.at(P_ATOM)}.sum()")
    L()
