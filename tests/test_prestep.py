"""The split of the dual-form chunk step into ``_chunk_pre`` and ``_chunk_step``
(memspec.codegen.prestep) decides on the statements the writer recorded (what each binds and
reads), never on the generated text."""
import ast
from pathlib import Path

import pytest

import memspec
from memspec.codegen import dual, generate
from memspec.codegen.dualterms import Call, Post, Ref, local, method
from memspec.codegen.prestep import classify, split_pre
from memspec.codegen.text import Lines, Statement
from memspec.pipeline.build import generate_source, load_checked
from memspec.schedule import analyse

ROOT = Path(__file__).resolve().parent.parent


def record(lines, targets, reads, returns=False):
    return Statement(tuple(lines), frozenset(targets), frozenset(reads), returns)


def test_kinds_come_from_the_records_not_the_text():
    """Text that does not parse alone, and text that names other locals than the record says,
    are classified by the record: a state-dependent local taints what reads it, a statement
    of the inputs alone is `pre`, one of no batched input `free`."""
    recs = [
        record(["    # the gate's weights", "    a = torch.sigmoid("], {"a"}, {"g"}),   # does not parse
        record(["    n = S @ S"], {"n"}, {"lr"}),        # the text reads S, the record does not
        record(["    y = a"], {"y"}, {"S", "a"}),        # the text reads no state, the record does
        record(["    z = y"], {"z"}, {"y"}),             # reads a state-dependent local
        record(["    causal = ones"], {"causal"}, {"g"}),  # a batched read, but a free target
        record(["    return ("], (), {"z"}, returns=True),
    ]
    kinds = [st[3] for st in classify(recs, ["S"], ["g"], {"causal"})]
    assert kinds == ["pre", "free", "state", "state", "free", "state"]
    st = classify(recs, ["S"], ["g"], set())[0]
    assert st[0] == ["    # the gate's weights", "    a = torch.sigmoid("] and st[1] == {"a"} and st[2] == {"g"}


class _Writer:
    def shape(self, e):
        return ("d_k",)


def _body():
    body = Lines(record=True, level=2)
    body("# the decay of the chunk")
    body("d = torch.sigmoid(\n    g)", "[B, H, C]", targets=("d",), reads=("g",))
    body("W1 = self.W1.unsqueeze(-3)", targets=("W1",), reads=())
    body("u = d * k @ W1", targets=("u",), reads=("d", "k", "W1"))
    body("unused = k * 2", targets=("unused",), reads=("k",))
    body("S_end = S + u", targets=("S_end",), reads=("S", "u"))
    body("return o, (S_end,)", reads=("o", "S_end"), returns=True)
    return body


def test_split_pre_moves_what_reads_no_state_with_its_comments():
    """_chunk_pre gets the statements the state-dependent ones need (a multi-line one whole,
    its comment with it, the free param binding where it is read); _chunk_step the rest and
    the docstring's own lines."""
    L = Lines()
    L.level = 1
    doc = ['        """First line;', "        the state before the chunk.", '        """']
    got = split_pre(_Writer(), {"W1"}, L, "    def _chunk_step(self, S, k, g):", doc, _body(), ["S"], ["k", "g"])
    assert got == (["k", "g"], ["u"], [])
    text = "\n".join(L.lines)
    pre, step = text.split("    def _chunk_step(")
    assert "def _chunk_pre(self, k, g):" in pre and "return (u,)" in pre
    assert "# the decay of the chunk\n        d = torch.sigmoid(\n            g)  # [B, H, C]" in pre
    assert "W1 = self.W1.unsqueeze(-3)" in pre and "unused" not in text
    assert step.startswith("self, S, u):") and "the state before the chunk." in step
    assert "S_end = S + u" in step and "sigmoid" not in step and step.rstrip().endswith("return o, (S_end,)")


