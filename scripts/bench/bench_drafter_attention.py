"""One drafter training step (forward + backward) with the dense SDPA mask vs flex_attention's block
mask, side by side in one process on the same batch; writes $OUT/bench_drafter_attention.json.

    python3 scripts/bench/bench_drafter_attention.py [--batch 16 --length 1024 --anchors 64 --layers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from qdflash.drafter import init_drafter
from qdflash.drafter.blocks import loss_weights, sample_anchors
from qdflash.drafter.train import draft_blocks, pad_anchors, target_pass
from qdflash.drafter.blocks import weighted_block_loss
from qdflash.models import load_target
from qdflash.tracking import environment


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    target = load_target(args.model, dtype="bfloat16", device="cuda")
    drafter = init_drafter(target, block_size=args.block, num_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, target.vocab_size, (args.batch, args.length), generator=g)
    loss_masks = torch.zeros_like(input_ids)
    loss_masks[:, args.length // 8 :] = 1
    anchors, valid = pad_anchors([sample_anchors(m, args.anchors, g) for m in loss_masks], args.anchors)
    features, _ = target_pass(target, input_ids.cuda(), drafter.config.target_layer_ids)
    weights = loss_weights(args.block, 7.0)
    result = {"config": vars(args), **environment()}
    logits = {}
    for kind in ("sdpa", "flex"):
        def step():
            out, targets = draft_blocks(drafter, features, input_ids, loss_masks, anchors, valid, attention=kind)
            loss = weighted_block_loss(out.flatten(0, 1), targets.flatten(0, 1), weights)
            loss.backward()
            return out

        torch.cuda.synchronize()
        started = time.perf_counter()
        step()  # includes compilation for flex
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        for _ in range(2):
            step()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.iters):
            out = step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - started) / args.iters * 1e3
        logits[kind] = out.detach().float()
        drafter.zero_grad(set_to_none=True)
        result[kind] = {"first_step_s": round(first, 3), "step_ms": round(ms, 2),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        print(kind, result[kind], flush=True)
    diff = (logits["flex"] - logits["sdpa"]).abs()
    result["max_abs_logit_diff"] = diff.max().item()
    result["argmax_agreement"] = (logits["flex"].argmax(-1) == logits["sdpa"].argmax(-1)).float().mean().item()
    result["speedup_flex_vs_sdpa"] = round(result["sdpa"]["step_ms"] / result["flex"]["step_ms"], 3)
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_drafter_attention.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("env.")}, indent=2))


if __name__ == "__main__":
    main()
