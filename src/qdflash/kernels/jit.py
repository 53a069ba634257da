"""Triton helpers more than one kernel calls (one definition of a rounding rule each)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None

if triton is not None:

    @triton.jit
    def silu_rounded(x, dt: tl.constexpr):
        """silu of x as a 16-bit model's unfused ops give it: x rounded to the model's dtype `dt` (the op before's
        output), silu in fp32 (torch's: x / (1 + e^-x)), rounded to `dt` again; returned in fp32."""
        x = x.to(dt).to(tl.float32)
        return (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
