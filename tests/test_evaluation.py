"""The lm-eval adapter and the gate arithmetic: log-likelihoods equal a direct forward pass, generated
text equals autoregressive greedy decoding, a local multiple-choice task runs through lm-eval, and the
gate verdicts follow the confidence interval and the minimum sample count."""

import random

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("lm_eval_task_index")  # conftest: lm-eval's task files parsed once

from qdflash.data.sources import PromptItem  # noqa: E402
from qdflash.evaluation.gates import judge, passes_all  # noqa: E402
from qdflash.evaluation.lm import QdflashLM  # noqa: E402
from qdflash.evaluation.tasks import GSM8K_INSTRUCTION, evaluate, write_gsm8k_task, write_mmlu_task  # noqa: E402
from qdflash.spec import autoregressive_generate  # noqa: E402


class Req:
    def __init__(self, *args):
        self.args = args


def test_loglikelihood_equals_a_direct_forward_sum(tiny_llama):
    lm = QdflashLM(tiny_llama)
    context, continuation = "The capital of France is", " Paris, of course."
    (got, greedy), = lm.loglikelihood([Req(context, continuation)])
    tok = tiny_llama.tokenizer
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama.model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
    direct = sum(logp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
    assert got == pytest.approx(direct, abs=1e-5)
    assert isinstance(greedy, bool)


def test_single_token_choices_share_a_forward_and_score_as_each_alone(tiny_llama):
    lm = QdflashLM(tiny_llama)
    context = "Question: which colour is the sky?\nA. red\nB. blue\nAnswer:"
    requests = [Req(context, f" {c}") for c in "ABCD"] + [Req(context, " B, blue.")]
    together = lm.loglikelihood(requests)
    for request, got in zip(requests, together):
        ctx, cont = lm._split(*request.args)
        alone = lm.continuation_logprob(ctx, cont)
        assert got[0] == pytest.approx(alone[0], abs=1e-5) and got[1] == alone[1]
    assert len({round(r[0], 6) for r in together[:4]}) == 4  # four different tokens, four scores


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_batched_choice_scoring_gives_the_batch_1_scores(fixture, request):
    """gates.batch_size > 1: multiple-choice contexts of different lengths scored in right-padded
    batches give the batch-1 log-probabilities and greedy flags, in fp32, on llama and on the hybrid."""
    target = request.getfixturevalue(fixture)
    questions = ["Is the sky blue?", "Which is larger, 7 or 12, when both are written in base ten?", "2+2=",
                 "Name the planet closest to the sun, please, in one word.", "Red or green?"]
    requests = [Req(f"Question: {q}\nAnswer:", f" {c}") for q in questions for c in "ABCD"]
    one, batched = QdflashLM(target).loglikelihood(requests), QdflashLM(target, batch_size=2).loglikelihood(requests)
    for (alone, greedy_alone), (together, greedy_together) in zip(one, batched):
        assert together == pytest.approx(alone, abs=1e-4) and greedy_together == greedy_alone
    assert len({round(r[0], 4) for r in batched}) > len(questions)  # not one score repeated


def test_generate_until_is_autoregressive_greedy(tiny_llama):
    lm = QdflashLM(tiny_llama, max_gen_toks=12)
    prompt = "Once upon a time"
    text, = lm.generate_until([Req(prompt, {"until": [], "max_gen_toks": 12})])
    ids = tiny_llama.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = autoregressive_generate(tiny_llama, [ids], 12).tokens
    assert text == tiny_llama.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_batched_generation_gives_the_batch_1_text(fixture, request):
    """gates.batch_size > 1: greedy batches (per-request budgets and stop strings) give what batch-1
    generation gives, in fp32, on llama and on the hybrid, through the engine's batched generator
    (rows refilled) and through transformers' generate (sorted, left-padded)."""
    target = request.getfixturevalue(fixture)
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "2+2=", "List three colors", "Once"]
    requests = [Req(p, {"until": ["\n\n", "e"] if i == 2 else ["\n\n"], "max_gen_toks": 10 + 4 * (i % 2)})
                for i, p in enumerate(prompts)]
    one = QdflashLM(target).generate_until(requests)
    for backend in ("engine", "transformers"):
        lm = QdflashLM(target, batch_size=2, backend=backend)
        assert lm.generate_until(requests) == one, backend
        assert lm.backends_used == {backend}
    with pytest.raises(ValueError, match="not with a drafter"):
        QdflashLM(target, drafter=object(), batch_size=2)


