"""The verifier: ``check(spec) -> (graph, diagnostics)``.

Lowering (:func:`memspec.graph.lower`) types every expression; this module adds the
checks that need the whole spec or the whole graph.  Every diagnostic is located
at the offending span and carries its own code:

=====================  =========================================================
``E-identifier``       a declared name is not a plain, safe identifier
``E-duplicate``        one name declared in two sections (a view and a state ``k``)
``E-shadow``           the model's argument or name hides another name
``E-unknown-dim``      a shape or view width names an undeclared dim
``E-unknown-name``     an expression uses an undeclared name (with did-you-mean)
``E-unknown-function`` a call to a function outside the whitelist (did-you-mean)
``E-arity``            a function called with the wrong number of arguments
``E-shape``            shapes do not fit (both shapes in ``[d_k, d_v]`` notation)
``E-grad``             grad of a non-scalar loss, w.r.t. a non-state, without a
                       loss, with a first argument other than ``loss``, ambiguous
                       ``grad(loss)``, or outside the update program
``E-cache``            ``append``/``attend`` misuse; a cache assigned otherwise
``E-target``           an update statement assigns a declared name that is not a
                       state (a view, gate, let, ...)
``E-temp-shadow``      a temporary named like the model, its argument, ``loss`` or
                       ``logit``
``E-temp-twice``       a temporary assigned twice in one token
``E-temp-later``       a temporary used before (or in) the statement that assigns it
``E-temp-scope``       a temporary used outside the update program (read, let, loss,
                       model, gate)
``E-cycle``            a cycle within one token step (lets using each other)
``E-order``            something that uses a value only available later (a gate
                       using anything but logit/constants/dims/params; a let
                       reading state, applying the model or using a later let;
                       a model using a view, gate or let: the model is f(u; state))
``E-state-unwritten``  a state no update statement assigns
``E-state-unread``     a state whose value never reaches the output
``E-limit``            an expression that grows past the limits once inlined
                       (:mod:`memspec.check.complexity`)
``E-size``             a parameter or state tensor (or all of them) too large to allocate
                       (:mod:`memspec.check.sizes`; the message gives the bytes)
``W-state-temporary``  (warning) a state always overwritten before it is read in a
                       step (a per-token temporary carried for nothing)
``W-unused``           (warning) a let/view/gate/param/constant/dim/model/loss
                       that nothing uses
``W-grad-zero``        (warning) grad(loss, W) where the loss does not depend on W
``W-temp-unused``      (warning) a temporary no later update statement uses
``E-every``            a state updated ``every C`` tokens reads a temporary that mixes a
                       state with a gradient (a block sums gradient terms, see
                       :mod:`memspec.lang.blocks`)
``W-log-state``        (warning) ``log(S)`` of a state whose init has zeros or negative
                       entries (``log`` gives -inf / NaN at the first token)
=====================  =========================================================
"""
from __future__ import annotations

import builtins
import keyword
import re
from typing import Iterable, Optional

import networkx as nx

from ..lang.blocks import NotBlockwise, block_statements, frequencies
from ..lang.errors import Collector, Diagnostic, Span, did_you_mean, sorted_diagnostics
from ..lang.limits import MAX_NAME_CHARS, MAX_QUOTED_CHARS, quote
from ..lang.expr import FUNCTIONS, Call, Expr, Name
from .complexity import inlined_problems
from .graph import lower
from .sizes import size_problems
from ..lang.names import RESERVED_NAMES, class_names, runtime_names, shadows_module
from ..lang.shapes import ShapeEnv, let_order
from ..lang.spec import parse_init

IDENT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")



BUILTIN_NAMES = frozenset(n for n in dir(builtins))

# section key in the spec -> the word used in messages
SECTIONS = (
    ("dims", "dim"),
    ("constants", "constant"),
    ("views", "view"),
    ("gates", "gate"),
    ("params", "param"),
    ("state", "state"),
    ("let", "let"),
)
LAYER_DIMS = frozenset({"d_model", "heads"})


