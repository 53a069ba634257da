"""Back-of-the-envelope cost of one drafting round, in matmul FLOPs (2 x multiply-adds).

Per round the drafter (1) turns the features of the newly committed tokens into context K/V
(`fc` + every layer's k/v projections), (2) runs its layers over the B block tokens, and (3) reads
B rows of logits through the target's LM head. Attention scores are counted too. Compared with one
target forward of a single token (its linear layers + LM head), which is what a decode step costs.
"""

from __future__ import annotations


def drafter_round_flops(c, context_len: int, new_tokens: int) -> dict[str, float]:
    h, b = c.hidden_size, c.block_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    fc = 2 * new_tokens * len(c.target_layer_ids) * h * h
    per_layer_ctx = 2 * new_tokens * (2 * h * kv)  # k, v of the new context tokens (cached afterwards)
    per_layer_block = 2 * b * (h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size)
    attention = 2 * 2 * b * (context_len + b) * q
    head = 2 * b * h * c.vocab_size
    layers = c.num_layers * (per_layer_ctx + per_layer_block + attention)
    return {"fc": fc, "layers": layers, "lm_head": head, "total": fc + layers + head}


def target_token_flops(model) -> float:
    """Linear layers of one target token forward (2 x their weights), LM head included."""
    import torch

    return 2.0 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
