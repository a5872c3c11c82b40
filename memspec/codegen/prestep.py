"""The state-independent part of a dual-form chunk step (see :mod:`.dual`).

The chunk step's lines that read no state -- the update's token-local coefficients, the
decay matrices built from the gates, the ``[C, C]`` score products of the inputs alone --
do not depend on the chunk's position in the recurrence: ``_forward_minibatch`` runs them
once for all full chunks, stacked on the batch axis (``_chunk_pre``), and the sequential
loop runs the rest (``_chunk_step``).  The split is made on the statements as the writer
recorded them (:class:`.text.Statement`: the locals each binds and reads, never its text): a
statement is state-dependent when it reads a state or a state-dependent local; the others go
to ``_chunk_pre``, except those with no batch axis (params, the chunk size, ``[C, C]``
constants), which are emitted wherever they are read.
"""
from __future__ import annotations

from ..lang.expr import Call, Name
from .text import shape_text, tuple_text


def expr_reads(em, e) -> set:
    """The locals and inputs the code ``em`` writes for the expression ``e`` reads (its names as
    ``em`` writes them; params, dims and constants read through ``self`` or as literals are
    not locals)."""
    spec, out = em.spec, set()
    for n in e.walk():
        if isinstance(n, Name):
            if n.id in em.names:
                out.add(em.names[n.id])
            elif n.id in em.scope or not (n.id in spec.dims or n.id in spec.constants or n.id in spec.params):
                out.add(n.id)
        elif isinstance(n, Call) and n.fn == "eye" and em.like:
            out.add(em.like)
        elif isinstance(n, Call) and spec.model is not None and n.fn == spec.model.name:
            out |= {em.names.get(s, s) for s in spec.model_states()}
    return out


def classify(records: list, carried: list, inputs: list, free: set) -> list:
    """Each statement with its kind: (lines, targets, names read, kind), kind ``state`` (it
    returns, or reads a state or a state-dependent local), ``free`` (no batch axis: it binds
    only ``free`` locals or reads nothing batched) or ``pre``."""
    stmts = []
    dep = set(carried)      # the locals that depend on a state
    batched = set(inputs)   # the locals with a batch axis
    for rec in records:
        targets, reads = set(rec.targets), set(rec.reads)
        if rec.returns or reads & dep:
            kind = "state"
            dep |= targets
        elif (targets and targets <= free) or not reads & batched:
            kind = "free"   # no batch axis: emitted where it is read
        else:
            kind = "pre"
            batched |= targets
        stmts.append((list(rec.lines), targets, reads, kind))
    return stmts


def split_pre(w, free: set, L, header: str, doc: list, body, carried: list, inputs: list):
    """Re-emit the chunk step (its ``header`` line, docstring lines ``doc`` and ``body``, a
    recording :class:`.text.Lines`) as two methods: ``_chunk_pre``, its statements that
    read no state (gate weights, decay matrices, products of the inputs alone), which
    ``_forward_minibatch`` runs once for all full chunks stacked on the batch axis, and
    ``_chunk_step``, the rest, taking those locals.  ``free``: the locals with no batch axis
    (params, C, [C, C] constants), emitted where they are read.  Returns (the inputs of
    ``_chunk_pre``, its outputs, the inputs of ``_chunk_step``), or None (all lines kept)."""
    stmts = classify(body.records, carried, inputs, free)

    def closure(seed: set, kinds: tuple) -> list:
        """The statements of ``kinds`` that ``seed`` needs, and what they need, in order."""
        want, keep = set(seed), []
        for st in reversed(stmts):
            if st[3] in kinds and st[1] & want:
                keep.append(st)
                want |= st[2]
        return keep[::-1]

    core = [st for st in stmts if st[3] == "state"]
    core_reads = set().union(*(st[2] for st in core))
    pre_targets = set().union(*(st[1] for st in stmts if st[3] == "pre"))
    outs = [t for st in stmts if st[3] == "pre" for t in sorted(st[1]) if t in core_reads]
    if not outs:
        L.lines.extend([header, *doc, *body.lines, ""])
        return None
    core = closure(core_reads - pre_targets, ("free",)) + core
    core = sorted(core, key=stmts.index)
    pre = closure(set(outs), ("pre", "free"))
    reads_of = (lambda sts: set().union(*(st[2] for st in sts)))
    pre_in = [x for x in inputs if x in reads_of(pre)]
    core_in = [x for x in inputs if x in reads_of(core)]

    def shapes(xs):
        return ", ".join(shape_text("B, H, C", w.shape(Name(x))).replace("[", f"{x} [", 1) for x in xs)

    L(f"def _chunk_pre(self, {', '.join(pre_in)}):")
    with L.indent():
        L('"""' + "What the dual-form chunk step reads that depends on no state (gate weights, decay")
        L("matrices, products of the inputs alone), for one chunk or any number of chunks stacked on")
        L("the batch axis (every line is local to a batch row): " + shapes(pre_in) + ".")
        L("Returns the locals `_chunk_step` takes after its inputs.")
        L('"""')
    L.lines.extend(ln for st in pre for ln in st[0])
    with L.indent():
        L(f"return {tuple_text(outs)}")
    L()
    L(f"def _chunk_step(self, {', '.join(carried + core_in + outs)}):")
    with L.indent():
        L('"""' + "One mini-batch chunk of C tokens in the dual form, head-major: " + shapes(core_in) + ";")
        L(", ".join(outs) + ": its state-independent part (`_chunk_pre`);")
        L.lines.extend(doc[1:-1])
        L('"""')
    L.lines.extend(ln for st in core for ln in st[0])
    L()
    return pre_in, outs, core_in
