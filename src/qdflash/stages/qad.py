"""qad node: quantization-aware distillation that keeps the PTQ artifact's grid.

Before training, the student's step-0 held-out KL must equal the KL the PTQ node recorded (same
grid, same data): anything else means the student is not the PTQ model (a tampered or mismatched
artifact) and the run stops. After training the latent weights are rounded back onto the frozen
grid; the exported `weight_scale` tensors are checked bit-identical to the PTQ artifact's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ..data.jsonl import load_token_examples
from ..distill import compare_to_teacher, tf32_matmuls
from ..errors import QdflashError
from ..models import load_target, resolve_device, resolve_dtype
from ..distributed import all_sum, full_state_dict, setup, shard, shard_layers, wrap
from ..qad import (StudentHidden, cosine_lr, kl_sum_count, load_checkpoint, make_student_trainable, pack_sequences,
                   save_checkpoint)
from ..quant.apply import quant_linears
from ..quant.export import load_quantized, save_quantized
from ..tracking import NodeRun, content_digest, source_digest
from ._app import stage
from .quantize_target import record_comparison

log = logging.getLogger("qdflash.qad")


def check_step0(kl_now: float, kl_ptq: float, tolerance: float, ptq_dir: Path) -> None:
    if abs(kl_now - kl_ptq) > tolerance * kl_ptq + 1e-12:
        raise QdflashError(
            f"step-0 check failed: the student's held-out KL is {kl_now:.8g} but the PTQ artifact {ptq_dir} "
            f"recorded {kl_ptq:.8g} (relative tolerance {tolerance}). The student is not the PTQ model: "
            f"the artifact was modified, or data_dir / eval.heldout_samples differ from the quantize_target run."
        )


def resume_key(cfg: DictConfig, ptq_dir: Path, world_size: int, dtype: torch.dtype) -> str:
    """What a checkpoint must have been made from to be resumed: every input of the run, by content.
    The PTQ artifact's path is not enough: a re-run quantize_target (after quant.* changed) writes
    other weights to the same folder, and a resume from the old ones would publish the old QAD."""
    inputs = {
        "qad": OmegaConf.to_container(cfg.qad, resolve=True), "model": str(cfg.model.name), "dtype": str(dtype),
        "world_size": world_size, "code": source_digest(),
        "ptq": content_digest(ptq_dir / "model", ptq_dir / "metrics.json"),
        "data": content_digest(*(Path(cfg.data_dir) / f"{split}.tokens.jsonl" for split in ("train", "heldout"))),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


# Tests only: the process kills itself (SIGKILL, as `kill -9` does: no cleanup runs) right after the
# checkpoint of this step is written, so a resume can be checked against an uninterrupted run.
KILL_AFTER_STEP = "QDFLASH_QAD_KILL_AFTER_STEP"


def grid_identical(before: dict[str, tuple], after: dict[str, tuple]) -> bool:
    return before.keys() == after.keys() and all(
        torch.equal(b[0], a[0]) and b[0].dtype == a[0].dtype and (b[1] is None) == (a[1] is None)
        and (b[1] is None or torch.equal(b[1], a[1]))
        for b, a in ((before[k], after[k]) for k in before)
    )


def evaluate(run: NodeRun, teacher, student, heldout, cfg, step: int, prefix: str = "qad") -> dict:
    was_training = student.training
    student.eval()
    result = compare_to_teacher(teacher, student, heldout, chunk_tokens=cfg.eval.chunk_tokens)
    student.train(was_training)
    run.log({"heldout/kl": result["kl"], "heldout/top1": result["top1_agreement"], "heldout/ppl": result["ppl"]}, step=step)
    log.info("step %d: held-out KL %.5f  top-1 %.4f  ppl %.3f", step, result["kl"], result["top1_agreement"], result["ppl"])
    return result


@stage("qad")
def main(cfg: DictConfig, run: NodeRun) -> None:
    qad = cfg.qad
    ptq_dir = Path(cfg.ptq_dir)
    ptq_metrics_path = ptq_dir / "metrics.json"
    if not ptq_metrics_path.is_file():
        raise QdflashError(f"{ptq_metrics_path} not found: ptq_dir must be a quantize_target output")
    ptq_metrics = json.loads(ptq_metrics_path.read_text())
    world, device = setup(str(resolve_device(cfg.device)))  # one process per GPU under torchrun (qdflash.distributed)
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    if qad.batch_size % world.size:
        raise QdflashError(f"qad.batch_size={qad.batch_size} must be a multiple of the {world.size} processes")
    torch.manual_seed(qad.seed)
    random.seed(qad.seed)

    teacher = load_target(cfg.model.name, dtype=dtype, device=device).model
    for p in teacher.parameters():
        p.requires_grad_(False)
    student, tokenizer, spec = load_quantized(ptq_dir / "model", device=device, dtype=dtype)
    grid_before = {n: (m.weight_scale.clone(), None if m.weight_zero_point is None else m.weight_zero_point.clone())
                   for n, m in quant_linears(student).items()}

    heldout = load_token_examples(cfg.data_dir, "heldout", cfg.eval.heldout_samples)
    rows = pack_sequences(load_token_examples(cfg.data_dir, "train"), qad.seq_len, qad.loss_on)
    if not rows:
        raise QdflashError(f"{cfg.data_dir}: not enough training tokens for one packed sequence of {qad.seq_len}")
    run.metrics.update({"qad.packed_rows": len(rows), "qad.grid": spec.name, "ptq.kl": ptq_metrics["quant.kl"],
                        "ptq.top1_agreement": ptq_metrics["quant.top1_agreement"], "ptq.ppl": ptq_metrics["quant.ppl"],
                        "bf16.ppl": ptq_metrics["bf16.ppl"]})

    latents = make_student_trainable(student, reference=teacher)
    step0 = evaluate(run, teacher, student, heldout, cfg, step=0)
    check_step0(step0["kl"], ptq_metrics["quant.kl"], qad.step0_tolerance, ptq_dir)
    run.metrics["qad.step0_kl"] = step0["kl"]

    if qad.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    fsdp = world.distributed and qad.parallel == "fsdp"
    if fsdp:  # the latents (and their optimizer state) split over the ranks; the frozen rest stays whole
        shard_layers(student.model.layers)
        latents = [p for p in student.parameters() if p.requires_grad]  # fully_shard replaced them
        hidden = StudentHidden(student)
    else:
        hidden = wrap(StudentHidden(student), world)  # DDP over the trained part: averages the latents' gradients
    run.metrics.update({"qad.world_size": world.size, "qad.parallel": qad.parallel if world.distributed else "none"})
    optimizer = torch.optim.AdamW(latents, lr=qad.lr, weight_decay=qad.weight_decay)
    fingerprint = resume_key(cfg, ptq_dir, world.size, dtype)
    ckpt = Path(f"{cfg.out_dir}.ckpt") / "state.pt"
    if fsdp:
        log.info("fsdp: resumable checkpoints are not written (each rank holds a shard of the latents)")
    order = random.Random(qad.seed)  # the batch order: its state is saved and restored with the checkpoint
    curve: list[float] = []  # training KL per step, the resumed steps' included (restored from the checkpoint)
    rows_here = 0  # packed rows this process trained on (a 1/N share of each batch under torchrun)
    start, progress = (0, {}) if fsdp else load_checkpoint(ckpt, latents, optimizer, fingerprint)
    if start:
        order.setstate(progress["order"])
        curve, rows_here = list(progress["curve"]), int(progress["rows_here"])
        log.info("resuming from %s at step %d", ckpt, start)
    run.metrics["qad.resumed_from_step"] = start
    warmup = max(1, round(qad.warmup_ratio * qad.steps))
    tf32 = bool(qad.tf32) and device.type == "cuda"
    run.metrics["qad.tf32"] = int(tf32)
    student.train()
    train_s = 0.0  # the training steps' wall time, held-out evaluations and checkpoints excluded
    tokens_here = 0
    bar = tqdm(range(start, qad.steps), desc="qad", unit="step", initial=start, total=qad.steps)
    for step in bar:
        step_start = time.perf_counter()
        lr = cosine_lr(step, qad.steps, warmup, qad.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        picks = [rows[order.randrange(len(rows))] for _ in range(qad.batch_size)]  # the whole batch, on every rank
        mine = shard(picks, world)
        rows_here += len(mine)
        ids = torch.stack([p[0] for p in mine]).to(device)
        mask = torch.stack([p[1] for p in mine]).to(device)
        with tf32_matmuls(tf32):  # the loss and its backward only: evaluate() stays exact fp32
            total, count = kl_sum_count(teacher, student, ids, mask, temperature=qad.temperature,
                                        chunk_tokens=qad.chunk_tokens, hidden=hidden)
            count_all = float(all_sum(torch.tensor(float(count), device=device)).clamp_min(1.0))  # the whole batch's tokens
            optimizer.zero_grad(set_to_none=True)
            (total / count_all * world.size).backward()  # DDP averages over ranks: x size gives the 1-process gradient
        loss = all_sum(total) / count_all
        grad_norm = torch.nn.utils.clip_grad_norm_(latents, qad.grad_clip)
        optimizer.step()
        loss_value = loss.item()  # synchronizes: the step's time is complete below
        train_s += time.perf_counter() - step_start
        tokens_here += int(ids.numel())
        run.log({"train/kl": loss_value, "train/lr": lr, "train/grad_norm": grad_norm.item()}, step=step + 1)
        curve.append(round(loss_value, 7))
        bar.set_postfix(kl=f"{loss_value:.4f}")
        if (step + 1) % qad.eval_every == 0 and step + 1 < qad.steps:
            evaluate(run, teacher, student, heldout, cfg, step=step + 1)
        if (step + 1) % qad.checkpoint_every == 0 and not fsdp and world.main:  # one writer; every rank resumes from it
            save_checkpoint(ckpt, step + 1, latents, optimizer, fingerprint,
                            {"order": order.getstate(), "curve": curve, "rows_here": rows_here})
            if os.environ.get(KILL_AFTER_STEP) == str(step + 1):
                os.kill(os.getpid(), signal.SIGKILL)

    run.metrics.update({"qad.train_kl_curve": curve, "qad.rows_per_process": rows_here,
                        # this run's steps only (a resumed run's earlier steps are not timed here)
                        "qad.train_s": round(train_s, 2), "qad.steps_timed": qad.steps - start,
                        "qad.tokens_per_s": round(tokens_here / train_s, 1) if train_s else None})
    if train_s:
        log.info("trained %d steps in %.1f s: %.0f packed tokens/s per process (tf32 %s)", qad.steps - start, train_s,
                 tokens_here / train_s, "on" if tf32 else "off")
    if fsdp:  # rank 0 rounds, evaluates and exports a whole student with the trained latents
        state = full_state_dict(student)
        if not world.main:
            return
        student, tokenizer, spec = load_quantized(ptq_dir / "model", device=device, dtype=dtype)
        make_student_trainable(student, reference=teacher)
        student.load_state_dict(state)
    for module in quant_linears(student).values():
        module.freeze()  # latent weights -> ints on the frozen grid
    final = evaluate(run, teacher, student, heldout, cfg, step=qad.steps)
    record_comparison(run, "quant", final)
    grid_after = {n: (m.weight_scale, m.weight_zero_point) for n, m in quant_linears(student).items()}
    if not grid_identical(grid_before, grid_after):
        raise RuntimeError("QAD changed the quantization grid (scales / zero points); this is a bug")
    run.metrics["grid.scales_identical_to_ptq"] = 1
    run.metrics["qad.kl_recovered_fraction"] = round(1.0 - final["kl"] / max(ptq_metrics["quant.kl"], 1e-12), 4)
    save_quantized(student, tokenizer, run.dir / "model", extra={
        "node": "qad", "ptq_dir": str(ptq_dir), "grid": spec.name, "source_model": cfg.model.name,
        "config": OmegaConf.to_container(qad, resolve=True)})
    shutil.rmtree(ckpt.parent, ignore_errors=True)  # finished: the checkpoint is no longer needed


if __name__ == "__main__":
    main()
