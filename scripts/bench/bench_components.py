"""What one speculative round costs at the Qwen3.5-4B shape, part by part, against the bandwidth bound.

    python scripts/bench/bench_components.py --out $OUT/components.json          # the H200
    python scripts/bench/bench_components.py --shape tiny --reps 3                # the CPU: the code path only

Speed does not depend on weight values, so the target is built from docs/recipe.md's text config with
random weights, on the GPU (no download). Measured, each a CUDA graph replayed at a fixed position
after a prefill of `--context` tokens (median of `--reps` replays, CUDA events):
- the target's decode step (1 token) and verify block (`--block` tokens), 16-bit and W4A16 (RTN, the
  recipe's layers: symmetric, group 32; GDN in_proj_a/b, embeddings and the LM head stay 16-bit), and
  with `--w4-head` then the same W4 target with its LM head quantized too (`target_w4_head`: the head
  runs on the W4 backend tuning picks for its shape);
- the drafter's step (5 layers, the recipe's shape, 16-bit and W4 group 128): the context features of
  `--block` newly accepted positions (fc + their K/V in every layer) + the block forward over the cached
  context + the target's LM head on the block + argmax (with `--attention kernel` as the speed stage drafts:
  the accepted positions' K/V written into DrafterEngine's buffers, the block's after them, and
  kernels.decode_attention instead of a masked SDPA; `--drafter-only`: both, side by side); with
  `--w4-head` the W4 drafter again with its block's logits through the target's 4-bit head
  (`drafter_w4_head`, paired with `target_w4_head`), as DrafterEngine runs a quantized head;
- the matmuls alone (every projection and the LM head at 1 row, in one graph): what the rest of a decode
  step (norms, rotary, conv, recurrence, attention) costs on top of reading the weights;
- the 16-bit target twice: with cuBLAS for every matmul (`target16_cublas`), then after
  `kernels.gemv.tune` picked the Triton GEMV for each shape and row bucket (1 row, 16) where it beat cuBLAS
  (`target16`);
- `--unfused-gdn`: the 16-bit target again with each Gated DeltaNet layer's middle unfused (the buffer write,
  window, conv, silu / l2norm, gates, a / b matmul and recurrence as separate kernels, as before
  `kernels.gated_delta.gated_delta_step` fused them into one launch), and `fused_gdn.*_speedup` (unfused over fused);
- `--hf-generate`: transformers' own static compiled `generate` on the same 16-bit model at batch 1, its
  decode step's time from two generation lengths (`hf_static_generate`), and over this engine's steps;
- `--study`: the tuned 16-bit target and the W4 target, each with each further `--gdn-ba` mode (how the GDN gates get
  their b / a projection), and with `--gdn-two-phase` / `--gdn-chunked` each mode's verify block through the two-phase
  or chunked GDN block kernel, side by side (`study`);
- `--profile`: where a decode step's and a verify block's time goes, kernel by kernel (torch.profiler over graph
  replays), grouped into matmuls, recurrence, attention, fused elementwise (inductor) and the rest.
Each time is set against its bound: bytes it must read (weights, recurrent states read and written,
KV up to the context) / the device-to-device copy bandwidth measured in the same process. The speedup
these costs imply at acceptance length tau: tau * decode step / (verify block + drafter step).
`reference.*`: the same bytes at `--reference-gbps` (600: an A10G-class device, the paper's hardware
class), each part at its bound there (a verify block reads the decode step's bytes: at that bandwidth
16 tokens of compute hide under the weight reads), and the speedup those bounds imply at each tau:
where the H200 numbers would sit on a device that is only bandwidth.
Checks (bf16, reported): graph vs eager logits of a step; the W4A16 kernel vs the dequantized matmul.
The JSON is rewritten after each part, so a run cut off by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qdflash.bench import copy_bandwidth, device_timer as timer, spread, timed_in_turn
from qdflash.cudagraph import capture
from qdflash.drafter import init_drafter
from qdflash.drafter.static import DrafterEngine
from qdflash.engine import build_engine
from qdflash.engine.base import allow_compiles, compiled_since, compiled_step, dynamo_counts
from qdflash.engine.graphs import restore, snapshot, stacked_states
from qdflash.errors import raised_at
from qdflash.kernels.w4a16 import MAX_ROWS, w4a16_matmul
from qdflash.quant.apply import replace_linears, select_linears
from qdflash.quant.gptq import rtn_quantize
from qdflash.quant.grid import GridSpec
from qdflash.tracking import environment

SHAPES = {
    # docs/recipe.md: the Qwen3.5-4B text config (4.21 B parameters with the tied head)
    "qwen3.5-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       vocab_size=248320, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=1024, tie_word_embeddings=True),
}
DRAFTERS = {"qwen3.5-4b": dict(num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=9728),
            "tiny": dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)}


def build_target(shape: str, device: str, dtype: torch.dtype):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**SHAPES[shape], max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return SimpleNamespace(model=model, config=model.config)


def quantize_in_place(model, group: int, names=None) -> int:
    """RTN on the device, symmetric 4-bit (RecIPE's target grid); returns the number of layers."""
    names = names or select_linears(model)
    modules = dict(model.named_modules())
    spec = GridSpec(4, group, True)
    replace_linears(model, {n: rtn_quantize(modules[n].weight.detach(), spec) for n in names})
    return len(names)


def step_bytes(engine, context: int) -> dict[str, int]:
    """What a step must read: weights (projections, conv, norms, the LM head), recurrent states (read
    and written), KV of `context` positions."""
    weights = sum(p.nbytes for p in engine.projections()) + engine.head_proj.nbytes
    weights += sum(w["conv"].numel() * w["conv"].element_size() for w in engine.layers if "conv" in w)
    states = 2 * sum(s.numel() * 4 for s in engine.state.values())
    kv = 2 * sum(k.shape[0] * context * k.shape[2] * k.element_size() for k in engine.k_cache.values())
    return {"weights": weights, "states": states, "kv": kv, "total": weights + states + kv}


INDUCTOR = "fused elementwise (inductor)"
KERNEL_GROUPS = (  # (group, substrings of a kernel's name), first match wins; inductor's kernels are matched first
    ("w4a16 (ours)", ("w4a16",)), ("w4 mma (ours)", ("_w4_mma_",)), ("gemv (ours)", ("_gemv_kernel", "_gemv_rows_kernel")), ("gated delta (ours)", ("gated_delta",)),
    ("gated norm (ours)", ("_gated_rms_norm_kernel",)), ("qk norm rope (ours)", ("_qk_norm_rope_kernel",)),
    ("int4 matmul (tinygemm, Marlin, Machete)", ("tinygemm", "marlin", "machete")),  # before cuBLAS: "tinygemm" holds "gemm"
    ("cuBLAS matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
    ("attention", ("flash", "attention", "fmha", "sdpa")), ("memcpy / memset", ("memcpy", "memset")),
)


def kernel_group(name: str) -> str:
    """The KERNEL_GROUPS group of a profiled kernel. Inductor's kernels first, by their prefix: inductor names a kernel
    after the ops its region fuses, so a norm fused after Marlin's op is "triton_red_fused_..._marlin_w4_mm_...", which
    the substrings would count as an int4 matmul (the published runs up to 2026-12-05-h200-gdn-warps did: ~113 us of a
    W4 step's "int4 matmul" group there is inductor's). Our own Triton kernels are named "_<name>_kernel"."""
    if name.startswith("triton_"):
        return INDUCTOR
    return next((g for g, keys in KERNEL_GROUPS if any(k in name.lower() for k in keys)), "other")


def kernel_breakdown(step, device: str, replays: int = 20) -> dict:
    """Device time per call of `step` (a decode step or a verify block), by kernel and by group (torch.profiler
    over `replays` replays); device copies and fills count as kernels, in `kernels_per_step` too (the runs published
    up to 2026-12-05-h200-epilogues-pdl left them out)."""
    if device != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        # copies and fills count: a graph node that is no kernel of ours or inductor's would otherwise show only as a gap
        if us > 0 and not e.key.startswith("cuda"):
            kernels[e.key] = (us / replays, e.count / replays)
    groups = {}
    for name, (us, _) in kernels.items():
        group = kernel_group(name)
        groups[group] = round(groups.get(group, 0.0) + us, 1)
    # every kernel, not the few slowest: most of a step's launches are small ones, and which of them a fusion removes
    # is what the next change needs to know (run before run, from one profile)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"us_per_step": round(sum(us for us, _ in kernels.values()), 1), "groups_us": groups,
            "kernels_per_step": round(sum(c for _, c in kernels.values()), 1),
            "kernels": [{"kernel": name[:240], "us": round(us, 2), "calls": round(c, 1)} for name, (us, c) in ranked]}


def matmul_only(engine, device: str):
    """One graph (on CUDA) of every projection and the LM head at 1 row: the weight-reading floor."""
    inputs = {id(p): torch.randn(1, p.in_features, device=device, dtype=engine.dtype) for p in engine.projections()}
    x_head = torch.randn(1, engine.lm_head.shape[1], device=device, dtype=engine.dtype)

    def run():
        for p in engine.projections():
            p(inputs[id(p)])
        engine.head_proj(x_head)  # the LM head as the step runs it (16-bit, or a packed head's tuned backend)
    return graphed(run, device)


def graphed(fn, device: str):
    """`fn` as a replayable CUDA graph (the CPU: `fn` itself)."""
    return capture(fn)[0].replay if device == "cuda" else fn


def dynamo_report(before, prefix: str) -> dict:
    """`compiled_since(before)` as results `<prefix>_graphs`, `_graph_breaks`, `_recompile_limits`."""
    return {f"{prefix}_{key}": value for key, value in compiled_since(before).items()}


def measure_target(engine, args, device, layer_ids, bandwidth, label) -> dict:
    run = timer(device)
    prompt = torch.randint(0, engine.lm_head.shape[0], (args.context,), device=device)
    engine.reset()
    with torch.no_grad():
        engine.forward(prompt, 0)  # prefill (eager, chunked): the caches hold `context` positions
    cuda = device == "cuda"
    engine.capture([1], None, cuda_graphs=cuda, lengths=[engine.max_len])
    engine.capture([args.block], layer_ids, cuda_graphs=cuda, lengths=[engine.max_len])
    one = torch.randint(0, 1000, (1,), device=device)
    block = torch.randint(0, 1000, (args.block,), device=device)
    decode_graph, verify_graph = engine.graph_for(1, None, args.context + 1), engine.graph_for(args.block, layer_ids, args.context + args.block)
    # the graph's step and the eager step give the same logits (both at position `context`)
    saved = snapshot(engine)  # a step advances the recurrent states: both start from the same ones
    with torch.no_grad():
        graph_logits = decode_graph(one, args.context)[0].float().clone()
        restore(engine, saved)
        eager_logits = engine._step(one, torch.tensor([args.context], device=device), None, None)[0].float()
    decode_ms = run(lambda: decode_graph(one, args.context), args.reps)
    verify_ms = run(lambda: verify_graph(block, args.context), args.reps)
    replayed = replay_in_graph(engine, verify_graph, block, args.context, f"{label}.replay_in_graph")
    rollback = rollback_ms(engine, args, run, block)
    restore(engine, saved)
    floor_ms = run(matmul_only(engine, device), args.reps)
    compiled = {}
    if args.compile:  # the same decode step and verify block through torch.compile (fused elementwise work), captured
        try:
            t0, before = time.perf_counter(), dynamo_counts()
            engine.capture([1], None, cuda_graphs=cuda, compile=args.compile, lengths=[engine.max_len])  # replaces the eager one
            restore(engine, saved)
            got = engine.graph_for(1, None, args.context + 1)(one, args.context)[0].float()
            # (after a first call: without CUDA graphs a step compiles there) {graphs: 1, graph_breaks: {}} for one graph
            compiled.update(dynamo_report(before, f"{label}.decode_compiled"))
            compiled[f"{label}.compiled_vs_eager_max_abs"] = float((got - eager_logits).abs().max())
            compiled_graph = engine.graph_for(1, None, args.context + 1)
            compiled[f"{label}.decode_compiled_ms"] = round(run(lambda: compiled_graph(one, args.context), args.reps), 4)
            compiled[f"{label}.compile_s"] = round(time.perf_counter() - t0, 1)
            # the verify block compiled too: a round's target part, beside the compiled decode step
            before = dynamo_counts()
            engine.capture([args.block], layer_ids, cuda_graphs=cuda, compile=args.compile, lengths=[engine.max_len])
            verify_compiled = engine.graph_for(args.block, layer_ids, args.context + args.block)
            compiled[f"{label}.verify_compiled_ms"] = round(run(lambda: verify_compiled(block, args.context), args.reps), 4)
            compiled.update(dynamo_report(before, f"{label}.verify_compiled"))
            compiled.update(replay_in_graph(engine, verify_compiled, block, args.context, f"{label}.replay_in_compiled"))
            compiled[f"{label}.verify_compiled_over_decode_compiled"] = round(
                compiled[f"{label}.verify_compiled_ms"] / compiled[f"{label}.decode_compiled_ms"], 4)
        except Exception as err:  # noqa: BLE001 -- a failed compile is a result to report, not a crash
            compiled[f"{label}.compile_error"] = error_text(err)
            # to the log at once: a CUDA error is sticky, and the next device call raises it again before the result
            # is written (results/published/2026-12-06-h100-gdn-kept lost which step failed so)
            # in full: the result's 300 characters of an inductor SubprocException end before its worker's error
            # (results/published/2026-12-06-h100-lean-replay lost the tiny W4 head's so)
            print(f"{label}: compiled steps failed: {type(err).__name__}: {str(err)[-6000:]}", flush=True)
    if args.profile:  # the compiled graphs where they were captured
        step = engine.graph_for(1, None, args.context + 1)
        verify = engine.graph_for(args.block, layer_ids, args.context + args.block)
        for name, fn in (("decode", lambda: step(one, args.context)), ("verify", lambda: verify(block, args.context))):
            try:
                compiled[f"{label}.{name}_kernels"] = kernel_breakdown(fn, device)
            except Exception as err:  # noqa: BLE001 -- the profile is extra; its failure is reported
                compiled[f"{label}.{name}_kernels"] = {"error": error_text(err)}
        if f"{label}.decode_compiled_ms" in compiled:
            # the same compiled graphs timed again once the profiler has run in this process: a later part (an arm,
            # the W4 targets after the 16-bit one) is timed after a profile, and ran with more time between kernels
            # in results/published/2026-12-06-h100-multi-kernel; this says whether the profiler leaves that behind
            for name, fn in (("decode", lambda: step(one, args.context)), ("verify", lambda: verify(block, args.context))):
                if f"{label}.{name}_compiled_ms" in compiled:  # (a verify compile can fail after the decode one)
                    compiled[f"{label}.{name}_compiled_after_profile_ms"] = round(run(fn, args.reps), 4)
    need = step_bytes(engine, args.context)
    bound_ms = need["total"] / bandwidth * 1e3
    return {
        f"{label}.decode_ms": round(decode_ms, 4), f"{label}.verify_ms": round(verify_ms, 4),
        f"{label}.matmuls_only_ms": round(floor_ms, 4), f"{label}.bound_ms": round(bound_ms, 4),
        f"{label}.decode_of_bound": round(bound_ms / decode_ms, 4),
        f"{label}.verify_over_decode": round(verify_ms / decode_ms, 4), f"{label}.rollback_ms": round(rollback, 4),
        f"{label}.achieved_GBps": round(need["total"] / (decode_ms / 1e3) / 1e9, 1),
        f"{label}.bytes": need, f"{label}.tokens_per_s": round(1e3 / decode_ms, 1),
        f"{label}.graph_vs_eager_max_abs": float((graph_logits - eager_logits).abs().max()),
        f"{label}.logit_scale": float(eager_logits.abs().max()), **replayed, **compiled,
    }


def rollback_ms(engine, args, run, block) -> float:
    """A round's rollback, eager as a round runs it: into a verify block just fed (at `--context`), back to all but its
    last token (the most tokens a GDN replay recomputes, `LeanQwen35.gdn_replay`; without it, one copy of the kept
    states). Leaves the engine at `--context` positions."""
    with torch.no_grad():
        engine.forward(block, args.context)
    end = args.context + args.block

    def once():
        engine.length = end  # (the block stays fed: each call rolls the same block back)
        engine.rollback(end - 1)

    ms = run(once, args.reps)
    engine.length = end
    engine.rollback(args.context)
    return ms


def compiled_steps(engine, args, layer_ids, label, result) -> dict:
    """`label`'s compiled decode step and verify block as `measure_target` timed them (position `--context`), for
    `side_by_side`; none where they did not compile. Taken before any arm recaptures the engine's graphs."""
    if f"{label}.verify_compiled_ms" not in result:
        return {}
    device = engine.device
    one, block = torch.zeros(1, dtype=torch.long, device=device), torch.zeros(args.block, dtype=torch.long, device=device)
    decode = engine.graph_for(1, None, args.context + 1)
    verify = engine.graph_for(args.block, layer_ids, args.context + args.block)
    return {f"{label}.decode": lambda: decode(one, args.context), f"{label}.verify": lambda: verify(block, args.context)}


SIDE_BY_SIDE_ARMS = ("_pdl", "_kept_states", "_swiglu_unfused")  # engine arms whose compiled steps `side_by_side` times beside the targets'


def side_by_side_ratios(names) -> list[tuple[str, str, str]]:
    """(ratio, numerator step, denominator step) of `side_by_side` for the compiled steps `names` holds: issue 23's
    (the W4-head decode step's speedup over the 16-bit one, each target's verify over decode), for the targets' own
    graphs and, with --pdl (--kept-states-arm, --swiglu-arm), for those arms' too; and each arm's step against its target's (> 1:
    the arm faster)."""
    out = []
    for arm in ("", *SIDE_BY_SIDE_ARMS):
        if {f"target16{arm}.decode", f"target_w4_head{arm}.decode"} <= set(names):
            out.append((f"w4_head{arm}_decode_speedup_over_16bit{arm}", f"target16{arm}.decode", f"target_w4_head{arm}.decode"))
        for label in ("target16", "target_w4_head"):
            if {f"{label}{arm}.decode", f"{label}{arm}.verify"} <= set(names):
                out.append((f"{label}{arm}.verify_over_decode", f"{label}{arm}.verify", f"{label}{arm}.decode"))
    for arm in SIDE_BY_SIDE_ARMS:
        for label in ("target16", "target_w4_head"):
            for step in ("decode", "verify"):
                if {f"{label}.{step}", f"{label}{arm}.{step}"} <= set(names):
                    out.append((f"{label}{arm}.{step}_speedup", f"{label}.{step}", f"{label}{arm}.{step}"))
    return out


def side_by_side(steps: dict, result: dict, args, run) -> dict:
    """The compiled 16-bit and W4-head steps timed again in turn, `--side-by-side-rounds` rounds of one median of
    `--reps` replays each, and issue 23's ratios per round (`side_by_side.<ratio>`: median, min, max over rounds;
    the 16-bit step's fraction of its bound too). Why: two timings of the same graph in one process differed by up to
    6% (results/published/2026-12-06-h100-gated-norm, before and after its profile, in opposite directions for the
    two targets), as much as a ratio's distance to its threshold; steps timed minutes apart put that drift into
    their ratio, steps timed in turn spread it over both."""
    if not {"target16.decode", "target_w4_head.decode"} <= steps.keys():
        return {}
    times = timed_in_turn(run, steps, args.side_by_side_rounds, args.reps)
    out = {"side_by_side.rounds": args.side_by_side_rounds,
           **{f"side_by_side.{name}_ms": spread(values) for name, values in times.items()}}
    for name, top, bottom in side_by_side_ratios(times):
        out[f"side_by_side.{name}"] = spread([a / b for a, b in zip(times[top], times[bottom])])
    bound = result["target16.bound_ms"]
    out["side_by_side.target16.decode_of_bound"] = spread([bound / ms for ms in times["target16.decode"]])
    return out


def engine_arm(engine, args, device, layer_ids, bandwidth, label, result, suffix: str, change: dict, steps=None) -> None:
    """`engine` measured again after `label` (its own run) with its attributes `change` set (same tuning, same
    process), into `result` as `<label>_<suffix>` with `vs_<suffix>.<label>.*_speedup`: the arm's time over
    `label`'s (> 1: the engine as it is, `label`, faster than the arm; `side_by_side`'s `<label>_pdl.*_speedup` is the
    other way round, > 1: PDL faster); its compiled steps into
    `steps` (for `side_by_side`) where given. The attributes and an empty set of graphs are restored after."""
    arm, saved = f"{label}_{suffix}", {name: getattr(engine, name) for name in change}
    engine.graphs = {}  # first: a setting a captured step was made with (e.g. gdn_replay) may not change under it
    for name, value in change.items():
        setattr(engine, name, value)
    torch._dynamo.reset()
    try:
        result.update(measure_target(engine, args, device, layer_ids, bandwidth, arm))
        if steps is not None:
            arm_steps = compiled_steps(engine, args, layer_ids, arm, result)
            result.update(logits_apart(engine, steps, arm_steps, label, arm))
            steps.update(arm_steps)
    finally:
        engine.graphs = {}
        for name, value in saved.items():
            setattr(engine, name, value)
        torch._dynamo.reset()
    result.update(step_speedups(result, arm, label, f"vs_{suffix}.{label}"))
    report(result, arm, args.out)


def replay_in_graph(engine, verify, block: torch.Tensor, context: int, label: str) -> dict:
    """With the replay on (`LeanQwen35.gdn_replay`), a captured verify block `verify` (a CUDA graph, or compiled) run
    once from the engine's states: a rollback replays from the state before the block and the tokens' inputs that the
    block kept, so the block must have written them to the engine's own buffers. Then replaying none of its tokens
    gives the state before it and replaying all of them the state it left, bit for bit (`<label>.n<n>_max_abs`).
    Why: `replay_check` runs the eager step; in a compiled graph those buffers are graph inputs that inductor writes
    through its own handling of a Triton kernel's mutations, and the replay's first device run failed in its
    compiled steps (results/published/2026-12-06-h100-gdn-kept). The states are restored after."""
    t = block.shape[0]
    if not (getattr(engine, "gdn_replay", False) and engine._replays(t)):
        return {}
    from qdflash.kernels.gated_delta import gated_delta_replay

    saved, out = snapshot(engine), {}
    try:
        with torch.no_grad():
            before = stacked_states(engine)
            verify(block, context)
            after = stacked_states(engine)
            for n, expected in ((0, before), (t, after)):
                gated_delta_replay(engine._replay_tables, n)
                out[f"{label}.n{n}_max_abs"] = float((stacked_states(engine) - expected).abs().max())
    except Exception as err:  # noqa: BLE001 -- a result; the run goes on
        out[f"{label}.error"] = error_text(err)
    finally:
        restore(engine, saved)
    if any(v != 0.0 for k, v in out.items() if k.endswith("_max_abs")):
        out[f"{label}.error"] = "; ".join(filter(None, (
            "the captured block did not leave its first state and kept inputs where a rollback replays from (the "
            "timings go on with the replay on: its rollbacks would be wrong)", out.get(f"{label}.error"))))
    if f"{label}.error" in out:  # to the log at once, as a failed compile (a CUDA error is sticky)
        print(f"{label}: {out[f'{label}.error']}", flush=True)
    return out


def logits_apart(engine, steps: dict, arm_steps: dict, label: str, arm: str) -> dict:
    """`<arm>.<step>_logits_vs_base_max_abs`: the arm's compiled decode step / verify block against `label`'s, each
    from the same recurrent states (0: the same logits; e.g. PDL, which changes when a kernel starts, not what it
    computes: anything else would be a race)."""
    out = {}
    for step in ("decode", "verify"):
        base, other = steps.get(f"{label}.{step}"), arm_steps.get(f"{arm}.{step}")
        if base is None or other is None:
            continue
        saved = snapshot(engine)
        with torch.no_grad():
            a = base()[0].float().clone()
            restore(engine, saved)
            b = other()[0].float()
        restore(engine, saved)
        out[f"{arm}.{step}_logits_vs_base_max_abs"] = float((a - b).abs().max())
    return out


def pdl_arm(engine, args, device, layer_ids, bandwidth, label, result, steps) -> None:
    """`--pdl`: the steps captured under programmatic dependent launch (EngineBase.pdl), in `side_by_side` too."""
    if args.pdl and args.compile:
        engine_arm(engine, args, device, layer_ids, bandwidth, label, result, "pdl", {"pdl": True}, steps)


def kept_states_arm(engine, args, device, layer_ids, bandwidth, label, result, steps) -> None:
    """`--kept-states-arm`: the verify blocks keeping every position's GDN state instead of their inputs for a replay
    (LeanQwen35.gdn_replay off), in `side_by_side` too: the A/B behind the replay's default, in one process."""
    if args.kept_states_arm and getattr(engine, "gdn_replay", False):
        engine_arm(engine, args, device, layer_ids, bandwidth, label, result, "kept_states", {"gdn_replay": False}, steps)


def swiglu_arm(engine, args, device, layer_ids, bandwidth, label, result, steps) -> None:
    """`--swiglu-arm`: silu(gate) * up by a launch of its own from the gate / up matmul's output (EngineBase.swiglu_epilogue
    off) instead of in that matmul's epilogue, in `side_by_side` too: the A/B that set the epilogue's default, in one
    process (`side_by_side.*_swiglu_unfused.*_speedup` > 1 where the unfused arm is faster; `vs_swiglu_unfused.*` is
    the arm's time over the target's, > 1 where the epilogue is faster)."""
    if args.swiglu_arm:
        engine_arm(engine, args, device, layer_ids, bandwidth, label, result, "swiglu_unfused", {"swiglu_epilogue": False},
                   steps)


def inductor_default_arm(engine, args, device, layer_ids, bandwidth, label, result) -> None:
    """`--inductor-default`: compiled with inductor's own options instead of the engine's."""
    if args.inductor_default and args.compile:
        engine_arm(engine, args, device, layer_ids, bandwidth, label, result, "inductor_default", {"inductor_options": {}})


def hf_static_generate(model, args, device: str) -> dict:
    """`hf_static.*`: transformers' own batch-1 decoding of the same 16-bit model, as a user gets it:
    `generate` with a static cache, which compiles the decode step by itself on a GPU (torch.compile,
    mode reduce-overhead: CUDA graphs). A decode step's time is the difference between generating
    `--hf-tokens` more tokens and 8 after the same `--context`-token prompt (medians of `--hf-reps` runs
    each, the prefill in both), divided by the extra tokens. One stopping rule ends both runs, so both
    keep the same static cache size and compiled step. `--compile <backend>` (the CPU test) compiles
    with that backend on any device instead. Whether transformers found its fused GDN kernels
    (flash-linear-attention, causal-conv1d) is recorded: without them it runs their torch fallbacks."""
    import importlib.util

    from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

    class StopAt(StoppingCriteria):
        limit = 0

        def __call__(self, ids, scores, **kwargs):
            return torch.full((ids.shape[0],), ids.shape[1] >= self.limit, dtype=torch.bool, device=ids.device)

    short, long = 8, 8 + args.hf_tokens
    stop = StopAt()
    config = CompileConfig() if isinstance(args.compile, bool) else CompileConfig(backend=args.compile, mode=None)
    config._compile_all_devices = device != "cuda" and not isinstance(args.compile, bool)  # the CPU test's traced run
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)

    def generate(new: int):
        stop.limit = args.context + new
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=long, min_new_tokens=long, do_sample=False, cache_implementation="static",
                                 compile_config=config, stopping_criteria=StoppingCriteriaList([stop]), pad_token_id=0)
        if out.shape[1] != args.context + new:
            raise RuntimeError(f"hf_static: generate made {out.shape[1] - args.context} tokens, asked for {new}")

    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    generate(long)  # compiles the decode step (and, in reduce-overhead mode, records its graphs over the next calls)
    generate(long)
    warmup_s = time.perf_counter() - t0
    run = timer(device)
    short_ms = run(lambda: generate(short), args.hf_reps, warmup=1)
    long_ms = run(lambda: generate(long), args.hf_reps, warmup=1)
    decode_ms = (long_ms - short_ms) / (long - short)
    return {"hf_static.decode_ms": round(decode_ms, 4), "hf_static.tokens_per_s": round(1e3 / decode_ms, 1),
            "hf_static.warmup_s": round(warmup_s, 1), "hf_static.generate_ms": {str(short): round(short_ms, 3), str(long): round(long_ms, 3)},
            "hf_static.compile": str(config.backend), "hf_static.graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
            "hf_static.fla": importlib.util.find_spec("fla") is not None,
            "hf_static.causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None}


def unfused_gdn_arm(engine, args, device, layer_ids, bandwidth) -> dict:
    """`target16_unfused_gdn`: the tuned 16-bit engine measured again with its GDN layers unfused (engine.fuse_gdn
    False), and what the fused layer middle saves per decode step. The fused path runs only with the engine's
    kernels; without them (the CPU) both are the same torch code, so the arm is skipped and says why."""
    if not engine.kernels:
        return {"target16_unfused_gdn": "skipped: the engine's kernels are off, so the GDN layers run one torch path"}
    if not engine.fuse_gdn:
        return {"target16_unfused_gdn": "skipped: the fused path failed its check (gdn_fused_check.error), so every arm ran unfused"}
    engine.graphs = {}  # first: the engine refuses a change of what its captured verify blocks keep (gdn_replay)
    engine.fuse_gdn = False
    try:
        return measure_target(engine, args, device, layer_ids, bandwidth, "target16_unfused_gdn")
    finally:
        engine.graphs = {}
        engine.fuse_gdn = True


def error_text(err: BaseException) -> str:
    """An exception for a result file: its type and message, and where it was raised (the innermost three frames)."""
    where = raised_at(err, 3)
    return f"{type(err).__name__}: {str(err)[:300]}" + (f" (at {where})" if where else "")


def gdn_ba_list(text: str) -> list[str]:
    from qdflash.engine.qwen3_5 import GDN_BA

    out = text.split(",")
    if any(mode not in GDN_BA for mode in out) or len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"--gdn-ba: expected distinct modes of {', '.join(GDN_BA)}, got {text!r}")
    return out