def test_nothing_to_split_keeps_every_line():
    body = Lines(record=True, level=1)
    body("S_end = S * 2", targets=("S_end",), reads=("S",))
    body("return S_end", reads=("S_end",), returns=True)
    L = Lines()
    assert split_pre(_Writer(), set(), L, "def _chunk_step(self, S):", ['    """Doc."""'], body, ["S"], []) is None
    assert L.lines == ["def _chunk_step(self, S):", '    """Doc."""', "    S_end = S * 2", "    return S_end", ""]


def test_a_recorded_block_refuses_a_statement_without_its_reads():
    body = Lines(record=True)
    body("# a comment is fine")
    with pytest.raises(AssertionError, match="without its reads"):
        body("x = y")


def test_terms_name_the_locals_their_code_reads():
    """A local's method or attribute in a term (``first.new_ones(first.shape[:3])``) counts as a read."""
    ones = Call(method("k", "new_ones"), (method("k", "shape[:3]"),))
    assert ones.render() == "k.new_ones(k.shape[:3])" and ones.names == {"k"}
    assert Post(Call("torch.ones", (local("C"),), (("dtype", method("q", "dtype")),)), ".tril()").names == {"C", "q"}
    assert Ref("(C,)", reads=frozenset({"C"})).names == {"C"} and Ref("(1, 0)").names == frozenset()


# no closed-form gradient (clamp): the deltas by torch.func.grad of _chunk_loss, one statement on two lines
TAPPED = """
name: probe
dims: {d_model: 8, heads: 2, d_k: 3, hidden: 4}
views: {q: d_k, k: d_k, v: d_k}
gates: {eta: 0.5 * sigmoid(logit), alpha: sigmoid(logit)}
state:
  W1: {shape: [d_k, hidden], init: normal(0.5)}
  W2: {shape: [hidden, d_k], init: normal(0.5)}
model: f(u) = clamp(u @ W1, -1, 1) @ W2
loss: 0.5 * sum((f(k) - v)^2)
update:
  - g1 = grad(loss, W1)
  - g2 = grad(loss, W2)
  - W1 = (1 - alpha) * W1 - eta * g1
  - W2 = W2 - eta * g2
read: f(q)
"""


@pytest.mark.parametrize("name", ["titans", "titans_mac", "titans_mag", "titans_mal", "ttt_mlp", "ttt_linear",
                                  "moneta", "yaad", "deltanet", "longhorn", "momentum_deltanet", "tapped"])
def test_records_say_what_the_text_binds_and_reads(name, monkeypatch):
    """For the dual-form specs, every recorded statement binds and reads (among the chunk
    step's locals and inputs) exactly what its generated text does."""
    seen = []
    real = dual.split_pre

    def spy(w, free, L, header, doc, body, carried, inputs):
        seen.append((body, carried, inputs))
        return real(w, free, L, header, doc, body, carried, inputs)

    monkeypatch.setattr(dual, "split_pre", spy)
    if name == "tapped":
        spec = memspec.loads(TAPPED, "yaml")
        generate(spec, analyse(spec))
    else:
        generate_source(load_checked(ROOT / f"specs/{name}.yaml"))
    assert len(seen) == 1, f"{name}: no dual-form chunk step"
    body, carried, inputs = seen[0]
    stmts = [ast.parse("\n".join(ln.strip() for ln in rec.lines if not ln.strip().startswith("#"))).body
             for rec in body.records]
    assert all(len(s) == 1 for s in stmts)
    targets = [{n.id for t in getattr(s[0], "targets", []) for n in ast.walk(t) if isinstance(n, ast.Name)}
               for s in stmts]
    local_names = set(carried) | set(inputs) | set().union(*targets)
    for rec, s, tg in zip(body.records, stmts, targets):
        reads = {n.id for n in ast.walk(s[0]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert set(rec.targets) == tg, rec.lines
        assert set(rec.reads) & local_names == reads & local_names, rec.lines
        assert rec.returns == isinstance(s[0], ast.Return)
    assert sum(len(r.lines) for r in body.records) == len([ln for ln in body.lines if ln.strip()])
