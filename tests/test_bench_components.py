"""scripts/gpu/bench_components.py runs its whole code path on the CPU (tiny shape): the numbers
mean nothing here, but every part is measured and the captured-step check holds."""

import json
import subprocess
import sys

from qdflash.paths import REPO_ROOT


def test_component_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "components.json"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu" / "bench_components.py"), "--shape", "tiny",
                          "--reps", "1", "--context", "32", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    for label in ("target16", "target_w4"):
        assert r[f"{label}.decode_ms"] > 0 and r[f"{label}.verify_ms"] > 0 and r[f"{label}.bound_ms"] > 0
        assert r[f"{label}.graph_vs_eager_max_abs"] == 0.0
    assert r["drafter16.step_ms"] > 0 and r["drafter_w4.step_ms"] > 0
    assert r["target_w4.quantized_layers"] > 0 and ("w4a16_rel_err@1" in r or r["w4a16_check"].startswith("no packed"))
    assert {k for k in r if k.startswith("implied_speedup.tau6.5")}


def test_round_bench_runs_on_the_cpu(tmp_path):
    """scripts/gpu/bench_round.py (a speculative round's parts, eager vs static drafter) on a 2-layer
    SmolLM2-shaped target: every part timed, and the static drafter drafts the eager one's tokens."""
    out = tmp_path / "round.json"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu" / "bench_round.py"), "--layers", "2",
                          "--context", "40", "--block", "4", "--reps", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["drafts_equal"] and r["rounds_equal"] == [True] * 5
    for part in ("target_decode_ms", "target_verify_ms", "draft_eager_ms", "draft_static_ms", "append2_eager_ms",
                 "append2_static_ms"):
        assert r[part] > 0, part
    assert r["round_static_in_decode_steps"] > 0
    assert r["loop_ar_ms_per_token"] > 0 and r["loop_static_ms_per_round"] > 0
    assert r["loop_static_tau"] >= 1.0 and r["loop_eager_tau"] == r["loop_static_tau"]  # same drafts, same acceptance
    assert r["loop_eager_same_tokens_as_ar"] and r["loop_static_same_tokens_as_ar"]  # fp32 on the CPU: exact
