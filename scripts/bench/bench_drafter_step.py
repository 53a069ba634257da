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

`--cached` times the step of the node's later epochs instead: the target's features read from a
feature cache in the GPU's memory (`drafter_train.cache_features: device`, filled before timing),
block positions 1..`--loss-positions` trained (`drafter_train.loss_positions`), TF32, against that
step with its attention kernel in bf16 (`drafter_train.attention_bf16`), with the drafter's forward
through torch.compile (dynamic shapes) or under bf16 autocast, and with `--block-variants 9x64,9x112` the node's
cached step of a drafter with another block size and anchor count (each its own drafter and optimizer; blocks
carry the anchor + block-1 masks, so a 9-token block holding the trained positions 1-8 is ~9/16 of a 16-token
block's query rows: the gpu profile's block since 2026-12-04). With `--profile` it profiles the node's
cached step and every variant slower than it (bf16 autocast was ~3x slower, unexplained): the top ops by
GPU time and by host time, and the share of the step's wall time the GPU is busy (a host-bound step
leaves it idle between kernels).
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


def cached_variants(args, drafter, target, examples, batches, device, gen, autocast_forward) -> dict:
    """The node's step on a cached epoch (module docstring, `--cached`) and its variants, name -> (loss of a
    batch, TF32). The cache is filled here, so no timed step runs the target."""
    from qdflash.drafter.train import make_feature_cache

    cache = make_feature_cache("device" if device.type == "cuda" else "memory", Path("."), device)
    weights = loss_weights(16, 7.0, args.loss_positions)
    with torch.no_grad():
        for idx in batches:  # every batch a timed or warm-up step may read
            batch_loss(drafter, target, [examples[i] for i in idx], weights, args.anchors, gen, cache=cache)
    compiled_drafter = torch.compile(drafter, dynamic=True)

    def compiled(*a, **k):  # a function: draft_blocks tests `module or drafter`, and a module's truth is its len()
        return compiled_drafter(*a, **k)

    def loss(module=None):
        return lambda chunk: batch_loss(drafter, target, chunk, weights, args.anchors, gen, cache=cache, module=module)

    def bf16_attention(*a, **k):  # drafter_train.attention_bf16: the attention kernel in bf16, the rest as the node
        drafter.set_attention_dtype(torch.bfloat16)
        try:
            return drafter(*a, **k)
        finally:
            drafter.set_attention_dtype(None)

    out = {"node-cached": (loss(), True), "node-cached+bf16-attention": (loss(bf16_attention), True),
           "node-cached+compile": (loss(compiled), True), "node-cached+autocast": (loss(autocast_forward), True)}
    for block, anchors in args.block_variants:  # the same cache (target features do not depend on the block)
        other = init_drafter(target, block_size=block, num_layers=args.drafter_layers).to(device).train()
        other_weights = loss_weights(block, 7.0, args.loss_positions)
        out[f"node-cached@block{block}x{anchors}"] = (
            lambda chunk, other=other, w=other_weights, a=anchors: batch_loss(other, target, chunk, w, a, gen, cache=cache), True,
            torch.optim.AdamW(other.parameters(), lr=1e-4))
    return out


def block_variants(text: str) -> list[tuple[int, int]]:
    """`--block-variants` "9x64,9x112" -> [(9, 64), (9, 112)]: block sizes of at least 2 (the anchor and one draft),
    at least one anchor a sequence."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 2 or int(parts[1]) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: expected BLOCKxANCHORS, e.g. 9x112 (block >= 2, anchors >= 1)")
        out.append((int(parts[0]), int(parts[1])))
    return out


def profile_steps(run, device) -> dict:
    """torch.profiler over `run()` (a few steps): the top ops by GPU time and by host time, and how much of
    the wall time the GPU was busy (kernels' summed time / wall: well below 1 means the host sets the pace)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"wall_ms": round(wall * 1e3, 1), "gpu_busy_ms": round(gpu_us / 1e3, 1),
            "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
            "by_gpu_time": events.table(sort_by="self_device_time_total", row_limit=25).splitlines(),
            "by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=20).splitlines()}


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
    parser.add_argument("--cached", action="store_true", help="time the node's cached-epoch step and its variants (module docstring)")
    parser.add_argument("--loss-positions", type=int, default=8, help="--cached: block positions trained (null in the node: all)")
    parser.add_argument("--only", default=None, help="comma-separated variants to time (default: all)")
    parser.add_argument("--block-variants", type=block_variants, default=[],
                        help="--cached: BxA,... the node's cached step with a drafter of block B, A anchors a sequence")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.block_variants and not args.cached:
        parser.error("--block-variants times variants of the cached step: add --cached")
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
        loss_fn, tf32, *own = variant  # a variant of another drafter brings its optimizer
        opt = own[0] if own else optimizer
        torch.backends.cuda.matmul.allow_tf32 = tf32
        chunk = [examples[i] for i in idx]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(chunk)
        loss.backward()
        opt.step()
        torch.backends.cuda.matmul.allow_tf32 = False
        return chunk

    if args.cached:
        variants, base_name = cached_variants(args, drafter, target, examples, grouped_batches, device, gen, autocast_forward), "node-cached"
    else:
        base_name = "fp32+whole-logits"
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",") or k == base_name or "@block" in k}
    failed = {}
    for name, fn in list(variants.items()):  # allocate for the largest shapes first
        try:
            for idx in sorted(grouped_batches[: args.steps + 2], key=lambda b: -max(lengths[i] for i in b))[:1] + grouped_batches[:2]:
                step(idx, fn)  # (and two more shapes: a dynamic-shape compile settles before timing)
        except Exception as error:  # noqa: BLE001  a variant that cannot run here (e.g. no compiler) is reported, not fatal
            if name == base_name:
                raise
            failed[name] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"{name}: left out: {failed[name]}", flush=True)
            del variants[name]
    result["variants_left_out"] = failed
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
    if args.profile and device.type == "cuda" and args.cached:  # the node's step, and each variant slower than it
        slower = [name for name in variants if name != base_name
                  and result["steps"][name]["ms_median"] > result["steps"][base_name]["ms_median"]]
        for name in [base_name, *slower]:
            key = "profile" if name == base_name else f"profile[{name}]"
            result[key] = profile_steps(lambda name=name: [step(idx, variants[name]) for idx in grouped_batches[2:5]], device)
            print(name, flush=True)
            for line in result[key]["by_gpu_time"] + result[key]["by_host_time"]:
                print(line, flush=True)
            print({k: v for k, v in result[key].items() if not k.startswith("by_")}, flush=True)
    elif args.profile and device.type == "cuda":  # where a step's GPU time goes, by kernel, before and now
        from torch.profiler import ProfilerActivity, profile

        for name in ("fp32+whole-logits", "tf32+chunked-head"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for idx in grouped_batches[2:5]:
                    step(idx, variants[name])
                synchronize(device)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            print(name, "\n", table, flush=True)
            result[f"profile_top_ops[{name}]"] = table.splitlines()
    base = result["steps"][base_name]["ms_mean"]
    result[f"speedup_vs_{base_name}"] = {name: round(base / r["ms_mean"], 3) for name, r in result["steps"].items()}
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
