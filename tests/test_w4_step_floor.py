"""scripts/investigations/w4_step_floor.py: what a published component run says the W4 step's int4 matmuls would need."""

import json
import subprocess
import sys

import pytest

from qdflash.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "investigations" / "w4_step_floor.py"
RUN = REPO_ROOT / "results" / "published" / "2026-12-05-h200-gdn-warps" / "components.json"


def test_the_floor_counts_the_calls_the_profile_saw_and_adds_up():
    out = subprocess.run([sys.executable, str(SCRIPT), str(RUN)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    # the calls derived from the model's config are the int4 kernel launches the run's profile counted in a W4-head step
    # (inductor's kernels named after a fused Marlin op are not int4 matmuls: bench_components.kernel_group)
    profile = json.loads(RUN.read_text())["target_w4_head.decode_kernels"]["kernels"]
    int4 = [k for k in profile if not k["kernel"].startswith("triton_") and any(
        name in k["kernel"].lower() for name in ("marlin", "tinygemm", "machete"))]
    assert sum(r["calls_per_step"].values()) == sum(k["calls"] for k in int4)
    assert r["target_w4_head.int4_device_ms"] == pytest.approx(sum(k["us"] for k in int4) / 1e3, abs=1e-3)
    # the step splits into its int4 kernels and the rest; what 1.8x needs is the target less that rest
    assert r["target_w4_head.int4_device_ms"] + r["target_w4_head.rest_ms"] == pytest.approx(
        r["target_w4_head.decode_compiled_ms"], abs=2e-3)
    assert r["int4_ms_needed"] == pytest.approx(r["target_ms"] - r["target_w4_head.rest_ms"], abs=2e-3)
    # the fastest kernel per shape is no slower than the ones the fits describe, and cuBLAS reads 4x the bytes
    assert r["matmul_ms.best_int4"] < r["matmul_ms.dense"]
    for reference in ("dense", "gemv16"):
        assert r["speedup_with.best_int4"] < r[f"speedup_with.int4_as_good_as.{reference}"] < r[
            f"speedup_with.int4_as_good_as.{reference}_and_no_rest"]
    # our 16-bit GEMV beat cuBLAS at one row in that run: an int4 kernel as good as it is the faster one
    assert r["matmul_ms.int4_as_good_as.gemv16"] < r["matmul_ms.int4_as_good_as.dense"]


def test_a_run_without_the_w4_head_is_refused_by_name(tmp_path):
    run = json.loads(RUN.read_text())
    del run["w4a16_head.tuned"]
    bad = tmp_path / "components.json"
    bad.write_text(json.dumps(run))
    out = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "w4a16_head.tuned" in out.stderr and str(bad) in out.stderr
