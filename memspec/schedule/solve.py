"""Family ``solve``: a read that solves a linear system with an additive state -- the mesa layer
(MesaNet, von Oswald et al. 2025): ``o = p @ solve(H + lam I, G)`` with ``H <- gamma H + beta
outer(k, k)`` and ``G`` an additive memory.

Every token t needs ``x_t = (H_t + lam I)^-1 p_t`` (``H_t + lam I`` is symmetric, so ``p @
solve(A, G)`` is ``x_t @ G_t``), then probes ``G`` with it.  Inside a chunk ``H_t = g_t H_0 +
sum_{s <= t} (g_t / g_s) beta_s k_s k_sᵀ``, so conjugate gradients runs for all tokens of a chunk at
once, each step's matrix-vector products being chunk-level products
(:func:`memspec.runtime.solve.chunk_solve`); the probe of ``G`` is the additive family's chunked
form (:func:`memspec.runtime.additive.chunk_additive`) with the probes ``x``.

Exactness: conjugate gradients is exact for a symmetric positive definite system in at most
``d`` steps in exact arithmetic; the kernel runs each token until its relative residual is at
most the solver's tolerance at the dtype's precision (:data:`TOLERANCE`), at most ``d`` steps, so
the schedule is exact *to that tolerance* and ``explain`` says so.  The analysis admits only
systems that are positive definite: ``lam`` a constant > 0, ``beta >= 0`` provably, a decay
``>= 0``, and an initial state that is symmetric positive semi-definite (zeros, ones or eye, not
learned).

A spec may instead name the solver: ``cg(H + lam I, p, N) @ G`` is N steps of conjugate
gradients from x = 0 (the language's ``cg``, the MesaNet paper's fixed-step solver; fla's kernels
run 30).  The kernel then runs exactly N steps (``steps=N, fixed=True``; a token stops early only
once its residual is at the rounding level of its right-hand side, ``||r|| <= eps ||p||``, the
language's definition of ``cg``, where exact arithmetic has converged), so the schedule computes the spec's
function and is exact to float rounding; ``explain`` says "conjugate gradients, N steps (the
spec's solver)".  Its backward differentiates the N iterations (they are not the exact solve, whose
adjoint would give another gradient).

The regulariser ``lam`` may be a constant > 0, or a token-local value (a scalar, or one per key
channel: ``lam * eye(d)`` with ``lam [d]`` is ``Diag(lam)``, MesaNet's per-dimension Lambda) whose
lower bound the analysis proves > 0 (``softplus(x) + 0.25`` as fla's MesaNet; ``softplus`` or ``exp``
alone reach 0 in floating point, where the system may be singular).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.expr import BinOp, Call, Expr, Name, rewrite
from ..lang.normalize import canon
from ..lang.shape_rules import cg_steps
from .algebra import ZERO, Algebra, NotAdmitted, add, is_num, mul, simplify, txt
from .chained import ChainedState, _additive_state
from .ranges import check_decay, value_range
from .transition import normal_form, split_scalar

# chunks of 32 tokens measured fastest on CPU (the mesa layer, B=1 H=4 T=2048 D=64, float32 forward: 43 ms
# against 48 ms at 64 and 50 ms at 16 on one thread, 27 against 30 ms on two): the pair products of a
# conjugate-gradient step grow with the chunk, the products with the chunk-start state do not
SOLVE_CHUNK = 32

# the solver's tolerance per dtype: a token's iteration stops at a residual <= TOLERANCE ||p||
# (memspec.runtime.solve._solve_tolerance, which the kernel uses)
TOLERANCE = {"float32": 1e-6, "float64": 1e-12}


@dataclass(frozen=True)
class SolvePlan:
    """``x_t = solve(H_t + lam I, rhs_t)`` with ``H <- decay * H + weight * outer(key, key)``
    (``decay`` None: 1), then the probe ``x_t @ G_t`` of the additive state ``probe``, named
    ``probe_name`` in ``read``."""

    state: str
    decay: Expr | None
    key: Expr
    weight: Expr
    lam: float | Expr           # a constant, or a token-local value > 0 (scalar or [d]: Diag(lam))
    rhs: Expr
    probe: ChainedState
    probe_name: str
    read: Expr
    inclusive: bool
    steps: int                  # at most this many conjugate-gradient steps (the state's dim)
    iterations: int | None = None   # cg(A, p, N): exactly N steps (the spec's solver); None: the exact solve


def _tolerances() -> str:
    return ", ".join(f"{v:g} in {k}" for k, v in TOLERANCE.items())


def exact_text(plan: SolvePlan) -> str:
    """explain's ``exact:`` line: the spec's fixed-step solver computed as written, or the exact solve
    to the solver's tolerance."""
    if plan.iterations is not None:
        return f"yes (conjugate gradients, {plan.iterations} steps: the spec's solver, to float rounding)"
    return f"yes, to the solver's tolerance ({_tolerances()})"


