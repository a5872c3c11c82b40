"""The typed spec: pydantic v2 models (frozen, ``extra="forbid"``).

A :class:`Spec` is what both frontends (YAML, `.mem`) produce.  Expressions are
AST values from :mod:`memspec.expr`; a plain string is accepted and parsed, so
``Spec(read="f(q)", ...)`` works from Python too.

Layout conventions (shared by every phase): views ``[B, T, H, D]``, gates
``[B, T, H]`` (a per-channel gate ``[B, T, H, *shape]``), state ``[B, H, *shape]``.  Shapes in a spec are written in named
dims and exclude the batch and head axes.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from .expr import Assign, Expr, FunDef, Name, parse_expr, parse_fundef, parse_stmt
from .limits import MAX_NAME_CHARS, MAX_NS_STEPS, MAX_NUMBER_CHARS, MAX_SIZE, quote


def _as_expr(v: Any) -> Any:
    if isinstance(v, str):
        return parse_expr(v)
    if isinstance(v, bool):
        raise ValueError("expected an expression, got a boolean")
    if isinstance(v, (int, float)):
        return parse_expr(repr(v) if isinstance(v, float) else str(v))
    return v


def _as_stmt(v: Any) -> Any:
    return parse_stmt(v) if isinstance(v, str) else v


def _as_fundef(v: Any) -> Any:
    return parse_fundef(v) if isinstance(v, str) else v


ExprField = Annotated[Expr, BeforeValidator(_as_expr)]
StmtField = Annotated[Assign, BeforeValidator(_as_stmt)]
FunDefField = Annotated[FunDef, BeforeValidator(_as_fundef)]


def _as_shape(v: Any) -> Any:
    if isinstance(v, str):
        s = v.strip()
        if not (s.startswith("[") and s.endswith("]")):
            raise ValueError(f"a shape is written in dims, like [d_k, d_v]; got {quote(v)}")
        inner = s[1:-1].strip()
        return [p.strip() for p in inner.split(",")] if inner else []
    return v


Shape = Annotated[list[str], BeforeValidator(_as_shape)]


def _what(v: Any) -> str:
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, str):
        return f"text ({quote(v)})"
    if v is None:
        return "nothing (null)"
    return type(v).__name__


def _size(v: Any) -> Any:
    """A size (dims, chunk, window, segment, persistent): an integer, never a boolean, a float
    or text, at most MAX_SIZE."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {_what(v)}")
    if v > MAX_SIZE:
        raise ValueError(f"{v if len(str(v)) <= 20 else 'the value'} is too large: a size is at most {MAX_SIZE}")
    return v


def _number(v: Any) -> Any:
    """A number (constants, gate biases): an int or float, or text that is one (YAML 1.1 reads
    ``1e-6``, without a dot, as text); never a boolean."""
    if isinstance(v, str) and len(v) <= MAX_NUMBER_CHARS:
        try:
            return float(v)
        except ValueError:
            pass
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"expected a number, got {_what(v)}")
    return v


def _constant(v: Any) -> Any:
    """A constant: a number, or a Newton-Schulz coefficient schedule -- a list of ``(a, b, c)``
    triples, one per iteration of ``newton_schulz(X, schedule)`` (kept as a tuple of tuples)."""
    if isinstance(v, (list, tuple)):
        if not 1 <= len(v) <= MAX_NS_STEPS:
            raise ValueError(f"a coefficient schedule has 1 to {MAX_NS_STEPS} (a, b, c) triples, got {len(v)}")
        rows = []
        for item in v:
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise ValueError(f"a coefficient schedule is a list of (a, b, c) triples, got {_what(item)}")
            row = tuple(float(_number(x)) for x in item)
            if not all(math.isfinite(x) for x in row):
                raise ValueError("the coefficients of a schedule must be finite")
            rows.append(row)
        return tuple(rows)
    return _number(v)


def is_schedule(value: Any) -> bool:
    """Is a constant's value a Newton-Schulz coefficient schedule (not a number)?"""
    return isinstance(value, tuple)


Size = Annotated[int, BeforeValidator(_size)]
Number = Annotated[float, BeforeValidator(_number)]
Constant = Annotated[Union[float, tuple[tuple[float, float, float], ...]], BeforeValidator(_constant)]

