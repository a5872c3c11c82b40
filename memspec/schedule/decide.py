"""The schedule decision: one ordered table of families, the fastest admitted one wins.

Reading :data:`FAMILIES` top to bottom tells the whole analysis: each row names a family,
the module whose ``analyse_*`` function decides it from the spec's algebra (a plan and the
reasons, or :class:`~.algebra.NotAdmitted` with one line of algebra), whether its
schedule is exact, the ``schedule:`` keyword that asks for it, and the text ``memspec explain``
and the schedule errors print.  The code generator has the matching table of emitters
(:data:`memspec.codegen.EMITTERS`), one per row; :func:`register` adds a row.

``schedule: auto`` takes the first admitted *exact* family; approximate ones (mini-batch)
only when the spec asks for them (``schedule: minibatch(N)``).  An exception other than
``NotAdmitted`` inside an analysis is a bug and propagates.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..lang.errors import Diagnostic, SpecError
from ..lang.expr import Expr, Name, unparse
from . import additive, apply_update, cache, chained, delta, dplr, minibatch, momentum, oja, online, scan, sides, \
    solve, transition
from .algebra import SHOW_LETS, Algebra, NotAdmitted, grad_calls

DEFAULT_CHUNK = 64


@dataclass(frozen=True)
class Family:
    """One schedule family: how it is decided and what it promises."""

    name: str
    analyse: Callable            # (Algebra, chunk) -> (plan, reasons); raises NotAdmitted
    exact: bool                  # equals online token-by-token learning exactly
    chunked: bool                # runs in chunks of `chunk` tokens
    carried: bool                # the generated module carries it whenever admitted (not only as default)
    text: str                    # one line for `memspec explain`
    hint: str | None = None      # how to write a spec that this family admits
    hint_applies: Callable = lambda spec: True
    # (Algebra, plan) -> (chunk, reason) when the plan runs best at another default chunk, or None
    prefers: Callable = lambda alg, plan: None
    keyword: str | None = None   # the `schedule:` keyword that asks for it (several exact chunked ones share "chunk")
    token: bool = False          # token by token: the fallback of every module and the step of an exact one
    block_chunk: bool = False    # its default chunk nests in the spec's block updates (every C)
    needs: str | None = None     # what `schedule: <keyword>` needs, when the spec admits no family for it
    instead: str | None = None   # the schedules to use instead
    tells: Callable | None = None    # (spec) -> its rejection explains a refused `schedule: chunk(N)`
    served: str | None = None    # admitted, why a refused `schedule: chunk(N)` is not needed
    listed: Callable = lambda spec: True   # listed under "not faster" in explain when rejected
    note: str | Callable | None = None   # explain's note when it is the decision (or plan -> note / None)
    # (coupling, rejected) -> explain's note on coupled states when it is the decision, or None
    coupled_note: Callable = lambda coupled, rej: None
    # (Algebra, rejected) -> further reasons when it is the decision
    more_reasons: Callable = lambda alg, rej: []
    # (ScheduleDecision, spec) -> further explain notes when it is the decision
    more_notes: Callable = lambda d, spec: []
    sided: bool = False          # its kernel takes the key side: it sees states used on their value side transposed
    # explain's "exact:" line when it says more than yes / no (or plan -> that line / None)
    exact_text: str | Callable | None = None

    def exact_line(self, exact: bool, plan=None) -> str:
        """The value of explain's ``exact:`` line for a decision of this family (with its plan)."""
        text = self.exact_text(plan) if callable(self.exact_text) else self.exact_text
        if text is not None and exact:
            return text
        return "yes" if exact else "no (an approximation of online learning)"


def _has_grads(spec) -> bool:
    return any(grad_calls(s.value) for s in spec.update)


def _requested_apply_update(alg, chunk):
    if alg.spec.schedule_kind != "apply_update":
        raise NotAdmitted("asked for with schedule: apply_update(C)")
    return apply_update.analyse_apply_update(alg, chunk)