class Arm(NamedTuple):
    """One arm of the `--study`."""
    suffix: str  # of the target's label ("" for its base)
    gdn_ba: str
    two_phase: bool  # verify blocks' GDN middle through the two-phase kernel
    chunked: bool = False  # verify blocks' GDN recurrence in the chunked form


def study_arms(args) -> list[Arm]:
    """`--study`'s arms (`Arm`). The first is the base the others are set against; every other `--gdn-ba` mode is an
    arm, with `--gdn-two-phase` each mode (the base's too) also through the two-phase GDN block kernel, and with
    `--gdn-chunked` each mode also with the block's recurrence in the chunked form."""
    base = args.gdn_ba[0]
    arms = [Arm("", base, False)]
    for mode in args.gdn_ba:
        if mode != base:
            arms.append(Arm(f"_gdn_{mode}", mode, False))
        if args.gdn_two_phase:
            arms.append(Arm(f"_gdn_{mode}_two_phase", mode, True))
        if getattr(args, "gdn_chunked", False):
            arms.append(Arm(f"_gdn_{mode}_chunked", mode, False, True))
    return arms


def target_engine(target, args, max_len):
    """The main run's engine for `target` (16-bit, W4, W4 head): --attention, the first --gdn-ba mode, and its verify
    block's GDN middle through the two-phase kernel (the engine's default for a 16-bit model) unless --gdn-step-kernel
    (token by token through the step kernel; decode steps are the same either way); its two-phase verify blocks keep
    their GDN inputs for a replay (LeanQwen35.gdn_replay, the engine's default), or with --no-gdn-replay every
    position's state."""
    engine = build_engine(target, max_len=max_len, attention=args.attention, gdn_ba=args.gdn_ba[0])
    if getattr(args, "gdn_step_kernel", False):
        engine.gdn_two_phase = False
    if getattr(args, "no_gdn_replay", False):
        engine.gdn_replay = False
    return engine


