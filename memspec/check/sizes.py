"""Sizes: the bytes a spec's parameters and state take, refused when they cannot be allocated.

``tensors(spec, dims)`` lists what the generated module allocates for one sequence
(float32, batch 1): the layer's projections, the memory's params and learned initial
states, the state itself, the wiring's attention and persistent tokens.  A tensor over
``MAX_TENSOR_BYTES`` or a total over ``MAX_TOTAL_BYTES`` is an error that names the
bytes: ``memspec check`` reports it at the declaration, ``memspec.build`` with dims that
are too large raises ``ValueError`` before anything is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..lang.limits import MAX_TENSOR_BYTES, MAX_TOTAL_BYTES

BYTES_PER_VALUE = 4  # float32
DEFAULT_HEADS, DEFAULT_D_MODEL = 1, 64   # the generated modules' defaults when the spec has no such dim


@dataclass(frozen=True)
class Tensor:
    label: str            # "state W", "param ln_w", "view projection q", ...
    path: tuple           # where it is declared in the spec (for the span)
    factors: tuple        # ((name, size), ...): its shape

    @property
    def bytes(self) -> int:
        return prod(n for _, n in self.factors) * BYTES_PER_VALUE


def _gib(n: int) -> str:
    return f"{n / 2**30:.0f} GiB" if n >= 2**30 else f"{n:,} bytes"


def tensors(spec, dims: dict | None = None, wiring: dict | None = None) -> list[Tensor]:
    """The tensors of ``spec`` with its dims (``dims`` override them; unknown dims are left
    out: the verifier reports them)."""
    d = {**spec.dims, **(dims or {})}
    H = ("heads", d.get("heads", DEFAULT_HEADS))
    M = ("d_model", d.get("d_model", DEFAULT_D_MODEL))

    def shape(names) -> tuple | None:
        if any(n not in d or not isinstance(d[n], int) for n in names):
            return None
        return tuple((n, d[n]) for n in names)

    out: list[Tensor] = []
    for v, view in spec.views.items():
        s = shape([view.dim])
        if s is not None:
            out.append(Tensor(f"the projection of view {v}", ("views", v), (M, H, *s)))
    for g in spec.gates:
        out.append(Tensor(f"the projection of gate {g}", ("gates", g), (M, H)))
    for p, prm in spec.params.items():
        s = shape(prm.shape)
        if s is not None:
            out.append(Tensor(f"param {p}", ("params", p), (H, *s)))
    for name, st in spec.state.items():
        s = shape(st.shape)
        if s is None or st.cache:   # a cache grows with the sequence, from empty
            continue
        out.append(Tensor(f"state {name}", ("state", name), (("batch", 1), H, *s)))
        if st.learned:
            out.append(Tensor(f"the learned initial {name}", ("state", name), (H, *s)))
    w = {"segment": spec.wiring.segment, "window": spec.wiring.window,
         "persistent": spec.wiring.persistent, **(wiring or {})}
    if spec.wiring.kind != "none":
        out.append(Tensor("the wiring's attention projections", ("wiring",), (("4", 4), M, M)))
        out.append(Tensor("the wiring's persistent tokens", ("wiring",), (("persistent", w["persistent"]), M)))
    return out


def size_problems(spec, dims: dict | None = None, wiring: dict | None = None) -> list[tuple[str, tuple]]:
    """(message, spec path) for each tensor too large to allocate, and for the total."""
    ts = tensors(spec, dims, wiring)
    problems = []
    for t in ts:
        if t.bytes > MAX_TENSOR_BYTES:
            formula = " × ".join(f"{n} {v}" if not n.isdigit() else n for n, v in t.factors)
            problems.append((f"{t.label} needs {t.bytes:,} bytes ({formula} × {BYTES_PER_VALUE} bytes); "
                             f"one tensor is at most {MAX_TENSOR_BYTES:,} bytes ({_gib(MAX_TENSOR_BYTES)})", t.path))
    total = sum(t.bytes for t in ts)
    if not problems and total > MAX_TOTAL_BYTES:
        problems.append((f"the parameters and state need {total:,} bytes together; at most "
                         f"{MAX_TOTAL_BYTES:,} bytes ({_gib(MAX_TOTAL_BYTES)})", ("dims",)))
    return problems
