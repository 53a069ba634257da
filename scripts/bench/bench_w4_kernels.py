"""Every W4A16 matmul this project can run, timed side by side at a model's real projection shapes.

    python scripts/bench/bench_w4_kernels.py --out w4_kernels.json                 # Qwen3.5-4B target (g32)
    python scripts/bench/bench_w4_kernels.py --shape qwen2.5-coder-0.5b --group 128

Issue 23 asks for the maintained int4 kernels to be timed against bf16 cuBLAS at the model's shapes in
one process before any kernel of our own is kept. This is that table, without building a model: for
each [N, K] projection and 1 / 16 rows, `kernels.w4a16.tune` times our Triton kernel, every EXTERNAL
kernel that imports here (torch's tinygemm, gemlite, FBGEMM's preshuffled CUTLASS GEMM, vLLM's Marlin and, on Hopper at
groups 64 / 128, Machete: each first checked against the dequantized
product) and cuBLAS on the 16-bit weight, each over weight copies larger than L2 inside one CUDA graph.
Beside each time: the bytes it must read (packed ints + scales, or the 16-bit weight) over that time,
so a kernel bound by its work per weight shows as GB/s far under the device's bandwidth.
Needs only torch and triton (`PYTHONPATH=src` on a bare GPU machine; gemlite, fbgemm-gpu-genai where installed, Marlin where
$QDFLASH_MARLIN_LIB names vLLM's `_C_stable_libtorch.abi3.so` or vllm is installed: kernels.marlin_w4).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from qdflash.kernels import w4a16

# [N, K] (out, in) of the packed projections of a decode step, then the LM head [vocab, hidden]; Qwen3.5-4B's as
# the engine packs them (bench_components' tuning keys)
SHAPES = {
    "qwen3.5-4b": [(2560, 4096), (2560, 9216), (10240, 2560), (12288, 2560), (18432, 2560), (248320, 2560)],
    "qwen2.5-coder-0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)],
}


def packed_bytes(n: int, k: int, group: int) -> int:
    """A W4 matrix's bytes as the kernels read them: 4-bit weights, one 16-bit scale per group."""
    return n * k // 2 + n * (k // group) * 2


def gbps(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else round(nbytes / ms / 1e6, 1)


def tile_times(times: dict[str, list]) -> dict:
    """Each tiled kernel's every tile with its time (`<name>_tile_ms`), and where its tiles have a `prefetch` field
    the best time with and without it (`<name>_prefetch_ms`, `<name>_plain_ms`): what the winning tile alone hides."""
    out = {}
    for name, timed in times.items():
        out[f"{name}_tile_ms"] = [{**fields, "ms": round(ms, 4)} for fields, ms in timed if isinstance(fields, dict)]
        for label, want in (("prefetch", True), ("plain", False)):
            best = [ms for fields, ms in timed if isinstance(fields, dict) and fields.get("prefetch") is want]
            if best:
                out[f"{name}_{label}_ms"] = round(min(best), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-4b")
    parser.add_argument("--group", type=int, default=32, help="quantization group (the Qwen3.5-4B target's: 32)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, w4a16.MAX_ROWS])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4_kernels: needs a CUDA device (the kernels are timed, not emulated)")
    dtype = torch.bfloat16
    externals = {name: module.load() is not None if hasattr(module, "load") else True for name, module in w4a16.EXTERNAL.items()}
    rows_out = []
    print(f"{args.shape}, group {args.group}, {torch.cuda.get_device_name()}; external kernels importable: {externals}")
    print(f"{'N x K':>14} {'rows':>4} | {'ours':>14} {'cuBLAS bf16':>14} " + " ".join(f"{n:>14}" for n in w4a16.EXTERNAL) + " | used")
    for n, k in SHAPES[args.shape]:
        packed = packed_bytes(n, k, args.group)
        dense_bytes = n * k * 2
        for rows in args.rows:
            config, ms, dense_ms, others = w4a16.tune(n, k, args.group, rows=rows, dtype=dtype)
            row = {"n": n, "k": k, "group": args.group, "rows": rows, "packed_bytes": packed,
                   "ours_ms": round(ms, 4), "ours_gbps": gbps(packed, ms), "ours_config": config.__dict__,
                   "dense_ms": round(dense_ms, 4), "dense_gbps": gbps(dense_bytes, dense_ms),
                   **{f"{name}_ms": None if t is None else round(t, 4) for name, t in others.items()},
                   **{f"{name}_gbps": gbps(packed, t) for name, t in others.items()},
                   "used": w4a16.backend(n, k, args.group, rows, dtype),
                   "external_tiles": w4a16.external_tiles(n, k, args.group, rows, dtype),
                   **tile_times(w4a16.external_tile_times(n, k, args.group, rows, dtype))}
            rows_out.append(row)
            cell = lambda t, b: "—" if t is None else f"{t * 1e3:6.1f}us {gbps(b, t):>5.0f}"  # noqa: E731
            print(f"{n:>7}x{k:<6} {rows:>4} | {cell(ms, packed):>14} {cell(dense_ms, dense_bytes):>14} "
                  + " ".join(f"{cell(others[name], packed):>14}" for name in w4a16.EXTERNAL) + f" | {row['used']}")
    result = {"shape": args.shape, "group": args.group, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "externals_importable": externals,
              "rows": rows_out}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import gemlite

        result["gemlite"] = getattr(gemlite, "__version__", "?")
    except Exception:  # noqa: BLE001 - not installed, or its import fails off a supported device
        result["gemlite"] = None
    from qdflash.kernels import marlin_w4

    result["marlin_library"] = marlin_w4.SOURCE[0] if marlin_w4.SOURCE else None
    try:
        from importlib.metadata import version

        result["fbgemm_gpu_genai"] = version("fbgemm-gpu-genai")
    except Exception:  # noqa: BLE001 - not installed
        result["fbgemm_gpu_genai"] = None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
