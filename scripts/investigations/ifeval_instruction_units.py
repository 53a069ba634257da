"""The IFEval gate with lm-eval's own aggregation: instructions as the units, not prompts.

    python scripts/investigations/ifeval_instruction_units.py results/published/2026-12-02-h200-qwen-w8/gates

The gate scores IFEval per prompt (the share of its instructions followed, qdflash.evaluation.ifeval);
lm-eval's `inst_level_strict_acc` averages over all instructions. From the per-prompt shares in each
variant's `scores.json` and the instruction counts of Google's `input_data.jsonl`, this prints the
margin mean(x - ratio * y) and its 95% lower end both ways: per prompt (the gate's), and per
instruction with a cluster-robust interval by prompt (the instructions of one prompt are not
independent). Whether the second aggregation would let a variant pass.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from qdflash.evaluation.gates import Z95, mean_interval
from qdflash.evaluation.ifeval import ifeval_data_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gates", type=Path, help="a results folder's gates/ (bf16/ and one folder per variant)")
    parser.add_argument("--ratio", type=float, default=0.95)
    parser.add_argument("--data", type=Path, default=None, help="IFEval's input_data.jsonl (default: as the gate finds it)")
    args = parser.parse_args()
    counts = {str(json.loads(line)["key"]): len(json.loads(line)["instruction_id_list"])
              for line in ifeval_data_file(args.data).read_text().splitlines() if line.strip()}
    reference = json.loads((args.gates / "bf16" / "scores.json").read_text())["ifeval"]
    for folder in sorted(p for p in args.gates.iterdir() if (p / "scores.json").is_file() and p.name != "bf16"):
        variant = json.loads((folder / "scores.json").read_text())["ifeval"]
        if variant["ids"] != reference["ids"]:
            raise SystemExit(f"{folder}: its IFEval items are not the reference's")
        per_prompt = [x - args.ratio * y for x, y in zip(variant["scores"], reference["scores"])]
        mean, half = mean_interval(per_prompt)
        n_ins = [counts[i] for i in reference["ids"]]
        d = [(x - args.ratio * y) * k for x, y, k in zip(variant["scores"], reference["scores"], n_ins)]
        total, n = sum(n_ins), len(n_ins)
        margin = sum(d) / total
        var = sum((di - margin * k) ** 2 for di, k in zip(d, n_ins)) / total**2 * n / (n - 1)
        print(f"{folder.name}: per prompt ({n}) margin {mean:.4f} low {mean - half:.4f}; "
              f"per instruction ({total}) margin {margin:.4f} low {margin - Z95 * math.sqrt(var):.4f}")


if __name__ == "__main__":
    main()
