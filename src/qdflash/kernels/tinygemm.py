"""torch's built-in int4 weight-only matmul (`aten._weight_int4pack_mm`, "tinygemm") as a third way to
run a packed 4-bit projection, beside the Triton kernel (`w4a16`) and cuBLAS on the dequantized weight.

Why: at one row it streams large packed weights faster than bf16 cuBLAS (docs/design.md: 1.74x on a
248K-vocab LM head at M = 1), where the Triton GEMV reads at a fraction of bandwidth at the
Qwen3.5-4B shape (issue 23). At 16 rows it is ~3x slower than bf16. So it is not chosen by rule:
`w4a16.tune` times it per shape and row bucket with the other two and a projection uses it only
where it won.

The numbers are this project's grid, repacked once, never requantized. tinygemm dequantizes an
unsigned nibble u with a per-group scale and zero as (u - 8) * scale + zero. The symmetric ints
q in [-8, 7] are therefore u = q + 8 with zero 0.

The CUDA op takes bf16 activations and scales, and the nibbles two to a byte (even column in the
high half). Its CPU twin (`*_for_cpu`, which takes the ints unpacked) is what the tests run.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

INNER_K_TILES = 8  # tinygemm's K tiling (2, 4 or 8); 8 reads the longest runs. K must be a multiple of 16 x 8
GROUPS = (32, 64, 128, 256)


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether tinygemm takes this shape here: a group it knows, N a multiple of 8, K of 128, and on
    CUDA bf16 activations (its only dtype there; the CPU op also takes fp32)."""
    device = torch.device(device)
    dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.bfloat16, torch.float32)
    return (group in GROUPS and n % 8 == 0 and k % (16 * INNER_K_TILES) == 0 and dtype in dtypes
            and hasattr(torch.ops.aten, "_weight_int4pack_mm"))


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This project's packed ints (`w4a16.pack_int4` words [N, K/8]) and scales [N, K/group] ->
    tinygemm's packed weight and its scales-and-zeros [K/group, N, 2] in `dtype`, on their device."""
    from .w4a16 import unpack_int4

    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"tinygemm cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    u = unpack_int4(words).to(torch.int32) + 8  # [N, K] in [0, 15]
    if words.is_cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8), INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, INNER_K_TILES)
    scale = scale.to(dtype)
    scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ dequant(W).T -> [M, N] in x's dtype (the scales' dtype)."""
    x = x.to(scales_and_zeros.dtype).contiguous()
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
