"""quantize_target node: post-training quantization of the target (RTN or GPTQ) on the W-bit grid.

Output (out_dir): `model/` (compressed-tensors pack-quantized export + `model/dense/` 16-bit twin),
metrics.json with held-out KL / top-1 agreement / perplexity against the 16-bit target.
"""

from __future__ import annotations

import copy
import logging

import torch
from omegaconf import DictConfig, OmegaConf

from ..data.jsonl import load_token_examples
from ..distill import compare_to_teacher
from ..models import load_target, resolve_dtype
from ..quant.apply import quant_linears, quantize_weights, replace_linears, select_linears
from ..quant.export import round_like_export, save_quantized
from ..quant.grid import GridSpec
from ..tracking import NodeRun
from ._app import stage

log = logging.getLogger("qdflash.quantize_target")


def grid_spec(quant: DictConfig) -> GridSpec:
    return GridSpec(bits=int(quant.bits), group_size=int(quant.group_size), symmetric=bool(quant.symmetric))


def record_comparison(run: NodeRun, prefix: str, result: dict) -> None:
    for key, value in result.items():
        run.metrics[f"{prefix}.{key}"] = value  # full precision: the QAD step-0 check compares against it
    log.info("%s: KL %.5f  top-1 %.4f  ppl %.3f (%d tokens)", prefix, result["kl"], result["top1_agreement"], result["ppl"], result["tokens"])


@stage("quantize_target")
def main(cfg: DictConfig, run: NodeRun) -> None:
    quant = cfg.quant
    spec = grid_spec(quant)
    target = load_target(cfg.model.name, dtype=cfg.dtype, device=cfg.device)
    model = target.model
    teacher = copy.deepcopy(model)  # untouched 16-bit copy (no second load / GGUF check)
    names = select_linears(model, list(quant.include), list(quant.exclude))
    heldout = load_token_examples(cfg.data_dir, "heldout", cfg.eval.heldout_samples)
    calibration = [
        torch.tensor([ex["input_ids"][: quant.calibration.max_tokens]])
        for ex in load_token_examples(cfg.data_dir, "train", quant.calibration.samples)
    ] if quant.method == "gptq" else None

    weights = quantize_weights(
        model, names, spec, method=quant.method, calibration=calibration, damp=quant.gptq.damp,
        act_order=quant.gptq.act_order, clip_search=quant.clip_search,
        scale_dtype=resolve_dtype(quant.scale_dtype, target.device),
    )
    student = replace_linears(model, weights)
    round_like_export(student)  # measure the artifact as exported: its unquantized tensors in 16 bits
    run.metrics.update({"quant.method": quant.method, "quant.grid": spec.name, "quant.bits": spec.bits,
                        "quant.group_size": spec.group_size, "quant.symmetric": int(spec.symmetric),
                        "quant.linears": len(quant_linears(student)), "quant.kept_16bit_linears": sum(
                            isinstance(m, torch.nn.Linear) for m in student.modules())})
    record_comparison(run, "bf16", compare_to_teacher(teacher, teacher, heldout, chunk_tokens=cfg.eval.chunk_tokens))
    record_comparison(run, "quant", compare_to_teacher(teacher, student, heldout, chunk_tokens=cfg.eval.chunk_tokens))
    save_quantized(student, target.tokenizer, run.dir / "model", extra={
        "node": "quantize_target", "method": quant.method, "grid": spec.name,
        "source_model": cfg.model.name, "config": OmegaConf.to_container(quant, resolve=True)})


if __name__ == "__main__":
    main()
