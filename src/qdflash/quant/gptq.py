"""GPTQ (Frantar et al., 2022) for one linear layer: quantize columns one block at a time and push
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's inputs (H = 2 X^T X / n from calibration activations).

Output is on exactly the same grid as RTN (same GridSpec, per-group scales, same storage), so every
consumer treats both alike. With act-order the columns are visited by decreasing Hessian diagonal,
but the group scales are computed up front on the original weights ("static groups"), so the groups
stay contiguous and the format needs no column permutation.
"""

from __future__ import annotations

import torch

from .grid import GridSpec, compute_scale, quantize
from .quantlinear import QuantizedWeight


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over the rows x of a linear layer's inputs."""

    def __init__(self, in_features: int, device=None):
        """`device`: where H lives; None = where the first inputs are (no host copy per batch on a GPU)."""
        self.in_features, self.device = in_features, device
        self.h: torch.Tensor | None = None
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        # one batch in fp32 (fast GEMM), accumulated across batches in fp64 (no drift over many)
        x = x.reshape(-1, x.shape[-1]).float()
        if self.h is None:
            self.h = torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device or x.device)
        self.h += (x.T @ x).to(self.h.device, torch.float64)
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.h is None:  # never called: H = 0 (every input "dead"), as before
            return torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device)
        return (2.0 / max(self.n, 1)) * self.h


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    spec: GridSpec,
    *,
    damp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    scale_dtype: torch.dtype = torch.bfloat16,
    clip: torch.Tensor | float = 1.0,
) -> QuantizedWeight:
    w = w.detach().clone().double()
    out_features, in_features = w.shape
    spec.groups(in_features)
    h = h.detach().clone().double()
    dead = torch.diag(h) == 0  # inputs that were always zero: any value is fine, fix them to zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    # static groups: scales from the original weights (before error feedback moves them)
    scale, zero = compute_scale(w.float(), spec, clip, scale_dtype)
    group = spec.group_size if spec.group_size > 0 else in_features
    col_scale = scale.double().repeat_interleave(group, dim=1)  # [out, in]
    col_zero = zero.double().repeat_interleave(group, dim=1) if zero is not None else None

    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(in_features, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    col_scale = col_scale[:, perm]
    col_zero = col_zero[:, perm] if col_zero is not None else None

    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_features, dtype=h.dtype, device=h.device)
    # upper Cholesky factor of H^-1: row i holds the weights for spreading column i's error
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros_like(w)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        wb = w[:, start:end].clone()
        errb = torch.zeros_like(wb)
        hb = hinv[start:end, start:end]
        for j in range(end - start):
            col = wb[:, j]
            s = col_scale[:, start + j]
            z = col_zero[:, start + j] if col_zero is not None else 0.0
            qc = torch.clamp(torch.round(col / s) + z, spec.qmin, spec.qmax)
            q[:, start + j] = qc
            err = (col - (qc - z) * s) / hb[j, j]
            wb[:, j:] -= err.unsqueeze(1) * hb[j, j:].unsqueeze(0)
            errb[:, j] = err
        w[:, end:] -= errb @ hinv[start:end, end:]

    inv = torch.argsort(perm)
    q = q[:, inv].to(torch.int8)
    return QuantizedWeight(q, scale.to(scale_dtype), zero.to(torch.int8) if zero is not None else None, spec)


def rtn_quantize(w: torch.Tensor, spec: GridSpec, *, scale_dtype=torch.bfloat16, clip: torch.Tensor | float = 1.0) -> QuantizedWeight:
    """Round to nearest on the grid."""
    scale, zero = compute_scale(w.float(), spec, clip, scale_dtype)
    q = quantize(w.float(), scale, zero, spec)
    return QuantizedWeight(q, scale.to(scale_dtype), zero.to(torch.int8) if zero is not None else None, spec)
