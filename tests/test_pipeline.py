"""End-to-end: the DAG built so far, on the `ci` profile, through Snakemake."""

import json
import subprocess
import sys
import time

import pytest
import yaml

from qdflash.data.sources import load_source
from qdflash.data.split import content_key
from qdflash.paths import REPO_ROOT

pytestmark = pytest.mark.slow
CONFIG = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())


def snakemake(workdir, *args):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory", str(workdir), "--cores", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def read(path):
    return [json.loads(line) for line in open(path)]


def test_dry_run_lists_the_dag(tmp_path):
    out = snakemake(tmp_path, "-n")
    assert out.returncode == 0, out.stderr
    assert "prepare_data" in out.stdout and "results/default/data/bf16" in out.stdout


def test_ci_profile_end_to_end(tmp_path):
    start = time.time()
    out = snakemake(tmp_path, "--config", "profile=ci", "experiment=e2e")
    elapsed = time.time() - start
    assert out.returncode == 0, out.stderr[-3000:]
    assert elapsed < 180, f"ci DAG took {elapsed:.0f} s (budget 3 min)"

    data = tmp_path / "results" / "e2e" / "data" / "bf16"
    for name in ("metrics.json", "config.yaml", "train.jsonl", "heldout.jsonl", "train.tokens.jsonl", "heldout.tokens.jsonl", "prepare_data.log"):
        assert (data / name).is_file(), name
    assert list((data / "wandb").glob("offline-run-*/*.wandb"))
    assert not list(data.parent.glob("bf16.partial-*"))

    metrics = json.loads((data / "metrics.json").read_text())
    sources = CONFIG["profiles"]["ci"]["data"]["sources"]
    # optional sources (GSM8K) are skipped, and recorded, where they resolve nowhere
    loaded = {n: s for n, s in sources.items() if metrics[f"source.{n}.status"] == "loaded"}
    assert {n for n, s in sources.items() if not s["optional"]} <= set(loaded)
    train, heldout = read(data / "train.jsonl"), read(data / "heldout.jsonl")
    assert len(train) == metrics["train.prompts"] == sum(s["n_train"] for s in loaded.values())
    assert len(heldout) == metrics["heldout.prompts"] == sum(s["n_heldout"] for s in loaded.values())
    assert {r["decoding"] for r in train} == {"sampled"} and {r["decoding"] for r in heldout} == {"greedy"}
    assert {r["category"] for r in heldout} == {"chat", "knowledge", "code"} | ({"math"} if "gsm8k" in loaded else set())
    assert "code" not in {r["category"] for r in train}

    # the rule: no evaluation item (GSM8K test, MMLU gate items, HumanEval) among training prompts
    eval_keys = set()
    for name in ("mmlu", "humaneval", *(["gsm8k"] if "gsm8k" in loaded else [])):
        eval_keys |= {content_key(i.prompt) for i in load_source(name).eval_items}
    assert not {content_key(r["messages"][0]["content"]) for r in train} & eval_keys

    for split, rows in (("train", train), ("heldout", heldout)):
        tokens = {r["id"]: r for r in read(data / f"{split}.tokens.jsonl")}
        for row in rows:
            t = tokens[row["id"]]
            assert len(t["input_ids"]) == len(t["loss_mask"]) == row["n_prompt_tokens"] + row["n_response_tokens"]
            assert sum(t["loss_mask"]) == row["n_response_tokens"]
            assert t["loss_mask"][: row["n_prompt_tokens"]] == [0] * row["n_prompt_tokens"]

    cfg = yaml.safe_load((data / "config.yaml").read_text())
    assert cfg["data"] == CONFIG["profiles"]["ci"]["data"] and cfg["model"]["name"] == "tiny-qwen3.5"

    again = snakemake(tmp_path, "--config", "profile=ci", "experiment=e2e")  # nothing to redo
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


def test_failed_node_leaves_no_output(tmp_path):
    config = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())
    config["profiles"]["ci"]["data"]["sources"]["gsm8k"]["path"] = str(tmp_path / "no-such-gsm8k")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    out = snakemake(tmp_path, "--configfile", str(tmp_path / "bad.yaml"), "--config", "profile=ci")
    assert out.returncode != 0
    assert "data source gsm8k: the path given in the config" in out.stderr + out.stdout
    assert not (tmp_path / "results" / "ci" / "data" / "bf16").exists()
