"""train_drafter node: DFlash drafter stage 1 (from scratch, against the 16-bit target) or stage 2
(weights-only warm start from stage 1, against the QAD target's dense twin, on its own data).

Output: `drafter/` (load_drafter), metrics.json with teacher-forced acceptance on the held-out greedy
responses: tau (mean acceptance length, bonus included), per category, per block position; stage 2
also records the stage-1 drafter's tau against the same (QAD) target before any adaptation.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ..data.jsonl import load_token_examples, read_jsonl
from ..drafter import init_drafter, load_drafter, save_drafter
from ..drafter.blocks import loss_weights
from ..data.split import unit_interval
from ..distributed import all_sum, full_state_dict, setup, shard, shard_module, wrap
from ..drafter.train import (batch_anchors, batch_loss, check_labels, estimate_acceptance, feature_cache_folder,
                             make_feature_cache, round_up, walk_acceptance)
from ..errors import QdflashError
from ..models import load_target, resolve_device, synchronize
from ..qad import cosine_lr
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.train_drafter")
LOG_EVERY = 50  # steps between reads of the pending losses (one host-device sync each; see `flush`)
FLEX_LENGTH_MULTIPLE = 128  # flex_attention's tile size


def categories(data_dir) -> dict[str, str]:
    return {row["id"]: row["category"] for row in read_jsonl(Path(data_dir) / "heldout.jsonl")}


def record_acceptance(run: NodeRun, prefix: str, result: dict) -> None:
    for key, value in result.items():
        run.metrics[f"{prefix}.{key}"] = value
    per_cat = ", ".join(f"{k[4:]} {v:.3f}" for k, v in result.items() if k.startswith("tau."))
    log.info("%s: tau %.3f over %d blocks (%s)", prefix, result["tau"], result["blocks"], per_cat)
    if "tau_by_answer_offset" in result:
        bounds = [*result["answer_offset_bounds"], None]
        log.info("%s: tau by answer offset: %s", prefix, ", ".join(
            f"{low}-{'' if high is None else high - 1}: {t:.3f} ({n} blocks)" for low, high, t, n in
            zip(bounds[:-1], bounds[1:], result["tau_by_answer_offset"], result["blocks_by_answer_offset"])))


def hash_subset(rows: list[dict], n: int, salt: str) -> list[dict]:
    """The first `n` rows in a fixed hash order of their ids: every category mixed in, and the subset
    of a smaller n always inside the subset of a larger one."""
    return sorted(rows, key=lambda ex: unit_interval(ex["id"], salt))[:n]


def training_examples(data_dir, max_length: int, max_examples: int | None) -> list[dict]:
    """Training sequences cut to `max_length`. With `max_examples`, a subset in a fixed hash order of
    the ids, so smaller subsets are nested in larger ones and mix every category (scaling runs)."""
    rows = load_token_examples(data_dir, "train")
    if not rows:
        raise QdflashError(f"{data_dir}/train.tokens.jsonl has no examples")
    if max_examples is not None:
        if max_examples > len(rows):
            raise QdflashError(f"drafter_train.max_examples={max_examples} but {data_dir}/train.tokens.jsonl has only {len(rows)} examples")
        rows = hash_subset(rows, max_examples, "drafter-subset")
    cut = [{"id": ex["id"], "input_ids": ex["input_ids"][:max_length], "loss_mask": ex["loss_mask"][:max_length]} for ex in rows]
    # an anchor a >= 1 needs a trained token at a + 1 (drafter.blocks.sample_anchors): a cut that
    # leaves none would train nothing and still report a drafter
    if not any(any(ex["loss_mask"][2:]) for ex in cut):
        first = min((ex["loss_mask"].index(1) for ex in rows if 1 in ex["loss_mask"]), default=None)
        raise QdflashError(f"drafter_train.max_length={max_length} leaves no trained (assistant) token in any sequence of "
                           f"{data_dir}/train.tokens.jsonl, so no block can be trained"
                           + (f"; the earliest answer starts at token {first}: use a max_length well above it" if first is not None else ""))
    return cut


def training_steps(train_cfg: DictConfig, examples: int, stage: int = 1) -> int:
    """`steps`, or with `epochs` set: enough steps for that many passes over the examples. Stage 2 runs its own
    schedule (RECIPE: a fresh optimizer), so `stage2_epochs`, where set, replaces `epochs` there."""
    epochs = train_cfg.epochs
    if stage == 2 and train_cfg.get("stage2_epochs") is not None:
        epochs = train_cfg.stage2_epochs
    if epochs is None:
        return int(train_cfg.steps)
    return max(1, math.ceil(epochs * examples / train_cfg.batch_size))


def epoch_ends(steps: int, examples: int, batch_size: int) -> list[int]:
    """The step count after which each epoch (a pass over the examples) is complete; the last entry is
    `steps` itself (a fractional last epoch counts as one)."""
    per_epoch = examples / batch_size
    ends = [math.ceil(e * per_epoch - 1e-9) for e in range(1, math.ceil(steps / per_epoch - 1e-9) + 1)]
    return sorted({min(end, steps) for end in ends})


def epoch_batches(count: int, batch_size: int, seed: int, lengths: list[int] | None = None, group: int = 0):
    """Index batches without replacement: each epoch a fresh permutation (an endless iterator).

    With `lengths` and `group` > 1 (drafter_train.group_by_length), each run of `group` batches of the
    permuted order is sorted by sequence length, cut into batches, and those are yielded in random
    order: a batch holds sequences of similar lengths, so padding to its longest one wastes little of
    the target forward (self-distilled conversations run from ~100 to 3,072 tokens), and sequences
    are still drawn without replacement, epoch after epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    if lengths is None or group <= 1:
        while True:
            if len(order) < batch_size:
                fresh = list(range(count))
                rng.shuffle(fresh)
                order += fresh
            yield order[:batch_size]
            del order[:batch_size]
    pending: list[list[int]] = []
    while True:
        while len(order) < batch_size * group and not pending:  # one sorted run of `group` batches at a time
            fresh = list(range(count))
            rng.shuffle(fresh)
            order += fresh
        if not pending:
            run = sorted(order[: batch_size * group], key=lambda j: lengths[j])
            del order[: batch_size * group]
            pending = [run[i : i + batch_size] for i in range(0, len(run), batch_size)]
            rng.shuffle(pending)
        yield pending.pop()


