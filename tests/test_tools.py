"""The nodes' command lines name what is missing (issue 18); the artifacts in other tools are
checked on the ci DAG's outputs in test_pipeline.py (transformers, lm_eval, vLLM's config fields)."""

import subprocess
import sys

import pytest

# every node goes through the same entry point (qdflash.stages._app.stage): three of them, of different groups
NODES = ["quantize_target", "train_drafter", "report"]


@pytest.mark.parametrize("node", NODES)
def test_a_node_without_out_dir_names_the_missing_key(node, tmp_path):
    out = subprocess.run([sys.executable, "-m", f"qdflash.stages.{node}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "out_dir=<folder> is required" in out.stderr and "Traceback" not in out.stderr
    assert "Hydra's exception formatting" not in out.stderr
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("profile", ["default", "ci", "gpu", "qwen3.5-4b"])
def test_snakemake_lint_is_clean_for_every_profile(profile, tmp_path):
    """Every rule has a log:, declares its environment, passes what its shell command reads as params;
    rule files hold rules, common.smk the functions (the README's `--lint` runs the default profile)."""
    from qdflash.paths import REPO_ROOT

    out = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory", str(tmp_path),
                          "--lint", "--config", f"profile={profile}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Congratulations, your workflow is in a good condition" in out.stdout + out.stderr, out.stdout[-3000:]
