"""Packed documents over shards: :func:`context_parallel` with ``cu_seqlens`` (flash-linear-attention's
offsets ``[N + 1]`` of the whole row, the same on every rank; ``B = 1``).

Rank ``r`` holds the tokens ``[a, b)`` of the row.  Its documents (:func:`local_documents`) are those
with a token in ``[a, b)``, the one that spans ``[a, b)`` when the shard is empty, and the empty ones
at a position in ``[a, b)`` (at T: the last rank's).  The shard is cut into at most three runs:

* ``first`` -- the document that started on an earlier rank (``continues in``), from the state that
  rank's scan or relay gives;
* ``middle`` -- the documents that start and end in the shard: one packed call from their own rows of
  the initial state (``cu_seqlens`` shifted to the shard);
* ``last`` -- the document that goes on to the next rank (``continues out``), from its own row.

Only ``first`` waits for the ranks before.  The state a rank hands on is the ``last`` document's at
``b``: its map from the state at ``a`` is the shard's map ``(M, D)`` when one document spans the
whole shard, else ``M = 0`` and ``D`` the ``last`` run's final state (it starts in the shard).

The final states returned are the rank's documents' rows ``[N_r, H, ...]``, in document order: a
document's final state is on the rank where it ends (the ``last`` document's row is its state at
``b``).  Gradients of the initial state's rows are on the rank where each document starts.
"""
from __future__ import annotations

import torch

from . import comm
from .maps import Layout, attached, shard_bounds, shard_maps


def local_documents(cu_seqlens, group=None) -> list[int]:
    """The documents of this rank's shard (global indices, in order): see the module docstring."""
    offsets = [int(x) for x in cu_seqlens.tolist()]
    rank, size = comm.rank_and_size(group)
    a, b = shard_bounds(offsets[-1], size)[rank]
    return _local(offsets, a, b, rank == size - 1)


def _local(offsets, a, b, last_rank):
    out = []
    for i, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        if s < e and ((s < b and e > a) or (s < a and e > b)) or s == e and (a <= s < b or (last_rank and s == b)):
            out.append(i)
    return out


def _spans(offsets, x):
    return any(s < x < e for s, e in zip(offsets[:-1], offsets[1:]))


def run_documents(memory, inputs, state, cu_seqlens, schedule, plan, group, rank, size):
    """:func:`~.run.context_parallel` over packed documents; returns ``(o [1, T_r, ...], the rows
    ``{name: [N_r, H, ...]}`` of :func:`local_documents`)``."""
    offsets = [int(x) for x in cu_seqlens.tolist()]
    x = next(iter(inputs.values()))
    a, b = shard_bounds(offsets[-1], size)[rank]
    if x.shape[0] != 1 or x.shape[1] != b - a:
        raise ValueError(f"cu_seqlens: rank {rank} of {size} holds the tokens [{a}, {b}) of a row of "
                         f"{offsets[-1]} (B = 1); got views [{x.shape[0]}, {x.shape[1]}, ...]")
    docs = _local(offsets, a, b, rank == size - 1)
    into, out = _spans(offsets, a), _spans(offsets, b)
    N = len(offsets) - 1
    state = memory.init_state(N, device=x.device, dtype=x.dtype) if state is None else state

    def rows(ids):
        idx = torch.tensor(ids, dtype=torch.long, device=x.device)
        return {n: v.index_select(0, idx) for n, v in state.items() if isinstance(v, torch.Tensor)}

    def run(t0, t1, st, cu=None):
        piece = {n: v[:, t0 - a:t1 - a] for n, v in inputs.items()}
        return memory(**piece, state=st, schedule=schedule,
                      cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.long, device=x.device))

    first = docs[0] if into else None
    last = docs[-1] if out else None
    whole = first is not None and first == last
    middle = [i for i in docs if i not in (first, last)]
    pieces = {}                                                  # doc group -> (o, final state)
    if last is not None and not whole:                           # from its own row: no wait
        pieces["last"] = run(offsets[last], b, rows([last]))
    if middle:
        m0, m1 = max(offsets[middle[0]], a), min(offsets[middle[-1] + 1], b)
        pieces["middle"] = run(m0, m1, rows(middle), [max(o, a) - m0 for o in offsets[middle[0]:middle[-1] + 2]])
    carried, incoming = [], None
    if plan.path == "scan":
        layout = Layout(memory, plan, inputs)
        if whole:
            piece = layout.flat(*shard_maps(memory, inputs, schedule, plan, layout))
        elif last is not None:
            piece = layout.flat(None, pieces["last"][1])
        else:
            piece = layout.zeros()
        gathered = comm.all_gather(piece, group)
        carried = list(gathered)
        if into:
            incoming = layout.unflat(gathered[0])[1]
            for j in range(1, rank):
                incoming = layout.apply(*layout.unflat(gathered[j]), incoming)
    elif into:
        meta = comm.recv_object(rank - 1, group)
        shapes = [(s, d, x.device) for _, s, d in meta if s is not None]
        received = comm.recv(shapes, rank - 1, group) if shapes else []
        carried = list(received)                # in the graph even where nothing reads it
        got = iter(received)
        incoming = {n: (next(got) if s is not None else d) for n, s, d in meta}
    if first is not None:
        pieces["first"] = run(a, min(offsets[first + 1], b), incoming)
    if plan.path != "scan" and out:
        handed = pieces["first" if whole else "last"][1]
        meta = [(n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, None, v) for n, v in handed.items()]
        comm.send_object(meta, rank + 1, group)
        tensors = [v for v in handed.values() if isinstance(v, torch.Tensor)]
        token = comm.send(tensors, rank + 1, group) if tensors else None
        carried += [token] if token is not None else []
    order = [k for k in ("first", "middle", "last") if k in pieces]
    if not order:                                                # an empty shard with no document
        o = run(a, b, rows([0]))[0]                              # no tokens: the state stays as it was
        return attached(memory, o, {}, carried)
    o = torch.cat([pieces[k][0] for k in order], dim=1) if len(order) > 1 else pieces[order[0]][0]
    return attached(memory, o, _rows([pieces[k][1] for k in order]), carried)


def _rows(finals: list[dict]) -> dict:
    """The documents' final states in order: the tensor entries every run returned with one row shape."""
    keys = [k for k in finals[0] if all(isinstance(f.get(k), torch.Tensor) for f in finals)]
    keys = [k for k in keys if len({tuple(f[k].shape[1:]) for f in finals}) == 1]
    return {k: torch.cat([f[k] for f in finals], dim=0) if len(finals) > 1 else finals[0][k] for k in keys}
