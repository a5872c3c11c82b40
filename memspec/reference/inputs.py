"""What goes into the reference interpreter, checked: dims, learned params, initial states,
views ``[B, T, H, D]`` and gates ``[B, T, H, ...]``, and the schedule argument with the update
frequency of each state."""
from __future__ import annotations

import re
from typing import Any

import torch

from ..lang.blocks import frequencies
from ..lang.errors import did_you_mean
from ..lang.spec import Spec, parse_init


def with_dims(spec: Spec, dims: dict[str, int] | None) -> Spec:
    return spec.with_dims(**dims) if dims else spec


def dim_size(spec: Spec, name: str) -> int:
    if name.isdigit():
        return int(name)
    if name not in spec.dims:
        hint = did_you_mean(name, spec.dims)
        raise ValueError(f"unknown dim {name!r}" + (f"; {hint}" if hint else "")
                         + f" (this spec has dims {sorted(spec.dims)})")
    return spec.dims[name]


def dim_sizes(spec: Spec, shape: list[str]) -> tuple[int, ...]:
    return tuple(dim_size(spec, d) for d in shape)


def notation(names: list[str]) -> str:
    return "[" + ", ".join(names) + "]"


def shape_text(names: list[str], sizes: list[int | str]) -> str:
    """``[B, T, H, d_k] = [2, 5, 1, 4]``."""
    return f"{notation(names)} = {notation([str(s) for s in sizes])}"


def init_tensor(init: Any, shape: tuple[int, ...], lead: tuple[int, ...], *, what: str,
                 dtype, device, generator=None, allow_random: bool = True) -> torch.Tensor:
    """A tensor ``[*lead, *shape]`` from an init (number, zeros, ones, eye, normal(std))."""
    if isinstance(init, (int, float)) and not isinstance(init, bool):
        return torch.full((*lead, *shape), float(init), dtype=dtype, device=device)
    d = parse_init(init)
    kind = d["kind"]
    if kind == "zeros":
        return torch.zeros((*lead, *shape), dtype=dtype, device=device)
    if kind == "ones":
        return torch.ones((*lead, *shape), dtype=dtype, device=device)
    if kind == "eye":
        if len(shape) != 2 or shape[0] != shape[1]:
            raise ValueError(f"{what}: init eye needs a square shape [d, d], got {list(shape)}")
        return torch.eye(shape[0], dtype=dtype, device=device).expand(*lead, *shape).clone()
    if not allow_random:
        raise ValueError(
            f"{what} has a random init ({init}); pass its value explicitly "
            f"(params={{'{what.split()[-1]}': tensor}})"
        )
    if kind == "uniform":
        out = torch.rand((*lead, *shape), dtype=dtype, device=device, generator=generator)
        return d["lo"] + (d["hi"] - d["lo"]) * out
    out = torch.randn((*lead, *shape), dtype=dtype, device=device, generator=generator)
    return out * d["std"]


def learned_params(spec: Spec, given: dict | None, heads: int, dtype, device) -> dict[str, torch.Tensor]:
    """Learned params ``[H, *shape]`` (given, or their deterministic init), checked."""
    given = dict(given or {})
    learned_states = {n for n, s in spec.state.items() if s.learned}
    extra = set(given) - set(spec.params) - learned_states
    if extra:
        raise ValueError(
            f"unexpected params {sorted(extra)}; this spec has params {sorted(spec.params)}"
            + (f" and learned states {sorted(learned_states)}" if learned_states else "")
        )
    out: dict[str, torch.Tensor] = {}
    for name, p in spec.params.items():
        shape = dim_sizes(spec, p.shape)
        if name in given:
            out[name] = check_shape(given[name], ["H", *p.shape], [heads, *shape], f"param {name!r}")
        else:
            out[name] = init_tensor(p.init, shape, (heads,), what=f"param {name}",
                                     dtype=dtype, device=device, allow_random=False)
    for name in learned_states & set(given):
        st = spec.state[name]
        out[name] = check_shape(given[name], ["H", *st.shape], [heads, *dim_sizes(spec, st.shape)],
                                 f"learned initial state {name!r}")
    return out


