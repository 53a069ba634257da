"""Read node metrics into small tables (the report stage builds on this).

    python -m qdflash.tables target results/default              # markdown table of the target variants
    python -m qdflash.tables scaling results/gpu/scaling [--csv F] [--md F]   # the drafter scaling table
    python -m qdflash.tables scaling results/published/2026-12-03-h200-drafter-{long,12k} --png F   # studies side by side
    python -m qdflash.tables nodes results/published/2026-12-03-h200-qwen-recipe/snakemake.log   # what each node took
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from datetime import datetime
from pathlib import Path

from .variants import group_label, parse_target

TARGET_COLUMNS = ["variant", "method", "bits", "group_size", "kl", "top1_agreement", "ppl", "qad_kl_recovered"]


def target_quality_rows(results: Path) -> list[dict]:
    """One row for the 16-bit target and one per PTQ / QAD variant, from their metrics.json."""
    rows: list[dict] = []
    for folder in sorted((results / "target").glob("*/")):
        path = folder / "metrics.json"
        variant = parse_target(folder.name)
        if not path.is_file() or variant is None:  # e.g. a *.partial-* folder of a node cut off
            continue
        m = json.loads(path.read_text())
        if not rows and "bf16.ppl" in m:
            rows.append({"variant": "bf16", "method": "-", "bits": 16, "group_size": "-", "kl": 0.0,
                         "top1_agreement": 1.0, "ppl": m["bf16.ppl"], "qad_kl_recovered": ""})
        start = variant["method"]
        rows.append({
            "variant": folder.name, "method": f"qad (from {start})" if variant["kind"] == "qad" else start,
            "bits": variant["bits"], "group_size": group_label(variant["group_size"]), "kl": m["quant.kl"], "top1_agreement": m["quant.top1_agreement"],
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


SCALING_COLUMNS = ["run", "examples", "train_tokens", "layers", "parameters", "steps", "epochs", "train_seconds", "first_step_seconds",
                   "tau", "tau_chat", "tau_code", "tau_knowledge", "tau_math", "accept_pos1", "heldout_blocks",
                   "tau_by_epoch", "seconds_by_epoch"]


def scaling_rows(scaling_dir: Path) -> list[dict]:
    """One row per scaling run (`drafter/n{size}-L{depth}`, an arm's `n{size}-L{depth}-{arm}`), sorted by
    depth, then data size, then run name (a size's plain run before its arms). A folder without runs
    but with the study's `table.csv` (a published study) gives that table's rows."""
    if not (scaling_dir / "drafter").is_dir() and (scaling_dir / "table.csv").is_file():
        return published_scaling_rows(scaling_dir / "table.csv")
    rows = []
    for folder in (scaling_dir / "drafter").glob("n*-L*/"):
        if not re.fullmatch(r"n\d+-L\d+(-[A-Za-z0-9_]+)?", folder.name):  # e.g. a *.partial-* folder of a run cut off
            continue
        m = json.loads((folder / "metrics.json").read_text())
        rows.append({
            "run": folder.name, "examples": m["train.examples"], "train_tokens": m["train.tokens"], "layers": m["drafter.layers"],
            "parameters": m["drafter.parameters"], "steps": m["train.steps"],
            "epochs": round(m["train.steps"] * m.get("train.batch_size", 0) / m["train.examples"], 3) if m.get("train.batch_size") else "",
            "train_seconds": m["train.seconds"], "first_step_seconds": m.get("train.first_step_seconds", ""), "tau": round(m["final.tau"], 4),
            **{f"tau_{c}": round(m[f"final.tau.{c}"], 4) for c in ("chat", "code", "knowledge", "math") if f"final.tau.{c}" in m},
            "accept_pos1": round(m["final.accept_rate_by_position"][0], 4), "heldout_blocks": m["final.blocks"],
            # after each epoch: what more passes over the same data buy, and what they cost
            "tau_by_epoch": " ".join(f"{t:.3f}" for t in m.get("train.tau_by_epoch", [])),
            "seconds_by_epoch": " ".join(f"{t:.0f}" for t in m.get("train.seconds_by_epoch", [])),
        })
    return sorted(rows, key=lambda r: (r["layers"], r["examples"], r["run"]))


def published_scaling_rows(path: Path) -> list[dict]:
    """The rows of a scaling `table.csv` as `scaling_rows` gives them (its counts as numbers again)."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    missing = sorted({"run", "examples", "layers", "tau"} - set(rows[0] if rows else {}))
    if missing:
        raise SystemExit(f"{path}: not a drafter scaling table (no column {', '.join(missing)})")
    for r in rows:
        r["examples"], r["layers"] = int(r["examples"]), int(r["layers"])
    return sorted(rows, key=lambda r: (r["layers"], r["examples"], r["run"]))


def studies_rows(folders: list[Path]) -> list[dict]:
    """The runs of several scaling studies in one table, each run named `<study>/<run>` (two studies
    have runs of the same name), so that one figure shows tau-hat against passes across them."""
    if len(folders) == 1:
        return scaling_rows(folders[0])
    rows = []
    for folder in folders:
        found = scaling_rows(folder)
        if not found:  # e.g. results/<experiment> for results/<experiment>/scaling: say so, not a figure without it
            raise SystemExit(f"{folder}: no finished scaling runs (drafter/n*-L*/metrics.json) and no table.csv")
        rows += [dict(r, run=f"{study_name(folder)}/{r['run']}") for r in found]
    return rows


def study_name(folder: Path) -> str:
    """A short name for a study's folder: results/<experiment>/scaling -> <experiment>;
    results/published/2026-12-02-h200-drafter-schedule/qwen -> drafter-schedule/qwen."""
    parts = list(folder.resolve().parts)
    if parts[-1] == "scaling":
        return parts[-2]
    for i in range(len(parts) - 1, -1, -1):
        dated = re.fullmatch(r"\d{4}-\d{2}-\d{2}-(?:h200x?\d*-|cpu-)?(.+)", parts[i])
        if dated:
            return "/".join([dated.group(1), *parts[i + 1:]])
    return parts[-1]


NODE_COLUMNS = ["rule", "output", "start_s", "took_s", "status"]
_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^(?:local)?rule (\w+):$")


def node_rows(log: Path) -> list[dict]:
    """What each job of a Snakemake run took, from its log (a PROVENANCE's node-time table): the rule,
    its output (the part after results/<experiment>/), seconds from the run's first job to its start,
    and its wall time, or the time it had run when the log ends ("not finished": cut, or still running)
    or failed. Nodes that share a device run side by side, so a took_s is that node's wall time there."""
    rows, by_id, stamp, first, current, failing = [], {}, None, None, None, False
    for line in log.read_text(errors="replace").splitlines():
        line = line.rstrip()
        match = _STAMP.match(line)
        if match:
            stamp = datetime.strptime(" ".join(match.group(1).split()), "%a %b %d %H:%M:%S %Y")
            continue
        match = _RULE.match(line)
        if match:
            current = {"rule": match.group(1), "output": "", "start": stamp, "end": None, "status": "not finished"}
            first = first or stamp
            continue
        key, _, value = line.strip().partition(": ")
        if line.startswith("Error in rule "):
            current, failing = None, True  # its jobid line names the job that failed
        elif failing:
            if key == "jobid" and value.isdigit():
                job = by_id.get(int(value))
                if job is not None:
                    job["end"], job["status"] = stamp, "failed"
                failing = False
        elif line.startswith("Finished jobid: "):
            job = by_id.get(int(line.split()[2]))
            if job is not None:
                job["end"], job["status"] = stamp, "done"
        elif current is not None and key == "output" and not current["output"]:
            current["output"] = re.sub(r"^(?:.*?/)?results/[^/]+/", "", value.split(",")[0].strip())
        elif current is not None and key == "jobid" and value.isdigit() and "id" not in current:
            current["id"] = int(value)
            by_id[current["id"]] = current
            rows.append(current)
    last = stamp
    out = []
    for job in rows:
        if job["rule"] == "all" or job["start"] is None:
            continue
        end = job["end"] or last
        out.append({"rule": job["rule"], "output": job["output"], "start_s": int((job["start"] - first).total_seconds()),
                    "took_s": int((end - job["start"]).total_seconds()), "status": job["status"]})
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m qdflash.tables")
    parser.add_argument("table", choices=["target", "scaling", "nodes"])
    parser.add_argument("folder", type=Path, nargs="+",
                        help="results/<experiment> (target) or results/<experiment>/scaling; scaling: several studies "
                             "(a study's folder, or a published one with its table.csv) side by side; nodes: a Snakemake log")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV")
    parser.add_argument("--md", type=Path, help="write the markdown table here instead of printing it")
    parser.add_argument("--png", type=Path, help="scaling: also draw tau-hat after every epoch (figures.scaling_figure)")
    args = parser.parse_args(argv)
    if args.table in ("target", "nodes") and len(args.folder) > 1:
        sys.exit(f"{args.table}: one {'results/<experiment> folder' if args.table == 'target' else 'Snakemake log'} at a time")
    if args.table == "nodes" and not args.folder[0].is_file():
        sys.exit(f"nodes: {args.folder[0]} is not a file (a Snakemake log, e.g. results/published/<run>/snakemake.log)")
    rows, columns = {"target": lambda: (target_quality_rows(args.folder[0]), TARGET_COLUMNS),
                     "scaling": lambda: (studies_rows(args.folder), SCALING_COLUMNS),
                     "nodes": lambda: (node_rows(args.folder[0]), NODE_COLUMNS)}[args.table]()
    where = " ".join(str(f) for f in args.folder)
    if not rows:
        sys.exit(f"{where}: no finished runs to tabulate")
    if args.csv:
        write_csv(rows, columns, args.csv)
    if args.png:
        if args.table != "scaling":
            sys.exit("--png: only the scaling table has a figure")
        from .figures import scaling_figure

        figure = scaling_figure(rows)
        if figure is None:
            sys.exit(f"{where}: no run recorded tau-hat by epoch; nothing to draw for --png")
        figure.savefig(args.png, dpi=120)
    text = markdown(rows, columns)
    if args.md:
        args.md.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
