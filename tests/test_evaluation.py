"""The lm-eval adapter and the gate arithmetic: log-likelihoods equal a direct forward pass, generated
text equals autoregressive greedy decoding, a local multiple-choice task runs through lm-eval, and the
gate verdicts follow the confidence interval and the minimum sample count."""

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from qdflash.data.sources import PromptItem  # noqa: E402
from qdflash.evaluation.gates import judge, passes_all  # noqa: E402
from qdflash.evaluation.lm import QdflashLM  # noqa: E402
from qdflash.evaluation.tasks import evaluate, write_mmlu_task  # noqa: E402
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


def test_generate_until_is_autoregressive_greedy(tiny_llama):
    lm = QdflashLM(tiny_llama, max_gen_toks=12)
    prompt = "Once upon a time"
    text, = lm.generate_until([Req(prompt, {"until": [], "max_gen_toks": 12})])
    ids = tiny_llama.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = autoregressive_generate(tiny_llama, [ids], 12).tokens
    assert text == tiny_llama.tokenizer.decode(expected, skip_special_tokens=True)


def test_local_mmlu_task_runs_through_lm_eval(tiny_llama, tmp_path):
    items = [PromptItem(f"m{i}", "mmlu", "knowledge", f"Question {i}?\nA. red\nB. blue\nC. green\nD. black\n\n"
                        "Answer with the letter of the correct option, then explain briefly.", True, "ABCD"[i % 4])
             for i in range(6)]
    name = write_mmlu_task(tmp_path, items)
    lm = QdflashLM(tiny_llama)
    scores = evaluate(lm, tmp_path, [name])[name]
    assert len(scores) == 6 and set(scores) <= {0.0, 1.0}
    # the same answers by hand: the choice with the highest log-likelihood
    for item, score in zip(items, scores):
        question = item.prompt.split("\n\nAnswer with")[0]
        lls = [lm.loglikelihood([Req(f"{question}\nAnswer:", f" {c}")])[0][0] for c in "ABCD"]
        assert score == float("ABCD"[max(range(4), key=lls.__getitem__)] == item.reference)


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
