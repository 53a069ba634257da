"""Decode attention for a batch of rows of different lengths, reading each row's own length only.

One new token per row: q [B, heads, D] against the rows' static KV cache [rows, kv_heads, max_len, D],
row b attending its positions 0..lengths[b]-1. A fixed-shape masked attention (SDPA over a common
cache length) reads the longest row's length for every row: with continuous batching some row is
nearly always long, so most of what it reads is masked (the profile published with issue 20's
benchmark shows what that costs). Here one program per (row, KV head) loops over that row's
positions only, in blocks, with an online softmax (flash-decoding without the split), and the `rep`
query heads of the KV head share each K / V block read (grouped-query attention, no copy).

In fp32 the dots run in IEEE fp32 (not TF32), so greedy decoding stays the target's own.

`splits` > 1 (flash-decoding): each row's positions are cut into that many contiguous chunks, one
program each, and a second kernel merges their partial softmaxes. Batch 1 needs it: one row of a
model with 2 KV heads is 2 programs, which leave a GPU of 132 SMs idle while each walks the whole
context. The same call serves a verify block of T tokens of one sequence: T "rows" over one cache
row (stride 0) whose lengths are the tokens' own positions + 1 (`cached_attention(kernel=True)`).
Such rows share programs, as many as fit their query heads in one 16-row tile, so each K / V block is
read once for them, not once per token. A row's result depends only on its own q, K / V, start and
length (the chunking is a function of those; a block outside a row's chunk is masked for it whole), so
a token attends exactly as it would in a decode step of one token at that position.
A tree of drafts (`spec.speculative_generate(tree_nodes=)`) is such a block whose rows all end at the
tree's last node; each row then sees the cache before the tree and only the nodes whose bit is set in its
int64 mask (its ancestors and itself), so a node attends as the last token of its own path would.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, start_ptr, tree_ptr, out_ptr, m_ptr, l_ptr, scale,
                                 stride_row, stride_head, stride_pos, B, KVH: tl.constexpr, REP: tl.constexpr,
                                 REP_PAD: tl.constexpr, TOKS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                 IEEE: tl.constexpr, SPLITS: tl.constexpr, HAS_START: tl.constexpr, TREE: tl.constexpr):
        """Program (rows TOKS*i.., KV head h, chunk c) over each row's positions start..length-1 (start 0
        without HAS_START). SPLITS == 1: the normalized output of the row. Else the chunk's unnormalized
        sums: acc [REP, D] into out_ptr, its max m and sum l per head into m_ptr / l_ptr (all fp32, laid out
        [B, KVH, SPLITS, ...]), merged by _merge_splits_kernel. TREE > 0: the last TREE positions are a
        tree's nodes, of which row b sees those whose bit is set in tree_ptr[b].

        TOKS > 1 (rows sharing one cache row: a verify block): the REP query heads of TOKS rows fill the
        program's 16-row tile and share each K / V block read. Each row keeps its own chunk and its own
        block boundaries (chunk starts are whole blocks), and a block outside its chunk is masked for it
        whole, which leaves its sums exactly as they were: so a row's result is bit for bit the one it gets
        alone (one row a program), i.e. a decode step's."""
        c = tl.program_id(2)
        h = tl.program_id(1)
        rr = tl.arange(0, REP_PAD)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        row = tl.program_id(0) * TOKS + rr // REP  # the row (token) of each tile row
        live = (rr < TOKS * REP) & (row < B)
        length = tl.load(len_ptr + row, mask=live, other=1)
        begin = tl.load(start_ptr + row, mask=live, other=0) if HAS_START else length * 0
        chunk = tl.cdiv(tl.cdiv(length - begin, SPLITS), BLOCK_N) * BLOCK_N  # whole blocks, the same for every chunk
        first = begin + c * chunk
        last = tl.minimum(first + chunk, length)
        lo = tl.min(tl.where(live, first, 2147483647), 0)  # the blocks some row of the tile reads
        hi = tl.max(tl.where(live, last, 0), 0)
        q_off = (row[:, None] * (KVH * REP) + h * REP + rr[:, None] % REP) * D + rd[None, :]
        heads = live[:, None]  # tl.dot needs >= 16 rows: the padding rows are zeros, never stored
        q = tl.load(q_ptr + q_off, mask=heads, other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        base = (tl.program_id(0) * TOKS).to(tl.int64) * stride_row + h * stride_head  # TOKS > 1: stride_row is 0
        if TREE > 0:
            bits = tl.load(tree_ptr + row, mask=live, other=0)
        for start in range(lo, hi, BLOCK_N):
            n = start + rn
            valid = (n[None, :] >= first[:, None]) & (n[None, :] < last[:, None])
            if TREE > 0:  # a node of the tree: the cache before it, and its own ancestors (and itself) in it
                j = n[None, :] - (length[:, None] - TREE)
                shift = tl.where(j > 0, j, 0).to(tl.int64)
                valid = valid & ((j < 0) | (((bits[:, None] >> shift) & 1) != 0))
            kv_off = base + n[:, None] * stride_pos + rd[None, :]
            k = tl.load(k_ptr + kv_off, mask=(n < hi)[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = s.to(tl.float32)  # torch.compile passes `scale` (a Python float) as fp64
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # a row can have no position in a block yet (a tree's node, a row of the tile outside this chunk or
            # past the last row): -inf - -inf would be nan. Where it has one, m_use is m_new.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=(n < hi)[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if SPLITS == 1:
            # l > 0 on every row stored (its length >= 1); a padding row can have seen no position: not 0 / 0
            tl.store(out_ptr + q_off, (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=heads)
        else:
            part = (row * KVH + h) * SPLITS + c
            tl.store(out_ptr + (part[:, None] * REP + rr[:, None] % REP) * D + rd[None, :], acc, mask=heads)
            tl.store(m_ptr + part * REP + rr % REP, m, mask=live)
            tl.store(l_ptr + part * REP + rr % REP, l, mask=live)

    @triton.jit
    def _merge_splits_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, REP: tl.constexpr, D: tl.constexpr,
                             SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """Program (row b, KV head h, head r of the group): the chunks' partial softmaxes, each rescaled
        to the common max and summed by one fixed reduction (deterministic; an empty chunk has m = -inf,
        l = 0, acc = 0)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        kvh = tl.num_programs(1)
        rs = tl.arange(0, SPLITS_PAD)
        rd = tl.arange(0, D)
        part = (b * kvh + h) * SPLITS + rs
        ok = rs < SPLITS
        m = tl.load(m_ptr + part * REP + r, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + part * REP + r, mask=ok, other=0.0)
        top = tl.max(m, 0)  # chunk 0 always holds a position (length >= 1): finite
        w = tl.where(ok, tl.exp(m - top), 0.0)
        acc = tl.load(acc_ptr + (part[:, None] * REP + r) * D + rd[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + ((b * kvh + h) * REP + r) * D + rd, out.to(out_ptr.dtype.element_ty))


BLOCK_N = 64  # cache positions per step of a program's loop
MAX_SPLITS = 16  # chunks per row at batch 1 (flash-decoding): kv_heads x T rows are far fewer programs than SMs


def batch1_splits(cache_len: int) -> int:
    """Chunks per row for a batch-1 call over a cache of `cache_len` positions: MAX_SPLITS, but never
    more than the cache has blocks of positions (an empty chunk is a wasted program)."""
    return min(MAX_SPLITS, -(-cache_len // BLOCK_N))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     block_n: int = BLOCK_N, splits: int = 1, starts: torch.Tensor | None = None,
                     tree: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, heads, D]; caches [rows >= B, kv_heads, max_len, D] (row b is q's row b; a cache row
    of stride 0 serves every row); row b attends positions starts[b]..lengths[b]-1 (starts: None =
    0; starts[b] < lengths[b]: a sliding window). `splits`: chunks per row (module docstring).
    `tree` [B] int64: the last B positions before lengths[b] are a tree's nodes (every row of the same
    length), of which row b sees node j where bit j of tree[b] is set (its ancestors and itself).
    Returns [B, heads, D] in q's dtype."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    rep = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    rep_pad = max(16, triton.next_power_of_2(rep))
    # rows over one cache row (a verify block) share a program, REP heads each, where a row's chunking does
    # not depend on a start of its own (`_decode_attention_kernel`)
    toks = rep_pad // rep if k_cache.stride(0) == 0 and starts is None and b > 1 else 1
    common = dict(KVH=kv_heads, REP=rep, REP_PAD=rep_pad, TOKS=toks, D=d, BLOCK_N=block_n,
                  IEEE=q.dtype == torch.float32, SPLITS=splits, HAS_START=starts is not None,
                  TREE=b if tree is not None else 0)
    programs = triton.cdiv(b, toks)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    # no start / tree: None, not another view of `lengths`: the kernel reads neither, and torch.compile makes each
    # tensor argument of a user kernel a buffer of its own (three kernels a layer computing positions + 1)
    first, bits = starts, tree
    if splits == 1:
        _decode_attention_kernel[(programs, kv_heads, 1)](q, k_cache, v_cache, lengths, first, bits, out, out, out, d ** -0.5,
                                                          *strides, b, **common)
        return out
    acc = torch.empty(b, kv_heads, splits, rep, d, device=q.device, dtype=torch.float32)
    m = torch.empty(b, kv_heads, splits, rep, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _decode_attention_kernel[(programs, kv_heads, splits)](q, k_cache, v_cache, lengths, first, bits, acc, m, l, d ** -0.5,
                                                           *strides, b, **common)
    _merge_splits_kernel[(b, kv_heads, rep)](acc, m, l, out, REP=rep, D=d, SPLITS=splits,
                                             SPLITS_PAD=triton.next_power_of_2(splits))
    return out


def one_sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                           starts: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """T tokens of one sequence (a decode step, a verify block, a drafted block) over its cache:
    q [T, heads, D], caches [kv_heads, max_len, D]; token t attends positions starts[t]..lengths[t]-1
    (`tree`: decode_attention's, the T tokens being the tree's nodes). The T rows share the one cache row
    (stride 0), in `batch1_splits` chunks each. Returns [T, heads, D]."""
    t = q.shape[0]
    return decode_attention(q, k_cache[None].expand(t, *k_cache.shape), v_cache[None].expand(t, *v_cache.shape), lengths,
                            splits=batch1_splits(k_cache.shape[1]), starts=starts, tree=tree)
