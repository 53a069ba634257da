"""A 16-bit GEMV (one row: y = x @ W.T) for the decode step, used only where it beats cuBLAS.

Why: a 16-bit decode step is bound by reading the weights once, and cuBLAS at one row read them
well below the device's copy bandwidth (results/published/2026-11-30-h200-engine-components), which
caps the step below the 80% the engine aims for whatever the rest costs. A GEMV has no reuse to
exploit: each program streams a [BN, BK] tile of weight rows, multiplies it with x in fp32 FMAs and
reduces once at the end; wide layers split K over programs (partial sums reduced by torch, in fp32).

`tune(n, k)` times the tile configs against `F.linear` on the same shape inside CUDA graphs (weights
copied past the L2 cache) and remembers a config only when it is faster; `gemv_config(n, k)` is None
otherwise, and the engine keeps cuBLAS. So an untuned shape, the CPU and a GPU where cuBLAS wins
run exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import QdflashError
from . import copies_past_l2, fastest, graph_ms

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None


MAX_UNROLL = 16  # K tiles one program of the unrolled GEMV holds in flight (its code and registers grow with them)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    unrolled: bool = False  # the K loop unrolled at compile time: every tile's loads issued up front


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn, stride_os,
                     K_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
        """TILES = 0: a runtime loop over K_PER_SPLIT (one compile serves every K). TILES > 0: K_PER_SPLIT
        is TILES * BLOCK_K and the loop is unrolled, so the compiler issues every tile's loads before the
        arithmetic: a program's whole slice of the weight in flight, where the runtime loop waits on memory
        once per tile (one compile per K and split)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn[:, None] < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if TILES > 0:
            for tile in tl.static_range(TILES):
                acc += _gemv_tile(x_ptr, w_ptr, rn, n_ok, pid_k * TILES * BLOCK_K + tile * BLOCK_K + rk, stride_wn)
        else:
            for step in range(0, K_PER_SPLIT, BLOCK_K):
                acc += _gemv_tile(x_ptr, w_ptr, rn, n_ok, pid_k * K_PER_SPLIT + step + rk, stride_wn)
        tl.store(out_ptr + pid_k * stride_os + rn, tl.sum(acc, axis=1), mask=rn < N)

    @triton.jit
    def _gemv_tile(x_ptr, w_ptr, rn, n_ok, col, stride_wn):
        w = tl.load(w_ptr + rn[:, None] * stride_wn + col[None, :], mask=n_ok, other=0)
        return w.to(tl.float32) * tl.load(x_ptr + col).to(tl.float32)[None, :]


def fits(config: GemvConfig, k: int) -> bool:
    return k % (config.split_k * config.block_k) == 0


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [1, K] @ weight [N, K].T -> [1, N] in x's dtype (fp32 accumulation)."""
    if triton is None:
        raise QdflashError("gemv needs triton (installed with torch on CUDA machines)")
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise QdflashError(f"gemv: x {tuple(x.shape)} and a contiguous weight [{n}, {k}] expected, got weight {tuple(weight.shape)}")
    if not fits(config, k):
        raise QdflashError(f"gemv: {config} does not tile K={k}")
    x = x.contiguous()
    out = torch.empty(config.split_k, n, device=x.device, dtype=x.dtype if config.split_k == 1 else torch.float32)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    # K_PER_SPLIT is a runtime argument (one compile per tile serves every shape: tuning is compile-bound),
    # except where the config unrolls the K loop
    tiles = k // (config.split_k * config.block_k) if config.unrolled else 0
    _gemv_kernel[grid](x, weight, out, n, weight.stride(0), out.stride(0), k // config.split_k, BLOCK_N=config.block_n,
                       BLOCK_K=config.block_k, TILES=tiles, num_warps=config.num_warps)
    return out[:1] if config.split_k == 1 else out.sum(0, keepdim=True).to(x.dtype)


def candidate_configs(n: int, k: int) -> list[GemvConfig]:
    """Tiles of 1K-8K weights (the fp32 accumulator stays in registers) launching 128..4096 programs; for a
    weight where none does, `narrow_configs`."""
    out = []
    for block_n in (2, 4, 8, 16, 32):
        for block_k in (256, 512, 1024, 2048):
            if not 1024 <= block_n * block_k <= 8192:
                continue
            for split_k in (1, 2, 4):
                for warps in ((4, 8) if block_n * block_k >= 4096 else (4,)):
                    c = GemvConfig(block_n, block_k, split_k, warps)
                    if fits(c, k) and 128 <= -(-n // block_n) * split_k <= 4096:
                        out.append(c)
    if not out:
        return narrow_configs(n, k)
    # the same tiles (4 warps) with the K loop unrolled, up to MAX_UNROLL tiles a program
    return out + [GemvConfig(c.block_n, c.block_k, c.split_k, c.num_warps, unrolled=True) for c in out
                  if c.num_warps == 4 and k // (c.split_k * c.block_k) <= MAX_UNROLL]


def narrow_configs(n: int, k: int) -> list[GemvConfig]:
    """For a weight too narrow for the tiles above (e.g. Qwen3.5's GDN a/b projection, 64 x 2,560: no tile
    launches 128 programs with a split that tiles K): smaller tiles, fewer programs, and K split wherever it
    divides. Such a weight is a few hundred KB, so a call is bound by latency, where cuBLAS's fixed cost is
    what a GEMV may beat; `tune` keeps one only if it does."""
    out = []
    for block_n in (2, 4, 8):
        for block_k in (256, 512, 1024):
            for split_k in range(1, 17):
                c = GemvConfig(block_n, block_k, split_k, 4)
                if fits(c, k) and 16 <= -(-n // block_n) * split_k <= 4096:
                    out.append(c)
    return out


_TUNED: dict[tuple[int, int, torch.dtype], GemvConfig] = {}


def gemv_config(n: int, k: int, dtype: torch.dtype) -> GemvConfig | None:
    """The tuned config for this shape where it beat cuBLAS, else None (use F.linear)."""
    return _TUNED.get((n, k, dtype))


def tune(n: int, k: int, device="cuda", dtype=torch.bfloat16, l2_bytes: int = 64 << 20) -> dict:
    """Time cuBLAS (F.linear) and every candidate for x [1, K] @ W [N, K].T in CUDA graphs over weight
    copies larger than the L2 cache; keep the fastest GEMV if it beats cuBLAS. Returns the timings."""
    copies = copies_past_l2(n * k * torch.finfo(dtype).bits // 8, l2_bytes)
    ws = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=dtype)
    cublas = graph_ms(lambda: [F.linear(x, w) for w in ws]) / copies
    best = fastest(candidate_configs(n, k), lambda c: [gemv(x, w, c) for w in ws], copies)
    if best[0] is not None and best[1] < cublas:
        _TUNED[(n, k, dtype)] = best[0]
    return {"cublas_ms": round(cublas, 4), "gemv_ms": round(best[1], 4), "config": best[0] and best[0].__dict__,
            "used": best[0] is not None and best[1] < cublas}
