"""Teacher-vs-student math on the logits, computed from final hidden states in vocabulary chunks so
that full-vocab fp32 logits of a long sequence are never materialised at once (docs/recipe.md: a 248K
vocabulary makes them the largest tensor of QAD)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .quant.quantlinear import QuantLinear


def _chunk_kl(h_s, h_t, w_s, w_t, temperature: float):
    log_p_s = F.log_softmax((h_s.float() @ w_s.float().T) / temperature, dim=-1)
    log_p_t = F.log_softmax((h_t.float() @ w_t.float().T) / temperature, dim=-1)
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)


def chunked_kl(
    h_student: torch.Tensor,
    h_teacher: torch.Tensor,
    head_student: torch.Tensor,
    head_teacher: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Forward KL(p_teacher || p_student) per token, fp32, over the full vocabulary.

    h_*: [N, H] final hidden states (after the final norm); head_*: [V, H] LM-head weights.
    Each chunk of `chunk_tokens` rows is recomputed in backward (activation checkpointing), so peak
    memory is one chunk's [chunk_tokens, V] logits, not N x V.
    """
    out = []
    for start in range(0, h_student.shape[0], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and h_student.requires_grad:
            out.append(checkpoint(_chunk_kl, h_student[sl], h_teacher[sl], head_student, head_teacher, temperature, use_reentrant=False))
        else:
            out.append(_chunk_kl(h_student[sl], h_teacher[sl], head_student, head_teacher, temperature))
    return torch.cat(out) if out else h_student.new_zeros(0)


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """fp32 matmuls on tensor cores (TF32: 10-bit mantissa products, fp32 sums) inside the block, and
    the previous setting restored after it. Why: the KL's fp32 LM-head products over a 152K vocabulary
    are most of a QAD step's work on a GPU when they run as exact fp32 kernels; a training loss
    tolerates TF32, while the held-out KL (the number runs are compared by) stays exact outside the
    block. Does nothing on the CPU, which has no TF32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states after the final norm (what the LM head reads), without computing the logits."""
    return model.model(input_ids=input_ids).last_hidden_state


def lm_head_weight(model) -> torch.Tensor:
    """The LM head's weight [V, H] as a tensor: the output embedding's own, or for a quantized head
    (a target quantized with `lm_head` not in quant.exclude) what its forward uses, in the model's
    16-bit dtype (the STE weight while QAD trains it, else its dequantized ints, kept once made)."""
    head = model.get_output_embeddings()
    if isinstance(head, QuantLinear):
        return head.weight_for(model.get_input_embeddings().weight.dtype)
    return head.weight


def pad_right(rows: list[torch.Tensor], value, length: int | None = None) -> torch.Tensor:
    """Stack 1-d (or [L, ...]) tensors of different lengths, padded at the end with `value` (to
    `length` when given, else to the longest)."""
    length = max(length or 0, *(r.shape[0] for r in rows))
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def length_batches(examples: list[dict], batch_tokens: int) -> list[list[dict]]:
    """Examples sorted by length, cut into batches whose padded size (rows x longest) stays within
    `batch_tokens` (a longer example alone makes a batch of one)."""
    batches: list[list[dict]] = []
    for ex in sorted(examples, key=lambda ex: len(ex["input_ids"])):
        if batches and (len(batches[-1]) + 1) * len(ex["input_ids"]) <= batch_tokens:
            batches[-1].append(ex)
        else:
            batches.append([ex])
    return batches


@torch.no_grad()
def compare_to_teacher(teacher, student, examples: list[dict], *, chunk_tokens: int = 1024, device=None,
                       batch_tokens: int = 16384) -> dict[str, float]:
    """Held-out agreement of `student` with `teacher` on the response tokens of `examples`
    (dicts with input_ids and loss_mask): mean forward KL(teacher || student), top-1 agreement of the
    next-token argmax, and the student's perplexity of the actual response tokens.

    Examples go through the models in right-padded batches of up to `batch_tokens` (a causal model's
    states at real positions never see the padding after them), and the sums stay on the device
    until the end: one forward and three syncs per example made this host-bound on a GPU (the PTQ
    nodes' logs in results/published/2026-11-30-h200-gpu-dag)."""
    device = device or next(student.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # KL, agreement, NLL
    count = 0
    w_t, w_s = lm_head_weight(teacher), lm_head_weight(student)
    usable = [ex for ex in examples if any(ex["loss_mask"][1:])]
    for batch in length_batches(usable, batch_tokens):
        ids = pad_right([torch.tensor(ex["input_ids"]) for ex in batch], 0).to(device)
        # position i predicts token i+1: score the positions whose *next* token is a response token
        predict = pad_right([torch.tensor(ex["loss_mask"][1:], dtype=torch.bool) for ex in batch], False).to(device)
        h_t = final_hidden(teacher, ids)[:, :-1][predict]
        h_s = final_hidden(student, ids)[:, :-1][predict]
        targets = ids[:, 1:][predict]
        for start in range(0, h_s.shape[0], chunk_tokens):  # one pass: KL, agreement and NLL per chunk
            sl = slice(start, start + chunk_tokens)
            log_p_s = F.log_softmax(h_s[sl].float() @ w_s.float().T, dim=-1)
            log_p_t = F.log_softmax(h_t[sl].float() @ w_t.float().T, dim=-1)
            sums[0] += (log_p_t.exp() * (log_p_t - log_p_s)).sum()
            sums[1] += (log_p_s.argmax(-1) == log_p_t.argmax(-1)).sum()
            sums[2] += F.nll_loss(log_p_s, targets[sl], reduction="sum")
        count += sum(sum(ex["loss_mask"][1:]) for ex in batch)
    if count == 0:
        raise ValueError("no response tokens to compare on")
    kl_sum, agree, nll_sum = sums.tolist()
    return {"kl": kl_sum / count, "top1_agreement": agree / count, "ppl": float(torch.exp(torch.tensor(nll_sum / count))), "tokens": count}
