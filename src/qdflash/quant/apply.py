"""Quantize a whole model: choose the linears by name patterns, run RTN or GPTQ on each, and swap
them for `QuantLinear` modules."""

from __future__ import annotations

import fnmatch
import logging
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import QdflashError
from .gptq import HessianAccumulator, gptq_quantize, rtn_quantize
from .grid import GridSpec, mse_clip_search
from .quantlinear import QuantizedWeight, QuantLinear

log = logging.getLogger(__name__)

# docs/recipe.md: 16-bit stay the embeddings / LM head, norms (not linears), Gated DeltaNet in_proj_a,
# in_proj_b and conv1d (a Conv1d, not a Linear), and a vision tower if the checkpoint has one.
DEFAULT_EXCLUDE = ("lm_head", "*embed*", "*.in_proj_a", "*.in_proj_b", "*visual*", "*vision*")


def select_linears(model: nn.Module, include: Iterable[str] = ("*",), exclude: Iterable[str] = DEFAULT_EXCLUDE) -> list[str]:
    """Names of the nn.Linear modules matching an include pattern and no exclude pattern (fnmatch on
    the module's full name). A pattern that matches no linear at all is an error: it is a typo."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for kind, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in linears) and pattern not in DEFAULT_EXCLUDE:
                raise QdflashError(
                    f"quant.{kind} pattern {pattern!r} matches no linear layer of this model "
                    f"(linears look like {linears[:3]} ... {linears[-2:]})"
                )
    chosen = [
        name for name in linears
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(fnmatch.fnmatchcase(name, p) for p in exclude)
    ]
    if not chosen:
        raise QdflashError("the quant include/exclude patterns leave no linear layer to quantize")
    return chosen


@contextmanager
def capture_hessians(model: nn.Module, names: list[str]):
    """Within the block, every forward through the named linears adds its inputs to their Hessian
    accumulators (yielded: name -> HessianAccumulator). Whatever runs the model decides the inputs:
    token batches for a target, teacher-forced anchor blocks for a drafter."""
    modules = dict(model.named_modules())
    acc = {name: HessianAccumulator(modules[name].in_features) for name in names}
    hooks = [modules[name].register_forward_pre_hook(lambda _m, args, n=name: acc[n].add(args[0])) for name in names]
    try:
        yield acc
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def collect_hessians(model: nn.Module, names: list[str], batches: list[torch.Tensor], desc="calibration") -> dict[str, torch.Tensor]:
    """One forward pass over the calibration batches with a hook on every chosen linear (the 16-bit
    model's activations: "one-shot" GPTQ, which fits small models; see quant.gptq for the per-layer math)."""
    device = next(model.parameters()).device
    with capture_hessians(model, names) as acc:
        for ids in tqdm(batches, desc=desc, unit="batch"):
            model(input_ids=ids.to(device))
    return {name: a.hessian() for name, a in acc.items()}


def quantize_weights(
    model: nn.Module,
    names: list[str],
    spec: GridSpec,
    *,
    method: str,
    calibration: list[torch.Tensor] | None = None,
    hessians: dict[str, torch.Tensor] | None = None,
    damp: float = 0.01,
    act_order: bool = False,
    clip_search: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, QuantizedWeight]:
    modules = dict(model.named_modules())
    for name in names:
        spec.groups(modules[name].in_features, where=name)  # fail before any work on a bad group size
    if method not in ("rtn", "gptq"):
        raise QdflashError(f"quant.method={method!r} is not one of rtn, gptq")
    if method == "gptq" and hessians is None:
        if not calibration:
            raise QdflashError("GPTQ needs calibration batches (quant.calibration.samples > 0)")
        hessians = collect_hessians(model, names, calibration)
    hessians = dict(hessians or {})
    out = {}
    for name in tqdm(names, desc=f"{method} {spec.name}", unit="linear"):
        # on the weight's own device: GPTQ's column loop is ~10 small ops per input column, which in fp64
        # on a GPU machine's few shared CPU cores dominated the whole node
        # (results/published/2026-12-01-h200-qwen-dag). The results go back to the CPU, as before.
        w = modules[name].weight.detach().float()
        clip = mse_clip_search(w, spec, scale_dtype=scale_dtype) if clip_search else 1.0
        if method == "rtn":
            q = rtn_quantize(w, spec, scale_dtype=scale_dtype, clip=clip)
        else:
            q = gptq_quantize(w, hessians.pop(name).to(w.device), spec, damp=damp, act_order=act_order,
                              scale_dtype=scale_dtype, clip=clip)
        out[name] = QuantizedWeight(q.q.cpu(), q.scale.cpu(), None if q.zero is None else q.zero.cpu(), q.spec)
    return out


def replace_linears(model: nn.Module, weights: dict[str, QuantizedWeight]) -> nn.Module:
    """Swap each named nn.Linear for a QuantLinear holding its ints and scales (in place)."""
    for name, qw in weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_quantized(getattr(parent, child), qw))
    return model


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
