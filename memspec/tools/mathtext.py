"""Expressions in mathematical notation (Greek letters, subscripts, ∇ℓ, ‖x‖², Σ) for
:mod:`.table` and the costs."""
from __future__ import annotations

from ..lang.expr import BinOp, Call, Expr, Name, Neg, Num, Transpose, format_number


SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
GREEK = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "eps": "ε", "epsilon": "ε", "eta": "η",
    "theta": "θ", "lam": "λ", "lambda_": "λ", "mu": "μ", "rho": "ρ", "sigma": "σ", "tau": "τ",
    "phi": "φ", "omega": "ω", "loss": "ℓ",
}
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
_MPREC = {"+": 1, "-": 1, "*": 2, "/": 2, "@": 2, "neg": 3, "^": 4, "atom": 6}


def mname(n: str) -> str:
    if n in GREEK:
        return GREEK[n]
    head = n.rstrip("0123456789")
    if head and head != n and "_" not in n:
        return mname(head) + n[len(head):].translate(SUBSCRIPT)
    return n


def _mprec(e: Expr) -> int:
    if isinstance(e, BinOp):
        return _MPREC[e.op]
    if isinstance(e, Neg) or (isinstance(e, Num) and float(e.value) < 0):
        return _MPREC["neg"]
    return _MPREC["atom"]


def _num_text(v) -> str:
    if float(v) == 0.5:
        return "½"
    return format_number(v).replace("-", "−")


def render(e: Expr) -> str:
    """An expression as plain-text math: ``W − η ∇ℓ(W)``, ``‖f(k) − v‖²``, ``k ⊗ v``."""
    if isinstance(e, Num):
        return _num_text(e.value)
    if isinstance(e, Name):
        return mname(e.id)
    if isinstance(e, Neg):
        inner = render(e.operand)
        return "−" + (f"({inner})" if _mprec(e.operand) < _MPREC["neg"] else inner)
    if isinstance(e, Transpose):
        inner = render(e.operand)
        return (f"({inner})" if _mprec(e.operand) < _MPREC["atom"] else inner) + "ᵀ"
    if isinstance(e, Call):
        a = e.args
        if e.fn == "grad":
            return "∇ℓ" + (f"({render(a[1])})" if len(a) > 1 else "")
        if e.fn == "outer":
            return f"{_wrap(a[0], 3)} ⊗ {_wrap(a[1], 3)}"
        if e.fn in ("sum", "mean", "norm", "softmax") and len(a) == 2:   # over a named axis
            axis = a[1].id if isinstance(a[1], Name) else render(a[1])
            if e.fn == "norm":
                return f"‖{render(a[0])}‖_{axis}"
            return {"sum": "Σ", "mean": "mean", "softmax": "softmax"}[e.fn] + f"_{axis}({render(a[0])})"
        if e.fn == "newton_schulz":
            steps = format_number(a[1].value) if isinstance(a[1], Num) else render(a[1])
            return f"NS{steps.translate(SUBSCRIPT)}({render(a[0])})"
        if e.fn == "sum" and isinstance(a[0], BinOp) and a[0].op == "^" and a[0].right == Num(2):
            return f"‖{render(a[0].left)}‖²"
        if e.fn == "norm":
            return f"‖{render(a[0])}‖"
        if e.fn == "sqrt":
            return "√" + _wrap(a[0], _MPREC["atom"])
        if e.fn == "abs":
            return f"|{render(a[0])}|"
        if e.fn == "sum":
            return f"Σ({render(a[0])})"
        if e.fn == "solve":
            return f"{_wrap(a[0], 6)}⁻¹ {_wrap(a[1], 3)}"
        if e.fn == "eye":
            return "I"
        if e.fn == "diag":
            return f"Diag({render(a[0])})"
        if e.fn == "attend":
            sc = a[3]
            if isinstance(sc, BinOp) and sc.op == "^" and (sc.right == Num(-0.5) or sc.right == Neg(Num(0.5))):
                return f"softmax({_wrap(a[1], 3)} {_wrap(a[0], 3)}/√{_wrap(sc.left, 6)}) · {_wrap(a[2], 3)}"
            return f"softmax({_wrap(sc, 3)} {_wrap(a[1], 3)} {_wrap(a[0], 3)}) · {_wrap(a[2], 3)}"
        if e.fn == "append":
            return f"[{render(a[0])}; {render(a[1])}]"
        return f"{e.fn}({', '.join(render(x) for x in a)})"
    if isinstance(e, BinOp):
        p = _MPREC[e.op]
        if e.op == "^":
            left = _wrap(e.left, p + 1)
            if isinstance(e.right, Num) and float(e.right.value) in (0.5, -0.5):
                return ("1/√" if float(e.right.value) < 0 else "√") + _wrap(e.left, _MPREC["atom"])
            if isinstance(e.right, Neg) and e.right.operand == Num(0.5):
                return "1/√" + _wrap(e.left, _MPREC["atom"])
            if isinstance(e.right, Num) and float(e.right.value).is_integer() and 0 <= float(e.right.value) < 10:
                return left + format_number(int(e.right.value)).translate(SUPERSCRIPT)
            return f"{left}^{_wrap(e.right, p)}"
        left = _wrap(e.left, p)
        right = _wrap(e.right, p + 1)
        sym = {"+": " + ", "-": " − ", "*": " ", "/": "/", "@": " · "}[e.op]
        if e.op == "@" and any(isinstance(x, Call) and x.fn == "diag" for x in (e.left, e.right)):
            sym = " "   # the papers' Diag(α) S
        return f"{left}{sym}{right}"
    raise TypeError(f"not an expression: {e!r}")


def _wrap(e: Expr, p: int) -> str:
    s = render(e)
    return f"({s})" if _mprec(e) < p else s
