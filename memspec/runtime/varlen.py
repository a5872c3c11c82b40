"""Packed variable-length sequences (flash-linear-attention's ``cu_seqlens``): the documents of
one row ``[1, T, ...]`` at offsets ``[N + 1]``, each run alone from its own initial state.

Generated modules carry these functions (copied by source: torch only).
"""
import torch


def _document_bounds(cu_seqlens, B, T):
    """The ``(start, end)`` of each document, from offsets ``[N + 1]`` (checked: a 1-D integer
    tensor from 0 to T, never decreasing, over a batch of one row)."""
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
            or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool):
        got = (f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens: expected an integer tensor of offsets [N + 1] (0, ..., T), "
                         f"got {got}")
    if B != 1:
        raise ValueError(f"cu_seqlens: the documents are packed into one row, so B must be 1, "
                         f"got B = {B}")
    offsets = [int(x) for x in cu_seqlens.tolist()]   # one device sync per call
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens: expected offsets rising from 0 to T = {T} without "
                         f"decreasing, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def _by_document(run, tensors, state, bounds, shrink=False):
    """Run packed documents, each alone (:func:`_by_length`; ``shrink``: :func:`_shrinking`, for a
    token loop, whose time follows its steps: measured 3.65x faster on 26 documents of 2,048 tokens,
    and 0.75-0.79x the time of one call per length for mini-batch chunks and caches)."""
    return (_shrinking if shrink else _by_length)(run, tensors, state, bounds)


