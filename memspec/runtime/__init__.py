"""Runtime: the torch-only code that generated modules carry.

Every function and class here is copied into generated modules with ``inspect.getsource``,
so each one is standalone: it uses only ``torch`` (and the standard library), no memspec
imports and no closures over module state.

* :mod:`.helpers`   -- the language's functions (layernorm, l2norm, ...), input checks, the
                       compile wrapper, scan helpers of the mini-batch and cache schedules;
* :mod:`.muon`      -- ``newton_schulz`` (the language's function) with its closed-form backward;
* :mod:`.additive`  -- the additive family's exact chunked kernel (per key channel under autograd, a
                       closed-form backward: ``_AdditiveChannel``, carried with the kernel);
* :mod:`.chained`   -- an additive state decayed on its columns (``chunk_value_decay``: gated slot
                       attention's key memory, the chained family's first pass);
* :mod:`.delta`     -- the delta family's exact chunked kernel (a scalar step, or one per value
                       channel);
* :mod:`.dplr`      -- diagonal-plus-low-rank transitions (``chunk_dplr``: R rank-1 sub-steps per
                       token, scalar or per-key-channel decays; DeltaNet, gated DeltaNet, KDA, GDN-2,
                       Comba, RWKV-7, gated DeltaProduct);
* :mod:`.phases`    -- the phases the exact chunked kernels share: their chunks and groups, the
                       layout of a sequence into chunks and back, the state passing over chunks
                       (``_pass_states``: each chunk's map ``S <- M S + D``, packed documents
                       entered and left); carried with the kernels that call them;
* :mod:`.oja`       -- a state transformed on its value side and read on its key side
                       (``chunk_oja``: the gated Oja rule);
* :mod:`.solve`     -- reads that solve a linear system with an additive state (``chunk_solve``:
                       conjugate gradients for every token of a chunk at once; Mesa);
* :mod:`.rows`      -- the dual form's scans of states decayed per row (exact products of decays);
* :mod:`.momentum`  -- the momentum delta rule (``chunk_momentum_delta``: two states coupled
                       linearly);
* :mod:`.scan`      -- elementwise linear recurrences ``h <- a * h + b`` (``chunk_scan``: every
                       token's state, any state shape; ``chunk_scan_read``: the scan fused with
                       its read for matrix states; HGRN, RG-LRU, Mamba-1);
* :mod:`.varlen`    -- packed variable-length sequences (``cu_seqlens``): the document bounds,
                       each document run alone, the documents' layout in the chunked kernels;
* :mod:`.wiring`    -- MAC / MAG / MAL around a memory layer.

Kernels
-------
Layout (flash-linear-attention): views ``[B, T, H, D]``, per-token scalars
``[B, T, H]``, per-channel gates ``[B, T, H, D]``, states ``[B, H, K, V]``.  Row-vector
convention: the probe of a state is ``q_t @ S`` and a write is ``outer(k_t, v_t)``; a
per-channel decay scales the rows of S (``Diag(gamma_t) S``).

Decays enter as *log* decays ``log_gamma <= 0``; inside a chunk only the decay from an
earlier token to a later one enters: ``exp(L_t - L_s)`` with ``s <= t`` (a difference of
cumulative log decays, never positive), or, per channel, a product of decays (each
``<= 1``).  Entries outside the causal mask are zeroed before ``exp`` so that neither the
values nor their gradients can overflow into NaN.  All arithmetic runs in float32 or
wider; the results are cast back to the input dtype.  T need not be a multiple of the
chunk size: the last chunk is shorter (the delta kernel pads only its per-token scalars;
the per-channel additive kernel pads its tail chunk with zero tokens).  T = 0 returns an
empty output and the initial state.  Chunks are processed in groups sized so that
temporaries stay small (about 512 KB on CPU): larger ones are page-faulted back on every
call.

Causality with non-finite inputs (the additive kernel): a NaN or inf in token t's
inputs must not reach the outputs of earlier tokens, so a causal mask is applied after the
product it masks (``tril_``), never by multiplying a future value by zero; where a dense
triangular matmul meets future values, their non-finite entries are taken out of it and put
back through a causal prefix sum (see :func:`.additive.chunk_additive`).

Per-channel decays (both the additive and the DPLR kernels) never form a ``[C, C, K]`` tensor
of decays: a chunk is halved level by level and every pair's weight is a product of two factors,
each a product of per-token decays (<= 1), so no exponent is positive and none is a difference
of long cumulative sums; everything stays in the input dtype (no float64: it runs where float64
is slow or missing).  The delta, DPLR, momentum and Oja kernels run a token with a non-finite
input as an identity token (``torch.where``, never a product with zero) and set every output that
reads a state at or after it, and the final state, to NaN at the end.
"""
