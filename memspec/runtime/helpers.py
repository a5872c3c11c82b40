"""Helpers that generated modules carry: the language's functions, input checks, the compile
wrapper, and the scans of the mini-batch and cache schedules.

Each is copied into a generated module with ``inspect.getsource`` (only those its code
calls), so each uses only ``torch``, ``time`` and ``warnings`` and, of memspec, only the kernels'
shared phases (:mod:`.phases`), which a module carries with the functions that call them.
The language's functions are named after the functions of the spec language
(``layernorm(x)`` in a spec is ``layernorm(x)`` in the generated code), which a spec can
never use as identifiers; the others start with ``_``, which spec names cannot.
"""
import time
import warnings

import torch

from .phases import _affine_steps


def layernorm(x, weight=None, bias=None):
    """LayerNorm over the last axis (eps 1e-5), then optional weight and bias."""
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rmsnorm(x, weight=None):
    """x / sqrt(mean(x^2) + 1e-6) over the last axis, times an optional weight."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)   # (x * x, rsqrt: 1.8x faster backward)
    return y if weight is None else y * weight


def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)   # (x * x, rsqrt: 1.8x faster backward)


def _l2norm_columns(x):
    """l2norm(x.T).T without the transposes: every column of x (over the second-last axis) scaled
    to x / sqrt(sum(x^2) + 1e-6).  The factor as exp(-log(.) / 2): torch.compile computes a
    broadcast factor with exp once per column, where it recomputes rsqrt (a division and a square
    root) for every element (LaCT's chunk step at chunk 64: 8% of the forward)."""
    return x * torch.exp(-0.5 * torch.log((x * x).sum(-2, keepdim=True) + 1e-6))


def _norm_axis(x, dim):
    """The 2-norm of x over a non-last axis `dim`, as sqrt(sum(x^2)) (a strided
    torch.linalg.vector_norm is 2-3x slower); below sqrt(finfo.tiny) (1e-19 in float32) it reads
    that floor, so that the gradient at a zero vector is 0, as vector_norm's.  As exp(log(.) / 2),
    so that torch.compile computes it once per vector where it is broadcast (see _l2norm_columns)."""
    return torch.exp(0.5 * torch.log((x * x).sum(dim).clamp_min(torch.finfo(x.dtype).tiny)))


class _OuterSum(torch.autograd.Function):
    """sum_t outer(x_t, d_t) = x^T d over the rows t of x [..., C, m] and d [..., C, n].  The
    backward forms both gradients row-major, d g^T and x g: autograd's product backward forms the
    gradient of the transposed operand transposed, [m, C], and every elementwise backward of the
    rows then reads it across its rows (LaCT's chunk step at chunk 512, compiled: 10% of the forward
    and backward, and the inputs' gradients left transposed)."""

    @staticmethod
    def forward(ctx, x, d):
        ctx.save_for_backward(x, d)
        return x.transpose(-2, -1) @ d

    @staticmethod
    def backward(ctx, g):
        x, d = ctx.saved_tensors
        gx = d @ g.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        gd = x @ g if ctx.needs_input_grad[1] else None
        return gx, gd


def _outer_sum(x, d):
    """x^T d, the sum over the rows t of outer(x_t, d_t) (x [..., C, m], d [..., C, n] -> [..., m,
    n]); under autograd through _OuterSum."""
    if torch.is_grad_enabled() and (x.requires_grad or d.requires_grad):
        return _OuterSum.apply(x, d)
    return x.transpose(-2, -1) @ d


def _renorm_columns(x, like):
    """l2norm(x.T).T * norm(like, over the second-last axis): every column of x scaled to the 2-norm
    of like's column, x / sqrt(sum(x^2) + 1e-6) * sqrt(sum(like^2)), like's norm floored as in
    _norm_axis (weight normalisation: a step's result kept at the columns' norms)."""
    return _scaled_columns(x, _column_norms2(like))[0]


def huber(x, delta):
    """Elementwise Huber penalty: x^2/2 where |x| <= delta, else delta * (|x| - delta/2)."""
    ax = x.abs()
    return torch.where(ax <= delta, 0.5 * x * x, delta * (ax - 0.5 * delta))


def _layernorm_grad(x, g, weight=None):
    """The gradient with respect to x of layernorm(x, weight, bias) (eps 1e-5), given the
    gradient g with respect to its output (one fused backward; differentiable)."""
    gw = g if weight is None else g * weight
    with torch.no_grad():
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, x.shape[-1:], None, None, 1e-5)
    return torch.ops.aten.native_layer_norm_backward(gw, x, x.shape[-1:], mean, rstd, None, None,
                                                     [True, False, False])[0]