def note(plan: SolvePlan) -> str:
    """explain's note on what the schedule matches."""
    if plan.iterations is not None:
        return (f"the spec's read is {plan.iterations} steps of conjugate gradients (cg), not the exact solve: the "
                f"chunked schedule runs exactly those steps and matches online (and the reference interpreter) to "
                f"float rounding; both differ from the exact solve by what {plan.iterations} steps leave")
    return (f"exact to the solver's tolerance {_tolerances()} (the relative residual at which each token's conjugate "
            f"gradients stop), at most d steps for a d x d system: it matches online to that tolerance times the "
            f"system's condition number")


def preferred_chunk(alg: Algebra, plan: SolvePlan):
    """(chunk, reason): chunks of :data:`SOLVE_CHUNK` tokens."""
    return SOLVE_CHUNK, (f"chunks of {SOLVE_CHUNK} tokens: each conjugate-gradient step's pair products grow with "
                         f"the chunk (ask for another size with schedule: chunk(N))")


def solves(spec) -> bool:
    """Does the read solve a linear system?  (explain lists this family's rejection only then.)"""
    return spec.read is not None and any(isinstance(n, Call) and n.fn in ("solve", "cg")
                                         for n in Algebra(spec).inline(spec.read).walk())


def analyse_solve(alg: Algebra) -> tuple[SolvePlan, list[str]]:
    """The solve family: the read is ``p @ solve(H + lam * eye(d), G)`` (p token-local) inside
    token-local functions, ``H`` a symmetric additive state that stays positive semi-definite,
    ``lam > 0`` a constant, ``G`` an additive state decayed on its rows."""
    spec = alg.spec
    read = alg.inline(spec.read)
    found = [n for n in read.walk() if isinstance(n, Call) and n.fn in ("solve", "cg")]
    if not found:
        raise NotAdmitted("the read solves no linear system")
    if len(found) > 1:
        raise NotAdmitted(f"the read solves {len(found)} linear systems; the solve form takes one")
    if found[0].fn == "cg":
        site, rhs, A, target, iterations = _cg_site(alg, read, found[0])
    else:
        site = [n for n in read.walk() if isinstance(n, BinOp) and n.op == "@" and n.right is found[0]]
        if not site or alg.rank(site[0].left) != 1 or alg.depends(site[0].left):
            raise NotAdmitted(f"the read uses {txt(found[0])} other than as p @ solve(A, G) with p a token-local "
                              f"vector")
        (rhs, (A, target)), iterations = (site[0].left, found[0].args), None
    H, lam, lam_lo = _system(alg, A)
    if not (isinstance(target, Name) and target.id in alg.states and target.id != H
            and alg.rank(target) == 2):
        raise NotAdmitted(f"the solve's right-hand side {txt(target)} is not a matrix state other than {H}: the "
                          f"solve form probes an additive memory with the solution")
    G = target.id
    name = "_x0"
    rest = rewrite(read, lambda e: Name(name) if e is site[0] else None)
    if alg.depends(rest):
        raise NotAdmitted("the read uses a state outside p @ solve(A, G)")
    if set(alg.states) != {H, G}:
        raise NotAdmitted(f"the spec has {len(alg.states)} states ({', '.join(alg.states)}); the solve form takes "
                          f"the solved state and the probed one")
    nf = normal_form(alg)
    decay, key, weight, why = _symmetric_state(alg, H, nf.maps[H])
    probe, more = _additive_state(alg, G, nf.maps[G])
    if probe.vector or probe.side != "rows" or len(probe.terms) != 1:
        raise NotAdmitted(f"the probed state {G} is not one additive write decayed on its rows (the additive "
                          f"kernel's form)")
    d = spec.state[H].shape[0]
    steps = int(spec.dims[d]) if d in spec.dims else int(d)   # the system's size
    tol = _tolerances()
    lam_t = f"{lam:g}" if isinstance(lam, float) else txt(lam)
    reg = f"Diag({lam_t})" if not isinstance(lam, float) and alg.rank(lam) == 1 else "lam I"
    form = (f"the read is cg({H} + {reg}, p, {iterations}) @ {G}" if iterations else
            f"the read is p @ solve({H} + {reg}, {G})")
    solver = (f"conjugate gradients, {iterations} steps (the spec's solver): exactly {iterations} steps from x = 0 "
              f"for every token (a token stops early only at a residual at the rounding level of p, cg's definition), so "
              f"the schedule computes the spec's function, exact to float rounding; the backward differentiates "
              f"the {iterations} iterations (recomputed per group of chunks), not the exact solve's adjoint"
              if iterations else
              f"exact to the solver's tolerance ({tol}: the relative residual at which a token stops), at most "
              f"{steps} steps (conjugate gradients converges in {steps} in exact arithmetic); the backward solves "
              f"the adjoint systems the same way")
    reasons = why + more + [
        f"{form} with p = {txt(rhs)}: {H} + {reg} is symmetric ({_bound(lam_t, lam_lo)}: positive definite), so every "
        f"token solves x_t ({H}_t + {reg}) = p_t and probes {G} with x_t",
        f"inside a chunk {H}_t = g_t {H}_0 + sum_(s <= t) (g_t / g_s) beta_s k_s k_sᵀ: conjugate gradients for "
        f"every token of a chunk at once, each step's products chunk-level (p_t {H}_0, a masked [C, C] product "
        f"with the keys)",
        solver,
        f"the probe of {G} with x: the additive chunked form (intra-chunk masked products + the inter-chunk state)",
    ]
    if spec.order == "read_write":
        reasons.append("each token reads the states before its own write (order read_write): the solve and the "
                       "probe see the state through t - 1")
    plan = SolvePlan(H, decay, key, weight, lam, rhs, probe, name, rest, spec.order == "write_read", steps,
                     iterations)
    return plan, reasons