_NUM = r"[0-9.eE+-]+"
INIT_RE = re.compile(
    rf"^(?:(?P<kind>zeros|ones|eye)|normal\((?P<std>{_NUM})\)|uniform\((?P<lo>{_NUM}),(?P<hi>{_NUM})\)"
    rf"|learned(?:\((?P<inner>zeros|ones|eye|normal\({_NUM}\)|uniform\({_NUM},{_NUM}\))\))?)$"
)


def parse_init(text: str) -> dict:
    """``"learned(normal(0.02))"`` -> ``{"learned": True, "kind": "normal", "std": 0.02}``;
    ``"uniform(0.5, 1.5)"`` -> ``{"learned": False, "kind": "uniform", "std": None, "lo": 0.5, "hi": 1.5}``."""
    s = text.replace(" ", "")
    m = INIT_RE.match(s)
    if not m:
        raise ValueError(
            f"unknown init {quote(text)}: use zeros, ones, eye, normal(std), uniform(lo, hi), learned or "
            f"learned(<init>)"
        )
    if s.startswith("learned"):
        inner = m.group("inner") or "normal(0.02)"
        out = parse_init(inner)
        out["learned"] = True
        return out
    if m.group("kind"):
        return {"learned": False, "kind": m.group("kind"), "std": None}
    if m.group("lo") is not None:
        lo, hi = (float(x) if len(x) <= MAX_NUMBER_CHARS else math.nan for x in (m.group("lo"), m.group("hi")))
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"uniform(lo, hi) needs finite lo < hi, got {quote(m.group('lo'))} and "
                             f"{quote(m.group('hi'))}")
        return {"learned": False, "kind": "uniform", "std": None, "lo": lo, "hi": hi}
    try:
        std = float(m.group("std")) if len(m.group("std")) <= MAX_NUMBER_CHARS else math.nan
    except ValueError:
        raise ValueError(f"normal(std) needs a number, got {quote(m.group('std'))}") from None
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"normal(std) needs a finite std >= 0, got {quote(m.group('std'))}")
    return {"learned": False, "kind": "normal", "std": std}


def init_text(d: dict) -> str:
    """The canonical text of a parsed init (the inverse of :func:`parse_init`)."""
    if d["kind"] == "normal":
        base = f"normal({d['std']!r})"
    elif d["kind"] == "uniform":
        base = f"uniform({d['lo']!r}, {d['hi']!r})"
    else:
        base = d["kind"]
    return f"learned({base})" if d["learned"] else base


def _canonical_init(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"expected an init (zeros, ones, eye, normal(std), learned), got {_what(v)}")
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, str):
        return init_text(parse_init(v))
    return v


SCHEDULE_RE = re.compile(r"^(auto|online|chunk\((\d+)\)|minibatch\((\d+)\)|apply_update\((\d+)\))$")