TARGET_LABELS = {"16": "target16", "w4": "target_w4"}  # --study-targets' names -> the study's result labels


def study_targets(text: str) -> list[str]:
    out = text.split(",")
    if out not in (["16"], ["w4"], ["16", "w4"]):
        raise argparse.ArgumentTypeError(f"--study-targets: expected 16, w4 or 16,w4 (the W4 arms quantize the model "
                                         f"in place), got {text!r}")
    return out


def study(target, engine16, args, device, layer_ids, bandwidth, max_len, result) -> dict:
    """`--study`: the tuned 16-bit target, then the W4 target (RTN, `--group`), each measured per `study_arms` in turn:
    each further `--gdn-ba` mode (an engine of its own; "fused" needs 16-bit b / a and qkvz, so the W4 target skips it),
    with `--gdn-two-phase` / `--gdn-chunked` each mode's verify blocks through that form of the GDN block kernel. Each
    arm compiles afresh. `vs_base.<target><arm>.<step>_speedup`: the arm's time over the first arm's (> 1: faster)."""
    out = {}
    for label in [TARGET_LABELS[name] for name in args.study_targets]:
        if args.arms and not any(arm.startswith(label + "_") for arm in args.arms):
            continue  # --arms names none of this target's arms: not even its base
        if label == "target_w4":
            out["target_w4.quantized_layers"] = quantize_in_place(target.model, args.group)
        engine = engine16 if label == "target16" else None
        replay = engine16.gdn_replay  # as checked (replay_check) or asked (--no-gdn-replay): every arm's engine too
        tuned_for = None  # the engine the kernels were last tuned for: an arm of the same engine keeps that tuning
        for suffix, gdn_ba, two_phase, chunked in study_arms(args):
            arm = label + suffix
            if suffix and args.arms and arm not in args.arms:  # --arms: only these beside each target's base
                continue
            if label == "target_w4" and gdn_ba == "fused":
                out[arm] = "skipped: the W4 target's qkvz is 4-bit, its b / a 16-bit: they do not fuse"
                continue
            if engine is None or engine.gdn_ba != gdn_ba:
                engine = None  # an arm's own engine is freed before the next is built (each copies the weights)
                engine = build_engine(target, max_len=max_len, attention=args.attention, gdn_ba=gdn_ba)
            engine.graphs = {}  # first: the engine refuses a change of what its captured verify blocks keep
            engine.gdn_two_phase, engine.gdn_chunked, engine.gdn_replay = two_phase, chunked, replay
            try:
                if suffix:  # the arm's GDN path against the unfused layer, as main() checks the base's
                    out.update(gdn_check(engine, device, label=f"{arm}.gdn_check"))
                if tuned_for is engine:  # the same kernels, the same launches: retuning would only add noise
                    out[f"{arm}.tuned"] = "as the arm before"
                else:
                    t0 = time.perf_counter()
                    out[f"{arm}.tuned"] = engine.tune_kernels()
                    out[f"{arm}.tune_s"] = round(time.perf_counter() - t0, 1)
                    tuned_for = engine
                torch._dynamo.reset()
                out.update(measure_target(engine, args, device, layer_ids, bandwidth, arm))
            except Exception as err:  # noqa: BLE001 -- an arm's kernel failing on its first GPU run is a result; the next arm runs
                out[f"{arm}.error"] = error_text(err)
            if suffix:
                out.update(step_speedups(out, label, arm, f"vs_base.{arm}"))
            report(result | out, arm, args.out)
    return out