def _additive_reasons(alg, rej) -> list:
    if "additive" in rej and "scan" in rej and additive.additive_states_ok(alg):
        mixed = sides.orientation(alg).mixed
        if mixed:
            return [f"the updates of {', '.join(alg.states)} are additive running sums, but {mixed}"]
        if sides.read_sites(alg, sides.matrix_states(alg))[1]:   # probes C @ q: the read is linear in the state
            return [f"the updates of {', '.join(alg.states)} are additive running sums, but {rej['additive']}"]
        return [f"the updates of {', '.join(alg.states)} are additive running sums (S <- g*S + A, A "
                f"independent of the state), but {rej['additive']}: the read needs the full state of every "
                f"token, so a chunk form would only batch the state materialisation while the per-token "
                f"read dominates"]
    return []


def _minibatch_when_asked(d, spec) -> list:
    if "minibatch" not in d.admits or spec.schedule_kind != "auto":
        return []
    lines = ["  note: the approximate minibatch(N) schedule is admitted too; `auto` picks only exact "
             "schedules, so ask for it with `schedule: minibatch(N)`"]
    how = d.plans["minibatch"].how
    if how:
        lines.append(f"  mini-batch, when asked for (chunk {d.chunks.get('minibatch')}):")
        lines += [f"    - {r}" for r in how]
    return lines


FAMILIES: tuple[Family, ...] = (
    Family("cache", lambda alg, chunk: cache.analyse_cache(alg), exact=True, chunked=False, carried=True,
           text="cache (softmax attention over the cache, exact, scaled_dot_product_attention)",
           served="the spec is a cache read by attention: it is served exactly by scaled_dot_product_attention",
           listed=lambda spec: any(st.cache for st in spec.state.values())),
    Family("additive", lambda alg, chunk: additive.analyse_additive(alg), exact=True, chunked=True, carried=False,
           text="additive (exact chunked form: S <- g*S + A)", keyword="chunk", needs="an exact chunk form",
           tells=lambda spec: not _has_grads(spec), sided=True,
           hint="write the update as S = Diag(g) S + A (g a scalar, or one decay per key channel) with A "
                "independent of every state (e.g. outer(k, v)) and read the state only through probes q @ S"),
    Family("delta", lambda alg, chunk: delta.analyse_delta(alg), exact=True, chunked=True, carried=False,
           text="delta (exact chunked form: WY / UT representation, triangular solve per chunk)",
           keyword="chunk", needs="an exact chunk form", tells=_has_grads, sided=True,
           hint="give one matrix state a transition T = gamma I - beta k kᵀ (a scalar decay and the delta "
                "rule: a gradient step on a loss quadratic in a linear model, or the error written out)",
           hint_applies=lambda spec: len(spec.state) == 1, prefers=delta.preferred_chunk),
    Family("dplr", lambda alg, chunk: dplr.analyse_dplr(alg), exact=True, chunked=True, carried=False,
           text="dplr (exact chunked form: diagonal plus low rank, WY / UT representation, triangular solve per chunk)",
           keyword="chunk", needs="an exact chunk form", sided=True,
           hint="give one matrix state a transition on its key side that is a decay (a scalar or one per key "
                "channel) on the token's first step and rank-one corrections a (bᵀ S), each step writing an "
                "outer(k, v) (delta-rule steps with per-channel decays, asymmetric keys, several steps per token)",
           hint_applies=lambda spec: len(spec.state) == 1, prefers=dplr.preferred_chunk),
    Family("momentum", lambda alg, chunk: momentum.analyse_momentum(alg), exact=True, chunked=True, carried=False,
           text="momentum (exact chunked form: two coupled states, one triangular solve per chunk)",
           keyword="chunk", needs="an exact chunk form", sided=True,
           coupled_note=lambda coupled, rej: f"{coupled}, but triangular (the momentum feeds the memory, never "
                                             f"back), which the momentum chunked form takes exactly",
           hint="give a memory S and a momentum M the momentum delta rule: M = mu M + eta outer(k, p @ S - v) and "
                "S = gamma S - beta M (the new M), with token-local scalars mu, eta, gamma, beta",
           hint_applies=lambda spec: len(spec.state) == 2),
    Family("scan", lambda alg, chunk: scan.analyse_scan(alg), exact=True, chunked=True, carried=False,
           text="scan (exact chunked form: h <- a * h + b elementwise, every token's state materialised)",
           keyword="chunk", needs="an exact chunk form",
           hint="write every state's update as a * S + b (a and b token-local: a scalar, per-channel or "
                "per-entry decay, diag(a) @ S for rows) with no state in a or b",
           hint_applies=scan.hint_applies, prefers=scan.preferred_chunk),
    Family("minibatch", minibatch.analyse_minibatch, exact=False, chunked=True, carried=True,
           text="mini-batch (approximate: gradients at the chunk-start state)", keyword="minibatch",
           block_chunk=True, needs="gradient writes that form linear recurrences", instead="auto, chunk(N) or online",
           note="mini-batch evaluates every grad(...) of a chunk at the chunk-start state; it approximates online "
                "learning and equals it at chunk 1 (schedule minibatch(1))",
           hint="write the update as linear recurrences with token-local scalar coefficients "
                "around grad(...) (momentum, decay)",
           hint_applies=_has_grads),
    Family("online", lambda alg, chunk: online.analyse_online(alg), exact=True, chunked=False, carried=True,
           text="online (token by token, exact)", keyword="online", token=True,
           coupled_note=lambda coupled, rej: f"{coupled}; the momentum chunked form does not apply (see momentum "
                                             f"above), so the exact schedule is online" if "momentum" in rej else None,
           more_reasons=_additive_reasons, more_notes=_minibatch_when_asked),
    # only when a spec asks for it (LaCT's large chunks): after online, so never in "not faster"
    Family("apply_update", _requested_apply_update, exact=False, chunked=True, carried=False,
           text="apply-then-update chunks (approximate: every state updates once per chunk)", keyword="apply_update",
           needs="gradient writes whose chunk sums it can take", instead="auto, minibatch(N) or online",
           note="apply-then-update reads every token of a chunk at the state the previous chunk left and updates "
                "once per chunk; it approximates online learning and equals it at chunk 1 (schedule "
                "apply_update(1))"),
)
BY_NAME = {f.name: f for f in FAMILIES}
NAMES = tuple(f.name for f in FAMILIES)


