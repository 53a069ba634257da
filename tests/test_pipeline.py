"""End-to-end: the DAG built so far, on the `ci` profile, through Snakemake."""

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

from qdflash.config import load_config
from qdflash.data.sources import COPY_TEMPLATES, load_source
from qdflash.data.split import content_key
from qdflash.paths import REPO_ROOT
from readme import clone_like_copy, readme_command, run_as_written

pytestmark = pytest.mark.slow
CONFIG = load_config()  # profiles merged over the base, as the rules read them


def snakemake(workdir, *args):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO_ROOT / "Snakefile"), "--directory", str(workdir), "--cores", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def read(path):
    return [json.loads(line) for line in open(path)]


def test_dry_run_lists_the_dag(tmp_path):
    out = snakemake(tmp_path, "-n")
    assert out.returncode == 0, out.stderr
    assert "prepare_data" in out.stdout and "results/default/data/bf16" in out.stdout
    for job in ("quantize_target", "qad", "ptq_rtn_w4g32", "ptq_gptq_w3g32", "qad_gptq_w3g32", "regenerate_data",
                "drafter_stage1", "drafter_stage2", "bench_speedup"):
        assert job in out.stdout


def test_gpu_rehearsal_overlay_gives_the_gpu_dag_on_the_cpu(tmp_path):
    """config/gpu-rehearsal.yaml still validates over the gpu profile: the same 18 jobs, on the CPU,
    at toy sizes (a run of it is the check before device time is spent; docs/airgap.md)."""
    out = snakemake(tmp_path, "-n", "-p", "--configfile", str(REPO_ROOT / "config" / "gpu-rehearsal.yaml"),
                    "--config", "profile=gpu", "experiment=rehearsal")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device=cpu" in out.stdout and "device=cuda" not in out.stdout and "gates.batch_size=4" in out.stdout
    assert "bench.attention=sdpa" in out.stdout and "bench.attention=kernel" not in out.stdout  # the kernel needs a GPU
    assert out.stdout.count("rule bench_speedup:") == 2 and out.stdout.count("rule quality_gate:") == 3


@pytest.mark.parametrize("overlay, runs, epochs, flags", [
    ("gpu-drafter-arms.yaml", {"n4000-L2", "n4000-L2-soft", "n4000-L2-lr1e3", "n4000-L2-lr2e3", "n4000-L2-lr3e4"}, 4,
     ["drafter_train.labels=soft", "drafter_train.lr=0.002"]),
    ("gpu-drafter-schedule.yaml", {"n4000-L2", *(f"n4000-L2-{a}" for a in ("floor50", "const", "b8", "a32", "p8"))}, 4,
     ["drafter_train.min_lr_ratio=1.0", "drafter_train.batch_size=8", "drafter_train.anchors_per_seq=32",
      "drafter_train.loss_positions=8", "drafter_train.min_lr_ratio=0.0"]),
    ("gpu-drafter-long.yaml", {"n8000-L2", "n8000-L2-p8"}, 6,
     ["drafter_train.min_lr_ratio=1.0", "drafter_train.cache_features=memory", "drafter_train.loss_positions=8"]),
    ("gpu-drafter-depth.yaml", {"n4000-L1", "n4000-L2", "n4000-L4"}, 4, ["drafter_train.min_lr_ratio=1.0", "drafter.num_layers=4"]),
    ("gpu-drafter-12k.yaml", {"n12000-L2"}, 6,
     ["drafter_train.min_lr_ratio=1.0", "drafter_train.cache_features=device", "drafter_train.loss_positions=8",
      "data.sources.sharegpt.n_train=6300"]),
    ("gpu-drafter-copy.yaml", {"n12000-L2", "n12000-L2-p8"}, 6,
     ["drafter_train.min_lr_ratio=1.0", "drafter_train.cache_features=device", "drafter_train.loss_positions=null",
      "drafter_train.loss_positions=8", "data.sources.copy.n_train=1000", "drafter_train.max_examples=12000"]),
])
def test_drafter_arms_overlays_replace_the_profiles_arms(tmp_path, overlay, runs, epochs, flags):
    """The recipe-arm overlays over the gpu profile: their runs (arms beside the plain run), the profile's
    own arm dropped by its null, the overlay's epochs and each arm's flags."""
    out = snakemake(tmp_path, "-n", "-p", "drafter_scaling", "--configfile", str(REPO_ROOT / "config" / overlay),
                    "--config", "profile=gpu", "experiment=arms")
    assert out.returncode == 0, out.stderr[-3000:]
    found = set(re.findall(r"scaling/drafter/(n\d+-L\d+[-\w]*)", out.stdout))
    assert found == runs, found
    assert all(flag in out.stdout for flag in flags), flags
    assert f"drafter_train.epochs={epochs}" in out.stdout and "target_labels" not in out.stdout


