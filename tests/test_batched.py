"""Batched generation on the lean engine (qdflash.engine.batched): row for row the batch-1 output,
greedy and seeded sampling, with rows of different lengths that stop early and slots refilled
(llama, Qwen2 and the Qwen3.5 hybrid, whose Gated DeltaNet state is per row)."""

import pytest
import torch

from qdflash.data.generate import Sampling, generate_batched
from qdflash.engine import build_engine
from qdflash.engine.batched import BatchGenerator
from qdflash.spec import autoregressive_generate


def prompts(seed, n, low=3, high=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (int(k),), generator=g).tolist() for k in torch.randint(low, high, (n,), generator=g)]


def cut(tokens, eos):
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


def early_stops(references, rows=(0, 3, 6), at=(2, 7, 12)):
    """EOS ids taken from inside some reference outputs, so those rows stop early at different
    steps (the tokens before an EOS do not depend on which ids are EOS)."""
    return {references[r][k] for r, k in zip(rows, at)}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen"])
def test_batched_greedy_equals_batch1_row_for_row(fixture, request):
    target = request.getfixturevalue(fixture)
    batch = prompts(0, 11)
    references = [autoregressive_generate(target, p, 16).tokens for p in batch]
    eos = early_stops(references)
    expected = [cut(r, eos) for r in references]
    assert sorted({len(e) for e in expected})[0] < 16 and any(len(e) == 16 for e in expected)
    engine = build_engine(target, max_len=128)
    # 4 slots for 11 prompts: finished rows are refilled; a look every 3 steps (rows run on stopped)
    gen = BatchGenerator(engine, rows=4, max_len=64, eos_ids=sorted(eos), max_new_tokens=16, sampling=Sampling(0.0),
                         sync_every=3, prefill_tokens=24)  # rows x chunk <= 24: long prompts in chunks, short ones 2 at a time
    results, stats = gen.generate(batch, progress=False)
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["stop" if e[-1] in eos else "length" for e in expected]
    assert stats.new_tokens == sum(map(len, expected))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen"])
def test_batched_sampling_equals_keyed_batch1_sampling(fixture, request):
    """Each prompt's sample depends on (seed, key, step) only: the engine's batch with refills gives
    what transformers' generate with KeyedSampler gives that prompt alone."""
    target = request.getfixturevalue(fixture)
    sampling = Sampling(0.9, 0.8, 20)
    batch, keys = prompts(1, 9), [1000 + 7 * i for i in range(9)]
    references = [generate_batched(target.model, [p], pad_id=0, eos_ids=[-1], max_new_tokens=12, batch_size=1,
                                   sampling=sampling, seed=3, keys=[k], progress=False)[0][0].token_ids
                  for p, k in zip(batch, keys)]
    assert len({tuple(r) for r in references}) == len(references)  # really sampled, not one fixed answer
    eos = early_stops(references, rows=(1, 4), at=(3, 8))
    engine = build_engine(target, max_len=64)
    gen = BatchGenerator(engine, rows=3, max_len=64, eos_ids=sorted(eos), max_new_tokens=12, sampling=sampling, seed=3,
                         sync_every=2)
    results, _ = gen.generate(batch, keys, progress=False)
    assert [r.token_ids for r in results] == [cut(r, eos) for r in references]
    # another seed, other samples (the noise is keyed by the seed too)
    other, _ = BatchGenerator(engine, rows=3, max_len=64, eos_ids=[-1], max_new_tokens=12, sampling=sampling,
                              seed=4).generate(batch, keys, progress=False)
    assert [r.token_ids for r in other] != references


