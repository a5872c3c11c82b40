"""Phases shared by the exact chunked kernels: the chunks and their groups, the layout of a
sequence into chunks and back, and the state passing over chunks.

The exact chunked kernels (:mod:`.additive`, :mod:`.delta`, :mod:`.dplr`, :mod:`.momentum`) are
composed the same way: the sequence is cut into chunks of C tokens, processed G chunks at a time
(:func:`_chunk_groups`, :func:`_group_size`); a group's tokens are laid out chunk-major
(:func:`_chunk_major`), the family prepares each chunk's affine map of the state,
``S_end = M S_start + D``, batched over the group's chunks; :func:`_pass_states` carries the state
over the chunks in order, applying each chunk's map; the family's outputs are batched over the
group again, and :func:`_join_chunks` lays them back out token-major.  They start from
:func:`_initial_states` (packed documents laid out, the state before the first chunk); the ones
that solve a system per chunk (delta, dplr, momentum, oja, solve) screen non-finite inputs by one
rule (:func:`_screen`), where a solve would otherwise carry a NaN to earlier tokens (the additive
kernel has no solve: its masks keep a NaN causal, entry by entry as the token loop does).  The oja
and chained kernels keep layouts of their own and pass their states with :func:`_pass_states`; the
scan carries its chunks' end states by a scan of the same kind one level up.  The step
recurrences along a chunk's tokens or blocks (the mini-batch's decayed sums, the per-channel dual
form's rows and blocks) take one step each with :func:`_affine_steps`.

Generated modules carry the functions their kernels call (copied by source: torch only).
"""
import torch


def _initial_states(S0, documents, C, B, shape, dt, device):
    """Packed documents laid out for chunks of C tokens, each from a chunk's start
    (``documents.for_kernel``: their initial states S0 ``[N, *shape]`` in dtype ``dt``, or zeros),
    or None (``documents`` None: one sequence per batch row); and the state before the first chunk
    ``[B shape[0], *shape[1:]]``: S0 (``[B, *shape]``), or zeros (no S0, or packed: each document's
    state enters where it starts).  ``shape``: the state of a batch row, ``(H, ...)``."""
    docs = None
    if documents is not None:
        S_docs = S0.to(dt) if S0 is not None else torch.zeros(documents.count, *shape, dtype=dt, device=device)
        docs = documents.for_kernel(C, S_docs)
    if S0 is None or docs is not None:
        return docs, torch.zeros(B * shape[0], *shape[1:], dtype=dt, device=device)
    return docs, S0.to(dt).reshape(B * shape[0], *shape[1:])


def _screen(writes, decays, probes, docs, inclusive):
    """Non-finite inputs, one rule for the kernels that solve per chunk: a token whose state inputs
    are not all finite runs as an identity token (the kernel clears it by ``torch.where``, never by
    a product with zero), and every output that reads a state at or after it (in its document), and
    the final state, are set to NaN at the end; a non-finite probe makes only its own output NaN.
    So no NaN meets a product, forward or backward: the outputs before a bad token, and their
    gradients, are those of the clean sequence.  The flags come from one sum per token (NaN or inf
    when one of its inputs is), taken on the packed row and laid out with the documents.

    Args:
        writes: the state inputs ``[B, T, H, ...]`` (keys, values, steps...; None where absent),
            as the kernel takes them (not laid out); the axes after the heads are summed.
        decays: the log decays ``[B, T, H, ...]`` (None where absent): a decay of 0 (log -inf) is
            finite here.
        probes: ``[B, T, H, K]``, or None.
        docs: the packed documents' chunks (``_DocumentChunks``), or None.
        inclusive: the outputs read the state after their token (else before it).

    Returns:
        ``(ok [B, T', H], read_bad [B, T', H] or None (no probes), state_bad [B or N, H])``, bool on
        the laid-out row: the tokens that run as written, the outputs and the final states that are
        NaN.
    """
    dt = torch.promote_types(writes[0].dtype, torch.float32)
    total = 0
    for x in writes:
        if x is not None:
            total = total + (x.sum(tuple(range(3, x.dim())), dtype=dt) if x.dim() > 3 else x.to(dt))
    for x in decays:
        if x is not None:
            lg = x.to(dt).clamp_min(-80.0)
            total = total + (lg.sum(tuple(range(3, x.dim()))) if x.dim() > 3 else lg)
    bad = (~torch.isfinite(total)).to(dt)                            # [B, T, H]
    if docs is not None:
        bad = docs.lay(bad)                                          # (the slots after a document: ok)
    before = docs.cumsum(bad) if docs is not None else torch.cumsum(bad, dim=1)   # bad at or before t
    state_bad = (docs.total(bad) if docs is not None else bad.sum(1)) > 0
    read_bad = None
    if probes is not None:
        probe_bad = (~torch.isfinite(probes.sum(-1, dtype=dt))).to(dt)
        if docs is not None:
            probe_bad = docs.lay(probe_bad)
        read_bad = (before if inclusive else before - bad) + probe_bad > 0
    return bad == 0, read_bad, state_bad


