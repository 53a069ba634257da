"""The drafter recipe on the Qwen2.5-Coder-0.5B-Instruct target, measured on the H200 (issue 21):
multi-turn self-distilled data, stage-1 training for several epochs with tau-hat after each, and
greedy speculative decoding against this project's autoregressive decoding, batch 1.

Every step runs the real node (prepare_data, train_drafter) with the `gpu` profile's overrides
(qdflash.config.node_overrides) and the study's settings below on top, so a later profile with these
settings reproduces it; the benchmark uses qdflash.bench as bench_speedup does. Steps (each fits one
device call; the folder ROOT survives between calls while the machine stays warm):

    python scripts/bench/study_drafter.py data ROOT                       # the 16-bit target's answers
    python scripts/bench/study_drafter.py probe ROOT                      # training sequences per second
    python scripts/bench/study_drafter.py train ROOT NAME --epochs 4 --budget-s 480   # sized by the probe
    python scripts/bench/study_drafter.py train ROOT NAME2 --max-examples N --set drafter_train.labels=target  # an arm
    python scripts/bench/study_drafter.py bench ROOT NAME [--verify-tokens V]   # tau, speedup, mismatches
    python scripts/bench/study_drafter.py bench ROOT NAME --drafter DIR --data DIR --verify-tokens 6,block --verify-adaptive
    python scripts/bench/study_drafter.py bench ROOT NAME ... --served    # the drafter in bf16, compiled: as the DAG serves it
    python scripts/bench/study_drafter.py bench ROOT NAME ... --verify-tokens 6 --verify-adaptive --no-repeat --tree-nodes 15
                                                                          # the served chain beside a tree of 15 drafts

`train` trains on as many examples as `epochs` passes fit in `budget-s` seconds at the probe's rate
(all of them if they fit; `--max-examples` fixes the number instead). Results: ROOT/<step>/ (each
node's folder) and ROOT/study.json (one entry per step), copied to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from qdflash.config import deep_merge, load_config, node_overrides  # noqa: E402

# the study's settings over the gpu profile (config/config.yaml): Qwen target, multi-turn answers,
# long training sequences, several epochs
STUDY = {
    "model": "qwen2.5-coder-0.5b",
    "data": {
        "sources": {
            "sharegpt": {"n_train": 12000, "n_heldout": 128, "optional": False, "path": None},
            "gsm8k": {"n_train": 7000, "n_heldout": 64, "optional": False, "path": None},
            "mmlu": {"n_train": 6000, "n_heldout": 64, "optional": False, "path": None},
            "humaneval": {"n_train": 0, "n_heldout": 64, "optional": False, "path": None},
        },
        "max_prompt_tokens": 1024,
        "max_turns": 4,
        "max_sequence_tokens": 3072,
        "generation": {"max_new_tokens": 384, "batch_size": 1024, "prefill_tokens": 32768, "static_cache": False},
    },
    "drafter": {"num_layers": 2, "block_size": 16},
    "drafter_train": {"batch_size": 16, "anchors_per_seq": 64, "max_length": 3072, "lr": 6.0e-4, "warmup_ratio": 0.04,
                      "gamma": 7.0, "eval_every": 1000000, "eval_anchors_per_seq": 64, "heldout_samples": 256,
                      "cache_features": False, "attention": "sdpa",
                      # the recipe as the study measured it (2026-12-01), not the profile's later one
                      "min_lr_ratio": 0.0, "loss_positions": None, "epochs": None},
}
PROBE_STEPS = 40
# `--rehearse`: the same steps on the CPU at toy sizes (tiny-qwen2), before device time is spent
REHEARSAL = {
    "model": "tiny-qwen2", "device": "cpu", "dtype": "float32",
    "data": {"sources": {"sharegpt": {"n_train": 8, "n_heldout": 4}, "gsm8k": {"n_train": 4, "n_heldout": 2},
                         "mmlu": {"n_train": 4, "n_heldout": 2}, "humaneval": {"n_heldout": 2}},
             "max_prompt_tokens": 256, "max_sequence_tokens": 400, "generation": {"max_new_tokens": 24, "batch_size": 8}},
    "drafter_train": {"batch_size": 2, "anchors_per_seq": 8, "max_length": 256, "eval_anchors_per_seq": 8, "heldout_samples": 4},
    "drafter": {"block_size": 4, "mask_token_id": None},  # the gpu profile's mask token is past tiny-qwen2's vocabulary
}


def study_config() -> dict:
    config = load_config()  # profiles merged over the base, as the rules read them
    config["profile"] = "gpu"
    config["experiment"] = "study"
    config["profiles"]["gpu"] = deep_merge(config["profiles"]["gpu"], STUDY)
    return config


def record(root: Path, step: str, entry: dict) -> None:
    path = root / "study.json"
    study = json.loads(path.read_text()) if path.is_file() else {}
    study[step] = entry
    path.write_text(json.dumps(study, indent=1))
    if os.environ.get("OUT"):
        shutil.copy2(path, Path(os.environ["OUT"]) / "study.json")
    print(json.dumps({step: entry}, indent=1), flush=True)


def run_node(root: Path, node: str, out: Path, sections: list[str], extra: dict, timeout: float | None = None) -> dict:
    """One node with the study's overrides; its log beside it (and in $OUT); its metrics.json."""
    args = node_overrides(study_config(), node, out, sections, extra)
    log = root / f"{out.name}.log"
    cmd = [sys.executable, "-m", f"qdflash.stages.{node}", *args]
    print(" ".join(cmd), flush=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            code = proc.wait()
    wall = time.perf_counter() - started
    if os.environ.get("OUT"):
        shutil.copy2(log, Path(os.environ["OUT"]) / log.name)
    print(f"{node} -> {out}: exit {code} after {wall:.1f} s", flush=True)
    if code != 0:
        print(log.read_text()[-4000:], flush=True)
        raise SystemExit(code)
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["study.wall_s"] = round(wall, 1)
    return metrics


def step_data(root: Path, _args) -> None:
    m = run_node(root, "prepare_data", root / "data", ["data"], {})
    keep = {k: v for k, v in m.items() if k.startswith(("train.", "heldout.", "generation.", "study.", "model."))}
    record(root, "data", keep)


def step_probe(root: Path, _args) -> None:
    m = run_node(root, "train_drafter", root / "probe", ["drafter", "drafter_train"],
                 {"stage": 1, "data_dir": str(root / "data"), "drafter_train.steps": PROBE_STEPS, "drafter_train.epochs": None,
                  "drafter_train.heldout_samples": 16})
    # the first step compiles / allocates: the rate is of the other steps
    steady = m["train.seconds"] - m.get("train.first_step_seconds", 0.0)
    per_s = (PROBE_STEPS - 1) * m["train.batch_size"] / max(steady, 1e-9)
    record(root, "probe", {"sequences_per_s": round(per_s, 2), "train.seconds": m["train.seconds"],
                           "first_step_seconds": m.get("train.first_step_seconds"), "examples": m["train.examples"],
                           "tokens": m["train.tokens"], "study.wall_s": m["study.wall_s"]})


def step_train(root: Path, args) -> None:
    study = json.loads((root / "study.json").read_text())
    examples = study["probe"]["examples"]
    if args.max_examples:
        n = min(args.max_examples, examples)
    else:
        n = min(examples, int(args.budget_s * study["probe"]["sequences_per_s"] / args.epochs))
    extra = {"stage": 1, "data_dir": str(root / "data"), "drafter_train.epochs": args.epochs,
             "drafter_train.max_examples": n, "drafter.num_layers": args.layers, **overrides(args.set)}
    m = run_node(root, "train_drafter", root / args.name, ["drafter", "drafter_train"], extra)
    keep = {k: v for k, v in m.items() if k.startswith(("train.", "final.", "drafter.", "study."))
            and k not in ("train.loss_curve",)}
    keep["train.loss_curve_every_50"] = m["train.loss_curve"][::50]
    record(root, f"train.{args.name}", keep)


def overrides(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` pairs (VALUE read as YAML: 256, 1.0e-3, target) for an arm of the study."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith(("drafter.", "drafter_train.")):
            raise SystemExit(f"study_drafter: --set {pair!r}: expected drafter.KEY=VALUE or drafter_train.KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def node_counts(text: str) -> list[int]:
    """`--tree-nodes` "8,15" -> [8, 15]: drafts a round's tree holds, 1..62 each (bench.tree_nodes' bound: the
    attention's int64 ancestor masks)."""
    items = [item for item in text.split(",") if item]
    if not items or not all(item.isdigit() and 1 <= int(item) <= 62 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts 1..62, comma separated, e.g. 8,15")
    return [int(item) for item in items]


BENCH_SIZES = (4, 256, 2048)  # bench's --per-category, --max-new-tokens, --long defaults (its entry key names others)


def step_bench(root: Path, args) -> None:
    import torch

    from qdflash import bench
    from qdflash.drafter import load_drafter
    from qdflash.drafter.static import DrafterEngine
    from qdflash.engine import build_engine
    from qdflash.models import load_target
    from qdflash.spec import verify_length, verify_sizes

    dtype = args.dtype
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(STUDY["model"], dtype=dtype, device=device)
    drafter_dir = args.drafter or root / args.name / "drafter"
    # --served: the drafter as the gpu profile's benchmark runs it (bench.drafter_dtype, bench.compile_drafter; the
    # compile on a GPU only, as bench_speedup); else as saved (fp32) and eager, as the published studies ran
    served = study_config()["profiles"]["gpu"]["bench"] if args.served else {}
    in_target_dtype = served.get("drafter_dtype", "checkpoint") == "target"
    compile_drafts = bool(served.get("compile_drafter", False)) and device == "cuda"
    drafter = load_drafter(drafter_dir, target, dtype=target.dtype if in_target_dtype else None)
    # one speculative method per verify length (None: the whole block), interleaved with AR on the same prompts
    asked = [None] if not args.verify_tokens else [None if v in ("block", "none") else int(v)
                                                    for v in args.verify_tokens.split(",")]
    # each checked now, and one method per distinct length (16 and "block" are the same method at block 16)
    verifies = list({verify_length(drafter, v): v for v in asked}.values())
    sizes = sorted({s for v in verifies for s in verify_sizes(drafter, v, args.verify_adaptive)})
    tok = target.tokenizer
    data = args.data or root / "data"
    cases = bench.category_cases(data, tok, args.per_category, args.max_new_tokens)
    cases += bench.bucket_cases(data, tok, [[args.long, args.max_new_tokens]], target.config.max_position_embeddings, True)
    trees = args.tree_nodes or []
    # room past the longest answer for a round's whole block, or a tree's nodes (written after the cache, then moved)
    longest = max(len(c.ids) + c.max_new_tokens for c in cases) + max([drafter.block_size, *trees]) + 1
    target.engine = build_engine(target, max_len=longest)
    attention = args.attention or ("kernel" if device == "cuda" else "sdpa")  # the gpu profile's bench.attention
    target.engine.set_attention(attention)
    if device == "cuda":  # as bench_speedup: tuned kernels, decode steps and verify blocks as CUDA graphs
        target.engine.tune_kernels()
        target.engine.capture([1], None)
        target.engine.capture([1, *sizes], drafter.config.target_layer_ids)
        for n in trees:  # a tree's step: the committed token and its n nodes
            target.engine.capture([n + 1], drafter.config.target_layer_ids, tree=True)
    drafter.engine = DrafterEngine(drafter, max_len=longest, attention=attention, compile=compile_drafts)
    drafter.engine.tune_kernels()  # as bench_speedup: its fused shapes, before capture ({} off the GPU)
    drafter.engine.capture(None)
    # each speculative method's rule: a chain per verify length, a tree per node count (no-repeat: "nr" on the name)
    repeat = "nr" if args.no_repeat else ""
    rules = {f"spec16.v{v or drafter.block_size}" + ("a" if args.verify_adaptive else "") + repeat:
             dict(verify_tokens=v, verify_adaptive=args.verify_adaptive, no_repeat=args.no_repeat) for v in verifies}
    rules |= {f"spec16.tree{n}{repeat}": dict(no_repeat=args.no_repeat, tree_nodes=n) for n in trees}
    methods = {"ar16": bench.ar(target), **{name: bench.spec(target, drafter, None, **rule) for name, rule in rules.items()}}
    results = bench.run_interleaved(methods, cases, warmup=2)
    fp32 = target.dtype == torch.float32
    out = {"dtype": str(target.dtype), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "prompts": len(cases),
           "block_size": drafter.block_size, "verify_adaptive": bool(args.verify_adaptive), "attention": attention,
           "drafter": str(drafter_dir), "drafter_dtype": str(drafter.norm.weight.dtype).removeprefix("torch."),
           "compile_drafter": compile_drafts, "data": str(data), "no_repeat": bool(args.no_repeat), "tree_nodes": trees}
    groups = {"all": None, "chat+math+code": ("chat", "math", "code"), **{c.label: (c.label,) for c in cases}}
    for label, members in groups.items():
        keep = [members is None or c.label in members for c in cases]
        if not any(keep):
            continue
        ar = results["ar16"].subset(keep)
        out[label] = {"prompts": sum(keep), "ar16.tokens_per_s": round(ar.tokens_per_s, 1)}
        for name in rules:
            sp = results[name].subset(keep)
            check = bench.compare(target, [c for c, k in zip(cases, keep) if k], ar, sp, fp32)
            tau = sum(sp.acceptance) / max(len(sp.acceptance), 1)
            speedup = sp.tokens_per_s / max(ar.tokens_per_s, 1e-9)
            out[label][name] = {
                "tokens": sp.tokens, "tokens_per_s": round(sp.tokens_per_s, 1), "tau": round(tau, 3),
                "speedup_vs_ar16": round(speedup, 3), "round_cost_in_ar_steps": round(tau / max(speedup, 1e-9), 3),
                "mismatches": check["mismatches"], "mismatch_bugs": check["mismatch_bugs"],
                "divergence_margins": check["divergence_margins"],
                "tau_histogram": [sp.acceptance.count(k) for k in range(1, drafter.block_size + 1)]}
    # where a round's time goes (draft / verify / append / host, ms and in decode steps): a profiling pass after
    # the timed runs, on the chat / math / code prompts, as bench_speedup's round_parts
    core = [c for c in cases if c.label in ("chat", "math", "code")]
    if core:
        core_ar = results["ar16"].subset([c.label in ("chat", "math", "code") for c in cases])
        for name, rule in rules.items():
            out["chat+math+code"][name]["round"] = bench.round_parts(target, drafter, core, core_ar, None, **rule)
    # one entry per drafter, dtype, rules, attention and prompt set: a bench with other options does not replace it
    # (the prompt set is named where it is not the default: runs before 2026-12-05 did not name it)
    sizes = (args.per_category, args.max_new_tokens, args.long)
    key = ".".join([f"bench.{args.name}.{dtype}", *(n.removeprefix("spec16.") for n in rules), attention,
                    *(["served"] if args.served else []),
                    *([f"p{sizes[0]}x{sizes[1]}.long{sizes[2]}"] if sizes != BENCH_SIZES else [])])
    record(root, key, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["data", "probe", "train", "bench"])
    parser.add_argument("root", type=Path)
    parser.add_argument("name", nargs="?", default="stage1")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--layers", type=int, default=STUDY["drafter"]["num_layers"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--per-category", type=int, default=BENCH_SIZES[0])
    parser.add_argument("--max-new-tokens", type=int, default=BENCH_SIZES[1])
    parser.add_argument("--long", type=int, default=BENCH_SIZES[2], help="the long prompt's tokens (and the filler prompt's)")
    parser.add_argument("--verify-tokens", default=None,
                        help="bench: tokens a speculative round verifies, 1 < V <= block size, or a comma list (one "
                             "method each, e.g. 6,block; default: the whole block)")
    parser.add_argument("--verify-adaptive", action="store_true",
                        help="bench: the whole block after a round that accepted that far (bench.verify_adaptive)")
    parser.add_argument("--attention", choices=["sdpa", "kernel"], default=None,
                        help="bench: the engines' attention (default: kernel on a GPU, as the gpu profile's bench; sdpa "
                             "on the CPU; the 2026-12-01 study's bench ran sdpa)")
    parser.add_argument("--tree-nodes", type=node_counts, default=None,
                        help="bench: also a method verifying a tree of the drafter's N best paths a round (a comma list: "
                             "one method each, e.g. 8,15; bench.tree_nodes), beside the chains")
    parser.add_argument("--no-repeat", action="store_true",
                        help="bench: no draft repeats the draft before it, chains and trees alike (bench.no_repeat)")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="bench: the drafter folder (default: ROOT/NAME/drafter), e.g. a scaling run's "
                             "$QDFLASH_RESULTS/<exp>/scaling/drafter/<run>/drafter")
    parser.add_argument("--data", type=Path, default=None,
                        help="bench: the data folder whose held-out prompts are measured (default: ROOT/data), e.g. "
                             "the scaling study's scaling/data/merged")
    parser.add_argument("--served", action="store_true",
                        help="bench: the drafter as the gpu profile's benchmark runs it (bench.drafter_dtype, "
                             "bench.compile_drafter: bf16, compiled on a GPU); default: as saved (fp32), eager")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train: one more drafter./drafter_train. override for this arm, e.g. "
                             "--set drafter_train.labels=target --set drafter_train.anchors_per_seq=256")
    parser.add_argument("--rehearse", action="store_true", help="toy sizes on the CPU (tiny-qwen2)")
    args = parser.parse_args()
    if args.rehearse:
        STUDY.update(deep_merge(STUDY, REHEARSAL))
    args.root.mkdir(parents=True, exist_ok=True)
    {"data": step_data, "probe": step_probe, "train": step_train, "bench": step_bench}[args.step](args.root, args)


if __name__ == "__main__":
    main()
