"""Where a drafter training step's time goes at the Qwen2.5-Coder-0.5B shape, side by side in one
process (random weights: speed does not depend on their values; core wheels only, no download).

    python3 scripts/bench/bench_drafter_step.py --out $OUT/drafter_step.json     # the H200
    python3 scripts/bench/bench_drafter_step.py --layers 2 --steps 2 --batch 2 --max-length 256   # CPU: the code path

Training sequences get the lengths of the H200 study's multi-turn data (lognormal, median 387, mean
550 tokens, cut at --max-length; results/published/2026-12-01-h200-qwen-drafter-recipe). Timed,
each synchronized, median over --steps batches:
- the target forward of a random batch with its LM head (what training ran before: [n, L, vocab]
  logits it never used) and without it (`target_pass(greedy=False)`);
- the block mask built on the CPU and copied, against built on the GPU;
- whole steps (loss, backward, AdamW; fp32 drafter weights, as the node) on length-grouped batches
  (drafter_train.group_by_length), the variants taking turns batch by batch: the step as the node
  ran it before (fp32 forward, loss over the whole [rows, vocab] logits), with the chunked LM head +
  cross-entropy on the trained rows only, and with that with TF32 matmuls (the node's step now,
  drafter_train.tf32), that with its chunk softmax in fp32 as it was before `blocks.PROBS_IN_BF16`
  (bf16 for a bf16 head), or with the drafter's forward under bf16 autocast; `--anchor-sweep 128,256`
  also times the node's step with more anchors per sequence. Sequences per second is what sets how
  much data a training minute sees;
- with `--profile`, three steps before and now under torch.profiler: the top kernels by GPU time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from qdflash.drafter import init_drafter  # noqa: E402
from qdflash.drafter import blocks  # noqa: E402
from qdflash.drafter.blocks import batch_attention_mask, loss_weights, weighted_block_loss_parts  # noqa: E402
from qdflash.drafter.train import batch_anchors, batch_loss, draft_blocks, padded_batch, target_pass  # noqa: E402
from qdflash.models import synchronize  # noqa: E402
from qdflash.stages.train_drafter import epoch_batches  # noqa: E402
from qdflash.tracking import environment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_round import QWEN25_05B, Target  # noqa: E402  (the shape and the target stand-in, one definition)


def timed(fn, device, reps):
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--group", type=int, default=32, help="group_by_length runs (batches)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--anchor-sweep", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                        help="also time the node's step with these anchors per sequence (e.g. 128,256)")
    parser.add_argument("--profile", action="store_true", help="also profile 3 steps before / now (torch.profiler, by kernel)")
    parser.add_argument("--only", default=None, help="comma-separated variants to time (default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    target = Target(Qwen2ForCausalLM(Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": args.layers})).to(device=device, dtype=dtype).eval())
    for p in target.model.parameters():
        p.requires_grad_(False)
    drafter = init_drafter(target, block_size=16, num_layers=args.drafter_layers).train()  # fp32 weights, as the node
    g = torch.Generator().manual_seed(0)
    mu, sigma = math.log(387), math.sqrt(2 * math.log(550 / 387))  # median 387, mean 550 (the study's data)
    lengths = [int(min(args.max_length, max(64, math.exp(mu + sigma * torch.randn(1, generator=g).item())))) for _ in range(args.examples)]
    examples = []
    for i, n in enumerate(lengths):
        prompt = max(8, n // 3)
        examples.append({"id": f"s{i}", "input_ids": torch.randint(100, 150000, (n,), generator=g).tolist(),
                         "loss_mask": [0] * prompt + [1] * (n - prompt)})
    layer_ids = drafter.config.target_layer_ids
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "config": vars(args), "mean_length": round(sum(lengths) / len(lengths), 1),
              "median_length": sorted(lengths)[len(lengths) // 2], "env": environment()}

    random_batches = list(itertools.islice(epoch_batches(len(examples), args.batch, 0), 1))
    grouped_batches = list(itertools.islice(epoch_batches(len(examples), args.batch, 0, lengths, args.group), args.steps + 5))
    batch = [examples[i] for i in random_batches[0]]
    anchors = batch_anchors(batch, args.anchors, torch.Generator().manual_seed(0))
    input_ids, _, anchor_t, _ = padded_batch(batch, anchors)
    ids = input_ids.to(device)
    target_pass(target, ids, layer_ids)  # warm-up
    result["target_forward_with_lm_head_ms"] = timed(lambda: target_pass(target, ids, layer_ids), device, 5)
    result["target_forward_features_only_ms"] = timed(lambda: target_pass(target, ids, layer_ids, greedy=False), device, 5)
    result["first_batch_padded_tokens"] = int(ids.numel())
    length = ids.shape[1]
    result["mask_cpu_and_copy_ms"] = timed(lambda: batch_attention_mask(anchor_t, 16, length).to(device), device, 5)
    result["mask_on_device_ms"] = timed(lambda: batch_attention_mask(anchor_t.to(device), 16, length), device, 5)

    weights = loss_weights(16, 7.0)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def autocast_forward(*a, **k):  # the drafter's forward (only) in bf16 under autocast, weights fp32
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return drafter(*a, **k)

    def old_loss(chunk, anchors_per_seq):  # what the node ran before: fp32 forward, loss over whole [.., V] logits
        anchor_lists = batch_anchors(chunk, anchors_per_seq, gen)
        input_ids, loss_masks, anchor_t, valid = padded_batch(chunk, anchor_lists)
        features = target_pass(target, input_ids.to(device), layer_ids, greedy=False)[0]
        logits, targets = draft_blocks(drafter, features, input_ids, loss_masks, anchor_t, valid)
        total, weight = weighted_block_loss_parts(logits.flatten(0, 1), targets.flatten(0, 1), weights)
        return total / weight

    def fp32_probs_loss(chunk):  # the chunked head as it was: its softmax written in fp32 for a bf16 head
        before, blocks.PROBS_IN_BF16 = blocks.PROBS_IN_BF16, False
        try:
            return batch_loss(drafter, target, chunk, weights, args.anchors, gen)
        finally:
            blocks.PROBS_IN_BF16 = before

    # name -> (loss of a batch, TF32 fp32 matmuls): fp32 = exact fp32 matmuls (no tensor cores), tf32 =
    # fp32 weights and activations with tensor-core matmuls, autocast = bf16 matmuls and attention
    variants = {
        "fp32+whole-logits": (lambda chunk: old_loss(chunk, args.anchors), False),
        "fp32+chunked-head": (lambda chunk: batch_loss(drafter, target, chunk, weights, args.anchors, gen), False),
        "tf32+chunked-head": (lambda chunk: batch_loss(drafter, target, chunk, weights, args.anchors, gen), True),
        "tf32+chunked-head+fp32-probs": (fp32_probs_loss, True),
        "autocast+chunked-head": (lambda chunk: batch_loss(drafter, target, chunk, weights, args.anchors, gen, module=autocast_forward), False),
    }
    for more in args.anchor_sweep:
        variants[f"tf32+chunked-head@{more}anchors"] = (
            lambda chunk, more=more: batch_loss(drafter, target, chunk, weights, more, gen), True)

    def step(idx, variant):
        loss_fn, tf32 = variant
        torch.backends.cuda.matmul.allow_tf32 = tf32
        chunk = [examples[i] for i in idx]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(chunk)
        loss.backward()
        optimizer.step()
        torch.backends.cuda.matmul.allow_tf32 = False
        return chunk

    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",") or k == "fp32+whole-logits"}
    for name, fn in variants.items():  # allocate for the largest shapes first
        for idx in sorted(grouped_batches[: args.steps + 2], key=lambda b: -max(lengths[i] for i in b))[:1]:
            step(idx, fn)
    # the variants take turns, batch by batch (length-grouped batches, as the node trains), so none
    # runs on a colder allocator or on other batches
    timing = {name: [] for name in variants}
    for k in range(2, args.steps + 2):
        for name, fn in variants.items():
            synchronize(device)
            start = time.perf_counter()
            chunk = step(grouped_batches[k], fn)
            synchronize(device)
            timing[name].append(((time.perf_counter() - start) * 1e3, len(chunk) * max(len(ex["input_ids"]) for ex in chunk),
                                 sum(len(ex["input_ids"]) for ex in chunk)))
    result["steps"] = {}
    for name, rows in timing.items():
        times = [t for t, _, _ in rows]
        result["steps"][name] = {"ms_median": round(statistics.median(times), 1), "ms_mean": round(sum(times) / len(times), 1),
                                 "sequences_per_s": round(args.batch * 1e3 / (sum(times) / len(times)), 3),
                                 "padded_tokens_per_step": round(sum(p for _, p, _ in rows) / len(rows)),
                                 "real_tokens_per_step": round(sum(r for _, _, r in rows) / len(rows))}
        print(name, result["steps"][name], flush=True)
    if args.profile and device.type == "cuda":  # where a step's GPU time goes, by kernel, before and now
        from torch.profiler import ProfilerActivity, profile

        for name in ("fp32+whole-logits", "tf32+chunked-head"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for idx in grouped_batches[2:5]:
                    step(idx, variants[name])
                synchronize(device)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            print(name, "\n", table, flush=True)
            result[f"profile_top_ops[{name}]"] = table.splitlines()
    base = result["steps"]["fp32+whole-logits"]["ms_mean"]
    result["speedup_vs_fp32_whole_logits"] = {name: round(base / r["ms_mean"], 3) for name, r in result["steps"].items()}
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
