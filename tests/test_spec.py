"""Lossless speculative decoding: greedy output == autoregressive output, token for token, on a
llama-style and a hybrid (Gated DeltaNet) target; rollback of recurrent state; sampling exactness."""

import random

import pytest
import torch

from qdflash.drafter import init_drafter
from qdflash.drafter.static import DrafterEngine
from qdflash.errors import QdflashError
from qdflash.spec import (TargetSession, accepted_prefix, autoregressive_generate, choose, speculative_generate)
import qdflash.spec as spec


def prompt(seed, length):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (1, length), generator=g)


def oracle(monkeypatch, reference, prompt_len, wrong_rate=0.0, seed=0):
    """Drafts that are the reference continuation, each wrong with probability `wrong_rate`."""
    rng = random.Random(seed)

    def draft(self, last_token, position):
        b = self.drafter.block_size
        out = []
        for pos in range(position + 1, position + b):
            i = pos - prompt_len
            token = reference[i] if 0 <= i < len(reference) else 7
            out.append(token + 1 if rng.random() < wrong_rate else token)
        return torch.tensor(out)

    monkeypatch.setattr(spec.DrafterSession, "draft", draft)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("block", [2, 4, 8])
def test_greedy_speculative_equals_autoregressive(fixture, block, request, monkeypatch):
    target = request.getfixturevalue(fixture)
    for seed in range(3):
        ids = prompt(seed, 5 + 7 * seed)
        reference = autoregressive_generate(target, ids, 24).tokens
        drafter = init_drafter(target, block_size=block, seed=seed)
        random_drafts = speculative_generate(target, drafter, ids, 24)  # an untrained drafter: ~no acceptance
        assert random_drafts.tokens == reference
        assert sum(random_drafts.acceptance_lengths) >= len(reference) - 1
        with monkeypatch.context() as m:
            oracle(m, reference, ids.shape[1])
            full = speculative_generate(target, drafter, ids, 24)
        assert full.tokens == reference
        assert all(n == block for n in full.acceptance_lengths[:-1])  # every draft accepted (but the cut last)
        with monkeypatch.context() as m:
            oracle(m, reference, ids.shape[1], wrong_rate=0.3, seed=seed)
            partly = speculative_generate(target, drafter, ids, 24)
        assert partly.tokens == reference
        assert 1 < partly.tau < block or block == 2


def test_window_and_stop_strings_keep_the_output(tiny_qwen):
    ids = prompt(5, 40)
    reference = autoregressive_generate(tiny_qwen, ids, 30).tokens
    drafter = init_drafter(tiny_qwen, block_size=4)
    assert speculative_generate(tiny_qwen, drafter, ids, 30, window=8).tokens == reference
    text = tiny_qwen.tokenizer.decode(reference[:10])
    stop = text[-3:] if text.strip() else None
    if stop:
        cut = speculative_generate(tiny_qwen, drafter, ids, 30, stop_strings=[stop])
        assert cut.stop_reason == "stop_string" and cut.tokens == reference[: len(cut.tokens)]


@pytest.mark.parametrize("verify, adaptive", [(None, False), (2, True)])
def test_a_stop_string_ends_at_the_same_token_as_token_by_token_decoding(varied_llama, verify, adaptive, monkeypatch):
    """Rounds that commit whole blocks (always-right drafts) stop at the token that completes the stop
    string, as autoregressive decoding does: the same tokens, none past it (the server counts them)."""
    ids = prompt(4, 12)
    reference = autoregressive_generate(varied_llama, ids, 40).tokens
    drafter = init_drafter(varied_llama, block_size=5, num_layers=1)
    cut_inside_a_round = 0
    for at in range(6, 30):  # stop strings completed at different places inside a round
        stop = varied_llama.tokenizer.decode(reference[:at])[-3:]
        if not stop.strip() or "\ufffd" in stop:  # a partial UTF-8 character: later bytes can change its text
            continue
        ar = autoregressive_generate(varied_llama, ids, 40, stop_strings=[stop])
        with monkeypatch.context() as m:
            oracle(m, reference, ids.shape[1])
            sp = speculative_generate(varied_llama, drafter, ids, 40, stop_strings=[stop], verify_tokens=verify,
                                      verify_adaptive=adaptive)
        assert ar.stop_reason == sp.stop_reason == "stop_string"
        assert sp.tokens == ar.tokens
        # the last round was cut: it would have committed more than it kept
        cut_inside_a_round += bool(sp.acceptance_lengths) and len(sp.tokens) < 1 + sum(sp.acceptance_lengths)
    assert cut_inside_a_round >= 3


def test_eos_stops_both_the_same_way(tiny_llama, monkeypatch):
    ids = prompt(1, 12)
    reference = autoregressive_generate(tiny_llama, ids, 20).tokens
    eos = reference[6]
    monkeypatch.setattr(type(tiny_llama), "eos_token_ids", property(lambda self: [eos]))
    ar = autoregressive_generate(tiny_llama, ids, 20)
    sp = speculative_generate(tiny_llama, init_drafter(tiny_llama, block_size=4), ids, 20)
    assert ar.stop_reason == sp.stop_reason == "eos"
    assert ar.tokens == sp.tokens == reference[: reference.index(eos) + 1]


def test_recurrent_rollback_equals_a_fresh_forward(tiny_qwen):
    """Feed a block, roll back to the accepted prefix: the cache then predicts exactly what a fresh
    forward over prompt + accepted tokens predicts (GDN recurrent + conv state, attention KV)."""
    ids = prompt(3, 20)[0].tolist()
    extra = [101, 202, 303, 404, 505, 606]
    session = TargetSession(tiny_qwen)
    session.feed(ids)
    snap = session.snapshot()
    session.feed(extra)  # the whole block, as in a verify
    keep = 2
    session.rollback(len(ids), snap)
    session.feed(extra[:keep])
    after, _ = session.feed([777])
    fresh = TargetSession(tiny_qwen)
    expected, _ = fresh.feed(ids + extra[:keep] + [777])
    torch.testing.assert_close(after[-1], expected[-1], atol=1e-4, rtol=1e-4)
    # without the snapshot the recurrent state would still hold the rejected tokens
    broken = TargetSession(tiny_qwen)
    broken.feed(ids)
    broken.feed(extra)
    for layer in broken.cache.layers:
        if not spec.is_linear_attention_layer(layer):
            layer.crop(len(ids) + keep - layer.get_seq_length())
    wrong, _ = broken.feed([777])
    assert not torch.allclose(wrong[-1], expected[-1], atol=1e-4)


