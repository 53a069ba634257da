"""Response generation side by side on the same prompts: transformers' static compiled `generate`
(what prepare_data ran before issue 20) against batched generation on the lean engine (GPU measurement).

    python scripts/bench/bench_generate.py --model smollm2-135m --batches 64,256 --engine-batches 1024,2048 \
        --out $OUT/bench_generate-smollm2.json [--profile 256]

For every batch in --batches: 2 x batch prompts (so finished rows are refilled), the same sampling
(T 0.7, top-p 0.8, top-k 20, keyed by prompt index: both backends draw the same noise), the same
max_new_tokens, through
- transformers: `generate_batched` with a static cache of max_prompt + max_new positions, prompts
  sorted by length, every batch padded to the full size (its decode step is compiled once); one
  untimed run on one batch compiles it;
- engine: `BatchGenerator` with `batch` rows; one untimed run on the same prompts captures its graphs;
- with --compile, also the engine with its decode step compiled by torch.compile (inductor) inside
  the graphs (`engine_compiled`; its untimed run compiles, and its `warmup_s` says what that cost).
Then --repeats timed runs of each, alternating, synchronized; the median is reported. --engine-batches
run the engine alone (batches where transformers' static generate is too slow to wait for). Bytes
per second count what the engine's decode steps read: every weight once per step, plus the KV
positions each step's attention reads (rows x cache length read). --profile B: at batch B, the graph
replay time of one decode step (CUDA events, median of 20) against the device time of its kernels run
eagerly (torch.profiler), by kernel: what bounds the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

from qdflash.data.chat import render_prompt_ids
from qdflash.data.generate import Sampling, generate_batched
from qdflash.data.sources import load_source
from qdflash.data.split import mostly_ascii, select_prompts
from qdflash.engine import build_engine
from qdflash.engine.batched import BatchGenerator
from qdflash.models import load_target, synchronize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="64,256", help="transformers and engine, side by side")
    parser.add_argument("--engine-batches", default="", help="the engine alone")
    parser.add_argument("--prompts-per-row", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--prefill-tokens", type=int, default=32768, help="the engine's rows x chunk per prefill forward")
    parser.add_argument("--profile", type=int, default=0, help="profile one decode step at this batch")
    parser.add_argument("--compile", action="store_true", help="also the engine with its decode step compiled (torch.compile inside the graph)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    target = load_target(args.model)
    tok, device = target.tokenizer, target.device
    side = [int(b) for b in args.batches.split(",") if b]
    alone = [int(b) for b in args.engine_batches.split(",") if b]
    need = args.prompts_per_row * max(side + alone)
    pool = load_source("sharegpt").pool
    ids: dict[str, list[int]] = {}

    def accept(item) -> bool:
        if not mostly_ascii(item.prompt):
            return False
        ids[item.id] = render_prompt_ids(tok, item.prompt)
        return len(ids[item.id]) <= args.max_prompt_tokens

    chosen, _ = select_prompts(pool, text=lambda i: i.prompt, n=need, accept=accept)
    all_prompts = [ids[i.id] for i in chosen]
    print(f"{len(all_prompts)} prompts, mean {statistics.mean(map(len, all_prompts)):.0f} tokens", flush=True)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    max_len = args.max_prompt_tokens + args.max_new_tokens
    engine = build_engine(target, max_len=max_len)
    rows = []
    record = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
              "dtype": str(target.dtype), "max_new_tokens": args.max_new_tokens, "max_len": max_len,
              "prompts_per_row": args.prompts_per_row, "prefill_tokens": args.prefill_tokens, "repeats": args.repeats, "sampling": vars(sampling), "results": rows}

    def save():  # after every batch: a call cut short by its time limit keeps what was measured
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(record, handle, indent=2)

    def timed(fn):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        return out, time.perf_counter() - start

    engines = ["engine"] + (["engine_compiled"] if args.compile else [])
    for batch in side + alone:
        prompts = all_prompts[: args.prompts_per_row * batch]
        keys = list(range(len(prompts)))
        gens = {name: BatchGenerator(engine, rows=batch, max_len=max_len, eos_ids=target.eos_token_ids,
                                     max_new_tokens=args.max_new_tokens, sampling=sampling, seed=0,
                                     prefill_tokens=args.prefill_tokens, compile=name == "engine_compiled")
                for name in engines}

        def run_transformers(subset=prompts):
            return generate_batched(target.model, subset, pad_id=tok.pad_token_id, eos_ids=target.eos_token_ids,
                                    max_new_tokens=args.max_new_tokens, batch_size=batch, sampling=sampling, seed=0,
                                    static_cache_len=max_len, keys=list(range(len(subset))), progress=False)

        with_hf = batch in side
        # untimed: the engine's run captures (and, compiled, compiles) the graphs that run needs;
        # transformers' compiles its step
        warm = {name: timed(lambda: gen.generate(prompts, keys, progress=False))[1] for name, gen in gens.items()}
        warm_hf = timed(lambda: run_transformers(prompts[:batch]))[1] if with_hf else None
        runs = {name: [] for name in [*engines, "transformers"]}
        outs = {}
        for _ in range(args.repeats):  # alternating, so drifts of the machine hit every backend alike
            for name, gen in gens.items():
                (outs[name], stats), seconds = timed(lambda: gen.generate(prompts, keys, progress=False))
                runs[name].append({"seconds": seconds, "new_tokens": stats.new_tokens, "steps": gen.decode_steps,
                                   "kv_read": gen.kv_read})
            if with_hf:
                (hf_out, hf_stats), seconds = timed(run_transformers)
                runs["transformers"].append({"seconds": seconds, "new_tokens": hf_stats.new_tokens})
        row = {"batch": batch, "prompts": len(prompts)}
        for name, gen in gens.items():
            e_runs = runs[name]
            med = statistics.median(r["seconds"] for r in e_runs)
            new_tokens = e_runs[0]["new_tokens"]
            steps, kv_read = e_runs[0]["steps"], e_runs[0]["kv_read"]
            read = steps * gen.weight_bytes() + kv_read * gen.kv_bytes_per_position()
            row[name] = {"tokens_per_s": round(new_tokens / med, 1), "new_tokens": new_tokens, "median_s": round(med, 3),
                         "seconds": [round(r["seconds"], 3) for r in e_runs], "decode_steps": steps,
                         "ms_per_step": round(1000 * med / max(steps, 1), 3), "gb_read": round(read / 1e9, 2),
                         "gb_per_s": round(read / med / 1e9, 1), "graphs": len(gen.graphs),
                         "kernel_attention": gen.kernel_attention, "warmup_s": round(warm[name], 2)}
        if "engine_compiled" in gens:
            row["compiled_vs_engine"] = round(row["engine_compiled"]["tokens_per_s"] / row["engine"]["tokens_per_s"], 2)
            row["identical_compiled_engine"] = f"{sum(a.token_ids == b.token_ids for a, b in zip(outs['engine'], outs['engine_compiled']))}/{len(prompts)}"
        if with_hf:
            h_runs = runs["transformers"]
            hmed = statistics.median(r["seconds"] for r in h_runs)
            row["transformers_static_compiled"] = {"tokens_per_s": round(h_runs[0]["new_tokens"] / hmed, 1),
                                                   "new_tokens": h_runs[0]["new_tokens"], "median_s": round(hmed, 3),
                                                   "seconds": [round(r["seconds"], 3) for r in h_runs],
                                                   "warmup_s": round(warm_hf, 2)}
            for name in engines:
                hf_tps = row["transformers_static_compiled"]["tokens_per_s"]
                row[f"{name}_vs_transformers"] = round(row[name]["tokens_per_s"] / hf_tps, 2)
                row[f"identical_{name}_transformers"] = f"{sum(a.token_ids == b.token_ids for a, b in zip(outs[name], hf_out))}/{len(prompts)}"
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)
        del gens
        torch.cuda.empty_cache() if device.type == "cuda" else None

    if args.profile:
        record["profile"] = profile_step(engine, target, all_prompts, args.profile, max_len, sampling, args.max_new_tokens)
        if args.compile:
            record["profile_compiled"] = profile_step(engine, target, all_prompts, args.profile, max_len, sampling,
                                                      args.max_new_tokens, compile=True)
        save()
    print(f"{'batch':>6} {'backend':>16} {'tok/s':>10} {'hf tok/s':>10} {'ratio':>6} {'ms/step':>8} {'GB/s':>6}")
    for r in rows:
        hf = r.get("transformers_static_compiled", {}).get("tokens_per_s", "-")
        for name in engines:
            print(f"{r['batch']:>6} {name:>16} {r[name]['tokens_per_s']:>10} {hf:>10} {r.get(f'{name}_vs_transformers', '-'):>6} "
                  f"{r[name]['ms_per_step']:>8} {r[name]['gb_per_s']:>6}")


def profile_step(engine, target, prompts, batch, max_len, sampling, max_new_tokens, compile=False) -> dict:
    """One decode step at `batch` rows (slots filled by a real prefill): graph replay time against the
    eager kernels' device time, grouped by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    gen = BatchGenerator(engine, rows=batch, max_len=max_len, eos_ids=[-1], max_new_tokens=max_new_tokens,
                         sampling=sampling, seed=0, compile=compile)
    gen._prefill(list(range(batch)), prompts[:batch], list(range(batch)))
    attend_len = next(n for n in gen.len_buckets if n >= int(gen.pos.max()) + 64)
    kv_read = int(gen.pos[:batch].sum()) + batch if gen.kernel_attention else batch * attend_len
    gen._run_decode(batch, attend_len)  # capture
    graph = gen.graphs[(batch, attend_len)]
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    gen.cuda_graphs = False
    gen._run_decode(batch, attend_len)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            gen._run_decode(batch, attend_len)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:80], []).append(e.device_time_total / 1000)
    total = sum(sum(v) for v in by_name.values()) / 2
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    out = {"batch": batch, "compiled": compile, "attend_len": attend_len, "graph_replay_ms_median": round(statistics.median(times), 3),
           "kernels_per_step": len(kernels) // 2, "kernel_device_ms_per_step": round(total, 3),
           "weight_bytes": gen.weight_bytes(), "kv_bytes_read": kv_read * gen.kv_bytes_per_position(),
           "kernel_attention": gen.kernel_attention,
           "top_kernels_ms_per_step": {name: round(sum(v) / 2, 4) for name, v in top},
           "top_kernels_count_per_step": {name: len(v) // 2 for name, v in top}}
    print(json.dumps(out, indent=1), flush=True)
    return out


if __name__ == "__main__":
    main()
