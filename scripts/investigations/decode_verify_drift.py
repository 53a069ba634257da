"""How far a decode step (1 row) and a verify block (16 rows) of the lean engine drift apart in 16 bits.

    python scripts/investigations/decode_verify_drift.py --model smollm2-135m --dtype bfloat16 --prompts 6

Per held-out ShareGPT prompt (the first 200 tokens): the engine's greedy continuation of 16 tokens,
fed one token per step, then the same 16 tokens fed again as one block from the same cache. Printed
per prompt: the largest |logit difference| relative to the largest |logit|, and over all prompts how
often the argmax differs, with the residual stream in fp32 (the engine's default) and in the model's
dtype. Where these differ, greedy speculative decoding can diverge from autoregressive decoding.
"""

from __future__ import annotations

import argparse

import torch

from qdflash.data.sources import load_source
from qdflash.engine import build_engine
from qdflash.models import load_target


@torch.no_grad()
def drift(engine, prompt: torch.Tensor, tokens: int = 16) -> tuple[float, int]:
    engine.reset()
    logits, _ = engine.forward(prompt, 0)
    fed, step_logits = [], []
    nxt = logits[-1].float().argmax()
    for i in range(tokens):
        fed.append(nxt)
        out, _ = engine.forward(nxt.view(1), len(prompt) + i)
        step_logits.append(out[0].float())
        nxt = out[0].float().argmax()
    engine.reset()
    engine.forward(prompt, 0)
    block, _ = engine.forward(torch.stack(fed), len(prompt))
    a, b = torch.stack(step_logits), block.float()
    relative = ((a - b).abs().max(-1).values / a.abs().max(-1).values).max().item()
    return relative, int((a.argmax(-1) != b.argmax(-1)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    target = load_target(args.model, dtype=args.dtype, device="cpu")
    tok = target.tokenizer
    prompts = [tok(item.prompt, return_tensors="pt").input_ids[0][:200] for item in load_source("sharegpt").pool[: args.prompts]]
    for residual in ("fp32", args.dtype):
        engine = build_engine(target, max_len=1024)
        if residual != "fp32":
            engine.residual_dtype = engine.dtype
        results = [drift(engine, p) for p in prompts]
        print(f"residual {residual}: max relative logit difference per prompt "
              f"{[round(r, 4) for r, _ in results]}, argmax flips {sum(f for _, f in results)} of {16 * len(prompts)}")


if __name__ == "__main__":
    main()
