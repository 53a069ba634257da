"""quality_gate node: one quantized target variant against the 16-bit target, through lm-eval.

Both models answer the same evaluation items (never a training prompt), through the "qdflash"
lm-eval model (qdflash.evaluation.lm). Local tasks, written into the node's folder (`tasks/`) over
the offline data: `mmlu` (the MMLU items reserved for gates; multiple choice, log-likelihood),
`gsm8k` (test questions; greedy generation through the chat template, the last number scored),
`ifeval` (Google's 541 prompts, scored by lm-eval's verifiers with an offline sentence splitter,
qdflash.evaluation.ifeval; per item the fraction of its instructions followed, strict), and, behind
`allow_code_execution: true`, `humaneval` (the answers' code run against the tests). Any other
task key names one of lm-eval's standard tasks (`lm_eval_task: mmlu_pro`, with its metric, filter,
shots): the Hub path, for users who have it (the qwen3.5-4b profile: docs/recipe.md's gates).

Two modes, so the 16-bit target is evaluated once per DAG run and not once per variant:
- `variant=null`: the 16-bit target's per-item scores -> `scores.json` (the reference);
- `variant=<export folder>` with `reference=<that folder>`: the variant's scores, and each task's
  gate (qdflash.evaluation.gates): the variant must score at least `ratio` x the 16-bit target's,
  judged on the paired per-item scores with a 95% confidence interval and a minimum sample count,
  and only where the 16-bit target is shown to score above the task's chance floor (else
  `uninformative`); only `pass` passes. The reference must have scored the very same items (checked by id).

Output (out_dir): `gates.csv` (task, n, scores, margin and its interval, verdict, and what the gate can resolve: `needed_difference`, `power_if_equal`), `scores.json`,
`tasks/`, metrics.json with the same and `passes_gates`. With `gates.strict`, a variant that does
not pass fails the node (and so the DAG).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from ..data.sources import load_source
from ..errors import QdflashError, SourceNotFound
from ..evaluation.gates import RULES, judge, passes_all
from ..evaluation.lm import QdflashLM
from ..evaluation.humaneval import write_humaneval_task
from ..evaluation.ifeval import SENTENCE_SPLITTER, load_ifeval_items, write_ifeval_task
from ..evaluation.tasks import evaluate, write_gsm8k_task, write_mmlu_task
from ..models import load_target
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.quality_gate")


@dataclass(frozen=True)
class GateTask:
    """How one gate task runs: the lm-eval task name and how to read its per-item scores."""

    key: str                         # gates.tasks.<key>
    name: str                        # the lm-eval task (or group) name
    ids: list[str] | None            # local tasks: the item ids, known before scoring
    chat: bool = False               # prompts through the chat template
    metric: str | None = None        # per-sample metric (None: acc / exact_match)
    filter_name: str | None = None
    num_fewshot: int | None = None
    limit: int | None = None         # standard tasks: lm-eval's first N documents (per subtask)
    floor: float = 0.0               # the task's chance score


@dataclass(frozen=True)
class LocalTask:
    writer: Callable[..., str]       # writer(folder, items, **options) -> lm-eval task name
    chat: bool
    options: tuple[str, ...]         # keys of gates.tasks.<task> passed to the writer
    metric: str | None = None
    floor: float = 0.0               # chance score (gates.judge: a reference not above it is uninformative)


LOCAL_TASKS = {
    "mmlu": LocalTask(write_mmlu_task, False, (), floor=0.25),  # 4 options
    "gsm8k": LocalTask(write_gsm8k_task, True, ("max_gen_toks",)),
    # docs/recipe.md's IFEval gate is instruction-level strict accuracy: per item, the share of its instructions followed
    "ifeval": LocalTask(write_ifeval_task, True, ("max_gen_toks",), metric="inst_level_strict_acc"),
    # runs the model's code: only with gates.tasks.humaneval.allow_code_execution: true (the writer refuses otherwise)
    "humaneval": LocalTask(write_humaneval_task, True, ("max_gen_toks", "allow_code_execution"), metric="pass_at_1"),
}


def gate_items(cfg: DictConfig, task: str, limit: int):
    """The source's evaluation items (never training prompts), the first `limit` in a fixed hash order,
    with their ids and where they came from."""
    if task == "ifeval":  # instruction prompts only, not a training source
        items = load_ifeval_items(cfg.gates.tasks.ifeval.get("path"))
        ordered = sorted(items, key=lambda item: hashlib.sha256(str(item["key"]).encode()).hexdigest())[:limit]
        return ordered, [str(item["key"]) for item in ordered], f"ifeval ({len(items)} prompts)"
    spec = cfg.data.sources.get(task)
    source = load_source(task, spec.path if spec is not None else None, mmlu_gate_fraction=cfg.data.mmlu_gate_fraction)
    if not source.eval_items:
        raise QdflashError(f"gates.tasks.{task}: the {task} source ({source.location}) has no evaluation items")
    ordered = sorted(source.eval_items, key=lambda item: hashlib.sha256(item.id.encode()).hexdigest())[:limit]
    return ordered, [item.id for item in ordered], source.location


def plan_tasks(cfg: DictConfig, folder: Path, run: NodeRun) -> list[GateTask]:
    """Write the local tasks' files; resolve the standard ones. A local task marked `optional` whose
    items are found nowhere (offline, no $QDFLASH_DATA_DIR, no ../shared/data) is skipped, with the
    reason in metrics.json (`<task>.skipped`); the reference and every variant skip it alike."""
    plans = []
    for key, task_cfg in cfg.gates.tasks.items():
        if task_cfg.get("lm_eval_task"):
            plans.append(GateTask(key, str(task_cfg.lm_eval_task), None, bool(task_cfg.get("chat", True)),
                                  task_cfg.get("metric"), task_cfg.get("filter"), task_cfg.get("num_fewshot"),
                                  task_cfg.get("max_items"), float(task_cfg.get("floor") or 0.0)))
            run.metrics[f"{key}.source"] = f"lm-eval task {task_cfg.lm_eval_task}"
            continue
        if key not in LOCAL_TASKS:
            raise QdflashError(f"gates.tasks.{key}: no local task of that name (local: {sorted(LOCAL_TASKS)}); "
                               "for one of lm-eval's standard tasks, give its name as gates.tasks.<key>.lm_eval_task")
        local = LOCAL_TASKS[key]
        try:
            items, ids, location = gate_items(cfg, key, int(task_cfg.max_items))
        except SourceNotFound as err:
            if not task_cfg.get("optional", False):
                raise
            log.warning("gate task %s skipped (marked optional): %s", key, err)
            run.metrics[f"{key}.skipped"] = str(err)
            continue
        name = local.writer(folder, items, **{k: task_cfg[k] for k in local.options if k in task_cfg})
        floor = task_cfg.get("floor")
        plans.append(GateTask(key, name, ids, local.chat, local.metric, floor=local.floor if floor is None else float(floor)))
        run.metrics[f"{key}.source"] = location
        if key == "ifeval":
            run.metrics["ifeval.sentence_splitter"] = SENTENCE_SPLITTER
    if not plans:
        raise QdflashError(f"gates.tasks: none of {', '.join(cfg.gates.tasks)} could run (every one was skipped; "
                           "see the warnings above)")
    return plans


def score(model: str, cfg: DictConfig, folder: Path, plans: list[GateTask], run: NodeRun) -> dict[str, tuple[list[str], list[float]]]:
    """Item ids and per-item scores of one model on every task; `generation.backend` in the run's
    metrics says what generated its answers (engine / transformers batches, or the batch-1 loop)."""
    target = load_target(model, dtype=cfg.dtype, device=cfg.device)
    log.info("evaluating %s on %s", target.source, ", ".join(p.name for p in plans))
    lm = QdflashLM(target, batch_size=int(cfg.gates.batch_size), backend=cfg.gates.get("backend", "auto"))
    scores = {}
    for plan in plans:
        ids, values = evaluate(lm, folder, [plan.name], plan.limit, plan.chat, plan.metric, plan.num_fewshot,
                               plan.filter_name)[plan.name]
        scores[plan.key] = (plan.ids if plan.ids is not None else ids, values)
    run.metrics["generation.backend"] = ",".join(sorted(lm.backends_used)) or "batch-1 loop"
    return scores


def write_scores(folder: Path, scores: dict[str, tuple[list[str], list[float]]]) -> None:
    """scores.json: per task the item ids and per-item scores (what read_reference reads back)."""
    (folder / "scores.json").write_text(json.dumps({t: {"ids": i, "scores": v} for t, (i, v) in scores.items()}))


def read_reference(folder: Path, items: dict[str, list[str]]) -> dict[str, tuple[list[str], list[float]]]:
    """The 16-bit target's item ids and per-item scores, checked to be on the same items as this
    gate's (`items`: the ids known so far; standard tasks are checked again after scoring)."""
    path = Path(folder) / "scores.json"
    if not path.is_file():
        raise QdflashError(f"reference={folder}: no scores.json (expected the 16-bit target's quality_gate folder)")
    saved = json.loads(path.read_text())
    for task, ids in items.items():
        if task not in saved or (ids is not None and saved[task]["ids"] != ids):
            raise QdflashError(f"{path}: the 16-bit target was not scored on this gate's {task} items "
                               "(the gates config changed since); re-run it")
    return {task: (saved[task]["ids"], saved[task]["scores"]) for task in items}