def step_speedups(result: dict, slower: str, faster: str, prefix: str) -> dict:
    """`<prefix>.<step>_speedup`: arm `slower`'s time over arm `faster`'s for each step both measured (> 1: `faster`
    is faster)."""
    out = {}
    for step in ("decode", "verify", "decode_compiled", "verify_compiled"):
        before, after = result.get(f"{slower}.{step}_ms"), result.get(f"{faster}.{step}_ms")
        if before and after:
            out[f"{prefix}.{step}_speedup"] = round(before / after, 3)
    return out


def fused_gdn_gains(result: dict) -> dict:
    """Unfused over fused time of each step both arms measured (> 1: the fused layer middle is faster)."""
    return step_speedups(result, "target16_unfused_gdn", "target16", "fused_gdn")


def drafts_agreement(drafts: torch.Tensor, reference_logits: torch.Tensor, label: str) -> dict:
    """How the engine's drafts [R] agree with the drafter's own forward (its logits [R, V]): the share of rows with the
    same token, and where they differ how near a tie the forward had them: its top logit minus its logit for the
    engine's token (the largest such gap), beside the logits' scale. Why: the engine's fused, packed matmuls sum in
    another order than the forward's linears, so in bf16 a draft may flip where two logits nearly tie (a benchmark's
    random drafter has many); a gap near the logits' scale would be a bug, not rounding."""
    ref = reference_logits.float()
    top = ref.max(-1).values
    gap = top - ref.gather(-1, drafts.long()[:, None])[:, 0]
    return {f"{label}.drafts_agree_with_forward": float((drafts == ref.argmax(-1)).float().mean()),
            f"{label}.drafts_max_gap": float(gap.max()), f"{label}.drafts_logit_scale": float(ref.abs().max())}


