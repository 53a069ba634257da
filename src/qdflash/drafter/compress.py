"""Drafter compression: every linear of a trained drafter (`fc` included) onto a W-bit integer grid,
by RTN or GPTQ (docs/recipe.md "drafter compression").

GPTQ needs the inputs each layer sees at inference. A drafter's inputs are not token ids but the
target's hidden states (through `fc`) and blocks of [anchor token, mask x (B-1)], so calibration runs
the drafter the way training and teacher-forced acceptance do: per calibration sequence, the target's
features and anchor blocks drawn in the assistant region, every linear's inputs accumulated into its
Hessian. `fc` and the context keys/values see every context position's features; the rest see the
block positions, exactly as in speculative decoding.

The result keeps the drafter's shape with `QuantLinear` layers (exact ints + scales), so it saves and
loads like any drafter (`save_drafter` / `load_drafter` record the grid) and runs packed on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..quant.apply import capture_hessians, quantize_weights, replace_linears
from ..quant.grid import GridSpec
from .blocks import linear_argmax
from .model import Drafter
from .train import anchored_examples, draft_blocks, padded_batch, target_pass


def drafter_linears(drafter: Drafter) -> list[str]:
    """Every nn.Linear of the drafter: `fc` and each layer's projections (its LM head is the target's)."""
    return [name for name, m in drafter.named_modules() if type(m) is nn.Linear]


@torch.no_grad()
def calibration_hessians(drafter: Drafter, target, examples: list[dict], anchors_per_seq: int, seed: int = 0,
                         names: list[str] | None = None, batch_size: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """Hessians (2 X^T X / n) of each linear's inputs over teacher-forced anchor blocks of `examples`
    (token examples with input_ids / loss_mask). Returns (hessians, number of blocks). The target's
    features come `batch_size` examples per forward (right padding: a causal target's features of the
    real tokens do not change); the drafter then runs each example alone, so that no padding position
    or padding anchor adds to a Hessian."""
    names = names or drafter_linears(drafter)
    device = drafter.norm.weight.device
    drawn = anchored_examples(examples, anchors_per_seq, seed)
    blocks = 0
    was_training = drafter.training
    drafter.eval()
    with capture_hessians(drafter, names) as acc, tqdm(total=len(drawn), desc="drafter calibration", unit="seq") as bar:
        for start in range(0, len(drawn), batch_size):
            chunk = drawn[start : start + batch_size]
            padded = padded_batch([ex for ex, _ in chunk], [a for _, a in chunk])[0]
            features = target_pass(target, padded.to(device), drafter.config.target_layer_ids, greedy=False)[0]
            for i, (ex, anchors) in enumerate(chunk):
                input_ids, loss_masks, anchor_rows, valid = padded_batch([ex], [anchors])
                draft_blocks(drafter, features[i : i + 1, : input_ids.shape[1]], input_ids, loss_masks, anchor_rows, valid)
                blocks += int(anchors.numel())
            bar.update(len(chunk))
    drafter.train(was_training)
    return {name: a.hessian() for name, a in acc.items()}, blocks


@torch.no_grad()
def draft_agreement(reference: Drafter, other: Drafter, target, examples: list[dict], anchors_per_seq: int,
                    seed: int = 0, batch_size: int = 1) -> float:
    """Fraction of drafted positions (1..B-1 of teacher-forced anchor blocks) where two drafters pick
    the same token: more sensitive than tau-hat, which only sees positions where the draft is right.
    Anchors are drawn per example in order, so which blocks are compared does not depend on
    `batch_size` (one target forward per batch: one per example took 18 s of the gpu DAG's
    compression node on the H200, on its critical path)."""
    device = reference.norm.weight.device
    drawn = anchored_examples(examples, anchors_per_seq, seed)
    same = total = 0
    for start in range(0, len(drawn), batch_size):
        chunk = drawn[start : start + batch_size]
        input_ids, loss_masks, anchors, valid = padded_batch([ex for ex, _ in chunk], [a for _, a in chunk])
        features = target_pass(target, input_ids.to(device), reference.config.target_layer_ids, greedy=False)[0]
        a, b = (linear_argmax(draft_blocks(d, features, input_ids, loss_masks, anchors, valid, head=False)[0][:, :, 1:],
                              d.head_weight()).cpu() for d in (reference, other))
        keep = valid[:, :, None].expand_as(a)  # the real anchors' drafted positions, not the padding anchors'
        same += int((a == b)[keep].sum())
        total += int(keep.sum())
    return same / max(total, 1)


def compress_drafter(drafter: Drafter, spec: GridSpec, method: str, hessians: dict[str, torch.Tensor] | None = None,
                     damp: float = 0.01, act_order: bool = False, scale_dtype: torch.dtype = torch.bfloat16) -> Drafter:
    """Replace every linear of `drafter` (in place) by its quantized QuantLinear; returns it."""
    names = drafter_linears(drafter)
    weights = quantize_weights(drafter, names, spec, method=method, hessians=hessians, damp=damp,
                               act_order=act_order, scale_dtype=scale_dtype)
    replace_linears(drafter, weights)
    return drafter


def weight_bytes(drafter: Drafter) -> int:
    """Bytes of the drafter's own weights as stored for inference: 16-bit for dense parameters, packed
    ints plus scales for quantized linears (what a GPU reads per drafting step, LM head excluded)."""
    from ..quant.quantlinear import QuantLinear

    total = 0
    for module in drafter.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_int.numel() * module.spec.bits // 8
            total += module.weight_scale.numel() * module.weight_scale.element_size()
            if module.weight_zero_point is not None:
                total += module.weight_zero_point.numel()
        else:
            total += sum(p.numel() * 2 for p in module.parameters(recurse=False))
    return total


__all__ = ["calibration_hessians", "compress_drafter", "draft_agreement", "drafter_linears", "weight_bytes"]
