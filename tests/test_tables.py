import json

from qdflash.tables import scaling_rows


def test_scaling_table_reads_finished_runs_only(tmp_path):
    def run(name, examples, layers, tau):
        folder = tmp_path / "drafter" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({
            "train.examples": examples, "train.tokens": 10 * examples, "drafter.layers": layers, "drafter.parameters": 5,
            "train.steps": examples // 4, "train.batch_size": 4, "train.seconds": 1.5, "final.tau": tau,
            "final.tau.chat": tau, "final.accept_rate_by_position": [0.1, 0.01], "final.blocks": 9,
        }))

    run("n8-L2", 8, 2, 1.3)
    run("n4-L1", 4, 1, 1.1)
    run("n8-L1", 8, 1, 1.2)
    (tmp_path / "drafter" / "n16-L1.partial-20261130-075937-113060").mkdir()  # a run cut off: no metrics
    rows = scaling_rows(tmp_path)
    assert [(r["layers"], r["examples"]) for r in rows] == [(1, 4), (1, 8), (2, 8)]
    assert rows[0]["epochs"] == 1 and rows[0]["tau_chat"] == 1.1 and rows[0]["accept_pos1"] == 0.1
