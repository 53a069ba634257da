"""Training and teacher-forced acceptance of the DFlash drafter (docs/recipe.md "drafter training").

Target hidden states are computed online by a frozen target forward. All blocks of one sequence are
drafted in one drafter forward: their queries are concatenated and `blocks.block_attention_mask`
keeps every block on its own context prefix and its own tokens. Sequences of a batch are right-padded
and run through one target forward and one drafter forward. The mask is a dense SDPA boolean mask
(CPU) or flex_attention's block-sparse mask (GPU: `attention=flex`); both implement the same rule
(tested equal).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from ..distill import pad_right
from ..errors import QdflashError
from ..ops import tap_features
from .blocks import (IGNORE, TREE_TOP_K, acceptance_lengths, answer_offsets, batch_attention_mask, block_inputs,
                     block_mask_mod, distinct_drafts, linear_argmax, linear_top, sample_anchors, tree_acceptance,
                     weighted_linear_block_loss_parts)
from .model import Drafter


LABELS = ("data", "target", "soft")  # drafter_train.labels: what a block position learns (batch_loss)
# estimate_acceptance's tau by answer offset: [0, 32), [32, 128) (what a 128-token benchmark answer decodes), [128, ...)
ANSWER_OFFSET_BOUNDS = (0, 32, 128)


def check_labels(labels: str) -> str:
    if labels not in LABELS:
        raise QdflashError(f"drafter_train.labels={labels!r}: expected one of {', '.join(LABELS)}")
    return labels


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, layer_ids: list[int], greedy: bool = True, chunk_rows: int = 4096,
                last: bool = False):
    """Concatenated hidden states of `layer_ids` [n, L, k*H] and the target's greedy next tokens [n, L]
    (None with `greedy=False`; with `last=True`, its final normed states [n, L, H] instead, what its LM
    head reads). The LM head runs `chunk_rows` positions at a time, so its [n, L, vocab]
    logits are never held at once (for Qwen2.5's 151,936 tokens ~9 GB per 16 x 1,800-token batch in
    bf16). Right padding needs no attention mask: the target is causal, so real tokens never see it."""
    out = target.model.get_decoder()(input_ids=input_ids, output_hidden_states=True)
    features = tap_features(out.hidden_states, layer_ids)
    if last:
        return features, out.last_hidden_state
    if not greedy:
        return features, None
    head = target.model.get_output_embeddings()  # the module itself: a bias or a quantized head runs as in forward
    last = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
    tokens = torch.cat([head(last[i : i + chunk_rows]).argmax(-1) for i in range(0, last.shape[0], chunk_rows)])
    return features, tokens.reshape(input_ids.shape)


def target_labels(input_ids: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Per position t, the token the target itself would emit there: its greedy prediction from position
    t-1 (`drafter_train.labels: target`). A block position is accepted in greedy speculative decoding
    when it equals exactly this token; the sampled data token (T 0.7) differs from it at some positions,
    which are label noise for acceptance. Position 0 keeps its data token (never a training target)."""
    return torch.cat([input_ids[:, :1], greedy[:, :-1].to(input_ids.device, input_ids.dtype)], dim=1)


