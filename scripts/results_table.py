"""The README's results table, read from a run's tables (never typed in by hand).

    python scripts/results_table.py results/published/2026-11-30-cpu-default-sweep --model smollm2-135m   # prints it
    python scripts/results_table.py results/published/<date>-h200 --readme README.md   # puts it in the README

FOLDER is an experiment's results tree, or its published copy: tables/{summary,quality}.csv,
tables/metrics.json, bench/speedup_winnone/metrics.json. The row is the selected variant: the
fastest that passes every gate with no mismatch bug. When none qualifies, it is the fastest
window-less variant, marked "none selected". The row gives its τ, tokens/s, speedups and its
target's gate verdicts. Below it come the reference numbers of docs/recipe.md, for comparison
only, and a sentence on what differs. `--readme` replaces what stands between the lines
`<!-- results-table:start -->` and `<!-- results-table:end -->`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from qdflash.variants import is_pooled, window_name  # noqa: E402  (one source of the variant and row names)

WINDOWLESS = f"speedup_{window_name(None)}"  # the benchmark job without a drafter window: bench/speedup_winnone

START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
# docs/recipe.md, "Competition contract" and "Anchors": other setups, quoted for comparison
ANCHORS = [
    ("the paper: Qwen3.5-4B, quantized target + drafter, one A10G", "6.978× (average of 3 length categories, against its harness's baseline)", "all passed"),
    ("DFlash, Qwen3-4B drafter, B200 (τ 3.10–6.63)", "2.23–5.26× (Alpaca … HumanEval)", ""),
    ("z-lab Qwen3.5-4B DFlash drafter, B200, Math500", "3.5× (274 → 959 tokens/s)", ""),
]


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        sys.exit(f"results_table: {path} not found (expected the tables of a finished report node)")
    with open(path) as handle:
        return list(csv.DictReader(handle))


def pick(summary: list[dict]) -> tuple[dict, bool]:
    """(the row to show, whether it is the selected variant)."""
    selected = [r for r in summary if r["selected"] == "1"]
    if selected:
        return selected[0], True
    windowless = [r for r in summary if r["window"] == ""] or summary
    return max(windowless, key=lambda r: float(r["tokens_per_s"])), False


def times(value: str) -> str:
    return f"{float(value):.2f}×" if value not in ("", None) else "—"


def gate_text(quality: list[dict], target: str) -> str:
    row = next((r for r in quality if r["variant"] == target), None)
    if row is None:
        return "not run"
    tasks = sorted({k.split(".")[0] for k in row if k.endswith(".verdict") and row[k]})
    return "; ".join(f"{t} {float(row[t + '.variant']):.3f} vs {float(row[t + '.reference']):.3f} (n {row[t + '.n']}): "
                     f"{row[t + '.verdict']}{' (reported, not required)' if str(row.get(t + '.counts', 1)) == '0' else ''}"
                     f"{other_rule(row, t)}" for t in tasks) or "none"


def other_rule(row: dict, task: str) -> str:
    """Where the rule that did not decide (gates.rule) says otherwise, its verdict, so a reader sees both."""
    for rule in ("interval", "point"):
        other = row.get(f"{task}.{rule}_verdict")
        if other and other != row[f"{task}.verdict"]:
            return f" ({rule} rule: {other})"
    return ""


def device_of(folder: Path) -> str:
    bench = folder / "bench" / WINDOWLESS / "metrics.json"
    if bench.is_file():
        m = json.loads(bench.read_text())
        return m.get("cuda.device") or m.get("env.device", "?")
    return "?"


def model_of(folder: Path) -> str | None:
    """The target's name from any node config.yaml in the folder (pack.sh brings them back)."""
    import yaml

    for path in sorted(folder.rglob("config.yaml")):
        name = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("name")
        if name:
            return str(name)
    return None


