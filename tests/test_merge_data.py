import json

import pytest

from qdflash.errors import QdflashError
from qdflash.stages.merge_data import check_shards, interleave


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_interleave_undoes_the_sharding(count):
    rows = [{"i": i} for i in range(17)]
    assert interleave([rows[k::count] for k in range(count)]) == rows


def test_shards_out_of_order_or_missing_are_refused(tmp_path):
    folders = []
    for i in range(3):
        folder = tmp_path / f"s{i}"
        folder.mkdir()
        (folder / "metrics.json").write_text(json.dumps({"shard.index": i, "shard.count": 3, "model.name": "m"}))
        folders.append(folder)
    check_shards(folders)
    with pytest.raises(QdflashError, match="s1 is shard 1 of 3, expected shard 0 of 3"):
        check_shards([folders[1], folders[0], folders[2]])
    with pytest.raises(QdflashError, match="expected shard 0 of 2"):
        check_shards([folders[0], folders[2]][::-1])
    with pytest.raises(QdflashError, match="not a prepare_data output"):
        check_shards([tmp_path])


def test_a_shard_without_its_files_names_the_file(tmp_path):
    from qdflash.data.jsonl import read_jsonl

    with pytest.raises(QdflashError, match=r"train\.jsonl not found"):
        list(read_jsonl(tmp_path / "train.jsonl"))


@pytest.mark.slow
def test_sharded_generation_writes_what_one_job_writes(tmp_path):
    """The ci profile's data stage as one job, and as 2 shards joined by merge_data: the same rows
    (prompts, sampled training responses, greedy held-out responses, tokens), in the same order."""
    import os
    import subprocess
    import sys

    from qdflash.config import load_config, node_overrides

    config = load_config()
    config["profile"] = "ci"

    def start(module, out, sections, extra=None):
        args = node_overrides(config, module, out, sections, extra) + ["tracking.wandb.mode=disabled"]
        # one thread each: the three data nodes are independent and run side by side on 2 cores
        with open(tmp_path / f"{out.name}.log", "w") as log:  # a file, not a pipe: no process waits on a full pipe
            return out, subprocess.Popen([sys.executable, "-m", f"qdflash.stages.{module}", *args], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait(started):
        out, process = started
        process.wait(timeout=600)
        assert process.returncode == 0, (tmp_path / f"{out.name}.log").read_text()[-3000:]
        return out

    started = [start("prepare_data", tmp_path / "whole", ["data"])]
    started += [start("prepare_data", tmp_path / f"shard-{i}", ["data"], {"shard.index": i, "shard.count": 2}) for i in range(2)]
    whole, *shards = [wait(s) for s in started]
    merged = wait(start("merge_data", tmp_path / "merged", [], {"shards": [str(s) for s in shards]}))
    for name in ("train.jsonl", "heldout.jsonl", "train.tokens.jsonl", "heldout.tokens.jsonl"):
        one = [json.loads(line) for line in open(whole / name)]
        two = [json.loads(line) for line in open(merged / name)]
        assert len(one) == len(two) > 0 and one == two, name
