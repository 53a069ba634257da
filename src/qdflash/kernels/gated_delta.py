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
bit for bit (except through the two-phase block kernel, `gated_delta_step(two_phase=True)`, or with the block's
recurrence in the chunked form, `chunked=True`, whose sums run in another order: there they agree to fp32 rounding,
and a greedy token may flip where two logits nearly tie).

`gated_delta_step` is the same recurrence with what feeds it in the same launch: the causal conv over the
projected inputs (reading earlier positions from the layer's conv-input buffer and writing this block's
rows there), silu, the l2norm of q and k, and the gates from the a / b projection, whose dot products it
computes itself (a 2 x heads-row matmul is a whole kernel launch otherwise). At batch 1 each of those was
its own kernel of a few microseconds, launch-bound (results/published/2026-12-04-h200-components-marlin:
~500 non-matmul kernels per Qwen3.5-4B decode step). It rounds to the model's dtype where the unfused
layer's 16-bit outputs round, so the two paths differ only by summation order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import QdflashError

try:
    import triton
    import triton.language as tl

    from .jit import silu_rounded
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

    @triton.jit
    def _gated_delta_step_kernel(qkvz_ptr, qkvz_stride, conv_in_ptr, conv_w_ptr, pos_ptr, x_ptr, ba_ptr, ba_stride, decay_ptr, dt_bias_ptr,
                                 state_ptr, out_ptr, states_ptr, HV, KEY_DIM, CONV_DIM, SCALE, HIDDEN: tl.constexpr,
                                 H_CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, T: tl.constexpr, REP: tl.constexpr,
                                 KW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                                 BA_DOT: tl.constexpr, STORE_STATES: tl.constexpr):
        h = tl.program_id(0)
        vb = tl.program_id(1)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        rk = tl.arange(0, DK)
        qc = (h // REP) * DK + rk  # this value head's query channels (key heads are shared by REP value heads)
        kc = KEY_DIM + qc
        vc = 2 * KEY_DIM + h * DV + rv
        dt = qkvz_ptr.dtype.element_ty
        start = tl.load(pos_ptr)  # the block's first position (positions are consecutive)
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        s = tl.load(state_ptr + tile)
        if STORE_STATES:
            tl.store(states_ptr + tile, s)
        # Token by token, only the state update depends on the token before. A token's inputs (conv, silu,
        # l2norm, gates) do not, so token t + 1's are loaded and computed while token t's recurrence runs: a
        # verify block does not wait on memory once per token. The last token is peeled off the loop so a
        # decode step (T = 1) computes no inputs it does not use. (Holding the conv and a / b weights in
        # registers for the whole launch, with each token's conv taps as one [taps, channels] tile, took ~18%
        # longer a decode step and ~25% a verify block on the H200: results/published/2026-12-05-h200-components-gaps.)
        qq, kk, vv, kq, g, beta = _step_inputs(start, 0, qkvz_ptr, qkvz_stride, conv_in_ptr, conv_w_ptr, x_ptr, ba_ptr, ba_stride,
                                               decay_ptr, dt_bias_ptr, qc, kc, vc, rk, rv, h, vb, HV, CONV_DIM, SCALE, dt, REP,
                                               KW, HIDDEN, H_CHUNKS, BLOCK_H, BA_DOT)
        for t in range(T - 1):
            nq, nk, nv, nkq, ng, nbeta = _step_inputs(start, t + 1, qkvz_ptr, qkvz_stride, conv_in_ptr, conv_w_ptr, x_ptr, ba_ptr,
                                                      ba_stride, decay_ptr, dt_bias_ptr, qc, kc, vc, rk, rv, h, vb, HV, CONV_DIM,
                                                      SCALE, dt, REP, KW, HIDDEN, H_CHUNKS, BLOCK_H, BA_DOT)
            s = _step_state(s, qq, kk, vv, kq, g, beta, out_ptr + (t * HV + h) * DV + rv)
            if STORE_STATES:
                tl.store(states_ptr + (t + 1) * HV * DK * DV + tile, s)
            qq, kk, vv, kq, g, beta = nq, nk, nv, nkq, ng, nbeta
        s = _step_state(s, qq, kk, vv, kq, g, beta, out_ptr + ((T - 1) * HV + h) * DV + rv)
        if STORE_STATES:
            tl.store(states_ptr + T * HV * DK * DV + tile, s)
        tl.store(state_ptr + tile, s)

    @triton.jit
    def _gated_delta_block_kernel(qkvz_ptr, qkvz_stride, conv_in_ptr, conv_w_ptr, pos_ptr, x_ptr, ba_ptr, ba_stride, decay_ptr,
                                  dt_bias_ptr, state_ptr, out_ptr, states_ptr, scratch_ptr, HV, KEY_DIM, CONV_DIM,
                                  SCALE, SCRATCH_ROWS: tl.constexpr, T: tl.constexpr, T_P: tl.constexpr,
                                  REP: tl.constexpr, KW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                                  STORE_STATES: tl.constexpr, FIRST_STATE_ONLY: tl.constexpr, CHUNKED: tl.constexpr,
                                  CHUNK_K: tl.constexpr,
                                  BA_DOT: tl.constexpr, HIDDEN: tl.constexpr, H_CHUNKS: tl.constexpr,
                                  BLOCK_H: tl.constexpr):
        """`_gated_delta_step_kernel` for a block, in two phases. First every token's inputs at once ([T, channels]
        tiles: the conv's taps as shifted loads, silu, the l2norms' reductions over the key dimension for all tokens
        in one, the gates from the b / a product given or, BA_DOT, computed here from x), written to this program's
        rows of `scratch`; then the recurrence token by token, reading them back: a token's chain is its state update
        alone (one reduction of the state over the key dimension), its inputs' loads free to be issued ahead of it.
        The same formulas as the one-token kernel, summed in another order (the conv over its taps, the l2norms, the
        b / a dot), so a block and one-token steps agree to fp32 rounding, not bit for bit.
        CHUNKED (T_P >= 16, a tensor-core tile): phase 2 as `_chunk_state` instead of token by token. A program's
        scratch rows start SCRATCH_ROWS (>= T_P) rows apart. FIRST_STATE_ONLY (with STORE_STATES, not CHUNKED): of the
        states only states[0], the state before the block; the scratch rows (the caller's, kept) let
        `_gated_delta_replay_kernel` recompute the state after any position from it."""
        h = tl.program_id(0)
        vb = tl.program_id(1)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        rb = tl.arange(0, BLOCK_V)
        rk = tl.arange(0, DK)
        rt = tl.arange(0, T_P)
        t_ok = rt < T
        qc = (h // REP) * DK + rk
        kc = KEY_DIM + qc
        vc = 2 * KEY_DIM + h * DV + rv
        dt = qkvz_ptr.dtype.element_ty
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        if not CHUNKED:  # (_chunk_state reads the state a key chunk at a time)
            s = tl.load(state_ptr + tile)  # in flight through phase 1
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        decay = tl.load(decay_ptr + h)
        start = tl.load(pos_ptr)
        aq = tl.zeros((T_P, DK), dtype=tl.float32)
        ak = tl.zeros((T_P, DK), dtype=tl.float32)
        av = tl.zeros((T_P, BLOCK_V), dtype=tl.float32)
        for j in tl.static_range(KW):  # tap j of every token: the input row KW - 1 - j before it
            row = start + rt - (KW - 1) + j
            cur = (t_ok & (row >= start))[:, None]  # this block's rows, from qkvz
            old = (t_ok & (row >= 0) & (row < start))[:, None]  # earlier ones, from the buffer (zero before the start)
            src = qkvz_ptr + (row - start)[:, None] * qkvz_stride
            buf = conv_in_ptr + row[:, None] * CONV_DIM
            xq = tl.load(tl.where(cur, src + qc[None, :], buf + qc[None, :]), mask=cur | old, other=0.0)
            xk = tl.load(tl.where(cur, src + kc[None, :], buf + kc[None, :]), mask=cur | old, other=0.0)
            xv = tl.load(tl.where(cur, src + vc[None, :], buf + vc[None, :]), mask=cur | old, other=0.0)
            aq += xq.to(tl.float32) * tl.load(conv_w_ptr + qc * KW + j).to(tl.float32)[None, :]
            ak += xk.to(tl.float32) * tl.load(conv_w_ptr + kc * KW + j).to(tl.float32)[None, :]
            av += xv.to(tl.float32) * tl.load(conv_w_ptr + vc * KW + j).to(tl.float32)[None, :]
        qq = silu_rounded(aq, dt)
        kk = silu_rounded(ak, dt)
        vv = silu_rounded(av, dt)
        rq = 1.0 / tl.sqrt(tl.sum(qq * qq, axis=1) + 1e-6)
        rk2 = 1.0 / tl.sqrt(tl.sum(kk * kk, axis=1) + 1e-6)
        kq = tl.sum(kk * qq, axis=1) * rk2 * rq / SCALE
        qq = qq * rq[:, None] / SCALE
        kk = kk * rk2[:, None]
        if BA_DOT:  # b, a = x @ in_proj_b / a (this head's rows) for every token, rounded as the step kernel rounds them
            b = tl.zeros([T_P], dtype=tl.float32)
            a = tl.zeros([T_P], dtype=tl.float32)
            for c in tl.static_range(H_CHUNKS):
                rh = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mh = rh < HIDDEN
                xt = tl.load(x_ptr + rt[:, None] * HIDDEN + rh[None, :], mask=t_ok[:, None] & mh[None, :],
                             other=0.0).to(tl.float32)
                wb = tl.load(ba_ptr + h * HIDDEN + rh, mask=mh, other=0.0).to(tl.float32)
                wa = tl.load(ba_ptr + (HV + h) * HIDDEN + rh, mask=mh, other=0.0).to(tl.float32)
                db, da = tl.reduce((xt * wb[None, :], xt * wa[None, :]), 1, _add2)
                b += db
                a += da
            b = b.to(dt).to(tl.float32)
            a = a.to(dt).to(tl.float32)
        else:  # the product given, rows ba_stride apart
            b = tl.load(ba_ptr + rt * ba_stride + h, mask=t_ok, other=0.0).to(tl.float32)
            a = tl.load(ba_ptr + rt * ba_stride + HV + h, mask=t_ok, other=0.0).to(tl.float32)
        g, beta = _gates(a, b, dt_bias, decay)
        # this block's conv inputs to the buffer (later steps read them as history): each program its value
        # channels, the first program of a key head its query and key channels
        here = qkvz_ptr + rt[:, None] * qkvz_stride
        dst = conv_in_ptr + (start + rt)[:, None] * CONV_DIM
        tl.store(dst + vc[None, :], tl.load(here + vc[None, :], mask=t_ok[:, None]), mask=t_ok[:, None])
        own = t_ok[:, None] & ((qc * 0 + h % REP + vb) == 0)[None, :]
        tl.store(dst + qc[None, :], tl.load(here + qc[None, :], mask=own), mask=own)
        tl.store(dst + kc[None, :], tl.load(here + kc[None, :], mask=own), mask=own)
        if CHUNKED:  # q and k through this program's scratch rows, read back a key chunk at a time
            base = scratch_ptr + (h * tl.num_programs(1) + vb) * (SCRATCH_ROWS * 2 * DK)
            tl.store(base + rt[:, None] * (2 * DK) + rk[None, :], qq)
            tl.store(base + rt[:, None] * (2 * DK) + DK + rk[None, :], kk)
            tl.debug_barrier()  # the rows are read back by other threads of this program
            _chunk_state(base, state_ptr, states_ptr, out_ptr + (rt[:, None] * HV + h) * DV + rv[None, :], vv, g, beta, t_ok,
                         rt, rv, h * DK * DV, HV * DK * DV, T, DK, DV, CHUNK_K, STORE_STATES)
        else:  # phase 2: the tokens' inputs through this program's scratch rows, token by token
            SCR: tl.constexpr = 2 * DK + BLOCK_V + 3
            base = scratch_ptr + (h * tl.num_programs(1) + vb) * (SCRATCH_ROWS * SCR)
            tl.store(base + rt[:, None] * SCR + rk[None, :], qq)
            tl.store(base + rt[:, None] * SCR + DK + rk[None, :], kk)
            tl.store(base + rt[:, None] * SCR + 2 * DK + rb[None, :], vv)
            tl.store(base + rt * SCR + 2 * DK + BLOCK_V, kq)
            tl.store(base + rt * SCR + 2 * DK + BLOCK_V + 1, g)
            tl.store(base + rt * SCR + 2 * DK + BLOCK_V + 2, beta)
            tl.debug_barrier()  # the rows are read back by other threads of this program
            if STORE_STATES:
                tl.store(states_ptr + tile, s)
            for t in range(T):
                s = _step_state(s, *_scratch_row(base + t * SCR, rk, rb, DK, BLOCK_V), out_ptr + (t * HV + h) * DV + rv)
                if STORE_STATES and not FIRST_STATE_ONLY:
                    tl.store(states_ptr + (t + 1) * HV * DK * DV + tile, s)
        if not CHUNKED:  # (_chunk_state wrote it)
            tl.store(state_ptr + tile, s)

    @triton.jit
    def _gated_delta_replay_kernel(tables_ptr, N, LAYERS, HV, SCRATCH_ROWS: tl.constexpr, DK: tl.constexpr,
                                   DV: tl.constexpr, BLOCK_V: tl.constexpr, LEAN: tl.constexpr):
        """The state after the first N tokens of the last two-phase block (FIRST_STATE_ONLY), for every layer in one
        launch (program_id(2): the layer; `tables` [3, LAYERS] int64: each layer's states[0], kept scratch and state
        addresses, so the layers' buffers stay allocations of their own): from the state before the block through the
        same `_step_update` lines over the block's scratch rows the block kernel read (the outputs dropped: they were
        the block's), so it is the state the block kernel held after token N - 1. LEAN: the update without the output's
        reduction (`_step_update(OUTPUT=False)`: S^T k alone on the token-by-token critical path) and the next token's
        row loaded before this token's update, so its load is in flight during the reduction."""
        h = tl.program_id(0)
        vb = tl.program_id(1)
        layer = tl.program_id(2)
        # the addresses' 16-byte alignment (replay_tables checks it), as Triton knows it of the block kernel's pointer
        # arguments: without it the loads get other layouts, so the reduction over dk another tree, and the replayed
        # state another rounding of the block's (the 2026-12-06 H100 run at the tiny shape: 4.7e-10 apart)
        states0_ptr = tl.multiple_of(tl.load(tables_ptr + layer).to(tl.pointer_type(tl.float32)), 16)
        scratch_ptr = tl.multiple_of(tl.load(tables_ptr + LAYERS + layer).to(tl.pointer_type(tl.float32)), 16)
        state_ptr = tl.multiple_of(tl.load(tables_ptr + 2 * LAYERS + layer).to(tl.pointer_type(tl.float32)), 16)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        rb = tl.arange(0, BLOCK_V)
        rk = tl.arange(0, DK)
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        s = tl.load(states0_ptr + tile)
        SCR: tl.constexpr = 2 * DK + BLOCK_V + 3
        base = scratch_ptr + (h * tl.num_programs(1) + vb) * (SCRATCH_ROWS * SCR)
        if LEAN:
            kk, vv, g, beta = _scratch_row_state(base, rk, rb, DK, BLOCK_V)
            for t in range(N):
                # the next row (the last one again at the end: a row the scratch has), loaded ahead of the update
                k1, v1, g1, beta1 = _scratch_row_state(base + tl.minimum(t + 1, SCRATCH_ROWS - 1) * SCR, rk, rb, DK, BLOCK_V)
                s, _ = _step_update(s, kk, kk, vv, g, g, beta, OUTPUT=False)
                kk, vv, g, beta = k1, v1, g1, beta1
        else:
            for t in range(N):
                s, _ = _step_update(s, *_scratch_row(base + t * SCR, rk, rb, DK, BLOCK_V))
        tl.store(state_ptr + tile, s)

    @triton.jit
    def _scratch_row(row, rk, rb, DK: tl.constexpr, BLOCK_V: tl.constexpr):
        """One token's row of a two-phase block's scratch, as its phase 1 stored it: q, k, this program's v, k . q, g
        and beta (what `_step_update` takes after the state)."""
        return (tl.load(row + rk), tl.load(row + DK + rk), tl.load(row + 2 * DK + rb), tl.load(row + 2 * DK + BLOCK_V),
                tl.load(row + 2 * DK + BLOCK_V + 1), tl.load(row + 2 * DK + BLOCK_V + 2))

    @triton.jit
    def _scratch_row_state(row, rk, rb, DK: tl.constexpr, BLOCK_V: tl.constexpr):
        """Of `_scratch_row`, what the state's update reads (k, v, g, beta): a lean replay's row (q's and k . q's loads,
        unused, are dropped by the compiler)."""
        _, kk, vv, _, g, beta = _scratch_row(row, rk, rb, DK, BLOCK_V)
        return kk, vv, g, beta

    # _chunk_state's matmuls in fp32 FMAs: its tiles are small, and for sm_90 at 8 warps and 32-key chunks this compiles
    # to 128 registers with no spill, where tf32 / tf32x3 tensor-core operands did not fit (tests' sm90_resources)
    PRECISION: tl.constexpr = tl.constexpr("ieee")

    @triton.jit
    def _chunk_state(base, state_ptr, states_ptr, out_ptrs, vv, g, beta, t_ok, rt, rv, tile0, STATE_SIZE, T: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, CHUNK_K: tl.constexpr, STORE_STATES: tl.constexpr):
        """A block's recurrence in the chunked (WY) form. With G the cumulative sum of the log decays g and u_t the
        delta-rule write of token t, S_t = e^G_t S_0 + sum_{i <= t} e^(G_t - G_i) k_i u_i^T, so u solves the unit
        lower-triangular system (I + N) u = beta (v - e^G K S_0), N[t, i] = beta_t e^(G_t - G_i) k_t . k_i (i < t), and
        o_t = e^G_t q_t S_0 + sum_{i <= t} e^(G_t - G_i) (q_t . k_i) u_i. Why: token by token, each token waits on a
        reduction of the state over dk (a CTA barrier) before the next; here the products are matmuls of the whole block
        and only the [T_P, T_P] inverse runs row by row. The sums run in another order than a step's, so a block agrees
        with one-token steps to fp32 rounding. q, k [T_P, dk] come from `base` (q, then k, in each row) and the state
        slice [dk, BLOCK_V] from state_ptr + tile0, CHUNK_K keys at a time (a whole [T_P, dk] operand in every warp
        spilled). Stores o (out_ptrs [T_P, BLOCK_V]), with STORE_STATES the state before the block and after each
        position (states[0], states[t + 1]), and the state after the block in place."""
        lower = rt[:, None] > rt[None, :]
        incl = rt[:, None] >= rt[None, :]
        rc = tl.arange(0, CHUNK_K)
        gm = tl.where(t_ok, g, 0.0)  # rows past the block: no decay, no write
        bm = tl.where(t_ok, beta, 0.0)
        gc = tl.cumsum(gm, axis=0)
        eg = tl.exp(gc)
        dec = _decay_where(incl, gc[:, None] - gc[None, :])  # e^(G_t - G_i) where i <= t
        kkt = tl.zeros(dec.shape, dtype=tl.float32)
        qkt = tl.zeros(dec.shape, dtype=tl.float32)
        ks = tl.zeros(vv.shape, dtype=tl.float32)
        qs = tl.zeros(vv.shape, dtype=tl.float32)
        for c in tl.static_range(DK // CHUNK_K):
            cols = c * CHUNK_K + rc
            kc = tl.load(base + rt[:, None] * (2 * DK) + DK + cols[None, :])
            qc = tl.load(base + rt[:, None] * (2 * DK) + cols[None, :])
            sc = tl.load(state_ptr + tile0 + cols[:, None] * DV + rv[None, :])
            kkt += tl.dot(kc, tl.trans(kc), input_precision=PRECISION)
            qkt += tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
            ks += tl.dot(kc, sc, input_precision=PRECISION)
            qs += tl.dot(qc, sc, input_precision=PRECISION)
        n = tl.where(lower, bm[:, None] * dec * kkt, 0.0)
        rhs = bm[:, None] * (vv - eg[:, None] * ks)
        # (I + N)^-1 row by row: row t = e_t - N[t, :] (I + N)^-1 (its rows before t are done). Unrolled: as a loop
        # at run time, with the launch's aligned pointers, sm_90 spilled 768 bytes a thread (tests' sm90_resources)
        inv = tl.zeros(n.shape, dtype=tl.float32)
        for t in tl.static_range(T):
            row = tl.sum(tl.where(rt[:, None] == t, n, 0.0), axis=0)
            inv = tl.where(rt[:, None] == t, tl.where(rt == t, 1.0, 0.0)[None, :] - tl.sum(row[:, None] * inv, axis=0)[None, :],
                           inv)
        u = tl.dot(inv, rhs, input_precision=PRECISION)
        tl.store(out_ptrs, eg[:, None] * qs + tl.dot(dec * qkt, u, input_precision=PRECISION), mask=t_ok[:, None])
        last = tl.sum(tl.where(rt == T - 1, gc, 0.0), axis=0)
        w_last = _decay_where(t_ok, last - gc)
        for c in tl.static_range(DK // CHUNK_K):
            cols = c * CHUNK_K + rc
            at = tile0 + cols[:, None] * DV + rv[None, :]
            kc = tl.load(base + rt[:, None] * (2 * DK) + DK + cols[None, :])
            sc = tl.load(state_ptr + at)
            # the state after the block: states[T] too (the loop below stops before it)
            new = sc * tl.exp(last) + tl.dot(tl.trans(kc * w_last[:, None]), u, input_precision=PRECISION)
            if STORE_STATES:
                tl.store(states_ptr + at, sc)
                for t in range(T - 1):
                    gt = tl.sum(tl.where(rt == t, gc, 0.0), axis=0)
                    tl.store(states_ptr + (t + 1) * STATE_SIZE + at,
                             sc * tl.exp(gt) + tl.dot(tl.trans(kc * _decay_where(rt <= t, gt - gc)[:, None]), u,
                                                      input_precision=PRECISION))
                tl.store(states_ptr + T * STATE_SIZE + at, new)
            tl.debug_barrier()  # every thread has read this chunk of the state before any overwrites it
            tl.store(state_ptr + at, new)

    @triton.jit
    def _decay_where(mask, log_decay):
        """e^log_decay where `mask`, else 0: the exponent is zeroed outside the mask first, so nothing overflows there
        (the chunked form's masked exponents G_t - G_i are <= 0 inside it, g being <= 0)."""
        return tl.where(mask, tl.exp(tl.where(mask, log_decay, 0.0)), 0.0)

    @triton.jit
    def _add3(a0, b0, c0, a1, b1, c1):
        return a0 + a1, b0 + b1, c0 + c1

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _add2(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @triton.jit
    def _step_inputs(start, t, qkvz_ptr, qkvz_stride, conv_in_ptr, conv_w_ptr, x_ptr, ba_ptr, ba_stride, decay_ptr, dt_bias_ptr,
                     qc, kc, vc, rk, rv, h, vb, HV, CONV_DIM, SCALE, dt: tl.constexpr, REP: tl.constexpr, KW: tl.constexpr,
                     HIDDEN: tl.constexpr, H_CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, BA_DOT: tl.constexpr):
        """Token t's q, k (l2-normed; q / sqrt(dk)), v, k . q, decay g and beta: what its recurrence step
        reads, none of it from the state. Also writes the token's conv inputs to the buffer (a later step
        reads them as history): each program its value channels, the first program of a key head its query
        and key channels. The same arithmetic for a token whatever the block's length."""
        p = start + t
        # the gates: b, a = x @ in_proj_b / a (this head's rows), rounded as the 16-bit projection's output
        # would be. The hidden chunks unrolled: all their loads are issued at once (a loop over them waited on
        # memory once per chunk, ~15 us a layer on the H200 at hidden 2,560). A token's sum runs over the same
        # chunks in the same order whatever the block's length.
        if BA_DOT:
            acc_b = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc_a = tl.zeros([BLOCK_H], dtype=tl.float32)
            for c in tl.static_range(H_CHUNKS):
                rh = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mh = rh < HIDDEN
                xt = tl.load(x_ptr + t * HIDDEN + rh, mask=mh, other=0.0).to(tl.float32)
                acc_b += xt * tl.load(ba_ptr + h * HIDDEN + rh, mask=mh, other=0.0).to(tl.float32)
                acc_a += xt * tl.load(ba_ptr + (HV + h) * HIDDEN + rh, mask=mh, other=0.0).to(tl.float32)
            b = tl.sum(acc_b, axis=0).to(dt).to(tl.float32)
            a = tl.sum(acc_a, axis=0).to(dt).to(tl.float32)
        else:  # ba_ptr: the projection's output [T, 2 * HV] (b heads, then a heads; rows ba_stride apart)
            b = tl.load(ba_ptr + t * ba_stride + h).to(tl.float32)
            a = tl.load(ba_ptr + t * ba_stride + HV + h).to(tl.float32)
        g, beta = _gates(a, b, tl.load(dt_bias_ptr + h).to(tl.float32), tl.load(decay_ptr + h))
        # the causal conv at p over inputs p-KW+1..p: this block's rows from qkvz, earlier ones from the
        # conv-input buffer (zero before the sequence start); each tap accumulated in place, so no sum over
        # the taps crosses threads
        aq = tl.zeros(rk.shape, dtype=tl.float32)
        ak = tl.zeros(rk.shape, dtype=tl.float32)
        av = tl.zeros(rv.shape, dtype=tl.float32)
        for j in tl.static_range(KW):
            row = p - (KW - 1) + j
            row_k = rk * 0 + row  # the row as vectors: the masks of the two sources
            row_v = rv * 0 + row
            src = qkvz_ptr + (row - start) * qkvz_stride
            buf = conv_in_ptr + row * CONV_DIM
            cur_k, old_k = row_k >= start, (row_k >= 0) & (row_k < start)
            cur_v, old_v = row_v >= start, (row_v >= 0) & (row_v < start)
            xq = tl.load(src + qc, mask=cur_k, other=0.0) + tl.load(buf + qc, mask=old_k, other=0.0)
            xk = tl.load(src + kc, mask=cur_k, other=0.0) + tl.load(buf + kc, mask=old_k, other=0.0)
            xv = tl.load(src + vc, mask=cur_v, other=0.0) + tl.load(buf + vc, mask=old_v, other=0.0)
            aq += xq.to(tl.float32) * tl.load(conv_w_ptr + qc * KW + j).to(tl.float32)
            ak += xk.to(tl.float32) * tl.load(conv_w_ptr + kc * KW + j).to(tl.float32)
            av += xv.to(tl.float32) * tl.load(conv_w_ptr + vc * KW + j).to(tl.float32)
        # silu, rounded where the unfused layer rounds (the conv's and the silu's 16-bit outputs)
        qq = silu_rounded(aq, dt)
        kk = silu_rounded(ak, dt)
        vv = silu_rounded(av, dt)
        # l2norm (then q / sqrt(dk)) and k . q from one reduction over the key dimension
        q2, k2, kq = tl.reduce((qq * qq, kk * kk, kk * qq), 0, _add3)
        rq = 1.0 / tl.sqrt(q2 + 1e-6)
        rk2 = 1.0 / tl.sqrt(k2 + 1e-6)
        qq = qq * rq / SCALE
        kk = kk * rk2
        kq = kq * rk2 * rq / SCALE
        own = (rk * 0 + h % REP + vb) == 0
        here = qkvz_ptr + t * qkvz_stride
        tl.store(conv_in_ptr + p * CONV_DIM + vc, tl.load(here + vc))
        tl.store(conv_in_ptr + p * CONV_DIM + qc, tl.load(here + qc, mask=own, other=0.0), mask=own)
        tl.store(conv_in_ptr + p * CONV_DIM + kc, tl.load(here + kc, mask=own, other=0.0), mask=own)
        return qq, kk, vv, kq, g, beta

    @triton.jit
    def _gates(a, b, dt_bias, decay):
        """The decay g = decay * softplus(a + dt_bias) and beta = sigmoid(b), for one token or a [T] block alike:
        softplus as torch's (threshold 20), log1p(e) to full precision where e is tiny (log(w) * e / (w - 1))."""
        u = a + dt_bias
        e = tl.exp(u)
        w = 1.0 + e
        softplus = tl.where(u > 20.0, u, tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0)))
        return decay * softplus, 1.0 / (1.0 + tl.exp(-b))

    @triton.jit
    def _step_state(s, qq, kk, vv, kq, g, beta, out_ptrs):
        """One token's recurrence on the state slice s [dk, BLOCK_V], its output stored at out_ptrs; returns
        the new state. S' = S e^g + k delta^T with delta = (v - e^g S^T k) beta, and o = S'^T q = e^g S^T q +
        (k . q) delta: both reductions of the old state over the key dimension in one pass (a reduction
        across warps is a round trip through shared memory, on the token-by-token critical path)."""
        s, o = _step_update(s, qq, kk, vv, kq, g, beta)
        # stored from the reduction's own layout, as a [dk, value block] tile of which row 0 alone is written: stored as
        # the [value block] row it is, Triton moved it through shared memory first, two CTA barriers a token on its
        # chain (of 9 a token in the block kernel's loop, sm_90 PTX)
        first = tl.arange(0, s.shape[0])[:, None] == 0
        tl.store(tl.broadcast_to(out_ptrs[None, :], s.shape), tl.broadcast_to(o[None, :], s.shape), mask=first)
        return s

    @triton.jit
    def _step_update(s, qq, kk, vv, kq, g, beta, OUTPUT: tl.constexpr = True):
        """`_step_state`'s arithmetic: (the new state, the token's output). OUTPUT=False (a replay, whose outputs
        were its block's): S^T k alone, the same reduction tree as the pair's first (in one layout: the H100 gave the
        same states both ways, results/published/2026-12-06-h100-lean-replay), and the output returned is not one
        (qq and kq unread)."""
        decay = tl.exp(g)
        if OUTPUT:
            sk, sq = tl.reduce((s * kk[:, None], s * qq[:, None]), 0, _add2)
        else:
            sk = tl.reduce(s * kk[:, None], 0, _add)
            sq = sk
        delta = (vv - decay * sk) * beta
        return s * decay + kk[:, None] * delta[None, :], decay * sq + kq * delta


CHUNK = 16  # tokens per launch: T is a compile-time constant, so longer inputs (a prefill) go in chunks
# gated_delta_step's launch: value columns a program owns and its warps, one for every block length (a decode
# step and a verify block then run the same arithmetic, bit for bit). At Qwen3.5-4B's heads (dk = dv = 128) a
# 16-token block keeps 32 columns x 4 warps in registers only without the next token's inputs in flight;
# 16 x 4 holds both (tests/test_kernels.py compiles it for sm_90 and checks it does not spill).
STEP_BLOCK_V, STEP_WARPS = 16, 4
CHUNK_K = 32  # the chunked block's key chunk (_chunk_state)
STEP_BLOCK_H = 512  # the a / b dot's hidden chunk: Qwen3.5-4B's 2,560 in 5 whole chunks (a power of two pads 2,560 to 4,096)
# the block kernel's warps at that value block. Two-phase: 4, which the H200 timed 1.4x faster than 8 at 16 tokens
# (results/published/2026-12-05-h200-gdn-warps); its [T, dk] input tiles fit 4 warps' registers without a spill (tests'
# sm90_resources). Chunked: 8, as at 4 its [T_P, dk] operands spill under the device's Triton
BLOCK_WARPS, CHUNKED_WARPS = 4, 8


def _value_block(name: str, dk: int, dv: int, block_v: int, states, t: int) -> int:
    """The value block a program owns (<= dv), checked with the head sizes and the per-position states buffer."""
    block_v = min(block_v, dv)
    if dv % block_v or dk & (dk - 1) or block_v & (block_v - 1):
        raise QdflashError(f"{name}: dk={dk} and the value block {block_v} must be powers of two dividing dv={dv}")
    if states is not None and (states.shape[0] < t + 1 or not states.is_contiguous()):
        raise QdflashError(f"{name}: states must be contiguous with >= {t + 1} entries")
    return block_v


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
    block_v = _value_block("gated_delta_recurrence", dk, dv, block_v, states, t)
    out = torch.empty(t, h, dv, device=q.device, dtype=torch.float32)
    _gated_delta_kernel[(h, dv // block_v)](q, k, v, g, beta, state, out, state if states is None else states, h, T=t,
                                            DK=dk, DV=dv, BLOCK_V=block_v, STORE_STATES=states is not None)
    return out


def gated_delta_step(qkvz, conv_in, conv_weight, positions, x, ba, decay, dt_bias, state, states=None, *,
                     key_heads: int, key_dim: int, ba_weight: bool = True, block_v: int = STEP_BLOCK_V,
                     num_warps: int | None = None, two_phase: bool = False, chunked: bool = False,
                     kept: torch.Tensor | None = None):
    """A Gated DeltaNet layer's middle for a decode step or verify block (T <= CHUNK tokens) in one launch:
    the causal conv over `qkvz`'s conv part [T, conv_dim (+ z)] with the `conv_in` history [max_len, conv_dim]
    (this block's rows written there too), silu, q / k l2-normed (q / sqrt(dk)), the gates
    g = decay * softplus(a + dt_bias) and beta = sigmoid(b) with b, a = x [T, hidden] @ `ba` [2H, hidden].T
    (`ba_weight`; else `ba` is that product [T, 2H], its rows possibly strided: the tail of a fused projection's
    output), then the recurrence as `gated_delta_recurrence`.
    `positions` [T]: consecutive, read on the device (a captured step's input). Returns o [T, H, dv] fp32.
    What it replaces per layer (engine.qwen3_5's unfused path: the buffer write, the window gather, the conv,
    silu / l2norm, the gates and the a / b matmul) is about eight launches, each a few microseconds at batch 1.
    `two_phase`: a block of T > 1 tokens through `_gated_delta_block_kernel`, every token's
    inputs first, then the recurrence alone token by token (one token keeps the step kernel). `chunked`: the same
    block kernel with the recurrence in the chunked form (`_chunk_state`: matmuls over the block instead
    of a state reduction per token), its block padded to 16 rows. `num_warps`:
    STEP_WARPS, or BLOCK_WARPS (two-phase) or CHUNKED_WARPS for the block kernel, unless given.
    `kept` (a two-phase block of T > 1 tokens with `states`; `replay_scratch`'s shape, fp32): the block's per-token
    inputs are written there and kept, and of the states only states[0], the state before the block: a rollback into
    the block recomputes the state it needs (`gated_delta_replay`) instead of the block writing all T + 1 (at
    Qwen3.5-4B, 16 x 2 MB a layer a verify block, most of them never read)."""
    if triton is None:
        raise QdflashError("gated_delta_step needs triton")
    t = qkvz.shape[0]
    heads, dk, dv = state.shape
    conv_dim = conv_weight.shape[0]
    if not 1 <= t <= CHUNK:
        raise QdflashError(f"gated_delta_step: {t} tokens; it takes 1..{CHUNK} (a longer prefill runs the unfused layer)")
    if conv_dim != 2 * key_dim + heads * dv or conv_in.shape[1] != conv_dim or heads % key_heads or key_dim != key_heads * dk:
        raise QdflashError(f"gated_delta_step: conv_dim {conv_dim} (buffer {conv_in.shape[1]}) is not 2 x key_dim {key_dim} "
                           f"+ {heads} heads x dv {dv}, or {key_heads} key heads do not split {heads} value heads")
    ba_ok = ba.is_contiguous() if ba_weight else ba.stride(-1) == 1
    if qkvz.stride(-1) != 1 or not (x.is_contiguous() and ba_ok and conv_in.is_contiguous() and conv_weight.is_contiguous()):
        raise QdflashError("gated_delta_step: qkvz and b / a product rows, x, the b / a weight, conv_in and the conv weight must be "
                           "contiguous")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise QdflashError(f"gated_delta_step: the state must be contiguous fp32 (got {state.dtype})")
    if two_phase and chunked:
        raise QdflashError("gated_delta_step: two_phase and chunked are two forms of the block kernel; ask for one")
    chunked = chunked and t > 1
    two_phase = two_phase and t > 1
    block_v = _value_block("gated_delta_step", dk, dv, block_v, states, t)
    shape = replay_scratch(heads, dk, dv, t, block_v)  # a two-phase block's scratch (the chunked one's rows: q, k)
    if kept is not None:
        if not (two_phase and not chunked and states is not None):
            raise QdflashError("gated_delta_step: kept scratch is for a two-phase block of > 1 tokens with states")
        if (kept.dtype != torch.float32 or not kept.is_contiguous() or kept.device != state.device or kept.dim() != 3
                or kept.shape[0] != shape[0] or kept.shape[1] < shape[1] or kept.shape[2] != shape[2]):
            raise QdflashError(f"gated_delta_step: kept must be contiguous fp32 [{shape[0]}, >= {shape[1]}, {shape[2]}], "
                               f"got {tuple(kept.shape)} {kept.dtype}")
    if chunked and (block_v < 16 or dk < 16):
        raise QdflashError(f"gated_delta_step: chunked multiplies [16, dk] x [dk, value block] tiles: dk={dk} and the value "
                           f"block {block_v} must be >= 16")
    num_warps = num_warps or (CHUNKED_WARPS if chunked else BLOCK_WARPS if two_phase else STEP_WARPS)
    hidden, kw = x.shape[-1], conv_weight.shape[-1]
    out = torch.empty(t, heads, dv, device=qkvz.device, dtype=torch.float32)
    if two_phase or chunked:
        t_p = triton.next_power_of_2(t)
        t_p = max(t_p, 16) if chunked else t_p  # a tensor-core tile's least rows
        scratch = kept if kept is not None else torch.empty(
            shape[0], t_p, 2 * dk if chunked else shape[2], device=qkvz.device, dtype=torch.float32)
        _gated_delta_block_kernel[(heads, dv // block_v)](
            qkvz, qkvz.stride(0), conv_in, conv_weight, positions, x, ba, ba.stride(0), decay, dt_bias, state, out,
            state if states is None else states, scratch, heads, key_dim, conv_dim, float(dk ** 0.5),
            SCRATCH_ROWS=scratch.shape[1], T=t, T_P=t_p, REP=heads // key_heads, KW=kw, DK=dk, DV=dv, BLOCK_V=block_v,
            STORE_STATES=states is not None, FIRST_STATE_ONLY=kept is not None, CHUNKED=chunked,
            CHUNK_K=min(CHUNK_K, dk), BA_DOT=ba_weight, HIDDEN=hidden, H_CHUNKS=-(-hidden // STEP_BLOCK_H),
            BLOCK_H=STEP_BLOCK_H, num_warps=num_warps)
    else:
        _gated_delta_step_kernel[(heads, dv // block_v)](
            qkvz, qkvz.stride(0), conv_in, conv_weight, positions, x, ba, ba.stride(0), decay, dt_bias, state, out,
            state if states is None else states, heads, key_dim, conv_dim, float(dk ** 0.5),
            HIDDEN=hidden, H_CHUNKS=-(-hidden // STEP_BLOCK_H), BLOCK_H=STEP_BLOCK_H, T=t, REP=heads // key_heads,
            KW=kw, DK=dk, DV=dv, BLOCK_V=block_v, BA_DOT=ba_weight, STORE_STATES=states is not None,
            num_warps=num_warps)
    return out


def replay_scratch(heads: int, dk: int, dv: int, max_block: int, block_v: int = STEP_BLOCK_V) -> tuple[int, int, int]:
    """The shape of a layer's kept two-phase scratch (`gated_delta_step(kept=)`) for blocks of up to `max_block`
    tokens: [programs, rows, one token's q, k, this program's v, k . q, g, beta]."""
    block_v = min(block_v, dv)
    return heads * (dv // block_v), 1 << (max_block - 1).bit_length(), 2 * dk + block_v + 3  # rows: T_P of the longest


class ReplayTables(NamedTuple):
    """What `gated_delta_replay` reads: each layer's states[0], kept scratch and state (`tensors`, held so that their
    addresses in `addresses` [3, layers] int64 stay theirs), their shapes, and the value block the scratch was written
    with."""
    addresses: torch.Tensor
    tensors: tuple
    heads: int
    dk: int
    dv: int
    rows: int
    block_v: int


def replay_tables(states0: list[torch.Tensor], kept: list[torch.Tensor], state: list[torch.Tensor],
                  block_v: int = STEP_BLOCK_V) -> ReplayTables:
    """The layers' buffers for `gated_delta_replay`, checked once: per layer the state before its last block (that
    `gated_delta_step(kept=)` call's states[0]), its kept scratch (`replay_scratch`'s shape) and its state, all fp32,
    contiguous, on one device. Why addresses and not one buffer of all layers sliced: the engine's states were
    allocations of their own, and the one device run with them as views of one buffer (results/published/
    2026-12-06-h100-gdn-kept) failed with an illegal memory access in its first compiled steps (the cause not isolated:
    those views, or the kept scratch in the compiled block), so the layers' buffers stay as they were."""
    layers = len(state)
    if not layers or len(states0) != layers or len(kept) != layers:
        raise QdflashError(f"replay_tables: {len(states0)} states0, {len(kept)} kept and {layers} states; one of each a layer")
    heads, dk, dv = state[0].shape
    block_v = _value_block("replay_tables", dk, dv, block_v, None, 0)
    shape = replay_scratch(heads, dk, dv, 1, block_v)
    for name, group in (("states0", states0), ("kept", kept), ("state", state)):
        for x in group:
            if x.dtype != torch.float32 or not x.is_contiguous() or x.device != state[0].device:
                raise QdflashError(f"replay_tables: each layer's {name} must be contiguous fp32 on {state[0].device}")
            if x.data_ptr() % 16:  # the replay kernel declares it (tl.multiple_of), as the block kernel's launch knows it
                raise QdflashError(f"replay_tables: each layer's {name} must start 16-byte aligned (got an address "
                                   f"{x.data_ptr() % 16} past it)")
    if any(x.shape != state[0].shape for x in (*states0, *state)) or any(
            x.dim() != 3 or x.shape[0] != shape[0] or x.shape[2] != shape[2] or x.shape[1] != kept[0].shape[1] for x in kept):
        raise QdflashError(f"replay_tables: states0 / state of {tuple(state[0].shape)} and kept of [{shape[0]}, rows, "
                           f"{shape[2]}] expected for every layer")
    addresses = torch.tensor([[x.data_ptr() for x in group] for group in (states0, kept, state)], dtype=torch.int64,
                             device=state[0].device)
    return ReplayTables(addresses, (*states0, *kept, *state), heads, dk, dv, kept[0].shape[1], block_v)


def gated_delta_replay(tables: ReplayTables, n: int, num_warps: int = BLOCK_WARPS, lean: bool = True) -> None:
    """Every layer's state after the first `n` tokens of its last block fed with `gated_delta_step(kept=)`, written to
    its state, in one launch (`replay_tables`: the layers' buffers). Runs the block kernel's own step lines over the
    kept inputs, with its warps (`num_warps`) and value block (the tables'): where they compile alike, bit for bit the
    state the block kernel held after token n - 1. `n` at most that block's length (the caller's to know: the scratch
    holds up to `tables.rows`). `lean`: the kernel's LEAN form (the state's reduction alone, the next row in flight;
    the same states, less work on the critical path); lean=False runs the block kernel's pair reduction as it is, a
    bench's comparison (bench_gdn_step)."""
    if triton is None:
        raise QdflashError("gated_delta_replay needs triton")
    if not 0 <= n <= tables.rows:
        raise QdflashError(f"gated_delta_replay: {n} tokens; the kept scratch holds up to {tables.rows}")
    layers = tables.addresses.shape[1]
    _gated_delta_replay_kernel[(tables.heads, tables.dv // tables.block_v, layers)](
        tables.addresses, n, layers, tables.heads, SCRATCH_ROWS=tables.rows, DK=tables.dk, DV=tables.dv,
        BLOCK_V=tables.block_v, LEAN=lean, num_warps=num_warps)
