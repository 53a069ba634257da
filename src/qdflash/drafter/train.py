"""Training and teacher-forced acceptance of the DFlash drafter (RECIPE.md "drafter training").

Target hidden states are computed online by a frozen target forward. All blocks of one sequence are
drafted in one drafter forward: their queries are concatenated and `blocks.block_attention_mask`
keeps every block on its own context prefix and its own tokens (an SDPA boolean mask: correct on the
CPU; a GPU path through flex_attention is future work).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch

from .blocks import IGNORE, acceptance_lengths, block_attention_mask, block_inputs, sample_anchors, weighted_block_loss
from .model import Drafter


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated hidden states of `layer_ids` [1, L, n*H] and the target's greedy next tokens [L]."""
    out = target.model(input_ids=input_ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, out.logits[0].argmax(-1)


def draft_blocks(drafter: Drafter, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, B, V] of every block (one forward for all anchors of the sequence) and targets [n, B]."""
    b = drafter.block_size
    ids, targets, positions = block_inputs(input_ids[0], loss_mask, anchors.cpu(), b, drafter.mask_id)
    device = features.device
    length = input_ids.shape[1]
    context = drafter.context_features(features.to(drafter.fc.weight.dtype))
    q_pos = positions.reshape(1, -1).to(device)
    k_pos = torch.cat([torch.arange(length), positions.reshape(-1)]).reshape(1, -1).to(device)
    mask = block_attention_mask(anchors.cpu(), b, length)[None].to(device)
    logits = drafter(ids.reshape(1, -1).to(device), context, q_pos, k_pos, mask)
    return logits.reshape(len(anchors), b, -1), targets.to(device)


class FeatureCache:
    """Target features of training sequences kept on disk (one file per sequence id, in the target's
    dtype, so a cached feature equals a recomputed one): repeated epochs skip the target forward."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def get(self, key: str, compute) -> torch.Tensor:
        path = self.folder / f"{key}.pt"
        if path.is_file():
            self.hits += 1
            return torch.load(path, map_location="cpu")
        self.misses += 1
        value = compute()
        tmp = path.with_name(path.name + ".tmp")
        torch.save(value.cpu(), tmp)
        os.replace(tmp, path)
        return value


def block_loss(drafter: Drafter, target, example: dict, weights: torch.Tensor, anchors_per_seq: int,
               generator: torch.Generator, cache: FeatureCache | None = None) -> torch.Tensor | None:
    device = next(drafter.parameters()).device
    input_ids = torch.tensor([example["input_ids"]], device=device)
    loss_mask = torch.tensor(example["loss_mask"])
    anchors = sample_anchors(loss_mask, anchors_per_seq, generator)
    if anchors.numel() == 0:
        return None
    compute = lambda: target_pass(target, input_ids, drafter.config.target_layer_ids)[0]  # noqa: E731
    features = cache.get(example["id"], compute).to(device) if cache is not None and "id" in example else compute()
    logits, targets = draft_blocks(drafter, features, input_ids, loss_mask, anchors)
    return weighted_block_loss(logits, targets, weights)


@torch.no_grad()
def estimate_acceptance(drafter: Drafter, target, examples: list[dict], *, anchors_per_seq: int = 32,
                        seed: int = 0, categories: dict[str, str] | None = None) -> dict:
    """Teacher-forced acceptance on (greedy) held-out responses.

    For each anchor whose whole block lies inside the response, the drafter's argmax at block
    positions 1..B-1 is compared with the target's argmax at the same positions (the target's logits
    at a+k-1 predict token a+k). On greedy responses this is exactly what greedy speculative
    decoding would accept at that point. Returns tau (mean acceptance length, bonus token included),
    the per-position acceptance rate, and tau per category.
    """
    b = drafter.block_size
    generator = torch.Generator().manual_seed(seed)
    device = next(drafter.parameters()).device
    lengths: list[torch.Tensor] = []
    by_category: dict[str, list[torch.Tensor]] = defaultdict(list)
    was_training = drafter.training
    drafter.eval()
    for ex in examples:
        loss_mask = torch.tensor(ex["loss_mask"])
        anchors = sample_anchors(loss_mask, anchors_per_seq, generator, full_block=b)
        if anchors.numel() == 0:
            continue
        input_ids = torch.tensor([ex["input_ids"]], device=device)
        features, greedy = target_pass(target, input_ids, drafter.config.target_layer_ids)
        logits, _ = draft_blocks(drafter, features, input_ids, loss_mask, anchors)
        draft = logits[:, 1:].argmax(-1)
        want = greedy[(anchors[:, None] + torch.arange(b - 1)[None, :]).to(device)]
        acc = acceptance_lengths(draft, want).cpu()
        lengths.append(acc)
        if categories:
            by_category[categories.get(ex["id"], "unknown")].append(acc)
    drafter.train(was_training)
    if not lengths:
        raise ValueError("no anchor with a full block inside a response: responses shorter than the block size")
    acc = torch.cat(lengths).float()
    rates = [(acc > k).float().mean().item() for k in range(1, b)]  # P(draft position k accepted)
    result = {"tau": acc.mean().item(), "blocks": int(acc.numel()), "accept_rate_by_position": rates}
    for category, parts in sorted(by_category.items()):
        result[f"tau.{category}"] = torch.cat(parts).float().mean().item()
    return result


__all__ = ["IGNORE", "FeatureCache", "block_loss", "draft_blocks", "estimate_acceptance", "target_pass"]
