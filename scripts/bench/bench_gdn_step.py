"""The fused Gated DeltaNet layer middle (`kernels.gated_delta.gated_delta_step`) alone, at Qwen3.5-4B's layer
shape, over its launch shapes: how many value columns a program owns (`block_v`) and its warps.

    python scripts/bench/bench_gdn_step.py --out gdn_step.json

Why: in a compiled verify block of 16 tokens the kernel takes ~30% of the block's device time (~62 us a
layer on the H200, `bench_components --profile`, `target16.verify_kernels`), against ~7 us in a decode
step: its 16 tokens run one after another, and each token's recurrence reduces the state over the key
dimension twice (k @ S and q @ S). Where that dimension spans warps the reductions go through shared memory
and barriers; fewer warps and narrower value blocks keep them inside a warp, at the price of more programs
recomputing the same conv and gates. This times each launch shape for a decode step (T = 1) and a verify
block (T = 16, with the per-position states a rollback needs, and without), each over enough layers' inputs
and states that they come from HBM, inside one CUDA graph (launches not timed), and checks every shape's
outputs against the default one's.

`--variants` times each launch shape again as: `dot` (the default: the kernel computes the a / b projection of the
hidden row itself, a HIDDEN-wide dot and cross-warp reduction per token), `given` (that product computed before,
as a fused qkvz + ba projection would give it: the kernel reads 2 values a token), `two_phase` (`given` through the
block kernel that computes every token's inputs first, then runs the recurrence alone; a decode step, one token,
keeps the step kernel), `two_phase_dot` (that block kernel computing the a / b projection itself, as the engine's
default gdn_ba='dot' runs it), `chunked` (that block kernel with the block's recurrence as matmuls, the chunked form:
`kernels.gated_delta._chunk_state`; one token keeps the step kernel) and `chunked_dot` (with the projection in the
kernel). `two_phase_dot_kept`: `two_phase_dot` keeping its tokens' inputs and only the state before the block instead
of every position's state (`gated_delta_step(kept=)`, the engine's `gdn_replay`; timed where states are kept), and
then the rollback's replay of 1, 2, 4, 6 and 15 of its tokens for 24 layers in one launch (`gated_delta_replay`; a row
each, as it is and lean, with the states' max abs difference).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from qdflash.kernels import copies_past_l2, graph_ms
from qdflash.kernels.gated_delta import gated_delta_replay, gated_delta_step, replay_scratch, replay_tables

# Qwen3.5-4B's linear-attention layers: 16 key heads, 32 value heads, head dims 128, conv kernel 4, hidden 2560
SHAPE = dict(key_heads=16, heads=32, dk=128, dv=128, kw=4, hidden=2560)
# (block_v, num_warps); the default first (the step kernel's, and the two-phase block kernel's: BLOCK_WARPS)
LAUNCHES = [(16, 4), (16, 8), (32, 4), (32, 8), (8, 4), (16, 2), (8, 2), (64, 8)]
VARIANTS = ("dot", "given", "two_phase", "two_phase_dot", "two_phase_dot_kept", "chunked", "chunked_dot")
REPLAY_LAYERS = 24  # Qwen3.5-4B's GDN layers
# a round replays tau - 1 tokens (tau 2-7 in practice); 15 is a rollback to all but the last of a 16-token block
REPLAY_TOKENS = (1, 2, 4, 6, 15)


def launch_list(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(pair) != 2 or min(pair) < 1 for pair in out):
        raise argparse.ArgumentTypeError(f"--launches: expected block_v x num_warps pairs like 16x4,32x8, got {text!r}")
    return out


def layer_inputs(t: int, position: int, device, g: torch.Generator) -> dict:
    s = SHAPE
    key_dim = s["key_heads"] * s["dk"]
    conv_dim = 2 * key_dim + s["heads"] * s["dv"]
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(t, s["hidden"], generator=g).to(**bf16)
    ba = (torch.randn(2 * s["heads"], s["hidden"], generator=g) * 0.02).to(**bf16)
    return dict(
        qkvz=torch.randn(t, conv_dim + s["heads"] * s["dv"], generator=g).to(**bf16),
        conv_in=torch.randn(position + 16, conv_dim, generator=g).to(**bf16),
        conv_weight=(torch.randn(conv_dim, 1, s["kw"], generator=g) * 0.5).to(**bf16),
        positions=torch.arange(position, position + t, device=device),
        x=x,
        ba=ba,
        ba_product=(x @ ba.T).contiguous(),  # b, a of every head: the `given` variant's input
        decay=-torch.rand(s["heads"], generator=g).to(device),
        dt_bias=torch.randn(s["heads"], generator=g).to(**bf16),
        state=(torch.randn(s["heads"], s["dk"], s["dv"], generator=g) * 0.1).to(device),
        states=torch.zeros(t + 1, s["heads"], s["dk"], s["dv"], device=device) if t > 1 else None,
    )


def run(layer: dict, block_v: int, num_warps: int, keep_states: bool, variant: str = "dot"):
    given = variant in ("given", "two_phase", "chunked")  # the _dot block variants compute b / a in the kernel (BA_DOT)
    return gated_delta_step(layer["qkvz"], layer["conv_in"], layer["conv_weight"], layer["positions"], layer["x"],
                            layer["ba_product"] if given else layer["ba"], layer["decay"], layer["dt_bias"], layer["state"],
                            layer["states"] if keep_states else None, key_heads=SHAPE["key_heads"],
                            key_dim=SHAPE["key_heads"] * SHAPE["dk"], ba_weight=not given, block_v=block_v, num_warps=num_warps,
                            two_phase=variant.startswith("two_phase"), chunked=variant.startswith("chunked"),
                            kept=kept_scratch(layer, block_v) if variant.endswith("_kept") else None)


def kept_scratch(layer: dict, block_v: int) -> torch.Tensor:
    """The layer's kept scratch for a launch of `block_v` value columns (its layout's), made at its first call (a
    graph's warm-up, before capture)."""
    key = f"kept_{block_v}"
    if key not in layer:
        s = SHAPE
        layer[key] = torch.zeros(replay_scratch(s["heads"], s["dk"], s["dv"], layer["qkvz"].shape[0], block_v),
                                 device=layer["qkvz"].device)
    return layer[key]


def variant_list(text: str) -> list[str]:
    out = text.split(",")
    if any(v not in VARIANTS for v in out) or len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"--variants: expected distinct names of {','.join(VARIANTS)}, comma-separated, got {text!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", type=int, default=1024, help="the block's first position (conv history before it)")
    parser.add_argument("--launches", type=launch_list, default=LAUNCHES,
                        help="block_v x num_warps, comma-separated (e.g. 16x4,32x8); the first is the reference")
    parser.add_argument("--variants", type=variant_list, default=["dot"],
                        help=f"comma-separated, of {','.join(VARIANTS)} (the module docstring says what each is)")
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn_step: needs a CUDA device (the kernel is timed, not emulated)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for t, keep_states in ((1, False), (16, True), (16, False)):
        state_bytes = SHAPE["heads"] * SHAPE["dk"] * SHAPE["dv"] * 4 * (t + 2 if keep_states else 2)
        layers = [layer_inputs(t, args.position, "cuda", g) for _ in range(copies_past_l2(state_bytes))]
        snapshot = [layer["state"].clone() for layer in layers]
        reference = None
        for variant in args.variants:
            if variant.endswith("_kept") and not keep_states:  # (it keeps the first state: a block with states)
                continue
            for block_v, num_warps in args.launches:
                for layer, state in zip(layers, snapshot):
                    layer["state"].copy_(state)
                out = run(layers[0], block_v, num_warps, keep_states, variant)  # compiles; from the same state each time
                if reference is None:
                    reference = out
                diff = float((out - reference).abs().max())
                us = graph_ms(lambda: [run(layer, block_v, num_warps, keep_states, variant) for layer in layers]) / len(layers) * 1e3
                row = {"tokens": t, "per_position_states": keep_states, "variant": variant, "block_v": block_v,
                       "num_warps": num_warps, "us_per_layer": round(us, 2), "max_abs_vs_first": diff}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if "two_phase_dot_kept" in args.variants:  # the rollback's replay: every layer in one launch, default launch shape
        s = SHAPE
        state = [torch.randn(s["heads"], s["dk"], s["dv"], device="cuda") for _ in range(REPLAY_LAYERS)]
        states0 = [x.clone() for x in state]
        kept = [torch.randn(replay_scratch(s["heads"], s["dk"], s["dv"], 16), device="cuda") for _ in range(REPLAY_LAYERS)]
        tables = replay_tables(states0, kept, state)
        for n in REPLAY_TOKENS:
            first = None
            for lean in (False, True):  # gated_delta_replay(lean=): the state's reduction alone, the next row ahead
                gated_delta_replay(tables, n, lean=lean)
                torch.cuda.synchronize()
                got = torch.stack(state)
                first = got if first is None else first
                us = graph_ms(lambda: gated_delta_replay(tables, n, lean=lean)) * 1e3
                row = {"replay_layers": REPLAY_LAYERS, "replay_tokens": n, "lean": lean, "us_per_launch": round(us, 2),
                       "bytes": (2 * state[0].numel() + n * kept[0][:, 0].numel()) * REPLAY_LAYERS * 4,
                       "max_abs_vs_first": float((got - first).abs().max())}
                row["GBps"] = round(row["bytes"] / us / 1e3, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"shape": SHAPE, "position": args.position, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
