"""Decode attention for a batch of rows of different lengths, reading each row's own length only.

One new token per row: q [B, heads, D] against the rows' static KV cache [rows, kv_heads, max_len, D],
row b attending its positions 0..lengths[b]-1. A fixed-shape masked attention (SDPA over a common
cache length) reads the longest row's length for every row: with continuous batching some row is
nearly always long, so most of what it reads is masked (the profile published with issue 20's
benchmark shows what that costs). Here one program per (row, KV head) loops over that row's
positions only, in blocks, with an online softmax (flash-decoding without the split), and the `rep`
query heads of the KV head share each K / V block read (grouped-query attention, no copy).

In fp32 the dots run in IEEE fp32 (not TF32), so greedy decoding stays the target's own.
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
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, scale, stride_row, stride_head, stride_pos,
                                 KVH: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
                                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(len_ptr + b)
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
        for start in range(0, length, BLOCK_N):
            n = start + rn
            valid = n < length
            kv_off = base + n[:, None] * stride_pos + rd[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = s.to(tl.float32)  # torch.compile passes `scale` (a Python float) as fp64
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        tl.store(out_ptr + q_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=heads)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     block_n: int = 64) -> torch.Tensor:
    """q [B, heads, D]; caches [rows >= B, kv_heads, max_len, D] (row b is q's row b); lengths [B]
    (>= 1). Returns [B, heads, D] in q's dtype."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    rep = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    _decode_attention_kernel[(b, kv_heads)](
        q, k_cache, v_cache, lengths, out, d ** -0.5, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KVH=kv_heads, REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )
    return out
