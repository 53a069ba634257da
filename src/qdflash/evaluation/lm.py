"""An lm-eval model for qdflash targets (registered as "qdflash"): log-likelihoods through the target's
forward, generation through this project's decoding loop (speculative with a drafter, else
autoregressive; greedy, so both give the same text).

    from qdflash.evaluation.lm import QdflashLM
    lm = QdflashLM(target, drafter=None, max_gen_toks=256)
    lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=...))

Log-likelihoods are scored one request (or one shared context) at a time by default, so they do not
depend on batching or padding; with `batch_size > 1` the shared contexts of multiple-choice items
go through the forward in batches (sorted by length, right-padded: a causal model's logits at a
row's last token cannot see the padding after it). Generation is batch 1 through this project's
loop by default; `batch_size > 1` (no drafter) generates greedily in batches instead: on the lean
engine's batched generator where the target's family has one (`backend` "auto" or "engine";
qdflash.engine.batched, rows refilled as they finish), else through transformers' `generate`
(qdflash.data.generate.generate_batched: sorted by length, left padding). Batches are what make full
test sets affordable on a GPU, where one forward costs the same host time at batch 1 and batch 64;
the engine's continuous batching and captured steps are several times faster than `generate` there
(results/published/2026-12-01-h200-generate*).
Same results in fp32 every way (tests); batched rows may round differently from batch 1 in 16-bit,
so a gate's reference and variants must use the same setting (they share `gates.batch_size` and
`gates.backend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ..data.generate import Sampling, generate_batched, generate_on_engine, resolve_backend
from ..spec import autoregressive_generate, speculative_generate


@register_model("qdflash")
class QdflashLM(LM):
    def __init__(self, target, drafter=None, max_gen_toks: int = 256, window: int | None = None, batch_size: int = 1,
                 backend: str = "auto"):
        super().__init__()
        if batch_size > 1 and drafter is not None:
            raise ValueError("batch_size > 1 generates greedy batches without speculation: not with a drafter (batch 1)")
        self.target, self.drafter, self.max_gen_toks, self.window = target, drafter, max_gen_toks, window
        self.batch_size, self.backend = batch_size, backend
        self.backends_used: set[str] = set()  # what batched generation ran on (metrics)
        self.tok = target.tokenizer
        self._model_device = next(target.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tok, "name_or_path", "qdflash").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation, split as lm-eval's HF model does: whitespace at the end
        of the context moves to the continuation, and the whole string is encoded at once so the
        boundary tokenizes as it would in running text."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return whole[: len(ctx)], whole[len(ctx):]

    @torch.no_grad()
    def continuation_logprob(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) under the target, and whether it is the greedy choice."""
        ids = torch.tensor([context_ids + continuation_ids], device=self._model_device)
        logits = self.target.model(input_ids=ids).logits[0, len(context_ids) - 1 : -1].float()
        logprobs = F.log_softmax(logits, dim=-1)
        want = torch.tensor(continuation_ids, device=self._model_device)
        total = logprobs.gather(-1, want[:, None]).sum().item()
        return total, bool((logprobs.argmax(-1) == want).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """Requests whose continuation is one token and whose contexts are equal (a multiple-choice
        item's " A" .. " D") share one forward: its last position scores them all (several such
        contexts per forward when `batch_size > 1`). Others get a forward each. Both read the same
        logits, so the results do not depend on the grouping."""
        bos = [self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id]
        splits = []
        for request in requests:
            ctx, cont = self._split(*request.args)
            splits.append((ctx or bos, cont))  # an empty context: condition on BOS / EOS, as lm-eval's HF model does
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        shared: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, cont) in enumerate(splits):
            if len(cont) == 1:
                shared.setdefault(tuple(ctx), []).append(i)
        contexts = [list(ctx) for ctx in shared]
        with tqdm(total=len(requests), desc="loglikelihood", unit="req") as bar:
            if self.batch_size > 1:
                scored = self.next_token_logprobs_batched(contexts)
            else:
                scored = (self.next_token_logprobs(ctx) for ctx in contexts)
            for members, logprobs in zip(shared.values(), scored):
                best = int(logprobs.argmax())
                for i in members:
                    token = splits[i][1][0]
                    out[i] = (logprobs[token].item(), best == token)
                bar.update(len(members))
            for i, (ctx, cont) in enumerate(splits):
                if out[i] is None:
                    out[i] = self.continuation_logprob(ctx, cont)
                    bar.update(1)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def next_token_logprobs(self, context_ids: list[int]) -> torch.Tensor:
        """log p(next token | context) over the vocabulary."""
        logits = self.target.model(input_ids=torch.tensor([context_ids], device=self._model_device)).logits[0, -1].float()
        return F.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def next_token_logprobs_batched(self, contexts: list[list[int]]) -> list[torch.Tensor]:
        """log p(next token | context) for each context, `batch_size` contexts per forward. Sorted by
        length so a batch pads little; right padding needs no attention mask, since causal attention
        and the recurrent layers only look back from a row's last real token."""
        out: list[torch.Tensor | None] = [None] * len(contexts)
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            lengths = [len(contexts[i]) for i in rows]
            width = max(lengths)
            ids = torch.tensor([contexts[i] + [contexts[i][-1]] * (width - len(contexts[i])) for i in rows],
                               device=self._model_device)
            # logits only at the positions where some row ends (not [rows, width, vocab])
            ends = sorted({n - 1 for n in lengths})
            logits = self.target.model(input_ids=ids, logits_to_keep=torch.tensor(ends, device=ids.device)).logits
            last = torch.tensor([ends.index(n - 1) for n in lengths], device=logits.device)
            logprobs = F.log_softmax(logits[torch.arange(len(rows), device=logits.device), last].float(), dim=-1)
            for row, i in enumerate(rows):
                out[i] = logprobs[row]
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", unit="req"):
            ids = self._encode(request.args[0])
            start = [self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id]
            out.append(self.continuation_logprob(start, ids)[0])
        return out

    def generate_until(self, requests) -> list[str]:
        asks = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            asks.append((self._encode(context), int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                         [until] if isinstance(until, str) else list(until)))
        if self.batch_size > 1:
            tokens = self._generate_batched(asks)
        else:
            tokens = [self._generate_one(ids, max_new, until)
                      for ids, max_new, until in tqdm(asks, desc="generate_until", unit="req")]
        out = []
        for generated, (_, _, until) in zip(tokens, asks):
            text = self.tok.decode(generated, skip_special_tokens=True)
            for stop in until:  # lm-eval returns the text before the first stop sequence
                text = text.split(stop)[0]
            out.append(text)
        return out

    def _generate_one(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        if self.drafter is not None:
            return speculative_generate(self.target, self.drafter, [ids], max_new, stop_strings=until or None,
                                        window=self.window).tokens
        return autoregressive_generate(self.target, [ids], max_new, stop_strings=until or None).tokens

    def _generate_batched(self, asks) -> list[list[int]]:
        """Greedy, in batches per generation budget; stop strings cut the text afterwards (the same
        text batch-1 generation stops at, since greedy tokens do not depend on where it stops)."""
        eos = self.target.eos_token_ids
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos[0]
        out: list[list[int] | None] = [None] * len(asks)
        for max_new in sorted({m for _, m, _ in asks}):
            members = [i for i, (_, m, _) in enumerate(asks) if m == max_new]
            prompts = [asks[i][0] for i in members]
            max_len = max(map(len, prompts)) + max_new
            backend, engine = resolve_backend(self.target, self.backend, max_len, key="gates.backend")
            self.backends_used.add(backend)
            if engine is not None:
                results, _ = generate_on_engine(engine, prompts, eos_ids=eos, max_new_tokens=max_new,
                                                batch_size=self.batch_size, sampling=Sampling(), seed=0, keys=None,
                                                max_len=max_len, desc="generate_until (batched, engine)")
                del engine  # its fused weights and caches before the next budget's
            else:
                results, _ = generate_batched(self.target.model, prompts, pad_id=pad, eos_ids=eos,
                                              max_new_tokens=max_new, batch_size=self.batch_size, sampling=Sampling(),
                                              desc="generate_until (batched)")
            for i, result in zip(members, results):
                out[i] = result.token_ids
        return out  # type: ignore[return-value]
