"""`QuantLinear`: a linear layer whose weight lives on an integer grid.

Two modes:
- packed (default): int buffers `weight_int` [out, in] (int8 in memory; packed to int32 on export),
  `weight_scale` [out, groups] in its storage dtype and, for asymmetric grids, `weight_zero_point`;
  forward dequantizes (cached while the ints do not change);
- fake-quant (QAD): `latent` is a trainable 16-bit weight; forward = STE fake quantization on the
  *frozen* scales, so training moves the weights along the same grid. `freeze()` turns the latent
  weights back into ints on that grid; the scales are never touched (bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .grid import GridSpec, dequantize, latent_in_cell, quantize, ste_fake_quantize


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out, groups], storage dtype
    zero: torch.Tensor | None  # [out, groups] ints (asymmetric only)
    spec: GridSpec

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, self.spec).to(dtype)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, spec: GridSpec, scale_dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        groups = spec.groups(in_features)
        self.register_buffer("weight_int", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=scale_dtype))
        self.register_buffer(
            "weight_zero_point", None if spec.symmetric else torch.zeros(out_features, groups, dtype=torch.int8)
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.latent: nn.Parameter | None = None
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_quantized(cls, linear: nn.Linear, qw: QuantizedWeight) -> "QuantLinear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, qw.spec, qw.scale.dtype)
        module.load(qw)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module.to(linear.weight.device)

    def load(self, qw: QuantizedWeight) -> None:
        self.weight_int.copy_(qw.q)
        self.weight_scale = qw.scale.clone()
        if qw.zero is not None:
            self.weight_zero_point = qw.zero.to(torch.int8).clone()
        self._dense = None

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight_int, self.weight_scale, self.weight_zero_point, self.spec)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight_int, self.weight_scale, self.weight_zero_point, self.spec).to(dtype)

    # -- QAD ------------------------------------------------------------------------------------
    def enable_fake_quant(self, dtype: torch.dtype = torch.float32, reference: torch.Tensor | None = None) -> None:
        """Trainable latent weight that rounds to exactly the current ints (so step 0 equals the PTQ
        model); with the original 16-bit weight as `reference`, it keeps that weight's position
        inside its rounding cell (grid.latent_in_cell)."""
        latent = latent_in_cell(self.weight_int, self.weight_scale, self.weight_zero_point, self.spec,
                                None if reference is None else reference.to(self.weight_int.device))
        self.latent = nn.Parameter(latent.to(dtype))
        self._dense = None

    def freeze(self) -> None:
        """Latent weights -> ints on the same (frozen) grid; back to packed mode."""
        if self.latent is None:
            return
        with torch.no_grad():
            self.weight_int.copy_(quantize(self.latent, self.weight_scale, self.weight_zero_point, self.spec))
        self.latent = None
        self._dense = None

    # -----------------------------------------------------------------------------------------
    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight forward multiplies by in `dtype`: the STE fake-quantized latent (fake-quant mode:
        gradients reach the latent), else the dequantized ints, computed once and kept. Code that needs
        a layer's weight as a tensor (a quantized LM head read by distillation or a drafter) uses this."""
        if self.latent is not None:
            return ste_fake_quantize(self.latent, self.weight_scale, self.weight_zero_point, self.spec).to(dtype)
        if self._dense is None or self._dense.dtype != dtype or self._dense.device != self.weight_int.device:
            self._dense = self.dequantized_weight(dtype)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight_for(x.dtype), bias)

    def extra_repr(self) -> str:
        mode = "fake-quant" if self.latent is not None else "packed"
        return f"in={self.in_features}, out={self.out_features}, {self.spec.name}, {mode}"
