import pytest
import torch

from qdflash.drafter import init_drafter, load_drafter, save_drafter
from qdflash.drafter.blocks import (
    IGNORE, acceptance_lengths, block_attention_mask, block_inputs, default_layer_ids, linear_argmax, loss_weights,
    sample_anchors, weighted_block_loss_parts, weighted_linear_block_loss_parts,
)
from qdflash.drafter.train import batch_loss, draft_blocks, estimate_acceptance, pad_anchors, pad_right, target_pass
from qdflash.errors import QdflashError


def example(target, length=40, prompt=10, seed=0, id="x"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (length,), generator=g).tolist()
    return {"id": id, "input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)}


def test_mask_blocks_see_only_their_prefix_and_themselves():
    anchors = torch.tensor([3, 7])
    mask = block_attention_mask(anchors, block_size=4, context_len=10)
    assert mask.shape == (8, 18)
    for i, a in enumerate(anchors.tolist()):
        for k in range(4):
            row = mask[i * 4 + k]
            assert row[:10].tolist() == [j < a for j in range(10)]  # context strictly before the anchor
            own = row[10:].view(2, 4)
            assert own[i].all() and not own[1 - i].any()  # bidirectional in-block, never another block


def test_block_inputs_and_targets():
    ids = torch.arange(100, 112)
    mask = torch.tensor([0] * 4 + [1] * 8)
    block, targets, positions = block_inputs(ids, mask, torch.tensor([3, 9]), 4, mask_token=-1)
    assert block.tolist() == [[103, -1, -1, -1], [109, -1, -1, -1]]
    assert targets.tolist() == [[IGNORE, 104, 105, 106], [IGNORE, 110, 111, IGNORE]]  # past the end: ignored
    assert positions.tolist() == [[3, 4, 5, 6], [9, 10, 11, 12]]


def test_loss_weights_decay():
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))
    assert all(a > b for a, b in zip(w[1:], w[2:]))


def test_loss_positions_train_only_the_first_block_positions(tiny_llama, monkeypatch):
    """drafter_train.loss_positions: positions past N weigh 0, the first N keep the decay's weights, and
    only their rows reach the LM head (the point: a cheaper step)."""
    from qdflash.drafter import blocks

    w, full = loss_weights(16, 7.0, positions=3), loss_weights(16, 7.0)
    assert torch.equal(w[:4], full[:4]) and w[1:4].gt(0).all() and w[4:].eq(0).all()
    assert torch.equal(loss_weights(16, 7.0, positions=15), full)
    for bad in (0, 16):
        with pytest.raises(QdflashError, match="loss_positions"):
            loss_weights(16, 7.0, positions=bad)

    rows = []
    real = blocks._LinearCrossEntropy.apply
    monkeypatch.setattr(blocks._LinearCrossEntropy, "apply", lambda hidden, *a: rows.append(hidden.shape[0]) or real(hidden, *a))
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    batch = [example(tiny_llama, 40, seed=1, id="a"), example(tiny_llama, 50, seed=2, id="b")]
    losses = [batch_loss(drafter, tiny_llama, batch, loss_weights(4, 7.0, positions=p), 8, torch.Generator().manual_seed(0))
              for p in (1, None)]
    blocks_trained = rows[0]  # one row per block at position 1 (every anchor has its next token: full_block)
    assert 0 < blocks_trained < rows[1] <= 3 * blocks_trained
    assert not torch.isclose(losses[0], losses[1])


def test_anchor_sampling_stays_in_the_response():
    mask = torch.tensor([0] * 10 + [1] * 20)
    anchors = sample_anchors(mask, 100, torch.Generator().manual_seed(0))
    assert anchors.min() >= 9 and anchors.max() <= 28 and len(anchors) == 20
    full = sample_anchors(mask, 100, torch.Generator().manual_seed(0), full_block=4)
    assert full.min() >= 9 and full.max() + 3 <= 29


