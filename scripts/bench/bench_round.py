"""What one speculative round costs at a target's shape (SmolLM2-135M; `--shape qwen2.5-coder-0.5b`),
part by part, in one process.

    python3 scripts/bench/bench_round.py --out $OUT/round.json          # the H200 (core wheels only)
    python3 scripts/bench/bench_round.py --layers 2 --context 64 --reps 3   # the CPU: the code path only
    python3 scripts/bench/bench_round.py --shape qwen2.5-coder-0.5b --verify-tokens 2,3,4,6,8,16 --out $OUT/r.json
    python3 scripts/bench/bench_round.py --shape qwen2.5-coder-0.5b --w4 32 --drafter-dtype float32 --context 8192 --verify-tokens 6

Speed does not depend on weight values, so the target is the shape's config with random weights,
built on the device (no download), and the drafter is an untrained 2-layer DFlash drafter for it.
Each is timed with the context holding `--context` positions (median of `--reps`, synchronized):
- the target's decode step (1 token) and verify block (`--block` tokens) on the lean engine's CUDA graphs,
  its kernels tuned first as bench_speedup tunes them (`kernel_tuning` in the JSON);
- one draft, eager (DrafterSession: K/V concatenated, kernels launched from Python) and static
  (DrafterEngine: K/V in place, one CUDA graph per context bucket), checked to give the same drafts;
  beside it the target's LM head alone on the block's positions (the drafter shares it: for
  Qwen2.5's 151,936 x 896 head that read is a large part of a draft);
- appending the features of 2 accepted positions to the drafter's context, eager and static (static: the
  features stored, their K/V written by the next draft's graph, so the static draft's time includes
  them); then five rounds accepting 1..5 positions, checked to draft the same both ways.
`--compile`: every captured step (decode, verify, draft) through torch.compile first, as bench.compile.
`--profile` (CUDA): where each part's device time goes, kernel by kernel (bench_components.kernel_breakdown:
torch.profiler over replays, grouped into matmuls, attention, ...): the decode step, the whole block's verify and
each V-token verify, the static draft and the append ('profile' in the JSON, with each verify's excess over the
decode step by group: what makes a verify cost more than a decode step).
`--attention sdpa,kernel`: the decode step, the verify blocks and the static draft again with each other
attention (EngineBase.set_attention, DrafterEngine(attention=)), on the same context, with the block's
logits against the first's, and each verify length's round.
A speculative round is draft + verify + append (+ host work); at acceptance length tau it beats
autoregressive decoding when it costs less than tau decode steps. `--verify-tokens 2,3,...`: the
verify step of each V tokens (the committed one + V-1 drafts; qdflash.spec's verify_tokens), each
captured as a CUDA graph, and the round with it (`verify.<V>` in the JSON: verify ms, round ms and
in decode steps, and the whole loop at that V). Then the whole loop, host work
included: `--new` tokens of autoregressive generation (ms per token) and of speculative generation
with the eager and the static drafter (ms per round), after the prefill, checked to emit the same
tokens (in bf16 with random weights, near-ties are everywhere: a difference is recorded, not a failure).
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
from qdflash.models import synchronize  # noqa: E402
from qdflash.spec import DrafterSession, autoregressive_generate, speculative_generate, verify_length  # noqa: E402
from qdflash.tracking import environment  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_theta=1000000.0)
SHAPES = {"smollm2-135m": ("llama", SMOLLM2), "qwen2.5-coder-0.5b": ("qwen2", QWEN25_05B)}


def random_model(shape_name: str, layers: int | None, device, dtype):
    """The shape's model (transformers' class) with random weights, built on the device: speed does
    not depend on weight values. `layers`: None for the shape's own depth."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, shape = SHAPES[shape_name]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]})
    return model_cls(config).to(device=device, dtype=dtype).eval()


