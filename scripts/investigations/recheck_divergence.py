"""Re-measure, at another precision, where a benchmark's speculative greedy output left the
autoregressive one: is it a near-tie of the target's top two tokens, or a real disagreement?

    python scripts/investigations/recheck_divergence.py results/published/2026-11-30-h200-3521bb7/bench/speedup_winnone \
        --data results/published/2026-11-30-h200-3521bb7/data/bf16 --dtype float32

The bench node (qdflash.bench.compare) measures the reference's top-2 margin in the benchmark's own
dtype. In bf16 a logit near 12 has a resolution of 1/16, so a relative margin of 1e-2 is only ~2
bf16 steps. Here the margin comes from one full forward over prompt + common prefix. This script rebuilds the node's prompts from its config.yaml and the data folder
(train/heldout.jsonl, or the *.head50.jsonl that pack.sh brings back), checks each against the
prompt length the node recorded, and at every divergence of METHODS from REFERENCE prints the
target's top-5 next-token logits after the common prefix, computed in --dtype (fp32 on the CPU by
default): the two diverging tokens, their logit gap, and the relative top-2 margin.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from qdflash import bench
from qdflash.data.jsonl import read_jsonl
from qdflash.models import load_target


def data_folder(path: Path, scratch: Path) -> Path:
    """`path` itself when it has train/heldout.jsonl; else a scratch folder linking its *.head50.jsonl."""
    if (path / "train.jsonl").is_file() and (path / "heldout.jsonl").is_file():
        return path
    for split in ("train", "heldout"):
        head = path / f"{split}.head50.jsonl"
        if not head.is_file():
            sys.exit(f"recheck_divergence: {path} has neither {split}.jsonl nor {split}.head50.jsonl")
        (scratch / f"{split}.jsonl").symlink_to(head.resolve())
    return scratch


def cases_by_label(node: Path, data: Path, tokenizer, context_len: int) -> dict[str, list[bench.PromptCase]]:
    """The node's prompts, built the way qdflash.stages.bench_speedup builds them, by label in order.
    From *.head50.jsonl a category may be missing (its first held-out prompts lie further on)."""
    b = yaml.safe_load((node / "config.yaml").read_text())["bench"]
    cases = bench.category_cases(data, tokenizer, b["prompts_per_category"], b["max_new_tokens"])
    # a node that recorded no `prompts.<bucket>.text_from` ran before 755f14b: its long prompts are training text
    metrics = json.loads((node / "metrics.json").read_text()) if (node / "metrics.json").is_file() else {}
    splits = ("heldout", "train") if any(k.endswith(".text_from") for k in metrics) else ("train",)
    cases += bench.bucket_cases(data, tokenizer, b["buckets"], context_len, b["filler"], splits)
    by_label: dict[str, list[bench.PromptCase]] = {}
    for case in cases:
        by_label.setdefault(case.label, []).append(case)
    return by_label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("node", type=Path, help="a bench_speedup node folder (config.yaml, outputs[.head50].jsonl)")
    parser.add_argument("--data", type=Path, required=True, help="the data folder the node read (data/bf16)")
    parser.add_argument("--target", default=None, help="the reference's model (default: the node's model.name)")
    parser.add_argument("--reference", default="ar16")
    parser.add_argument("--methods", nargs="+", default=["spec16_stage1"])
    parser.add_argument("--prompts", nargs="*", default=None, help="only these prompt labels (default: all)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    outputs = next((p for p in (args.node / "outputs.jsonl", args.node / "outputs.head50.jsonl") if p.is_file()), None)
    if outputs is None:
        sys.exit(f"recheck_divergence: {args.node} has no outputs.jsonl or outputs.head50.jsonl")
    name = args.target or yaml.safe_load((args.node / "config.yaml").read_text())["model"]["name"]
    target = load_target(name, dtype=args.dtype, device=args.device)
    context_len = getattr(target.config, "max_position_embeddings", 4096)
    rows = [r for r in read_jsonl(outputs) if args.prompts is None or r["label"] in args.prompts]
    with tempfile.TemporaryDirectory() as scratch:
        cases = cases_by_label(args.node, data_folder(args.data, Path(scratch)), target.tokenizer, context_len)
    found, seen = [], {}
    for row in rows:
        nth = seen[row["label"]] = seen.get(row["label"], -1) + 1
        if nth >= len(cases.get(row["label"], [])):
            found.append({"prompt": row["label"], "note": f"not rebuildable from {args.data} (a *.head50.jsonl lacks it)"})
            continue
        case = cases[row["label"]][nth]
        if len(case.ids) != row["prompt_tokens"]:
            sys.exit(f"recheck_divergence: prompt {row['prompt']} rebuilt as {case.label} ({len(case.ids)} tokens), the node "
                     f"recorded {row['label']} ({row['prompt_tokens']} tokens): --data is not the data the node read")
        ref = row[args.reference]
        for method in args.methods:
            got = row[method]
            if got == ref:
                continue
            k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            if k >= min(len(ref), len(got)):
                found.append({"prompt": row["label"], "method": method, "position": k, "note": "one output is a prefix of the other"})
                continue
            with torch.no_grad():
                logits = target.model(input_ids=torch.tensor([case.ids + ref[:k]], device=target.device)).logits[0, -1].float()
            top = logits.topk(5)
            found.append({
                "prompt": row["label"], "method": method, "position": k, "reference_token": ref[k], "method_token": got[k],
                "logit_reference_token": round(logits[ref[k]].item(), 4), "logit_method_token": round(logits[got[k]].item(), 4),
                "top5": [[i, round(v, 4)] for i, v in zip(top.indices.tolist(), top.values.tolist())],
                "relative_top2_margin": round(((top.values[0] - top.values[1]) / top.values[0].abs()).item(), 6),
                "tokens_are_top2": sorted([ref[k], got[k]]) == sorted(top.indices[:2].tolist()),
            })
    print(json.dumps({"node": str(args.node), "target": name, "dtype": args.dtype, "divergences": found}, indent=1))


if __name__ == "__main__":
    main()