def test_accepted_prefix_and_choose():
    assert accepted_prefix(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])) == 3
    assert accepted_prefix(torch.tensor([1, 9, 3]), torch.tensor([1, 2, 3])) == 1
    assert accepted_prefix(torch.tensor([9, 2, 3]), torch.tensor([1, 2, 3])) == 0
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert choose(logits, 0.0, None).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([choose(logits, 1.0, g) for _ in range(4000)]).flatten()
    p = torch.softmax(logits[0], -1)
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    assert (freq - p).abs().max() < 0.03


@pytest.fixture(scope="module")
def tiny_vocab_target():
    """A llama-style target over 4 tokens: distributions small enough to enumerate exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qdflash.models import Target

    config = LlamaConfig(vocab_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)  # distributions neither flat nor one-hot

    class NoTokenizer:
        eos_token_id = None

    model.generation_config.eos_token_id = None
    return Target("tiny-vocab", model, NoTokenizer(), "test")


def test_sampling_keeps_the_target_distribution(tiny_vocab_target, monkeypatch):
    """Chi-square of 3-token continuations sampled speculatively against the exact target
    probabilities (enumerated: 64 outcomes). Drafts are uniform random tokens, so about a quarter
    are accepted and the rest end in a bonus: both paths of the rule are exercised."""
    target = tiny_vocab_target
    rng = random.Random(0)
    monkeypatch.setattr(spec.DrafterSession, "draft",
                        lambda self, last, position: torch.tensor([rng.randrange(4) for _ in range(self.drafter.block_size - 1)]))
    ids = [0, 1, 2, 3, 1]
    exact = {}
    with torch.no_grad():
        for a in range(4):
            for b in range(4):
                for c in range(4):
                    logits = target.model(torch.tensor([ids + [a, b, c]])).logits[0].float()
                    p = torch.softmax(logits, -1)
                    n = len(ids)
                    exact[a, b, c] = (p[n - 1, a] * p[n, b] * p[n + 1, c]).item()
    drafter = init_drafter(target, block_size=3, num_layers=1)
    counts = {k: 0 for k in exact}
    trials = 800
    accepted = 0
    for s in range(trials):
        out = speculative_generate(target, drafter, [ids], 3, temperature=1.0, seed=s)
        counts[tuple(out.tokens)] += 1
        accepted += sum(out.acceptance_lengths) - len(out.acceptance_lengths)
    assert accepted > 50  # drafts were accepted often: the test exercises acceptance, not only bonuses
    chi2 = sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in exact.items() if trials * p >= 5)
    cells = sum(1 for p in exact.values() if trials * p >= 5)
    assert chi2 < cells + 4 * (2 * cells) ** 0.5, (chi2, cells)  # mean + 4 sd of chi-square(cells)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_inference_drafts_what_training_drafts(fixture, request):
    """The incremental drafter (cached context K/V, one block) gives the same logits as the training
    forward (all context features at once, block mask) for the same anchor: what is trained is what runs."""
    from qdflash.drafter.train import draft_blocks, target_pass

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=3).eval()
    ids = prompt(9, 30)
    features, _ = target_pass(target, ids, drafter.config.target_layer_ids)
    anchor = 17
    logits, _ = draft_blocks(drafter, features, ids, torch.ones_like(ids), torch.tensor([[anchor]]))
    session = spec.DrafterSession(drafter)
    session.append(features[0, :10], 0)  # context arrives in pieces, as accepted tokens do
    session.append(features[0, 10:anchor], 10)
    block = torch.full((1, 4), drafter.mask_id)
    block[0, 0] = ids[0, anchor]
    q_pos = torch.arange(anchor, anchor + 4)[None]
    with torch.no_grad():
        cached = drafter.forward_block(block, q_pos, session.keys, session.values, session.positions[None])
    torch.testing.assert_close(cached[0], logits[0, 0], atol=1e-4, rtol=1e-4)
    assert session.draft(int(ids[0, anchor]), anchor).tolist() == logits[0, 0, 1:].argmax(-1).tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("static_drafter", [False, True])
def test_decoding_drafts_what_training_drafts_at_every_round(fixture, lean, static_drafter, request, monkeypatch):
    """During speculative decoding, the drafter's logits at each round's anchor equal the training
    forward's (draft_blocks over target_pass of the final sequence), with the context features that
    the target session produced as it went: prefill, verify blocks, rollbacks (recurrent ones
    re-fed), on transformers' forward and on the lean engine. Acceptance comes from an oracle with
    some wrong drafts, so rounds accept 0 to B-1 tokens; the real drafter's logits are recorded."""
    from qdflash.drafter.train import draft_blocks, target_pass
    from qdflash.engine import build_engine

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=5).eval()
    ids = prompt(11, 12)
    reference = autoregressive_generate(target, ids, 24).tokens
    if lean:
        target.engine = build_engine(target, max_len=64)
    if static_drafter:
        drafter.engine = DrafterEngine(drafter, max_len=64, smallest_bucket=8)
    rng, recorded = random.Random(0), []

    def draft(self, last_token, position):
        b = self.drafter.block_size
        logits = self.draft_logits(last_token, position)[0].clone()  # the static engine reuses its buffer
        recorded.append((position, last_token, logits))
        out = []
        for pos in range(position + 1, position + b):
            i = pos - ids.shape[1]
            token = reference[i] if 0 <= i < len(reference) else 7
            out.append(token + 1 if rng.random() < 0.3 else token)
        return torch.tensor(out)

    monkeypatch.setattr(DrafterEngine if static_drafter else spec.DrafterSession, "draft", draft)
    try:
        result = speculative_generate(target, drafter, ids, 24)
    finally:
        target.engine = drafter.engine = None
    assert result.tokens == reference and len(set(result.acceptance_lengths)) > 1
    full = torch.cat([ids, torch.tensor([result.tokens])], dim=1)
    features, _ = target_pass(target, full, drafter.config.target_layer_ids)
    rounds = [(p, token, logits) for p, token, logits in recorded if p + 4 <= full.shape[1]]
    assert len(rounds) >= 4
    for p, token, _ in rounds:
        assert int(full[0, p]) == token  # the round's first block token is the committed one at p
    trained, _ = draft_blocks(drafter, features, full, torch.ones_like(full), torch.tensor([[p for p, _, _ in rounds]]))
    for (p, _, logits), want in zip(rounds, trained[0]):
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=2e-4, msg=lambda m: f"anchor {p}: {m}")


