"""Figures from the tables: which points are drawn, where windows are compared, the Pareto frontier."""

import pytest

from qdflash import figures
from qdflash.errors import QdflashError


def summary_row(drafter, bits, window, tau, speedup, tps):
    return {"variant": f"qad+{drafter}+win{window or 'none'}", "target": "qad_gptq_w4g32", "target_bits": "4", "drafter": drafter,
            "drafter_bits": str(bits), "window": str(window or ""), "selected": "0", "tau_mean": str(tau), "speedup_vs_ar16": str(speedup),
            "tokens_per_s": str(tps)}


def speed_row(window, prompts, method, tau, tps, speedup=1.0):
    return {"window": str(window or ""), "prompts": prompts, "method": method, "tau": str(tau), "tokens_per_s": str(tps),
            "speedup_vs_ar16": str(speedup), "speedup_vs_ar_qad": str(speedup)}


QUALITY = [
    {"variant": "bf16", "method": "-", "bits": "16", "top1_agreement": "1.0"},
    {"variant": "ptq_rtn_w4g32", "method": "rtn", "bits": "4", "top1_agreement": "0.8", "mmlu.variant": "0.3", "mmlu.reference": "0.35", "mmlu.n": "100"},
    {"variant": "qad_gptq_w4g32", "method": "qad (from gptq)", "bits": "4", "top1_agreement": "0.9", "mmlu.variant": "0.33", "mmlu.reference": "0.35", "mmlu.n": "100"},
]
SUMMARY = [summary_row("stage2", 16, None, 1.5, 1.2, 12.0), summary_row("gptq_w4g64", 4, None, 1.4, 1.3, 13.0),
           summary_row("stage2", 16, 256, 1.3, 1.0, 9.0)]
SPEED = [speed_row(None, "all", "ar16", "", 10.0, 1.0), speed_row(None, "all", "ar_qad", "", 11.0, 1.1),
         speed_row(None, "p2048", "spec_qad_stage2", 1.5, 10.0), speed_row(None, "p64", "spec_qad_stage2", 1.5, 10.0),
         speed_row(None, "p2048", "spec_qad_stage1", 1.2, 8.0), speed_row(256, "p2048", "spec_qad_stage2", 1.3, 9.0),
         speed_row(256, "filler", "spec_qad_stage2", 1.3, 9.0)]


def test_windows_are_compared_on_the_longest_bucket_every_window_job_measured():
    assert figures.long_bucket(SPEED) == "p2048"  # p64 was not measured with a window; filler is not a bucket
    assert figures.window_figure(SPEED) is not None
    assert figures.window_figure([r for r in SPEED if r["window"] == ""]) is None  # one window: nothing to compare


def test_pareto_frontier_keeps_only_points_nobody_beats_on_both_axes():
    points = {p["name"]: p for p in figures.pareto_points(SUMMARY, SPEED, QUALITY)}
    assert set(points) == {"qad+stage2+winnone", "qad+gptq_w4g64+winnone", "ar16 (autoregressive)", "ar_qad (autoregressive)"}
    assert points["ar16 (autoregressive)"]["quality"] == 1.0 and points["ar16 (autoregressive)"]["frontier"]
    assert points["qad+gptq_w4g64+winnone"]["frontier"]                  # fastest
    assert not points["qad+stage2+winnone"]["frontier"]                  # beaten by the W4 drafter at equal quality
    assert not points["ar_qad (autoregressive)"]["frontier"]


def test_labels_of_coinciding_points_go_on_separate_lines():
    points = [{"speedup": 0.49, "quality": 0.911}, {"speedup": 0.4935, "quality": 0.911}, {"speedup": 1.0, "quality": 1.0},
              {"speedup": 0.4899, "quality": 0.911}, {"speedup": 1.14, "quality": 0.911}]
    assert figures.label_lines(points) == [0, 1, 0, 2, 0]


def test_every_figure_is_drawn_from_full_tables_and_a_missing_table_is_named(tmp_path):
    drawn = figures.draw_all({"summary": SUMMARY, "speed": SPEED, "quality": QUALITY, "training": []})
    assert set(drawn) == {"drafter_bits", "drafter_window", "target_bits", "pareto"}
    with pytest.raises(QdflashError, match="summary.csv"):
        figures.read_tables(tmp_path)


def test_the_notebook_runs_on_a_tables_folder_and_shows_every_figure(tmp_path, monkeypatch):
    import csv

    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from qdflash.paths import REPO_ROOT

    for name, rows in (("summary", SUMMARY), ("speed", SPEED), ("quality", QUALITY),
                       ("training", [{"drafter": "stage2", "kind": "stage 2", "bits": 16, "tau": 1.5}])):
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    notebook = nbformat.read(REPO_ROOT / "notebooks" / "results.ipynb", as_version=4)
    monkeypatch.setenv("QDFLASH_TABLES", str(tmp_path))
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    assert any("selected: none" in o.get("text", "") for o in outputs)  # no row of SUMMARY is marked selected