def test_local_mmlu_task_runs_through_lm_eval(tiny_llama, tmp_path):
    items = [PromptItem(f"m{i}", "mmlu", "knowledge", f"Question {i}?\nA. red\nB. blue\nC. green\nD. black\n\n"
                        "Answer with the letter of the correct option, then explain briefly.", True, "ABCD"[i % 4])
             for i in range(6)]
    name = write_mmlu_task(tmp_path, items)
    lm = QdflashLM(tiny_llama)
    ids, scores = evaluate(lm, tmp_path, [name])[name]
    assert ids == [f"{name}/{i}" for i in range(6)]
    assert len(scores) == 6 and set(scores) <= {0.0, 1.0}
    # the same answers by hand: the choice with the highest log-likelihood
    for item, score in zip(items, scores):
        question = item.prompt.split("\n\nAnswer with")[0]
        lls = [lm.loglikelihood([Req(f"{question}\nAnswer:", f" {c}")])[0][0] for c in "ABCD"]
        assert score == float("ABCD"[max(range(4), key=lls.__getitem__)] == item.reference)


def test_local_tasks_skip_lm_evals_own_index_and_standard_tasks_keep_it(tmp_path):
    """Gate tasks written here are found without indexing lm-eval's ~14,000 task files; a standard task
    name (a Hub user's lm_eval_task) still gets lm-eval's index."""
    from qdflash.evaluation.tasks import task_manager

    items = [PromptItem("m0", "mmlu", "knowledge", "Q?\nA. a\nB. b\nC. c\nD. d\n\nAnswer with the letter.", True, "A")]
    name = write_mmlu_task(tmp_path, items)
    local = task_manager(tmp_path, [name])
    assert name in local.all_tasks and "gsm8k" not in local.all_tasks
    both = task_manager(tmp_path, [name, "gsm8k"])
    assert {name, "gsm8k"} <= set(both.all_tasks)


class ScriptedLM(lm_eval.api.model.LM):
    """An lm-eval model that answers each generation request by the first script key its prompt
    contains (lm-eval may reorder requests) and records the prompts."""

    def __init__(self, answers: dict):
        super().__init__()
        self.answers, self.prompts = answers, []

    def generate_until(self, requests):
        self.prompts += [r.args[0] for r in requests]
        return [next(a for key, a in self.answers.items() if key in r.args[0]) for r in requests]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        return "<user>" + chat_history[-1]["content"] + "</user>"

    @property
    def tokenizer_name(self):
        return "scripted"


def test_local_gsm8k_task_scores_the_last_number_of_the_answer(tmp_path):
    items = [PromptItem(f"g{i}", "gsm8k", "math", f"How many apples, case {i}?", True, ref)
             for i, ref in enumerate(["18", "1200", "7", "5"])]
    name = write_gsm8k_task(tmp_path, items, max_gen_toks=64)
    answers = {"case 0": "3 + 15 = 18 apples. The answer is 18.",      # last number, final period ignored
               "case 1": "She pays $1,200 in all. The answer is $1,200",  # $ and thousands separator ignored
               "case 2": "The answer is 7, not 8.",                     # the LAST number counts: wrong
               "case 3": "I do not know."}                              # no number: wrong
    lm = ScriptedLM(answers)
    _, scores = evaluate(lm, tmp_path, [name], chat=True)[name]
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert f"<user>{items[0].prompt}\n\n{GSM8K_INSTRUCTION}</user>" in lm.prompts  # through the chat template