def register(family: Family, *, before: str | None = None) -> Callable[[], None]:
    """Add ``family`` to :data:`FAMILIES` (before the row ``before``, else last); returns the
    function that takes it out again.  The code generator needs its emitter too
    (:func:`memspec.codegen.register`)."""
    global FAMILIES, NAMES
    if family.name in BY_NAME:
        raise ValueError(f"schedule family {family.name!r} is already in FAMILIES")
    if before is not None and before not in BY_NAME:
        raise ValueError(f"register(before={before!r}): no such family; the families are {', '.join(NAMES)}")
    at = NAMES.index(before) if before is not None else len(FAMILIES)
    FAMILIES = FAMILIES[:at] + (family,) + FAMILIES[at:]
    NAMES = tuple(f.name for f in FAMILIES)
    BY_NAME[family.name] = family

    def unregister() -> None:
        global FAMILIES, NAMES
        FAMILIES = tuple(f for f in FAMILIES if f is not family)
        NAMES = tuple(f.name for f in FAMILIES)
        BY_NAME.pop(family.name, None)

    return unregister


# reads that chain probes of additive states (gated slot attention): after additive, ahead of the
# one-state families, whose rejections of such a spec say nothing about it
register(Family("chained", lambda alg, chunk: chained.analyse_chained(alg), exact=True, chunked=True, carried=False,
                text="chained (exact multi-pass chunked form: the read chains probes of additive states)",
                keyword="chunk", needs="an exact chunk form", listed=chained.chains,
                note="the chained kernels take each state on the side its probes contract (a decay on the other "
                     "axis runs in the value-decay kernel), whatever the orientation above says of the one-state "
                     "families"), before="delta")
