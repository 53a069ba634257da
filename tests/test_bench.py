import torch

from qdflash import bench
from qdflash.bench import MethodResult, PromptCase
from qdflash.spec import GenerationResult, autoregressive_generate


def test_compare_counts_mismatches_and_calls_fp32_ones_bugs(tiny_llama):
    ids = torch.randint(10, 900, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = autoregressive_generate(tiny_llama, [ids], 6).tokens
    cases = [PromptCase("chat", ids, 6), PromptCase("math", ids, 6)]
    reference = MethodResult([GenerationResult(ref), GenerationResult(ref)])
    wrong = ref[:3] + [ref[3] + 1] + ref[4:]
    candidate = MethodResult([GenerationResult(ref), GenerationResult(wrong)])
    fp32 = bench.compare(tiny_llama, cases, reference, candidate, fp32=True)
    assert fp32["mismatches"] == 1 and fp32["mismatch_bugs"] == 1 and len(fp32["divergence_margins"]) == 1
    margin = bench.top2_margin(tiny_llama, ids + ref[:3])
    assert fp32["divergence_margins"][0] == round(margin, 6) and margin >= 0
    bf16 = bench.compare(tiny_llama, cases, reference, candidate, fp32=False)
    assert bf16["mismatch_bugs"] == (1 if margin > bench.MARGIN_BUG else 0)


def test_methods_take_turns_prompt_by_prompt():
    calls = []

    def method(name):
        def run(ids, n):
            calls.append((name, len(ids), n))
            return GenerationResult([1] * n, seconds=0.5)
        return run

    cases = [PromptCase("a", [1, 2], 4), PromptCase("b", [1, 2, 3], 5)]
    results = bench.run_interleaved({"x": method("x"), "y": method("y")}, cases, warmup=1)
    assert calls[:2] == [("x", 2, 4), ("y", 2, 4)]  # warm-up, shortened to <= 8 new tokens
    assert calls[2:] == [("x", 2, 4), ("y", 2, 4), ("x", 3, 5), ("y", 3, 5)]
    assert results["x"].tokens == 9 and results["x"].tokens_per_s == 9.0
    assert results["y"].subset([False, True]).tokens == 5


def test_long_buckets_are_capped_at_the_context(tokenizer, tmp_path):
    import json

    rows = [{"messages": [{"role": "user", "content": "word " * 300}], "response": "answer " * 300} for _ in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = bench.bucket_cases(tmp_path, tokenizer, [[64, 16], [5000, 32]], context_len=1024, filler=True)
    assert [c.label for c in cases] == ["p64", "p5000(capped 928)", "filler"]
    assert all(len(c.ids) + c.max_new_tokens <= 1024 for c in cases)
    assert 40 <= len(cases[0].ids) <= 90 and len(cases[1].ids) > 800
