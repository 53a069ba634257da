"""How many tensor operations one decode step of the lean engine runs (each is one kernel launch on
a GPU, where a captured but uncompiled step costs ~2-3 µs per kernel whatever its size).

    python scripts/investigations/count_step_ops.py --model smollm2-135m --dtype bfloat16

Runs the static-shape step (the code a CUDA graph records) once on the CPU under torch.profiler and
counts the top-level aten operations that compute (views and allocations excluded).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from qdflash.engine import build_engine
from qdflash.models import load_target

NO_KERNEL = {"aten::view", "aten::reshape", "aten::transpose", "aten::split", "aten::chunk", "aten::slice",
             "aten::select", "aten::unsqueeze", "aten::expand", "aten::as_strided", "aten::t", "aten::_reshape_alias",
             "aten::squeeze", "aten::split_with_sizes", "aten::narrow", "aten::detach", "aten::alias", "aten::permute",
             "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
             "aten::_unsafe_view"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=50)
    args = parser.parse_args()
    target = load_target(args.model, device="cpu", dtype=args.dtype)
    engine = build_engine(target, max_len=512)
    engine.capture([1], None, cuda_graphs=False, lengths=[512])
    engine.forward(torch.arange(10, 10 + args.context), 0)
    step = engine.graph_for(1, None, args.context + 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(torch.tensor([5]), args.context)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_KERNEL
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    print(f"{args.model} ({args.dtype}): {len(ops)} operations per decode step, "
          f"{len(ops) / target.model.config.num_hidden_layers:.1f} per layer")
    print(", ".join(f"{name[6:]} {n}" for name, n in Counter(ops).most_common()))


if __name__ == "__main__":
    main()
