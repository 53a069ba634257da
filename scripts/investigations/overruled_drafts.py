"""What the drafter drafts where the target overrules it: a benchmark job's outputs.jsonl, tallied.

Each round of `speculative_generate` records the draft the target overruled (`rejected`, -1 when none was). A
round that committed `a` tokens accepted drafts 1..a-1, so the overruled draft stood at position a, where the
output holds the target's own token; the token before it is the last accepted draft (or the round's committed
token). This counts, per draft position, the overruled drafts that repeat the token before them and those that are
the token one position later (a skipped token), beside how often accepted drafts repeat the token before them.

    python scripts/investigations/overruled_drafts.py results/published/2026-12-04-h200-qwen-greedy/bench/speedup_winnone/outputs.jsonl \
        --method spec_qad_stage2 --skip-label filler
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def tally(rows: list[dict], method: str) -> dict:
    overruled, repeats, skips = collections.Counter(), collections.Counter(), collections.Counter()
    accepted, accepted_repeats = collections.Counter(), collections.Counter()
    for row in rows:
        tokens, start = row[method], 1  # tokens[0] came from the prefill; round r's tokens start at `start`
        for a, rejected in zip(row["committed"][method], row["rejected"][method]):
            for k in range(1, a):  # accepted drafts 1..a-1 at tokens[start + k - 1]
                if start + k - 1 < len(tokens):
                    accepted[k] += 1
                    accepted_repeats[k] += tokens[start + k - 1] == tokens[start + k - 2]
            at = start + a - 1  # where the overruled draft stood
            if rejected >= 0 and at < len(tokens):
                overruled[a] += 1
                repeats[a] += rejected == tokens[at - 1]
                skips[a] += at + 1 < len(tokens) and rejected == tokens[at + 1]
            start += a
    return {"by_position": [{"position": k, "overruled": overruled[k], "repeat_before": repeats[k], "next_token": skips[k],
                             "accepted": accepted[k], "accepted_repeat_before": accepted_repeats[k]}
                            for k in sorted(set(overruled) | set(accepted))],
            "overruled": sum(overruled.values()), "repeat_before": sum(repeats.values()), "next_token": sum(skips.values()),
            "accepted": sum(accepted.values()), "accepted_repeat_before": sum(accepted_repeats.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outputs", type=Path, help="a bench_speedup job's outputs.jsonl")
    ap.add_argument("--method", default="spec_qad_stage2")
    ap.add_argument("--skip-label", action="append", default=[], help="leave these prompt labels out (e.g. filler)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.outputs.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["label"] not in args.skip_label]
    if not rows or "rejected" not in rows[0]:
        raise SystemExit(f"overruled_drafts: {args.outputs} has no rows with `rejected` (benchmarks before f5d6927 lack it)")
    if args.method not in rows[0]["rejected"]:
        raise SystemExit(f"overruled_drafts: no method {args.method!r} in {args.outputs}; it has {sorted(rows[0]['rejected'])}")
    result = tally(rows, args.method)
    print(f"{len(rows)} prompts, {args.method}: {result['overruled']} overruled drafts, {result['repeat_before']} repeat the "
          f"token before them, {result['next_token']} are the token after; accepted drafts {result['accepted']}, "
          f"{result['accepted_repeat_before']} repeat the token before them")
    print("position  overruled  repeat_before  next_token  accepted  accepted_repeat_before")
    for r in result["by_position"]:
        print(f"{r['position']:>8}  {r['overruled']:>9}  {r['repeat_before']:>13}  {r['next_token']:>10}  {r['accepted']:>8}  "
              f"{r['accepted_repeat_before']:>22}")


if __name__ == "__main__":
    main()
