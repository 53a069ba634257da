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


GSM8K_INSTRUCTION = "Solve this step by step. End with the final answer as a number after \"The answer is\"."


def write_gsm8k_task(folder: Path, items: list[PromptItem], name: str = "qdflash_gsm8k", max_gen_toks: int = 256) -> str:
    """A zero-shot generation task over GSM8K test items, greedy: the question and an instruction
    (sent through the model's chat template), the last number of the answer compared with the
    reference answer (lm-eval's "flexible extract": commas, $ and a final period ignored)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w") as f:
        for item in items:
            f.write(json.dumps({"id": item.id, "question": item.prompt, "answer": item.reference}) + "\n")
    (folder / f"{name}.yaml").write_text("\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
        "output_type: generate_until",
        f"doc_to_text: {json.dumps('{{question}}' + chr(10) + chr(10) + GSM8K_INSTRUCTION)}",
        "doc_to_target: answer",
        "generation_kwargs:",
        "  until: []",
        "  do_sample: false",
        f"  max_gen_toks: {int(max_gen_toks)}",
        "filter_list:",
        "  - name: flexible-extract",
        "    filter:",
        "      - function: regex",
        "        group_select: -1",  # the last number of the answer
        '        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"',
        "      - function: take_first",
        "metric_list:",
        "  - metric: exact_match",
        "    aggregation: mean",
        "    higher_is_better: true",
        "    ignore_case: true",
        "    ignore_punctuation: false",
        '    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]',
        "metadata:",
        "  version: 1.0",
        "",
    ]))
    return name


def evaluate(lm, task_folder: Path, tasks: list[str], limit: int | None = None, chat: bool = False) -> dict[str, list[float]]:
    """Run `tasks` (defined in `task_folder`) with the lm-eval model `lm`; per task the per-item
    scores in document order (acc for multiple choice, exact_match for generation). `chat`: send the
    prompts through the model's chat template (the generation tasks: the targets are chat models)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder))
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                                  bootstrap_iters=0, random_seed=0, apply_chat_template=chat)
    scores = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        metric = next(m for m in ("acc", "exact_match", "prompt_level_strict_acc") if m in samples[0])
        scores[task] = [float(s[metric]) for s in samples]
    return scores
