"""Which way a memory runs over shards of one sequence, and why: :func:`parallel_plan`.

**The state maps' scan** (``path == "scan"``).  When the spec's normal form
(:func:`memspec.schedule.transition.normal_form`) writes every state's update as
``S_t = T_t(S_{t-1}) + W_t`` with ``T_t`` acting on the key side only (every term ``c L S``,
no factor on the columns, no transpose), a shard of tokens maps its initial state affinely:
``S_end = M S_0 + D`` with ``M = T_n ... T_1`` a ``[K, K]`` matrix (one per batch row and head)
and ``D`` the state the shard leaves from zeros.  Coupled states (a memory and its momentum) are
one stacked state ``[K_1 + K_2, V]`` with one joint ``M``.

``M`` is read off the memory itself: run the shard from the identity as initial state with the
**value views zeroed**.  That run returns ``M I + D(0) = M`` exactly when

* the views zeroed (the *values*: the views that occur in a state's increment ``W_t =
  sum_i outer(a_i, b_i)`` on its column side ``b_i`` and nowhere else: not in any ``a_i``, not in
  any coefficient or key-side factor of any ``T_t``) leave ``M`` unchanged -- ``T_t`` does not
  read them, by that definition; and
* every increment ``b_i`` of the state is *linear* in the values (polynomial degree exactly 1:
  ``eta * v``, never ``l2norm(v)`` or ``v + 1``), so that zero values write nothing.

A state whose increment is not of that form (the normaliser ``z`` of linear attention, whose
increment is ``outer(phi(k), 1)``) may still take the scan when its transition is, term for term,
that of a state which is: it shares that state's ``M`` and takes its own ``D`` from the zero run.
Anything else -- caches, a model not polynomial in the state, temporaries read after a write,
elementwise (per-entry) decays, vector states without such a partner, block updates
(``every C``), approximate schedules (mini-batch, apply-update: their chunks are positions in the
sequence) -- runs the **relay** (``path == "relay"``): the state passes rank to rank in order,
each rank continuing exactly where the one before stopped (open chunks included).

Both paths compute the one-process run of the same schedule; they differ in what runs at the
same time.
"""
from __future__ import annotations

import hashlib
import inspect
import linecache
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..lang.expr import Expr, Name
from ..lang.fmt import to_yaml
from ..lang.spec import Spec
from ..schedule.algebra import Algebra, NotAdmitted, txt
from ..schedule.decide import BY_NAME
from ..schedule.polynomial import degree
from ..schedule.sides import orientation, transposed_algebra
from ..schedule.transition import Affine, NormalForm, describe, normal_form


@dataclass(frozen=True)
class Group:
    """States whose joint map ``S_end = M S_0 + D`` is computed together: ``states`` stacked on
    their rows (one ``M`` of ``[sum K, sum K]``, from the identity run), and ``sharing`` the states
    whose transition is the same (their own ``D``, this ``M``)."""

    states: tuple[str, ...]
    sharing: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelPlan:
    """How a memory runs over contiguous shards of one sequence on several ranks."""

    spec: str                       # the spec's name
    schedule: str                   # the schedule each rank runs
    path: str                       # "scan" (the state maps' exclusive scan) or "relay" (rank to rank)
    reason: str                     # why, in one line of algebra
    groups: tuple[Group, ...] = ()  # scan: the states' joint maps
    values: tuple[str, ...] = ()    # scan: the views zeroed in the identity run
    normal_form: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()   # scan: states written on their value side, mapped as their transpose

    def text(self) -> str:
        """The plan in words (``explain``'s style)."""
        lines = [f"{self.spec}: context parallel by "
                 + ("the state maps' exclusive scan" if self.path == "scan" else "relay (the state rank to rank)")
                 + f", schedule {self.schedule}"]
        lines.append("  equals one process: yes (the same schedule over the same tokens)")
        if self.normal_form:
            lines.append("  normal form:")
            lines += [f"    {ln}" for ln in self.normal_form]
        lines.append(f"  because: {self.reason}")
        if self.path == "scan":
            if self.transposed:
                lines.append(f"  states mapped transposed (written on their value side): {', '.join(self.transposed)}: "
                             f"S_end = S_0 Mᵀ + D")
            for g in self.groups:
                joint = " and ".join(g.states)
                lines.append(f"  map of {joint}: S_end = M S_0 + D; D from zeros, M from the identity with "
                             f"{', '.join(self.values)} = 0" + (" (stacked: one joint M)" if len(g.states) > 1 else ""))
                for s in g.sharing:
                    lines.append(f"  map of {s}: the same transition as {joint}: its M, its own D from zeros")
            lines.append("  each rank: its map (two runs in one batch), one all-gather of the maps, the exclusive "
                         "scan to its initial state, its outputs from that state")
        else:
            lines.append("  each rank waits for the state of the rank before it, runs its shard from it and "
                         "sends its final state on (backward: the state's gradient back)")
        return "\n".join(lines) + "\n"


