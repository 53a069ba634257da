"""The README's command blocks, read as a user reads them (tests run them as written: test_readme.py,
and the ci DAG, its report and the lm_eval check in test_pipeline.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from qdflash.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
# what a clone holds that a user's commands may read; results, caches and git state stay behind
COPY_IGNORE = shutil.ignore_patterns(".git", "results", ".snakemake", "__pycache__", "*.egg-info", ".pytest_cache",
                                     ".gpu-stage*", ".whl", "wandb", "outputs", "multirun")


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the README's indented (4-space) blocks outside ``` fences: continuation lines
    (ending in a backslash) joined, trailing comments (two spaces, then #) dropped."""
    commands, pending, blank, fenced, in_block = [], "", True, False, False
    for line in (README.read_text() if text is None else text).splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("    ") and (blank or in_block or pending):
            body = line.strip()
            in_block = True
            if pending:
                body = pending + " " + body
                pending = ""
            if body.endswith("\\"):
                pending = body[:-1].rstrip()
                continue
            body = re.split(r"\s{2,}#", body)[0].rstrip()
            if body:
                commands.append(body)
        else:
            in_block = False
        blank = not line.strip()
    return commands


def readme_command(pattern: str) -> str:
    """The one README command matching `pattern` (a regex), so a test runs what the README says."""
    found = [c for c in readme_commands() if re.search(pattern, c)]
    assert len(found) == 1, f"README: expected one command matching {pattern!r}, found {found}"
    return found[0]


def clone_like_copy(dst: Path) -> Path:
    """The working tree as a fresh clone has it (no results, no caches), where commands may write."""
    shutil.copytree(REPO_ROOT, dst, ignore=COPY_IGNORE)
    return dst


def run_as_written(command: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a README command through bash in `cwd`, with this interpreter's `python3` / `python` /
    `lm_eval` first on PATH (the environment the README's set-up makes)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