def test_acceptance_lengths_oracle_and_random():
    target = torch.randint(0, 50, (200, 15))
    assert acceptance_lengths(target, target).tolist() == [16] * 200  # oracle: all accepted + bonus = B
    random = torch.randint(0, 50, (200, 15))
    assert acceptance_lengths(random, target).float().mean() < 1.1
    assert acceptance_lengths(torch.tensor([[1, 2, 9, 4]]), torch.tensor([[1, 2, 3, 4]])).tolist() == [3]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_shapes_for_both_tiny_presets(fixture, request):
    target = request.getfixturevalue(fixture)
    drafter = init_drafter(target, block_size=4, num_layers=1)
    ex = example(target)
    loss = batch_loss(drafter, target, [ex], loss_weights(4, 7.0), 6, torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert drafter.fc.weight.grad is not None
    assert not any(p.grad is not None for p in target.model.parameters())  # the target stays frozen
    assert drafter.config.target_layer_ids == default_layer_ids(target.num_layers)


def test_save_load_round_trip(tiny_llama, tmp_path):
    drafter = init_drafter(tiny_llama, block_size=4)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", tiny_llama)
    for (k, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    # the embedding and LM head are the target's, never stored with the drafter
    assert not any("embed_tokens" in k or "lm_head" in k for k in loaded.state_dict())
    assert all(tiny_llama.vocab_size not in v.shape for v in loaded.state_dict().values())


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tiny_llama):
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    ex, w = example(tiny_llama), loss_weights(4, 7.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = batch_loss(drafter, tiny_llama, [ex], w, 8, torch.Generator().manual_seed(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the tiny target's random LM head has rows of norm ~0.16, so logits move slowly: a clear, steady drop
    assert losses[-1] < losses[0] - 0.5 and sum(losses[-5:]) < sum(losses[:5])


def test_oracle_drafter_gets_tau_equal_to_block_size(tiny_llama):
    """A drafter that outputs the target's own argmax accepts every block fully: tau = B."""
    b = 4
    drafter = init_drafter(tiny_llama, block_size=b)
    ex = example(tiny_llama)
    _, greedy = target_pass(tiny_llama, torch.tensor([ex["input_ids"]]), drafter.config.target_layer_ids)
    vocab = tiny_llama.vocab_size

    def states(tokens):
        """2-d "states" whose argmax through the head below is `tokens`: (t, 1) . (v, -v^2/2) = t v - v^2/2
        peaks at v = t (in fp64; a [V, V] identity head would be 49,152^2 floats)."""
        return torch.stack([tokens.double(), torch.ones_like(tokens, dtype=torch.float64)], dim=-1)

    def oracle(block_ids, context, q_pos, k_pos, mask, target_hidden=None, head=True):
        return states(greedy.gather(1, (q_pos - 1).clamp_min(0)))  # position p predicts the target's argmax at p-1

    # the acceptance estimate reads the drafter's states through its LM head
    v = torch.arange(vocab, dtype=torch.float64)
    drafter.head_weight = lambda: torch.stack([v, -v * v / 2], dim=-1)
    drafter.forward = oracle
    result = estimate_acceptance(drafter, tiny_llama, [ex], anchors_per_seq=8)
    assert result["tau"] == b and result["accept_rate_by_position"] == [1.0] * (b - 1)
    drafter.forward = lambda *a, **k: states(torch.randint(vocab, a[2].shape))  # random drafter
    assert estimate_acceptance(drafter, tiny_llama, [ex], anchors_per_seq=8)["tau"] < 1.2


def test_bad_drafter_input(tiny_llama, tiny_qwen, tmp_path):
    with pytest.raises(QdflashError, match="target_layer_ids"):
        init_drafter(tiny_llama, target_layer_ids=[1, 6])
    with pytest.raises(QdflashError, match="block_size=1"):
        init_drafter(tiny_llama, block_size=1)
    save_drafter(init_drafter(tiny_llama, block_size=4), tmp_path / "d")
    with pytest.raises(QdflashError, match="layers|hidden size"):
        load_drafter(tmp_path / "d", tiny_qwen)  # another target
    with pytest.raises(QdflashError, match="not a drafter checkpoint"):
        load_drafter(tmp_path, tiny_llama)


def test_round_cost_terms(tiny_llama):
    from qdflash.drafter.cost import drafter_round_flops, target_token_flops

    c = init_drafter(tiny_llama, block_size=4).config
    f = drafter_round_flops(c, context_len=100, new_tokens=2)
    assert f["lm_head"] == 2 * 4 * c.hidden_size * c.vocab_size
    assert f["total"] == f["fc"] + f["layers"] + f["lm_head"]
    assert drafter_round_flops(c, context_len=200, new_tokens=2)["layers"] > f["layers"]  # attention grows with context
    assert target_token_flops(tiny_llama.model) > 2 * c.hidden_size * c.vocab_size  # at least the LM head


@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
def test_chunked_head_loss_equals_the_loss_over_whole_logits(chunk_rows):
    """The LM head + cross-entropy a chunk of trained rows at a time gives the loss over the whole
    [n, B, V] logits, its weight and its gradient (IGNORE rows and the anchor position included)."""
    g = torch.Generator().manual_seed(0)
    n, b, h, v = 7, 4, 16, 50
    hidden = torch.randn(n, b, h, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n, b), generator=g)
    targets[:, 0] = IGNORE
    targets[2] = IGNORE  # a padding anchor
    targets[4, 3] = IGNORE  # past the sequence's end
    weights = loss_weights(b, 7.0).double()
    total, weight = weighted_linear_block_loss_parts(hidden, head, targets, weights, chunk_rows)
    (total / weight).backward()
    grad, hidden.grad = hidden.grad, None
    want_total, want_weight = weighted_block_loss_parts(torch.nn.functional.linear(hidden, head), targets, weights)
    (want_total / want_weight).backward()
    torch.testing.assert_close(total.double(), want_total)
    torch.testing.assert_close(weight.double(), want_weight)
    torch.testing.assert_close(grad, hidden.grad)
    assert grad[2].abs().max() == 0 and grad[:, 0].abs().max() == 0  # untrained rows get no gradient
    assert torch.equal(linear_argmax(hidden, head, chunk_rows), torch.nn.functional.linear(hidden, head).argmax(-1))
    assert torch.equal(linear_argmax(hidden, head, chunk_rows, top2=True),
                       torch.nn.functional.linear(hidden, head).topk(2, dim=-1).indices)


def test_chunked_head_loss_in_bf16_follows_fp64():
    """With a bf16 head (the GPU case), loss and gradient stay what fp64 gives, to bf16 accuracy."""
    g = torch.Generator().manual_seed(1)
    n, b, h, v = 16, 4, 32, 300
    hidden = torch.randn(n, b, h, generator=g, dtype=torch.float64)
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n, b), generator=g)
    targets[:, 0] = IGNORE
    weights = loss_weights(b, 7.0).double()
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        x = hidden.clone().requires_grad_(True)
        total, weight = weighted_linear_block_loss_parts(x, head.to(dtype), targets, weights, chunk_rows=7)
        (total / weight).backward()
        results.append((total.double() / weight.double(), x.grad))
    (exact, grad64), (approx, grad16) = results
    assert abs(approx.item() - exact.item()) < 0.02 * exact.item()
    cosine = torch.nn.functional.cosine_similarity(grad64.flatten(), grad16.double().flatten(), dim=0)
    assert cosine > 0.999, cosine


def test_chunked_head_loss_in_bf16_keeps_confident_rows_gradient():
    """A bf16 head writes its chunk softmax in bf16, where a p_t near 1 is held only to 2^-8: the
    target's gradient 1 - p_t and a confident row's loss come from the other tokens' probabilities
    instead, so confident rows keep their pull (per-row gradient within a few % of fp64, where
    p_t - 1 read from bf16 gave errors up to ~100%), and so does the loss."""
    g = torch.Generator().manual_seed(5)
    n, b, h, v = 64, 2, 32, 400
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n, b), generator=g)
    targets[:, 0] = IGNORE
    # hidden states aligned with their target's row of the head: p_t from ~0.9 to ~0.9999
    hidden = (head[targets[:, 1]] * torch.linspace(0.4, 0.9, n, dtype=torch.float64)[:, None])[:, None, :].repeat(1, b, 1)
    weights = loss_weights(b, 7.0).double()
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        x = hidden.clone().requires_grad_(True)
        total, weight = weighted_linear_block_loss_parts(x, head.to(dtype), targets, weights, chunk_rows=16)
        (total / weight).backward()
        results[dtype] = (total.double().item(), x.grad[:, 1].double())
    p_t = torch.softmax(hidden[:, 1] @ head.T, -1).gather(1, targets[:, 1:]).flatten()
    assert p_t.min() > 0.5 and p_t.max() > 0.999
    (exact, grad64), (approx, grad16) = results[torch.float64], results[torch.bfloat16]
    row_error = (grad16 - grad64).norm(dim=1) / grad64.norm(dim=1)
    assert row_error.max() < 0.1, row_error.max()
    assert abs(approx - exact) < 0.05 * exact


