import torch

from qdflash.data.chat import render_prompt_ids
from qdflash.data.generate import Sampling, cut_at_stop, generate_batched


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 2, 2], {2}).token_ids == [5, 6, 2]
    assert cut_at_stop([5, 6, 2], {2}).finish_reason == "stop"
    assert cut_at_stop([5, 6, 7], {2}).finish_reason == "length"


def test_batched_greedy_equals_one_at_a_time(tiny_llama):
    """Left padding and length sorting must not change what the model generates."""
    tok = tiny_llama.tokenizer
    prompts = [render_prompt_ids(tok, p) for p in ["Hi", "Tell me a long story about a dragon and a knight", "2+2?"]]
    kwargs = dict(pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], max_new_tokens=8, sampling=Sampling(0.0), progress=False)
    batched, stats = generate_batched(tiny_llama.model, prompts, batch_size=3, **kwargs)
    for prompt, got in zip(prompts, batched):
        single, _ = generate_batched(tiny_llama.model, [prompt], batch_size=1, **kwargs)
        assert got.token_ids == single[0].token_ids
        expect = tiny_llama.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert got.token_ids == expect.tolist()[: len(got.token_ids)]
    assert stats.new_tokens == sum(len(g.token_ids) for g in batched) and stats.tokens_per_s > 0


def test_sampling_is_seeded(tiny_llama):
    tok = tiny_llama.tokenizer
    prompts = [render_prompt_ids(tok, p) for p in ["Hi", "Hello"]]
    kwargs = dict(pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], max_new_tokens=6, batch_size=2,
                  sampling=Sampling(1.0, 0.9, 50), progress=False)
    a, _ = generate_batched(tiny_llama.model, prompts, seed=1, **kwargs)
    b, _ = generate_batched(tiny_llama.model, prompts, seed=1, **kwargs)
    c, _ = generate_batched(tiny_llama.model, prompts, seed=2, **kwargs)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