def _cg_site(alg: Algebra, read: Expr, call: Call):
    """``cg(A, p, N) @ G`` (p a token-local vector): (the ``@`` node, p, A, G, N)."""
    A, p, n = call.args
    site = [e for e in read.walk() if isinstance(e, BinOp) and e.op == "@" and e.left is call]
    if not site or alg.rank(p) != 1 or alg.depends(p):
        raise NotAdmitted(f"the read uses {txt(call)} other than as cg(A, p, N) @ G with p a token-local vector "
                          f"(cg on the columns of a state is another iteration: write cg(A, p, N) @ G, as MesaNet)")
    return site, p, A, site[0].right, cg_steps(n, alg.spec.constants)


def _bound(lam: str, lo: float) -> str:
    return f"lam = {lam} > 0" if lam == f"{lo:g}" else f"lam = {lam} >= {lo:g} > 0"


def _system(alg: Algebra, A: Expr) -> tuple[str, float | Expr, float]:
    """``A = H + lam * eye(d)`` (either order; ``lam`` a constant > 0, or a token-local scalar or
    ``[d]`` vector -- ``Diag(lam)`` -- whose lower bound is provably > 0) -> (H, lam, its lower bound)."""
    parts = [A.left, A.right] if isinstance(A, BinOp) and A.op == "+" else [A]
    states = [p for p in parts if isinstance(p, Name) and p.id in alg.states]
    eyes = [p for p in parts if p not in states]
    if len(states) != 1 or len(eyes) != 1:
        raise NotAdmitted(f"the system {txt(A)} is not S + lam * eye(d) with S a state")
    H = states[0].id
    factors = [eyes[0].left, eyes[0].right] if isinstance(eyes[0], BinOp) and eyes[0].op == "*" else [eyes[0]]
    eye = [f for f in factors if isinstance(f, Call) and f.fn == "eye"]
    if len(eye) != 1:
        raise NotAdmitted(f"the system {txt(A)} adds {txt(eyes[0])} to {H}, not lam * eye(d): the solve form "
                          f"needs a regulariser that keeps it positive definite")
    if alg.rank(Name(H)) != 2:
        raise NotAdmitted(f"the system {txt(A)} solves with {H}, not a matrix state")
    lam_e = next((f for f in factors if f is not eye[0]), None)
    lo, hi = value_range(alg, lam_e) if lam_e is not None else (1.0, 1.0)
    if not lo > 0:
        raise NotAdmitted(f"the regulariser {txt(lam_e)} is not a constant > 0 or a value provably > 0 (its lower "
                          f"bound is {lo:g}; softplus and exp reach 0 in floating point: a floor such as softplus(x) "
                          f"+ 0.25, MesaNet's, keeps it positive): the system may be singular or indefinite, and "
                          f"conjugate gradients needs it positive definite")
    if lo == hi:
        return H, float(lo), lo
    if alg.depends(lam_e) or alg.rank(lam_e) not in (0, 1):
        raise NotAdmitted(f"the regulariser {txt(lam_e)} is not token-local: a scalar or one per key channel "
                          f"(lam * eye(d) with lam [d] is Diag(lam))")
    return H, lam_e, lo