def check_shape(t: Any, names: list[str], sizes: list[int], what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a tensor {shape_text(names, sizes)}, got {type(t).__name__}")
    if list(t.shape) != list(sizes):
        raise ValueError(f"{what} must be {shape_text(names, sizes)}, got {list(t.shape)}")
    return t


def init_state(spec: Spec, batch: int, heads: int, *, dims: dict | None = None,
               dtype=torch.float32, device=None, params: dict | None = None,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Initial state: ``{name: [B, H, *shape]}``; a cache starts empty ``[B, H, 0, *shape]``.

    ``zeros``/``ones``/``eye``/``normal(std)``; a ``learned(...)`` state takes
    ``params[name]`` (``[H, *shape]``, broadcast over the batch) when given, else its
    inner init.  Random inits draw one ``[H, *shape]`` tensor (from ``generator``)
    shared by every sequence of the batch.
    """
    spec = with_dims(spec, dims)
    params = params or {}
    out: dict[str, torch.Tensor] = {}
    for name, st in spec.state.items():
        shape = dim_sizes(spec, st.shape)
        if st.cache:
            out[name] = torch.zeros((batch, heads, 0, *shape), dtype=dtype, device=device)
        elif st.learned and name in params:
            p = check_shape(params[name], ["H", *st.shape], [heads, *shape],
                             f"learned initial state {name!r}")
            out[name] = p.to(dtype=dtype).unsqueeze(0).expand(batch, heads, *shape)
        else:
            per_head = init_tensor(st.init, shape, (heads,), what=f"state {name}",
                                    dtype=dtype, device=device, generator=generator)
            out[name] = per_head.unsqueeze(0).expand(batch, heads, *shape)
    return out


def full_state(spec: Spec, given: dict | None, B: int, H: int, dtype, device,
                params: dict) -> dict[str, torch.Tensor]:
    """The given state (checked) completed by ``init_state`` for the missing entries."""
    given = dict(given or {})
    extra = set(given) - set(spec.state)
    if extra:
        raise ValueError(f"unexpected state {sorted(extra)}; this spec has state {sorted(spec.state)}")
    missing = [n for n in spec.state if n not in given]
    defaults = init_state(spec, B, H, dtype=dtype, device=device, params=params) if missing else {}
    out = {}
    for name, st in spec.state.items():
        if name not in given:
            out[name] = defaults[name]
            continue
        t = given[name]
        shape = list(dim_sizes(spec, st.shape))
        if st.cache:
            if not isinstance(t, torch.Tensor) or t.dim() != 3 + len(shape) \
                    or list(t.shape[:2]) != [B, H] or list(t.shape[3:]) != shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"cache state {name!r} must be "
                                 f"{shape_text(['B', 'H', 'n', *st.shape], [B, H, 'n', *shape])}, got {got}")
            out[name] = t
        else:
            out[name] = check_shape(t, ["B", "H", *st.shape], [B, H, *shape], f"state {name!r}")
    return out


def check_inputs(spec: Spec, inputs: dict) -> tuple[int, int, int, torch.dtype, Any]:
    """Check views ``[B, T, H, D]`` and gates ``[B, T, H, *shape]``; return B, T, H, dtype, device."""
    expected = {n: ["B", "T", "H", v.dim] for n, v in spec.views.items()}
    expected.update({n: ["B", "T", "H", *g.shape] for n, g in spec.gates.items()})
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in expected]
    problems = []
    if missing:
        problems.append("missing " + ", ".join(f"{n} {notation(expected[n])}" for n in missing))
    if extra:
        hints = [did_you_mean(n, expected) for n in extra]
        problems.append("unexpected " + ", ".join(extra) + "".join(f" ({h})" for h in hints if h))
    if problems:
        gates = ", ".join(f"{n} {notation(expected[n])}" for n in spec.gates)
        raise ValueError("; ".join(problems) + f". This spec takes views {list(spec.views)} "
                         f"[B, T, H, D]" + (f" and gates {gates}" if gates else ""))
    if not expected:
        raise ValueError("this spec has no views or gates, so B, T and H cannot be inferred")
    first = next(iter(expected))
    t0 = inputs[first]
    if not isinstance(t0, torch.Tensor) or t0.dim() < 3:
        raise ValueError(f"{first} must be a tensor {notation(expected[first])}, got "
                         f"{list(t0.shape) if isinstance(t0, torch.Tensor) else type(t0).__name__}")
    B, T, H = t0.shape[:3]
    if not t0.is_floating_point():
        raise ValueError(f"{first} must be a floating-point tensor, got {t0.dtype}")
    if T < 1:
        raise ValueError("the sequence is empty (T = 0); run needs at least one token")
    for name, names in expected.items():
        sizes = [B, T, H] + [dim_size(spec, d) for d in names[3:]]
        kind = "view" if name in spec.views else "gate"
        check_shape(inputs[name], names, sizes, f"{kind} {name!r}")
    return B, T, H, t0.dtype, t0.device


def schedule_mode(schedule: Any, spec: Spec) -> tuple[str, int | None]:
    """``("online", None)``, ``("minibatch", C)`` or ``("apply_update", C)``."""
    if schedule == "spec":
        kind = spec.schedule_kind
        if kind in ("minibatch", "apply_update"):
            return kind, spec.schedule_size
        return "online", None
    if isinstance(schedule, (tuple, list)) and len(schedule) == 2 and schedule[0] in ("minibatch", "apply_update"):
        c = schedule[1]
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"{schedule[0]} chunk size must be a positive integer, got {c!r}")
        return schedule[0], c
    if isinstance(schedule, str):
        s = schedule.replace(" ", "")
        if s in ("online", "auto") or re.fullmatch(r"chunk\(\d+\)", s):
            return "online", None  # chunked forms of exact schedules compute online learning
        m = re.fullmatch(r"(minibatch|apply_update)\((\d+)\)", s)
        if m and int(m.group(2)) >= 1:
            return m.group(1), int(m.group(2))
    raise ValueError(f"unknown schedule {schedule!r}: use 'online', ('minibatch', C), ('apply_update', C) "
                     f"or 'spec'")


def state_frequencies(spec: Spec, mode: tuple[str, int | None]) -> dict[str, int]:
    """Each learned state's update frequency: its ``every`` (1: every token); under
    ``apply_update(C)`` every state updates once per chunk of C tokens."""
    own = frequencies(spec)
    if mode[0] != "apply_update":
        return own
    clash = {n: c for n, c in own.items() if c not in (1, mode[1])}
    if clash:
        raise ValueError(f"apply_update({mode[1]}) updates every state once per chunk, but "
                         + ", ".join(f"{n} updates every {c} tokens" for n, c in clash.items()))
    return {n: mode[1] for n in own}
