"""The block-diffusion training layout as pure functions (docs/recipe.md "drafter training").

For each anchor position a of a sequence, a block of B tokens is drafted: [x_a, MASK x (B-1)].
Block position k (1..B-1) predicts token a+k. A block sees the target's features of the context
strictly before its anchor, and all of its own B tokens (bidirectional); blocks never see each other.
"""

from __future__ import annotations

import heapq
import math

import torch

from ..errors import QdflashError

IGNORE = -100


def loss_weights(block_size: int, gamma: float, positions: int | None = None) -> torch.Tensor:
    """Weight of each block position: 0 for the anchor itself, exp(-(k-1)/gamma) for k >= 1 (earlier
    positions matter more: a rejection there ends the whole block). `positions`: only k <= positions
    are trained (the rest weigh 0, so their rows never reach the LM head, the step's largest cost); a
    drafted token at k counts only if all before it were accepted, which at low tau few deep ones are."""
    if positions is not None and not 1 <= positions <= block_size - 1:
        raise QdflashError(f"drafter_train.loss_positions={positions}: the block of {block_size} drafts positions "
                           f"1..{block_size - 1}; train 1 to {block_size - 1} of them (null: all)")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    if positions is not None:
        w[positions + 1 :] = 0.0
    return w


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None,
                   full_block: int | None = None) -> torch.Tensor:
    """Up to `n` distinct anchors a >= 1 whose next token a+1 is a trained (assistant) token, sorted.
    With `full_block=B`, tokens a+1 .. a+B-1 must all exist and be trained (for acceptance estimates)."""
    mask = loss_mask.bool()
    if full_block is None:
        candidates = torch.nonzero(mask[2:], as_tuple=False).flatten() + 1  # a in [1, L-2] with mask[a+1]
    else:
        span = full_block - 1
        if mask.numel() < span + 2:
            return torch.zeros(0, dtype=torch.long)
        whole = mask[2:].unfold(0, span, 1).all(dim=1) if span > 0 else mask[2:]
        candidates = torch.nonzero(whole, as_tuple=False).flatten() + 1
    if candidates.numel() <= n:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:n]
    return candidates[pick].sort().values


def answer_offsets(loss_mask: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """For each anchor a (whose next token a+1 is trained), how many tokens of its answer come before a+1:
    0 where a+1 opens an answer (a run of trained tokens: a turn of a multi-turn sequence starts its own).
    Greedy decoding's rounds draft from offset 1 on (the target's prefill chooses the first token)."""
    mask = loss_mask.bool()
    index = torch.arange(mask.numel())
    opens = mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), mask[:-1]])
    run_start = torch.cummax(torch.where(opens, index, torch.zeros_like(index)), dim=0).values
    nxt = anchors + 1
    return nxt - run_start[nxt]


def block_inputs(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token: int, label_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block token ids [n, B] (anchor token then `mask_token`), targets [n, B] (token a+k of `label_ids`,
    default `input_ids`, where it exists and is trained, else IGNORE; position 0 is always IGNORE) and
    absolute positions [n, B]."""
    labels = input_ids if label_ids is None else label_ids
    length = input_ids.shape[0]
    offsets = torch.arange(block_size)
    positions = anchors[:, None] + offsets[None, :]
    inside = positions < length
    clipped = positions.clamp(max=length - 1)
    targets = torch.where(inside & loss_mask[clipped].bool(), labels[clipped], torch.full_like(clipped, IGNORE))
    targets[:, 0] = IGNORE
    ids = torch.full_like(positions, mask_token)
    ids[:, 0] = input_ids[anchors]
    return ids, targets, positions


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Boolean [n*B, context_len + n*B]: True where a query may attend.

    Query (i, k) sees context positions j < anchors[i] and the B tokens of block i, nothing else.
    """
    n = anchors.shape[0]
    block_of_query = torch.arange(n).repeat_interleave(block_size)
    context = torch.arange(context_len)[None, :] < anchors[block_of_query][:, None]
    same_block = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([context, same_block], dim=1)


def batch_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """`block_attention_mask` for a batch: anchors [n, A] -> boolean [n, A*B, context_len + A*B], on
    the anchors' device (built there in a few kernels: a 16 x 1,024 x 2,800 mask is 46 MB to copy)."""
    n, count = anchors.shape
    device = anchors.device
    block_of_query = torch.arange(count, device=device).repeat_interleave(block_size)
    context = torch.arange(context_len, device=device)[None, None, :] < anchors[:, block_of_query][:, :, None]
    same_block = (block_of_query[:, None] == block_of_query[None, :]).expand(n, -1, -1)
    return torch.cat([context, same_block], dim=2)


def block_mask_mod(anchors: torch.Tensor, block_size: int, context_len: int):
    """The same rule as `batch_attention_mask` as a flex_attention mask_mod (anchors [n, A] on the
    device): keys < context_len are context positions, the rest are the concatenated blocks."""

    def mask_mod(batch, head, q_idx, kv_idx):
        block = q_idx // block_size
        in_context = kv_idx < anchors[batch, block]
        same_block = (kv_idx - context_len) // block_size == block
        return torch.where(kv_idx < context_len, in_context, same_block)

    return mask_mod


def target_weights(targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each block target's loss weight [n, B]: its position's weight, 0 where there is no trained target."""
    return weights.to(targets.device)[None, :] * (targets != IGNORE)


def weighted_block_loss_parts(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of position-weighted cross-entropies, sum of the weights) over the trained targets: the
    parts of the loss, so data-parallel ranks can divide by the whole batch's weight."""
    n, b, v = logits.shape
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, v).float(), targets.reshape(-1), ignore_index=IGNORE,
                                           reduction="none").reshape(n, b)
    w = target_weights(targets, weights)
    return (ce * w).sum(), w.sum()