def test_copy_overlay_adds_copy_prompts_to_the_gpu_data(tmp_path):
    """config/gpu-copy.yaml validates over the gpu profile and puts the copy source into every data node
    (appended: the data node's defaults do not list it); and a source added this way reaches a real data
    node (here the ci profile's, with a few copy prompts)."""
    out = snakemake(tmp_path, "-n", "-p", "--configfile", str(REPO_ROOT / "config" / "gpu-copy.yaml"),
                    "--config", "profile=gpu", "experiment=copy")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "+data.sources.copy.n_train=1000" in out.stdout and "+data.sources.copy.n_heldout=0" in out.stdout
    (tmp_path / "copy.yaml").write_text(yaml.safe_dump(
        {"profiles": {"ci": {"data": {"sources": {"copy": {"n_train": 3, "n_heldout": 1, "optional": False, "path": None}}}}}}))
    out = snakemake(tmp_path, "results/cc/data/bf16", "--configfile", str(tmp_path / "copy.yaml"), "--config", "profile=ci",
                    "experiment=cc")
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "results" / "cc" / "data" / "bf16" / "metrics.json").read_text())
    assert metrics["train.category.copy"] == 3 and metrics["heldout.category.copy"] == 1
    copies = [r for r in read(tmp_path / "results" / "cc" / "data" / "bf16" / "train.jsonl") if r["category"] == "copy"]
    assert all(any(r["messages"][0]["content"].startswith(t.split("{text}")[0]) for t in COPY_TEMPLATES) for r in copies)


def test_repeat_overlay_adds_repeat_prompts_to_the_gpu_data(tmp_path):
    """config/gpu-repeat.yaml validates over the gpu profile and puts the repeat source into every data node
    (stage 1's answers and stage 2's fresh prompts)."""
    out = snakemake(tmp_path, "-n", "-p", "--configfile", str(REPO_ROOT / "config" / "gpu-repeat.yaml"),
                    "--config", "profile=gpu", "experiment=repeat")
    assert out.returncode == 0, out.stderr[-3000:]
    data_nodes = [line for line in out.stdout.splitlines() if "qdflash.stages.prepare_data" in line]
    assert len(data_nodes) == 2  # prepare_data and regenerate_data (stage 2's fresh prompts)
    assert all("+data.sources.repeat.n_train=500" in line and "+data.sources.repeat.n_heldout=0" in line for line in data_nodes)


def test_ci_profile_end_to_end(tmp_path):
    """The README's ci command, as written (plus one core per node), in a tree like a fresh clone; then every check of its
    outputs, and the README's commands that read them (report, targets table, lm_eval)."""
    # (its wall time is a budget of the profile, measured and reported, not asserted: a loaded
    # machine must not fail the test)
    clone = clone_like_copy(tmp_path / "qdflash")
    command = readme_command(r"snakemake --cores all --config profile=ci$")
    # as written, plus one core per node: the ci profile gives every node all cores (one node at a time),
    # yet its tiny nodes use about one (a measured run of this DAG on 2 cores: 232 s wall for 243 s of
    # CPU); with one each, independent nodes run side by side (123 s). The same nodes and outputs; the
    # second run below, exactly as written, finds nothing to redo.
    out = run_as_written(f"{command} --set-threads {one_core_per_node(clone)}", clone, timeout=2700)  # a hang guard, not a speed check
    assert out.returncode == 0, out.stderr[-3000:]
    results = clone / "results" / "ci"

    data = results / "data" / "bf16"
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
            # a multi-turn sequence (data.max_turns) also holds the later user turns between its answers
            turns = row.get("turns", 1)
            assert len(t["input_ids"]) == len(t["loss_mask"]) == row.get("n_tokens", len(t["input_ids"]))
            assert len(t["input_ids"]) == row["n_prompt_tokens"] + row["n_response_tokens"] if turns == 1 else \
                len(t["input_ids"]) > row["n_prompt_tokens"] + row["n_response_tokens"]
            assert sum(t["loss_mask"]) == row["n_response_tokens"]
            assert t["loss_mask"][: row["n_prompt_tokens"]] == [0] * row["n_prompt_tokens"]
            assert len(row["messages"]) == 2 * turns
    # the ci profile answers ShareGPT follow-ups: some conversations went to a second turn
    assert metrics["train.max_turns"] == 2 and any(r.get("turns") == 2 for r in train)
    assert metrics["train.answers"] == sum(r["turns"] for r in train)

    cfg = yaml.safe_load((data / "config.yaml").read_text())
    assert cfg["data"] == CONFIG["profiles"]["ci"]["data"] and cfg["model"]["name"] == "tiny-qwen3.5"

    again = run_as_written(command, clone)  # nothing to redo
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    # the README's commands that read the outputs (lm_eval, the report, the targets table) run one after
    # another in a second thread while this one checks the outputs: they only read them and write files of
    # their own (results/ci/lm_eval, report.html), and 2 cores run both
    readers = [readme_command(r"^lm_eval "), readme_command(r"--report report.html --config profile=ci"),
               readme_command(r"qdflash.tables target results/ci")]
    with ThreadPoolExecutor(1) as pool:
        runs = [pool.submit(run_as_written, c, clone, timeout=900) for c in readers]
        check_logs(results)
        check_target_stage(results, data)
        check_drafter_stage(results)
        check_bench(results)
        check_gates(results)
        check_report(results)
        check_figures_and_notebook(results, tmp_path)
        check_exports_in_transformers_and_for_vllm(results)
        lm_eval, report, table = [r.result() for r in runs]
    check_lm_eval_command_line(results, clone, lm_eval)
    assert report.returncode == 0, report.stderr[-2000:]
    html = (clone / "report.html").read_text(errors="replace")
    assert "summary.csv" in html and "pareto.png" in html
    assert table.returncode == 0 and "qad_gptq_w4g32" in table.stdout, table.stderr[-2000:]


