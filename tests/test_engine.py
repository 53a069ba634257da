"""The lean engine: transformers' logits, exactly; a static cache that rolls back by length; the
speculative loop on it emits the autoregressive tokens."""

import copy
import dataclasses

import pytest
import torch

from qdflash.drafter import init_drafter
from qdflash.engine import build_engine
from qdflash.engine.graphs import stacked_states
from qdflash.errors import QdflashError
from qdflash.spec import autoregressive_generate, speculative_generate


def ids(seed, n):
    return torch.randint(10, 2000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def smollm2():
    from qdflash.models import load_target

    return load_target("smollm2-135m", device="cpu")


@pytest.mark.parametrize("fixture", ["tiny_llama", "smollm2", "tiny_qwen", "tiny_qwen2"])
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


def test_hybrid_rollback_restores_the_kept_recurrent_state(tiny_qwen):
    """Feed a verify block, roll back into it: Gated DeltaNet state, conv inputs and KV then predict
    what a fresh forward over the accepted tokens predicts (no token fed twice)."""
    engine = build_engine(tiny_qwen, max_len=128)
    x = ids(2, 30).tolist()
    block = [101, 202, 303, 404, 505]
    engine.forward(torch.tensor(x), 0)
    engine.forward(torch.tensor(block), 30)
    engine.rollback(32)  # two block tokens accepted
    after, _ = engine.forward(torch.tensor([777]), 32)
    fresh = build_engine(tiny_qwen, max_len=128)
    expected, _ = fresh.forward(torch.tensor(x + block[:2] + [777]), 0)
    torch.testing.assert_close(after[-1], expected[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(QdflashError, match="only positions"):
        engine.rollback(10)  # older than the last block: that state is not kept
    with pytest.raises(QdflashError, match="only positions 33..33"):
        engine.rollback(32)  # into a decode step: one token keeps no states (nothing rolls a decode step back)
    with pytest.raises(QdflashError, match="feed from there"):
        engine.forward(torch.tensor([1]), 40)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen", "tiny_qwen2"])
@pytest.mark.parametrize("block", [2, 5])
def test_speculative_on_the_engine_equals_autoregressive(fixture, block, request, monkeypatch):
    import qdflash.spec as spec

    target = request.getfixturevalue(fixture)
    for seed in range(3):
        prompt = ids(seed, 8 + 5 * seed)[None]
        reference = autoregressive_generate(target, prompt, 30).tokens  # transformers' forward
        fast = dataclasses.replace(target, engine=build_engine(target, max_len=256))  # one engine, reused
        assert autoregressive_generate(fast, prompt, 30).tokens == reference
        drafter = init_drafter(target, block_size=block, seed=seed)
        assert speculative_generate(fast, drafter, prompt, 30).tokens == reference
        # drafts right 70% of the time: rollbacks into the middle of blocks
        rng = __import__("random").Random(seed)

        def draft(self, last, position, reference=reference, n=prompt.shape[1]):
            out = [reference[p - n] if 0 <= p - n < len(reference) else 7 for p in range(position + 1, position + block)]
            return torch.tensor([t + 1 if rng.random() < 0.3 else t for t in out])

        with monkeypatch.context() as m:
            m.setattr(spec.DrafterSession, "draft", draft)
            partly = speculative_generate(fast, drafter, prompt, 30)
        assert partly.tokens == reference and (block == 2 or partly.tau > 1.2)


def test_qwen2_engine_uses_the_biases(tiny_qwen2):
    """The tiny Qwen2 preset has non-zero q/k/v biases (so the logits test above checks them) and
    tied embeddings; the engine fuses the three biases like the weights."""
    attn = tiny_qwen2.model.model.layers[0].self_attn
    assert attn.q_proj.bias.abs().sum() > 0 and attn.o_proj.bias is None
    assert tiny_qwen2.model.lm_head.weight.data_ptr() == tiny_qwen2.model.model.embed_tokens.weight.data_ptr()
    engine = build_engine(tiny_qwen2, max_len=32)
    wqkv = engine.layers[0]["wqkv"]
    torch.testing.assert_close(wqkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


def test_unsupported_families_and_packed_weights_say_so(tiny_llama):
    from types import SimpleNamespace

    with pytest.raises(QdflashError, match="no lean engine for model type 'mamba'"):
        build_engine(SimpleNamespace(config=SimpleNamespace(model_type="mamba")))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_static_shape_step_is_the_eager_step(fixture, request):
    """The step a CUDA graph captures (attention over a fixed length of the cache, masked by position;
    positions from a static buffer) gives the eager step's logits and features, and speculative
    decoding through it emits the autoregressive tokens (on a GPU, `capture()` records this step)."""
    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, seed=0)
    eager = build_engine(target, max_len=96)
    static = build_engine(target, max_len=96)
    static.capture([1, 4], drafter.config.target_layer_ids, cuda_graphs=False, lengths=[32, 96])
    static.capture([1], None, cuda_graphs=False, lengths=[32, 96])  # autoregressive decoding asks for no features
    assert len(static.graphs) == 6
    x = ids(3, 28)
    eager.forward(x, 0, drafter.config.target_layer_ids)
    static.forward(x, 0, drafter.config.target_layer_ids)  # a prefill of 28: no graph for that size, eager
    # steps ending at or before 32 read 32 cache positions, later ones 96; the mask hides the rest
    for start, piece in ((28, [11, 12, 13, 14]), (32, [15]), (33, [16, 17, 18, 19])):
        a = eager.forward(torch.tensor(piece), start, drafter.config.target_layer_ids)
        b = static.forward(torch.tensor(piece), start, drafter.config.target_layer_ids)
        torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b[1], a[1], atol=1e-5, rtol=1e-5)
    prompt = ids(4, 12)[None]
    reference = autoregressive_generate(target, prompt, 24).tokens
    fast = dataclasses.replace(target, engine=static)
    assert speculative_generate(fast, drafter, prompt, 24).tokens == reference
    assert autoregressive_generate(fast, prompt, 24).tokens == reference


def small_model(family):
    """A random model whose projections are multiples of 128 wide (the W4A16 kernel's K tile)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
    if family == "llama":
        config = LlamaConfig(num_hidden_layers=2, **common)
    else:
        config = Qwen3_5TextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                   linear_value_head_dim=32, linear_conv_kernel_dim=4, **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_engine_runs_packed_w4_weights(family):
    """QuantLinear (W4, g32) layers run through the W4A16 kernel (Triton's interpreter here): the same
    logits as transformers' forward of the quantized model, and lossless speculative decoding."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from qdflash.quant.apply import quant_linears, quantize_weights, replace_linears, select_linears
    from qdflash.quant.grid import GridSpec

    model = small_model(family)
    replace_linears(model, quantize_weights(model, select_linears(model), GridSpec(4, 32, True), method="rtn"))
    assert len(quant_linears(model)) >= 7
    target = SimpleNamespace(model=model, config=model.config)
    engine = build_engine(target, max_len=64, kernels=True)
    assert engine.layers[0]["w13"].fast and engine.layers[0]["w13"].words is not None
    x = ids(5, 24) % 512
    ref = model(input_ids=x[None]).logits[0]
    prefill, _ = engine.forward(x[:20], 0)  # 20 rows: the dequantized matmul
    block, _ = engine.forward(x[20:24], 20)  # 4 rows: the kernel
    torch.testing.assert_close(torch.cat([prefill, block]), ref, atol=1e-4, rtol=1e-4)
    engine.reset()
    step, _ = engine.forward(x[:1], 0)  # 1 row: the kernel
    torch.testing.assert_close(step[0], model(input_ids=x[None, :1]).logits[0, 0], atol=1e-4, rtol=1e-4)


# the packed head under Triton's interpreter on llama only: the hybrid's recurrence kernel there costs ~1 min
@pytest.mark.parametrize("family,kernels", [("llama", False), ("qwen3_5", False), ("llama", True)])
def test_a_quantized_lm_head_runs_in_the_engine_the_drafter_and_the_loop(family, kernels):
    """A target quantized with its (tied) LM head (`lm_head` not in quant.exclude): the engine computes
    the logits of its forward, the head packed for the W4 backends where the kernels run (Triton's
    interpreter here), else its dequantized weight; the drafter shares that head; speculative
    decoding on it emits the autoregressive tokens."""
    if kernels:
        pytest.importorskip("triton")
    from types import SimpleNamespace

    from qdflash.models import Target
    from qdflash.quant.apply import quantize_weights, replace_linears, select_linears
    from qdflash.quant.grid import GridSpec
    from qdflash.quant.quantlinear import QuantLinear

    model = small_model(family)  # 128 wide: the head packs for the W4 kernel's K tile
    target = Target(family, model, SimpleNamespace(eos_token_id=None), "small_model")
    embedding = model.get_input_embeddings().weight.clone()
    names = select_linears(model, ["*"], ["*embed*", "*.in_proj_a", "*.in_proj_b"])
    assert "lm_head" in names
    replace_linears(model, quantize_weights(model, names, GridSpec(4, 32, True), method="rtn"))
    head = model.get_output_embeddings()
    assert isinstance(head, QuantLinear) and torch.equal(model.get_input_embeddings().weight, embedding)  # untied, embedding kept
    engine = build_engine(target, max_len=96, kernels=kernels)
    assert (engine.head_proj.words is not None) == kernels
    assert torch.equal(engine.lm_head, head.dequantized_weight(torch.float32))
    x = ids(7, 24) % 512
    ref = model(input_ids=x[None]).logits[0]
    prefill, _ = engine.forward(x[:20], 0)  # 20 rows: the kept dequantized head
    block, _ = engine.forward(x[20:24], 20)  # 4 rows: the W4 kernel where the kernels run
    torch.testing.assert_close(torch.cat([prefill, block]), ref, atol=1e-4, rtol=1e-4)
    engine.reset()
    step, _ = engine.forward(x[:1], 0)  # 1 row
    torch.testing.assert_close(step[0], ref[0], atol=1e-4, rtol=1e-4)

    drafter = init_drafter(target, block_size=4, seed=1)
    assert torch.equal(drafter.head_weight(), head.dequantized_weight(torch.float32))
    fast = dataclasses.replace(target, engine=engine)
    prompt = x[None, :10]
    reference = autoregressive_generate(target, prompt, 16).tokens  # transformers' forward of the quantized model
    assert autoregressive_generate(fast, prompt, 16).tokens == reference
    assert speculative_generate(fast, drafter, prompt, 16).tokens == reference
    # the static drafter reads the head as the engine does: packed where the kernels run (a block of rows through
    # the W4 kernel: the dequantized product up to the order of its sums)
    from qdflash.drafter.static import DrafterEngine

    drafter.engine = DrafterEngine(drafter, 96, kernels=kernels)
    assert (drafter.engine.head.words is not None) == kernels
    h = torch.randn(4, model.config.hidden_size)
    torch.testing.assert_close(drafter.engine.head(h), h @ head.dequantized_weight(torch.float32).T, atol=1e-4, rtol=1e-4)
    assert speculative_generate(fast, drafter, prompt, 16).tokens == reference


@pytest.mark.parametrize("gdn_ba,two_phase", [("dot", False), ("given", False), ("fused", False), ("fused", True),
                                              ("dot", True), ("given", "chunked"), ("dot", "chunked")])
def test_hybrid_engine_through_the_recurrence_kernel(short_qwen, gdn_ba, two_phase, monkeypatch):
    """kernels=True: the Gated DeltaNet recurrence runs in the Triton kernels (their interpreter here): a
    20-token prompt through the unfused layer and the recurrence kernel, a verify block and a decode step
    through the fused layer middle (gated_delta_step). Both keep per-position states, and a rollback into
    a block still predicts what a fresh forward does. Whichever way the gates get their b / a projection
    (`gdn_ba`: in the kernel, its own matmul, or the tail of the qkvz matmul), and with the block through the
    two-phase kernel (`gdn_two_phase`) or in the chunked form (`gdn_chunked`)."""
    pytest.importorskip("triton")
    import qdflash.engine.qwen3_5 as qwen3_5
    from qdflash.kernels.gated_delta import gated_delta_step
    from qdflash.kernels.gated_norm import gated_rms_norm

    calls = []

    def counted(qkvz, *args, **kwargs):
        calls.append((qkvz.shape[0], "chunked" if kwargs["chunked"] else kwargs["two_phase"]))
        return gated_delta_step(qkvz, *args, **kwargs)

    monkeypatch.setattr(qwen3_5, "gated_delta_step", counted)
    norms = []
    monkeypatch.setattr(qwen3_5.gated_norm, "gated_rms_norm", lambda o, *a: norms.append(o.shape[0]) or gated_rms_norm(o, *a))
    engine = build_engine(short_qwen, max_len=64, kernels=True, gdn_ba=gdn_ba)
    engine.gdn_two_phase, engine.gdn_chunked = two_phase is True, two_phase == "chunked"
    assert engine.kernels and engine.fuse_gdn
    gdn = [w for w in engine.layers if "la" in w]
    assert all((w["ba"] is None) == (gdn_ba == "fused") for w in gdn)  # fused: one projection fewer a layer
    x = ids(6, 20)
    logits, _ = engine.forward(x, 0)
    torch.testing.assert_close(logits, short_qwen.model(input_ids=x[None]).logits[0], atol=1e-4, rtol=1e-4)
    engine.forward(torch.tensor([101, 202, 303, 404]), 20)
    engine.rollback(21)
    after, _ = engine.forward(torch.tensor([777]), 21)
    expected = short_qwen.model(input_ids=torch.cat([x, torch.tensor([101, 777])])[None]).logits[0, -1]
    torch.testing.assert_close(after[-1], expected, atol=1e-4, rtol=1e-4)
    layers = short_qwen.model.config.layer_types.count("linear_attention")
    # two_phase asked for both: gated_delta_step runs one token through the step kernel whatever it says
    assert calls == [(4, two_phase)] * layers + [(1, two_phase)] * layers, \
        "the prompt unfused; the block (two-phase where asked) and the step fused, every GDN layer"
    assert norms == [20] * layers + [4] * layers + [1] * layers  # each GDN layer's gated norm in one launch (gated_norm)


def test_a_rollback_replays_a_two_phase_block_to_the_state_it_would_have_kept(short_qwen, monkeypatch):
    """gdn_replay (with the two-phase block): a verify block keeps its GDN inputs and the state before it,
    and a rollback into it recomputes every layer's state in one launch (gated_delta_replay). The engine then holds
    exactly the states, and predicts exactly the logits, that keeping every position's state gave; a rollback after a
    decode step, a prompt or an unfused block copies as before."""
    pytest.importorskip("triton")
    import qdflash.engine.qwen3_5 as qwen3_5

    replays = []
    monkeypatch.setattr(qwen3_5, "gated_delta_replay", lambda *a: replays.append(a[-1]) or gated_delta_replay(*a))
    from qdflash.kernels.gated_delta import gated_delta_replay

    x = ids(6, 20)
    runs = {}
    for replay in (True, False):
        engine = build_engine(short_qwen, max_len=64, kernels=True)
        engine.gdn_two_phase, engine.gdn_replay = True, replay
        engine.forward(x, 0)
        out = []
        for keep, block in ((22, [101, 202, 303, 404, 505]), (24, [7, 8, 9]), (26, [11, 12])):
            engine.forward(torch.tensor(block), engine.length)
            engine.rollback(keep)
            out.append((stacked_states(engine), engine.forward(torch.tensor([777]), keep)[0]))
        engine.rollback(27)  # after a decode step: nothing kept, nothing to roll back to
        runs[replay] = out
    assert replays == [2, 1, 1], "each rollback into a block replayed its accepted tokens, and only with gdn_replay"
    for (state, logits), (kept_state, kept_logits) in zip(runs[True], runs[False]):
        assert torch.equal(state, kept_state) and torch.equal(logits, kept_logits)
    with pytest.raises(QdflashError, match="only positions"):
        engine.rollback(20)
    assert not engine.kept  # the engine that never replayed allocated no kept inputs
    engine.gdn_replay = True
    assert set(engine.kept) == set(engine.state)  # allocated when the replay is turned on
    engine.capture([1], cuda_graphs=False)
    engine.gdn_replay = False  # a decode step keeps no per-position states: its graph is the same either way
    engine.gdn_replay = True
    engine.capture([3], cuda_graphs=False)
    with pytest.raises(QdflashError, match="before capture"):  # a captured block would keep the other thing
        engine.gdn_replay = False
    engine.gdn_replay = True  # (the same setting: nothing changes)
    for name, value in (("fuse_gdn", False), ("gdn_two_phase", False), ("gdn_chunked", True)):
        with pytest.raises(QdflashError, match=f"{name}: set it before capture"):  # each would stop the replay too
            setattr(engine, name, value)
    assert engine.fuse_gdn and engine.gdn_two_phase and not engine.gdn_chunked and engine._replays(3)
    engine.graphs = {}
    engine.gdn_replay = False
    plain = build_engine(short_qwen, max_len=64, kernels=False)  # no kernels, no kept scratch: nothing to replay
    plain.gdn_two_phase = plain.gdn_replay = True
    assert not plain.kept and plain._replays(3) is False


def test_two_phase_gdn_blocks_are_the_default_for_16_bit_models_only(tiny_qwen):
    """A verify block's GDN middle runs through the two-phase kernel by default where the model is 16-bit (its blocks
    agree with one-token steps to fp32 rounding, which bf16 output tolerates at near-ties), and through the step kernel
    where it is fp32 (whose speculative output must equal the autoregressive one bit for bit)."""
    import copy

    full = build_engine(tiny_qwen, max_len=32, kernels=False)  # tiny_qwen is fp32
    assert not full.gdn_two_phase and not full.gdn_replay
    half = copy.deepcopy(tiny_qwen)
    half.model.to(torch.bfloat16)
    engine = build_engine(half, max_len=32, kernels=False)
    assert engine.gdn_two_phase and engine.gdn_replay  # ... whose two-phase blocks keep their inputs for a replay


def test_gdn_ba_fused_without_kernels_and_where_it_cannot_fuse(tiny_qwen, tiny_llama):
    """gdn_ba="fused" on the CPU path (no kernels): the same logits as transformers; on a target whose qkvz is
    4-bit (b / a stay 16-bit) it keeps them apart ("given"); only Qwen3.5 takes the option, and only its values."""
    from qdflash.quant.apply import replace_linears, select_linears
    from qdflash.quant.gptq import rtn_quantize
    from qdflash.quant.grid import GridSpec

    x = ids(4, 24)
    engine = build_engine(tiny_qwen, max_len=64, gdn_ba="fused")
    torch.testing.assert_close(engine.forward(x, 0)[0], tiny_qwen.model(input_ids=x[None]).logits[0], atol=1e-5, rtol=1e-5)
    quantized = copy.deepcopy(tiny_qwen)
    modules = dict(quantized.model.named_modules())
    names = select_linears(quantized.model, ["*in_proj_qkv", "*in_proj_z"])
    replace_linears(quantized.model, {n: rtn_quantize(modules[n].weight.detach(), GridSpec(4, 32, True)) for n in names})
    mixed = build_engine(quantized, max_len=64, gdn_ba="fused")
    assert all(w["ba"] is not None for w in mixed.layers if "la" in w)
    torch.testing.assert_close(mixed.forward(x, 0)[0], build_engine(quantized, max_len=64).forward(x, 0)[0])
    with pytest.raises(QdflashError, match="gdn_ba='cat'"):
        build_engine(tiny_qwen, max_len=64, gdn_ba="cat")
    with pytest.raises(QdflashError, match="only a Qwen3.5 engine"):
        build_engine(tiny_llama, max_len=64, gdn_ba="fused")


def test_bf16_engine_keeps_the_residual_in_fp32(smollm2):
    """In bf16 the residual stream stays fp32 (matmuls still read bf16): the logits are closer to the
    fp32 model's than with a bf16 residual, and logits and features come out in the model's dtype."""
    import copy

    x = ids(3, 48)
    ref = smollm2.model(input_ids=x[None]).logits[0]
    bf16 = dataclasses.replace(smollm2, model=copy.deepcopy(smollm2.model).to(torch.bfloat16))
    errors = {}
    for fp32_residual in (True, False):
        engine = build_engine(bf16, max_len=64)
        if not fp32_residual:
            engine.residual_dtype = torch.bfloat16
        logits, features = engine.forward(x, 0, [2])
        assert logits.dtype == features.dtype == torch.bfloat16
        errors[fp32_residual] = (logits.float() - ref).abs().mean().item()
    assert errors[True] < 0.8 * errors[False], errors


def test_compiled_capture_raises_the_recompile_limit(tiny_llama):
    """capture(compile=True) compiles `_step` once per (tokens, cache length) graph: past dynamo's
    recompile limit the rest would silently run uncompiled, so the limit grows with what is asked."""
    import torch._dynamo.config as dynamo_config

    engine = build_engine(tiny_llama, max_len=2048)
    before = dynamo_config.recompile_limit
    engine.capture([1, 4], None, cuda_graphs=False, compile=True)  # 4 lengths (256 .. 2048) x 2 sizes, compiled lazily
    assert dynamo_config.recompile_limit >= max(before, 8 + 8)


def test_compiled_capture_logs_the_graph_breaks_of_its_steps(tiny_llama, monkeypatch, caplog):
    """capture(compile=...) logs, by reason, each graph break dynamo made in the steps it compiled (a step meant as one
    graph then runs unfused around each break); a step that compiles as one graph logs none."""
    import qdflash.engine.graphs as graphs

    # a CUDA graph's capture runs the step (its warm-up, where it compiles); here the warm-up alone, on the CPU
    monkeypatch.setattr(graphs, "capture", lambda fn, warmup, device: (None, [fn() for _ in range(warmup)][-1]))
    engine = build_engine(tiny_llama, max_len=64)
    with caplog.at_level("WARNING", logger="qdflash.engine.base"):
        engine.capture([1], None, compile="eager")
    assert "graph breaks" not in caplog.text
    step = engine._step

    def broken(*args, **kwargs):  # a step with something dynamo cannot trace in it
        out = step(*args, **kwargs)
        torch._dynamo.graph_break()
        return out

    monkeypatch.setattr(engine, "_step", broken)
    with caplog.at_level("WARNING", logger="qdflash.engine.base"):
        engine.capture([2], None, compile="eager")
    assert "compiled steps for [2] tokens: 1 graphs for 1 steps, 1 graph breaks" in caplog.text  # (nothing after it)
    assert "graph_break()" in caplog.text


def test_compiled_since_reports_graphs_breaks_and_recompile_limits_hit():
    """engine.base.compiled_since: the graphs dynamo compiled, its graph breaks by reason, and its warnings that a
    piece hit the recompile limit (past which the piece runs uncompiled: dynamo only logs that)."""
    import torch._dynamo.config as dynamo_config

    from qdflash.engine.base import compiled_since, dynamo_counts

    def scaled(x, n):
        return x * n

    before = dynamo_counts()
    step = torch.compile(scaled, backend="eager", dynamic=False)
    with dynamo_config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        for n in range(4):  # an int argument is a constant to dynamo: a recompile per value, the last two past the limit
            assert torch.equal(step(torch.ones(2), n), torch.full((2,), float(n)))
    done = compiled_since(before)
    assert done["graphs"] == 2 and done["graph_breaks"] == {}
    assert len(done["recompile_limits"]) >= 1 and "recompile_limit" in done["recompile_limits"][0]
    assert "scaled" in done["recompile_limits"][0]


def test_each_compiled_step_traces_as_one_graph():
    """scripts/bench/check_step_graphs.py: dynamo traces a 16-bit and a W4 Qwen3.5 engine's decode step and verify block
    with the kernels on (the fused GDN middle, two-phase blocks keeping their inputs for a replay, the gated norm,
    qk_norm_rope, the attention kernel, w4a16_matmul untuned) and a drafter's steps with its qk kernel, each as one
    graph, no break, its launches real triton.jit functions made no-ops. Why: a break splits every GDN layer's step
    on the GPU (a layer's closure then compiles once per layer index, and past dynamo's recompile limit runs
    uncompiled). Two did: `max(..., key=)` in w4a16.default_config and, under the device's torch 2.11, `bool(dict)` in
    `_replays`. A subprocess: this session's kernels are the interpreter's (conftest), which dynamo cannot lift."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(root / "scripts/bench/check_step_graphs.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout)
    for name in ("qwen3.5_16bit", "qwen3.5_w4", "drafter_kernel", "drafter_sdpa"):
        assert result[name]["graph_breaks"] == {} and result[name]["graphs"] == result[name]["steps"] >= 1, name
        assert result[name]["recompile_limits"] == [], name
        assert result[name]["kernel_nodes"] > 0, name  # the launches were lifted into the graph, as on the device
    # the launches dynamo met: the GDN step and block kernels, the W4 matmul, the drafter's and target's qk kernel
    assert {"_gated_delta_block_kernel", "_gated_delta_step_kernel", "_w4a16_kernel", "_qk_norm_rope_kernel",
            "_decode_attention_kernel"} <= set(result["launched"])


def test_compiled_steps_give_inductor_the_engines_options(tiny_llama, monkeypatch):
    """capture(compile=True) hands inductor the engine's options (INDUCTOR_OPTIONS unless changed: multi_kernel, so a
    wide norm may run persistent), with `pdl` its PDL option too; another backend gets none (aot_eager takes no
    inductor options)."""
    import os

    import qdflash.engine.base as base

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    monkeypatch.setenv("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "")  # recorded, so undone after the test
    monkeypatch.delenv("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE")
    engine = build_engine(tiny_llama, max_len=64)
    assert engine.inductor_options == base.INDUCTOR_OPTIONS and engine.inductor_options is not base.INDUCTOR_OPTIONS
    engine.capture([1], None, cuda_graphs=False, compile=True)
    engine.inductor_options = {}
    engine.capture([1], None, cuda_graphs=False, compile=True)
    engine.capture([1], None, cuda_graphs=False, compile="aot_eager")
    engine.capture([1], None, cuda_graphs=False, compile="inductor")  # inductor named: its options too
    engine.pdl = True  # programmatic dependent launch: inductor's kernels too, beside the engine's options
    engine.capture([1], None, cuda_graphs=False, compile=True)
    engine.inductor_options = dict(base.INDUCTOR_OPTIONS)
    engine.capture([1], None, cuda_graphs=False, compile=True)
    assert engine.inductor_options == base.INDUCTOR_OPTIONS  # (the engine's own options unchanged)
    assert seen == [dict(dynamic=False, options=base.INDUCTOR_OPTIONS), dict(dynamic=False, options={}),
                    dict(dynamic=False, backend="aot_eager"), dict(dynamic=False, options={}),
                    dict(dynamic=False, options={"triton.enable_pdl": True}),
                    dict(dynamic=False, options={**base.INDUCTOR_OPTIONS, "triton.enable_pdl": True})]
    assert base.INDUCTOR_OPTIONS["triton.multi_kernel"] == 1
    # multi_kernel's picks are not keyed on disk (a drafter compiled after a target failed to: base.compiled_step)
    assert os.environ["TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE"] == "1"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen", "tiny_qwen2"])
def test_kernel_attention_is_the_sdpa_attention(fixture, request, monkeypatch):
    """attention='kernel' (kernels.decode_attention, Triton's interpreter here: each token of a step
    reads its own positions only) gives the SDPA engine's logits and features for a verify block and
    a decode step, eagerly and through the static step a graph captures (one cache length). Two
    chunks per token instead of 16: the same split-and-merge path, at a fraction of the interpreter's
    time (~9 ms a program; the chunking itself is checked in test_kernels)."""
    pytest.importorskip("triton")
    import qdflash.kernels.decode_attention as kernel_module

    monkeypatch.setattr(kernel_module, "MAX_SPLITS", 2)
    target = request.getfixturevalue(fixture)
    if fixture == "tiny_qwen":  # its attention layers' q / k norms, rotation and cache writes in one launch
        import qdflash.engine.qwen3_5 as qwen3_5

        launches, fused = [], qwen3_5.qk_norm_rope.qk_norm_rope
        monkeypatch.setattr(qwen3_5.qk_norm_rope, "qk_norm_rope", lambda qkv, *a: launches.append(qkv.shape[0]) or fused(qkv, *a))
        # its Gated DeltaNet layers through torch's recurrence: their kernels have tests of their own
        # (test_hybrid_engine_through_the_recurrence_kernel), and in the interpreter they took most of this case's time
        monkeypatch.setattr(qwen3_5, "gated_delta_recurrence", qwen3_5.recurrence_torch)
    layer_ids = init_drafter(target, block_size=4, seed=0).config.target_layer_ids
    sdpa = build_engine(target, max_len=96, kernels=True)
    kernel = build_engine(target, max_len=96, kernels=True, attention="kernel")
    static = build_engine(target, max_len=96, kernels=True, attention="kernel")
    if fixture == "tiny_qwen":
        for engine in (sdpa, kernel, static):
            engine.fuse_gdn = False
    static.capture([1, 3], layer_ids, cuda_graphs=False)
    assert sorted(n for _, _, n, _ in static.graphs) == [96, 96]  # the kernel needs no cache-length buckets
    x = ids(5, 40)
    for engine in (sdpa, kernel, static):
        engine.forward(x, 0, layer_ids)  # a prefill of 40: SDPA in every engine
    for start, piece in ((40, [11, 12, 13]), (43, [15])):
        a = sdpa.forward(torch.tensor(piece), start, layer_ids)
        for engine in (kernel, static):
            b = engine.forward(torch.tensor(piece), start, layer_ids)
            torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b[1], a[1], atol=1e-5, rtol=1e-5)
    if fixture == "tiny_qwen":  # not the 40-token prefill (SDPA); the block and the step of both kernel engines
        attention_layers = target.model.config.layer_types.count("full_attention")
        assert launches == ([3] * attention_layers * 2 + [1] * attention_layers * 2)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_tree_step_gives_each_node_its_paths_logits_and_keeps_the_accepted_path(fixture, request, monkeypatch):
    """engine.forward_tree: every node of a tree, fed in one step, gets the logits and features a chain of its own
    path gets (SDPA, the kernel under Triton's interpreter, and both through the static step a graph captures);
    after keep_nodes, the next step sees only the kept path, as if the chain had been fed."""
    pytest.importorskip("triton")
    import qdflash.kernels.decode_attention as kernel_module

    monkeypatch.setattr(kernel_module, "MAX_SPLITS", 2)
    target = request.getfixturevalue(fixture)
    layer_ids = init_drafter(target, block_size=4, seed=0).config.target_layer_ids
    tokens, parents = [11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 2, 4]  # root 11: 12 -> 14, 13 -> 15 -> 16
    engines = {"sdpa": build_engine(target, max_len=96, kernels=True),
               "kernel": build_engine(target, max_len=96, kernels=True, attention="kernel")}
    engines["sdpa static"] = build_engine(target, max_len=96, kernels=True)
    engines["sdpa static"].capture([6], layer_ids, cuda_graphs=False, tree=True)
    engines["kernel static"] = build_engine(target, max_len=96, kernels=True, attention="kernel")
    engines["kernel static"].capture([6], layer_ids, cuda_graphs=False, tree=True)
    x = ids(5, 40)
    chain = build_engine(target, max_len=96, kernels=True)
    chain.forward(x, 0, layer_ids)
    paths = {0: [11], 1: [11, 12], 2: [11, 13], 3: [11, 12, 14], 4: [11, 13, 15], 5: [11, 13, 15, 16]}
    expected = {}
    for node, path in paths.items():
        logits, features = chain.forward(torch.tensor(path), 40, layer_ids)
        expected[node] = (logits[-1], features[-1])
    for name, engine in engines.items():
        engine.forward(x, 0, layer_ids)
        logits, features = engine.forward_tree(torch.tensor(tokens), 40, parents, layer_ids)
        for node, (want_logits, want_features) in expected.items():
            torch.testing.assert_close(logits[node], want_logits, atol=1e-5, rtol=1e-5, msg=f"{name}, node {node}")
            torch.testing.assert_close(features[node], want_features, atol=1e-5, rtol=1e-5, msg=f"{name}, node {node}")
        engine.keep_nodes(40, [0, 2, 4])  # the path 11 -> 13 -> 15: positions 40, 41, 42
        after, _ = engine.forward(torch.tensor([17]), 43, layer_ids)
        want, _ = chain.forward(torch.tensor([11, 13, 15, 17]), 40, layer_ids)
        torch.testing.assert_close(after[-1], want[-1], atol=1e-5, rtol=1e-5, msg=name)
    hybrid = request.getfixturevalue("tiny_qwen")
    with pytest.raises(QdflashError, match="cannot verify a tree"):
        build_engine(hybrid, max_len=96).forward_tree(torch.tensor(tokens), 0, parents)


@pytest.mark.parametrize("tree_nodes", [None, 5])
def test_speculative_through_kernel_attention_equals_autoregressive(tiny_llama, tree_nodes):
    """Greedy speculative decoding with the kernel's verify blocks (or trees, through its ancestor bits) emits the
    autoregressive tokens (fp32; one chunk per token, the interpreter's fastest)."""
    pytest.importorskip("triton")
    prompt = ids(6, 12)[None]
    reference = autoregressive_generate(tiny_llama, prompt, 8).tokens
    fast = dataclasses.replace(tiny_llama, engine=build_engine(tiny_llama, max_len=64, kernels=True, attention="kernel"))
    with pytest.MonkeyPatch.context() as m:
        import qdflash.kernels.decode_attention as kernel_module

        m.setattr(kernel_module, "MAX_SPLITS", 1)
        assert autoregressive_generate(fast, prompt, 8).tokens == reference
        drafter = init_drafter(tiny_llama, block_size=3, seed=0)
        assert speculative_generate(fast, drafter, prompt, 8, tree_nodes=tree_nodes).tokens == reference


def test_kernel_attention_says_what_it_needs(tiny_llama):
    with pytest.raises(QdflashError, match="needs the engine's Triton kernels"):
        build_engine(tiny_llama, max_len=32, kernels=False, attention="kernel")
    with pytest.raises(QdflashError, match="expected 'sdpa' or 'kernel'"):
        build_engine(tiny_llama, max_len=32, attention="flash")
    engine = build_engine(tiny_llama, max_len=32)
    engine.capture([1], None, cuda_graphs=False)
    with pytest.raises(QdflashError, match="before capture"):
        engine.set_attention("sdpa")


@pytest.mark.parametrize("start", [0, 5])
def test_prefill_attention_is_causal_attention_over_the_cache(start, monkeypatch):
    """The eager prefill's attention (engine.base.prefill_attention: flash-style causal from position 0, the
    mask after it, KV heads repeated) equals causal softmax attention written out, with grouped KV heads; from
    position 0 SDPA gets no mask tensor (what lets flash attention take it on CUDA instead of cuDNN's per-shape plans)."""
    import torch.nn.functional as F

    from qdflash.engine import base
    from qdflash.engine.base import cached_attention

    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(base.F, "scaled_dot_product_attention", recording)

    g = torch.Generator().manual_seed(start)
    heads, kv_heads, d, t, max_len = 6, 2, 8, 7, 32
    k_cache, v_cache = torch.zeros(kv_heads, max_len, d), torch.zeros(kv_heads, max_len, d)
    k_cache[:, :start] = torch.randn(kv_heads, start, d, generator=g)  # what earlier feeds cached
    v_cache[:, :start] = torch.randn(kv_heads, start, d, generator=g)
    q, k, v = (torch.randn(h, t, d, generator=g) for h in (heads, kv_heads, kv_heads))
    positions = torch.arange(start, start + t)
    out = cached_attention(q, k, v, k_cache, v_cache, positions, start + t, exact=True)
    keys = k_cache[:, :start + t].repeat_interleave(heads // kv_heads, 0)
    values = v_cache[:, :start + t].repeat_interleave(heads // kv_heads, 0)
    scores = q @ keys.transpose(1, 2) / d ** 0.5
    scores = scores.masked_fill(torch.arange(start + t)[None, :] > positions[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ values).transpose(0, 1).reshape(t, -1)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(k_cache[:, start:start + t], k)  # the tokens' own K/V written at their positions
    (call,) = calls
    assert (call["attn_mask"] is None, call["is_causal"], call.get("enable_gqa", False)) == (start == 0, start == 0, False)


def test_the_prefill_never_runs_cudnn_attention_on_cuda():
    """On CUDA the prefill's SDPA call runs with cuDNN attention off (its per-shape plans: prefill_attention) and
    flash attention on; the flags are back as they were afterwards. The CPU build has the same switches."""
    from qdflash.engine.base import _prefill_backends

    class OnCuda:
        is_cuda = True

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    with _prefill_backends(OnCuda()):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_swiglu_is_made_in_the_gate_up_gemv_where_it_runs(fixture, request, monkeypatch):
    """kernels=True: the gate / up projection keeps (gate, up) row pairs, and with `swiglu_epilogue` on, where its GEMV
    is tuned at one K split (here for 1 and 2-16 rows, Triton's interpreter), the kernel's epilogue makes
    silu(gate) * up: the logits stay transformers' at 1 and 4 rows; with the tuned config split over K, or the
    epilogue off (on by default), silu(gate) * up comes from the matmul's output, the same logits. Without
    kernels the rows keep the modules' order (the matmul bit for bit the model's)."""
    pytest.importorskip("triton")
    from qdflash.kernels import gemv as gemv_module

    target = request.getfixturevalue(fixture)
    assert not build_engine(target, max_len=64).layers[0]["w13"].pairs
    engine = build_engine(target, max_len=64, kernels=True)
    assert engine.swiglu_epilogue  # on by default
    w13 = engine.layers[0]["w13"]
    assert w13.pairs and w13.weight is not None
    n, k = w13.weight.shape
    calls, real = [], gemv_module.gemv
    monkeypatch.setattr("qdflash.engine.linear.gemv", lambda *a, **kw: calls.append(kw.get("swiglu", False)) or real(*a, **kw))
    x = ids(5, 24) % target.config.vocab_size
    ref = target.model(input_ids=x[None]).logits[0]
    # (the hybrid's layers run the same swiglu: one case there, every case on Llama; the interpreter is slow)
    cases = ((False, True), (True, True), (False, False)) if fixture == "tiny_llama" else ((False, True),)
    for split, epilogue in cases:
        for rows, block_n in ((1, 4), (16, 16)):  # (a 2-16-row tile is a dot's operand: >= 16 weight rows)
            config = gemv_module.GemvConfig(block_n, k // 2 if split else k, split_k=2 if split else 1)
            monkeypatch.setitem(gemv_module._TUNED, (n, k, w13.weight.dtype, rows), config)
        engine.swiglu_epilogue = epilogue
        calls.clear()
        engine.reset()
        prefill, _ = engine.forward(x[:20], 0)  # 20 rows: F.linear, silu(gate) * up from its pairs
        block, _ = engine.forward(x[20:24], 20)  # 4 rows: the 2-16-row GEMV
        torch.testing.assert_close(torch.cat([prefill, block]), ref, atol=1e-5, rtol=1e-5)
        engine.reset()
        step, _ = engine.forward(x[:1], 0)  # 1 row: the one-row GEMV
        torch.testing.assert_close(step[0], ref[0], atol=1e-5, rtol=1e-5)
        layers = len(engine.layers)
        fused = epilogue and not split
        assert calls.count(True) == (2 * layers if fused else 0) and calls.count(False) == (0 if fused else 2 * layers)
