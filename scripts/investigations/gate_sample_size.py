"""How many items a quality gate would need to decide, from per-item scores already measured.

    python scripts/investigations/gate_sample_size.py results/default/gates

For every variant folder beside the 16-bit reference (`bf16/scores.json`) and every task with a
`gates.tasks.<task>.ratio` (given here as task=ratio, default mmlu=0.9 gsm8k=0.9 ifeval=0.95): the
paired differences d = variant - ratio x reference, their standard deviation, and the number of items
at which a 95% interval of mean(d) would be narrower than the margin to show if the variant scored
exactly as the reference does, (1.96 sd / ((1 - ratio) x reference score))^2 (qdflash.evaluation.gates).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from qdflash.evaluation.gates import Z95, mean_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gates", type=Path, help="a results/<experiment>/gates folder")
    parser.add_argument("ratios", nargs="*", default=["mmlu=0.9", "gsm8k=0.9", "ifeval=0.95"], help="task=ratio")
    args = parser.parse_args()
    ratios = {task: float(r) for task, r in (item.split("=") for item in args.ratios)}
    reference = json.loads((args.gates / "bf16" / "scores.json").read_text())
    print("variant task n reference variant sd(d) items_needed")
    for folder in sorted(p for p in args.gates.iterdir() if p.name != "bf16" and (p / "scores.json").is_file()):
        scores = json.loads((folder / "scores.json").read_text())
        for task, ratio in ratios.items():
            if task not in scores or task not in reference:
                continue
            x, y = scores[task]["scores"], reference[task]["scores"]
            n = len(x)
            # the gate's own interval of mean(d), d = x - ratio * y: half-width Z95 * sd / sqrt(n)
            _, half = mean_interval([a - ratio * b for a, b in zip(x, y)])
            sd = half * math.sqrt(n) / Z95
            margin = (1 - ratio) * sum(y) / n
            need = "never (reference scores 0)" if margin == 0 else round(n * (half / margin) ** 2)
            print(folder.name, task, n, round(sum(y) / n, 3), round(sum(x) / n, 3), round(sd, 3), need)


if __name__ == "__main__":
    main()
