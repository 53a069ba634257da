"""scripts/results_table.py: the README's results table is read from a run's tables, never typed in."""

import subprocess
import sys

from qdflash.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "results_table.py"
SWEEP = REPO_ROOT / "results" / "published" / "2026-11-30-cpu-default-sweep"
H200 = REPO_ROOT / "results" / "published" / "2026-11-30-h200"


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
    assert "qad_gptq_w4g32+gptq_w8g64+winnone (none selected" in out.stdout and "| 1.32 | 153.4 | 11.74× | 2.73× | 0.57× | 0.48× |" in out.stdout
    assert ("46 of 81 speculative greedy outputs differ from this engine's autoregressive output, 1 of them counted as bugs; "
            "largest top-2 margin at a divergence 0.0108") in out.stdout