def assert_same_drafts(eager, static, features, ids):
    """Grow both sessions' context in pieces (lengths 5, 8, 9, 13, 22, 24, 36: across every bucket of
    a 48-position engine with buckets from 8; a piece's last B positions are written by the next draft,
    with stale rows past the context when it is shorter than B) and compare a draft after each piece
    but the 8th position's (two appends in a row)."""
    start = 0
    for n in (5, 3, 1, 4, 9, 2, 12):
        for session in (eager, static):
            session.append(features[0, start : start + n], start)
        start += n
        if start == 8:
            continue
        token = int(ids[0, start])
        got, drafts = static.draft_logits(token, start)
        torch.testing.assert_close(got, eager.draft_logits(token, start)[0], atol=1e-5, rtol=1e-5)
        assert drafts.tolist() == eager.draft(token, start).tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("window", [None, 6])
def test_static_drafter_drafts_what_the_eager_session_drafts(fixture, window, request):
    """DrafterEngine (context K/V in place, attention over a masked power-of-two bucket: the CUDA
    graph path, run eagerly) gives the eager session's logits as the context grows across buckets,
    with and without a sliding window; a new session forgets the last generation's context."""
    from qdflash.drafter.train import target_pass

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=7).eval()
    ids = prompt(3, 40)
    features, _ = target_pass(target, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, smallest_bucket=8)
    assert engine.buckets == [8, 16, 32, 48]
    for generation in range(2):
        static = engine.session(window)
        assert_same_drafts(spec.DrafterSession(drafter, window), static, features, ids)
        assert static.length == 36
    with pytest.raises(ValueError, match="must follow"):
        engine.append(features[0, :2], 40)
    with pytest.raises(QdflashError, match="max_len"):
        engine.session().append(features[0, :40].repeat(2, 1), 0)


def test_static_drafter_runs_a_layer_as_five_matmuls_and_drafts_what_the_session_drafts(tiny_llama, monkeypatch):
    """DrafterEngine runs each layer's linears fused (`fused_projections`): q / k / v of the block, k / v of the
    context, o, gate / up and down, one matmul each, so a draft makes 5 per layer plus fc's and the head's (the
    layers' own linears: 9 per layer). 16-bit and compressed (RTN W4, dequantized on the CPU) drafters draft the
    eager session's tokens; a layer the engine cannot fuse (a linear of another kind) runs its own linears."""
    from qdflash.drafter.compress import compress_drafter
    from qdflash.drafter.model import GATE_UP, KV, QKV
    from qdflash.drafter.train import target_pass
    from qdflash.quant.grid import GridSpec

    ids = prompt(3, 40)
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7).eval()
    features, _ = target_pass(tiny_llama, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, smallest_bucket=8)
    layer = drafter.layers[0]
    for names in (QKV, KV, GATE_UP):
        assert engine.fused[0][names].out_features == sum(getattr(layer, n).out_features for n in names)
    assert engine.fc.out_features == drafter.config.hidden_size and len(list(engine.projections())) == 1 + 5 * 2
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(a[1].shape) or linear(*a, **k))
    engine.session().append(features[0, :4], 0)  # one block's rows: the draft writes their K/V
    engine.draft(int(ids[0, 4]), 4)
    assert len(calls) == 2 + 5 * 2, calls  # fc, the head, 5 a layer
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    assert_same_drafts(spec.DrafterSession(drafter, None), engine.session(), features, ids)

    compress_drafter(drafter, GridSpec(4, 32, True), "rtn", None)
    assert_same_drafts(spec.DrafterSession(drafter, None), DrafterEngine(drafter, max_len=48, smallest_bucket=8).session(),
                       features, ids)

    class Odd(torch.nn.Linear):  # a kind of linear Projection.of does not run
        pass

    odd = Odd(layer.q_proj.in_features, layer.q_proj.out_features, bias=False)
    odd.weight.data.copy_(layer.q_proj.weight_for(torch.float32))  # the compressed layer's numbers
    layer.q_proj = odd
    engine = DrafterEngine(drafter, max_len=48, smallest_bucket=8)
    assert engine.fused[0] is None and engine.fused[1] is not None
    assert_same_drafts(spec.DrafterSession(drafter, None), engine.session(), features, ids)


def counting_backend():
    """A torch.compile backend that records the graphs it is given and runs each as traced, and that record."""
    traced = []

    def backend(graph_module, example_inputs):
        traced.append(graph_module)
        return graph_module.forward

    return backend, traced


