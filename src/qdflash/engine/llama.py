"""A llama-style decoder (Llama, SmolLM2, Qwen2/3-style dense attention) with a static KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import QdflashError

def rope_tables(head_dim: int, max_len: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D]; cos / sin [T, D] (rotate-half convention, as transformers' llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def cached_attention(q, k, v, k_cache, v_cache, start: int, end: int) -> torch.Tensor:
    """Write k, v [kv_heads, T, D] at positions start..end-1 of a static cache [kv_heads, max_len, D]
    and attend q [heads, T, D] over positions 0..end-1: the block is causal inside itself and sees
    every cached position before it. Returns [T, heads * D]."""
    t = q.shape[1]
    k_cache[:, start:end], v_cache[:, start:end] = k, v
    rep = q.shape[0] // k.shape[0]
    mask = None
    if t > 1:
        mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q[None], k_cache[:, :end].repeat_interleave(rep, 0)[None],
                                         v_cache[:, :end].repeat_interleave(rep, 0)[None], attn_mask=mask)
    return out[0].transpose(0, 1).reshape(t, -1)


class LeanLlama:
    """Holds fused copies of the projection weights and references to the rest (embedding, norms,
    LM head are the target's own tensors). Batch 1."""

    def __init__(self, model, max_len: int):
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.max_len = max_len
        params = next(model.parameters())
        device, dtype = params.device, params.dtype
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        self.cos, self.sin = rope_tables(self.head_dim, max_len, theta, device, dtype)
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append({
                    "wqkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    "wo": attn.o_proj.weight,
                    "w13": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    "w2": mlp.down_proj.weight,
                    "norm1": layer.input_layernorm.weight,
                    "norm2": layer.post_attention_layernorm.weight,
                })
        shape = (len(self.layers), self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    def reset(self) -> None:
        """A new generation: nothing to clear (the cache is written before it is read)."""

    def rollback(self, keep: int) -> None:
        """Nothing to undo: positions at or past `keep` are masked until they are written again."""

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int, layer_ids: list[int] | None = None):
        """Logits [T, V] for tokens `ids` [T] at positions start..start+T-1 (the cache holds the
        positions before `start`; whatever it holds beyond is ignored and overwritten), and the hidden
        states after `layer_ids` concatenated [T, k*H] (None without layer_ids)."""
        t = ids.shape[0]
        end = start + t
        if end > self.max_len:
            raise QdflashError(f"engine cache holds {self.max_len} positions; asked for {end} (build_engine(max_len=...))")
        cos, sin = self.cos[start:end], self.sin[start:end]
        h = F.embedding(ids, self.embed)
        features = {}
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w["norm1"], self.eps)
            q, k, v = F.linear(x, w["wqkv"]).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(t, self.heads, self.head_dim).transpose(0, 1), cos, sin)
            k = apply_rope(k.view(t, self.kv_heads, self.head_dim).transpose(0, 1), cos, sin)
            v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
            h = h + F.linear(cached_attention(q, k, v, self.k_cache[i], self.v_cache[i], start, end), w["wo"])
            x = rms_norm(h, w["norm2"], self.eps)
            gate, up = F.linear(x, w["w13"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["w2"])
            if layer_ids is not None and i in layer_ids:
                features[i] = h
        logits = F.linear(rms_norm(h, self.final_norm, self.eps), self.lm_head)
        return logits, (torch.cat([features[i] for i in layer_ids], dim=-1) if layer_ids is not None else None)


def build_engine(target, max_len: int | None = None):
    """The lean model for `target` (sharing its weights; llama: fused copies of the projections).
    Raises QdflashError for families not built yet and for packed (QuantLinear) weights."""
    from .qwen3_5 import LeanQwen35

    model_type = getattr(target.config, "model_type", "?")
    builders = {"llama": LeanLlama, "qwen3_5_text": LeanQwen35}
    if model_type not in builders:
        raise QdflashError(f"no lean engine for model type {model_type!r} yet (built: {', '.join(builders)})")
    linears = [m for m in target.model.model.layers.modules() if "Linear" in type(m).__name__]
    if any(type(m) is not torch.nn.Linear for m in linears):
        raise QdflashError("the lean engine runs dense 16-bit projections; load the quantized target's dense twin")
    return builders[model_type](target.model, max_len or getattr(target.config, "max_position_embeddings", 4096))
