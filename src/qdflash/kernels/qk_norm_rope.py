"""A gated-attention layer's inputs for a decode step or verify block in one launch: each head's q and k RMS-normed
(their own norms), rotated, and k and v written into the layer's KV cache at the tokens' positions.

Why: compiled, inductor made this eight kernels an attention layer of a Qwen3.5 decode step (the two norms'
variances, the rotated and the passed parts of q and of k, the cache writes of k and of v), each a few microseconds of
latency at one row plus the time between kernels. One program per (token, head) reads the head's D values once.

Numbers: transformers' (`Qwen3_5RMSNorm`: the norm and its (1 + w) in fp32, rounded once to the model's dtype; the
rotation as its eager ops in that dtype round: x cos and rotate_half(x) sin each rounded, then their sum). A row's
result depends on that row alone, so a decode step and a verify block give a token the same q, k and v.

Layout (Qwen3.5's gated attention, `LeanQwen35._attention`): a token's qkv row holds each query head's q and its output
gate (2D values a head), then the KV heads' k, then their v; the caches are [kv_heads, max_len, D].
The DFlash drafter's layers (`drafter.static.DrafterEngine`) take the same launch with `gated=False` (D values a query
head) and their plain RMSNorms (`drafter.model.RMSNorm`: the normalized row rounded to the dtype, then times w, rounded
again, as `ops.rms_norm`); with no query heads (`heads=0`) it writes a context row's k and v alone.
"""

from __future__ import annotations

import torch

from ..errors import QdflashError

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None