def answers_of(folder: Path) -> int | None:
    path = folder / "data" / "bf16" / "metrics.json"
    if not path.is_file():
        return None
    metrics = json.loads(path.read_text())
    # multi-turn data (data.max_turns > 1) answer several turns per prompt: count the answers
    return metrics.get("train.answers", metrics.get("train.prompts"))


def agreement(folder: Path) -> str | None:
    """One sentence on losslessness from every benchmark job: greedy outputs that differ from this
    engine's autoregressive output at the same dtype, and how many of them count as bugs (any in
    fp32; in bf16, a reference top-2 margin above qdflash.bench.MARGIN_BUG)."""
    jobs = sorted((folder / "bench").glob("speedup_*/metrics.json"))
    if not jobs:
        return None
    mismatches = bugs = outputs = 0
    margins, dtypes = [], set()
    for path in jobs:
        m = json.loads(path.read_text())
        dtypes.add(str(m.get("dtype", "?")))
        methods = {k.split(".")[1] for k in m if k.startswith("all.") and k.endswith(".mismatches")}
        outputs += len(methods) * int(m.get("prompts", 0))
        for method in methods:
            mismatches += int(m[f"all.{method}.mismatches"])
            bugs += int(m[f"all.{method}.mismatch_bugs"])
            margins += [float(x) for x in m.get(f"all.{method}.divergence_margins", [])]
    worst = f"; largest top-2 margin at a divergence {max(margins):.4f}" if margins else ""
    return (f"Lossless check ({len(jobs)} benchmark jobs, {'/'.join(sorted(dtypes))}): {mismatches} of {outputs} speculative "
            f"greedy outputs differ from this engine's autoregressive output, {bugs} of them counted as bugs{worst}.")


def compile_caveat(folder: Path, row: dict) -> str | None:
    """A sentence when `generate`'s static compiled run (static16) spent one prompt compiling: a
    prompt at over 10x its median seconds per token. Runs before `qdflash.bench.warmup_lengths` (the
    two-length warm-up) had this. The sentence gives the shown variant's ratio without those prompts,
    for both methods, from the same benchmark's per-prompt rows."""
    path = folder / "bench" / WINDOWLESS / "speed.csv"
    if row["speedup_vs_hf_compiled"] in ("", None) or not path.is_file():
        return None
    rows = [r for r in read_csv(path) if r["prompts"] != "all" and not is_pooled(r["prompts"]) and int(r["tokens"]) > 0]
    static = {r["prompts"]: float(r["seconds"]) / int(r["tokens"]) for r in rows if r["method"] == "static16"}
    if len(static) < 3:
        return None
    median = statistics.median(static.values())
    slow = sorted(p for p, per_token in static.items() if per_token > 10 * median)
    if not slow:
        return None

    def totals(method: str, on_slow: bool) -> tuple[int, float]:
        """(tokens, seconds) of `method` on the slow prompts, or on all the others."""
        kept = [r for r in rows if r["method"] == method and (r["prompts"] in slow) == on_slow]
        return sum(int(r["tokens"]) for r in kept), sum(float(r["seconds"]) for r in kept)

    def rate_elsewhere(method: str) -> float:
        tokens, seconds = totals(method, on_slow=False)
        return tokens / seconds

    tokens, spent = totals("static16", on_slow=True)
    ratio = rate_elsewhere(f"spec_qad_{row['drafter']}") / rate_elsewhere("static16")
    return (f"Caveat on the static compiled column: in this run, `generate`'s static compiled cache took {spent:.1f} s "
            f"for {tokens} tokens on the {', '.join(slow)} prompts, over 10× its median time per token. That is a "
            f"compilation inside the measurement; the warm-up now compiles both cache shapes first "
            f"(`qdflash.bench.warmup_lengths`). Without those prompts, for both methods: {ratio:.2f}×.")


