"""The GPU fast path is still lossless: on CUDA, with the Triton kernels and captured CUDA graphs,
speculative decoding emits exactly the autoregressive tokens of transformers' own forward (fp32).

    python scripts/bench/check_engine.py --out $OUT/check_engine.json

For tiny-llama and tiny-qwen3.5 (hybrid: the Gated DeltaNet kernel keeps per-position states and a
rollback copies one back): prompts x block sizes x a drafter that is right 70% of the time (rollbacks
into the middle of blocks). Also a W4 (g32) model run through the W4A16 kernel against transformers'
forward of the same quantized model. Prints and writes counts; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

import torch

import qdflash.spec as spec
from qdflash.drafter import init_drafter
from qdflash.engine import build_engine
from qdflash.models import load_target


def check_family(name: str, blocks=(4, 16), prompts=3, new_tokens=48) -> dict:
    target = load_target(name, device="cuda", dtype=torch.float32)
    out = {"runs": 0, "mismatches": 0, "graphs": 0}
    for block in blocks:
        drafter = init_drafter(target, block_size=block, seed=block)
        engine = build_engine(target, max_len=512)
        engine.capture([1, block], drafter.config.target_layer_ids)
        engine.capture([1], None)
        out["graphs"] += len(engine.graphs)
        fast = dataclasses.replace(target, engine=engine)
        for seed in range(prompts):
            prompt = torch.randint(10, 2000, (1, 10 + 7 * seed), generator=torch.Generator().manual_seed(seed))
            reference = spec.autoregressive_generate(target, prompt, new_tokens).tokens  # transformers' forward
            rng = random.Random(seed)

            def draft(self, last, position, reference=reference, n=prompt.shape[1], block=block):
                want = [reference[p - n] if 0 <= p - n < len(reference) else 7 for p in range(position + 1, position + block)]
                return torch.tensor([t + 1 if rng.random() < 0.3 else t for t in want], device="cuda")

            original = spec.DrafterSession.draft
            spec.DrafterSession.draft = draft
            try:
                got = spec.speculative_generate(fast, drafter, prompt, new_tokens)
            finally:
                spec.DrafterSession.draft = original
            ar = spec.autoregressive_generate(fast, prompt, new_tokens).tokens
            out["runs"] += 1
            out["mismatches"] += int(got.tokens != reference) + int(ar != reference)
            out.setdefault("tau", []).append(round(got.tau, 3))
    return out


def check_w4() -> dict:
    sys.path.insert(0, "tests")
    from test_engine import small_model  # the same 128-wide model the CPU test uses

    from qdflash.quant.apply import quantize_weights, replace_linears, select_linears
    from qdflash.quant.grid import GridSpec

    out = {}
    for family in ("llama", "qwen3_5"):
        model = small_model(family)
        replace_linears(model, quantize_weights(model, select_linears(model), GridSpec(4, 32, True), method="rtn"))
        model = model.cuda()
        from types import SimpleNamespace

        engine = build_engine(SimpleNamespace(model=model, config=model.config), max_len=64)
        x = torch.randint(0, 512, (24,), device="cuda")
        ref = model(input_ids=x[None]).logits[0]
        a, _ = engine.forward(x[:20], 0)
        b, _ = engine.forward(x[20:24], 20)
        out[family] = {"max_abs_diff": float((torch.cat([a, b]) - ref).abs().max()), "kernel": engine.layers[0]["w13"].fast}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {name: check_family(name) for name in ("tiny-llama", "tiny-qwen3.5")}
    result["w4"] = check_w4()
    result["gpu"] = torch.cuda.get_device_name(0)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    bad = sum(r["mismatches"] for k, r in result.items() if k.startswith("tiny"))
    bad += sum(r["max_abs_diff"] > 1e-3 for r in result["w4"].values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