def _rmsnorm_grad(x, g, weight=None):
    """The gradient with respect to x of rmsnorm(x, weight) (eps 1e-6), given g."""
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    gw = g if weight is None else g * weight
    return rstd * (gw - x * rstd.square() * (gw * x).mean(-1, keepdim=True))


def _l2norm_grad(x, g):
    """The gradient with respect to x of l2norm(x) (eps 1e-6), given g."""
    rnorm = torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    return rnorm * (g - x * rnorm.square() * (g * x).sum(-1, keepdim=True))


def _gelu_backward(g, x):
    """g * gelu'(x) for the exact (erf) GELU, in one fused (differentiable) op."""
    return torch.ops.aten.gelu_backward(g, x)


def _column_norms2(w):
    """The squared 2-norms of w's columns (over the second-last axis) [..., n], floored at
    finfo.tiny as _norm_axis floors them."""
    return torch.linalg.vecdot(w, w, dim=-2).clamp_min(torch.finfo(w.dtype).tiny)


def _scaled_columns(x, kept):
    """(x with every column scaled to the squared norm `kept` [..., n], as x / sqrt(sum(x^2) + 1e-6)
    * sqrt(kept); x's squared column norms; the squared factor).  Eagerly the fewest kernels; under
    torch.compile the factor as exp((log(.) - log(.)) / 2), once per column (see _l2norm_columns)."""
    if torch.compiler.is_compiling():
        nx = (x * x).sum(-2)
        ratio = torch.log(kept) - torch.log(nx + 1e-6)
        return x * torch.exp(0.5 * ratio).unsqueeze(-2), nx, torch.exp(ratio)
    nx = torch.linalg.vecdot(x, x, dim=-2)
    factor = kept / (nx + 1e-6)
    return x * factor.sqrt().unsqueeze(-2), nx, factor


def _renorm_kept(x, kept):
    """_renorm_columns(x, like) given like's squared column norms `kept` [..., n] (_column_norms2):
    returns (x's columns scaled to like's norms, the result's squared column norms).  Those follow
    without a pass over the result, kept |x|^2 / (|x|^2 + 1e-6) (floored): a state renormalised to
    its own norms (weight normalisation) carries them from chunk to chunk."""
    out, nx, factor = _scaled_columns(x, kept)
    return out, (factor * nx).clamp_min(torch.finfo(kept.dtype).tiny)


class _SiluBackward(torch.autograd.Function):
    """g * silu'(x) by aten's fused kernel (one pass where the expression takes six); its backward
    in differentiable operations (aten's kernel has no derivative of its own)."""

    @staticmethod
    def forward(ctx, g, x):
        ctx.save_for_backward(g, x)
        return torch.ops.aten.silu_backward(g, x)

    @staticmethod
    def backward(ctx, gout):
        g, x = ctx.saved_tensors
        s = torch.sigmoid(x)
        gg = gout * (s * (1 + x * (1 - s))) if ctx.needs_input_grad[0] else None
        # silu''(x) = s (1 - s) (2 + x (1 - 2 s))
        gx = gout * g * (s * (1 - s) * (2 + x * (1 - 2 * s))) if ctx.needs_input_grad[1] else None
        return gg, gx


def _silu_backward(g, x):
    """g * silu'(x) = g sigmoid(x) (1 + x (1 - sigmoid(x))): eagerly one fused kernel (under
    autograd through _SiluBackward); under torch.compile the expression, which inductor fuses."""
    if torch.compiler.is_compiling():
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))
    if torch.is_grad_enabled() and (g.requires_grad or x.requires_grad):
        return _SiluBackward.apply(g, x)
    return torch.ops.aten.silu_backward(g, x)


def attend(q, K, V, scale):
    """softmax(scale * K q) V over a cache: q [..., d], K [..., n, d], V [..., n, e] -> [..., e];
    scale a number or [..., 1]."""
    scores = (K @ q.unsqueeze(-1)).squeeze(-1) * scale
    return (torch.softmax(scores, dim=-1).unsqueeze(-2) @ V).squeeze(-2)