@pytest.mark.parametrize("fixture,sampling", [("tiny_llama", Sampling(0.0)), ("tiny_qwen", Sampling(0.9, 0.8, 20))])
def test_a_compiled_decode_step_gives_the_same_rows(fixture, sampling, request):
    """`compile`: the decode step through torch.compile (here its trace with the aot_eager backend:
    dynamo's capture of the in-place state updates and the hybrid's per-row states, which inductor's
    kernels then run on the GPU, checked there by scripts/bench/check_batched.py --compile) decodes the
    same tokens as the uncompiled step, with refills and early stops."""
    target = request.getfixturevalue(fixture)
    batch = prompts(2, 9)
    engine = build_engine(target, max_len=64)

    def run(compile, eos):
        gen = BatchGenerator(engine, rows=3, max_len=64, eos_ids=sorted(eos), max_new_tokens=12, sampling=sampling,
                             seed=3, sync_every=2, compile=compile)
        return [r.token_ids for r in gen.generate(batch, progress=False)[0]]

    eos = early_stops(run(False, [-1]), rows=(1, 4), at=(3, 8))
    plain = run(False, eos)
    assert min(map(len, plain)) < 12 and max(map(len, plain)) == 12  # some rows stop early, slots are refilled
    assert run("aot_eager", eos) == plain


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_a_generator_is_freed_as_soon_as_it_is_dropped(compile, tiny_llama):
    """No reference cycle keeps a used generator (and its KV cache for all rows) alive until the
    garbage collector runs: the multi-turn data stage builds one per turn, and two turns' caches of
    1,024 rows x 3,072 positions did not fit on the H200 beside each other."""
    import gc
    import weakref

    engine = build_engine(tiny_llama, max_len=64)
    gen = BatchGenerator(engine, rows=3, max_len=64, eos_ids=[-1], max_new_tokens=4, sampling=Sampling(0.0), compile=compile)
    gen.generate(prompts(3, 4), progress=False)
    alive = weakref.ref(gen.k_cache[0])
    gc.disable()
    try:
        del gen
        assert alive() is None
    finally:
        gc.enable()


def test_batched_sampling_follows_the_target_distribution():
    """A tiny-vocabulary model, one prompt, 3,000 keys: the first token (sampled after the prefill)
    and the second (sampled by the decode step) follow the target's tempered, top-k / top-p filtered
    distribution (chi-square, p > 0.001), and fail the same test against the unfiltered one."""
    from scipy.stats import chi2
    from transformers import AutoModelForCausalLM, LlamaConfig
    from types import SimpleNamespace

    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_hidden_layers=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a peaked distribution, so filtering matters
    engine = build_engine(SimpleNamespace(model=model, config=config), max_len=64)
    prompt, n = [1, 5, 2, 7], 3000
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=5)

    def probabilities(prefix, filtered=True):
        logits = model(input_ids=torch.tensor([prefix])).logits[0, -1].double() / (sampling.temperature if filtered else 1)
        if filtered:
            kth = logits.topk(sampling.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            p = logits.softmax(-1)
            ordered, index = p.sort(descending=True)
            drop = ordered.cumsum(-1) - ordered > sampling.top_p
            logits = logits.masked_fill(drop.scatter(-1, index, drop), float("-inf"))
        return logits.softmax(-1)

    gen = BatchGenerator(engine, rows=256, max_len=16, eos_ids=[-1], max_new_tokens=2, sampling=sampling, seed=0)
    results, _ = gen.generate([prompt] * n, list(range(n)), progress=False)
    first = torch.tensor([r.token_ids[0] for r in results])
    second = torch.tensor([r.token_ids[1] for r in results])

    def chi_square(observed, expected):
        keep = expected > 0
        assert observed[~keep].sum() == 0  # never a filtered-out token
        stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
        return chi2.sf(stat, int(keep.sum()) - 1)

    counts = torch.bincount(first, minlength=8).double()
    assert chi_square(counts, n * probabilities(prompt)) > 1e-3
    conditional = {t: probabilities(prompt + [t]) for t in first.unique().tolist()}
    expected_second = sum(conditional[t] for t in first.tolist())
    assert chi_square(torch.bincount(second, minlength=8).double(), expected_second) > 1e-3
    # the test has power: the unfiltered (temperature 1) distribution is rejected
    unfiltered = n * probabilities(prompt, filtered=False)
    stat = ((counts - unfiltered) ** 2 / unfiltered).sum().item()
    assert chi2.sf(stat, 7) < 1e-6


@pytest.mark.slow
def test_prepare_data_on_the_engine_writes_what_transformers_writes(tmp_path):
    """The ci profile's data stage on a Qwen2 target with backend=engine and backend=transformers:
    the same rows (sampled training responses and greedy held-out ones), token for token; the
    metrics say which backend generated."""
    import json
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from qdflash.config import load_config, node_overrides

    config = load_config()
    config["profile"] = "ci"
    config["profiles"]["ci"]["model"] = "tiny-qwen2"
    folders = {}

    def node(backend):
        out = tmp_path / backend
        args = node_overrides(config, "prepare_data", out, ["data"], {"data.generation.backend": backend}) + ["tracking.wandb.mode=disabled"]
        return out, subprocess.run([sys.executable, "-m", "qdflash.stages.prepare_data", *args], capture_output=True, text=True,
                                   timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})

    # the two nodes are independent: side by side on 2 cores, one thread each
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(("engine", "transformers"), pool.map(node, ("engine", "transformers"))))
    for backend, (out, done) in runs.items():
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((out / "metrics.json").read_text())["generation.backend"] == backend
        folders[backend] = out
    for name in ("train.jsonl", "heldout.jsonl", "train.tokens.jsonl", "heldout.tokens.jsonl"):
        one, two = ([json.loads(line) for line in open(folders[b] / name)] for b in ("engine", "transformers"))
        assert len(one) == len(two) > 0 and one == two, name


