"""compress_drafter node: the stage-2 drafter on a W-bit grid (RTN or GPTQ, every linear incl. fc),
GPTQ calibrated on teacher-forced anchor blocks of the QAD target's own data.

Output (out_dir): `drafter/` (load_drafter rebuilds its QuantLinear layers), metrics.json with tau-hat
of the uncompressed and the compressed drafter against the same (QAD) target on the same held-out
blocks (overall, per category, per position), their ratio, how often the two draft the same token
(`draft_agreement`), and the drafter's weight bytes before and after. The sliding window is not a compression setting: it is chosen per benchmark (bench.window).
"""

from __future__ import annotations

import copy
import logging

import torch
from omegaconf import DictConfig

from ..data.jsonl import load_token_examples
from ..drafter import load_drafter, save_drafter
from ..drafter.compress import calibration_hessians, compress_drafter, draft_agreement, weight_bytes
from ..drafter.train import estimate_acceptance
from ..errors import QdflashError
from ..models import load_target
from ..quant.grid import GridSpec
from ..tracking import NodeRun
from ._app import stage
from .train_drafter import categories, hash_subset, record_acceptance

log = logging.getLogger("qdflash.compress_drafter")
SCALE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@stage("compress_drafter")
def main(cfg: DictConfig, run: NodeRun) -> None:
    c = cfg.compress
    if c.method not in ("rtn", "gptq"):
        raise QdflashError(f"compress.method={c.method!r}: expected rtn or gptq")
    spec = GridSpec(int(c.bits), int(c.group_size), bool(c.symmetric))
    target = load_target(cfg.model.name, dtype=cfg.dtype, device=cfg.device)
    drafter = load_drafter(cfg.drafter_dir, target)
    for linear in (m for m in drafter.modules() if isinstance(m, torch.nn.Linear)):
        spec.groups(linear.in_features, where=f"compress.group_size for the drafter's {linear.in_features}-wide inputs")
    heldout = hash_subset(load_token_examples(cfg.data_dir, "heldout"), c.eval.heldout_samples, "heldout-subset")
    cats = categories(cfg.data_dir)

    def acceptance(prefix: str) -> dict:
        result = estimate_acceptance(drafter, target, heldout, anchors_per_seq=c.eval.anchors_per_seq, seed=c.seed,
                                     categories=cats, batch_size=c.eval.batch_size)
        record_acceptance(run, prefix, result)
        return result

    before = acceptance("uncompressed")
    bytes_before = weight_bytes(drafter)
    hessians = None
    if c.method == "gptq":
        train = load_token_examples(cfg.data_dir, "train")
        if not train:
            raise QdflashError(f"{cfg.data_dir}/train.tokens.jsonl has no examples to calibrate on")
        chosen = hash_subset(train, min(c.calibration.sequences, len(train)), "drafter-calibration")
        chosen = [{"id": ex["id"], "input_ids": ex["input_ids"][: c.calibration.max_length],
                   "loss_mask": ex["loss_mask"][: c.calibration.max_length]} for ex in chosen]
        hessians, blocks = calibration_hessians(drafter, target, chosen, c.calibration.anchors_per_seq, c.seed,
                                                batch_size=c.eval.batch_size)
        run.metrics.update({"calibration.sequences": len(chosen), "calibration.blocks": blocks})
        log.info("calibrated on %d anchor blocks of %d sequences", blocks, len(chosen))
    original = copy.deepcopy(drafter)
    compress_drafter(drafter, spec, c.method, hessians, damp=float(c.damp), act_order=bool(c.act_order),
                     scale_dtype=SCALE_DTYPES[c.scale_dtype])
    after = acceptance("compressed")
    run.metrics["draft_agreement"] = draft_agreement(original, drafter, target, heldout, c.eval.anchors_per_seq, c.seed,
                                                   batch_size=c.eval.batch_size)
    log.info("the compressed drafter drafts the uncompressed one's token at %.1f%% of held-out block positions",
             100 * run.metrics["draft_agreement"])
    run.metrics.update({
        "compress.method": c.method, "compress.grid": spec.name, "compress.bits": spec.bits,
        "drafter.weight_bytes_16bit": bytes_before, "drafter.weight_bytes": weight_bytes(drafter),
        "tau_ratio": after["tau"] / before["tau"],
    })
    log.info("tau-hat %.3f -> %.3f (%s %s); weights %.2f -> %.2f MB", before["tau"], after["tau"], c.method, spec.name,
             bytes_before / 1e6, run.metrics["drafter.weight_bytes"] / 1e6)
    save_drafter(drafter, run.dir / "drafter")


if __name__ == "__main__":
    main()