class Target:
    """The attributes of a qdflash target that the engine and the drafter read."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype


def draft_variants(drafter, target, features, max_len: int, attention: str, args, device, decode_ms: float) -> dict:
    """The static draft with the drafter's weights in fp32 and in bf16, each captured as it is and
    compiled first, on the same context: ms, in decode steps, and whether its drafts are the first
    variant's (bf16 or a compiled step may round a near-tie otherwise: recorded, not required; drafts
    only propose, so what the target emits never depends on it)."""
    from qdflash.drafter.model import Drafter

    cuda = device.type == "cuda"
    out, first = {}, None
    for dtype in (torch.float32, torch.bfloat16):
        for compile in (False, args.draft_variants):
            copy = Drafter(drafter.config)
            copy.load_state_dict(drafter.state_dict())
            copy = copy.to(device=device, dtype=dtype).eval().bind(target)
            engine = DrafterEngine(copy, max_len=max_len, cuda_graphs=cuda, attention=attention, compile=compile)
            if compile is False:  # its fused shapes in this dtype, before capture (the compiled engine's are the same)
                engine.tune_kernels()
            engine.capture(None)
            engine.session().append(features, 0)
            drafts = engine.draft(11, args.context).tolist()
            first = drafts if first is None else first
            ms = timed(lambda: engine.draft(11, args.context), device, args.reps)
            out[str(dtype).removeprefix("torch.") + ("+compiled" if compile else "")] = {
                "draft_ms": round(ms, 4), "in_decode_steps": round(ms / decode_ms, 3), "same_drafts": drafts == first}
            del engine, copy
    return out


def profile_parts(engine, static, one, block, verify_counts, layer_ids, context: int, append) -> dict:
    """Device time by kernel group of the decode step, each verify (the whole block and every V), the static
    draft and the append (bench_components.kernel_breakdown), and each verify's excess over the decode step by
    group. A profile that fails is reported, not raised: it is extra to the timings."""
    from bench_components import kernel_breakdown

    parts = {"decode": lambda: engine.forward(one, context, layer_ids),
             f"verify{block.shape[0]}": lambda: engine.forward(block, context, layer_ids),
             **{f"verify{v}": (lambda v=v: engine.forward(block[:v], context, layer_ids)) for v in verify_counts},
             "draft": lambda: static.draft(11, context), "append2": append}
    out = {}
    for name, fn in parts.items():
        try:
            out[name] = kernel_breakdown(fn, "cuda")
        except Exception as err:  # noqa: BLE001
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    decode = out["decode"].get("groups_us", {})
    for name, row in list(out.items()):
        if name.startswith("verify") and "groups_us" in row:
            groups = set(decode) | set(row["groups_us"])
            row["excess_over_decode_us"] = {g: round(row["groups_us"].get(g, 0.0) - decode.get(g, 0.0), 1) for g in sorted(groups)}
    return out


def timed(fn, device, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls, synchronized around each (after 3 warm-ups).
    Wall clock, not CUDA events (qdflash.bench.device_timer): an eager draft's host work before its
    first kernel is part of what it costs, and events would not see it."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's; SmolLM2 30, Qwen2.5-0.5B 24)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--new", type=int, default=32, help="tokens generated by the whole-loop timing")
    parser.add_argument("--verify-tokens", default=None,
                        help="comma-separated verify lengths V (1 < V <= --block): time the V-token verify and the round at each")
    parser.add_argument("--w4", type=int, default=None, metavar="GROUP",
                        help="quantize the target's linears to W4 with this group size first (RTN; the engine packs them for "
                             "the W4A16 kernel): the round of a quantized target, as bench_speedup's spec_qad_* methods run it")
    parser.add_argument("--drafter-dtype", choices=["target", "float32"], default="target",
                        help="the drafter's weights: the target's dtype, or fp32 as load_drafter gives them to bench_speedup")
    parser.add_argument("--attention", default="sdpa",
                        help="comma-separated: the engines' attention (EngineBase.set_attention, DrafterEngine(attention=)); the "
                             "first runs everything, each other one times the decode step, the verify blocks and the static draft "
                             "again, side by side ('attention' in the JSON)")
    parser.add_argument("--kernels", choices=["auto", "on"], default="auto",
                        help="the engine's Triton kernels: auto (on CUDA) or on (also the CPU, under TRITON_INTERPRET=1)")
    parser.add_argument("--compile", nargs="?", const=True, default=False,
                        help="the target's steps and the static drafter's draft step through torch.compile before capture "
                             "(bench.compile); a value: the torch.compile backend (the CPU: aot_eager)")
    parser.add_argument("--draft-variants", nargs="?", const=True, default=False, metavar="BACKEND",
                        help="the static draft again with the drafter's weights in fp32 (as training saves them, what "
                             "bench_speedup ran until bench.drafter_dtype) and in bf16, each as a CUDA graph and compiled then "
                             "captured (bench.compile_drafter), side by side on the same context ('draft_variants' in the JSON); "
                             "a value: the torch.compile backend (the CPU: aot_eager)")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: each part's device time by kernel and kernel group ('profile' in the JSON)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    args.layers = args.layers or SHAPES[args.shape][1]["num_hidden_layers"]
    model = random_model(args.shape, args.layers, device, dtype)
    if args.w4:  # the quantize_target node's default linears, RTN on the symmetric 4-bit grid
        from qdflash.quant.apply import quantize_weights, replace_linears, select_linears
        from qdflash.quant.grid import GridSpec

        replace_linears(model, quantize_weights(model, select_linears(model), GridSpec(4, args.w4, True), method="rtn"))
        model.to(device)
    target = Target(model)
    drafter = init_drafter(target, block_size=args.block, num_layers=2).eval()
    if args.drafter_dtype == "target":
        drafter.to(dtype)
    layer_ids = drafter.config.target_layer_ids
    verify_counts = sorted({verify_length(drafter, int(v)) for v in args.verify_tokens.split(",")}) if args.verify_tokens else []
    max_len = args.context + args.new + 4 * args.block
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype), "shape": args.shape,
                    "target_weights": f"w4g{args.w4} (RTN)" if args.w4 else "16-bit", "drafter_dtype": str(drafter.norm.weight.dtype),
                    "context": args.context, "block": args.block, "target_layers": args.layers, "reps": args.reps,
                    "compile": args.compile,
                    "env": environment()}

    attentions = args.attention.split(",")
    cuda = device.type == "cuda"
    ids = torch.randint(100, 40000, (args.context,), device=device)  # inside every shape's vocabulary
    one = torch.tensor([7], device=device)
    block = torch.randint(100, 40000, (args.block,), device=device)

    def engine_with(attention):
        """An engine with the context fed. Every verify length is captured first: a capture runs the
        step at the end of each cache length it reads, which would overwrite the context's positions."""
        built = build_engine(target, max_len=max_len, kernels=True if args.kernels == "on" else "auto", attention=attention)
        if "kernel_tuning" not in result:  # as bench_speedup does before capturing: tiles per shape, and which
            result["kernel_tuning"] = built.tune_kernels()  # shapes run the 16-bit weight instead ({} off the GPU)
        built.capture(sorted({1, args.block, *verify_counts}), layer_ids, cuda_graphs=cuda, compile=args.compile)
        _, context_features = built.forward(ids, 0, layer_ids)  # the context the drafter reads
        return built, context_features

    def step_times(built) -> tuple[float, float, dict[int, float]]:
        """The decode step, the whole block's verify, and each V-token verify, in ms."""
        return (timed(lambda: built.forward(one, args.context, layer_ids), device, args.reps),
                timed(lambda: built.forward(block, args.context, layer_ids), device, args.reps),
                {v: timed(lambda: built.forward(block[:v], args.context, layer_ids), device, args.reps) for v in verify_counts})

    engine, features = engine_with(attentions[0])
    result["attention"] = {"used": attentions[0]}
    result["target_decode_ms"], result["target_verify_ms"], verify_ms = step_times(engine)
    verify: dict[int, dict] = {v: {"verify_ms": ms} for v, ms in verify_ms.items()}
    reference_logits = engine.forward(block, args.context, layer_ids)[0].float().clone()
    others = {}
    for attention in attentions[1:]:  # the same steps with another attention, on the same context
        other, _ = engine_with(attention)
        decode_ms, verify_all_ms, other_verify = step_times(other)
        logits = other.forward(block, args.context, layer_ids)[0].float()
        others[attention] = {
            "decode_ms": decode_ms, "verify_ms": verify_all_ms,
            "verify": {str(v): {"verify_ms": ms, "verify_in_decode_steps": round(ms / decode_ms, 3)} for v, ms in other_verify.items()},
            "max_logit_difference": round((logits - reference_logits).abs().max().item(), 5),  # the block's logits, vs the first
            "same_argmax": bool(torch.equal(logits.argmax(-1), reference_logits.argmax(-1))),
        }
        del other

    eager = DrafterSession(drafter)
    eager.append(features, 0)
    static = DrafterEngine(drafter, max_len=max_len, cuda_graphs=cuda, attention=attentions[0], compile=args.compile)
    static.tune_kernels()  # its fused shapes ({} off the GPU); the other attention's engines run the same shapes
    result["drafter_static_graphs"] = static.capture(None)  # before the generation, as bench_speedup does
    static.session().append(features, 0)
    for attention, row in others.items():  # the static drafter with that attention, on the same context
        drafter_other = DrafterEngine(drafter, max_len=max_len, cuda_graphs=cuda, attention=attention, compile=args.compile)
        drafter_other.capture(None)
        drafter_other.session().append(features, 0)
        row["draft_static_ms"] = timed(lambda: drafter_other.draft(11, args.context), device, args.reps)
        row["same_drafts"] = drafter_other.draft(11, args.context).tolist() == static.draft(11, args.context).tolist()
        del drafter_other
    result["attention"].update(others)
    same = eager.draft(11, args.context).tolist() == static.draft(11, args.context).tolist()
    result["drafts_equal"] = bool(same)
    result["draft_eager_ms"] = timed(lambda: eager.draft(11, args.context), device, args.reps)
    result["draft_static_ms"] = timed(lambda: static.draft(11, args.context), device, args.reps)
    if args.draft_variants:
        result["draft_variants"] = draft_variants(drafter, target, features, max_len, attentions[0], args, device,
                                                  result["target_decode_ms"])
    hidden = torch.randn(args.block - 1, target.config.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        result["lm_head_block_ms"] = timed(lambda: target.model.lm_head(hidden), device, args.reps)
    two = features[:2]

    def append_eager():  # grow by 2 positions, then drop them again: the same context every time
        keys, values, positions = eager.keys, eager.values, eager.positions
        eager.append(two, args.context)
        eager.keys, eager.values, eager.positions = keys, values, positions

    def append_static():  # what a round's append costs: its rows are written by the next draft, timed with it
        static.append(two, args.context)
        static.length, static.pending = args.context, False

    result["append2_eager_ms"] = timed(append_eager, device, args.reps)
    result["append2_static_ms"] = timed(append_static, device, args.reps)
    if args.profile and cuda:
        result["profile"] = profile_parts(engine, static, one, block, verify_counts, layer_ids, args.context, append_static)
    # five rounds that accept 1..5 positions each, each append written by the next draft's graph:
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
    for v, row in verify.items():  # the static drafter's round with a V-token verify (it still drafts the whole block)
        row["verify_in_decode_steps"] = round(row["verify_ms"] / result["target_decode_ms"], 3)
        round_ms = result["draft_static_ms"] + row["verify_ms"] + result["append2_static_ms"]
        row["round_static_ms"] = round(round_ms, 4)
        row["round_static_in_decode_steps"] = round(round_ms / result["target_decode_ms"], 3)
    for row in others.values():  # the same rounds with the other attention's draft, verify and decode step (append: the same)
        for v, part in row["verify"].items():
            round_ms = row["draft_static_ms"] + part["verify_ms"] + result["append2_static_ms"]
            part["round_static_ms"] = round(round_ms, 4)
            part["round_static_in_decode_steps"] = round(round_ms / row["decode_ms"], 3)

    # the whole loop, host work included: autoregressive and speculative generation of `--new` tokens
    # after the same prompt (the untrained drafter accepts ~nothing, so a round commits ~1 token)
    target.engine, target.eos_token_ids, target.tokenizer = engine, [], None
    engine.capture([1], None, cuda_graphs=cuda, compile=args.compile)  # the AR step reads no layer features (as bench_speedup)
    prompt = ids.tolist()
    ar = autoregressive_generate(target, [prompt], args.new)
    ar = autoregressive_generate(target, [prompt], args.new)  # the second run is timed (the first warms up)
    # after the prefill (not timed here: the prompt's forward, and the first token it gives): the
    # decode loop alone, per token and per round
    result["loop_ar_ms_per_token"] = round((ar.seconds - ar.prefill_seconds) * 1e3 / (len(ar.tokens) - 1), 4)
    for kind, attached in (("eager", None), ("static", static)):
        drafter.engine = attached
        speculative_generate(target, drafter, [prompt], args.new)
        spec = speculative_generate(target, drafter, [prompt], args.new)
        # in fp32 they must be equal; in bf16 a 16-row verify may round a near-tie differently (recorded)
        result[f"loop_{kind}_same_tokens_as_ar"] = spec.tokens == ar.tokens
        result[f"loop_{kind}_ms_per_round"] = round((spec.seconds - spec.prefill_seconds) * 1e3 / len(spec.acceptance_lengths), 4)
        result[f"loop_{kind}_tau"] = round(spec.tau, 3)
        result[f"loop_{kind}_round_in_decode_steps"] = round(result[f"loop_{kind}_ms_per_round"] / result["loop_ar_ms_per_token"], 3)
    drafter.engine = static
    for v, row in verify.items():  # the whole loop (static drafter) at each verify length
        speculative_generate(target, drafter, [prompt], args.new, verify_tokens=v)
        spec = speculative_generate(target, drafter, [prompt], args.new, verify_tokens=v)
        row["loop_same_tokens_as_ar"] = spec.tokens == ar.tokens
        row["loop_ms_per_round"] = round((spec.seconds - spec.prefill_seconds) * 1e3 / len(spec.acceptance_lengths), 4)
        row["loop_tau"] = round(spec.tau, 3)
        row["loop_round_in_decode_steps"] = round(row["loop_ms_per_round"] / result["loop_ar_ms_per_token"], 3)
    if verify:
        result["verify"] = {str(v): row for v, row in verify.items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