def test_batch_loss_equals_the_loss_of_the_drafters_logits(tiny_llama):
    """batch_loss (states -> chunked head loss) is the weighted loss of the drafter's own logits, with
    the same gradient in every drafter weight."""
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    batch = [example(tiny_llama, 30, seed=3, id="a"), example(tiny_llama, 45, seed=4, id="b")]
    w = loss_weights(4, 7.0)
    loss = batch_loss(drafter, tiny_llama, batch, w, 6, torch.Generator().manual_seed(0))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters()}
    drafter.zero_grad()
    from qdflash.drafter.train import batch_anchors, padded_batch

    anchors = batch_anchors(batch, 6, torch.Generator().manual_seed(0))
    input_ids, masks, anchor_t, valid = padded_batch(batch, anchors)
    features = target_pass(tiny_llama, input_ids, drafter.config.target_layer_ids)[0]
    logits, targets = draft_blocks(drafter, features, input_ids, masks, anchor_t, valid)
    total, weight = weighted_block_loss_parts(logits.flatten(0, 1), targets.flatten(0, 1), w)
    want = total / weight
    want.backward()
    torch.testing.assert_close(loss, want)
    for k, p in drafter.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=k)


def test_attention_in_bf16_changes_only_the_attentions_rounding(tiny_llama):
    """drafter_train.attention_bf16: the same loss and gradients up to bf16's rounding of the attention (its
    output is fp32 again, so the weights and their gradients stay fp32); off again, exactly the fp32 step."""
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2)
    batch = [example(tiny_llama, 30, seed=3, id="a"), example(tiny_llama, 45, seed=4, id="b")]
    w = loss_weights(4, 7.0)

    def loss_and_grads():
        drafter.zero_grad()
        loss = batch_loss(drafter, tiny_llama, batch, w, 6, torch.Generator().manual_seed(0))
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()}

    fp32_loss, fp32_grads = loss_and_grads()
    drafter.set_attention_dtype(torch.bfloat16)
    bf16_loss, bf16_grads = loss_and_grads()
    assert bf16_loss.dtype == torch.float32 and bf16_loss != fp32_loss  # it did run in bf16
    torch.testing.assert_close(bf16_loss, fp32_loss, rtol=2e-2, atol=0)
    for k, g in fp32_grads.items():
        assert bf16_grads[k].dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(bf16_grads[k].flatten(), g.flatten(), dim=0)
        assert cosine > 0.99, (k, float(cosine))
    drafter.set_attention_dtype(None)
    again, grads = loss_and_grads()
    assert again == fp32_loss and all(torch.equal(grads[k], g) for k, g in fp32_grads.items())


@pytest.mark.parametrize("mode", [True, "memory", "device"])
def test_feature_cache_returns_what_the_target_computes(tiny_llama, tmp_path, mode):
    """Misses of a batch are computed in one right-padded forward, hits read back; the loss equals the
    uncached one, and a sequence whose tokens changed (same id) is not served stale features. On disk
    (cache_features: true), in RAM (memory) or in the training device's memory (device; here the CPU),
    which write no file."""
    from qdflash.drafter.train import feature_cache_folder, feature_key, make_feature_cache

    drafter = init_drafter(tiny_llama, block_size=4)
    layer_ids = drafter.config.target_layer_ids
    short, long = example(tiny_llama, 20, seed=1, id="short"), example(tiny_llama, 40, seed=2, id="long")
    folder = feature_cache_folder(tmp_path / "stage1", "tiny", "float32", layer_ids)
    cache = make_feature_cache(mode, folder, "cpu")
    assert make_feature_cache(False, folder) is None
    with pytest.raises(QdflashError, match="cache_features='disk'"):
        make_feature_cache("disk", folder)
    with pytest.raises(QdflashError, match="cache_features='device': no training device"):
        make_feature_cache("device", folder)
    alone = [target_pass(tiny_llama, torch.tensor([ex["input_ids"]]), layer_ids)[0][0] for ex in (short, long)]
    w, g = loss_weights(4, 7.0), torch.Generator
    cached = batch_loss(drafter, tiny_llama, [short, long], w, 6, g().manual_seed(0), cache)
    assert (cache.hits, cache.misses) == (0, 2)
    again = cache.get_batch([feature_key(short), feature_key(long)], lambda missing: pytest.fail("recomputed"))
    for got, want in zip(again, alone):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    direct = batch_loss(drafter, tiny_llama, [short, long], w, 6, g().manual_seed(0))
    torch.testing.assert_close(cached, direct)
    changed = dict(short, input_ids=list(reversed(short["input_ids"])))
    assert feature_key(changed) != feature_key(short)
    assert feature_cache_folder("o", "a", "float32", [1]) != feature_cache_folder("o", "b", "float32", [1])
    assert folder.is_dir() == (mode is True) and (cache.folder is None) == (mode != True)  # noqa: E712
    if mode == "device":
        assert all(v.device == torch.device("cpu") for v in cache.store.values())


def test_a_planted_pickle_payload_in_the_feature_cache_does_not_run(tmp_path):
    import os

    from qdflash.drafter.train import FeatureCache

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'payload-ran'}",))

    cache = FeatureCache(tmp_path / "cache")
    torch.save(Payload(), tmp_path / "cache" / "seq-0.pt")
    with pytest.raises(QdflashError, match=r"seq-0\.pt: not a cached feature tensor"):
        cache.get_batch(["seq-0"], lambda missing: pytest.fail("a planted file is not a miss"))
    assert not (tmp_path / "payload-ran").exists()
    torch.save({"not": "a tensor"}, tmp_path / "cache" / "seq-1.pt")  # plain data, but not what the cache holds
    with pytest.raises(QdflashError, match=r"seq-1\.pt: holds a dict"):
        cache.get_batch(["seq-1"], lambda missing: pytest.fail("a planted file is not a miss"))


