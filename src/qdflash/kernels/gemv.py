"""A 16-bit GEMV (one row: y = x @ W.T) for the decode step, and its 2-16-row form for a verify block, used
only where they beat cuBLAS.

Why: a 16-bit decode step is bound by reading the weights once, and cuBLAS at one row read them
well below the device's copy bandwidth (results/published/2026-11-30-h200-engine-components), which
caps the step below the 80% the engine aims for whatever the rest costs. A GEMV has no reuse to
exploit: each program streams a [BN, BK] tile of weight rows, multiplies it with x in fp32 FMAs and
reduces once at the end; wide layers split K over programs (partial sums reduced by torch, in fp32).

A verify block (2-16 rows) streams the weight the same way, once for all its rows: each [BN, BK] tile
meets the rows' [16, BK] slice of x in one tensor-core dot (rows padded to 16, fp32 accumulation; IEEE
fp32 products for an fp32 model, not TF32). At 16 rows cuBLAS took longer than the one-row GEMV on every
Qwen3.5-4B shape, with split-K reductions of its own (results/published/2026-12-05-h200-w4-unrolled: `dense_ms`
at 16 rows; 2026-12-05-h200-gdn-prefetch: `gemv.tuned`, `target16.verify_kernels`), though the weight bytes
to read are the same.

`tune(n, k, rows)` times the tile configs against `F.linear` on the same shape and row bucket (1 row, or
2-16) inside CUDA graphs (weights copied past the L2 cache) and remembers a config only when it is
faster; `gemv_config(n, k, dtype, rows)` is None otherwise, and the engine keeps cuBLAS. So an untuned
shape, the CPU and a GPU where cuBLAS wins run exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import QdflashError
from . import MAX_ROWS, copies_past_l2, fastest, graph_ms, row_bucket

try:
    import triton
    import triton.language as tl

    from .jit import swiglu_rounded
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
                     K_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
                     SWIGLU: tl.constexpr = False):
        """TILES = 0: a runtime loop over K_PER_SPLIT (one compile serves every K). TILES > 0: K_PER_SPLIT
        is TILES * BLOCK_K and the loop is unrolled, so the compiler issues every tile's loads before the
        arithmetic: a program's whole slice of the weight in flight, where the runtime loop waits on memory
        once per tile (one compile per K and split). SWIGLU: the weight's rows are (gate, up) pairs
        (`swiglu_pairs`) and the program stores silu(gate) * up of its pairs (`jit.swiglu_rounded`), N / 2 outputs."""
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
        if SWIGLU:
            gate, up = tl.split(tl.reshape(tl.sum(acc, axis=1), (BLOCK_N // 2, 2)))
            half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + half, swiglu_rounded(gate, up, out_ptr.dtype.element_ty), mask=half < N // 2)
        else:
            tl.store(out_ptr + pid_k * stride_os + rn, tl.sum(acc, axis=1), mask=rn < N)

    @triton.jit
    def _gemv_rows_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_os, stride_om, K_PER_SPLIT,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, IEEE: tl.constexpr,
                          SWIGLU: tl.constexpr = False):
        """2-16 rows: the [BN, BK] weight tile read once and multiplied with all rows by one dot (rows
        padded to 16 with zeros, never stored). TILES and SWIGLU as in `_gemv_kernel`."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, 16)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        n_ok = rn[:, None] < N
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        if TILES > 0:
            for tile in tl.static_range(TILES):
                acc += _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, pid_k * TILES * BLOCK_K + tile * BLOCK_K + rk, stride_xm,
                                  stride_wn, IEEE)
        else:
            for step in range(0, K_PER_SPLIT, BLOCK_K):
                acc += _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, pid_k * K_PER_SPLIT + step + rk, stride_xm, stride_wn, IEEE)
        if SWIGLU:
            gate, up = tl.split(tl.reshape(acc, (16, BLOCK_N // 2, 2)))
            half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + rm[:, None] * stride_om + half[None, :], swiglu_rounded(gate, up, out_ptr.dtype.element_ty),
                     mask=m_ok & (half[None, :] < N // 2))
        else:
            tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=m_ok & (rn[None, :] < N))

    @triton.jit
    def _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, col, stride_xm, stride_wn, IEEE: tl.constexpr):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=m_ok, other=0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + col[None, :], mask=n_ok, other=0)
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        return tl.dot(x, tl.trans(w))

    @triton.jit
    def _gemv_tile(x_ptr, w_ptr, rn, n_ok, col, stride_wn):
        w = tl.load(w_ptr + rn[:, None] * stride_wn + col[None, :], mask=n_ok, other=0)
        return w.to(tl.float32) * tl.load(x_ptr + col).to(tl.float32)[None, :]


def fits(config: GemvConfig, k: int) -> bool:
    return k % (config.split_k * config.block_k) == 0


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, swiglu: bool = False) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K].T -> [M, N] in x's dtype (fp32 accumulation). swiglu: weight's rows are
    (gate, up) pairs (`swiglu_pairs`) and the result is silu(gate) * up, [M, N / 2], made in the kernel's epilogue
    (`swiglu_fits`: one K split)."""
    if triton is None:
        raise QdflashError("gemv needs triton (installed with torch on CUDA machines)")
    n, k = weight.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or not 1 <= m <= MAX_ROWS or weight.stride(1) != 1:
        raise QdflashError(f"gemv: x [1..{MAX_ROWS}, {k}] and a contiguous weight [{n}, {k}] expected, got x {tuple(x.shape)}, "
                           f"weight {tuple(weight.shape)}")
    if not fits(config, k):
        raise QdflashError(f"gemv: {config} does not tile K={k}")
    if swiglu and not swiglu_fits(config, n):
        raise QdflashError(f"gemv: silu(gate) * up of a {n}-row weight needs one K split and whole pairs, got {config}")
    x = x.contiguous()
    out = torch.empty(config.split_k, m, n // 2 if swiglu else n, device=x.device,
                      dtype=x.dtype if config.split_k == 1 else torch.float32)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    # K_PER_SPLIT is a runtime argument (one compile per tile serves every shape: tuning is compile-bound),
    # except where the config unrolls the K loop
    tiles = k // (config.split_k * config.block_k) if config.unrolled else 0
    if m == 1:
        _gemv_kernel[grid](x, weight, out, n, weight.stride(0), out.stride(0), k // config.split_k, BLOCK_N=config.block_n,
                           BLOCK_K=config.block_k, TILES=tiles, SWIGLU=swiglu, num_warps=config.num_warps)
    else:
        _gemv_rows_kernel[grid](x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
                                k // config.split_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TILES=tiles,
                                IEEE=x.dtype == torch.float32, SWIGLU=swiglu, num_warps=config.num_warps)
    return out[0] if config.split_k == 1 else out.sum(0).to(x.dtype)


def swiglu_fits(config: GemvConfig, n: int) -> bool:
    """Whether `gemv(..., swiglu=True)` takes the config for an n-row weight: each program holds whole (gate, up) pairs
    and its final sums (no K split to reduce after it)."""
    return config.split_k == 1 and n % 2 == 0 and config.block_n % 2 == 0


def swiglu_pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows (or scales, biases: anything with a row per output) of gate and up interleaved, gate 0, up 0, gate 1,
    up 1, ...: the order in which a matmul's epilogue finds each output's (gate, up) pair side by side."""
    if gate.shape != up.shape:
        raise QdflashError(f"swiglu_pairs: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def candidate_configs(n: int, k: int, rows: int = 1) -> list[GemvConfig]:
    """Tiles of 1K-8K weights (the fp32 accumulator stays in registers) launching 128..4096 programs; for a
    weight where none does, `narrow_configs`. 2-16 rows: `rows_configs`."""
    if rows > 1:
        return rows_configs(n, k)
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


def rows_configs(n: int, k: int) -> list[GemvConfig]:
    """Tiles for 2-16 rows: [BN >= 16, BK] weight tiles (a dot's operand) of 2K-8K weights (16K spill on the
    H200), launching 64..4096 programs, the K loop unrolled or not."""
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            if not 2048 <= block_n * block_k <= 8192:
                continue
            for split_k in (1, 2, 4):
                for unrolled in (False, True):
                    c = GemvConfig(block_n, block_k, split_k, 4, unrolled)
                    if (fits(c, k) and 64 <= -(-n // block_n) * split_k <= 4096
                            and (not unrolled or k // (split_k * block_k) <= MAX_UNROLL)):
                        out.append(c)
    return out


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


_TUNED: dict[tuple[int, int, torch.dtype, int], GemvConfig] = {}  # (n, k, dtype, row bucket: 1 or MAX_ROWS)


def gemv_config(n: int, k: int, dtype: torch.dtype, rows: int = 1) -> GemvConfig | None:
    """The tuned config for this shape and row bucket (1 row, or 2-16) where it beat cuBLAS, else None
    (use F.linear)."""
    return _TUNED.get((n, k, dtype, row_bucket(rows))) if rows <= MAX_ROWS else None


def tune(n: int, k: int, device="cuda", dtype=torch.bfloat16, l2_bytes: int = 64 << 20, rows: int = 1) -> dict:
    """Time cuBLAS (F.linear) and every candidate for x [rows, K] @ W [N, K].T in CUDA graphs over weight
    copies larger than the L2 cache; keep the fastest if it beats cuBLAS. Returns the timings."""
    copies = copies_past_l2(n * k * torch.finfo(dtype).bits // 8, l2_bytes)
    ws = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=dtype)
    cublas = graph_ms(lambda: [F.linear(x, w) for w in ws]) / copies
    best = fastest(candidate_configs(n, k, rows), lambda c: [gemv(x, w, c) for w in ws], copies)
    key = (n, k, dtype, row_bucket(rows))
    _TUNED.pop(key, None)
    if best[0] is not None and best[1] < cublas:
        _TUNED[key] = best[0]
    return {"cublas_ms": round(cublas, 4), "gemv_ms": round(best[1], 4), "config": best[0] and best[0].__dict__,
            "used": best[0] is not None and best[1] < cublas}
