"""Selection of the fastest variant that passes every gate, and the variant names the tables use."""

import pytest

from qdflash.errors import QdflashError
from qdflash.report import drafter_bits, read_metrics, select_fastest


def row(name, tokens_per_s, passes=1, bugs=0, window=""):
    return {"variant": name, "tokens_per_s": tokens_per_s, "passes_gates": passes, "mismatch_bugs": bugs,
            "window": window, "selected": 0}


def test_the_fastest_passing_variant_without_bugs_is_selected():
    rows = [row("a", 10.0), row("b", 30.0, passes=0), row("c", 20.0), row("d", 25.0, bugs=1)]
    best = select_fastest(rows)
    assert best["variant"] == "c" and [r["selected"] for r in rows] == [0, 0, 1, 0]


def test_no_selection_when_nothing_passes():
    rows = [row("a", 10.0, passes=0), row("b", 5.0, bugs=2)]
    assert select_fastest(rows) is None and all(r["selected"] == 0 for r in rows)


def test_window_rows_measured_on_long_prompts_only_do_not_outrank_full_rows():
    rows = [row("full", 10.0), row("win256", 50.0, window=256)]
    assert select_fastest(rows)["variant"] == "full"
    assert select_fastest([row("win256", 50.0, window=256)])["variant"] == "win256"


def test_window_rows_measured_on_the_same_prompts_compete_with_full_rows():
    """bench.window_prompts: all: a window job that measured the window-less job's very prompts (the same
    prompt_set) competes; one that measured another set still does not."""
    same = dict(row("win256", 50.0, window=256), prompt_set="abc")
    other = dict(row("win1024", 60.0, window=1024), prompt_set="long-only")
    rows = [dict(row("full", 10.0), prompt_set="abc"), same, other]
    assert select_fastest(rows)["variant"] == "win256"
    assert [r["selected"] for r in rows] == [0, 1, 0]


def test_jobs_compare_by_the_speedup_measured_in_their_own_process():
    """A window job that ran on a slower machine moment has lower tokens/s but the higher speedup over
    the same baseline measured beside it: the ratio decides, not the raw rate across processes."""
    rows = [dict(row("full", 400.0), prompt_set="abc", speedup_vs_ar16=1.05),
            dict(row("win256", 380.0, window=256), prompt_set="abc", speedup_vs_ar16=1.30)]
    assert select_fastest(rows)["variant"] == "win256"


def test_drafter_names_and_bits():
    assert drafter_bits("spec_qad_stage2") == ("stage2", 16)
    assert drafter_bits("spec_qad_gptq_w4g64") == ("gptq_w4g64", 4)
    assert drafter_bits("spec_qad_rtn_w8g32") == ("rtn_w8g32", 8)


def test_a_folder_without_metrics_is_named(tmp_path):
    with pytest.raises(QdflashError, match="metrics.json not found"):
        read_metrics(tmp_path / "bench" / "speedup_winnone")
