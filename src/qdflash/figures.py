"""Figures of an experiment, drawn from its tables only (results/{experiment}/tables/*.csv).

The `figures` node writes them as PNG files and notebooks/results.ipynb draws them inline. Both
call these functions, so the notebook shows exactly what the report shows. Each function takes
table rows (lists of dicts as csv.DictReader gives them) and returns a matplotlib Figure, or None
when the tables hold nothing to draw (e.g. a sweep with a single window).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from .errors import QdflashError
from .variants import window_label

TABLES = ("summary", "speed", "quality", "training")


def read_table(tables: Path, name: str) -> list[dict]:
    """Rows of tables/<name>.csv; a clear error when the report has not written it."""
    path = Path(tables) / f"{name}.csv"
    if not path.is_file():
        raise QdflashError(f"{path} not found: expected the tables folder of a finished report node")
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def read_tables(tables: Path) -> dict[str, list[dict]]:
    return {name: read_table(tables, name) for name in TABLES}


def _num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _window_order(label: str) -> float:
    return -1.0 if label == "none" else float(label)


def drafter_bits_figure(summary: list[dict]) -> Figure | None:
    """τ and speedup over 16-bit autoregressive decoding against the drafter's bit width
    (window-less variants: the full prompt set)."""
    rows = sorted((r for r in summary if r["window"] == ""), key=lambda r: -int(r["drafter_bits"]))
    if not rows:
        return None
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    labels = [f"W{r['drafter_bits']}" if int(r["drafter_bits"]) < 16 else "16-bit" for r in rows]
    for ax, key, title in zip(fig.subplots(1, 2), ("tau_mean", "speedup_vs_ar16"),
                              ("τ (tokens per target forward)", "speedup vs 16-bit autoregressive")):
        values = [float(r[key]) for r in rows]
        ax.bar(labels, values, color="#4c72b0")
        for x, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
        if key == "speedup_vs_ar16":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("drafter weights")
    fig.suptitle(f"Drafter bit width ({rows[0]['target']}, no window)", fontsize=11)
    return fig


def long_bucket(speed: list[dict]) -> str | None:
    """The longest length bucket (p<N>) measured by every window job: where windows are compared."""
    by_window: dict[str, set[str]] = {}
    for r in speed:
        by_window.setdefault(window_label(r["window"]), set()).add(r["prompts"])
    common = set.intersection(*by_window.values()) if by_window else set()
    buckets = [p for p in common if re.match(r"p\d+", p)]
    return max(buckets, key=lambda p: int(re.match(r"p(\d+)", p).group(1))) if buckets else None


def window_figure(speed: list[dict]) -> Figure | None:
    """τ and speedup of each stage-2 drafter (uncompressed and compressed) on the QAD target against
    the drafter's sliding window, on the longest bucket every window job measured (a window only
    engages on a context longer than itself). The speedup is over autoregressive decoding of the same
    target measured in the same job, side by side: each window is its own job, and absolute tokens/s
    of jobs run at different times on a shared machine are not comparable."""
    bucket = long_bucket(speed)
    rows = [r for r in speed if r["prompts"] == bucket and r["method"].startswith("spec_qad_") and r["method"] != "spec_qad_stage1"]
    windows = sorted({window_label(r["window"]) for r in rows}, key=_window_order)
    if bucket is None or len(windows) < 2:
        return None
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for method in sorted({r["method"] for r in rows}):
        mine = {window_label(r["window"]): r for r in rows if r["method"] == method}
        xs = [w for w in windows if w in mine]
        label = method.removeprefix("spec_qad_")
        axes[0].plot(xs, [float(mine[w]["tau"]) for w in xs], marker="o", label=label)
        axes[1].plot(xs, [float(mine[w]["speedup_vs_ar_qad"]) for w in xs], marker="o", label=label)
    axes[0].set_title("τ", fontsize=10)
    axes[1].set_title("speedup vs autoregressive (same target, same job)", fontsize=10)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xlabel("drafter window (tokens)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Drafter sliding window, prompts of bucket {bucket}", fontsize=11)
    return fig


def target_bits_figure(quality: list[dict]) -> Figure | None:
    """Quality of each quantized target against its bit width, per method: top-1 agreement with the
    16-bit target, and each gate task's score (the 16-bit target's score dashed)."""
    rows = [r for r in quality if r["variant"] != "bf16"]
    if not rows:
        return None
    tasks = sorted({k.split(".")[0] for r in quality for k in r if k.endswith(".variant") and r[k] != ""})
    fig = Figure(figsize=(4 * (1 + len(tasks)), 3.2), layout="constrained")
    axes = fig.subplots(1, 1 + len(tasks), squeeze=False)[0]
    for method in sorted({r["method"] for r in rows}):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: int(r["bits"]))
        bits = [int(r["bits"]) for r in mine]
        axes[0].plot(bits, [float(r["top1_agreement"]) for r in mine], marker="o", label=method)
        for ax, task in zip(axes[1:], tasks):
            points = [(b, _num(r.get(f"{task}.variant"))) for b, r in zip(bits, mine)]
            points = [(b, v) for b, v in points if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
    axes[0].set_title("top-1 agreement with 16-bit", fontsize=10)
    for ax, task in zip(axes[1:], tasks):
        reference = [_num(r.get(f"{task}.reference")) for r in rows if _num(r.get(f"{task}.reference")) is not None]
        if reference:
            ax.axhline(reference[0], color="grey", ls="--", lw=0.8, label="16-bit")
        n = max((int(r[f"{task}.n"]) for r in rows if _num(r.get(f"{task}.n"))), default=0)
        ax.set_title(f"{task} score (n = {n})", fontsize=10)
    for ax in axes:
        ax.set_xlabel("target weight bits")
        ax.set_xticks(sorted({int(r["bits"]) for r in rows}))
    axes[0].legend(fontsize=8)
    fig.suptitle("Target quantization: quality vs bits", fontsize=11)
    return fig


def pareto_points(summary: list[dict], speed: list[dict], quality: list[dict]) -> list[dict]:
    """Speed (speedup over 16-bit autoregressive, full prompt set) and quality (top-1 agreement of
    the target with the 16-bit target) of every deployable variant and of the autoregressive
    baselines; `frontier` marks the points no other point beats on both."""
    agreement = {r["variant"]: float(r["top1_agreement"]) for r in quality}
    points = [{"name": r["variant"], "speedup": float(r["speedup_vs_ar16"]), "quality": agreement.get(r["target"])}
              for r in summary if r["window"] == ""]
    target = summary[0]["target"] if summary else None
    for r in speed:
        if r["window"] == "" and r["prompts"] == "all" and r["method"] in ("ar16", "ar_qad"):
            quality_of = 1.0 if r["method"] == "ar16" else agreement.get(target)
            points.append({"name": f"{r['method']} (autoregressive)", "speedup": float(r["speedup_vs_ar16"]), "quality": quality_of})
    points = [p for p in points if p["quality"] is not None]
    for p in points:
        p["frontier"] = not any(q["speedup"] >= p["speedup"] and q["quality"] >= p["quality"]
                                and (q["speedup"], q["quality"]) != (p["speedup"], p["quality"]) for q in points)
    return points


def label_lines(points: list[dict], near: float = 0.03) -> list[int]:
    """For each point, how many earlier points lie within `near` of it (as a fraction of each axis's
    span): the line its label goes on, so that labels of coinciding points do not overprint."""
    span = {k: (max(p[k] for p in points) - min(p[k] for p in points)) or 1.0 for k in ("speedup", "quality")}
    return [sum(all(abs(p[k] - q[k]) <= near * span[k] for k in span) for q in points[:i]) for i, p in enumerate(points)]


def pareto_figure(summary: list[dict], speed: list[dict], quality: list[dict]) -> Figure | None:
    points = pareto_points(summary, speed, quality)
    if not points:
        return None
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for p, line in zip(points, label_lines(points)):
        ax.scatter(p["speedup"], p["quality"], color="#c44e52" if p["frontier"] else "#8c8c8c", zorder=3)
        # variants that differ only in the drafter sit on one spot: their labels go one line apart
        ax.annotate(p["name"], (p["speedup"], p["quality"]), fontsize=7, xytext=(4, 2 - 9 * line), textcoords="offset points")
    front = sorted((p for p in points if p["frontier"]), key=lambda p: p["speedup"])
    ax.plot([p["speedup"] for p in front], [p["quality"] for p in front], color="#c44e52", lw=1, label="Pareto frontier")
    ax.set_xlabel("speedup vs 16-bit autoregressive (all prompts)")
    ax.set_ylabel("target top-1 agreement with 16-bit")
    ax.legend(fontsize=8)
    ax.set_title("Speed vs quality", fontsize=11)
    return fig


def scaling_figure(rows: list[dict]) -> Figure | None:
    """The drafter scaling study (`python -m qdflash.tables scaling`'s rows): held-out τ̂ after every
    epoch against the sequence passes trained by then (epochs x examples, log scale), one line per
    run, with the training seconds of its last epoch. Runs at equal passes and different data sizes
    show what repeating data costs; an arm beside its plain run, what its one change buys."""
    runs = [r for r in rows if str(r.get("tau_by_epoch") or "").strip()]
    if not runs:
        return None
    many = len(runs) > 6  # several studies side by side: the legend beside the axes, a color for each of up to 20
    fig = Figure(figsize=(10.5, 4.6) if many else (6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    colors = matplotlib.colormaps["tab20" if len(runs) > 10 else "tab10"].colors
    for k, r in enumerate(runs):
        taus = [float(t) for t in str(r["tau_by_epoch"]).split()]
        passes = [int(r["examples"]) * (i + 1) for i in range(len(taus))]
        seconds = str(r.get("seconds_by_epoch") or "").split()
        label = f"{r.get('run') or r['examples']} ({r['layers']} layers" + (f", {seconds[-1]} s)" if seconds else ")")
        ax.plot(passes, taus, marker="o", ms=3, label=label, color=colors[k % len(colors)])
    ax.set_xscale("log")
    ax.set_xlabel("sequence passes (epochs x examples)")
    ax.set_ylabel("held-out τ̂ (teacher-forced)")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    if many:
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    ax.set_title("Drafter stage 1: τ̂ after every epoch", fontsize=11)
    return fig


def draw_all(tables: dict[str, list[dict]]) -> dict[str, Figure]:
    """Every figure the tables support, by file stem."""
    figures = {
        "drafter_bits": drafter_bits_figure(tables["summary"]),
        "drafter_window": window_figure(tables["speed"]),
        "target_bits": target_bits_figure(tables["quality"]),
        "pareto": pareto_figure(tables["summary"], tables["speed"], tables["quality"]),
    }
    return {name: fig for name, fig in figures.items() if fig is not None}