def test_a_padded_batch_drafts_exactly_what_each_sequence_drafts_alone(tiny_qwen):
    """Right padding, padding anchors and batching change no block's logits (hybrid target too)."""
    drafter = init_drafter(tiny_qwen, block_size=4, num_layers=2).eval()
    examples = [example(tiny_qwen, 40, seed=0), example(tiny_qwen, 25, 5, seed=1), example(tiny_qwen, 33, 20, seed=2)]
    anchor_lists = [sample_anchors(torch.tensor(ex["loss_mask"]), n, torch.Generator().manual_seed(0))
                    for ex, n in zip(examples, (6, 3, 5))]
    input_ids = pad_right([torch.tensor(ex["input_ids"]) for ex in examples], 0, 48)
    masks = pad_right([torch.tensor(ex["loss_mask"]) for ex in examples], 0, 48)
    features, _ = target_pass(tiny_qwen, input_ids, drafter.config.target_layer_ids)
    anchors, valid = pad_anchors(anchor_lists, 8)
    with torch.no_grad():
        batched, targets = draft_blocks(drafter, features, input_ids, masks, anchors, valid)
        for i, (ex, a) in enumerate(zip(examples, anchor_lists)):
            ids = torch.tensor([ex["input_ids"]])
            alone_features, _ = target_pass(tiny_qwen, ids, drafter.config.target_layer_ids)
            alone, alone_targets = draft_blocks(drafter, alone_features, ids, torch.tensor([ex["loss_mask"]]), a[None])
            torch.testing.assert_close(batched[i, : a.numel()], alone[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(targets[i, : a.numel()], alone_targets[0])
            assert (targets[i, a.numel():] == IGNORE).all()  # padding anchors carry no loss


def test_flex_attention_path_equals_the_sdpa_mask(tiny_llama):
    """The block-sparse flex_attention mask (the GPU path) computes what the dense SDPA mask does."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2).eval()
    examples = [example(tiny_llama, 40, seed=0), example(tiny_llama, 30, 8, seed=3)]
    input_ids = pad_right([torch.tensor(ex["input_ids"]) for ex in examples], 0)
    masks = pad_right([torch.tensor(ex["loss_mask"]) for ex in examples], 0)
    anchors, valid = pad_anchors([sample_anchors(masks[i], 5, torch.Generator().manual_seed(i)) for i in range(2)])
    features, _ = target_pass(tiny_llama, input_ids, drafter.config.target_layer_ids)
    with torch.no_grad():
        dense, _ = draft_blocks(drafter, features, input_ids, masks, anchors, valid, attention="sdpa")
        flex, _ = draft_blocks(drafter, features, input_ids, masks, anchors, valid, attention="flex")
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


def test_acceptance_does_not_depend_on_batching(tiny_llama):
    drafter = init_drafter(tiny_llama, block_size=4)
    examples = [example(tiny_llama, 30 + 5 * i, seed=i, id=f"e{i}") for i in range(5)]
    one = estimate_acceptance(drafter, tiny_llama, examples, anchors_per_seq=6, batch_size=1)
    three = estimate_acceptance(drafter, tiny_llama, examples, anchors_per_seq=6, batch_size=3, length_multiple=16)
    assert one["blocks"] == three["blocks"] and one["tau"] == pytest.approx(three["tau"])
    # tau by where each block starts in its answer: the buckets hold every block, and their blocks' tau is tau
    assert one["answer_offset_bounds"] == [0, 32, 128] and sum(one["blocks_by_answer_offset"]) == one["blocks"]
    assert one["blocks_by_answer_offset"] == three["blocks_by_answer_offset"]
    parts = [(t, n) for t, n in zip(one["tau_by_answer_offset"], one["blocks_by_answer_offset"]) if n]
    assert sum(t * n for t, n in parts) / one["blocks"] == pytest.approx(one["tau"])
    assert all((t == 0) == (n == 0) for t, n in zip(one["tau_by_answer_offset"], one["blocks_by_answer_offset"]))
    assert 0 in one["blocks_by_answer_offset"]  # these short answers leave the 128+ bucket empty: 0, not null
    from qdflash.tracking import check_metric_value

    for key in ("tau_by_answer_offset", "blocks_by_answer_offset", "answer_offset_bounds"):
        check_metric_value(key, one[key])  # what metrics.json takes


def test_answer_offsets_count_from_each_answers_first_token():
    """A block anchored at a drafts a+1..: its offset is how many tokens of that answer precede a+1; each
    turn of a multi-turn sequence (each run of trained tokens) counts from its own first token."""
    from qdflash.drafter.blocks import answer_offsets

    mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1])
    anchors = torch.tensor([0, 3, 4, 6, 9, 10, 11])
    assert answer_offsets(mask, anchors).tolist() == [1, 0, 1, 3, 0, 1, 2]


# -- compression ------------------------------------------------------------------------------------
def test_calibration_captures_every_drafter_linear(tiny_llama):
    from qdflash.drafter.compress import calibration_hessians, drafter_linears

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=0)
    examples = [{"id": str(i), "input_ids": list(range(10 + i, 40 + i)), "loss_mask": [0] * 10 + [1] * 20} for i in range(3)]
    names = drafter_linears(drafter)
    assert names[0] == "fc" and len(names) == 1 + 7 * 2
    hessians, blocks = calibration_hessians(drafter, tiny_llama, examples, anchors_per_seq=5)
    assert blocks == 15 and set(hessians) == set(names)
    h = tiny_llama.hidden_size
    assert hessians["fc"].shape == (len(drafter.config.target_layer_ids) * h,) * 2
    for name, hess in hessians.items():
        eig = torch.linalg.eigvalsh(hess)
        assert torch.allclose(hess, hess.T) and eig.min() > -1e-6 * eig.max(), name  # PSD up to fp32 rounding
        assert hess.diagonal().sum() > 0, f"{name} saw no input"
    # the target's features in padded batches of examples of different lengths: the same Hessians (no padding
    # position or padding anchor adds to them)
    examples[1] = {"id": "1", "input_ids": list(range(11, 25)), "loss_mask": [0] * 10 + [1] * 4}  # shorter, < 5 anchors
    one, n_one = calibration_hessians(drafter, tiny_llama, examples, anchors_per_seq=5)
    batched, n_batched = calibration_hessians(drafter, tiny_llama, examples, anchors_per_seq=5, batch_size=3)
    assert n_batched == n_one < 15
    for name in names:
        torch.testing.assert_close(batched[name], one[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_compressed_drafter_saves_loads_and_drafts_the_same(tiny_llama, tmp_path, method):
    from qdflash.drafter import load_drafter, save_drafter
    from qdflash.drafter.compress import calibration_hessians, compress_drafter, weight_bytes
    from qdflash.quant.grid import GridSpec
    from qdflash.quant.quantlinear import QuantLinear

    drafter = init_drafter(tiny_llama, block_size=4, seed=1)
    dense_bytes = weight_bytes(drafter)
    examples = [{"id": "a", "input_ids": list(range(20, 60)), "loss_mask": [0] * 10 + [1] * 30}]
    hessians = calibration_hessians(drafter, tiny_llama, examples, 8)[0] if method == "gptq" else None
    compress_drafter(drafter, GridSpec(4, 32, True), method, hessians)
    assert all(isinstance(drafter.get_submodule(n), QuantLinear) for n in ["fc", "layers.0.q_proj", "layers.0.down_proj"])
    assert weight_bytes(drafter) < dense_bytes / 3
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", tiny_llama)
    for name, m in drafter.named_modules():
        if isinstance(m, QuantLinear):
            other = loaded.get_submodule(name)
            assert torch.equal(m.weight_int, other.weight_int) and torch.equal(m.weight_scale, other.weight_scale), name
    ids, feats = torch.tensor([[5, drafter.mask_id, drafter.mask_id, drafter.mask_id]]), torch.randn(1, 6, drafter.fc.in_features)
    pos = torch.arange(6)[None]
    q_pos = torch.arange(6, 10)[None]

    def block_logits(d):
        ctx = d.context_features(feats)
        kv = [layer.context_kv(ctx, pos) for layer in d.layers]
        return d.forward_block(ids, q_pos, [k for k, _ in kv], [v for _, v in kv], pos)

    with torch.no_grad():
        torch.testing.assert_close(block_logits(loaded), block_logits(drafter))


def test_draft_agreement_sees_what_compression_changes(tiny_llama):
    import copy

    from qdflash.drafter.compress import compress_drafter, draft_agreement
    from qdflash.quant.grid import GridSpec

    drafter = init_drafter(tiny_llama, block_size=4, seed=2)
    examples = [{"id": "a", "input_ids": list(range(30, 80)), "loss_mask": [0] * 10 + [1] * 40}]
    assert draft_agreement(drafter, copy.deepcopy(drafter), tiny_llama, examples, 8) == 1.0
    two_bit = compress_drafter(copy.deepcopy(drafter), GridSpec(2, 32, True), "rtn")
    assert draft_agreement(drafter, two_bit, tiny_llama, examples, 8) < 1.0
    # in batches (right-padded, padding anchors left out) the same blocks are compared: the same fraction
    examples += [{"id": "b", "input_ids": list(range(100, 110)), "loss_mask": [0] * 5 + [1] * 5},  # < 8 anchors
                 {"id": "c", "input_ids": list(range(200, 237)), "loss_mask": [0] * 7 + [1] * 30}]
    four_bit = compress_drafter(copy.deepcopy(drafter), GridSpec(4, 32, True), "rtn")
    alone = draft_agreement(drafter, four_bit, tiny_llama, examples, 8)
    assert 0.0 < alone < 1.0
    assert draft_agreement(drafter, four_bit, tiny_llama, examples, 8, batch_size=3) == alone


def test_compressed_checkpoint_that_does_not_match_says_so(tiny_llama, tmp_path):
    import json

    from qdflash.drafter import load_drafter, save_drafter
    from qdflash.drafter.compress import compress_drafter
    from qdflash.errors import QdflashError
    from qdflash.quant.grid import GridSpec

    drafter = compress_drafter(init_drafter(tiny_llama, block_size=4), GridSpec(4, 32, True), "rtn")
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["quantization"]["layers"].append("layers.0.not_a_layer")
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(QdflashError, match="not_a_layer"):
        load_drafter(tmp_path / "d", tiny_llama)
    with pytest.raises(QdflashError, match="group_size=128 does not divide"):
        compress_drafter(init_drafter(tiny_llama, block_size=4), GridSpec(4, 128, True), "rtn")


def test_a_max_length_that_cuts_off_every_answer_is_an_error(tmp_path):
    """drafter_train.max_length: 8 passed the schema and trained nothing (empty loss curve, tau 1.0,
    exit 0): every sequence was cut inside its prompt."""
    from qdflash.data.jsonl import write_jsonl
    from qdflash.stages.train_drafter import training_examples

    write_jsonl(tmp_path / "train.tokens.jsonl", ({"id": f"t{i}", "input_ids": list(range(40)), "loss_mask": [0] * 30 + [1] * 10}
                                                  for i in range(3)))
    with pytest.raises(QdflashError, match=r"drafter_train.max_length=8 leaves no trained .* earliest answer starts at token 30"):
        training_examples(tmp_path, 8, None)
    assert [len(ex["input_ids"]) for ex in training_examples(tmp_path, 36, None)] == [36] * 3


def test_stage2_epochs_set_only_stage_2s_steps():
    from omegaconf import OmegaConf

    from qdflash.stages.train_drafter import training_steps

    cfg = OmegaConf.create({"steps": 5, "batch_size": 16, "epochs": 6, "stage2_epochs": 4})
    assert training_steps(cfg, 100, stage=1) == 38   # ceil(6 * 100 / 16)
    assert training_steps(cfg, 100, stage=2) == 25   # ceil(4 * 100 / 16)
    cfg.stage2_epochs = None
    assert training_steps(cfg, 100, stage=2) == 38   # unset: stage 2 takes `epochs`
    cfg.epochs = None
    assert training_steps(cfg, 100, stage=2) == 5    # neither: `steps`


def test_epoch_ends_mark_each_pass_over_the_data():
    from qdflash.stages.train_drafter import epoch_ends

    assert epoch_ends(10, 32, 16) == [2, 4, 6, 8, 10]
    assert epoch_ends(7, 32, 16) == [2, 4, 6, 7]      # a fractional last epoch ends at the last step
    assert epoch_ends(3, 100, 16) == [3]              # less than one epoch: the final evaluation only
    assert epoch_ends(12, 30, 8) == [4, 8, 12]        # 3.75 steps per epoch


def test_the_batch_mask_is_each_sequences_mask():
    """The batch mask, built in a few tensor ops on the anchors' device, is the per-sequence mask of
    every row (the rule `test_mask_blocks_see_only_their_prefix_and_themselves` checks)."""
    from qdflash.drafter.blocks import batch_attention_mask

    anchors = torch.tensor([[3, 7, 8], [1, 2, 11], [5, 5, 5]])
    mask = batch_attention_mask(anchors, 4, 13)
    assert mask.shape == (3, 12, 13 + 12) and mask.dtype == torch.bool
    for row, a in zip(mask, anchors):
        assert torch.equal(row, block_attention_mask(a, 4, 13))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen", "tiny_qwen2"])
def test_features_without_the_lm_head_are_the_full_forwards(fixture, request):
    target = request.getfixturevalue(fixture)
    ids = torch.randint(5, 1000, (2, 23), generator=torch.Generator().manual_seed(1))
    layer_ids = default_layer_ids(target.config.num_hidden_layers)
    with_head, greedy = target_pass(target, ids, layer_ids, chunk_rows=5)  # the head a few rows at a time
    features, none = target_pass(target, ids, layer_ids, greedy=False)
    assert none is None and greedy.shape == (2, 23)
    assert torch.equal(features, with_head)
    assert torch.equal(greedy, target.model(input_ids=ids).logits.argmax(-1))  # the whole forward's argmax


def test_target_labels_train_each_block_position_on_the_targets_greedy_token(tiny_llama):
    """labels=target: block position k of anchor a learns the target's argmax at a+k-1 (what greedy
    verification accepts there), not the data token; the loss is the drafter's weighted loss on those."""
    from qdflash.drafter.train import batch_anchors, padded_batch, target_labels

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    batch = [example(tiny_llama, 30, seed=3, id="a"), example(tiny_llama, 45, seed=4, id="b")]
    w = loss_weights(4, 7.0)
    loss = batch_loss(drafter, tiny_llama, batch, w, 6, torch.Generator().manual_seed(0), labels="target")
    anchors = batch_anchors(batch, 6, torch.Generator().manual_seed(0))
    input_ids, masks, anchor_t, valid = padded_batch(batch, anchors)
    features, greedy = target_pass(tiny_llama, input_ids, drafter.config.target_layer_ids)
    labels = target_labels(input_ids, greedy)
    logits, targets = draft_blocks(drafter, features, input_ids, masks, anchor_t, valid, label_ids=labels)
    total, weight = weighted_block_loss_parts(logits.flatten(0, 1), targets.flatten(0, 1), w)
    torch.testing.assert_close(loss, total / weight)
    trained = 0
    for i in range(len(batch)):
        for j, a in enumerate(anchor_t[i].tolist()):
            for k in range(1, 4):
                if valid[i, j] and targets[i, j, k] != IGNORE:
                    assert targets[i, j, k] == greedy[i, a + k - 1]
                    trained += 1
    assert trained > 0
    _, data_targets = draft_blocks(drafter, features, input_ids, masks, anchor_t, valid)
    assert not torch.equal(targets, data_targets)  # random data: the target's tokens differ from it
    assert not torch.isclose(loss, batch_loss(drafter, tiny_llama, batch, w, 6, torch.Generator().manual_seed(0)))
    with pytest.raises(QdflashError, match="labels='teacher'"):
        batch_loss(drafter, tiny_llama, batch, w, 6, torch.Generator().manual_seed(0), labels="teacher")


def test_target_labels_come_from_the_feature_cache_too(tiny_llama, tmp_path):
    """With the cache, the target's tokens are kept beside the features: the loss equals the uncached
    one, the next epoch runs no target forward, and features cached by a data-label run get their
    tokens with one more forward."""
    from qdflash.drafter.train import FeatureCache

    drafter = init_drafter(tiny_llama, block_size=4)
    batch = [example(tiny_llama, 20, seed=1, id="short"), example(tiny_llama, 40, seed=2, id="long")]
    w, g = loss_weights(4, 7.0), torch.Generator
    direct = batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), labels="target")
    cache = FeatureCache(tmp_path / "cache")
    batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache)  # data labels: features only
    torch.testing.assert_close(batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache, labels="target"), direct)

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran although everything was cached")

    real = tiny_llama.model.get_decoder
    tiny_llama.model.get_decoder = no_forward
    try:
        again = batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache, labels="target")
    finally:
        tiny_llama.model.get_decoder = real
    torch.testing.assert_close(again, direct)


