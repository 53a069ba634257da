"""Export a drafter in the DFlash checkpoint format (z-lab's `dflash` package, `DFlashDraftModel`;
the format vLLM and SGLang read as a DFlash speculator):

    out_dir/
      config.json         a Qwen3 config (`model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`)
                          with the drafter's sizes, plus `block_size`, `num_target_layers` and
                          `dflash_config: {mask_token_id, target_layer_ids}`; a windowed drafter has
                          `layer_types` (all "sliding_attention"), `sliding_window` and `is_causal: false`;
                          a compressed drafter has a compressed-tensors `quantization_config`
                          (pack-quantized, as quantized targets: qdflash.quant.export); our own notes
                          under "qdflash"
      model.safetensors   the drafter's weights under the format's names (`fc.weight`,
                          `hidden_norm.weight`, `layers.N.self_attn.q_proj.weight`, `layers.N.mlp.*`, ...)

What the format cannot say, and the export therefore refuses (QdflashError):
- a learned mask vector (`mask_token_id: null`): DFlashDraftModel embeds mask positions as the target's
  embedding of `mask_token_id`, so drafters meant for export use a mask token of the target's vocabulary;
- a sliding window smaller than the block: dflash's sliding mask is symmetric (|q - k| < window) and
  also applies inside the block, where our drafter sees the whole block; from window >= block_size on
  the two masks are the same.
The rest maps one to one: the drafter is a Qwen3 decoder layer stack (q/k norms, rotate-half RoPE at
absolute positions, SwiGLU MLP, no biases) whose keys / values are [context features, block], with the
target's embedding and LM head, which both sides borrow from the target.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from ..errors import QdflashError
from ..quant.export import (
    CONFIG_FILE,
    EXTRA_KEY,
    WEIGHTS_FILE,
    _check_linear,
    _compress_linear,
    _shared_spec,
    add_quantization_config,
    export_tensor,
)
from ..quant.quantlinear import QuantLinear
from .model import Drafter

ARCHITECTURE = "DFlashDraftModel"

# our module names -> DFlashDraftModel's (per layer: Qwen3DFlashDecoderLayer's)
_TOP = {"fc": "fc", "context_norm": "hidden_norm", "norm": "norm"}
_LAYER = {
    "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


def dflash_module_name(name: str) -> str:
    """The DFlash name of one of our drafter's modules (`layers.0.q_proj` -> `layers.0.self_attn.q_proj`)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise QdflashError(f"export_dflash: drafter module {name!r} has no place in the DFlash format")


def check_exportable(drafter: Drafter, window: int | None) -> None:
    """Refuse what DFlashDraftModel cannot represent (module docstring)."""
    c = drafter.config
    if c.mask_token_id is None:
        raise QdflashError(
            "export_dflash: this drafter uses a learned mask vector (mask_token_id: null), which the DFlash "
            "format has no place for (it embeds mask positions as the target's embedding of dflash_config."
            "mask_token_id); train drafters meant for export with a mask_token_id of the target's vocabulary"
        )
    if window is not None and window < c.block_size:
        raise QdflashError(
            f"export_dflash: window={window} is smaller than block_size={c.block_size}; DFlash's sliding mask "
            "also applies inside the block (|q - k| < window), so it would differ from this drafter's; "
            "export with no window or one >= block_size"
        )


def dflash_config(drafter: Drafter, target, window: int | None = None, dtype: torch.dtype | None = None) -> dict:
    """config.json of the export (without the quantization config)."""
    from transformers import Qwen3Config

    check_exportable(drafter, window)
    c = drafter.config
    layered = dict(layer_types=["sliding_attention"] * c.num_layers, sliding_window=window,
                   use_sliding_window=True) if window is not None else {}
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, hidden_act="silu", rms_norm_eps=c.rms_norm_eps, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=getattr(target.config, "max_position_embeddings", 32768),
        tie_word_embeddings=False, **layered,
    ).to_dict()
    config.update(
        architectures=[ARCHITECTURE], model_type="qwen3", block_size=c.block_size,
        num_target_layers=c.target_num_layers,
        dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        dtype=str(dtype or drafter.norm.weight.dtype).removeprefix("torch."),
    )
    if window is not None:
        # dflash reads a sliding layer as causal unless told otherwise; our drafter is non-causal
        config["is_causal"] = False
    return config


