"""Why the filler prompt's rounds stop short (issue 21 asks for tau >= 8 there): a trained drafter on the
benchmark's filler prompt, round by round, on the CPU.

The filler prompt is `bench.bucket_cases`' own ("Continue: " + the cat sentence repeated); its greedy answer is
one short cycle repeated, so every draft position could be right. This decodes it twice with the same
drafter and target (fp32, greedy, lossless either way):
- as served (`--verify` tokens, the whole block after a long accept when `--adaptive`), and
- verifying the whole block every round, and with `--tree-nodes N` verifying trees of N drafts (`tree_nodes`),
and reports tau, the acceptance-length histogram and, from the whole-block pass, how often each draft
position was right given that every earlier one was (where the drafter's reach ends).

    python scripts/investigations/filler_rounds.py --drafter /tmp/drafter-complete/drafter \
        --prompt-tokens 2048 --new-tokens 256 --out results/published/<run>/filler-rounds.json

Also, per round of each decode, the draft the target overruled beside the token it chose there (`overruled`:
which token the drafter writes where it goes wrong), and from the training forward at every anchor of the
answer (`drafter.train.anchor_acceptance`) the acceptance length by the anchor's phase in the cycle (`by_phase`:
whether one place in the cycle or one block position stops the rounds). On the H200, with the run's own
drafter (no fetch): `--drafter $QDFLASH_RESULTS/<run>/drafter/stage2/drafter --device cuda --dtype bfloat16`.

The drafter comes back from the H200 with scripts/airgap/fetch_drafter.sh (bf16 pieces); the target is the
preset the drafter was trained on (its 16-bit weights: the drafter was adapted to the QAD target, which
differs from them by a held-out KL of ~2e-4).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from qdflash import bench
from qdflash.data.chat import render_prompt_ids
from qdflash.drafter.train import anchor_acceptance
from qdflash.spec import autoregressive_generate, speculative_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_repeats import load_checked  # noqa: E402  (the studies' drafter and target, loaded one way)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, required=True, help="a drafter folder (config.json + model.safetensors)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="the filler prompt's length (the benchmark: 8,192, capped)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--verify", type=int, default=6)
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-repeat", action="store_true", help="drafts by decoding's no_repeat rule (blocks.distinct_drafts)")
    ap.add_argument("--tree-nodes", type=int, default=None, help="also decode verifying trees of N drafts (spec's tree_nodes)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: the served dtype; outputs may then differ from greedy at near-ties (reported)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target, drafter = load_checked(args, "filler_rounds")
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
              "block_size": drafter.block_size, "no_repeat": args.no_repeat, "answer_period": cycle, "answer_head": tok.decode(answer[:48])}
    runs = [("served", args.verify, args.adaptive, None), ("whole_block", None, False, None)]
    runs += [("tree", None, False, args.tree_nodes)] if args.tree_nodes else []
    for name, verify, adaptive, tree in runs:
        started = time.perf_counter()
        out = speculative_generate(target, drafter, [ids], args.new_tokens, verify_tokens=verify, verify_adaptive=adaptive,
                                   no_repeat=args.no_repeat, tree_nodes=tree)
        if args.dtype == "float32":
            assert out.tokens == answer, f"{name}: speculative output differs from greedy (fp32 must be exact)"
        same = next((i for i, (x, y) in enumerate(zip(out.tokens, answer)) if x != y), None)
        hist = collections.Counter(out.acceptance_lengths)
        # the draft the target overruled in each round that stopped short, beside the target's own token there
        ends = list(itertools.accumulate(out.acceptance_lengths, initial=1))  # round r's tokens: [ends[r], ends[r+1])
        overruled = collections.Counter(
            (a, tok.decode([out.tokens[e + a - 1]]), tok.decode([r]))
            for e, a, r in zip(ends, out.acceptance_lengths, out.rejected) if r >= 0 and e + a - 1 < len(out.tokens))
        report[name] = {"verify_tokens": verify, "adaptive": adaptive, "tree_nodes": tree, "tau": round(out.tau, 3), "rounds": len(out.acceptance_lengths),
                        "acceptance_lengths": out.acceptance_lengths, "verify_lengths": out.verify_lengths,
                        "first_difference": same, "histogram": dict(sorted(hist.items())),
                        "overruled": [{"draft_position": k, "target": t, "drafted": d, "rounds": c}
                                      for (k, t, d), c in overruled.most_common(12)]}
        print(f"{name}: overruled drafts (position, target's token, drafted, rounds): "
              + "; ".join(f"{k} {t!r}->{d!r} x{c}" for (k, t, d), c in overruled.most_common(6)))
        print(f"{name}: tau {out.tau:.2f} over {len(out.acceptance_lengths)} rounds; histogram {dict(sorted(hist.items()))} "
              f"({time.perf_counter() - started:.0f} s)")
        if verify is None and tree is None:
            # a round accepting a drafts (acceptance a + 1 with the bonus) tried positions 1..a+1 and got
            # 1..a right: the conditional rate at position k is (rounds past k) / (rounds that reached k)
            reached = [sum(1 for a in out.acceptance_lengths if a - 1 >= k - 1) for k in range(1, drafter.block_size)]
            right = [sum(1 for a in out.acceptance_lengths if a - 1 >= k) for k in range(1, drafter.block_size)]
            report[name]["conditional_accept_by_position"] = [round(r / n, 3) if n else None for r, n in zip(right, reached)]
            print("position: " + " ".join(f"{k}:{r}/{n}" for k, (r, n) in enumerate(zip(right, reached), 1)))
    # the training forward at every anchor of the answer (its first token is the prefill's, at len(ids))
    b = drafter.block_size
    example = {"id": "filler", "input_ids": ids + answer, "loss_mask": [0] * len(ids) + [1] * len(answer)}
    anchors = torch.arange(len(ids), len(ids) + len(answer) - b + 1)
    _, _, acc, _ = next(anchor_acceptance(drafter, target, [(example, anchors)], no_repeat=args.no_repeat))
    phases = collections.defaultdict(list)  # phase -> [(answer index, acceptance length)]
    for a, length in zip(anchors.tolist(), acc.tolist()):
        phases[(a - len(ids)) % cycle if cycle else 0].append((a - len(ids), length))
    report["teacher_forced"] = {
        "tau_every_anchor": round(acc.float().mean().item(), 3),
        "conditional_accept_by_position": [round(float((acc > k).sum() / max(1, (acc > k - 1).sum())), 3) for k in range(1, b)],
        "by_phase": [{"phase": ph, "anchor_token": tok.decode([answer[v[-1][0]]]),  # the cycle's token (the head may differ)
                      "mean_acceptance": round(sum(x for _, x in v) / len(v), 2), "blocks": len(v)}
                     for ph, v in sorted(phases.items())]}
    print("teacher-forced, by the anchor's phase in the cycle: " + "; ".join(
        f"{r['phase']} {r['anchor_token']!r} {r['mean_acceptance']}" for r in report["teacher_forced"]["by_phase"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