def pad_anchors(anchor_lists: list[torch.Tensor], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [n, A] (short lists padded with anchor 1) and which entries are real [n, A]."""
    width = max(width or 0, *(a.numel() for a in anchor_lists))
    anchors = torch.ones(len(anchor_lists), width, dtype=torch.long)
    valid = torch.zeros(len(anchor_lists), width, dtype=torch.bool)
    for i, a in enumerate(anchor_lists):
        anchors[i, : a.numel()], valid[i, : a.numel()] = a, True
    return anchors, valid


def padded_batch(examples: list[dict], anchor_lists: list[torch.Tensor], length: int | None = None,
                 width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and loss masks [n, L] (L >= `length`) and padded anchors with their
    validity [n, A] (A >= `width`): the inputs of one `draft_blocks` call."""
    input_ids = pad_right([torch.tensor(ex["input_ids"]) for ex in examples], 0, length)
    loss_masks = pad_right([torch.tensor(ex["loss_mask"]) for ex in examples], 0, length)
    return (input_ids, loss_masks, *pad_anchors(anchor_lists, width))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def teacher_states(last: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, A, B, H]: for block position k of the block at anchor a, the target's final state at a+k-1,
    the position whose LM-head output predicts token a+k (position 0, never trained, gets a's own)."""
    n, length = last.shape[:2]
    positions = (anchors[:, :, None] + torch.arange(block_size)[None, None, :] - 1).clamp(0, length - 1).to(last.device)
    return torch.gather(last, 1, positions.reshape(n, -1, 1).expand(-1, -1, last.shape[-1])).reshape(
        n, anchors.shape[1], block_size, -1)


def draft_blocks(drafter: Drafter, features: torch.Tensor, input_ids: torch.Tensor, loss_masks: torch.Tensor,
                 anchors: torch.Tensor, valid: torch.Tensor | None = None,
                 attention: str = "sdpa", module=None, head: bool = True,
                 label_ids: torch.Tensor | None = None, cpu_targets: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, A, B, V] of every block of a (right-padded) batch in one drafter forward, and the
    targets [n, A, B] (IGNORE where no trained token is, and for padding anchors: `valid` False).
    With `head=False`, the normed states [n, A, B, H] the LM head would read instead of the logits.
    `label_ids` [n, L]: the targets' tokens (default: `input_ids`, the data; `target_labels`: the target's).
    `cpu_targets`: the targets stay where they were built (the CPU), so that choosing the trained rows from
    them needs no device-to-host copy (`blocks.weighted_linear_block_loss_parts`).

    input_ids / loss_masks [n, L], features [n, L, k*H], anchors [n, A] (CPU tensors except features).
    attention: "sdpa" (a dense boolean mask) or "flex" (flex_attention's block-sparse mask).
    module: what runs the drafter's forward (its DDP wrapper under torchrun; the drafter itself otherwise,
    FSDP-sharded or not). The context features (`fc`) are computed inside that forward.
    """
    b = drafter.block_size
    n, length = input_ids.shape
    device = features.device
    blocks = [block_inputs(input_ids[i], loss_masks[i], anchors[i], b, drafter.mask_id,
                           None if label_ids is None else label_ids[i]) for i in range(n)]
    ids, targets, positions = (torch.stack(parts) for parts in zip(*blocks))
    if valid is not None:
        targets = torch.where(valid[..., None], targets, torch.full_like(targets, IGNORE))
    q_pos = positions.reshape(n, -1)
    k_pos = torch.cat([torch.arange(length).expand(n, length), q_pos], dim=1)
    if attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        queries = q_pos.shape[1]
        mask = create_block_mask(block_mask_mod(anchors.to(device), b, length), n, None, queries, length + queries,
                                 device=device)
    elif attention == "sdpa":
        mask = batch_attention_mask(anchors.to(device), b, length)  # built where it is used: no host copy
    else:
        raise ValueError(f"attention={attention!r}: expected 'sdpa' or 'flex'")
    out = (module or drafter)(ids.reshape(n, -1).to(device), None, q_pos.to(device), k_pos.to(device), mask,
                              target_hidden=features.to(drafter.norm.weight.dtype), head=head)
    return out.reshape(n, anchors.shape[1], b, -1), targets if cpu_targets else targets.to(device)


class FeatureCache:
    """Target features of training sequences kept on disk (one file per sequence id, in the target's
    dtype): repeated epochs skip the target forward. The sequences a batch misses are computed
    together in one right-padded forward, as without the cache; one forward per sequence made the
    first epoch host-bound on a GPU (several times slower than the cached epochs)."""

    def __init__(self, folder: Path | None):
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def get_batch(self, keys: list[str], compute, count: bool = True) -> list[torch.Tensor]:
        """The cached tensor of each key; `compute(indices)` returns those of the missing ones (in
        that order), which are saved before they are returned. `count`: add to hits / misses (the
        features' lookups do; the labels' side tensors kept beside them do not count twice)."""
        missing = [i for i, key in enumerate(keys) if not self._has(key)]
        if count:
            self.hits += len(keys) - len(missing)
            self.misses += len(missing)
        fresh = dict(zip(missing, compute(missing))) if missing else {}
        for i, value in fresh.items():
            self._save(keys[i], self._keep(value))
        return [fresh[i] if i in fresh else self._load(keys[i]) for i in range(len(keys))]

    def _keep(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().cpu().clone()  # clone: a row of a batch would keep the whole batch

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.pt"

    def _has(self, key: str) -> bool:
        return self._path(key).is_file()

    def _save(self, key: str, value: torch.Tensor) -> None:
        path = self._path(key)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(value, tmp)
        os.replace(tmp, path)

    def _load(self, key: str) -> torch.Tensor:
        return load_tensor(self._path(key))


class MemoryFeatureCache(FeatureCache):
    """The same cache in host memory (`drafter_train.cache_features: memory`): for multi-epoch runs whose
    features fit the machine's RAM but not its disk (the gpu profile's 3,072-token sequences x 5 layers:
    ~5 MB a sequence of mean length, ~540 tokens, so 4,000 answers ~20 GB against the H200 machine's 64 GB of disk
    and 128 GB of RAM). Gone when the process ends; nothing to clean up.
    `device`: kept in that device's memory instead (`cache_features: device`, the training device): an H200
    holds 141 GB, more than its machine's RAM can spare for 16,000 answers (~87 GB), and a cached epoch then
    copies nothing from the host."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(None)
        self.store: dict[str, torch.Tensor] = {}
        self.device = None if device is None else torch.device(device)

    def _keep(self, value: torch.Tensor) -> torch.Tensor:
        if self.device is None:
            return super()._keep(value)
        return value.detach().to(self.device).clone()  # clone: a row of a batch would keep the whole batch

    def _has(self, key: str) -> bool:
        return key in self.store

    def _save(self, key: str, value: torch.Tensor) -> None:
        self.store[key] = value

    def _load(self, key: str) -> torch.Tensor:
        return self.store[key]


