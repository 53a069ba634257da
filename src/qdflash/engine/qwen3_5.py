"""Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention) with static caches and exact rollback.

Gated DeltaNet layers run the recurrent form token by token and keep the recurrent state after every
position of the last block fed (up to `max_block` tokens), so a rollback to any accepted prefix
restores the exact state without feeding anything again (docs/recipe.md: "keep per-position states during
verify"). With `gdn_replay` (on by default where blocks run two-phase) a block through the two-phase kernel (a 16-bit
model's verify block on a GPU) keeps instead the state before it and its tokens' kernel inputs, and a rollback re-runs
the accepted tokens' state updates from those, every layer in one launch (docs/recipe.md's other way: "re-run the
recurrence on the accepted prefix"). Their causal-conv inputs live in a per-position buffer like a KV cache, so a rollback there
is a change of length too. Every cache is a fixed buffer updated in place and positions are a tensor,
so a decode step and a verify block can be captured as CUDA graphs (`qdflash.engine.graphs`).
On a GPU a decode step's or verify block's layer middle (buffer write, causal conv, silu, l2norm, gates with
their a / b matmul, recurrence) is one Triton kernel per layer (`qdflash.kernels.gated_delta.gated_delta_step`;
a longer prefill runs them apart, its recurrence in `gated_delta_recurrence`), and its gated RMSNorm another
(`qdflash.kernels.gated_norm`); on the CPU the same lines run in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QdflashError
from ..kernels import gated_norm, qk_norm_rope
from ..kernels.gated_delta import (CHUNK, gated_delta_recurrence, gated_delta_replay, gated_delta_step, replay_scratch,
                                   replay_tables)
from .linear import Projection, StreamNorm, residual_norm, swiglu
from ..ops import apply_rope, tap_features
from .base import KERNEL_TOKENS, EngineBase, cached_attention

# the settings that decide what a verify block keeps for a rollback (`LeanQwen35._replays`): fixed under captured blocks
ROLLBACK_SETTINGS = frozenset({"gdn_replay", "fuse_gdn", "gdn_two_phase", "gdn_chunked"})
GDN_BA = ("dot", "given", "fused")  # LeanQwen35's gdn_ba: how a step's GDN gates get their b / a projection


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrence_torch(q, k, v, g, beta, state, states=None):
    """The Gated DeltaNet recurrence in torch (the CPU path; the Triton kernel's reference).
    Updates `state` in place and fills states[0..T] when given."""
    s = state
    if states is not None:
        states[0].copy_(s)
    out = torch.empty(*v.shape, device=v.device, dtype=torch.float32)
    for t in range(k.shape[0]):  # time first; any leading dims after it (batched rows: [T, B, H, d])
        s = s * g[t].exp()[..., None, None]
        delta = (v[t] - (s * k[t][..., None]).sum(-2)) * beta[t][..., None]
        s = s + k[t][..., None] * delta[..., None, :]
        out[t] = (s * q[t][..., None]).sum(-2)
        if states is not None:
            states[t + 1].copy_(s)
    state.copy_(s)
    return out


class LeanQwen35(EngineBase):
    def __init__(self, model, max_len: int, kernels: bool | str = "auto", max_block: int = 16, fp32_residual: bool = True,
                 gdn_ba: str = "dot"):
        c = model.config
        super().__init__(model, max_len, kernels, fp32_residual)
        self.max_block = max_block
        # the gates' b / a projection (2 x heads rows) in a decode step / verify block with the kernels: "dot", the
        # fused GDN kernel computes it from the hidden row (no launch of its own, but a hidden-wide dot and reduction
        # in the kernel's token chain); "given", its own matmul before the kernel; "fused", its rows appended to the
        # qkvz projection where both are 16-bit (one matmul; a quantized qkvz keeps "given")
        if gdn_ba not in GDN_BA:
            raise QdflashError(f"gdn_ba={gdn_ba!r}: expected one of {', '.join(GDN_BA)}")
        self.gdn_ba = gdn_ba
        # a verify block's GDN middle through the two-phase kernel (every token's inputs first, then the recurrence
        # alone; gated_delta_step's two_phase). Its block then agrees with one-token steps to fp32 rounding, not bit
        # for bit, so a greedy speculative token may differ from the autoregressive one where two logits nearly tie.
        # On by default for a 16-bit model, whose speculative output is held to its autoregressive one up to
        # near-ties anyway (bench.MARGIN_BUG), and where it runs a 16-token block faster than the step kernel token by
        # token (results/published/2026-12-06-h100-prefetch2-gdn); off for fp32, whose output must equal the
        # autoregressive one exactly. Set before capture, like fuse_gdn
        self.gdn_two_phase = self.dtype != torch.float32
        # likewise, a verify block's recurrence in the chunked form (gated_delta_step's chunked: the block's products as
        # matmuls, no state reduction per token), to fp32 rounding too. Set before capture
        self.gdn_chunked = False
        # a two-phase verify block (above) writes the GDN state before it and keeps its tokens' inputs (the kernel's
        # scratch) instead of writing the state after every position: a rollback into the block recomputes the one
        # state it needs, every layer in one launch (gated_delta_replay). At Qwen3.5-4B a verify block wrote 16 states
        # of 2 MB a layer, 24 layers, and a round reads one of them. On where blocks run two-phase (set at the end of
        # __init__: turning it on allocates the kept inputs, 4.5 MB a layer at Qwen3.5-4B), since a device run found
        # its states and logits 0 apart from the kept ones, eagerly and after CUDA-graph and compiled verify blocks, and
        # the compiled verify blocks faster (results/published/2026-12-06-h100-gdn-replay). Set before capture
        self.kept, self._replay_tables, self._gdn_replay = {}, None, False
        # with the kernels: a decode step's / verify block's GDN middle in one launch (`_delta_net_fused`);
        # False runs the unfused layer (the benchmark's side-by-side arm)
        self.fuse_gdn = True
        # with the kernels: each GDN layer's gated RMSNorm of a decode step / verify block in one launch
        # (kernels.gated_norm; compiled, inductor makes it two); False runs the model's module. Set before capture
        self.gated_norm_kernel = True
        # with the kernels and the attention kernel: each attention layer's q / k norms, rotation and KV cache writes of
        # a decode step / verify block in one launch (kernels.qk_norm_rope; compiled, inductor makes them eight). Set
        # before capture
        self.qk_norm_rope_kernel = True
        dtype, device = self.dtype, self.device
        rope = c.rope_parameters
        # partial rotary: the first `rot` dims of a head rotate (text positions: mrope reduces to plain rope)
        self.rot = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        self._rope_tables(self.rot, rope["rope_theta"])
        self.final_norm = model.model.norm  # the model's own (zero-centered) norm modules are used as they are
        self.types = list(c.layer_types)
        kv = (self.kv_heads, max_len, self.head_dim)
        self.layers, self.k_cache, self.v_cache = [], {}, {}
        self.conv_in, self.state, self.block_states = {}, {}, {}
        self._replay_last = False  # whether the last block fed kept its inputs (rollback replays) or its states
        for i, layer in enumerate(model.model.layers):
            w = {"norm1": self._norm(layer.input_layernorm), "norm2": self._norm(layer.post_attention_layernorm),
                 "w13": Projection.of([layer.mlp.gate_proj, layer.mlp.up_proj], dtype, self.kernels, swiglu=True),
                 "w2": Projection.of([layer.mlp.down_proj], dtype, self.kernels)}
            if self.types[i] == "full_attention":
                a = layer.self_attn
                w.update(qkv=Projection.of([a.q_proj, a.k_proj, a.v_proj], dtype, self.kernels), o=Projection.of([a.o_proj], dtype, self.kernels),
                         q_norm=a.q_norm, k_norm=a.k_norm)
                self.k_cache[i] = torch.zeros(kv, device=device, dtype=dtype)
                self.v_cache[i] = torch.zeros(kv, device=device, dtype=dtype)
            else:
                la = layer.linear_attn
                parts = [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a]
                if gdn_ba == "fused" and all(type(m) is nn.Linear for m in parts):  # ba=None: its rows end qkvz's
                    w.update(qkvz=Projection.of(parts, dtype, self.kernels), ba=None)
                else:
                    w.update(qkvz=Projection.of(parts[:2], dtype, self.kernels), ba=Projection.of(parts[2:], dtype, self.kernels))
                w.update(la=la, out=Projection.of([la.out_proj], dtype, self.kernels),
                         conv=la.conv1d.weight.detach(), decay=-la.A_log.detach().float().exp(), dt_bias=la.dt_bias.detach())
                self.conv_in[i] = torch.zeros(max_len, la.conv_dim, device=device, dtype=dtype)
                self.state[i] = torch.zeros(la.num_v_heads, la.head_k_dim, la.head_v_dim, device=device)
                self.block_states[i] = torch.zeros(max_block + 1, *self.state[i].shape, device=device)
            self.layers.append(w)
        kernel = max((w["la"].conv_kernel_size for w in self.layers if "la" in w), default=1)
        self.conv_offsets = torch.arange(-(kernel - 1), max_len, device=device)
        self.length = 0
        self.block_start = 0  # the last block fed: states of positions block_start..length are kept
        self.gdn_replay = self.gdn_two_phase  # (needs self.state: the kept inputs are sized from it)

    @property
    def gdn_replay(self) -> bool:
        """Whether a two-phase verify block keeps its GDN inputs for a replay (see __init__)."""
        return self._gdn_replay

    @gdn_replay.setter
    def gdn_replay(self, on: bool) -> None:
        if on and not self.kept and self.kernels and self.state:  # a two-phase block's inputs, kept for a replay
            for i, state in self.state.items():
                self.kept[i] = torch.zeros(replay_scratch(*state.shape, self.max_block), device=self.device)
            layers = list(self.kept)
            self._replay_tables = replay_tables([self.block_states[i][0] for i in layers], [self.kept[i] for i in layers],
                                                [self.state[i] for i in layers])
        self._gdn_replay = bool(on)

    def __setattr__(self, name: str, value) -> None:
        """A setting of ROLLBACK_SETTINGS refuses a change under captured verify blocks that would change what they
        keep for a rollback (`_replays`): a captured block keeps its inputs or every position's state as it was
        captured, and a rollback would then read the other, states never written (silently wrong, no GPU error)."""
        if name not in ROLLBACK_SETTINGS or not self.__dict__.get("graphs"):  # (first: every attribute set comes here)
            return super().__setattr__(name, value)
        blocks = {key[0] for key in self.graphs}
        before, old = {t: self._replays(t) for t in blocks}, getattr(self, name)
        super().__setattr__(name, value)
        if {t: self._replays(t) for t in blocks} != before:
            super().__setattr__(name, old)
            kept = "their GDN inputs" if any(before.values()) else "every position's GDN state"
            raise QdflashError(f"{name}: set it before capture; this engine holds captured verify blocks that keep "
                               f"{kept} for a rollback (clear engine.graphs first)")

    def _norm(self, module: nn.Module) -> StreamNorm:
        """The model's own norm module into the model's dtype (it computes in fp32 and returns its input's dtype)."""
        return StreamNorm(lambda h: module(h).to(self.dtype))

    def reset(self) -> None:
        """An empty sequence (a new generation): zero recurrent states, length 0."""
        for state in self.state.values():
            state.zero_()
        self.length = self.block_start = 0
        self._replay_last = False

    def rollback(self, keep: int) -> None:
        """Back to `keep` positions; exact for any keep within the last block fed (or equal to now)."""
        if keep == self.length:
            return
        if not self.block_start <= keep < self.length:
            raise QdflashError(f"engine rollback to {keep}: only positions {self.block_start}..{self.length} are kept")
        # in place (a captured graph reads these buffers), every GDN layer's in one launch: a copy_ per layer was 24
        # launches of a 4B model, each more host time than its 2 MB copy takes on a GPU, between two rounds
        if self._replay_last:  # the block kept its inputs: the state after `keep` recomputed from the one before it
            gated_delta_replay(self._replay_tables, keep - self.block_start)
        else:
            layers = list(self.block_states)
            torch._foreach_copy_([self.state[i] for i in layers],
                                 [self.block_states[i][keep - self.block_start] for i in layers])
        self.length = keep

    def _keeps_states(self, t: int) -> bool:
        """Whether a forward of t tokens keeps the state after each of them: a verify block does (2..max_block tokens:
        a rollback into it copies one); a decode step does not (nothing rolls one back, and the state before and after
        it were two more state-sized writes a layer every step), nor a longer prefill."""
        return 1 < t <= self.max_block

    def _check_feed(self, start: int, t: int) -> None:
        if start != self.length:
            raise QdflashError(f"engine holds {self.length} positions; feed from there (or roll back) instead of {start}")

    def _replays(self, t: int) -> bool:
        """Whether a block of t tokens keeps its GDN inputs and the state before it instead of the state after each
        position (`gdn_replay`): a block the fused two-phase kernel runs (kernels, fuse_gdn, gdn_two_phase, not chunked)."""
        # (kept: the kernels are on and there are GDN layers; len, not bool: torch 2.11's dynamo breaks the graph on
        # bool(dict), which then splits every GDN layer of a compiled step)
        return (self._keeps_states(t) and t <= CHUNK and len(self.kept) > 0 and self.fuse_gdn and self.gdn_two_phase
                and self.gdn_replay and not self.gdn_chunked)

    def _after_feed(self, start: int, end: int) -> None:
        kept = self._keeps_states(end - start)
        self._replay_last = self._replays(end - start)
        self.block_start, self.length = (start if kept else end), end

    def _rope(self, x, cos, sin):
        return torch.cat([apply_rope(x[..., : self.rot], cos, sin), x[..., self.rot :]], dim=-1)

    def _attention(self, i, w, x, cos, sin, attend, positions=None):
        """The o projection's input of attention layer `i`. `positions` (the batch-1 step's, with the attention kernel):
        where `_qk_kernel` says so, q / k norms, rotation and cache writes in one launch and the attention kernel
        after it, instead of the module lines below and `attend`."""
        *lead, t, _ = x.shape
        q_size, kv_size = self.heads * 2 * self.head_dim, self.kv_heads * self.head_dim
        if positions is not None and self._qk_kernel(w, t):
            from ..kernels.decode_attention import one_sequence_attention

            qkv = w["qkv"](x)
            q = qk_norm_rope.qk_norm_rope(qkv, positions, self.cos, self.sin, w["q_norm"], w["k_norm"], self.k_cache[i],
                                          self.v_cache[i], self.heads)
            out = one_sequence_attention(q, self.k_cache[i], self.v_cache[i], positions + 1).reshape(t, -1)
            gate = qkv[:, :q_size].view(t, self.heads, 2 * self.head_dim)[..., self.head_dim:]
            return out * torch.sigmoid(gate.reshape(t, -1))
        q, k, v = w["qkv"](x).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = q.view(*lead, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(w["q_norm"](q).transpose(-3, -2), cos, sin)
        k = self._rope(w["k_norm"](k.view(*lead, t, self.kv_heads, self.head_dim)).transpose(-3, -2), cos, sin)
        v = v.view(*lead, t, self.kv_heads, self.head_dim).transpose(-3, -2)
        return attend(i, q, k, v) * torch.sigmoid(gate.reshape(*lead, t, -1))  # the o projection's input

    def _qk_kernel(self, w, t: int) -> bool:
        """Whether a batch-1 step of `t` tokens runs an attention layer's inputs through kernels.qk_norm_rope: the
        kernels and the attention kernel on (which reads the cache the launch writes), a decode step or verify block."""
        return (self.kernels and self.qk_norm_rope_kernel and self.attention == "kernel" and t <= KERNEL_TOKENS
                and qk_norm_rope.supported(self.head_dim, self.rot, w["q_norm"], w["k_norm"], self.dtype))

    def _delta_net(self, i, w, x, positions):
        """A Gated DeltaNet layer of the batch-1 path up to its out projection's input (the decoder adds the projection
        to the residual stream)."""
        la, t = w["la"], x.shape[0]
        if self.kernels and self.fuse_gdn and t <= CHUNK:
            return self._delta_net_fused(i, w, x, positions)
        qkvz, ba = self._qkvz_ba(w, x)
        mixed_in, z = qkvz.split([la.conv_dim, la.value_dim], dim=-1)
        self.conv_in[i].index_copy_(0, positions, mixed_in)
        kernel = la.conv_kernel_size
        rows = positions[0] + self.conv_offsets[: t + kernel - 1]  # the block and the kernel-1 inputs before it
        window = self.conv_in[i][rows.clamp(min=0)] * (rows >= 0)[:, None]  # zero history before the sequence start
        mixed = F.silu(F.conv1d(window.T[None], w["conv"], groups=la.conv_dim)[0].T)
        q, k, v, g, beta = self._gdn_inputs(w, mixed, ba)
        states = self.block_states[i] if self._keeps_states(t) else None
        if self.kernels:
            out = gated_delta_recurrence(q, k, v, g, beta, self.state[i], states)
        else:
            out = recurrence_torch(q, k, v, g, beta, self.state[i], states)
        return self._gdn_out(w, out, z)

    def _qkvz_ba(self, w, x):
        """The layer's qkvz projection of x and its b / a product [..., 2 * heads] (b heads, then a heads): the two
        ends of one matmul's output where gdn_ba "fused" joined them, else two matmuls."""
        out = w["qkvz"](x)
        if w["ba"] is not None:
            return out, w["ba"](x)
        n = w["la"].conv_dim + w["la"].value_dim
        return out[..., :n], out[..., n:]

    def _delta_net_fused(self, i, w, x, positions):
        """`_delta_net` for a decode step or verify block with the kernels on: everything between the qkvz
        and out projections in one launch (kernels.gated_delta.gated_delta_step), the gates' b / a product as
        `gdn_ba` says (a b / a projection with a bias is always computed apart)."""
        la, t = w["la"], x.shape[0]
        ba = w["ba"]
        dot = self.gdn_ba == "dot" and isinstance(ba, Projection) and ba.weight is not None and ba.bias is None
        if dot:  # the kernel computes x @ ba.T
            qkvz = w["qkvz"](x)
        else:
            qkvz, ba = self._qkvz_ba(w, x)
        out = gated_delta_step(qkvz, self.conv_in[i], w["conv"], positions, x, ba.weight if dot else ba, w["decay"], w["dt_bias"],
                               self.state[i], self.block_states[i] if self._keeps_states(t) else None,
                               key_heads=la.num_k_heads, key_dim=la.key_dim, ba_weight=dot,
                               two_phase=self.gdn_two_phase, chunked=self.gdn_chunked,
                               kept=self.kept[i] if self._replays(t) else None)
        return self._gdn_out(w, out, qkvz[:, la.conv_dim:])

    def _gdn_inputs(self, w, mixed, ba):
        """q, k, v [..., T, heads, d] (fp32; q scaled), decay g and beta [..., T, heads] of the conv output and the
        b / a product `ba`."""
        la = w["la"]
        lead = mixed.shape[:-1]
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        rep = la.num_v_heads // la.num_k_heads
        q = l2norm(q.reshape(*lead, la.num_k_heads, la.head_k_dim).float()).repeat_interleave(rep, -2) / la.head_k_dim ** 0.5
        k = l2norm(k.reshape(*lead, la.num_k_heads, la.head_k_dim).float()).repeat_interleave(rep, -2)
        v = v.reshape(*lead, la.num_v_heads, la.head_v_dim).float()
        b, a = ba.float().split([la.num_v_heads, la.num_v_heads], dim=-1)
        return q, k, v, w["decay"] * F.softplus(a + w["dt_bias"]), torch.sigmoid(b)

    def _gdn_out(self, w, out, z):
        """The out projection's input: the gated RMSNorm norm(out) * silu(z) per head, heads concatenated."""
        la = w["la"]
        lead = z.shape[:-1]
        if self.kernels and self.gated_norm_kernel and len(lead) == 1 and gated_norm.supported(la.norm):
            return gated_norm.gated_rms_norm(out, z, la.norm.weight, la.norm.variance_epsilon)
        z = z.reshape(*lead, la.num_v_heads, la.head_v_dim)
        return la.norm(out.to(z.dtype), z).reshape(*lead, -1)

    def delta_net_rows(self, i, w, x, conv_state, state):
        """The Gated DeltaNet layer up to its out projection's input, for a batch of rows (`engine.batched`): x [B, T,
        hidden], each row's rolling conv input of its last kernel-1 positions `conv_state` [B, kernel-1, conv_dim]
        and recurrent `state` [B, heads, dk, dv], both updated in place (no rollback: no per-position
        copies). Zeroed, they are a sequence start (the zero history the batch-1 path masks in)."""
        la = w["la"]
        t = x.shape[1]
        qkvz, ba = self._qkvz_ba(w, x)
        mixed_in, z = qkvz.split([la.conv_dim, la.value_dim], dim=-1)
        window = torch.cat([conv_state, mixed_in], dim=1)  # [B, kernel-1+T, conv_dim]
        conv_state.copy_(window[:, t:])
        mixed = F.silu(F.conv1d(window.transpose(1, 2), w["conv"], groups=la.conv_dim).transpose(1, 2))
        q, k, v, g, beta = self._gdn_inputs(w, mixed, ba)
        out = recurrence_torch(*(a.transpose(0, 1) for a in (q, k, v, g, beta)), state).transpose(0, 1)
        return self._gdn_out(w, out, z)

    def _step(self, ids, positions, attend_len, layer_ids, exact=False):
        def attend(i, q, k, v):
            return cached_attention(q, k, v, self.k_cache[i], self.v_cache[i], positions, attend_len, exact,
                                    kernel=self.attention == "kernel")

        def mix(i, w, x):
            return self._delta_net(i, w, x, positions)

        h, features = self.decoder(ids, positions, attend, layer_ids, mix, one_sequence=True)
        return self.head(h), features

    def decoder(self, ids, positions, attend, layer_ids=None, mix=None, one_sequence=False):
        """LeanLlama.decoder's contract, plus `mix(layer, weights, x)`: the Gated DeltaNet layers up to their out
        projection's input (the batch-1 path's per-position states, or the batched rows' states). `one_sequence`: the
        batch-1 step's (positions [T]; `attend` the cached attention over this engine's caches), whose attention
        layers may then run `_attention`'s kernel path."""
        dtype = self.dtype
        cos, sin = self.cos[positions].unsqueeze(-3), self.sin[positions].unsqueeze(-3)  # broadcast over heads
        h = F.embedding(ids, self.embed).to(self.residual_dtype)  # fp32 residual stream: EngineBase says why
        features = {}
        x = self.layers[0]["norm1"](h) if self.layers else None
        for i, w in enumerate(self.layers):
            if self.types[i] == "linear_attention":
                mixed, out = mix(i, w, x), w["out"]
            else:
                mixed, out = self._attention(i, w, x, cos, sin, attend, positions if one_sequence else None), w["o"]
            # each residual add and the norm after it (the next layer's input norm after the MLP)
            h, x = residual_norm(out, mixed, h, w["norm2"])
            after = self.layers[i + 1]["norm1"] if i + 1 < len(self.layers) else None
            h, x = residual_norm(w["w2"], swiglu(w["w13"], x, self.swiglu_epilogue), h, after)
            if layer_ids is not None and i in layer_ids:
                features[i] = h.to(dtype)
        return h, (tap_features(features, layer_ids) if layer_ids is not None else None)

    def head(self, h):
        return self.head_proj(self.final_norm(h).to(self.dtype))
