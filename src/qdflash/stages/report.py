"""report node: the experiment's tables and the selected variant (qdflash.report).

Output (out_dir = results/{experiment}/tables/): quality.csv (target variants: KL, top-1, perplexity,
gate verdicts), speed.csv (every benchmark row, with its window), training.csv (drafters: stage 1,
stage 2, compressed), summary.csv (one row per deployable variant, `selected` = the fastest that
passes every gate with no mismatch bug), metrics.json naming the selection (or why there is none).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ..report import (SUMMARY_COLUMNS, quality_rows, read_metrics, select_fastest, speed_rows, summary_rows, training_rows,
                      write_rows)
from ..tables import target_quality_rows
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.report")


@stage("report")
def main(cfg: DictConfig, run: NodeRun) -> None:
    bench = [Path(p) for p in cfg.bench_dirs]
    write_rows(quality_rows(target_quality_rows(Path(cfg.results)), [Path(p) for p in cfg.gate_dirs]), run.dir / "quality.csv")
    write_rows(speed_rows(bench), run.dir / "speed.csv")
    write_rows(training_rows([Path(p) for p in cfg.drafter_dirs]), run.dir / "training.csv")
    passes = int(read_metrics(Path(cfg.target_gate))["passes_gates"])
    rows = summary_rows(bench, str(cfg.target), int(cfg.target_bits), passes)
    best = select_fastest(rows)
    write_rows(rows, run.dir / "summary.csv", SUMMARY_COLUMNS)
    run.metrics.update({"variants": len(rows), "target": str(cfg.target), "target.passes_gates": passes})
    if best is None:
        reason = (f"{cfg.target} does not pass every gate (gates/{cfg.target}/gates.csv)" if not passes
                  else "every variant had a mismatch bug")
        run.metrics.update({"selected": "none", "selected.reason": reason})
        log.info("no variant selected: %s", reason)
    else:
        run.metrics.update({"selected": best["variant"], "selected.tokens_per_s": best["tokens_per_s"],
                            "selected.speedup_vs_ar16": best["speedup_vs_ar16"]})
        log.info("selected %s: %.2f tokens/s, %.2fx the 16-bit autoregressive loop", best["variant"],
                 best["tokens_per_s"], best["speedup_vs_ar16"])


if __name__ == "__main__":
    main()
