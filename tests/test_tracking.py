import json

import pytest
from omegaconf import OmegaConf

from qdflash.errors import QdflashError
from qdflash import tracking
from qdflash.tracking import MARKER, check_metric_value, node_run


def make_cfg(out_dir, **extra):
    return OmegaConf.create(
        {"out_dir": str(out_dir), "experiment": "test", "overwrite": False,
         "tracking": {"wandb": {"mode": "offline", "project": "qdflash-tests", "entity": None}}, **extra}
    )


def test_success_writes_record_and_moves_into_place(tmp_path):
    out = tmp_path / "node"
    with node_run(make_cfg(out), "demo") as run:
        assert run.dir != out and not out.exists()  # work happens in a staging folder
        (run.dir / "result.txt").write_text("ok")
        run.log({"loss": 1.0}, step=0)
        run.metrics["answer"] = 42
        run.metrics["curve"] = [1, 2.5]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["answer"] == 42 and metrics["curve"] == [1, 2.5]
    assert metrics["env.torch"] and metrics["env.git_commit"] and metrics["env.device"]
    assert metrics["env.source_sha256"] == tracking.source_digest()
    assert metrics["wandb.mode"] == "offline"
    assert OmegaConf.load(out / "config.yaml").experiment == "test"
    assert (out / "result.txt").read_text() == "ok"
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert not list(tmp_path.glob("node.partial-*"))


def test_failure_leaves_no_output(tmp_path):
    out = tmp_path / "node"
    with pytest.raises(RuntimeError):
        with node_run(make_cfg(out), "demo") as run:
            (run.dir / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert not out.exists()  # nothing Snakemake would take as done
    assert len(list(tmp_path.glob("node.partial-*"))) == 1  # kept for debugging


def test_existing_output_is_not_overwritten_silently(tmp_path):
    out = tmp_path / "node"
    out.mkdir()
    (out / "mine.txt").write_text("user data")
    with pytest.raises(QdflashError, match="already exists"):
        with node_run(make_cfg(out), "demo"):
            pass
    with pytest.raises(QdflashError, match="not made by qdflash"):
        with node_run(make_cfg(out, overwrite=True), "demo"):
            pass
    assert (out / "mine.txt").read_text() == "user data"


def test_overwrite_replaces_a_qdflash_output(tmp_path):
    out = tmp_path / "node"
    with node_run(make_cfg(out), "demo") as run:
        run.metrics["v"] = 1
    assert (out / MARKER).exists()
    with node_run(make_cfg(out, overwrite=True), "demo") as run:
        run.metrics["v"] = 2
    assert json.loads((out / "metrics.json").read_text())["v"] == 2


@pytest.mark.parametrize("bad", [float("nan"), None, {"a": 1}, True, [1, None]])
def test_metric_values_follow_the_contract(bad):
    with pytest.raises(TypeError):
        check_metric_value("k", bad)


def test_source_digest_names_the_code_by_content(tmp_path):
    """The digest changes with any file's content or name, not with where the tree lies or its mtimes."""
    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "sub").mkdir(parents=True)
        (root / "x.py").write_text("x = 1\n")
        (root / "sub" / "y.py").write_text("y = 2\n")
        (root / "notes.txt").write_text("not code")
    first = tracking.source_digest(tmp_path / "a")
    assert first == tracking.source_digest(tmp_path / "b") and len(first) == 16
    (tmp_path / "b" / "notes.txt").write_text("other")  # not a Python source: same digest
    assert tracking.source_digest.__wrapped__(tmp_path / "b") == first
    (tmp_path / "b" / "sub" / "y.py").write_text("y = 3\n")
    assert tracking.source_digest.__wrapped__(tmp_path / "b") != first
    (tmp_path / "a" / "sub" / "y.py").rename(tmp_path / "a" / "sub" / "z.py")
    assert tracking.source_digest.__wrapped__(tmp_path / "a") != first


def test_two_nodes_with_one_out_dir_do_not_undo_each_other(tmp_path):
    """A second node given the same out_dir (both run by hand) stops at once: it neither deletes the
    first one's staging folder as a stale one nor replaces its output."""
    out = tmp_path / "node"
    with node_run(make_cfg(out), "first") as first:
        (first.dir / "mine.txt").write_text("first")
        with pytest.raises(QdflashError, match="being written by another qdflash node"):
            with node_run(make_cfg(out, overwrite=True), "second") as second:
                (second.dir / "mine.txt").write_text("second")
        assert (first.dir / "mine.txt").read_text() == "first"
    assert (out / "mine.txt").read_text() == "first" and json.loads((out / MARKER).read_text())["node"] == "first"
    assert not list(tmp_path.glob("node.partial-*")) and not (tmp_path / "node.lock").exists()
    with node_run(make_cfg(out, overwrite=True), "third"):  # the lock is released with the node
        pass


def test_staging_folders_of_one_out_dir_are_unique(tmp_path):
    from qdflash.tracking import _staging_dir

    assert _staging_dir(tmp_path / "node") != _staging_dir(tmp_path / "node")


def test_a_user_folder_given_as_hydra_run_dir_is_left_alone(tmp_path):
    import subprocess
    import sys

    mine = tmp_path / "my-folder"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    for run_dir, message in ((mine, "already exists"), (elsewhere, "the staging folder must be")):
        done = subprocess.run([sys.executable, "-m", "qdflash.stages.figures", f"tables={tmp_path / 'tables'}",
                               f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={run_dir}", "tracking.wandb.mode=disabled"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists() and mine.exists()
