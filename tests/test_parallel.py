"""Context parallelism (memspec.parallel): one sequence split into contiguous shards over P gloo
processes equals one process -- outputs, the state at the end of every shard, and the gradients of
the inputs, of rank 0's initial state and of the memory's parameters (summed over ranks) -- for
the state maps' scan (additive scalar and per channel with a shared normaliser, delta with
d_v < d_k, dplr, the momentum pair) and the relay (mini-batch Titans, with open chunks crossing
ranks; a cache).  T is a multiple of neither P nor the chunk."""
from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from close import assert_same_function

from memspec.parallel import parallel_plan

SPECS = Path(__file__).resolve().parent.parent / "specs"

# spec: (dims, path)
CASES = {
    "linear_attention": (dict(heads=2, d_k=6, d_v=6, chunk=4), "scan"),
    "gla": (dict(heads=2, d_k=6, d_v=6, chunk=4), "scan"),
    "gated_deltanet": (dict(heads=2, d_k=8, d_v=3, chunk=4), "scan"),
    "momentum_deltanet": (dict(heads=2, d_k=5, d_v=5, chunk=4), "scan"),
    "titans": (dict(heads=2, d_k=4, d_v=4, hidden=6, chunk=4), "relay"),
    "deltanet_column": (dict(heads=2, d_k=6, d_v=4, chunk=4), "scan"),   # a state [d_v, d_k], mapped transposed
}
SLOW_CASES = {
    "kda": (dict(heads=2, d_k=6, d_v=4, chunk=4), "scan"),
    "softmax_attention": (dict(heads=2, d_k=4, d_v=4), "relay"),
    "mesa": (dict(heads=1, d_k=4, d_v=4), "scan"),
    **{n: (dict(heads=2, d_k=4, d_v=3, chunk=4), "scan")
       for n in ("retention", "rwkv6", "hgrn2", "mamba2", "deltanet_textbook", "longhorn", "comba", "gdn2", "rwkv7",
                 "gated_deltaproduct")},
    "hgrn": (dict(heads=2, d_v=4, chunk=4), "relay"),
    "mlstm": (dict(heads=2, d_k=4, d_v=3, chunk=4), "scan"),
    "variants/linear_attention_column": (dict(heads=2, d_k=5, d_v=3, chunk=4), "scan"),
    "gated_oja": (dict(heads=2, d_k=4, d_v=4, chunk=4), "relay"),
    "gated_deltanet_channel": (dict(heads=2, d_k=4, d_v=3, chunk=4), "relay"),   # a transition per column
}


def _inputs(mem, B, T, gen):
    x = {n: torch.randn(B, T, mem.heads, getattr(mem, d), generator=gen, dtype=torch.float64)
         for n, d in mem.VIEWS.items()}
    gates = mem.GATES
    for g, shape in gates.items():
        dims = tuple(getattr(mem, d) for d in shape)
        x[g] = 0.1 + 0.8 * torch.rand(B, T, mem.heads, *dims, generator=gen, dtype=torch.float64)
    return x


