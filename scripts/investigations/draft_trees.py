"""Would verifying a tree of drafts, instead of one chain, raise tau at the same verify size? On the CPU.

The served drafter fills its block in one pass, so at each block position it has a whole distribution, of which
decoding proposes only the argmax (a chain). When the first draft is wrong the round ends at once, and that is
the most common round (P(draft 1 accepted) ~0.63: results/published/2026-12-04-cpu-draft-repeats). A tree spends
some of the verify's tokens on second choices instead: the target checks every node in one forward (each node
sees the cache and its own ancestors) and keeps the longest path that is its own greedy continuation, so the
output stays exactly greedy decoding's. Because one block pass gives each position's choices independently of
the tokens before it, a path's probability is taken as the product of its tokens' probabilities, and a tree of
N nodes is the N most probable paths (`drafter.blocks.draft_tree`).

This walks decoding's own rounds over greedy answers (as `drafter.train.walk_acceptance` does: the first round at
the answer's first token, each next one where the last stopped) for chains and trees of the same node counts,
so that tau is compared at equal verify tokens (nodes + the anchor). `--references`: the greedy answers written
by scripts/investigations/draft_repeats.py (their prompts: that script's, `--per-kind` of each kind); `--chat`: a
data stage's held-out answers (the first turn). On greedy answers the walk is what decoding would accept: the
argmax chain of 8 reproduces `walk_acceptance`'s tau (checked here), and `--decode N` decodes the first N prompts of
each kind with trees (`speculative_generate(tree_nodes=...)`) and counts the prompts whose rounds are the walk's.

    python scripts/investigations/draft_trees.py --drafter /tmp/dgreedy --references /tmp/dr/references.json \
        --per-kind 12 --chat /tmp/chat-heldout.jsonl --out results/published/<study>/trees.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_repeats import data_answers, load_checked, prompts  # noqa: E402  (the same prompts, in the same order, as the references)

from qdflash.data.chat import render_prompt_ids  # noqa: E402
from qdflash.drafter.blocks import (TREE_TOP_K, acceptance_lengths, distinct_drafts, linear_top,  # noqa: E402
                                    tree_acceptance)
from qdflash.drafter.train import (draft_blocks, first_answer, padded_batch, target_pass, walk_acceptance,  # noqa: E402
                                   walk_rounds)
from qdflash.spec import speculative_generate  # noqa: E402


def block_choices(drafter, target, ex: dict, anchors: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At each anchor: the drafter's `top_k` tokens and log-probabilities at block positions 1..B-1 ([A, B-1, k]
    each), and the target's greedy tokens there ([A, B-1])."""
    input_ids, loss_masks, padded, valid = padded_batch([ex], [anchors])
    device = next(drafter.parameters()).device
    with torch.no_grad():
        features, greedy = target_pass(target, input_ids.to(device), drafter.config.target_layer_ids)
        hidden, _ = draft_blocks(drafter, features, input_ids, loss_masks, padded, valid, head=False)
        ids, logp = linear_top(hidden[0, : anchors.numel(), 1:], drafter.head_weight(), top_k)
    offsets = torch.arange(drafter.block_size - 1)
    return ids.cpu(), logp.cpu(), greedy[0].cpu()[anchors[:, None] + offsets[None, :]]


def walk_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a walk over draft_repeats.py's greedy answers (this script's and tree_scores.py's)."""
    ap.add_argument("--drafter", type=Path, required=True, help="a drafter folder (config.json + model.safetensors)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--references", type=Path, required=True, help="draft_repeats.py's --references json (greedy answers)")
    ap.add_argument("--per-kind", type=int, default=12, help="the --per-kind the references were written with")
    ap.add_argument("--chat", type=Path, default=None, help="a data stage's heldout jsonl (its first turns are walked too)")
    ap.add_argument("--new-tokens", type=int, default=128, help="walk the first N tokens of each answer")
    ap.add_argument("--top-k", type=int, default=TREE_TOP_K, help="choices per block position a tree may take")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, required=True)