def test_rows_argmax_is_torchs_argmax_in_two_stages_where_compiled():
    """ops.rows_argmax, which a drafted block's greedy tokens go through: eager, torch.argmax itself; traced by
    torch.compile (the counting backend), the two-stage form for rows longer than its chunk, and either way torch.argmax's
    index: the first maximum among ties, the first NaN, 0 for a row of -inf, a vocabulary no multiple of the chunk."""
    from qdflash.ops import rows_argmax, two_stage_argmax

    backend, traced = counting_backend()
    compiled = torch.compile(lambda x: rows_argmax(x, 64), backend=backend)
    g = torch.Generator().manual_seed(0)
    for v in (50, 1000):
        x = torch.randn(5, v, generator=g).to(torch.bfloat16)
        x[1, ::3] = x[1].max()  # ties: the first one
        x[2, v // 2: v // 2 + 2] = float("nan")
        x[3] = float("-inf")
        want = x.argmax(-1)
        assert want[1] == 0 and want[2] == v // 2 and want[3] == 0
        for got in (rows_argmax(x, 64), compiled(x), two_stage_argmax(x, 64)):
            assert torch.equal(got, want), (v, got, want)
        assert ("gather" in traced[-1].code) == (v > 64)


def test_compiled_static_drafter_drafts_what_the_eager_session_drafts(tiny_llama):
    """DrafterEngine(compile=backend): the draft step goes through torch.compile (here a backend that counts
    the graphs it is given and runs them as traced), once per (bucket, window), and drafts as before."""
    from qdflash.drafter.train import target_pass

    backend, traced = counting_backend()
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7).eval()
    ids = prompt(3, 40)
    features, _ = target_pass(tiny_llama, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, smallest_bucket=8, compile=backend)
    assert_same_drafts(spec.DrafterSession(drafter, 6), engine.session(6), features, ids)
    assert len(traced) >= len(engine.buckets)  # a graph per bucket the context crossed (8, 16, 32, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compressed_drafter_compiled_first_drafts_what_it_drafts_uncompiled(tiny_llama, tmp_path, dtype):
    """What the gpu profile's benchmark runs (bench.drafter_dtype: target, bench.compile_drafter: true): a
    compressed drafter, loaded in the target's dtype or another, compiled on its first draft, while its
    QuantLinear layers still dequantize their ints (a module attribute set inside the traced call). The
    compiled engine's logits and drafts equal the same engine's run uncompiled, as the context grows."""
    from qdflash.drafter import load_drafter, save_drafter
    from qdflash.drafter.compress import compress_drafter
    from qdflash.drafter.train import target_pass
    from qdflash.quant.grid import GridSpec

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7)
    compress_drafter(drafter, GridSpec(4, 32, True), "rtn", None)
    save_drafter(drafter, tmp_path / "d")
    backend, traced = counting_backend()
    compiled, plain = (DrafterEngine(load_drafter(tmp_path / "d", tiny_llama, dtype=dtype).eval(), max_len=48,
                                     smallest_bucket=8, compile=compile) for compile in (backend, False))
    ids = prompt(3, 40)
    features, _ = target_pass(tiny_llama, ids, drafter.config.target_layer_ids)
    start = 0
    for engine in (compiled, plain):
        engine.session(6)
    for n in (5, 3, 9, 12):
        for engine in (compiled, plain):
            engine.append(features[0, start : start + n], start)
        start += n
        (logits, drafts), (want, want_drafts) = (e.draft_logits(int(ids[0, start]), start) for e in (compiled, plain))
        assert torch.equal(logits, want) and drafts.tolist() == want_drafts.tolist()
    assert traced and compiled.dtype == plain.dtype == dtype  # compiled, in the dtype it was loaded in


@pytest.mark.parametrize("window", [None, 6])
def test_static_drafter_through_the_attention_kernel_drafts_what_the_eager_session_drafts(tiny_llama, window):
    """DrafterEngine(attention='kernel'): the block's K/V written after the context and
    kernels.decode_attention (Triton's interpreter here) over each block position's visible range,
    with a sliding window as a start position per row: the eager session's logits and drafts as the
    context grows, one graph length for all of it; a window smaller than the block is refused."""
    pytest.importorskip("triton")
    from qdflash.drafter.train import target_pass

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7).eval()
    ids = prompt(3, 40)
    features, _ = target_pass(tiny_llama, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, attention="kernel")
    assert engine.buckets == [48]
    assert_same_drafts(spec.DrafterSession(drafter, window), engine.session(window), features, ids)
    with pytest.raises(QdflashError, match="smaller than the block"):
        engine.session(3)
    with pytest.raises(QdflashError, match="expected 'sdpa' or 'kernel'"):
        DrafterEngine(drafter, max_len=48, attention="flash")


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("window", [None, 6])
def test_static_drafter_with_the_qk_kernel_drafts_what_the_eager_session_drafts(tiny_llama, window, attention,
                                                                                 monkeypatch):
    """DrafterEngine.qk_norm_rope_kernel: each layer's q / k norms, rotation and cache writes through
    kernels.qk_norm_rope (Triton's interpreter here: the drafter's plain RMSNorms, its q rows without an output gate),
    a launch per layer for the context rows a draft writes (k and v alone) and, with the attention kernel, one for the
    block (its query heads): the eager session's logits and drafts as the context grows."""
    pytest.importorskip("triton")
    import qdflash.drafter.static as static
    from qdflash.drafter.train import target_pass

    launches, fused = [], static.qk_norm_rope.qk_norm_rope
    monkeypatch.setattr(static.qk_norm_rope, "qk_norm_rope",
                        lambda qkv, *args, **kwargs: launches.append((qkv.shape[0], args[-1])) or fused(qkv, *args, **kwargs))
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7).eval()
    ids = prompt(3, 40)
    features, _ = target_pass(tiny_llama, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, attention=attention, kernels=True, smallest_bucket=8)
    assert not launches and not engine.qk_norm_rope_kernel  # off unless asked (not yet timed on a GPU)
    engine.qk_norm_rope_kernel = True
    assert_same_drafts(spec.DrafterSession(drafter, window), engine.session(window), features, ids)
    heads, drafts = drafter.config.num_heads, 6  # assert_same_drafts drafts after 6 of its 7 pieces
    # each draft's block, both layers (the 4 rows of its block), with the attention kernel (SDPA's block: the model's)
    assert launches.count((4, heads)) == (drafts * 2 if attention == "kernel" else 0)
    assert sum(1 for rows, h in launches if h == 0) >= drafts * 2  # and the context rows it writes first


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("window", [None, 5])
def test_greedy_speculative_with_the_static_drafter_is_unchanged(fixture, window, request):
    """The static drafter changes nothing but speed: the same tokens as autoregressive decoding and
    the same acceptance lengths as the eager drafter, on the lean engine too."""
    from qdflash.engine import build_engine

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=1, seed=2).eval()
    ids = prompt(5, 20)
    reference = autoregressive_generate(target, ids, 30).tokens
    eager = speculative_generate(target, drafter, ids, 30, window=window)
    try:
        drafter.engine = DrafterEngine(drafter, max_len=64, smallest_bucket=16)
        static = speculative_generate(target, drafter, ids, 30, window=window)
        target.engine = build_engine(target, max_len=64)
        lean = speculative_generate(target, drafter, ids, 30, window=window)
    finally:
        target.engine = drafter.engine = None
    assert eager.tokens == static.tokens == lean.tokens == reference
    assert eager.acceptance_lengths == static.acceptance_lengths == lean.acceptance_lengths


class FakeGraph:
    """What the static drafter needs of a CUDA graph, on the CPU: the step runs once when recorded,
    and each replay reruns it into the same output buffers (as a replayed graph rewrites them)."""

    def __init__(self, step):
        self.step, self.out = step, step()

    def replay(self):
        new = self.step()
        if new is not None:
            for buffer, value in zip(self.out, new):
                buffer.copy_(value)


