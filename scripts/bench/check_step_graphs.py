"""Each compiled step is one graph: dynamo traces the engines' decode steps, verify blocks and drafter steps with the
Triton kernels as the GPU runs them (real `triton.jit` functions, which dynamo lifts into the graph), on the CPU,
without a GPU: the launches themselves are no-ops, so this checks tracing, not numbers.

    python scripts/bench/check_step_graphs.py [--out graphs.json]

Why a script of its own (the tests run it in a subprocess): the test session's kernels are Triton's interpreter
functions, which dynamo cannot lift; here dynamo meets the launches as on the device. A graph break in a step
splits each GDN layer into a frame of its own, recompiled per layer index until dynamo's recompile limit, past which
those layers run uncompiled; two such breaks (`bool(dict)`, which the device's torch 2.11 could not trace, and
`max(..., key=)`) went unseen until the benchmark's logs. Run it under another torch by putting that torch first on
PYTHONPATH (a CUDA build imports on a machine without a GPU only where its CUDA libraries can be found). Prints and
writes per step the graphs, breaks, recompile-limit warnings and launches lifted into the graphs; exits 1 on a break, a
recompile limit, an extra graph or where no launch was lifted.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import pkgutil
import sys

if os.environ.get("TRITON_INTERPRET") == "1":  # before triton is imported: its jit would make interpreter functions
    sys.exit("check_step_graphs: unset TRITON_INTERPRET (the point is dynamo meeting real triton.jit functions)")

import torch  # noqa: E402
import torch.utils._triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import qdflash.drafter.static as static  # noqa: E402
import qdflash.kernels  # noqa: E402
from qdflash.drafter import init_drafter  # noqa: E402
from qdflash.drafter.train import target_pass  # noqa: E402
from qdflash.engine import build_engine  # noqa: E402
from qdflash.engine.base import compiled_since, dynamo_counts  # noqa: E402
from qdflash.models import load_target  # noqa: E402
from qdflash.quant.apply import quantize_weights, replace_linears, select_linears  # noqa: E402
from qdflash.quant.grid import GridSpec  # noqa: E402

for _module in pkgutil.iter_modules(qdflash.kernels.__path__):  # every kernel decorated now, while the interpreter is off
    importlib.import_module(f"qdflash.kernels.{_module.name}")

LAUNCHED: set[str] = set()


def _no_launch(self, *args, **kwargs):
    LAUNCHED.add(self.fn.__name__)


KERNEL_NODES = [0]  # triton_kernel_wrapper_* nodes in the graphs dynamo handed the backend


def counting(gm, example_inputs):
    """The backend: counts the launches dynamo lifted into the graph as Triton kernels, then runs the graph as is."""
    KERNEL_NODES[0] += sum(1 for node in gm.graph.nodes if "triton_kernel_wrapper" in str(node.target))
    return gm.forward


def traced(run) -> dict:
    """What dynamo did while `run()` compiled and called its steps (engine.base.compiled_since: graphs, graph breaks by
    reason, recompile-limit warnings), and the Triton launches it lifted into the graphs."""
    torch._dynamo.reset()  # each engine's steps compile afresh (no earlier engine's code counts towards a limit)
    KERNEL_NODES[0], before = 0, dynamo_counts()
    run()
    return {**compiled_since(before), "kernel_nodes": KERNEL_NODES[0]}


def target_steps(target, w4: bool) -> dict:
    """A 16-bit (bf16) or W4 (RTN g32, every layer's projection that packs) engine's decode step and a verify block."""
    model = copy.deepcopy(target)
    model.model.to(torch.bfloat16)
    if w4:
        names = select_linears(model.model)
        replace_linears(model.model, quantize_weights(model.model, names, GridSpec(4, 32, True), method="rtn"))
    engine = build_engine(model, max_len=64, kernels=True, attention="kernel")
    if not engine._replays(4):  # the verify block's path this checks (the two-phase block keeping its inputs)
        raise SystemExit("check_step_graphs: the engine's verify block no longer replays; update the check")
    step = torch.compile(engine._step, backend=counting, dynamic=False)

    def run():
        for t in (1, 4):  # a decode step and a verify block (positions past a prefill that was never run: no launch reads)
            step(torch.randint(0, 100, (t,)), torch.arange(8, 8 + t), 16, None)

    return {**traced(run), "steps": 2}


def drafter_steps(target, attention: str) -> dict:
    """A DrafterEngine's draft steps with the qk kernel, compiled, across three cache buckets."""
    drafter = init_drafter(target, block_size=4, num_layers=2, seed=7).eval()
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    features, _ = target_pass(target, ids, drafter.config.target_layer_ids)
    engine = static.DrafterEngine(drafter, max_len=48, attention=attention, kernels=True, smallest_bucket=8,
                                  compile=counting)
    engine.qk_norm_rope_kernel = True

    def run():
        session, start = engine.session(None), 0
        for n in (5, 4, 8):  # contexts of 5, 9 and 17: the buckets of 8, 16 and 32
            session.append(features[0, start:start + n], start)
            start += n
            session.draft_logits(int(ids[0, start]), start)

    return {**traced(run), "steps": len(engine._compiled)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results here too (JSON)")
    args = parser.parse_args(argv)
    JITFunction.run = _no_launch  # the launches (and their compiles) are what a CPU cannot do
    # dynamo lifts a triton.jit launch into the graph only where torch finds a GPU Triton can drive: without one it
    # would trace the launch as plain Python (into the no-op above), and not meet what the device's steps meet
    torch.utils._triton.has_triton = lambda: True
    # build_engine refuses kernels on the CPU unless the interpreter is on; the kernels are already real jit functions
    os.environ["TRITON_INTERPRET"] = "1"
    qwen, llama = load_target("tiny-qwen3.5", device="cpu"), load_target("tiny-llama", device="cpu")
    result = {"torch": torch.__version__,
              "qwen3.5_16bit": target_steps(qwen, w4=False), "qwen3.5_w4": target_steps(qwen, w4=True)}
    for attention in ("kernel", "sdpa"):
        result[f"drafter_{attention}"] = drafter_steps(llama, attention)
    result["launched"] = sorted(LAUNCHED)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    broke = [name for name, r in result.items()
             if isinstance(r, dict) and (r["graph_breaks"] or r["recompile_limits"] or r["graphs"] != r["steps"]
                                         or not r["kernel_nodes"])]
    if broke:
        print(f"check_step_graphs: graph breaks, recompile limits, extra graphs or no lifted launch in {', '.join(broke)}", file=sys.stderr)
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
