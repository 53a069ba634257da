"""The transformer math every model here shares, written once: RMSNorm, rotary embeddings, the
layer-feature taps the drafter reads, and the greedy pick over a vocabulary. The lean engine (`qdflash.engine`), the drafter
(`qdflash.drafter.model`) and the training / speculative paths that read transformers' hidden states
all use these, so a convention (rounding, rotate-half, which hidden state is "layer i") has one home.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """transformers' llama RMSNorm (in fp32, then rounded); `dtype`: what the normalized input is
    rounded to (x's by default)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype or x.dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [..., T, dim] of rotate-half RoPE at `positions` [..., T] (angles in fp32)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.float()[..., None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tables(head_dim: int, max_len: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [max_len, head_dim] for positions 0..max_len-1 (an engine's static tables)."""
    return rope_cos_sin(torch.arange(max_len, device=device), head_dim, theta, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos / sin broadcastable to it (rotate-half convention, as transformers' llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def tap_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """The hidden states after decoder layers `layer_ids` (0-based), concatenated on the last dim.
    `hidden_states`: transformers' output tuple (index 0 is the embedding output, so layer i's output
    is index i + 1) or a dict {layer id: its output} (the engine's)."""
    if isinstance(hidden_states, dict):
        return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def rows_argmax(logits: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """argmax over the last dim of logits [R, V]: torch.argmax's index (the first maximum), in two stages where
    torch.compile traces it. Why: inductor's one-stage argmax of a drafted block's few rows over a 248K vocabulary was
    one of the compiled drafter step's slowest kernels for the bytes it reads (the profile in
    results/published/2026-12-05-h200-gdn-warps), as a reduction over so few rows gets few programs; the max of each
    `chunk`-wide slice, then the best slice, gives it R x V / chunk of them. Eager torch's own kernel already splits
    long rows: it keeps that."""
    if not torch.compiler.is_compiling() or logits.shape[-1] <= chunk:
        return logits.argmax(-1)
    return two_stage_argmax(logits, chunk)


def two_stage_argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """rows_argmax's compiled form: each stage keeps its first maximum, so the pick is torch.argmax's (NaN too: the
    first NaN, as torch treats NaN as the maximum). The padding is -inf, never picked over a real entry."""
    r, v = logits.shape
    padded = F.pad(logits, (0, -v % chunk), value=float("-inf"))
    values, within = padded.view(r, -1, chunk).max(-1)
    best = values.argmax(-1, keepdim=True)
    return (within.gather(-1, best) + best * chunk)[:, 0]
