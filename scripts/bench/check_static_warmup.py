"""Does the benchmark's warm-up keep `generate`'s compiled static cache out of the measurement? (GPU)

    python scripts/bench/check_static_warmup.py --out $OUT/static_warmup.json

The benchmark's `static16` method (transformers' `generate` with its static cache, compiled on a
GPU) through `qdflash.bench.run_interleaved`, on prompts of several lengths and new-token counts like
the benchmark node's, warm-up as configured there. It prints each measured prompt's seconds: a
compilation that falls into the measurement shows as one prompt taking seconds instead of a fraction.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import transformers

from qdflash import bench
from qdflash.data.chat import render_prompt_ids
from qdflash.data.sources import load_source
from qdflash.data.split import mostly_ascii
from qdflash.models import load_target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", default="64,64,64,64,128,256,256", help="one prompt per entry")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--short-warmup-only", action="store_true",
                        help="the warm-up before 2026-11-30's fix: the first prompt at <= 8 new tokens, once")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    target = load_target(args.model)
    prompts = (item.prompt for item in load_source("sharegpt").pool if mostly_ascii(item.prompt))
    cases = [bench.PromptCase(f"prompt{i}", render_prompt_ids(target.tokenizer, next(prompts)), int(n))
             for i, n in enumerate(args.new_tokens.split(","))]
    static = lambda ids, n: bench.plain_generate(target, ids, n, static=True)  # noqa: E731
    # the old warm-up is the shorter of the benchmark's two lengths alone, run here before measuring
    lengths = bench.warmup_lengths(cases[0].max_new_tokens)[:1 if args.short_warmup_only else None]
    if args.short_warmup_only:
        for case in cases[:args.warmup]:
            static(case.ids, bench.warmup_lengths(case.max_new_tokens)[0])
    # touch=False: a prompt's first visit is what this check looks at (a compile falls into it)
    runs = bench.run_interleaved({"static16": static}, cases, warmup=0 if args.short_warmup_only else args.warmup,
                                 touch=False)["static16"].runs
    rows = [{"prompt_tokens": len(c.ids), "new_tokens": len(r.tokens), "seconds": round(r.seconds, 3)}
            for c, r in zip(cases, runs)]
    for row in rows:
        print(json.dumps(row), flush=True)
    record = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
              "warmup": args.warmup,
              "warmup_new_tokens": lengths,
              "results": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=2)


if __name__ == "__main__":
    main()
