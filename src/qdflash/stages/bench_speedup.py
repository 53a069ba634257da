"""bench_speedup node: batch-1 decoding speed of the speculative variants against the baselines.

Methods, on the same prompts, side by side in this process (qdflash.bench):
- `plain16`: transformers' `generate` on the 16-bit target (the unoptimized baseline, (a));
- `static16`: `generate` with its static cache (compiled) where the device is a GPU ((a'));
- `ar16` / `ar_qad`: this project's autoregressive loop on the 16-bit / QAD target ((b), (c)), on
  the lean engine (qdflash.engine) where the family has one (recorded as `engine.*` in metrics.json;
  on a GPU its kernels are tuned to the model's shapes first: `engine.*.kernel_tuning`);
- `spec16_stage1`: the stage-1 drafter on the 16-bit target;
- `spec_qad_stage1` / `spec_qad_stage2`: the stage-1 / stage-2 drafter on the QAD target;
- `spec_qad_<method>_w<bits>g<group>`: each compressed stage-2 drafter (`compressed=[...]`) on it.
`bench.tau_prompts_per_category` (default 0: off): after the timed runs, the window-less job decodes that many
held-out prompts a category with the stage-2 drafter on the QAD target, untimed, for its tau per category
(`tau_pass.spec_qad_stage2.<category>.{tau,rounds,tokens}` in metrics.json).
`bench.methods` (a list of these names; default all) restricts a job to some of them, e.g. the fp32 run
that checks the served stack's losslessness (each speculative method with the autoregressive run it is checked against).
The drafter of every speculative method the job measures drafts through its static engine
(qdflash.drafter.static: one CUDA graph per context bucket on a GPU, captured before measuring;
`drafter_engine.<method>.graphs` in metrics.json).
Every speculative method verifies `bench.verify_tokens` tokens per round (the committed token and
that many - 1 drafts; null: the whole block), recorded as `verify_tokens` in metrics.json, and with
`bench.verify_adaptive` the whole block after a round that accepted that far (`verify_adaptive`;
`<method>.verified_per_round`); on a GPU the verify step of each length is captured as a CUDA graph. With
`bench.no_repeat` no draft repeats the draft before it (`blocks.distinct_drafts`; `no_repeat` in metrics.json). With
`bench.tree_nodes` N every round verifies a tree of the drafter's N best paths instead (`tree_nodes`; its step captured). `bench.attention` is the engines'
attention in decode steps, verify blocks and drafts (sdpa, or the Triton kernel: EngineBase.set_attention,
DrafterEngine(attention=)).
The drafter window (`bench.window`) is one per job: the sweep runs one job per window. A job with a
window measures only prompts longer than it (where it can engage; from `bench.window_buckets` when
set, e.g. up to the model's context, else `bench.buckets`), or, with `bench.window_prompts: all`,
every prompt of the window-less job, so that its variants' "all" rows are measured on the same prompts
(`prompt_set` in metrics.json: a digest of the prompts) and compete with the window-less ones in the
selection (qdflash.report.select_fastest); either way with this project's autoregressive
baselines (b), (c) and the stage-2 drafters (uncompressed and compressed); transformers' (a) and (a')
do not depend on the window and are measured in the window-less job only (its speed.csv and
metrics.json), so a window job's `speedup_vs_plain16` is blank (and every job's with
`bench.plain_baseline: false`, which leaves (a) out: a run that only checks losslessness, or the gpu
profile, to fit the DAG into a session's device time).
Prompts: held-out prompts per category, and length buckets (real text; the filler prompt apart).
Every speculative greedy output is compared with the autoregressive output of its target; all
outputs are kept in `outputs.jsonl` (token ids per prompt and method).
"""

from __future__ import annotations

import csv
import logging
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .. import bench
from ..data.jsonl import write_jsonl
from ..drafter import load_drafter
from ..drafter.static import DrafterEngine, tune_engines
from ..engine import build_engine
from ..errors import QdflashError
from ..models import load_target, resolve_device
from ..spec import verify_length, verify_sizes
from ..tracking import NodeRun
from ..variants import POOLED, pooled_label
from ._app import stage

log = logging.getLogger("qdflash.bench_speedup")


