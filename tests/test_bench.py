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
    margin = bench.top2_margin(tiny_llama, ids, ref[:3])
    assert fp32["divergence_margins"][0] == round(margin, 6) and margin >= 0
    # the replayed reference step (prefill + 3 decode steps) has the full forward's logits, up to fp32 rounding
    with torch.no_grad():
        full = tiny_llama.model(input_ids=torch.tensor([ids + ref[:3]])).logits[0, -1].topk(2).values
    assert abs(margin - ((full[0] - full[1]) / full[0].abs()).item()) < 1e-4
    bf16 = bench.compare(tiny_llama, cases, reference, candidate, fp32=False)
    assert bf16["mismatch_bugs"] == (1 if margin > bench.MARGIN_BUG else 0)


def test_methods_take_turns_prompt_by_prompt_in_a_rotating_order():
    calls = []

    def method(name):
        def run(ids, n):
            calls.append((name, len(ids), n))
            return GenerationResult([1] * n, seconds=0.5)
        return run

    cases = [PromptCase("a", [1, 2], 12), PromptCase("b", [1, 2, 3], 5)]
    results = bench.run_interleaved({"x": method("x"), "y": method("y")}, cases, warmup=1, touch=True)
    # warm-up: the first prompt at 8 new tokens, then at its measured length (two cache shapes)
    assert calls[:4] == [("x", 2, 8), ("x", 2, 12), ("y", 2, 8), ("y", 2, 12)]
    # the order rotates per prompt: no method always runs right after the same one; each prompt is touched
    # first, untimed, by the method whose turn comes first, so that no timed turn is a prompt's first visit
    assert calls[4:] == [("x", 2, 12), ("x", 2, 12), ("y", 2, 12), ("y", 3, 5), ("y", 3, 5), ("x", 3, 5)]
    assert [len(r.tokens) for r in results["x"].runs] == [12, 5]  # each method's runs stay in prompt order
    assert results["x"].tokens == 17 and results["x"].tokens_per_s == 17.0  # the touches are not timed
    assert results["y"].subset([False, True]).tokens == 5
    assert list(results["x"].touches) == [0] and list(results["y"].touches) == [1]
    assert len(results["y"].touches[1].tokens) == 5
    calls.clear()
    untouched = bench.run_interleaved({"x": method("x"), "y": method("y")}, cases, warmup=0)
    assert calls == [("x", 2, 12), ("y", 2, 12), ("y", 3, 5), ("x", 3, 5)] and not untouched["x"].touches


def test_timed_turns_collect_only_what_they_made():
    """What exists before the timed turns is frozen during them (the per-turn collection does not walk
    every model and tokenizer object again), and the collector is back to normal afterwards."""
    import gc

    frozen = []

    def run(ids, n):
        frozen.append(gc.get_freeze_count())
        return GenerationResult([1] * n, seconds=0.5)

    gc.unfreeze()
    bench.run_interleaved({"x": run}, [PromptCase("a", [1, 2], 12), PromptCase("b", [1], 3)], warmup=1, touch=True)
    assert frozen[:2] == [0, 0] and len(frozen) == 6  # the warm-up (at 8 and 12 new tokens) runs before the freeze
    assert all(count > 1000 for count in frozen[2:])  # the touches and timed turns: what was alive before them frozen
    assert gc.get_freeze_count() == 0