def _case(name, dims, rank, world, group=None, T=23, learned=False):
    """``learned``: from the memory's own initial state (its parameters, if learned) instead of a given one."""
    import torch.distributed as dist

    from memspec.parallel import context_parallel, shard, shard_bounds
    from memspec.pipeline.build import build_memory

    torch.manual_seed(0)
    mem = build_memory(SPECS / f"{name}.yaml", compile=False, **dims).double()
    gen = torch.Generator().manual_seed(1)
    B = 2
    full = _inputs(mem, B, T, gen)
    state0 = {n: (0.3 * torch.randn(s.shape, generator=gen, dtype=torch.float64) if s.is_floating_point() else s)
              for n, s in mem.init_state(B, dtype=torch.float64).items()}
    probe = torch.randn(B, T, mem.heads, getattr(mem, next(iter(mem.VIEWS.values()))), generator=gen,
                        dtype=torch.float64)

    # one process
    xs = {n: x.clone().requires_grad_() for n, x in full.items()}
    s0 = None if learned else {n: s.clone().requires_grad_() for n, s in state0.items()}
    o_ref, s_ref = mem(**xs, state=s0)
    w_o = probe[..., :o_ref.shape[-1]]
    weights = {n: torch.randn(s_ref[n].shape, generator=gen, dtype=torch.float64) for n in state0}   # caches grow
    ((o_ref * w_o).sum() + sum((s_ref[n] * weights[n]).sum() for n in weights)).backward()
    g_ref = {n: x.grad for n, x in xs.items()}
    g0_ref = {n: s.grad for n, s in (s0 or {}).items()}
    gp_ref = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in mem.parameters()]
    mem.zero_grad(set_to_none=True)
    a, b = shard_bounds(T, world)[rank]
    with torch.no_grad():
        _, s_end = mem(**{n: x[:, :b] for n, x in full.items()}, state=None if learned else state0)   # the state where this shard ends

    # P processes
    mine = {n: shard(x, group).clone().requires_grad_() for n, x in full.items()}
    s0 = None if learned else {n: s.clone().requires_grad_() for n, s in state0.items()}
    o, s = context_parallel(mem, **mine, state=s0, group=group)
    s0 = s0 or {}
    loss = (o * shard(w_o, group)).sum()
    if rank == world - 1:
        loss = loss + sum((s[n] * weights[n]).sum() for n in weights)
    loss.backward()
    grads = [s0[n].grad if s0[n].grad is not None else torch.zeros_like(s0[n]) for n in s0]
    grads += [p.grad if p.grad is not None else torch.zeros_like(p) for p in mem.parameters()]
    for g in grads:
        dist.all_reduce(g, group=group)

    assert_same_function(o, o_ref[:, a:b], msg=lambda m: f"{name}: outputs of rank {rank}: {m}")
    assert not learned or any(r.abs().sum() > 0 for r in gp_ref), f"{name}: no learned initial state"
    assert set(s) == set(s_end), f"{name}: state entries {sorted(s)} at the end of rank {rank}, {sorted(s_end)}"
    for n in s_end:
        if isinstance(s_end[n], torch.Tensor):
            assert_same_function(s[n], s_end[n], msg=lambda m, n=n: f"{name}: state {n} at the end of rank {rank}: {m}")
        else:   # a position in an open chunk
            assert s[n] == s_end[n], f"{name}: state {n} at the end of rank {rank}: {s[n]} != {s_end[n]}"
    for n in mine:
        got = mine[n].grad if mine[n].grad is not None else torch.zeros_like(mine[n])   # (an empty shard)
        assert_same_function(got, g_ref[n][:, a:b], msg=lambda m, n=n: f"{name}: grad {n}, rank {rank}: {m}")
    for n, g in zip(s0, grads):
        assert_same_function(g, g0_ref[n], msg=lambda m, n=n: f"{name}: grad of the initial {n}: {m}")
    for g, ref in zip(grads[len(s0):], gp_ref):
        assert_same_function(g, ref, msg=lambda m: f"{name}: a parameter's grad: {m}")


