"""τ and speedups of a benchmark job over a subset of its prompt rows (e.g. chat + math + code), from its
speed.csv: tokens and seconds summed over the rows, rounds as tokens / τ per row.

    python scripts/investigations/speed_subset.py results/published/2026-12-03-h200-qwen-recipe/bench/speedup_win1024/speed.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("speed_csv", type=Path)
    parser.add_argument("--prompts", default="chat,math,code", help="comma-separated prompt rows (speed.csv's `prompts`)")
    args = parser.parse_args()
    wanted = args.prompts.split(",")
    rows = [r for r in csv.DictReader(open(args.speed_csv)) if r["prompts"] in wanted]
    if {r["prompts"] for r in rows} != set(wanted):
        raise SystemExit(f"{args.speed_csv}: rows {sorted(set(wanted) - {r['prompts'] for r in rows})} are missing")
    per = {}
    for r in rows:
        m = per.setdefault(r["method"], {"tokens": 0, "seconds": 0.0, "rounds": 0.0})
        m["tokens"] += int(r["tokens"])
        m["seconds"] += float(r["seconds"])
        if r["tau"]:
            m["rounds"] += int(r["tokens"]) / float(r["tau"])
    rate = {name: m["tokens"] / m["seconds"] for name, m in per.items()}
    for name, m in per.items():
        tau = f"τ {m['tokens'] / m['rounds']:.3f}, " if m["rounds"] else ""
        ratios = ", ".join(f"{rate[name] / rate[b]:.3f}× {b}" for b in ("ar16", "ar_qad") if b in rate)
        print(f"{'+'.join(wanted)} {name}: {tau}{rate[name]:.1f} tokens/s, {ratios}")


if __name__ == "__main__":
    main()
