"""Read node metrics into small tables (the report stage builds on this).

    python -m qdflash.tables target results/default      # markdown table of the target variants
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

TARGET_COLUMNS = ["variant", "method", "bits", "group_size", "kl", "top1_agreement", "ppl", "qad_kl_recovered"]


def target_quality_rows(results: Path) -> list[dict]:
    """One row for the 16-bit target and one per PTQ / QAD variant, from their metrics.json."""
    rows: list[dict] = []
    for folder in sorted((results / "target").glob("*/")):
        path = folder / "metrics.json"
        if not path.is_file():
            continue
        m = json.loads(path.read_text())
        if not rows and "bf16.ppl" in m:
            rows.append({"variant": "bf16", "method": "-", "bits": 16, "group_size": "-", "kl": 0.0,
                         "top1_agreement": 1.0, "ppl": m["bf16.ppl"], "qad_kl_recovered": ""})
        kind, start, bits, group = re.match(r"(ptq|qad)_(\w+)_w(\d+)g(\d+|ch)$", folder.name).groups()
        rows.append({
            "variant": folder.name, "method": f"qad (from {start})" if kind == "qad" else start, "bits": int(bits),
            "group_size": group, "kl": m["quant.kl"], "top1_agreement": m["quant.top1_agreement"],
            "ppl": m["quant.ppl"], "qad_kl_recovered": m.get("qad.kl_recovered_fraction", ""),
        })
    return rows


def markdown(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.5g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "target":
        sys.exit("usage: python -m qdflash.tables target RESULTS_DIR")
    print(markdown(target_quality_rows(Path(argv[1])), TARGET_COLUMNS))


if __name__ == "__main__":
    main(sys.argv[1:])
