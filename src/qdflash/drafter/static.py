"""The drafter's step over static buffers, so that it replays as a CUDA graph like the target's steps
(qdflash.engine.graphs).

Run eagerly, one draft is a few dozen small kernels per drafter layer, each launched from Python,
plus a `torch.cat` of the whole context K/V every round (qdflash.spec.DrafterSession): on a GPU that
made a speculative round cost several autoregressive decode steps
(results/published/2026-11-30-h200-gpu-dag). Here the context K/V of every layer lives in buffers
of `max_len` positions, written in place as tokens are accepted. A draft attends to the first
`bucket` positions: the smallest of powers of two that holds the context, as the target's graphs do.
Positions past the context, and outside the sliding window, are masked. So one graph per (bucket,
window) serves every round. The accepted positions' K/V are written by the next draft's graph, first:
an append only stores the round's features and positions, and every draft writes the K/V of the last
append's B rows (`index_copy_` at positions held in a tensor). Rows past the append's count are stale
and land past the context, where the mask hides them and the block's own K/V (the attention kernel)
or a later append overwrite them; rewriting a round's rows is idempotent. So the append costs no
launch of its own and compiles with the draft: as a graph of its own it cost most of what a draft
cost (bench_speedup's round parts, results/published/2026-12-04-h200-qwen-block9). As a graph a
draft costs a fraction of the eager one
(scripts/bench/bench_round.py; results/published/2026-11-30-h200-smollm2-round). On CUDA each graph is captured on first use, or up
front with `capture`. Elsewhere the same static step runs eagerly, which is how the CPU tests check
the graph path.

    drafter.engine = DrafterEngine(drafter, max_len)   # speculative_generate then drafts through it
"""

from __future__ import annotations

import torch

from ..cudagraph import capture as capture_graph
from ..distill import lm_head_weight
from ..engine.base import allow_compiles, cache_buckets, compiled_step
from ..engine.linear import Concat, Projection, head_projection, tune_projections
from ..errors import QdflashError
from ..kernels import kernels_usable, qk_norm_rope
from ..ops import rope_tables, rows_argmax
from .model import KV, PROJECTION_GROUPS, QKV


def fused_projections(drafter, dtype: torch.dtype, kernels: bool) -> tuple[list[dict | None], "Projection | None"]:
    """Each layer's linears as the engine runs them, {names: projection} for every group of PROJECTION_GROUPS (q / k / v
    of the block, k / v of the context, o, gate / up, down; a group one matmul over its concatenated rows), and fc's.
    Quantized linears (exact ints + scales) run packed through the W4 backend tuning picks where `kernels`, else as
    their dequantized weights; 16-bit ones through the 16-bit GEMV where tuning picked it. Why: at a draft's 16 rows a
    matmul costs a few microseconds whatever its size, so a layer's nine matmuls alone cost more than its five
    (`results/published/2026-12-06-h100-w4-head`). A layer the engine cannot run so (fake-quant training layers, a
    module of another kind) gets None: it runs its own linears, as before. The projections copy what they
    concatenate: a snapshot of the weights when the engine was built."""
    layers = []
    for layer in drafter.layers:
        try:
            layers.append({names: Projection.of([getattr(layer, n) for n in names], dtype, kernels) for names in PROJECTION_GROUPS})
        except TypeError:
            layers.append(None)
    try:
        fc = Projection.of([drafter.fc], dtype, kernels)
    except TypeError:
        fc = None
    return layers, fc


def tune_engines(engines: list["DrafterEngine"]) -> dict:
    """`DrafterEngine.tune_kernels` for several engines at once, per dtype: drafters share shapes, and each shape is
    timed once. Engines off CUDA or with the kernels off have nothing to time."""
    engines = [e for e in engines if e.kernels and e.device.type == "cuda"]
    tuned = {}
    for dtype in {e.dtype for e in engines}:
        tuned |= tune_projections([p for e in engines if e.dtype == dtype for p in e.projections()], (), dtype)
    return tuned


def target_head(model, kernels: bool):
    """The target's LM head as the target engine runs it (engine.linear.head_projection): a quantized head packed
    through the W4 backend tuning chose for its shape where the kernels run, else its 16-bit weight. A 16-row draft
    block through a 4-bit head reads a quarter of the bytes (at Qwen3.5-4B's 248K vocab the head is most of a draft)."""
    dense = lm_head_weight(model)
    return head_projection(model, dense, dense.dtype, kernels)


