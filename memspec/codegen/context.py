"""The code generator's context: everything the emitters of one module read.

A :class:`Context` is built once from a spec and its :class:`~memspec.schedule.ScheduleDecision`
and never re-derives what the analysis decided: the schedules the module carries, the
default, the chunk sizes and every family's plan come from the decision.  It also names
things (attributes of the generated Memory module, fresh locals) and collects what the
emitted code needs from :mod:`memspec.runtime` (``helpers``, ``parts``), which the module
emitter writes at the top of the file.
"""
from __future__ import annotations

import ast
import inspect
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from ..lang.expr import Call, Name, unparse
from ..lang.names import GENERATED_NAMES, LANGUAGE_NAMES, fresh
from ..lang.shapes import ShapeEnv, let_order
from ..runtime import helpers as runtime_helpers
from ..runtime import muon as runtime_muon
from ..runtime import phases as runtime_phases
from ..runtime import solve as runtime_solve
from ..schedule.decide import BY_NAME, DEFAULT_CHUNK, ScheduleDecision
from .exprs import ExprEmitter
from .text import class_name, inert, shape_text

# the language's functions the emitted code may call, as module-level helpers
HELPER_FUNCTIONS = ("layernorm", "rmsnorm", "l2norm", "huber", "attend", "append", "newton_schulz", "cg")

# attributes and methods of the generated Memory module besides nn.Module's own
OWN_ATTRS = ("chunk", "compile", "checkpoint", "forward", "step", "init_state", "inner_loss",
             "VIEWS", "GATES", "STATE", "CACHES", "SCHEDULES", "DEFAULT_SCHEDULE", "STEP_SCHEDULE",
             "CHUNK_SCHEDULES", "LOSS_STATES")


def runtime_source(obj) -> str:
    """The source of a :mod:`memspec.runtime` function or class, as the module carries it."""
    return inspect.getsource(obj)


def kernel_functions(fn, src: str) -> list:
    """The private functions of kernel ``fn``'s module that its (specialised) source ``src`` calls: a
    family's chunk maps and outputs, in their order in the module; and its private classes that it
    names (an autograd function with a closed-form backward)."""
    used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    module = inspect.getmodule(fn)
    return [f for name, f in vars(module).items() if name.startswith("_") and name in used
            and (inspect.isfunction(f) or inspect.isclass(f)) and f.__module__ == module.__name__]


def phase_sources(runtime: list) -> list:
    """The sources of the kernels' shared phases (:mod:`memspec.runtime.phases`) that the runtime
    sources ``runtime`` call (after specialising: only those a kernel still uses), and the phases
    those call in turn, in the module's order."""
    phases = {name: f for name, f in vars(runtime_phases).items()
              if inspect.isfunction(f) and f.__module__ == runtime_phases.__name__}

    def names(src: str) -> set:
        return {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}

    used: set = set().union(*(names(src) for src in runtime))
    pending = [n for n in used if n in phases]
    while pending:   # a phase that calls another phase carries it too
        for n in names(runtime_source(phases[pending.pop()])) - used:
            used.add(n)
            if n in phases:
                pending.append(n)
    return [runtime_source(f) for name, f in phases.items() if name in used]


@dataclass(frozen=True)
class Emitter:
    """What the module frame needs of one schedule family's emitter: each emitter module
    declares one (``EMITTER``), :data:`memspec.codegen.module.EMITTERS` orders them.  What the
    analysis knows of the family (exact, chunked) is its row of
    :data:`memspec.schedule.decide.FAMILIES`, never repeated here."""

    family: str                  # the name of its row in memspec.schedule.decide.FAMILIES
    emit: Callable               # (ctx, L): the family's methods of the Memory class
    forward_method: str          # the method `forward` dispatches the family's schedule to
    schedule_text: str           # the header's "# schedule:" line ({chunk}, {window} filled in)
    kernel: bool = False         # one exact chunked kernel call (compile=True compiles it in slices)
    packed: bool = False         # the kernel takes packed documents (cu_seqlens) in one call
    chunk_step: tuple | None = None   # (attribute, method) of its compiled chunk step
    compiled: Callable | None = None   # (ctx, plan) -> [(attribute, method, dynamic, what)]: more
    #   methods compiled under `compile` (dynamic: torch.compile's argument, False for static shapes,
    #   None to specialise first and make sizes symbolic when they change; what: docstring words)
    stays_eager: Callable | None = None   # (ctx, plan) -> True when its kernel must not be compiled
    header: Callable | None = None    # (ctx, plan) -> an extra header line (without "# "), or None
    approximation: str | None = None  # how an approximate family's module names its approximation
    state_prefix: str | None = None   # state entries of its own (e.g. running sums) start with it
    block_sums: bool = False     # carries the block sums (``every.<state>.<k>``) in the state
    recomputes: Callable | None = None   # (ctx, plan) -> True when its chunk step can run under
    #   torch.utils.checkpoint (the module's `checkpoint` option: per-token states not kept for autograd)

    @property
    def module(self):
        """The emitter's module (an exact chunked family's ``body`` and ``KERNEL`` live there)."""
        return sys.modules[self.emit.__module__]


