"""Kernels specialised to the constant arguments a module passes (memspec.codegen.specialise):
the same numbers as the general kernel for every binding, the decided branches gone."""
from __future__ import annotations

import ast
import importlib
import inspect
import itertools
from pathlib import Path

import pytest
import torch
from close import assert_same_function
from test_generated_readable import docstring_mismatches, unused_assignments

from memspec.codegen.context import kernel_functions, phase_sources, runtime_source
from memspec.codegen.specialise import constant_arguments, specialise, specialise_calls, specialise_source
from memspec.codegen.tidy import drop_dead
from memspec.runtime import dplr
from memspec.runtime.additive import chunk_additive
from memspec.runtime.delta import chunk_delta
from memspec.runtime.dplr import chunk_dplr, pair_index


def _load(src: str, name: str):
    ns = {"torch": torch}
    kernel = {f.__name__: f for f in (chunk_additive, chunk_delta, chunk_dplr)}.get(name)
    own = [runtime_source(f) for f in kernel_functions(kernel, src)] if kernel else []   # its family's functions
    for part in phase_sources([src] + own) + own:   # and the shared phases, as a generated module carries them
        exec(part, ns)
    exec(compile(src, f"<specialised {name}>", "exec"), ns)
    return ns[name]


def _inputs(T=37, B=2, H=2, K=5, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K) / K ** 0.5, v=r(B, T, H, V),
                beta=torch.sigmoid(r(B, T, H)), log_gamma=-torch.rand(B, T, H, generator=g, dtype=torch.float64),
                log_rho=-torch.rand(B, T, H, generator=g, dtype=torch.float64), S0=r(B, H, K, V))


@pytest.mark.parametrize("decay,inclusive", list(itertools.product([False, True], [False, True])))
def test_chunk_additive_specialised_equals_general(decay, inclusive):
    x = _inputs()
    consts = {"inclusive": inclusive, "group": None}
    if not decay:
        consts["log_gamma"] = None
    fn = _load(specialise(chunk_additive, **consts), "chunk_additive")
    lg = x["log_gamma"] if decay else None
    want = chunk_additive(x["q"], x["k"], x["v"], lg, x["S0"], 8, inclusive=inclusive)
    args = [x["q"], x["k"], x["v"]] + ([lg] if decay else []) + [x["S0"], 8]
    got = fn(*args)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    sig = inspect.signature(fn)
    assert "inclusive" not in sig.parameters and ("log_gamma" in sig.parameters) == decay


@pytest.mark.parametrize("decay,rho,inclusive", list(itertools.product([False, True], [False, True], [False, True])))
def test_chunk_delta_specialised_equals_general(decay, rho, inclusive):
    x = _inputs()
    consts = {"inclusive": inclusive}
    if not decay:
        consts["log_gamma"] = None
    if not rho:
        consts["log_rho"] = None
    src = specialise(chunk_delta, **consts)
    fn = _load(src, "chunk_delta")
    lg = x["log_gamma"] if decay else None
    lr = x["log_rho"] if rho else None
    want = chunk_delta(x["q"], x["k"], x["v"], x["beta"], lg, x["S0"], 8, log_rho=lr, inclusive=inclusive)
    kw = {"log_rho": lr} if rho else {}
    got = fn(x["q"], x["k"], x["v"], x["beta"], *([lg] if decay else []), x["S0"], 8, **kw)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    if not decay and not rho:
        assert "if decayed" not in src and "decayed =" not in src and "log_gamma is not None" not in src
    assert "Specialised for this module:" in src


