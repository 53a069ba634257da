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
