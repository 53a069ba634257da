"""Machete (vLLM's mixed-input GEMM for Hopper: CUTLASS 3, wgmma and TMA) as one more way to run a packed
4-bit projection, beside Marlin (`marlin_w4`), tinygemm, gemlite, FBGEMM, our Triton kernel and cuBLAS on
the dequantized weight.

Why: issue 23 asks for the maintained W4A16 kernels to be timed first. On the H200 vLLM itself prefers
Machete to Marlin wherever Machete takes the layer, and it had not been timed here. Like the others it is
not chosen by rule: `w4a16.tune` checks it against the dequantized product, times it per shape and row
bucket, and a projection uses it only where it won.

Where it comes from: the same library as Marlin, vLLM's `_C_stable_libtorch.abi3.so`, which also registers
`torch.ops._C.machete_prepack_B` and `torch.ops._C.machete_mm`; `marlin_w4.load()` loads it. What it takes
(vLLM 0.26.0's `MacheteLinearKernel` and `machete_utils`): compute capability 9.0, 16-bit activations, the
symmetric type `uint4b8`, groups of 64 or 128 (not this project's target group, 32: the drafter's 128 is
one), K a multiple of 64 and N of 128.

The numbers are this project's grid, repacked once, never requantized. `machete_prepack_B` reads GPTQ's
words [K/8, N] stored column-major, i.e. [N, K/8] row-major, which are our words as they are (vLLM passes
`w.t().contiguous().t()` of GPTQ's [K/8, N] for the same layout); the scales go [K/group, N] in the
activation dtype.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError
from . import marlin_w4

GROUPS = (64, 128)  # Machete's groups with 16-bit activations (besides per-channel, which our grid never uses)
_MODULE: list = []  # [True / None]: the ops there, checked once


def load():
    """True where vLLM's library is loaded (`marlin_w4.load`) and holds the Machete ops, else None."""
    if not _MODULE:
        ok = (marlin_w4.load() is not None and hasattr(torch.ops._C, "machete_mm")
              and hasattr(torch.ops._C, "machete_prepack_B"))
        _MODULE.append(ok or None)
    return _MODULE[0]


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether Machete takes this shape here (module docstring): a Hopper GPU, 16-bit activations, a group it
    has dividing K, K a multiple of 64 and N of 128, the ops loaded."""
    device = torch.device(device)
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and group in GROUPS and k % group == 0
            and k % 64 == 0 and n % 128 == 0 and load() is not None
            and torch.cuda.get_device_capability(device) == (9, 0))


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple:
    """This project's packed ints (`w4a16.pack_int4` words [N, K/8]) and scales [N, K/group] -> Machete's
    prepacked weight and its scales [K/group, N] (what `matmul` takes after x)."""
    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"machete_w4 cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    prepacked = torch.ops._C.machete_prepack_B(words.t(), dtype, marlin_w4.UINT4B8, dtype)
    return prepacked, scale.t().contiguous().to(dtype)


def _mm(x: torch.Tensor, prepacked: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """vLLM's op itself. Its schema in vLLM 0.26.0's library: machete_mm(Tensor A, Tensor B, int b_type,
    ScalarType? out_type, Tensor? group_scales, Tensor? group_zeros, int? group_size, Tensor? channel_scales,
    Tensor? token_scales, str? schedule) -> Tensor (no schedule: its own heuristic picks one per shape)."""
    return torch.ops._C.machete_mm(x, prepacked, marlin_w4.UINT4B8, None, scales, None, group, None, None, None)


# Our own custom op for the reason `marlin_w4` has one: vLLM registers the fake (meta) kernel of
# `_C::machete_mm` in Python, which we do not import, and torch.compile cannot trace an op without one.
@torch.library.custom_op("qdflash::machete_w4_mm", mutates_args=())
def _machete_mm(x: torch.Tensor, prepacked: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return _mm(x, prepacked, scales, group)


@_machete_mm.register_fake
def _(x, prepacked, scales, group):
    return x.new_empty((x.shape[0], scales.shape[1]), dtype=scales.dtype)


def matmul(x: torch.Tensor, prepacked: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ dequant(W).T -> [M, N] in the scales' dtype."""
    return _machete_mm(x.to(scales.dtype).contiguous(), prepacked, scales, group)