# a state transformed on its value side and read on its key side (the gated Oja rule): after the
# key-side families, which take every spec it could share with them
register(Family("oja", lambda alg, chunk: oja.analyse_oja(alg), exact=True, chunked=True, carried=False,
                text="oja (exact chunked form: a value-side transition read on the key side, one triangular solve "
                     "per chunk)", keyword="chunk", needs="an exact chunk form",
                hint="give one matrix state a transition on its value side, S Diag(g) plus one rank-one correction "
                     "c (S u) wᵀ, writing outer(a, w) along the same w, and read it through probes q @ S (the "
                     "gated Oja rule)",
                hint_applies=lambda spec: len(spec.state) == 1, prefers=oja.preferred_chunk), before="momentum")

# reads that solve a linear system with an additive state (the mesa layer): conjugate gradients over
# whole chunks, exact to the solver's tolerance; after chained, ahead of the one-state families
register(Family("solve", lambda alg, chunk: solve.analyse_solve(alg), exact=True, chunked=True, carried=False,
                text="solve (chunked conjugate gradients for every token's system)",
                keyword="chunk", needs="an exact chunk form", listed=solve.solves,
                note=solve.note,
                hint="read p @ solve(S + lam * eye(d), G) with S <- gamma S + beta outer(k, k) (a scalar decay, beta "
                     ">= 0, lam a constant > 0) and G an additive memory",
                hint_applies=solve.solves, prefers=solve.preferred_chunk, exact_text=solve.exact_text), before="delta")


@dataclass(frozen=True)
class ScheduleDecision:
    family: str                 # the name of one of FAMILIES: the module's default schedule
    exact: bool                 # equals online token-by-token learning exactly
    chunk: int | None           # chunk size (None for online / cache)
    reasons: tuple[str, ...] = ()   # the algebra behind the decision, one line each
    plan: Any = None            # the family's plan, consumed by its emitter
    admits: tuple[str, ...] = ()    # every family this spec admits, e.g. ("delta", "minibatch", "online")
    plans: dict = field(default_factory=dict, compare=False)   # family -> plan, for every admitted family
    rejected: tuple[tuple[str, str], ...] = ()  # (family, why not) for the families not admitted
    schedules: tuple[str, ...] = ()  # the schedules the generated module carries, in table order
    chunks: dict = field(default_factory=dict, compare=False)  # chunked family -> its chunk size
    let_forms: tuple = ()       # (inlined value, let name) of every let, as the analysis read them
    normal_form: tuple[str, ...] = ()  # S <- T(S) + W of every state, printed (empty: not linear in the state)
    coupled: str | None = None  # how the normal form couples several states (None: independent)
    why: dict = field(default_factory=dict, compare=False)     # admitted family -> its reasons
    step: str = ""              # the schedule `step` runs: the default when approximate, else token by token
    orientation: str = ""       # how the sided families see the matrix states (explain's line; "" when no side)
    transposed: tuple[str, ...] = ()   # the states the sided families' plans read transposed (sides.transposed_spec)
    transposed_spec: object = field(default=None, compare=False)   # the spec over those states' transposes


def analyse(spec) -> ScheduleDecision:
    """Decide the schedule of a (checked) spec from its algebra; raise SpecError if the
    schedule the spec asks for is impossible."""
    alg = Algebra(spec)
    token = SHOW_LETS.set(tuple((inl, n) for n, inl in alg.lets.items() if not isinstance(inl, Name)))
    try:
        return _decide(spec, alg)
    finally:
        SHOW_LETS.reset(token)


