"""Two small launches of a Qwen3.5-4B step against what they replace, alone, at the model's shapes: the GDN layer's
gated RMSNorm (`kernels.gated_norm`) against the model's module compiled by inductor, and the decode attention
merging its chunks in its own launch (`decode_attention(counts=)`) against its separate merge kernel.

    python scripts/bench/bench_layer_tails.py --out tails.json

Why: a compiled decode step is ~400 launches, most a few microseconds of latency at one row; each of these removes
one launch a layer (24 GDN layers, 8 attention layers a step), and what matters is whether the launch left does its
work in less time than the two did. Each is timed for a decode step (T = 1) and a verify block (T = 16) inside a CUDA
graph over enough layers' inputs that they come from HBM (`copies_past_l2`), and its output checked against the
other's (`*_max_abs`; the merge's split counters left zero: `counters_zero`).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from qdflash.kernels import copies_past_l2, graph_ms
from qdflash.kernels.decode_attention import batch1_splits, decode_attention
from qdflash.kernels.gated_norm import gated_rms_norm

GDN = dict(heads=32, dv=128, qkvz=2 * 16 * 128 + 32 * 128 + 32 * 128)  # value heads, their dim, a qkvz row's width
ATTENTION = dict(heads=16, kv_heads=4, d=256)


def gated_norm_rows(t: int, device, reps: int, dtype=torch.bfloat16) -> dict:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    h, d = GDN["heads"], GDN["dv"]
    g = torch.Generator().manual_seed(t)
    norm = Qwen3_5RMSNormGated(d, eps=1e-6).to(device, dtype)
    norm.weight.data.normal_(1.0, 0.2)
    layers = copies_past_l2(t * GDN["qkvz"] * 2)
    os = [torch.randn(t, h, d, generator=g).to(device) for _ in range(layers)]
    rows = [torch.randn(t, GDN["qkvz"], generator=g).to(device, dtype) for _ in range(layers)]
    zs = [r[:, -h * d:] for r in rows]  # the z tail of a qkvz projection's rows

    def module(o, z):
        return norm(o.to(z.dtype), z.reshape(t, h, d)).reshape(t, -1)

    compiled = torch.compile(module, dynamic=False)
    out = {"layers": layers}
    ours, theirs = gated_rms_norm(os[0], zs[0], norm.weight, norm.variance_epsilon), compiled(os[0], zs[0])
    out["max_abs"] = float((ours.float() - theirs.float()).abs().max())
    out["equal_fraction"] = float((ours == theirs).float().mean())
    out["kernel_us"] = graph_ms(lambda: [gated_rms_norm(o, z, norm.weight, norm.variance_epsilon)
                                         for o, z in zip(os, zs)], reps) / layers * 1e3
    out["inductor_us"] = graph_ms(lambda: [compiled(o, z) for o, z in zip(os, zs)], reps) / layers * 1e3
    return out


def attention_rows(t: int, context: int, device, reps: int, dtype=torch.bfloat16) -> dict:
    a = ATTENTION
    g = torch.Generator().manual_seed(t)
    max_len = context + 16
    cache_bytes = 2 * a["kv_heads"] * max_len * a["d"] * 2
    layers = copies_past_l2(cache_bytes)
    ks = [torch.randn(a["kv_heads"], max_len, a["d"], generator=g).to(device, dtype) for _ in range(layers)]
    vs = [torch.randn(a["kv_heads"], max_len, a["d"], generator=g).to(device, dtype) for _ in range(layers)]
    qs = [torch.randn(t, a["heads"], a["d"], generator=g).to(device, dtype) for _ in range(layers)]
    lengths = torch.arange(context + 1, context + t + 1, device=device)
    splits = batch1_splits(max_len)
    counts = torch.zeros(4096, dtype=torch.int32, device=device)

    def run(i, merged):
        k, v = ks[i][None].expand(t, *ks[i].shape), vs[i][None].expand(t, *vs[i].shape)
        return decode_attention(qs[i], k, v, lengths, splits=splits, counts=counts if merged else None)

    out = {"layers": layers, "splits": splits}
    out["max_abs"] = float((run(0, True).float() - run(0, False).float()).abs().max())
    out["merged_us"] = graph_ms(lambda: [run(i, True) for i in range(layers)], reps) / layers * 1e3
    out["separate_us"] = graph_ms(lambda: [run(i, False) for i in range(layers)], reps) / layers * 1e3
    out["counters_zero"] = not bool(counts.any())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20, help="graph replays a time is the median of")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it times launches in CUDA graphs)")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
              "context": args.context}
    for t in (1, 16):
        result[f"gated_norm.t{t}"] = gated_norm_rows(t, "cuda", args.reps)
        result[f"attention.t{t}"] = attention_rows(t, args.context, "cuda", args.reps)
        print(json.dumps({k: v for k, v in result.items() if k.endswith(f"t{t}")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