def pooled_text(folder: Path, row: dict) -> str | None:
    """The shown variant's τ and speedups on the pooled chat / math / code row of its own benchmark job
    (issue 21 states its targets there); None for a run whose speed.csv has no pooled row."""
    path = folder / "bench" / f"speedup_{window_name(int(row['window']) if row['window'] else None)}" / "speed.csv"
    method = f"spec_qad_{row['drafter']}"
    found = [r for r in read_csv(path) if is_pooled(r["prompts"]) and r["method"] == method] if path.is_file() else []
    if not found:
        return None
    r = found[0]
    kinds = " / ".join(r["prompts"].split("+"))
    return (f"On the timed held-out {kinds} prompts alone: τ {float(r['tau']):.2f}, {times(r['speedup_vs_ar16'])} autoregressive "
            f"16-bit decoding, {times(r['speedup_vs_ar_qad'])} autoregressive decoding of the quantized target.")


def differences(model: str, device: str, answers: int | None) -> str:
    parts = []
    if "qwen3.5-4b" not in model.lower():
        parts.append(f"the target here is {model}, not Qwen3.5-4B")
    if answers is not None:
        parts.append(f"its drafter learned from {answers:,} self-distilled answers, not the recipe's ~100 K")
    if "A10G" not in device:
        parts.append(f"the device is {device}, not the paper's A10G")
    parts.append("the paper's 6.978× is against its harness's baseline, not against this engine's own "
                 "autoregressive decoding")
    return "What differs: " + "; ".join(parts) + "."


def table(folder: Path, model: str | None = None) -> str:
    folder = Path(folder)
    summary = read_csv(folder / "tables" / "summary.csv")
    quality = read_csv(folder / "tables" / "quality.csv")
    model = model or model_of(folder)
    if model is None:
        sys.exit(f"results_table: no node config.yaml in {folder} names the model; pass --model")
    if not summary:
        sys.exit(f"results_table: {folder / 'tables' / 'summary.csv'} has no rows")
    row, selected = pick(summary)
    device = device_of(folder)
    window = row["window"] or "none"
    label = row["variant"] if selected else f"{row['variant']} (none selected: no variant passes its gates)"
    lines = [
        f"Run: `{folder}`, {model} on {device}. Speedups are tokens/s ratios, measured side by side in one process, "
        "batch 1, greedy, on the same prompts.",
        "",
        "| variant | τ | tokens/s | vs `generate` | vs `generate`, static compiled | vs AR 16-bit | vs AR quantized | gates of its target |",
        "|---|---|---|---|---|---|---|---|",
        f"| {label}, window {window} | {float(row['tau_mean']):.2f} | {float(row['tokens_per_s']):.1f} | "
        f"{times(row['speedup_vs_hf'])} | {times(row['speedup_vs_hf_compiled'])} | {times(row['speedup_vs_ar16'])} | "
        f"{times(row['speedup_vs_ar_quant'])} | {gate_text(quality, row['target'])} |",
        *(["", pooled] if (pooled := pooled_text(folder, row)) else []),
        *(["", caveat] if (caveat := compile_caveat(folder, row)) else []),
        *(["", agreement(folder)] if agreement(folder) else []),
        "",
        "For comparison (docs/recipe.md; other models, GPUs and baselines):",
        "",
        "| setup | speedup | gates |",
        "|---|---|---|",
        *(f"| {setup} | {speedup} | {gates} |" for setup, speedup, gates in ANCHORS),
        "",
        differences(model, device, answers_of(folder)),
    ]
    return "\n".join(lines)


def replace_block(readme: Path, text: str) -> None:
    content = readme.read_text()
    if START not in content or END not in content or content.index(START) > content.index(END):
        sys.exit(f"results_table: {readme} has no '{START}' ... '{END}' block to replace")
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--readme", type=Path, default=None)
    parser.add_argument("--model", default=None, help="the target's name, where no node config.yaml in FOLDER records it")
    args = parser.parse_args()
    text = table(args.folder, args.model)
    if args.readme:
        replace_block(args.readme, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