def append(cache, item, window=None):
    """Push item [..., d] onto cache [..., n, d]; keep the last `window` entries."""
    out = torch.cat([cache, item.unsqueeze(-2)], dim=-2)
    return out if window is None else out[..., -window:, :]


def _check(name, t, axes, sizes, ref=None):
    """Raise ValueError unless `t` is a floating tensor of shape `sizes` (None: any size),
    with the dtype and device of `ref` = (name, tensor) when given."""
    notation = "[" + ", ".join(axes) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {notation}, got {type(t).__name__}")
    want = "[" + ", ".join(a if s is None else str(s) for a, s in zip(axes, sizes)) + "]"
    if t.dim() != len(axes) or any(s is not None and s != n for s, n in zip(sizes, t.shape)):
        raise ValueError(f"{name}: expected {notation} = {want}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor {notation}, got {t.dtype}")
    if ref is not None and t.dtype != ref[1].dtype:
        raise ValueError(f"{name}: dtype {t.dtype} does not match {ref[0]} ({ref[1].dtype})")
    if ref is not None and t.device != ref[1].device:
        raise ValueError(f"{name}: device {t.device} does not match {ref[0]} ({ref[1].device})")
    return t


class _Compiled:
    """`torch.compile(fn, dynamic=dynamic)` (static shapes; None: torch.compile's automatic
    dynamic shapes), compiled at the first call.  A call on CPU without autograd (inference,
    evaluation) runs through inductor's C++ wrapper (`options={"cpp_wrapper": True}`): the graph's
    kernel calls, allocations and frees from C++, not Python (LaCT's forward at chunk 512: 7-15%
    faster).  A call under autograd keeps the Python wrapper: there the C++ one measured no faster
    and its backward graphs took 40% longer to compile.

    If compilation fails, warns and falls back: the C++ wrapper to the Python one, that to running
    `fn` eagerly from then on.  `seconds` is the wall time of the first (compiling) call."""

    def __init__(self, fn, dynamic=False):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=dynamic)
        self.inference = torch.compile(fn, dynamic=dynamic, options={"cpp_wrapper": True})
        self.seconds = None

    def __call__(self, *args):
        while self.compiled is not None:
            cpp = (self.inference is not None and not torch.is_grad_enabled()
                   and next((a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor)), False))
            try:
                start = time.perf_counter()
                out = (self.inference if cpp else self.compiled)(*args)
                if self.seconds is None:
                    self.seconds = time.perf_counter() - start
                return out
            except Exception as err:  # a construct torch.compile cannot handle on this machine
                first = str(err).splitlines()[0] if str(err) else ""
                failed = (f"torch.compile failed for {self.fn.__name__} "
                          f"({type(err).__name__}: {first})")
                if cpp:
                    warnings.warn(f"{failed} with the C++ wrapper; using the Python wrapper")
                    self.inference = None
                else:
                    warnings.warn(f"{failed}; running it eagerly")
                    self.compiled = None
        return self.fn(*args)


def _in_slices(step, eager, size, tensors, state):
    """A chunked forward ``fn(*tensors, state) -> (o, state)`` over its tokens ``size`` at a time.

    ``tensors`` are the views and gates ``[B, T, H, ...]``; every full slice of ``size`` tokens (a
    multiple of the chunk) goes through ``step`` (the forward under ``torch.compile`` with static
    shapes: all full slices have one shape, so it compiles once, whatever T), a shorter tail
    through ``eager``; the state is carried from slice to slice.  Exact: a chunked forward's
    token-local values and chunks do not depend on where the sequence was cut (at chunk
    boundaries).  Returns (o ``[B, T, H, ...]``, the final state)."""
    T = tensors[0].shape[1]
    if T <= size:
        return (step if T == size else eager)(*tensors, state)
    outs = []
    for t in range(0, T, size):
        part = [x[:, t:t + size] for x in tensors]
        o, state = (step if t + size <= T else eager)(*part, state)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def _decay_matrix(a):
    """The weights of s_i = a_i s_(i-1) + x_i over the C tokens of a chunk: a [B, H, C] ->
    (L [B, H, C, C] with L[i, j] = a_(j+1) ... a_i on and below the diagonal and 0 above it,
     P [B, H, C] with P[i] = a_1 ... a_i), so that s_i = P[i] s_0 + sum_j L[i, j] x_j.
    Built with one cumprod (exact for any a, zeros and negatives included)."""
    C = a.shape[-1]
    idx = torch.arange(C, device=a.device)
    later = idx.unsqueeze(0) > idx.unsqueeze(1)                            # [C, C]: l > j
    Z = torch.where(later, a.unsqueeze(-2), torch.ones_like(a).unsqueeze(-2))  # [B, H, C(j), C(l)]
    L = torch.cumprod(Z, dim=-1).transpose(-2, -1).tril()                  # [B, H, C(i), C(j)]
    return L, torch.cumprod(a, dim=-1)


