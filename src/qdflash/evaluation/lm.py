"""An lm-eval model for qdflash targets (registered as "qdflash"): log-likelihoods through the target's
forward, generation through this project's decoding loop (speculative with a drafter, else
autoregressive; greedy, so both give the same text).

    from qdflash.evaluation.lm import QdflashLM
    lm = QdflashLM(target, drafter=None, max_gen_toks=256)
    lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=...))

Batch 1 throughout (the project's setting); each request is scored on its own, so results do not
depend on batching or padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ..spec import autoregressive_generate, speculative_generate


@register_model("qdflash")
class QdflashLM(LM):
    def __init__(self, target, drafter=None, max_gen_toks: int = 256, window: int | None = None):
        super().__init__()
        self.target, self.drafter, self.max_gen_toks, self.window = target, drafter, max_gen_toks, window
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
        item's " A" .. " D") share one forward: its last position scores them all. Others get a
        forward each. Both read the same logits, so the results do not depend on the grouping."""
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
        with tqdm(total=len(requests), desc="loglikelihood", unit="req") as bar:
            for ctx, members in shared.items():
                logprobs = self.next_token_logprobs(list(ctx))
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

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", unit="req"):
            ids = self._encode(request.args[0])
            start = [self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id]
            out.append(self.continuation_logprob(start, ids)[0])
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for request in tqdm(requests, desc="generate_until", unit="req"):
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self._encode(context)
            if self.drafter is not None:
                result = speculative_generate(self.target, self.drafter, [ids], max_new, stop_strings=until or None,
                                              window=self.window)
            else:
                result = autoregressive_generate(self.target, [ids], max_new, stop_strings=until or None)
            text = self.tok.decode(result.tokens, skip_special_tokens=True)
            for stop in until:  # lm-eval returns the text before the first stop sequence
                text = text.split(stop)[0]
            out.append(text)
        return out