def one_core_per_node(clone):
    """`rule=1` for every rule that asks rule_threads() for its cores (unknown to this DAG: ignored)."""
    import re

    rules = sorted({name for smk in (clone / "workflow" / "rules").glob("*.smk")
                    for name in re.findall(r'rule_threads\("(\w+)"\)', smk.read_text())})
    assert "prepare_data" in rules and "bench_speedup" in rules
    return " ".join(f"{rule}=1" for rule in rules)


def check_logs(results):
    """Every rule's `log:` holds its node's output (outside the node's folder, so it survives a failure)."""
    logs = sorted(p.relative_to(results / "logs").as_posix() for p in (results / "logs").rglob("*.log"))
    assert "prepare_data.log" in logs and "quantize_target/ptq_gptq_w4g32.log" in logs and "report.log" in logs
    assert "quality_gate/ptq_gptq_w4g32.log" in logs and "bench_speedup/winnone.log" in logs
    assert "prepare_data: done in" in (results / "logs" / "prepare_data.log").read_text()


def check_exports_in_transformers_and_for_vllm(results):
    """Every exported target loads through transformers' own compressed-tensors path with the logits of
    load_target, and its config.json has what a vLLM loader reads (architectures, the format, bits it
    takes or the not-servable marker)."""
    from transformers import AutoModelForCausalLM

    from qdflash.models import load_target

    ids = torch.tensor([[1, 5, 42, 7, 99, 3, 250, 11]])
    exports = sorted(p / "model" for p in (results / "target").iterdir() if (p / "model" / "config.json").is_file())
    assert len(exports) >= 3
    for folder in exports:
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] and config["quantization_config"]["format"] == "pack-quantized", folder
        bits = config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"]
        assert config["qdflash"]["vllm_servable"] is (bits in (4, 8)), folder
        assert "qdflash" not in config["qdflash"]
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ours = load_target(str(folder), dtype=torch.float32, device="cpu")
        with torch.no_grad():
            torch.testing.assert_close(hf(input_ids=ids).logits, ours.model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def check_lm_eval_command_line(results, clone, out):
    """lm-eval's own command line (`--model hf`) on a gate folder's tasks, as the README writes it (`out`:
    its run): the node's per-item scores, and the log-likelihoods of this project's lm-eval model on the
    same requests."""
    from qdflash.evaluation.lm import QdflashLM
    from qdflash.models import load_target

    assert out.returncode == 0, out.stderr[-3000:]
    (samples,) = (clone / "results" / "ci" / "lm_eval").rglob("samples_qdflash_mmlu_*.jsonl")
    docs = sorted(read(samples), key=lambda s: s["doc_id"])
    saved = json.loads((results / "gates" / "ptq_gptq_w4g32" / "scores.json").read_text())["mmlu"]["scores"]
    assert [d["doc_id"] for d in docs] == list(range(len(saved)))  # --limit covers every gate item
    assert [d["acc"] for d in docs] == saved
    lm = QdflashLM(load_target(str(results / "target" / "ptq_gptq_w4g32" / "model"), dtype=torch.float32, device="cpu"))

    class Request:
        def __init__(self, args):
            self.args = tuple(args)

    for doc in docs:
        args = [(a["arg_0"], a["arg_1"]) for _, a in sorted(doc["arguments"].items(), key=lambda kv: int(kv[0].split("_")[-1]))]
        ours = [ll for ll, _ in lm.loglikelihood([Request(a) for a in args])]
        theirs = [float(r[0][0]) for r in doc["resps"]]
        assert ours == pytest.approx(theirs, abs=1e-4), doc["doc_id"]


def check_figures_and_notebook(results, tmp_path):
    """The figures node drew every figure the ci sweep supports (ci has two windows); the notebook
    runs (not just opens) on the same tables and draws the same figures."""
    import os

    import nbformat
    from nbclient import NotebookClient

    m = json.loads((results / "figures" / "metrics.json").read_text())
    assert m["figures"] == sorted(p.stem for p in (results / "figures").glob("*.png"))
    assert {"drafter_bits", "drafter_window", "target_bits", "pareto"} <= set(m["figures"])
    notebook = nbformat.read(REPO_ROOT / "notebooks" / "results.ipynb", as_version=4)
    os.environ["QDFLASH_TABLES"] = str(results / "tables")
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        del os.environ["QDFLASH_TABLES"]
    text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert "selected:" in text and f"drawn: {m['figures']}" in text
    assert len(images) == len(m["figures"])


def check_report(results):
    """The four tables of the contract; one summary row per (stage-2 drafter variant, window), every
    contract column present; `selected` only on a variant whose target passes its gates."""
    import csv

    from qdflash.report import SUMMARY_COLUMNS

    tables = results / "tables"
    for name in ("quality", "speed", "training", "summary"):
        assert (tables / f"{name}.csv").is_file(), name
    ci = CONFIG["profiles"]["ci"]
    summary = list(csv.DictReader(open(tables / "summary.csv")))
    assert list(summary[0]) == SUMMARY_COLUMNS
    drafters = len(ci["variants"]["drafter_bits"])  # stage 2 (16 bits) and each compressed one
    assert len(summary) == drafters * len(ci["variants"]["drafter_windows"])
    for r in summary:
        for column in SUMMARY_COLUMNS:
            # empty: a GPU baseline; no window; transformers' baseline, measured in the window-less job only
            if column not in ("speedup_vs_hf_compiled", "window") and not (column == "speedup_vs_hf" and r["window"]):
                assert r[column] != "", (r["variant"], column)
        assert (r["speedup_vs_hf"] == "") == (r["window"] != ""), r["variant"]
    m = json.loads((tables / "metrics.json").read_text())
    selected = [r for r in summary if r["selected"] == "1"]
    assert len(selected) == (1 if m["target.passes_gates"] else 0)
    assert m["selected"] == (selected[0]["variant"] if selected else "none")
    quality = list(csv.DictReader(open(tables / "quality.csv")))
    assert {r["variant"] for r in quality} >= {p.name for p in (results / "gates").iterdir()}
    assert {r["drafter"] for r in csv.DictReader(open(tables / "training.csv"))} >= {"stage1", "stage2"}


def check_gates(results):
    """The 16-bit target scored once (gates/bf16), then one quality_gate per quantized target variant
    on the same MMLU gate items: a verdict per task, and whether the variant passes them all."""
    import csv

    ci = CONFIG["profiles"]["ci"]
    variants = sorted(p.name for p in (results / "target").iterdir() if not p.name.endswith(".partial") and "partial" not in p.name)
    assert sorted(p.name for p in (results / "gates").iterdir()) == sorted(["bf16", *variants])
    reference = json.loads((results / "gates" / "bf16" / "scores.json").read_text())
    assert len(reference["mmlu"]["ids"]) == len(reference["mmlu"]["scores"]) == ci["gates"]["tasks"]["mmlu"]["max_items"]
    for name in variants:
        folder = results / "gates" / name
        rows = list(csv.DictReader(open(folder / "gates.csv")))
        assert [r["task"] for r in rows] == list(ci["gates"]["tasks"])
        m = json.loads((folder / "metrics.json").read_text())
        assert m["mmlu.n"] == ci["gates"]["tasks"]["mmlu"]["max_items"]
        assert 0 <= m["mmlu.reference"] <= 1 and 0 <= m["mmlu.variant"] <= 1 and m["mmlu.low"] <= m["mmlu.margin"] <= m["mmlu.high"]
        assert m["mmlu.verdict"] in {"pass", "fail", "inconclusive", "too_few", "uninformative"}
        assert m["passes_gates"] == int(m["mmlu.verdict"] == "pass")
        assert (folder / "tasks" / "qdflash_mmlu.yaml").is_file()
        assert abs(m["mmlu.reference"] - sum(reference["mmlu"]["scores"]) / len(reference["mmlu"]["scores"])) < 1e-9


def check_cut_after_timed_runs(folder):
    """A benchmark job cut after its timed runs (here: its tau pass fails) keeps them: speed.csv is in its
    partial folder, which the H200 runs bring back, and nothing is taken as done (results/published/
    2026-12-03-h200-qwen-complete lost its per-category results to a cut in the tau pass). The same job's
    overrides, on two of its methods."""
    import csv

    overrides = [o for o in yaml.safe_load((folder / "hydra" / "overrides.yaml").read_text()) if not o.startswith("out_dir=")]
    out_dir = folder.parent / "cut_in_tau_pass"
    cut = ("import sys, qdflash.bench as bench\n"
           "def cut(*args, **kwargs): raise RuntimeError('cut in the tau pass')\n"
           "bench.tau_pass = cut\n"
           "from qdflash.stages.bench_speedup import main\n"
           "sys.argv = ['bench_speedup', *sys.argv[1:]]\n"
           "main()\n")
    out = subprocess.run([sys.executable, "-c", cut, *overrides, f"out_dir={out_dir}", "bench.methods=[ar_qad,spec_qad_stage2]",
                          "tracking.wandb.mode=disabled"], capture_output=True, text=True, timeout=600,
                         cwd=folder.parents[3])  # the DAG's clone: its overrides name paths in it
    assert out.returncode != 0 and "cut in the tau pass" in out.stderr, out.stderr[-3000:]
    assert not out_dir.exists()
    (partial,) = folder.parent.glob("cut_in_tau_pass.partial-*")
    rows = list(csv.DictReader(open(partial / "speed.csv")))
    assert {(r["prompts"], r["method"]) for r in rows} >= {("all", "ar_qad"), ("all", "spec_qad_stage2"), ("chat", "spec_qad_stage2")}
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    outputs = read(partial / "outputs.jsonl")  # every prompt's tokens, per method
    assert outputs and all(o["spec_qad_stage2"] == o["ar_qad"] for o in outputs)  # fp32: lossless
    shutil.rmtree(partial)


def check_bench(results):
    import csv

    ci = CONFIG["profiles"]["ci"]
    compressed = {f"spec_qad_{ci['compress']['method']}_w{b}g{ci['compress']['group_size']}"
                  for b in ci["variants"]["drafter_bits"] if b != 16}
    baselines = {"plain16", "ar16", "ar_qad"}
    folders = sorted(p.name for p in (results / "bench").iterdir() if not p.name.endswith(".partial"))
    assert folders == sorted(f"speedup_win{'none' if w is None else w}" for w in ci["variants"]["drafter_windows"])
    for window in ci["variants"]["drafter_windows"]:
        folder = results / "bench" / f"speedup_win{'none' if window is None else window}"
        rows = list(csv.DictReader(open(folder / "speed.csv")))
        methods = {r["method"] for r in rows}
        m = json.loads((folder / "metrics.json").read_text())
        assert m["window"] == (-1 if window is None else window)
        if window is None:
            assert methods == baselines | {"spec16_stage1", "spec_qad_stage1", "spec_qad_stage2"} | compressed
            # the untimed tau pass of the stage-2 drafter over more held-out prompts (bench.tau_prompts_per_category)
            passed = {k.split(".")[2] for k in m if k.startswith("tau_pass.spec_qad_stage2.")}
            assert {"all", "chat", "knowledge", "code"} <= passed, passed
            assert m["tau_pass.prompts_per_category"] == ci["bench"]["tau_prompts_per_category"]
            assert 1 <= m["tau_pass.spec_qad_stage2.all.tau"] <= ci["drafter"]["block_size"]
            assert m["tau_pass.spec_qad_stage2.all.rounds"] == sum(m[f"tau_pass.spec_qad_stage2.{c}.rounds"] for c in passed - {"all"})
            labels = {r["prompts"] for r in rows}
            assert {"all", "chat", "knowledge", "code", "filler"} <= labels and any(l.startswith("p") for l in labels)
            # the pooled row of the kinds issue 21's targets are stated over: their tokens and seconds, summed
            pooled = "chat+math+code" if "math" in labels else "chat+code"
            for method in methods:
                (row,) = [r for r in rows if r["prompts"] == pooled and r["method"] == method]
                parts = [r for r in rows if r["prompts"] in pooled.split("+") and r["method"] == method]
                assert int(row["tokens"]) == sum(int(r["tokens"]) for r in parts)
                assert abs(float(row["seconds"]) - sum(float(r["seconds"]) for r in parts)) < 1e-3
            check_cut_after_timed_runs(folder)
        else:  # only prompts longer than the window, where it engages; the stage-2 drafters; no transformers
            assert methods == (baselines - {"plain16"}) | {"spec_qad_stage2"} | compressed
            assert all(r["speedup_vs_plain16"] == "" for r in rows)
            labels = {r["prompts"] for r in rows}
            assert m["prompts"] >= 1 and any(l.startswith("p") for l in labels)
            assert not any(k.startswith("tau_pass.") for k in m)  # the window-less job's only
        outputs = [json.loads(line) for line in open(folder / "outputs.jsonl")]
        assert len(outputs) == m["prompts"] and all(set(o) >= methods for o in outputs)
        # every prompt's timed seconds per method (they sum to the rows'), and which method touched it first, untimed
        for method in methods:
            (row,) = [r for r in rows if r["prompts"] == "all" and r["method"] == method]
            assert abs(sum(o["seconds"][method] for o in outputs) - float(row["seconds"])) < 1e-3 * len(outputs)
        assert all(o["first_visit"] in methods for o in outputs)
        for name in methods - baselines:  # each round's committed and verified tokens (the last round may be cut short)
            assert all(sum(o["committed"][name][:-1]) < len(o[name]) - 1 <= sum(o["committed"][name])
                       and len(o["verified"][name]) == len(o["committed"][name]) == len(o["rejected"][name])
                       for o in outputs if len(o[name]) > 1), name
        assert len(m["first_visit.extra_seconds"]) == len(outputs) == len(m["first_visit.method"])
        assert m["first_visit.method"] == [o["first_visit"] for o in outputs]
        # the prefill's share where the first method times one (this engine's methods; not transformers' generate)
        assert len(m["first_visit.extra_prefill_seconds"]) == len(m["first_visit.prefill_prompts"])
        assert {outputs[i]["first_visit"] for i in m["first_visit.prefill_prompts"]} <= methods - {"plain16", "static16"}
        assert len(m["first_visit.prefill_prompts"]) == sum(o["first_visit"] not in ("plain16", "static16") for o in outputs)
        # float32 on the CPU: speculative greedy output must equal autoregressive output exactly
        for name in methods - baselines:
            reference = "ar16" if name.startswith("spec16") else "ar_qad"
            assert all(o[name] == o[reference] for o in outputs), name
            assert m[f"all.{name}.mismatches"] == 0, m[f"all.{name}.divergence_margins"]
            assert 1 <= m[f"all.{name}.tau"] <= ci["drafter"]["block_size"]
            # rounds verify bench.verify_tokens, or the whole block after one that accepted that far
            assert ci["bench"]["verify_tokens"] <= m[f"all.{name}.verified_per_round"] <= ci["drafter"]["block_size"]
        assert m["verify_tokens"] == ci["bench"]["verify_tokens"] and m["verify_adaptive"] == 1
        assert m["no_repeat"] == int(ci["bench"]["no_repeat"]) == 1  # the no-repeat drafts' path, lossless above
        # no overruled draft after the first repeats the (accepted) draft before it: the rule reached every
        # speculative method
        for name in methods - baselines:
            for o in outputs:
                start = 1
                for a, wrong in zip(o["committed"].get(name, []), o["rejected"].get(name, [])):
                    assert wrong < 0 or a < 2 or start + a - 1 >= len(o[name]) or wrong != o[name][start + a - 2], \
                        (name, o["prompt"])
                    start += a
        assert m["bench.drafter_dtype"] == "float32" and m["bench.compile_drafter"] == 0  # cast to the fp32 target's dtype
        # each drafter's static engine: its graphs (CUDA only) and what capturing them cost, outside the timings
        assert all(m[f"drafter_engine.{name}.capture_seconds"] >= 0 and f"drafter_engine.{name}.graphs" in m
                   for name in methods - baselines)


def check_drafter_stage(results):
    from qdflash.drafter import load_drafter
    from qdflash.models import load_target

    qad_data = json.loads((results / "data" / "qad" / "metrics.json").read_text())
    assert qad_data["model.source"].endswith("target/qad_gptq_w4g32/model/dense")  # the QAD twin regenerated it
    # data.stage2_prompts: fresh in ci: stage 2's answers are to other training prompts, the held-out ones the same
    ids = {(role, split): [json.loads(line)["id"] for line in open(results / "data" / role / f"{split}.jsonl")]
           for role in ("bf16", "qad") for split in ("train", "heldout")}
    assert qad_data["data.fresh_prompts"] == 1 and ids["qad", "train"] and ids["qad", "heldout"] == ids["bf16", "heldout"]
    assert not set(ids["qad", "train"]) & set(ids["bf16", "train"])
    block = CONFIG["profiles"]["ci"]["drafter"]["block_size"]
    for stage in ("stage1", "stage2"):
        m = json.loads((results / "drafter" / stage / "metrics.json").read_text())
        assert 1 <= m["final.tau"] <= block and len(m["final.accept_rate_by_position"]) == block - 1
        # decoding's own rounds over the held-out answers' first walk_tokens tokens (drafter.train.walk_acceptance)
        assert m["final.walk.max_tokens"] == CONFIG["profiles"]["ci"]["drafter_train"]["walk_tokens"]
        assert 1 <= m["final.walk.tau"] <= block and m["final.walk.rounds"] >= 1
        assert len(m["final.walk.accept_rate_by_position"]) == block - 1
        assert len(m["train.walk_tau_by_epoch"]) == len(m["train.tau_by_epoch"])
        assert m["train.walk_tau_by_epoch"][-1] == round(m["final.walk.tau"], 4)
        assert len(m["train.loss_curve"]) == CONFIG["profiles"]["ci"]["drafter_train"]["steps"]
        assert m["train.feature_cache_misses"] > 0 and not list((results / "drafter").glob("*.features*"))
        assert list((results / "drafter" / stage / "wandb").glob("offline-run-*"))
    assert "stage1_on_this_target.tau" in json.loads((results / "drafter" / "stage2" / "metrics.json").read_text())
    drafter = load_drafter(results / "drafter" / "stage2" / "drafter", load_target("tiny-qwen3.5", device="cpu"))
    assert drafter.block_size == block
    # compress_drafter: one job per compressed grid of variants.drafter_bits (16 = stage 2 itself)
    compress = CONFIG["profiles"]["ci"]["compress"]
    bits = [b for b in CONFIG["profiles"]["ci"]["variants"]["drafter_bits"] if b != 16]
    folders = sorted(p.name for p in (results / "drafter").glob("*_w*g*"))
    assert folders == sorted(f"{compress['method']}_w{b}g{compress['group_size']}" for b in bits)
    for name in folders:
        m = json.loads((results / "drafter" / name / "metrics.json").read_text())
        # the profile evaluates on stage 2's own held-out blocks: before compression, the same tau-hat
        assert m["uncompressed.tau"] == pytest.approx(json.loads((results / "drafter" / "stage2" / "metrics.json").read_text())["final.tau"])
        assert 1 <= m["compressed.tau"] <= block and m["calibration.blocks"] > 0
        assert m["drafter.weight_bytes"] < m["drafter.weight_bytes_16bit"]
        compressed = load_drafter(results / "drafter" / name / "drafter", load_target("tiny-qwen3.5", device="cpu"))
        assert type(compressed.fc).__name__ == "QuantLinear"


def check_target_stage(results, data):
    from safetensors.torch import load_file

    target = results / "target"
    ptq, qad = target / "ptq_gptq_w4g32", target / "qad_gptq_w4g32"
    for folder in (target / "ptq_rtn_w4g32", ptq, qad):
        assert (folder / "metrics.json").is_file() and (folder / "model" / "config.json").is_file()
        assert (folder / "model" / "dense" / "config.json").is_file()
        m = json.loads((folder / "metrics.json").read_text())
        assert m["quant.kl"] > 0 and 0 <= m["quant.top1_agreement"] <= 1 and m["quant.ppl"] > 0
    qad_metrics = json.loads((qad / "metrics.json").read_text())
    assert qad_metrics["grid.scales_identical_to_ptq"] == 1
    assert qad_metrics["qad.step0_kl"] == pytest.approx(json.loads((ptq / "metrics.json").read_text())["quant.kl"], rel=1e-6)

    # the exported grids are bit-identical: every weight_scale tensor of QAD equals the PTQ one
    before, after = load_file(ptq / "model" / "model.safetensors"), load_file(qad / "model" / "model.safetensors")
    scales = [k for k in before if k.endswith("weight_scale")]
    assert scales and all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in scales)
    # GDN projections stay 16-bit on tiny-qwen3.5
    assert not any("in_proj_a" in k or "in_proj_b" in k for k in scales)
    assert any(k.endswith("in_proj_a.weight") for k in after)

    # the step-0 check fires on a tampered scale
    tampered = results / "tampered_ptq"
    shutil.copytree(ptq, tampered)
    tensors = load_file(tampered / "model" / "model.safetensors")
    tensors[scales[0]] = tensors[scales[0]] * 1.5
    from safetensors.torch import save_file

    save_file(tensors, tampered / "model" / "model.safetensors", metadata={"format": "pt"})
    out = subprocess.run(
        [sys.executable, "-m", "qdflash.stages.qad", "model=tiny-qwen3.5", "device=cpu", "dtype=float32",
         f"data_dir={data}", f"ptq_dir={tampered}", f"out_dir={results / 'qad_tampered'}",
         "eval.heldout_samples=" + str(CONFIG["profiles"]["ci"]["eval"]["heldout_samples"]), "tracking.wandb.mode=disabled"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "step-0 check failed" in out.stderr
    assert not (results / "qad_tampered").exists()


def test_adding_a_drafter_bit_width_adds_exactly_its_job(tmp_path):
    """The sweep axis expands through Snakemake: one more value in variants.drafter_bits is one more
    compress_drafter job in a dry run, and 16 (the uncompressed drafter) is none."""
    def planned(bits):
        config = load_config()
        config["profiles"]["ci"]["variants"]["drafter_bits"] = bits
        path = tmp_path / f"config-{len(bits)}.yaml"
        path.write_text(yaml.safe_dump(config))
        out = snakemake(tmp_path, "-n", "--configfile", str(path), "--config", "profile=ci")
        assert out.returncode == 0, out.stderr[-2000:]
        return sorted(line.split("drafter/")[-1] for line in out.stdout.splitlines()
                      if "output:" in line and "/drafter/gptq_w" in line)

    assert planned([16]) == []
    assert planned([16, 4]) == ["gptq_w4g32"]
    assert planned([16, 8, 4]) == ["gptq_w4g32", "gptq_w8g32"]


def test_failed_node_leaves_no_output(tmp_path):
    config = load_config()
    config["profiles"]["ci"]["data"]["sources"]["gsm8k"]["path"] = str(tmp_path / "no-such-gsm8k")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    # the data node's output as the target: the whole DAG would first run nodes that do not read the data
    # (quality_reference: ~18 s) before the data node fails
    out = snakemake(tmp_path, "results/ci/data/bf16", "--configfile", str(tmp_path / "bad.yaml"), "--config", "profile=ci",
                    "--show-failed-logs")
    assert out.returncode != 0
    assert not (tmp_path / "results" / "ci" / "data" / "bf16").exists()
    # the node's error is in the rule's log (kept, outside the removed output), and Snakemake shows it
    log = tmp_path / "results" / "ci" / "logs" / "prepare_data.log"
    assert "data source gsm8k: the path given in the config" in log.read_text()
    assert "results/ci/logs/prepare_data.log" in out.stderr + out.stdout
    assert "data source gsm8k: the path given in the config" in out.stderr + out.stdout


def test_drafter_scaling_study_on_ci(tmp_path):
    """Sharded data -> merged -> one stage-1 run per (size, depth) -> the table; greedy held-out
    responses of the sharded run equal the unsharded prepare_data node's, token for token."""
    scaling = CONFIG["profiles"]["ci"]["scaling"]
    # one core per node, so two of its independent nodes run side by side on 2 cores (every ci node holds all
    # cores by default, one node at a time); the nodes and their outputs are the same
    one_core = [f"{rule}=1" for rule in ("prepare_data", "scaling_data_shard", "scaling_drafter")]
    out = snakemake(tmp_path, "drafter_scaling", "results/sc/data/bf16", "--config", "profile=ci", "experiment=sc",
                    "--set-threads", *one_core)
    assert out.returncode == 0, out.stderr[-3000:]
    results = tmp_path / "results" / "sc"
    merged = results / "scaling" / "data" / "merged"
    shards = [json.loads((results / "scaling" / "data" / f"shard-{i}" / "metrics.json").read_text()) for i in range(scaling["shards"])]
    train = read(merged / "train.tokens.jsonl")
    assert len(train) == sum(m["train.prompts"] for m in shards) and len({r["id"] for r in train}) == len(train)
    sharded, unsharded = read(merged / "heldout.tokens.jsonl"), read(results / "data" / "bf16" / "heldout.tokens.jsonl")
    assert [r["id"] for r in sharded] == [r["id"] for r in unsharded]  # the same prompts, in the same order
    for a, b in zip(sharded, unsharded):  # greedy: the same tokens (the scaling data stops earlier: a prefix)
        assert a["input_ids"] == b["input_ids"][: len(a["input_ids"])]

    lines = (results / "scaling" / "table.md").read_text().splitlines()
    assert len(lines) == 2 + len(scaling["sizes"]) * len(scaling["depths"]) + len(scaling["arms"])
    runs = {}
    for size in scaling["sizes"]:
        for depth in scaling["depths"]:
            m = json.loads((results / "scaling" / "drafter" / f"n{size}-L{depth}" / "metrics.json").read_text())
            assert m["train.examples"] == size and m["drafter.layers"] == depth and m["train.seconds"] > 0
            batch = CONFIG["profiles"]["ci"]["drafter_train"]["batch_size"]
            assert m["train.steps"] == -(-scaling["epochs"] * size // batch)  # `epochs` passes
            # tau-hat after every epoch (the last is the final one), with the training seconds by then
            assert len(m["train.tau_by_epoch"]) == len(m["train.seconds_by_epoch"]) == scaling["epochs"] >= 2
            assert m["train.tau_by_epoch"][-1] == round(m["final.tau"], 4) and all(1 <= t <= 16 for t in m["train.tau_by_epoch"])
            assert m["train.seconds_by_epoch"] == sorted(m["train.seconds_by_epoch"]) and m["train.seconds_by_epoch"][-1] == m["train.seconds"]
            # the walked rounds' tau after every epoch too (drafter_train.walk_tokens, the ci profile's)
            assert len(m["train.walk_tau_by_epoch"]) == scaling["epochs"] and all(1 <= t <= 16 for t in m["train.walk_tau_by_epoch"])
            runs[size, depth] = m
    assert "tau_by_epoch" in lines[0]
    assert (results / "scaling" / "tau_by_epoch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an arm: the largest size at the first depth with only its overrides changed (here the labels)
    for name, overrides in scaling["arms"].items():
        arm = json.loads((results / "scaling" / "drafter" / f"n{max(scaling['sizes'])}-L{scaling['depths'][0]}-{name}" / "metrics.json").read_text())
        plain = runs[max(scaling["sizes"]), scaling["depths"][0]]
        assert arm["train.labels"] == overrides["labels"] != plain["train.labels"] == "data"
        lr = CONFIG["profiles"]["ci"]["drafter_train"]["lr"]  # the schedule's floor, where the arm sets one
        assert arm["train.lr_last"] == pytest.approx(overrides.get("min_lr_ratio", 0) * lr, abs=0.05 * lr) != plain["train.lr_last"]
        assert (arm["train.examples"], arm["train.steps"], arm["drafter.layers"]) == (plain["train.examples"], plain["train.steps"], plain["drafter.layers"])
        block = CONFIG["profiles"]["ci"]["drafter"]["block_size"]  # trained block positions, where the arm sets them
        assert arm["train.loss_positions"] == overrides.get("loss_positions", block - 1) != plain["train.loss_positions"] == block - 1
        if overrides.get("cache_features") == "memory":  # features kept in RAM: the second epoch reads them back
            assert arm["train.feature_cache"] == "memory" and arm["train.feature_cache_hits"] > 0
        assert any(line.startswith(f"| n{max(scaling['sizes'])}-L{scaling['depths'][0]}-{name} ") for line in lines)
    assert runs[scaling["sizes"][0], 1]["drafter.parameters"] < runs[scaling["sizes"][0], 2]["drafter.parameters"]


def test_slurm_profile_dry_run_lists_every_job_with_its_resources(tmp_path):
    """The qwen3.5-4b profile through the SLURM executor profile (dry run: no cluster needed):
    every rule with docs/recipe.md's resources, the multi-GPU training rules launched by torchrun."""
    pytest.importorskip("snakemake_executor_plugin_slurm")
    out = snakemake(tmp_path, "--profile", str(REPO_ROOT / "workflow" / "profiles" / "slurm"), "-n", "-p",
                    "--config", "profile=qwen3.5-4b")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    jobs = {}
    for block in text.split("\nrule ")[1:] + text.split("\nlocalrule ")[1:]:
        name = block.split(":")[0]
        resources = next((line for line in block.splitlines() if line.strip().startswith("resources:")), "")
        command = next((line for line in block.splitlines() if line.startswith("Shell command:") or "qdflash.stages" in line), "")
        jobs.setdefault(name, (resources, command))
    table = CONFIG["profiles"]["qwen3.5-4b"]["resources"]
    for rule in ("prepare_data", "quantize_target", "qad", "drafter_stage1", "drafter_stage2", "quality_gate", "bench_speedup", "report"):
        want = {**table["default"], **table.get(rule, {})}
        resources, command = jobs[rule]
        assert f"gpu={want['gpu']}," in resources and f"mem_mb={want['mem_mb']}," in resources, (rule, resources)
        assert f"runtime={want['runtime']}," in resources and f"cpus_per_task={want['cpus']}," in resources, (rule, resources)
        assert ("torch.distributed.run" in command) == (want["gpu"] > 1), (rule, command)
    assert "--nproc_per_node 8 -m qdflash.stages.qad" in jobs["qad"][1]


def test_a_resources_entry_for_no_rule_is_refused(tmp_path):
    config = load_config()
    config["profiles"]["ci"]["resources"] = {"qda": {"gpu": 2}}
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(config))
    out = snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "typo.yaml"), "--config", "profile=ci")
    assert out.returncode != 0 and "['qda'] are not rules of this workflow" in out.stdout + out.stderr


def test_a_data_source_that_appears_reruns_the_node_that_reads_it(tmp_path, monkeypatch):
    """The fingerprint covers where the sources resolve, not only the profile's values: GSM8K
    appearing in $QDFLASH_DATA_DIR after a run without it (skipped, or read from elsewhere) makes
    the data node out of date; it was left "up to date"."""
    from qdflash.data.jsonl import write_jsonl

    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "empty"))
    args = ("results/fp/data/bf16", "--config", "profile=ci", "experiment=fp")
    # one thread: the tiny node's torch gains nothing from a second one (the ci DAG's data node: 15 s on 2 threads,
    # 13 s on 1 beside another node) and loses much where the machine is shared
    out = snakemake(tmp_path, *args, "--set-threads", "prepare_data=1")
    assert out.returncode == 0, out.stderr[-3000:]
    again = snakemake(tmp_path, "-n", *args)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    gsm8k = tmp_path / "more" / "gsm8k"
    gsm8k.mkdir(parents=True)
    for split in ("train", "test"):
        write_jsonl(gsm8k / f"{split}.jsonl", ({"question": f"{split}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
                                               for i in range(12)))
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "more"))
    changed = snakemake(tmp_path, "-n", *args)
    assert changed.returncode == 0 and "rule prepare_data:" in changed.stdout, changed.stdout[-3000:]