@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
def test_chunked_soft_loss_is_the_weighted_kl_to_the_teacher_with_its_gradient(chunk_rows):
    """labels=soft: per trained row KL(softmax(teacher @ W) || softmax(hidden @ W)), position-weighted,
    the same value and gradient as autograd over the whole logits; 0 where the draft is the teacher."""
    g = torch.Generator().manual_seed(2)
    n, b, h, v = 7, 4, 16, 50
    hidden = torch.randn(n, b, h, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(n, b, h, generator=g, dtype=torch.float64)
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n, b), generator=g)
    targets[:, 0] = IGNORE
    targets[2] = IGNORE
    weights = loss_weights(b, 7.0).double()
    total, weight = weighted_linear_block_loss_parts(hidden, head, targets, weights, chunk_rows, teacher=teacher)
    (total / weight).backward()
    log_q = torch.log_softmax(torch.nn.functional.linear(hidden, head), -1)
    log_p = torch.log_softmax(torch.nn.functional.linear(teacher, head), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [n, b]
    w = weights[None, :] * (targets != IGNORE)
    grad, hidden.grad = hidden.grad, None
    ((kl * w).sum() / w.sum()).backward()
    torch.testing.assert_close(total.double(), (kl * w).sum())
    torch.testing.assert_close(grad, hidden.grad)
    assert grad[2].abs().max() == 0 and grad[:, 0].abs().max() == 0
    same, _ = weighted_linear_block_loss_parts(teacher, head, targets, weights, chunk_rows, teacher=teacher)
    assert abs(same.item()) < 1e-12  # the teacher's own distribution costs nothing


def test_soft_labels_are_the_targets_distribution_at_the_predicting_position(tiny_llama, tmp_path):
    """batch_loss(labels=soft) is the weighted KL of the target's full next-token distribution (its own
    logits at a+k-1) to the drafter's logits at block position k, and the same from the feature cache
    (whose second epoch runs no target forward)."""
    from qdflash.drafter.train import FeatureCache, batch_anchors, padded_batch

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    batch = [example(tiny_llama, 30, seed=3, id="a"), example(tiny_llama, 45, seed=4, id="b")]
    w, g = loss_weights(4, 7.0), torch.Generator
    loss = batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), labels="soft")
    anchors = batch_anchors(batch, 6, g().manual_seed(0))
    input_ids, masks, anchor_t, valid = padded_batch(batch, anchors)
    features, _ = target_pass(tiny_llama, input_ids, drafter.config.target_layer_ids)
    logits, targets = draft_blocks(drafter, features, input_ids, masks, anchor_t, valid)
    with torch.no_grad():
        target_logits = tiny_llama.model(input_ids=input_ids).logits  # [n, L, V]: position t predicts t+1
    total = weight = 0.0
    for i in range(len(batch)):
        for j, a in enumerate(anchor_t[i].tolist()):
            for k in range(1, 4):
                if valid[i, j] and targets[i, j, k] != IGNORE:
                    log_p = torch.log_softmax(target_logits[i, a + k - 1].float(), -1)
                    log_q = torch.log_softmax(logits[i, j, k].float(), -1)
                    total = total + w[k] * (log_p.exp() * (log_p - log_q)).sum()
                    weight = weight + w[k]
    assert weight > 0
    torch.testing.assert_close(loss, total / weight, rtol=1e-4, atol=1e-5)
    assert not torch.isclose(loss, batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0)))  # not the data CE

    cache = FeatureCache(tmp_path / "cache")
    batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache)  # data labels: features only
    torch.testing.assert_close(batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache, labels="soft"), loss)
    assert (cache.hits, cache.misses) == (2, 2)  # the features' lookups only: the final states beside them do not count
    real = tiny_llama.model.get_decoder
    tiny_llama.model.get_decoder = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the target ran again"))
    try:
        torch.testing.assert_close(batch_loss(drafter, tiny_llama, batch, w, 6, g().manual_seed(0), cache, labels="soft"), loss)
    finally:
        tiny_llama.model.get_decoder = real


