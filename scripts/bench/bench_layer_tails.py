"""A Gated DeltaNet layer's gated RMSNorm through its kernel (`kernels.gated_norm`) against the model's module
compiled by inductor with the engine's options (`engine.base.compiled_step`), alone, at Qwen3.5-4B's shape; with
`--attention-steps`, compiled steps of attention layers with and without `kernels.qk_norm_rope`.

    python scripts/bench/bench_layer_tails.py --out tails.json
    python scripts/bench/bench_layer_tails.py --attention-steps --out attention.json

Why: a compiled decode step is ~400 launches, most a few microseconds of latency at one row, and inductor made this
norm two of them a GDN layer; what matters is whether the one launch does the work in less time than the two did.
Timed for a decode step (T = 1) and a verify block (T = 16) inside a CUDA graph over enough layers' inputs that they
come from HBM (`copies_past_l2`), launches and the time between them included; outputs set against inductor's
(`max_abs`, `equal_fraction`: inductor keeps some of the module's bf16 roundings in fp32, the kernel makes them all).
(A decode attention that merged its chunks in its own launch was timed here too, at `12579ff`: it lost, and is gone.)

`--attention-steps`: a model of `--layers` full-attention layers at Qwen3.5-4B's shape (a small vocabulary: the head
is not what is timed), two engines (`LeanQwen35.qk_norm_rope_kernel` on and off: an attention layer's q / k norms,
rotation and cache writes in one launch, or inductor's kernels), each decode step and verify block compiled and
captured as the engine does at position `--context`, timed in turn for `--rounds` rounds (each a median of `--reps`
replays): what the launch saves in a whole compiled step, and that it compiles there. Logits set against each other.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from bench_gdn_step import SHAPE  # Qwen3.5-4B's GDN layer shape, one definition for both scripts (run from their folder)
from qdflash.engine.base import compiled_step
from qdflash.kernels import copies_past_l2, graph_ms
from qdflash.kernels.gated_norm import gated_rms_norm


def gated_norm_rows(t: int, device, reps: int, dtype=torch.bfloat16) -> dict:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    h, d = SHAPE["heads"], SHAPE["dv"]
    width = 2 * SHAPE["key_heads"] * SHAPE["dk"] + 2 * h * d  # a qkvz row: q, k, v, then z
    g = torch.Generator().manual_seed(t)
    norm = Qwen3_5RMSNormGated(d, eps=1e-6).to(device, dtype).requires_grad_(False)  # inference, as a step runs it
    norm.weight.data = (1.0 + 0.2 * torch.randn(d, generator=g)).to(device, dtype)
    layers = copies_past_l2(t * width * 2)
    os = [torch.randn(t, h, d, generator=g).to(device) for _ in range(layers)]
    rows = [torch.randn(t, width, generator=g).to(device, dtype) for _ in range(layers)]
    zs = [r[:, -h * d:] for r in rows]  # the z tail of a qkvz projection's rows

    def module(o, z):
        return norm(o.to(z.dtype), z.reshape(t, h, d)).reshape(t, -1)

    compiled = compiled_step(module, True)  # as the engine compiles a step (its inductor options)
    out = {"layers": layers}
    ours, theirs = gated_rms_norm(os[0], zs[0], norm.weight, norm.variance_epsilon), compiled(os[0], zs[0])
    out["max_abs"] = float((ours.float() - theirs.float()).abs().max())
    out["equal_fraction"] = float((ours == theirs).float().mean())
    out["kernel_us"] = graph_ms(lambda: [gated_rms_norm(o, z, norm.weight, norm.variance_epsilon)
                                         for o, z in zip(os, zs)], reps) / layers * 1e3
    out["inductor_us"] = graph_ms(lambda: [compiled(o, z) for o, z in zip(os, zs)], reps) / layers * 1e3
    return out


def attention_steps(args) -> dict:
    """`--attention-steps` (module docstring): per step, the engine with the kernel against without it."""
    import statistics

    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from bench_components import SHAPES  # the Qwen3.5-4B text config, one definition
    from qdflash.bench import device_timer, spread, timed_in_turn
    from qdflash.engine import build_engine

    device = args.device
    shape = {**SHAPES[args.shape], "num_hidden_layers": args.layers, "vocab_size": 1024,
             "layer_types": ["full_attention"] * args.layers}
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**shape), dtype=args.dtype).eval()
    target = type("Target", (), {"model": model, "config": model.config})()
    prompt = torch.randint(0, 1024, (args.context,), device=device)
    engines, steps = {}, {}
    for arm, on in (("kernel", True), ("inductor", False)):
        engine = build_engine(target, max_len=args.context + 32, kernels=True, attention="kernel")
        engine.qk_norm_rope_kernel = on
        with torch.no_grad():
            engine.forward(prompt, 0)  # the caches hold `context` positions
        engine.capture([1, 16], None, cuda_graphs=device == "cuda", compile=True, lengths=[engine.max_len])
        engines[arm] = engine
        for t in (1, 16):
            graph, tokens = engine.graph_for(t, None, args.context + t), torch.zeros(t, dtype=torch.long, device=device)
            steps[f"{arm}.t{t}"] = (lambda graph=graph, tokens=tokens: graph(tokens, args.context))
    out = {"layers": args.layers, "context": args.context, "rounds": args.rounds}
    for t in (1, 16):
        a, b = steps[f"kernel.t{t}"]()[0].float().clone(), steps[f"inductor.t{t}"]()[0].float()
        out[f"t{t}.logits_max_abs"] = float((a - b).abs().max())
    times = timed_in_turn(device_timer(device), steps, args.rounds, args.reps)
    for name, values in times.items():
        out[f"{name}_us"] = round(statistics.median(values) * 1e3, 2)
    for t in (1, 16):
        saved = [(b - a) * 1e3 / args.layers for a, b in zip(times[f"kernel.t{t}"], times[f"inductor.t{t}"])]
        out[f"t{t}.saved_us_per_layer"] = spread(saved, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="graph replays a time is the median of")
    parser.add_argument("--attention-steps", action="store_true",
                        help="compiled steps of attention layers with and without kernels.qk_norm_rope instead")
    parser.add_argument("--layers", type=int, default=8, help="--attention-steps: attention layers (Qwen3.5-4B has 8)")
    parser.add_argument("--context", type=int, default=1024, help="--attention-steps: the position steps run at")
    parser.add_argument("--rounds", type=int, default=7, help="--attention-steps: rounds of the arms timed in turn")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.shape, args.device, args.dtype = "qwen3.5-4b", "cuda", torch.bfloat16  # (the CPU test runs tiny ones)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it times launches in CUDA graphs)")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version()}
    if args.attention_steps:
        result["attention_steps"] = attention_steps(args)
        print(json.dumps(result, indent=1), flush=True)
    else:
        for t in (1, 16):
            result[f"gated_norm.t{t}"] = gated_norm_rows(t, "cuda", args.reps)
            print(json.dumps({k: v for k, v in result.items() if k.endswith(f"t{t}")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