@dataclass(frozen=True)
class BlockAcc:
    """The running sum of one gradient term of a block update: its state key, its local name,
    the statement and term it sums, the term's shape and the state the statement assigns."""

    key: str
    name: str
    index: int
    term: object
    shape: tuple
    target: str


class Context:
    """One module's generation context (see the module docstring)."""

    def __init__(self, spec, decision: ScheduleDecision, *, source_path=None, source_text=None):
        self.spec = spec
        self.decision = decision
        self.source_path = source_path
        self.source_text = source_text
        self.name = class_name(spec.name)
        self.env = ShapeEnv.from_spec(spec)
        self.helpers: set = set()      # runtime helper functions the emitted code calls
        self.parts: list = []          # further runtime sources the module carries, in order of need
        spec_names = set(spec.dims) | set(spec.constants) | set(spec.views) | set(spec.gates) | \
            set(spec.params) | set(spec.state) | set(spec.let)
        if spec.model is not None:
            spec_names |= {spec.model.name, spec.model.arg}
        for n in spec_names | {spec.name} | {st.target for st in spec.update}:
            inert(n, "name")   # every name the code binds or reads: a plain identifier, or UnsafeValue
        self.spec_names = spec_names | set(GENERATED_NAMES) | set(HELPER_FUNCTIONS) | set(LANGUAGE_NAMES) | \
            {st.target for st in spec.update}   # per-token temporaries are locals of the generated code
        # attribute names on the Memory module
        taken = set(dir(nn.Module)) | set(OWN_ATTRS)
        self.attr: dict = {}
        for n in list(spec.dims) + list(spec.params):
            self.attr[n] = fresh(n, taken)
        if "heads" not in spec.dims:
            self.attr["heads"] = "heads"
        self.init_attr = {s: fresh(f"{s}_init", taken) for s, st in spec.state.items() if st.learned}
        if spec.model is not None:
            self.attr[spec.model.name] = fresh(spec.model.name, taken)
        self.views = list(spec.views)
        self.gates = list(spec.gates)
        self.gate_shapes = {g: tuple(gt.shape) for g, gt in spec.gates.items()}   # () for a scalar gate
        self.vector_gates = any(self.gate_shapes.values())
        self.states = list(spec.state)
        self.first = self.views[0] if self.views else None
        # what the analysis decided
        d = decision
        self.plans = d.plans
        self.schedules = list(d.schedules)
        self.default = d.family
        self.step_schedule = d.step
        # a module whose default is unchunked takes the chunk of the approximate schedule it carries
        self.default_chunk = d.chunk or next((c for f, c in d.chunks.items() if not BY_NAME[f].exact), DEFAULT_CHUNK)
        online = d.plans[next(n for n, f in BY_NAME.items() if f.token)]   # the token-by-token plan
        self.loss_states = list(online.loss_states)
        self.grad_groups = online.grad_groups
        # unparse of a group's calls -> its closed-form gradient (memspec.schedule.backprop)
        self.closed_grads = {tuple(unparse(c) for c in g): cg for g, cg in zip(online.grad_groups, online.closed)
                             if cg is not None}
        self.loss_args = self.loss_states + self.loss_inputs() if spec.loss is not None else []
        # block updates of the online step (states with `every C`)
        self.blocks = tuple(online.blocks)
        self.accs = self.block_accs(self.blocks)
        taken = self.taken()
        self.flags = {}
        for c in sorted({b.every for b in self.blocks}):
            self.flags[c] = fresh(f"last_{c}", taken)
            taken.add(self.flags[c])
        self.spec_names |= set(self.flags.values())
        self.block_period = math.lcm(*self.flags) if self.flags else 1
        # the online step's max stabiliser of exponential input weights (memspec.schedule.stabiliser)
        self.stabiliser = online.stabiliser
        self.stab = fresh("m", self.taken()) if self.stabiliser is not None else None
        if self.stab:
            self.spec_names.add(self.stab)

    def carried(self) -> list:
        """The online step's carried tensors: the states, the stabiliser, the block sums."""
        return self.states + ([self.stab] if self.stab else []) + [a.name for a in self.accs]

    def block_accs(self, blocks) -> list:
        """One running sum per gradient term of the block statements ``blocks``
        (:class:`memspec.lang.blocks.BlockStatement`), carried in the state as ``every.<state>.<k>``;
        their locals are reserved in ``spec_names``."""
        taken = self.taken()
        accs: list = []
        count: dict = {}
        for b in blocks:
            for t in b.terms:
                k = count.get(b.target, 0)
                count[b.target] = k + 1
                name = fresh(f"acc_{b.target}_{k}", taken)
                taken.add(name)
                shape = tuple(self.env.infer(t, scope=self.env.temp_scope(b.index)))
                accs.append(BlockAcc(f"every.{b.target}.{k}", name, b.index, t, shape, b.target))
        self.spec_names |= {a.name for a in accs}
        return accs

    # ------------------------------------------------------------ runtime pieces
    def need(self, obj) -> None:
        """The module carries the runtime function/class ``obj`` (once, in order of need)."""
        src = runtime_source(obj)
        if src not in self.parts:
            self.parts.append(src)

    def need_kernel(self, fn) -> None:
        """The module carries the kernel ``fn``, specialised to the constant arguments its
        calls (:class:`memspec.codegen.calls.KernelCall`) pass, once every call is written."""
        if fn not in self.parts:
            self.parts.append(fn)

    def helper_sources(self) -> list:
        """Sources of the language helpers the emitted code called and of the private functions and
        classes of their modules that they call in turn (an autograd function, a step of an
        iteration), sorted by name (Newton-Schulz's in :mod:`memspec.runtime.muon`, ``cg`` in
        :mod:`memspec.runtime.solve`, the others in :mod:`memspec.runtime.helpers`)."""
        objs: dict = {}
        pending = [getattr(runtime_helpers, h, None) or getattr(runtime_muon, h, None) or getattr(runtime_solve, h)
                   for h in self.helpers]
        while pending:
            obj = pending.pop()
            if obj.__name__ not in objs:
                objs[obj.__name__] = obj
                pending += kernel_functions(obj, runtime_source(obj))
        return [runtime_source(objs[name]) for name in sorted(objs)]

    # ------------------------------------------------------------ names and shapes
    def emitter(self, **kw) -> ExprEmitter:
        kw.setdefault("like", self.first)
        return ExprEmitter(self.spec, attr=self.attr, helpers=self.helpers, **kw)

    def taken(self) -> set:
        """A fresh set of the names a method's new locals must avoid."""
        return set(self.spec_names)

    def shape(self, e) -> tuple:
        return tuple(self.env.infer(e))

    def read_shape(self) -> tuple:
        return self.shape(self.spec.read)

    def dim_sizes(self, shape, obj="self") -> str:
        return ", ".join(f"{obj}.{self.attr.get(d, d)}" for d in shape)

    def let_order(self) -> list:
        return [n for n in let_order(self.spec.let) if n in self.spec.let]

    def lets(self, L, em, prefix) -> None:
        """Bind every let as a local, in dependency order."""
        for n in self.let_order():
            L(f"{n} = {em.emit(self.spec.let[n])}", shape_text(prefix, self.shape(Name(n))))

    def model_arg_shape(self) -> tuple:
        spec = self.spec
        exprs = [spec.read] + ([spec.loss] if spec.loss is not None else []) + [s.value for s in spec.update]
        for e in exprs:
            for c in e.walk():
                if isinstance(c, Call) and c.fn == spec.model.name:
                    arg = self.shape(c.args[0])
                    if len(arg) >= 2 and arg[0] == self.env.cache_axis:   # f(K) of a cache: row-wise
                        arg = arg[1:]
                    return arg
        return (spec.dims and next(iter(spec.views.values())).dim,) if spec.views else ()

    def has_grads(self) -> bool:
        return any(isinstance(c, Call) and c.fn == "grad" for s in self.spec.update for c in s.value.walk())

    def loss_inputs(self) -> list:
        """The views, gates and lets the inner loss reads (after its states)."""
        spec = self.spec
        used = {n.id for n in spec.loss.walk() if isinstance(n, Name)}
        if spec.model is not None:
            used |= {n.id for n in spec.model.body.walk() if isinstance(n, Name)} - {spec.model.arg}
        return [n for n in self.views + self.gates + list(spec.let) if n in used]

    def dims_signature(self) -> list:
        spec = self.spec
        sig = []
        if "heads" not in spec.dims:
            sig.append("heads=1")
        for dname, val in spec.dims.items():
            sig.append(f"{dname}={val}")
        return sig

    def locals_bt(self) -> str:
        taken = self.taken()
        return f"{fresh('B', taken)}, {fresh('T', taken)}"

    def gate_text(self, g: str, prefix: str) -> str:
        """``[B, T, H]`` (a scalar gate) or ``[B, T, H, d_k]`` (per channel), for ``prefix``."""
        return shape_text(prefix, self.gate_shapes[g])

    def signature(self) -> tuple:
        """(views, gates) parts of the forward/step signatures."""
        views = ", ".join(self.views)
        gates = "".join(f"{g}=None, " for g in self.gates)
        return views, gates

    # ------------------------------------------------------------ the read
    def read_names(self) -> set:
        """Spec names the read uses, lets followed."""
        spec = self.spec
        seen: set = set()
        todo = [spec.read]
        while todo:
            e = todo.pop()
            for n in e.walk():
                if isinstance(n, Name) and n.id not in seen:
                    seen.add(n.id)
                    if n.id in spec.let:
                        todo.append(spec.let[n.id])
                if isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
                    for st in spec.model_states():
                        seen.add(st)
        return seen

    def read_views(self):
        """The views a read-only call needs, or None when the read is not a function of the
        views and the state alone (it uses a gate or a temporary, or a state is a cache)."""
        spec = self.spec
        used = self.read_names()
        if any(st.cache for st in spec.state.values()) or used & set(spec.gates) \
                or used & {st.target for st in spec.update if st.target not in spec.state}:
            return None
        views = [v for v in self.views if v in used]
        return views or None
