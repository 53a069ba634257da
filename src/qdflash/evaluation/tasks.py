"""Local lm-eval tasks over the offline evaluation items (never training prompts), and running them.

lm-eval's built-in tasks download from the Hub; here each task is a YAML, its items (JSONL) and a
loader module, written next to the node's outputs, so a run is reproducible from its folder. The
folder is self-contained: the YAML names no path (the loader reads the JSONL beside itself), so it
still runs after the node moves its staging folder into place, or after a user copies it
(`lm_eval --model hf --include_path <gates folder>/tasks --tasks <name>`). Users with the Hub can
name lm-eval's standard tasks instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.sources import PromptItem
from ..errors import QdflashError

MMLU_INSTRUCTION = "Answer with the letter of the correct option, then explain briefly."


# lm-eval calls a task's `custom_dataset` with its metadata as keyword arguments (version, ...).
_DOCS_MODULE = '''"""Written by qdflash: the {name} task's documents, read from the JSONL beside this file, so the
task folder names no absolute path and runs wherever it is (lm-eval resolves `!function` beside the YAML)."""
from pathlib import Path


def load(**_metadata):
    import datasets

    return datasets.load_dataset("json", data_files={{"test": str(Path(__file__).with_name("{name}.jsonl"))}})
'''


def write_task(folder: Path, name: str, rows: list[dict], lines: list[str]) -> str:
    """Write a local task: `<name>.jsonl` (its documents), `<name>_docs.py` (loads them as the test
    split) and `<name>.yaml` (lm-eval's task over them, then `lines`: output type, prompt, scoring).
    Returns the name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}_docs.py").write_text(_DOCS_MODULE.format(name=name))
    header = [f"task: {name}", "dataset_path: json", f"custom_dataset: !function {name}_docs.load", "test_split: test"]
    (folder / f"{name}.yaml").write_text("\n".join([*header, *lines, "metadata:", "  version: 1.0", ""]))
    return name


def greedy_generation(max_gen_toks: int) -> list[str]:
    """The YAML lines of a greedy generation budget (no stop string: the model's EOS ends it)."""
    return ["output_type: generate_until", "generation_kwargs:", "  until: []", "  do_sample: false",
            f"  max_gen_toks: {int(max_gen_toks)}"]


def scoring_module(folder: Path, name: str, module: str, functions: list[str]) -> str:
    """`<name>_utils.py` re-exporting scoring functions: lm-eval resolves `!function module.fn` only
    as a `module.py` beside the YAML (lm_eval.utils.import_function), never as a package path."""
    utils = f"{name}_utils"
    (folder / f"{utils}.py").write_text('"""Written by qdflash: lm-eval imports `!function` targets from beside the YAML."""\n'
                                        f"from {module} import {', '.join(functions)}  # noqa: F401\n")
    return utils


def write_mmlu_task(folder: Path, items: list[PromptItem], name: str = "qdflash_mmlu") -> str:
    """A zero-shot multiple-choice task over MMLU gate items: the question and its options, then
    "Answer:"; the choices " A" .. " D" (lm-eval adds the space) scored by log-likelihood (acc). Returns the task name."""
    rows = [{"id": item.id, "question": item.prompt.replace(MMLU_INSTRUCTION, "").rstrip(), "answer": "ABCD".index(item.reference)}
            for item in items]
    return write_task(folder, name, rows, [
        "output_type: multiple_choice",
        'doc_to_text: "{{question}}\\nAnswer:"',
        'doc_to_choice: ["A", "B", "C", "D"]',  # lm-eval puts its target delimiter (a space) before each
        "doc_to_target: answer",
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
    ])


GSM8K_INSTRUCTION = "Solve this step by step. End with the final answer as a number after \"The answer is\"."


