"""A llama-style decoder (Llama, SmolLM2, Qwen2: the same layout with q/k/v biases) with a static KV
cache, on `base.EngineBase`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import apply_rope, rms_norm, tap_features
from .base import EngineBase, cached_attention
from .linear import Projection, StreamNorm, residual_norm, swiglu


class LeanLlama(EngineBase):
    """Fused q/k/v and gate/up projections; embedding, norms and LM head are the target's own tensors."""

    def __init__(self, model, max_len: int, kernels: bool | str = "auto", fp32_residual: bool = True):
        super().__init__(model, max_len, kernels, fp32_residual)
        c = self.config
        self.eps = c.rms_norm_eps
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        self._rope_tables(self.head_dim, theta)
        self.final_norm = model.model.norm.weight
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "wqkv": Projection.of([attn.q_proj, attn.k_proj, attn.v_proj], self.dtype, self.kernels),
                "wo": Projection.of([attn.o_proj], self.dtype, self.kernels),
                "w13": Projection.of([mlp.gate_proj, mlp.up_proj], self.dtype, self.kernels, swiglu=True),
                "w2": Projection.of([mlp.down_proj], self.dtype, self.kernels),
                "norm1": self._norm(layer.input_layernorm.weight),
                "norm2": self._norm(layer.post_attention_layernorm.weight),
            })
        shape = (len(self.layers), self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _norm(self, weight: torch.Tensor) -> StreamNorm:
        """`ops.rms_norm` with `weight` into the model's dtype (the normed stream rounded before the weight's product)."""
        return StreamNorm(lambda h: rms_norm(h, weight, self.eps, self.dtype))

    # reset / rollback: nothing to do. The cache is written before it is read, and positions at or
    # past the current one are masked until they are written again (a rollback is a new length).

    def _step(self, ids, positions, attend_len, layer_ids, exact=False, slots=None, tree=None):
        def attend(i, q, k, v):
            return cached_attention(q, k, v, self.k_cache[i], self.v_cache[i], positions, attend_len, exact,
                                    kernel=self.attention == "kernel", slots=slots, tree=tree)

        h, features = self.decoder(ids, positions, attend, layer_ids)
        return self.head(h), features

    def tree_caches(self):
        return [self.k_cache, self.v_cache]

    def decoder(self, ids, positions, attend, layer_ids=None):
        """The layers over ids [..., T] at positions [..., T] (leading dims: batch rows, or none), with
        `attend(layer, q, k, v)` (q [..., heads, T, D], k / v [..., kv_heads, T, D] -> [..., T, heads*D])
        owning the KV cache: the batch-1 cache here, the rows' cache in `engine.batched`. Returns the
        residual stream [..., T, hidden] before the final norm and the features of `layer_ids`."""
        t, dtype = ids.shape[-1], self.dtype
        lead = ids.shape[:-1]
        cos, sin = self.cos[positions].unsqueeze(-3), self.sin[positions].unsqueeze(-3)  # broadcast over heads
        h = F.embedding(ids, self.embed).to(self.residual_dtype)
        features = {}
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        x = self.layers[0]["norm1"](h) if self.layers else None
        for i, w in enumerate(self.layers):
            q, k, v = w["wqkv"](x).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(*lead, t, self.heads, self.head_dim).transpose(-3, -2), cos, sin)
            k = apply_rope(k.view(*lead, t, self.kv_heads, self.head_dim).transpose(-3, -2), cos, sin)
            v = v.view(*lead, t, self.kv_heads, self.head_dim).transpose(-3, -2)
            # each residual add and the norm after it (the next layer's input norm after the MLP)
            h, x = residual_norm(w["wo"], attend(i, q, k, v), h, w["norm2"])
            after = self.layers[i + 1]["norm1"] if i + 1 < len(self.layers) else None
            h, x = residual_norm(w["w2"], swiglu(w["w13"], x, self.swiglu_epilogue), h, after)
            if layer_ids is not None and i in layer_ids:
                features[i] = h.to(dtype)
        return h, (tap_features(features, layer_ids) if layer_ids is not None else None)

    def head(self, h):
        """Logits of residual-stream rows [..., hidden] (final norm, then the LM head)."""
        return self.head_proj(rms_norm(h, self.final_norm, self.eps, self.dtype))