def test_long_buckets_are_capped_at_the_context(tokenizer, tmp_path):
    """Long prompts are summarization requests over held-out text (prompts and answers no drafter trained on),
    then training text only where the held-out text runs short, which each case says."""
    import json

    rows = [{"messages": [{"role": "user", "content": "word " * 300}], "response": "answer " * 300} for _ in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = [{"messages": [{"role": "user", "content": "held " * 100}], "response": "out " * 100}]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    cases = bench.bucket_cases(tmp_path, tokenizer, [[64, 16], [5000, 32]], context_len=1024, filler=True)
    assert [c.label for c in cases] == ["p64", "p5000(capped 928)", "filler"]
    assert [c.text_from for c in cases] == ["heldout", "heldout+train", ""]
    assert all(len(c.ids) + c.max_new_tokens <= 1024 for c in cases)
    assert 40 <= len(cases[0].ids) <= 90 and len(cases[1].ids) > 800
    short = tokenizer.decode(cases[0].ids)
    assert "held" in short and "word" not in short  # the held-out text first
    assert "held" in tokenizer.decode(cases[1].ids) and "word" in tokenizer.decode(cases[1].ids)


def test_filler_prompt_holds_every_token_of_the_cycle_its_answer_writes(tokenizer, tmp_path):
    """The target answers a repeated sentence from its capital, then repeats it: every token of that cycle must be
    in the prompt, or a drafter that copies from the prompt misses one each cycle (what capped the lowercase
    sentence's rounds at 7 tokens on the H200). The first token of the answer, with no space before it, is
    the one token allowed to be new."""
    (tmp_path / "heldout.jsonl").write_text('{"messages": [{"role": "user", "content": "a text"}], "response": "its summary"}\n')
    *_, case = bench.bucket_cases(tmp_path, tokenizer, [[2048, 16]], context_len=4096, filler=True)
    assert case.label == "filler"
    sentence = bench.FILLER.strip()
    answer = tokenizer(" ".join([sentence[0].upper() + sentence[1:]] * 3), add_special_tokens=False)["input_ids"]
    assert set(answer[1:]) <= set(case.ids), tokenizer.convert_ids_to_tokens(sorted(set(answer[1:]) - set(case.ids)))
    lowercase = tokenizer(sentence.lower() + " ", add_special_tokens=False)["input_ids"] * 50
    assert not set(answer[1:]) <= set(lowercase)  # the check sees the lowercase sentence's missing token


def test_weight_bytes_counts_a_shared_head_once_and_skips_an_unshared_embedding(tiny_llama):
    model = tiny_llama.model
    every = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    expected = sum(every.values()) - (0 if tied else embedding.numel() * embedding.element_size())
    assert bench.weight_bytes(model) == expected


def test_tensor_bytes_counts_own_tensors_once_without_the_excluded_module():
    layer = torch.nn.Linear(4, 4)

    class Holder:
        def __init__(self):
            self.cache = torch.zeros(10, dtype=torch.float32)          # 40 bytes
            self.states = {0: torch.zeros(3, dtype=torch.float16)}      # 6 bytes
            self.layers = [{"w": layer.weight, "packed": torch.zeros(2, dtype=torch.int32)}]  # weight excluded; 8 bytes
            self.alias = self.cache                                     # counted once

    assert bench.tensor_bytes(Holder(), exclude=layer) == 40 + 6 + 8
    assert bench.tensor_bytes(Holder()) == 40 + 6 + 8 + 64


def test_summary_reports_achieved_bandwidth_and_working_memory():
    result = MethodResult([GenerationResult([1] * 10, seconds=2.0)], peak_working_bytes=[3 * 2**20])
    row = bench.summary("ar16", result, decode_bytes=10**9, bandwidth=10e9)
    assert row["ar16.tokens_per_s"] == 5.0 and row["ar16.gb_per_s"] == 5.0 and row["ar16.of_bandwidth"] == 0.5
    assert row["ar16.peak_working_mib"] == 3.0
    assert "ar16.gb_per_s" not in bench.summary("ar16", MethodResult([GenerationResult([1], seconds=1.0)]))



def test_verify_tokens_setting_is_checked_before_anything_runs(tiny_llama):
    """bench.verify_tokens: the schema asks for null or an integer >= 2, validate_config (block_problems)
    for at most drafter.block_size; bench.spec refuses a bad value when the method is built, naming it."""
    import pytest

    from qdflash.config import block_problems, validate_section
    from qdflash.drafter import init_drafter
    from qdflash.errors import QdflashError

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1)
    with pytest.raises(QdflashError, match="verify_tokens = 5"):
        bench.spec(tiny_llama, drafter, None, 5)
    assert bench.spec(tiny_llama, drafter, None, 2)([11, 12, 13], 3).tokens == autoregressive_generate(tiny_llama, [[11, 12, 13]], 3).tokens
    tree = bench.spec(tiny_llama, drafter, None, tree_nodes=3)([11, 12, 13], 3)
    assert tree.tokens == autoregressive_generate(tiny_llama, [[11, 12, 13]], 3).tokens and set(tree.verify_lengths) == {4}
    section = {"prompts_per_category": 1, "max_new_tokens": 8, "buckets": [[64, 8]], "filler": False, "warmup": 0}
    for value in (None, 2, 16):
        validate_section({**section, "verify_tokens": value}, "bench", "bench")
    for value in (1, 2.5, "4"):
        with pytest.raises(QdflashError, match="verify_tokens"):
            validate_section({**section, "verify_tokens": value}, "bench", "bench")
    profile = {"drafter": {"block_size": 4}, "drafter_train": {"max_length": 64}}
    assert block_problems("profiles.p", {**profile, "bench": {"verify_tokens": 4}}) == []
    arms = {"scaling": {"arms": {"deep": {"loss_positions": 4}, "ok": {"loss_positions": 3}, "other": None}}}
    assert block_problems("profiles.p", {**profile, **arms}) == [
        "profiles.p.scaling.arms.deep.loss_positions = 4: a block of drafter.block_size = 4 drafts positions 1..3 "
        "(1 <= loss_positions <= 3, or null for all)"]
    assert block_problems("profiles.p", {**profile, "bench": {"verify_tokens": None}}) == []
    assert block_problems("profiles.p", {**profile, "bench": {"verify_tokens": 5}}) == [
        "profiles.p.bench.verify_tokens = 5 exceeds drafter.block_size = 4: a round verifies at most the block "
        "(2 <= verify_tokens <= 4, or null for the whole block)"]


