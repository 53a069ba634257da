"""gemlite (PyPI `gemlite`, Mobius Labs' Triton low-bit kernels, Apache-2.0) as one more way to run a packed
4-bit projection, beside our Triton kernel (`w4a16`), torch's int4 op (`tinygemm`) and cuBLAS on the
dequantized weight.

Why: issue 23 asks for the maintained W4A16 kernels to be timed first, and gemlite's one-row kernel
(GEMV "RevSplit-K") is built to stream packed weights at batch 1, where ours and tinygemm read them at
~1.2 TB/s on the H200 (results/published/2026-12-02-h200-components-tinygemm). Like tinygemm it is not
chosen by rule: `w4a16.tune` checks it against the dequantized product, times it per shape and row
bucket, and a projection uses it only where it won.

The numbers are this project's grid, repacked once, never requantized: gemlite's "symmetric with shift"
mode dequantizes an unsigned nibble u as (u - zero) * scale, so the symmetric ints q in [-8, 7] are
u = q + 8 with zero 8, and the scales are ours in the activation dtype.

gemlite needs CUDA (it reads the device's properties when imported) and triton >= 3.6; where it cannot
be imported (the CPU, a machine without it: `pip install gemlite`) it is simply not a candidate.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

KINDS = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}  # activation dtype -> gemlite.DType name
_MODULE: list = []  # [gemlite or None], imported once on first use


def load():
    """The gemlite module, or None where it cannot be imported here (not installed, no CUDA, another triton)."""
    if not _MODULE:
        try:
            import gemlite
        except Exception:  # noqa: BLE001 - ImportError, and the CUDA / triton errors its import raises elsewhere
            gemlite = None
        _MODULE.append(gemlite)
    return _MODULE[0]


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether gemlite takes this shape here: on CUDA, activations it has a type for, K a multiple of 32
    and of the group (gemlite's own limits), gemlite importable."""
    return (torch.device(device).type == "cuda" and dtype in KINDS and group >= 16 and k % 32 == 0 and k % group == 0
            and load() is not None)


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple:
    """This project's packed ints (`w4a16.pack_int4` words [N, K/8]) and scales [N, K/group] -> a gemlite
    layer holding the same weight, packed its way (a 1-tuple: what `matmul` takes after x)."""
    from .w4a16 import unpack_int4

    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"gemlite cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    gemlite = load()
    kind = getattr(gemlite.DType, KINDS[dtype])
    layer = gemlite.GemLiteLinearTriton(4, group_size=group, in_features=k, out_features=n, input_dtype=kind,
                                        output_dtype=kind)
    u = (unpack_int4(words).to(torch.int16) + 8).to(torch.uint8)  # [N, K] in [0, 15]
    layer.pack(u, scale.to(dtype), 8)  # W = (u - 8) * scale
    return (layer,)


def matmul(x: torch.Tensor, layer, group: int) -> torch.Tensor:
    """x [M, K] @ dequant(W).T -> [M, N] in the layer's dtype."""
    return layer(x.to(layer.compute_dtype).contiguous())
