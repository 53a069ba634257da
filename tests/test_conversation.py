"""Multi-turn self-distillation: sequences built from generated ids equal the chat template's rendering,
turn t answers are what the target samples from the conversation so far, and conversations stop
where they should."""

import copy

import pytest

from qdflash.data.chat import next_turn_ids, render_prompt_ids
from qdflash.data.conversation import answer_conversations
from qdflash.data.generate import GenerationStats, Sampling, generate_on_engine
from qdflash.data.sources import PromptItem, _sharegpt_rows
from qdflash.engine import build_engine
from qdflash.errors import QdflashError
from qdflash.stages.prepare_data import turn_key


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _rendered(tokenizer, messages):
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("stopped", [True, False])
def test_a_continued_sequence_is_the_templates_rendering_of_the_conversation(tokenizer, stopped):
    """prompt + generated answer + next_turn_ids == the template's tokens of [u1, a1, u2] with the
    generation prompt, whether the answer ended with the stop token or was cut at max_new_tokens."""
    eos = tokenizer.eos_token_id
    answer = _ids(tokenizer, "Paris is the capital.") + ([eos] if stopped else [])
    sequence = render_prompt_ids(tokenizer, "Capital of France?") + answer
    sequence += next_turn_ids(tokenizer, "And of Italy?", ended_by=eos if stopped else None)
    want = _rendered(tokenizer, [{"role": "user", "content": "Capital of France?"},
                                 {"role": "assistant", "content": "Paris is the capital."},
                                 {"role": "user", "content": "And of Italy?"}])
    assert sequence == want
    assert tokenizer.decode(sequence).endswith("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewriting = copy.deepcopy(tokenizer)
    # drops every assistant message but the last: the history is not a prefix of the longer conversation
    rewriting.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(QdflashError, match="max_turns > 1 needs one that does"):
        next_turn_ids(rewriting, "next", ended_by=None)


def test_sharegpt_keeps_the_later_human_turns_in_order():
    conv = {"conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "a"},
                              {"from": "human", "value": " second "}, {"from": "gpt", "value": "b"},
                              {"from": "human", "value": ""}, {"from": "gpt", "value": "c"},
                              {"from": "human", "value": "after an empty turn"}]}
    (item,), skipped = _sharegpt_rows([conv], "x.json")
    assert skipped == 0 and item.prompt == "first" and item.followups == ("second",)


def _fake_generate(lengths):
    """A generate that answers each prompt with `lengths[turn]` copies of token 7, then stop token 2."""
    calls = []

    def generate(prompts, *, sampling, seed, keys, desc):
        turn = len(calls) + 1
        calls.append((len(prompts), keys, desc))
        gens = [type("G", (), {"token_ids": [7] * lengths[turn] + [2], "finish_reason": "stop"})() for _ in prompts]
        return gens, GenerationStats(prompts=len(prompts), new_tokens=len(prompts) * (lengths[turn] + 1), seconds=1.0)

    return generate, calls


def test_conversations_stop_for_the_reason_they_give(tokenizer):
    items = [PromptItem("a", "sharegpt", "chat", "one", followups=("two", "three")),   # answered to max_turns
             PromptItem("b", "sharegpt", "chat", "one", followups=()),                  # nothing more to answer
             PromptItem("c", "sharegpt", "chat", "one", followups=("é" * 20,)),         # next turn rejected
             PromptItem("d", "sharegpt", "chat", "one", followups=("x " * 400,))]       # next turn too long
    first = {it.id: render_prompt_ids(tokenizer, it.prompt) for it in items}
    generate, calls = _fake_generate({1: 5, 2: 3})
    convs, stats = answer_conversations(
        items, first, generate, tokenizer=tokenizer, max_turns=2, max_sequence_tokens=200, max_new_tokens=16,
        sampling=Sampling(0.7), seed=0, key_of=turn_key, accept_user=lambda text: text.isascii())
    assert [c.stopped for c in convs] == ["max_turns", "no_more_turns", "rejected", "max_sequence_tokens"]
    assert [len(c.answers) for c in convs] == [2, 1, 1, 1]
    assert [n for n, _, _ in calls] == [4, 1] and [s.prompts for s in stats] == [4, 1]
    # turn 1 samples with the prompt's own key (single-turn data are first turns); turn 2 with (id, 2)
    assert calls[0][1] == [turn_key(i, 1) for i in "abcd"] and calls[1][1] == [turn_key("a", 2)]
    assert turn_key("a", 2) != turn_key("a", 1)
    a = convs[0]
    learned = [t for t, m in zip(a.input_ids, a.loss_mask) if m]
    assert learned == [7] * 5 + [2] + [7] * 3 + [2]  # loss on both answers, nothing else
    assert a.input_ids[: len(first["a"])] == first["a"] and a.prompt_tokens == len(first["a"])
    assert len(a.input_ids) == len(a.loss_mask)


def test_turn_two_answers_are_what_the_target_samples_from_the_conversation(tiny_llama):
    """On the engine, a batch of conversations at turn 2 gets, row for row, the answer the target
    samples for that conversation alone (keyed noise): batching turns does not change the data."""
    tok = tiny_llama.tokenizer
    items = [PromptItem(f"p{i}", "sharegpt", "chat", f"Question {i}: " + "word " * (3 * i),
                        followups=(f"Follow-up {i}" + "?" * i,)) for i in range(5)]
    first = {it.id: render_prompt_ids(tok, it.prompt) for it in items}
    engine = build_engine(tiny_llama, max_len=256)
    eos = tiny_llama.eos_token_ids
    common = dict(eos_ids=eos, max_new_tokens=8, max_len=256)

    def generate(prompts, **kwargs):
        return generate_on_engine(engine, prompts, batch_size=3, progress=False, **common, **kwargs)

    sampling = Sampling(0.8, 0.9, 20)
    convs, _ = answer_conversations(items, first, generate, tokenizer=tok, max_turns=2, max_sequence_tokens=256,
                                    max_new_tokens=8, sampling=sampling, seed=5, key_of=turn_key)
    assert all(len(c.answers) == 2 for c in convs)
    for conv in convs:
        second = conv.answers[1].token_ids
        prefix = conv.input_ids[: len(conv.input_ids) - len(second)]
        (alone,), _ = generate_on_engine(engine, [prefix], batch_size=1, progress=False, sampling=sampling, seed=5,
                                         keys=[turn_key(conv.id, 2)], **common)
        assert alone.token_ids == second
        # the first answer is the single-turn data's answer
        (single,), _ = generate_on_engine(engine, [first[conv.id]], batch_size=1, progress=False, sampling=sampling,
                                          seed=5, keys=[turn_key(conv.id, 1)], **common)
        assert single.token_ids == conv.answers[0].token_ids
