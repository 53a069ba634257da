import json

import pytest

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


def test_published_studies_side_by_side(tmp_path):
    """Published studies (a table.csv each) in one table: runs named by their study, counts as numbers,
    and the figure of tau-hat against passes draws them all."""
    from qdflash.figures import scaling_figure
    from qdflash.tables import SCALING_COLUMNS, main, studies_rows, write_csv

    def study(name, runs):
        folder = tmp_path / "published" / name
        folder.mkdir(parents=True)
        rows = [dict.fromkeys(SCALING_COLUMNS, "") | {"run": run, "examples": n, "layers": 2, "tau": taus[-1],
                                                      "tau_by_epoch": " ".join(map(str, taus)), "seconds_by_epoch": "5 9"}
                for run, n, taus in runs]
        write_csv(rows, SCALING_COLUMNS, folder / "table.csv")
        return folder

    long = study("2026-12-03-h200-drafter-long", [("n8000-L2", 8000, [1.4, 1.6])])
    more = study("2026-12-03-h200-drafter-12k", [("n8000-L2", 8000, [1.5, 1.8]), ("n12000-L2", 12000, [1.7, 2.1])])
    rows = studies_rows([long, more])
    assert [r["run"] for r in rows] == ["drafter-long/n8000-L2", "drafter-12k/n8000-L2", "drafter-12k/n12000-L2"]
    assert rows[2]["examples"] == 12000 and rows[2]["layers"] == 2
    assert len(scaling_figure(rows).axes[0].lines) == 3
    main(["scaling", str(long), str(more), "--png", str(tmp_path / "all.png"), "--md", str(tmp_path / "all.md")])
    assert (tmp_path / "all.png").stat().st_size > 0 and "drafter-12k/n12000-L2" in (tmp_path / "all.md").read_text()
    with pytest.raises(SystemExit, match="no finished scaling runs"):
        studies_rows([long, tmp_path / "published"])  # the studies' parent, not a study
    (long / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not a drafter scaling table"):
        studies_rows([long, more])


def test_node_times_from_a_snakemake_log(tmp_path, capsys):
    """`python -m qdflash.tables nodes <snakemake.log>`: each job's rule, output, start and wall time, and
    whether it finished, failed, or was still running when the log ends (a run cut by its time limit)."""
    from qdflash.tables import main, node_rows

    log = tmp_path / "snakemake.log"
    log.write_text("""Building DAG of jobs...
[Thu Dec  3 07:08:42 2026]
localrule prepare_data:
    output: /root/q/results/h200-x/data/bf16
    log: /root/q/results/h200-x/logs/prepare_data.log
    jobid: 1
    threads: 4
[Thu Dec  3 07:12:17 2026]
Finished jobid: 1 (Rule: prepare_data)
[Thu Dec  3 07:12:18 2026]
rule drafter_stage1:
    output: results/h200-x/drafter/stage1
    jobid: 5
[Thu Dec  3 07:12:20 2026]
localrule bench_speedup:
    output: /root/q/results/h200-x/bench/speedup_winnone
    jobid: 14
    wildcards: window=none
[Thu Dec  3 07:20:00 2026]
Error in rule bench_speedup:
    message: None
    jobid: 14
    output: /root/q/results/h200-x/bench/speedup_winnone
[Thu Dec  3 07:21:40 2026]
Select jobs to execute...
""")
    rows = node_rows(log)
    assert [(r["rule"], r["output"], r["start_s"], r["status"]) for r in rows] == [
        ("prepare_data", "data/bf16", 0, "done"), ("drafter_stage1", "drafter/stage1", 216, "not finished"),
        ("bench_speedup", "bench/speedup_winnone", 218, "failed")]
    assert [r["took_s"] for r in rows] == [215, 778 - 216, 678 - 218]  # done / until the log ends / until it failed
    main(["nodes", str(log)])
    assert "| drafter_stage1 | drafter/stage1 | 216 | 562 | not finished |" in capsys.readouterr().out
