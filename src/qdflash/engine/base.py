"""What every lean engine shares (`EngineBase`): rope tables, the feed / rollback bookkeeping, CUDA
graphs, and the attention over a static KV cache (batch 1: `cached_attention`; many rows:
`rows_attention`). The families build on it: `llama.LeanLlama` (llama, SmolLM2, Qwen2) and
`qwen3_5.LeanQwen35` (the Qwen3.5 hybrid)."""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.nn.functional as F

from ..distill import lm_head_weight
from ..drafter.blocks import tree_depths
from ..errors import QdflashError
from ..kernels import kernels_usable
from ..ops import rope_tables
from .linear import Concat, Projection, head_projection, tune_projections

log = logging.getLogger(__name__)


KERNEL_TOKENS = 16  # tokens per step that the attention kernel takes (a verify block); a prefill runs SDPA


def cached_attention(q, k, v, k_cache, v_cache, positions: torch.Tensor, attend_len: int | None,
                     exact: bool = False, kernel: bool = False, slots: torch.Tensor | None = None,
                     tree: torch.Tensor | None = None) -> torch.Tensor:
    """Write k, v [kv_heads, T, D] at `positions` [T] of a static cache [kv_heads, max_len, D] and
    attend q [heads, T, D] over every cached position up to its own (causal inside the block).
    `attend_len`: how much of the cache to read (None: all of it); `exact`: it ends at the last
    position fed (the eager path: no mask needed for one token). A captured graph reads a fixed length
    for many positions, so everything past each query's position is masked. `kernel` (T <= 16):
    kernels.decode_attention instead, each token reading its own positions only, whatever length a
    graph was captured for, and exactly as a one-token step at its position would. `tree` [T] (with `slots`
    [T], consecutive, where the tokens' K / V go; `positions` are then their rotary positions): the tokens
    are a tree's nodes, each seeing the cache before slots[0] and the nodes whose bit is set in its entry
    (`tree_bits`). Returns [T, heads*D]."""
    t = q.shape[1]
    where = positions if slots is None else slots
    k_cache.index_copy_(1, where, k)
    v_cache.index_copy_(1, where, v)
    if kernel and t <= KERNEL_TOKENS:
        from ..kernels.decode_attention import one_sequence_attention

        # each token as long as its own position + 1 (a tree's nodes: as long as the last node's slot + 1)
        return one_sequence_attention(q.transpose(0, 1), k_cache, v_cache, where + 1 if tree is None else
                                      (where[-1] + 1).repeat(t), tree=tree).reshape(t, -1)
    n = attend_len or k_cache.shape[1]
    rep = q.shape[0] // k.shape[0]
    keys, values = k_cache[:, :n], v_cache[:, :n]
    if exact and t > 1 and tree is None:  # an eager prefill (captured steps are never exact)
        return prefill_attention(q, keys, values, positions, rep)
    if tree is not None:
        mask = tree_mask(n, where[0], tree)
    else:
        mask = None if exact else causal_mask(n, positions)  # exact here: one token, the last position fed
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=rep > 1)
    return out[0].transpose(0, 1).reshape(t, -1)


def causal_mask(n: int, positions: torch.Tensor) -> torch.Tensor:
    """[..., n] boolean for positions [...] ([T], or [B, T] of a batch): the token at a position sees cache
    positions 0..that position."""
    return torch.arange(n, device=positions.device) <= positions[..., None]


def tree_bits(parents: list[int]) -> list[int]:
    """Each node's ancestors and itself as bits of an int (bit j: node j), for `parents` in an order where a
    parent comes first (-1: a root's parent, the cache). At most 63 nodes (int64)."""
    if len(parents) > 63:
        raise QdflashError(f"a tree of {len(parents)} nodes: at most 63 fit the attention's int64 masks")
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return bits