def parallel_plan(spec_or_memory, schedule: str | None = None) -> ParallelPlan:
    """The plan of a spec (a :class:`~memspec.lang.spec.Spec`, a spec file, or a generated
    ``<Name>Memory``, whose spec is found from its module's header and checked against its hash)
    under ``schedule`` (default: the spec's / module's default schedule)."""
    if isinstance(spec_or_memory, (Spec, str, Path)):
        from ..pipeline.build import decide, load_checked

        spec = load_checked(spec_or_memory).spec if not isinstance(spec_or_memory, Spec) else spec_or_memory
        schedule = schedule or decide(spec).family
        return plan_for(spec, schedule)
    memory = spec_or_memory
    schedule = schedule if schedule not in (None, "auto") else memory.DEFAULT_SCHEDULE
    spec, why = spec_of(memory)
    if spec is None:
        return ParallelPlan(type(memory).__name__, schedule, "relay", why)
    return plan_for(spec, schedule)


def plan_for(spec: Spec, schedule: str) -> ParallelPlan:
    """The plan of a checked spec under one of its schedules."""
    fam = BY_NAME.get(schedule)
    if fam is None or not fam.exact:
        return ParallelPlan(spec.name, schedule, "relay",
                            f"schedule {schedule} is approximate: its chunks are positions in the sequence, so each "
                            f"rank continues the chunk the rank before left open")
    blocks = [n for n, st in spec.state.items() if st.every and st.every > 1]
    if blocks:
        return ParallelPlan(spec.name, schedule, "relay",
                            f"state {', '.join(blocks)} updates in blocks (every C): a block is a position in the "
                            f"sequence, so each rank continues the block the rank before left open")
    alg = Algebra(spec)
    flipped = orientation(alg).transposed if not alg.caches else ()
    if flipped:   # a memory written on its value side: the same algebra on the transposed states
        alg = transposed_algebra(alg, flipped)
    try:
        nf = normal_form(alg)
    except NotAdmitted as err:
        return ParallelPlan(spec.name, schedule, "relay", f"no affine state map: {err}")
    shown = tuple(describe(nf, alg))
    try:
        groups, values = _scan_groups(alg, nf)
    except NotAdmitted as err:
        return ParallelPlan(spec.name, schedule, "relay", str(err), normal_form=shown)
    side = (f"every state's transition acts on its key side only" if not flipped else
            f"written on the value side of {', '.join(flipped)}, every state's transition acts on the key side "
            f"of its transpose")
    reason = (f"{side}, and the increments are linear in {', '.join(values)}, which no transition reads: a "
              f"shard's map S_end = M S_0 + D is read off two runs of the memory")
    return ParallelPlan(spec.name, schedule, "scan", reason, groups, values, shown, tuple(flipped))


# ------------------------------------------------------------------ the proof
def _scan_groups(alg: Algebra, nf: NormalForm) -> tuple[tuple[Group, ...], tuple[str, ...]]:
    """The groups of states and the value views, or NotAdmitted with the algebra that fails."""
    maps = nf.maps
    for n, m in maps.items():
        for t in m.terms:
            if t.t or t.right.kind not in ("I", "vec") or (t.right.kind == "vec" and not m.vector):
                raise NotAdmitted(f"the transition of {n} acts on its columns: a shard's map is not M S_0 + D "
                                  f"with M on the key side")
    values = _value_views(alg, maps)
    if not values:
        raise NotAdmitted("no view enters the increments only on their column side: zero values cannot "
                          "isolate M")
    X = set(values)
    coupled = _components(maps)
    groups, borrowers = [], []
    for comp in coupled:
        ok = all(not maps[n].vector and _linear_in(alg, maps[n], X) for n in comp)
        if ok and len({alg.states[n].shape[-1] for n in comp}) == 1:
            groups.append(list(comp))
        elif len(comp) == 1:
            borrowers.append(comp[0])
        else:
            raise NotAdmitted(f"the coupled states {', '.join(comp)} do not all write increments linear in "
                              f"{', '.join(values)} with one value size")
    if not groups:
        raise NotAdmitted(f"no state writes an increment linear in {', '.join(values)}: zero values cannot "
                          f"isolate M")
    sharing: dict[int, list[str]] = {}
    for b in borrowers:
        home = next((i for i, g in enumerate(groups) if len(g) == 1 and _same_transition(maps[g[0]], maps[b])), None)
        if home is None:
            inc = "; ".join(f"outer({txt(a)}, {txt(c)})" for a, c in maps[b].incs) or "0"
            raise NotAdmitted(f"the increment {inc} of {b} is not linear in {', '.join(values)}, and no state "
                              f"whose increment is has its transition")
        sharing.setdefault(home, []).append(b)
    return (tuple(Group(tuple(g), tuple(sharing.get(i, ()))) for i, g in enumerate(groups)), values)


