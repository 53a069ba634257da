"""How fast could the W4A16 decode step be with the int4 kernels we have, and with an ideal one? Issue 23 asks for a
W4 step >= 1.8x the 16-bit one; this reads a published component run (`bench_components.py --w4-head`'s JSON, no GPU)
and says what that target needs of the int4 matmuls.

Each kernel's one-row time at the model's layer shapes (the run's own tuning tables, `w4a16_head.tuned` at @1: cuBLAS
on the dequantized bf16 weight, tinygemm, Marlin, ours) is fitted as `fixed + bytes / bandwidth` (least squares over
the layer shapes): what a call costs whatever its size, and how fast its bytes then stream. The step's matmul time
follows from how many calls of each shape a decode step makes (from the model's config: a GDN layer's qkvz and out
projections, an attention layer's qkv and o, every layer's gate / up and down, the head). Why: at 1 row these
matrices are 6-27 MB, a few microseconds each, so a per-call cost and a bandwidth say different things about what a
faster kernel would have to do. `int4_as_good_as.<reference>` is an int4 kernel with the reference's fixed cost and
bandwidth over the packed bytes: as good at 4 bits as cuBLAS (`dense`) or our own 16-bit GEMV (`gemv16`, `gemv.tuned`)
is at 16.

    python scripts/investigations/w4_step_floor.py results/published/2026-12-05-h200-gdn-warps/components.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from bench_w4_kernels import packed_bytes  # noqa: E402 (scripts/bench, on the path just above)

from qdflash.engine.linear import tuning_key  # noqa: E402

KERNELS = ("dense", "tinygemm", "marlin", "machete", "gemlite", "fbgemm", "mma", "ours")  # the tuning table's *_ms (ours: ms)


def step_calls(shape: str) -> tuple[dict[tuple[int, int], int], tuple[int, int]]:
    """([N, K] -> calls a decode step makes, the LM head's [N, K]), from bench_components' config of `shape` (the
    engine's packed projections: qkvz / qkv and gate / up are one matmul each)."""
    from transformers import Qwen3_5TextConfig

    from bench_components import SHAPES

    c = Qwen3_5TextConfig(**SHAPES[shape])
    hidden, calls = c.hidden_size, {}

    def add(n, k):
        calls[(n, k)] = calls.get((n, k), 0) + 1

    for kind in c.layer_types:
        if kind == "linear_attention":
            key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
            add(2 * key + 2 * value, hidden)  # q, k, v, z (b / a: 16-bit, in the GDN kernel)
            add(hidden, value)
        else:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            add(2 * q + 2 * kv, hidden)  # q with its gate, k, v
            add(hidden, q)
        add(2 * c.intermediate_size, hidden)
        add(hidden, c.intermediate_size)
    head = (c.vocab_size, hidden)
    add(*head)
    return calls, head


def one_row_times(run: dict, source: str, table: str, shapes, group: int) -> dict[tuple[int, int], dict[str, float]]:
    """[N, K] -> kernel -> ms at one row, from the tuning table of the run read from `source` (kernels that did not run
    are left out)."""
    out = {}
    for n, k in shapes:
        row = run[table].get(tuning_key("w4a16", n, k, 1, group))
        if row is None:
            raise SystemExit(f"w4_step_floor: {source}'s {table} has no one-row time for {n}x{k} (group {group})")
        times = {kernel: row.get("ms" if kernel == "ours" else f"{kernel}_ms") for kernel in KERNELS}
        out[(n, k)] = {kernel: ms for kernel, ms in times.items() if ms}
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed us, bandwidth TB/s) of ms = fixed + bytes / bandwidth, least squares."""
    a = np.array([[1.0, nbytes] for nbytes, _ in points])
    (fixed_ms, ms_per_byte), *_ = np.linalg.lstsq(a, np.array([ms for _, ms in points]), rcond=None)
    return fixed_ms * 1e3, 1e-9 / ms_per_byte


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("components", help="a bench_components.py --w4-head JSON (with --profile and --compile)")
    parser.add_argument("--target", type=float, default=1.8, help="the W4 step's speedup over the 16-bit one asked for")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = json.load(open(args.components))
    config = run["config"]
    group, label = config["group"], "target_w4_head"
    for key in ("w4a16_head.tuned", f"{label}.decode_kernels", f"{label}.decode_compiled_ms", "target16.decode_compiled_ms"):
        if not isinstance(run.get(key), (dict, float, int)):
            raise SystemExit(f"w4_step_floor: {args.components} has no {key!r}: expected a bench_components.py run with "
                             "--w4-head --profile --compile")
    calls, head = step_calls(config["shape"])
    times = one_row_times(run, args.components, "w4a16_head.tuned", calls, group)
    layers = [s for s in calls if s != head]  # the head is timed, not fitted: it is one call
    result = {"source": args.components, "group": group, "calls_per_step": {f"{n}x{k}": c for (n, k), c in calls.items()}}
    for kernel in KERNELS:
        points = [(s[0] * s[1] * 2 if kernel == "dense" else packed_bytes(*s, group), times[s][kernel])
                  for s in layers if kernel in times[s]]
        if len(points) >= 3:
            fixed, tbps = fit(points)
            result[f"fit.{kernel}"] = {"fixed_us": round(fixed, 2), "TBps": round(tbps, 2), "shapes": len(points)}

    def step_ms(per_call) -> float:
        return sum(c * per_call(s) for s, c in calls.items())

    # our 16-bit GEMV at one row, where the run tuned it (gemv.tuned: "gemv NxK" is @1), fitted the same way
    gemv_tuned = run.get("gemv.tuned", {})
    gemv16 = [(s[0] * s[1] * 2, gemv_tuned[tuning_key("gemv", *s, 1)]["gemv_ms"]) for s in layers
              if tuning_key("gemv", *s, 1) in gemv_tuned]
    if len(gemv16) >= 3:
        fixed, tbps = fit(gemv16)
        result["fit.gemv16"] = {"fixed_us": round(fixed, 2), "TBps": round(tbps, 2), "shapes": len(gemv16)}

    def ideal(reference):  # ms of an int4 kernel with `reference`'s fixed cost and bandwidth over the packed bytes
        fixed_ms, tbps = result[f"fit.{reference}"]["fixed_us"] / 1e3, result[f"fit.{reference}"]["TBps"]
        return lambda s: fixed_ms + packed_bytes(*s, group) / (tbps * 1e9)

    best = lambda s: min(ms for kernel, ms in times[s].items() if kernel != "dense")  # noqa: E731
    result["matmul_ms.dense"] = round(step_ms(lambda s: times[s]["dense"]), 3)
    result["matmul_ms.best_int4"] = round(step_ms(best), 3)
    references = [r for r in ("dense", "gemv16") if f"fit.{r}" in result]
    for reference in references:
        result[f"matmul_ms.int4_as_good_as.{reference}"] = round(step_ms(ideal(reference)), 3)
    # the measured W4-head step: its int4 kernels' device time, and everything else (other kernels and gaps)
    # regrouped from the per-kernel list (bench_components.kernel_group): runs up to 2026-12-05-h200-gdn-warps counted
    # inductor's kernels fused after Marlin's op in their "int4 matmul" group
    from bench_components import kernel_group

    int4_us = sum(k["us"] for k in run[f"{label}.decode_kernels"]["kernels"] if kernel_group(k["kernel"]).startswith("int4"))
    step16, step4 = run["target16.decode_compiled_ms"], run[f"{label}.decode_compiled_ms"]
    rest = step4 - int4_us / 1e3
    needed = step16 / args.target - rest
    result.update({"target16.decode_compiled_ms": step16, f"{label}.decode_compiled_ms": step4,
                   f"{label}.int4_device_ms": round(int4_us / 1e3, 3), f"{label}.rest_ms": round(rest, 3),
                   "target_ms": round(step16 / args.target, 3), "int4_ms_needed": round(needed, 3),
                   "speedup_with.best_int4": round(step16 / (rest + result["matmul_ms.best_int4"]), 3)})
    for reference in references:
        matmuls = result[f"matmul_ms.int4_as_good_as.{reference}"]
        result[f"speedup_with.int4_as_good_as.{reference}"] = round(step16 / (rest + matmuls), 3)
        result[f"speedup_with.int4_as_good_as.{reference}_and_no_rest"] = round(step16 / matmuls, 3)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
