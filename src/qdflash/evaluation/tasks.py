"""Local lm-eval tasks over the offline evaluation items (never training prompts), and running them.

lm-eval's built-in tasks download from the Hub; here each task is a YAML with `dataset_path: json`
and absolute `data_files` (DESIGN.md), written next to the node's outputs together with its items, so
a run is reproducible from its folder. Users with the Hub can name lm-eval's standard tasks instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.sources import PromptItem

MMLU_INSTRUCTION = "Answer with the letter of the correct option, then explain briefly."


def write_mmlu_task(folder: Path, items: list[PromptItem], name: str = "qdflash_mmlu") -> str:
    """A zero-shot multiple-choice task over MMLU gate items: the question and its options, then
    "Answer:"; the choices " A" .. " D" (lm-eval adds the space) scored by log-likelihood (acc). Returns the task name."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w") as f:
        for item in items:
            question = item.prompt.replace(MMLU_INSTRUCTION, "").rstrip()
            f.write(json.dumps({"id": item.id, "question": question, "answer": "ABCD".index(item.reference)}) + "\n")
    (folder / f"{name}.yaml").write_text("\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{question}}\\nAnswer:"',
        'doc_to_choice: ["A", "B", "C", "D"]',  # lm-eval puts its target delimiter (a space) before each
        "doc_to_target: answer",
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ]))
    return name


def evaluate(lm, task_folder: Path, tasks: list[str], limit: int | None = None) -> dict[str, list[float]]:
    """Run `tasks` (defined in `task_folder`) with the lm-eval model `lm`; per task the per-item
    scores in document order (acc for multiple choice, exact_match for generation)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder))
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                                  bootstrap_iters=0, random_seed=0)
    scores = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        metric = "acc" if "acc" in samples[0] else "exact_match"
        scores[task] = [float(s[metric]) for s in samples]
    return scores
