"""The latency harness (qdflash.bench_latency) at toy sizes: both servers start as subprocesses, answer
through the openai client, and are stopped; the report has a row per server x prompt kind x category
with its statistics and the stack's speedup. Speeds are never asserted (CI machines vary)."""

import csv
import json

from qdflash.bench_latency import COLUMNS, main, percentile
from qdflash.drafter import init_drafter, save_drafter


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == 4.6
    assert percentile([7.0], 0.9) == 7.0


def test_harness_report_structure(tiny_llama, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"Tell me about rivers, part {i}."}],
             "response": "Rivers carry water from the hills to the sea, shaping valleys on the way. " * 3} for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_drafter(init_drafter(tiny_llama, block_size=4, num_layers=1, mask_token_id=3), tmp_path / "drafter")
    out = tmp_path / "latency"
    main(["--target", "tiny-llama", "--drafter", str(tmp_path / "drafter"), "--baseline-target", "tiny-llama",
          "--data-dir", str(data), "--out", str(out), "--categories", "24:4", "--requests", "2", "--warmup", "1",
          "--device", "cpu", "--verify-tokens", "3", "--verify-adaptive"])
    report = json.loads((out / "latency.json").read_text())
    with (out / "latency.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == COLUMNS and len(table) == len(report["rows"]) == 2 * 2
    keys = {(r["server"], r["kind"], r["category"]) for r in report["rows"]}
    assert keys == {(s, k, c) for s in ("stack", "baseline") for k in ("real", "filler") for c in ("p24",)}
    for r in report["rows"]:
        assert r["requests"] == 2 and 0 < r["median_s"] <= r["p90_s"] and r["tokens_per_s"] > 0
        assert r["completion_tokens"] == r["max_new_tokens"] and r["prompt_tokens"] > 0  # ignore_eos: exactly N
        if r["server"] == "stack":
            assert r["tau_mean"] >= 1 and r["speedup"] > 0
        else:
            assert r["tau_mean"] == "" and r["speedup"] == ""
    assert "--mode" in report["baseline_server"] and "hf" in report["baseline_server"] and report["ignore_eos"] is True
    assert report["env.device"] and report["env.torch"] and "env.git_commit" in report  # where the numbers come from
    # the rounds the variant was benchmarked with reach the stack server (its log says what it serves)
    stack = report["stack_server"]
    assert stack[stack.index("--verify-tokens") + 1] == "3" and "--verify-adaptive" in stack
    assert "verify 3" in (out / "server-stack.log").read_text()
    assert (out / "server-stack.log").is_file() and (out / "server-baseline.log").is_file()
