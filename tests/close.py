"""One comparison for floats that different code paths computed.

Two code paths that compute the same function in floating point (a kernel and a hand-assembled
reference, a tuple of value pieces and their concatenation, a compiled graph and eager code, two
schedules of the reference interpreter) may order their sums differently, and how they do depends
on the CPU, the BLAS build and the thread count.  Such results are compared here at a tolerance
stated per dtype, never with ``torch.equal``; ``torch.equal`` stays for results that the *same*
operations produce (determinism, slicing, causality: an earlier output must not move at all).
"""
from __future__ import annotations

import torch

# (rtol, atol) per dtype: a few units in the last place of values of order one, times the
# length of the sums these tests take
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


def assert_same_function(actual: torch.Tensor, expected: torch.Tensor, msg=None) -> None:
    """``actual`` equals ``expected`` up to the rounding of another order of the same sums."""
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)
