"""Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention) with static caches and exact rollback.

Gated DeltaNet layers run the recurrent form token by token and keep the recurrent state after every
position of the last block fed, so a rollback to any accepted prefix restores the exact state without
feeding anything again (RECIPE.md: "keep per-position states during verify"). Their causal-conv
inputs live in a per-position buffer like a KV cache, so a rollback there is a change of length too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import QdflashError
from .llama import apply_rope, cached_attention, rope_tables


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class LeanQwen35:
    def __init__(self, model, max_len: int):
        c = model.config
        self.c, self.max_len = c, max_len
        p = next(model.parameters())
        device, dtype = p.device, p.dtype
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        rope = c.rope_parameters
        # partial rotary: the first `rot` dims of a head rotate (text positions: mrope reduces to plain rope)
        self.rot = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.cos, self.sin = rope_tables(self.rot, max_len, rope["rope_theta"], device, dtype)
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm  # the model's own (zero-centered) norm modules are used as they are
        self.lm_head = model.get_output_embeddings().weight
        self.layers = list(model.model.layers)
        self.types = list(c.layer_types)
        kv = (self.kv_heads, max_len, self.head_dim)
        self.k_cache = {i: torch.zeros(kv, device=device, dtype=dtype) for i, t in enumerate(self.types) if t == "full_attention"}
        self.v_cache = {i: torch.zeros(kv, device=device, dtype=dtype) for i in self.k_cache}
        self.conv_in = {}   # per-position causal-conv inputs [max_len, conv_dim]
        self.state = {}     # recurrent state now [v_heads, dk, dv] fp32
        self.block_states = {}  # states after each position of the last block fed, and before it
        for i, t in enumerate(self.types):
            if t == "linear_attention":
                la = self.layers[i].linear_attn
                self.conv_in[i] = torch.zeros(max_len, la.conv_dim, device=device, dtype=dtype)
                self.state[i] = torch.zeros(la.num_v_heads, la.head_k_dim, la.head_v_dim, device=device)
        self.length = 0
        self.block_start = 0

    def reset(self) -> None:
        """An empty sequence (a new generation): zero recurrent states, length 0."""
        for state in self.state.values():
            state.zero_()
        self.block_states = {}
        self.length = self.block_start = 0

    def rollback(self, keep: int) -> None:
        """Back to `keep` positions; exact for any keep within the last block fed (or equal to now)."""
        if keep == self.length:
            return
        if not self.block_start <= keep < self.length:
            raise QdflashError(f"engine rollback to {keep}: only positions {self.block_start}..{self.length} are kept")
        for i, states in self.block_states.items():
            self.state[i] = states[keep - self.block_start].clone()
        self.length = keep

    def _rope(self, x, start, end):
        rotated = apply_rope(x[..., : self.rot], self.cos[start:end], self.sin[start:end])
        return torch.cat([rotated, x[..., self.rot :]], dim=-1)

    def _attention(self, i, x, start, end):
        a, t = self.layers[i].self_attn, x.shape[0]
        q, gate = a.q_proj(x).view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(t, -1)
        q = self._rope(a.q_norm(q).transpose(0, 1), start, end)
        k = self._rope(a.k_norm(a.k_proj(x).view(t, self.kv_heads, self.head_dim)).transpose(0, 1), start, end)
        v = a.v_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        out = cached_attention(q, k, v, self.k_cache[i], self.v_cache[i], start, end)
        return a.o_proj(out * torch.sigmoid(gate))

    def _delta_net(self, i, x, start, end):
        la, t = self.layers[i].linear_attn, x.shape[0]
        self.conv_in[i][start:end] = la.in_proj_qkv(x)
        kernel = la.conv_kernel_size
        first = start - (kernel - 1)
        window = self.conv_in[i][max(first, 0) : end]
        if first < 0:  # zero history before the sequence start, as transformers pads
            window = torch.cat([window.new_zeros(-first, window.shape[1]), window])
        mixed = F.silu(F.conv1d(window.T[None].to(la.conv1d.weight.dtype), la.conv1d.weight, groups=la.conv_dim)[0].T)
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        rep = la.num_v_heads // la.num_k_heads
        q = l2norm(q.reshape(t, la.num_k_heads, la.head_k_dim).float()).repeat_interleave(rep, 1) / la.head_k_dim ** 0.5
        k = l2norm(k.reshape(t, la.num_k_heads, la.head_k_dim).float()).repeat_interleave(rep, 1)
        v = v.reshape(t, la.num_v_heads, la.head_v_dim).float()
        beta = torch.sigmoid(la.in_proj_b(x)).float()
        g = -la.A_log.float().exp() * F.softplus(la.in_proj_a(x).float() + la.dt_bias)
        state = self.state[i]
        states = [state]
        out = torch.empty(t, la.num_v_heads, la.head_v_dim, device=x.device)
        for s in range(t):
            state = state * g[s].exp()[:, None, None]
            delta = (v[s] - (state * k[s][..., None]).sum(-2)) * beta[s][:, None]
            state = state + k[s][..., None] * delta[:, None, :]
            out[s] = (state * q[s][..., None]).sum(-2)
            states.append(state)
        self.state[i] = state
        self.block_states[i] = states
        z = la.in_proj_z(x).reshape(t, la.num_v_heads, la.head_v_dim)
        return la.out_proj(la.norm(out.to(x.dtype), z).reshape(t, -1))  # gated RMSNorm: norm(out) * silu(z)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int, layer_ids: list[int] | None = None):
        """Logits [T, V] for `ids` [T] at positions start.. (start must be the current length: roll
        back first), and hidden states after `layer_ids` concatenated [T, k*H] (or None)."""
        t, end = ids.shape[0], start + ids.shape[0]
        if start != self.length:
            raise QdflashError(f"engine holds {self.length} positions; feed from there (or roll back) instead of {start}")
        if end > self.max_len:
            raise QdflashError(f"engine cache holds {self.max_len} positions; asked for {end} (build_engine(max_len=...))")
        h = F.embedding(ids, self.embed)
        features = {}
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            h = h + (self._delta_net(i, x, start, end) if self.types[i] == "linear_attention" else self._attention(i, x, start, end))
            x = layer.post_attention_layernorm(h)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
            if layer_ids is not None and i in layer_ids:
                features[i] = h
        self.block_start, self.length = start, end
        logits = F.linear(self.final_norm(h), self.lm_head)
        return logits, (torch.cat([features[i] for i in layer_ids], dim=-1) if layer_ids is not None else None)
