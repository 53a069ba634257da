"""Batched generation on the lean engine: many prompts at once, continuous batching, one CUDA graph
per decode step.

    gen = BatchGenerator(engine, rows=256, max_len=1280, eos_ids=[2], max_new_tokens=256,
                         sampling=Sampling(0.7, 0.8, 20), seed=0)
    results, stats = gen.generate(prompts, keys)      # results in the prompts' order

The engine's weights are shared; the rows get their own static KV cache [layers, rows, kv_heads,
max_len, D]. Every row is its own sequence from position 0 (no left padding): per-row positions,
and attention masked per row past its own position (`llama.rows_attention`), so prompts of different
lengths decode in one fixed-shape step. On the GPU that step (the layers, the LM head, the keyed
sampler and the bookkeeping of which row stopped) is one captured graph per (batch bucket, cache
length read); the host only looks every `sync_every` steps.

Continuous batching: a row that stops (an EOS id, or max_new_tokens) is harvested at the next look
and its slot refilled with a waiting prompt, prefilled in chunks of at most `prefill_tokens` tokens
(rows x chunk) so memory stays bounded. Rows stopped between looks keep running in place, writing
only their own slot, and record nothing. Once no prompt waits, the rows still running are moved to
the lowest slots so a smaller batch bucket's graph runs them.

Sampling is `data.generate.sample_keyed`: each prompt's tokens depend on (seed, its key, step) only,
exactly as transformers' generate with `KeyedSampler` draws them, so batching, refilling and
sharding change nothing. Greedy decoding is the argmax of the same logits batch-1 decoding gets.

Llama-layout engines (llama, Qwen2) and the Qwen3.5 hybrid: its Gated DeltaNet layers keep a
recurrent state and a rolling conv input per row (`LeanQwen35.delta_net_rows`, the torch recurrence
on every device), zeroed when a slot is refilled; a hybrid prompt is prefilled one row at a time
(right padding would run the recurrence over pad tokens).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..data.generate import Generation, GenerationStats, Sampling, cut_at_stop, sample_keyed
from ..errors import QdflashError
from .base import allow_compiles, rows_attention
from .llama import LeanLlama
from .qwen3_5 import LeanQwen35


def batched_supported(engine) -> bool:
    return isinstance(engine, (LeanLlama, LeanQwen35))


def buckets(largest: int, smallest: int) -> list[int]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    out, n = [], smallest
    while n < largest:
        out.append(n)
        n *= 2
    return out + [largest]


class BatchGenerator:
    def __init__(self, engine, rows: int, max_len: int, eos_ids: list[int], max_new_tokens: int,
                 sampling: Sampling, seed: int = 0, prefill_tokens: int = 8192, sync_every: int = 8,
                 cuda_graphs: bool | None = None, smallest_batch: int = 8, smallest_len: int = 128,
                 compile: bool | str = False):
        if not batched_supported(engine):
            raise QdflashError(f"batched generation runs llama-layout and Qwen3.5 engines; not {type(engine).__name__}")
        if max_len > engine.max_len:
            raise QdflashError(f"batched max_len {max_len} > the engine's rope tables ({engine.max_len} positions)")
        self.engine, self.rows, self.max_len = engine, rows, max_len
        self.max_new, self.sampling, self.seed = max_new_tokens, sampling, seed
        self.prefill_tokens, self.sync_every = prefill_tokens, sync_every
        device, e = engine.device, engine
        self.device = device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.hybrid = isinstance(engine, LeanQwen35)
        types = e.types if self.hybrid else ["full_attention"] * len(e.layers)
        shape = (rows, e.kv_heads, max_len, e.head_dim)
        self.k_cache = {i: torch.zeros(shape, device=device, dtype=e.dtype) for i, t in enumerate(types) if t == "full_attention"}
        self.v_cache = {i: torch.zeros(shape, device=device, dtype=e.dtype) for i in self.k_cache}
        self.conv_state, self.state = {}, {}  # Gated DeltaNet layers: per row
        for i, t in enumerate(types):
            if t == "linear_attention":
                la = e.layers[i]["la"]
                self.conv_state[i] = torch.zeros(rows, la.conv_kernel_size - 1, la.conv_dim, device=device, dtype=e.dtype)
                self.state[i] = torch.zeros(rows, *e.state[i].shape, device=device)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
        # per-slot state, read and written in place by the captured step
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)   # last token, not yet fed
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)      # its position
        self.steps = torch.zeros(rows, dtype=torch.long, device=device)    # tokens generated (the noise's step)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)      # stopped, or empty
        self.out = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
        self.slot_ids = torch.arange(rows, device=device)
        self.batch_buckets = buckets(rows, min(smallest_batch, rows))
        # the Triton decode attention (where the engine runs its kernels) reads each row's own length:
        # then one graph per batch bucket; else a masked attention over a bucket of cache lengths
        self.kernel_attention = bool(engine.kernels)
        self.len_buckets = [max_len] if self.kernel_attention else buckets(max_len, min(smallest_len, max_len))
        self.graphs = {}  # (batch bucket, cache length read) -> captured decode step (CUDA)
        # one memory pool for all of them: a step's intermediates die with it (the state lives in
        # the buffers above), so the graphs can share it instead of holding one pool each
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # torch.compile fuses the step's ~10 elementwise launches per layer (norms, rope, residual adds,
        # SiLU x up, the cache writes, the sampler's bookkeeping) into a few kernels; the graph then
        # records the compiled step. The batch size is a Python int of the step, so dynamo compiles
        # once for the first bucket and once more with a symbolic batch for all the others.
        # `compile`: True (inductor) or a torch.compile backend name (the tests trace with "aot_eager").
        # The compiled function is the class's, shared by every generator (`_compiled_decode`): one
        # stored on the instance (a bound method) would make the generator a reference cycle that
        # outlives its last use until the garbage collector runs, with its whole KV cache (a
        # multi-turn data stage ran out of GPU memory holding two turns' caches that way).
        self.compile = compile
        if compile:
            allow_compiles(2)
        self.decode_steps = 0   # decode steps run by the last generate()
        self.kv_read = 0        # sum over its steps of rows x cache positions read (bandwidth accounting)

    # ------------------------------------------------------------------ the step (captured on CUDA)

    def _decode(self, b: int, attend_len: int) -> None:
        """One token for slots 0..b-1: feed each row's last token, sample the next, record it."""
        positions = self.pos[:b, None]

        def attend(i, q, k, v):
            return rows_attention(q, k, v, self.k_cache[i], self.v_cache[i], positions, attend_len,
                                  kernel=self.kernel_attention)

        h, _ = self.engine.decoder(self.tokens[:b, None], positions, attend, **self._mix(slice(0, b)))
        nxt = sample_keyed(self.engine.head(h[:, -1]), self.keys[:b], self.steps[:b], self.sampling, self.seed)
        self._record(self.slot_ids[:b], nxt)

    def _mix(self, rows: slice) -> dict:
        """The hybrid decoder's Gated DeltaNet layers over these slots' states (views: updated in place)."""
        if not self.hybrid:
            return {}
        return {"mix": lambda i, w, x: self.engine.delta_net_rows(i, w, x, self.conv_state[i][rows], self.state[i][rows])}

    def _record(self, index: torch.Tensor, nxt: torch.Tensor) -> None:
        """Slots `index` take their sampled tokens `nxt`; stopped rows keep everything as it was."""
        done, steps = self.done[index], self.steps[index]
        live = ~done
        at = steps.clamp(max=self.max_new - 1)
        self.out[index, at] = torch.where(live, nxt, self.out[index, at])
        stop = (nxt[:, None] == self.eos[None, :]).any(-1) | (steps + 1 >= self.max_new)
        self.tokens[index] = torch.where(live, nxt, self.tokens[index])
        self.pos[index] = self.pos[index] + live
        self.steps[index] = steps + live
        self.done[index] = done | stop

    def _step(self, b: int, attend_len: int) -> None:
        if self.compile:
            _compiled_decode("inductor" if self.compile is True else self.compile)(self, b, attend_len)
        else:
            self._decode(b, attend_len)

    def _run_decode(self, b: int, attend_len: int) -> None:
        if not self.cuda_graphs:
            with torch.no_grad():
                self._step(b, attend_len)
            return
        key = (b, attend_len)
        if key not in self.graphs:
            from ..cudagraph import capture

            # warm-up and capture run the step for real: keep the state, and let them write KV only
            # where the real step will (each row's own position, the same token)
            state = [self.tokens, self.pos, self.steps, self.done, self.out, *self.conv_state.values(), *self.state.values()]
            saved = [t.clone() for t in state]  # (recurrent states too: a step reads them before writing)
            self.graphs[key] = capture(lambda: self._step(b, attend_len), 2, self.device, self._pool)[0]
            for t, s in zip(state, saved):
                t.copy_(s)
        self.graphs[key].replay()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every projection and the LM head)."""
        e = self.engine
        return sum(p.nbytes for p in e.projections()) + e.head_proj.nbytes

    def kv_bytes_per_position(self) -> int:
        return sum(c[0, :, 0].numel() * 2 * c.element_size() for c in self.k_cache.values())

    # ------------------------------------------------------------------ prefill (eager, chunked)

    @torch.no_grad()
    def _prefill(self, slots: list[int], prompts: list[list[int]], keys: list[int]) -> None:
        """Fill `slots` with new prompts: KV of every prompt token, first token sampled (step 0)."""
        device, e = self.device, self.engine
        per_call = 1 if self.hybrid else max(1, self.prefill_tokens // max(len(p) for p in prompts))
        for s in slots:  # a new sequence: zero recurrent state and conv history
            for t in (*self.conv_state.values(), *self.state.values()):
                t[s].zero_()
        for first in range(0, len(slots), per_call):
            group, batch = slots[first : first + per_call], prompts[first : first + per_call]
            lengths = torch.tensor([len(p) for p in batch], device=device)
            width = int(lengths.max())
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for r, p in enumerate(batch):  # right padding: pad positions are past each row's end, so
                ids[r, : len(p)] = torch.tensor(p)  # masked until decoding overwrites them
            ids = ids.to(device)
            rows = torch.tensor(group, device=device)
            chunk = max(1, self.prefill_tokens // len(batch))
            last = torch.empty(len(batch), e.lm_head.shape[0], device=device, dtype=e.dtype)
            for start in range(0, width, chunk):
                end = min(start + chunk, width)
                positions = torch.arange(start, end, device=device)[None, :].expand(len(batch), -1)

                def attend(i, q, k, v):
                    return rows_attention(q, k, v, self.k_cache[i], self.v_cache[i], positions, end, rows)

                mix = self._mix(slice(group[0], group[0] + 1)) if self.hybrid else {}  # hybrid: one row per call
                h, _ = e.decoder(ids[:, start:end], positions, attend, **mix)
                ends_here = ((lengths - 1 >= start) & (lengths - 1 < end)).nonzero()[:, 0]
                if ends_here.numel():  # the LM head only where a prompt ends (not over every token)
                    last[ends_here] = e.head(h[ends_here, lengths[ends_here] - 1 - start])
            self.keys[rows] = torch.tensor(keys[first : first + per_call], device=device)
            self.steps[rows] = 0
            self.pos[rows] = lengths - 1  # _record advances it to the first new token's position
            self.done[rows] = False
            self._record(rows, sample_keyed(last, self.keys[rows], self.steps[rows], self.sampling, self.seed))

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: list[list[int]], keys: list[int] | None = None, progress: bool = True,
                 desc: str = "generate") -> tuple[list[Generation], GenerationStats]:
        keys = list(range(len(prompts))) if keys is None else keys
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        too_long = [i for i, p in enumerate(prompts) if len(p) + self.max_new > self.max_len or not p]
        if too_long:
            raise QdflashError(f"{len(too_long)} prompts (e.g. #{too_long[0]}) are empty or longer than "
                               f"max_len {self.max_len} - max_new_tokens {self.max_new}")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths prefill together
        waiting = list(reversed(order))  # pop() takes the longest first
        occupant: list[int | None] = [None] * self.rows
        results: list[Generation | None] = [None] * len(prompts)
        stats = GenerationStats(prompts=len(prompts))
        self.done.fill_(True)
        self.decode_steps = self.kv_read = 0
        bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
        _sync(self.device)
        started = time.perf_counter()
        b = self.rows
        while True:
            done = self.done.tolist()  # the host's one look per `sync_every` steps
            finished = [s for s in range(self.rows) if occupant[s] is not None and done[s]]
            if finished:
                steps, out = self.steps.tolist(), self.out[finished].tolist()
                for s, row in zip(finished, out):
                    results[occupant[s]] = cut_at_stop(row[: steps[s]], set(self.eos.tolist()))
                    stats.new_tokens += steps[s]
                    occupant[s] = None
                bar.update(len(finished))
                bar.set_postfix(tok_s=f"{stats.new_tokens / max(time.perf_counter() - started, 1e-9):.0f}")
            free = [s for s in range(self.rows) if occupant[s] is None]
            # refill once enough slots are free to make a prefill worth its launches, or at the end
            if waiting and free and (len(free) >= max(1, self.rows // 8) or len(free) == self.rows or len(waiting) <= len(free)):
                take = free[: len(waiting)]
                new = [waiting.pop() for _ in take]
                for s, i in zip(take, new):
                    occupant[s] = i
                self._prefill(take, [prompts[i] for i in new], [keys[i] for i in new])
            running = [s for s in range(self.rows) if occupant[s] is not None]
            if not running:
                break
            if not waiting:
                running = self._compact(running, occupant)
            b = next(n for n in self.batch_buckets if n > running[-1])
            # every row feeds at most sync_every more positions before the next look
            reach = int(self.pos[torch.tensor(running, device=self.device)].max()) + self.sync_every + 1
            attend_len = next(n for n in self.len_buckets if n >= min(reach, self.max_len))
            for _ in range(self.sync_every):
                self._run_decode(b, attend_len)
            stats.padded_slots += b * self.sync_every
            self.decode_steps += self.sync_every
            self.kv_read += (int(self.pos[:b].sum()) + b * self.sync_every // 2 if self.kernel_attention
                             else b * attend_len) * self.sync_every
        _sync(self.device)
        stats.seconds = time.perf_counter() - started
        bar.close()
        return results, stats  # type: ignore[return-value]

    def _compact(self, running: list[int], occupant: list) -> list[int]:
        """Move running rows into the lowest free slots (KV and state), so the smallest batch bucket
        that holds them can run; only when that bucket is smaller than the current one."""
        target = next(n for n in self.batch_buckets if n >= len(running))
        if running[-1] < target:
            return running
        low_free = [s for s in range(len(running)) if occupant[s] is None]
        high = [s for s in running if s >= len(running)]
        for dst, src in zip(low_free, high):
            for t in (*self.k_cache.values(), *self.v_cache.values(), *self.conv_state.values(), *self.state.values(),
                      self.tokens, self.pos, self.steps, self.keys, self.done, self.out):
                t[dst] = t[src]
            self.done[src] = True
            occupant[dst], occupant[src] = occupant[src], None
        return [s for s in range(self.rows) if occupant[s] is not None]


_COMPILED: dict = {}  # backend -> BatchGenerator._decode through torch.compile (one per process)


def _compiled_decode(backend: str):
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(BatchGenerator._decode, dynamic=None, backend=backend)
    return _COMPILED[backend]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