if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, stride_t,
                             stride_cache, q_eps, k_eps, HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                             ROT: tl.constexpr, GATED: tl.constexpr = True, ZERO_CENTERED: tl.constexpr = True):
        """Program (token t, head h): h < HEADS a query head (its q into q_ptr [T, HEADS, D]); else KV head
        h - HEADS (its k and v into the caches, [KVH, stride_cache / D, D], at the token's position). cos / sin:
        the engine's tables [max_len, ROT] in the model's dtype (the first ROT dims of a head rotate)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        rd = tl.arange(0, D)
        dt = q_ptr.dtype.element_ty
        half = ROT // 2
        # rotate_half within the first ROT dims: -x[d + half] below half, x[d - half] above it
        partner = tl.where(rd < half, rd + half, tl.where(rd < ROT, rd - half, rd))
        row = qkv_ptr + t * stride_t
        is_q = h < HEADS
        j = (h - HEADS).to(tl.int64)  # (a KV head's cache offset passes int32 at long caches)
        QW = 2 * D if GATED else D  # a query head's values in the row (q, and its output gate if GATED)
        start = tl.where(is_q, h * QW, HEADS * QW + j * D)
        w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
        x = tl.load(row + start + rd).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + tl.where(is_q, q_eps, k_eps))
        # every product in fp32 of values rounded to the model's dtype (as torch multiplies two bf16 tensors; Triton's
        # interpreter would multiply bf16 values' raw bits), rounded after
        xp = tl.load(row + start + partner).to(tl.float32)
        if ZERO_CENTERED:  # Qwen3.5's: x r (1 + w) in fp32, rounded once
            normed = (x * r * (1.0 + tl.load(w_ptr + rd).to(tl.float32))).to(dt).to(tl.float32)
            other = (xp * r * (1.0 + tl.load(w_ptr + partner).to(tl.float32))).to(dt).to(tl.float32)
        else:  # llama's: x r rounded, times w, rounded
            normed = ((x * r).to(dt).to(tl.float32) * tl.load(w_ptr + rd).to(tl.float32)).to(dt).to(tl.float32)
            other = ((xp * r).to(dt).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)).to(dt).to(tl.float32)
        other = tl.where(rd < half, -other, other)
        pos = tl.load(pos_ptr + t)
        rot = rd < ROT
        cos = tl.load(cos_ptr + pos * ROT + rd, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * ROT + rd, mask=rot, other=0.0).to(tl.float32)
        rotated = (normed * cos).to(dt).to(tl.float32) + (other * sin).to(dt).to(tl.float32)
        y = tl.where(rot, rotated, normed).to(dt)
        if is_q:
            tl.store(q_ptr + (t * HEADS + h) * D + rd, y)
        else:
            at = j * stride_cache + pos * D + rd
            tl.store(k_ptr + at, y)
            tl.store(v_ptr + at, tl.load(row + HEADS * QW + KVH * D + j * D + rd))


# the q / k norm classes it computes -> whether zero-centered (weight applied as 1 + w): Qwen3.5's (by its name, as
# transformers or a copy of its code defines it) and the drafter's own
NORMS = {"Qwen3_5RMSNorm": True, "qdflash.drafter.model.RMSNorm": False}


def zero_centered(norm) -> bool | None:
    """Whether a q / k norm of NORMS applies its weight as 1 + w (Qwen3.5's) or as w; None: not one of NORMS."""
    cls = type(norm)
    return NORMS.get(cls.__name__, NORMS.get(f"{cls.__module__}.{cls.__qualname__}"))


def supported(head_dim: int, rot: int, q_norm, k_norm, dtype: torch.dtype) -> bool:
    """Whether the kernel computes this layer in `dtype` (its activations'): D a power of two, an even rotated part
    within it, and RMSNorms of one kind of NORMS (a weight [D], an `eps`) for q and k: Qwen3.5's zero-centered ones,
    or the drafter's plain ones (`drafter.model.RMSNorm`). Their weights of one dtype (the kernel picks q's or k's
    weight pointer per program); a plain norm's in `dtype` (its w multiplies a row already rounded to `dtype`, which
    torch would promote to a wider weight's dtype; a zero-centered norm computes 1 + w in fp32 either way)."""
    def norm_ok(norm):
        weight = getattr(norm, "weight", None)
        return (zero_centered(norm) is not None and weight is not None and tuple(weight.shape) == (head_dim,)
                and hasattr(norm, "eps"))

    return (triton is not None and head_dim > 0 and head_dim & (head_dim - 1) == 0 and 0 < rot <= head_dim
            and rot % 2 == 0 and norm_ok(q_norm) and norm_ok(k_norm) and type(q_norm) is type(k_norm)
            and q_norm.weight.dtype == k_norm.weight.dtype and (zero_centered(k_norm) or k_norm.weight.dtype == dtype))


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, gated: bool = True) -> torch.Tensor:
    """qkv [T, heads * 2D + 2 * kv_heads * D] (rows may be strided; `gated=False`: heads * D, the query heads without
    an output gate; heads=0: a row of k and v alone), positions [T] int64, cos / sin [max_len, rot], caches
    [kv_heads, max_len, D] (written at the positions) -> q [T, heads, D], normed and rotated."""
    if triton is None:
        raise QdflashError("qk_norm_rope needs triton")
    if k_cache.dim() != 3 or positions.dtype != torch.long or len({qkv.dtype, k_cache.dtype, v_cache.dtype, cos.dtype,
                                                                    sin.dtype}) != 1:
        raise QdflashError(f"qk_norm_rope: caches [kv_heads, max_len, D], int64 positions, and qkv, caches and cos / sin "
                           f"of one dtype expected, got caches {tuple(k_cache.shape)} {k_cache.dtype} / {v_cache.dtype}, "
                           f"positions {positions.dtype}, qkv {qkv.dtype}, cos / sin {cos.dtype} / {sin.dtype}")
    kv_heads, max_len, d = k_cache.shape
    t, rot = qkv.shape[0], cos.shape[-1]
    width = heads * (2 if gated else 1) * d + 2 * kv_heads * d
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise QdflashError(f"qk_norm_rope: qkv [T, {width}] with unit column stride expected, got {tuple(qkv.shape)} "
                           f"(strides {qkv.stride()})")
    if (v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or positions.shape != (t,) or cos.shape != sin.shape or cos.shape[0] < max_len
            or not supported(d, rot, q_norm, k_norm, qkv.dtype)):
        raise QdflashError(f"qk_norm_rope: contiguous caches [kv_heads, max_len, D], positions [{t}], cos / sin "
                           f"[>= max_len, rot] and the layer's q / k norms (`supported`) expected, got caches {tuple(k_cache.shape)} / "
                           f"{tuple(v_cache.shape)}, positions {tuple(positions.shape)}, cos {tuple(cos.shape)}")
    q = torch.empty(t, heads, d, device=qkv.device, dtype=qkv.dtype)
    _qk_norm_rope_kernel[(t, heads + kv_heads)](qkv, positions, cos.contiguous(), sin.contiguous(), q_norm.weight,
                                                k_norm.weight, q, k_cache, v_cache, qkv.stride(0), k_cache.stride(0),
                                                float(q_norm.eps), float(k_norm.eps), HEADS=heads, KVH=kv_heads, D=d, ROT=rot,
                                                GATED=gated, ZERO_CENTERED=zero_centered(k_norm), num_warps=1)
    return q