def _dplr_inputs(decay, a_vec, b_kind, T=19, B=2, H=2, K=4, V=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    a = -u(B, T, H, K) * k if a_vec else -u(B, T, H)
    b = {"key": None, "scalar": u(B, T, H), "vector": u(B, T, H, K) * k}[b_kind]
    lg = {"none": None, "scalar": -u(B, T, H), "channel": -u(B, T, H, K)}[decay]
    return [r(B, T, H, K), k, r(B, T, H, V), a, b, lg, r(B, H, K, V)]


@pytest.mark.parametrize("decay,a_vec,b_kind,after", list(itertools.product(
    ["none", "scalar", "channel"], [False, True], ["key", "scalar", "vector"], [False, True])))
def test_chunk_dplr_specialised_equals_general(decay, a_vec, b_kind, after):
    """Every binding a generated module makes (b = None for b = k, no decay, the flags): the same
    numbers, bit for bit, as the general kernel (the kernel's elif chain over the decay kinds stays
    a chain when its head is undecided)."""
    x = _dplr_inputs(decay, a_vec, b_kind)
    consts = {"inclusive": True, "simultaneous": False, "read_after_decay": after, "group": None,
              "a_form": "vector" if a_vec else "scalar", "b_form": b_kind, "decay_form": decay}
    if b_kind == "key":
        consts["b"] = None
    if decay == "none":
        consts["log_decay"] = None
    src = specialise(chunk_dplr, **consts)
    # a generated module with a per-channel decay carries pair_index next to the kernel
    fn = _load((inspect.getsource(pair_index) + "\n\n" if decay == "channel" else "") + src, "chunk_dplr")
    want = chunk_dplr(*x, 4, inclusive=True, read_after_decay=after)
    args = [t for t, n in zip(x, ["q", "k", "v", "a", "b", "log_decay", "S0"]) if n not in consts]
    got = fn(*args, 4)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # the forms are decided: no test of them is left, and only the paths of this binding
    body = src.split('"""')[-1]
    for left in ("a_vec", "b_kind", "decay ==", "decay is", "decay !=", "_form"):
        assert left not in body, left
    assert ("pair_index" in body) == (decay == "channel")
    assert f"_dplr_solve(Nmat, rk, vg, {a_vec})" in body   # the solve of the a form decided at its call
    _assert_readable(src)


def _assert_readable(src: str):
    """No dead assignment and no docstring entry of a parameter the specialised kernel lacks."""
    fdef = ast.parse(src).body[0]
    assert unused_assignments(fdef) == []
    assert docstring_mismatches(fdef) == []


@pytest.mark.parametrize("decay,rho,inclusive", list(itertools.product([False, True], [False, True], [False, True])))
def test_specialised_delta_and_additive_kernels_read_cleanly(decay, rho, inclusive):
    consts = {"inclusive": inclusive, "group": None}
    if not decay:
        consts["log_gamma"] = None
    _assert_readable(specialise(chunk_additive, **consts))
    if not rho:
        consts["log_rho"] = None
    _assert_readable(specialise(chunk_delta, **consts))


def test_dead_assignments_go_and_live_or_effectful_ones_stay():
    src = (
        "def f(x, n, log):\n"
        "    # the table, empty\n"
        "    dec = {}\n"
        "\n"
        "    dec = {'a': x}\n"
        "    g = [None] * n\n"
        "    g = [x] * n\n"
        "    pair = divmod(n, 2)\n"
        "    noted = log.append(x)\n"
        "    grown = x.add_(1)\n"
        "    acc = 0\n"
        "    for i in range(n):\n"
        "        if i:\n"
        "            continue\n"
        "        acc = acc + i\n"
        "    s = x\n"
        "    s = s * 2\n"
        "\n"
        "    # a helper no one calls\n"
        "    def helper(y):\n"
        "        return y + 1\n"
        "\n"
        "    return dec, g, acc, s\n")
    out = drop_dead(src)
    assert "dec = {}" not in out and "the table" not in out and "g = [None]" not in out
    assert "pair =" not in out and "\n\n\n" not in out and "helper" not in out
    for kept in ("dec = {'a': x}", "g = [x] * n", "noted = log.append(x)", "grown = x.add_(1)", "acc = 0",
                 "s = x\n", "s = s * 2"):
        assert kept in out, kept
    ns = {}
    exec(out, ns)
    log, x = [], torch.tensor(2.0)
    dec, g, acc, s = ns["f"](x, 3, log)
    assert len(log) == 1 and x.item() == 3.0 and acc == 0 and s.item() == 6.0   # the effects ran
    assert dec["a"] is x and g == [x] * 3


def test_a_specialised_docstring_documents_its_own_signature():
    src = (
        "def f(x, y, flag=None, form=None):\n"
        '    """Add.\n'
        "\n"
        "    Args:\n"
        "        x, flag: the tensors.\n"
        "        y: another,\n"
        "            on two lines.\n"
        "        form: the form,\n"
        "            on two lines too.\n"
        "\n"
        "    Returns:\n"
        "        x + y.\n"
        '    """\n'
        "    if flag is not None:\n"
        "        x = x + flag\n"
        "    return x + y if form is None else x - y\n")
    out = specialise_source(src, {"flag": None, "form": None})
    assert "        x: the tensors." in out and "form" not in out.split("Specialised")[0]
    assert "y: another,\n            on two lines.\n\n    Returns:\n        x + y." in out
    _assert_readable(out)


def test_a_string_local_is_folded_and_its_comment_goes_with_it():
    src = ("def f(x, kind=None):\n    # the kind, from x unless given\n    k = kind if kind is not None else "
           "('a' if x > 0 else 'b')\n    if k == 'a':\n        return x + 1\n    y = max(x, (1 if k == 'b' else 2))"
           "\n    return y, ('p' if k == 'b' else 'q')\n")
    out = specialise_source(src, {"kind": "b"})
    assert "the kind" not in out and "k ==" not in out and "k = " not in out
    assert "y = max(x, 1)" in out and "return y, 'p'" in out      # a call's parentheses stay
    fn = _load(out, "f")
    assert fn(-3) == (1, "p") and fn(5) == (5, "p")
    assert _load(src, "f")(5, "b") == (5, "p")


def test_an_undecided_elif_stays_in_its_chain():
    src = ("def f(x, kind, flag=None):\n    if kind == 1:\n        x = x + 1\n    elif kind == 2:\n"
           "        x = x + 2\n    else:\n        x = x + 3\n    if flag is not None:\n        x = 0\n    return x\n")
    fn = _load(specialise_source(src, {"flag": None}), "f")
    assert [fn(0, kind) for kind in (1, 2, 3)] == [1, 2, 3]


def test_a_false_operand_ends_an_and_chain():
    src = ("def f(n, flag=False, other=None):\n    both = n == 1 and flag and other is None\n"
           "    either = n == 1 or not flag\n    return both, either\n")
    out = specialise_source(src, {"flag": False})
    assert "both = False" in out and "either = True" in out
    fn = _load(out, "f")
    assert fn(1) == (False, True) and fn(2) == (False, True)


def _calls_of(fn, code: str) -> list:
    return [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == fn.__name__]


def test_calls_lose_their_constant_arguments():
    code = ("def f(qn, kn, v, eta, state, S, self):\n"
            "    o, S = chunk_delta(qn, kn, v, eta, None, state['W'], self.chunk, log_rho=None, inclusive=True)\n"
            "    o2, S2 = chunk_delta(qn, kn, v, eta, None, S, self.chunk, log_rho=None, inclusive=True)\n"
            "    return o, o2\n")
    consts = constant_arguments(chunk_delta, _calls_of(chunk_delta, code))
    assert {"log_gamma": None, "log_rho": None, "inclusive": True}.items() <= consts.items()
    new = specialise_source(code, {}, drop={chunk_delta: frozenset(consts)})
    assert new == ("def f(qn, kn, v, eta, state, S, self):\n"
                   "    o, S = chunk_delta(qn, kn, v, eta, state['W'], self.chunk)\n"
                   "    o2, S2 = chunk_delta(qn, kn, v, eta, S, self.chunk)\n"
                   "    return o, o2\n")
    assert specialise(chunk_delta, **consts).startswith("def chunk_delta(q, k, v, beta, S0, chunk):")


def test_arguments_that_differ_between_calls_stay():
    code = ("def f(q, k, v, b, lg, S):\n"
            "    a = chunk_delta(q, k, v, b, None, S, 8, inclusive=True)\n"
            "    c = chunk_delta(q, k, v, b, lg, S, 8, inclusive=True)\n"
            "    return a, c\n")
    consts = constant_arguments(chunk_delta, _calls_of(chunk_delta, code))
    assert {"log_rho": None, "inclusive": True}.items() <= consts.items()  # log_rho: never passed, its default
    assert "log_gamma" not in consts
    new = specialise_source(code, {}, drop={chunk_delta: frozenset(consts)})
    assert "a = chunk_delta(q, k, v, b, None, S, 8)" in new and "c = chunk_delta(q, k, v, b, lg, S, 8)" in new
    assert specialise(chunk_delta, **consts).startswith("def chunk_delta(q, k, v, beta, log_gamma, S0, chunk):")


def _join(a, b, weight=None, *, mode="sum"):
    return a + b if mode == "sum" else a - b


def test_a_dropped_call_is_written_from_its_structure():
    """Positional and keyword arguments dropped, kept ones written through the folder (a decided
    conditional inside, an argument over two lines with its comment), calls nested in expressions, in
    a comprehension, in a lambda, in another dropped call's arguments and in a loop's header."""
    src = ("def f(x, y, flag=None):\n"
           "    z = _join(\n"
           "        x,\n"
           "        (y   # the second\n"
           "         * 2),\n"
           "        None,\n"
           "        mode='sum',\n"
           "    )\n"
           "    w = torch.tanh(_join(y, x if flag is None else -x, None, mode='sum') * 2)\n"
           "    pairs = [_join(a, b, None, mode='sum') for a, b in ((z, w), (w, z))]\n"
           "    twice = lambda t: _join(t, t, None, mode='sum')  # noqa: E731\n"
           "    for r in _join(_join(z, w, None, mode='sum'), (z, w)[0], None, mode='sum').unbind(0):\n"
           "        w = w + r.sum()\n"
           "    return z, w, pairs, twice(z), _join(x, y, mode='sum')\n")
    new = specialise_source(src, {"flag": None}, drop={_join: frozenset({"weight", "mode"})})
    assert "    z = _join(x, y   # the second\n         * 2)\n" in new    # the call's brackets hold it
    assert "    w = torch.tanh(_join(y, x) * 2)\n" in new
    assert "    pairs = [_join(a, b) for a, b in ((z, w), (w, z))]\n" in new
    assert "    twice = lambda t: _join(t, t)  # noqa: E731\n" in new
    assert "    for r in _join(_join(z, w), (z, w)[0]).unbind(0):\n" in new
    assert "return z, w, pairs, twice(z), _join(x, y)\n" in new
    assert "None" not in new.split("Specialised")[-1] and "mode" not in new
    ns = {"torch": torch, "_join": lambda a, b: a + b}
    exec(new, ns)
    ns_general = {"torch": torch, "_join": _join}
    exec(src, ns_general)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    for got, want in zip(ns["f"](x, y), ns_general["f"](x, y)):
        for a, b in zip(*(t if isinstance(t, list) else [t] for t in (got, want))):
            assert_same_function(a, b)


_RECURSIVE = '''
def kernel(x, mode=None):
    return _ping(x, 3, mode) + sum(map(_as_value, [x], [None]))


def _ping(x, n, mode=None):
    return x if n == 0 else _pong(x, n - 1, mode)


def _pong(x, n, mode=None):
    return _ping(x + 1, n, mode)


def _as_value(x, mode=None):
    return x if mode is None else -x


def _caller():
    return _as_value(1, None)
'''


def test_recursive_functions_and_ones_passed_as_values_stay_general(tmp_path, monkeypatch):
    (tmp_path / "recursive_demo.py").write_text(_RECURSIVE)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("recursive_demo")
    kernel_src, *own = specialise_calls(mod.kernel, {"mode": None}, lambda text: kernel_functions(mod.kernel, text))
    assert own == [inspect.getsource(f) for f in (mod._ping, mod._pong, mod._as_value)]
    assert "_ping(x, 3, None)" in kernel_src
    ns = {}
    for part in own + [kernel_src]:
        exec(part, ns)
    assert ns["kernel"](2) == mod.kernel(2) == 7


def test_an_unpacked_call_cannot_lose_arguments():
    src = "def f(x, args):\n    return _join(x, *args)\n"
    with pytest.raises(TypeError, match="unpacks its arguments"):
        specialise_source(src, {}, drop={_join: frozenset({"weight"})})
    assert constant_arguments(_join, _calls_of(_join, src)) == {}


_PHASES = '''
import torch


def kernel(x, y, scale=None, mode="sum", flag=False):
    """x and y combined, twice over, then scaled (:func:`_scale`) by :func:`_combine`.

    Args:
        x, y: the tensors.
        scale: a factor, or None.
        mode: "sum" or "diff".
        flag: add one to the doubled part.
    """
    z = _combine(
        x,
        (y   # the second, doubled
         * 2),
        None,
        mode=mode,
    )
    w = torch.tanh(_combine(y, x, None, mode=mode) * 2) + _twice(z, flag=flag)
    if scale is not None:
        w = _scale(w, scale)
    return [_combine(a, b, None, mode=mode) for a, b in ((z, w), (w, z))], w


def _scale(w, scale):
    return w * scale


def _combine(a, b, weight=None, *, mode="sum"):
    """a and b combined (b weighted first when a weight is given)."""
    if weight is not None:
        b = b * weight
    if mode == "sum":
        return a + b
    return a - b


def _twice(t, flag=False):
    """t doubled by :func:`_combine`, plus one when flagged."""
    u = _combine(t, t, None, mode="sum")
    if flag:
        u = _bump(u, None)
    return u


def _bump(u, step=None):
    return u + (1 if step is None else step)


def _unused(t):
    return _combine(t, t)
'''


@pytest.mark.parametrize("consts", [{"mode": "sum", "scale": None, "flag": True},
                                    {"mode": "diff", "flag": False}, {}])
def test_a_kernel_and_the_functions_it_calls_are_specialised_together(tmp_path, monkeypatch, consts):
    """Each private function is specialised to what every call of it passes -- the kernel's calls
    and those of another private function alike -- every call is written without those arguments,
    and the sources run with the general kernel's numbers."""
    (tmp_path / "phases_demo.py").write_text(_PHASES)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("phases_demo")
    reach = lambda text: kernel_functions(mod.kernel, text)  # noqa: E731
    kernel_src, *own = specialise_calls(mod.kernel, consts, reach)
    names = [ast.parse(s).body[0].name for s in own]
    flagged = consts.get("flag", True)     # _twice calls _bump (the kernel never does) when flagged
    scaled = "scale" not in consts
    assert names == ["_scale"] * scaled + ["_combine", "_twice"] + ["_bump"] * flagged   # in the module's order
    own = [s for s in own if not s.startswith("def _scale")]
    # a reference to a function the module does not carry (scale bound to None) names its module
    assert ("(:func:`_scale`)" if scaled else "(:func:`phases_demo._scale`)") in kernel_src
    assert "by :func:`_combine`." in kernel_src
    combine, twice = own[:2]
    if flagged:
        assert own[2].startswith("def _bump(u):") and "u = _bump(u)" in twice
    everywhere = consts.get("mode") == "sum"                  # _twice passes "sum" too
    assert combine.startswith("def _combine(a, b):" if everywhere else "def _combine(a, b, *, mode='sum'):")
    assert ("_combine(t, t)" in twice) == everywhere and "_combine(t, t, None" not in twice
    assert "_combine(x, y   # the second, doubled\n" in kernel_src
    assert "None, mode" not in kernel_src.split('"""')[-1]
    assert twice.startswith("def _twice(t):" if "flag" in consts else "def _twice(t, flag=False):")
    ns = {"_scale": mod._scale}
    for part in own + [kernel_src]:
        exec("import torch\n" + part, ns)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    got_pairs, got_w = ns["kernel"](x, y, *(() if "scale" in consts else (torch.tensor(0.5, dtype=torch.float64),)))
    scale = None if "scale" in consts else torch.tensor(0.5, dtype=torch.float64)
    want_pairs, want_w = mod.kernel(x, y, scale, consts.get("mode", "sum"), consts.get("flag", False))
    assert_same_function(got_w, want_w)
    for a, b in zip(got_pairs, want_pairs):
        assert_same_function(a, b)


def test_a_reassigned_parameter_is_refused():
    def f(x, flag=None):
        flag = x if flag is None else flag
        return flag

    with pytest.raises(TypeError, match="reassigns flag"):
        specialise(f, flag=None)


def test_a_use_the_folder_cannot_reach_is_refused():
    """A bound parameter read where the folder does not look (a loop over a tuple of parameters)
    fails at specialise time, not as a NameError in the generated module."""
    src = "def f(x, a=None, b=None):\n    for y in (a, b):\n        if y is not None:\n            x = x + y\n" \
          "    return x\n"
    with pytest.raises(TypeError, match="still read after specialising"):
        specialise_source(src, {"a": None})


def test_no_runtime_kernel_uses_a_backslash_continuation():
    """The specialiser and the layout work on bracketed lines; a backslash continuation in a
    kernel copied into generated modules would break both."""
    import memspec.runtime as rt
    root = Path(rt.__file__).parent
    for f in sorted(root.glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            assert not line.rstrip().endswith("\\"), f"{f.name}:{i}"


def test_references_to_functions_a_module_does_not_carry_name_their_module():
    src = specialise(chunk_dplr, inclusive=True)
    assert ":func:`memspec.runtime.dplr.recurrent_dplr`" in src and ":func:`recurrent_dplr`" not in src
    assert callable(dplr.recurrent_dplr)


def test_phase_sources_carry_the_phases_a_phase_calls(tmp_path, monkeypatch):
    """A kernel that calls phase ``_a``, which calls ``_b``: both are carried, in the module's
    order, and an unused ``_c`` is not."""
    import importlib.util

    import memspec.codegen.context as context
    path = tmp_path / "fake_phases.py"
    path.write_text("def _b(x):\n    return x + 1\n\n\ndef _a(x):\n    return _b(x) * 2\n\n\n"
                    "def _c(x):\n    return x\n")
    spec = importlib.util.spec_from_file_location("fake_phases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(context, "runtime_phases", module)
    parts = phase_sources(["def kernel(x):\n    return _a(x)\n"])
    assert [p.split("(")[0] for p in parts] == ["def _b", "def _a"]
    namespace: dict = {}
    for part in parts:
        exec(part, namespace)
    assert namespace["_a"](1) == 4