def test_length_grouped_batches_cover_each_epoch_and_hold_similar_lengths():
    import itertools

    from qdflash.stages.train_drafter import epoch_batches

    lengths = [int(x) for x in torch.randint(50, 3000, (96,), generator=torch.Generator().manual_seed(0))]
    batches = list(itertools.islice(epoch_batches(96, 8, 0, lengths, group=4), 24))  # two epochs
    for epoch in (batches[:12], batches[12:]):
        assert sorted(i for b in epoch for i in b) == list(range(96))  # every sequence once per epoch
    spread = lambda bs: sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in bs) / len(bs)
    plain = list(itertools.islice(epoch_batches(96, 8, 0), 24))
    assert spread(batches) < 0.5 * spread(plain)  # sorted runs: far less padding to each batch's longest
    assert batches[:12] != sorted(batches[:12], key=lambda b: lengths[b[0]])  # batch order still random
    # off (the default): the original stream of batches, unchanged
    assert plain == list(itertools.islice(epoch_batches(96, 8, 0, lengths, group=0), 24))


@pytest.mark.parametrize("compressed", [False, True])
def test_a_drafter_loaded_in_another_dtype_drafts_there_and_stays_lossless(tiny_llama, tmp_path, compressed):
    """load_drafter(dtype=bf16) against an fp32 target (the benchmark's bench.drafter_dtype=target in bf16 runs):
    every floating weight in bf16, the ints of a compressed drafter untouched, and speculative decoding
    still emits exactly the target's greedy tokens, because drafts only propose."""
    from qdflash.drafter.compress import compress_drafter
    from qdflash.quant.grid import GridSpec
    from qdflash.quant.quantlinear import QuantLinear
    from qdflash.spec import autoregressive_generate, speculative_generate

    drafter = init_drafter(tiny_llama, block_size=4, seed=2)
    if compressed:
        compress_drafter(drafter, GridSpec(4, 32, True), "rtn", None)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", tiny_llama, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    if compressed:
        layer = loaded.get_submodule("layers.0.q_proj")
        assert isinstance(layer, QuantLinear) and layer.weight_int.dtype == torch.int8
        assert torch.equal(layer.weight_int, drafter.get_submodule("layers.0.q_proj").weight_int)
    assert load_drafter(tmp_path / "d", tiny_llama).norm.weight.dtype == torch.float32  # as saved by default
    ids = torch.randint(10, 900, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = autoregressive_generate(tiny_llama, [ids], 24)
    spec = speculative_generate(tiny_llama, loaded, [ids], 24)
    assert spec.tokens == ar.tokens and len(spec.acceptance_lengths) > 0


def test_the_served_draft_is_the_training_forward_at_every_block_position(tiny_llama):
    # the H200 runs accept late drafts less often than the teacher-forced tau-hat predicts (the fifth: 0.34 against
    # 0.59, results/published/2026-12-04-h200-qwen-block9); the loop's incremental path must not be a cause of it
    from qdflash.spec import DrafterSession

    torch.manual_seed(0)
    drafter = init_drafter(tiny_llama, block_size=9).eval()
    for p in drafter.parameters():  # far from the zero-ish start, so that every position's logits differ
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, tiny_llama.vocab_size - 1, (1, 60))
    features = tiny_llama.hidden_states(ids, drafter.config.target_layer_ids)
    b, anchor = drafter.block_size, 37
    block = torch.full((1, b), drafter.mask_id)
    block[0, 0] = ids[0, anchor]
    q_pos = torch.arange(anchor, anchor + b)[None]
    k_pos = torch.cat([torch.arange(anchor)[None], q_pos], 1)
    with torch.no_grad():
        trained = drafter(block, None, q_pos, k_pos, block_attention_mask(torch.tensor([anchor]), b, anchor)[None],
                          target_hidden=features[:, :anchor])[0]
    session = DrafterSession(drafter)
    session.append(features[0, :20], 0)  # as rounds append what they accepted
    session.append(features[0, 20:anchor], 20)
    served = session.draft_logits(int(ids[0, anchor]), anchor)[0]
    assert trained.shape == served.shape == (b, tiny_llama.vocab_size)
    assert trained[1:].argmax(-1).unique().numel() > 1
    torch.testing.assert_close(served, trained, atol=1e-5, rtol=1e-5)