def drafter_qk_kernel_arm(engine, step, eager_drafts, args, run, device, label, base_ms: float,
                          reference_logits: torch.Tensor | None = None) -> dict:
    """`--drafter-qk-kernel`: the drafter's compiled step again, compiled anew with its q / k norms, rotation and
    cache writes through kernels.qk_norm_rope (DrafterEngine.qk_norm_rope_kernel), same process: its drafts against
    the eager step's and, given the drafter's own forward logits, against those (`<label>.qk_kernel.drafts_*`: where
    they differ, how near a tie), its time, `qk_kernel_speedup` (the step's time over the arm's: > 1 the kernel
    faster). Its own failure is its result; the drafter's numbers stand."""
    out = {}
    engine.qk_norm_rope_kernel = True
    try:
        allow_compiles(1)
        fast, before = compiled_step(step, args.compile), dynamo_counts()
        drafts = fast()
        out[f"{label}.qk_kernel_drafts_agree"] = float((drafts == eager_drafts).float().mean())
        if reference_logits is not None:
            out.update(drafts_agreement(drafts, reference_logits, f"{label}.qk_kernel"))
        out.update(dynamo_report(before, f"{label}.step_compiled_qk_kernel"))
        out[f"{label}.step_compiled_qk_kernel_ms"] = ms = round(run(graphed(fast, device), args.reps), 4)
        out[f"{label}.qk_kernel_speedup"] = round(base_ms / ms, 3)
    except Exception as err:  # noqa: BLE001 -- the arm failing is a result; the drafter's own step was measured
        out[f"{label}.qk_kernel_error"] = error_text(err)
        print(f"{label}: the qk kernel arm failed: {type(err).__name__}: {str(err)[-3000:]}", flush=True)
    finally:
        engine.qk_norm_rope_kernel = False
    return out


def measure_drafter(target, args, device, dtype, bandwidth, label, w4_group: int | None) -> dict:
    run = timer(device)
    drafter = init_drafter(target, block_size=args.block, **DRAFTERS[args.shape]).to(dtype)
    if w4_group:
        quantize_in_place(drafter, w4_group, [n for n, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)])
    c = drafter.config
    # the step as the speed stage drafts (bench_speedup: DrafterEngine(attention=) as the target's): each layer's
    # linears fused and, on the GPU, packed where quantized and tuned; a round's B accepted positions written as
    # context K/V (the append), then the block over the static context (masked SDPA over a bucket, or with the
    # kernel the block's K/V after the context and each row's attention through kernels.decode_attention)
    engine = DrafterEngine(drafter, max_len=args.context, cuda_graphs=False, attention=args.attention,
                           kernels=device == "cuda")
    tuned = engine.tune_kernels()  # the drafter's shapes ({} off the GPU: its projections run no kernels)
    head = engine.head  # the target's head as DrafterEngine reads it: packed where quantized
    feats = torch.randn(1, args.context, len(c.target_layer_ids) * c.hidden_size, device=device, dtype=dtype)
    pos = torch.arange(args.context, device=device)[None]
    with torch.no_grad():
        ctx = drafter.context_features(feats)
        kv = [layer.context_kv(ctx, pos) for layer in drafter.layers]
    keys, values = [k for k, _ in kv], [v for _, v in kv]
    new_feats, new_pos = feats[:, : args.block].clone(), pos[:, : args.block].clone()
    ids = torch.full((1, args.block), drafter.mask_id, device=device)
    q_pos = torch.arange(args.context, args.context + args.block, device=device)[None]

    def forward_step():  # the drafter's own forward (each linear alone, masked SDPA over a copy of the context)
        with torch.no_grad():
            new_ctx = drafter.context_features(new_feats)
            for layer in drafter.layers:
                layer.context_kv(new_ctx, new_pos)
            return drafter.forward_block(ids, q_pos, keys, values, pos, head=head)[0, 1:].float()

    # the prompt: its last B positions stand for the round's append, whose K/V every draft writes first
    engine.append(feats[0], 0)
    engine.draft_logits(drafter.mask_id, args.context)  # the step's inputs as a draft sets them: the block `ids`

    def step():
        with torch.no_grad():
            return engine._step(engine._bucket(), None)[1]

    reference = forward_step()
    agree = drafts_agreement(step(), reference, label)
    profiled = graphed(step, device)
    ms = run(profiled, args.reps)
    compiled = {}
    if args.compile:  # the same step through torch.compile, then captured (as the target's compiled steps)
        try:
            allow_compiles(1)
            fast, before = compiled_step(step, args.compile), dynamo_counts()
            eager_drafts = step()
            compiled_drafts = fast()
            compiled[f"{label}.compiled_drafts_agree"] = float((compiled_drafts == eager_drafts).float().mean())
            compiled.update(drafts_agreement(compiled_drafts, reference, f"{label}.compiled"))
            compiled.update(dynamo_report(before, f"{label}.step_compiled"))
            fast_graph = graphed(fast, device)
            compiled[f"{label}.step_compiled_ms"] = round(run(fast_graph, args.reps), 4)
            profiled = fast_graph
            if getattr(args, "drafter_qk_kernel", False) and engine.kernels:
                compiled.update(drafter_qk_kernel_arm(engine, step, eager_drafts, args, run, device, label,
                                                      compiled[f"{label}.step_compiled_ms"], reference))
        except Exception as err:  # noqa: BLE001 -- a failed compile is a result to report, not a crash
            compiled[f"{label}.compile_error"] = error_text(err)
    if args.profile:  # the step as timed last (compiled where it compiled): what bounds its ratio to a decode step
        try:
            compiled[f"{label}.step_kernels"] = kernel_breakdown(profiled, device)
        except Exception as err:  # noqa: BLE001 -- the profile is extra; its failure is reported
            compiled[f"{label}.step_kernels"] = {"error": error_text(err)}
    # what a step reads: the engine's projections (the k / v rows twice: the context's and the block's matmuls),
    # and the drafter's other weights (norms, a mask embedding)
    linears = {name for name, m in drafter.named_modules() if name.endswith("_proj") or name == "fc"}
    own = sum(p.nbytes for p in engine.projections()) + sum(
        t.numel() * t.element_size() for name, t in [*drafter.named_parameters(), *drafter.named_buffers()]
        if name.rpartition(".")[0] not in linears)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k in keys)
    need = own + head.nbytes + kv_bytes
    return {f"{label}.step_ms": round(ms, 4), f"{label}.bound_ms": round(need / bandwidth * 1e3, 4),
            f"{label}.of_bound": round(need / bandwidth * 1e3 / ms, 4),
            f"{label}.bytes": {"drafter": own, "lm_head": head.nbytes, "context_kv": kv_bytes},
            f"{label}.layers": c.num_layers, f"{label}.attention": args.attention, **agree,
            **({f"{label}.tuned": tuned} if tuned else {}), **compiled}