def attention_kind(setting: str, device: torch.device) -> str:
    """sdpa: a dense boolean mask through SDPA's fused kernels (the default: at the gpu profile's
    shape it measured faster than flex_attention, whose compile also costs seconds, because the LM
    head, not attention, dominates a drafter step: results/published/2026-12-01-h200-drafter-step);
    flex: the block-sparse mask, for long contexts where attention does dominate; auto: flex on a
    GPU, sdpa on the CPU."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if setting not in ("flex", "sdpa"):
        raise QdflashError(f"drafter_train.attention={setting!r}: expected auto, flex or sdpa")
    return setting


def use_tf32(setting: bool, device: torch.device) -> bool:
    """drafter_train.tf32 on a GPU: the fp32 drafter's matmuls run on tensor cores (TF32, 10-bit
    mantissa products, fp32 sums) instead of exact fp32 SIMT kernels, for this process; its weights,
    gradients and AdamW state stay fp32. (bf16 autocast measured slower than either:
    results/published/2026-12-01-h200-drafter-step.) The CPU has no TF32: the setting does nothing there."""
    on = setting and device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = on
    return on


@stage("train_drafter")
def main(cfg: DictConfig, run: NodeRun) -> None:
    train_cfg = cfg.drafter_train
    if cfg.stage not in (1, 2):
        raise QdflashError(f"stage={cfg.stage}: expected 1 or 2")
    if cfg.stage == 2 and not cfg.init_from:
        raise QdflashError("stage 2 needs init_from=<stage-1 drafter folder> (weights-only warm start)")
    torch.manual_seed(train_cfg.seed)
    if train_cfg.cache_features == "device":
        # tens of GB of per-sequence tensors of every length, kept while the batches' come and go: segments that
        # grow in place instead of fixed blocks (read when CUDA first allocates, so before the target loads);
        # the H200 run that measured this cache ran with it (results/published/2026-12-03-h200-drafter-12k)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    world, device = setup(str(resolve_device(cfg.device)))  # one process per GPU under torchrun (qdflash.distributed)
    if train_cfg.batch_size % world.size:
        raise QdflashError(f"drafter_train.batch_size={train_cfg.batch_size} must be a multiple of the {world.size} processes")
    target = load_target(cfg.model.name, dtype=cfg.dtype, device=device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    shape = {k: v for k, v in OmegaConf.to_container(cfg.drafter, resolve=True).items() if v is not None}
    def build():
        return load_drafter(cfg.init_from, target) if cfg.init_from else init_drafter(target, **shape)

    drafter = build()
    drafter.train()
    parallel = train_cfg.get("parallel", "ddp") if world.distributed else "none"
    fsdp = parallel == "fsdp"
    if fsdp:  # FSDP: weights, gradients and optimizer state split over the processes
        shard_module(drafter, drafter.layers)
        model = drafter
    else:
        model = wrap(drafter, world)  # DDP: averages the gradients over the processes
    run.metrics.update({"train.world_size": world.size, "train.parallel": parallel,
                        "drafter.parameters": drafter.num_parameters(), "drafter.layers": drafter.config.num_layers,
                        "drafter.block_size": drafter.block_size, "drafter.target_layer_ids": drafter.config.target_layer_ids,
                        "target.name": cfg.model.name, "stage": int(cfg.stage)})
    heldout = hash_subset(load_token_examples(cfg.data_dir, "heldout"), train_cfg.heldout_samples, "heldout-subset")
    cats = categories(cfg.data_dir)
    train = training_examples(cfg.data_dir, train_cfg.max_length, train_cfg.max_examples)
    steps = training_steps(train_cfg, len(train), int(cfg.stage))
    attention = attention_kind(train_cfg.attention, drafter.norm.weight.device)
    tf32 = use_tf32(bool(train_cfg.tf32), drafter.norm.weight.device)
    attention_bf16 = bool(train_cfg.attention_bf16)
    drafter.set_attention_dtype(torch.bfloat16 if attention_bf16 else None)
    ends = epoch_ends(steps, len(train), int(train_cfg.batch_size))
    run.metrics.update({"train.examples": len(train), "train.steps": steps, "train.attention": attention,
                        "train.epochs": round(steps * int(train_cfg.batch_size) / len(train), 4),
                        "train.batch_size": int(train_cfg.batch_size), "train.anchors_per_seq": int(train_cfg.anchors_per_seq),
                        "train.tf32": int(tf32), "train.attention_bf16": int(attention_bf16),
                        "train.tokens": sum(len(ex["input_ids"]) for ex in train)})
    log.info("%d training sequences (%d tokens), %d steps of %d sequences, %s attention", len(train),
             run.metrics["train.tokens"], steps, train_cfg.batch_size, attention)

    def acceptance() -> dict:
        return estimate_acceptance(drafter, target, heldout, anchors_per_seq=train_cfg.eval_anchors_per_seq,
                                   seed=train_cfg.seed, categories=cats, batch_size=train_cfg.batch_size,
                                   attention=attention, length_multiple=FLEX_LENGTH_MULTIPLE if attention == "flex" else None)

    def evaluate(prefix: str) -> None:
        record_acceptance(run, prefix, acceptance())

    walk_tokens = int(train_cfg.get("walk_tokens") or 0)

    def walk() -> dict:
        """Decoding's own rounds on the held-out answers (random anchors overstate them)."""
        return walk_acceptance(drafter, target, heldout, max_tokens=walk_tokens, categories=cats,
                               batch_size=train_cfg.batch_size, attention=attention,
                               length_multiple=FLEX_LENGTH_MULTIPLE if attention == "flex" else None)

    if cfg.stage == 2:
        evaluate("stage1_on_this_target")  # the warm start, before adaptation

    loss_positions = train_cfg.get("loss_positions")
    weights = loss_weights(drafter.block_size, train_cfg.gamma, None if loss_positions is None else int(loss_positions))
    run.metrics["train.loss_positions"] = drafter.block_size - 1 if loss_positions is None else int(loss_positions)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)  # fresh in stage 2
    warmup = max(1, round(train_cfg.warmup_ratio * steps))
    # flex: one static batch shape (compiled once); sdpa: pad each batch to its own longest sequence
    pad_length = round_up(train_cfg.max_length, FLEX_LENGTH_MULTIPLE) if attention == "flex" else None
    group = int(train_cfg.get("group_by_length", 0) or 0)
    batches = epoch_batches(len(train), train_cfg.batch_size, train_cfg.seed,
                            lengths=[len(ex["input_ids"]) for ex in train], group=group)
    run.metrics["train.group_by_length"] = group
    labels = check_labels(str(train_cfg.get("labels", "data")))  # before any step: batch_loss would say so only later
    run.metrics["train.labels"] = labels
    generator = torch.Generator().manual_seed(train_cfg.seed)
    # cached features live beside the output (not inside it) and are removed when the node succeeds; or in RAM
    # (memory), or in the training device's memory (device)
    cache = make_feature_cache(train_cfg.cache_features,
                               feature_cache_folder(cfg.out_dir, cfg.model.name, cfg.dtype, drafter.config.target_layer_ids),
                               device)
    run.metrics["train.feature_cache"] = str(train_cfg.cache_features).lower()
    curve: list[float] = []
    # tau-hat after each epoch, and the training seconds by then: what more passes over the same data buy
    tau_by_epoch: list[float] = []
    walk_by_epoch: list[float] = []  # the walked rounds' tau after each epoch (drafter_train.walk_tokens)
    seconds_by_epoch: list[float] = []
    skipped = 0  # steps whose batch had no trained block
    sequences_here = 0  # sequences this process trained on (a 1/N share of each batch under torchrun)
    # each step's loss and gradient norm stay on the device until a flush reads them back in one copy: a
    # .item() per step would make the host wait for every step's backward and optimizer before it could
    # prepare the next batch (padding, anchors, blocks), leaving the GPU idle meanwhile
    pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        values = torch.stack([torch.stack([loss.float(), norm.float()]) for _, _, loss, norm in pending]).cpu().tolist()
        for (at, rate, _, _), (loss_value, norm_value) in zip(pending, values):
            curve.append(round(loss_value, 5))
            run.log({"train/loss": curve[-1], "train/lr": rate, "train/grad_norm": norm_value}, step=at + 1)
        pending.clear()

    synchronize(drafter.norm.weight.device)
    started, eval_seconds = time.perf_counter(), 0.0
    for step in tqdm(range(steps), desc=f"drafter stage {cfg.stage}", unit="step"):
        lr = cosine_lr(step, steps, warmup, train_cfg.lr, float(train_cfg.get("min_lr_ratio", 0.0)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        batch = [train[i] for i in next(batches)]
        anchors = batch_anchors(batch, train_cfg.anchors_per_seq, generator)  # the whole batch's, on every rank

        mine = shard(batch, world)
        sequences_here += len(mine)

        def forward_backward():
            parts = batch_loss(drafter, target, mine, weights, train_cfg.anchors_per_seq, None, cache,
                               attention, pad_length, anchor_lists=shard(anchors, world), module=model, parts=True,
                               labels=labels)
            if parts is None:
                if world.distributed:  # the other ranks wait in the all-reduce: stop with the reason instead
                    raise QdflashError(f"step {step}: rank {world.rank}'s slice of the batch has no trained block; "
                                       "use a larger drafter_train.batch_size")
                return None
            total, weight = parts
            weight_all = all_sum(weight).clamp_min(1e-9)  # the whole batch's weight: the 1-process mean loss
            (total / weight_all * world.size).backward()  # DDP averages over ranks: x size gives the sum
            return all_sum(total) / weight_all

        try:
            loss = forward_backward()
        except Exception as err:  # noqa: BLE001 - only the first step of `auto` may fall back, and it says so
            if not (step == 0 and attention == "flex" and train_cfg.attention == "auto"):
                raise
            log.warning("flex_attention failed on this machine (%s: %s); using the SDPA mask instead", type(err).__name__, err)
            run.metrics["train.flex_error"] = f"{type(err).__name__}: {err}"[:500]
            attention, pad_length = "sdpa", None
            run.metrics["train.attention"] = attention
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward()
        if loss is None:  # no sequence of the batch has a trained token
            skipped += 1
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
        optimizer.step()
        if hasattr(grad_norm, "full_tensor"):  # FSDP's sharded norm (a DTensor): its value, still on the device
            grad_norm = grad_norm.full_tensor()
        pending.append((step, lr, loss.detach(), grad_norm.detach()))
        if step == 0:  # includes compiling flex_attention: reported apart from the steady steps
            flush()
            run.metrics["train.first_step_seconds"] = round(time.perf_counter() - started, 2)
        elif (step + 1) % LOG_EVERY == 0:
            flush()
        epoch_end = step + 1 in ends and step + 1 < steps  # (the last one is the final evaluation below)
        if epoch_end or ((step + 1) % train_cfg.eval_every == 0 and step + 1 < steps):
            flush()
            synchronize(drafter.norm.weight.device)
            eval_started = time.perf_counter()
            trained_seconds = eval_started - started - eval_seconds
            tau = acceptance()["tau"]
            run.log({"heldout/tau": tau}, step=step + 1)
            eval_seconds += time.perf_counter() - eval_started
            if epoch_end:
                tau_by_epoch.append(round(tau, 4))
                seconds_by_epoch.append(round(trained_seconds, 2))
                if walk_tokens:  # an evaluation too: its time is not training time
                    walk_started = time.perf_counter()
                    walk_by_epoch.append(round(walk()["tau"], 4))
                    eval_seconds += time.perf_counter() - walk_started
                log.info("epoch %d of %d: tau %.3f%s (%.0f s of training)", len(tau_by_epoch), len(ends), tau,
                         f", walked rounds' tau {walk_by_epoch[-1]:.3f}" if walk_tokens else "", trained_seconds)
    flush()
    synchronize(drafter.norm.weight.device)
    # wall time of the training steps alone (target forwards included; periodic evaluations excluded)
    run.metrics["train.seconds"] = round(time.perf_counter() - started - eval_seconds, 2)
    run.metrics["train.lr_last"] = lr  # the schedule's end (drafter_train.min_lr_ratio x lr; ~0 by default)
    run.metrics["train.eval_seconds"] = round(eval_seconds, 2)
    run.metrics["train.loss_curve"] = curve
    run.metrics["train.skipped_steps"] = skipped
    if not curve:
        raise QdflashError(f"none of the {steps} training steps had a trained block (drafter_train.max_length, anchors_per_seq "
                           f"and the data's answers leave none); the drafter is untrained")
    run.metrics["train.sequences_per_process"] = sequences_here
    if torch.cuda.is_available() and torch.device(device).type == "cuda":  # what a cache on the device leaves room for
        run.metrics["train.cuda_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if cache is not None:
        run.metrics.update({"train.feature_cache_hits": cache.hits, "train.feature_cache_misses": cache.misses})
        if cache.folder is not None:
            shutil.rmtree(cache.folder, ignore_errors=True)
        cache = None  # a cache in RAM or on the device is freed now, not after the final evaluation and the save:
        if torch.device(device).type == "cuda":  # the GPU is shared with other nodes (share_device)
            torch.cuda.empty_cache()
    evaluate("final")
    if walk_tokens:
        walked = walk()
        run.metrics.update({f"final.walk.{key}": value for key, value in walked.items()})
        run.metrics["final.walk.max_tokens"] = walk_tokens
        run.metrics["train.walk_tau_by_epoch"] = walk_by_epoch + [round(walked["tau"], 4)]
        log.info("final: the rounds decoding runs over the first %d tokens of each held-out answer: tau %.3f over %d "
                 "rounds (%s); P(draft k accepted) %s", walk_tokens, walked["tau"], walked["rounds"],
                 ", ".join(f"{k[4:]} {v:.3f}" for k, v in walked.items() if k.startswith("tau.")),
                 " ".join(f"{r:.3f}" for r in walked["accept_rate_by_position"]))
    run.metrics["train.tau_by_epoch"] = tau_by_epoch + [round(run.metrics["final.tau"], 4)]
    run.metrics["train.seconds_by_epoch"] = seconds_by_epoch + [run.metrics["train.seconds"]]
    if fsdp:  # rank 0 saves a whole drafter with the trained weights gathered from every rank
        state = full_state_dict(drafter)
        if not world.main:
            return
        drafter = build()
        drafter.load_state_dict(state)
    save_drafter(drafter, run.dir / "drafter")


if __name__ == "__main__":
    main()
