"""Why the filler prompt's rounds stop short (issue 21 asks for tau >= 8 there): a trained drafter on the
benchmark's filler prompt, round by round, on the CPU.

The filler prompt is `bench.bucket_cases`' own ("Continue: " + the cat sentence repeated); its greedy answer is
one short cycle repeated, so every draft position could be right. This decodes it twice with the same
drafter and target (fp32, greedy, lossless either way):
- as served (`--verify` tokens, the whole block after a long accept when `--adaptive`), and
- verifying the whole block every round,
and reports tau, the acceptance-length histogram and, from the whole-block pass, how often each draft
position was right given that every earlier one was (where the drafter's reach ends).

    python scripts/investigations/filler_rounds.py --drafter /tmp/drafter-complete/drafter \
        --prompt-tokens 2048 --new-tokens 256 --out results/published/<run>/filler-rounds.json

The drafter comes back from the H200 with scripts/airgap/fetch_drafter.sh (bf16 pieces); the target is the
preset the drafter was trained on (its 16-bit weights: the drafter was adapted to the QAD target, which
differs from them by a held-out KL of ~2e-4).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from qdflash import bench
from qdflash.data.chat import render_prompt_ids
from qdflash.drafter import load_drafter
from qdflash.models import load_target
from qdflash.spec import autoregressive_generate, speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, required=True, help="a drafter folder (config.json + model.safetensors)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="the filler prompt's length (the benchmark: 8,192, capped)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--verify", type=int, default=6)
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # before the target loads (~10 s): a folder that is not a drafter is a one-line error, not a traceback
    if not ((args.drafter / "config.json").is_file() and (args.drafter / "model.safetensors").is_file()):
        raise SystemExit(f"filler_rounds: --drafter {args.drafter} is not a drafter folder (expected config.json and "
                         "model.safetensors; scripts/airgap/fetch_drafter.sh says how to join one)")
    torch.manual_seed(0)
    target = load_target(args.model, dtype="float32", device="cpu")
    drafter = load_drafter(args.drafter, target, dtype=torch.float32)
    tok = target.tokenizer
    unit = len(tok(bench.FILLER, add_special_tokens=False)["input_ids"])
    ids = render_prompt_ids(tok, "Continue: " + bench.FILLER * max(1, (args.prompt_tokens - 20) // unit))
    print(f"filler prompt: {len(ids)} tokens; drafter block {drafter.block_size}")

    started = time.perf_counter()
    reference = autoregressive_generate(target, [ids], args.new_tokens)
    answer = reference.tokens
    # the shortest period of the answer's last quarter (None: no period up to 64 tokens)
    tail = len(answer) // 4
    cycle = next((p for p in range(1, 65) if tail > 2 * p and all(answer[i] == answer[i - p] for i in range(len(answer) - tail, len(answer)))), None)
    print(f"greedy answer: {len(answer)} tokens, period {cycle} ({time.perf_counter() - started:.0f} s)")
    report = {"model": args.model, "drafter": str(args.drafter), "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
              "block_size": drafter.block_size, "answer_period": cycle, "answer_head": tok.decode(answer[:48])}
    for name, verify, adaptive in (("served", args.verify, args.adaptive), ("whole_block", None, False)):
        started = time.perf_counter()
        out = speculative_generate(target, drafter, [ids], args.new_tokens, verify_tokens=verify, verify_adaptive=adaptive)
        assert out.tokens == answer, f"{name}: speculative output differs from greedy (fp32 must be exact)"
        hist = collections.Counter(out.acceptance_lengths)
        report[name] = {"verify_tokens": verify, "adaptive": adaptive, "tau": round(out.tau, 3), "rounds": len(out.acceptance_lengths),
                        "acceptance_lengths": out.acceptance_lengths, "verify_lengths": out.verify_lengths,
                        "histogram": dict(sorted(hist.items()))}
        print(f"{name}: tau {out.tau:.2f} over {len(out.acceptance_lengths)} rounds; histogram {dict(sorted(hist.items()))} "
              f"({time.perf_counter() - started:.0f} s)")
        if verify is None:
            # a round accepting a drafts (acceptance a + 1 with the bonus) tried positions 1..a+1 and got
            # 1..a right: the conditional rate at position k is (rounds past k) / (rounds that reached k)
            reached = [sum(1 for a in out.acceptance_lengths if a - 1 >= k - 1) for k in range(1, drafter.block_size)]
            right = [sum(1 for a in out.acceptance_lengths if a - 1 >= k) for k in range(1, drafter.block_size)]
            report[name]["conditional_accept_by_position"] = [round(r / n, 3) if n else None for r, n in zip(right, reached)]
            print("position: " + " ".join(f"{k}:{r}/{n}" for k, (r, n) in enumerate(zip(right, reached), 1)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
