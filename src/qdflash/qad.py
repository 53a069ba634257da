"""Quantization-aware distillation: the pieces of the loop (the node is stages/qad.py).

Teacher = the 16-bit target (frozen); student = the target with fake-quant linears on the PTQ
artifact's grid (scales frozen, latent weights trainable, STE with clipping). Loss = forward
KL(p_teacher || p_student) per token, fp32, chunked over the vocabulary (qdflash.distill).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import torch

from .distill import chunked_kl, final_hidden, lm_head_weight
from .errors import QdflashError
from .quant.quantlinear import QuantLinear


def pack_sequences(examples: list[dict], seq_len: int, loss_on: str = "all") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate tokenized conversations into rows of `seq_len` tokens (the last partial row is
    dropped). The mask marks tokens whose prediction is trained: every token ("all", docs/recipe.md) or
    only assistant tokens ("assistant")."""
    if loss_on not in ("all", "assistant"):
        raise ValueError(f"qad.loss_on={loss_on!r}: expected all or assistant")
    ids: list[int] = []
    mask: list[int] = []
    for ex in examples:
        ids += ex["input_ids"]
        mask += ex["loss_mask"] if loss_on == "assistant" else [1] * len(ex["input_ids"])
    rows = len(ids) // seq_len
    return [
        (torch.tensor(ids[i * seq_len : (i + 1) * seq_len]), torch.tensor(mask[i * seq_len : (i + 1) * seq_len]))
        for i in range(rows)
    ]


class StudentHidden(torch.nn.Module):
    """The student's final hidden states as a module's forward, so that DDP (which prepares its
    gradient all-reduce in forward) can wrap the part of the student that trains."""

    def __init__(self, student):
        super().__init__()
        self.student = student

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return final_hidden(self.student, ids)


def kl_sum_count(teacher, student, ids: torch.Tensor, mask: torch.Tensor, *, temperature: float, chunk_tokens: int,
                 hidden=None) -> tuple[torch.Tensor, int]:
    """Summed per-token KL over positions whose next token is trained (position i predicts token
    i+1), and their count. `hidden`: what computes the student's hidden states (its DDP wrapper)."""
    with torch.no_grad():
        h_t = final_hidden(teacher, ids)[:, :-1]
    h_s = (hidden or StudentHidden(student))(ids)[:, :-1]
    keep = mask[:, 1:].bool()
    kl = chunked_kl(h_s[keep], h_t[keep], lm_head_weight(student), lm_head_weight(teacher),
                    temperature=temperature, chunk_tokens=chunk_tokens)
    return kl.sum(), int(keep.sum())


def kl_loss(teacher, student, ids: torch.Tensor, mask: torch.Tensor, *, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """Mean per-token KL over positions whose next token is trained."""
    total, count = kl_sum_count(teacher, student, ids, mask, temperature=temperature, chunk_tokens=chunk_tokens)
    return total / max(count, 1)


def cosine_lr(step: int, total: int, warmup: int, peak: float, floor: float = 0.0) -> float:
    """Linear warmup to `peak`, then cosine decay to `floor` x `peak` at `total` (0: to zero; 1: constant)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_student_trainable(student, reference=None) -> list[torch.nn.Parameter]:
    """Freeze everything, then give each QuantLinear a trainable latent weight (scales stay frozen).
    `reference`: the 16-bit model the student was quantized from; its weights place each latent
    inside its rounding cell (see grid.latent_in_cell)."""
    for p in student.parameters():
        p.requires_grad_(False)
    originals = dict(reference.named_modules()) if reference is not None else {}
    latents = []
    for name, module in student.named_modules():
        if isinstance(module, QuantLinear):
            ref = originals.get(name)
            module.enable_fake_quant(torch.float32, None if ref is None else ref.weight.detach())
            latents.append(module.latent)
    return latents


def save_checkpoint(path: Path, step: int, latents: list[torch.Tensor], optimizer, fingerprint: str,
                    progress: dict | None = None) -> None:
    """Atomic: written to a temporary file, then renamed over the previous checkpoint. `progress`
    holds the loop's own state (the batch order's random state, the curve so far): plain data and
    tensors only, because the checkpoint is read back with weights_only=True."""
    state = {
        "step": step,
        "latents": [t.detach().cpu() for t in latents],
        "optimizer": optimizer.state_dict(),
        "fingerprint": fingerprint,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "progress": progress or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, latents: list[torch.Tensor], optimizer, fingerprint: str) -> tuple[int, dict]:
    """Resume: (the step to continue from, the saved `progress`); (0, {}) when there is no checkpoint
    of these inputs. The file lies in the results tree, where anyone may have put it: it is read with
    weights_only=True (tensors and plain data; a pickled object that would run code is refused)."""
    if not path.is_file():
        return 0, {}
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... here
        raise QdflashError(f"{path}: not a QAD checkpoint of tensors and plain data ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); it was not loaded. Delete it to start over.") from None
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        return 0, {}  # a checkpoint of other inputs (config, PTQ artifact, data, model, code): start over
    with torch.no_grad():
        for latent, saved in zip(latents, state["latents"]):
            latent.copy_(saved.to(latent.device))
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"]), state.get("progress", {})
