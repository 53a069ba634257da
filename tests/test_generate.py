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


def test_keyed_noise_depends_on_key_and_step_only():
    from qdflash.data.generate import keyed_uniform

    keys = torch.tensor([3, 99, -5, 2**40])
    u = keyed_uniform(keys, step=4, vocab=1000, seed=0)
    assert u.shape == (4, 1000) and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.01
    assert torch.equal(keyed_uniform(keys.flip(0), 4, 1000, 0), u.flip(0))   # a row's noise: its key, not its row
    assert not torch.equal(keyed_uniform(keys, 5, 1000, 0), u)                # steps differ
    assert not torch.equal(keyed_uniform(keys, 4, 1000, 1), u)                # seeds differ


def test_keyed_sampler_draws_from_the_warped_distribution():
    from qdflash.data.generate import KeyedSampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    sampling = Sampling(temperature=0.7, top_p=0.9, top_k=4)
    n = 6000
    sampler = KeyedSampler(sampling, list(range(n)), seed=0, prompt_width=0)
    picks = sampler(torch.zeros(n, 3, dtype=torch.long), logits.expand(n, -1)).argmax(-1)
    counts = torch.bincount(picks, minlength=5).double() / n
    # the warped target: top-4 of softmax(logits / 0.7), then the smallest prefix reaching 0.9
    p = torch.softmax(logits[0] / 0.7, -1)
    p[4] = 0
    keep = (p.sort(descending=True).values.cumsum(0) - p.sort(descending=True).values) <= 0.9
    q = torch.zeros(5, dtype=torch.float64)
    order = p.sort(descending=True).indices
    q[order[keep]] = p[order[keep]].double()
    q /= q.sum()
    assert counts[4] == 0 and torch.allclose(counts, q, atol=0.02), (counts, q)


def test_keyed_sampling_does_not_depend_on_batching(tiny_llama):
    tok = tiny_llama.tokenizer
    texts = ["Hi", "Tell me a long story about a dragon and a knight", "2+2?"]
    prompts = [render_prompt_ids(tok, p) for p in texts]
    kwargs = dict(pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], max_new_tokens=8, sampling=Sampling(1.0, 0.95, 50),
                  progress=False, seed=3)
    together, _ = generate_batched(tiny_llama.model, prompts, batch_size=3, keys=[11, 22, 33], **kwargs)
    for prompt, key, got in zip(prompts, [11, 22, 33], together):
        alone, _ = generate_batched(tiny_llama.model, [prompt], batch_size=1, keys=[key], **kwargs)
        assert got.token_ids == alone[0].token_ids
    other, _ = generate_batched(tiny_llama.model, prompts, batch_size=3, keys=[11, 22, 34], **kwargs)
    assert [g.token_ids for g in other[:2]] == [g.token_ids for g in together[:2]] and other[2] != together[2]