def test_gate_verdicts():
    same = [1.0, 0.0] * 100
    assert judge("t", same, same, 0.9, min_samples=50).verdict == "pass"  # equal, and shown >= 90%
    worse = [0.0] * 200
    assert judge("t", worse, same, 0.9, min_samples=50).verdict == "fail"
    assert judge("t", same[:10], same[:10], 0.9, min_samples=50).verdict == "too_few"
    noisy = [1.0, 0.0, 0.0, 1.0] * 25  # ~ the same mean, different items: not enough evidence either way
    result = judge("t", noisy, same[:100], 0.95, min_samples=50)
    assert result.verdict == "inconclusive" and result.low < 0 <= result.high
    assert passes_all([judge("t", same, same, 0.9, 50)]) and not passes_all([result]) and not passes_all([])
    with pytest.raises(ValueError, match="reference scores"):
        judge("t", [1.0], [1.0, 0.0], 0.9, 1)


def test_the_point_rule_is_the_recipes_and_both_verdicts_are_reported():
    """gates.rule: point passes a variant whose mean is >= ratio x the reference's whatever the interval
    (docs/recipe.md's rule) and fails one below it; too_few and uninformative stay; every result carries the
    point rule's verdict and the interval rule's, so either rule's table shows both."""
    same = [1.0, 0.0] * 100
    noisy = [1.0, 0.0, 0.0, 1.0] * 25  # mean 0.5 vs 0.5: >= 0.95 x the reference, but not shown
    interval = judge("t", noisy, same[:100], 0.95, min_samples=50)
    point = judge("t", noisy, same[:100], 0.95, min_samples=50, rule="point")
    assert (interval.verdict, interval.point_verdict, interval.interval_verdict, interval.rule) == (
        "inconclusive", "pass", "inconclusive", "interval")
    assert (point.verdict, point.point_verdict, point.interval_verdict, point.rule) == (
        "pass", "pass", "inconclusive", "point")
    assert (point.low, point.high, point.margin) == (interval.low, interval.high, interval.margin)
    # what each rule can resolve: a variant equal to the reference passes the point rule more often than the interval
    assert point.needed_difference == pytest.approx(-0.05 * 0.5) and point.power_if_equal > interval.power_if_equal
    below = [1.0, 0.0, 0.0, 0.0] * 25 + [1.0, 0.0] * 50  # mean 0.375 < 0.95 x 0.5
    assert judge("t", below, same[:200], 0.95, min_samples=50, rule="point").verdict == "fail"
    assert judge("t", same[:10], same[:10], 0.9, min_samples=50, rule="point").verdict == "too_few"
    chance = [1.0, 0.0, 0.0, 0.0] * 250
    result = judge("mmlu", chance, chance, 0.9, min_samples=50, floor=0.25, rule="point")
    assert (result.verdict, result.point_verdict, result.interval_verdict) == ("uninformative",) * 3
    with pytest.raises(ValueError, match="gates.rule='loose'"):
        judge("t", same, same, 0.9, 50, rule="loose")


def test_an_uninformative_task_blocks_unless_reported_and_something_else_passes():
    """when_uninformative: report excuses that task's `uninformative` verdict only: its fail still
    blocks, other tasks still count, and a variant judged on nothing but excused tasks does not pass."""
    chance, able = [1.0, 0.0, 0.0, 0.0] * 250, [1.0, 1.0, 0.0, 0.0] * 250
    mmlu = judge("mmlu", chance, chance, 0.9, min_samples=50, floor=0.25)
    gsm8k = judge("gsm8k", able, able, 0.9, min_samples=50)
    assert (mmlu.verdict, gsm8k.verdict) == ("uninformative", "pass")
    assert not passes_all([mmlu, gsm8k])  # the default: a task the target cannot do blocks
    assert passes_all([mmlu, gsm8k], {"mmlu"})
    assert not passes_all([mmlu], {"mmlu"})  # nothing really passed
    failing = judge("gsm8k", [0.0] * 1000, able, 0.9, min_samples=50)
    assert failing.verdict == "fail" and not passes_all([mmlu, failing], {"mmlu"})
    assert not passes_all([mmlu, failing], {"mmlu", "gsm8k"})  # only `uninformative` is excused, never a fail