def tree_mask(n: int, first: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    """[T, n] boolean of `cached_attention`'s tree: cache positions before `first` (a 0-dim tensor), and from
    it the nodes whose bit is set in each node's entry of `tree` [T]."""
    j = torch.arange(n, device=tree.device) - first
    inside = (j >= 0) & (j < tree.shape[0])
    bit = (tree[:, None] >> j.clamp(0, 62)) & 1
    return (j < 0) | (inside & (bit != 0))


def prefill_attention(q, keys, values, positions: torch.Tensor, rep: int) -> torch.Tensor:
    """Eager attention of T tokens q [heads, T, D] that end the cache's keys / values [kv_heads, n, D]
    (`cached_attention`'s exact path: a prompt). Returns [T, heads*D].
    Left to its own choice, SDPA runs 16-bit attention on Hopper through cuDNN (torch >= 2.11), which builds
    a plan for every new shape: every prompt length is new, and the first prompt of each length paid for
    it (on the H200 every benchmark prompt's first visit, whichever method made it, took 0.03-0.1 s longer
    in bf16, ~0.005 s in fp32, where cuDNN attention does not run: results/published/2026-12-04-h200-qwen-fox,
    "The benchmark's first turn"; in isolation 44-581 ms at each new length: results/published/
    2026-12-04-h200-prefill-first-call). So the prefill runs flash attention where it can: from position 0 the
    mask is the square causal one, which flash takes without a tensor; otherwise the memory-efficient kernel
    takes the mask. Neither plans per shape. The KV heads are repeated (not enable_gqa) so that both accept
    the call; a prefill runs once a prompt, so the copy is small against it."""
    t, n = q.shape[1], keys.shape[1]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    causal = n == t  # exact: the tokens end at position n - 1, so n == t means they start at 0
    mask = None if causal else causal_mask(n, positions)
    with _prefill_backends(q):
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal)
    return out[0].transpose(0, 1).reshape(t, -1)


