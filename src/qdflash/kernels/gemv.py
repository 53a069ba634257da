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
from .pdl import launch_options, pdl_for

try:
    import triton
    import triton.language as tl

    from .jit import last_to_arrive, silu_rounded
    from .pdl import pdl_release, pdl_wait
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

    def args(self) -> tuple:
        """The fields in order, as the ops take them. Not dataclasses.astuple: it deep-copies each field, and under
        torch.compile that traces id() of a config read from the tuning table, which dynamo cannot resolve."""
        return self.block_n, self.block_k, self.split_k, self.num_warps, self.unrolled


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn, stride_os, K_PER_SPLIT, res_ptr, norm_w_ptr, xn_ptr, arrivals_ptr,
                     EPS, W_OFFSET, src_ptr, in_w_ptr, xs_ptr, K, IN_EPS, IN_OFFSET,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
                     SWIGLU: tl.constexpr, NORM: tl.constexpr, N_P: tl.constexpr, ROUND_FIRST: tl.constexpr,
                     RESIDUAL: tl.constexpr, X_IN: tl.constexpr, IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr):
        """TILES = 0: a runtime loop over K_PER_SPLIT (one compile serves every K). TILES > 0: K_PER_SPLIT
        is TILES * BLOCK_K and the loop is unrolled, so the compiler issues every tile's loads before the
        arithmetic: a program's whole slice of the weight in flight, where the runtime loop waits on memory
        once per tile (one compile per K and split). PDL: the first tile's weight loads go out before
        `pdl_wait`, and the next kernel is released (`pdl_release`) after the K loop. SWIGLU (one split): the
        weight is a gate projection's N rows over an up projection's N rows, and the output is silu(gate) * up [N];
        a program's BLOCK_N weight rows are BLOCK_N / 2 gate rows interleaved with their up rows, so it holds both
        halves of its outputs.
        NORM (one split): the output is the residual stream after it, res + y (fp32, into out_ptr), and the last
        program to finish writes the next RMSNorm of that stream (`_residual_norm_tail`). RESIDUAL (one split): that
        residual stream alone, no norm (the next GEMV's prologue computes it).
        X_IN: where x comes from (`_x_tile`, a prologue that replaces the small kernel which made x): 0 x_ptr; 1 the
        RMSNorm of the fp32 residual stream src_ptr [K] with weight in_w_ptr (each program sums the stream's squares
        itself and scales its sums by the norm's scalar at the end: no load waits on it, no program on another); 2
        silu(gate) * up of a gate / up projection's output src_ptr [2K]. KEEP_X: the programs of the first column block
        also store the x they made into xs_ptr (for a consumer that reads x itself, e.g. the GDN kernel's b / a
        product)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn, n_ok = _weight_rows(pid_n, N, BLOCK_N, SWIGLU)
        rk = tl.arange(0, BLOCK_K)
        span = TILES * BLOCK_K if TILES > 0 else K_PER_SPLIT  # the columns this program reads
        k0 = pid_k * span
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)  # X_IN 1: the stream's squares over this program's columns
        dt = w_ptr.dtype.element_ty  # the model's dtype: what a prologue's x is rounded to, as the ops before round it
        keep = tl.where(pid_n == 0, K, 0)  # with KEEP_X: x's columns below this are stored (the first column block's)
        FIRST: tl.constexpr = 1 if PDL else 0  # tiles done before the loop
        if PDL:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=n_ok, other=0)
            pdl_wait()
            x, sq = _x_tile(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, k0 + rk, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
            acc += w.to(tl.float32) * x[None, :]
            squares += sq
        if TILES > 0:
            for tile in tl.static_range(FIRST, TILES):
                part, sq = _gemv_tile(x_ptr, w_ptr, rn, n_ok, k0 + tile * BLOCK_K + rk, stride_wn, src_ptr, in_w_ptr, xs_ptr,
                                      keep, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
                acc += part
                squares += sq
        else:
            for step in range(FIRST * BLOCK_K, K_PER_SPLIT, BLOCK_K):
                part, sq = _gemv_tile(x_ptr, w_ptr, rn, n_ok, k0 + step + rk, stride_wn, src_ptr, in_w_ptr, xs_ptr,
                                      keep, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
                acc += part
                squares += sq
        if PDL:
            pdl_release()
        y = tl.sum(acc, axis=1)
        if X_IN == 1:  # the norm's scalar, applied to the sums: the weight loads never waited on it
            rstd = _stream_rstd(src_ptr, squares, k0, span, K, IN_EPS)
            y = y * rstd
            if KEEP_X:
                if pid_n == 0:
                    _keep_normed(src_ptr, in_w_ptr, xs_ptr, k0 + rk, span, rstd, IN_OFFSET, IN_ROUND_FIRST, dt)
        if SWIGLU:
            gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            _store_swiglu(out_ptr + cols, cols < N, gate, up)
        elif NORM or RESIDUAL:
            # the projection's output rounded as the linear's would be, then added to the fp32 stream (torch's h + y)
            h = tl.load(res_ptr + rn, mask=rn < N, other=0.0) + y.to(dt).to(tl.float32)
            tl.store(out_ptr + rn, h, mask=rn < N)
            if NORM:
                _residual_norm_tail(out_ptr, norm_w_ptr, xn_ptr, arrivals_ptr, N, EPS, W_OFFSET, N_P, ROUND_FIRST, dt)
        else:
            tl.store(out_ptr + pid_k * stride_os + rn, y, mask=rn < N)

    @triton.jit
    def _residual_norm_tail(h_ptr, norm_w_ptr, xn_ptr, arrivals_ptr, N, EPS, W_OFFSET, N_P: tl.constexpr,
                            ROUND_FIRST: tl.constexpr, dt: tl.constexpr):
        """The RMSNorm of the residual stream h [N] (fp32) that the programs of this launch have stored, by the one that
        finishes last (`jit.last_to_arrive`), which sets the counter back to 0. Why: apart it
        is a launch of its own after every residual add (two a layer) whose work is one 10 KB vector. x (`dt`) is
        `_weighted` of h * rsqrt(mean(h^2) + eps)."""
        if last_to_arrive(arrivals_ptr, tl.num_programs(0)):
            rh = tl.arange(0, N_P)
            ok = rh < N
            h = tl.load(h_ptr + rh, mask=ok, other=0.0, cache_modifier=".cg")
            normed = h * tl.math.rsqrt(tl.sum(h * h, axis=0) / N + EPS)
            w = tl.load(norm_w_ptr + rh, mask=ok, other=0.0).to(tl.float32)
            tl.store(xn_ptr + rh, _weighted(normed, w, W_OFFSET, ROUND_FIRST, dt), mask=ok)
            tl.store(arrivals_ptr, 0)

    @triton.jit
    def _weighted(normed, w, W_OFFSET, ROUND_FIRST: tl.constexpr, dt: tl.constexpr):
        """An RMSNorm's output in `dt` from the normed stream (fp32) and the norm weight `w` (fp32): normed * (w + W_OFFSET)
        (transformers' Qwen3.5 norm: W_OFFSET 1), or with ROUND_FIRST w * round(normed) (the llama engine's
        `ops.rms_norm`), rounded where those round."""
        if ROUND_FIRST:
            x = w * normed.to(dt).to(tl.float32)
        else:
            x = normed * (w + W_OFFSET)
        return x.to(dt)

    @triton.jit
    def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
        """The BLOCK_N weight rows program pid_n reads and which of them exist ([BLOCK_N, 1]). SWIGLU: BLOCK_N / 2
        gate rows each followed by its up row (N rows on), so a program holds both halves of its outputs."""
        if SWIGLU:
            ri = tl.arange(0, BLOCK_N)
            out = pid_n * (BLOCK_N // 2) + ri // 2
            return out + (ri % 2) * N, out[:, None] < N
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return rn, rn[:, None] < N

    @triton.jit
    def _store_swiglu(out_ptrs, mask, gate, up):
        """silu(gate) * up, rounded where the unfused ops round in the output's dtype: the projection's outputs,
        silu's, the product's."""
        dt = out_ptrs.dtype.element_ty
        tl.store(out_ptrs, (silu_rounded(gate, dt) * up.to(dt).to(tl.float32)).to(dt), mask=mask)

    @triton.jit
    def _gemv_rows_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_os, stride_om, K_PER_SPLIT,
                          src_ptr, in_w_ptr, xs_ptr, res_ptr, stride_sm, stride_rm, K, IN_EPS, IN_OFFSET,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, IEEE: tl.constexpr,
                          PDL: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, X_IN: tl.constexpr,
                          IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr):
        """2-16 rows: the [BN, BK] weight tile read once and multiplied with all rows by one dot (rows
        padded to 16 with zeros, never stored). TILES, PDL, SWIGLU, RESIDUAL, X_IN and KEEP_X as in `_gemv_kernel`, row
        by row (the norm's scalar is each row's; the sources' and the residual's rows stride_sm and stride_rm apart)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, 16)
        rn, n_ok = _weight_rows(pid_n, N, BLOCK_N, SWIGLU)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm[:, None] < M
        span = TILES * BLOCK_K if TILES > 0 else K_PER_SPLIT
        k0 = pid_k * span
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        squares = tl.zeros((16, BLOCK_K), dtype=tl.float32)
        dt = w_ptr.dtype.element_ty
        keep = tl.where(pid_n == 0, K, 0)
        FIRST: tl.constexpr = 1 if PDL else 0
        if PDL:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=n_ok, other=0)
            pdl_wait()
            x, sq = _rows_x(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, rm, m_ok, k0 + rk, stride_xm, stride_sm, K, IN_OFFSET,
                            X_IN, IN_ROUND_FIRST, KEEP_X, dt)
            acc += _rows_product(x, w, IEEE)
            squares += sq
        if TILES > 0:
            for tile in tl.static_range(FIRST, TILES):
                part, sq = _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, k0 + tile * BLOCK_K + rk, stride_xm, stride_wn, IEEE,
                                      src_ptr, in_w_ptr, xs_ptr, keep, stride_sm, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
                acc += part
                squares += sq
        else:
            for step in range(FIRST * BLOCK_K, K_PER_SPLIT, BLOCK_K):
                part, sq = _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, k0 + step + rk, stride_xm, stride_wn, IEEE,
                                      src_ptr, in_w_ptr, xs_ptr, keep, stride_sm, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
                acc += part
                squares += sq
        if PDL:
            pdl_release()
        if X_IN == 1:  # each row's norm scalar, applied to its sums
            rstd = _rows_rstd(src_ptr, squares, rm, m_ok, stride_sm, k0, span, K, IN_EPS)
            acc = acc * rstd[:, None]
            if KEEP_X:
                if pid_n == 0:
                    _keep_normed_rows(src_ptr, in_w_ptr, xs_ptr, rm, m_ok, k0 + rk, span, stride_sm, K, rstd, IN_OFFSET,
                                      IN_ROUND_FIRST, dt)
        if SWIGLU:
            gate, up = tl.split(tl.reshape(acc, (16, BLOCK_N // 2, 2)))
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            _store_swiglu(out_ptr + rm[:, None] * stride_om + cols[None, :], m_ok & (cols[None, :] < N), gate, up)
        elif RESIDUAL:
            ok = m_ok & (rn[None, :] < N)
            h = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ok, other=0.0) + acc.to(dt).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], h, mask=ok)
        else:
            tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=m_ok & (rn[None, :] < N))

    @triton.jit
    def _rows_tile(x_ptr, w_ptr, rm, rn, m_ok, n_ok, col, stride_xm, stride_wn, IEEE: tl.constexpr, src_ptr, in_w_ptr, xs_ptr,
                   keep, stride_sm, K, IN_OFFSET, X_IN: tl.constexpr, IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr,
                   dt: tl.constexpr):
        x, sq = _rows_x(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, rm, m_ok, col, stride_xm, stride_sm, K, IN_OFFSET, X_IN,
                        IN_ROUND_FIRST, KEEP_X, dt)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + col[None, :], mask=n_ok, other=0)
        return _rows_product(x, w, IEEE), sq

    @triton.jit
    def _rows_x(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, rm, m_ok, col, stride_xm, stride_sm, K, IN_OFFSET, X_IN: tl.constexpr,
                IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr, dt: tl.constexpr):
        """The rows' x [16, BK] at columns `col` in `dt` (the dot's operand) and the stream's squares there (`_x_tile`,
        row by row)."""
        sq = 0.0
        if X_IN == 1:
            h = tl.load(src_ptr + rm[:, None] * stride_sm + col[None, :], mask=m_ok, other=0.0)
            w = tl.load(in_w_ptr + col).to(tl.float32)[None, :]
            sq = h * h
            if IN_ROUND_FIRST:
                x = (w * h).to(dt)
            else:
                x = (h * (w + IN_OFFSET)).to(dt)
        elif X_IN == 2:
            at = src_ptr + rm[:, None] * stride_sm + col[None, :]
            gate = tl.load(at, mask=m_ok, other=0.0).to(tl.float32)
            up = tl.load(at + K, mask=m_ok, other=0.0).to(tl.float32)
            x = (silu_rounded(gate, dt) * up).to(dt)
            if KEEP_X:
                tl.store(xs_ptr + rm[:, None] * K + col[None, :], x, mask=m_ok & (col[None, :] < keep))
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=m_ok, other=0)
        return x, sq

    @triton.jit
    def _rows_rstd(src_ptr, squares, rm, m_ok, stride_sm, k0, span, K, EPS):
        """Each row's rsqrt(mean(h^2) + eps) [16] (`_stream_rstd`, row by row)."""
        total = tl.sum(squares, axis=1)
        if span < K:
            rc = tl.arange(0, 256)
            rest = tl.zeros((16, 256), dtype=tl.float32)
            for c in range(0, K, 256):
                cols = c + rc
                out = (cols < K) & ((cols < k0) | (cols >= k0 + span))
                h = tl.load(src_ptr + rm[:, None] * stride_sm + cols[None, :], mask=m_ok & out[None, :], other=0.0)
                rest += h * h
            total += tl.sum(rest, axis=1)
        return tl.math.rsqrt(total / K + EPS)

    @triton.jit
    def _keep_normed_rows(src_ptr, in_w_ptr, xs_ptr, rm, m_ok, cols, span, stride_sm, K, rstd, IN_OFFSET,
                          IN_ROUND_FIRST: tl.constexpr, dt: tl.constexpr):
        """`_keep_normed`, row by row: the rows' norm over this program's columns into xs_ptr [M, K]."""
        for c in range(0, span, cols.shape[0]):
            h = tl.load(src_ptr + rm[:, None] * stride_sm + (c + cols)[None, :], mask=m_ok, other=0.0)
            w = tl.load(in_w_ptr + c + cols).to(tl.float32)[None, :]
            tl.store(xs_ptr + rm[:, None] * K + (c + cols)[None, :], _weighted(h * rstd[:, None], w, IN_OFFSET, IN_ROUND_FIRST, dt),
                     mask=m_ok)

    @triton.jit
    def _rows_product(x, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        return tl.dot(x, tl.trans(w))

    @triton.jit
    def _gemv_tile(x_ptr, w_ptr, rn, n_ok, col, stride_wn, src_ptr, in_w_ptr, xs_ptr, keep, K, IN_OFFSET,
                   X_IN: tl.constexpr, IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr, dt: tl.constexpr):
        """One [BN, BK] tile's products with x, and the stream's squares over its columns (`_x_tile`)."""
        w = tl.load(w_ptr + rn[:, None] * stride_wn + col[None, :], mask=n_ok, other=0)
        x, sq = _x_tile(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, col, K, IN_OFFSET, X_IN, IN_ROUND_FIRST, KEEP_X, dt)
        return w.to(tl.float32) * x[None, :], sq

    @triton.jit
    def _x_tile(x_ptr, src_ptr, in_w_ptr, xs_ptr, keep, col, K, IN_OFFSET, X_IN: tl.constexpr,
                IN_ROUND_FIRST: tl.constexpr, KEEP_X: tl.constexpr, dt: tl.constexpr):
        """x's columns `col` in fp32 (`_gemv_kernel`'s X_IN), and the squares of the stream there (X_IN 1, else 0).
        X_IN 1: the norm before its scalar, h * (w + IN_OFFSET) (IN_ROUND_FIRST: w * h), rounded to `dt` (as the 2-16-row
        kernel's dot operand is, so a decode step and a verify block read the same x): the scalar rsqrt(mean(h^2) + eps)
        needs the whole stream, so it multiplies the sums at the end instead of making every program wait on it before
        its loads. X_IN 2: silu(gate) * up rounded as `_store_swiglu` rounds it, stored into
        xs_ptr below column `keep` with KEEP_X."""
        sq = 0.0
        if X_IN == 1:
            h = tl.load(src_ptr + col)
            w = tl.load(in_w_ptr + col).to(tl.float32)
            sq = h * h
            if IN_ROUND_FIRST:
                x = (w * h).to(dt).to(tl.float32)
            else:
                x = (h * (w + IN_OFFSET)).to(dt).to(tl.float32)
        elif X_IN == 2:
            gate = tl.load(src_ptr + col).to(tl.float32)
            up = tl.load(src_ptr + K + col).to(tl.float32)
            made = (silu_rounded(gate, dt) * up).to(dt)
            if KEEP_X:
                tl.store(xs_ptr + col, made, mask=col < keep)
            x = made.to(tl.float32)
        else:
            x = tl.load(x_ptr + col).to(tl.float32)
        return x, sq

    @triton.jit
    def _stream_rstd(src_ptr, squares, k0, span, K, EPS):
        """rsqrt(mean(h^2) + eps) of the fp32 stream h [K]: this program's own columns' squares summed, plus (a program
        of a K split) the squares of the columns it did not read."""
        total = tl.sum(squares, axis=0)
        if span < K:
            rc = tl.arange(0, 1024)
            rest = tl.zeros((1024,), dtype=tl.float32)
            for c in range(0, K, 1024):
                cols = c + rc
                h = tl.load(src_ptr + cols, mask=(cols < K) & ((cols < k0) | (cols >= k0 + span)), other=0.0)
                rest += h * h
            total += tl.sum(rest, axis=0)
        return tl.math.rsqrt(total / K + EPS)

    @triton.jit
    def _keep_normed(src_ptr, in_w_ptr, xs_ptr, cols, span, rstd, IN_OFFSET, IN_ROUND_FIRST: tl.constexpr, dt: tl.constexpr):
        """The norm of the stream over this program's columns (from `cols`, `span` of them) into xs_ptr, as
        `_residual_norm_tail` computes and rounds it (for a reader of x itself)."""
        for c in range(0, span, cols.shape[0]):
            h = tl.load(src_ptr + c + cols)
            w = tl.load(in_w_ptr + c + cols).to(tl.float32)
            tl.store(xs_ptr + c + cols, _weighted(h * rstd, w, IN_OFFSET, IN_ROUND_FIRST, dt))


def fits(config: GemvConfig, k: int) -> bool:
    return k % (config.split_k * config.block_k) == 0


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, swiglu: bool = False) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K].T -> [M, N] in x's dtype (fp32 accumulation). `swiglu` (one K split):
    weight is a gate projection's rows over an up projection's, and the result silu(gate) * up [M, N / 2], the
    product never written out (the kernels' SWIGLU; `swiglu_fits` says where it runs)."""
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
        raise QdflashError(f"gemv: swiglu takes one K split, an even N and >= 2 rows a tile; got N={n}, {config}")
    x = x.contiguous()
    if pdl_for(x):  # a launch option torch.compile does not trace through: our op, an opaque node in a compiled step
        out = _gemv_op(x, weight, *config.args(), True, swiglu)
    else:
        out = _launch(x, weight, config, False, swiglu=swiglu)
    return out[0] if config.split_k == 1 else out.sum(0).to(x.dtype)


MAX_NORM_WIDTH = 16384  # the residual norm's last program holds the whole stream in registers (4 warps: 128 values a thread)


def gemv_residual_norm(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, offset: float, round_first: bool,
                       arrivals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of a projection added to the residual stream, and the RMSNorm of the sum, in one launch:
    h = residual + (x @ weight.T rounded to x's dtype), fp32 [1, N], and its norm [1, N] in x's dtype,
    (h * rsqrt(mean(h^2) + eps)) * (norm_weight + offset), or with `round_first` norm_weight * (that product before
    the weight, rounded to x's dtype) (`_residual_norm_tail`). `arrivals`: int32 [>= 1], zero, left zero. One K split."""
    if triton is None:
        raise QdflashError("gemv_residual_norm needs triton (installed with torch on CUDA machines)")
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1 or residual.shape != (1, n) or residual.dtype != torch.float32:
        raise QdflashError(f"gemv_residual_norm: x [1, {k}], a contiguous weight [{n}, {k}] and an fp32 residual [1, {n}] expected, "
                           f"got x {tuple(x.shape)}, residual {tuple(residual.shape)} {residual.dtype}")
    if norm_weight.shape != (n,) or not norm_weight.is_contiguous():
        raise QdflashError(f"gemv_residual_norm: a contiguous norm weight [{n}] expected, got {tuple(norm_weight.shape)}")
    if arrivals.dtype != torch.int32 or arrivals.numel() < 1 or not arrivals.is_contiguous():
        raise QdflashError(f"gemv_residual_norm: arrivals must be a contiguous int32 tensor of >= 1 zero, got "
                           f"{tuple(arrivals.shape)} {arrivals.dtype}")
    if not fits(config, k) or not residual_norm_fits(config, n):
        raise QdflashError(f"gemv_residual_norm: {config} must tile K={k} in one split (the norm needs whole sums), and N={n} "
                           f"be <= {MAX_NORM_WIDTH}")
    x, residual = x.contiguous(), residual.contiguous()
    if pdl_for(x):  # as gemv: our op, an opaque node in a compiled step
        return _residual_norm_op(x, weight, *config.args(), True, residual, norm_weight, arrivals, float(eps), float(offset),
                                 round_first)
    return _launch(x, weight, config, False, norm=(residual, norm_weight, arrivals, eps, offset, round_first))


@torch.library.custom_op("qdflash::gemv_residual_norm", mutates_args=("arrivals",))
def _residual_norm_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int, num_warps: int,
                      unrolled: bool, pdl: bool, residual: torch.Tensor, norm_weight: torch.Tensor, arrivals: torch.Tensor,
                      eps: float, offset: float, round_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_residual_norm`'s launch as one opaque node (`_gemv_op` says why); it leaves `arrivals` as it found them."""
    return _launch(x, weight, GemvConfig(block_n, block_k, split_k, num_warps, unrolled), pdl,
                   norm=(residual, norm_weight, arrivals, eps, offset, round_first))


@_residual_norm_op.register_fake
def _(x, weight, block_n, block_k, split_k, num_warps, unrolled, pdl, residual, norm_weight, arrivals, eps, offset, round_first):
    n = weight.shape[0]
    return x.new_empty((1, n), dtype=torch.float32), x.new_empty((1, n))


def residual_norm_fits(config: GemvConfig, n: int) -> bool:
    """Where `gemv_residual_norm` runs: one K split (the norm needs whole sums), a stream its last program holds."""
    return config.split_k == 1 and n <= MAX_NORM_WIDTH


def gemv_fused(weight: torch.Tensor, config: GemvConfig, x: torch.Tensor | None = None, *, stream: torch.Tensor | None = None,
               norm: tuple | None = None, gate_up: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               keep_x: bool = False, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1-16 rows (M) of x @ weight.T with what makes x and what takes the product in the same launch, where they are
    otherwise kernels of their own (a launch costs a decode step more than the few KB it computes). x comes from one
    of: `x` [M, K] as it is; `stream` [M, K] fp32 (a residual stream) with `norm` (weight [K], eps, offset,
    round_first), x = its RMSNorm, row by row (the product takes the norm before its scalar, h * (w + offset) rounded,
    and the scalar multiplies the sums; the x kept is rounded as `gemv_residual_norm` rounds one); `gate_up` [M, 2K],
    x = silu(gate) * up, rounded as `gemv(..., swiglu=True)` rounds it. `residual` [M, N] fp32 (one K split): the
    output is residual + (x @ weight.T rounded to the weight's dtype), fp32, else the product in the weight's dtype.
    `keep_x`: x [M, K] too (the weight's dtype), else None. `swiglu` (one K split, no residual): the weight is a gate /
    up projection's and the output silu(gate) * up [M, N / 2], as `gemv(..., swiglu=True)` makes it. Returns (output,
    x)."""
    if triton is None:
        raise QdflashError("gemv_fused needs triton (installed with torch on CUDA machines)")
    n, k = weight.shape
    sources = [name for name, t in (("x", x), ("stream", stream), ("gate_up", gate_up)) if t is not None]
    if len(sources) != 1:
        raise QdflashError(f"gemv_fused: exactly one of x, stream, gate_up expected, got {sources or 'none'}")
    if weight.stride(1) != 1 or not fits(config, k):
        raise QdflashError(f"gemv_fused: a contiguous weight [{n}, {k}] that {config} tiles expected, got {tuple(weight.shape)}")
    source = (x, stream, gate_up)[("x", "stream", "gate_up").index(sources[0])]
    m = source.shape[0] if source.dim() == 2 else 0
    expected = {"x": ((m, k), weight.dtype), "stream": ((m, k), torch.float32), "gate_up": ((m, 2 * k), weight.dtype)}
    shape, dtype = expected[sources[0]]
    if not 1 <= m <= MAX_ROWS or tuple(source.shape) != shape or source.dtype != dtype:
        raise QdflashError(f"gemv_fused: {sources[0]} [1..{MAX_ROWS}, {shape[1]}] {dtype} expected, got {tuple(source.shape)} "
                           f"{source.dtype}")
    if (stream is None) != (norm is None):
        raise QdflashError("gemv_fused: `norm` (weight, eps, offset, round_first) goes with `stream`, and only with it")
    if norm is not None and (norm[0].shape != (k,) or not norm[0].is_contiguous() or norm[2] is None):
        raise QdflashError(f"gemv_fused: a contiguous norm weight [{k}] and a numeric offset expected, got "
                           f"{tuple(norm[0].shape)}, offset {norm[2]}")
    if swiglu and (residual is not None or not swiglu_fits(config, n)):
        raise QdflashError(f"gemv_fused: swiglu takes one K split, an even N, >= 2 rows a tile and no residual; got N={n}, {config}")
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.dtype != torch.float32 or config.split_k != 1):
        raise QdflashError(f"gemv_fused: a residual [{m}, {n}] fp32 and one K split expected, got {tuple(residual.shape)} "
                           f"{residual.dtype}, {config}")
    if x is not None and residual is None:  # nothing to fuse: the plain GEMV
        return gemv(x, weight, config, swiglu=swiglu), x
    source = source.contiguous()
    residual = residual.contiguous() if residual is not None else None
    x_in = 0 if x is not None else 1 if stream is not None else 2
    in_weight, eps, offset, round_first = norm if norm is not None else (None, 0.0, 0.0, False)
    keep = keep_x and x_in != 0
    if pdl_for(source):  # as gemv: our op, an opaque node in a compiled step
        out, xs = _fused_op(source, weight, *config.args(), True, x_in, in_weight, float(eps), float(offset), round_first,
                            keep, residual, swiglu)
    else:
        out, xs = _launch(source if x_in == 0 else None, weight, config, False, swiglu=swiglu,
                          prologue=(x_in, source, in_weight, eps, offset, round_first, keep) if x_in else None,
                          residual=residual)
    out = out[0] if config.split_k == 1 else out.sum(0).to(weight.dtype)
    return out, (xs if keep else x)


@torch.library.custom_op("qdflash::gemv_fused", mutates_args=())
def _fused_op(source: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int, num_warps: int,
              unrolled: bool, pdl: bool, x_in: int, in_weight: torch.Tensor | None, eps: float, offset: float,
              round_first: bool, keep_x: bool, residual: torch.Tensor | None, swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_fused`'s launch as one opaque node (`_gemv_op` says why): (raw output, x or an empty tensor)."""
    config = GemvConfig(block_n, block_k, split_k, num_warps, unrolled)
    return _launch(source if x_in == 0 else None, weight, config, pdl, residual=residual, swiglu=swiglu,
                   prologue=(x_in, source, in_weight, eps, offset, round_first, keep_x) if x_in else None)


@_fused_op.register_fake
def _(source, weight, block_n, block_k, split_k, num_warps, unrolled, pdl, x_in, in_weight, eps, offset, round_first, keep_x,
      residual, swiglu):
    n, k = weight.shape
    m = source.shape[0]
    dtype = torch.float32 if residual is not None or split_k > 1 else weight.dtype
    return weight.new_empty((split_k, m, n // 2 if swiglu else n), dtype=dtype), weight.new_empty((m, k if keep_x else 0))


def swiglu_fits(config: GemvConfig, n: int) -> bool:
    """Where `gemv(..., swiglu=True)` runs: one K split (the epilogue needs whole sums), gate and up halves."""
    return config.split_k == 1 and n % 2 == 0 and config.block_n >= 2


def _launch(x: torch.Tensor | None, weight: torch.Tensor, config: GemvConfig, pdl: bool, swiglu: bool = False,
            norm: tuple | None = None, prologue: tuple | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The kernel's raw output [split_k, M, N] (N / 2 with swiglu): x's dtype for one split, else fp32 partial sums.
    `norm` (one row, one split): (residual [1, N] fp32, norm weight [N], arrivals, eps, weight offset, round first);
    then the residual stream after the projection [1, N] fp32 and its RMSNorm [1, N] in x's dtype.
    `prologue` (x None): (X_IN 1 or 2, its source [M, K or 2K], norm weight or None, eps, offset, round first, keep x);
    `residual` (one split): [M, N] fp32, the output is residual + y [M, N] fp32. With either: (output, x [M, K] in the
    weight's dtype where the prologue keeps it, else an empty tensor)."""
    n, k = weight.shape
    m = x.shape[0] if x is not None else prologue[1].shape[0]
    device = weight.device
    n_out = n // 2 if swiglu else n
    fused = prologue is not None or residual is not None
    out_dtype = torch.float32 if norm is not None or residual is not None or config.split_k > 1 else weight.dtype
    out = torch.empty(config.split_k, m, n_out, device=device, dtype=out_dtype)
    # swiglu: the same weight rows a program (half of them gate rows, half up), so the tuned tile's shape and count
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    # K_PER_SPLIT is a runtime argument (one compile per tile serves every shape: tuning is compile-bound),
    # except where the config unrolls the K loop
    tiles = k // (config.split_k * config.block_k) if config.unrolled else 0
    launch = launch_options(pdl)
    if prologue is not None:
        x_in, source, in_weight, in_eps, in_offset, in_round_first, keep_x = prologue
        xs = torch.empty(m, k if keep_x else 0, device=device, dtype=weight.dtype)
        head = (source, source if in_weight is None else in_weight, xs, k, float(in_eps), float(in_offset))
        head_args = dict(X_IN=x_in, IN_ROUND_FIRST=in_round_first, KEEP_X=keep_x)
    else:  # stand-ins the kernel never reads
        source, xs = out, out.new_empty(m, 0, dtype=weight.dtype)
        head, head_args = (out, out, out, k, 0.0, 0.0), dict(X_IN=0, IN_ROUND_FIRST=False, KEEP_X=False)
    if m == 1:
        if norm is not None:
            res, norm_weight, arrivals, eps, offset, round_first = norm
            xn = torch.empty(1, n, device=device, dtype=x.dtype)
            tail = (res, norm_weight, xn, arrivals, float(eps), float(offset))
            tail_args = dict(NORM=True, N_P=triton.next_power_of_2(n), ROUND_FIRST=round_first)
        else:  # stand-ins the kernel never reads
            tail = (residual if residual is not None else out, out, out, out, 0.0, 0.0)
            tail_args = dict(NORM=False, N_P=1, ROUND_FIRST=False)
        _gemv_kernel[grid](x if x is not None else head[0], weight, out, n_out, weight.stride(0), out.stride(0),
                           k // config.split_k, *tail, *head, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TILES=tiles,
                           PDL=pdl, SWIGLU=swiglu, RESIDUAL=residual is not None, **tail_args, **head_args,
                           num_warps=config.num_warps, **launch)
        if norm is not None:
            return out[0], xn
    else:
        res = residual if residual is not None else out
        _gemv_rows_kernel[grid](x if x is not None else source, weight, out, m, n_out, x.stride(0) if x is not None else 0,
                                weight.stride(0), out.stride(0), out.stride(1), k // config.split_k, *head[:3], res,
                                source.stride(0), res.stride(-2), *head[3:], BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                TILES=tiles, IEEE=weight.dtype == torch.float32, PDL=pdl, SWIGLU=swiglu,
                                RESIDUAL=residual is not None, **head_args, num_warps=config.num_warps, **launch)
    return (out, xs) if fused else out


@torch.library.custom_op("qdflash::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int, num_warps: int,
             unrolled: bool, pdl: bool, swiglu: bool) -> torch.Tensor:
    """`_launch` as one opaque node of a compiled graph: torch.compile traces a Triton launch itself but
    drops its launch options (PDL's among them)."""
    return _launch(x, weight, GemvConfig(block_n, block_k, split_k, num_warps, unrolled), pdl, swiglu=swiglu)


@_gemv_op.register_fake
def _(x, weight, block_n, block_k, split_k, num_warps, unrolled, pdl, swiglu):
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty((split_k, x.shape[0], n), dtype=x.dtype if split_k == 1 else torch.float32)


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