def fake_capture(step, warmup, device):
    for _ in range(warmup):
        step()
    graph = FakeGraph(step)
    return graph, graph.out


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_static_drafter_graph_path_drafts_what_the_eager_session_drafts(fixture, request, monkeypatch):
    """The graph bookkeeping of DrafterEngine (capture up front before a generation, lazy capture of a
    new window mid-generation, each round's append written by the next draft's graph, output buffers reused)
    with graphs emulated on the CPU: the same logits as the eager session, and the same tokens as autoregressive."""
    import qdflash.drafter.static as static_module
    from qdflash.drafter.train import target_pass

    monkeypatch.setattr(static_module, "capture_graph", fake_capture)
    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=9).eval()
    ids = prompt(4, 40)
    features, _ = target_pass(target, ids, drafter.config.target_layer_ids)
    engine = DrafterEngine(drafter, max_len=48, cuda_graphs=True, smallest_bucket=8)
    assert engine.capture(None) == len(engine.buckets)  # a graph per bucket: appends have none of their own
    assert_same_drafts(spec.DrafterSession(drafter, 6), engine.session(6), features, ids)  # window 6: captured lazily
    assert {key for key in engine.graphs if key[1] == 6} == {(8, 6), (16, 6), (32, 6), (48, 6)}
    with pytest.raises(ValueError, match="before a generation"):
        engine.capture(None)
    drafter.engine = engine
    try:
        reference = autoregressive_generate(target, ids[:, :20], 20).tokens
        assert speculative_generate(target, drafter, ids[:, :20], 20, window=5).tokens == reference
    finally:
        drafter.engine = None



_REFERENCES = {}  # (fixture, prompt seed, length, tokens) -> autoregressive tokens: one reference per target


def reference_tokens(fixture, target, ids, n):
    key = (fixture, ids.sum().item(), ids.shape[1], n)
    if key not in _REFERENCES:
        _REFERENCES[key] = autoregressive_generate(target, ids, n).tokens
    return _REFERENCES[key]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen", "tiny_qwen2"])
@pytest.mark.parametrize("verify", [2, 3, None])
@pytest.mark.parametrize("path", ["eager", "lean", "lean_graphs"])
def test_verify_length_keeps_the_greedy_output(fixture, verify, path, request, monkeypatch):
    """A round that verifies the committed token + V-1 drafts (V = 2, 3, the whole block) emits the
    autoregressive tokens: on transformers' forward (Gated DeltaNet: snapshot + re-feed), on the lean
    engine with a V-token feed of no captured size (the eager step) and with the V-token step
    captured (the graph path, run eagerly: every verify replays it). Rounds commit at most V tokens;
    with drafts that are always right every round commits exactly V."""
    import dataclasses

    from qdflash.engine import build_engine

    target = request.getfixturevalue(fixture)
    block, new = 5, 16
    v = verify or block
    drafter = init_drafter(target, block_size=block, num_layers=1, seed=1).eval()
    ids = prompt(2, 9)
    reference = reference_tokens(fixture, target, ids, new)
    hits = []
    if path != "eager":
        engine = build_engine(target, max_len=48)
        if path == "lean_graphs":
            engine.capture([1, v], drafter.config.target_layer_ids, cuda_graphs=False, lengths=[16, 48])
            find = engine.graph_for
            engine.graph_for = lambda t, layer_ids, end: hits.append(t) or find(t, layer_ids, end)
        target = dataclasses.replace(target, engine=engine)
    with monkeypatch.context() as m:
        oracle(m, reference, ids.shape[1])
        full = speculative_generate(target, drafter, ids, new, verify_tokens=verify)
    with monkeypatch.context() as m:
        oracle(m, reference, ids.shape[1], wrong_rate=0.4, seed=3)
        partly = speculative_generate(target, drafter, ids, new, verify_tokens=verify)
    for result in (full, partly):
        assert result.tokens == reference
        assert max(result.acceptance_lengths) <= v
    assert all(n == v for n in full.acceptance_lengths[:-1]) and len(full.acceptance_lengths) == -(-(new - 1) // v)
    assert len(set(partly.acceptance_lengths)) > 1  # accepted and rejected drafts: rollbacks inside the block
    if path == "lean_graphs":
        assert hits.count(v) == len(full.acceptance_lengths) + len(partly.acceptance_lengths)
        assert all(engine.graph_for(v, drafter.config.target_layer_ids, n) is not None for n in (12, 48))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("path", ["eager", "lean_graphs"])
def test_adaptive_verify_grows_to_the_block_after_a_full_accept_and_keeps_the_output(fixture, path, request, monkeypatch):
    """verify_adaptive: a round verifies V tokens, or the whole block after a round whose drafts were
    accepted at least V-1 deep. Always-right drafts: V once, then whole blocks (rounds commit B, not V);
    drafts wrong 40% of the time: both lengths, the autoregressive tokens either way (Gated DeltaNet
    rollback included), and on the lean engine each length replays its own captured step."""
    import dataclasses

    from qdflash.engine import build_engine

    target = request.getfixturevalue(fixture)
    block, verify, new = 5, 2, 16
    drafter = init_drafter(target, block_size=block, num_layers=1, seed=1).eval()
    ids = prompt(2, 9)
    reference = reference_tokens(fixture, target, ids, new)
    hits = []
    if path == "lean_graphs":
        engine = build_engine(target, max_len=48)
        assert spec.verify_sizes(drafter, verify, True) == [verify, block] and spec.verify_sizes(drafter, verify) == [verify]
        engine.capture([1, *spec.verify_sizes(drafter, verify, True)], drafter.config.target_layer_ids, cuda_graphs=False,
                       lengths=[16, 48])
        find = engine.graph_for
        engine.graph_for = lambda t, layer_ids, end: hits.append(t) or find(t, layer_ids, end)
        target = dataclasses.replace(target, engine=engine)
    with monkeypatch.context() as m:
        oracle(m, reference, ids.shape[1])
        full = speculative_generate(target, drafter, ids, new, verify_tokens=verify, verify_adaptive=True)
        fixed = speculative_generate(target, drafter, ids, new, verify_tokens=verify)
    with monkeypatch.context() as m:
        oracle(m, reference, ids.shape[1], wrong_rate=0.4, seed=3)
        partly = speculative_generate(target, drafter, ids, new, verify_tokens=verify, verify_adaptive=True)
    for result in (full, fixed, partly):
        assert result.tokens == reference
        assert len(result.verify_lengths) == len(result.acceptance_lengths)
        assert all(n <= v for n, v in zip(result.acceptance_lengths, result.verify_lengths))
    assert full.verify_lengths[0] == verify and set(full.verify_lengths[1:]) == {block}
    assert full.acceptance_lengths[:-1] == [verify] + [block] * (len(full.acceptance_lengths) - 2)
    assert set(fixed.verify_lengths) == {verify} and len(fixed.acceptance_lengths) > len(full.acceptance_lengths)
    assert set(partly.verify_lengths) == {verify, block}
    for a, (n, v) in enumerate(zip(partly.acceptance_lengths[:-1], partly.verify_lengths)):  # the rule, round by round
        assert partly.verify_lengths[a + 1] == (block if n - 1 >= verify - 1 else verify)
    # each round's overruled draft: none (-1) where every verified draft was accepted, else a token other than the
    # target's own at the bonus position (the prefill committed the first token)
    assert len(partly.rejected) == len(partly.acceptance_lengths) and -1 in partly.rejected
    done = 1
    for n, v, wrong in zip(partly.acceptance_lengths, partly.verify_lengths, partly.rejected):
        assert (wrong == -1) == (n == v)
        if wrong != -1:
            assert wrong != reference[done + n - 1]
        done += n
    if path == "lean_graphs":
        rounds = full.verify_lengths + fixed.verify_lengths + partly.verify_lengths
        assert hits.count(block) == rounds.count(block) and hits.count(verify) == rounds.count(verify)  # one per round


@pytest.mark.parametrize("verify", [2, 3])
def test_sampling_with_a_shorter_verify_keeps_the_target_distribution(tiny_vocab_target, verify, monkeypatch):
    """test_sampling_keeps_the_target_distribution with a block of 4 of which the first `verify`
    positions are verified: 3-token continuations still follow the target's exact distribution
    (half the trials, to stay fast: the bound is the same mean + 4 sd of chi-square)."""
    target = tiny_vocab_target
    rng = random.Random(verify)
    monkeypatch.setattr(spec.DrafterSession, "draft",
                        lambda self, last, position: torch.tensor([rng.randrange(4) for _ in range(self.drafter.block_size - 1)]))
    ids = [0, 1, 2, 3, 1]
    outcomes = [(a, b, c) for a in range(4) for b in range(4) for c in range(4)]
    with torch.no_grad():
        p = torch.softmax(target.model(torch.tensor([ids + list(o) for o in outcomes])).logits.float(), -1)
    n = len(ids)
    exact = {o: (p[row, n - 1, o[0]] * p[row, n, o[1]] * p[row, n + 1, o[2]]).item() for row, o in enumerate(outcomes)}
    drafter = init_drafter(target, block_size=4, num_layers=1)
    counts = {k: 0 for k in exact}
    trials, accepted = 400, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4-token forwards: a second thread only waits (10x slower on a busy machine)
    try:
        for s in range(trials):
            out = speculative_generate(target, drafter, [ids], 3, temperature=1.0, seed=s, verify_tokens=verify)
            counts[tuple(out.tokens)] += 1
            accepted += sum(out.acceptance_lengths) - len(out.acceptance_lengths)
            assert max(out.acceptance_lengths) <= verify
    finally:
        torch.set_num_threads(threads)
    assert accepted > 25  # drafts were accepted: the test exercises acceptance, not only bonuses
    chi2 = sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in exact.items() if trials * p >= 5)
    cells = sum(1 for p in exact.values() if trials * p >= 5)
    assert chi2 < cells + 4 * (2 * cells) ** 0.5, (chi2, cells)