def _linear_scan(a, x, s0):
    """s_i = a_i * s_{i-1} + x_i for the tokens i of a chunk, from s0.

    a [B, C, H] (or a number), x [B, C, H, *shape], s0 [B, H, *shape] -> [B, C, H, *shape] (token-major,
    contiguous).  In closed form, s_i = P[i] s0 + sum_{j <= i} L[i, j] x_j with the weights of
    _decay_matrix (one product of C^2 |shape| work); step by step (C fused multiply-adds) from 4,096 floats
    per token (B H |shape|) on, where the closed form's work outgrows them (measured 1.2x faster at 1,024
    floats per head, 5x at 8,192) -- but not under torch.compile, where the loop would unroll.
    """
    B, C, H = x.shape[:3]
    if not isinstance(a, torch.Tensor):
        a = torch.full((B, C, H), float(a), dtype=x.dtype, device=x.device)
    a = a.expand(B, C, H)
    if B * x[0, 0].numel() >= 4096 and not torch.compiler.is_compiling():
        a = a.reshape(a.shape + (1,) * (x.dim() - 3))
        return torch.stack(_affine_steps(x.unbind(1), a.unbind(1), s0), 1)
    L, P = _decay_matrix(a.transpose(1, 2))                                # [B, H, C, C], [B, H, C]
    xf = x.transpose(1, 2).reshape(B, H, C, -1)                            # [B, H, C, N]
    s = L @ xf + P.unsqueeze(-1) * s0.reshape(B, H, 1, -1)                 # [B, H, C, N]
    # token-major and contiguous: products of the per-token matrices (a Newton-Schulz iteration,
    # the reads) would otherwise copy the strided states at every call
    return s.reshape(B, H, C, *s0.shape[2:]).transpose(1, 2).contiguous()


