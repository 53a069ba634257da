"""Does a GEMV tile that tuning times as fast as another, alone, cost more inside a decode step? Why: across fourteen
H200 component runs the 16-bit step's GEMVs took 1,936-1,975 µs, except in the one run whose tuning picked 8 x 1,024
with the K loop unrolled for the down projection (2,560 x 9,216; 32 calls a step): 2,130 µs, though tuning timed
that tile within 0.1 µs of 2 x 1,024, the pick of every other run (results/published/2026-12-05-h200-gdn-warps).
Tuning (kernels.gemv.tune) times a tile back to back with itself; in a step each GEMV follows other kernels.

For each tile of the down projection below, three chains captured in one CUDA graph (weights cycled past L2):
  alone     the down GEMV back to back, as tuning times it
  tiny      each down GEMV after a small elementwise kernel (a step's silu(gate) * up / residual add size)
  mlp       gate / up GEMV (18,432 x 2,560, its tuned tile), tiny, down, tiny: a decode step's MLP
and for `mlp` the same chain without the down GEMV, so that the difference is the down GEMV's cost in that place.

    python scripts/investigations/gemv_in_step.py --out $OUT/gemv_in_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_gaps import timed_chain  # noqa: E402 -- the sibling script's chain timing, one copy

HIDDEN, INTER = 2560, 9216  # Qwen3.5-4B: down is [HIDDEN, INTER], gate / up [2 * INTER, HIDDEN]
TILES = ["2x1024", "4x1024", "8x1024", "8x1024u", "2x1024u"]  # block_n x block_k, u: the K loop unrolled


def tile(text: str):
    from qdflash.kernels.gemv import GemvConfig

    n, k = text.rstrip("u").split("x")
    return GemvConfig(block_n=int(n), block_k=int(k), unrolled=text.endswith("u"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=lambda s: s.split(","), default=TILES)
    parser.add_argument("--launches", type=int, default=32, help="down GEMVs a chain (a decode step has 32)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv_in_step: needs a CUDA device (it times kernels)")
    from qdflash.kernels import copies_past_l2
    from qdflash.kernels import gemv as gemv_module

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, HIDDEN, device="cuda")
    tiny = lambda: h.mul_(1.0001)  # noqa: E731
    x_down, x_up = torch.randn(1, INTER, **bf16), torch.randn(1, HIDDEN, **bf16)
    down = [torch.randn(HIDDEN, INTER, **bf16) for _ in range(copies_past_l2(HIDDEN * INTER * 2))]
    up = [torch.randn(2 * INTER, HIDDEN, **bf16) for _ in range(copies_past_l2(2 * INTER * HIDDEN * 2))]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "down": [HIDDEN, INTER], "tuned": {"down": gemv_module.tune(HIDDEN, INTER), "up": gemv_module.tune(2 * INTER, HIDDEN)}}
    up_tile = gemv_module.gemv_config(2 * INTER, HIDDEN, torch.bfloat16) or gemv_module.GemvConfig()
    up_call = lambda i: gemv_module.gemv(x_up, up[i % len(up)], up_tile)  # noqa: E731
    n = args.launches
    base = timed_chain([c for i in range(n) for c in (lambda i=i: up_call(i), tiny, tiny)], args.replays)
    result["mlp_without_down"] = base
    for text in args.tiles:
        config = tile(text)
        call = lambda i, c=config: gemv_module.gemv(x_down, down[i % len(down)], c)  # noqa: E731
        alone = timed_chain([lambda i=i: call(i) for i in range(n)], args.replays)
        after_tiny = timed_chain([c for i in range(n) for c in (tiny, lambda i=i: call(i))], args.replays)
        mlp = timed_chain([c for i in range(n) for c in (lambda i=i: up_call(i), tiny, lambda i=i: call(i), tiny)],
                          args.replays)
        row = {"alone_us": alone["wall_us_per_launch"], "alone_kernel_us": alone["kernel_us_per_launch"],
               # a launch here is half a pair (tiny, down): the pair's wall time, the tiny kernel's the same for every tile
               "after_tiny_pair_us": round(2 * after_tiny["wall_us_per_launch"], 3),
               # the MLP chain's wall time a layer, less the same chain's without the down GEMV
               "in_mlp_us": round(4 * mlp["wall_us_per_launch"] - 3 * base["wall_us_per_launch"], 3)}
        result[text] = row
        print(text, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
