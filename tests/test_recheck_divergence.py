"""scripts/investigations/recheck_divergence.py: the first H200 whole-DAG benchmark's bf16 divergences, re-measured in fp32."""

import json
import subprocess
import sys

from qdflash.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "investigations" / "recheck_divergence.py"
RUN = REPO_ROOT / "results" / "published" / "2026-11-30-h200-3521bb7"  # the run with the divergence counted as a bug


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600)


def test_the_one_bf16_divergence_above_the_bug_margin_is_an_fp32_near_tie():
    out = run(RUN / "bench" / "speedup_winnone", "--data", RUN / "data" / "bf16", "--methods", "spec16_stage1",
              "--prompts", "p2048", "math")
    assert out.returncode == 0, out.stderr
    found = {d["prompt"]: d for d in json.loads(out.stdout)["divergences"]}
    # the prompt is rebuilt token for token (the script checks its length against the node's record), and the
    # diverging tokens are the fp32 top two, 0.47% apart; bf16 measured 1.08% on the H200 (metrics.json)
    p2048 = found["p2048"]
    assert p2048["position"] == 48 and (p2048["reference_token"], p2048["method_token"]) == (1466, 2240)
    assert p2048["tokens_are_top2"] and 0.004 < p2048["relative_top2_margin"] < 0.005
    # categories whose first held-out prompts lie beyond the 50 rows brought back are said to be missing
    assert "not rebuildable" in found["math"]["note"]


def test_data_that_is_not_the_nodes_is_a_clear_error(tmp_path):
    for split in ("train", "heldout"):
        lines = (RUN / "data" / "bf16" / f"{split}.head50.jsonl").read_text().splitlines()
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines[5:]) + "\n")  # other rows first
    out = run(RUN / "bench" / "speedup_winnone", "--data", tmp_path)
    assert out.returncode != 0 and "is not the data the node read" in out.stderr