def _documents_case(name, dims, offsets, rank, world, group=None):
    """Packed documents (B = 1) over the ranks, some spanning a rank boundary or a whole shard."""
    import torch.distributed as dist

    from memspec.parallel import context_parallel, local_documents, shard, shard_bounds
    from memspec.pipeline.build import build_memory

    torch.manual_seed(0)
    mem = build_memory(SPECS / f"{name}.yaml", compile=False, **dims).double()
    gen = torch.Generator().manual_seed(2)
    T, N = offsets[-1], len(offsets) - 1
    cu = torch.tensor(offsets)
    full = _inputs(mem, 1, T, gen)
    state0 = {n: 0.3 * torch.randn(s.shape, generator=gen, dtype=torch.float64)
              for n, s in mem.init_state(N, dtype=torch.float64).items()}
    xs = {n: x.clone().requires_grad_() for n, x in full.items()}
    s0 = {n: s.clone().requires_grad_() for n, s in state0.items()}
    o_ref, s_ref = mem(**xs, state=s0, cu_seqlens=cu)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    # (a state the documents leave at different chunk positions is not in a packed final state)
    weights = {n: torch.randn(s_ref[n].shape, generator=gen, dtype=torch.float64) for n in state0 if n in s_ref}
    ((o_ref * w_o).sum() + sum((s_ref[n] * weights[n]).sum() for n in weights)).backward()
    a, b = shard_bounds(T, world)[rank]
    with torch.no_grad():   # the documents' states at b (those that end by b: their final states)
        _, s_at_b = mem(**{n: x[:, :b] for n, x in full.items()}, state=state0,
                        cu_seqlens=torch.tensor([min(o, b) for o in offsets]))

    docs = local_documents(cu)
    mine = {n: shard(x).clone().requires_grad_() for n, x in full.items()}
    s0c = {n: s.clone().requires_grad_() for n, s in state0.items()}
    o, s = context_parallel(mem, **mine, state=s0c, cu_seqlens=cu, group=group)
    ends = [i for i in docs if offsets[i + 1] <= b]   # final states here
    loss = (o * shard(w_o)).sum()
    loss = loss + sum((s[n][[docs.index(i) for i in ends]] * weights[n][ends]).sum() for n in weights)
    loss.backward()
    grads = [s0c[n].grad if s0c[n].grad is not None else torch.zeros_like(s0c[n]) for n in s0c]
    for g in grads:
        dist.all_reduce(g, group=group)

    assert_same_function(o, o_ref[:, a:b], msg=lambda m: f"{name} {offsets}: outputs of rank {rank}: {m}")
    for n in weights:
        assert n in s, f"{name} {offsets}: rank {rank} returns no state {n}"
    for n in set(s_ref) & set(s_at_b):
        assert_same_function(s[n], s_at_b[n][docs], msg=lambda m, n=n: f"{name} {offsets}: rows {docs} of {n}: {m}")
    for n in mine:
        assert_same_function(mine[n].grad, xs[n].grad[:, a:b], msg=lambda m, n=n: f"{name}: grad {n}, rank {rank}: {m}")
    for n, g in zip(s0c, grads):
        assert_same_function(g, s0[n].grad, msg=lambda m, n=n: f"{name} {offsets}: grad of the initial {n}: {m}")