@stage("quality_gate")
def main(cfg: DictConfig, run: NodeRun) -> None:
    folder = run.dir / "tasks"
    plans = plan_tasks(cfg, folder, run)
    if cfg.variant is None:  # the reference: the 16-bit target's scores, for every variant's gate
        scores = score(cfg.model.name, cfg, folder, plans, run)
        write_scores(run.dir, scores)
        for task, (_, values) in scores.items():
            run.metrics.update({f"{task}.n": len(values), f"{task}.score": round(sum(values) / max(len(values), 1), 4)})
            log.info("%s: 16-bit %.3f over %d items", task, run.metrics[f"{task}.score"], len(values))
        run.metrics["variant"] = "16-bit"
        return
    if cfg.reference is None:
        raise QdflashError("reference: the 16-bit target's quality_gate folder (variant=null) is required to judge a variant")
    rule = str(cfg.gates.get("rule") or "interval")
    if rule not in RULES:  # before a variant is scored: bad input fails at once
        raise QdflashError(f"gates.rule={rule!r}: expected one of {', '.join(RULES)}")
    reference = read_reference(Path(cfg.reference), {p.key: p.ids for p in plans})
    variant = score(cfg.variant, cfg, folder, plans, run)
    write_scores(run.dir, variant)
    results = []
    for plan in plans:
        (ref_ids, ref_scores), (ids, values) = reference[plan.key], variant[plan.key]
        if ref_ids != ids:
            raise QdflashError(f"{cfg.reference}: the 16-bit target was scored on other {plan.key} items than this variant")
        task_cfg = cfg.gates.tasks[plan.key]
        result = judge(plan.key, values, ref_scores, float(task_cfg.ratio),
                       int(task_cfg.get("min_samples") or cfg.gates.min_samples), plan.floor, rule)
        results.append(result)
        for key, value in dataclasses.asdict(result).items():
            if key != "task":
                run.metrics[f"{plan.key}.{key}"] = value
        log.info("%s: 16-bit %.3f (>= %.3f; floor %.2f), variant %.3f over %d items; variant - %.2f x 16-bit = %.3f "
                 "[%.3f, %.3f]: %s (at this spread, passing needs variant - 16-bit >= %+.3f; a variant as good as the "
                 "16-bit target would pass with probability %.2f, by the %s rule); point rule: %s, interval rule: %s", plan.key, result.reference,
                 result.reference_low, result.floor, result.variant, result.n, result.ratio, result.margin, result.low,
                 result.high, result.verdict, result.needed_difference, result.power_if_equal, rule, result.point_verdict,
                 result.interval_verdict)
    with open(run.dir / "gates.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(results[0])])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in results)
    report_only = {p.key for p in plans if cfg.gates.tasks[p.key].get("when_uninformative", "block") == "report"}
    for r in results:  # whether this task's verdict decided passes_gates (1) or was only reported (0)
        run.metrics[f"{r.task}.counts"] = int(not (r.verdict == "uninformative" and r.task in report_only))
    run.metrics["passes_gates"] = int(passes_all(results, report_only))  # 1 / 0 (metrics.json holds numbers)
    run.metrics["variant"] = str(cfg.variant)
    if cfg.gates.strict and not run.metrics["passes_gates"]:
        raise QdflashError(f"{cfg.variant} does not pass every gate (gates.strict): "
                           + ", ".join(f"{r.task} {r.verdict}" for r in results))


if __name__ == "__main__":
    main()