def check_references(args, script: str) -> None:
    if not args.references.is_file():
        raise SystemExit(f"{script}: --references {args.references}: no such file (write it with draft_repeats.py --references)")


def walked_examples(args, target, script: str) -> tuple[list[dict], dict[str, str]]:
    """The greedy answers of `--references` to draft_repeats.py's prompts (`--per-kind` of each kind, first
    `--new-tokens` tokens), then `--chat`'s held-out first turns, as examples, and each one's kind."""
    known = json.loads(args.references.read_text())
    examples, categories = [], {}
    for i, (kind, text) in enumerate(prompts(args.chat, args.per_kind), 1):
        ids = render_prompt_ids(target.tokenizer, text)
        key = f"{args.new_tokens}:{ids}"
        if key not in known:
            raise SystemExit(f"{script}: --references {args.references} has no {args.new_tokens}-token answer to {kind} "
                             f"prompt {i}: write it with draft_repeats.py --per-kind {args.per_kind} --new-tokens {args.new_tokens}")
        examples.append({"id": f"{kind}-{i}", "input_ids": ids + known[key],
                         "loss_mask": [0] * len(ids) + [1] * len(known[key])})
        categories[f"{kind}-{i}"] = kind
    if args.chat is not None:
        data, data_categories = data_answers(target, args.chat)
        examples += data
        categories.update(data_categories)
    return examples, categories


def walk_anchors(ex: dict, block: int, new_tokens: int) -> torch.Tensor | None:
    """walk_acceptance's anchors in an example's answer (a whole block inside it, its first `new_tokens`), or None."""
    run = first_answer(torch.tensor(ex["loss_mask"]))
    if run is None:
        return None
    start, end = run
    last = min(end - block, start + new_tokens - 1)
    return torch.arange(start, last + 1) if last >= start else None


