"""The declaration checks: every declared name a safe identifier, declared once, not hidden by
the model; every dim a shape names declared."""
from __future__ import annotations

import builtins
import keyword
import re
from typing import Optional

from ..lang.errors import Span, did_you_mean
from ..lang.expr import FUNCTIONS
from ..lang.limits import MAX_NAME_CHARS
from ..lang.names import RESERVED_NAMES, class_names, runtime_names, shadows_module
from .context import SECTIONS, CheckContext, quoted

IDENT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
BUILTIN_NAMES = frozenset(n for n in dir(builtins))


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



def identifiers(cx: CheckContext) -> None:
    spec = cx.spec
    if keyword.iskeyword(spec.name):
        cx.d.error(f"the spec name '{spec.name}' is a Python keyword", cx.span("name"),
                   hint="the compiled module is compiled/<name>.py; choose another name", code="E-identifier")
    elif shadows_module(spec.name):
        cx.d.error(f"the spec name '{spec.name}' is the name of a Python module", cx.span("name"),
                   hint=f"compiled/{spec.name}.py would shadow the module {spec.name} for code run in that "
                        f"folder; choose another name", code="E-identifier")
    seen: dict[str, tuple[str, Optional[Span]]] = {}
    for section, word in SECTIONS:
        for n in getattr(spec, section):
            sp = cx.span(section, n)
            prob = identifier_problem(n, spec.name)
            if prob is not None:
                cx.bad_names.add(n)
                cx.d.error(f"{word} name {quoted(n)} {prob[0]}", sp, hint=prob[1], code="E-identifier")
            if n in seen:
                cx.dup_names.add(n)
                kind, first = seen[n]
                where = ""
                if first is not None:
                    where = f" at line {first.line}" if sp is None or first.file == sp.file else \
                        f" at {first.file}:{first.line}"
                cx.d.error(f"{quoted(n)} is declared twice: as a {kind}{where} and as a {word}", sp,
                           hint="every name is declared once across dims, constants, views, gates, params, "
                                "state and let", code="E-duplicate")
            else:
                seen[n] = (word, sp)
                cx.first_kind[n] = word
    m = spec.model
    if m is None:
        return
    for what, n, sp in (("model name", m.name, m.name_span), ("model argument", m.arg, m.arg_span)):
        prob = identifier_problem(n, spec.name)
        if prob is not None:
            cx.bad_names.add(n)
            cx.d.error(f"{what} {quoted(n)} {prob[0]}", sp or m.span, hint=prob[1], code="E-identifier")
        elif n in seen:
            kind, first = seen[n]
            where = f" (line {first.line})" if first is not None else ""
            verb = "shadows" if what == "model argument" else "is also"
            cx.d.error(f"the {what} {quoted(n)} {verb} the {kind} {quoted(n)}{where}", sp or m.span,
                       hint="give it a name of its own, e.g. f(u)" if what == "model argument" else
                       "name the model differently, e.g. f", code="E-shadow")
    if m.name == m.arg:
        cx.d.error(f"the model argument {quoted(m.arg)} has the model's own name", m.arg_span or m.span,
                   hint="write e.g. f(u)", code="E-shadow")


def dims_in_shapes(cx: CheckContext) -> None:
    spec = cx.spec
    dims = list(spec.dims)

    def need(d, sp, what):
        if d not in spec.dims:
            hint = did_you_mean(d, dims) or (("dims: " + ", ".join(dims)) if dims else "declare it under dims")
            cx.d.error(f"unknown dim {quoted(d)} in {what}", sp, hint=hint, code="E-unknown-dim")

    for n, v in spec.views.items():
        need(v.dim, spec.span("views", n, "dim") or spec.span("views", n), f"the width of view {n}")
    for section, word in (("gates", "gate"), ("params", "param"), ("state", "state")):
        for n, x in getattr(spec, section).items():
            for i, d in enumerate(x.shape):
                sp = spec.span(section, n, "shape", i) or spec.span(section, n, "shape") or cx.span(section, n)
                need(d, sp, f"the shape of {word} {n}")