def kernel_check(engine, device) -> dict:
    """The W4A16 kernel against the dequantized matmul on one packed projection (bf16). Without
    kernels (the CPU) the engine holds no packed projection: nothing to check."""
    p = next((p for p in engine.projections() if p.words is not None), None)
    if p is None:
        return {"w4a16_check": "no packed projection (kernels off)"}
    out = {}
    for rows in (1, MAX_ROWS):
        x = torch.randn(rows, p.in_features, device=device, dtype=engine.dtype)
        ref = F.linear(x.float(), p.dequantized().float())
        got = w4a16_matmul(x, p.words, p.scale, p.group, counts=p.counts).float()
        out[f"w4a16_rel_err@{rows}"] = float((got - ref).abs().max() / ref.abs().max())
    return out


def gdn_check(engine, device: str, tokens: int = 40, block: int = 8, label: str = "gdn_fused_check") -> dict:
    """Before any timing: the fused GDN layer middle against the unfused one on the same prompt (a prefill of
    `tokens` - `block`, then a `block`-token step and a 1-token step, eager), logits compared. Where the fused path
    raises (a kernel that does not build on this device), the engine runs unfused for the whole run and the error
    is recorded, so that the rest is still measured. Without the kernels there is one path: nothing to check.
    `label`: the keys' prefix."""
    if not engine.kernels:
        return {label: "kernels off: one torch path"}
    prompt = torch.randint(0, engine.lm_head.shape[0], (tokens,), device=device)
    logits = {}
    try:
        for fused in (False, True):
            engine.fuse_gdn = fused
            engine.reset()
            with torch.no_grad():
                engine.forward(prompt[: tokens - block - 1], 0)
                verify = engine.forward(prompt[tokens - block - 1: tokens - 1], tokens - block - 1)[0]
                step = engine.forward(prompt[tokens - 1:], tokens - 1)[0]
            logits[fused] = torch.cat([verify, step]).float()
    except Exception as err:  # noqa: BLE001 -- a fused kernel that fails here is a result; the run goes on unfused
        engine.fuse_gdn = False
        engine.reset()
        return {f"{label}.error": error_text(err)}
    engine.reset()
    return {f"{label}.max_abs": float((logits[True] - logits[False]).abs().max()),
            f"{label}.logit_scale": float(logits[False].abs().max())}