def test_sampling_with_an_adaptive_verify_keeps_the_target_distribution(tiny_vocab_target, monkeypatch):
    """The same with verify_adaptive (2 tokens, the whole block of 4 after a round that accepted its
    draft): the next round's length depends only on past acceptance, so 4-token continuations still
    follow the target's exact distribution, and some runs verify a whole block."""
    target = tiny_vocab_target
    rng = random.Random(7)
    monkeypatch.setattr(spec.DrafterSession, "draft",
                        lambda self, last, position: torch.tensor([rng.randrange(4) for _ in range(self.drafter.block_size - 1)]))
    ids = [0, 1, 2, 3, 1]
    outcomes = [(a, b, c, d) for a in range(4) for b in range(4) for c in range(4) for d in range(4)]
    with torch.no_grad():
        p = torch.softmax(target.model(torch.tensor([ids + list(o) for o in outcomes])).logits.float(), -1)
    n = len(ids)
    exact = {o: (p[row, n - 1, o[0]] * p[row, n, o[1]] * p[row, n + 1, o[2]] * p[row, n + 2, o[3]]).item()
             for row, o in enumerate(outcomes)}
    drafter = init_drafter(target, block_size=4, num_layers=1)
    counts = {k: 0 for k in exact}
    trials, whole = 1200, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(trials):
            out = speculative_generate(target, drafter, [ids], 4, temperature=1.0, seed=s, verify_tokens=2, verify_adaptive=True)
            counts[tuple(out.tokens)] += 1
            whole += 4 in out.verify_lengths
    finally:
        torch.set_num_threads(threads)
    assert whole > 50  # the whole-block verify ran, not only the 2-token one
    chi2 = sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in exact.items() if trials * p >= 5)
    cells = sum(1 for p in exact.values() if trials * p >= 5)
    assert cells > 20 and chi2 < cells + 4 * (2 * cells) ** 0.5, (chi2, cells)


