"""Speed of speculative decoding against autoregressive baselines, batch 1, measured side by side.

Every method runs on the same prompts in the same process, one after the other, after a warm-up.
Greedy outputs of every speculative run are compared with this module's autoregressive output of the
same target (same dtype): a mismatch in float32 is a bug; in bfloat16 the relative top-2 margin of
the reference at the first divergence says whether it was a near-tie (kernels for 1 and B rows may
round differently) or a bug (margin above `MARGIN_BUG`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data.chat import render_prompt_ids
from .data.jsonl import read_jsonl
from .errors import QdflashError
from .models import synchronize
from .spec import GenerationResult, RoundTimer, autoregressive_generate, speculative_generate, target_session, verify_length

log = logging.getLogger(__name__)

MARGIN_BUG = 1e-2  # relative top-2 logit margin above which a bf16 divergence is a bug
# The repetitive prompt (its own row: drafters look best on it): the sentence of the reference recipe's public
# latency harness (docs/recipe.md). Why not a lowercase one: the target answers a repeated sentence from its
# capital, so the cycle it writes then holds a token the prompt never had (" The" after "."), and a drafter that
# copies from the prompt misses it once per cycle. On the H200 no round passed 7 tokens on "the cat sat on the
# mat. " (results/published/2026-12-03-h200-qwen-repeat); this one starts with its capital, so every token of
# the answer's cycle is in the prompt.
FILLER = "The quick brown fox jumps over the lazy dog. "


@dataclass
class PromptCase:
    label: str          # category (chat / math / code / knowledge) or bucket (p64, p2048, ..., filler)
    ids: list[int]
    max_new_tokens: int
    text_from: str = ""  # a bucket prompt's text: "heldout", or "heldout+train" where held-out text ran short


@dataclass
class MethodResult:
    """Per-case results of one method, in case order."""

    runs: list[GenerationResult] = field(default_factory=list)
    peak_working_bytes: list[int] = field(default_factory=list)  # CUDA only: allocation peak above the start, per run
    touches: dict[int, GenerationResult] = field(default_factory=dict)  # case index -> this method's untimed first touch

    @property
    def outputs(self) -> list[list[int]]:
        return [r.tokens for r in self.runs]

    def subset(self, keep: list[bool]) -> "MethodResult":
        return MethodResult([r for r, k in zip(self.runs, keep) if k], [b for b, k in zip(self.peak_working_bytes, keep) if k])

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.runs)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def acceptance(self) -> list[int]:
        return [n for r in self.runs for n in r.acceptance_lengths]


def prompt_set(cases) -> str:
    """A digest of the prompts a job measured (labels, token ids, new tokens): two jobs' rows compare
    only when they measured the same set (qdflash.report.select_fastest)."""
    digest = json.dumps([[c.label, list(c.ids), c.max_new_tokens] for c in cases])
    return hashlib.sha256(digest.encode()).hexdigest()[:16]


def category_cases(data_dir, tokenizer, per_category: int, max_new_tokens: int) -> list[PromptCase]:
    """The first held-out prompts of each category (held-out: never trained on)."""
    cases, seen = [], {}
    for row in read_jsonl(f"{data_dir}/heldout.jsonl"):
        if seen.get(row["category"], 0) >= per_category:
            continue
        seen[row["category"]] = seen.get(row["category"], 0) + 1
        cases.append(PromptCase(row["category"], render_prompt_ids(tokenizer, row["messages"][0]["content"]), max_new_tokens))
    return cases


def long_text(data_dir, tokenizer, n_tokens: int, splits: tuple[str, ...] = ("heldout", "train")) -> tuple[str, str]:
    """Real text of at least `n_tokens` tokens, and where it came from: the held-out prompts and their
    greedy answers first, which no drafter trained on (a drafter that has seen a text would recall it
    where the answer quotes it); the training split's prompts and answers only after them where the
    held-out ones are too short (the CPU profile's ~40 held-out answers hold ~9 K tokens): "heldout+train".
    `splits=("train",)`: how runs before 755f14b built them (scripts/investigations/recheck_divergence.py)."""
    parts, total = [], 0
    for split in splits:
        path = Path(data_dir) / f"{split}.jsonl"
        if not path.is_file():
            continue
        for row in read_jsonl(path):
            for text in (row["messages"][0]["content"], row["response"]):
                parts.append(text)
                total += len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if total >= n_tokens:
                return "\n\n".join(parts), "+".join(splits[: splits.index(split) + 1])
    return "\n\n".join(parts), "+".join(splits)


def bucket_cases(data_dir, tokenizer, buckets: list[list[int]], context_len: int, filler: bool,
                 text_splits: tuple[str, ...] = ("heldout", "train")) -> list[PromptCase]:
    """Prompts of about N tokens (a summarization request over real text), capped so that prompt +
    new tokens fit the model's context; plus the repetitive filler prompt at the largest length."""
    cases = []
    for prompt_tokens, new_tokens in buckets:
        n = min(prompt_tokens, context_len - new_tokens - 64)
        text, text_from = long_text(data_dir, tokenizer, n, text_splits)
        text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        body = tokenizer.decode(text_ids[: max(n - 40, 8)])
        ids = render_prompt_ids(tokenizer, f"Summarize this text in a few sentences.\n\n{body}")
        cases.append(PromptCase(f"p{prompt_tokens}" + ("" if n == prompt_tokens else f"(capped {n})"), ids, new_tokens,
                                text_from))
    if filler and buckets:
        prompt_tokens, new_tokens = buckets[-1]
        n = min(prompt_tokens, context_len - new_tokens - 64)
        unit = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
        ids = render_prompt_ids(tokenizer, "Continue: " + FILLER * max(1, (n - 20) // unit))
        cases.append(PromptCase("filler", ids, new_tokens))
    return cases


def top2_margin(target, prompt: list[int], generated: list[int]) -> float:
    """(top1 - top2) / |top1| of the logits from which the autoregressive reference chose its next
    token after `prompt` + `generated`: its own computation, replayed (prompt prefill, then one
    decode step per generated token, on the same engine session, graphs included). Not a fresh
    full-sequence forward: in bf16 that rounds differently from both decoding paths, so it would
    measure a third computation's near-tie instead of the reference's."""
    session = target_session(target)
    with torch.no_grad():
        logits, _ = session.feed(prompt)
        for token in generated:
            logits, _ = session.feed([token])
    top = logits[-1].float().topk(2).values
    return ((top[0] - top[1]) / top[0].abs().clamp_min(1e-9)).item()


def divergences(target, cases: list[PromptCase], reference: MethodResult, candidate: MethodResult) -> list[float | None]:
    """Per prompt: None where `candidate` equals the autoregressive `reference`, else the reference's top-2
    margin where they first diverge (a replay of its own computation: `top2_margin`)."""
    margins = []
    for case, ref, got in zip(cases, reference.outputs, candidate.outputs):
        if ref == got:
            margins.append(None)
            continue
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        margins.append(top2_margin(target, case.ids, ref[:first]))
    return margins


def tally(margins: list[float | None], fp32: bool) -> dict:
    """Mismatches among per-prompt `divergences` (any subset of them), and how many are bugs: every one in
    fp32, one whose margin exceeds MARGIN_BUG in bf16."""
    found = [m for m in margins if m is not None]
    return {"mismatches": len(found), "divergence_margins": [round(m, 6) for m in found],
            "mismatch_bugs": sum(1 for m in found if fp32 or m > MARGIN_BUG)}


def compare(target, cases: list[PromptCase], reference: MethodResult, candidate: MethodResult, fp32: bool) -> dict:
    """Mismatches of `candidate` against the autoregressive `reference`, with margins at divergence."""
    return tally(divergences(target, cases, reference, candidate), fp32)


def warmup_lengths(max_new_tokens: int) -> list[int]:
    """New-token counts a warm-up runs a prompt with: a short run, then the measured length. Two cache
    lengths, because `generate`'s compiled static cache compiles once per shape and then, at the
    second shape, again with dynamic shapes; only after that does a new prompt reuse the graph.
    With one short warm-up that second compilation fell into the first measured prompt (seconds
    against a fraction of a second per prompt after it: results/published/2026-11-30-h200-static-warmup)."""
    return sorted({min(max_new_tokens, 8), max_new_tokens})


def run_interleaved(methods: dict, cases: list[PromptCase], warmup: int = 1, touch: bool = False) -> dict[str, MethodResult]:
    """Every method on every prompt, the methods taking turns prompt by prompt, so that a change of
    machine load in the middle of the benchmark hits all methods alike (ratios stay fair). The turn
    order rotates by one method per prompt, so that no method always runs right after the same one:
    with a fixed order, autoregressive 16-bit decoding always followed transformers' `generate`
    (host-bound, the GPU mostly idle) and measured slower per prompt than the same kernels on the W8
    target's dense weights (results/published/2026-12-02-h200-qwen-w8, "Noticed"; the order is the
    suspect). Python's garbage collector runs before each turn, outside the timing, so that one method's
    garbage is not collected in another's. What is alive after the warm-up (models, tokenizers, engines,
    compiled code: ~0.4 M objects with two 0.5B targets) is frozen first (`gc.freeze`), so that those
    collections walk only what the turns made: a full collection of that heap took ~0.25 s on a laptop
    CPU, and that many turns' worth (~80-150 a job) fits the untimed time of the H200 benchmark jobs
    (results/published/2026-12-03-h200-qwen-recipe, "Changed since"; an estimate, not measured there).

    `touch`: before a prompt's timed turns, the turn's first method runs it once untimed (kept in that method's
    `touches`). Whatever ran a prompt first paid for it: on the H200 the first turn of every prompt took
    0.03-0.1 s longer than methods of the same tau after it, whichever method it was
    (results/published/2026-12-04-h200-qwen-fox, "The benchmark's first turn"), so a method's row depended on how
    often the rotation put it first. The touch makes every later turn a second visit of what the methods share
    (the engine methods' prompt shapes: one per prompt, whatever the target); transformers' `generate`
    (plain16, static16) runs shapes of its own, so its first turn on a prompt may still be a first visit for it. The
    touch's excess over the same method's timed run is what a first visit costs, reported by the job."""
    import gc

    from tqdm.auto import tqdm

    for name, fn in methods.items():
        started = time.perf_counter()
        for case in cases[:warmup]:  # compile / allocate / fill caches outside the measurement
            for n in warmup_lengths(case.max_new_tokens):
                fn(case.ids, n)
        log.info("warm-up %s: %.1f s", name, time.perf_counter() - started)
    results = {name: MethodResult() for name in methods}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    names = list(methods)
    gc.collect()
    gc.freeze()  # the long-lived objects move to the permanent generation until the turns are over
    try:
        for i, case in enumerate(tqdm(cases, desc="benchmark", unit="prompt")):
            turns = names[i % len(names):] + names[: i % len(names)]
            if touch:
                gc.collect()
                results[turns[0]].touches[i] = methods[turns[0]](case.ids, case.max_new_tokens)
            for name in turns:
                fn = methods[name]
                gc.collect()
                if cuda:  # what the run allocates on top of what is resident (weights, static caches)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                results[name].runs.append(fn(case.ids, case.max_new_tokens))
                if cuda:
                    results[name].peak_working_bytes.append(torch.cuda.max_memory_allocated() - start)
    finally:
        gc.unfreeze()
    return results


def plain_generate(target, ids: list[int], max_new_tokens: int, static: bool = False) -> GenerationResult:
    """transformers' own `generate` (greedy): dynamic cache = the unoptimized baseline (a); `static`:
    its static cache, which it compiles on a GPU (a')."""
    device = next(target.model.parameters()).device
    synchronize(device)
    started = time.perf_counter()
    out = target.model.generate(input_ids=torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_token_ids,
                                pad_token_id=target.tokenizer.pad_token_id,
                                **({"cache_implementation": "static"} if static else {}))
    synchronize(device)
    return GenerationResult(out[0, len(ids):].tolist(), seconds=time.perf_counter() - started)


def ar(target):
    return lambda ids, n: autoregressive_generate(target, [ids], n)


def round_parts(target, drafter, cases: list[PromptCase], reference: MethodResult, window=None,
                verify_tokens=None, verify_adaptive=False, no_repeat=False, tree_nodes=None) -> dict[str, float]:
    """Where a speculative round's time goes on `cases` (a profiling pass after the timed runs: its
    synchronizations cost time): ms per round of draft / verify / append / host, their sum, and that
    sum in decode steps of the target's autoregressive run `reference` on the same cases (its time
    after the prefill per token after the first)."""
    timer = RoundTimer(target.device)
    for case in cases:
        speculative_generate(target, drafter, [case.ids], case.max_new_tokens, window=window,
                             verify_tokens=verify_tokens, phases=timer, verify_adaptive=verify_adaptive, no_repeat=no_repeat,
                             tree_nodes=tree_nodes)
    per_round = timer.ms_per_round()
    parts = {f"{part}_ms": round(ms, 4) for part, ms in per_round.items()}
    decode_ms = 1e3 * sum(r.seconds - r.prefill_seconds for r in reference.runs) / max(
        sum(len(r.tokens) - 1 for r in reference.runs), 1)
    total = sum(per_round.values())
    return {**parts, "ms": round(total, 4), "decode_step_ms": round(decode_ms, 4),
            "in_decode_steps": round(total / max(decode_ms, 1e-9), 3), "rounds": timer.rounds}


def tau_pass(target, drafter, cases: list[PromptCase], window=None, verify_tokens=None, verify_adaptive=False,
             no_repeat=False, tree_nodes=None) -> dict:
    """Greedy speculative decoding of every case, untimed: per case label, the rounds, the tokens they
    committed and tau (tokens / rounds), and the same over all cases ("all"). A pooled tau of any set of
    labels is the sum of their tokens over the sum of their rounds."""
    from tqdm.auto import tqdm

    parts: dict[str, list[int]] = {}
    for case in tqdm(cases, desc="tau pass", unit="prompt"):
        out = speculative_generate(target, drafter, [case.ids], case.max_new_tokens, window=window,
                                   verify_tokens=verify_tokens, verify_adaptive=verify_adaptive, no_repeat=no_repeat,
                                   tree_nodes=tree_nodes)
        for label in (case.label, "all"):
            rounds, tokens = parts.get(label, [0, 0])
            parts[label] = [rounds + len(out.acceptance_lengths), tokens + sum(out.acceptance_lengths)]
    return {label: {"rounds": r, "tokens": t, "tau": round(t / max(r, 1), 4)} for label, (r, t) in parts.items()}


def spec(target, drafter, window=None, verify_tokens=None, verify_adaptive=False, no_repeat=False, tree_nodes=None):
    """Speculative decoding with the drafter `window` and the verify length `verify_tokens` (None:
    the whole block; qdflash.spec.verify_length checks it now, not at the first prompt), the whole
    block after a round that accepted that far where `verify_adaptive`, no draft repeating the draft
    before it where `no_repeat`, a tree of `tree_nodes` drafts instead of a chain where set."""
    verify_length(drafter, verify_tokens)
    return lambda ids, n: speculative_generate(target, drafter, [ids], n, window=window, verify_tokens=verify_tokens,
                                               verify_adaptive=verify_adaptive, no_repeat=no_repeat, tree_nodes=tree_nodes)


def reference_of(method: str) -> str:
    """The autoregressive method a speculative method's output is checked against: its own target's."""
    return "ar16" if method.startswith("spec16") else "ar_qad"


def keep_methods(methods: dict, keep, setting: str = "bench.methods") -> dict:
    """`methods` restricted to the names in `keep` (None: all), in their order. A name not among them, or a
    speculative method kept without the autoregressive run it is checked against, is an error that
    names the setting: a run that leaves the reference out could not say whether it is lossless."""
    if keep is None:
        return dict(methods)
    keep = list(keep)
    unknown = [name for name in keep if name not in methods]
    if unknown or not keep:
        raise QdflashError(f"{setting}={keep}: {', '.join(unknown) + ' not run by this job' if unknown else 'empty'}; "
                           f"its methods are {', '.join(methods)}")
    missing = sorted({reference_of(n) for n in keep if n.startswith("spec")} - set(keep))
    if missing:
        raise QdflashError(f"{setting}={keep}: add {', '.join(missing)}: every speculative output is checked "
                           "against its target's autoregressive output")
    return {name: fn for name, fn in methods.items() if name in keep}


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer (packed int4 words and scales
    included), except an input embedding table that the LM head does not share (a step reads one row)."""
    seen, total = set(), 0
    embedding = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    skip = None
    if embedding is not None and not (head is not None and getattr(head, "weight", None) is embedding.weight):
        skip = embedding.weight.data_ptr()
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() in seen or tensor.data_ptr() == skip:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def tensor_bytes(obj, exclude: torch.nn.Module | None = None) -> int:
    """Bytes of the tensors an object holds in its attributes (and in dicts / lists there), each
    counted once, leaving out those of `exclude` (e.g. an engine's static caches, recurrent states and
    packed weight copies, without the model weights it merely references)."""
    skip = {t.data_ptr() for t in [*exclude.parameters(), *exclude.buffers()]} if exclude is not None else set()
    seen, total = set(), 0
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            tensors = [t for t in (item.values() if isinstance(item, dict) else [item]) if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.data_ptr() not in seen and t.data_ptr() not in skip:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def device_timer(device: str):
    """A function that times `fn` `reps` times and returns the median in ms (CUDA events on a GPU)."""
    def run(fn, reps: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def timed_in_turn(run, steps: dict, rounds: int, reps: int) -> dict[str, list[float]]:
    """Each of `steps` (name -> fn) timed by `run(fn, reps)` (`device_timer`'s) once a round, in turn, for `rounds`
    rounds: name -> its times, round by round. Why in turn: what drifts in a process over minutes (two timings of one
    CUDA graph moved by up to 6%) then falls on every step of a round alike, and a ratio per round cancels it."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(run(fn, reps))
    return times


def spread(values, places: int = 4) -> dict[str, float]:
    """Median, min and max of `values`, rounded to `places`."""
    return {"median": round(statistics.median(values), places), "min": round(min(values), places),
            "max": round(max(values), places)}


def copy_bandwidth(device: str, reps: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write): the bandwidth a memory-bound step can use."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    ms = device_timer(device)(lambda: dst.copy_(src), reps)
    return 2 * n / (ms / 1e3)


def summary(name: str, result: MethodResult, block: int | None = None, decode_bytes: int | None = None,
            bandwidth: float | None = None) -> dict:
    """Metrics of one method. `decode_bytes` (its target's `weight_bytes`) gives the gpt-fast style
    achieved bandwidth: tokens/s x bytes a decode step reads (for speculative methods, the bandwidth
    autoregressive decoding would need to go as fast); `bandwidth` (copy_bandwidth) its fraction."""
    row = {f"{name}.tokens": result.tokens, f"{name}.seconds": round(result.seconds, 4),
           f"{name}.tokens_per_s": round(result.tokens_per_s, 3)}
    if decode_bytes:
        row[f"{name}.gb_per_s"] = round(result.tokens_per_s * decode_bytes / 1e9, 2)
        if bandwidth:
            row[f"{name}.of_bandwidth"] = round(result.tokens_per_s * decode_bytes / bandwidth, 4)
    if result.peak_working_bytes:
        row[f"{name}.peak_working_mib"] = round(max(result.peak_working_bytes) / 2**20, 1)
    if any(r.prefill_seconds for r in result.runs):  # transformers' generate does not report it
        row[f"{name}.ttft_median_s"] = round(statistics.median(r.prefill_seconds for r in result.runs), 5)
    if result.acceptance:
        row[f"{name}.tau"] = round(sum(result.acceptance) / len(result.acceptance), 4)
        if block:
            row[f"{name}.tau_histogram"] = [result.acceptance.count(k) for k in range(1, block + 1)]
        verified = [v for r in result.runs for v in r.verify_lengths]
        if verified:  # tokens the target verified per round (the verify length, or its mean where adaptive)
            row[f"{name}.verified_per_round"] = round(sum(verified) / len(verified), 3)
    return row


__all__ = ["PromptCase", "MethodResult", "ar", "bucket_cases", "category_cases", "compare", "copy_bandwidth",
           "device_timer", "plain_generate", "run_interleaved", "spec", "summary", "tau_pass", "tensor_bytes", "top2_margin",
           "warmup_lengths", "weight_bytes"]
