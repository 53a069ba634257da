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