def dflash_state_dict(drafter: Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under DFlash names; QuantLinear layers as pack-quantized tensors."""
    out = {}
    for name, module in drafter.named_modules():
        if isinstance(module, QuantLinear):
            _check_linear(name, module)
            tensors = _compress_linear(module)
        elif isinstance(module, nn.Linear) or name in _TOP or name.rsplit(".", 1)[-1] in _LAYER:
            tensors = {k: v for k, v in module.state_dict().items() if "." not in k}
        else:
            continue
        if not tensors:
            continue
        new = dflash_module_name(name)
        out.update({f"{new}.{k}": export_tensor(k, v.detach().cpu(), dtype).contiguous() for k, v in tensors.items()})
    return out


def export_dflash(drafter: Drafter, target, out_dir, *, window: int | None = None,
                  dtype: torch.dtype | None = None, extra: dict | None = None) -> Path:
    """Write `drafter` (bound to `target`) as a DFlash checkpoint folder (module docstring); `dtype`
    of its dense tensors (default: the drafter's own), `window` the sliding window it is served with.
    Atomic: written into a temporary sibling folder renamed into place."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    dtype = dtype or drafter.norm.weight.dtype
    config = dflash_config(drafter, target, window, dtype)
    if drafter.mask_embedding is not None:  # unreachable after check_exportable; kept as the invariant
        raise QdflashError("export_dflash: a learned mask vector cannot be exported")
    quantized = {name: m for name, m in drafter.named_modules() if isinstance(m, QuantLinear)}
    state = dflash_state_dict(drafter, dtype)
    config[EXTRA_KEY] = {**(extra or {}), "window": window, "quantized": bool(quantized)}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        if quantized:
            plain = [dflash_module_name(n) for n, m in drafter.named_modules() if type(m) is nn.Linear]
            add_quantization_config(tmp, _shared_spec(quantized), plain)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """python -m qdflash.drafter.export --results R --out O (the selected variant's drafter), or
    --target T --drafter D [--window W] --out O; --dtype of the dense tensors (default bfloat16)."""
    import argparse
    import sys

    from ..models import load_target
    from .model import load_drafter

    p = argparse.ArgumentParser(prog="python -m qdflash.drafter.export", description="a drafter in the DFlash checkpoint format")
    p.add_argument("--results", help="an experiment folder: export its selected variant's drafter (with its window)")
    p.add_argument("--target", help="or: the target the drafter was trained for (preset, folder)")
    p.add_argument("--drafter", help="and the drafter folder (drafter/<name>/drafter)")
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", help="the dense tensors' dtype (bfloat16, float16, float32)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        extra = {}
        if args.results:
            from ..serve import selected_variant

            chosen = selected_variant(args.results)
            target_path, drafter_path = chosen["target"], chosen["drafter"]
            window = chosen["window"] if args.window is None else args.window
            extra["variant"] = chosen["variant"]
        elif args.target and args.drafter:
            target_path, drafter_path, window = args.target, args.drafter, args.window
        else:
            raise QdflashError("export: give --results, or --target and --drafter")
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise QdflashError(f"export: --dtype {args.dtype!r} is not a torch floating dtype (bfloat16, float16, float32)")
        target = load_target(str(target_path), device="cpu", dtype="float32")
        drafter = load_drafter(drafter_path, target)
        extra.update(target=str(target_path), drafter=str(drafter_path))
        out = export_dflash(drafter, target, args.out, window=window, dtype=dtype, extra=extra)
    except QdflashError as err:
        print(f"\nqdflash export failed: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out} (DFlash format: dflash.DFlashDraftModel.from_pretrained, vLLM / SGLang speculators)")


__all__ = ["ARCHITECTURE", "check_exportable", "dflash_config", "dflash_module_name", "dflash_state_dict", "export_dflash"]


if __name__ == "__main__":
    main()