class DrafterEngine:
    """Static context K/V and a capturable block step for one drafter (batch 1, one generation at a
    time). `session(window)` starts a generation; `append` / `draft` are DrafterSession's interface.
    A captured graph keeps the tensors it was captured with, the bound target's embedding and LM head
    among them: build a new engine after `drafter.bind(other_target)`."""

    def __init__(self, drafter, max_len: int, cuda_graphs: bool | None = None, smallest_bucket: int = 256,
                 attention: str = "sdpa", compile=False, kernels: bool | str = "auto"):
        """`attention`: "sdpa" (the block over a masked power-of-two bucket of the context) or "kernel"
        (kernels.decode_attention: the block's K/V written after the context, each block position
        reading the context it may see and the block, nothing masked; one graph for any context
        length). The kernel needs Triton on CUDA, or its interpreter (tests).
        `compile`: the draft step through torch.compile (True: inductor; else that backend, e.g. the
        tests' "aot_eager"), as the target engine's `capture(compile=...)`: its elementwise work
        fused, one compile per (bucket, window) graph (one with the kernel), the round's append in it.
        Drafts only propose tokens, so a compiled draft's rounding (its context K/V's too) changes τ at
        most, never what the target emits.
        `kernels`: whether the drafter's quantized linears and a quantized target head run packed through the W4
        kernels, and its 16-bit ones through the 16-bit GEMV where tuned faster ("auto": on CUDA); `tune_kernels()`
        times them. Either way the layers' linears run fused (`fused_projections`)."""
        c = drafter.config
        self.drafter, self.max_len, self.block = drafter, max_len, c.block_size
        self.dtype = drafter.norm.weight.dtype
        self.device = drafter.norm.weight.device
        if attention not in ("sdpa", "kernel"):
            raise QdflashError(f"DrafterEngine attention={attention!r}: expected 'sdpa' or 'kernel'")
        if attention == "kernel":
            kernels_usable(self.device, True)  # raises, saying why, where Triton cannot run
        self.attention = attention
        # B positions past max_len: the kernel path writes the block's own K/V at length..length+B-1, and a
        # draft rewrites the last append's B rows, its stale ones past the context
        # [kv_heads, positions, D]: base tensors, which a kernel writes in place (qk_norm_rope; a view of a compiled
        # graph's input written by a user kernel may be copied whole around the launch)
        shape = (c.num_kv_heads, max_len + self.block, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        self.buckets = [max_len] if attention == "kernel" else cache_buckets(max_len, smallest_bucket)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        # the step's inputs: block tokens, their positions, the context length (tensors, so a graph reads them)
        self.ids = torch.zeros(1, self.block, dtype=torch.long, device=self.device)
        self.q_pos = torch.zeros(1, self.block, dtype=torch.long, device=self.device)
        self.context_len = torch.zeros((), dtype=torch.long, device=self.device)
        self.offsets = torch.arange(self.block, device=self.device)
        self.k_pos = torch.arange(max_len, device=self.device)
        # the last append's B rows (its features first, then stale ones) and their positions: what a draft
        # writes as context K/V before the block runs
        self.features = torch.zeros(self.block, len(c.target_layer_ids) * c.hidden_size, dtype=self.dtype, device=self.device)
        self.append_pos = self.offsets.clone()
        self.pending = False  # rows appended that no draft has written yet
        self.graphs: dict[tuple, tuple] = {}
        self.length, self.window = 0, None
        self._compiled_step = compiled_step(self._step, compile) if compile else None
        self._compiled: set[tuple] = set()  # the (bucket, window) steps compiled so far
        self.kernels = kernels_usable(self.device, kernels)
        self.head = target_head(drafter._target.model, self.kernels)
        self.fused, self.fc = fused_projections(drafter, self.dtype, self.kernels)
        # with the kernels: each layer's q / k norms, rotation and cache writes (the block's, and the context rows' a
        # draft writes) in one launch (kernels.qk_norm_rope) instead of the model's lines, which inductor made ~6
        # kernels a layer (~60 us of a 4B W4 drafter step on an H100, results/published/2026-12-06-h100-gdn-replay).
        # Off until a device run times it (bench_components --drafter-qk-kernel). Set before capture
        self.qk_norm_rope_kernel = False
        self.cos, self.sin = (rope_tables(c.head_dim, max_len + self.block, c.rope_theta, self.device, self.dtype)
                              if self.kernels else (None, None))

    def projections(self):
        """The drafter's projections this engine runs (the parts of a Concat one by one; not the target's head)."""
        for p in [self.fc, *(p for fused in self.fused if fused for p in fused.values())]:
            if isinstance(p, Concat):
                yield from p.parts
            elif isinstance(p, Projection):
                yield p

    def tune_kernels(self) -> dict:
        """On CUDA with the kernels on: time the drafter's W4 and 16-bit shapes at 1 and 16 rows, as the target
        engine's `tune_kernels` (the head is the target's: its engine tunes it). Call before `capture`. Returns
        the timings."""
        return tune_engines([self])

    def session(self, window: int | None = None) -> "DrafterEngine":
        """A new generation: the context is empty again (the buffers are overwritten as it grows)."""
        self._check_window(window)
        self.length, self.window = 0, window
        self.append_pos.copy_(self.offsets)  # the last session's rows land in the empty context: masked, overwritten
        self.pending = False
        return self

    def _check_window(self, window: int | None) -> None:
        if self.attention == "kernel" and window is not None and window < self.block:
            raise QdflashError(f"DrafterEngine attention='kernel': window={window} is smaller than the block "
                               f"({self.block}); the kernel reads a contiguous range, which would hide part of the block")

    @torch.no_grad()
    def append(self, features: torch.Tensor, start: int) -> None:
        """Target features [n, k*H] of positions start..start+n-1 become context K/V in every layer: the last
        B of them (a round's accepted tokens: all) in the next draft's graph, any before those (a prompt) now."""
        n = features.shape[0]
        if start != self.length:
            raise ValueError(f"context holds {self.length} positions; features for {start}.. must follow them")
        if start + n > self.max_len:
            raise QdflashError(f"drafter context holds {self.max_len} positions; asked for {start + n} (DrafterEngine(max_len=...))")
        if self.pending:  # two appends with no draft between: the first one's rows now, eagerly
            self._write_context(self.features, self.append_pos)
        kept = min(n, self.block)
        if n > kept:
            self._write_context(features[:n - kept].to(self.device), torch.arange(start, start + n - kept, device=self.device))
        self.features[:kept].copy_(features[n - kept:])
        torch.add(self.offsets, start + n - kept, out=self.append_pos)
        self.length += n
        self.pending = True

    def _qk_kernel(self, layer, fused) -> bool:
        """Whether `layer`'s q / k norms, rotation and cache writes run through kernels.qk_norm_rope (see __init__)."""
        c = self.drafter.config
        return (self.qk_norm_rope_kernel and self.kernels and fused is not None
                and qk_norm_rope.supported(c.head_dim, c.head_dim, layer.q_norm, layer.k_norm, self.dtype))

    def _write_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Context K/V of target features [n, k*H] at `positions` [n], written in place in every layer."""
        context = self.drafter.context_features(features[None].to(self.dtype), self.fc)
        for layer, fused, keys, values in zip(self.drafter.layers, self.fused, self.keys, self.values):
            if self._qk_kernel(layer, fused):  # the rows' k normed and rotated, and v, into the caches: one launch
                qk_norm_rope.qk_norm_rope(fused[KV](context)[0], positions, self.cos, self.sin, layer.k_norm,
                                          layer.k_norm, keys, values, 0, gated=False)
                continue
            k, v = layer.context_kv(context, positions[None], fused)
            keys.index_copy_(1, positions, k[0])
            values.index_copy_(1, positions, v[0])

    def _step(self, attend: int, window: int | None):
        """Logits [B, V] and greedy drafts [B-1] of the block in `self.ids` over the first `attend`
        context positions (those >= context_len, or outside the window, masked), after the last
        append's rows are written as context K/V."""
        d, b = self.drafter, self.block
        self._write_context(self.features, self.append_pos)
        h = d.embed_block(self.ids).to(self.dtype)
        if self.attention == "kernel":
            return self._kernel_step(h, window)
        k_pos = self.k_pos[:attend]
        visible = (k_pos < self.context_len)[None, None, :].expand(1, b, attend)
        if window is not None:  # symmetric window; for context before the block: q - k < window
            visible = visible & ((self.q_pos[:, :, None] - k_pos[None, None, :]) < window)
        mask = torch.cat([visible, torch.ones(1, b, b, dtype=torch.bool, device=self.device)], dim=-1)
        for layer, fused, keys, values in zip(d.layers, self.fused, self.keys, self.values):
            h = layer.forward_cached(h, self.q_pos, keys[None, :, :attend], values[None, :, :attend], mask, fused)
        return self._drafts(h)

    def _kernel_step(self, h, window: int | None):
        """`_step` through kernels.decode_attention: the block's K/V go to positions p..p+B-1 of the
        buffers (p = context_len; an append overwrites them with context K/V later), and block
        position i reads positions start_i..p+B-1: the whole context, or with a window the context
        q_i - k < window (the block itself always, as window >= B), as the mask of `_step` says."""
        from ..kernels.decode_attention import one_sequence_attention

        d, b = self.drafter, self.block
        q_pos = self.q_pos[0]
        lengths = (self.context_len + b).repeat(b)  # one per block position (the kernel reads a row each)
        starts = None if window is None else (q_pos - window + 1).clamp_min(0)
        for layer, fused, keys, values in zip(d.layers, self.fused, self.keys, self.values):
            if self._qk_kernel(layer, fused):  # q normed and rotated; the block's k and v into the caches: one launch
                q = qk_norm_rope.qk_norm_rope(fused[QKV](layer.input_norm(h))[0], q_pos, self.cos, self.sin,
                                              layer.q_norm, layer.k_norm, keys, values, d.config.num_heads,
                                              gated=False)
            else:
                q, k, v = layer.block_qkv(h, self.q_pos, fused)
                keys.index_copy_(1, q_pos, k[0])
                values.index_copy_(1, q_pos, v[0])
                q = q[0].transpose(0, 1)
            out = one_sequence_attention(q, keys, values, lengths, starts)
            h = layer.finish(h, out.transpose(0, 1)[None], fused)
        return self._drafts(h)

    def _drafts(self, h):
        """The block's logits [B, V] through the target's head, and its greedy drafts [B-1]."""
        logits = self.head(self.drafter.norm(h).to(self.head.dtype))[0]
        return logits, rows_argmax(logits[1:])

    def _bucket(self) -> int:
        return next(n for n in self.buckets if n >= max(self.length, 1))

    def capture(self, window: int | None = None) -> int:
        """Capture now (not during a measured generation) the draft graph of every bucket for this
        window. Before a generation: the warm-up drafts write context K/V (the append rows, and with the
        kernel the block's) at the first positions, which the prompt then overwrites. Returns how many
        graphs this engine holds."""
        self._check_window(window)
        if self.cuda_graphs:
            if self.length:
                raise ValueError("capture before a generation (a draft's warm-up writes K/V at positions 0..B-1)")
            self.q_pos[0].copy_(self.offsets)
            self.context_len.fill_(0)
            for attend in self.buckets:
                self._graph((attend, window), lambda attend=attend: self._draft_step(attend, window))
        return len(self.graphs)

    def _graph(self, key: tuple, step) -> tuple:
        """(graph, its output buffers) of `step` under `key`, captured on first use: a draft's warm-up
        writes what its replay writes (the last append's rows, the block's K/V at its own positions), so
        capturing in the middle of a generation is safe."""
        if key not in self.graphs:
            self.graphs[key] = capture_graph(step, 2, self.device)
        return self.graphs[key]

    @torch.no_grad()
    def draft_logits(self, last_token: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V], greedy drafts [B-1]) for positions position+1.. given the committed token
        at `position`; on CUDA the graph's own output buffers, valid until the next draft."""
        if position != self.length:
            raise ValueError(f"a draft at position {position} needs the context of exactly {position} positions; it holds {self.length}")
        block = torch.full((1, self.block), self.drafter.mask_id, dtype=torch.long)
        block[0, 0] = last_token
        self.ids.copy_(block)
        torch.add(self.offsets, position, out=self.q_pos[0])
        self.context_len.fill_(self.length)
        attend = self._bucket()
        self.pending = False  # the draft writes them first
        if self.cuda_graphs:
            window = self.window
            graph, out = self._graph((attend, window), lambda: self._draft_step(attend, window))
            graph.replay()
            return out
        return self._draft_step(attend, self.window)

    def _draft_step(self, attend: int, window: int | None):
        """`_step`, compiled where the engine was built with `compile` (each new (bucket, window) is one
        more compile of the same code: engine.base.allow_compiles)."""
        if self._compiled_step is None:
            return self._step(attend, window)
        if (attend, window) not in self._compiled:
            allow_compiles(1)
            self._compiled.add((attend, window))
        return self._compiled_step(attend, window)

    def draft(self, last_token: int, position: int) -> torch.Tensor:
        return self.draft_logits(last_token, position)[1]
