"""The engine's projections: one object per (possibly fused) matmul, 16-bit or packed 4-bit.

`Projection.of([q_proj, k_proj, v_proj])` concatenates the output rows of several layers so that one
matmul reads them all (a decode step is bound by launches and bytes, not FLOPs). Dense `nn.Linear`
weights are concatenated; `QuantLinear`s on the symmetric 4-bit grid become packed int4 words + scales
run by the W4A16 Triton kernel (`qdflash.kernels.w4a16`) for up to 16 rows where the kernels run
(a GPU), except for a shape and row count where tuning timed cuBLAS on the dequantized 16-bit weight
faster (`w4a16.backend` "dense": then that weight is kept beside the packed one and used) or another
int4 kernel (`w4a16.EXTERNAL`: torch's tinygemm, gemlite, FBGEMM's, vLLM's Marlin; then its repacking of the same ints is kept),
and by a dequantized matmul
for longer inputs (a prefill). A 16-bit projection at one row
runs the Triton GEMV where `kernels.gemv.tune` found it faster than cuBLAS for its shape (`dense_linear`). Without kernels (the CPU) and for
other grids (8-bit, asymmetric), quantized layers run as their exact dequantized weight, computed
once: the same numbers, not the speed. Layers of different kinds are not fused. Biases (Qwen2's
q/k/v) are concatenated like the weights and added after the matmul, whatever ran it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import gemv as gemv_kernel
from ..kernels import w4_mma
from ..kernels.gemv import gemv, gemv_config, swiglu_pairs
from ..kernels.w4a16 import (EXTERNAL, MAX_ROWS, backend, dense_faster, dequantize_words, external_tiles, pack_int4, split_counts,
                             tune, w4a16_matmul)
from ..quant.grid import dequantize
from ..quant.quantlinear import QuantLinear


def _packable(m: nn.Module) -> bool:
    return (isinstance(m, QuantLinear) and m.latent is None and m.spec.bits == 4 and m.spec.symmetric
            and m.spec.group_size > 0 and m.in_features % 128 == 0)


class Projection:
    def __init__(self, weight: torch.Tensor | None = None, words: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, group: int = 0, dtype: torch.dtype | None = None, kernels: bool = False,
                 bias: torch.Tensor | None = None, pairs: bool = False):
        self.weight, self.words, self.scale, self.group, self.bias = weight, words, scale, group, bias
        self.pairs = pairs  # rows of (gate, up) pairs (`of(..., swiglu=True)`): an output row is not a module's row
        self.dtype = dtype or (weight.dtype if weight is not None else scale.dtype)
        self.out_features = (weight if weight is not None else words).shape[0]
        self.fast = words is not None and kernels
        self.kernels = kernels
        self._dense: torch.Tensor | None = None  # the dequantized weight, kept once a tuned-dense shape used it
        self._external: dict[str, tuple] = {}  # an external int4 kernel's packing (tinygemm, gemlite), made once a shape chose it
        if words is not None:
            self.in_features = words.shape[1] * 8
        else:
            self.in_features = weight.shape[1]
        # a one-row W4A16 call split over K reduces its splits in its own launch on these (zero between launches)
        self.counts = split_counts(self.out_features, words.device) if self.fast else None

    @classmethod
    def of(cls, modules: list[nn.Module], dtype: torch.dtype, kernels: bool = False,
           swiglu: bool = False) -> "Projection | Concat":
        """`kernels`: run packed 4-bit weights through the Triton kernel (else their dequantized weight). `swiglu`:
        `modules` are an MLP's gate and up projections, for `swiglu`; one Projection keeps their rows as (gate, up)
        pairs (`swiglu_pairs`), the order in which a matmul's epilogue can make silu(gate) * up."""
        if swiglu and len(modules) != 2:
            raise ValueError(f"Projection.of(swiglu=True) takes a gate and an up projection, got {len(modules)} modules")
        # without kernels no epilogue runs: the rows keep the modules' order, so the matmul is the model's (a CPU
        # BLAS blocks permuted rows differently: SmolLM2's fp32 logits moved by 3e-5)
        swiglu = swiglu and kernels
        join = (lambda parts: swiglu_pairs(*parts)) if swiglu else torch.cat
        bias = _biases(modules, dtype, join)
        if kernels and all(_packable(m) for m in modules) and len({m.spec.group_size for m in modules}) == 1:
            words = join([pack_int4(m.weight_int) for m in modules])
            scale = join([m.weight_scale for m in modules])
            return cls(words=words, scale=scale, group=modules[0].spec.group_size, dtype=dtype, kernels=kernels, bias=bias,
                       pairs=swiglu)
        if all(type(m) is nn.Linear for m in modules):
            return cls(weight=join([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach(),
                       kernels=kernels, bias=bias, pairs=swiglu)
        if all(isinstance(m, QuantLinear) and m.latent is None for m in modules):
            # no kernel (the CPU) or another grid: the exact dequantized weights, computed once
            return cls(weight=join([dequantize(m.weight_int, m.weight_scale, m.weight_zero_point, m.spec).to(dtype)
                                    for m in modules]), kernels=kernels, bias=bias, pairs=swiglu)
        if len(modules) > 1:  # (gate, then up, for swiglu)
            return Concat([cls.of([m], dtype, kernels) for m in modules])
        raise TypeError(f"the engine cannot run a {type(modules[0]).__name__} projection (fake-quant mode)")

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads from this projection's weights (the bandwidth bound's numerator): the
        packed ones for a 4-bit projection, also where tuning moved a row count to the 16-bit copy."""
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        return self.words.numel() * 4 + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out if self.bias is None else out + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return dense_linear(x, self.weight, self.kernels)
        rows = x.reshape(-1, x.shape[-1])
        if self.fast and rows.shape[0] <= MAX_ROWS:
            use = backend(self.out_features, self.in_features, self.group, rows.shape[0], x.dtype)
            if use == "w4a16":
                return w4a16_matmul(rows, self.words, self.scale, self.group, counts=self.counts).view(*x.shape[:-1], -1)
            if use in EXTERNAL:
                return EXTERNAL[use].matmul(rows, *self._packed_for(use, x.dtype), self.group).view(*x.shape[:-1], -1)
            return dense_linear(x, self._dense_weight(), self.kernels)
        # a prefill: the kept 16-bit copy where there is one (the same numbers), else dequantized for this call
        return F.linear(x, self._dense if self._dense is not None else self.dequantized())

    def dequantized(self) -> torch.Tensor:
        return dequantize_words(self.words, self.scale, self.group).to(self.dtype)

    def _packed_for(self, use: str, dtype: torch.dtype) -> tuple:
        """EXTERNAL[use]'s repacking of the ints and scales, made once: a captured step reads it at every replay."""
        if use not in self._external:
            self._external[use] = EXTERNAL[use].pack(self.words, self.scale, self.group, dtype)
        return self._external[use]

    def _dense_weight(self) -> torch.Tensor:
        """The dequantized 16-bit weight, computed once: a captured step reads it at every replay."""
        if self._dense is None:
            self._dense = self.dequantized()
        return self._dense

    def swiglu(self, x: torch.Tensor, epilogue: bool = True) -> torch.Tensor:
        """silu(gate) * up of a (gate, up)-pairs projection (`of(..., swiglu=True)`): in the matmul's epilogue where the
        kernel that runs this shape and row count (`_matmul`'s choice) takes one (the 16-bit GEMV, w4_mma; one K
        split), which saves the launch of its own that it otherwise is; else from the matmul's output."""
        fused = self._fused_swiglu(x) if epilogue else None
        if fused is not None:
            return fused
        pairs = self(x).unflatten(-1, (-1, 2))
        return F.silu(pairs[..., 0]) * pairs[..., 1]

    def _fused_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.reshape(-1, x.shape[-1])
        if not self.pairs or self.bias is not None or not self.kernels or rows.shape[0] > MAX_ROWS:
            return None
        weight = self.weight
        if self.fast:
            use = backend(self.out_features, self.in_features, self.group, rows.shape[0], x.dtype)
            if use == "mma":
                tile = w4_mma.default_config(self.out_features, self.in_features, self.group, rows.shape[0])
                if not w4_mma.swiglu_fits(tile):
                    return None
                return w4_mma.matmul(rows, *self._packed_for(use, x.dtype), self.group, config=tile,
                                     swiglu=True).view(*x.shape[:-1], -1)
            if use != "dense":
                return None
            weight = self._dense_weight()
        config = gemv_config(*weight.shape, weight.dtype, rows.shape[0])
        if config is None or not gemv_kernel.swiglu_fits(config, weight.shape[0]):
            return None
        return gemv(rows, weight, config, swiglu=True).view(*x.shape[:-1], -1)


def head_projection(model: nn.Module, dense: torch.Tensor, dtype: torch.dtype, kernels: bool) -> Projection:
    """The LM head as a Projection. A quantized head that packs (symmetric 4-bit) runs 1-16 rows on the
    W4 backend tuning chose, like a layer, and longer inputs on `dense`, its dequantized weight (kept: a
    prefill's logits); any other head runs `dense` (the 16-bit GEMV where tuning picked it)."""
    head = model.get_output_embeddings()
    if kernels and _packable(head):
        projection = Projection.of([head], dtype, kernels)
        projection._dense = dense  # the same numbers as dequantizing its ints again
        return projection
    return Projection(weight=dense, kernels=kernels)


def _biases(modules: list[nn.Module], dtype: torch.dtype, join=torch.cat) -> torch.Tensor | None:
    """The fused projection's bias (zeros for parts without one), or None when no part has one; `join`: how the
    weights' rows are joined (concatenated, or `swiglu_pairs`)."""
    present = [m.bias for m in modules if m.bias is not None]
    if not present:
        return None
    return join([m.bias.detach().to(dtype) if m.bias is not None else present[0].new_zeros(m.out_features, dtype=dtype)
                      for m in modules])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, kernels: bool) -> torch.Tensor:
    """x @ weight.T; 1-16 rows through the Triton GEMV where it was tuned faster than cuBLAS for the shape
    and row bucket (1 row: a decode step; 2-16: a verify block)."""
    rows = x.numel() // x.shape[-1]
    config = gemv_config(*weight.shape, weight.dtype, rows) if kernels else None
    if config is None:
        return F.linear(x, weight)
    return gemv(x.reshape(rows, -1), weight, config).view(*x.shape[:-1], -1)