def _symmetric_state(alg: Algebra, H: str, m) -> tuple[Expr | None, Expr, Expr, list[str]]:
    """``H <- decay * H + weight * outer(key, key)`` from its normal-form map, with ``decay`` and
    ``weight`` provably >= 0 and an initial state that is symmetric positive semi-definite:
    (decay or None, key, weight, reasons)."""
    gamma = ZERO
    for t in m.terms:
        if t.state != H or t.left.kind != "I" or t.right.kind != "I":
            raise NotAdmitted(f"the transition of {H} is not a scalar decay: the solve form keeps {H} symmetric "
                              f"with a scalar decay per head")
        gamma = add(gamma, t.coef)
    gamma = simplify(gamma)
    if is_num(gamma, 0):
        raise NotAdmitted(f"the update of {H} overwrites it (decay 0): not a recurrence")
    if alg.rank(gamma):
        raise NotAdmitted(f"the decay of {H} is not a scalar: the solve form keeps {H} symmetric with a scalar "
                          f"decay per head")
    if len(m.incs) != 1:
        raise NotAdmitted(f"the update of {H} writes {len(m.incs)} outer products; the solve form takes one "
                          f"weight * outer(k, k)")
    (sa, a), (sb, b) = (split_scalar(alg, x) for x in m.incs[0])
    if canon(a) != canon(b):
        raise NotAdmitted(f"the write of {H}, outer({txt(m.incs[0][0])}, {txt(m.incs[0][1])}), is not symmetric")
    weight = simplify(mul(sa, sb))
    if value_range(alg, weight)[0] < 0:
        raise NotAdmitted(f"the write weight {txt(weight)} of {H} is not provably >= 0: {H} + lam I may be "
                          f"indefinite, and conjugate gradients needs it positive definite")
    init = alg.spec.state[H].init
    if init not in ("zeros", "ones", "eye"):
        raise NotAdmitted(f"the initial state of {H} ({init}) is not provably symmetric positive semi-definite")
    g, w = (f"({txt(x)})" if isinstance(simplify(x), BinOp) else txt(x) for x in (gamma, weight))
    why = [f"the update of {H} is {H} <- {g} * {H} + {w} * outer({txt(a)}, {txt(a)}): "
           f"symmetric, positive semi-definite (a weight >= 0, initial state {init})"]
    bound = check_decay(alg, gamma, f"of {H}")
    if bound:
        why.append(bound)
    return (None if is_num(gamma, 1) else gamma), a, weight, why