def _value_views(alg: Algebra, maps: dict) -> tuple[str, ...]:
    """Views that occur in some increment's column side and in no key-side vector or coefficient."""
    views = set(alg.spec.views)
    column, elsewhere = set(), set()
    for m in maps.values():
        for a, b in m.incs:
            column |= _names(b) & views
            elsewhere |= _names(a) & views
        for t in m.terms:
            elsewhere |= _names(t.coef) & views
            for side in (t.left, t.right):
                for e in (side.u, side.w):
                    if e is not None:
                        elsewhere |= _names(e) & views
    return tuple(v for v in alg.spec.views if v in column - elsewhere)


def _linear_in(alg: Algebra, m: Affine, X: set[str]) -> bool:
    return bool(m.incs) and all(degree(alg, b, X) == frozenset({1}) for _, b in m.incs)


def _components(maps: dict) -> list[tuple[str, ...]]:
    """States grouped by which read which (connected components, in the spec's order)."""
    parent = {n: n for n in maps}

    def root(n):
        while parent[n] != n:
            n = parent[n]
        return n

    for n, m in maps.items():
        for t in m.terms:
            parent[root(t.state)] = root(n)
    out: dict[str, list[str]] = {}
    for n in maps:
        out.setdefault(root(n), []).append(n)
    return [tuple(v) for v in out.values()]


def _same_transition(a: Affine, b: Affine) -> bool:
    """The same key-side transition, term for term (each reading its own state)."""
    def key(m: Affine):
        return sorted((txt(t.coef), t.left.kind, txt(t.left.u) if t.left.u is not None else "",
                       txt(t.left.w) if t.left.w is not None else "") for t in m.terms)
    return key(a) == key(b)


def _names(e: Expr) -> set[str]:
    out = set()

    def walk(x):
        if isinstance(x, Name):
            out.add(x.id)
        for c in x.children():
            walk(c)

    walk(e)
    return out


# ------------------------------------------------------------------ a module's spec
_HEADER = re.compile(r"^# Generated by memspec \S+ from (.+) -- do not edit\.$", re.MULTILINE)
_HASH = re.compile(r"^# spec sha256: ([0-9a-f]{64})$", re.MULTILINE)


def spec_of(memory) -> tuple[Spec | None, str]:
    """The spec a generated memory was compiled from: the file its header names (from the
    working directory, beside its module, or a shipped spec of that name), accepted only when its
    canonical form has the hash in the header.  Returns (spec, "") or (None, why not)."""
    mod = sys.modules.get(type(memory).__module__)
    text = _module_text(mod)
    src, digest = _HEADER.search(text or ""), _HASH.search(text or "")
    if src is None or digest is None:
        return None, (f"{type(memory).__name__} carries no memspec header naming its spec, so its state map "
                      f"cannot be proven affine (pass spec=)")
    from ..lang.errors import SpecError
    from ..pipeline.build import load_checked

    name = Path(src.group(1))
    here = Path(getattr(mod, "__file__", "") or ".").parent
    shipped = Path(__file__).resolve().parent.parent / "specs"
    for path in (name, here / name, here.parent / name, shipped / name.name):
        try:
            spec = load_checked(path).spec if path.is_file() else None
        except (SpecError, OSError):
            spec = None
        if spec is not None and hashlib.sha256(to_yaml(spec).encode("utf-8")).hexdigest() == digest.group(1):
            return spec, ""
    return None, (f"the spec {name} that {type(memory).__name__} was generated from is not found with the hash "
                  f"in its header, so its state map cannot be proven affine (pass spec=)")


def _module_text(mod) -> str | None:
    if mod is None:
        return None
    f = getattr(mod, "__file__", None)
    if f and f in linecache.cache:
        return "".join(linecache.cache[f][2])
    try:
        return inspect.getsource(mod)
    except (OSError, TypeError):
        return None
