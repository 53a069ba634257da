"""The experiment's tables (docs/design.md contract: results/{experiment}/tables/{quality,speed,training,summary}.csv)
and the selection of the fastest variant that passes every gate.

A *variant* is what a user would deploy: the speculative method on the quantized target (its target
bits), with one drafter (its bits) and one drafter window. Its speed comes from the benchmark job of
that window ("all prompts" row), its quality verdict from the target's quality gate. `selected`: the
fastest variant (its speedup over autoregressive 16-bit decoding measured in its own job) whose target
passes every gate and whose greedy outputs had no mismatch bug, among the variants measured on the
window-less job's prompts (a window job measures them too with `bench.window_prompts: all`, else only
its long prompts); none when no variant qualifies (said so in metrics.json, never guessed).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .errors import QdflashError
from .variants import parse_drafter, stack_name

SUMMARY_COLUMNS = ["variant", "target", "target_bits", "drafter", "drafter_bits", "window", "passes_gates", "selected",
                   "tau_mean", "tokens_per_s", "speedup_vs_hf", "speedup_vs_hf_compiled", "speedup_vs_ar16",
                   "speedup_vs_ar_quant", "mismatches", "mismatch_bugs", "prompts"]


def read_metrics(folder: Path) -> dict:
    path = Path(folder) / "metrics.json"
    if not path.is_file():
        raise QdflashError(f"{path} not found: expected the folder of a finished qdflash node")
    return json.loads(path.read_text())


def drafter_bits(method: str) -> tuple[str, int]:
    """(drafter name, bits) of a speculative method on the QAD target: spec_qad_stage2 -> (stage2, 16),
    spec_qad_gptq_w4g64 -> (gptq_w4g64, 4)."""
    return parse_drafter(method.removeprefix("spec_qad_"))


def summary_rows(bench_dirs: list[Path], target: str, target_bits: int, passes_gates: int) -> list[dict]:
    """One row per (drafter, window): the speculative methods on the quantized target, "all" prompts.
    transformers' baselines are measured in the window-less job only: a window row's speedups against
    them are blank (a ratio across processes and prompt sets would not be a measurement)."""
    rows = []
    for folder in bench_dirs:
        m = read_metrics(folder)
        window = m["window"]
        methods = sorted({k.split(".")[1] for k in m if k.startswith("all.spec_qad_") and k.endswith(".tokens_per_s")})
        for method in methods:
            if method == "spec_qad_stage1":
                continue  # the unadapted drafter: a training-stage comparison, not a deployable variant
            drafter, bits = drafter_bits(method)
            key = f"all.{method}"
            static = m.get("all.static16.tokens_per_s")
            rows.append({
                "variant": stack_name(target, drafter, window), "target": target,
                "target_bits": target_bits, "drafter": drafter, "drafter_bits": bits, "window": "" if window < 0 else window,
                "passes_gates": passes_gates, "selected": 0, "tau_mean": round(m[f"{key}.tau"], 4),
                "tokens_per_s": m[f"{key}.tokens_per_s"], "speedup_vs_hf": m.get(f"{key}.speedup_vs_plain16", ""),
                "speedup_vs_hf_compiled": round(m[f"{key}.tokens_per_s"] / static, 4) if static else "",
                "speedup_vs_ar16": m[f"{key}.speedup_vs_ar16"], "speedup_vs_ar_quant": m[f"{key}.speedup_vs_ar_qad"],
                "mismatches": m[f"{key}.mismatches"], "mismatch_bugs": m[f"{key}.mismatch_bugs"], "prompts": m["prompts"],
                "prompt_set": m.get("prompt_set", ""),  # not a column: which rows compare (select_fastest)
            })
    return rows


def select_fastest(rows: list[dict]) -> dict | None:
    """Mark (selected = 1) and return the fastest row that passes every gate with no mismatch bug: the
    highest `speedup_vs_ar16` (a ratio side by side in one process; tokens/s where a row has none).
    Only rows measured on the same prompts compare: the window-less job's, and a window job's where it
    measured the very same set (`prompt_set`, bench.window_prompts: all). A window job that measured only
    its long prompts does not compete with them (it is chosen only when no window-less row qualifies)."""
    eligible = [r for r in rows if r["passes_gates"] == 1 and r["mismatch_bugs"] == 0]
    if not eligible:
        return None
    full_sets = {r.get("prompt_set", "") for r in rows if r["window"] == ""} - {""}
    full = [r for r in eligible if r["window"] == "" or (r.get("prompt_set", "") in full_sets)] or eligible
    # rows of several jobs (one process each): rank by the speedup over autoregressive 16-bit decoding
    # measured in each row's own process, which a change of machine speed between jobs does not move
    ratio = all(r.get("speedup_vs_ar16") not in (None, "") for r in full)
    best = max(full, key=lambda r: float(r["speedup_vs_ar16"]) if ratio else float(r["tokens_per_s"]))
    best["selected"] = 1
    return best


def speed_rows(bench_dirs: list[Path]) -> list[dict]:
    """Every benchmark row (speed.csv of each window job) with its window."""
    rows = []
    for folder in bench_dirs:
        window = read_metrics(folder)["window"]
        with open(Path(folder) / "speed.csv") as handle:
            rows += [{"window": "" if window < 0 else window, **row} for row in csv.DictReader(handle)]
    return rows


def training_rows(drafter_dirs: list[Path]) -> list[dict]:
    """One row per drafter: stage 1 / stage 2 (training) and each compressed drafter."""
    rows = []
    for folder in drafter_dirs:
        m = read_metrics(folder)
        if "compressed.tau" in m:
            rows.append({"drafter": Path(folder).name, "kind": f"compressed ({m['compress.method']})",
                         "bits": m["compress.bits"], "tau": m["compressed.tau"], "tau_walk": "", "tau_before": m["uncompressed.tau"],
                         "draft_agreement": m.get("draft_agreement", ""), "weight_bytes": m["drafter.weight_bytes"],
                         "steps": "", "train_seconds": "", "epochs": "", "tau_by_epoch": "", "tau_walk_by_epoch": ""})
        else:
            rows.append({"drafter": Path(folder).name, "kind": f"stage {m['stage']}", "bits": 16, "tau": m["final.tau"],
                         # the rounds decoding runs on the held-out answers (drafter.train.walk_acceptance)
                         "tau_walk": m.get("final.walk.tau", ""), "tau_before": m.get("stage1_on_this_target.tau", ""), "draft_agreement": "",
                         "weight_bytes": "", "steps": m["train.steps"], "train_seconds": m["train.seconds"],
                         # tau-hat after each pass over the data (the last: final), ";"-joined in one cell
                         "epochs": m.get("train.epochs", ""),
                         "tau_by_epoch": ";".join(str(t) for t in m.get("train.tau_by_epoch", [])),
                         "tau_walk_by_epoch": ";".join(str(t) for t in m.get("train.walk_tau_by_epoch", []))})
    return rows


def quality_rows(target_rows: list[dict], gate_dirs: list[Path]) -> list[dict]:
    """The target table (KL, top-1, perplexity) joined with each variant's gate verdicts."""
    gates = {}
    for folder in gate_dirs:
        m = read_metrics(folder)
        tasks = sorted({k.split(".")[0] for k in m if k.endswith(".verdict")})
        gates[Path(folder).name] = {"passes_gates": m["passes_gates"],
                                    **{f"{t}.{f}": m[f"{t}.{f}"] for t in tasks for f in ("n", "reference", "variant", "low", "high", "verdict")},
                                    # both rules' verdicts beside the deciding one (gates.rule); absent in folders older than them
                                    **{f"{t}.{v}": m[f"{t}.{v}"] for t in tasks for v in ("point_verdict", "interval_verdict")
                                       if f"{t}.{v}" in m},
                                    # 0: an uninformative verdict only reported (gates.tasks.<t>.when_uninformative)
                                    **{f"{t}.counts": m.get(f"{t}.counts", 1) for t in tasks}}
    return [{**row, **gates.get(row["variant"], {})} for row in target_rows]


def write_rows(rows: list[dict], path: Path, columns: list[str] | None = None) -> None:
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
