"""The integer grid: pure functions (no modules, no state), so each can be unit-tested.

Conventions (docs/recipe.md "target quant"): weights ``w [out, in]`` are split into groups of
``group_size`` consecutive input columns (``group_size = -1``: one group per output channel).
- symmetric: ints in [-2^(b-1), 2^(b-1) - 1] (4-bit: [-8, 7]), scale = amax / (2^(b-1) - 1) (= amax/7),
  no zero point: w ≈ q * scale;
- asymmetric: the same signed ints, scale = (max - min) / (2^b - 1) and an integer zero point z in the
  int range: w ≈ (q - z) * scale (compressed-tensors' convention, so 8-bit fits int8).
Scales are rounded to their storage dtype *before* the ints are computed, so dequantizing the stored
(ints, scale) reproduces exactly the values the model was evaluated with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QdflashError

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUPS = (32, 64, 128, -1)


@dataclass(frozen=True)
class GridSpec:
    bits: int = 4
    group_size: int = 32  # -1 = per output channel
    symmetric: bool = True

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise QdflashError(f"bits={self.bits} is not supported; choose one of {SUPPORTED_BITS}")
        if self.group_size not in SUPPORTED_GROUPS:
            raise QdflashError(f"group_size={self.group_size} is not supported; choose one of {SUPPORTED_GROUPS} (-1 = per channel)")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups(self, in_features: int, where: str = "layer") -> int:
        if self.group_size == -1:
            return 1
        if in_features % self.group_size:
            raise QdflashError(
                f"{where}: group_size={self.group_size} does not divide in_features={in_features} "
                f"(choose a group size that divides it, e.g. {[g for g in (32, 64, 128) if in_features % g == 0] or 'per-channel (-1)'})"
            )
        return in_features // self.group_size

    @property
    def name(self) -> str:
        return f"w{self.bits}g{self.group_size if self.group_size > 0 else 'ch'}{'' if self.symmetric else 'a'}"


def _grouped(w: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    out, inp = w.shape
    return w.reshape(out, spec.groups(inp), -1)


def compute_scale(
    w: torch.Tensor, spec: GridSpec, clip: torch.Tensor | float = 1.0, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scale [out, n_groups] (and zero point for asymmetric grids). `clip` shrinks the range
    (1.0 = full range; a tensor [out, n_groups] gives one ratio per group)."""
    g = _grouped(w.float(), spec)
    if spec.symmetric:
        amax = g.abs().amax(dim=-1) * clip
        scale = (amax / spec.qmax).clamp_min(1e-10).to(scale_dtype).float()
        return scale, None
    lo = (g.amin(dim=-1) * clip).clamp_max(0)
    hi = (g.amax(dim=-1) * clip).clamp_min(0)
    scale = ((hi - lo) / (spec.qmax - spec.qmin)).clamp_min(1e-10).to(scale_dtype).float()
    zero = torch.round(spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax)
    return scale, zero


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec) -> torch.Tensor:
    """Integers on the grid (int8 tensor, same shape as w), rounded to nearest and clamped."""
    g = _grouped(w.float(), spec)
    q = torch.round(g / scale.float().unsqueeze(-1))
    if zero is not None:
        q = q + zero.unsqueeze(-1)
    return q.clamp(spec.qmin, spec.qmax).reshape(w.shape).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec) -> torch.Tensor:
    g = _grouped(q.float(), spec)
    if zero is not None:
        g = g - zero.float().unsqueeze(-1)
    return (g * scale.float().unsqueeze(-1)).reshape(q.shape)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec) -> torch.Tensor:
    return dequantize(quantize(w, scale, zero, spec), scale, zero, spec).to(w.dtype)


def in_range_mask(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec) -> torch.Tensor:
    """True where w lies inside the representable range of its group (where the STE lets gradient through)."""
    g = _grouped(w.float(), spec)
    s = scale.float().unsqueeze(-1)
    z = zero.float().unsqueeze(-1) if zero is not None else 0.0
    lo, hi = (spec.qmin - z) * s, (spec.qmax - z) * s
    return ((g >= lo) & (g <= hi)).reshape(w.shape)


def ste_fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec) -> torch.Tensor:
    """Straight-through estimator with clipping: forward = fake_quantize(w); backward = identity where
    w is inside the grid's range and zero where it is clipped (docs/recipe.md: zero gradient where |w| > amax)."""
    fq = fake_quantize(w.detach(), scale, zero, spec)
    mask = in_range_mask(w.detach(), scale, zero, spec).to(w.dtype)
    return fq + (w - w.detach()) * mask


def mse_clip_search(
    w: torch.Tensor, spec: GridSpec, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7), scale_dtype=torch.float32
) -> torch.Tensor:
    """Per-group clip ratio (from `ratios`) minimising the group's squared rounding error."""
    best_err, best = None, None
    for ratio in ratios:
        scale, zero = compute_scale(w, spec, ratio, scale_dtype)
        err = (_grouped(fake_quantize(w.float(), scale, zero, spec) - w.float(), spec) ** 2).sum(-1)
        if best_err is None:
            best_err, best = err, torch.full_like(err, ratio)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, torch.full_like(err, ratio), best)
    return best


def latent_in_cell(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: GridSpec,
                   reference: torch.Tensor | None = None, margin: float = 0.999) -> torch.Tensor:
    """A float weight that rounds back to exactly `q` on this grid (QAD's starting latent).

    Without `reference` it is the grid value itself. With the original 16-bit weights as `reference`,
    it keeps each weight's fractional position inside its rounding cell (w/s - round(w/s)), moved
    into the cell of `q` (GPTQ may have picked a neighbouring one) and kept strictly inside it and
    inside the grid's range. Why: starting every latent at a cell's centre puts it half a step from
    the nearest rounding boundary, so QAD must move every weight that far before any int changes.
    """
    g = _grouped(q.float(), spec)
    s = scale.float().unsqueeze(-1)
    z = zero.float().unsqueeze(-1) if zero is not None else 0.0
    position = g
    if reference is not None:
        x = _grouped(reference.float(), spec) / s + z
        position = g + (x - torch.round(x)) * margin
    position = position.clamp(spec.qmin, spec.qmax)
    return ((position - z) * s).reshape(q.shape)