def _model_case(name, dims, rank, world, group=None):
    """A MemoryLM (two layers, short convolutions) over shards of its sequences: logits and every
    parameter's gradient (summed over ranks) as one process."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from memspec.parallel import shard
    from memspec.parallel.model import ShardedLM
    from memspec.tools.nn import MemoryLM

    torch.manual_seed(0)
    dims = {k: v for k, v in dims.items() if k != "heads"}
    model = MemoryLM(SPECS / f"{name}.yaml", vocab_size=16, d_model=8, n_layers=2, heads=2, **dims).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 16, (2, 23), generator=gen)
    y = torch.randint(0, 16, (2, 23), generator=gen)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1), reduction="sum").backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    mine = ShardedLM(model, model, group)(shard(x))
    F.cross_entropy(mine.reshape(-1, 16), shard(y).reshape(-1), reduction="sum").backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g, group=group)
    assert_same_function(mine, shard(logits), msg=lambda m: f"{name}: logits of rank {rank}: {m}")
    for (pname, _), g, r in zip(model.named_parameters(), grads, ref):
        assert_same_function(g, r, msg=lambda m, pname=pname: f"{name}: grad of {pname}: {m}")


def _bf16_case(name, dims, rank, world, group=None):
    """bfloat16 views: the states stay float32 through the maps and the scan, as in one process."""
    from memspec.parallel import context_parallel, shard, shard_bounds
    from memspec.pipeline.build import build_memory

    torch.manual_seed(0)
    mem = build_memory(SPECS / f"{name}.yaml", compile=False, **dims)
    full = {n: x.to(torch.bfloat16) for n, x in _inputs(mem, 2, 23, torch.Generator().manual_seed(4)).items()}
    a, b = shard_bounds(23, world)[rank]
    o_ref, _ = mem(**full)
    _, s_end = mem(**{n: x[:, :b] for n, x in full.items()})
    o, s = context_parallel(mem, **{n: shard(x) for n, x in full.items()}, group=group)
    assert o.dtype == torch.bfloat16 and all(v.dtype == torch.float32 for v in s.values())
    assert_same_function(o, o_ref[:, a:b], msg=lambda m: f"{name} bfloat16: outputs of rank {rank}: {m}")
    for n in s_end:
        assert_same_function(s[n], s_end[n], msg=lambda m, n=n: f"{name} bfloat16: state {n}, rank {rank}: {m}")


def _within_data_parallel_case(name, dims, rank, world):
    """Context parallel inside data parallel: 4 ranks as 2 replicas of 2 shards, each replica's
    shards on their own group ({0, 1} and {2, 3}: global ranks that are not the group's ranks)."""
    import torch.distributed as dist

    groups = [dist.new_group(list(r)) for r in ((0, 1), (2, 3))]   # every rank creates every group
    _case(name, dims, rank % 2, 2, group=groups[rank // 2])


DOCUMENTS = [[0, 3, 10, 10, 17, 23], [0, 2, 20, 23]]   # documents across rank boundaries; one over a whole shard


def _worker(rank, world, init, cases, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a collective that waits longer fails (a hang would otherwise stall the suite)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    failed = []
    try:
        for name, dims, *documents in cases:
            try:   # the collectives run alike on every rank whatever the comparisons find
                if documents == ["learned"]:
                    _case(name, dims, rank, world, learned=True)
                elif documents == ["bf16"]:
                    _bf16_case(name, dims, rank, world)
                elif documents == ["short"]:   # fewer tokens than ranks: empty shards
                    _case(name, dims, rank, world, T=2)
                elif documents == ["data parallel"]:
                    _within_data_parallel_case(name, dims, rank, world)
                elif documents == ["model"]:
                    _model_case(name, dims, rank, world)
                elif documents:
                    _documents_case(name, dims, documents[0], rank, world)
                else:
                    _case(name, dims, rank, world)
            except AssertionError:
                failed.append(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.txt").write_text("\n".join(failed))


def _spawn(world, cases, tmp_path, limit=300):
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "init"), cases, str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish in {limit} s")
    failed = [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(world)]
    assert not any(failed), "\n".join(failed)


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_one_process(world, tmp_path):
    """One spawn of ``world`` processes (the start-up is most of the time) runs every case: each memory
    over shards; packed documents across rank boundaries (a document that spans ranks continues from
    the state the ranks before it left); a MemoryLM with short convolutions (memories by scan and relay)."""
    cases = [(n, d) for n, (d, _) in CASES.items()]
    cases += [(n, CASES[n][0], d) for n in ("gated_deltanet", "momentum_deltanet", "titans") for d in DOCUMENTS]
    cases += [(n, CASES[n][0], "model") for n in ("gated_deltanet", "titans")]
    cases += [(n, CASES[n][0], "short") for n in ("momentum_deltanet", "titans")]
    cases += [(n, CASES[n][0], "bf16") for n in ("gated_deltanet", "linear_attention")]
    cases += [("titans", CASES["titans"][0], "learned")]   # learned initial state: read by rank 0 only
    _spawn(world, cases, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_more_families(world, tmp_path):
    _spawn(world, [(n, d) for n, (d, _) in SLOW_CASES.items()], tmp_path)


@pytest.mark.slow
def test_context_parallel_within_data_parallel_groups(tmp_path):
    """4 processes: two data-parallel replicas, each one sequence over a group of 2 ranks (the relay
    and the scan paths), equal to one process."""
    _spawn(4, [(n, CASES[n][0], "data parallel") for n in ("gated_deltanet", "titans", "linear_attention")],
           tmp_path)


@pytest.mark.parametrize("name", sorted({**CASES, **SLOW_CASES}))
def test_plan_path(name):
    path = {**CASES, **SLOW_CASES}[name][1]
    plan = parallel_plan(SPECS / f"{name}.yaml")
    assert plan.path == path, plan.text()
    assert plan.spec == name.split("/")[-1] and plan.reason in plan.text()


def test_plan_of_a_generated_module_finds_its_spec():
    from memspec.pipeline.build import build_memory

    mem = build_memory(SPECS / "gated_deltanet.yaml", compile=False, heads=1, d_k=4, d_v=4)
    plan = parallel_plan(mem)
    assert (plan.path, plan.schedule, plan.values) == ("scan", "delta", ("v",))
    assert parallel_plan(mem, "minibatch").path == "relay"   # approximate: chunks are positions
    assert "approximate" in parallel_plan(mem, "minibatch").reason


def test_one_process_without_a_group_is_the_memory_itself():
    from memspec.parallel import ContextParallel, context_parallel, shard
    from memspec.pipeline.build import build_memory

    mem = build_memory(SPECS / "gated_deltanet.yaml", compile=False, heads=2, d_k=4, d_v=4, chunk=4).double()
    x = _inputs(mem, 1, 9, torch.Generator().manual_seed(5))
    o, s = context_parallel(mem, **x)
    o_ref, s_ref = mem(**x)
    assert torch.equal(o, o_ref) and torch.equal(s["W"], s_ref["W"])   # the same call
    assert torch.equal(shard(x["q"]), x["q"])
    cu = torch.tensor([0, 4, 9])
    o, s = ContextParallel(mem)(**x, cu_seqlens=cu)
    o_ref, s_ref = mem(**x, cu_seqlens=cu)
    assert torch.equal(o, o_ref) and torch.equal(s["W"], s_ref["W"])


def test_plan_reasons():
    la = parallel_plan(SPECS / "linear_attention.yaml")
    assert [(g.states, g.sharing) for g in la.groups] == [(("S",), ("z",))]
    mom = parallel_plan(SPECS / "momentum_deltanet.yaml")
    assert [g.states for g in mom.groups] == [("W", "U")]
    assert "cache" in parallel_plan(SPECS / "softmax_attention.yaml").reason
    assert "elementwise" in parallel_plan(SPECS / "mamba.yaml").reason
    assert "blocks" in parallel_plan(SPECS / "hope_cms.yaml").reason


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["gated_deltanet", "titans"])
def test_train_context_parallel_matches_one_process(spec, tmp_path):
    """torchrun memspec train --context-parallel 2 on 2 processes, and on 4 (two data-parallel replicas
    of 2 shards): the loss curve of one process."""
    import json
    import os
    import subprocess
    import sys

    args = ["train", str(SPECS / f"{spec}.yaml"), "--steps", "3", "--batch", "4", "--seq-len", "24", "--pairs", "3",
            "--vocab", "16", "--d-model", "16", "--layers", "2", "--heads", "2", "--eval-size", "8", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    runs = {}
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    # 2 shards; 4 processes = 2 data-parallel replicas of 2 shards
    for name, launch in (("one", []), ("cp", torchrun + ["2"]), ("dp_cp", torchrun + ["4"])):
        cmd = [sys.executable, *launch, "-m", "memspec", *args, "--out", str(tmp_path / name)]
        cmd += ["--context-parallel", "2"] if name != "one" else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "log.json").read_text())
    for name in ("cp", "dp_cp"):
        torch.testing.assert_close(torch.tensor([e["loss"] for e in runs[name]["log"]]),
                                   torch.tensor([e["loss"] for e in runs["one"]["log"]]), rtol=1e-5, atol=1e-6)


def test_context_parallel_and_data_parallel_split_the_batch():
    """k x P processes: replica r = rank // P takes rows [r B/k, (r+1) B/k), shard rank % P of their
    tokens; P not dividing the processes, or --pack, is refused with the reason."""
    from types import SimpleNamespace

    from memspec.parallel.model import data_world, split_batch

    cfg = SimpleNamespace(context_parallel=2, pack=False, batch=4)
    x = torch.arange(4 * 10).reshape(4, 10)
    assert data_world(cfg, 4) == 2 and data_world(cfg, 2) == 1
    parts = [split_batch(x, x + 100, rank, 4, cfg, "cpu") for rank in range(4)]
    assert [p[0].tolist() for p in parts] == [x[:2, :5].tolist(), x[:2, 5:].tolist(), x[2:, :5].tolist(),
                                              x[2:, 5:].tolist()]
    assert torch.equal(parts[3][1], x[2:, 5:] + 100)
    with pytest.raises(ValueError, match="multiple of 2 processes"):
        data_world(cfg, 3)
    with pytest.raises(ValueError, match="no --pack"):
        data_world(SimpleNamespace(context_parallel=2, pack=True, batch=4), 2)