def swiglu(w13: "Projection | Concat", x: torch.Tensor, epilogue: bool = True) -> torch.Tensor:
    """silu(gate) * up of a gate / up projection `w13` of x: (gate, up) row pairs (`Projection.of(..., swiglu=True)`;
    made in the matmul's epilogue where it can be, unless `epilogue` is False), or gate rows then up rows."""
    if isinstance(w13, Projection) and w13.pairs:
        return w13.swiglu(x, epilogue)
    gate, up = w13(x).chunk(2, dim=-1)
    return F.silu(gate) * up


class StreamNorm:
    """An RMSNorm of the residual stream into the model's dtype, the next matmul's input, as the engine computes it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(h)


def residual_norm(projection: "Projection | Concat", x: torch.Tensor, h: torch.Tensor,
                  norm: StreamNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream after a projection, h + projection(x), and `norm` of it (None: no norm follows)."""
    h = h + projection(x)
    return h, (norm(h) if norm is not None else None)


class Concat:
    """Several projections of different kinds applied to one input, outputs concatenated."""

    def __init__(self, parts: list[Projection]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def tuning_key(kind: str, n: int, k: int, rows: int, group: int | None = None) -> str:
    """`tune_projections`' key of a shape: "w4a16 NxKgG@rows" (kind "w4a16"), "gemv NxK" at one row, "gemv NxK@rows"."""
    if kind == "w4a16":
        return f"w4a16 {n}x{k}g{group}@{rows}"
    return f"gemv {n}x{k}" + (f"@{rows}" if rows > 1 else "")


def tune_projections(projections, dense_shapes=(), dtype: torch.dtype = torch.bfloat16) -> dict:
    """On the GPU, before capturing steps: time the W4A16 tiles of every packed shape (1 row and 16
    rows), and the 16-bit GEMV against cuBLAS for every dense shape at 1 and 16 rows (plus `dense_shapes`,
    e.g. the LM head). Later calls of those shapes use what won. Returns the timings, for metrics."""
    projections = list(projections)
    tuned = {}
    packed = {(p.out_features, p.in_features, p.group) for p in projections if p.words is not None and p.fast}
    # an MLP's gate / up kept as (gate, up) pairs: its tiles are checked in their silu(gate) * up epilogue too
    pairs = {(p.out_features, p.in_features, p.group) for p in projections if p.words is not None and p.fast and p.pairs}
    for n, k, group in sorted(packed):
        for rows in (1, MAX_ROWS):
            config, ms, dense_ms, others = tune(n, k, group, rows=rows, dtype=dtype, swiglu=(n, k, group) in pairs)
            tuned[tuning_key("w4a16", n, k, rows, group)] = {"config": config.__dict__, "ms": round(ms, 4), "dense_ms": round(dense_ms, 4),
                                                      **{f"{name}_ms": None if t is None else round(t, 4) for name, t in others.items()},
                                                      "used": backend(n, k, group, rows, dtype),
                                                      "external_tiles": external_tiles(n, k, group, rows, dtype)}
    dense = {tuple(p.weight.shape) for p in projections if p.weight is not None and p.kernels} | set(map(tuple, dense_shapes))
    # a packed shape that runs dense (at 1 or 16 rows): its 16-bit GEMV may beat cuBLAS too
    dense |= {(n, k) for n, k, group in packed if any(dense_faster(n, k, group, rows, dtype) for rows in (1, MAX_ROWS))}
    for n, k in sorted(dense):
        tuned[tuning_key("gemv", n, k, 1)] = gemv_kernel.tune(n, k, dtype=dtype)
        tuned[tuning_key("gemv", n, k, MAX_ROWS)] = gemv_kernel.tune(n, k, dtype=dtype, rows=MAX_ROWS)
    return tuned
