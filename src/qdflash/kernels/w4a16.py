"""W4A16 matmul for 1..16 rows: y = x @ dequant(W).T with 4-bit weights dequantized in registers.

Why a kernel of our own: at batch 1 a decode step reads every weight once, so time = bytes / bandwidth
and 4-bit weights should be ~3.5x cheaper than bf16. torch's built-in int4 op (tinygemm) is fast at
M = 1 but 3x slower than bf16 at M = 16, the size of a speculative verify block (docs/design.md). Here the
weight tile is loaded and unpacked once and multiplied with all (2-16) rows by one `tl.dot`, so 16
rows cost about what 1 row costs: the kernel stays bound by the weight bytes. One row (a decode step)
has a GEMV kernel of its own (`_w4a16_gemv_kernel`): FMAs with few instructions per weight byte.

Layout (`pack_int4`): the symmetric ints q in [-8, 7] of W [N, K] are stored as q + 8 in nibbles of
int32 words [N, K/8]; nibble j of word i holds column 8*i + j. Scales [N, K/group] in their storage
dtype. For 2-16 rows a weight element is (q * scale) computed in fp32 and rounded to the activation
dtype, which is exactly what `qdflash.quant.grid.dequantize(...).to(dtype)` gives, so the product equals
F.linear with the dequantized weight up to the order of the fp32 accumulation. For one row the
weight is not rounded: sum over groups of scale * (q . x), exact products in fp32 (in fp32 both paths
are the same numbers; in bf16 they differ by at most a weight's rounding, 2^-9 relative).

Wide layers are split along K (`split_k` programs per column block, partial sums reduced in fp32 by
torch: deterministic, unlike atomics); the tile sizes are chosen per shape by timing on the device
(`tune`), with enough weight copies to defeat the L2 cache. `tune` also times cuBLAS on the 16-bit
(dequantized) weight at the same shape and rows, and `dense_faster` says where that won: where a step is
bound by launches and latency rather than weight bytes (small layers on a fast GPU: every projection of
Qwen2.5-0.5B on the H200, results/published/2026-12-02-h200-qad-sweep), 4-bit weights buy memory, not
speed, and the engine runs those shapes on the dequantized weight instead (engine.linear.Projection).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, is_dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import QdflashError, raised_at
from ..quant.grid import GridSpec, dequantize
from . import MAX_ROWS, copies_past_l2, fastest, fbgemm_w4, first_best, gemlite_w4, machete_w4, marlin_w4, row_bucket, tinygemm, w4_mma
from .jit import NIBBLE_PAIRS

try:
    import triton
    import triton.language as tl

    from .jit import reduce_splits_last
except ImportError:  # the CPU install: kernels are optional, the dense path remains
    triton = tl = None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Symmetric 4-bit ints [N, K] (int8 in [-8, 7]) -> int32 words [N, K/8] (nibble j = column 8i+j)."""
    n, k = q.shape
    if k % 8:
        raise QdflashError(f"pack_int4: in_features={k} is not a multiple of 8")
    if q.min() < -8 or q.max() > 7:
        raise QdflashError("pack_int4: values outside the symmetric 4-bit range [-8, 7]")
    u = (q.to(torch.int32) + 8).view(n, k // 8, 8)
    words = torch.zeros(n, k // 8, dtype=torch.int32, device=q.device)
    for j in range(8):  # OR the nibbles in; nibble 7 lands in the sign bit, which unpacking masks off
        words |= u[..., j] << (4 * j)
    return words


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int32 [N, K/8] -> int8 [N, K] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = (words[..., None] >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).reshape(words.shape[0], -1)


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    block_k8: int = 16  # words per K step (x8 columns)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fast: bool = False  # bf16 on a GPU: the tensor-core kernel (also for 1 row) with its nibbles made bf16 by bit tricks (BF16_NIBBLES)


# One int32 word of 8 nibbles and its scale s (bf16) -> the 8 weights round_bf16((nibble_j - 8) * s), column j in
# output j, in 16 instructions (2 per weight) where converting each nibble to a float and scaling it takes ~6. A
# nibble OR-ed into the mantissa of bf16 128.0 (0x4300) is the bf16 128 + nibble, exactly (7 mantissa bits), and
# `lop3` does that for two nibbles at once: (w >> 4i) & 0x000F000F | 0x43004300 holds columns i and i + 4 as a bf16
# pair. Then (128 + nibble) * 1 - 136 is q exactly, and q * s + (-0) is q * s rounded once to bf16: what the other
# path computes in fp32 and rounds (the product of a 4-bit and an 8-bit significand is exact in either). fma rather
# than sub / mul .bf16x2: those need sm_90, fma sm_80.
BF16_NIBBLES = ("{\n.reg .b32 r0, r1, r2, r3, sc, one, bias, nz;\nmov.b32 sc, {$9, $9};\n" + NIBBLE_PAIRS.format(word="$8")
                + "".join(f"fma.rn.bf16x2 r{i}, r{i}, sc, nz;\n" for i in range(4))
                + "".join(f"mov.b32 {{${i}, ${i + 4}}}, r{i};\n" for i in range(4)) + "}")


if triton is not None:
    _NIBBLES_ASM = tl.constexpr(BF16_NIBBLES)  # a kernel reads a global only as a constexpr

    @triton.jit
    def _w4a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_os, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                      K_PER_SPLIT: tl.constexpr, FAST: tl.constexpr):
        """2-16 rows: the [BN, BK] weight tile unpacked once, one tensor-core dot with all rows. FAST (bf16):
        the nibbles made bf16 by BF16_NIBBLES, each word's scale loaded beside it, and the tile's 8 columns of
        every word multiplied as 8 dots of [BN, BK8] (no reshape of the weights)."""
        BLOCK_K: tl.constexpr = 8 * BLOCK_K8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn[:, None] < N
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, K_PER_SPLIT, BLOCK_K):
            col0 = pid_k * K_PER_SPLIT + step  # first column of this tile
            w, s = _w4_tile(w_ptr, s_ptr, rn, n_ok, col0, stride_wn, stride_sn, GROUP, BLOCK_K8, FAST)
            acc += _w4_dot(x_ptr, w, s, rm, m_ok, col0, stride_xm, GROUP, BLOCK_N, BLOCK_K8, FAST)
        tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=m_ok & (rn[None, :] < N))

    @triton.jit
    def _w4_tile(w_ptr, s_ptr, rn, n_ok, col0, stride_wn, stride_sn, GROUP: tl.constexpr, BLOCK_K8: tl.constexpr,
                 FAST: tl.constexpr):
        """The words [BN, BK8] of the tile starting at column col0 and its scales: [BN, BK / GROUP], or with FAST
        each word's scale [BN, BK8]."""
        if FAST:
            w, s = _w4_words(w_ptr, s_ptr, rn, tl.arange(0, BLOCK_K8), n_ok, col0, stride_wn, stride_sn, GROUP)
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (col0 // 8 + tl.arange(0, BLOCK_K8))[None, :], mask=n_ok, other=0)
            s = tl.load(s_ptr + rn[:, None] * stride_sn + (col0 // GROUP + tl.arange(0, 8 * BLOCK_K8 // GROUP))[None, :],
                        mask=n_ok, other=0)
        return w, s

    @triton.jit
    def _w4_dot(x_ptr, w, s, rm, m_ok, col0, stride_xm, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
                FAST: tl.constexpr):
        if FAST:
            out = _w4_dot_fast(x_ptr, w, s, rm, m_ok, col0, stride_xm, BLOCK_N, BLOCK_K8)
        else:
            BLOCK_K: tl.constexpr = 8 * BLOCK_K8
            q = ((w[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF) - 8  # [BN, BK8, 8]: column 8i + j
            wt = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s.to(tl.float32)[:, :, None],
                            (BLOCK_N, BLOCK_K))
            wt = wt.to(x_ptr.dtype.element_ty)  # q * scale in fp32, rounded to the activation dtype (= dequantize().to(dtype))
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (col0 + tl.arange(0, BLOCK_K))[None, :], mask=m_ok, other=0)
            out = tl.dot(x, tl.trans(wt))
        return out

    @triton.jit
    def _w4_dot_fast(x_ptr, w, s, rm, m_ok, col0, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr):
        """x's rows [BLOCK_M, BK] @ the tile's weights.T: column j of every word is one [BN, BK8] bf16 operand, met
        by x's columns col0 + 8i + j (a strided load from L1)."""
        cols = tl.inline_asm_elementwise(_NIBBLES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, s], dtype=(tl.bfloat16,) * 8,
                                         is_pure=True, pack=1)
        ri = tl.arange(0, BLOCK_K8)
        acc = tl.zeros((rm.shape[0], BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (col0 + 8 * ri + j)[None, :], mask=m_ok, other=0)
            acc += tl.dot(x, tl.trans(cols[j]))
        return acc

    @triton.jit
    def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, stride_wn, stride_sn, stride_os, K_PER_SPLIT, y_ptr, counts_ptr,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, SPLITS: tl.constexpr):
        """1 row (a decode step): bound by the weight bytes only if unpacking costs few instructions
        per byte. So no reshape (a layout shuffle through shared memory) and no int->float convert
        instruction (a quarter-rate op): nibble j of every word in the [BN, BK8] tile is taken in
        turn, made a float by the exponent trick (nibble | 0x4B000000 is the fp32 2^23 + nibble),
        multiplied with x's columns 8i + j (a strided load from L1), and a word's 8 products are
        scaled once (its 8 columns share a scale group). q * x is exact in fp32, so this is the
        fp32 dequantized product up to the order of the sums. SPLITS > 1: the K splits'
        partial sums (out_ptr) are reduced in this launch into y_ptr (`reduce_splits_last`), counted on counts_ptr."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ri = tl.arange(0, BLOCK_K8)
        n_ok = rn[:, None] < N
        acc = tl.zeros((BLOCK_N, BLOCK_K8), dtype=tl.float32)
        for step in range(0, K_PER_SPLIT, 8 * BLOCK_K8):
            col0 = pid_k * K_PER_SPLIT + step
            w, s = _w4_words(w_ptr, s_ptr, rn, ri, n_ok, col0, stride_wn, stride_sn, GROUP)
            acc += _w4_gemv_part(x_ptr, w, s, ri, col0, BLOCK_N, BLOCK_K8)
        tl.store(out_ptr + pid_k * stride_os + rn, tl.sum(acc, axis=1), mask=rn < N)
        if SPLITS > 1:
            reduce_splits_last(out_ptr, y_ptr, counts_ptr, pid_n, rn, N, stride_os, SPLITS)

    @triton.jit
    def _w4_words(w_ptr, s_ptr, rn, ri, n_ok, col0, stride_wn, stride_sn, GROUP: tl.constexpr):
        """The [BN, BK8] words from column col0, and each word's scale (the one-row kernel's tile, and the fast one's)."""
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (col0 // 8 + ri)[None, :], mask=n_ok, other=0)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + ((col0 + 8 * ri) // GROUP)[None, :], mask=n_ok, other=0)
        return w, s

    @triton.jit
    def _w4_gemv_part(x_ptr, w, s, ri, col0, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr):
        part = tl.zeros((BLOCK_N, BLOCK_K8), dtype=tl.float32)
        for j in tl.static_range(8):
            q = (((w >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # nibble - 8
            x = tl.load(x_ptr + col0 + 8 * ri + j).to(tl.float32)
            part += q * x[None, :]
        return part * s.to(tl.float32)


def _check(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[int, int, int]:
    m, k = x.shape
    n = words.shape[0]
    if m > MAX_ROWS:
        raise QdflashError(f"w4a16_matmul: {m} rows; the kernel takes at most {MAX_ROWS} (use the dense path for prefill)")
    if words.shape[1] * 8 != k or scale.shape != (n, k // group):
        raise QdflashError(f"w4a16_matmul: x {tuple(x.shape)}, words {tuple(words.shape)}, scale {tuple(scale.shape)} "
                           f"do not fit a [{n}, {k}] weight in groups of {group}")
    return m, n, k


def fits(config: Config, k: int, group: int, rows: int = MAX_ROWS) -> bool:
    """A config is valid for K when its K tiles cover each split exactly and hold whole scale groups, a word's
    8 columns in one group (the one-row and fast kernels scale a word once) (and, for the tensor-core path of 2-16 rows and a fast config at any rows, its column block is at least 16
    wide; a fast config's dots are BK8 deep, so at least 16 words too)."""
    tile = 8 * config.block_k8
    dot = rows > 1 or config.fast
    return (tile % group == 0 and group % 8 == 0 and k % (config.split_k * tile) == 0 and (not dot or config.block_n >= 16)
            and (not config.fast or config.block_k8 >= 16))


def w4a16_matmul(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, group: int,
                 config: Config | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] (bf16/fp16/fp32) @ dequant(words, scale).T -> [M, N] in x's dtype. `counts` (int32 zeros, one a
    column block of the config, `split_counts`): one row split over K is reduced in its own launch instead of by a
    torch sum after it (`jit.reduce_splits_last`); the counts are left zero."""
    if triton is None:
        raise QdflashError("w4a16_matmul needs triton (installed with torch on CUDA machines)")
    x = x.contiguous()
    m, n, k = _check(x, words, scale, group)
    config = config or default_config(n, k, group, m, x.dtype)
    if not fits(config, k, group, m):
        raise QdflashError(f"w4a16_matmul: {config} does not tile K={k} (group {group}) for {m} rows")
    if config.fast and scale.dtype != torch.bfloat16:  # its bit tricks read bf16 scales: the same tile without them
        config = replace(config, fast=False)
    if config.fast and (x.dtype != torch.bfloat16 or not x.is_cuda):
        raise QdflashError(f"w4a16_matmul: a fast config takes bf16 activations on a CUDA GPU (its bit tricks are bf16 PTX), "
                           f"got {x.dtype} on {x.device}")
    in_launch = counts is not None and m == 1 and not config.fast and config.split_k > 1 and not config.split_k & (config.split_k - 1)
    if in_launch and (counts.dtype != torch.int32 or not counts.is_contiguous() or counts.numel() < -(-n // config.block_n)):
        raise QdflashError(f"w4a16_matmul: counts must be contiguous int32 zeros, one per column block ({-(-n // config.block_n)} "
                           f"for {config} at N={n}), got {tuple(counts.shape)} {counts.dtype}")
    counts = counts if in_launch else None
    out = _launch(x, words, scale, group, config, counts=counts)
    return out[0] if out.shape[0] == 1 else out.sum(0).to(x.dtype)


def split_counts(n: int, device) -> torch.Tensor:
    """The zeroed counts `w4a16_matmul` reduces a one-row split with, for any one-row config of N columns (its
    narrowest column block is 8): made once per projection, before a graph captures it."""
    return torch.zeros(-(-n // 8), device=device, dtype=torch.int32)


def _launch(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, group: int, config: Config,
            counts: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's raw output [split_k, M, N]: x's dtype for one split, else fp32 partial sums (reduced by the caller);
    with `counts` (one row, split over K) the splits reduced in the launch, [1, 1, N] in x's dtype."""
    m, n, k = x.shape[0], words.shape[0], x.shape[1]
    out = torch.empty(config.split_k, m, n, device=x.device, dtype=x.dtype if config.split_k == 1 else torch.float32)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    common = dict(GROUP=group, BLOCK_N=config.block_n, BLOCK_K8=config.block_k8, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    if m == 1 and not config.fast:  # K_PER_SPLIT at run time: one compile per tile serves every shape (tuning is compile-bound)
        y = torch.empty(1, 1, n, device=x.device, dtype=x.dtype) if counts is not None else out
        _w4a16_gemv_kernel[grid](x, words, scale, out, n, words.stride(0), scale.stride(0), out.stride(0),
                                 k // config.split_k, y, out if counts is None else counts,
                                 SPLITS=1 if counts is None else config.split_k, **common)
        if counts is not None:
            return y
    else:
        _w4a16_kernel[grid](x, words, scale, out, m, n, x.stride(0), words.stride(0), scale.stride(0),
                            out.stride(0), out.stride(1), BLOCK_M=MAX_ROWS, K_PER_SPLIT=k // config.split_k, FAST=config.fast,
                            **common)
    return out


def candidate_configs(k: int, group: int, n: int | None = None, rows: int = MAX_ROWS, fast: bool = False) -> list[Config]:
    """Tile configs that fit K; with `n`, only those launching 64..4096 programs (enough to fill a
    GPU's SMs, few enough that split-K partial sums stay small): the set `tune` times. One row
    (the GEMV kernel) takes [BN, BK8] word tiles of 512-4096 words: long contiguous runs of each
    weight row, and its five tile-sized fp32/int32 arrays still fit the registers. `fast` (bf16 on a GPU): the
    tensor-core tiles again with BF16_NIBBLES (for 1 row also 16 x 16 words), of at most 2048 words (4096 spill
    on sm_90, the 8 bf16 column operands living beside the words), each at its two fewest K splits that fill
    the GPU (a K split is a compile of its own for that kernel: tuning time)."""
    one = rows == 1

    def programs(c: Config) -> int:
        return -(-n // c.block_n) * c.split_k if n else 64

    def launches(c: Config) -> bool:
        return 64 <= programs(c) <= 4096

    out = []
    for block_n in ((8, 16, 32, 64, 128) if one else (32, 64, 128)):
        for block_k8 in ((16, 32, 64, 128) if one else (16, 32)):
            if one and not 512 <= block_n * block_k8 <= 4096:
                continue
            for split_k in (1, 2, 4, 8, 16):
                for warps in ((4, 8) if one and block_n * block_k8 >= 2048 else (4,)):
                    c = Config(block_n, block_k8, split_k, warps, 3)
                    if fits(c, k, group, rows) and launches(c):
                        out.append(c)
    if fast:  # per tile its two fewest splits that still launch >= 128 programs: each is a compile of its own
        tiles = candidate_configs(k, group, n, MAX_ROWS) + ([Config(16, 16, split) for split in (1, 2, 4, 8, 16)] if one else [])
        fitting = [replace(c, fast=True) for c in tiles if c.block_n * c.block_k8 <= 2048 and fits(c, k, group) and launches(c)]
        for tile in dict.fromkeys((c.block_n, c.block_k8) for c in fitting):
            splits = sorted((c for c in fitting if (c.block_n, c.block_k8) == tile), key=lambda c: c.split_k)
            full = [c for c in splits if programs(c) >= 128] if n else splits
            out += (full or splits[-1:])[:2]
    return out


def default_config(n: int, k: int, group: int, rows: int = 1, dtype: torch.dtype = torch.bfloat16) -> Config:
    """The tuned config where `tune` ran for this shape, row bucket (1 row, or 2-16 rows) and
    activation dtype (an fp32 engine's tiles are timed apart from a bf16 one's), else a heuristic:
    the longest K tile, then the fewest splits that still launch >= 256 programs."""
    tuned = _TUNED.get((n, k, group, row_bucket(rows), dtype))
    if tuned is not None:
        return tuned
    fitting = candidate_configs(k, group, n, rows) or candidate_configs(k, group, None, rows)
    if not fitting:
        raise QdflashError(f"w4a16_matmul: no tile config divides K={k} (group {group}); K must be a multiple of 128")
    enough = [c for c in fitting if -(-n // c.block_n) * c.split_k >= 256] or fitting
    return first_best(enough, lambda c: (c.block_k8, -c.split_k, c.block_n if rows > 1 else -c.block_n))


_TUNED: dict[tuple[int, int, int, int, torch.dtype], Config] = {}
_DENSE_FASTER: set[tuple[int, int, int, int, torch.dtype]] = set()  # shapes / row buckets where cuBLAS on the 16-bit weight won
_EXTERNAL_FASTER: dict[tuple[int, int, int, int, torch.dtype], str] = {}  # ... where another int4 kernel won: its name
_EXTERNAL_TILE_TIMES: dict[tuple[int, int, int, int, torch.dtype], dict] = {}  # ... each EXTERNAL kernel's tiles' times (those with tiles)
# other int4 kernels on the same packed ints, timed by `tune` beside this one, by name: each module has
# supported(n, k, group, dtype, device), pack(words, scale, group, dtype) -> state (a tuple) and matmul(x, *state, group);
# optionally tiles of its own, timed per shape and row bucket (configs(n, k, group, rows) -> tiles, matmul(..., config=
# tile), remember(n, k, group, rows, tile): the one matmul then runs)
EXTERNAL = {"tinygemm": tinygemm, "gemlite": gemlite_w4, "fbgemm": fbgemm_w4, "marlin": marlin_w4, "machete": machete_w4,
            "mma": w4_mma}
EXTERNAL_TOLERANCE = 2e-2  # max error relative to the dequantized product's largest value (tinygemm: ~0.003 in bf16)


def dense_faster(n: int, k: int, group: int, rows: int, dtype: torch.dtype) -> bool:
    """Whether `tune` timed cuBLAS on the dequantized 16-bit weight faster than this kernel (and than
    the EXTERNAL ones) for the shape, row bucket (1 row, or 2-16 rows) and activation dtype. False where
    it was not tuned."""
    return (n, k, group, row_bucket(rows), dtype) in _DENSE_FASTER


def backend(n: int, k: int, group: int, rows: int, dtype: torch.dtype) -> str:
    """What runs a packed projection of this shape for `rows` rows: "w4a16" (this kernel; also where
    it was not tuned), "dense" (cuBLAS on the dequantized weight), or an EXTERNAL kernel's name
    ("tinygemm": torch's int4 op; "gemlite"), whichever `tune` timed fastest."""
    key = (n, k, group, row_bucket(rows), dtype)
    return _EXTERNAL_FASTER.get(key) or ("dense" if key in _DENSE_FASTER else "w4a16")


def external_tiles(n: int, k: int, group: int, rows: int, dtype: torch.dtype) -> dict[str, dict]:
    """The tile `tune` timed fastest for each EXTERNAL kernel that brings tiles (its fields), e.g. whether w4_mma's
    won with `prefetch`: what the timings alone do not say. Empty where this shape was not tuned."""
    # min keeps the first of equal times, as `fastest` does
    return {name: min(timed, key=lambda t: t[1])[0] for name, timed in external_tile_times(n, k, group, rows, dtype).items()}


def external_tile_times(n: int, k: int, group: int, rows: int, dtype: torch.dtype) -> dict[str, list]:
    """Every tile `tune` timed for each EXTERNAL kernel that brings tiles: [(its fields, ms per call)], in the order
    timed (`scripts/bench/bench_w4_kernels.py` reports the best of each kind of tile from it, e.g. with and without
    w4_mma's `prefetch`). Empty where this shape was not tuned."""
    return dict(_EXTERNAL_TILE_TIMES.get((n, k, group, row_bucket(rows), dtype), {}))


def _fields(tile):
    return asdict(tile) if is_dataclass(tile) else repr(tile)


def _check_external(name: str, x, ws, ss, group: int):
    """(states of every weight copy, None) when the kernel's product matches the dequantized one, else
    ([], what is wrong): a packing it read differently would be wrong, not slow."""
    module = EXTERNAL[name]
    try:  # a private op or another package: a build that packs or checks differently is a result (not used), not a crash
        states = [module.pack(w, s, group, x.dtype) for w, s in zip(ws, ss)]
        got = module.matmul(x, *states[0], group).float()
    except Exception as err:  # noqa: BLE001 - RuntimeError from torch's op, anything from a package's Triton code
        return [], f"raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    reference = F.linear(x.float(), dequantize_words(ws[0], ss[0], group))
    error = _relative_error(got, reference)
    if error > EXTERNAL_TOLERANCE:
        return [], f"is off the dequantized product by {error:.3g} (relative; tolerance {EXTERNAL_TOLERANCE})"
    return states, None


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest error relative to the reference's largest value (what EXTERNAL_TOLERANCE bounds)."""
    return float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def _tile(config) -> dict:
    """The keyword an EXTERNAL kernel with tiles of its own takes its tile by (none for one without)."""
    return {} if config is None else {"config": config}


def _matching(configs: list, run, reference: torch.Tensor, check=lambda config: True) -> tuple[list, list[str]]:
    """`configs` without those `check` picks whose product `run(config)` is off `reference` by more than
    EXTERNAL_TOLERANCE or that fail to run, and what was wrong with each dropped (the others are kept unchecked)."""
    kept, problems = [], []
    for config in configs:
        if check(config):
            try:
                error = _relative_error(run(config).float(), reference)
            except Exception as err:  # noqa: BLE001 -- a tile that does not build or launch here is dropped, not fatal
                problems.append(f"{config}: raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''} "
                                f"(at {raised_at(err)})")
                continue
            if error > EXTERNAL_TOLERANCE:
                problems.append(f"{config}: off the dequantized product by {error:.3g} (relative)")
                continue
        kept.append(config)
    return kept, problems


def _rounded_product(x, words, scale, group: int) -> torch.Tensor:
    """x @ the dequantized weight with each weight rounded to x's dtype (as the tensor-core paths round it), in fp32."""
    return F.linear(x.float(), dequantize_words(words, scale, group).to(x.dtype).float())


def _external_tiles(module, x, state, reference, n: int, k: int, group: int,
                    swiglu: bool = False) -> tuple[list, list[str]]:
    """An EXTERNAL kernel's tiles for the shape and x's rows whose product matches `reference` (`_rounded_product`),
    and what was wrong with each dropped; [None] for a kernel without tiles of its own. Tuned at 9-16 rows, a tile also
    runs a verify block's 2-8 (w4_mma's one-mma form, another code path): checked too, on x's first ONE_MMA_CHECK rows.
    `swiglu` (an MLP's gate / up, rows as (gate, up) pairs): a tile the kernel's silu(gate) * up epilogue takes
    (`module.swiglu_fits`) is checked with it too, against the same product's pairs (`_swiglu_reference`)."""
    if not hasattr(module, "configs"):
        return [None], []
    kept, problems = _matching(module.configs(n, k, group, x.shape[0]), lambda c: module.matmul(x, *state, group, config=c),
                               reference)
    if x.shape[0] > ONE_MMA_CHECK:
        head = x[:ONE_MMA_CHECK]
        kept, more = _matching(kept, lambda c: module.matmul(head, *state, group, config=c), reference[:ONE_MMA_CHECK])
        problems += [f"{problem} at {ONE_MMA_CHECK} rows" for problem in more]
    if swiglu and hasattr(module, "swiglu_fits"):
        kept, more = _matching(kept, lambda c: module.matmul(x, *state, group, config=c, swiglu=True),
                               _swiglu_reference(reference, x.dtype), check=module.swiglu_fits)
        problems += [f"{problem} in its silu(gate) * up epilogue" for problem in more]
    return kept, problems


ONE_MMA_CHECK = 5  # rows of w4_mma's 2-8-row form checked: odd, so its padded half is exercised too


def _swiglu_reference(product: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a product whose columns are (gate, up) pairs, each rounded to `dtype` as a matmul's output
    and an eager silu's are (`jit.swiglu_rounded`'s rule), in fp32."""
    gate, up = product[:, 0::2].to(dtype), product[:, 1::2].to(dtype)
    return (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype).float()


def _check_fast(x, words, scale, group: int, configs: list[Config], reference) -> tuple[list[Config], list[str]]:
    """`configs` without the fast ones whose product is off `reference` (`_rounded_product`: each weight rounded to
    bf16, as that path rounds it) or that fail to run, and what was wrong with each dropped: inline PTX the interpreter
    cannot run, checked on the device before any timing or use."""
    return _matching(configs, lambda c: w4a16_matmul(x, words, scale, group, c), reference, check=lambda c: c.fast)


def tune(n: int, k: int, group: int, rows: int = MAX_ROWS, device="cuda", dtype=torch.bfloat16,
         l2_bytes: int = 64 << 20, swiglu: bool = False) -> tuple[Config, float, float, dict[str, float | None]]:
    """Time every candidate for [rows, K] x [N, K] and remember the fastest for this shape and row
    bucket (later calls use it); then cuBLAS on a 16-bit [N, K] weight and, where they take the shape,
    the EXTERNAL int4 kernels on the same packed weights, and remember which won (`backend`). Each
    candidate runs once on each of several weight copies (together > 4x the L2 cache, so weights come
    from HBM; the 16-bit copies are 4x larger, so fewer are needed) inside one CUDA graph, as in a
    captured decode step: launch overhead is not what is measured. An external kernel is first checked
    against the dequantized product: outside EXTERNAL_TOLERANCE it is not used, and this says so. `swiglu`: the shape
    is an MLP's gate / up as (gate, up) row pairs, so tiles are checked in their silu(gate) * up epilogue too.
    Returns (config, its median ms per call, cuBLAS's, {external kernel: its ms, None where it did not run})."""
    copies = copies_past_l2(n * k // 2, l2_bytes)
    ws = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=device, dtype=torch.int32) for _ in range(copies)]
    ss = [torch.rand(n, k // group, device=device, dtype=dtype) / 64 for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=dtype)
    fast = dtype == torch.bfloat16 and torch.device(device).type == "cuda"
    configs = candidate_configs(k, group, n, rows, fast) or candidate_configs(k, group, None, rows, fast)
    rounded = _rounded_product(x, ws[0], ss[0], group)  # what the fast configs and tiled kernels are checked against
    configs, problems = _check_fast(x, ws[0], ss[0], group, configs, rounded)
    if problems:
        warnings.warn(f"w4a16 on {n}x{k} (group {group}, {rows} rows), fast configs not used: {'; '.join(problems)[:1000]}",
                      stacklevel=2)
    counts = split_counts(n, device)  # one row split over K reduces in its launch, as in the engine (Projection.counts)
    config, ms = fastest(configs, lambda c: [w4a16_matmul(x, w, s, group, c, counts) for w, s in zip(ws, ss)], copies)
    others: dict[str, float | None] = {}
    tile_times: dict[str, list] = {}
    for name, module in EXTERNAL.items():
        others[name] = None
        if not module.supported(n, k, group, dtype, device):
            continue
        states, problem = _check_external(name, x, ws, ss, group)
        if problem:
            warnings.warn(f"{name} on {n}x{k} (group {group}, {rows} rows) {problem}: not used", stacklevel=2)
            continue
        tiles, problems = _external_tiles(module, x, states[0], rounded, n, k, group, swiglu)
        if problems:
            warnings.warn(f"{name} on {n}x{k} (group {group}, {rows} rows), tiles not used: {'; '.join(problems)[:1000]}",
                          stacklevel=2)
        times = []
        tile, others[name] = fastest(tiles, lambda c: [module.matmul(x, *state, group, **_tile(c)) for state in states], copies,
                                     times)
        if tile is not None:
            module.remember(n, k, group, rows, tile)
            tile_times[name] = [(_fields(c), ms) for c, ms in times]
        del states
    del ws, ss
    key = (n, k, group, row_bucket(rows), dtype)
    _TUNED[key] = config
    _EXTERNAL_TILE_TIMES[key] = tile_times
    dense_copies = copies_past_l2(n * k * torch.finfo(dtype).bits // 8, l2_bytes)
    dense = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(dense_copies)]
    _, dense_ms = fastest([None], lambda _: [F.linear(x, w) for w in dense], dense_copies)
    _DENSE_FASTER.discard(key)
    _EXTERNAL_FASTER.pop(key, None)
    timed = {name: t for name, t in others.items() if t is not None}
    best = min(timed, key=timed.get) if timed else None
    if best is not None and timed[best] < min(ms, dense_ms):
        _EXTERNAL_FASTER[key] = best
    elif dense_ms < ms:
        _DENSE_FASTER.add(key)
    return config, ms, dense_ms, others


def dequantize_words(words: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The weight [N, K] of packed words and their scales, q * scale in fp32 (exact: a caller rounds it
    to its activation dtype once, as the kernels do per element)."""
    return dequantize(unpack_int4(words), scale, None, GridSpec(4, group, True))