def make_feature_cache(mode, folder: Path, device: torch.device | str | None = None) -> FeatureCache | None:
    """drafter_train.cache_features: true (on disk, in `folder`), memory (host RAM), device (the memory of
    `device`, the training device) or false (none)."""
    if mode == "memory":
        return MemoryFeatureCache()
    if mode == "device":
        if device is None:
            raise QdflashError("drafter_train.cache_features='device': no training device was given to keep the features on")
        return MemoryFeatureCache(device)
    if mode is True or mode is False or mode is None:
        return FeatureCache(folder) if mode else None
    raise QdflashError(f"drafter_train.cache_features={mode!r}: expected true (on disk), memory (host RAM), "
                       "device (the training device's memory) or false")


def load_tensor(path: Path) -> torch.Tensor:
    """A cached feature tensor. The cache lies beside the results, where anyone may have put a file:
    weights_only=True refuses a pickled object that would run code (torch < 2.6 defaults to False)."""
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ... all mean the same here
        raise QdflashError(f"{path}: not a cached feature tensor ({type(err).__name__}); it was not loaded. "
                           f"Delete {path.parent} to recompute the features.") from None
    if not isinstance(value, torch.Tensor):
        raise QdflashError(f"{path}: holds a {type(value).__name__}, not a cached feature tensor. Delete {path.parent} to recompute the features.")
    return value


def feature_key(example: dict) -> str:
    """A sequence's cache key: its id and a digest of its tokens (regenerated answers keep their ids)."""
    tokens = torch.tensor(example["input_ids"], dtype=torch.int64).numpy().tobytes()
    return f"{example['id']}-{hashlib.sha256(tokens).hexdigest()[:12]}"


def feature_cache_folder(out_dir: str | Path, target_name: str, dtype: str, layer_ids: list[int]) -> Path:
    """Where a node's feature cache lives: beside its output, named after what the features depend
    on, so a failed run's cache is reused by its retry but never by a run on another target."""
    key = hashlib.sha256(json.dumps([str(target_name), str(dtype), list(layer_ids)]).encode()).hexdigest()[:12]
    return Path(f"{out_dir}.features-{key}")


def anchored_examples(examples: list[dict], anchors_per_seq: int, seed: int,
                      full_block: int | None = None) -> list[tuple[dict, torch.Tensor]]:
    """Each example with its anchors, drawn example by example from one generator seeded with `seed`
    (so which blocks an evaluation sees does not depend on how the examples are batched afterwards);
    examples without an anchor are left out. `full_block`: as sample_anchors."""
    generator = torch.Generator().manual_seed(seed)
    drawn = [(ex, sample_anchors(torch.tensor(ex["loss_mask"]), anchors_per_seq, generator, full_block)) for ex in examples]
    return [(ex, a) for ex, a in drawn if a.numel()]


