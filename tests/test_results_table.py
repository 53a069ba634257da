"""scripts/results_table.py: the README's results table is read from a run's tables, never typed in."""

import csv
import shutil
import subprocess
import sys

from qdflash.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "results_table.py"
SWEEP = REPO_ROOT / "results" / "published" / "2026-11-30-cpu-default-sweep"
H200 = REPO_ROOT / "results" / "published" / "2026-11-30-h200"
H200_FIRST = REPO_ROOT / "results" / "published" / "2026-11-30-h200-3521bb7"  # the first full run, superseded


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def test_table_of_the_published_cpu_sweep_and_its_readme_block(tmp_path):
    out = run(SWEEP, "--model", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    # none of the sweep's variants passes its gates: the fastest window-less one is shown, said so
    assert "qad_gptq_w4g32+stage2+winnone (none selected" in out.stdout and "| 1.16 | 5.1 | 0.70× | — | 0.51× |" in out.stdout
    assert "mmlu 0.220 vs 0.250 (n 100): uninformative" in out.stdout and "6.978×" in out.stdout
    assert "the target here is smollm2-135m, not Qwen3.5-4B" in out.stdout
    # losslessness summed over the sweep's three benchmark jobs (fp32: every mismatch would be a bug)
    assert "Lossless check (3 benchmark jobs, torch.float32): 0 of 76 speculative greedy outputs differ" in out.stdout
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results-table:start -->\nold\n<!-- results-table:end -->\nrest\n")
    assert run(SWEEP, "--model", "smollm2-135m", "--readme", readme).returncode == 0
    text = readme.read_text()
    assert text.startswith("intro\n<!-- results-table:start -->\nRun: ") and text.endswith("<!-- results-table:end -->\nrest\n")
    assert "old" not in text and out.stdout.strip() in text


def test_missing_model_or_block_is_a_clear_error(tmp_path):
    out = run(SWEEP)
    assert out.returncode != 0 and "names the model; pass --model" in out.stderr
    readme = tmp_path / "README.md"
    readme.write_text("no block here\n")
    out = run(SWEEP, "--model", "smollm2-135m", "--readme", readme)
    assert out.returncode != 0 and "block to replace" in out.stderr and readme.read_text() == "no block here\n"
    out = run(tmp_path / "nothing")
    assert out.returncode != 0 and "summary.csv not found" in out.stderr


def test_table_of_the_published_h200_run_counts_bf16_divergences_and_bugs():
    out = run(H200)  # the model comes from the node configs
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m on NVIDIA H200" in out.stdout
    assert "qad_gptq_w4g32+gptq_w8g64+winnone (none selected" in out.stdout and "| 1.36 | 148.7 | 7.20× | 4.79× | 0.49× | 0.43× |" in out.stdout
    assert ("38 of 81 speculative greedy outputs differ from this engine's autoregressive output, 0 of them counted as bugs; "
            "largest top-2 margin at a divergence 0.0070") in out.stdout
    out = run(H200_FIRST)  # a divergence above the margin rule is counted as a bug
    assert out.returncode == 0, out.stderr
    assert "46 of 81 speculative greedy outputs differ" in out.stdout and "1 of them counted as bugs; largest top-2 margin at a divergence 0.0108" in out.stdout


def test_a_compilation_inside_the_static_compiled_measurement_is_flagged_with_the_ratio_without_it(tmp_path):
    # both H200 runs predate the two-length warm-up: static16 compiled during their chat prompts
    out = run(H200)
    assert "took 27.7 s for 80 tokens on the chat prompts" in out.stdout and "for both methods: 0.65×." in out.stdout
    # the ratio is recomputed from the per-prompt rows: tokens / seconds of every other prompt, both methods
    rows = [r for r in csv.DictReader(open(H200 / "bench" / "speedup_winnone" / "speed.csv")) if r["prompts"] not in ("all", "chat")]
    def rate(method):
        kept = [r for r in rows if r["method"] == method]
        return sum(int(r["tokens"]) for r in kept) / sum(float(r["seconds"]) for r in kept)
    assert f"{rate('spec_qad_gptq_w8g64') / rate('static16'):.2f}×" == "0.65×"
    # without an outlier prompt there is no caveat
    copy = tmp_path / "run"
    shutil.copytree(H200 / "tables", copy / "tables")
    shutil.copytree(H200 / "bench", copy / "bench")
    speed = copy / "bench" / "speedup_winnone" / "speed.csv"
    kept = [line for line in speed.read_text().splitlines(keepends=True) if not line.startswith("chat,static16,")]
    speed.write_text("".join(kept))
    out = run(copy, "--model", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    assert "Caveat" not in out.stdout and "| 1.36 | 148.7 |" in out.stdout


def test_a_reported_uninformative_gate_says_it_is_not_required():
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = {"variant": "qad_x", "mmlu.verdict": "uninformative", "mmlu.variant": 0.25, "mmlu.reference": 0.254,
           "mmlu.n": 2000, "mmlu.counts": "0", "gsm8k.verdict": "pass", "gsm8k.variant": 0.25, "gsm8k.reference": 0.254,
           "gsm8k.n": 1319, "gsm8k.counts": "1"}
    text = module.gate_text([row], "qad_x")
    assert "mmlu 0.250 vs 0.254 (n 2000): uninformative (reported, not required)" in text
    assert "gsm8k 0.250 vs 0.254 (n 1319): pass" in text and "pass (reported" not in text


def test_the_pooled_chat_math_code_row_is_shown_and_left_out_of_sums_over_rows(tmp_path):
    """A benchmark job's pooled row (qdflash.variants.pooled_label: issue 21's targets are stated over chat + math
    + code) gives the shown variant's own sentence, and sums over per-prompt rows (the compile caveat) skip it:
    with the row added to the published H200 run, the caveat's numbers stay what they were."""
    copy = tmp_path / "run"
    shutil.copytree(H200 / "tables", copy / "tables")
    shutil.copytree(H200 / "bench", copy / "bench")
    speed = copy / "bench" / "speedup_winnone" / "speed.csv"
    rows = list(csv.DictReader(open(speed)))
    kinds = ("chat", "math", "code")

    def pooled(method):
        part = [r for r in rows if r["method"] == method and r["prompts"] in kinds]
        tokens, seconds = sum(int(r["tokens"]) for r in part), sum(float(r["seconds"]) for r in part)
        tau = tokens / sum(int(r["tokens"]) / float(r["tau"]) for r in part) if part[0]["tau"] else ""
        return {"prompts": "chat+math+code", "method": method, "tokens": tokens, "seconds": seconds, "tau": tau,
                "tokens_per_s": tokens / seconds}

    added = [pooled(m) for m in ("ar16", "ar_qad", "static16", "spec_qad_gptq_w8g64")]
    rate = {r["method"]: r["tokens_per_s"] for r in added}
    for r in added:
        r["speedup_vs_ar16"], r["speedup_vs_ar_qad"] = r["tokens_per_s"] / rate["ar16"], r["tokens_per_s"] / rate["ar_qad"]
    with open(speed, "a", newline="") as handle:
        csv.DictWriter(handle, fieldnames=list(rows[0])).writerows(added)
    out = run(copy, "--model", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    spec = added[-1]
    assert (f"On the timed held-out chat / math / code prompts alone: τ {spec['tau']:.2f}, {spec['speedup_vs_ar16']:.2f}× "
            f"autoregressive 16-bit decoding, {spec['speedup_vs_ar_qad']:.2f}× autoregressive decoding") in out.stdout
    assert "took 27.7 s for 80 tokens on the chat prompts" in out.stdout and "for both methods: 0.65×." in out.stdout
    # a run without the pooled row (every published one so far) shows no such sentence
    assert "prompts alone" not in run(H200).stdout


def test_pooled_label_names_the_kinds_a_job_measured():
    from qdflash.variants import is_pooled, pooled_label

    assert pooled_label(["chat", "math", "knowledge", "code", "p64", "filler"]) == "chat+math+code"
    assert pooled_label(["chat", "knowledge", "code"]) == "chat+code"  # a profile without math prompts
    assert pooled_label(["chat", "knowledge", "p64"]) is None and pooled_label([]) is None
    assert is_pooled("chat+code") and not is_pooled("chat") and not is_pooled("p2048(capped 2000)") and not is_pooled("c++")


def test_a_gate_decided_by_one_rule_shows_the_other_rules_verdict_where_it_differs():
    """gates.rule: point passes IFEval where the interval rule is inconclusive (the published gpu run): the
    README cell says both, and says nothing more where the two rules agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = {"variant": "qad_x", "ifeval.verdict": "pass", "ifeval.point_verdict": "pass",
           "ifeval.interval_verdict": "inconclusive", "ifeval.variant": 0.350, "ifeval.reference": 0.359, "ifeval.n": 541,
           "gsm8k.verdict": "pass", "gsm8k.point_verdict": "pass", "gsm8k.interval_verdict": "pass",
           "gsm8k.variant": 0.265, "gsm8k.reference": 0.263, "gsm8k.n": 1319}
    text = module.gate_text([row], "qad_x")
    assert "ifeval 0.350 vs 0.359 (n 541): pass (interval rule: inconclusive)" in text
    assert text.startswith("gsm8k 0.265 vs 0.263 (n 1319): pass; ifeval")  # the rules agree: nothing added
    interval_decided = {**row, "ifeval.verdict": "inconclusive"}
    assert "inconclusive (point rule: pass)" in module.gate_text([interval_decided], "qad_x")
