"""A W4A16 matmul for 1-16 rows on tensor cores, on a repacking of this project's ints: one more way to run a packed
4-bit projection at batch 1, timed by `w4a16.tune` beside the others (it is one of `w4a16.EXTERNAL`).

Why: at one row a 4-bit matmul has ~8 weights per byte of instructions to spend, and the fp32 FMA GEMV
(`w4a16._w4a16_gemv_kernel`) spends 6-7 SASS instructions a weight (unpack, bias, FMA, the activation's
conversion; `scripts/investigations/w4_sass.py`), so it is bound by instruction issue near 1.5 TB/s where the 16-bit GEMV streams 4.2 TB/s
(README, `scripts/investigations/w4_step_floor.py`). Here two weights become bf16 in ~1 instruction each
(`w4a16.BF16_NIBBLES`'s bit tricks, a pair at a time) and one `mma.sync` multiplies 8 of them per lane.

How one row uses an m16n8k16 mma without wasting its layout on padding rows: each lane holds one int32
word: 8 weights, rows (n1, n2) x 4 consecutive input columns (its "slots"), and the activation's 4 values at
those columns. The word's nibbles are placed so that the bit tricks give exactly the mma's A fragment (a0a1:
n1 at slots 0-1, a2a3: n2 at slots 0-1, a4a5: n1 at slots 2-3, a6a7: n2 at slots 2-3) and the 4 activations
its B fragment (b0b1: slots 0-1, b2b3: slots 2-3). Then the mma's C[g][g] (g = lane / 4) is the dot product
of quad g's four words with their own activations for row n1, and C[g + 8][g] for row n2: the other 56 of
C's 64 columns x rows mix one lane's weights with another's activations and are dropped. So the 4 lanes of a
quad must hold words of the same row pair (each lane's own columns, any of them): true of Triton's blocked
layout for a [pairs, words] tile with >= 4 lanes along the words (tests/test_kernels.py checks the compiled
layout), and no element may be held twice (the useful lane is chosen by lane id).

2-16 rows (a verify block, `_w4_mma_rows_kernel`) read the same words: a [pairs, 16 words] tile puts the 4 lanes
of a quad along the words and a warp's 8 quads on 8 row pairs at the same columns, so quad g can feed the mma's B
column g with activation row g (a second mma: row g + 8): C[g][n] is then row pair g times activation row n, and every
lane's accumulators are outputs. A word is unpacked once for both mmas: 16 rows cost ~1.3x one row's instructions.

Numbers: each weight is q * scale rounded to bf16 (what the 2-16-row kernels, Marlin and cuBLAS on the
dequantized weight multiply), products and sums in fp32 on the tensor cores. bf16 activations on a CUDA GPU
only (PTX); elsewhere `supported` is False and the other backends run.

Layout (`pack`): rows 2r and 2r + 1 are pair r; words [N/2, K/4] int32, word w holding columns 4w..4w+3
(nibble p at bits 4p: 0 (n1, slot 0), 1 (n2, 0), 2 (n1, 2), 3 (n2, 2), 4 (n1, 1), 5 (n2, 1), 6 (n1, 3),
7 (n2, 3)); scales [N/2, K/group] int32, the bf16 pair (s_n1 low, s_n2 high).

SWIGLU (`matmul(..., swiglu=True)`, one K split): an MLP's gate / up kept as (gate, up) row pairs
(`gemv.swiglu_pairs`) makes each row pair a (gate, up) pair, so a program holds both sums of an output and its
epilogue writes silu(gate) * up, [rows, N / 2] (`jit.swiglu_rounded`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import QdflashError
from . import MAX_ROWS, first_best, pdl_enabled, row_bucket  # 1 row: `_w4_mma_kernel`; 2-16 (a verify block): `_w4_mma_rows_kernel`
from .jit import NIBBLE_PAIRS

try:
    import triton
    import triton.language as tl

    from .jit import pdl_start, reduce_splits_last, swiglu_rounded
except ImportError:  # the CPU install
    triton = tl = None

GROUPS = (32, 64, 128)  # a word's 4 columns are one scale group; more than one group per row (as Marlin's)


@dataclass(frozen=True)
class Config:
    block_p: int = 16  # row pairs of a program
    block_w: int = 64  # words along K of a tile (4 columns each)
    split_k: int = 1
    num_warps: int = 4
    prefetch: bool = False  # the next tile's words loaded before this one's math, its scales (activations) by asm of their own


# A word's A fragment (r0-r3) from the word ({word}) and the address of its row pair's scales ({scales}: bf16 s_n1 low,
# s_n2 high). The nibble pairs (p, p + 4) become bf16 (128 + nibble) by one lop3 each, minus 136 by one fma, times the
# row's scale by one more (as w4a16.BF16_NIBBLES: q * s rounded once to bf16, exactly what the other paths compute in
# fp32 and round). The scales are loaded here, not by tl.load: Triton lays out an elementwise op's operands as one of
# their loads, and the scales' load (one address for a group's words) gets a layout with the lanes along the rows
# (Triton 3.6 on the H200), which would break the quads; the words' load alone gives the layout the mma needs.
DEQUANT = ("ld.global.nc.b32 sp, [{scales}];\nprmt.b32 s1, sp, sp, 0x1010;\nprmt.b32 s2, sp, sp, 0x3232;\n" + NIBBLE_PAIRS
           + "".join(f"fma.rn.bf16x2 r{i}, r{i}, s{1 + i % 2}, nz;\n" for i in range(4)))
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def dequant(given: bool) -> str:
    """DEQUANT, or with `given` the same taking the scale pair itself ({scales}, loaded before by LOAD_B32)."""
    return DEQUANT.replace("ld.global.nc.b32 sp, [{scales}];", "mov.b32 sp, {scales};") if given else DEQUANT


def word_asm(scales_given: bool) -> str:
    """One row: the word ($4), its scales' address ($5; `scales_given`: the scale pair itself, loaded before by
    LOAD_B32), the 4 activations at its columns ($6, 64 bits), the accumulators ($7-$10) -> the accumulators after
    one m16n8k16 mma ($0-$3)."""
    return ("{\n.reg .b32 r0, r1, r2, r3, sp, s1, s2, one, bias, nz, xlo, xhi;\n"
            + dequant(scales_given).format(word="$4", scales="$5")
            + "mov.b64 {xlo, xhi}, $6;\n" + MMA + " {$0, $1, $2, $3}, {r0, r1, r2, r3}, {xlo, xhi}, {$7, $8, $9, $10};\n}")


MMA_WORD, MMA_WORD_GIVEN = word_asm(False), word_asm(True)
# A 32-bit load as an elementwise op of its own (no tl.load: it would set the layout, see DEQUANT's comment), whose
# only input is its address: issued as early as that is known, not behind the word it scales as inside MMA_WORD.
LOAD_B32 = "ld.global.nc.b32 $0, [$1];"
# The rows kernel's loads, a lane's 4 words at once (pack=4: its [1, 4] registers, words 4t..4t+3 of a 16-word tile,
# consecutive and in one scale group, GROUP_WORDS >= 4): the scale pair once for the four ($4: the first word's
# address), and an activation row's values at their 16 columns (32 bytes, 16-byte aligned) in two 16-byte loads. Why:
# loaded a word at a time, the 16-row kernel issued 3 loads a word (its scale pair, 8 bytes of each of two activation
# rows), and a warp's 8-byte activation loads spread over 8 rows x 4 lanes 32 bytes apart; here 1.25 a word, each
# lane's 32 bytes whole.
LOAD_B32_X4 = "{\n.reg .b32 s;\nld.global.nc.b32 s, [$4];\nmov.b32 $0, s;\nmov.b32 $1, s;\nmov.b32 $2, s;\nmov.b32 $3, s;\n}"
LOAD_B64_X4 = ("{\n.reg .b32 a0, a1, a2, a3, a4, a5, a6, a7;\nld.global.nc.v4.b32 {a0, a1, a2, a3}, [$4];\n"
               "ld.global.nc.v4.b32 {a4, a5, a6, a7}, [$4+16];\nmov.b64 $0, {a0, a1};\nmov.b64 $1, {a2, a3};\n"
               "mov.b64 $2, {a4, a5};\nmov.b64 $3, {a6, a7};\n}")


def rows_asm(high: bool) -> str:
    """2-16 rows (`_w4_mma_rows_kernel`): the word, its scale pair, the 4 activations at its columns in activation row g
    and (`high`) g + 8 (each loaded before, LOAD_B32_X4 / LOAD_B64_X4), the accumulators -> the accumulators after one
    mma per 8 activation rows, the word's A fragment made once. Operands: 8 outputs with `high`, else 4, then the
    inputs."""
    outs = 8 if high else 4
    word, scales, xa, xb = (f"${i}" for i in range(outs, outs + 4))
    acc = outs + (4 if high else 3)
    load = "mov.b64 {{{0}0, {0}1}}, {1};"
    lines = ["{", ".reg .b32 r0, r1, r2, r3, sp, s1, s2, one, bias, nz, xa0, xa1, xb0, xb1;",
             dequant(True).format(word=word, scales=scales).strip(), load.format("xa", xa),
             f"{MMA} {{$0, $1, $2, $3}}, {{r0, r1, r2, r3}}, {{xa0, xa1}}, {{${acc}, ${acc + 1}, ${acc + 2}, ${acc + 3}}};"]
    if high:
        lines += [load.format("xb", xb),
                  f"{MMA} {{$4, $5, $6, $7}}, {{r0, r1, r2, r3}}, {{xb0, xb1}}, {{${acc + 4}, ${acc + 5}, ${acc + 6}, ${acc + 7}}};"]
    return "\n".join(lines + ["}"])


MMA_ROWS8, MMA_ROWS16 = rows_asm(False), rows_asm(True)

# The accumulators ($2-$5) -> row n1's and n2's sums ($0, $1) in the lane that holds C[g][g] and C[g + 8][g]
# (lane 4g + g / 2: c0 / c2 for even g, c1 / c3 for odd), 0 in every other lane.
DIAGONAL = """{
.reg .u32 lane, g, c, h;
.reg .pred useful, odd;
mov.u32 lane, %laneid;
shr.u32 g, lane, 2;
and.b32 c, lane, 3;
shr.u32 h, g, 1;
setp.eq.u32 useful, c, h;
and.b32 h, g, 1;
setp.ne.u32 odd, h, 0;
selp.f32 $0, $3, $2, odd;
selp.f32 $1, $5, $4, odd;
selp.f32 $0, $0, 0f00000000, useful;
selp.f32 $1, $1, 0f00000000, useful;
}"""


if triton is not None:
    _MMA_WORD = tl.constexpr(MMA_WORD)  # a kernel reads a global only as a constexpr
    _MMA_WORD_GIVEN = tl.constexpr(MMA_WORD_GIVEN)
    _LOAD_B32 = tl.constexpr(LOAD_B32)
    _DIAGONAL = tl.constexpr(DIAGONAL)
    _MMA_ROWS8 = tl.constexpr(MMA_ROWS8)
    _MMA_ROWS16 = tl.constexpr(MMA_ROWS16)
    _LOAD_B32_X4 = tl.constexpr(LOAD_B32_X4)
    _LOAD_B64_X4 = tl.constexpr(LOAD_B64_X4)

    @triton.jit
    def _w4_mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N2, stride_wn, stride_sn, stride_os, W_PER_SPLIT, y_ptr, counts_ptr,
                       GROUP_WORDS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS: tl.constexpr,
                       PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False, SWIGLU: tl.constexpr = False):
        """x_ptr: the row's activations as int64 (4 bf16 each); w_ptr / s_ptr: `pack`'s words and scale pairs; out_ptr
        [SPLITS, 2 * N2]: for one split the output (x's dtype), else fp32 partial sums, reduced in this launch into y_ptr
        by the last program of a column block (`reduce_splits_last`, counted on counts_ptr). PREFETCH: every load of a
        tile (its words, its scales by LOAD_B32, the activations) is issued two steps ahead, so two tiles' DRAM reads
        are in flight while a step waits on one. Why two: ptxas places a loop's loads after its mmas, so loads issued
        one step ahead were still waited on at the top of the next step (`scripts/investigations/w4_sass.py`), as
        without prefetch. The last steps load the split's last tile again (nothing past the split is read). On an H100
        it decided nothing (results/published/2026-12-06-h100-prefetch2-gdn); tuning times it beside the plain tiles.
        PDL: launched with programmatic dependent launch (`kernels.pdl`, `jit.pdl_start`). SWIGLU (one split): each row
        pair is a (gate, up) pair (`gemv.swiglu_pairs`) and out_ptr [N2] gets silu(gate) * up (`jit.swiglu_rounded`)."""
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
        rw = tl.arange(0, BLOCK_W)
        p_ok = rp[:, None] < N2
        rows = tl.minimum(rp, N2 - 1)[:, None]  # a pair past N2 reads the last one's scales (its sums are not stored)
        c0 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        c1 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        c2 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        c3 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        words_at = w_ptr + rp[:, None] * stride_wn + (pid_k * W_PER_SPLIT + rw)[None, :]
        row_scales = s_ptr + rows * stride_sn
        if PREFETCH:  # the first two tiles' loads
            words1, s1, x1 = _one_row_loads(words_at, row_scales, x_ptr, pid_k * W_PER_SPLIT, 0, rw, p_ok, GROUP_WORDS)
            nxt = tl.minimum(BLOCK_W, W_PER_SPLIT - BLOCK_W)
            words2, s2, x2 = _one_row_loads(words_at, row_scales, x_ptr, pid_k * W_PER_SPLIT, nxt, rw, p_ok, GROUP_WORDS)
        for step in range(0, W_PER_SPLIT, BLOCK_W):
            if PREFETCH:  # this tile's loads were issued two steps ago; issue those two ahead
                words, s_in, x = words1, s1, tl.broadcast_to(x1[None, :], (BLOCK_P, BLOCK_W))
                words1, s1, x1 = words2, s2, x2
                nxt = tl.minimum(step + 2 * BLOCK_W, W_PER_SPLIT - BLOCK_W)
                words2, s2, x2 = _one_row_loads(words_at, row_scales, x_ptr, pid_k * W_PER_SPLIT, nxt, rw, p_ok,
                                                GROUP_WORDS)
            else:  # ... the scales' address, loaded in the asm
                w0 = pid_k * W_PER_SPLIT + step
                x = tl.broadcast_to(tl.load(x_ptr + w0 + rw)[None, :], (BLOCK_P, BLOCK_W))
                words = tl.load(words_at + step, mask=p_ok, other=0)
                s_in = row_scales + ((w0 + rw) // GROUP_WORDS)[None, :]
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _MMA_WORD_GIVEN if PREFETCH else _MMA_WORD, "=f,=f,=f,=f,r," + ("r" if PREFETCH else "l") + ",l,f,f,f,f",
                [words, s_in, x, c0, c1, c2, c3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        y1, y2 = tl.inline_asm_elementwise(_DIAGONAL, "=f,=f,f,f,f,f", [c0, c1, c2, c3], dtype=(tl.float32,) * 2,
                                           is_pure=True, pack=1)
        ok = rp < N2
        if SWIGLU:
            tl.static_assert(SPLITS == 1, "silu(gate) * up needs the pairs' final sums")
            tl.store(out_ptr + rp, swiglu_rounded(tl.sum(y1, axis=1), tl.sum(y2, axis=1), out_ptr.dtype.element_ty), mask=ok)
        else:
            out = out_ptr + pid_k * stride_os + 2 * rp
            tl.store(out, tl.sum(y1, axis=1).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(out + 1, tl.sum(y2, axis=1).to(out_ptr.dtype.element_ty), mask=ok)
        if SPLITS > 1:
            reduce_splits_last(out_ptr, y_ptr, counts_ptr, pid_n, pid_n * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P), 2 * N2,
                               stride_os, SPLITS)

    @triton.jit
    def _w4_mma_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N2, stride_xm, stride_wn, stride_sn, stride_os, W_PER_SPLIT,
                            y_ptr, counts_ptr, GROUP_WORDS: tl.constexpr, BLOCK_P: tl.constexpr, HIGH: tl.constexpr,
                            SPLITS: tl.constexpr, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
                            SWIGLU: tl.constexpr = False):
        """2-16 rows of x (x_ptr: int64, 4 bf16 each, rows stride_xm apart), the same words as the one-row kernel, in
        tiles of 16 words: Triton lays a [pairs, 16] int32 tile out with 4 lanes along the words and 8 along the
        pairs, so at each register the warp's 8 quads hold 8 row pairs at the same columns. Quad g then feeds the
        mma's B column g with activation row g (HIGH: a second mma with row g + 8), and C[g][n] / C[g + 8][n] is row
        pair g times activation row n: every lane's accumulators are outputs (lane t of a quad: rows 2t, 2t + 1).
        out_ptr [SPLITS, M, 2 * N2] (the output for one split; else fp32 partial sums reduced in this launch).
        A tile's scales and activations are loaded 4 words a lane (`_rows_loads`) before its mmas; PREFETCH: two steps
        ahead, as the one-row kernel's. PDL, SWIGLU: as the one-row kernel's (out_ptr [M, N2]). x_ptr 16-byte aligned
        (`_launch`)."""
        pdl_start(PDL)
        BLOCK_W: tl.constexpr = 16
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)
        rw = tl.arange(0, BLOCK_W)
        p_ok = rp[:, None] < N2
        rows = tl.minimum(rp, N2 - 1)[:, None]
        g = (rp % 8)[:, None]  # the quad holding pair rp (lanes: 8 along the pairs); rows past M read row M - 1 (not stored)
        xa = x_ptr + tl.minimum(g, M - 1) * stride_xm
        xb = x_ptr + tl.minimum(g + 8, M - 1) * stride_xm
        a0 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        b0 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        b1 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        b2 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        b3 = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
        words_at = w_ptr + rp[:, None] * stride_wn + (pid_k * W_PER_SPLIT + rw)[None, :]
        row_scales = s_ptr + rows * stride_sn
        if PREFETCH:  # the first two tiles' loads
            words1, s1, xa1, xb1 = _rows_loads(words_at, row_scales, xa, xb, pid_k * W_PER_SPLIT, 0, rw, p_ok,
                                               GROUP_WORDS, HIGH)
            nxt = tl.minimum(BLOCK_W, W_PER_SPLIT - BLOCK_W)
            words2, s2, xa2, xb2 = _rows_loads(words_at, row_scales, xa, xb, pid_k * W_PER_SPLIT, nxt, rw, p_ok,
                                               GROUP_WORDS, HIGH)
        for step in range(0, W_PER_SPLIT, BLOCK_W):
            if PREFETCH:  # this tile's loads were issued two steps ago; issue those two ahead
                words, s_in, xa_in, xb_in = words1, s1, xa1, xb1
                words1, s1, xa1, xb1 = words2, s2, xa2, xb2
                nxt = tl.minimum(step + 2 * BLOCK_W, W_PER_SPLIT - BLOCK_W)
                words2, s2, xa2, xb2 = _rows_loads(words_at, row_scales, xa, xb, pid_k * W_PER_SPLIT, nxt, rw, p_ok,
                                                   GROUP_WORDS, HIGH)
            else:  # this tile's loads, then its mmas
                words, s_in, xa_in, xb_in = _rows_loads(words_at, row_scales, xa, xb, pid_k * W_PER_SPLIT, step, rw, p_ok,
                                                        GROUP_WORDS, HIGH)
            if HIGH:
                a0, a1, a2, a3, b0, b1, b2, b3 = tl.inline_asm_elementwise(
                    _MMA_ROWS16, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,l,l,f,f,f,f,f,f,f,f",
                    [words, s_in, xa_in, xb_in, a0, a1, a2, a3, b0, b1, b2, b3], dtype=(tl.float32,) * 8,
                    is_pure=True, pack=1)
            else:
                a0, a1, a2, a3 = tl.inline_asm_elementwise(
                    _MMA_ROWS8, "=f,=f,=f,=f,r,r,l,f,f,f,f", [words, s_in, xa_in, a0, a1, a2, a3],
                    dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        lane_rows = 2 * tl.arange(0, 4)[None, :]  # lane t's accumulators c0 / c1: activation rows 2t / 2t + 1
        if SWIGLU:  # a pair's first row (a0, a1) is its gate, its second (a2, a3) its up
            tl.static_assert(SPLITS == 1, "silu(gate) * up needs the pairs' final sums")
            _store_swiglu(out_ptr + rp[:, None], a0, a1, a2, a3, lane_rows, 0, M, N2, p_ok, BLOCK_P)
            if HIGH:
                _store_swiglu(out_ptr + rp[:, None], b0, b1, b2, b3, lane_rows, 8, M, N2, p_ok, BLOCK_P)
            return
        base = out_ptr + pid_k * stride_os + 2 * rp[:, None]
        _store_rows(base, a0, a1, lane_rows, 0, M, N2, p_ok, BLOCK_P)
        _store_rows(base + 1, a2, a3, lane_rows, 0, M, N2, p_ok, BLOCK_P)
        if HIGH:
            _store_rows(base, b0, b1, lane_rows, 8, M, N2, p_ok, BLOCK_P)
            _store_rows(base + 1, b2, b3, lane_rows, 8, M, N2, p_ok, BLOCK_P)
        if SPLITS > 1:  # the block's [M, 2 * BLOCK_P] outputs, flattened as [M, N] is (N a multiple of 2 * BLOCK_P)
            j = tl.arange(0, 16 * 2 * BLOCK_P)
            cols = (j // (2 * BLOCK_P)) * (2 * N2) + pid_n * 2 * BLOCK_P + j % (2 * BLOCK_P)
            reduce_splits_last(out_ptr, y_ptr, counts_ptr, pid_n, cols, M * 2 * N2, stride_os, SPLITS)

    @triton.jit
    def _one_row_loads(words_at, row_scales, x_ptr, first, step, rw, p_ok, GROUP_WORDS: tl.constexpr):
        """The one-row kernel's loads of the tile `step` words into its split (which starts at word `first`): its
        words, scale pairs (LOAD_B32: no tl.load, which would set the layout) and activations."""
        w0 = first + step
        words = tl.load(words_at + step, mask=p_ok, other=0)
        scales = tl.inline_asm_elementwise(_LOAD_B32, "=r,l", [row_scales + ((w0 + rw) // GROUP_WORDS)[None, :]],
                                           dtype=tl.int32, is_pure=True, pack=1)
        return words, scales, tl.load(x_ptr + w0 + rw)

    @triton.jit
    def _rows_loads(words_at, row_scales, xa, xb, first, step, rw, p_ok, GROUP_WORDS: tl.constexpr, HIGH: tl.constexpr):
        """The rows kernel's loads of the tile `step` words into its split (which starts at word `first`): its words,
        scale pairs and activations (rows g and, HIGH, g + 8), the last three by asm loads of their own, a lane's 4
        words at once (LOAD_B32_X4, LOAD_B64_X4; no tl.load: it would set the layout); without HIGH the second
        activations are the first."""
        tl.static_assert(GROUP_WORDS % 4 == 0, "LOAD_B32_X4 reads one scale pair for a lane's 4 words")
        cols = (first + step + rw)[None, :]
        words = tl.load(words_at + step, mask=p_ok, other=0)
        s_in = tl.inline_asm_elementwise(_LOAD_B32_X4, "=r,=r,=r,=r,l,l,l,l", [row_scales + cols // GROUP_WORDS],
                                         dtype=tl.int32, is_pure=True, pack=4)
        xa_in = tl.inline_asm_elementwise(_LOAD_B64_X4, "=l,=l,=l,=l,l,l,l,l", [xa + cols], dtype=tl.int64, is_pure=True,
                                          pack=4)
        xb_in = xa_in
        if HIGH:
            xb_in = tl.inline_asm_elementwise(_LOAD_B64_X4, "=l,=l,=l,=l,l,l,l,l", [xb + cols], dtype=tl.int64,
                                              is_pure=True, pack=4)
        return words, s_in, xa_in, xb_in

    @triton.jit
    def _store_swiglu(base, gate_even, gate_odd, up_even, up_odd, lane_rows, first, M, N2, ok, BLOCK_P: tl.constexpr):
        """`_store_rows` of a (gate, up) pair's two rows as the one output silu(gate) * up (base: the pair's column of
        an [M, N2] output)."""
        m = first + lane_rows
        dt = base.dtype.element_ty
        even = swiglu_rounded(tl.sum(tl.reshape(gate_even, (BLOCK_P, 4, 4)), axis=2),
                              tl.sum(tl.reshape(up_even, (BLOCK_P, 4, 4)), axis=2), dt)
        odd = swiglu_rounded(tl.sum(tl.reshape(gate_odd, (BLOCK_P, 4, 4)), axis=2),
                             tl.sum(tl.reshape(up_odd, (BLOCK_P, 4, 4)), axis=2), dt)
        tl.store(base + m * N2, even, mask=ok & (m < M))
        tl.store(base + (m + 1) * N2, odd, mask=ok & (m + 1 < M))

    @triton.jit
    def _store_rows(base, c_even, c_odd, lane_rows, first, M, N2, ok, BLOCK_P: tl.constexpr):
        """One output row of each pair (base: its column) for the activation rows its accumulators hold: a lane's 4
        registers (the tile's words 4t..4t+3) summed, lane t's c_even at activation row first + 2t, c_odd at + 1."""
        even = tl.sum(tl.reshape(c_even, (BLOCK_P, 4, 4)), axis=2)
        odd = tl.sum(tl.reshape(c_odd, (BLOCK_P, 4, 4)), axis=2)
        m = first + lane_rows
        dt = base.dtype.element_ty
        tl.store(base + m * (2 * N2), even.to(dt), mask=ok & (m < M))
        tl.store(base + (m + 1) * (2 * N2), odd.to(dt), mask=ok & (m + 1 < M))


def supported(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """CUDA with triton, bf16 activations (the PTX is bf16), N even (row pairs), a group of GROUPS dividing K, more
    than one group per row, and a tile that fits (`configs`: K a multiple of 128, enough rows to fill the GPU)."""
    return (triton is not None and torch.device(device).type == "cuda" and dtype == torch.bfloat16 and n % 2 == 0
            and group in GROUPS and k % group == 0 and k > group and len(configs(n, k, group)) > 0)  # len: bool(list) breaks dynamo 2.11


def pack_words(words: torch.Tensor) -> torch.Tensor:
    """This project's words [N, K/8] (`w4a16.pack_int4`) -> the kernel's [N/2, K/4] (module docstring)."""
    from .w4a16 import unpack_int4

    n = words.shape[0]
    if n % 2:
        raise QdflashError(f"w4_mma: {n} rows do not pair up")
    u = (unpack_int4(words).to(torch.int32) + 8).view(n // 2, 2, -1, 4)  # [pair, row of the pair, word, slot]
    order = [(0, 0), (1, 0), (0, 2), (1, 2), (0, 1), (1, 1), (0, 3), (1, 3)]  # nibble p: (row of the pair, slot)
    out = torch.zeros(n // 2, u.shape[2], dtype=torch.int32, device=words.device)
    for p, (row, slot) in enumerate(order):  # nibble 7 lands in the sign bit: the kernel shifts logically
        out |= u[:, row, :, slot] << (4 * p)
    return out


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales [N, K/group] -> [N/2, K/group] int32: bf16 s_n1 in the low half, s_n2 in the high."""
    pairs = scale.to(torch.bfloat16).view(scale.shape[0] // 2, 2, -1).transpose(1, 2).contiguous()
    return pairs.view(torch.int32).view(pairs.shape[0], pairs.shape[1])


def pack(words: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> tuple:
    """This project's packed ints and scales -> (words, scale pairs, zeroed split counters, N): what `matmul` takes
    after x."""
    n, k = words.shape[0], words.shape[1] * 8
    if not supported(n, k, group, dtype, words.device):
        raise QdflashError(f"w4_mma cannot run a {n}x{k} weight in group {group} at {dtype} on {words.device}")
    from .w4a16 import split_counts  # w4a16 imports this module

    return pack_words(words), pack_scales(scale), split_counts(n, words.device), n  # >= one count per column block


def fits(config: Config, n: int, k: int, rows: int = 1) -> bool:
    """K's words split into whole tiles; for 2-16 rows also N into whole column blocks (their split-K reduction reads
    the [rows, N] output flat) and 16-word tiles (the layout the rows kernel needs)."""
    whole = (k // 4) % (config.split_k * config.block_w) == 0
    return whole if rows == 1 else whole and config.block_w == ROWS_TILE_W and (n // 2) % config.block_p == 0


ROWS_TILE_W = 16  # the rows kernel's tile: 4 lanes x 4 words along K, so a warp's 8 quads hold 8 row pairs


def configs(n: int, k: int, group: int, rows: int = 1) -> list[Config]:
    """The tiles `w4a16.tune` times. One row: 4 warps, 4-16 words a thread (each its 4 fp32 accumulators in
    registers), at least as many words as the blocked layout covers (no word held twice). 2-16 rows: 16-word tiles of
    8 row pairs per warp (4 or 8 warps, one or two such rows of quads). Both: each tile also with `prefetch`,
    64..4096 programs, K split 1-8 ways (powers of two: the in-launch reduction's). Each tile and split is a compile
    of its own: tuning time."""
    out = []
    if rows > 1:
        for block_p, warps in ((32, 4), (64, 4), (64, 8)):
            for split_k in (1, 2, 4, 8):
                c = Config(block_p, ROWS_TILE_W, split_k, warps)
                if fits(c, n, k, rows) and 64 <= n // (2 * block_p) * split_k <= 4096:
                    out += [c, replace(c, prefetch=True)]
        # (tiles of fewer pairs, 16 x 2 warps and 8 x 1 with K split at most twice, were timed at every Qwen3.5-4B shape
        # and never won: results/published/2026-12-07-h100-gdn-layout-reverted, `w4_rows16.json`)
        return out
    for block_p in (4, 8, 16, 32):
        for block_w in (32, 64, 128):
            for warps in (4,):
                per_thread = block_p * block_w // (32 * warps)
                lanes_w = min(32, block_w // 4)  # lanes along the words (4 words a lane: 16-byte loads)
                if not 4 <= per_thread <= 16 or block_p < (32 // lanes_w) * warps:
                    continue
                for split_k in (1, 2, 4, 8):
                    c = Config(block_p, block_w, split_k, warps)
                    if fits(c, n, k) and 64 <= -(-n // (2 * block_p)) * split_k <= 4096:
                        out += [c, replace(c, prefetch=True)]
    return out


_TUNED: dict[tuple[int, int, int, int], Config] = {}  # (n, k, group, row bucket: 1 or MAX_ROWS)


def remember(n: int, k: int, group: int, rows: int, config: Config) -> None:
    """The tile `matmul` runs this shape and row bucket with (what `w4a16.tune` timed fastest)."""
    _TUNED[(n, k, group, row_bucket(rows))] = config


def default_config(n: int, k: int, group: int, rows: int = 1) -> Config:
    tuned = _TUNED.get((n, k, group, row_bucket(rows)))
    if tuned is not None:
        return tuned
    fitting = configs(n, k, group, rows)
    if not fitting:
        raise QdflashError(f"w4_mma: no tile fits a {n}x{k} weight at {rows} rows")
    # the tile launching nearest 512 programs, then the widest (min(fitting, key=...) written as first_best: dynamo traces it)
    return first_best(fitting, lambda c: (-abs(-(-n // (2 * c.block_p)) * c.split_k - 512), c.block_w))


def matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, n: int, group: int,
           config: Config | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [1..16, K] bf16 @ dequant(W).T -> [rows, N] bf16. swiglu: W's rows are (gate, up) pairs (`gemv.swiglu_pairs`)
    and the result is silu(gate) * up, [rows, N / 2], made in the kernel (`swiglu_fits`: one K split)."""
    k = words.shape[1] * 4
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise QdflashError(f"w4_mma: 1-{MAX_ROWS} bf16 rows of {k} expected, got {tuple(x.shape)} {x.dtype}")
    rows = x.shape[0]
    config = config or default_config(n, k, group, rows)
    if not fits(config, n, k, rows):
        raise QdflashError(f"w4_mma: {config} does not tile a {n}x{k} weight at {rows} rows")
    if swiglu and not swiglu_fits(config):
        raise QdflashError(f"w4_mma: silu(gate) * up needs one K split, got {config}")
    return _mma_mm(x, words, scales, counts, n, group, config.block_p, config.block_w, config.split_k, config.num_warps,
                   config.prefetch, swiglu)


def swiglu_fits(config: Config) -> bool:
    """Whether `matmul(..., swiglu=True)` takes the tile: its programs hold their pairs' final sums (one K split)."""
    return config.split_k == 1


# A custom op, as marlin_w4's: a compiled decode step holds it as one opaque node instead of tracing the launch (the
# fake gives the output's shape). `mutates_args=()` although the kernel writes `counts`: it leaves them zero again, so
# no state changes between calls, and declaring them mutated would make a compiled graph clone them before each call.
@torch.library.custom_op("qdflash::w4_mma_mm", mutates_args=())
def _mma_mm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, n: int, group: int,
            block_p: int, block_w: int, split_k: int, num_warps: int, prefetch: bool, swiglu: bool = False) -> torch.Tensor:
    return _launch(x, words, scales, counts, n, group, block_p, block_w, split_k, num_warps, prefetch, swiglu)


@_mma_mm.register_fake
def _(x, words, scales, counts, n, group, block_p, block_w, split_k, num_warps, prefetch, swiglu=False):
    return x.new_empty((x.shape[0], n // 2 if swiglu else n))


def _launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, n: int, group: int,
            block_p: int, block_w: int, split_k: int, num_warps: int, prefetch: bool, swiglu: bool = False) -> torch.Tensor:
    m, k = x.shape[0], words.shape[1] * 4
    x = x.contiguous()
    if x.data_ptr() % (8 if m == 1 else 16):  # 4 activations a load (8 bytes); 2-16 rows, 16 bytes (LOAD_B64_X4)
        x = x.clone()
    y = torch.empty(m, n // 2 if swiglu else n, device=x.device, dtype=x.dtype)
    out = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32) if split_k > 1 else y  # the splits' partial sums
    grid = (triton.cdiv(n // 2, block_p), split_k)
    common = dict(GROUP_WORDS=group // 4, BLOCK_P=block_p, SPLITS=split_k, PREFETCH=prefetch, num_warps=num_warps)
    if swiglu:
        common.update(SWIGLU=True)
    if pdl_enabled():  # (a captured graph keeps the launch as it was)
        common.update(PDL=True, launch_pdl=True)
    xs = x.view(torch.int64)
    if m == 1:
        _w4_mma_kernel[grid](xs, words, scales, out, n // 2, words.stride(0), scales.stride(0),
                             out.stride(0) if split_k > 1 else 0, k // 4 // split_k, y, counts, BLOCK_W=block_w, **common)
    else:
        _w4_mma_rows_kernel[grid](xs, words, scales, out, m, n // 2, xs.stride(0), words.stride(0), scales.stride(0),
                                  out.stride(0) if split_k > 1 else 0, k // 4 // split_k, y, counts, HIGH=m > 8, **common)
    return y