def test_decode_attention_kernel_reads_each_rows_own_length():
    """The Triton decode attention (its interpreter here) against the masked SDPA path, on rows of
    very different lengths, grouped-query heads (rep 3, padded to the kernel's 16 rows); positions
    past each row's length hold garbage that must not be read."""
    pytest.importorskip("triton")
    from qdflash.engine.base import rows_attention

    g = torch.Generator().manual_seed(0)
    b, kv_heads, rep, d, max_len = 5, 2, 3, 16, 200
    caches = [torch.randn(b + 2, kv_heads, max_len, d, generator=g) * 3 for _ in range(2)]
    q = torch.randn(b, kv_heads * rep, 1, d, generator=g)
    k, v = torch.randn(2, b, kv_heads, 1, d, generator=g)
    positions = torch.tensor([[0], [5], [63], [64], [150]])
    expected = rows_attention(q, k, v, *[c.clone() for c in caches], positions, max_len)
    got = rows_attention(q, k, v, *caches, positions, max_len, kernel=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_batched_greedy_through_the_kernel_equals_batch1(tiny_qwen2):
    pytest.importorskip("triton")
    batch = prompts(2, 6)
    references = [autoregressive_generate(tiny_qwen2, p, 10).tokens for p in batch]
    engine = build_engine(tiny_qwen2, max_len=64, kernels=True)
    gen = BatchGenerator(engine, rows=4, max_len=64, eos_ids=[-1], max_new_tokens=10, sampling=Sampling(0.0))
    assert gen.kernel_attention and gen.len_buckets == [64]  # one graph per batch bucket
    results, _ = gen.generate(batch, progress=False)
    assert [r.token_ids for r in results] == references


@pytest.mark.slow
def test_training_answers_at_temperature_0_are_greedy_whatever_the_seed(tmp_path):
    """data.generation.temperature 0 (an arm: the contexts greedy serving sees): the ci data stage with two seeds writes
    the same training rows, each saying it was decoded greedily (sampled rows would differ by seed)."""
    import json
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from qdflash.config import load_config, node_overrides

    config = load_config()
    config["profile"] = "ci"

    def node(seed):
        out = tmp_path / f"seed{seed}"
        args = node_overrides(config, "prepare_data", out, ["data"], {"data.generation.temperature": 0,
                                                                       "data.generation.seed": seed})
        done = subprocess.run([sys.executable, "-m", "qdflash.stages.prepare_data", *args, "tracking.wandb.mode=disabled"],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in open(out / "train.jsonl")]

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(node, (0, 1))
    assert len(first) > 0 and all(row["decoding"] == "greedy" for row in first)
    assert [row["response"] for row in first] == [row["response"] for row in second]
