"""Family ``cache``: softmax attention over caches, served exactly by
``scaled_dot_product_attention`` with a causal (windowed) mask.

Admitted when every state is a cache written only by ``K = append(K, x)`` of a
token-local vector (once per token), the read attends over the caches with a token-local
query and a token-local scalar scale (a number, or e.g. a learned per-head temperature:
``softmax(s K q) = softmax(K (s q))``, so the scale can multiply the query), and the write
comes before the read.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Transpose
from .algebra import Algebra, NotAdmitted, txt


@dataclass(frozen=True)
class CachePlan:
    """The appends as written in the spec, and the read with each attend(...) a placeholder."""

    appends: tuple[tuple[str, Expr], ...]          # (cache, token-local vector)
    attends: tuple[tuple[str, Expr, str, str, Expr], ...]  # (placeholder, q, K, V, scale)
    read: Expr                                      # read with attend(...) replaced by placeholders
    windows: dict                                   # cache -> window (None: growing)
    inclusive: bool


def analyse_cache(alg: Algebra) -> tuple[CachePlan, list[str]]:
    spec = alg.spec
    if not alg.states or alg.caches != set(alg.states):
        tensor = sorted(set(alg.states) - alg.caches)
        raise NotAdmitted(f"state {', '.join(tensor)} is a tensor, not a cache" if len(tensor) == 1 else
                          f"states {', '.join(tensor)} are tensors, not caches")
    if spec.order != "write_read":
        raise NotAdmitted("the read comes before the write (read_write): the first token would attend "
                          "over an empty cache")
    appends = []
    for stmt in spec.update:
        tgt, e = stmt.target, stmt.value
        if not (isinstance(e, Call) and e.fn == "append" and isinstance(e.args[0], Name) and e.args[0].id == tgt):
            raise NotAdmitted(f"the update of {tgt} is not {tgt} = append({tgt}, x)")
        if alg.depends(alg.inline(e.args[1])):
            raise NotAdmitted(f"the vector appended to {tgt} depends on a state")
        appends.append((tgt, e.args[1]))   # as written: the generated code binds the lets as locals
    written = [t for t, _ in appends]
    if sorted(written) != sorted(alg.states) or len(set(written)) != len(written):
        raise NotAdmitted("every cache must be appended to exactly once per token")
    attends = []

    def walk(e: Expr) -> Expr:
        if isinstance(e, Call) and e.fn == "attend":
            q, K, V, scale = e.args
            if not (isinstance(K, Name) and isinstance(V, Name) and K.id in alg.caches and V.id in alg.caches):
                raise NotAdmitted("attend(...) must read two caches directly")
            if alg.depends(q) or alg.depends(scale):
                raise NotAdmitted("the query and scale of attend(...) must be token-local")
            if alg.states[K.id].window != alg.states[V.id].window:
                raise NotAdmitted(f"caches {K.id} and {V.id} have different windows")
            name = f"_a{len(attends)}"
            attends.append((name, q, K.id, V.id, scale))
            return Name(name)
        if isinstance(e, Name) and e.id in alg.caches:
            raise NotAdmitted(f"the read uses cache {e.id} outside attend(...)")
        if isinstance(e, BinOp):
            return BinOp(e.op, walk(e.left), walk(e.right))
        if isinstance(e, (Neg, Transpose)):
            return type(e)(walk(e.operand))
        if isinstance(e, Call):
            return Call(e.fn, tuple(walk(a) for a in e.args))
        return e

    read = walk(alg.inline(spec.read))
    if not attends:
        raise NotAdmitted("the read does not attend over the caches")
    windows = {c: alg.states[c].window for c in alg.states if c in alg.caches}
    reasons = [
        f"every state ({', '.join(alg.states)}) is a cache written only by append of a token-local vector",
        "the read is " + ", ".join(f"attend({txt(q)}, {K}, {V}, {txt(s)})" for _, q, K, V, s in attends)
        + " of a token-local query over the caches: exact through scaled_dot_product_attention"
        + (f" with a causal window of {sorted(set(w for w in windows.values() if w))} tokens"
           if any(windows.values()) else " with a causal mask"),
    ]
    plan = CachePlan(tuple(appends), tuple(attends), read, windows, spec.order == "write_read")
    return plan, reasons