def _by_length(run, tensors, state, bounds):
    """Run packed documents, each alone: ``run(*tensors, state)`` on the documents of each length
    as one batch ``[n, length, ...]`` (a mix of lengths costs one call per distinct length).

    ``tensors``: ``[1, T, ...]`` each; ``state``: ``{name: [N, H, ...]}`` (a row per document;
    streaming entries such as a chunk position, plain ints, are passed to every call).  Returns
    ``(o [1, T, ...], the final state {name: [N, H, ...]})``.  An entry the documents cannot
    share in one tensor (caches of different lengths; a mini-batch chunk or block left open at
    different positions) is left out of the final state, with the states it belongs to, so that
    a call continuing from it says what is missing instead of computing something else.
    """
    by_length = {}
    for i, (a, b) in enumerate(bounds):
        by_length.setdefault(b - a, []).append(i)
    outs, finals, order = [], [], []   # per group: outputs [n L, ...], final states, document ids
    for length, docs in by_length.items():
        rows = torch.tensor(docs, device=tensors[0].device)
        tokens = torch.tensor([t for i in docs for t in range(bounds[i][0], bounds[i][1])],
                              dtype=torch.long, device=tensors[0].device)
        xs = [x[0].index_select(0, tokens).reshape(len(docs), length, *x.shape[2:]) for x in tensors]
        group = {k: v.index_select(0, rows) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        o, final = run(*xs, group)
        outs.append(o.reshape(len(docs) * length, *o.shape[2:]))
        finals.append(final)
        order += docs
    # packed order: the outputs of document order[j] sit at its tokens; invert the gather once
    tokens = torch.tensor([t for i in order for t in range(bounds[i][0], bounds[i][1])], dtype=torch.long)
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    o = o.index_select(0, torch.argsort(tokens).to(o.device)).unsqueeze(0)
    back = torch.argsort(torch.tensor(order)).to(o.device)
    return o, _stack_finals(finals, back)


def _shrinking(run, tensors, state, bounds):
    """As :func:`_by_length`, as one batch that shrinks as documents end: the documents
    sorted longest first, ``run(*tensors, state)`` over the tokens between two consecutive document
    ends on the documents still running, each from its own state (every schedule streams: a call
    resumes exactly where the one before stopped).  A mix of lengths costs one call per distinct
    length; the calls add up to the longest document's tokens.

    Returns what :func:`_by_length` returns.
    """
    dev = tensors[0].device
    order = sorted(range(len(bounds)), key=lambda i: bounds[i][0] - bounds[i][1])   # longest first
    lengths = [bounds[i][1] - bounds[i][0] for i in order]
    rows = torch.tensor(order, dtype=torch.long, device=dev)
    cur = {k: v.index_select(0, rows) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    outs, where, finals, finished = [], [], [], []   # outputs, their packed tokens; finished documents
    n, done = len(order), 0                          # documents running (a prefix of order), tokens run
    while n:
        end = lengths[n - 1]                         # the next document end
        if end > done:
            tokens = torch.tensor([bounds[i][0] + t for i in order[:n] for t in range(done, end)],
                                  dtype=torch.long, device=dev)
            xs = [x[0].index_select(0, tokens).view(n, end - done, *x.shape[2:]) for x in tensors]
            o, cur = run(*xs, cur)
            outs.append(o.reshape(n * (end - done), *o.shape[2:]))
            where.append(tokens)
            done = end
        k = n
        while k and lengths[k - 1] == done:
            k -= 1
        finals.append({key: v[k:n] if isinstance(v, torch.Tensor) else v for key, v in cur.items()})
        finished += order[k:n]
        cur = {key: v[:k] if isinstance(v, torch.Tensor) else v for key, v in cur.items()}
        n = k
    if not outs:                                     # no tokens at all: the output is empty
        outs = [run(*[x[:, :0] for x in tensors], {k: v[:1] if isinstance(v, torch.Tensor) else v
                                                    for k, v in state.items()})[0][0]]
        where = [torch.zeros(0, dtype=torch.long, device=dev)]
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    o = o.index_select(0, torch.argsort(torch.cat(where))).unsqueeze(0)   # packed order
    back = torch.argsort(torch.tensor(finished, device=dev))
    return o, _stack_finals(finals, back)


def _stack_finals(finals, back):
    """Final states of the groups -> ``{name: [N, H, ...]}`` in document order (``back``: the
    inverse of the groups' document order); entries the groups cannot share are left out."""
    keys = list(dict.fromkeys(k for f in finals for k in f))
    out, ragged = {}, set()
    for k in keys:
        vals = [f.get(k) for f in finals]
        if all(isinstance(v, torch.Tensor) for v in vals) and len({tuple(v.shape[1:]) for v in vals}) == 1:
            out[k] = (torch.cat(vals, dim=0) if len(vals) > 1 else vals[0]).index_select(0, back)
        elif all(v is not None and not isinstance(v, torch.Tensor) for v in vals) and len(set(vals)) == 1:
            out[k] = vals[0]
        else:
            ragged.add(k)
    prefixes = {k.split(".")[0] for k in ragged if "." in k}
    for k in keys:
        if "." in k and k.split(".")[0] in prefixes:
            ragged.add(k.split(".")[1])   # the state a streaming entry belongs to
    return {k: v for k, v in out.items() if k not in ragged and k.split(".")[0] not in prefixes}


class _Documents:
    """Packed documents for the exact chunked kernels: offsets ``cu_seqlens [N + 1]`` of a row of T
    tokens.  A kernel lays them out for its chunk with :meth:`for_kernel`."""

    def __init__(self, cu_seqlens):
        self.offsets = [int(x) for x in cu_seqlens.tolist()]   # one device sync per call
        self.count = len(self.offsets) - 1                       # N

    def for_kernel(self, C, S0):
        """The layout of one kernel call: chunks of C tokens, initial states ``S0 [N, ...]`` (in the
        kernel's dtype)."""
        return _DocumentChunks(self.offsets, C, S0)


class _DocumentChunks:
    """Packed documents laid out for one exact chunked kernel call (flash-linear-attention's chunk
    indices): every document starts at a chunk, and its last chunk is filled up with zero tokens (an
    identity token of every kernel: no write, no decay), so that a chunk holds one document.  The
    state passes from chunk to chunk as ever, replaced by a document's initial state where it starts
    (:meth:`enter`) and read out where it ends (:meth:`leave`).

    ``offsets``: the documents' offsets ``[N + 1]`` in a row of T tokens; ``C``: the kernel's chunk;
    ``S0``: the initial states ``[N, ...]`` (already in the kernel's dtype).
    """

    def __init__(self, offsets, C, S0):
        dev = S0.device
        self.first, self.last = {}, {}                     # chunk -> the document it starts / ends
        slots, slot = [], 0                                # each document's first slot in the laid-out row
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            n = -(-(b - a) // C)                           # the document's chunks
            if n:
                self.first[slot // C] = i
                self.last[slot // C + n - 1] = i
            slots.append(slot)
            slot += n * C
        self.T = slot                                      # tokens of the laid-out row
        lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:])], device=dev)
        padded = (lengths + C - 1) // C * C
        first_slot = torch.tensor(slots, dtype=torch.long, device=dev)
        shift = first_slot - torch.tensor(offsets[:-1], dtype=torch.long, device=dev)
        # the slot of each packed token, and per slot its document and its document's first slot
        shift = shift.repeat_interleave(lengths, output_size=offsets[-1])
        self.give = torch.arange(offsets[-1], device=dev) + shift
        self.doc_of = torch.arange(len(slots), device=dev).repeat_interleave(padded, output_size=slot)
        self.start = first_slot.repeat_interleave(padded, output_size=slot)
        filled = torch.zeros(slot, dtype=torch.bool, device=dev).index_fill_(0, self.give, True)
        self.pads = (~filled).nonzero()[:, 0]              # the slots after each document's end
        self.S0 = S0
        self.finals = list(S0.unbind(0))                   # an empty document keeps its state

    def lay(self, x):
        """``[1, T, ...]`` -> ``[1, T', ...]``: the laid-out row, zeros after each document (None stays
        None)."""
        if x is None:
            return None
        out = x.new_empty(1, self.T, *x.shape[2:]).index_copy_(1, self.give, x)
        return out.index_fill_(1, self.pads, 0)

    def unlay(self, o):
        """``[1, T', ...]`` -> ``[1, T, ...]``: the outputs of the real tokens, in packed order."""
        return o.index_select(1, self.give)

    def enter(self, j, S):
        """The state at the start of chunk j: a document's initial state where one starts."""
        i = self.first.get(j)
        return S if i is None else self.S0[i].reshape(S.shape)

    def leave(self, j, S):
        """Chunk j has run: keep S as its document's final state where the document ends."""
        i = self.last.get(j)
        if i is not None:
            self.finals[i] = S.reshape(self.S0.shape[1:])

    def final(self):
        """The documents' final states ``[N, ...]``."""
        return torch.stack(self.finals)

    def cumsum(self, x):
        """Cumulative sums over ``[1, T', ...]`` that restart at each document."""
        c = torch.cumsum(x, dim=1)
        return c - (c - x).index_select(1, self.start)

    def total(self, x):
        """Sums of ``[1, T', *rest]`` per document: ``[N, *rest]``."""
        out = x.new_zeros(self.S0.shape[0], *x.shape[2:])
        return out.index_add(0, self.doc_of, x[0])
