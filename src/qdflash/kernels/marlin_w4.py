"""Marlin (IST Austria's mixed-precision GEMM, as vLLM builds and ships it) as one more way to run a packed
4-bit projection, beside our Triton kernel (`w4a16`), torch's int4 op (`tinygemm`), gemlite, FBGEMM and
cuBLAS on the dequantized weight.

Why: issue 23 asks for the maintained W4A16 kernels to be timed first, Marlin-style ones included where a
build exists for this torch. Marlin is written to stream 4-bit weights at batch 1-16 near the memory
bound; tinygemm, gemlite and FBGEMM read them at 0.35-1.8 TB/s on the H200 at one row
(results/published/2026-12-02-h200-w4-kernels, 2026-12-03-h200-w4-fbgemm). Like the others it is not
chosen by rule: `w4a16.tune` checks it against the dequantized product, times it per shape and row
bucket, and a projection uses it only where it won.

Where it comes from: vLLM's wheel (PyPI `vllm`, built for one torch: 0.26.0 pins torch 2.11) holds the
kernels in `vllm/_C_stable_libtorch.abi3.so`, which registers `torch.ops._C.gptq_marlin_repack` and
`torch.ops._C.marlin_gemm` when loaded. Only that library is needed, not vLLM itself: `load()` takes
the ops if something registered them already, else the library at $QDFLASH_MARLIN_LIB, else the one
inside an installed vllm package (found without importing vllm). Where none loads (the CPU, another
torch) Marlin is simply not a candidate.

The numbers are this project's grid, repacked once, never requantized. Marlin reads GPTQ's layout: int32
words [K/8, N], eight consecutive input features of one output per word (nibble j = feature 8i + j),
unsigned with bias 8 (its type `uint4b8`: q = u - 8). Our words [N, K/8] are the same nibbles with the
same bias, so the GPTQ layout is their transpose; `gptq_marlin_repack` then tiles them for the kernel.
Scales are [K/group, N] in the activation dtype, each run of 64 read as an 8 x 8 tile transposed (the
order Marlin's threads load them in).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..errors import QdflashError
from ..paths import env_path

LIBRARY = "_C_stable_libtorch.abi3.so"  # the library of vLLM's wheel that holds the Marlin ops
GROUPS = (32, 64, 128)  # Marlin's group sizes (besides per-channel, which this project's grid never uses)
# Marlin's weight type, as the integer vLLM's ScalarType passes to its ops: fields packed low to high as
# exponent (8 bits) 0, mantissa (8) 4, signed (1) 0, bias (32) 8, finite-values-only (1) 0, NaN
# representation (8) 1 (the dataclass's default, IEEE 754)
UINT4B8 = (4 << 8) | (8 << 17) | (1 << 50)
_MODULE: list = []  # [True / None]: the ops there, checked once
SOURCE: list[str] = []  # where they came from: "registered" (before load) or the library's path


def _library_paths() -> list[Path]:
    paths = [lib] if (lib := env_path("QDFLASH_MARLIN_LIB")) else []
    try:
        spec = importlib.util.find_spec("vllm")  # where vllm is installed, without importing it
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        paths.append(Path(folder) / LIBRARY)
    return paths


def load():
    """True where torch.ops._C.marlin_gemm and gptq_marlin_repack are there (registered already, or by
    loading the library: module docstring), else None."""
    if not _MODULE:
        ok = False
        if torch.cuda.is_available():
            for path in [None, *_library_paths()]:
                try:
                    if path is not None:
                        if not path.is_file():
                            continue
                        torch.ops.load_library(str(path))
                    ok = hasattr(torch.ops._C, "marlin_gemm") and hasattr(torch.ops._C, "gptq_marlin_repack")
                except Exception:  # noqa: BLE001 - OSError of a library built for another torch / CUDA, missing ops
                    ok = False
                if ok:
                    SOURCE.append("registered" if path is None else str(path))
                    break
        _MODULE.append(ok or None)
    return _MODULE[0]


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether Marlin takes this shape here: CUDA, 16-bit activations, a group it has (dividing K, and more
    than one group: with one, Marlin reads the scales as per-channel, in another order than `permute_scales`),
    N a multiple of 64 and K of 128 (its thread tiles; vLLM pads other shapes, this project does not), the ops loaded."""
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and group in GROUPS
            and k % group == 0 and k > group and n % 64 == 0 and k % 128 == 0 and load() is not None)