def _block_tokens(C, floats):
    """How many of a chunk's C tokens solve their states together, given ``floats``, one token's
    largest state over the batch rows and heads: blocks of about 2^18 floats (1 MiB in float32)
    per state sequence, so that a block's per-token states stay in a core's cache between the
    products that make and read them (a chunk's would be fresh memory at every step: titans_muon's
    64 tokens of 4 [64, 128] states ran 1.2x slower in one block than in blocks of 8); the whole
    chunk under torch.compile, which fuses the steps instead."""
    if torch.compiler.is_compiling():
        return C
    return max(1, min(C, (1 << 18) // max(floats, 1)))


def _recomputing(option, T):
    """Does a call over T tokens recompute its per-token states in the backward?  ``option``: the
    module's `checkpoint` (True, False, or None: when training on more than 256 tokens, where the
    per-token states start to outweigh the rest of the layer)."""
    return torch.is_grad_enabled() and (option if option is not None else T > 256)


def _recomputed(fn):
    """``fn`` (-> (o, states)) whose backward recomputes its forward (``torch.utils.checkpoint``): autograd keeps its
    inputs, not the per-token states it materialises inside.  Reentrant (one recomputation, no
    hook per saved tensor: measured 1.4-2x faster than the non-reentrant form on per-token loops)
    when an input requires grad -- its gradients then come through ``.backward()``, which
    ``torch.autograd.grad`` cannot drive -- else, and under torch.distributed (DDP marks a parameter
    ready once per backward; a reentrant chunk would mark the ones it reads again), non-reentrant."""
    def flat(*args):   # (o, (states...)) -> (o, *states): a reentrant checkpoint tracks flat outputs only
        o, states = fn(*args)
        return (o, *states)

    def run(*args):
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        reentrant = not distributed and any(torch.is_tensor(a) and a.requires_grad for a in args)
        o, *states = torch.utils.checkpoint.checkpoint(flat, *args, use_reentrant=reentrant)
        return o, tuple(states)
    return run


def _window_band(C, R, window, like):
    """[C, R]: 1 where row r is in the window of token i (rows R - C + i - window + 1 .. R - C + i;
    the last C rows are the chunk's own tokens), else 0; dtype and device of `like`."""
    i = torch.arange(C, device=like.device).unsqueeze(1) + (R - C)             # [C, 1]: token i's row
    r = torch.arange(R, device=like.device).unsqueeze(0)                       # [1, R]
    return ((i - r >= 0) & (i - r < window)).to(like.dtype)


def _window_sums(g, C, window):
    """Each token's sum over the rows of its window: g [B, R, H, ...] holds one value per row ->
    [B, C, H, ...], with the [C, R] band of _window_band."""
    return torch.einsum("ir,br...->bi...", _window_band(C, g.shape[1], window, g), g)


def _causal_mask(T, N, window, device):
    """[T, N] boolean: new token i (position N - T + i) may attend to cached position j
    when j <= its position and j > its position - window."""
    pos = torch.arange(N - T, N, device=device).unsqueeze(1)               # [T, 1]
    j = torch.arange(N, device=device).unsqueeze(0)                        # [1, N]
    allowed = j <= pos
    if window is not None:
        allowed = allowed & (j > pos - window)
    return allowed


def _finite_prefix(*xs):
    """The tokens of a chunk before its first token whose inputs hold a non-finite value:
    xs [B, C, H] or [B, C, H, ...] -> [B, C, H] bool.  A chunked schedule computes the chunk
    from inputs masked with it (``torch.where``, never a product: 0 * inf is nan), so that a
    nan or inf in token j cannot reach the outputs of tokens before j through the chunk's
    [C, C] products; from token j on, the state itself is non-finite, as token by token."""
    ok = None
    for x in xs:
        if x.dim() > 3:  # the largest magnitude is inf or nan exactly when an entry is
            x = x.detach().abs().flatten(3).amax(-1)
        f = torch.isfinite(x)
        ok = f if ok is None else ok & f
    return torch.cummin(ok.to(torch.int32), dim=1).values.bool()


def _where_ok(ok, x, fill):
    """``x`` where ``ok`` (its leading axes), else ``fill`` (0.0 for inputs, nan for results)."""
    return torch.where(ok.reshape(ok.shape + (1,) * (x.dim() - ok.dim())), x, torch.full((), fill, dtype=x.dtype,
                       device=x.device))


def _masked_attention(q, K, V, mask, scale, window=None):
    """``scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scale)`` (q [B, H, T, d],
    K [B, H, N, d], V [B, H, N, e], mask [T, N] bool: ``_causal_mask(T, N, window)``) ->
    [B, H, T, e], with a non-finite query, key or value reaching only the outputs that attend
    to it: non-finite entries are replaced by zeros before the products (``torch.where``: a
    masked weight times a future inf would be nan) and the outputs that do attend to one (or
    whose query is one) are nan, as token by token.  A token is non-finite when the sum of
    its row is (one reduction per row); which outputs reach one comes from a prefix count of
    the non-finite keys over the mask's window, O(N) per head."""
    N, T = K.shape[2], q.shape[2]
    bad_kv = ~torch.isfinite(K.sum(-1) + V.sum(-1))                       # [B, H, N]
    bad_q = ~torch.isfinite(q.sum(-1))                                     # [B, H, T]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.where(bad_q.unsqueeze(-1), zero, q), torch.where(bad_kv.unsqueeze(-1), zero, K),
        torch.where(bad_kv.unsqueeze(-1), zero, V), attn_mask=mask, scale=scale)
    count = torch.cumsum(bad_kv.to(torch.int32), dim=-1)                  # [B, H, N] bad keys in [0, j]
    pos = torch.arange(N - T, N, device=q.device)                          # [T] positions of the queries
    reached = count[..., pos]                                              # [B, H, T] bad keys at or before
    if window is not None:                                                 # minus those out of the window
        before = pos - window
        reached = reached - torch.where(before >= 0, count[..., before.clamp_min(0)], 0)
    nan_value = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    return torch.where(((reached > 0) | bad_q).unsqueeze(-1), nan_value, out)