def test_a_gate_on_a_task_the_reference_cannot_do_is_uninformative():
    zeros = [0.0] * 500  # SmolLM2-135M on GSM8K: 0 for the 16-bit target and for the variant
    result = judge("gsm8k", zeros, zeros, 0.9, min_samples=50)
    assert result.verdict == "uninformative" and (result.low, result.high) == (0.0, 0.0)  # would be a vacuous pass
    chance = [1.0, 0.0, 0.0, 0.0] * 250  # 4-way multiple choice at chance, the variant identical
    assert judge("mmlu", chance, chance, 0.9, min_samples=50, floor=0.25).verdict == "uninformative"
    assert judge("mmlu", chance, chance, 0.9, min_samples=50, floor=0.0).verdict == "pass"  # without the floor
    able = [1.0, 1.0, 0.0, 0.0] * 250  # 0.5, well above chance: the gate can judge
    result = judge("mmlu", able, able, 0.9, min_samples=50, floor=0.25)
    assert result.verdict == "pass" and 0.25 < result.reference_low < 0.5
    assert judge("t", zeros[:10], zeros[:10], 0.9, min_samples=50).verdict == "too_few"  # too few comes first


def test_a_reference_scored_on_other_items_is_refused(tmp_path):
    import json

    from qdflash.errors import QdflashError
    from qdflash.stages.quality_gate import read_reference

    (tmp_path / "scores.json").write_text(json.dumps({"mmlu": {"ids": ["a", "b"], "scores": [1.0, 0.0]}}))
    assert read_reference(tmp_path, {"mmlu": ["a", "b"]}) == {"mmlu": (["a", "b"], [1.0, 0.0])}
    with pytest.raises(QdflashError, match="not scored on this gate's mmlu items"):
        read_reference(tmp_path, {"mmlu": ["a", "c"]})
    with pytest.raises(QdflashError, match="gsm8k"):
        read_reference(tmp_path, {"mmlu": ["a", "b"], "gsm8k": ["x"]})
    with pytest.raises(QdflashError, match="no scores.json"):
        read_reference(tmp_path / "elsewhere", {"mmlu": ["a"]})


def test_groups_are_flattened_and_one_answer_filter_is_read(tmp_path):
    """Standard lm-eval tasks come as groups (mmlu_pro -> subjects) and with several answer filters
    (GPQA: strict-match / flexible-extract): the scores are read per subtask, for the named filter."""
    items = [PromptItem(f"g{i}", "gsm8k", "math", f"Sum, case {i}?", True, "12") for i in range(2)]
    write_gsm8k_task(tmp_path, items, name="part_a")
    write_gsm8k_task(tmp_path, items[:1], name="part_b")
    for part in ("part_a", "part_b"):  # a second filter: the first number instead of the last
        text = (tmp_path / f"{part}.yaml").read_text()
        text = text.replace("metric_list:", "  - name: first-number\n    filter:\n      - function: regex\n"
                            "        group_select: 0\n        regex_pattern: \"(-?[0-9]+)\"\n      - function: take_first\nmetric_list:")
        (tmp_path / f"{part}.yaml").write_text(text)
    (tmp_path / "both.yaml").write_text("group: both\ntask: [part_a, part_b]\naggregate_metric_list:\n"
                                        "  - metric: exact_match\n    filter_list: flexible-extract\nmetadata:\n  version: 1.0\n")
    lm = ScriptedLM({"case 0": "12 or 13? 12", "case 1": "It is 13, then 12"})
    with pytest.raises(Exception, match="several filters"):
        evaluate(lm, tmp_path, ["part_b"])
    ids, last = evaluate(lm, tmp_path, ["both"], filter_name="flexible-extract")["both"]
    assert ids == ["part_a/0", "part_a/1", "part_b/0"] and last == [1.0, 1.0, 1.0]
    _, first = evaluate(lm, tmp_path, ["both"], filter_name="first-number")["both"]
    assert first == [1.0, 0.0, 1.0]


