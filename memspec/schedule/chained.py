"""Family ``chained``: reads that chain probes -- a read that is a DAG of linear probes ``p @ S``
of several additive states with token-local functions between them, some probe vector a
function of other probes.  Gated slot attention (Zhang et al. 2024) is the case that names it:
two memories over m slots, ``K̃ <- K̃ Diag(a) + outer(k, 1 - a)`` and ``Ṽ <- Diag(a) Ṽ + outer(1 - a, v)``,
read ``softmax(q @ K̃) @ Ṽ``: the probe vector of ``Ṽ`` is a token-local function of the probe
of ``K̃``.  Only the read couples the states, so the multi-pass chunked form is exact: pass one
probes the first states for every token (a chunked kernel call each), the token-local functions
between the passes run over the whole sequence at once, pass two probes the next states with
those vectors, and so on.

Every state is additive by the normal form (:mod:`.transition`): ``S <- Diag(g) S + A`` (a scalar
or a decay per row: :func:`memspec.runtime.additive.chunk_additive`) or ``S <- S Diag(g) + A`` (a
decay per column, the output channels of its probe: :func:`memspec.runtime.chained.chunk_value_decay`),
``A`` independent of every state.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Transpose, rewrite
from .algebra import ZERO, Algebra, NotAdmitted, add, is_num, simplify, txt
from .linear import times
from .ranges import check_decay
from .transition import normal_form, side_text


@dataclass(frozen=True)
class ChainedState:
    """The state the kernels run on (``Sᵀ`` when ``transposed``: S is probed on its columns,
    ``S @ p``): ``Diag(decay_t) S_{t-1} + sum_i outer(a_i, b_i)`` (``side`` "rows": a scalar or
    one decay per row), ``S_{t-1} Diag(decay_t) + ...`` (``side`` "columns"), or a vector state
    ``z_t = decay_t * z_{t-1} + sum_i b_i * a_i``; ``decay`` None: no decay."""

    name: str
    decay: Expr | None
    side: str
    terms: tuple[tuple[Expr, Expr], ...]
    vector: bool
    transposed: bool = False


@dataclass(frozen=True)
class ChainedProbe:
    """A linear probe ``vector @ state``, replaced by ``Name(name)`` in the plan's read and in the
    vectors of later probes; ``stage`` 0 for a token-local vector, else one more than the latest
    stage of the probes its vector reads."""

    name: str
    state: str
    vector: Expr
    stage: int
    columns: bool = False   # the probe is S @ vector (it contracts the columns of a matrix state)


@dataclass(frozen=True)
class ChainedPlan:
    states: tuple[ChainedState, ...]
    probes: tuple[ChainedProbe, ...]   # in stage order: a probe's vector reads only earlier probes
    read: Expr                         # the read with every probe replaced by Name(probe.name)
    inclusive: bool                    # write_read: token t reads the state after its own write


def analyse_chained(alg: Algebra) -> tuple[ChainedPlan, list[str]]:
    """The chained family: every state additive by the normal form (a decay on one side only,
    an increment independent of every state), the read a function of linear probes whose
    vectors are token-local or token-local functions of other probes, and at least one probe
    vector that reads another probe (else one pass of probes: the additive family's form)."""
    spec = alg.spec
    read, probes = chain_probes(alg, alg.inline(spec.read), set(alg.states))
    if not any(p.stage for p in probes):
        raise NotAdmitted("no probe vector reads another probe: the read is one pass of probes (the additive "
                          "family's form), not a chain")
    nf = normal_form(alg)
    reasons, states = [], []
    for n in alg.states:
        st, why = _additive_state(alg, n, nf.maps[n])
        sides = {p.columns for p in probes if p.state == n}
        if len(sides) > 1:
            raise NotAdmitted(f"the read probes {n} on its rows (p @ {n}) and on its columns ({n} @ p): the kernels "
                              f"contract one axis of a state")
        if sides == {True}:   # S @ p is p @ Sᵀ: the kernels run on Sᵀ, the decay on the other axis
            st = ChainedState(n, st.decay, {"rows": "columns", "columns": "rows"}[st.side] if st.decay is not None
                              and alg.rank(st.decay) else st.side, tuple((b, a) for a, b in st.terms), st.vector,
                              transposed=True)
            why.append(f"the read probes {n} on its columns ({n} @ p): the kernels run on {n}ᵀ, the decay on its "
                       f"{'rows' if st.side == 'rows' else 'columns'}")
        states.append(st)
        reasons += why
    by = {p.name: BinOp("@", Name(p.state), p.vector) if p.columns else BinOp("@", p.vector, Name(p.state))
          for p in probes}

    def shown(e: Expr) -> Expr:   # probes written out again, for the reasons
        return rewrite(e, lambda x: shown(by[x.id]) if isinstance(x, Name) and x.id in by else None)

    reasons.append("only the read couples the states: it chains the probes "
                   + ", ".join(txt(shown(Name(p.name))) for p in probes)
                   + "; each probe vector is token-local or a token-local function of earlier probes")
    for stage in range(max(p.stage for p in probes) + 1):
        here = [p for p in probes if p.stage == stage]
        what = ", ".join(txt(shown(Name(p.name))) for p in here)
        reasons.append(f"pass {stage + 1}: a chunked kernel call per probe ({what}) for every token"
                       + (", after its vectors' token-local functions over the whole sequence" if stage else ""))
    for st in states:
        if st.side == "columns":
            reasons.append(f"{st.name}{'ᵀ' if st.transposed else ''} decays on its columns and is probed on its "
                           f"rows: the value-decay kernel "
                           f"(decay factors on the probe's output channels, log-space cumulative sums) takes it as "
                           f"it is, no transpose")
    if spec.order == "read_write":
        reasons.append("each token reads the states before its own write (order read_write): the kernels' "
                       "exclusive read, pairs s < t inside a chunk")
    reasons.append("exact chunk form: one additive chunked pass per stage of the chain, intra-chunk decay-weighted "
                   "products + inter-chunk state")
    return ChainedPlan(tuple(states), tuple(probes), read, spec.order == "write_read"), reasons


def _additive_state(alg: Algebra, n: str, m) -> tuple[ChainedState, list[str]]:
    """One state's additive form from its normal-form map ``m`` (NotAdmitted with the algebra otherwise)."""
    rows, cols = [], []
    for t in m.terms:
        if t.state != n:
            raise NotAdmitted(f"the update of {n} reads state {t.state}: the states are coupled in their updates, "
                              f"not only by the read")
        if "outer" in (t.left.kind, t.right.kind):
            side = t.left if t.left.kind == "outer" else t.right
            raise NotAdmitted(f"the transition of {n} has a rank-one term {side_text(side)} (the state corrects "
                              f"itself): not an additive running sum")
        if t.left.kind == "diag" and t.right.kind == "diag":
            raise NotAdmitted(f"the decay of {n} scales its rows and its columns ({side_text(t.left)} {n} "
                              f"{side_text(t.right)}): the chunk kernels decay one axis")
        if t.right.kind == "diag":
            cols.append(times(t.coef, t.right.u))
        else:
            rows.append(t.coef if t.left.kind == "I" else times(t.coef, t.left.u))
    if cols and any(alg.rank(r) for r in rows):
        raise NotAdmitted(f"the decay of {n} scales both its rows and its columns: the chunk kernels decay one axis")
    if not rows and not cols:
        raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
    gamma = ZERO
    for part in rows + cols:
        gamma = add(gamma, part)
    gamma = simplify(gamma)
    if is_num(gamma, 0):
        raise NotAdmitted(f"the update of {n} overwrites it (decay 0): not a recurrence")
    if not m.incs:
        raise NotAdmitted(f"the update of {n} has no increment (a state that only decays): the chunk kernels "
                          f"need a write")
    side = "columns" if cols and alg.rank(gamma) == 1 else "rows"
    gamma = None if is_num(gamma, 1) else gamma
    why = [(f"the update of {n} is additive: {_update_text(alg, n, gamma, side, m)}, the increment independent of "
            f"every state")]
    bound = check_decay(alg, gamma, f"of {n}")
    if bound:
        why.append(bound)
    return ChainedState(n, gamma, side, tuple(m.incs), m.vector), why


def _update_text(alg: Algebra, n: str, gamma: Expr | None, side: str, m) -> str:
    inc = " + ".join(txt(BinOp("*", b, a) if m.vector else Call("outer", (a, b))) for a, b in m.incs) or "0"
    if gamma is None:
        return f"{n} <- {n} + {inc} (no decay)"
    g = txt(gamma)
    if side == "columns":
        return f"{n} <- {n} Diag({g}) + {inc}, a decay per column"
    if alg.rank(gamma):
        return f"{n} <- Diag({g}) {n} + {inc}, a decay per row"
    return f"{n} <- {g} * {n} + {inc}, a scalar decay"


def chain_probes(alg: Algebra, read: Expr, states: set[str], prefix: str = "_p") -> tuple[Expr, list[ChainedProbe]]:
    """Replace every linear probe ``p @ S`` or ``S @ p`` (S a state, p a vector that reads no state
    outside probes) by a placeholder name, innermost first: a probe vector may itself read probes
    (``softmax(q @ K) @ V``, ``V.T @ softmax(K @ q)``).  Raises NotAdmitted when a state is used other than through probes."""
    probes: list[ChainedProbe] = []

    def walk(e: Expr) -> Expr:
        if isinstance(e, BinOp) and e.op == "@":
            for i, side in enumerate((e.left, e.right)):   # Sᵀ @ p is p @ S, p @ Sᵀ is S @ p
                if isinstance(side, Transpose) and isinstance(side.operand, Name) and side.operand.id in states:
                    other = e.right if i == 0 else e.left
                    if alg.rank(other) == 1:
                        e = BinOp("@", other, side.operand) if i == 0 else BinOp("@", side.operand, other)
                        break
            for vec, st in ((e.left, e.right), (e.right, e.left)):
                if isinstance(st, Name) and st.id in states and not (isinstance(vec, Name) and vec.id in states):
                    rank_s = alg.rank(st)
                    if alg.rank(vec) == 1 and rank_s in (1, 2):
                        inner = walk(vec)
                        columns = rank_s == 2 and st is e.left
                        stage = max((p.stage + 1 for p in probes if any(
                            isinstance(x, Name) and x.id == p.name for x in inner.walk())), default=0)
                        for p in probes:
                            if p.state == st.id and p.vector == inner and p.columns == columns:
                                return Name(p.name)
                        name = f"{prefix}{len(probes)}"
                        probes.append(ChainedProbe(name, st.id, inner, stage, columns))
                        return Name(name)
        if isinstance(e, Name) and e.id in states:
            raise NotAdmitted(f"the read uses the state {e.id} other than through a linear probe p @ {e.id}")
        if isinstance(e, BinOp):
            return BinOp(e.op, walk(e.left), walk(e.right))
        if isinstance(e, (Neg, Transpose)):
            return type(e)(walk(e.operand))
        if isinstance(e, Call):
            if e.fn == "grad":
                raise NotAdmitted("the read takes a gradient of the state")
            return Call(e.fn, tuple(walk(a) for a in e.args))
        return e

    out = walk(read)
    return out, sorted(probes, key=lambda p: p.stage)


def chains(spec) -> bool:
    """Does the read (its lets inlined) probe a state with a vector that probes a state?  (explain
    lists this family's rejection only then.)"""
    alg = Algebra(spec)
    try:
        _, probes = chain_probes(alg, alg.inline(spec.read), set(alg.states))
    except NotAdmitted:
        return False
    return any(p.stage for p in probes)
