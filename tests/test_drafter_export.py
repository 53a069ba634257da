"""Drafter export in the DFlash format, read by z-lab's own `dflash` package (DFlashDraftModel):
same draft logits, same drafts in its own generation loop, the target's greedy tokens."""

import json

import pytest
import torch

from qdflash.drafter import init_drafter
from qdflash.drafter.compress import compress_drafter
from qdflash.drafter.export import export_dflash
from qdflash.errors import QdflashError
from qdflash.quant.grid import GridSpec
from qdflash.spec import DrafterSession, autoregressive_generate, speculative_generate
import qdflash.spec as spec

import dflash.model as dflash_model  # z-lab's package, installed with --no-deps by scripts/install.sh --test


def prompt(seed, length):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (1, length), generator=g)


def drafter_for(target, **kw):
    """An untrained drafter whose norms are not all ones, so a norm exported under the wrong name shows."""
    d = init_drafter(target, block_size=4, num_layers=2, mask_token_id=3, seed=2, **kw).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return d


def load_dflash(path):
    model, info = dflash_model.DFlashDraftModel.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def dflash_block_logits(model, target, features, last_token, position):
    """DFlashDraftModel's logits for the block [last_token, MASK..] at `position` over context features."""
    b = model.block_size
    block = torch.full((1, b), model.mask_token_id)
    block[0, 0] = last_token
    with torch.no_grad():
        hidden = model(target_hidden=features, noise_embedding=target.model.get_input_embeddings()(block),
                       position_ids=torch.arange(features.shape[1] + b)[None])
        return model.compute_logits(hidden, target.model.lm_head)[0]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("compressed", [False, True])
def test_dflash_reads_the_export_with_our_draft_logits(tiny_llama, tmp_path, window, compressed):
    drafter = drafter_for(tiny_llama)
    if compressed:
        compress_drafter(drafter, GridSpec(4, 32, True), "rtn")
    path = export_dflash(drafter, tiny_llama, tmp_path / "dflash", window=window)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": drafter.config.target_layer_ids}
    assert config["block_size"] == 4 and config["num_target_layers"] == tiny_llama.num_layers
    assert (config.get("sliding_window"), "quantization_config" in config) == (window, compressed)
    model = load_dflash(path)
    ids = prompt(0, 13)  # longer than the window: the window's mask matters
    features = tiny_llama.hidden_states(ids, drafter.config.target_layer_ids)
    ours = DrafterSession(drafter, window)
    ours.append(features[0], 0)
    for last in (42, 999):
        expected = ours.draft_logits(last, ids.shape[1])[0]
        torch.testing.assert_close(dflash_block_logits(model, tiny_llama, features, last, ids.shape[1]), expected,
                                   rtol=0, atol=1e-4)


def oracle_token(reference, prompt_len, pos):
    """The reference continuation at `pos`, wrong at scattered positions (a fixed function of the
    position, so both loops see the same drafts): rounds accept 0..B-1 drafts."""
    i = pos - prompt_len
    token = reference[i] if 0 <= i < len(reference) else 7
    return token + 1 if pos * 2654435761 % 7 < 2 else token


@pytest.mark.parametrize("window", [None, 6])
def test_dflash_generation_loop_is_lossless_and_drafts_what_we_draft(varied_llama, tmp_path, monkeypatch, window):
    """dflash's own loop (its caches, crops and context features) with the exported drafter gives the
    target's greedy tokens, and our drafter's greedy drafts in each of its rounds are the ones our
    speculative loop computes. Which drafts are *used* comes from an oracle in both loops (the
    untrained drafter would accept nothing), so rounds accept 0 to B-1 tokens and every path runs."""
    target = varied_llama
    drafter = drafter_for(target)
    model = load_dflash(export_dflash(drafter, target, tmp_path / "dflash", window=window))
    theirs, ours, block_start = [], [], []
    forward, compute_logits = model.forward, model.compute_logits

    def forward_theirs(*args, position_ids, **kwargs):
        block_start.append(int(position_ids[0, -model.block_size]))  # only full blocks are compared
        return forward(*args, position_ids=position_ids, **kwargs)

    def logits_theirs(hidden, head):
        logits = compute_logits(hidden, head)
        theirs.append(logits[0].argmax(-1).tolist())
        start = block_start[-1]
        oracle = torch.full_like(logits, -1e4)
        for j in range(logits.shape[1]):
            oracle[0, j, oracle_token(reference, ids.shape[1], start + 1 + j)] = 0
        return oracle

    def draft_ours(self, last_token, position):
        ours.append(self.draft_logits(last_token, position)[1].tolist())
        b = self.drafter.block_size
        return torch.tensor([oracle_token(reference, ids.shape[1], pos) for pos in range(position + 1, position + b)])

    model.forward, model.compute_logits = forward_theirs, logits_theirs
    monkeypatch.setattr(spec.DrafterSession, "draft", draft_ours)
    for seed in range(2):
        theirs.clear(), ours.clear()
        ids = prompt(seed, 9 + 4 * seed)
        reference = autoregressive_generate(target, ids, 20).tokens
        assert len(set(reference)) > 1  # a constant continuation would not test much
        out = dflash_model.dflash_generate(model, target.model, ids, 20, stop_token_ids=None)
        assert out[0, ids.shape[1]:].tolist() == reference
        result = speculative_generate(target, drafter, ids, 20, window=window)
        assert result.tokens == reference and len(set(result.acceptance_lengths[:-1])) > 1
        # dflash shortens its last block to what is left; compare the rounds both drafted in full
        full = len(ours) - 1
        assert theirs[:full] == ours[:full] and full > 2


def test_export_refuses_what_dflash_cannot_represent(tiny_llama, tmp_path):
    learned = init_drafter(tiny_llama, block_size=4, mask_token_id=None)
    with pytest.raises(QdflashError, match="learned mask vector"):
        export_dflash(learned, tiny_llama, tmp_path / "a")
    with pytest.raises(QdflashError, match="window=3 is smaller than block_size=4"):
        export_dflash(drafter_for(tiny_llama), tiny_llama, tmp_path / "b", window=3)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_export_command_writes_the_selected_variants_drafter(tiny_llama, tmp_path):
    """python -m qdflash.drafter.export --results: the selected row's drafter, with its window (the
    export_drafter rule's command)."""
    from qdflash.drafter import save_drafter
    from qdflash.drafter.export import main

    results = tmp_path / "results"
    tiny_llama.model.save_pretrained(results / "target" / "qad_x" / "model")
    tiny_llama.tokenizer.save_pretrained(results / "target" / "qad_x" / "model")
    drafter = drafter_for(tiny_llama)
    save_drafter(drafter, results / "drafter" / "stage2" / "drafter")
    (results / "tables").mkdir()
    (results / "tables" / "summary.csv").write_text(
        "variant,target,target_bits,drafter,drafter_bits,window,passes_gates,selected\n"
        "qad_x+stage2+win8,qad_x,4,stage2,16,8,1,1\nqad_x+stage2+winnone,qad_x,4,stage2,16,,1,0\n")
    main(["--results", str(results), "--out", str(tmp_path / "out"), "--dtype", "float32"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["sliding_window"] == 8 and config["qdflash"]["variant"] == "qad_x+stage2+win8"
    model = load_dflash(tmp_path / "out")
    assert torch.equal(model.fc.weight, drafter.fc.weight)
