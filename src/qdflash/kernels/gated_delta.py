"""The Gated DeltaNet recurrence over a few tokens, keeping the state after every position.

Per value head h, with the state S [dk, dv] (fp32) and for each token t in order:

    S = S * exp(g[t])                         # gated decay
    delta = (v[t] - k[t] @ S) * beta[t]       # what the state mispredicts for this key
    S = S + outer(k[t], delta)                # delta-rule write
    o[t] = q[t] @ S

(`qdflash.engine.qwen3_5` runs the same lines in torch on the CPU.) One program owns a [dk, BLOCK_V]
slice of one head's state in registers for all T tokens, so a 16-token verify block is one launch per
layer instead of ~10 small kernels per token. With `states` given, the state after each position is
written to states[t + 1] (states[0] = the state before the block): a rejected draft is rolled back by
copying one of them, with no token fed again (docs/recipe.md: "keep per-position states during verify").
A decode step (T = 1) and a verify block run the same per-token arithmetic, so their outputs agree
bit for bit.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:

    @triton.jit
    def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, state_ptr, out_ptr, states_ptr, H, T: tl.constexpr,
                            DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, STORE_STATES: tl.constexpr):
        h = tl.program_id(0)
        rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rk = tl.arange(0, DK)
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        s = tl.load(state_ptr + tile)
        if STORE_STATES:
            tl.store(states_ptr + tile, s)
        for t in range(T):
            row = t * H + h
            kk = tl.load(k_ptr + row * DK + rk)
            qq = tl.load(q_ptr + row * DK + rk)
            vv = tl.load(v_ptr + row * DV + rv)
            s = s * tl.exp(tl.load(g_ptr + row))
            delta = (vv - tl.sum(s * kk[:, None], axis=0)) * tl.load(b_ptr + row)
            s = s + kk[:, None] * delta[None, :]
            tl.store(out_ptr + row * DV + rv, tl.sum(s * qq[:, None], axis=0))
            if STORE_STATES:
                tl.store(states_ptr + (t + 1) * H * DK * DV + tile, s)
        tl.store(state_ptr + tile, s)


CHUNK = 16  # tokens per launch: T is a compile-time constant, so longer inputs (a prefill) go in chunks


def gated_delta_recurrence(q, k, v, g, beta, state, states=None, block_v: int = 32):
    """q, k [T, H, dk], v [T, H, dv], g, beta [T, H] (fp32, q already scaled), state [H, dk, dv]
    fp32 updated in place. Returns o [T, H, dv] fp32; fills states [>= T+1, H, dk, dv] if given."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if k.shape[0] > CHUNK:  # chunk s starts from the state the previous chunk left (states[s] is written twice, equal)
        return torch.cat([gated_delta_recurrence(q[s:s + CHUNK], k[s:s + CHUNK], v[s:s + CHUNK], g[s:s + CHUNK],
                                                 beta[s:s + CHUNK], state, None if states is None else states[s:], block_v)
                          for s in range(0, k.shape[0], CHUNK)])
    if triton is None:
        raise QdflashError("gated_delta_recurrence needs triton")
    t, h, dk = k.shape
    dv = v.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise QdflashError(f"gated_delta_recurrence: {name} must be contiguous fp32 (got {x.dtype})")
    block_v = min(block_v, dv)
    if dv % block_v or dk & (dk - 1) or block_v & (block_v - 1):
        raise QdflashError(f"gated_delta_recurrence: dk={dk} and the value block {block_v} must be powers of two dividing dv={dv}")
    if states is not None and (states.shape[0] < t + 1 or not states.is_contiguous()):
        raise QdflashError(f"gated_delta_recurrence: states must be contiguous with >= {t + 1} entries")
    out = torch.empty(t, h, dv, device=q.device, dtype=torch.float32)
    _gated_delta_kernel[(h, dv // block_v)](q, k, v, g, beta, state, out, state if states is None else states, h, T=t,
                                            DK=dk, DV=dv, BLOCK_V=block_v, STORE_STATES=states is not None)
    return out
