import pytest

from qdflash.data.chat import render_prompt_ids, tokenize_conversation, training_example
from qdflash.errors import QdflashError


def test_prompt_ends_with_generation_prompt(tokenizer):
    ids = render_prompt_ids(tokenizer, "What is 2+2?")
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and "What is 2+2?" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids.count(tokenizer.bos_token_id) == text.count(tokenizer.bos_token)  # no doubled BOS


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you"},
    ]
    eos = [tokenizer.eos_token_id]
    out = tokenize_conversation(tokenizer, messages, eos_token_ids=eos)
    assert len(out["input_ids"]) == len(out["loss_mask"])
    learned = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert tokenizer.decode(learned) == "Hello there<|im_end|>See you<|im_end|>"
    # the user text and the template scaffolding are never learned
    assert "Hi" not in tokenizer.decode(learned) and "assistant" not in tokenizer.decode(learned)


def test_training_example_from_generated_ids(tokenizer):
    prompt = render_prompt_ids(tokenizer, "Hi")
    response = tokenizer("Hello there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ex = training_example(prompt, response)
    assert ex["input_ids"] == prompt + response
    assert ex["loss_mask"] == [0] * len(prompt) + [1] * len(response)
    # agrees with the template-based mask on the same conversation
    conv = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
        eos_token_ids=[tokenizer.eos_token_id],
    )
    n = len(ex["input_ids"])
    assert conv["input_ids"][:n] == ex["input_ids"] and conv["loss_mask"][:n] == ex["loss_mask"]


def test_bad_role(tokenizer):
    with pytest.raises(QdflashError, match="role"):
        tokenize_conversation(tokenizer, [{"role": "robot", "content": "x"}], eos_token_ids=[2])
