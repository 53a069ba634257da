"""Batched response generation with transformers' `generate`, batch > 1, left padding; or on the lean
engine (`generate_on_engine`: qdflash.engine.batched, continuous batching, CUDA graphs), which
`resolve_backend` picks where it can run.

Why it is faster than a plain loop over `generate`: prompts are sorted by length (little padding),
batches are large, and on a GPU an optional static KV cache of one fixed size lets `generate`
compile its decode step once and replay it for every batch.

Sampling with `keys` (one integer per prompt) draws each prompt's tokens from noise that depends only
on (seed, key, step), not on the batch the prompt lands in or the random state before it
(`KeyedSampler`). So a prompt gets the same response whether the data is generated in one job or
sharded over many (qdflash.stages.prepare_data `shard.*` + merge_data).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..errors import QdflashError
from ..models import synchronize

log = logging.getLogger(__name__)


@dataclass
class Sampling:
    """`temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class Generation:
    token_ids: list[int]  # new tokens, up to and including the stop token when there is one
    finish_reason: str  # "stop" (an EOS id was produced) or "length" (max_new_tokens reached)


@dataclass
class GenerationStats:
    prompts: int = 0
    new_tokens: int = 0  # tokens kept (up to EOS), the useful output
    padded_slots: int = 0  # batch x steps actually run, incl. finished rows and padding
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def cut_at_stop(row: list[int], eos_ids: set[int]) -> Generation:
    for j, tok in enumerate(row):
        if tok in eos_ids:
            return Generation(row[: j + 1], "stop")
    return Generation(row, "length")


def _int64(value: int) -> int:
    """A Python int wrapped to a signed 64-bit value (what int64 tensor arithmetic wraps to)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic; logical shifts by masking): a
    counter-based hash, so the noise for (key, step, token) is computed, not drawn in sequence."""
    def shr(v, n):  # logical right shift of a two's-complement int64
        return (v >> n) & ((1 << (64 - n)) - 1)

    x = (x ^ shr(x, 30)) * -4658895280553007687   # 0xbf58476d1ce4e5b9 as int64
    x = (x ^ shr(x, 27)) * -7723592293110705685   # 0x94d049bb133111eb as int64
    return x ^ shr(x, 31)


def keyed_uniform(keys: torch.Tensor, step, vocab: int, seed: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """U(0, 1) noise [len(keys), vocab] that depends only on (seed, key, step, token id).
    `step`: an int, or a tensor [len(keys)] (rows at different steps: the batched engine; int64
    arithmetic wraps as the Python int is wrapped, so both give the same numbers). `token_ids`
    [len(keys), K]: the noise of those tokens only (the engine's top-k candidates), else of 0..vocab-1."""
    golden = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64
    if torch.is_tensor(step):
        offset = (step.to(torch.int64) + _int64(seed * 1_000_003)) * 6364136223846793005
    else:
        offset = _int64((seed * 1_000_003 + step) * 6364136223846793005)
    base = _mix64(keys.to(torch.int64) * golden + offset)
    if token_ids is None:
        token_ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    x = _mix64(base[:, None] + token_ids.to(torch.int64) * golden)
    return ((x >> 11) & ((1 << 53) - 1)).to(torch.float64).div_(float(1 << 53)).clamp_(1e-12, 1 - 1e-12)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest set of most likely tokens whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    ordered, index = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
    return logits.masked_fill(drop.scatter(-1, index, drop), float("-inf"))


def gumbel_scores(logits: torch.Tensor, keys: torch.Tensor, step, seed: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log p + g with g = -log(-log u), u keyed (`keyed_uniform`): its argmax is a sample of p
    (the Gumbel-max trick). `logits`: already tempered and filtered."""
    u = keyed_uniform(keys, step, logits.shape[-1], seed, token_ids)
    return logits.log_softmax(-1) + (-torch.log(-torch.log(u))).to(logits.dtype)


def sample_keyed(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, sampling: Sampling, seed: int) -> torch.Tensor:
    """The tokens [B] that `KeyedSampler` makes transformers pick, for logits [B, V] of rows at steps
    [B] (the batched engine's sampler: on the GPU, inside its captured step). With top-k, only the k
    candidates are tempered, filtered and given noise (the same noise: it depends on the token id),
    not the whole vocabulary; the one difference is a tie at the k-th logit, which KeyedSampler keeps
    in (k+1 candidates) and topk does not."""
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        logits, token_ids = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1)
        scores = gumbel_scores(top_p_filter(logits, sampling.top_p), keys, steps, seed, token_ids)
        return token_ids.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    return gumbel_scores(top_p_filter(logits, sampling.top_p), keys, steps, seed).argmax(-1)


class KeyedSampler:
    """A logits processor that turns greedy `generate` into sampling at `temperature` with top-k /
    top-p, by the Gumbel-max trick: argmax(log p + g) with g = -log(-log u) is a sample of p. u comes
    from `keyed_uniform`, so each row's sample depends on its key and step only (batch-invariant)."""

    def __init__(self, sampling: Sampling, keys: list[int], seed: int, prompt_width: int):
        self.sampling, self.seed, self.width = sampling, seed, prompt_width
        self.keys = torch.tensor(keys, dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width  # tokens generated so far (the same for every row)
        logits = scores.float() / self.sampling.temperature
        if self.sampling.top_k > 0:
            kth = logits.topk(min(self.sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return gumbel_scores(top_p_filter(logits, self.sampling.top_p), self.keys.to(scores.device), step, self.seed)


def _sampling_kwargs(sampling: Sampling) -> dict:
    if sampling.greedy:
        # explicit Nones silence generation_config defaults that only apply to sampling
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else None,
    }


@torch.inference_mode()
def generate_batched(
    model,
    prompts: list[list[int]],
    *,
    pad_id: int,
    eos_ids: list[int],
    max_new_tokens: int,
    batch_size: int,
    sampling: Sampling,
    seed: int = 0,
    sort_by_length: bool = True,
    static_cache_len: int | None = None,
    desc: str = "generate",
    progress: bool = True,
    keys: list[int] | None = None,
) -> tuple[list[Generation], GenerationStats]:
    """Generate for every prompt (token-id lists); results come back in the prompts' order.

    `keys`: one integer per prompt; when sampling, each prompt's tokens then depend on (seed, its key)
    only, not on batching or sharding (KeyedSampler). Without keys, transformers samples from the
    global generator seeded once with `seed`.

    `static_cache_len`: when set, every batch uses a static KV cache of exactly this many positions
    (so the compiled decode step is reused; transformers compiles it for static caches on a GPU);
    ignored when there are fewer prompts than one batch.
    """
    device = next(model.parameters()).device
    if len(prompts) < batch_size:
        # fewer prompts than one batch (a small held-out split): compiling a static cache for a new,
        # one-off batch shape costs more than it saves (its compile takes longer than the generation)
        static_cache_len = None
    batch_size = max(1, min(batch_size, len(prompts)))  # no filler rows when there are fewer prompts
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if sort_by_length else list(range(len(prompts)))
    results: list[Generation | None] = [None] * len(prompts)
    stats = GenerationStats(prompts=len(prompts))
    eos_set = set(eos_ids)
    torch.manual_seed(seed)
    keyed = keys is not None and not sampling.greedy
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
    extra = _sampling_kwargs(Sampling(0.0) if keyed else sampling)  # keyed: greedy over the sampler's scores
    if static_cache_len:
        extra["cache_implementation"] = "static"

    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    synchronize(device)
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        idx = order[first : first + batch_size]
        rows = list(idx)
        if static_cache_len:
            # every batch the same size, so the compiled decode step is replayed, never recompiled;
            # the filler rows (copies of the batch's last prompt) are dropped afterwards
            rows += [idx[-1]] * (batch_size - len(idx))
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, i in enumerate(rows):  # left padding: generation continues at the right edge
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        kwargs = dict(extra)
        if keyed:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([KeyedSampler(sampling, [keys[i] for i in rows], seed, width)])
        if static_cache_len:
            kwargs["max_cache_len"] = max(static_cache_len, width + max_new_tokens)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
            **kwargs,
        )
        new = out[:, width:].tolist()
        stats.padded_slots += len(rows) * len(new[0]) if new else 0
        for row, i in enumerate(idx):
            results[i] = cut_at_stop(new[row], eos_set)
            stats.new_tokens += len(results[i].token_ids)
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{stats.new_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    synchronize(device)
    stats.seconds = time.perf_counter() - start
    bar.close()
    log.info(
        "%s: %d prompts, %d new tokens in %.1f s (%.0f tokens/s, batch %d%s)",
        desc, stats.prompts, stats.new_tokens, stats.seconds, stats.tokens_per_s, batch_size,
        ", static cache" if static_cache_len else "",
    )
    return results, stats  # type: ignore[return-value]


BACKENDS = ("auto", "engine", "transformers")


def resolve_backend(target, backend: str, max_len: int, key: str = "data.generation.backend"):
    """("engine", its engine) where batched generation on the lean engine can run, else
    ("transformers", None). `auto`: the engine wherever the target's family has a batched one (on the
    GPU for its CUDA graphs; on the CPU too, where it was measured faster than transformers' generate
    at the default and ci profiles' batches: results/published/2026-12-01-h200-generate/PROVENANCE.md), else
    transformers; `engine`: the engine or an error saying why not."""
    if backend not in BACKENDS:
        raise QdflashError(f"{key} = {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "transformers":
        return "transformers", None
    from ..engine import build_engine
    from ..engine.batched import batched_supported

    try:
        engine = build_engine(target, max_len=max_len)
        if not batched_supported(engine):
            raise QdflashError(f"no batched generation for {type(engine).__name__}")
    except QdflashError as err:
        if backend == "engine":
            raise
        log.info("generation through transformers' generate: %s", err)
        return "transformers", None
    return "engine", engine


def generate_on_engine(engine, prompts: list[list[int]], *, eos_ids: list[int], max_new_tokens: int, batch_size: int,
                       sampling: Sampling, seed: int, keys: list[int] | None, max_len: int, prefill_tokens: int = 8192,
                       compile: bool = False, desc: str = "generate", progress: bool = True) -> tuple[list[Generation], GenerationStats]:
    """`generate_batched`'s contract on the lean engine (qdflash.engine.batched): the same tokens
    (greedy: the target's argmax; sampling: the same keyed noise), `batch_size` rows kept full by
    refilling finished ones."""
    from ..engine.batched import BatchGenerator

    rows = max(1, min(batch_size, len(prompts)))
    gen = BatchGenerator(engine, rows=rows, max_len=max_len, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                         sampling=sampling, seed=seed, prefill_tokens=prefill_tokens, compile=compile)
    results, stats = gen.generate(prompts, keys, progress=progress, desc=desc)
    log.info("%s: %d prompts, %d new tokens in %.1f s (%.0f tokens/s, engine, %d rows)",
             desc, stats.prompts, stats.new_tokens, stats.seconds, stats.tokens_per_s, rows)
    return results, stats
