"""Side-by-side throughput of response generation settings on the same prompts (GPU measurement).

    python scripts/gpu/bench_generate.py --prompts 1024 --out $OUT/bench_generate.json

Plain `generate` (batch 128, file order, dynamic cache) against length-sorted large batches, with a
dynamic cache and with a static cache (compiled decode step). The first static run includes the
compilation; it is run twice and both timings are reported.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import transformers

from qdflash.data.chat import render_prompt_ids
from qdflash.data.generate import Sampling, generate_batched
from qdflash.data.sources import load_source
from qdflash.data.split import mostly_ascii, select_prompts
from qdflash.models import load_target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--settings", default="plain:128,dynamic:1024,static:1024,static:1024")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    target = load_target(args.model)
    tok = target.tokenizer
    pool = load_source("sharegpt").pool
    ids: dict[str, list[int]] = {}

    def accept(item) -> bool:
        if not mostly_ascii(item.prompt):
            return False
        ids[item.id] = render_prompt_ids(tok, item.prompt)
        return len(ids[item.id]) <= args.max_prompt_tokens

    chosen, _ = select_prompts(pool, text=lambda i: i.prompt, n=args.prompts, accept=accept)
    prompts = [ids[i.id] for i in chosen]
    common = dict(pad_id=tok.pad_token_id, eos_ids=target.eos_token_ids, max_new_tokens=args.max_new_tokens,
                  sampling=Sampling(0.7, 0.8, 20), seed=0)
    rows = []
    for setting in args.settings.split(","):
        kind, batch = setting.split(":")
        stats = generate_batched(
            target.model, prompts, batch_size=int(batch), sort_by_length=kind != "plain",
            static_cache_len=args.max_prompt_tokens + args.max_new_tokens if kind == "static" else None,
            desc=setting, **common,
        )[1]
        rows.append({"setting": setting, "tokens_per_s": round(stats.tokens_per_s, 1), "new_tokens": stats.new_tokens,
                     "seconds": round(stats.seconds, 2)})
        print(json.dumps(rows[-1]), flush=True)
    record = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=2)


if __name__ == "__main__":
    main()