def _decide(spec, alg: Algebra) -> ScheduleDecision:
    kind = spec.schedule_kind
    # a spec with block updates (every C) runs mini-batches nested in its blocks by default
    blocks = [st.every for st in spec.state.values() if st.every and st.every > 1]
    mb_default = math.gcd(*blocks) if blocks else DEFAULT_CHUNK
    chunks = {f.name: spec.schedule_size if kind == f.keyword else mb_default if f.block_chunk else DEFAULT_CHUNK
              for f in sorted(FAMILIES, key=lambda f: f.exact) if f.chunked}
    plans: dict[str, Any] = {}
    whys: dict[str, list[str]] = {}
    rejected: list[tuple[str, str]] = []
    side = sides.orientation(alg)
    flipped = sides.transposed_algebra(alg, side.transposed) if side.transposed else alg
    seen = {f.name: flipped if f.sided else alg for f in FAMILIES}   # the algebra each family reads
    for f in FAMILIES:
        try:
            plans[f.name], whys[f.name] = f.analyse(seen[f.name], chunks.get(f.name))
        except NotAdmitted as err:
            rejected.append((f.name, sides.shown(str(err), side.transposed) if f.sided else str(err)))
        else:
            if f.sided:
                whys[f.name] = [sides.shown(r, side.transposed) for r in whys[f.name]]
    for f in FAMILIES:   # a chunk the spec did not ask for: the family's preferred one
        pref = f.prefers(seen[f.name], plans[f.name]) if f.name in plans and kind != "chunk" else None
        if pref is not None:
            chunks[f.name] = pref[0]
            whys[f.name].append(pref[1])
    admits = tuple(f.name for f in FAMILIES if f.name in plans)
    rej = dict(rejected)
    if kind == "auto":   # the first admitted exact family
        fam = next(f.name for f in FAMILIES if f.exact and f.name in plans)
    else:   # the first admitted family the keyword asks for
        asked = [f for f in FAMILIES if f.keyword == kind]
        fam = next((f.name for f in asked if f.name in plans), None)
        if fam is None:
            raise SpecError([_refused(spec, asked, plans, rej)])
    reasons = list(whys[fam]) + BY_NAME[fam].more_reasons(alg, rej)
    if kind != "auto":
        reasons.insert(0, f"forced by schedule {spec.schedule}")
    schedules = tuple(f.name for f in FAMILIES if f.name in plans and (f.name == fam or f.carried))
    try:
        nf = transition.normal_form(flipped)
        shown = {n: f"{n}ᵀ" for n in side.transposed}
        normal, coupled = tuple(transition.describe(nf, flipped, shown)), transition.coupling(nf, flipped)
    except NotAdmitted:
        normal, coupled = (), None
    token = next(f.name for f in FAMILIES if f.token)
    return ScheduleDecision(fam, BY_NAME[fam].exact, chunks.get(fam), tuple(reasons), plans[fam], admits,
                            plans, tuple(rejected), schedules,
                            {f: c for f, c in chunks.items() if f in schedules},
                            tuple((inl, n) for n, inl in alg.lets.items()), normal, coupled,
                            {f: tuple(w) for f, w in whys.items()}, token if BY_NAME[fam].exact else fam,
                            side.text, side.transposed, flipped.spec if side.transposed else None)


def _refused(spec, asked: list, plans: dict, rej: dict) -> Diagnostic:
    """The error of a ``schedule:`` that asks for families (``asked``) this spec admits none of."""
    first = asked[0]
    if len(asked) == 1:
        return Diagnostic("error", f"schedule {spec.schedule} needs {first.needs}", spec.span("schedule"),
                          hint=rej[first.name] + f"; use {first.instead}", code="E-schedule")
    why = rej[next(f.name for f in asked if f.tells is not None and f.tells(spec))]
    why = next((f.served for f in FAMILIES if f.served and f.name in plans), why)
    approx = "".join(f"{f.keyword}(N) (approximate) or " for f in FAMILIES
                     if not f.exact and f.keyword and f.name in plans)
    token = next(f.keyword for f in FAMILIES if f.token)
    names = [f.name for f in asked]
    needs = f"{first.needs} ({', '.join(names[:-1])} or {names[-1]})"
    return Diagnostic("error", f"schedule {spec.schedule} needs {needs}, and this spec admits none",
                      spec.span("schedule"), hint=why + f"; use {approx}{token} or auto", code="E-schedule")


