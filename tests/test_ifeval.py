"""The offline IFEval gate task: the prompts load (and say where they looked when absent), every
instruction type in them is verified by lm-eval's own checkers with the nupunkt splitter and no NLTK
model, the scores are right on crafted responses, and the written task runs through lm-eval."""

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("nupunkt")
pytest.importorskip("langdetect")
pytestmark = pytest.mark.usefixtures("lm_eval_task_index")  # conftest: lm-eval's task files parsed once

from lm_eval.api.model import LM  # noqa: E402

from qdflash.errors import QdflashError  # noqa: E402
from qdflash.evaluation import ifeval  # noqa: E402
from qdflash.evaluation.ifeval import (  # noqa: E402
    SENTENCE_SPLITTER, install_offline_splitter, load_ifeval_items, process_results, write_ifeval_task,
)

SAMPLE_RESPONSE = """<<A Title>>

Section 1
*First highlighted part.* Dr. Smith went home. It was LATE! Was it? [name] lives at [address].

* one bullet
* another bullet

Section 2
This paragraph is the second one, and it says "hello" to everyone.
******
Another response, DON'T worry.

P.S. the end. Is there anything else I can help with?"""


def doc(instructions, kwargs, prompt="Write something."):
    return {"key": 1, "prompt": prompt, "instruction_id_list": instructions, "kwargs": kwargs}


@pytest.fixture
def shared_items():
    try:
        return load_ifeval_items()
    except QdflashError as err:  # a clone without ../shared/data (and no QDFLASH_DATA_DIR)
        pytest.skip(str(err))


@pytest.fixture
def no_nltk_models(monkeypatch):
    """NLTK data lookups fail loudly: the verifiers must not need punkt (or anything else)."""
    import nltk

    def refuse(resource, *args, **kwargs):
        raise AssertionError(f"an IFEval verifier asked NLTK for {resource}")

    install_offline_splitter()  # its import-time guard is not a verifier's lookup
    monkeypatch.setattr(nltk.data, "find", refuse)
    monkeypatch.setattr(nltk.data, "load", refuse)


def test_every_instruction_in_the_prompts_is_verified_offline(shared_items, no_nltk_models):
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT

    assert len(shared_items) == 541
    used = {i for item in shared_items for i in item["instruction_id_list"]}
    assert used <= set(INSTRUCTION_DICT), used - set(INSTRUCTION_DICT)
    checked = set()
    for item in shared_items:
        scores = process_results(item, [SAMPLE_RESPONSE])
        assert len(scores["inst_level_strict_acc"]) == len(item["instruction_id_list"])
        assert scores["prompt_level_strict_acc"] == all(scores["inst_level_strict_acc"])
        checked.update(item["instruction_id_list"])
    assert checked == used and len(used) == 25