def replay_check(engine, device: str, tokens: int = 40, block: int = 8, keeps: tuple[int, ...] = (0, 3, 7),
                 label: str = "gdn_replay_check") -> dict:
    """Before any timing, where the engine replays a rolled-back verify block (`LeanQwen35.gdn_replay`: a two-phase
    block keeps its inputs, not every position's state): rollbacks to `keeps` (< `block`) of a block's tokens, then a
    decode step, against the same with every position's state kept. The states and logits apart (on the CPU's
    interpreter: 0; on the H100 too, `results/published/2026-12-06-h100-gdn-kept`). Where the replay raises or its
    states differ at all, the engine keeps every state for the whole run and the error is recorded."""
    if not (engine.kernels and getattr(engine, "gdn_replay", False) and engine._replays(block)):
        return {label: "no replay: the engine keeps every position's state"}
    if engine.graphs:  # (it switches the replay off and on: an engine refuses that under captured steps)
        return {f"{label}.error": "not checked: the engine holds captured steps (the check runs before capture)"}
    prompt = torch.randint(0, engine.lm_head.shape[0], (tokens,), device=device)
    start = tokens - block - 1
    out = {}
    try:
        for replay in (True, False):
            engine.gdn_replay = replay
            rows = []
            for keep in keeps:
                engine.reset()
                with torch.no_grad():
                    engine.forward(prompt[:start], 0)
                    engine.forward(prompt[start:start + block], start)
                    engine.rollback(start + keep)
                    state = stacked_states(engine)
                    rows.append((state, engine.forward(prompt[start + block:], start + keep)[0].float()))
            out[replay] = rows
    except Exception as err:  # noqa: BLE001 -- a replay that fails here is a result; the run goes on keeping every state
        engine.gdn_replay = False
        engine.reset()  # (a CUDA error is sticky: this raises it again, and the run ends here with it in the log)
        return {f"{label}.error": error_text(err)}
    engine.reset()
    apart = {f"{label}.state_max_abs": max(float((a[0] - b[0]).abs().max()) for a, b in zip(out[True], out[False])),
             f"{label}.logits_max_abs": max(float((a[1] - b[1]).abs().max()) for a, b in zip(out[True], out[False]))}
    # the replay runs the block kernel's own lines on its own inputs: any difference is a bug, not rounding
    engine.gdn_replay = apart[f"{label}.state_max_abs"] == 0.0
    if not engine.gdn_replay:
        apart[f"{label}.error"] = "the replayed states differ from the kept ones: the run keeps every state"
    return apart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-4b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--group", type=int, default=32, help="the target's W4 group size (RECIPE: 32)")
    parser.add_argument("--drafter-group", type=int, default=128, help="the drafter's W4 group size (RECIPE: 128)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--compile", nargs="?", const=True, default=False,
                        help="also time the decode step, verify block and drafter step compiled by torch.compile "
                             "(a value: the torch.compile backend; the CPU test traces with aot_eager)")
    parser.add_argument("--profile", action="store_true",
                        help="also break each decode step, verify block and drafter step down by kernel")
    parser.add_argument("--w4-head", action="store_true",
                        help="then also the W4 target with its LM head quantized (target_w4_head; issue 23: a 16-bit head "
                             "is ~40%% of a W4 step's bytes at 4B)")
    parser.add_argument("--w4-head-only", action="store_true",
                        help="of the W4 targets only the one with its LM head quantized (target_w4_head, drafter_w4_head): "
                             "no target_w4 / drafter_w4, so the must-show run needs ~a third less device time")
    parser.add_argument("--reference-gbps", type=float, default=600.0,
                        help="a memory-bound reference device's bandwidth (GB/s) to compute the bounds at (A10G class: 600)")
    parser.add_argument("--unfused-gdn", action="store_true",
                        help="then also the 16-bit target with each GDN layer's middle unfused (conv, gates, a/b matmul, "
                             "recurrence as separate kernels: the path before kernels.gated_delta.gated_delta_step), same process")
    parser.add_argument("--attention", choices=("sdpa", "kernel"), default="sdpa",
                        help="the target engines' attention in decode steps and verify blocks (EngineBase.set_attention; "
                             "kernel: the Triton decode attention, what the gpu profile serves with; needs the GPU)")
    parser.add_argument("--gdn-only", action="store_true",
                        help="the 16-bit target alone (tuned, no cuBLAS-only arm), with --unfused-gdn beside it: what the "
                             "fused GDN layer middle saves, in a few minutes of device time; no drafters, no W4")
    parser.add_argument("--study", action="store_true",
                        help="the 16-bit target (tuned) and the W4 target, each as its base and in the arms the flags "
                             "below add (other --gdn-ba modes, two-phase and chunked GDN blocks), same process; no "
                             "drafters")
    parser.add_argument("--gdn-ba", type=gdn_ba_list, default=["dot"],
                        help="how the GDN gates get their b / a projection (LeanQwen35's gdn_ba: dot, given, fused), "
                             "comma-separated: the first for every engine of the run; with --study each other one is "
                             "an arm too")
    parser.add_argument("--study-targets", type=study_targets, default=["16", "w4"],
                        help="--study: which targets' arms, in order (16: the 16-bit target; w4: the W4 one; the W4 "
                             "arms quantize the model in place, so 16 after w4 is refused)")
    parser.add_argument("--gdn-two-phase", action="store_true",
                        help="--study: each --gdn-ba mode again as an arm with its verify block's GDN middle through the "
                             "two-phase kernel (LeanQwen35.gdn_two_phase, the engine's default for a 16-bit model: "
                             "the main run's targets use it either way)")
    parser.add_argument("--gdn-step-kernel", action="store_true",
                        help="the main run's targets' verify blocks run their GDN middle through the step kernel, token "
                             "by token, instead of the two-phase kernel (the engine's default for a 16-bit model)")
    parser.add_argument("--gdn-chunked", action="store_true",
                        help="--study: each --gdn-ba mode again with its verify block's GDN recurrence in the "
                             "chunked form (LeanQwen35.gdn_chunked: the block's products as matmuls)")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=None,
                        help="--study: run only these arms (full labels, e.g. "
                             "target16_gdn_given,target_w4_gdn_dot_two_phase) beside each target's base; the flags "
                             "above say which arms there are")
    parser.add_argument("--inductor-default", action="store_true",
                        help="--compile: each target of the main run again with inductor's own options instead of the "
                             "engine's (INDUCTOR_OPTIONS: multi_kernel) after its own, same tuning, same process "
                             "(<target>_inductor_default, vs_inductor_default.*)")
    parser.add_argument("--drafter-only", action="store_true",
                        help="the 16-bit and W4 drafter steps alone, each with the masked SDPA and with --attention's kernel "
                             "path (drafter*_sdpa, drafter*_kernel), same process: what the drafter's attention costs, in a "
                             "few minutes of device time; no target steps")
    parser.add_argument("--pdl", action="store_true",
                        help="--compile: each target again with its steps captured under programmatic dependent launch "
                             "(EngineBase.pdl: the int4 mma kernels and inductor's own), after its own run, same tuning, "
                             "same process (<target>_pdl, vs_pdl.*; in side_by_side beside the targets' own steps)")
    parser.add_argument("--targets-only", action="store_true",
                        help="no drafter steps and no cuBLAS-only arm: the targets' decode steps and verify blocks (and "
                             "with --compile their `side_by_side` ratios), in about half the device time")
    parser.add_argument("--no-gdn-replay", action="store_true",
                        help="the targets' verify blocks keep every position's GDN state, where by default "
                             "(LeanQwen35.gdn_replay) they keep their inputs and the state before them and a rollback "
                             "replays the accepted tokens, checked against kept states before timing (gdn_replay_check)")
    parser.add_argument("--swiglu-arm", action="store_true",
                        help="each target again with silu(gate) * up by a launch of its own, not in the gate / up "
                             "matmul's epilogue (EngineBase.swiglu_epilogue off; on by default), same tuning, same "
                             "process (<target>_swiglu_unfused, vs_swiglu_unfused.*; in side_by_side)")
    parser.add_argument("--kept-states-arm", action="store_true",
                        help="each target again with its verify blocks keeping every position's GDN state (gdn_replay "
                             "off), same process (<target>_kept_states, vs_kept_states.*; in side_by_side with --compile)")
    parser.add_argument("--drafter-qk-kernel", action="store_true",
                        help="--compile: each drafter's compiled step again with its q / k norms, rotation and cache writes "
                             "through kernels.qk_norm_rope (DrafterEngine.qk_norm_rope_kernel), same process "
                             "(<drafter>.step_compiled_qk_kernel_ms, .qk_kernel_speedup: > 1 the kernel faster)")
    parser.add_argument("--no-cublas", action="store_true",
                        help="no cuBLAS-only arm (target16_cublas: the 16-bit target's matmuls through cuBLAS, "
                             "uncompiled), the drafters kept: the must-show run in less device time")
    parser.add_argument("--side-by-side-rounds", type=int, default=7,
                        help="--compile: rounds of `side_by_side` (each compiled step timed once a round, in turn)")
    parser.add_argument("--hf-generate", action="store_true",
                        help="then transformers' static compiled generate on the same 16-bit model (hf_static.*, issue 23)")
    parser.add_argument("--hf-tokens", type=int, default=64, help="--hf-generate: decode steps timed (beyond 8)")
    parser.add_argument("--hf-reps", type=int, default=5, help="--hf-generate: runs of each length (median)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.arms:
        # an arm the study would skip whatever the device (W4 with a fused qkvz + b / a) is no arm to ask for
        known = {TARGET_LABELS[name] + arm.suffix for name in args.study_targets for arm in study_arms(args)[1:]
                 if not (name == "w4" and arm.gdn_ba == "fused")}
        if not args.study or not set(args.arms) <= known:
            parser.error(f"--arms: with --study, labels of {', '.join(sorted(known))} (as --study-targets and the arm "
                         f"flags give them), got {','.join(args.arms)}")
    if args.side_by_side_rounds < 1:
        parser.error(f"--side-by-side-rounds: at least 1, got {args.side_by_side_rounds}")
    if args.pdl and not args.compile:
        parser.error("--pdl: an arm of the compiled steps, so with --compile")
    if args.targets_only and (args.gdn_only or args.study or args.drafter_only):
        parser.error("--targets-only: the main run's targets; --gdn-only, --study and --drafter-only are runs of their own")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = {"config": vars(args) | {"device": device, "dtype": str(dtype)}, **environment()}
    if device == "cuda":
        result["env.gpu"] = torch.cuda.get_device_name(0)
    result["env.platform"] = platform.platform()
    bandwidth = copy_bandwidth(device, args.reps)
    result["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)

    target = build_target(args.shape, device, dtype)
    result["target.parameters"] = sum(p.numel() for p in target.model.parameters())
    max_len = args.context + 4 * args.block
    layer_ids = init_drafter(target, block_size=args.block, **DRAFTERS[args.shape]).config.target_layer_ids
    if args.drafter_only:
        for label, group in (("drafter16", None), ("drafter_w4", args.drafter_group)):
            for attention in ("sdpa", "kernel"):
                arm = argparse.Namespace(**{**vars(args), "attention": attention})
                result.update(measure_drafter(target, arm, device, dtype, bandwidth, f"{label}_{attention}", group))
                report(result, f"{label}_{attention}", args.out)
        report(result, None, args.out)
        return
    engine16 = target_engine(target, args, max_len)
    result.update(gdn_check(engine16, device))
    fuse_gdn = engine16.fuse_gdn  # False where the fused path failed its check: every engine of the run then runs unfused
    result.update(replay_check(engine16, device))
    gdn_replay = engine16.gdn_replay  # likewise: False where the replay failed its check
    report(result, "gdn_fused_check", args.out)
    if args.study:
        result.update(study(target, engine16, args, device, layer_ids, bandwidth, max_len, result))
        report(result, None, args.out)
        return
    plain = argparse.Namespace(**{**vars(args), "compile": False, "profile": False})
    if not (args.gdn_only or args.targets_only or args.no_cublas):
        result.update(measure_target(engine16, plain, device, layer_ids, bandwidth, "target16_cublas"))
    result["gemv.tuned"] = engine16.tune_kernels()  # the GEMV against cuBLAS per shape ({} off the GPU)
    report(result, "target16_cublas", args.out)
    result.update(measure_target(engine16, args, device, layer_ids, bandwidth, "target16"))
    report(result, "target16", args.out)
    steps = compiled_steps(engine16, args, layer_ids, "target16", result)  # kept for `side_by_side`
    inductor_default_arm(engine16, args, device, layer_ids, bandwidth, "target16", result)
    pdl_arm(engine16, args, device, layer_ids, bandwidth, "target16", result, steps)
    kept_states_arm(engine16, args, device, layer_ids, bandwidth, "target16", result, steps)
    swiglu_arm(engine16, args, device, layer_ids, bandwidth, "target16", result, steps)
    if args.hf_generate:  # transformers' static compiled generate on the same 16-bit model, this process
        try:
            result.update(hf_static_generate(target.model, args, device))
        except Exception as err:  # noqa: BLE001 -- transformers failing on this model is a result; the rest is still measured
            result["hf_static.error"] = error_text(err)
        for step in ("decode_ms", "decode_compiled_ms"):
            if f"target16.{step}" in result and "hf_static.decode_ms" in result:
                result[f"hf_static.over_target16.{step}"] = round(result["hf_static.decode_ms"] / result[f"target16.{step}"], 3)
        report(result, "hf_static", args.out)
    if args.unfused_gdn:
        result.update(unfused_gdn_arm(engine16, args, device, layer_ids, bandwidth))
        result.update(fused_gdn_gains(result))
        report(result, "target16_unfused_gdn", args.out)
    if args.gdn_only:
        report(result, None, args.out)
        return
    if not args.targets_only:
        result.update(measure_drafter(target, args, device, dtype, bandwidth, "drafter16", None))
        if not args.w4_head_only:
            result.update(measure_drafter(target, args, device, dtype, bandwidth, "drafter_w4", args.drafter_group))
        report(result, "drafter", args.out)
    del engine16  # (its compiled graphs in `steps` keep it: they are timed again beside the W4 target's)
    result["target_w4.quantized_layers"] = quantize_in_place(target.model, args.group)
    targets = [("target16", "drafter16")]
    if not args.w4_head_only:
        engine4 = target_engine(target, args, max_len)
        engine4.fuse_gdn, engine4.gdn_replay = fuse_gdn, gdn_replay
        result["w4a16.tuned"] = engine4.tune_kernels()
        result.update(kernel_check(engine4, device))
        report(result, "w4a16", args.out)
        result.update(measure_target(engine4, args, device, layer_ids, bandwidth, "target_w4"))
        report(result, "target_w4", args.out)
        result["w4_decode_speedup_over_16bit"] = round(result["target16.decode_ms"] / result["target_w4.decode_ms"], 3)
        targets.append(("target_w4", "drafter_w4"))
        del engine4
    if args.w4_head or args.w4_head_only:  # the same W4 target with its LM head on the W4 grid too, in this process (side by side)
        quantize_in_place(target.model, args.group, ["lm_head"])
        engine4h = target_engine(target, args, max_len)
        engine4h.fuse_gdn, engine4h.gdn_replay = fuse_gdn, gdn_replay
        result["w4a16_head.tuned"] = engine4h.tune_kernels()
        if args.w4_head_only:  # the check the W4 target would have had
            result.update(kernel_check(engine4h, device))
        result.update(measure_target(engine4h, args, device, layer_ids, bandwidth, "target_w4_head"))
        report(result, "target_w4_head", args.out)
        steps |= compiled_steps(engine4h, args, layer_ids, "target_w4_head", result)
        pdl_arm(engine4h, args, device, layer_ids, bandwidth, "target_w4_head", result, steps)
        kept_states_arm(engine4h, args, device, layer_ids, bandwidth, "target_w4_head", result, steps)
        swiglu_arm(engine4h, args, device, layer_ids, bandwidth, "target_w4_head", result, steps)
        result.update(side_by_side(steps, result, args, timer(device)))
        report(result, "side_by_side", args.out)
        inductor_default_arm(engine4h, args, device, layer_ids, bandwidth, "target_w4_head", result)
        result["w4_head_decode_speedup_over_16bit"] = round(result["target16.decode_ms"] / result["target_w4_head.decode_ms"], 3)
        if not args.targets_only:  # the W4 drafter again, its block's logits through the target's now 4-bit head
            result.update(measure_drafter(target, args, device, dtype, bandwidth, "drafter_w4_head", args.drafter_group))
            report(result, "drafter_w4_head", args.out)
        targets.append(("target_w4_head", "drafter_w4_head"))
    for tau in TAUS:
        for target_label, drafter_label in targets:
            if f"{drafter_label}.step_ms" not in result:  # --targets-only
                continue
            # a round: the verify block, the rollback of what it rejected, the drafter's step
            verify = result[f"{target_label}.verify_ms"] + result.get(f"{target_label}.rollback_ms", 0.0)
            draft = result[f"{drafter_label}.step_ms"]
            result[f"implied_speedup.tau{tau}.{target_label}+{drafter_label}.vs_ar16"] = implied_speedup(
                tau, result["target16.decode_ms"], verify, draft)
            result[f"implied_speedup.tau{tau}.{target_label}+{drafter_label}.vs_same_target_ar"] = implied_speedup(
                tau, result[f"{target_label}.decode_ms"], verify, draft)
    result.update(reference_bounds(result, args.reference_gbps))
    for label in ("target16", "target_w4", "target_w4_head"):
        if f"{label}.decode_compiled_ms" in result:
            result[f"{label}.decode_compiled_of_bound"] = round(result[f"{label}.bound_ms"] / result[f"{label}.decode_compiled_ms"], 4)
    # issue 23's first target, compiled (the number of record), for the W4 target and for it with its 4-bit head
    for label, key in (("target_w4", "w4"), ("target_w4_head", "w4_head")):
        if f"{label}.decode_compiled_ms" in result and "target16.decode_compiled_ms" in result:
            result[f"{key}_compiled_decode_speedup_over_16bit_compiled"] = round(
                result["target16.decode_compiled_ms"] / result[f"{label}.decode_compiled_ms"], 3)
    result.update(compiled_rounds(result, targets))
    report(result, None, args.out)
    print(json.dumps(result, indent=1, default=str))


TAUS = (3.0, 5.0, 6.5)  # acceptance lengths the implied speedups are given at (issue 23)


def implied_speedup(tau: float, ar_ms: float, verify_ms: float, draft_ms: float) -> float:
    """tau tokens a round of verify (with its rollback) + draft, against one token an autoregressive step of `ar_ms`."""
    return round(tau * ar_ms / (verify_ms + draft_ms), 3)


def compiled_rounds(result: dict, targets: list[tuple[str, str]]) -> dict:
    """From the compiled steps (where all three compiled): the drafter step over the decode step, and
    the implied speedup tau * decode / (verify + rollback + drafter step) over compiled 16-bit decoding (the rollback
    is eager in either case: `rollback_ms`)."""
    out = {}
    for target_label, drafter_label in targets:
        parts = [f"{target_label}.decode_compiled_ms", f"{target_label}.verify_compiled_ms", f"{drafter_label}.step_compiled_ms"]
        if not all(p in result for p in parts + ["target16.decode_compiled_ms"]):
            continue
        decode, verify, draft = (result[p] for p in parts)
        verify += result.get(f"{target_label}.rollback_ms", 0.0)
        out[f"compiled.{drafter_label}_step_over_{target_label}_decode"] = round(draft / decode, 4)
        for tau in TAUS:
            out[f"compiled.implied_speedup.tau{tau}.{target_label}+{drafter_label}.vs_ar16"] = implied_speedup(
                tau, result["target16.decode_compiled_ms"], verify, draft)
    return out


def reference_bounds(result: dict, gbps: float) -> dict:
    """Each part's bound at `gbps` (its bytes / that bandwidth), and the speedups over 16-bit
    autoregressive decoding those bounds imply at each tau, for a device that is only bandwidth."""
    targets = [label for label in ("target16", "target_w4", "target_w4_head") if f"{label}.bytes" in result]
    ms = {label: result[f"{label}.bytes"]["total"] / (gbps * 1e9) * 1e3 for label in targets}
    drafters = [label for label in ("drafter16", "drafter_w4", "drafter_w4_head") if f"{label}.bytes" in result]
    ms |= {label: sum(result[f"{label}.bytes"].values()) / (gbps * 1e9) * 1e3 for label in drafters}
    out = {"reference.GBps": gbps, **{f"reference.{label}.bound_ms": round(v, 4) for label, v in ms.items()},
           **{f"reference.{label}.tokens_per_s": round(1e3 / ms[label], 1) for label in targets},
           **{f"reference.{label.replace('target_', '')}_decode_speedup_over_16bit": round(ms["target16"] / ms[label], 3)
              for label in targets[1:]},
           **({"reference.drafter_w4_step_over_w4_decode": round(ms["drafter_w4"] / ms["target_w4"], 4)}
              if {"drafter_w4", "target_w4"} <= ms.keys() else {})}
    # each target with the drafter measured beside it: the W4-head target's drafts read its 4-bit head
    pairs = [("target16", "drafter16")] + [(label, "drafter_w4_head" if label == "target_w4_head" and "drafter_w4_head" in ms
                                             else "drafter_w4") for label in targets[1:]]
    for tau in TAUS:
        for target_label, drafter_label in pairs:  # the verify block at its bound reads what a decode step does
            if drafter_label not in ms:  # --targets-only
                continue
            out[f"reference.implied_speedup.tau{tau}.{target_label}+{drafter_label}.vs_ar16"] = implied_speedup(
                tau, ms["target16"], ms[target_label], ms[drafter_label])
    return out


_LAST_REPORT = [time.perf_counter()]  # when the last part ended (the process's start before the first)


def report(result: dict, prefix: str | None, out: str | None) -> None:
    """Print what `prefix` measured (flat values) and rewrite the JSON with everything so far, with the seconds the
    part took since the last report (`wall_s.<prefix>`, tuning and compiles included: what a device window must fit)."""
    now = time.perf_counter()
    result.setdefault("wall_s", {})[prefix or "end"] = round(now - _LAST_REPORT[0], 1)
    _LAST_REPORT[0] = now
    if prefix is not None:
        print({k: v for k, v in result.items() if k.startswith(prefix) and not isinstance(v, dict)}, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
