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
A row's result depends only on its own q, K / V, start and length (the chunking is a function of
those), so a token attends exactly as it would in a decode step of one token at that position.
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
                                 stride_row, stride_head, stride_pos, KVH: tl.constexpr, REP: tl.constexpr,
                                 REP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                                 SPLITS: tl.constexpr, HAS_START: tl.constexpr, TREE: tl.constexpr):
        """Program (row b, KV head h, chunk c) over the row's positions start..length-1 (start 0
        without HAS_START). SPLITS == 1: the normalized output of the row. Else the chunk's
        unnormalized sums: acc [REP, D] into out_ptr, its max m and sum l per head into m_ptr / l_ptr
        (all fp32, laid out [B, KVH, SPLITS, ...]), merged by _merge_splits_kernel. TREE > 0: the last
        TREE positions are a tree's nodes, of which row b sees those whose bit is set in tree_ptr[b]."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        length = tl.load(len_ptr + b)
        begin = tl.load(start_ptr + b) if HAS_START else 0
        chunk = tl.cdiv(tl.cdiv(length - begin, SPLITS), BLOCK_N) * BLOCK_N  # whole blocks, the same for every chunk
        first = begin + c * chunk
        last = tl.minimum(first + chunk, length)
        rr = tl.arange(0, REP_PAD)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        q_off = ((b * KVH + h) * REP + rr[:, None]) * D + rd[None, :]
        heads = rr[:, None] < REP  # tl.dot needs >= 16 rows: the padding rows are zeros, never stored
        q = tl.load(q_ptr + q_off, mask=heads, other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        base = b.to(tl.int64) * stride_row + h * stride_head
        if TREE > 0:
            bits = tl.load(tree_ptr + b)
        for start in range(first, last, BLOCK_N):
            n = start + rn
            valid = n < last
            if TREE > 0:  # a node of the tree: the cache before it, and its own ancestors (and itself) in it
                j = n - (length - TREE)
                shift = tl.where(j > 0, j, 0).to(tl.int64)
                valid = valid & ((j < 0) | (((bits >> shift) & 1) != 0))
            kv_off = base + n[:, None] * stride_pos + rd[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = s.to(tl.float32)  # torch.compile passes `scale` (a Python float) as fp64
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = m_new
            if TREE > 0:  # a tile of the tree's nodes can be wholly masked (so far): -inf - -inf would be nan
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if SPLITS == 1:
            tl.store(out_ptr + q_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=heads)
        else:
            part = (b * KVH + h) * SPLITS + c
            tl.store(out_ptr + (part * REP + rr[:, None]) * D + rd[None, :], acc, mask=heads)
            tl.store(m_ptr + part * REP + rr, m, mask=rr < REP)
            tl.store(l_ptr + part * REP + rr, l, mask=rr < REP)

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
    common = dict(KVH=kv_heads, REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BLOCK_N=block_n,
                  IEEE=q.dtype == torch.float32, SPLITS=splits, HAS_START=starts is not None,
                  TREE=b if tree is not None else 0)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    first = starts if starts is not None else lengths  # (not read without HAS_START)
    bits = tree if tree is not None else lengths  # (not read without TREE)
    if splits == 1:
        _decode_attention_kernel[(b, kv_heads, 1)](q, k_cache, v_cache, lengths, first, bits, out, out, out, d ** -0.5,
                                                   *strides, **common)
        return out
    acc = torch.empty(b, kv_heads, splits, rep, d, device=q.device, dtype=torch.float32)
    m = torch.empty(b, kv_heads, splits, rep, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _decode_attention_kernel[(b, kv_heads, splits)](q, k_cache, v_cache, lengths, first, bits, acc, m, l, d ** -0.5,
                                                    *strides, **common)
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