def test_an_optional_gate_task_whose_items_are_found_nowhere_is_skipped_and_recorded(tmp_path, monkeypatch):
    """Offline with no $QDFLASH_DATA_DIR and no ../shared/data (a fresh clone elsewhere), GSM8K and
    IFEval exist nowhere: a task marked optional is skipped with the reason in metrics.json; one not
    marked optional, or a path the user gave that does not exist, stays an error."""
    import dataclasses
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from qdflash.data import sources
    from qdflash.errors import QdflashError, SourceNotFound
    from qdflash.evaluation import ifeval
    from qdflash.stages.quality_gate import plan_tasks

    monkeypatch.setattr(sources, "shared_data_dir", lambda: None)
    monkeypatch.setattr(ifeval, "shared_data_dir", lambda: None)
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "empty"))
    def no_hub(options):
        raise OSError("offline")

    monkeypatch.setitem(sources.SOURCES, "gsm8k", dataclasses.replace(sources.SOURCES["gsm8k"], read_hub=no_hub))

    def cfg(tasks, gsm8k_path=None):
        return OmegaConf.create({"gates": {"tasks": tasks}, "data": {"sources": {"gsm8k": {"path": gsm8k_path}}, "mmlu_gate_fraction": 0.5}})

    optional = {"gsm8k": {"ratio": 0.9, "max_items": 4, "max_gen_toks": 8, "optional": True},
                "ifeval": {"ratio": 0.95, "max_items": 4, "max_gen_toks": 8, "optional": True},
                "mmlu": {"ratio": 0.9, "max_items": 4}}
    run = SimpleNamespace(metrics={})
    plans = plan_tasks(cfg(optional), tmp_path / "tasks", run)
    assert [p.key for p in plans] == ["mmlu"] and len(plans[0].ids) == 4
    assert "data source gsm8k not found" in run.metrics["gsm8k.skipped"]
    assert "IFEval data not found" in run.metrics["ifeval.skipped"]
    with pytest.raises(QdflashError, match="none of gsm8k, ifeval could run"):  # nothing left to judge
        plan_tasks(cfg({k: optional[k] for k in ("gsm8k", "ifeval")}), tmp_path / "tasks", SimpleNamespace(metrics={}))
    required = {"gsm8k": {**optional["gsm8k"], "optional": False}}
    with pytest.raises(SourceNotFound, match="data source gsm8k not found"):
        plan_tasks(cfg(required), tmp_path / "tasks", SimpleNamespace(metrics={}))
    with pytest.raises(QdflashError, match="does not exist") as given:  # a path the user gave must work
        plan_tasks(cfg({"gsm8k": optional["gsm8k"]}, gsm8k_path=str(tmp_path / "nowhere")), tmp_path / "tasks", SimpleNamespace(metrics={}))
    assert not isinstance(given.value, SourceNotFound)


def test_what_a_gate_can_resolve():
    """needed_difference is the verdict read the other way (pass iff variant - reference reaches it),
    and power_if_equal is the pass rate of variants as good as the reference on average, checked by
    simulation: paired items drawn at random, the variant disagreeing on some of them."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(50, 400)
        y = [float(rng.random() < 0.4) for _ in range(n)]
        x = [1.0 - v if rng.random() < rng.choice([0.05, 0.2]) else v for v in y]
        r = judge("t", x, y, rng.choice([0.9, 0.95]), min_samples=10)
        assert r.passes == (r.variant - r.reference >= r.needed_difference - 1e-12)
    n, p, flip = 400, 0.4, 0.15  # flip ones at `flip`, zeros at a rate that keeps the mean
    results = []
    for _ in range(1000):
        y = [float(rng.random() < p) for _ in range(n)]
        x = [1.0 - v if rng.random() < (flip if v else flip * p / (1 - p)) else v for v in y]
        results.append(judge("t", x, y, 0.9, min_samples=10))
    rate = sum(r.passes for r in results) / len(results)
    predicted = sum(r.power_if_equal for r in results) / len(results)
    assert 0.2 < predicted < 0.8 and abs(rate - predicted) < 0.06, (rate, predicted)
    same = [1.0, 0.0] * 100  # no disagreement: the spread is only (1 - ratio) x the reference's
    assert judge("t", same, same, 0.9, 50).power_if_equal > 0.999
    assert judge("t", [0.0] * 60, [0.0] * 60, 0.9, 50).power_if_equal == 1.0  # no spread at all: the margin decides