def write_gsm8k_task(folder: Path, items: list[PromptItem], name: str = "qdflash_gsm8k", max_gen_toks: int = 256) -> str:
    """A zero-shot generation task over GSM8K test items, greedy: the question and an instruction
    (sent through the model's chat template), the last number of the answer compared with the
    reference answer (lm-eval's "flexible extract": commas, $ and a final period ignored)."""
    rows = [{"id": item.id, "question": item.prompt, "answer": item.reference} for item in items]
    return write_task(folder, name, rows, [
        *greedy_generation(max_gen_toks),
        f"doc_to_text: {json.dumps('{{question}}' + chr(10) + chr(10) + GSM8K_INSTRUCTION)}",
        "doc_to_target: answer",
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
    ])


def task_manager(task_folder: Path, tasks: list[str]):
    """lm-eval's task index for `tasks`: the gate folder's tasks alone when it defines every one of them
    (indexing lm-eval's own ~14,000 task files takes ~10 s per call: every gate job paid it for nothing),
    else those with lm-eval's standard tasks (a Hub user's `lm_eval_task`)."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=str(task_folder), include_defaults=False)
    if all(task in local.all_tasks for task in tasks):
        return local
    return TaskManager(include_path=str(task_folder))


def evaluate(lm, task_folder: Path, tasks: list[str], limit: int | None = None, chat: bool = False,
             metric: str | None = None, num_fewshot: int | None = None, filter_name: str | None = None
             ) -> dict[str, tuple[list[str], list[float]]]:
    """Run `tasks` (local ones defined in `task_folder`, or lm-eval's standard task and group names)
    with the lm-eval model `lm`. Per task: the item ids (`<subtask>/<doc_id>`) and per-item scores,
    in a fixed order. `metric`: the per-sample metric to read (default: acc for multiple choice,
    exact_match for generation); a metric that is a list per sample (IFEval's instruction-level ones)
    scores the item by its mean. `filter_name`: which answer filter's scores to read, for tasks with
    several (e.g. GPQA's strict-match / flexible-extract). `chat`: send the prompts through the
    model's chat template (generation tasks: the targets are chat models)."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(task_folder, tasks), limit=limit, log_samples=True,
                                  bootstrap_iters=0, random_seed=0, apply_chat_template=chat, num_fewshot=num_fewshot)
    groups = out.get("group_subtasks", {})
    scores = {}
    for task in tasks:
        leaves = [task] if task in out["samples"] else _leaves(task, groups)
        ids, values = [], []
        for leaf in sorted(leaves):
            samples = _one_filter(leaf, out["samples"][leaf], filter_name)
            key = metric or next((m for m in ("acc", "exact_match") if m in samples[0]), "acc")
            if key not in samples[0]:
                raise QdflashError(f"lm-eval task {leaf} reports no per-sample {key!r} "
                                   f"(it has: {sorted(k for k in samples[0] if k not in _SAMPLE_FIELDS)})")
            ids += [f"{leaf}/{s['doc_id']}" for s in samples]
            values += [_item_score(s[key]) for s in samples]
        scores[task] = (ids, values)
    return scores


_SAMPLE_FIELDS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
                  "prompt_hash", "target_hash"}


def _leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks that hold samples under a group name (lm-eval groups nest: mmlu_pro -> its subjects)."""
    if task not in groups:
        raise QdflashError(f"lm-eval returned no samples for {task}")
    return [leaf for sub in groups[task] for leaf in ([sub] if sub not in groups else _leaves(sub, groups))]


def _one_filter(task: str, samples: list[dict], filter_name: str | None) -> list[dict]:
    """The samples of one answer filter, by doc_id (lm-eval logs one sample per doc and filter)."""
    filters = sorted({s.get("filter", "none") for s in samples})
    if filter_name is None and len(filters) > 1:
        raise QdflashError(f"lm-eval task {task} scores answers with several filters {filters}: name one (filter: ...)")
    chosen = filter_name or filters[0]
    if chosen not in filters:
        raise QdflashError(f"lm-eval task {task} has no answer filter {chosen!r} (it has {filters})")
    return sorted((s for s in samples if s.get("filter", "none") == chosen), key=lambda s: s["doc_id"])


def _item_score(value) -> float:
    if isinstance(value, (list, tuple)):  # e.g. one bool per instruction of an IFEval prompt
        return sum(float(v) for v in value) / max(len(value), 1)
    return float(value)
