"""Which score should pick a tree's nodes? On the CPU, over the walk of scripts/investigations/draft_trees.py.

`drafter.blocks.draft_tree` keeps the N paths with the highest sum of their tokens' log-probabilities: the
drafter's one block pass read as independent, calibrated choices per position. If the drafter is more (or less)
sure of itself than it is right, or its far positions are right less often than their probabilities say, another
score would spend the same N verify tokens on nodes the target accepts more often. The scores compared, each a
"log-probability" per (position, choice) that draft_tree then sums along a path:
- `logp`: the drafter's own (what decoding runs);
- `temp<T>`: its logits at temperature T, renormalized over the top-k kept (T < 1 trusts the first choice more,
  T > 1 spreads nodes over second choices);
- `rank`: log of how often the choice of that rank at that position is the target's token, counted on the other
  half of the answers (cross-fitted: even-numbered answers calibrate the odd ones and back), whatever its probability;
- `bins`: the same per position and probability bin (10 bins of log-probability), so a confident second choice
  scores higher than an unsure one.
Each is walked as decoding's rounds (`train.walk_rounds`), at equal node counts, with the no-repeat rule.

    python scripts/investigations/tree_scores.py --drafter /tmp/dgreedy --references /tmp/dr/references.json \
        --per-kind 12 --chat /tmp/chat-heldout.jsonl --cache /tmp/st/choices.pt --out <folder>/scores.json

The drafter's and target's passes (the slow part, ~5 s an answer on 2 cores) are kept in `--cache` and reused.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_repeats import load_checked  # noqa: E402
from draft_trees import block_choices, check_references, walk_anchors, walk_arguments, walked_examples  # noqa: E402

from qdflash.drafter.blocks import tree_acceptance  # noqa: E402
from qdflash.drafter.train import walk_rounds  # noqa: E402

BINS = torch.tensor([-0.01, -0.05, -0.1, -0.25, -0.5, -1.0, -2.0, -3.0, -5.0])  # log-probability bin edges, high to low


def choices(args) -> list[dict]:
    """Each answer's block choices at its walk anchors (ids, logp [A, B-1, k], greedy [A, B-1]) and kind; from
    --cache where it holds them for these settings."""
    key = {"drafter": str(args.drafter), "references": str(args.references), "per_kind": args.per_kind,
           "chat": str(args.chat), "new_tokens": args.new_tokens, "top_k": args.top_k, "model": args.model, "dtype": args.dtype}
    if args.cache is not None and args.cache.is_file():
        cached = torch.load(args.cache)
        if cached["key"] == key:
            return cached["answers"]
        print(f"tree_scores: --cache {args.cache} was made with other settings; computing again", flush=True)
    target, drafter = load_checked(args, "tree_scores")
    drafter.eval()
    examples, categories = walked_examples(args, target, "tree_scores")
    answers, started = [], time.perf_counter()
    for e, ex in enumerate(examples, 1):
        anchors = walk_anchors(ex, drafter.block_size, args.new_tokens)
        if anchors is None:
            continue
        ids, logp, greedy = block_choices(drafter, target, ex, anchors, args.top_k)
        answers.append({"id": ex["id"], "kind": categories[ex["id"]], "ids": ids, "logp": logp, "greedy": greedy})
        print(f"[{e}/{len(examples)}] {ex['id']}: {len(anchors)} anchors ({time.perf_counter() - started:.0f} s)", flush=True)
    if args.cache is not None:
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "answers": answers}, args.cache)
    return answers


def temperature(logp: torch.Tensor, t: float) -> torch.Tensor:
    """The top-k choices' log-probabilities at temperature t, renormalized over them (logits = logp + const)."""
    return torch.log_softmax(logp / t, dim=-1)


def hits(answers: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each choice is the target's token at its position ([A, B-1, k]), and its probability bin, stacked."""
    hit = torch.cat([a["ids"] == a["greedy"][..., None] for a in answers])
    bins = torch.cat([torch.bucketize(-a["logp"], -BINS) for a in answers])
    return hit, bins


def calibrated(fit: list[dict], apply: list[dict], by: str) -> list[torch.Tensor]:
    """Scores for `apply`'s choices: log of the hit rate on `fit` per (position, rank) or per (position, bin), with
    one pseudo-count each way (no empty cell scores -inf)."""
    hit, bins = hits(fit)
    positions = hit.shape[1]
    if by == "rank":
        rate = (hit.float().sum(0) + 1) / (hit.shape[0] + 2)  # [B-1, k]
        return [rate.log().expand_as(a["logp"]) for a in apply]
    cells = len(BINS) + 1
    flat = torch.arange(positions)[None, :, None] * cells + bins  # [A, B-1, k]: (position, bin) cell
    count = torch.bincount(flat.flatten(), minlength=positions * cells).float()
    got = torch.bincount(flat.flatten(), weights=hit.flatten().float(), minlength=positions * cells)
    rate = ((got + 1) / (count + 2)).log()
    out = []
    for a in apply:
        cell = torch.arange(positions)[None, :, None] * cells + torch.bucketize(-a["logp"], -BINS)
        out.append(rate[cell])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    walk_arguments(ap)
    ap.add_argument("--budgets", default="5,8,15", help="tree sizes (nodes)")
    ap.add_argument("--temperatures", default="0.5,0.7,1,1.5,2,3")
    ap.add_argument("--cache", type=Path, default=None, help="where the block choices are kept (.pt)")
    args = ap.parse_args()
    check_references(args, "tree_scores")
    answers = choices(args)
    halves = [answers[0::2], answers[1::2]]
    scores = {"logp": [a["logp"] for a in answers]}
    for t in (float(x) for x in args.temperatures.split(",")):
        scores[f"temp{t:g}"] = [temperature(a["logp"], t) for a in answers]
    for by in ("rank", "bins"):  # cross-fitted: each half scored by the other's hit rates, back in answer order
        even, odd = calibrated(halves[1], halves[0], by), calibrated(halves[0], halves[1], by)
        scores[by] = [even[i // 2] if i % 2 == 0 else odd[i // 2] for i in range(len(answers))]
    report = {"drafter": str(args.drafter), "answers": len(answers), "top_k": args.top_k, "no_repeat": True, "taus": {}}
    for n in (int(b) for b in args.budgets.split(",")):
        for name, per_answer in scores.items():
            rounds = collections.defaultdict(list)
            for a, score in zip(answers, per_answer):
                rounds[a["kind"]] += walk_rounds(tree_acceptance(a["ids"], score, a["greedy"], n, skip_repeats=True).tolist())
            every = [r for v in rounds.values() for r in v]
            row = {"tau": round(sum(every) / len(every), 4), "rounds": len(every),
                   **{f"tau.{kind}": round(sum(v) / len(v), 4) for kind, v in sorted(rounds.items())}}
            report["taus"][f"tree{n}.{name}"] = row
            print(f"tree{n:>2} {name:>8}: tau {row['tau']:.3f} over {row['rounds']} rounds; "
                  + ", ".join(f"{k[4:]} {v:.3f}" for k, v in row.items() if k.startswith("tau.")), flush=True)
    hit, _ = hits(answers)
    report["hit_rate_by_position_rank"] = [[round(x, 4) for x in row] for row in hit.float().mean(0).tolist()]
    report["mean_prob_by_position_rank"] = [[round(x, 4) for x in row] for row in
                                            torch.cat([a["logp"] for a in answers]).exp().mean(0).tolist()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