def test_sentence_counting_and_the_number_of_sentences_instruction(no_nltk_models):
    from lm_eval.tasks.ifeval import instructions_util

    assert instructions_util.count_sentences("Dr. Smith went home. It was late! Was it?") == 3
    assert ifeval.word_tokenize("DON'T stop, Mr. Brown. OK?") == ["DO", "N'T", "stop", ",", "Mr.", "Brown", ".",
                                                                  "OK", "?"]
    fewer = doc(["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 3}])
    assert process_results(fewer, ["Dr. Smith went home. It was late."])["prompt_level_strict_acc"]
    assert not process_results(fewer, ["Dr. Smith went home. It was late! Was it?"])["prompt_level_strict_acc"]
    at_least = doc(["length_constraints:number_sentences"], [{"relation": "at least", "num_sentences": 3}])
    assert process_results(at_least, ["Dr. Smith went home. It was late! Was it?"])["prompt_level_strict_acc"]
    capitals = doc(["change_case:capital_word_frequency"], [{"capital_relation": "at least", "capital_frequency": 3}])
    assert process_results(capitals, ["DON'T do THAT."])["prompt_level_strict_acc"]  # DO, N'T, THAT
    assert not process_results(capitals, ["Don't do THAT."])["prompt_level_strict_acc"]


def test_install_is_idempotent_and_scoped():
    import nltk
    from lm_eval.tasks.ifeval import instructions_util

    install_offline_splitter()
    patched = instructions_util.nltk
    install_offline_splitter()
    assert instructions_util.nltk is patched  # not wrapped twice
    assert nltk.word_tokenize is not ifeval.word_tokenize  # the real nltk is untouched
    assert patched.tokenize is nltk.tokenize  # everything else is NLTK's
    assert SENTENCE_SPLITTER.startswith("nupunkt ") and SENTENCE_SPLITTER[len("nupunkt "):][0].isdigit()


def test_strict_and_loose_scores():
    item = doc(["punctuation:no_comma", "change_case:english_lowercase", "language:response_language"],
               [{}, {}, {"language": "en"}])
    good = "this answer has no commas and every letter is lowercase. it is written in plain english for you."
    assert process_results(item, [good]) == {
        "prompt_level_strict_acc": True, "inst_level_strict_acc": [True, True, True],
        "prompt_level_loose_acc": True, "inst_level_loose_acc": [True, True, True]}
    bad = "This answer, sadly, has commas. It is also written in plain English for you."
    assert process_results(item, [bad]) == {
        "prompt_level_strict_acc": False, "inst_level_strict_acc": [False, False, True],
        "prompt_level_loose_acc": False, "inst_level_loose_acc": [False, False, True]}
    # the loose score forgives a first line of preamble; the strict one does not
    preamble = "Sure, Here It Is:\n" + good
    scores = process_results(item, [preamble])
    assert not scores["prompt_level_strict_acc"] and scores["prompt_level_loose_acc"]
    assert process_results(item, [""])["inst_level_strict_acc"] == [False] * 3  # an empty answer follows nothing


def test_a_random_verifier_argument_is_fixed_by_the_prompt_key():
    import random

    # as in IFEval prompt 1129: "!" is no letter, so lm-eval's checker draws a random one instead
    item = doc(["keywords:letter_frequency"], [{"let_relation": "at least", "letter": "!", "let_frequency": 6}])
    responses = [letter * 6 for letter in "abcdefghijklmnopqrstuvwxyz"]
    verdicts = []
    for seed in (0, 1):
        random.seed(seed)
        verdicts.append([process_results(item, [r])["prompt_level_strict_acc"] for r in responses])
        assert random.random() == random.Random(seed).random()  # the caller's random state is left as it was
    assert sum(verdicts[0]) == 1 and verdicts[0] == verdicts[1]  # one letter, the same whatever the caller's seed


def test_missing_data_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(ifeval, "shared_data_dir", lambda: None)
    monkeypatch.delenv("QDFLASH_DATA_DIR", raising=False)
    with pytest.raises(QdflashError) as err:
        load_ifeval_items()
    assert "$QDFLASH_DATA_DIR/ifeval (not set)" in str(err.value) and "../shared/data/ifeval" in str(err.value)
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path))
    with pytest.raises(QdflashError, match="input_data.jsonl"):
        load_ifeval_items()
    with pytest.raises(QdflashError, match="nope"):
        load_ifeval_items(tmp_path / "nope")


def test_data_folder_order_and_bad_rows(tmp_path, monkeypatch):
    row = doc(["punctuation:no_comma"], [{}])
    (tmp_path / "env" / "ifeval").mkdir(parents=True)
    (tmp_path / "env" / "ifeval" / "input_data.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "env"))
    assert load_ifeval_items() == [row]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({"key": 2, "prompt": "p"}) + "\n")
    with pytest.raises(QdflashError, match=r"bad.jsonl, line 2: missing instruction_id_list, kwargs"):
        load_ifeval_items(bad)  # an explicit path wins over $QDFLASH_DATA_DIR


class FixedLM(LM):
    """An lm-eval model whose answers are fixed strings, one per request in order."""

    def __init__(self, answers):
        super().__init__()
        self.answers, self.requests = answers, []

    def generate_until(self, requests):
        start = len(self.requests)
        self.requests += requests
        return [self.answers[start + i] for i in range(len(requests))]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


def test_task_runs_through_lm_eval(tmp_path):
    items = [doc(["punctuation:no_comma"], [{}], prompt="Say hi without commas."),
             doc(["startend:quotation"], [{}], prompt="Quote yourself."),
             doc(["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 2}],
                 prompt="One sentence please."),
             doc(["punctuation:no_comma"], [{}], prompt="Not reached: limit 3.")]
    for key, item in enumerate(items):
        item["key"] = key
    name = write_ifeval_task(tmp_path, items, max_gen_toks=32)
    assert name == "qdflash_ifeval"
    assert "process_results: !function qdflash_ifeval_utils.process_results" in (tmp_path / f"{name}.yaml").read_text()

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tmp_path))
    lm = FixedLM(["hi there", "no quotes here", "Dr. Smith went home."])
    out = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=manager, limit=3, log_samples=True,
                                  bootstrap_iters=0, random_seed=0)
    assert [r.args[0] for r in lm.requests] == [item["prompt"] for item in items[:3]]
    assert lm.requests[0].args[1]["max_gen_toks"] == 32 and lm.requests[0].args[1]["until"] == []
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    assert [float(s["prompt_level_strict_acc"]) for s in samples] == [1.0, 0.0, 1.0]
    assert out["results"][name]["inst_level_strict_acc,none"] == pytest.approx(2 / 3)