@pytest.mark.parametrize("bad", [1, 0, -3, 5, 16, True, 2.0])
def test_a_verify_length_outside_the_block_is_an_error_naming_it(tiny_llama, bad):
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    with pytest.raises(QdflashError, match=r"verify_tokens = .*1 < verify_tokens <= the drafter's block size \(4\)"):
        speculative_generate(tiny_llama, drafter, prompt(0, 6), 4, verify_tokens=bad)
    assert spec.verify_length(drafter, None) == 4 and spec.verify_length(drafter, 4) == 4


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_round_timer_times_every_round_without_changing_the_output(fixture, request, monkeypatch):
    """speculative_generate(phases=RoundTimer) gives the same tokens, one timed round per verify,
    and the parts add up to the loop's time; bench.round_parts reports them per round and in decode
    steps of the autoregressive run."""
    from qdflash import bench
    from qdflash.spec import RoundTimer

    target = request.getfixturevalue(fixture)
    ids = prompt(3, 9)
    reference = autoregressive_generate(target, ids, 20)
    drafter = init_drafter(target, block_size=4, seed=1)
    with monkeypatch.context() as m:
        oracle(m, reference.tokens, ids.shape[1], wrong_rate=0.3, seed=2)
        timer = RoundTimer(target.device)
        timed = speculative_generate(target, drafter, ids, 20, phases=timer)
        assert timed.tokens == reference.tokens
        assert timer.rounds == len(timed.acceptance_lengths) > 1
        assert all(timer.seconds[p] > 0 for p in RoundTimer.PARTS)
        assert sum(timer.seconds.values()) <= timed.seconds - timed.prefill_seconds
        case = bench.PromptCase("chat", ids[0].tolist(), 20)
        oracle(m, reference.tokens, ids.shape[1], wrong_rate=0.3, seed=2)  # the same drafts again
        parts = bench.round_parts(target, drafter, [case], bench.MethodResult([reference]))
    assert parts["rounds"] == len(timed.acceptance_lengths)
    assert parts["ms"] == pytest.approx(sum(parts[f"{p}_ms"] for p in RoundTimer.PARTS), abs=1e-3)
    assert parts["in_decode_steps"] == pytest.approx(parts["ms"] / parts["decode_step_ms"], rel=1e-2)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_decoding_drafts_from_the_logits_training_computes_at_the_same_anchors(fixture, request, monkeypatch):
    """No train/inference mismatch: at every round of greedy speculative decoding, the drafter's block
    logits (context = the target's features of the committed tokens, fed incrementally through prefill
    and verify blocks; block = the committed token and masks) equal what training computes for a block
    anchored at that position over the whole output sequence in one target forward (draft_blocks: the
    same logits the loss and tau-hat read). A difference here would be a tau-hat that decoding cannot reach."""
    from qdflash.drafter.train import draft_blocks, target_pass

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=3).eval()
    ids = prompt(5, 12)
    seen = {}
    real = spec.DrafterSession.draft_logits

    def recording(self, last_token, position):
        logits, drafts = real(self, last_token, position)
        seen[position] = (last_token, logits.clone())
        return logits, drafts

    monkeypatch.setattr(spec.DrafterSession, "draft_logits", recording)
    out = speculative_generate(target, drafter, ids, 24)
    assert out.tokens == autoregressive_generate(target, ids, 24).tokens and len(seen) >= 6
    full = torch.cat([ids[0], torch.tensor(out.tokens)])[None]
    features, _ = target_pass(target, full, drafter.config.target_layer_ids)
    anchors = torch.tensor([sorted(seen)])
    with torch.no_grad():
        logits, _ = draft_blocks(drafter, features, full, torch.ones_like(full), anchors, head=True)
    for i, position in enumerate(sorted(seen)):
        token, decoded = seen[position]
        assert token == int(full[0, position])
        torch.testing.assert_close(logits[0, i], decoded, atol=1e-4, rtol=1e-4)


def test_distinct_drafts_takes_the_second_choice_only_where_the_first_repeats_the_draft_before():
    from qdflash.drafter.blocks import distinct_drafts

    assert distinct_drafts([[5, 6], [7, 8], [9, 1]]) == [5, 7, 9]  # no repeat: the first choices
    assert distinct_drafts([[5, 6], [5, 8], [5, 2]]) == [5, 8, 5]  # a repeat of the draft before it
    assert distinct_drafts([[5, 6], [6, 5]]) == [5, 6]  # compared with the draft as chosen ...
    assert distinct_drafts([[5, 6], [5, 7], [7, 3]]) == [5, 7, 3]  # ... which can be the second choice
    assert distinct_drafts([[4, 6]]) == [4] and distinct_drafts([]) == []  # the first draft is the first choice


def ranked_logits(monkeypatch, cls, reference, prompt_len, vocab, wrong, scores=(2.0, 1.0), rest=0.0):
    """`draft_logits` whose first choice at block position k is `wrong(k, token, before)` where that gives a token (the
    reference token then second), else the reference continuation `token` (`before`: the reference token before it);
    `scores`: the logits of the first and the second choice, `rest`: every other token's."""

    def draft_logits(self, last_token, position):
        b = self.drafter.block_size
        logits = torch.full((b, vocab), rest)
        for k in range(1, b):
            i = position + k - prompt_len
            token = reference[i] if 0 <= i < len(reference) else 7
            before = reference[i - 1] if 0 <= i - 1 < len(reference) else last_token
            first = wrong(k, token, before)
            if first is not None:
                logits[k, first], logits[k, token] = scores
            else:
                logits[k, token] = scores[0]
        return logits, logits[1:].argmax(-1)

    monkeypatch.setattr(cls, "draft_logits", draft_logits)


def confused_logits(monkeypatch, cls, reference, prompt_len, vocab, every=3):
    """The reference continuation, except at every `every`-th block position (from 2), where the first choice is the
    token of the position before (a repeat) and the reference token is the second choice."""
    ranked_logits(monkeypatch, cls, reference, prompt_len, vocab,
                  lambda k, token, before: before if k > 1 and k % every == 0 and before != token else None)


@pytest.mark.parametrize("static_drafter", [False, True])
def test_no_repeat_drafts_raise_acceptance_where_the_drafter_repeats_and_keep_the_greedy_output(
        varied_llama, static_drafter, monkeypatch):
    """`no_repeat`: a drafter that writes the token before again at every second block position from 2 (the
    reference token its second choice) has those drafts overruled under argmax drafting, and accepted with the rule; both outputs are
    the autoregressive tokens, and the rule holds in every block fed (eager and static drafter)."""
    target = varied_llama
    block, new = 4, 6
    drafter = init_drafter(target, block_size=block, num_layers=1, seed=2).eval()
    ids = prompt(5, 8)  # one of the few prompts the tiny target continues without repeating a token
    reference = reference_tokens("varied_llama", target, ids, new)
    assert all(a != b for a, b in zip(reference, reference[1:]))
    if static_drafter:
        drafter.engine = DrafterEngine(drafter, max_len=64, smallest_bucket=8)
    fed = []
    feed = spec.TargetSession.feed
    monkeypatch.setattr(spec.TargetSession, "feed", lambda self, tokens: fed.append(list(tokens)) or feed(self, tokens))
    try:
        with monkeypatch.context() as m:
            confused_logits(m, DrafterEngine if static_drafter else spec.DrafterSession, reference, ids.shape[1],
                            target.model.config.vocab_size, every=2)
            plain = speculative_generate(target, drafter, ids, new)
            fed.clear()
            distinct = speculative_generate(target, drafter, ids, new, no_repeat=True)
    finally:
        drafter.engine = None
    assert plain.tokens == reference and distinct.tokens == reference
    assert max(plain.acceptance_lengths) < block and distinct.tau > plain.tau
    blocks = fed[1:]  # the prompt first, then one block a round
    assert len(blocks) == len(distinct.acceptance_lengths)
    assert all(a != b for block_fed in blocks for a, b in zip(block_fed, block_fed[1:]))


