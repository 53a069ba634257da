"""scripts/bench/study_drafter.py, the script behind the published drafter studies, runs every step at toy
sizes on the CPU (`--rehearse`): data, probe, train, and the benchmark of a drafter given by its folder,
with two verify lengths and the adaptive verify; in fp32 the speculative output is the autoregressive one."""

import json
import os
import subprocess
import sys

from qdflash.paths import REPO_ROOT


def study(root, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)  # the script copies its results to $OUT when it is set
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench" / "study_drafter.py"), args[0], str(root),
                          *args[1:], "--rehearse"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]


def test_study_steps_and_a_bench_of_any_drafter_folder(tmp_path):
    root = tmp_path / "study"
    study(root, "data")
    study(root, "probe")
    study(root, "train", "s1", "--epochs", "1")
    # the drafter and data by their folders, as for a scaling run's (here the study's own, under another name)
    study(root, "bench", "other", "--drafter", str(root / "s1" / "drafter"), "--data", str(root / "data"),
          "--dtype", "float32", "--per-category", "1", "--max-new-tokens", "8", "--long", "64",
          "--verify-tokens", "2,4,block", "--verify-adaptive")  # 4 is the whole block: one method for both
    result = json.loads((root / "study.json").read_text())
    assert {"data", "probe", "train.s1"} <= set(result)
    # the study's recipe is its own, not the gpu profile's later one (block 4 here: loss_positions 8 would not fit)
    assert result["train.s1"]["train.loss_positions"] == 3
    bench = result["bench.other.float32.v2a.v4a.sdpa.p1x8.long64"]
    assert bench["drafter"] == str(root / "s1" / "drafter") and bench["verify_adaptive"] and bench["attention"] == "sdpa"
    methods = ["spec16.v2a", "spec16.v4a"]  # verify 2 (+ the whole block after a long accept), and the whole block
    for label in ("all", "chat+math+code", "filler"):
        for name in methods:
            run = bench[label][name]
            assert run["mismatches"] == 0 and run["tokens"] > 0, (label, name, run)
            assert 1.0 <= run["tau"] <= bench["block_size"]
            assert sum(run["tau_histogram"]) > 0
    for name in methods:
        parts = bench["chat+math+code"][name]["round"]
        assert parts["rounds"] > 0 and parts["ms"] > 0 and parts["decode_step_ms"] > 0
        assert abs(parts["ms"] - sum(parts[f"{p}_ms"] for p in ("draft", "verify", "append", "host"))) < 1e-3
    assert bench["drafter_dtype"] == "float32" and bench["compile_drafter"] is False  # as saved, eager
    # --served: the drafter as the gpu profile's benchmark runs it, in the target's dtype (its compile is GPU-only)
    study(root, "bench", "other", "--drafter", str(root / "s1" / "drafter"), "--data", str(root / "data"),
          "--dtype", "bfloat16", "--per-category", "1", "--max-new-tokens", "8", "--long", "64", "--served")
    served = json.loads((root / "study.json").read_text())["bench.other.bfloat16.v4.sdpa.served.p1x8.long64"]
    assert served["drafter_dtype"] == "bfloat16" and served["compile_drafter"] is False
    assert served["all"]["spec16.v4"]["tokens"] > 0 and served["all"]["spec16.v4"]["mismatch_bugs"] == 0
    # --tree-nodes beside the chain, both with --no-repeat: a tree of 3 drafts a round, lossless in fp32
    study(root, "bench", "other", "--drafter", str(root / "s1" / "drafter"), "--data", str(root / "data"),
          "--dtype", "float32", "--per-category", "1", "--max-new-tokens", "8", "--long", "64", "--tree-nodes", "3", "--no-repeat")
    trees = json.loads((root / "study.json").read_text())["bench.other.float32.v4nr.tree3nr.sdpa.p1x8.long64"]
    assert trees["tree_nodes"] == [3] and trees["no_repeat"]
    for name in ("spec16.v4nr", "spec16.tree3nr"):
        run = trees["chat+math+code"][name]
        assert run["mismatches"] == 0 and run["tokens"] > 0 and 1.0 <= run["tau"] <= 4 and run["round"]["rounds"] > 0


def test_tree_node_counts_parse_or_name_the_bad_value():
    """study_drafter.py bench --tree-nodes: node counts 1..62, and a clear argparse error for anything else."""
    import argparse

    import pytest

    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import study_drafter

    assert study_drafter.node_counts("8,15") == [8, 15] and study_drafter.node_counts("15,") == [15]
    for bad in ("", "0", "63", "a", "8,x", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="node counts 1..62"):
            study_drafter.node_counts(bad)
