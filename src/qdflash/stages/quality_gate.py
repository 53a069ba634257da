"""quality_gate node: one quantized target variant against the 16-bit target, through lm-eval.

Both models answer the same evaluation items (never a training prompt): the MMLU items reserved for
gates (multiple choice, log-likelihood), GSM8K test questions (generation, greedy, through the
model's chat template; the last number of the answer is scored). The "qdflash" lm-eval model
(qdflash.evaluation.lm) runs on local task files written into the node's folder (`tasks/`).

Two modes, so the 16-bit target is evaluated once per DAG run and not once per variant:
- `variant=null`: the 16-bit target's per-item scores -> `scores.json` (the reference);
- `variant=<export folder>` with `reference=<that folder>`: the variant's scores, and each task's
  gate (qdflash.evaluation.gates): the variant must score at least `ratio` x the 16-bit target's,
  judged on the paired per-item scores with a 95% confidence interval and a minimum sample count;
  only `pass` passes. The reference must have scored the very same items (checked by id).

Output (out_dir): `gates.csv` (task, n, scores, margin and its interval, verdict), `scores.json`,
`tasks/`, metrics.json with the same and `passes_gates`. With `gates.strict`, a variant that does
not pass fails the node (and so the DAG).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from ..data.sources import load_source
from ..errors import QdflashError
from ..evaluation.gates import judge, passes_all
from ..evaluation.lm import QdflashLM
from ..evaluation.tasks import evaluate, write_gsm8k_task, write_mmlu_task
from ..models import load_target
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.quality_gate")
# task -> (writer(folder, items, **options), chat template?, options read from gates.tasks.<task>)
TASKS = {"mmlu": (write_mmlu_task, False, ()), "gsm8k": (write_gsm8k_task, True, ("max_gen_toks",))}


def gate_items(cfg: DictConfig, task: str, limit: int):
    """The source's evaluation items (never training prompts), the first `limit` in a fixed hash order."""
    spec = cfg.data.sources.get(task)
    source = load_source(task, spec.path if spec is not None else None, mmlu_gate_fraction=cfg.data.mmlu_gate_fraction)
    if not source.eval_items:
        raise QdflashError(f"gates.tasks.{task}: the {task} source ({source.location}) has no evaluation items")
    ordered = sorted(source.eval_items, key=lambda item: hashlib.sha256(item.id.encode()).hexdigest())
    return ordered[:limit], source.location


def score(model: str, cfg: DictConfig, folder: Path, names: dict[str, str]) -> dict[str, list[float]]:
    """Per-item scores of one model on every task (chat tasks through its chat template)."""
    target = load_target(model, dtype=cfg.dtype, device=cfg.device)
    log.info("evaluating %s on %s", target.source, ", ".join(names.values()))
    lm = QdflashLM(target)
    scores = {}
    for task, name in names.items():
        scores[task] = evaluate(lm, folder, [name], chat=TASKS[task][1])[name]
    return scores


def read_reference(folder: Path, items: dict[str, list[str]]) -> dict[str, list[float]]:
    """The 16-bit target's per-item scores, checked to be on the same items as this gate's."""
    path = Path(folder) / "scores.json"
    if not path.is_file():
        raise QdflashError(f"reference={folder}: no scores.json (expected the 16-bit target's quality_gate folder)")
    saved = json.loads(path.read_text())
    for task, ids in items.items():
        if task not in saved or saved[task]["ids"] != ids:
            raise QdflashError(f"{path}: the 16-bit target was not scored on this gate's {task} items "
                               "(the gates config changed since); re-run it")
    return {task: saved[task]["scores"] for task in items}


@stage("quality_gate")
def main(cfg: DictConfig, run: NodeRun) -> None:
    unknown = sorted(set(cfg.gates.tasks) - set(TASKS))
    if unknown:
        raise QdflashError(f"gates.tasks: {unknown} have no local task yet (available: {sorted(TASKS)})")
    folder = run.dir / "tasks"
    names, items = {}, {}
    for task, task_cfg in cfg.gates.tasks.items():
        chosen, location = gate_items(cfg, task, int(task_cfg.max_items))
        writer, _, options = TASKS[task]
        names[task] = writer(folder, chosen, **{k: task_cfg[k] for k in options if k in task_cfg})
        items[task] = [item.id for item in chosen]
        run.metrics[f"{task}.source"] = location
    if cfg.variant is None:  # the reference: the 16-bit target's scores, for every variant's gate
        scores = score(cfg.model.name, cfg, folder, names)
        (run.dir / "scores.json").write_text(json.dumps({t: {"ids": items[t], "scores": scores[t]} for t in names}))
        for task, values in scores.items():
            run.metrics.update({f"{task}.n": len(values), f"{task}.score": round(sum(values) / max(len(values), 1), 4)})
            log.info("%s: 16-bit %.3f over %d items", task, run.metrics[f"{task}.score"], len(values))
        run.metrics["variant"] = "16-bit"
        return
    if cfg.reference is None:
        raise QdflashError("reference: the 16-bit target's quality_gate folder (variant=null) is required to judge a variant")
    reference = read_reference(Path(cfg.reference), items)
    variant = score(cfg.variant, cfg, folder, names)
    (run.dir / "scores.json").write_text(json.dumps({t: {"ids": items[t], "scores": variant[t]} for t in names}))
    results = []
    for task in names:
        task_cfg = cfg.gates.tasks[task]
        result = judge(task, variant[task], reference[task], float(task_cfg.ratio),
                       int(task_cfg.get("min_samples") or cfg.gates.min_samples))
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
