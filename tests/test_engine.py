"""The lean engine: transformers' logits, exactly; a static cache that rolls back by length; the
speculative loop on it emits the autoregressive tokens."""

import dataclasses

import pytest
import torch

from qdflash.drafter import init_drafter
from qdflash.engine import build_engine
from qdflash.errors import QdflashError
from qdflash.spec import autoregressive_generate, speculative_generate


def ids(seed, n):
    return torch.randint(10, 2000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def smollm2():
    from qdflash.models import load_target

    return load_target("smollm2-135m", device="cpu")


@pytest.mark.parametrize("fixture", ["tiny_llama", "smollm2"])
def test_logits_and_features_match_transformers(fixture, request):
    target = request.getfixturevalue(fixture)
    engine = build_engine(target, max_len=128)
    x = ids(0, 40)
    ref = target.model(input_ids=x[None], output_hidden_states=True)
    logits, features = engine.forward(x, 0, [1, 3])
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-5, rtol=1e-5)
    h = target.hidden_size
    torch.testing.assert_close(features[:, :h], ref.hidden_states[2][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features[:, h:], ref.hidden_states[4][0], atol=1e-5, rtol=1e-5)


def test_pieces_and_rollback_by_length(tiny_llama):
    engine = build_engine(tiny_llama, max_len=128)
    x = ids(1, 40)
    full, _ = engine.forward(x, 0)
    engine.forward(x[:20], 0)
    engine.forward(torch.tensor([5, 6, 7, 8]), 20)  # a rejected block...
    part, _ = engine.forward(x[20:30], 20)         # ...overwritten: the cache length is the position
    last, _ = engine.forward(x[30:31], 30)
    torch.testing.assert_close(part, full[20:30], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, full[30:31], atol=1e-5, rtol=1e-5)
    with pytest.raises(QdflashError, match="holds 128 positions"):
        engine.forward(x, 100)


@pytest.mark.parametrize("block", [2, 5])
def test_speculative_on_the_engine_equals_autoregressive(tiny_llama, block):
    fast = dataclasses.replace(tiny_llama, engine=build_engine(tiny_llama, max_len=256))
    for seed in range(3):
        prompt = ids(seed, 8 + 5 * seed)[None]
        reference = autoregressive_generate(tiny_llama, prompt, 30).tokens  # transformers' forward
        assert autoregressive_generate(fast, prompt, 30).tokens == reference
        drafter = init_drafter(tiny_llama, block_size=block, seed=seed)
        assert speculative_generate(fast, drafter, prompt, 30).tokens == reference


def test_unsupported_families_say_so(tiny_qwen):
    with pytest.raises(QdflashError, match="no lean engine for model type"):
        build_engine(tiny_qwen)