def _prefill_backends(q: torch.Tensor):
    """SDPA's kernels for a prefill on CUDA: flash, memory-efficient, else math; never cuDNN (prefill_attention)."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def rows_attention(q, k, v, k_cache, v_cache, positions: torch.Tensor, attend_len: int,
                   rows: torch.Tensor | None = None, kernel: bool = False) -> torch.Tensor:
    """`cached_attention` for a batch: q [B, heads, T, D], k / v [B, kv_heads, T, D] of cache rows
    `rows` [B] (None: rows 0..B-1 of the cache, which is then read without a copy) at positions
    [B, T], each row its own sequence from position 0. Cache [rows, kv_heads, max_len, D]. Every row
    reads `attend_len` positions, masked past its own position, so rows of different lengths share one
    fixed-shape step. `kernel`: a decode step (T = 1, rows 0..B-1) reads each row's own length only
    (kernels.decode_attention; `attend_len` is then not read). Returns [B, T, heads*D]."""
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    index = rows if rows is not None else torch.arange(b, device=q.device)
    k_cache[index[:, None], :, positions] = k.transpose(1, 2)  # [B, T, kv_heads, D] at (row, position)
    v_cache[index[:, None], :, positions] = v.transpose(1, 2)
    if kernel and t == 1 and rows is None:
        from ..kernels.decode_attention import decode_attention

        return decode_attention(q[:, :, 0], k_cache, v_cache, positions[:, 0] + 1).reshape(b, 1, heads * d)
    keys = k_cache[:b, :, :attend_len] if rows is None else k_cache[rows, :, :attend_len]
    values = v_cache[:b, :, :attend_len] if rows is None else v_cache[rows, :, :attend_len]
    # grouped-query attention without repeating the cache: the `rep` query heads of one KV head are
    # stacked on the query axis ([B, kv_heads, rep*T, D] against [B, kv_heads, n, D])
    rep = heads // kv_heads
    mask = causal_mask(attend_len, positions)  # [B, T, n]
    out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, rep * t, d), keys, values,
                                         attn_mask=mask.repeat(1, rep, 1)[:, None])
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d)



class EngineBase:
    """Batch 1. Subclasses build their weights and implement `_step(ids, positions, attend_len,
    layer_ids, exact=False) -> (logits, features)` with tensor positions and in-place cache updates only, so that a
    step can be captured as a CUDA graph (`capture`)."""

    def __init__(self, model, max_len: int, kernels: bool | str = "auto", fp32_residual: bool = True):
        c = model.config
        self.config, self.max_len = c, max_len
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kernels = kernels_usable(self.device, kernels)  # Triton W4A16 matmul and GDN recurrence
        # The residual stream (the running sum of every layer's output) is kept in fp32 while the
        # matmuls read 16-bit activations and weights: rounding it to 16 bits after every layer is
        # where a decode step (1 row) and a verify block (16 rows) drift apart most, because their
        # kernels round differently and the residual carries each difference to the next layer.
        # fp32 costs nothing measurable at batch 1 (one [T, hidden] vector) and makes greedy
        # speculative decoding in bf16 diverge from autoregressive decoding far more rarely.
        self.residual_dtype = torch.float32 if fp32_residual else self.dtype
        self.embed = model.model.embed_tokens.weight
        self.lm_head = lm_head_weight(model)  # [V, H] 16-bit: a quantized head's dequantized weight
        self.head_proj = head_projection(model, self.lm_head, self.dtype, self.kernels)  # what computes the logits
        self.graphs = {}  # (tokens per step, layer ids, cache length read, a tree's step) -> CapturedStep
        self.attention = "sdpa"  # set_attention
        self.inductor_options = dict(INDUCTOR_OPTIONS)  # what capture(compile=True) gives inductor
        # capture's steps with programmatic dependent launch (kernels.pdl: the int4 mma kernels' launches, and with
        # compile inductor's own kernels, `triton.enable_pdl`): off until timed in a whole step. Set before capture
        self.pdl = False
        # silu(gate) * up made in the gate / up matmul's epilogue where its kernel takes one (`linear.swiglu`), else from
        # the matmul's output. On: a launch and a round trip of the gate / up product fewer a layer; side by side in one
        # process the compiled decode steps were faster with it, 16-bit and W4 alike, and verify blocks no slower
        # (results/published/2026-12-07-h100-swiglu-epilogue; bench_components --swiglu-arm times it off). Set before capture
        self.swiglu_epilogue = True

    def set_attention(self, attention: str) -> None:
        """How decode steps and verify blocks attend over the cache: "sdpa" (torch's attention over
        the cache length a step reads, masked past each token's position) or "kernel" (the Triton
        kernels.decode_attention: each token reads its own positions only; needs the engine's
        kernels). Prefill always runs SDPA. Set before `capture`: a graph keeps what it captured."""
        if attention not in ("sdpa", "kernel"):
            raise QdflashError(f"attention={attention!r}: expected 'sdpa' or 'kernel'")
        if attention == "kernel" and not self.kernels:
            raise QdflashError("attention='kernel' needs the engine's Triton kernels (kernels=True, or 'auto' on CUDA)")
        if self.graphs:
            raise QdflashError("set_attention: graphs are captured already; set the attention before capture()")
        self.attention = attention

    def projections(self):
        """Every Projection of the layers (the parts of a Concat one by one)."""
        for w in self.layers:
            for p in w.values():
                if isinstance(p, Concat):
                    yield from p.parts
                elif isinstance(p, Projection):
                    yield p

    def tune_kernels(self) -> dict:
        """On CUDA with the kernels on: pick the W4A16 tiles and the 16-bit GEMV (where it beats cuBLAS)
        for this model's shapes by timing them (kernels.w4a16.tune, kernels.gemv.tune). Call before
        `capture`: a captured graph keeps the kernels it was captured with. Returns the timings."""
        if not self.kernels or self.device.type != "cuda":
            return {}
        if self.head_proj.words is not None:  # a packed 4-bit head: tuned among the W4 backends like the layers
            return tune_projections([*self.projections(), self.head_proj], (), self.dtype)
        return tune_projections(self.projections(), [self.lm_head.shape], self.dtype)

    def _rope_tables(self, dims: int, theta: float) -> None:
        self.cos, self.sin = rope_tables(dims, self.max_len, theta, self.device, self.dtype)

    def _check_feed(self, start: int, t: int) -> None:
        """Raise if `t` tokens cannot be fed from `start`."""

    def _after_feed(self, start: int, end: int) -> None:
        """Bookkeeping after tokens start..end-1 were fed."""

    def reset(self) -> None:
        """A new generation."""

    def rollback(self, keep: int) -> None:
        """Forget positions from `keep` on."""

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int, layer_ids: list[int] | None = None):
        """Logits [T, V] for tokens `ids` [T] at positions start..start+T-1, and the hidden states after
        `layer_ids` concatenated [T, k*H] (None without layer_ids). A captured graph runs the step where
        one exists for T tokens and these layer ids (the one reading the shortest cache that holds them)."""
        t = ids.shape[0]
        end = start + t
        if end > self.max_len:
            raise QdflashError(f"engine cache holds {self.max_len} positions; asked for {end} (build_engine(max_len=...))")
        self._check_feed(start, t)
        graph = self.graph_for(t, layer_ids, end)
        if graph is not None:
            out = graph(ids, start)
        else:
            positions = torch.arange(start, end, device=ids.device)
            out = self._step(ids, positions, end, layer_ids, exact=True)
        self._after_feed(start, end)
        return out

    def graph_for(self, t: int, layer_ids, end: int, tree: bool = False):
        """The captured step for `t` tokens and these layer ids (`tree`: of a tree's nodes) that reads the
        shortest cache length holding `end` positions, or None."""
        key = _key(layer_ids)
        fit = [n for (tokens, ids, n, kind) in self.graphs if tokens == t and ids == key and n >= end and kind == tree]
        return self.graphs[(t, key, min(fit), tree)] if fit else None

    def tree_caches(self) -> list[torch.Tensor] | None:
        """The attention caches [layers, kv_heads, max_len, D] that `keep_nodes` rearranges; None: this engine
        cannot verify a tree (a recurrent layer's state cannot be kept per branch)."""
        return None

    @torch.no_grad()
    def forward_tree(self, ids: torch.Tensor, start: int, parents: list[int], layer_ids: list[int] | None = None):
        """`forward` of a tree's nodes `ids` [T] (node i a child of node parents[i]; -1: of the cache's last
        token, parents first), written to slots start..start+T-1 at rotary positions start + depth - 1, each
        attending the cache before `start` and its own ancestors. `keep_nodes` then keeps a path of them."""
        if self.tree_caches() is None:
            raise QdflashError(f"{type(self).__name__} cannot verify a tree: its recurrent layers keep one state")
        t = ids.shape[0]
        end = start + t
        if end > self.max_len:
            raise QdflashError(f"engine cache holds {self.max_len} positions; asked for {end} (build_engine(max_len=...))")
        depths = torch.tensor(tree_depths(parents), device=ids.device) - 1  # the first node sits at `start`
        bits = torch.tensor(tree_bits(parents), device=ids.device)
        graph = self.graph_for(t, layer_ids, end, tree=True)
        if graph is not None:
            return graph(ids, start, depths, bits)
        return self._step(ids, start + depths, end, layer_ids, slots=torch.arange(start, end, device=ids.device),
                          tree=bits)

    def keep_nodes(self, start: int, nodes: list[int]) -> None:
        """After `forward_tree` at `start`: the K / V of `nodes` (a path, in order) become positions start..;
        the cache's length is the caller's (a rollback is a new length)."""
        index = torch.tensor(nodes, device=self.device) + start
        for cache in self.tree_caches():
            cache[:, :, start : start + len(nodes)] = cache.index_select(2, index)

    def capture(self, token_counts: list[int], layer_ids: list[int] | None = None, cuda_graphs: bool = True,
                compile=False, lengths: list[int] | None = None, tree: bool = False) -> None:
        """Capture one CUDA graph per number of tokens (e.g. [1, block size]) and cache length for
        steps that return the features of `layer_ids` (before a generation: see CapturedStep).
        `lengths`: how much of the cache each graph's attention reads (default: cache_buckets(), powers
        of two up to max_len: a step reads at most twice the KV it needs, not the whole cache).
        cuda_graphs=False runs the same static-shape step eagerly (the CPU; a check of the graph path).
        compile=True captures the step as compiled by torch.compile (fused elementwise work); any other
        true value is the torch.compile backend (the CPU tests trace with "aot_eager"). `tree`: the steps of
        `forward_tree` (a tree's nodes) instead."""
        from .graphs import CapturedStep, StaticStep

        # the kernel reads each token's own length whatever a graph was captured for: one length does
        lengths = sorted(lengths or ([self.max_len] if self.attention == "kernel" else cache_buckets(self.max_len)))
        step, steps = self._step, len(token_counts) * len(lengths)
        if compile:
            options = self.inductor_options | ({"triton.enable_pdl": True} if self.pdl else {})
            step = compiled_step(self._step, compile, options)
            allow_compiles(steps)
        from ..kernels import pdl, pdl_supported

        before = dynamo_counts()
        with pdl(self.pdl and pdl_supported(self.device)):  # the graphs record their launches as they are made now
            for t in token_counts:
                for n in lengths:
                    self.graphs[(t, _key(layer_ids), n, tree)] = (
                        CapturedStep(self, t, layer_ids, n, step=step, tree=tree) if cuda_graphs
                        else StaticStep(self, t, layer_ids, n, step=step, tree=tree))
        done = compiled_since(before)  # (a CUDA graph's warm-up compiled each step; a StaticStep compiles at its first call)
        if compile and (done["graph_breaks"] or done["recompile_limits"] or done["graphs"] > steps):
            log.warning("compiled steps for %s tokens: %d graphs for %d steps, %d graph breaks (%s), %d recompile "
                        "limits hit", token_counts, done["graphs"], steps, sum(done["graph_breaks"].values()),
                        "; ".join(f"{n} x {reason}" for reason, n in done["graph_breaks"].items()),
                        len(done["recompile_limits"]))


# inductor's options for a compiled step (compile=True). Why multi_kernel: inductor makes a reduction over more than
# 1,024 elements (each RMSNorm of a 2,560-wide model) a looped kernel that reads its rows twice, one load after the
# other, where a step's 1-16 rows leave a kernel bound by those loads' latency, not by bytes; with multi_kernel it
# also generates the persistent form (rows read once; up to 16 x that size) and keeps, kernel by kernel, whichever
# ran faster at its first call (a captured graph's warmup, before its capture).
INDUCTOR_OPTIONS = {"triton.multi_kernel": 1}


def compiled_step(fn, compile, options: dict | None = None):
    """`fn` through torch.compile with static shapes: compile=True (or "inductor") with inductor and `options`
    (default INDUCTOR_OPTIONS), any other true value as the torch.compile backend (the CPU tests trace with
    "aot_eager")."""
    if compile not in (True, "inductor"):
        return torch.compile(fn, dynamic=False, backend=compile)
    options = dict(INDUCTOR_OPTIONS if options is None else options)
    if options.get("triton.multi_kernel"):
        # the picks stay in this process (each benchmarks its kernels again at their first call): with torch 2.11 and
        # Triton 3.6, keying the on-disk pick by a kernel that an earlier compile made (a drafter step compiled after a
        # target step: the same norm kernels) fails (`JITFunction.cache_key` on a kernel prepared for pickling). An
        # environment variable, so it holds for every compile of this process and its children (docs/gpu.md)
        os.environ.setdefault("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "1")
    return torch.compile(fn, dynamic=False, options=options)


class _RecompileLimits(logging.Handler):
    """Dynamo's warnings that a piece of code hit its recompile limit, in this process: past it the piece runs
    uncompiled, which dynamo only logs (no counter holds it)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:  # "torch._dynamo hit config.recompile_limit (N)", the function, the last reason
            self.hits.append(" / ".join(line.strip() for line in message.splitlines()[:3])[:300])


_RECOMPILE_LIMITS = _RecompileLimits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(_RECOMPILE_LIMITS)


def dynamo_counts() -> tuple[dict, int, int]:
    """Dynamo's graph breaks so far in this process (reason -> count), the graphs it compiled and its recompile-limit
    warnings, for `compiled_since`."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"], len(_RECOMPILE_LIMITS.hits)


def compiled_since(before: tuple[dict, int, int]) -> dict:
    """What dynamo did since `before` (`dynamo_counts()`): `graphs`, the graphs it compiled (a step that compiled as
    one graph: 1); `graph_breaks`, reason (its first line and debug context: what dynamo could not trace) -> count;
    `recompile_limits`, its warnings that a piece hit the recompile limit (past it, that piece runs uncompiled). Why:
    a compiled step meant as one graph that breaks runs its pieces as separate graphs, unfused around each break
    (results/published/2026-12-04-h200-components-marlin: 1,151 kernels a step instead of 635 at a break per Marlin
    projection; results/published/2026-12-06-h100-gdn-replay: a GDN layer's closure recompiled per layer until the
    limit), and none of this is an error."""
    breaks, graphs, limits = dynamo_counts()
    out = {}
    for reason, count in breaks.items():
        if count > before[0].get(reason, 0):
            lines = [part.strip() for part in reason.strip().splitlines()]
            context = [part for part in lines if part.startswith("Developer debug context:")]
            line = " / ".join(lines[:1] + context)[:300]
            out[line] = out.get(line, 0) + count - before[0].get(reason, 0)
    return {"graphs": graphs - before[1], "graph_breaks": out, "recompile_limits": _RECOMPILE_LIMITS.hits[before[2]:limits]}


_COMPILES = [0]  # compiled steps asked for in this process (allow_compiles)


def allow_compiles(count: int) -> None:
    """Raise dynamo's recompile limit for `count` more compiled steps. Every (tokens, cache length)
    graph and every engine is one more compile of the same `_step` code, and past the limit (8 by
    default) dynamo silently runs the rest uncompiled: a 4-length, 2-size capture of two engines
    already needs 16."""
    import torch._dynamo.config as dynamo_config

    _COMPILES[0] += count
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 + _COMPILES[0])


def cache_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """Powers of two from `smallest`, then max_len itself."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def _key(layer_ids: list[int] | None) -> tuple[int, ...] | None:
    return None if layer_ids is None else tuple(layer_ids)