def _group_size(chunks, width, group, device):
    """Chunks per batched group G (any G >= 1 gives the same numbers): ``group`` when given; on CPU
    so that a temporary of ``width`` floats per chunk stays near 512 KB (large per-call allocations
    are returned to the OS and page-faulted back on every call); on other devices 64 (caching
    allocators: fewer, larger launches).  At least 1, at most ``chunks`` (when there are any)."""
    if group is not None:
        G = int(group)
    elif device.type == "cpu":
        G = round((1 << 17) / width)
    else:
        G = 64
    return max(1, min(chunks, G))


def _chunk_groups(T, C, G, tail=None):
    """The groups of a sequence of T tokens in chunks of C, G chunks per group: ``(n, c, cp)`` per
    group, n chunks of c tokens laid out in cp slots; a tail chunk of ``r = T % C`` tokens is a group
    of its own, in r slots (``tail=None``), the next power of two (``"power of two"``) or C
    (``"chunk"``): the slots after its tokens are padding."""
    N, r = divmod(T, C)
    groups = [(min(G, N - j), C, C) for j in range(0, N, G)]
    if r:
        groups.append((1, r, C if tail == "chunk" else 1 << (r - 1).bit_length() if tail == "power of two" else r))
    return groups


def _split_groups(x, groups):
    """``[B, T, ...]`` -> one ``[B, n c, ...]`` piece per group (None -> Nones); a split, not slices:
    the backward of a slice fills a zero tensor of the whole input, once per group."""
    if x is None:
        return [None] * len(groups)
    return x.split([n * c for n, c, _ in groups], dim=1)


def _chunk_major(x, n, c, value=0.0):
    """``[B, T', H, *D]`` -> ``[n, B, H, c, *D]`` (a view unless padded): chunk j is ``[j]``; a
    sequence shorter than ``n c`` (a tail chunk) is padded with tokens of ``value``."""
    B, T, H = x.shape[:3]
    if T < n * c:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, n * c - T), value=value)
    x = x.reshape(B, n, c, H, *x.shape[3:])
    return x.permute(1, 0, 3, 2, *range(4, x.dim()))


def _token_major(o, B, H, c):
    """``[n B H, cp, D]`` -> ``[B, n, c, H, D]`` (a view): the first c slots of each chunk."""
    cp, D = o.shape[1:]
    return o.reshape(-1, B, H, cp, D)[:, :, :, :c].permute(1, 0, 3, 2, 4)


def _join_chunks(parts):
    """``[B, n, c, H, D]`` per group -> ``[B, T, H, D]``: one copy (a second one only for a tail
    chunk); no in-place writes."""
    B, _, C, H, D = parts[0].shape
    full = [x for x in parts if x.shape[2] == C]
    o = torch.cat(full, dim=1).reshape(B, -1, H, D)
    if len(full) < len(parts):
        o = torch.cat([o, parts[-1].reshape(B, -1, H, D)], dim=1)
    return o


def _pass_states(step, n, S, docs=None, j0=0, true_state=None):
    """The state passing over n chunks in order: ``S, x_j = step(j, S)`` applies chunk j's map
    ``S <- M_j S + D_j`` to the state at its start (and returns what its outputs need of the state:
    a chunk's reads of it, or None).

    Packed documents (``docs``, a ``_DocumentChunks``; ``j0`` the chunks before these): a chunk that
    starts a document enters its initial state, one that ends it leaves its final state
    (``true_state(j, S)``: the state at its true scale, when the kernel carries it scaled).

    Returns ``(S, starts, xs)``: the state after the last chunk, the states at the chunks' starts
    and the ``x_j`` (lists of n).
    """
    starts, xs = [], []
    for j in range(n):
        if docs is not None:
            S = docs.enter(j0 + j, S)                                # a document's initial state
        starts.append(S)
        S, x = step(j, S)
        if docs is not None:                                         # a document's final state
            docs.leave(j0 + j, S if true_state is None else true_state(j, S))
        xs.append(x)
    return S, starts, xs


def _affine_steps(x, a, s):
    """The states of the recurrence ``s_i = a_i * s_(i-1) + x_i`` over the pairs of ``x`` and ``a``
    (tensors in token or block order, each ``a_i`` broadcasting to ``x_i``), from ``s`` (None:
    ``s_0 = x_0``): a list, one state per pair.  One fused multiply-add a step (``addcmul``), each
    state a new tensor (a write into one stacked tensor would copy it whole in the backward)."""
    out = []
    for x_i, a_i in zip(x, a):
        s = x_i if s is None else torch.addcmul(x_i, a_i, s)
        out.append(s)
    return out


def _stacked(xs):
    """n tensors ``[BH, ...]`` -> ``[n BH, ...]`` (the one tensor itself when n = 1)."""
    return torch.stack(xs).flatten(0, 1) if len(xs) > 1 else xs[0]
