"""quality_gate node: one quantized target variant against the 16-bit target, through lm-eval.

Both models answer the same evaluation items in this run (the MMLU items reserved for gates: never
a training prompt), through the "qdflash" lm-eval model (qdflash.evaluation.lm) on local task files
written into this node's folder (`tasks/`). Each task's gate (qdflash.evaluation.gates): the variant
must score at least `ratio` x the 16-bit target's, judged on the paired per-item scores with a 95%
confidence interval and a minimum sample count; only `pass` passes.

Output (out_dir): `gates.csv` (task, n, scores, margin and its interval, verdict), `tasks/`,
metrics.json with the same and `passes_gates`. With `gates.strict`, a variant that does not pass
fails the node (and so the DAG).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import logging

from omegaconf import DictConfig

from ..data.sources import load_source
from ..errors import QdflashError
from ..evaluation.gates import judge, passes_all
from ..evaluation.lm import QdflashLM
from ..evaluation.tasks import evaluate, write_mmlu_task
from ..models import load_target
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.quality_gate")
TASK_WRITERS = {"mmlu": write_mmlu_task}


def gate_items(cfg: DictConfig, task: str, limit: int):
    """The source's evaluation items (never training prompts), the first `limit` in a fixed hash order."""
    spec = cfg.data.sources.get(task)
    source = load_source(task, spec.path if spec is not None else None, mmlu_gate_fraction=cfg.data.mmlu_gate_fraction)
    if not source.eval_items:
        raise QdflashError(f"gates.tasks.{task}: the {task} source ({source.location}) has no evaluation items")
    ordered = sorted(source.eval_items, key=lambda item: hashlib.sha256(item.id.encode()).hexdigest())
    return ordered[:limit], source.location


@stage("quality_gate")
def main(cfg: DictConfig, run: NodeRun) -> None:
    unknown = sorted(set(cfg.gates.tasks) - set(TASK_WRITERS))
    if unknown:
        raise QdflashError(f"gates.tasks: {unknown} have no local task yet (available: {sorted(TASK_WRITERS)})")
    folder = run.dir / "tasks"
    names = {}
    for task, task_cfg in cfg.gates.tasks.items():
        items, location = gate_items(cfg, task, int(task_cfg.max_items))
        names[task] = TASK_WRITERS[task](folder, items)
        run.metrics[f"{task}.source"] = location
    scores = {}
    for role, name in (("reference", cfg.model.name), ("variant", cfg.variant)):
        target = load_target(name, dtype=cfg.dtype, device=cfg.device)
        log.info("evaluating the %s (%s) on %s", role, target.source, ", ".join(names.values()))
        scores[role] = evaluate(QdflashLM(target), folder, list(names.values()))
        del target
    results = []
    for task, name in names.items():
        result = judge(task, scores["variant"][name], scores["reference"][name], float(cfg.gates.tasks[task].ratio),
                       int(cfg.gates.min_samples))
        results.append(result)
        for key, value in dataclasses.asdict(result).items():
            if key != "task":
                run.metrics[f"{task}.{key}"] = value
        log.info("%s: 16-bit %.3f, variant %.3f over %d items; variant - %.2f x 16-bit = %.3f [%.3f, %.3f]: %s",
                 task, result.reference, result.variant, result.n, result.ratio, result.margin, result.low, result.high,
                 result.verdict)
    with open(run.dir / "gates.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(results[0])])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in results)
    run.metrics["passes_gates"] = int(passes_all(results))  # 1 / 0 (metrics.json holds numbers)
    run.metrics["variant"] = str(cfg.variant)
    if cfg.gates.strict and not run.metrics["passes_gates"]:
        raise QdflashError(f"{cfg.variant} does not pass every gate (gates.strict): "
                           + ", ".join(f"{r.task} {r.verdict}" for r in results))


if __name__ == "__main__":
    main()
