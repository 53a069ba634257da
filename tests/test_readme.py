"""Every command of the README's command blocks is checked as written (issue 18): run exactly where it
fits CI's time on a CPU, otherwise as a dry run (`-n`) of exactly that command, and the rest said why.
A command added to the README without a line here fails `test_every_readme_command_is_checked`.
The ci DAG, its `--report`, the targets table and the `lm_eval` command run in test_pipeline.py
(after the one ci DAG run CI can afford)."""

import re

import pytest

from qdflash.paths import REPO_ROOT
from readme import clone_like_copy, readme_commands, run_as_written

pytestmark = pytest.mark.slow

# run as written, in a copy of the tree as a clone has it
RUN = [
    "python3 -m snakemake -n",
    "python3 -m snakemake --lint",
    "python3 -m qdflash.stages.prepare_data out_dir=results/by-hand/data model=tiny-llama data.generation.max_new_tokens=8",
    "python3 -m snakemake --profile workflow/profiles/slurm --config profile=qwen3.5-4b -n -p",
]
# the whole DAG of these profiles takes 45 min on a CPU or needs a GPU: the same command with -n
DRY = {
    "python3 -m snakemake --cores all": "python3 -m snakemake --cores all -n",
    "python3 -m snakemake --cores all --config profile=gpu experiment=my-run":
        "python3 -m snakemake --cores all --config profile=gpu experiment=my-run -n",
    # install.sh is what CI runs first (.ci/run); then the command's DAG
    "bash scripts/install.sh && python3 -m snakemake --cores all": "python3 -m snakemake --cores all -n",
    # placeholders a user fills in
    "python3 -m snakemake --profile workflow/profiles/slurm --config profile=qwen3.5-4b --default-resources "
    "slurm_account=<account> slurm_partition=<partition>":
        "python3 -m snakemake --profile workflow/profiles/slurm --config profile=qwen3.5-4b --default-resources "
        "slurm_account=acct slurm_partition=gpu -n",
}
# run exactly by test_pipeline.py::test_ci_profile_end_to_end, on the DAG's outputs
AFTER_CI_DAG = [
    "python3 -m snakemake --cores all --config profile=ci",
    "python3 -m snakemake --report report.html --config profile=ci",
    "python3 -m qdflash.tables target results/ci",
    "lm_eval --model hf --model_args pretrained=results/ci/target/ptq_gptq_w4g32/model,dtype=float32 --device cpu "
    "--include_path results/ci/gates/ptq_gptq_w4g32/tasks --tasks qdflash_mmlu --limit 8 --log_samples "
    "--output_path results/ci/lm_eval",
]
# CI itself
CI = ["bash scripts/install.sh --test && python3 -m pytest"]
# installs packages into the user's environment: CI installs the same plugin through the [test] extra
INSTALLS = ['pip install -e ".[cluster]"']


def test_every_readme_command_is_checked():
    listed = RUN + list(DRY) + AFTER_CI_DAG + CI + INSTALLS
    assert sorted(readme_commands()) == sorted(listed), "a README command changed: check it here"
    assert CI[0] in (REPO_ROOT / ".ci" / "run").read_text()  # CI runs the README's test command
    assert "snakemake-executor-plugin-slurm" in re.search(r"^test = \[.*\]", (REPO_ROOT / "pyproject.toml").read_text(), re.M).group(0)


def test_the_block_parser_joins_continuations_and_drops_comments():
    text = "Intro:\n\n    cmd one --a \\\n        --b    # why\n    cmd two\n\n```\n    not a command\n```\n"
    assert readme_commands(text) == ["cmd one --a --b", "cmd two"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return clone_like_copy(tmp_path_factory.mktemp("readme") / "qdflash")


COMMANDS = RUN + sorted(set(DRY.values()))


@pytest.fixture(scope="module")
def runs(clone):
    """Every command run as written, two at a time in the one clone (the by-hand data node beside the
    Snakemake dry runs and lint, which only read the tree); each test checks its own command's run."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        yield {command: pool.submit(run_as_written, command, clone) for command in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(runs, clone, command):
    out = runs[command].result()
    assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-3000:])
    if "--lint" in command:
        assert "Congratulations, your workflow is in a good condition" in out.stdout + out.stderr
    if "prepare_data" in command:
        assert (clone / "results" / "by-hand" / "data" / "metrics.json").is_file()