def explain(spec, decision: ScheduleDecision | None = None) -> str:
    """Human-readable account of the schedule decision, the algebra behind it and its plan."""
    d = analyse(spec) if decision is None else decision
    fam = BY_NAME[d.family]
    lines = [f"{spec.name}: {fam.text}"]
    lines.append(f"  exact: {fam.exact_line(d.exact, d.plan)}")
    if d.chunk is not None:
        lines.append(f"  chunk: {d.chunk}" + ("" if fam.exact else "  (chunk 1 equals online)"))
    lines.append(f"  admits: {', '.join(d.admits)}")
    if d.orientation:
        lines.append(f"  orientation: {d.orientation}")
    if d.normal_form:
        lines.append("  normal form (S_t = T_t(S_{t-1}) + W_t, in the states before the token):")
        lines += [f"    {ln}" for ln in d.normal_form]
    lines.append("  because:")
    lines += [f"    - {r}" for r in d.reasons]
    rej = dict(d.rejected)
    ahead = NAMES[:NAMES.index(d.family)]
    better = [f for f in ahead if f in rej and BY_NAME[f].listed(spec)]
    if better:
        lines.append("  not faster, because:")
        for f in better:
            lines.append(f"    - {f}: {rej[f]}")
    note = fam.note(d.plan) if callable(fam.note) else fam.note
    if note:
        lines.append(f"  note: {note}")
    coupled = fam.coupled_note(d.coupled, rej) if d.coupled else None
    if coupled:
        lines.append(f"  note: {coupled}")
    lines += fam.more_notes(d, spec)
    hints = [f for f in ahead if f in rej and BY_NAME[f].hint and BY_NAME[f].hint_applies(spec)]
    if hints:
        lines.append("  for a faster schedule:")
        lines += [f"    - {f}: {BY_NAME[f].hint}" for f in hints]
    lines.append("  plan:")
    lines += ["    " + ln for ln in render_plan(d.plan)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ printed plans
def render_plan(obj: Any) -> list[str]:
    """The stable printed form of a plan (a dataclass of expressions, names and nested plans):
    one ``field: value`` line per scalar field, nested blocks indented by two spaces,
    expressions in the spec's notation; fields declared ``repr=False`` (text for explain) are left out."""
    if dataclasses.is_dataclass(obj):
        lines = [type(obj).__name__]
        for f in dataclasses.fields(obj):
            if not f.repr:
                continue
            v = getattr(obj, f.name)
            inline = _inline(v)
            if inline is not None:
                lines.append(f"  {f.name}: {inline}")
            else:
                lines.append(f"  {f.name}:")
                lines += ["    " + ln for ln in _block(v)]
        return lines
    inline = _inline(obj)
    return [inline] if inline is not None else _block(obj)


def _inline(v: Any) -> str | None:
    if v is None or isinstance(v, (bool, int, float, str)):
        return str(v)
    if isinstance(v, Expr):
        return unparse(v)
    if isinstance(v, (tuple, list)) and all(_inline(x) is not None and not isinstance(x, (tuple, list, dict))
                                            for x in v):
        return "(" + ", ".join(_inline(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, dict) and not v:
        return "{}"
    return None


def _key(k: Any) -> str:
    return " ".join(_inline(x) or "?" for x in k) if isinstance(k, tuple) else (_inline(k) or "?")


def _block(v: Any) -> list[str]:
    if dataclasses.is_dataclass(v):
        return render_plan(v)
    if isinstance(v, dict):
        out = []
        for k, x in v.items():
            inline = _inline(x)
            if inline is not None and not isinstance(x, (tuple, list)):
                out.append(f"{_key(k)}: {inline}")
            else:
                out.append(f"{_key(k)}:")
                out += ["  " + ln for ln in _block(x)]
        return out
    if isinstance(v, (tuple, list)):
        out = []
        for x in v:
            inline = _inline(x)
            if inline is not None:
                out.append(f"- {inline}")
            else:
                sub = _block(x)
                out += [("- " if i == 0 else "  ") + ln for i, ln in enumerate(sub)]
        return out
    return [_inline(v) or repr(v)]