PROBS_IN_BF16 = True  # a bf16 head's chunk softmax written in bf16 (below); False: in fp32 (scripts/bench/bench_drafter_step.py)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, t_i) over rows, a chunk of rows at a time, with the gradient for
    `hidden` computed in the same pass. W is frozen (the target's LM head): no gradient for it.

    Why: autograd over the whole [rows, vocab] logits keeps them, their fp32 copy and the softmax
    alive for the backward; for 16 x 64 blocks of 16 on Qwen2.5's 151,936 tokens that is ~30 GB
    written and read several times per step. Here only one chunk's logits exist at a time, and the
    backward is a scale of the stored [rows, H] gradient. A chunk makes few passes over its
    [rows, vocab] values: the logits in W's dtype, one softmax (into bf16 for a bf16 head, else fp32;
    reduced in fp32 either way), the one-hot subtracted at the targets, the matmul back to [rows, H];
    the row weight is applied on [rows, H] (d/dh_i = w_i (p_i - e_t_i) W): every extra pass over an
    fp32 chunk is a visible part of a training step (results/published/2026-12-01-h200-drafter-step).

    With `teacher` [rows, H'] (the target's own final states at the position that predicts each row's
    token; `drafter_train.labels: soft`), a row's loss is KL(p_teacher || p_draft) over the whole
    vocabulary instead of the CE of one token, through the same head W (the drafter's head is the
    target's), and d/dlogits = p_draft - p_teacher: the draft learns the target's whole distribution,
    ranks of the runner-up tokens included, from every trained row. The teacher's logits are its final
    states through the bare head weight, as the drafter's are: a head with a bias or a logit cap (none
    of the registry's families has one) would need them applied to both."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, chunk, teacher=None):
        acc = torch.promote_types(weight.dtype, torch.float32)  # softmax and sums in fp32 (or wider)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(weight.dtype)
            t, w = targets[start : start + chunk], row_weights[start : start + chunk].to(acc)
            if teacher is None:
                # a bf16 head: the probabilities are written in bf16 (the softmax still reduces in fp32), the
                # dtype the backward matmul reads anyway, so no fp32 [rows, vocab] tensor is written and read
                # again. bf16's exponent is fp32's, so nothing underflows sooner; a fp16 head (5-bit exponent)
                # keeps the fp32 softmax. bf16 holds a p_t near 1 only to 2^-8, so 1 - p_t (the target's
                # gradient, and the loss of a confident row) is taken from the other tokens' probabilities,
                # summed in fp32: each is exact to 2^-9 of itself.
                out = weight.dtype if weight.dtype == torch.bfloat16 and PROBS_IN_BF16 else acc
                probs = torch.softmax(torch.nn.functional.linear(h, weight), dim=-1, dtype=out)
                rows = torch.arange(t.numel(), device=t.device)
                p_t = probs[rows, t].to(acc)
                # CE = -log p_t; a p_t that underflowed (a logit gap over ~87) counts as the smallest normal
                loss, minus_one = -torch.log(p_t.clamp_min(torch.finfo(acc).tiny)), p_t - 1.0
                if out != acc:
                    probs[rows, t] = 0
                    rest = probs.sum(-1, dtype=acc)  # 1 - p_t
                    sure = p_t > 0.5  # there 1 - p_t from `rest`; elsewhere p_t itself is the precise one
                    loss = torch.where(sure, -torch.log1p(-rest.clamp(max=1 - torch.finfo(acc).eps)), loss)
                    minus_one = torch.where(sure, -rest, minus_one)
                total += (loss * w).sum()
                if grad is not None:
                    probs[rows, t] = minus_one.to(out)  # softmax - onehot: d CE / d logits
            else:
                log_q = torch.log_softmax(torch.nn.functional.linear(h, weight), dim=-1, dtype=acc)
                log_p = torch.log_softmax(torch.nn.functional.linear(teacher[start : start + chunk].to(weight.dtype), weight),
                                          dim=-1, dtype=acc)
                p = log_p.exp()
                # KL = sum_v p (log p - log q), a row at a time (no third [rows, vocab] temporary); where p
                # underflowed to 0 its term is 0 (p log p -> 0)
                kl = torch.bmm(p.unsqueeze(1), log_p.sub_(log_q).unsqueeze(2)).flatten()
                del log_p
                total += (kl * w).sum()
                if grad is None:
                    continue
                probs = log_q.exp_().sub_(p)  # q - p: d KL / d logits
            if grad is not None:
                g = torch.nn.functional.linear(probs.to(weight.dtype), weight.t())  # [rows, H]
                grad[start : start + chunk] = (g.to(acc) * w[:, None]).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def weighted_linear_block_loss_parts(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                                     weights: torch.Tensor, chunk_rows: int = 4096,
                                     teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weighted_block_loss_parts` of the logits `hidden @ head^T`, without ever holding them whole:
    hidden [n, B, H] (the drafter's normed states), head [V, H] (frozen), targets [n, B]. Only rows
    with a positive weight (a trained target at a drafted position) reach the LM head. `teacher`
    [n, B, H]: the target's final states predicting each position; the loss is then the weighted
    KL(target || draft) per row (`_LinearCrossEntropy`), on the same rows. `targets` may be on the CPU
    (hidden's device is where the loss is computed): then picking the rows needs no device sync."""
    w = target_weights(targets, weights)  # where the targets are: on the CPU (training), choosing rows waits for no GPU work
    rows = torch.nonzero(w.flatten() > 0, as_tuple=False).flatten()
    device = hidden.device
    at = rows.to(device, non_blocking=True)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
    taught = None if teacher is None else teacher.reshape(-1, teacher.shape[-1]).index_select(0, at).detach()
    total = _LinearCrossEntropy.apply(picked, head.detach(), targets.flatten()[rows].to(device), w.flatten()[rows].to(device),
                                      chunk_rows, taught)
    return total, w.sum().to(device)


@torch.no_grad()
def linear_argmax(hidden: torch.Tensor, head: torch.Tensor, chunk_rows: int = 4096, top2: bool = False) -> torch.Tensor:
    """argmax over the vocabulary of `hidden @ head^T` (hidden [..., H]), a chunk of rows at a time;
    `top2`: the two best tokens [..., 2] instead (for `distinct_drafts`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], *([2] if top2 else []), dtype=torch.long, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_rows):
        logits = torch.nn.functional.linear(flat[start : start + chunk_rows].to(head.dtype), head)
        out[start : start + chunk_rows] = logits.topk(2, dim=-1).indices if top2 else logits.argmax(-1)
    return out.reshape(*hidden.shape[:-1], *([2] if top2 else []))


def linear_top(hidden: torch.Tensor, head: torch.Tensor, k: int, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best tokens of `hidden @ head^T` (hidden [..., H]) and their log-probabilities, each [..., k], a chunk of
    rows at a time (a tree's choices at every block position: `draft_tree`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = torch.empty(flat.shape[0], k, dtype=torch.long, device=hidden.device)
    logp = torch.empty(flat.shape[0], k, dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_rows):
        logits = torch.nn.functional.linear(flat[start : start + chunk_rows].to(head.dtype), head).float()
        top = logits.log_softmax(-1).topk(k, dim=-1)
        ids[start : start + chunk_rows], logp[start : start + chunk_rows] = top.indices, top.values
    return ids.reshape(*hidden.shape[:-1], k), logp.reshape(*hidden.shape[:-1], k)


def distinct_drafts(top2: list[list[int]]) -> list[int]:
    """One block's drafts where none repeats the draft just before it (`no_repeat`): the drafter's first choice at
    each position, its second where the first equals the draft chosen one position earlier. Why: the drafter fills
    every block position in one pass from the same mask input, and where it is unsure which position a token
    belongs to it writes that token at two neighbouring positions, where the target's own greedy output almost
    never repeats a token (results/published/2026-12-04-h200-qwen-greedy, PROVENANCE.md, "Where the drafts go
    wrong"). The first draft is left alone: the confusion is between guessed positions, and it follows a real token
    (also comparing it with that token walked the same: results/published/2026-12-04-cpu-draft-repeats).
    A draft only proposes, so the rule changes what is accepted, never what is emitted. Lists, not tensors:
    decoding runs it once a round on the host, where a tensor scan would cost a few small ops per position."""
    out: list[int] = []
    for first, second in top2:
        out.append(second if out and first == out[-1] else first)
    return out


TREE_TOP_K = 8  # choices per block position a tree may branch into: 8 walked +0.05 tau over 4 at 15 nodes
#                (results/published/2026-12-04-cpu-draft-trees, topk8.log)


def draft_tree(top_ids: list[list[int]], top_logp: list[list[float]], nodes: int,
               skip_repeats: bool = False) -> tuple[list[int], list[int]]:
    """A tree of `nodes` drafts from one block pass: the drafter's top choices at block positions 1.. (`top_ids` /
    `top_logp` [positions][k], best first). A path's score is the sum of its tokens' log-probabilities (one pass
    drafts every position from the same mask input, so the positions are taken as independent), and the tree is
    the `nodes` best paths, found best first; a parent always scores at least its child, so they form a tree.
    `skip_repeats`: from depth 2, no child repeats its parent's token (`distinct_drafts`' rule, on every path).
    Returns (tokens, parents) in an order where a parent comes before its children; parent -1 is the committed
    token the block starts from. Why a tree: a round most often ends at the first draft, and the target can check
    second choices in the same forward (results/published/2026-12-04-cpu-draft-trees)."""
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-lp, tok, -1, 1) for tok, lp in zip(top_ids[0], top_logp[0])]  # (-score, token, parent, depth)
    heapq.heapify(heap)
    while heap and len(tokens) < nodes:
        neg, tok, parent, depth = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        if depth < len(top_ids):
            me = len(tokens) - 1
            for child, lp in zip(top_ids[depth], top_logp[depth]):
                if not (skip_repeats and child == tok):
                    heapq.heappush(heap, (neg - lp, child, me, depth + 1))
    return tokens, parents


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the committed token), for `draft_tree`'s order (parents first)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def accepted_path(tokens: list[int], parents: list[int], next_token) -> list[int]:
    """The nodes greedy verification accepts: from the committed token down, the child whose token is the
    target's own next token there, while one is. `next_token(node)`: the target's choice after that node's path
    (node -1: after the committed token). The round then commits those nodes' tokens and the target's token
    after the last of them."""
    path: list[int] = []
    node = -1
    while True:
        want = next_token(node)
        child = next((i for i, (tok, parent) in enumerate(zip(tokens, parents)) if parent == node and tok == want), None)
        if child is None:
            return path
        path.append(child)
        node = child


def tree_acceptance(ids: torch.Tensor, logp: torch.Tensor, target: torch.Tensor, nodes: int,
                    skip_repeats: bool = False) -> torch.Tensor:
    """Greedy acceptance per block of a `draft_tree` of `nodes` drafts from each block's choices (ids / logp
    [N, B-1, k], best first) against the target's argmax at the block's positions [N, B-1] (on a greedy answer the
    target's token after a matched path of depth d is the answer's token d + 1): 1..B, bonus included, as
    `acceptance_lengths` counts a chain's."""
    out = []
    for block_ids, block_logp, greedy in zip(ids.tolist(), logp.tolist(), target.tolist()):
        tokens, parents = draft_tree(block_ids, block_logp, nodes, skip_repeats)
        depths = tree_depths(parents)
        after = lambda node: greedy[0] if node < 0 else (greedy[depths[node]] if depths[node] < len(greedy) else None)  # noqa: E731
        out.append(len(accepted_path(tokens, parents, after)) + 1)
    return torch.tensor(out, dtype=torch.long)


def weighted_block_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per block position, weighted by position, averaged over weighted targets."""
    total, weight = weighted_block_loss_parts(logits, targets, weights)
    return total / weight.clamp_min(1e-9)


def acceptance_lengths(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance per block: drafts [N, B-1] vs the target's argmax [N, B-1] at the same
    positions. Tokens are committed while they match, plus the target's bonus token: 1..B."""
    matches = (draft == target).long()
    return 1 + torch.cumprod(matches, dim=1).sum(dim=1)


def default_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced from 1 to L-3 (docs/recipe.md: [1, 8, 15, 22, 29] for 32 layers)."""
    last = max(1, num_target_layers - 3)
    if count <= 1:
        return [1]
    ids = {int(math.floor(1 + i * (last - 1) / (count - 1) + 0.5)) for i in range(count)}
    return sorted(i for i in ids if 0 <= i < num_target_layers)
