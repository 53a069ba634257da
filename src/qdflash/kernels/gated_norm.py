"""A Gated DeltaNet layer's gated RMSNorm (norm(o) * silu(z) per head, the out projection's input) in one launch.

Why: in a compiled decode step inductor makes it two kernels a layer (the variance, then the product), each a few
microseconds of latency at one row plus the time between kernels; one program per (token, head) reads the head's 128
values once and writes its output. Numbers: those of `engine.qwen3_5`'s unfused lines with transformers' module
(`Qwen3_5RMSNormGated`): o rounded to the model's dtype, the norm in fp32 and rounded, times the weight rounded,
times silu(z) in fp32 (x / (1 + e^-x), as torch computes it), rounded once more. A row's result depends on that row
alone, so a decode step and a verify block give a token the same output.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None

if triton is not None:

    @triton.jit
    def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, stride_zt, eps, H: tl.constexpr, D: tl.constexpr,
                               ROUND_PRODUCT: tl.constexpr):
        """Program (token t, head h): o [T, H, D] fp32, z rows stride_zt apart ([H * D] each, the model's dtype), the
        weight [D] and out [T, H * D] in the model's dtype. ROUND_PRODUCT: weight x norm is rounded to the model's
        dtype (torch's product of a weight in that dtype; an fp32 weight's product stays fp32)."""
        t = tl.program_id(0).to(tl.int64)  # a long prefill's T x row stride passes int32
        h = tl.program_id(1)
        rd = tl.arange(0, D)
        dt = out_ptr.dtype.element_ty
        x = tl.load(o_ptr + (t * H + h) * D + rd).to(dt).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / D
        normed = (x * tl.math.rsqrt(variance + eps)).to(dt).to(tl.float32)
        y = tl.load(w_ptr + rd).to(tl.float32) * normed
        if ROUND_PRODUCT:
            y = y.to(dt).to(tl.float32)
        g = tl.load(z_ptr + t * stride_zt + h * D + rd).to(tl.float32)
        tl.store(out_ptr + t * (H * D) + h * D + rd, (y * (g / (1.0 + tl.exp(-g)))).to(dt))


def supported(norm) -> bool:
    """Whether `norm` is a module this kernel computes: a weight [D] (D a power of two), an epsilon, silu."""
    weight = getattr(norm, "weight", None)
    d = weight.shape[-1] if weight is not None and weight.dim() == 1 else 0
    return (triton is not None and d > 0 and d & (d - 1) == 0 and getattr(norm, "activation", None) == "silu"
            and hasattr(norm, "variance_epsilon"))


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [T, H, D] fp32 (the recurrence's output), z [T, H * D] in the model's dtype (rows may be strided: the tail
    of the qkvz projection's output), weight [D] -> [T, H * D] in z's dtype."""
    if triton is None:
        raise QdflashError("gated_rms_norm needs triton")
    if o.dim() != 3 or o.dtype != torch.float32:
        raise QdflashError(f"gated_rms_norm: o must be fp32 [T, H, D], got {o.dtype} {tuple(o.shape)}")
    t, h, d = o.shape
    o = o.contiguous()
    if z.shape != (t, h * d) or z.stride(-1) != 1 or weight.shape != (d,) or not weight.is_contiguous():
        raise QdflashError(f"gated_rms_norm: z [{t}, {h * d}] with unit column stride and a weight [{d}] expected, got z "
                           f"{tuple(z.shape)} (strides {z.stride()}), weight {tuple(weight.shape)}")
    out = torch.empty(t, h * d, device=o.device, dtype=z.dtype)
    _gated_rms_norm_kernel[(t, h)](o, z, weight, out, z.stride(0), float(eps), H=h, D=d,
                                   ROUND_PRODUCT=torch.promote_types(weight.dtype, z.dtype) == z.dtype, num_warps=1)
    return out
