"""Batched generation on the engine is still exact on CUDA with its captured graphs (fp32): greedy
rows equal batch-1 autoregressive decoding, keyed sampling equals transformers' generate with
KeyedSampler at batch 1, for tiny-llama and tiny-qwen2 (refills, early stops, chunked prefill).
`--random`: seeded random llama / Qwen2 / Qwen3.5-hybrid models of a 512-token vocabulary instead
(no tokenizer: needs only torch and transformers, e.g. the core wheels). `--compile`: the decode step
compiled by torch.compile (inductor) inside the graphs.

    python scripts/bench/check_batched.py --out $OUT/check_batched.json [--random] [--compile]

Prints and writes counts; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from qdflash.data.generate import Sampling, generate_batched
from qdflash.engine import build_engine
from qdflash.engine.batched import BatchGenerator
from qdflash.models import load_target
from qdflash.spec import autoregressive_generate


def prompts(seed, n, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def random_target(family: str):
    """A seeded random model (vocabulary 512) as a target without a tokenizer."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3_5TextConfig

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
    config = {"llama": lambda: LlamaConfig(num_hidden_layers=2, **common),
              "qwen2": lambda: Qwen2Config(num_hidden_layers=2, **common),
              "qwen3_5": lambda: Qwen3_5TextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                                   linear_value_head_dim=32, linear_conv_kernel_dim=4, **common)}[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().eval()
    return SimpleNamespace(model=model, config=config, tokenizer=None, eos_token_ids=[-1], device=torch.device("cuda"), engine=None)


def cut(tokens, eos):
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


def check(name: str, n: int = 40, new: int = 24, compile: bool = False) -> dict:
    target = random_target(name) if name in ("llama", "qwen2", "qwen3_5") else load_target(name, device="cuda", dtype=torch.float32)
    batch = prompts(0, n, min(2000, target.config.vocab_size))
    greedy = [autoregressive_generate(target, p, new).tokens for p in batch]
    eos = {greedy[r][k] for r, k in ((0, 3), (5, 9), (11, 15))}
    sampling = Sampling(0.9, 0.8, 20)
    sampled = [generate_batched(target.model, [p], pad_id=0, eos_ids=[-1], max_new_tokens=new, batch_size=1,
                                sampling=sampling, seed=3, keys=[k], progress=False)[0][0].token_ids
               for k, p in enumerate(batch)]
    engine = build_engine(target, max_len=128)
    out = {}
    for label, s, ref in (("greedy", Sampling(0.0), greedy), ("sampled", sampling, sampled)):
        gen = BatchGenerator(engine, rows=16, max_len=128, eos_ids=sorted(eos), max_new_tokens=new, sampling=s, seed=3,
                             prefill_tokens=64, smallest_batch=4, smallest_len=32, compile=compile)
        results, _ = gen.generate(batch, list(range(n)), progress=False)
        out[label] = {"rows": n, "mismatches": sum(r.token_ids != cut(e, eos) for r, e in zip(results, ref)),
                      "graphs": len(gen.graphs), "early_stops": sum(r.finish_reason == "stop" for r in results)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--random", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--families", default=None, help="comma-separated subset of the models to check")
    args = parser.parse_args()
    names = ("llama", "qwen2", "qwen3_5") if args.random else ("tiny-llama", "tiny-qwen2", "tiny-qwen3.5")
    if args.families:
        names = tuple(n for n in names if n in args.families.split(","))
    result = {name: check(name, compile=args.compile) for name in names}
    result["gpu"], result["compile"] = torch.cuda.get_device_name(0), args.compile
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    bad = sum(r[k]["mismatches"] for name, r in result.items() if name not in ("gpu", "compile") for k in r)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