@stage("bench_speedup")
def main(cfg: DictConfig, run: NodeRun) -> None:
    b = cfg.bench
    # bench.drafter_dtype: the drafters as saved (training saves fp32) or in the target's dtype. Drafts only
    # propose, so either is lossless; the choice moves tau (rounding) and the draft's cost (fp32 GEMMs)
    drafter_dtype = b.get("drafter_dtype", "checkpoint")
    if drafter_dtype not in ("checkpoint", "target"):  # before the targets load: bad input fails at once
        raise QdflashError(f"bench.drafter_dtype={drafter_dtype!r}: expected 'checkpoint' (as saved) or 'target' (the target's dtype)")
    # what this job runs (its window, device and baselines), restricted by bench.methods: a name the job does
    # not run fails here, before any model loads
    cuda = resolve_device(cfg.device).type == "cuda"  # where load_target puts both targets
    names = job_methods([f"spec_qad_{Path(p).parent.name}" for p in cfg.compressed], b.window, cuda, b)
    kept = list(bench.keep_methods(dict.fromkeys(names), b.get("methods")))
    target16 = load_target(cfg.model.name, dtype=cfg.dtype, device=cfg.device)
    qad = load_target(cfg.qad_model, dtype=cfg.dtype, device=cfg.device)

    def drafter_for(path, target):
        return load_drafter(path, target, dtype=target.dtype if drafter_dtype == "target" else None)

    stage1_16, stage1_qad = drafter_for(cfg.stage1, target16), drafter_for(cfg.stage1, qad)
    stage2_qad = drafter_for(cfg.stage2, qad)
    # compressed stage-2 drafters: one method each, named after their folder (e.g. gptq_w4g64)
    compressed = {f"spec_qad_{Path(path).parent.name}": drafter_for(path, qad) for path in cfg.compressed}
    run.metrics["bench.drafter_dtype"] = str(stage2_qad.norm.weight.dtype).removeprefix("torch.")
    tok = target16.tokenizer
    context_len = getattr(target16.config, "max_position_embeddings", 4096)
    window = b.window
    verify = verify_length(stage1_16, b.get("verify_tokens"))  # every speculative method's verify length
    adaptive = bool(b.get("verify_adaptive", False)) and verify < stage1_16.block_size  # ... or the whole block after a long accept
    no_repeat = bool(b.get("no_repeat", False))  # the drafts' rule (qdflash.drafter.blocks.distinct_drafts)
    tree = b.get("tree_nodes")  # a tree of that many drafts a round instead of the chain (qdflash.spec)
    rule = dict(verify_tokens=verify, verify_adaptive=adaptive, no_repeat=no_repeat, tree_nodes=tree)
    every_prompt = b.get("window_prompts", "long") == "all"
    if b.get("window_prompts", "long") not in ("long", "all"):
        raise QdflashError(f"bench.window_prompts={b.window_prompts!r}: expected 'long' or 'all'")
    if every_prompt and b.get("window_buckets") is not None:
        raise QdflashError("bench.window_prompts=all measures the window-less job's prompts, which come from "
                           "bench.buckets: set bench.window_buckets to null")
    # a window job may measure longer buckets than the window-less one (the window engages on long contexts only)
    chosen = b.buckets if window is None or b.get("window_buckets") is None else b.window_buckets
    buckets = OmegaConf.to_container(chosen, resolve=True)
    cases = bench.category_cases(cfg.data_dir, tok, b.prompts_per_category, b.max_new_tokens)
    cases += bench.bucket_cases(cfg.data_dir, tok, buckets, context_len, b.filler)
    if window is not None and not every_prompt:  # a window can only engage on a context longer than itself
        cases = [c for c in cases if len(c.ids) > window]
        if not cases:
            raise QdflashError(f"bench.window={window}: no benchmark prompt is longer than the window (buckets {buckets})")
    log.info("%d prompts: %s", len(cases), ", ".join(f"{c.label} ({len(c.ids)} tokens)" for c in cases))
    # where each long prompt's text came from: held-out text, or training text too where held-out ran short
    run.metrics.update({f"prompts.{c.label}.text_from": c.text_from for c in cases if c.text_from})
    # bench.tau_prompts_per_category: the served drafter's tau over more held-out prompts than the timed ones,
    # untimed (a few prompts a category time a round well but measure tau loosely). Window-less job only: a window
    # engages only past its length, so on these prompts every window job would measure the same
    tau_n = int(b.get("tau_prompts_per_category") or 0)
    wide = (bench.category_cases(cfg.data_dir, tok, tau_n, b.max_new_tokens)
            if tau_n and window is None and "spec_qad_stage2" in kept else [])
    # this project's loops run on the lean engine where the family has one (transformers' forward otherwise);
    # its caches hold the longest prompt and answer of the timed runs and of the tau pass
    # (and a round's block or tree past the last token)
    longest = max(len(c.ids) + c.max_new_tokens for c in cases + wide) + max(stage1_16.block_size, tree or 0) + 1
    # bench.compile: every captured step (decode, verify, draft) through torch.compile, so the AR and the
    # speculative methods run the same fused steps; CUDA graphs only (a CPU run would time compilation)
    compiled = bool(b.get("compile", False)) and cuda
    run.metrics["bench.compile"] = int(compiled)
    # bench.compile_drafter: only the drafters' draft steps compiled (the target's steps as captured): drafts only
    # propose, so a compiled draft's rounding moves tau at most, never what is emitted
    compile_drafts = (compiled or bool(b.get("compile_drafter", False))) and cuda
    run.metrics["bench.compile_drafter"] = int(compile_drafts)
    for key, target, ar in (("target16", target16, "ar16"), ("qad", qad, "ar_qad")):
        # a target's engine runs its AR method and, only beside it (bench.keep_methods), its speculative ones
        if ar not in kept:  # e.g. the 16-bit target in the served fp32 run
            run.metrics[f"engine.{key}"] = "unused"
            continue
        try:
            target.engine = build_engine(target, max_len=longest)
        except QdflashError as err:  # a family without an engine
            log.info("%s runs on transformers' forward: %s", key, err)
            run.metrics[f"engine.{key}"] = "transformers"
            continue
        target.engine.set_attention(b.attention)  # a bad value or no kernels: an error, not a fallback
        run.metrics[f"engine.{key}"] = "lean"
        run.metrics[f"engine.{key}.attention"] = target.engine.attention
        if target.device.type == "cuda":  # decode steps and verify blocks replay CUDA graphs
            started = time.perf_counter()
            run.metrics[f"engine.{key}.kernel_tuning"] = tuning_summary(target.engine.tune_kernels())
            target.engine.capture([1], None, compile=compiled)
            target.engine.capture([1, *verify_sizes(stage1_16, verify, adaptive)], stage1_16.config.target_layer_ids,
                                  compile=compiled)  # the verify blocks
            if tree is not None:  # the tree's step: the committed token and its nodes
                target.engine.capture([int(tree) + 1], stage1_16.config.target_layer_ids, compile=compiled, tree=True)
            run.metrics[f"engine.{key}.graphs"] = len(target.engine.graphs)
            # said as it happens: a job cut here (a lost machine) shows in its log how far it got
            log.info("engine %s: kernels tuned, %d graphs captured%s in %.1f s", key, len(target.engine.graphs),
                     " (compiled)" if compiled else "", time.perf_counter() - started)
    methods = {
        "plain16": lambda ids, n: bench.plain_generate(target16, ids, n),
        "ar16": bench.ar(target16),
        "spec16_stage1": bench.spec(target16, stage1_16, window, **rule),
        "ar_qad": bench.ar(qad),
        "spec_qad_stage1": bench.spec(qad, stage1_qad, window, **rule),
        "spec_qad_stage2": bench.spec(qad, stage2_qad, window, **rule),
        **{name: bench.spec(qad, drafter, window, **rule) for name, drafter in compressed.items()},
    }
    methods["static16"] = lambda ids, n: bench.plain_generate(target16, ids, n, static=True)
    methods = {name: methods[name] for name in kept}  # job_methods, then bench.methods
    # the drafter of each speculative method this job measures
    drafters = {name: drafter for name, drafter in {"spec16_stage1": stage1_16, "spec_qad_stage1": stage1_qad,
                                                    "spec_qad_stage2": stage2_qad, **compressed}.items() if name in methods}
    for name, drafter in drafters.items():  # drafts through its static engine: K/V in place, a CUDA graph per bucket
        drafter.engine = DrafterEngine(drafter, max_len=longest, attention=b.attention, compile=compile_drafts)
    if cuda:  # every drafter's fused (and, quantized, packed) shapes at once, before any capture (drafters share shapes)
        started = time.perf_counter()
        tuned = tune_engines([d.engine for d in drafters.values()])
        run.metrics["drafter_engine.kernel_tuning"] = tuning_summary(tuned)
        log.info("drafter engines: %d shapes tuned in %.1f s", len(tuned), time.perf_counter() - started)
    for name, drafter in drafters.items():
        started = time.perf_counter()
        run.metrics[f"drafter_engine.{name}.graphs"] = drafter.engine.capture(window)
        # what capturing (and with bench.compile_drafter, compiling) cost this job: outside the measurement
        run.metrics[f"drafter_engine.{name}.capture_seconds"] = round(time.perf_counter() - started, 2)
        log.info("drafter engine %s: %d graphs captured%s in %.1f s", name, run.metrics[f"drafter_engine.{name}.graphs"],
                 " (compiled)" if compile_drafts else "", run.metrics[f"drafter_engine.{name}.capture_seconds"])
    # achieved bandwidth (gpt-fast's tokens/s x weight bytes) against the copy bandwidth of this GPU
    decode_bytes = {"target16": bench.weight_bytes(target16.model), "qad": bench.weight_bytes(qad.model)}
    run.metrics.update({f"{key}.decode_weight_mib": round(v / 2**20, 2) for key, v in decode_bytes.items()})
    bandwidth = bench.copy_bandwidth("cuda") if cuda else None
    if cuda:
        run.metrics["copy_bandwidth_gb_per_s"] = round(bandwidth / 1e9, 1)
        for key, target in (("target16", target16), ("qad", qad)):
            if getattr(target, "engine", None) is not None:
                run.metrics[f"engine.{key}.own_mib"] = round(bench.tensor_bytes(target.engine, exclude=target.model) / 2**20, 1)
        run.metrics["cuda.resident_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)  # every model and engine
    results = bench.run_interleaved(methods, cases, warmup=b.warmup, touch=bool(b.touch_prompts))
    for name, r in results.items():
        log.info("%s: %.1f tokens/s", name, r.tokens_per_s)
    # what a prompt's first visit cost beyond the same method's timed (second) visit: untimed, reported
    first_visit = {i: (name, r.touches[i], r.runs[i]) for name, r in results.items() for i in r.touches}
    if first_visit:
        visits = sorted(first_visit.items())
        extra = [round(touch.seconds - timed.seconds, 4) for _, (_, touch, timed) in visits]
        # the prefill's share, on the prompts whose first method times its prefill (transformers' generate does not)
        timed_prefill = [(i, touch, timed) for i, (_, touch, timed) in visits if timed.prefill_seconds]
        prefills = [round(touch.prefill_seconds - timed.prefill_seconds, 4) for _, touch, timed in timed_prefill]
        run.metrics.update({"first_visit.method": [name for _, (name, _, _) in visits], "first_visit.extra_seconds": extra,
                            "first_visit.prefill_prompts": [i for i, _, _ in timed_prefill],
                            "first_visit.extra_prefill_seconds": prefills,
                            "first_visit.extra_seconds_median": round(statistics.median(extra), 4)})
        log.info("a prompt's first visit (untimed) took %+.3f s (median; prefill %s) beyond the same method's timed "
                 "run, per prompt: %s", statistics.median(extra),
                 f"{statistics.median(prefills):+.3f} s" if prefills else "not timed",
                 ", ".join(f"{x:+.3f}" for x in extra))
    fp32 = target16.dtype == torch.float32
    # each speculative output against autoregressive decoding of its own target
    checks = {name: (bench.reference_of(name), target16 if name.startswith("spec16") else qad) for name in drafters}
    # once per prompt (a bf16 divergence replays the reference to read its margin), then tallied per row
    diverged = {name: bench.divergences(model, cases, results[reference], results[name])
                for name, (reference, model) in checks.items()}
    rows = []
    kinds = list(dict.fromkeys(c.label for c in cases))
    pooled = pooled_label(kinds)  # chat + math + code: what issue 21's targets are stated over
    for label in ["all", *kinds, *([pooled] if pooled else [])]:
        keep = [label == "all" or c.label == label or (label == pooled and c.label in POOLED) for c in cases]
        part = {name: r.subset(keep) for name, r in results.items()}
        for name, r in part.items():
            reads = decode_bytes["target16" if name in ("plain16", "static16", "ar16") or name.startswith("spec16") else "qad"]
            summary = bench.summary(name, r, stage1_16.block_size, reads, bandwidth)
            run.metrics.update({f"{label}.{k}": v for k, v in summary.items()})
            row = {"prompts": label, "method": name, "tokens": r.tokens, "seconds": round(r.seconds, 4),
                   "tokens_per_s": round(r.tokens_per_s, 3), "tau": summary.get(f"{name}.tau", ""),
                   "gb_per_s": summary.get(f"{name}.gb_per_s", ""), "peak_working_mib": summary.get(f"{name}.peak_working_mib", "")}
            for base in ("plain16", "ar16", "ar_qad"):
                if base not in part:  # plain16 is not measured in a window job: left blank there
                    continue
                row[f"speedup_vs_{base}"] = round(r.tokens_per_s / max(part[base].tokens_per_s, 1e-9), 4)
                run.metrics[f"{label}.{name}.speedup_vs_{base}"] = row[f"speedup_vs_{base}"]
            if name in checks:
                check = bench.tally([m for m, k in zip(diverged[name], keep) if k], fp32)
                row.update({"mismatches": check["mismatches"], "mismatch_bugs": check["mismatch_bugs"]})
                run.metrics.update({f"{label}.{name}.{k}": v for k, v in check.items()})
            rows.append(row)
    # the timed results are written (and summarized in the log) before the round profile and the tau pass:
    # a job cut after its timed runs (results/published/2026-12-03-h200-qwen-complete lost them so, in the
    # tau pass) still leaves them in its partial folder, which the H200 runs bring back
    columns = ["prompts", "method", "tokens", "seconds", "tokens_per_s", "tau", "speedup_vs_plain16", "speedup_vs_ar16",
               "speedup_vs_ar_qad", "mismatches", "mismatch_bugs", "gb_per_s", "peak_working_mib"]
    with open(run.dir / "speed.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    # every method's tokens per prompt: a divergence can be looked at (and re-scored) afterwards
    # and its timed seconds per method (a row's total hides which prompt a difference came from), and each
    # speculative method's rounds: tokens committed and tokens verified per round (what caps a row's tau)
    write_jsonl(run.dir / "outputs.jsonl", [{"prompt": i, "label": case.label, "prompt_tokens": len(case.ids),
                                             **{name: r.runs[i].tokens for name, r in results.items()},
                                             "seconds": {name: round(r.runs[i].seconds, 5) for name, r in results.items()},
                                             "committed": {name: r.runs[i].acceptance_lengths for name, r in results.items()
                                                           if r.runs[i].acceptance_lengths},
                                             "verified": {name: r.runs[i].verify_lengths for name, r in results.items()
                                                          if r.runs[i].verify_lengths},
                                             # the draft each round's target overruled (-1: none): what a drafter gets wrong
                                             "rejected": {name: r.runs[i].rejected for name, r in results.items()
                                                          if r.runs[i].rejected},
                                             "first_visit": first_visit[i][0] if i in first_visit else None}
                                            for i, case in enumerate(cases)])
    for row in rows:  # every drafter over all prompts; the served one (stage 2) per prompt kind too
        if row["method"] in drafters and (row["prompts"] == "all" or row["method"] == "spec_qad_stage2"):
            log.info("%s %s: tau %s, %.1f tokens/s, %s", row["prompts"], row["method"], row["tau"], row["tokens_per_s"],
                     ", ".join(f"{row[k]}x {k[len('speedup_vs_'):]}" for k in ("speedup_vs_ar16", "speedup_vs_ar_qad") if k in row))
    # what a round costs, part by part, for the drafter the stack serves and its 16-bit counterpart: one
    # profiling pass per prompt kind after the timed runs (it synchronizes between parts)
    for name, target, drafter, reference in (("spec16_stage1", target16, stage1_16, "ar16"),
                                             ("spec_qad_stage2", qad, stage2_qad, "ar_qad")):
        if name not in methods:
            continue
        for label in dict.fromkeys(c.label for c in cases):
            keep = [c.label == label for c in cases]
            parts = bench.round_parts(target, drafter, [c for c, k in zip(cases, keep) if k], results[reference].subset(keep),
                                      window, **rule)
            run.metrics.update({f"{label}.{name}.round.{k}": v for k, v in parts.items()})
            log.info("%s %s: a round %.2f ms = %.2f decode steps (draft %.2f, verify %.2f, append %.2f, host %.2f ms)",
                     label, name, parts["ms"], parts["in_decode_steps"], parts["draft_ms"], parts["verify_ms"],
                     parts["append_ms"], parts["host_ms"])
    if wide:  # the untimed tau pass (bench.tau_prompts_per_category, above)
        measured = bench.tau_pass(qad, stage2_qad, wide, window, **rule)
        for label, part in measured.items():
            run.metrics.update({f"tau_pass.spec_qad_stage2.{label}.{k}": v for k, v in part.items()})
        run.metrics["tau_pass.prompts_per_category"] = tau_n
        log.info("tau pass (spec_qad_stage2, up to %d held-out prompts a category, untimed): %s", tau_n,
                 ", ".join(f"{label} {part['tau']:.3f} ({part['rounds']} rounds)" for label, part in measured.items()))
    if cuda:
        run.metrics["cuda.device"] = torch.cuda.get_device_name()
    run.metrics.update({"prompts": len(cases), "prompt_set": bench.prompt_set(cases), "dtype": str(target16.dtype),
                        "window": -1 if window is None else int(window),
                        "block_size": stage1_16.block_size, "verify_tokens": verify, "verify_adaptive": int(adaptive),
                        "no_repeat": int(no_repeat), "tree_nodes": int(tree or 0)})
    bugs = sum(v for k, v in run.metrics.items() if k.startswith("all.") and k.endswith(".mismatch_bugs"))
    log.info("speculative vs autoregressive: %d mismatch bugs (%s)", bugs, "float32: any mismatch" if fp32 else f"margin > {bench.MARGIN_BUG}")


def job_methods(compressed: list[str], window, cuda: bool, b) -> list[str]:
    """The methods a job runs, before bench.methods: every one of the module docstring's, but (a') only on
    a GPU with bench.compiled_baseline, (a) only with bench.plain_baseline, and in a window job only the
    AR baselines and the stage-2 drafters: the window sweep is about the adapted drafters, and
    transformers' baselines, which no drafter window changes, are the slowest methods by far
    (results/published/2026-11-30-h200-gpu-dag)."""
    names = ["plain16", "ar16", "spec16_stage1", "ar_qad", "spec_qad_stage1", "spec_qad_stage2", *compressed]
    if cuda and b.get("compiled_baseline", True):
        names.append("static16")
    if not b.get("plain_baseline", True):  # e.g. an fp32 run that checks losslessness: (a) is its slowest method
        names.remove("plain16")
    if window is not None:
        names = [n for n in names if not n.startswith(("spec16_", "spec_qad_stage1")) and n not in ("plain16", "static16")]
    return names


def tuning_summary(tuned: dict) -> list[str]:
    """One line per tuned shape (metrics.json holds strings and lists): which kernel its steps run."""
    lines = []
    for shape, t in tuned.items():
        if shape.startswith("gemv"):
            winner = "Triton GEMV" if t["used"] else "cuBLAS"
            lines.append(f"{shape}: {winner} (cuBLAS {t['cublas_ms'] * 1e3:.1f} us, GEMV {t['gemv_ms'] * 1e3:.1f} us)")
        else:
            lines.append(f"{shape}: {t['used']} (W4A16 {t['config']} {t['ms'] * 1e3:.1f} us, "
                         f"cuBLAS on the 16-bit weight {t['dense_ms'] * 1e3:.1f} us)")
    return lines


if __name__ == "__main__":
    main()
