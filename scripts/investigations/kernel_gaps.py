"""Where do the gaps between a decode step's kernels come from? Chains of launches captured in one CUDA graph, each
timed two ways: wall time per launch (graph replays, CUDA events) and the kernels' own time (torch.profiler); the
difference per launch is the gap. Why: on the H100 (results/published/2026-12-05-h100-prologues-pdl) the compiled
W4 step had 1.22 µs of gap per kernel against 0.58 µs for the 16-bit step, and the 16-bit step with the prologue
fusions 1.13 µs: ~480 µs of a 3.1 ms W4 step is time in which no kernel runs. If chains of one kind of kernel show
small gaps and chains that alternate kinds (our Triton GEMVs, inductor-sized elementwise kernels, torch's tinygemm,
vLLM's Marlin) large ones, the switch between kernels is what costs (e.g. a different shared-memory carveout to set
up), not the launch itself. Answered on the H200 (results/published/2026-12-05-h200-components-gaps): no. Every chain,
one kind or two alternating, has ~0.7 us of gap after a matmul-sized kernel, and a chain of tiny kernels 0.2 us.

Chains (N launches each, weights cycled over copies past L2 as in a step; all at Qwen3.5-4B's 2,560 x 4,096 o / out
projection, bf16, group 32):
  tiny       an elementwise kernel on a 2,560-wide fp32 vector (a step's residual add / norm size)
  gemv16     our 16-bit one-row GEMV (its tuned config)
  w4         our one-row W4A16 GEMV (tuned)
  tinygemm   torch's int4 op (torch._weight_int4pack_mm)
  marlin     vLLM's Marlin, where its library loads ($QDFLASH_MARLIN_LIB)
and every pair of two kinds alternating (a, b, a, b, ...).

    python scripts/investigations/kernel_gaps.py --out $OUT/kernel_gaps.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform

import torch

N, K, GROUP = 2560, 4096, 32


def kernels() -> dict:
    """Each kind's launch function: (call i) -> None, its inputs made here (weights cycled over enough copies)."""
    from qdflash.kernels import copies_past_l2
    from qdflash.kernels import gemv as gemv_module
    from qdflash.kernels import marlin_w4, tinygemm, w4a16

    out = {}
    h = torch.randn(1, N, device="cuda")
    out["tiny"] = lambda i: h.mul_(1.0001)  # one small elementwise kernel a launch, as a step's inductor kernels are
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    gemv_module.tune(N, K)
    config = gemv_module.gemv_config(N, K, torch.bfloat16) or gemv_module.GemvConfig()
    dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies_past_l2(N * K * 2))]
    out["gemv16"] = lambda i: gemv_module.gemv(x, dense[i % len(dense)], config)
    copies = copies_past_l2(N * K // 2)
    words = [torch.randint(-2**31, 2**31 - 1, (N, K // 8), device="cuda", dtype=torch.int32) for _ in range(copies)]
    scales = [torch.rand(N, K // GROUP, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
    w4a16.tune(N, K, GROUP, rows=1)
    w4_config = w4a16.default_config(N, K, GROUP, 1)
    counts = w4a16.split_counts(N, "cuda")
    out["w4"] = lambda i: w4a16.w4a16_matmul(x, words[i % copies], scales[i % copies], GROUP, w4_config, counts)
    for name, module in (("tinygemm", tinygemm), ("marlin", marlin_w4)):
        if module.supported(N, K, GROUP, torch.bfloat16, "cuda"):
            states = [module.pack(w, s, GROUP, torch.bfloat16) for w, s in zip(words, scales)]
            out[name] = lambda i, m=module, st=states: m.matmul(x, *st[i % len(st)], GROUP)
    return out


def timed_chain(calls: list, replays: int) -> dict:
    """The chain captured as one CUDA graph: wall µs a launch (median over replays) and kernel µs a launch (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from qdflash.cudagraph import capture
    from qdflash.kernels import graph_ms

    def chain():
        for call in calls:
            call()

    wall = graph_ms(chain, replays) * 1e3 / len(calls)  # median of the replays, as tuning times a kernel
    graph, _ = capture(chain, warmup=1)  # the same chain again, for the profiler
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    busy = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
               for e in prof.key_averages() if not e.key.startswith("cuda"))
    count = sum(e.count for e in prof.key_averages() if not e.key.startswith("cuda") and
                (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) > 0)
    kernel = busy / replays / len(calls)
    return {"launches": len(calls), "kernels_per_launch": round(count / replays / len(calls), 2),
            "wall_us_per_launch": round(wall, 3), "kernel_us_per_launch": round(kernel, 3), "gap_us_per_launch": round(wall - kernel, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_gaps: needs a CUDA device (it times kernels)")
    kinds = kernels()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "shape": [N, K], "group": GROUP, "kinds": sorted(kinds), "chains": {}}
    chains = [(name,) for name in kinds] + list(itertools.combinations(kinds, 2))
    for chain in chains:
        calls = [lambda i=i, kind=chain[i % len(chain)]: kinds[kind](i) for i in range(args.launches)]
        try:
            result["chains"]["+".join(chain)] = timed_chain(calls, args.replays)
        except Exception as err:  # noqa: BLE001 -- a kind that fails in a graph is a result; the other chains run
            result["chains"]["+".join(chain)] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print("+".join(chain), json.dumps(result["chains"]["+".join(chain)]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