def acceptance(kind: str, n: int, ids: torch.Tensor, logp: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Each anchor's acceptance length [A] under a chain of the first n block positions (argmax, or `distinct_drafts`)
    or a tree of n nodes (`tree_acceptance`, with or without its no-repeat rule)."""
    if kind.startswith("chain"):
        drafts = ids[:, :n, 0]
        if kind == "chain-norepeat":
            drafts = torch.tensor([distinct_drafts(top2) for top2 in ids[:, :n, :2].tolist()], dtype=torch.long)
        return acceptance_lengths(drafts, greedy[:, :n])
    return tree_acceptance(ids, logp, greedy, n, skip_repeats=kind == "tree-norepeat")


def policies(budgets: list[int], block: int) -> list[tuple[str, int, str]]:
    out = [(f"chain{n}", n, "chain") for n in budgets if n <= block - 1]
    out += [(f"chain{n}-norepeat", n, "chain-norepeat") for n in budgets if n <= block - 1]
    out += [(f"tree{n}", n, "tree") for n in budgets] + [(f"tree{n}-norepeat", n, "tree-norepeat") for n in budgets]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    walk_arguments(ap)
    ap.add_argument("--budgets", default="3,5,8,12,16,24", help="node counts (verify tokens = nodes + the anchor)")
    ap.add_argument("--decode", type=int, default=0, help="also decode the first N prompts of each kind with trees "
                    "(speculative_generate(tree_nodes=...)): their rounds must be the walk's")
    ap.add_argument("--decode-budgets", default="5,15", help="the tree sizes decoded (with and without no-repeat)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="walk_acceptance again over the same answers: its tau must be the argmax chain's of a whole block")
    args = ap.parse_args()
    check_references(args, "draft_trees")
    target, drafter = load_checked(args, "draft_trees")
    drafter.eval()
    examples, categories = walked_examples(args, target, "draft_trees")
    budgets = [int(b) for b in args.budgets.split(",")]
    block = drafter.block_size
    rules = policies(budgets, block)
    rounds = {name: collections.defaultdict(list) for name, _, _ in rules}
    per_example = {name: {} for name, _, _ in rules}  # each example's walked rounds
    started = time.perf_counter()
    for e, ex in enumerate(examples, 1):
        anchors = walk_anchors(ex, block, args.new_tokens)
        if anchors is None:
            continue
        ids, logp, greedy = block_choices(drafter, target, ex, anchors, args.top_k)
        for name, n, kind in rules:
            path = walk_rounds(acceptance(kind, n, ids, logp, greedy).tolist())
            rounds[name][categories[ex["id"]]] += path
            per_example[name][ex["id"]] = path
        print(f"[{e}/{len(examples)}] {ex['id']}: {len(ids)} anchors; " + ", ".join(
            f"{name} {sum(rounds[name][categories[ex['id']]]) / len(rounds[name][categories[ex['id']]]):.2f}"
            for name in ("chain5", "tree5", "chain8", "tree15") if name in rounds)
            + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    report = {"model": args.model, "drafter": str(args.drafter), "dtype": args.dtype, "device": str(target.device),
              "new_tokens": args.new_tokens, "top_k": args.top_k, "block_size": block, "examples": len(examples),
              "policies": {}}
    for name, n, kind in rules:
        by_kind = {cat: torch.tensor(v, dtype=torch.float) for cat, v in sorted(rounds[name].items())}
        every = torch.cat(list(by_kind.values()))
        report["policies"][name] = {
            "nodes": n, "verify_tokens": n + 1, "kind": kind, "tau": round(every.mean().item(), 4),
            "rounds": int(every.numel()), **{f"tau.{cat}": round(v.mean().item(), 4) for cat, v in by_kind.items()}}
        print(f"{name:>18}: verify {n + 1:2d} tokens, tau {every.mean().item():.3f} over {every.numel()} rounds; "
              + ", ".join(f"{cat} {v.mean().item():.3f}" for cat, v in by_kind.items()), flush=True)
    # the argmax chain of a whole block is exactly walk_acceptance's walk: the check that this walk is decoding's
    mine = report["policies"].get(f"chain{block - 1}", {}).get("tau")
    if args.check and mine is not None:
        check = walk_acceptance(drafter, target, examples, max_tokens=args.new_tokens)
        report["walk_acceptance_tau"] = round(check["tau"], 4)
        print(f"walk_acceptance: tau {check['tau']:.4f} (chain{block - 1} here: {mine})", flush=True)
        if abs(mine - check["tau"]) > 1e-3:
            raise SystemExit(f"draft_trees: the chain{block - 1} walk ({mine}) is not walk_acceptance's ({check['tau']:.4f})")
    if args.decode:  # decoding's own rounds: the walk's, up to its last anchor (a whole block inside the answer)
        report["decoded"] = {}
        chosen = [ex for kind in ("math", "code", "chat")
                  for ex in [e for e in examples if categories[e["id"]] == kind][: args.decode]]
        for n in (int(b) for b in args.decode_budgets.split(",")):
            for name, no_repeat in ((f"tree{n}", False), (f"tree{n}-norepeat", True)):
                same, decoded_rounds, differ = 0, [], 0
                for ex in chosen:
                    prompt = ex["input_ids"][: ex["loss_mask"].index(1)]
                    out = speculative_generate(target, drafter, [prompt], args.new_tokens, tree_nodes=n, no_repeat=no_repeat)
                    differ += out.tokens != ex["input_ids"][len(prompt):]
                    walked = per_example.get(name, {}).get(ex["id"], [])
                    same += out.acceptance_lengths[: len(walked)] == walked
                    decoded_rounds += out.acceptance_lengths
                tau = sum(decoded_rounds) / len(decoded_rounds)
                report["decoded"][name] = {"prompts": len(chosen), "tau": round(tau, 4), "rounds": len(decoded_rounds),
                                           "prompts_whose_rounds_are_the_walks": same, "outputs_differing_from_greedy": differ}
                print(f"decoded {name}: tau {tau:.3f} over {len(decoded_rounds)} rounds of {len(chosen)} prompts; "
                      f"{same} of them walked the same rounds; {differ} outputs differ from greedy", flush=True)
                if args.dtype == "float32" and differ:
                    raise SystemExit(f"draft_trees: {differ} tree-decoded outputs differ from greedy decoding (fp32)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