def gptq_words(words: torch.Tensor) -> torch.Tensor:
    """This project's words [N, K/8] -> GPTQ's [K/8, N] (the same nibbles: module docstring)."""
    return words.t().contiguous()


def permute_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales [N, K/group] -> Marlin's [K/group, N]: row-major, every 64 consecutive entries an 8 x 8 tile
    read transposed."""
    s = scale.t().contiguous()
    if s.numel() % 64:
        raise QdflashError(f"marlin_w4: {s.shape[0]} x {s.shape[1]} scales are not whole 64-entry tiles")
    return s.reshape(-1, 8, 8).transpose(1, 2).reshape(s.shape).contiguous()


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple:
    """This project's packed ints (`w4a16.pack_int4` words [N, K/8]) and scales [N, K/group] -> Marlin's
    tiled weight, its scales, its workspace and N (what `matmul` takes after x)."""
    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"marlin_w4 cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    empty = torch.empty(0, dtype=torch.int32, device=words.device)  # no activation reordering
    tiled = torch.ops._C.gptq_marlin_repack(gptq_words(words), empty, k, n, 4, False)
    sms = torch.cuda.get_device_properties(words.device).multi_processor_count
    workspace = torch.zeros(sms, dtype=torch.int32, device=words.device)  # one counter per thread block
    return tiled, permute_scales(scale).to(dtype), workspace, n


def _gemm(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, workspace: torch.Tensor, n: int) -> torch.Tensor:
    """vLLM's op itself. Its schema in vLLM 0.26.0's library: marlin_gemm(Tensor a, Tensor? c_or_none,
    Tensor b_q_weight, Tensor? b_bias_or_none, Tensor b_scales, Tensor? a_scales, Tensor? global_scale,
    Tensor? b_zeros_or_none, Tensor? g_idx_or_none, Tensor? perm_or_none, Tensor workspace, int b_type_id,
    SymInt size_m, SymInt size_n, SymInt size_k, bool is_k_full, bool use_atomic_add, bool use_fp32_reduce,
    bool is_zp_float) -> Tensor."""
    empty = torch.empty(0, dtype=torch.int32, device=x.device)  # no zero points, no reordering: empty, as vLLM passes them
    return torch.ops._C.marlin_gemm(x, None, tiled, None, scales, None, None, empty, empty, empty, workspace, UINT4B8,
                                    x.shape[0], n, x.shape[1], True, False, True, False)


# Why a custom op of our own: `_C::marlin_gemm`, loaded from vLLM's library alone, has no fake (meta) kernel
# (vLLM registers those in Python, which we do not import), so torch.compile cannot trace it and breaks the
# compiled decode step at every projection: on the H200 that cost more than Marlin saved (nearly twice the
# kernels per step, the norms and adds around each projection left unfused: PROVENANCE of
# results/published/2026-12-04-h200-components-marlin). Wrapped here with a fake that gives the output's
# shape, the op is one opaque node in the compiled graph. `mutates_args=()` although Marlin writes its
# workspace: it uses it as per-block locks that it leaves zeroed again, so no state is changed between calls
# (vLLM's own schema, above, declares `Tensor workspace`, not mutated, for the same reason), and declaring it
# mutated would make compiled graphs clone it before every call.
@torch.library.custom_op("qdflash::marlin_w4_mm", mutates_args=())
def _marlin_mm(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, workspace: torch.Tensor,
               n: int) -> torch.Tensor:
    return _gemm(x, tiled, scales, workspace, n)


@_marlin_mm.register_fake
def _(x, tiled, scales, workspace, n):
    return x.new_empty((x.shape[0], n), dtype=scales.dtype)


def matmul(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, workspace: torch.Tensor, n: int,
           group: int) -> torch.Tensor:
    """x [M, K] @ dequant(W).T -> [M, N] in the scales' dtype (fp32 reduction across thread blocks). The
    group is in the scales' shape: Marlin reads it from there."""
    return _marlin_mm(x.to(scales.dtype).contiguous(), tiled, scales, workspace, n)
