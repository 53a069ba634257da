"""train_drafter node: DFlash drafter stage 1 (from scratch, against the 16-bit target) or stage 2
(weights-only warm start from stage 1, against the QAD target's dense twin, on its own data).

Output: `drafter/` (load_drafter), metrics.json with teacher-forced acceptance on the held-out greedy
responses: tau (mean acceptance length, bonus included), per category, per block position; stage 2
also records the stage-1 drafter's tau against the same (QAD) target before any adaptation.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ..data.jsonl import load_token_examples, read_jsonl
from ..drafter import init_drafter, load_drafter, save_drafter
from ..drafter.blocks import loss_weights
from ..drafter.train import FeatureCache, block_loss, estimate_acceptance
from ..errors import QdflashError
from ..models import load_target
from ..qad import cosine_lr
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.train_drafter")


def categories(data_dir) -> dict[str, str]:
    return {row["id"]: row["category"] for row in read_jsonl(Path(data_dir) / "heldout.jsonl")}


def record_acceptance(run: NodeRun, prefix: str, result: dict) -> None:
    for key, value in result.items():
        run.metrics[f"{prefix}.{key}"] = value
    per_cat = ", ".join(f"{k[4:]} {v:.3f}" for k, v in result.items() if k.startswith("tau."))
    log.info("%s: tau %.3f over %d blocks (%s)", prefix, result["tau"], result["blocks"], per_cat)


@stage("train_drafter")
def main(cfg: DictConfig, run: NodeRun) -> None:
    train_cfg = cfg.drafter_train
    if cfg.stage not in (1, 2):
        raise QdflashError(f"stage={cfg.stage}: expected 1 or 2")
    if cfg.stage == 2 and not cfg.init_from:
        raise QdflashError("stage 2 needs init_from=<stage-1 drafter folder> (weights-only warm start)")
    torch.manual_seed(train_cfg.seed)
    target = load_target(cfg.model.name, dtype=cfg.dtype, device=cfg.device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    shape = {k: v for k, v in OmegaConf.to_container(cfg.drafter, resolve=True).items() if v is not None}
    drafter = load_drafter(cfg.init_from, target) if cfg.init_from else init_drafter(target, **shape)
    drafter.train()
    run.metrics.update({"drafter.parameters": drafter.num_parameters(), "drafter.layers": drafter.config.num_layers,
                        "drafter.block_size": drafter.block_size, "drafter.target_layer_ids": drafter.config.target_layer_ids,
                        "target.name": cfg.model.name, "stage": int(cfg.stage)})
    heldout = load_token_examples(cfg.data_dir, "heldout", train_cfg.heldout_samples)
    cats = categories(cfg.data_dir)
    train = [
        {"id": ex["id"], "input_ids": ex["input_ids"][: train_cfg.max_length], "loss_mask": ex["loss_mask"][: train_cfg.max_length]}
        for ex in load_token_examples(cfg.data_dir, "train")
    ]
    if not train:
        raise QdflashError(f"{cfg.data_dir}/train.tokens.jsonl has no examples")

    def acceptance() -> dict:
        return estimate_acceptance(drafter, target, heldout, anchors_per_seq=train_cfg.eval_anchors_per_seq,
                                   seed=train_cfg.seed, categories=cats)

    def evaluate(prefix: str) -> None:
        record_acceptance(run, prefix, acceptance())

    if cfg.stage == 2:
        evaluate("stage1_on_this_target")  # the warm start, before adaptation

    weights = loss_weights(drafter.block_size, train_cfg.gamma)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)  # fresh in stage 2
    warmup = max(1, round(train_cfg.warmup_ratio * train_cfg.steps))
    order = random.Random(train_cfg.seed)
    generator = torch.Generator().manual_seed(train_cfg.seed)
    # cached features live beside the output (not inside it) and are removed when the node succeeds
    cache = FeatureCache(Path(f"{cfg.out_dir}.features")) if train_cfg.cache_features else None
    curve: list[float] = []
    for step in tqdm(range(train_cfg.steps), desc=f"drafter stage {cfg.stage}", unit="step"):
        lr = cosine_lr(step, train_cfg.steps, warmup, train_cfg.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for _ in range(train_cfg.batch_size):  # one sequence at a time: variable lengths, no padding
            loss = block_loss(drafter, target, train[order.randrange(len(train))], weights,
                              train_cfg.anchors_per_seq, generator, cache)
            if loss is None:
                continue
            (loss / train_cfg.batch_size).backward()
            total, count = total + loss.item(), count + 1
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
        optimizer.step()
        curve.append(round(total / max(count, 1), 5))
        run.log({"train/loss": curve[-1], "train/lr": lr, "train/grad_norm": grad_norm.item()}, step=step + 1)
        if (step + 1) % train_cfg.eval_every == 0 and step + 1 < train_cfg.steps:
            run.log({"heldout/tau": acceptance()["tau"]}, step=step + 1)
    run.metrics["train.loss_curve"] = curve
    if cache is not None:
        run.metrics.update({"train.feature_cache_hits": cache.hits, "train.feature_cache_misses": cache.misses})
        shutil.rmtree(cache.folder, ignore_errors=True)
    evaluate("final")
    save_drafter(drafter, run.dir / "drafter")


if __name__ == "__main__":
    main()