def test_the_walked_rounds_are_the_rounds_speculative_decoding_runs(tiny_llama):
    # walk_acceptance reads decoding's rounds off teacher-forced blocks: on the target's own greedy answer, with a
    # drafter that is right or wrong by (anchor, block position), the rounds it walks are exactly the ones
    # speculative_generate commits (whole-block verifies), up to where a whole block still fits
    from qdflash.drafter.train import walk_acceptance
    from qdflash.spec import autoregressive_generate, speculative_generate

    b, prompt = 4, list(range(5, 15))
    answer = autoregressive_generate(tiny_llama, [prompt], 60).tokens
    seq = torch.tensor(prompt + answer)
    ex = {"id": "x", "input_ids": seq.tolist(), "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    drafter = init_drafter(tiny_llama, block_size=b)
    vocab = tiny_llama.vocab_size

    def drafts(q_pos):  # [.., B] positions -> the token there, wrong where (anchor, k) says so
        anchor, k = q_pos[..., :1], q_pos - q_pos[..., :1]
        right = seq[q_pos.clamp(max=len(seq) - 1)]
        return torch.where((anchor * 7 + k * 3) % 5 == 0, (right + 1) % vocab, right)

    def states(tokens):  # argmax through the head below is `tokens` (test_oracle_drafter_gets_tau_equal_to_block_size)
        return torch.stack([tokens.double(), torch.ones_like(tokens, dtype=torch.float64)], dim=-1)

    v = torch.arange(vocab, dtype=torch.float64)
    drafter.head_weight = lambda: torch.stack([v, -v * v / 2], dim=-1)
    drafter.forward = lambda block_ids, context, q_pos, *a, **k: states(drafts(q_pos.reshape(q_pos.shape[0], -1, b)).reshape(q_pos.shape))
    drafter.forward_block = lambda block_ids, q_pos, *a, **k: torch.nn.functional.one_hot(drafts(q_pos), vocab).float()

    got = walk_acceptance(drafter, tiny_llama, [ex], max_tokens=40)
    decoded = speculative_generate(tiny_llama, drafter, [prompt], len(answer))
    assert decoded.tokens == answer
    rounds, offset = [], 0  # the decoded rounds whose anchor (answer offset) is within the walk's reach
    for n in decoded.acceptance_lengths:
        if offset > min(len(answer) - b, 39):
            break
        rounds.append(n)
        offset += n
    assert 1 < got["tau"] < b and len(set(rounds)) > 2  # rounds of several lengths: the walk is tested, not a constant
    assert got["rounds"] == len(rounds) and got["tau"] == pytest.approx(sum(rounds) / len(rounds))
    assert got["accept_rate_by_position"] == pytest.approx([sum(n > k for n in rounds) / len(rounds) for k in range(1, b)])


def small_vocab_target(vocab: int = 64):
    """A random llama-style target over `vocab` tokens (a head that is the identity stays small)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qdflash.models import Target

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the current token's embedding dominates, and an untied head maps it to a random next token:
        model.model.embed_tokens.weight.mul_(20)  # varied continuations, not one token repeated

    class NoTokenizer:
        eos_token_id = None

    model.generation_config.eos_token_id = None
    return Target("small-vocab", model, NoTokenizer(), "test")


@pytest.mark.parametrize("tree_nodes", [None, 6])
def test_the_walked_rounds_with_no_repeat_are_the_rounds_decoding_with_no_repeat_runs(tree_nodes):
    # the same check with decoding's no_repeat rule (blocks.distinct_drafts): a drafter whose first choice is the
    # token of the position before (a repeat) at some (anchor, position), with the right token second, and right
    # elsewhere (a junk second choice); the walk takes each block's two best from the training forward. With
    # `tree_nodes` both verify trees of the drafter's best paths (blocks.tree_acceptance against spec's tree rounds)
    from qdflash.drafter.train import walk_acceptance
    from qdflash.spec import autoregressive_generate, speculative_generate

    target = small_vocab_target()
    b, prompt = 4, [5, 9, 1, 30, 12, 7, 44, 2, 18, 60]
    answer = autoregressive_generate(target, [prompt], 60).tokens
    assert sum(x != y for x, y in zip(answer, answer[1:])) > 40  # a varied answer: confused drafts have room
    seq = torch.tensor(prompt + answer)
    ex = {"id": "x", "input_ids": seq.tolist(), "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    drafter = init_drafter(target, block_size=b)
    vocab = target.vocab_size

    def scores(q_pos):  # [.., B] positions -> [.., B, V]: 2 at the first choice, 1 at the second
        anchor, k = q_pos[..., :1], q_pos - q_pos[..., :1]
        right = seq[q_pos.clamp(max=len(seq) - 1)]
        before = seq[(q_pos - 1).clamp(max=len(seq) - 1)]
        confused = ((anchor * 7 + k * 3) % 4 == 0) & (before != right)
        first = torch.where(confused, before, right)
        second = torch.where(confused, right, (right + 1) % vocab)
        return 2 * torch.nn.functional.one_hot(first, vocab).float() + torch.nn.functional.one_hot(second, vocab).float()

    drafter.head_weight = lambda: torch.eye(vocab)  # the scores are the states: the head passes them through
    drafter.forward = lambda block_ids, context, q_pos, *a, **k: scores(q_pos.reshape(q_pos.shape[0], -1, b)).reshape(
        q_pos.shape[0], q_pos.shape[1], vocab)
    drafter.forward_block = lambda block_ids, q_pos, *a, **k: scores(q_pos)

    for no_repeat in (False, True):
        got = walk_acceptance(drafter, target, [ex], max_tokens=40, no_repeat=no_repeat, tree_nodes=tree_nodes)
        decoded = speculative_generate(target, drafter, [prompt], len(answer), no_repeat=no_repeat, tree_nodes=tree_nodes)
        assert decoded.tokens == answer
        rounds, offset = [], 0
        for n in decoded.acceptance_lengths:
            if offset > min(len(answer) - b, 39):
                break
            rounds.append(n)
            offset += n
        assert got["rounds"] == len(rounds) and got["tau"] == pytest.approx(sum(rounds) / len(rounds))
        if no_repeat and tree_nodes is None:  # the confused drafts are accepted with the rule (the answer repeats a
            assert got["tau"] > plain_tau                 # token only a few times)
        elif no_repeat:  # a tree holds the second choices anyway
            assert got["tau"] >= plain_tau
        else:
            plain_tau = got["tau"]
            assert 1 < plain_tau < b
