"""Does forbidding a draft that repeats the draft before it raise tau? A trained drafter, on the CPU.

The served drafter fills its block in one pass; where it goes wrong at block positions 2-5 it often writes the
token of the position before again (results/published/2026-12-04-h200-qwen-greedy, PROVENANCE.md), a repeat that
the target's own greedy answers almost never make there. `spec.speculative_generate(..., no_repeat=True)` takes the
drafter's second choice where its first repeats the draft before (`drafter.blocks.distinct_drafts`). This decodes held-out prompts of each kind
(GSM8K and HumanEval test items, never trained on; ShareGPT held-out prompts of a run's data) with the same
drafter and target, fp32, greedy, both ways, and reports tau and the acceptance histogram of each; both outputs
must equal the target's greedy decoding. Decoded tau per prompt is noisy (one early difference moves every later
round), so it also walks both rules over the same answers (`drafter.train.walk_acceptance`, whole-block verifies:
decoding's rounds without decoding), the greedy answers above and the run's held-out chat answers (`--chat`),
paired anchor by anchor.

    python scripts/investigations/draft_repeats.py --drafter /tmp/dgreedy --chat results/<run>/data/qad/heldout.head50.jsonl \
        --per-kind 8 --new-tokens 128 --out results/published/<run>/draft-repeats.json

The drafter comes back from the H200 with scripts/airgap/fetch_drafter.sh; the target is the preset it was trained
on (16-bit weights: a stage-2 drafter was adapted to the QAD target, within a held-out KL of ~2e-4 of them).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from qdflash.data.chat import render_prompt_ids, tokenize_conversation
from qdflash.data.sources import load_source
from qdflash.drafter import load_drafter
from qdflash.drafter.model import check_drafter_folder
from qdflash.errors import QdflashError
from qdflash.drafter.train import walk_acceptance
from qdflash.models import load_target
from qdflash.spec import autoregressive_generate, speculative_generate


def prompts(chat_file: Path | None, per_kind: int) -> list[tuple[str, str]]:
    out = [("math", item.prompt) for item in load_source("gsm8k").eval_items[:per_kind]]
    out += [("code", item.prompt) for item in load_source("humaneval").eval_items[:per_kind]]
    if chat_file is not None:
        rows = [json.loads(line) for line in chat_file.read_text().splitlines() if line.strip()]
        out += [("chat", row["messages"][0]["content"]) for row in rows if row.get("category") == "chat"][:per_kind]
    return out


def load_checked(args, script: str):
    """The target (`args.model`, in `args.dtype` on `args.device`) and the drafter `args.drafter` on it, in its
    dtype; a folder that is not a drafter is a one-line error naming `script`, said before the target loads (~10 s)."""
    try:
        check_drafter_folder(args.drafter)
    except QdflashError as err:
        raise SystemExit(f"{script}: --drafter: {err}")
    torch.manual_seed(0)
    target = load_target(args.model, dtype=args.dtype, device=args.device)
    return target, load_drafter(args.drafter, target, dtype=target.dtype)  # on the target's device, in its dtype


def data_answers(target, chat_file: Path) -> tuple[list[dict], dict[str, str]]:
    """A data stage's held-out answers (the QAD target's, bf16 on the H200), first turn each, as walked examples and
    their categories (`data-<category>`)."""
    examples, categories = [], {}
    for j, row in enumerate(json.loads(line) for line in chat_file.read_text().splitlines() if line.strip()):
        ex = tokenize_conversation(target.tokenizer, row["messages"][:2], eos_token_ids=list(target.eos_token_ids))
        examples.append({"id": f"data-{j}", **ex})
        categories[f"data-{j}"] = f"data-{row.get('category', 'chat')}"
    return examples, categories


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, required=True, help="a drafter folder (config.json + model.safetensors)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--chat", type=Path, default=None, help="a data stage's heldout jsonl (its chat prompts)")
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--verify", type=int, default=6, help="the served verify length (the gpu profile's)")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                    help="decode each prompt both ways (slow on the CPU); --no-decode: only the walks")
    ap.add_argument("--references", type=Path, default=None,
                    help="a json of the prompts' greedy answers: read where it exists (same prompts), else written")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16 (the served dtype): outputs may differ from greedy at near-ties, counted, not asserted")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target, drafter = load_checked(args, "draft_repeats")
    differ = collections.Counter()
    cases = prompts(args.chat, args.per_kind)
    lengths = {rule: collections.defaultdict(list) for rule in ("argmax", "no_repeat")}
    started = time.perf_counter()
    walked, categories = [], {}
    known = json.loads(args.references.read_text()) if args.references is not None and args.references.is_file() else {}
    for i, (kind, text) in enumerate(cases, 1):
        ids = render_prompt_ids(target.tokenizer, text)
        key = f"{args.new_tokens}:{ids}"
        reference = known[key] if key in known else autoregressive_generate(target, [ids], args.new_tokens).tokens
        known[key] = reference
        walked.append({"id": f"{kind}-{i}", "input_ids": ids + reference, "loss_mask": [0] * len(ids) + [1] * len(reference)})
        categories[f"{kind}-{i}"] = kind
        if not args.decode:
            print(f"[{i}/{len(cases)}] {kind}: {len(reference)} tokens ({time.perf_counter() - started:.0f} s)", flush=True)
            continue
        for rule in lengths:
            out = speculative_generate(target, drafter, [ids], args.new_tokens, verify_tokens=args.verify,
                                       verify_adaptive=args.adaptive, no_repeat=rule == "no_repeat")
            if args.dtype == "float32":
                assert out.tokens == reference, f"{kind} prompt {i}, {rule}: the output differs from greedy decoding (fp32)"
            differ[rule] += out.tokens != reference
            lengths[rule][kind].append(out.acceptance_lengths)
        print(f"[{i}/{len(cases)}] {kind}: tau " + ", ".join(
            f"{rule} {sum(lengths[rule][kind][-1]) / len(lengths[rule][kind][-1]):.2f}" for rule in lengths)
            + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    if args.references is not None:
        args.references.write_text(json.dumps(known) + "\n")
    report = {"model": args.model, "drafter": str(args.drafter), "new_tokens": args.new_tokens, "verify_tokens": args.verify,
              "adaptive": args.adaptive, "prompts": collections.Counter(kind for kind, _ in cases),
              "device": str(target.device), "dtype": args.dtype, "outputs_differing_from_greedy": dict(differ)}
    if args.chat is not None:  # the run's held-out answers
        data, data_categories = data_answers(target, args.chat)
        walked += data
        categories.update(data_categories)
    report["walk"] = {}
    for rule in ("argmax", "no_repeat"):
        walk = walk_acceptance(drafter, target, walked, max_tokens=args.new_tokens, categories=categories,
                               no_repeat=rule == "no_repeat")
        report["walk"][rule] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in walk.items()
                                if k != "accept_rate_by_position"} | {
            "accept_rate_by_position": [round(x, 4) for x in walk["accept_rate_by_position"]]}
        print(f"walk, {rule}: tau {walk['tau']:.3f} over {walk['rounds']} rounds; " + ", ".join(
            f"{k[4:]} {v:.3f}" for k, v in sorted(walk.items()) if k.startswith("tau.")), flush=True)
    if not args.decode:
        lengths = {}
    for rule, by_kind in lengths.items():
        rows = {kind: [a for per_prompt in runs for a in per_prompt] for kind, runs in by_kind.items()}
        rows["all"] = [a for kind_rows in list(rows.values()) for a in kind_rows]
        report[rule] = {kind: {"tau": round(sum(r) / len(r), 3), "rounds": len(r),
                               "histogram": dict(sorted(collections.Counter(r).items()))} for kind, r in rows.items()}
        print(f"{rule}: " + ", ".join(f"{kind} tau {v['tau']} ({v['rounds']} rounds)" for kind, v in report[rule].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