class Node(BaseModel):
    """Base: frozen, no extra keys.  Equality compares fields only (never source spans)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and all(
            getattr(self, f) == getattr(other, f) for f in type(self).model_fields
        )

    __hash__ = None  # type: ignore[assignment]


class View(Node):
    """A per-token projection of the layer input: ``[B, T, H, dim]``."""

    dim: str


class Gate(Node):
    """A per-token gate per head: ``formula`` of ``logit = x @ w + bias``.

    A scalar per head, ``[B, T, H]``, or with ``shape: [d]`` a vector per head and channel,
    ``[B, T, H, d]`` (``logit`` then has the gate's shape: ``heads * d`` projections of x)."""

    formula: ExprField = Field(default_factory=lambda: parse_expr("sigmoid(logit)"))
    shape: Shape = Field(default_factory=list)
    bias: Number = 0.0


class Param(Node):
    """A learned outer-loop tensor per head, ``[H, *shape]`` (e.g. LayerNorm weight)."""

    shape: Shape = Field(default_factory=list)
    init: Union[float, str] = "zeros"

    @field_validator("init", mode="before")
    @classmethod
    def _canon(cls, v):
        return _canonical_init(v)


class State(Node):
    """A fast-weight tensor ``[B, H, *shape]``, or a cache of past vectors ``[B, H, n, *shape]``."""

    shape: Shape
    init: str = "zeros"
    cache: bool = False
    window: Optional[Size] = None
    every: Optional[Size] = None     # update frequency: one block update every `every` tokens

    @field_validator("init", mode="before")
    @classmethod
    def _canon(cls, v):
        return _canonical_init(v)

    @field_validator("window")
    @classmethod
    def _window_positive(cls, v):
        if v is not None and v < 1:
            raise ValueError("window must be a positive number of tokens")
        return v

    @field_validator("every")
    @classmethod
    def _every_positive(cls, v):
        if v is not None and v < 1:
            raise ValueError("every must be a positive number of tokens")
        return v

    @model_validator(mode="after")
    def _cache_rules(self):
        if self.window is not None and not self.cache:
            raise ValueError("window is only meaningful for a cache state (cache: true)")
        if self.every is not None and self.cache:
            raise ValueError("a cache is appended to on every token; every is for learned states")
        if self.cache and self.init != "zeros":
            raise ValueError("a cache starts empty; remove its init")
        return self

    @property
    def learned(self) -> bool:
        return isinstance(self.init, str) and self.init.startswith("learned")


WIRING_OPTIONS = {"mac": ("write", "output"), "mag": ("gate",), "mal": ("residual",)}
"""Each wiring kind's own options (``qk_norm`` belongs to every kind's attention)."""


def _strict_bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    raise ValueError(f"expected true or false, got {v!r}")


StrictFlag = Annotated[bool, BeforeValidator(_strict_bool)]


class Wiring(Node):
    """How the memory is wired into a network (Titans §4): none, mac, mag or mal.

    Sizes: ``segment`` (MAC), ``window`` (MAG, MAL), ``persistent`` tokens.  Options,
    each defaulting to the paper's form (``memspec.runtime.wiring``):

    * ``qk_norm`` (every kind): l2-normalised queries and keys with a learned per-head
      temperature in the wiring's attention (true), or plain scaled dot-product (false);
    * ``write`` (MAC): what the memory writes, the ``attention`` output (Titans Eq. 24)
      or the segment ``input``;
    * ``output`` (MAC): ``gated``, ``y * sigmoid(M(y))`` (Eq. 25), or ``additive``, ``y + M(.)``;
    * ``gate`` (MAG): ``normalized``, ``RMSNorm(y) * sigmoid(RMSNorm(M(x)))`` (Eq. 28), or
      ``convex``, ``g * y + (1 - g) * M(x)`` with a learned gate g;
    * ``residual`` (MAL): ``M(x) + SWA(M(x))`` (true) or ``SWA(M(x))`` (false).

    An option of another kind (``write`` on a MAG wiring) is an error.
    """

    kind: Literal["none", "mac", "mag", "mal"] = "none"
    segment: Size = 64
    window: Size = 64
    persistent: Size = 4
    qk_norm: StrictFlag = True
    write: Literal["attention", "input"] = "attention"
    output: Literal["gated", "additive"] = "gated"
    gate: Literal["normalized", "convex"] = "normalized"
    residual: StrictFlag = True

    @field_validator("segment", "window")
    @classmethod
    def _positive(cls, v):
        if v < 1:
            raise ValueError("must be a positive number of tokens")
        return v

    @field_validator("persistent")
    @classmethod
    def _nonneg(cls, v):
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("qk_norm")
    @classmethod
    def _attention_option(cls, v, info):
        if info.data.get("kind") == "none":        # (no kind in data: the kind itself was invalid)
            raise ValueError("qk_norm sets the wiring's attention; an unwired memory (kind none) has none")
        return v

    @field_validator("write", "output", "gate", "residual")
    @classmethod
    def _own_option(cls, v, info):
        kind = info.data.get("kind")
        owner = next(k for k, names in WIRING_OPTIONS.items() if info.field_name in names)
        if kind is not None and kind != owner:
            own = ", ".join(("qk_norm",) + WIRING_OPTIONS.get(kind, ()))
            raise ValueError(f"{info.field_name} is an option of {owner} wirings, not of {kind} "
                             f"(whose options are {own})" if kind != "none" else
                             f"{info.field_name} is an option of {owner} wirings; this memory is not wired")
        return v

    def options(self) -> dict:
        """The options this kind uses, e.g. ``{"qk_norm": True, "write": "attention", "output": "gated"}``."""
        if self.kind == "none":
            return {}
        return {"qk_norm": self.qk_norm, **{f: getattr(self, f) for f in WIRING_OPTIONS[self.kind]}}


def _as_wiring(v: Any) -> Any:
    if isinstance(v, str):
        return {"kind": v}
    if v is None:
        return {"kind": "none"}
    return v


class Spec(Node):
    """A memory layer: views, gates, state, model, loss, update program, read, schedule, wiring."""

    name: str
    description: str = ""
    cite: str = ""
    dims: dict[str, Size] = Field(default_factory=dict)
    constants: dict[str, Constant] = Field(default_factory=dict)
    views: dict[str, View] = Field(default_factory=dict)
    gates: dict[str, Gate] = Field(default_factory=dict)
    params: dict[str, Param] = Field(default_factory=dict)
    state: dict[str, State] = Field(default_factory=dict)
    let: dict[str, ExprField] = Field(default_factory=dict)
    model: FunDefField | None = None
    loss: ExprField | None = None
    update: list[StmtField] = Field(default_factory=list)
    read: ExprField
    order: Literal["write_read", "read_write"] = "write_read"
    schedule: str = "auto"
    wiring: Annotated[Wiring, BeforeValidator(_as_wiring)] = Field(default_factory=Wiring)

    # Where each field came from (path tuple -> Span); never part of equality.
    _spans: dict = PrivateAttr(default_factory=dict)
    _key_spans: dict = PrivateAttr(default_factory=dict)
    _path: str | None = PrivateAttr(default=None)

    @field_validator("views", mode="before")
    @classmethod
    def _view_shorthand(cls, v):
        if isinstance(v, dict):
            return {k: ({"dim": x} if isinstance(x, str) else x) for k, x in v.items()}
        return v

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_shorthand(cls, v):
        if isinstance(v, dict):
            return {k: ({"formula": x} if isinstance(x, (str, Expr)) else x) for k, x in v.items()}
        return v

    @field_validator("dims")
    @classmethod
    def _dims_positive(cls, v):
        for k, n in v.items():
            if n < 1:
                raise ValueError(f"dim {k} must be a positive integer, got {n}")
        return v

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_form(cls, v):
        if isinstance(v, str):
            v = v.replace(" ", "")
            m = SCHEDULE_RE.match(v)
            if not m:
                raise ValueError(f"unknown schedule {quote(v)}: use auto, online, chunk(N), minibatch(N) or "
                                 f"apply_update(N)")
            n = m.group(2) or m.group(3) or m.group(4)
            if n is not None and int(n) < 1:
                raise ValueError("a chunk size must be >= 1")
            if n is not None and (len(n) > 10 or int(n) > MAX_SIZE):
                raise ValueError(f"a chunk size is at most {MAX_SIZE}")
        return v

    @field_validator("name")
    @classmethod
    def _name_form(cls, v):
        if len(v) > MAX_NAME_CHARS:
            raise ValueError(f"a spec name is at most {MAX_NAME_CHARS} characters, got {len(v)}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", v):
            raise ValueError(
                f"a spec name is a plain identifier (letters, digits, _), got {quote(v)}"
            )
        return v

    @field_validator("description", "cite")
    @classmethod
    def _text_is_unicode(cls, v):
        for i, ch in enumerate(v):
            if "\ud800" <= ch <= "\udfff":
                raise ValueError(f"text holds a lone surrogate {ascii(ch)} at character {i + 1}, which is not a "
                                 f"character (UTF-8 cannot write it)")
        return v

    # ------------------------------------------------------------ helpers
    @property
    def schedule_kind(self) -> str:
        return self.schedule.split("(")[0]

    @property
    def schedule_size(self) -> int | None:
        m = SCHEDULE_RE.match(self.schedule)
        n = (m.group(2) or m.group(3) or m.group(4)) if m else None
        return int(n) if n else None

    def span(self, *path) -> Any:
        """The source span of a field, e.g. ``spec.span("gates", "eta")``."""
        return self._spans.get(tuple(path))

    def key_span(self, *path) -> Any:
        return self._key_spans.get(tuple(path)) or self._spans.get(tuple(path))

    @property
    def path(self) -> str | None:
        return self._path

    def with_dims(self, **dims: int) -> "Spec":
        """A copy with some dims overridden (build-time sizes)."""
        unknown = set(dims) - set(self.dims)
        if unknown:
            raise ValueError(f"unknown dims {sorted(unknown)}; this spec has {sorted(self.dims)}")
        new = self.model_copy(update={"dims": {**self.dims, **dims}})
        new._spans, new._key_spans, new._path = self._spans, self._key_spans, self._path
        return new

    def model_states(self) -> list[str]:
        """State tensors the inner model reads (in declaration order)."""
        if self.model is None:
            return []
        used = {n.id for n in self.model.body.walk() if isinstance(n, Name)}
        return [s for s in self.state if s in used]


SPEC_KEYS = tuple(Spec.model_fields)
