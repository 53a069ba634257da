"""FBGEMM's CUTLASS mixed-dtype GEMM (PyPI `fbgemm-gpu-genai`, Meta, BSD) as one more way to run a packed
4-bit projection, beside our Triton kernel (`w4a16`), torch's int4 op (`tinygemm`), gemlite and cuBLAS on
the dequantized weight.

Why: issue 23 asks for the maintained W4A16 kernels to be timed first. `bf16i4bf16_shuffled` is
FBGEMM's Hopper kernel for bf16 activations and int4 weights whose nibbles are "preshuffled" once at
load (`preshuffle_i4`) into the order its warps read, which is what lets a mixed-dtype GEMM stream the
packed bytes instead of being bound by unpacking them. Like the others it is not chosen by rule:
`w4a16.tune` checks it against the dequantized product, times it per shape and row bucket, and a
projection uses it only where it won.

The numbers are this project's grid, repacked once, never requantized: the kernel dequantizes a signed
nibble q as q * scale + zero with per-group scale and zero laid out [K / group, N]. The symmetric ints
q in [-8, 7] are taken as they are, with zero 0.

Its limits: CUDA with bf16 activations, groups of at least 128 (FBGEMM's `quantize_int4_preshuffle`
says so), K a multiple of the group. Where it cannot be imported (the CPU, a torch other than the
wheel's: fbgemm-gpu-genai 1.6 is built against torch 2.11) it is simply not a candidate.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

_MODULE: list = []  # [True / False]: the ops loaded, once on first use


def load():
    """True where torch.ops.fbgemm's int4 GEMM is there (fbgemm-gpu-genai imports, on CUDA), else None."""
    if not _MODULE:
        try:
            import fbgemm_gpu.experimental.gen_ai  # noqa: F401 - registers torch.ops.fbgemm.*

            ok = hasattr(torch.ops.fbgemm, "bf16i4bf16_shuffled") and hasattr(torch.ops.fbgemm, "preshuffle_i4")
        except Exception:  # noqa: BLE001 - ImportError, and the OSError of a library built for another torch
            ok = False
        _MODULE.append(ok or None)
    return _MODULE[0]


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether FBGEMM takes this shape here: CUDA, bf16 activations, a group >= 128 that divides K, the ops loaded."""
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16 and group >= 128 and k % group == 0
            and n % 8 == 0 and load() is not None)


def two_per_byte(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit ints [N, K] (int8) -> int8 [N, K/2], FBGEMM's packing: column 2i in the low nibble,
    2i+1 in the high one, each as its two's-complement nibble."""
    if q.shape[-1] % 2:
        raise QdflashError(f"fbgemm_w4: in_features={q.shape[-1]} is odd")
    low, high = q[:, 0::2], q[:, 1::2]
    return torch.bitwise_or(torch.bitwise_and(low, 0xF), torch.bitwise_left_shift(high, 4)).contiguous()


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple:
    """This project's packed ints (`w4a16.pack_int4` words [N, K/8]) and scales [N, K/group] -> FBGEMM's
    preshuffled weight, its group scales and zeros (what `matmul` takes after x)."""
    from .w4a16 import unpack_int4

    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"fbgemm_w4 cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    group_scale = scale.t().to(torch.bfloat16).contiguous()  # [K / group, N]
    wq, group_scale = torch.ops.fbgemm.preshuffle_i4(two_per_byte(unpack_int4(words)), group_scale)
    return wq, group_scale, torch.zeros_like(group_scale)


def matmul(x: torch.Tensor, wq: torch.Tensor, group_scale: torch.Tensor, group_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ dequant(W).T -> [M, N] in bf16."""
    return torch.ops.fbgemm.bf16i4bf16_shuffled(x.to(torch.bfloat16).contiguous(), wq, group_scale, group_zero)