def identifier_problem(name: str, spec_name: Optional[str] = None) -> Optional[tuple[str, str]]:
    """Why ``name`` cannot be a spec identifier, as (message tail, hint), or None.  With
    ``spec_name``, also the names of the classes that spec's module defines."""
    if isinstance(name, str) and name.startswith("_") and IDENT_RE.fullmatch("a" + name.lstrip("_")):
        return ("starts with '_'", "names starting with '_' (and dunders like __class__) belong to Python")
    if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
        return (f"is too long ({len(name)} characters; at most {MAX_NAME_CHARS})", "choose a shorter name")
    if not isinstance(name, str) or not IDENT_RE.fullmatch(name):
        return ("is not a plain identifier",
                "names are a letter followed by letters, digits or '_' (no spaces or punctuation)")
    if keyword.iskeyword(name):
        return ("is a Python keyword", "generated code would not compile; choose another name")
    if name in FUNCTIONS:
        return (f"is the name of the function {name}(...)", "choose a name that is not a function")
    if name in RESERVED_NAMES:
        return ("is reserved: the generated code uses it",
                "reserved names: " + ", ".join(sorted(RESERVED_NAMES, key=str.lower)))
    if name in runtime_names():
        return ("is reserved: memspec's runtime code, which generated modules carry, defines it",
                "reserved runtime names: " + ", ".join(sorted(n for n in runtime_names() if not n.startswith("_"))))
    if spec_name is not None and name in class_names(spec_name):
        return ("is the name of a class the generated module defines",
                f"{spec_name} generates {', '.join(sorted(class_names(spec_name)))}; choose another name")
    if name in BUILTIN_NAMES:
        return ("is a Python builtin", "generated code would shadow it; choose another name")
    return None