def test_draft_tree_takes_the_most_probable_paths_and_accepted_path_follows_the_target():
    from qdflash.drafter.blocks import accepted_path, draft_tree, tree_depths

    ids = [[5, 6], [7, 8], [9, 1]]
    logp = [[-0.1, -1.0], [-0.2, -3.0], [-0.5, -0.6]]
    tokens, parents = draft_tree(ids, logp, 5)
    # best first: 5 (-0.1), 5-7 (-0.3), 5-7-9 (-0.8), 5-7-1 (-0.9), 6 (-1.0)
    assert list(zip(tokens, parents)) == [(5, -1), (7, 0), (9, 1), (1, 1), (6, -1)]
    assert tree_depths(parents) == [1, 2, 3, 3, 1]
    assert all(p < i for i, p in enumerate(parents))  # a parent comes first
    assert draft_tree(ids, logp, 3) == ([5, 7, 9], [-1, 0, 1])  # a chain where the first choices lead
    after = {-1: 5, 0: 7, 1: 1, 3: 4}  # the target's next token after each node
    assert accepted_path(tokens, parents, after.get) == [0, 1, 3]
    assert accepted_path(tokens, parents, {-1: 6, 4: 2}.get) == [4]
    assert accepted_path(tokens, parents, {-1: 8}.get) == []
    same = [[5, 6], [5, 8]]
    assert draft_tree(same, [[-0.1, -1.0], [-0.2, -0.3]], 2, skip_repeats=True) == ([5, 8], [-1, 0])


def second_choice_logits(monkeypatch, cls, reference, prompt_len, vocab):
    """A first choice always wrong (the reference token + 1), the reference token a close second and every other token
    far behind (a path of second choices then ranks above longer paths of first choices and above third choices)."""
    ranked_logits(monkeypatch, cls, reference, prompt_len, vocab, lambda k, token, before: (token + 1) % vocab, (3.0, 2.9),
                  rest=-20.0)


@pytest.mark.parametrize("fixture", ["varied_llama", "tiny_qwen2"])
@pytest.mark.parametrize("nodes, window", [(1, None), (3, None), (8, 5), (15, None)])
@pytest.mark.parametrize("path", ["eager", "lean", "lean_graphs"])
def test_tree_verification_keeps_the_greedy_output(fixture, nodes, window, path, request):
    """A tree of drafts (a random drafter's best paths), verified in one forward each round, emits exactly the
    autoregressive tokens (fp32): on transformers' forward, on the lean engine's eager tree step and through the
    static step a graph captures (every round replays it), the drafts then from the drafter's static engine."""
    import dataclasses

    from qdflash.engine import build_engine

    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=1, seed=1).eval()
    ids = prompt(5, 8)
    new = 14
    reference = reference_tokens(fixture, target, ids, new)
    hits = []
    if path != "eager":
        engine = build_engine(target, max_len=48)
        if path == "lean_graphs":
            engine.capture([nodes + 1], drafter.config.target_layer_ids, cuda_graphs=False, lengths=[48], tree=True)
            find = engine.graph_for
            engine.graph_for = lambda t, layer_ids, end, tree=False: hits.append(tree) or find(t, layer_ids, end, tree)
            drafter.engine = DrafterEngine(drafter, max_len=64, smallest_bucket=8)
        target = dataclasses.replace(target, engine=engine)
    try:
        out = speculative_generate(target, drafter, ids, new, tree_nodes=nodes, window=window)
    finally:
        drafter.engine = None
    assert out.tokens == reference
    if path == "lean_graphs":
        assert hits.count(True) == len(out.acceptance_lengths)
    assert set(out.verify_lengths) == {min(nodes, 3 + 9 + 27) + 1}  # the committed token + the nodes
    assert all(1 <= a <= drafter.block_size for a in out.acceptance_lengths)


@pytest.mark.parametrize("static_drafter", [False, True])
def test_a_tree_accepts_second_choices_a_chain_cannot(varied_llama, static_drafter, monkeypatch):
    """A drafter whose second choice is always the target's token: a chain never gets past its first draft, a tree
    of 8 nodes does, and both outputs are the autoregressive tokens."""
    target = varied_llama
    drafter = init_drafter(target, block_size=4, num_layers=1, seed=2).eval()
    ids, new = prompt(5, 8), 12
    reference = reference_tokens("varied_llama", target, ids, new)
    if static_drafter:
        drafter.engine = DrafterEngine(drafter, max_len=64, smallest_bucket=8)
    try:
        with monkeypatch.context() as m:
            second_choice_logits(m, DrafterEngine if static_drafter else spec.DrafterSession, reference, ids.shape[1],
                                 target.model.config.vocab_size)
            chain = speculative_generate(target, drafter, ids, new)
            tree = speculative_generate(target, drafter, ids, new, tree_nodes=8)
    finally:
        drafter.engine = None
    assert chain.tokens == reference and tree.tokens == reference
    assert set(chain.acceptance_lengths) == {1} and max(tree.acceptance_lengths) > 2 and tree.tau > 2


def test_tree_verification_refuses_what_it_cannot_keep_exact(tiny_qwen, varied_llama):
    drafter = init_drafter(tiny_qwen, block_size=4, num_layers=1, seed=1).eval()
    with pytest.raises(QdflashError, match="recurrent"):
        speculative_generate(tiny_qwen, drafter, prompt(5, 8), 4, tree_nodes=4)
    drafter = init_drafter(varied_llama, block_size=4, num_layers=1, seed=1).eval()
    with pytest.raises(QdflashError, match="greedy"):
        speculative_generate(varied_llama, drafter, prompt(5, 8), 4, tree_nodes=4, temperature=0.7)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(QdflashError, match="tree_nodes"):
            speculative_generate(varied_llama, drafter, prompt(5, 8), 4, tree_nodes=bad)