def batch_anchors(examples: list[dict], anchors_per_seq: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Random anchor positions of every sequence of a batch, in batch order (data-parallel ranks draw
    them for the whole batch, then take their slice, so they train on the 1-process run's blocks)."""
    return [sample_anchors(torch.tensor(ex["loss_mask"]), anchors_per_seq, generator) for ex in examples]


def batch_loss(drafter: Drafter, target, examples: list[dict], weights: torch.Tensor, anchors_per_seq: int,
               generator: torch.Generator | None, cache: FeatureCache | None = None, attention: str = "sdpa",
               pad_length: int | None = None, anchor_lists: list[torch.Tensor] | None = None, module=None,
               parts: bool = False, labels: str = "data"):
    """Weighted block loss of a batch of sequences (right-padded, one target and one drafter forward).
    With `cache`, features come per sequence from disk (computed unpadded on a miss).
    `pad_length` (and `anchors_per_seq` anchors always) gives every batch one shape, so a compiled
    flex_attention is compiled once instead of once per batch shape. `anchor_lists`: anchors drawn
    beforehand (batch_anchors; else drawn here from `generator`); `module`: the drafter's DDP
    wrapper; `parts`: return (weighted loss sum, weight sum) instead of their ratio. The LM head and
    cross-entropy run on the trained rows only, a chunk at a time (blocks.weighted_linear_block_loss_parts).
    `labels`: what a block position learns, "data" (the training sequence's next token), "target" (the
    target's own greedy next token on the same prefix, `target_labels`) or "soft" (the target's whole
    next-token distribution there: KL(target || draft) per position; `_LinearCrossEntropy`). What
    "target" and "soft" need of the target (greedy tokens, final states) is cached beside the features.
    None when no sequence has an anchor."""
    check_labels(labels)
    extra = {"data": None, "target": "greedy", "soft": "last"}[labels]  # what else of the target pass is needed
    device = next(drafter.parameters()).device
    if anchor_lists is None:
        anchor_lists = batch_anchors(examples, anchors_per_seq, generator)
    keep = [i for i, a in enumerate(anchor_lists) if a.numel()]
    if not keep:
        return None
    examples, anchor_lists = [examples[i] for i in keep], [anchor_lists[i] for i in keep]
    input_ids, loss_masks, anchors, valid = padded_batch(examples, anchor_lists, pad_length,
                                                         anchors_per_seq if pad_length else None)
    layer_ids = drafter.config.target_layer_ids

    def run_target(ids):
        return target_pass(target, ids, layer_ids, greedy=extra == "greedy", last=extra == "last")

    side = None  # greedy tokens [n, L] or final states [n, L, H]
    if cache is not None:
        fresh_side = {}

        def compute(indices):  # one forward over the missing rows; each keeps its own length
            width = max(len(examples[i]["input_ids"]) for i in indices)
            features, more = run_target(input_ids[indices, :width].to(device))
            for row, i in enumerate(indices):
                if extra:
                    fresh_side[i] = more[row, : len(examples[i]["input_ids"])]
            return [features[row, : len(examples[i]["input_ids"])] for row, i in enumerate(indices)]

        keys = [feature_key(ex) for ex in examples]
        rows = cache.get_batch(keys, compute)
        features = pad_right([r.to(device) for r in rows], 0, pad_length)
        if extra:
            def compute_side(indices):  # features cached by a run with other labels: one more target pass
                missing = [i for i in indices if i not in fresh_side]
                if missing:
                    compute(missing)
                return [fresh_side[i] for i in indices]

            side = pad_right([r.to(device) for r in cache.get_batch([f"{key}.{extra}" for key in keys], compute_side, count=False)],
                             0, input_ids.shape[1])
    else:
        features, side = run_target(input_ids.to(device))
    label_ids = target_labels(input_ids, side.cpu()) if extra == "greedy" else None
    hidden, targets = draft_blocks(drafter, features, input_ids, loss_masks, anchors, valid, attention, module, head=False,
                                   label_ids=label_ids, cpu_targets=True)
    teacher = teacher_states(side, anchors, drafter.block_size).flatten(0, 1) if extra == "last" else None
    total, weight = weighted_linear_block_loss_parts(hidden.flatten(0, 1), drafter.head_weight(), targets.flatten(0, 1), weights,
                                                     teacher=teacher)
    return (total, weight) if parts else total / weight.clamp_min(1e-9)


@torch.no_grad()
def anchor_acceptance(drafter: Drafter, target, drawn: list[tuple[dict, torch.Tensor]], *, batch_size: int = 1,
                      attention: str = "sdpa", length_multiple: int | None = None, width: int | None = None,
                      no_repeat: bool = False, tree_nodes: int | None = None):
    """For each (example, anchors) of `drawn`, in order: (example, anchors, the greedy acceptance length of the block
    at each anchor [A], the example's padded loss mask). Examples go `batch_size` at a time through one target pass
    and one drafter forward; the drafter is in eval mode meanwhile. `length_multiple`: every batch is padded to one
    length (the longest example, rounded up) and `width` anchors (default: the most any example has), i.e. one
    shape (flex). `no_repeat`: the drafts of decoding's `no_repeat` rule (`blocks.distinct_drafts`); `tree_nodes`: a
    tree of that many drafts a block instead of a chain (`blocks.tree_acceptance`, decoding's `tree_nodes`)."""
    if not drawn:
        return
    device = next(drafter.parameters()).device
    offsets = torch.arange(drafter.block_size - 1)
    length = None
    if length_multiple:
        length = round_up(max(len(ex["input_ids"]) for ex, _ in drawn), length_multiple)
        width = width or max(a.numel() for _, a in drawn)
    else:
        width = None
    was_training = drafter.training
    drafter.eval()
    try:
        for start in range(0, len(drawn), batch_size):
            chunk = drawn[start : start + batch_size]
            input_ids, loss_masks, anchors, valid = padded_batch([ex for ex, _ in chunk], [a for _, a in chunk], length, width)
            features, greedy = target_pass(target, input_ids.to(device), drafter.config.target_layer_ids)
            hidden, _ = draft_blocks(drafter, features, input_ids, loss_masks, anchors, valid, attention, head=False)
            greedy = greedy.cpu()
            if tree_nodes is not None:
                ids, logp = (x.cpu() for x in linear_top(hidden[:, :, 1:], drafter.head_weight(), TREE_TOP_K))
                for i, (ex, a) in enumerate(chunk):
                    yield ex, a, tree_acceptance(ids[i, : a.numel()], logp[i, : a.numel()],
                                                 greedy[i][a[:, None] + offsets[None, :]], tree_nodes, no_repeat), loss_masks[i]
                continue
            # [n, A, B-1] (no [.., V] logits held)
            draft = linear_argmax(hidden[:, :, 1:], drafter.head_weight(), top2=no_repeat).cpu()
            for i, (ex, a) in enumerate(chunk):
                drafts = draft[i, : a.numel()]
                if no_repeat:
                    drafts = torch.tensor([distinct_drafts(top2) for top2 in drafts.tolist()], dtype=torch.long)
                yield ex, a, acceptance_lengths(drafts, greedy[i][a[:, None] + offsets[None, :]]), loss_masks[i]
    finally:
        drafter.train(was_training)


def estimate_acceptance(drafter: Drafter, target, examples: list[dict], *, anchors_per_seq: int = 32,
                        seed: int = 0, categories: dict[str, str] | None = None, batch_size: int = 1,
                        attention: str = "sdpa", length_multiple: int | None = None) -> dict:
    """Teacher-forced acceptance on (greedy) held-out responses.

    For each anchor whose whole block lies inside the response, the drafter's argmax at block
    positions 1..B-1 is compared with the target's argmax at the same positions (the target's logits
    at a+k-1 predict token a+k). On greedy responses this is exactly what greedy speculative
    decoding would accept at that point. Returns tau (mean acceptance length, bonus token included),
    the per-position acceptance rate, and tau per category. Anchors are drawn per example in order,
    so the result does not depend on `batch_size`. `length_multiple`: every batch is padded to one
    length (the longest example, rounded up) and `anchors_per_seq` anchors, i.e. one shape (flex).
    """
    b = drafter.block_size
    lengths: list[torch.Tensor] = []
    offsets_seen: list[torch.Tensor] = []  # each block's answer_offsets
    by_category: dict[str, list[torch.Tensor]] = defaultdict(list)
    drawn = anchored_examples(examples, anchors_per_seq, seed, full_block=b)
    for ex, a, acc, loss_mask in anchor_acceptance(drafter, target, drawn, batch_size=batch_size, attention=attention,
                                                   length_multiple=length_multiple, width=anchors_per_seq):
        lengths.append(acc)
        offsets_seen.append(answer_offsets(loss_mask, a))
        if categories:
            by_category[categories.get(ex["id"], "unknown")].append(acc)
    if not lengths:
        raise ValueError("no anchor with a full block inside a response: responses shorter than the block size")
    acc = torch.cat(lengths).float()
    rates = [(acc > k).float().mean().item() for k in range(1, b)]  # P(draft position k accepted)
    result = {"tau": acc.mean().item(), "blocks": int(acc.numel()), "accept_rate_by_position": rates}
    # tau by where the block starts in its answer: a benchmark decodes the first max_new_tokens of each
    # answer, these blocks come from anywhere in answers of up to ~3,000 tokens
    offset = torch.cat(offsets_seen)
    edges = [*ANSWER_OFFSET_BOUNDS, None]
    result["answer_offset_bounds"] = list(ANSWER_OFFSET_BOUNDS)
    result["tau_by_answer_offset"], result["blocks_by_answer_offset"] = [], []
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (offset >= low) & (offset < high if high is not None else True)
        # 0 for a bucket without blocks (a tau is >= 1; metrics.json holds no nulls)
        result["tau_by_answer_offset"].append(acc[inside].mean().item() if inside.any() else 0.0)
        result["blocks_by_answer_offset"].append(int(inside.sum()))
    for category, parts in sorted(by_category.items()):
        result[f"tau.{category}"] = torch.cat(parts).float().mean().item()
    return result


def first_answer(loss_mask: torch.Tensor) -> tuple[int, int] | None:
    """[start, end) of a sequence's first answer (its first run of trained tokens), or None."""
    mask = loss_mask.bool()
    trained = torch.nonzero(mask).flatten()
    if not trained.numel():
        return None
    start = int(trained[0])
    untrained = torch.nonzero(~mask[start:]).flatten()
    return start, start + (int(untrained[0]) if untrained.numel() else mask.numel() - start)


def walk_rounds(acceptance: list[int]) -> list[int]:
    """Decoding's rounds over per-anchor acceptance lengths: the first at anchor 0, each next one where the last
    stopped (the anchor + its length), while there is an anchor."""
    path, k = [], 0
    while k < len(acceptance):
        path.append(acceptance[k])
        k += acceptance[k]
    return path


def walk_acceptance(drafter: Drafter, target, examples: list[dict], *, max_tokens: int,
                    categories: dict[str, str] | None = None, batch_size: int = 1, attention: str = "sdpa",
                    length_multiple: int | None = None, no_repeat: bool = False, tree_nodes: int | None = None) -> dict:
    """Greedy speculative decoding's own rounds on (greedy) held-out answers, without decoding (`no_repeat`,
    `tree_nodes`: with decoding's rules of those names).

    `estimate_acceptance` draws its anchors anywhere in an answer; a decoding round starts where the last one
    stopped, i.e. right after the target overruled a draft (or after a whole block). Here every position of each
    example's first answer (up to `max_tokens` of it, as a benchmark decodes) gets its teacher-forced acceptance
    length, and the rounds are walked as decoding walks them: the first at the answer's first token (the
    prefill chose it), each next one at the previous anchor + its acceptance length, while a whole block fits
    in the answer. On the target's own greedy answer these are exactly the rounds `speculative_generate` runs
    with whole-block verifies (tested). Returns tau (tokens committed per round), the rounds, P(draft position k
    accepted) over the rounds, and tau per category."""
    b = drafter.block_size
    walked: list[tuple[dict, torch.Tensor]] = []
    for ex in examples:
        mask = torch.tensor(ex["loss_mask"])
        run = first_answer(mask)
        if run is None:
            continue
        start, end = run
        last = min(end - b, start + max_tokens - 1)  # the block a+1..a+b-1 inside the answer, a within max_tokens
        if last >= start:
            walked.append((ex, torch.arange(start, last + 1)))
    if not walked:
        raise ValueError(f"no answer holds a whole block of {b} tokens after its first token")
    rounds: list[torch.Tensor] = []
    by_category: dict[str, list[torch.Tensor]] = defaultdict(list)
    for ex, _, acc, _ in anchor_acceptance(drafter, target, walked, batch_size=batch_size, attention=attention,
                                           length_multiple=length_multiple, no_repeat=no_repeat, tree_nodes=tree_nodes):
        lengths = torch.tensor(walk_rounds(acc.tolist()))
        rounds.append(lengths)
        if categories:
            by_category[categories.get(ex["id"], "unknown")].append(lengths)
    acc = torch.cat(rounds).float()
    result = {"tau": acc.mean().item(), "rounds": int(acc.numel()),
              "accept_rate_by_position": [(acc > k).float().mean().item() for k in range(1, b)]}
    for category, parts in sorted(by_category.items()):
        result[f"tau.{category}"] = torch.cat(parts).float().mean().item()
    return result


__all__ = ["IGNORE", "LABELS", "FeatureCache", "anchor_acceptance", "anchored_examples", "batch_loss", "check_labels", "draft_blocks", "estimate_acceptance", "first_answer", "pad_anchors", "pad_right", "walk_acceptance", "walk_rounds",
           "target_labels", "target_pass", "teacher_states"]