class _Checker:
    def __init__(self, spec, graph: nx.DiGraph):
        self.spec = spec
        self.g = graph
        self.d = Collector()
        self.bad_names: set[str] = set()   # declared names that are not safe identifiers
        self.dup_names: set[str] = set()   # names declared in two sections
        self.first_kind: dict[str, str] = {}
        self.unknown_target = False

    def span(self, *path) -> Optional[Span]:
        return self.spec.key_span(*path) or self.spec.span(*path)

    # ------------------------------------------------------------ declarations
    def identifiers(self) -> None:
        spec = self.spec
        if keyword.iskeyword(spec.name):
            self.d.error(f"the spec name '{spec.name}' is a Python keyword", self.span("name"),
                         hint="the compiled module is compiled/<name>.py; choose another name", code="E-identifier")
        elif shadows_module(spec.name):
            self.d.error(f"the spec name '{spec.name}' is the name of a Python module", self.span("name"),
                         hint=f"compiled/{spec.name}.py would shadow the module {spec.name} for code run in that "
                              f"folder; choose another name", code="E-identifier")
        seen: dict[str, tuple[str, Optional[Span]]] = {}
        for section, word in SECTIONS:
            for n in getattr(spec, section):
                sp = self.span(section, n)
                prob = identifier_problem(n, spec.name)
                if prob is not None:
                    self.bad_names.add(n)
                    self.d.error(f"{word} name {_q(n)} {prob[0]}", sp, hint=prob[1], code="E-identifier")
                if n in seen:
                    self.dup_names.add(n)
                    kind, first = seen[n]
                    where = ""
                    if first is not None:
                        where = f" at line {first.line}" if sp is None or first.file == sp.file else \
                            f" at {first.file}:{first.line}"
                    self.d.error(f"{_q(n)} is declared twice: as a {kind}{where} and as a {word}", sp,
                                 hint="every name is declared once across dims, constants, views, gates, params, "
                                      "state and let", code="E-duplicate")
                else:
                    seen[n] = (word, sp)
                    self.first_kind[n] = word
        m = spec.model
        if m is None:
            return
        for what, n, sp in (("model name", m.name, m.name_span), ("model argument", m.arg, m.arg_span)):
            prob = identifier_problem(n, spec.name)
            if prob is not None:
                self.bad_names.add(n)
                self.d.error(f"{what} {_q(n)} {prob[0]}", sp or m.span, hint=prob[1], code="E-identifier")
            elif n in seen:
                kind, first = seen[n]
                where = f" (line {first.line})" if first is not None else ""
                verb = "shadows" if what == "model argument" else "is also"
                self.d.error(f"the {what} {_q(n)} {verb} the {kind} {_q(n)}{where}", sp or m.span,
                             hint="give it a name of its own, e.g. f(u)" if what == "model argument" else
                             "name the model differently, e.g. f", code="E-shadow")
        if m.name == m.arg:
            self.d.error(f"the model argument {_q(m.arg)} has the model's own name", m.arg_span or m.span,
                         hint="write e.g. f(u)", code="E-shadow")

    def dims_in_shapes(self) -> None:
        spec = self.spec
        dims = list(spec.dims)

        def need(d, sp, what):
            if d not in spec.dims:
                hint = did_you_mean(d, dims) or (("dims: " + ", ".join(dims)) if dims else "declare it under dims")
                self.d.error(f"unknown dim {_q(d)} in {what}", sp, hint=hint, code="E-unknown-dim")

        for n, v in spec.views.items():
            need(v.dim, spec.span("views", n, "dim") or spec.span("views", n), f"the width of view {n}")
        for section, word in (("gates", "gate"), ("params", "param"), ("state", "state")):
            for n, x in getattr(spec, section).items():
                for i, d in enumerate(x.shape):
                    sp = spec.span(section, n, "shape", i) or spec.span(section, n, "shape") or self.span(section, n)
                    need(d, sp, f"the shape of {word} {n}")

    # ------------------------------------------------------------ availability
    def gates(self) -> None:
        spec = self.spec
        allowed = {"dim", "constant", "param"}
        env = None
        for n, gt in spec.gates.items():
            if len(gt.shape) > 1:
                self.d.error(f"gate {_q(n)} has shape [{', '.join(gt.shape)}]; a gate is a scalar or a vector per "
                             "head", spec.span("gates", n, "shape") or self.span("gates", n),
                             hint="a per-channel gate has one dim, e.g. shape: [d_k]", code="E-shape")
            elif all(d in spec.dims for d in gt.shape):
                env = env or ShapeEnv.from_spec(spec)
                got = env.infer(gt.formula, context="gate", scope=env.gate_scope(n), diags=Collector())
                want = tuple(gt.shape)
                if got is not None and got not in ((), want):
                    decl = f"declared with shape [{', '.join(want)}]" if want else "a scalar per head"
                    self.d.error(f"the formula of gate {_q(n)} has shape [{', '.join(got)}], but the gate is {decl}",
                                 gt.formula.span or self.span("gates", n),
                                 hint=(f"declare it with shape: [{', '.join(got)}]" if len(got) == 1 else
                                       "a gate formula computes one value per head (and channel)"),
                                 code="E-shape")
            for x in gt.formula.walk():
                if isinstance(x, Name) and x.id != "logit":
                    kind = self.first_kind.get(x.id)
                    if kind is not None and kind not in allowed:
                        self.d.error(f"gate {_q(n)} uses the {kind} {_q(x.id)}; a gate formula may use only logit, "
                                     "constants, dims and params", x.span,
                                     hint="a gate is computed from the layer input: a formula of logit = x·w + bias",
                                     code="E-order")
                if isinstance(x, Call) and spec.model is not None and x.fn == spec.model.name:
                    self.d.error(f"gate {_q(n)} applies the model {x.fn}; a gate formula may use only logit, "
                                 "constants, dims and params", x.fn_span or x.span, code="E-order")

    def model_scope(self) -> None:
        """The model is f(u; state): its argument, states, params, constants and dims."""
        m = self.spec.model
        if m is None:
            return
        allowed = {"dim", "constant", "param", "state"}
        for x in m.body.walk():
            if isinstance(x, Name) and x.id != m.arg:
                kind = self.first_kind.get(x.id)
                if kind is not None and kind not in allowed:
                    self.d.error(f"the model uses the {kind} {_q(x.id)}; a model may use only its argument "
                                 f"{_q(m.arg)}, states, params, constants and dims", x.span,
                                 hint=f"pass it in as the argument, e.g. {m.name}({x.id}), or use it in the loss",
                                 code="E-order")

    def lets(self) -> None:
        spec = self.spec
        names = list(spec.let)
        pos = {n: i for i, n in enumerate(names)}
        in_cycle = set(names) - set(let_order(spec.let))
        for n, e in spec.let.items():
            for x in e.walk():
                if not isinstance(x, Name):
                    continue
                kind = self.first_kind.get(x.id)
                if kind == "state":
                    self.d.error(f"let {_q(n)} reads the state {_q(x.id)}; lets are computed before the update",
                                 x.span, hint="use the state in the model, an update statement or the read",
                                 code="E-order")
                elif kind == "let" and x.id in pos and pos[x.id] > pos[n] and n not in in_cycle:
                    self.d.error(f"let {_q(n)} uses the let {_q(x.id)}, which is defined later", x.span,
                                 hint=f"move {x.id} above {n}", code="E-order")

    def cycles(self) -> None:
        g = self.g
        for comp in nx.strongly_connected_components(g):
            if len(comp) == 1:
                (only,) = comp
                if not g.has_edge(only, only):
                    continue
            owners = [n for n in g.nodes if n in comp and g.nodes[n]["role"] == "let" and "/" not in n]
            if not owners:
                owners = [n for n in g.nodes if n in comp]
            names = [o.split(":", 1)[1] if o.startswith("let:") else o for o in owners]
            first = owners[0]
            sp = g.nodes[first].get("span")
            chain = " -> ".join(names + [names[0]])
            self.d.error(f"cycle within a step: {chain}", sp,
                         hint="a let cannot depend on itself, directly or through other lets", code="E-cycle")

    # ------------------------------------------------------------ updates
    def temporary(self, st, tsp, temps: dict) -> None:
        """An update target that is no declared name: a per-token temporary."""
        spec, t = self.spec, st.target
        m = spec.model
        shadowed = {"loss": "the inner loss 'loss'", "logit": "'logit' (the input of gate formulas)"}
        if m is not None:
            shadowed[m.name] = f"the model {_q(m.name)}"
            shadowed.setdefault(m.arg, f"the model's argument {_q(m.arg)}")
        if t in shadowed:
            self.bad_names.add(t)
            self.d.error(f"the temporary {_q(t)} would shadow {shadowed[t]}", tsp,
                         hint="give the temporary a name of its own, e.g. g", code="E-temp-shadow")
            return
        prob = identifier_problem(t, self.spec.name)
        if prob is not None:
            self.bad_names.add(t)
            self.d.error(f"temporary name {_q(t)} {prob[0]}", tsp, hint=prob[1], code="E-identifier")
            return
        if t in temps:
            first = temps[t].target_span or temps[t].span
            where = f" (line {first.line})" if first is not None else ""
            self.d.error(f"the temporary {_q(t)} is assigned twice{where}; a temporary is assigned once per token",
                         tsp, hint=f"give the second value a new name (e.g. {t}2), or declare {t} under state "
                                   "to update it in place", code="E-temp-twice")
            return
        temps[t] = st

    def updates(self) -> None:
        spec = self.spec
        temps: dict = {}
        for st in spec.update:
            kind = self.first_kind.get(st.target)
            tsp = st.target_span or st.span
            if st.target in self.dup_names:
                continue  # reported as a duplicate
            if kind is None:
                self.temporary(st, tsp, temps)
                continue
            if kind != "state":
                self.d.error(f"{_q(st.target)} is a {kind}; update statements assign states or new temporaries",
                             tsp, hint="a temporary needs a name of its own; a value carried from token to token "
                                       "is declared under state", code="E-target")
                continue
            st_decl = spec.state.get(st.target)
            v = st.value
            is_append = isinstance(v, Call) and v.fn == "append"
            if st_decl is not None and st_decl.cache:
                if not is_append:
                    self.d.error(f"the cache {_q(st.target)} is only updated as {st.target} = append({st.target}, k)",
                                 v.span or st.span, hint="a cache grows by one vector per token", code="E-cache")
                elif v.args and isinstance(v.args[0], Name) and v.args[0].id != st.target:
                    self.d.error(f"append onto {_q(v.args[0].id)} assigned to {_q(st.target)}",
                                 v.args[0].span or v.span, hint=f"write {st.target} = append({st.target}, k)",
                                 code="E-cache")
            # append anywhere but the top of a cache statement
            for x in v.walk():
                if isinstance(x, Call) and x.fn == "append" and not (x is v and st_decl is not None and st_decl.cache):
                    if x is v and st_decl is not None and not st_decl.cache:
                        continue  # reported by shapes: not a cache
                    self.d.error("append(K, k) is only allowed as a whole statement K = append(K, k)",
                                 x.fn_span or x.span, hint="a cache grows by one vector per token", code="E-cache")
        for where, e in self.other_exprs():
            for x in e.walk():
                if isinstance(x, Call) and x.fn == "append":
                    self.d.error(f"append(K, k) is only allowed as an update statement K = append(K, k), not in {where}",
                                 x.fn_span or x.span, code="E-cache")

    def other_exprs(self):
        spec = self.spec
        for n, gt in spec.gates.items():
            yield f"gate {n}", gt.formula
        for n, e in spec.let.items():
            yield f"let {n}", e
        if spec.model is not None:
            yield "the model", spec.model.body
        if spec.loss is not None:
            yield "the loss", spec.loss
        yield "the read", spec.read

    def loss_scalar(self) -> None:
        """grad of a non-scalar loss."""
        spec = self.spec
        if spec.loss is None or not any(isinstance(x, Call) and x.fn == "grad"
                                        for st in spec.update for x in st.value.walk()):
            return
        shape = next((self.g.nodes[n]["shape"] for n in self.g.nodes if self.g.nodes[n]["op"] == "loss"), ())
        if shape:
            self.d.error(f"grad needs a scalar loss; the loss has shape [{', '.join(shape)}]", spec.loss.span,
                         hint="reduce it, e.g. sum((f(k) - v)^2) or mean(...)", code="E-grad")

    def grad_dependence(self) -> None:
        spec = self.spec
        if spec.loss is None:
            return
        used = {x.id for x in spec.loss.walk() if isinstance(x, Name)}
        if spec.model is not None and any(isinstance(x, Call) and x.fn == spec.model.name for x in spec.loss.walk()):
            used |= set(spec.model_states())
        for st in spec.update:
            for x in st.value.walk():
                if (isinstance(x, Call) and x.fn == "grad" and len(x.args) == 2 and isinstance(x.args[1], Name)
                        and x.args[1].id in spec.state and not spec.state[x.args[1].id].cache
                        and x.args[1].id not in used):
                    w = x.args[1].id
                    self.d.warning(f"the loss does not depend on {_q(w)}; grad(loss, {w}) is always zero",
                                   x.span, hint="the loss reaches a state through the model or by naming it",
                                   code="W-grad-zero")

    # ------------------------------------------------------------ states
    def states(self) -> None:
        spec, g = self.spec, self.g
        written = {st.target for st in spec.update}
        for n in spec.state:
            if n in self.bad_names or self.first_kind.get(n) != "state" or self.unknown_target:
                continue
            if n not in written:
                temps = [t for t in written if t not in spec.state and self.first_kind.get(t) is None]
                near = did_you_mean(n, temps)
                hint = (f"the update assigns the temporary {near[len('did you mean '):-1]}: a typo for {n}?"
                        if near else f"add an update statement `{n} = ...`; a learned tensor that the memory does not "
                                     "change is a param")
                self.d.error(f"state {_q(n)} is never written", self.span("state", n), hint=hint,
                             code="E-state-unwritten")
        if self.expression_errors():
            return  # the graph is incomplete; what reaches the output is not known
        reach = {n: nx.descendants(g, f"state_in:{n}") for n in spec.state if f"state_in:{n}" in g}
        live = {n for n, r in reach.items() if "output" in r}
        changed = True
        while changed:
            changed = False
            for n, r in reach.items():
                if n not in live and any(f"state_out:{m}" in r for m in live):
                    live.add(n)
                    changed = True
        for n in spec.state:
            if n in live or n in self.bad_names or self.first_kind.get(n) != "state" or n not in reach:
                continue
            succ = set(g.successors(f"state_in:{n}")) - {f"state_out:{n}"}
            named = any(isinstance(x, Name) and x.id == n for e in self.all_exprs() for x in e.walk())
            if not succ and named:
                # a per-token temporary (e.g. g = grad(loss, W); W = W - eta * g): legal, but carried for nothing
                self.d.warning(f"state {_q(n)} is overwritten before it is read: its value from the previous token "
                               "is never used", self.span("state", n),
                               hint=f"for a per-token temporary, remove the state declaration: an update "
                                    f"statement `{n} = ...` without a state binds a temporary",
                               code="W-state-temporary")
            elif not succ:
                self.d.error(f"state {_q(n)} is never read", self.span("state", n),
                             hint="use it in the model, an update or the read, or remove it", code="E-state-unread")
            else:
                self.d.error(f"state {_q(n)} is never read by the output: its value does not reach the read",
                             self.span("state", n),
                             hint="use it in the model or the read (directly or through another state), or remove it",
                             code="E-state-unread")

    # ------------------------------------------------------------ unused
    def unused(self) -> None:
        spec, g = self.spec, self.g
        prefix = {"constant": "const", "view": "view", "gate": "gate", "param": "param", "let": "let"}
        for section, word in SECTIONS:
            if word in ("dim", "state"):
                continue
            for n in getattr(spec, section):
                nid = f"{prefix[word]}:{n}"
                if n in self.bad_names or self.first_kind.get(n) != word or nid not in g:
                    continue
                if g.out_degree(nid) == 0:
                    self.d.warning(f"{word} {_q(n)} is never used", self.span(section, n),
                                   hint="remove it, or use it", code="W-unused")
        used_dims = set(LAYER_DIMS)
        for v in spec.views.values():
            used_dims.add(v.dim)
        for sec in (spec.params, spec.state):
            for x in sec.values():
                used_dims.update(x.shape)
        for e in self.all_exprs():
            used_dims.update(x.id for x in e.walk() if isinstance(x, Name))
        for n in spec.dims:
            if n not in used_dims and n not in self.bad_names and self.first_kind.get(n) == "dim":
                self.d.warning(f"dim {_q(n)} is never used", self.span("dims", n), hint="remove it, or use it",
                               code="W-unused")
        for nid in g.nodes:
            a = g.nodes[nid]
            if a["role"] == "temp" and a.get("version") == 1 and g.out_degree(nid) == 0:
                t = a["target"]
                self.d.warning(f"the temporary {_q(t)} is never used", a.get("target_span") or a.get("span"),
                               hint="a temporary is visible only to later update statements; use it there, "
                                    "or remove it", code="W-temp-unused")
        if spec.model is not None and not any(g.nodes[n]["op"] == "apply" for n in g.nodes):
            self.d.warning(f"the model {spec.model.name} is never applied", spec.model.name_span or spec.model.span,
                           hint=f"apply it in the loss or the read, e.g. {spec.model.name}(q)", code="W-unused")
        if spec.loss is not None and not any(g.nodes[n]["op"] == "loss" for n in g.nodes):
            self.d.warning("the loss is never used: no update statement takes grad(loss, ...)", spec.loss.span,
                           hint="remove it, or write an update like W = W - eta * grad(loss, W)", code="W-unused")

    def sizes(self) -> None:
        """Parameters and state that could not be allocated (memspec.check.sizes)."""
        for message, path in size_problems(self.spec):
            self.d.error(message, self.span(*path) or self.span("dims"),
                         hint="lower the dims (memspec.build(spec, d_k=...) sets them at build time)", code="E-size")

    def blocks(self) -> None:
        """Block updates (``every C``): each gradient they sum must be written in the statement."""
        spec = self.spec
        every = frequencies(spec)
        if all(c == 1 for c in every.values()):
            return
        try:
            block_statements(spec, every)
        except NotBlockwise as err:
            self.d.error(err.problem, self.span("state", err.target, "every") or self.span("update"),
                         hint=err.hint, code="E-every")

    def log_states(self) -> None:
        """``log(S)`` needs S > 0 from the first token on."""
        spec = self.spec
        for e in self.all_exprs():
            for c in e.walk():
                if isinstance(c, Call) and c.fn == "log" and c.args and isinstance(c.args[0], Name) \
                        and c.args[0].id in spec.state:
                    st = spec.state[c.args[0].id]
                    init = st.init if isinstance(st.init, str) else str(st.init)
                    if isinstance(st.init, str):   # (a validated spec: the init parses)
                        d = parse_init(st.init)
                        nonpositive = d["kind"] in ("zeros", "eye", "normal") or (
                            d["kind"] == "uniform" and d["lo"] <= 0)
                    else:
                        nonpositive = float(st.init) <= 0
                    if nonpositive:
                        self.d.warning(f"log({c.args[0].id}) of a state initialised with {init}, which has zero or "
                                       "negative entries: log gives -inf or NaN at the first token",
                                       c.span or self.span("state", c.args[0].id),
                                       hint="start it positive, e.g. init: ones or learned(uniform(0.5, 1.5))",
                                       code="W-log-state")

    def all_exprs(self) -> Iterable[Expr]:
        for _, e in self.other_exprs():
            yield e
        for st in self.spec.update:
            yield st.value

    def expression_errors(self) -> bool:
        return any(d.severity == "error" and d.code in _EXPRESSION_CODES for d in self.d.items)

    def run(self) -> list[Diagnostic]:
        self.identifiers()
        self.dims_in_shapes()
        self.d.extend(self.g.graph.get("diagnostics", []))
        self.gates()
        self.model_scope()
        self.lets()
        self.cycles()
        self.updates()
        self.loss_scalar()
        self.states()
        self.sizes()
        self.blocks()
        # warnings only for an otherwise valid spec: with errors they are mostly echoes
        if not self.d.errors:
            self.grad_dependence()
            self.unused()
            self.log_states()
        return _dedupe(sorted_diagnostics(self.d.items))