def test_keep_methods_restricts_a_job_and_refuses_what_could_not_be_checked():
    """bench.methods: a subset, in the job's order; an unknown or empty list, or a speculative method kept
    without the autoregressive run its output is compared with, is refused, naming the setting."""
    import pytest

    from qdflash.errors import QdflashError

    methods = dict.fromkeys(["plain16", "ar16", "spec16_stage1", "ar_qad", "spec_qad_stage2", "spec_qad_gptq_w4g128"])
    assert bench.keep_methods(methods, None) == methods
    assert list(bench.keep_methods(methods, ["spec_qad_gptq_w4g128", "ar_qad"])) == ["ar_qad", "spec_qad_gptq_w4g128"]
    assert list(bench.keep_methods(methods, ["ar16", "spec16_stage1"])) == ["ar16", "spec16_stage1"]
    with pytest.raises(QdflashError, match=r"bench.methods=.*spec_qad_stage3 not run by this job; its methods are plain16"):
        bench.keep_methods(methods, ["ar_qad", "spec_qad_stage3"])
    with pytest.raises(QdflashError, match="bench.methods=.*: add ar_qad"):
        bench.keep_methods(methods, ["ar16", "spec_qad_stage2"])
    with pytest.raises(QdflashError, match="add ar16"):
        bench.keep_methods(methods, ["spec16_stage1", "ar_qad"])
    with pytest.raises(QdflashError, match="empty"):
        bench.keep_methods(methods, [])
    assert (bench.reference_of("spec16_stage1"), bench.reference_of("spec_qad_gptq_w8g128")) == ("ar16", "ar_qad")


def test_tau_pass_pools_rounds_and_tokens_per_label(tiny_llama):
    """bench.tau_pass: per label and over all cases, the rounds of greedy speculative decoding and the tokens
    they committed (the first token comes from the prefill, not a round), tau their ratio, as each
    generation's own tau."""
    from qdflash.drafter import init_drafter
    from qdflash.spec import speculative_generate

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1, seed=2)
    cases = [PromptCase("chat", [11, 12, 13, 14], 9), PromptCase("code", [21, 22, 23], 7), PromptCase("chat", [31, 32], 5)]
    out = bench.tau_pass(tiny_llama, drafter, cases, verify_tokens=3, verify_adaptive=True)
    runs = [speculative_generate(tiny_llama, drafter, [c.ids], c.max_new_tokens, verify_tokens=3, verify_adaptive=True)
            for c in cases]
    assert out["code"]["rounds"] == len(runs[1].acceptance_lengths) and out["code"]["tau"] == round(runs[1].tau, 4)
    assert out["chat"]["tokens"] == sum(runs[0].acceptance_lengths) + sum(runs[2].acceptance_lengths)
    assert out["all"]["rounds"] == sum(len(r.acceptance_lengths) for r in runs)
    assert out["all"]["tokens"] == sum(len(r.tokens) - 1 for r in runs)  # every token after the prefill's
    assert out["all"]["tau"] == round(out["all"]["tokens"] / out["all"]["rounds"], 4)


def test_a_job_knows_its_methods_before_loading_anything():
    """bench_speedup.job_methods: (a') only on a GPU with bench.compiled_baseline, (a) only with
    bench.plain_baseline, a window job only the AR baselines and the stage-2 drafters; so a bench.methods
    name this job would not run (e.g. stage 1 in a window job) is refused before any model loads."""
    import pytest
    from omegaconf import OmegaConf

    from qdflash.errors import QdflashError
    from qdflash.stages.bench_speedup import job_methods

    b = OmegaConf.create({"compiled_baseline": True, "plain_baseline": True})
    full = ["plain16", "ar16", "spec16_stage1", "ar_qad", "spec_qad_stage1", "spec_qad_stage2", "spec_qad_gptq_w4g128"]
    assert job_methods(["spec_qad_gptq_w4g128"], None, False, b) == full
    assert job_methods(["spec_qad_gptq_w4g128"], None, True, b) == [*full, "static16"]
    assert job_methods([], None, True, OmegaConf.create({"compiled_baseline": False, "plain_baseline": False})) == full[1:6]
    window = job_methods(["spec_qad_gptq_w4g128"], 1024, True, b)
    assert window == ["ar16", "ar_qad", "spec_qad_stage2", "spec_qad_gptq_w4g128"]
    with pytest.raises(QdflashError, match="spec_qad_stage1 not run by this job"):
        bench.keep_methods(dict.fromkeys(window), ["ar_qad", "spec_qad_stage1"])
