"""What one speculative round costs at the SmolLM2-135M shape, part by part, in one process.

    python3 scripts/gpu/bench_round.py --out $OUT/round.json          # the H200 (core wheels only)
    python3 scripts/gpu/bench_round.py --layers 2 --context 64 --reps 3   # the CPU: the code path only

Speed does not depend on weight values, so the target is SmolLM2-135M's config with random weights,
built on the device (no download), and the drafter is an untrained 2-layer DFlash drafter for it.
Each is timed with the context holding `--context` positions (median of `--reps`, synchronized):
- the target's decode step (1 token) and verify block (`--block` tokens) on the lean engine's CUDA graphs;
- one draft, eager (DrafterSession: K/V concatenated, kernels launched from Python) and static
  (DrafterEngine: K/V in place, one CUDA graph per context bucket), checked to give the same drafts;
- appending the features of 2 accepted positions to the drafter's context, eager and static (one
  graph per count); then five rounds accepting 1..5 positions, checked to draft the same both ways.
A speculative round is draft + verify + append (+ host work); at acceptance length tau it beats
autoregressive decoding when it costs less than tau decode steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from qdflash.drafter import init_drafter  # noqa: E402
from qdflash.drafter.static import DrafterEngine  # noqa: E402
from qdflash.engine import build_engine  # noqa: E402
from qdflash.spec import DrafterSession  # noqa: E402
from qdflash.tracking import environment  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)


class Target:
    """The attributes of a qdflash target that the engine and the drafter read."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype


def timed(fn, device, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls, synchronized around each (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="target layers (SmolLM2: 30)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": args.layers})
    target = Target(LlamaForCausalLM(config).to(device=device, dtype=dtype).eval())
    drafter = init_drafter(target, block_size=args.block, num_layers=2).to(dtype).eval()
    layer_ids = drafter.config.target_layer_ids
    max_len = args.context + 4 * args.block
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
                    "context": args.context, "block": args.block, "target_layers": args.layers, "reps": args.reps,
                    "env": environment()}

    engine = build_engine(target, max_len=max_len)
    cuda = device.type == "cuda"
    engine.capture([1, args.block], layer_ids, cuda_graphs=cuda)
    ids = torch.randint(100, 40000, (args.context,), device=device)
    _, features = engine.forward(ids, 0, layer_ids)  # the context the drafter reads
    one = torch.tensor([7], device=device)
    block = torch.randint(100, 40000, (args.block,), device=device)
    result["target_decode_ms"] = timed(lambda: engine.forward(one, args.context, layer_ids), device, args.reps)
    result["target_verify_ms"] = timed(lambda: engine.forward(block, args.context, layer_ids), device, args.reps)

    eager = DrafterSession(drafter)
    eager.append(features, 0)
    static = DrafterEngine(drafter, max_len=max_len, cuda_graphs=cuda)
    result["drafter_static_graphs"] = static.capture(None)  # before the generation, as bench_speedup does
    static.session().append(features, 0)
    same = eager.draft(11, args.context).tolist() == static.draft(11, args.context).tolist()
    result["drafts_equal"] = bool(same)
    result["draft_eager_ms"] = timed(lambda: eager.draft(11, args.context), device, args.reps)
    result["draft_static_ms"] = timed(lambda: static.draft(11, args.context), device, args.reps)
    two = features[:2]

    def append_eager():  # grow by 2 positions, then drop them again: the same context every time
        keys, values, positions = eager.keys, eager.values, eager.positions
        eager.append(two, args.context)
        eager.keys, eager.values, eager.positions = keys, values, positions

    def append_static():
        static.append(two, args.context)
        static.length = args.context

    result["append2_eager_ms"] = timed(append_eager, device, args.reps)
    result["append2_static_ms"] = timed(append_static, device, args.reps)
    # five rounds that accept 1..5 positions each, through the append graphs captured on first use:
    # the static drafts must stay the eager ones
    agree, position = [], args.context
    for accepted in range(1, 6):
        part = features[position - args.context : position - args.context + accepted]
        eager.append(part, position)
        static.append(part, position)
        position += accepted
        agree.append(eager.draft(11, position).tolist() == static.draft(11, position).tolist())
    result["rounds_equal"] = agree
    for kind in ("eager", "static"):
        round_ms = result[f"draft_{kind}_ms"] + result["target_verify_ms"] + result[f"append2_{kind}_ms"]
        result[f"round_{kind}_ms"] = round(round_ms, 4)
        result[f"round_{kind}_in_decode_steps"] = round(round_ms / result["target_decode_ms"], 3)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