_EXPRESSION_CODES = frozenset({"E-unknown-name", "E-unknown-function", "E-arity", "E-shape", "E-grad",
                               "E-cache", "E-cycle", "E-unknown-dim"})


def _q(name: str) -> str:
    """A name quoted for messages; odd names are shown with their escapes."""
    if isinstance(name, str) and name.isprintable() and "'" not in name and len(name) <= MAX_QUOTED_CHARS:
        return f"'{name}'"
    return quote(name)


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    seen, out = set(), []
    for d in diags:
        key = (d.severity, d.message, d.span, d.code)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def check(spec) -> tuple[nx.DiGraph, list[Diagnostic]]:
    """Lower ``spec`` and verify it: the graph and every diagnostic (errors and
    warnings, sorted by position).  The spec is valid when no diagnostic is an error."""
    too_large = inlined_problems(spec)
    if too_large:   # checked first: lowering and every later phase inline
        return nx.DiGraph(), [Diagnostic("error", m, sp, "name fewer, smaller steps; memspec inlines lets, "
                                         "temporaries and the model", "E-limit") for m, sp in too_large]
    graph = lower(spec)
    return graph, _Checker(spec, graph).run()


def errors_of(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    return [d for d in diags if d.severity == "error"]


__all__ = ["RESERVED_NAMES", "check", "errors_of", "identifier_problem"]
