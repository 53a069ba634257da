"""scripts/bench/bench_components.py runs its whole code path on the CPU (tiny shape): the numbers
mean nothing here, but every part is measured and the captured-step check holds."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from qdflash.paths import REPO_ROOT


class Started:
    """One script run started in the background: its output file, and its process (stdout + stderr to a log file,
    not a pipe, so no process waits on a full pipe)."""

    def __init__(self, folder, name, script, *args):
        self.out, self.log = folder / f"{name}.json", folder / f"{name}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "bench" / script), *args, "--out", str(self.out)],
                                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def result(self):
        try:
            self.process.wait(timeout=600)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        assert self.process.returncode == 0, self.log.read_text()[-2000:]
        return json.loads(self.out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two scripts are independent: side by side on 2 cores, one thread each (each test reads its own)."""
    folder = tmp_path_factory.mktemp("bench-scripts")
    started = {"components": Started(folder, "components", "bench_components.py", "--shape", "tiny", "--reps", "1", "--context", "32",
                                     "--w4-head", "--compile", "aot_eager", "--unfused-gdn", "--profile", "--gdn-two-phase",
                                     "--inductor-default", "--pdl", "--hf-generate", "--hf-tokens", "8", "--hf-reps", "1",
                                     "--side-by-side-rounds", "3"),
               # --study: on the CPU (no kernels) the arms run one code path; what is tested is the study's plumbing:
               # each arm tuned, checked, measured and set against the first (not compiled here: the components run
               # above covers --compile, and a compile per arm would double this test's time)
               "study": Started(folder, "study", "bench_components.py", "--shape", "tiny", "--reps", "1", "--context",
                                "32", "--study", "--gdn-ba", "dot,fused", "--gdn-two-phase", "--gdn-chunked"),
               "round": Started(folder, "round", "bench_round.py", "--layers", "2", "--context", "40", "--block", "4", "--reps", "1",
                               "--attention", "sdpa,kernel", "--kernels", "on"),
               # --compile (traced with aot_eager: Triton's interpreter does not run under dynamo, so sdpa here)
               "round_compiled": Started(folder, "round_compiled", "bench_round.py", "--layers", "2", "--context", "40", "--block", "4",
                                         "--reps", "1", "--new", "8", "--verify-tokens", "2,3", "--compile", "aot_eager",
                                         "--draft-variants", "aot_eager")}
    yield started
    for s in started.values():  # a test that failed before waiting leaves no process behind
        if s.process.poll() is None:
            s.process.kill()
            s.process.wait()


def test_component_bench_runs_on_the_cpu(runs):
    r = runs["components"].result()
    for label in ("target16", "target_w4"):
        assert r[f"{label}.decode_ms"] > 0 and r[f"{label}.verify_ms"] > 0 and r[f"{label}.bound_ms"] > 0
        assert r[f"{label}.graph_vs_eager_max_abs"] == 0.0
    assert r["drafter16.step_ms"] > 0 and r["drafter_w4.step_ms"] > 0
    # --profile: each decode step, verify block and drafter step by kernel (the GPU's profiler; on the CPU, nothing)
    assert all(r[f"{label}.{part}_kernels"] == {} for label in ("target16", "target_w4") for part in ("decode", "verify"))
    assert all(r[f"{label}.step_kernels"] == {} for label in ("drafter16", "drafter_w4", "drafter_w4_head"))
    # --hf-generate: transformers' static generate on the same model, compiled (here traced with aot_eager)
    # (its step time is a difference of two wall times: no sign asserted, a loaded machine may stall either run)
    assert set(r["hf_static.generate_ms"]) == {"8", "16"} and r["hf_static.graphs_compiled"] >= 1 and r["hf_static.compile"] == "aot_eager"
    # (rounded to 3 places: within 5e-4 whatever the ratio's size, which on the CPU can be anything)
    assert r["hf_static.over_target16.decode_compiled_ms"] == pytest.approx(
        r["hf_static.decode_ms"] / r["target16.decode_compiled_ms"], rel=2e-3, abs=6e-4)
    # --unfused-gdn: without the kernels (the CPU) fused and unfused are one torch path, so the arm says so instead
    assert r["target16_unfused_gdn"].startswith("skipped: the engine's kernels are off") and not any(k.startswith("fused_gdn.") for k in r)
    assert r["target_w4.quantized_layers"] > 0 and ("w4a16_rel_err@1" in r or r["w4a16_check"].startswith("no packed"))
    # --w4-head: then the same W4 target with its LM head quantized, in the same process
    assert r["target_w4_head.decode_ms"] > 0 and r["target_w4_head.graph_vs_eager_max_abs"] == 0.0
    assert r["w4_head_decode_speedup_over_16bit"] > 0 and "implied_speedup.tau3.0.target_w4_head+drafter_w4_head.vs_ar16" in r
    # its drafter reads the head as the target now holds it (on the CPU: the dequantized weight, as many bytes)
    assert r["drafter_w4_head.step_ms"] > 0 and r["drafter_w4_head.bytes"]["lm_head"] == r["drafter_w4.bytes"]["lm_head"]
    assert "reference.implied_speedup.tau3.0.target_w4_head+drafter_w4_head.vs_ar16" in r
    assert r["reference.w4_head_decode_speedup_over_16bit"] >= r["reference.w4_decode_speedup_over_16bit"] * 0.999
    assert {k for k in r if k.startswith("implied_speedup.tau6.5")}
    # --compile (here traced with aot_eager): decode, verify and drafter steps compiled, and the round they imply
    for label in ("target16", "target_w4", "target_w4_head"):
        assert r[f"{label}.decode_compiled_ms"] > 0 and r[f"{label}.verify_compiled_ms"] > 0, r.get(f"{label}.compile_error")
        # each compiled as one graph (the graph breaks dynamo counted, by reason: none)
        for step in ("decode", "verify"):
            assert r[f"{label}.{step}_compiled_graphs"] == 1 and r[f"{label}.{step}_compiled_graph_breaks"] == {}
            assert r[f"{label}.{step}_compiled_recompile_limits"] == []
    for label in ("drafter16", "drafter_w4"):
        assert r[f"{label}.step_compiled_ms"] > 0 and r[f"{label}.compiled_drafts_agree"] == 1.0, r.get(f"{label}.compile_error")
        assert r[f"{label}.step_compiled_graphs"] == 1 and r[f"{label}.step_compiled_graph_breaks"] == {}
    for key, label in (("w4", "target_w4"), ("w4_head", "target_w4_head")):
        assert r[f"{key}_compiled_decode_speedup_over_16bit_compiled"] == pytest.approx(
            r["target16.decode_compiled_ms"] / r[f"{label}.decode_compiled_ms"], abs=1e-3)
    # --profile with --compile: each target's compiled graphs timed again after the profiler ran
    assert r["target16.decode_compiled_after_profile_ms"] > 0 and r["target_w4_head.verify_compiled_after_profile_ms"] > 0
    # the compiled 16-bit and W4-head steps timed again in turn, issue 23's ratios round by round
    assert r["side_by_side.rounds"] == 3  # (as given; 7 by default)
    for key in ("w4_head_decode_speedup_over_16bit", "target16.verify_over_decode", "target_w4_head.verify_over_decode",
                "target16.decode_of_bound", "target16.decode_ms", "target_w4_head.verify_ms"):
        assert 0 < r[f"side_by_side.{key}"]["min"] <= r[f"side_by_side.{key}"]["median"] <= r[f"side_by_side.{key}"]["max"]
    # --pdl: each target again with its steps captured under programmatic dependent launch, in side_by_side too
    for label in ("target16", "target_w4_head"):
        assert r[f"{label}_pdl.decode_compiled_ms"] > 0 and f"vs_pdl.{label}.decode_compiled_speedup" in r
        assert r[f"side_by_side.{label}_pdl.decode_speedup"]["median"] > 0 and f"side_by_side.{label}_pdl.verify_ms" in r
    assert r["side_by_side.w4_head_pdl_decode_speedup_over_16bit_pdl"]["median"] > 0
    # set against the steps captured without PDL from the same states: the same logits (on the CPU, one path)
    assert all(r[f"{label}_pdl.{step}_logits_vs_base_max_abs"] == 0.0 for label in ("target16", "target_w4_head")
               for step in ("decode", "verify"))
    # --inductor-default: each target again compiled with inductor's own options, set against the engine's
    for label in ("target16", "target_w4_head"):
        assert r[f"{label}_inductor_default.decode_compiled_ms"] > 0, r.get(f"{label}_inductor_default.compile_error")
        assert r[f"vs_inductor_default.{label}.decode_compiled_speedup"] == pytest.approx(
            r[f"{label}_inductor_default.decode_compiled_ms"] / r[f"{label}.decode_compiled_ms"], abs=2e-3)
    assert "target_w4_inductor_default.decode_ms" not in r  # the targets of record only
    assert r["compiled.drafter_w4_step_over_target_w4_decode"] == pytest.approx(
        r["drafter_w4.step_compiled_ms"] / r["target_w4.decode_compiled_ms"], abs=1e-4)
    assert r["compiled.implied_speedup.tau3.0.target16+drafter16.vs_ar16"] == pytest.approx(
        3.0 * r["target16.decode_compiled_ms"]
        / (r["target16.verify_compiled_ms"] + r["target16.rollback_ms"] + r["drafter16.step_compiled_ms"]), abs=2e-3)
    # a round's rollback (into the verify block, eager) is timed and counted in its implied speedup
    assert all(r[f"{label}.rollback_ms"] > 0 for label in ("target16", "target_w4", "target_w4_head"))
    # the bounds at a 600 GB/s reference device: the parts' own bytes at that bandwidth (on the CPU the W4
    # target runs its dequantized weights, so it reads as much as the 16-bit one: the H200 run packs them)
    assert r["reference.GBps"] == 600.0
    # each part's wall time (what a device window must fit), in the order run
    assert list(r["wall_s"])[:6] == ["gdn_fused_check", "target16_cublas", "target16", "target16_inductor_default",
                                     "target16_pdl", "hf_static"], r["wall_s"]
    assert {"target_w4_head", "target_w4_head_inductor_default", "target16_pdl", "target_w4_head_pdl"} <= set(r["wall_s"])
    assert all(v >= 0 for v in r["wall_s"].values())
    for label in ("target16", "target_w4"):
        assert r[f"reference.{label}.bound_ms"] == pytest.approx(r[f"{label}.bytes"]["total"] / 600e9 * 1e3, abs=6e-5)  # rounded to 4 places
    assert r["reference.drafter16.bound_ms"] == pytest.approx(sum(r["drafter16.bytes"].values()) / 600e9 * 1e3, abs=6e-5)
    assert r["reference.w4_decode_speedup_over_16bit"] >= 1.0
    target_bytes, drafter_bytes = r["target16.bytes"]["total"], sum(r["drafter16.bytes"].values())
    bound = target_bytes / (target_bytes + drafter_bytes)  # tau * decode bound / (verify bound + drafter bound)
    assert r["reference.implied_speedup.tau3.0.target16+drafter16.vs_ar16"] == pytest.approx(3.0 * bound, abs=2e-3)


def test_w4_head_only_measures_the_w4_head_target_alone(tmp_path):
    """--w4-head-only (the must-show run in less device time): no target_w4 / drafter_w4 anywhere in the
    result, the W4-head target and its drafter with their implied speedups and reference bounds."""
    run = Started(tmp_path, "head_only", "bench_components.py", "--shape", "tiny", "--reps", "1", "--context", "32", "--w4-head-only")
    r = run.result()
    assert not any(k.startswith(("target_w4.", "drafter_w4.")) and k != "target_w4.quantized_layers" for k in r)
    assert not any(".target_w4+" in k or "w4_decode_speedup" in k.replace("w4_head_decode", "") for k in r)
    assert r["target_w4_head.decode_ms"] > 0 and r["drafter_w4_head.step_ms"] > 0
    assert "w4a16_rel_err@1" in r or r["w4a16_check"].startswith("no packed")
    assert "implied_speedup.tau6.5.target_w4_head+drafter_w4_head.vs_ar16" in r
    assert r["reference.implied_speedup.tau3.0.target_w4_head+drafter_w4_head.vs_ar16"] > 0


def test_side_by_side_ratios_are_each_rounds_own_the_right_way_round(monkeypatch, capsys):
    """side_by_side: each step timed once a round, in turn; each ratio per round from that round's times (16-bit over
    W4-head decode: > 1 where W4 is faster; verify over decode; a target's step over its PDL or kept-states arm's: > 1
    where the arm is faster), its median / min / max over rounds; the 16-bit decode step's fraction of its bound too."""
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    rounds = {"target16.decode": [4.0, 3.0, 5.0], "target16.verify": [6.0, 6.0, 6.0],
              "target_w4_head.decode": [2.0, 2.0, 2.0], "target_w4_head.verify": [3.0, 3.0, 3.0],
              "target_w4_head_pdl.decode": [1.0, 1.6, 2.0], "target_w4_head_pdl.verify": [3.0, 3.0, 3.0],
              "target16_kept_states.verify": [7.5, 6.0, 12.0], "target_w4_head_swiglu_unfused.decode": [2.5, 2.0, 4.0]}
    calls = {name: iter(values) for name, values in rounds.items()}
    steps = {name: name for name in rounds}  # a step is its name here: the fake timer looks its times up
    args = argparse.Namespace(side_by_side_rounds=3, reps=1)
    r = bench_components.side_by_side(steps, {"target16.bound_ms": 2.0}, args, lambda name, reps: next(calls[name]))
    assert r["side_by_side.w4_head_decode_speedup_over_16bit"] == {"median": 2.0, "min": 1.5, "max": 2.5}
    assert r["side_by_side.target16.verify_over_decode"] == {"median": 1.5, "min": 1.2, "max": 2.0}
    assert r["side_by_side.target_w4_head.verify_over_decode"]["median"] == 1.5
    assert r["side_by_side.target_w4_head_pdl.decode_speedup"] == {"median": 1.25, "min": 1.0, "max": 2.0}
    # --kept-states-arm likewise (< 1: the replay's blocks, the target's own, faster than keeping every state)
    assert r["side_by_side.target16_kept_states.verify_speedup"] == {"median": 0.8, "min": 0.5, "max": 1.0}
    # --swiglu-arm likewise (< 1: the arm's steps, silu(gate) * up by a launch of its own, slower than the target's own)
    assert r["side_by_side.target_w4_head_swiglu_unfused.decode_speedup"] == {"median": 0.8, "min": 0.5, "max": 1.0}
    assert r["side_by_side.target16.decode_of_bound"] == {"median": 0.5, "min": 0.4, "max": 0.6667}
    assert r["side_by_side.target16.decode_ms"] == {"median": 4.0, "min": 3.0, "max": 5.0}
    assert "side_by_side.w4_head_pdl_decode_speedup_over_16bit_pdl" not in r  # no 16-bit PDL arm timed
    for argv in (["--side-by-side-rounds", "0"], ["--pdl"], ["--targets-only", "--gdn-only"]):  # refused by name
        monkeypatch.setattr(sys, "argv", ["bench_components.py", *argv])
        with pytest.raises(SystemExit):
            bench_components.main()
        assert argv[0] in capsys.readouterr().err


def test_targets_only_measures_no_drafter(tmp_path):
    """--targets-only (issue 23's target ratios in less device time): the tuned 16-bit and W4-head targets, no
    cuBLAS-only arm, no drafter and so no implied speedup; without --compile no side-by-side rounds either."""
    run = Started(tmp_path, "targets_only", "bench_components.py", "--shape", "tiny", "--reps", "1", "--context", "32",
                  "--w4-head-only", "--targets-only")
    r = run.result()
    assert r["target16.decode_ms"] > 0 and r["target_w4_head.verify_ms"] > 0 and r["w4_head_decode_speedup_over_16bit"] > 0
    assert not any(k.startswith(("drafter", "target16_cublas", "side_by_side")) or "implied_speedup" in k for k in r)
    assert r["reference.target_w4_head.bound_ms"] > 0


def test_no_cublas_keeps_the_drafters(tmp_path):
    """--no-cublas (the must-show run in less device time): no cuBLAS-only arm, but the drafters and so the implied
    speedups are measured."""
    run = Started(tmp_path, "no_cublas", "bench_components.py", "--shape", "tiny", "--reps", "1", "--context", "32",
                  "--w4-head-only", "--no-cublas")
    r = run.result()
    assert not any(k.startswith("target16_cublas") for k in r)
    assert r["drafter_w4_head.step_ms"] > 0 and r["implied_speedup.tau3.0.target_w4_head+drafter_w4_head.vs_ar16"] > 0


def test_study_runs_each_arm_on_the_cpu(runs):
    r = runs["study"].result()
    assert r["target_w4_gdn_fused"].startswith("skipped: the W4 target's qkvz is 4-bit")
    assert r["target_w4_gdn_fused_two_phase"].startswith("skipped: the W4 target's qkvz is 4-bit")
    assert r["target_w4_gdn_fused_chunked"].startswith("skipped: the W4 target's qkvz is 4-bit")
    for label in ("target16", "target_w4"):
        for suffix in ("", "_gdn_dot_two_phase", "_gdn_dot_chunked") + (
                ("_gdn_fused", "_gdn_fused_two_phase", "_gdn_fused_chunked") if label == "target16" else ()):
            arm = label + suffix
            assert r[f"{arm}.decode_ms"] > 0 and r[f"{arm}.verify_ms"] > 0, r.get(f"{arm}.error")
            assert r[f"{arm}.graph_vs_eager_max_abs"] == 0.0
            if suffix:
                assert r[f"vs_base.{arm}.decode_speedup"] == pytest.approx(r[f"{label}.decode_ms"] / r[f"{arm}.decode_ms"], abs=2e-3)
                assert r[f"{arm}.gdn_check"] == "kernels off: one torch path"  # the GPU compares the arm's GDN path
    assert r["target_w4.quantized_layers"] > 0 and not any(k.startswith("drafter") for k in r)
    # an arm after one of the same engine keeps its tuning; an engine of its own is tuned again
    assert r["target16_gdn_dot_two_phase.tuned"] == "as the arm before"
    assert isinstance(r["target16_gdn_fused.tuned"], dict)


def test_study_arms_option_names_arms_of_the_targets(capsys):
    """--arms takes the study's arm labels (not a base, not an arm the W4 target always skips) and fails clearly
    otherwise; study_arms lists the base first, then each --gdn-ba mode's arms."""
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    args = argparse.Namespace(gdn_ba=["dot", "fused"], gdn_two_phase=True, gdn_chunked=False)
    assert [arm.suffix for arm in bench_components.study_arms(args)] == ["", "_gdn_dot_two_phase", "_gdn_fused",
                                                                         "_gdn_fused_two_phase"]
    for bad in ("target16", "target_w4_gdn_fused", "target16_gdn_fused,target16_foo"):
        sys.argv = ["bench_components.py", "--study", "--gdn-ba", "dot,fused", "--arms", bad]
        with pytest.raises(SystemExit):
            bench_components.main()
        assert "--arms: with --study, labels of" in capsys.readouterr().err


def test_drafter_step_through_the_attention_kernel_drafts_what_sdpa_drafts():
    """bench_components' drafter step with --attention kernel runs as the speed stage drafts (DrafterEngine's kernel
    path: the round's append, the block's K/V after the context, kernels.decode_attention through Triton's interpreter
    here) and drafts the masked-SDPA step's tokens on the same context and block (fp32); the 16-bit and W4 drafters."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    target = bench_components.build_target("tiny", "cpu", torch.float32)
    args = argparse.Namespace(shape="tiny", block=4, context=20, reps=1, compile=False, profile=False, attention="kernel")
    for label, group in (("drafter16", None), ("drafter_w4", 32)):
        out = bench_components.measure_drafter(target, args, "cpu", torch.float32, 1e11, label, group)
        assert out[f"{label}.attention"] == "kernel" and out[f"{label}.drafts_agree_with_forward"] == 1.0, out
        assert out[f"{label}.drafts_max_gap"] == 0.0 and out[f"{label}.drafts_logit_scale"] > 0, out


def test_drafts_agreement_reports_the_gap_where_drafts_differ():
    """bench_components.drafts_agreement: where a draft differs from the forward's argmax, the forward's top logit minus
    its logit for the drafted token (the largest over the rows), and the share of rows that agree."""
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 1.5, -4.0], [0.5, 0.0, 0.25]])
    out = bench_components.drafts_agreement(torch.tensor([1, 1, 2]), logits, "d")
    assert out == {"d.drafts_agree_with_forward": pytest.approx(1 / 3), "d.drafts_max_gap": 0.5,
                   "d.drafts_logit_scale": 4.0}, out


def test_round_bench_runs_on_the_cpu(runs):
    """scripts/bench/bench_round.py (a speculative round's parts, eager vs static drafter) on a 2-layer
    SmolLM2-shaped target: every part timed, and the static drafter drafts the eager one's tokens."""
    r = runs["round"].result()
    assert r["drafts_equal"] and r["rounds_equal"] == [True] * 5
    for part in ("target_decode_ms", "target_verify_ms", "draft_eager_ms", "draft_static_ms", "append2_eager_ms",
                 "append2_static_ms"):
        assert r[part] > 0, part
    assert r["round_static_in_decode_steps"] > 0
    assert r["loop_ar_ms_per_token"] > 0 and r["loop_static_ms_per_round"] > 0
    assert r["loop_static_tau"] >= 1.0 and r["loop_eager_tau"] == r["loop_static_tau"]  # same drafts, same acceptance
    assert r["loop_eager_same_tokens_as_ar"] and r["loop_static_same_tokens_as_ar"]  # fp32 on the CPU: exact
    kernel = r["attention"]["kernel"]  # the attention kernel's steps beside SDPA's, on the same context
    assert r["attention"]["used"] == "sdpa" and kernel["decode_ms"] > 0 and kernel["verify_ms"] > 0
    assert kernel["same_argmax"] and kernel["max_logit_difference"] < 1e-4
    assert kernel["same_drafts"] and kernel["draft_static_ms"] > 0


def test_round_bench_with_compiled_steps_on_the_cpu(runs):
    """bench_round.py --compile: the target's steps and the static draft step through torch.compile (bench.compile),
    the static drafter still drafting the eager one's tokens and the loop emitting autoregressive decoding's."""
    r = runs["round_compiled"].result()
    assert r["compile"] == "aot_eager" and r["drafts_equal"] and r["rounds_equal"] == [True] * 5
    assert r["loop_static_same_tokens_as_ar"] and r["round_static_in_decode_steps"] > 0
    assert set(r["verify"]) == {"2", "3"}
    # --draft-variants: the static draft with fp32 and bf16 weights, captured as is and compiled, side by side
    variants = r["draft_variants"]
    assert set(variants) == {"float32", "float32+compiled", "bfloat16", "bfloat16+compiled"}
    assert all(v["draft_ms"] > 0 and v["in_decode_steps"] > 0 for v in variants.values())
    assert variants["float32"]["same_drafts"] and variants["float32+compiled"]["same_drafts"]  # fp32, traced: exact


def test_round_profile_sets_each_verify_against_the_decode_step(monkeypatch):
    """bench_round.py --profile: every part profiled by bench_components.kernel_breakdown, and each verify's
    excess over the decode step by kernel group (a group only one of them has counts from zero)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components
    import bench_round
    import torch

    calls = []

    def breakdown(fn, device):
        name = fn()
        calls.append((name, device))
        if name == "draft":
            raise RuntimeError("no profiler here")
        groups = {"decode": {"matmul": 10.0, "attention": 2.0}, "verify4": {"matmul": 13.0, "attention": 2.5, "other": 1.0},
                  "verify2": {"matmul": 11.0, "attention": 2.0}, "append2": {"other": 3.0}}[name]
        return {"groups_us": groups}

    class Engine:
        def forward(self, ids, start, layer_ids):
            return "decode" if ids.shape[0] == 1 else f"verify{ids.shape[0]}"

    class Static:
        def draft(self, first, position):
            return "draft"

    monkeypatch.setattr(bench_components, "kernel_breakdown", breakdown)
    out = bench_round.profile_parts(Engine(), Static(), torch.zeros(1), torch.zeros(4), [2], [0], 40, lambda: "append2")
    assert [c[0] for c in calls] == ["decode", "verify4", "verify2", "draft", "append2"] and {c[1] for c in calls} == {"cuda"}
    assert out["verify4"]["excess_over_decode_us"] == {"attention": 0.5, "matmul": 3.0, "other": 1.0}
    assert out["verify2"]["excess_over_decode_us"] == {"attention": 0.0, "matmul": 1.0}
    assert out["draft"]["error"].startswith("RuntimeError") and "excess_over_decode_us" not in out["append2"]


def test_drafter_step_block_variants_parse_or_name_the_bad_item():
    """bench_drafter_step.py --block-variants: BLOCKxANCHORS items, and a clear error naming a malformed one."""
    import argparse

    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_drafter_step

    assert bench_drafter_step.block_variants("9x64,9x112,") == [(9, 64), (9, 112)]
    for bad in ("9", "9x", "1x64", "9x0", "ax64", "9x64x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="BLOCKxANCHORS"):
            bench_drafter_step.block_variants(f"16x64,{bad}")


def test_gdn_check_compares_the_fused_path_or_turns_it_off_where_it_fails(short_qwen, monkeypatch):
    """bench_components.gdn_check, before any timing: the fused GDN layer middle against the unfused one on the same
    prompt (the kernels under Triton's interpreter here), and where the fused path raises, the error recorded and
    the engine left unfused, so that one broken kernel does not cost the rest of a device run."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components
    import qdflash.engine.qwen3_5 as qwen3_5
    from qdflash.engine import build_engine

    assert bench_components.gdn_check(build_engine(short_qwen, max_len=64), "cpu") == {"gdn_fused_check": "kernels off: one torch path"}
    engine = build_engine(short_qwen, max_len=64, kernels=True)
    good = bench_components.gdn_check(engine, "cpu", tokens=24, block=4)
    assert good["gdn_fused_check.max_abs"] < 1e-4 * good["gdn_fused_check.logit_scale"] and engine.fuse_gdn

    def broken(*args, **kwargs):
        raise RuntimeError("no such PTX")

    monkeypatch.setattr(qwen3_5, "gated_delta_step", broken)
    bad = bench_components.gdn_check(engine, "cpu", tokens=24, block=4)
    # the error and where it was raised, innermost frame first (bench_components.error_text)
    assert list(bad) == ["gdn_fused_check.error"] and not engine.fuse_gdn
    assert bad["gdn_fused_check.error"].startswith("RuntimeError: no such PTX (at test_bench_components.py:")
    assert "broken <- qwen3_5.py:" in bad["gdn_fused_check.error"]
    assert bench_components.unfused_gdn_arm(engine, None, "cpu", None, 1.0)["target16_unfused_gdn"].startswith("skipped: the fused")


def test_gdn_step_bench_variants_run_one_layer_and_agree(monkeypatch):
    """bench_gdn_step.py's variants on one tiny layer through the kernels (Triton's interpreter here; the script
    itself needs CUDA for its timings): dot, given, two_phase and chunked (the block kernels also with the b / a dot in
    the kernel) give the same outputs for a 4-token block and a decode step (to fp32 rounding), so a device run times
    the same computation six ways; bad --variants and --launches values are clear errors."""
    import argparse

    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_gdn_step

    monkeypatch.setitem(bench_gdn_step.SHAPE, "key_heads", 1)
    for key, value in dict(heads=2, dk=16, dv=16, hidden=32).items():
        monkeypatch.setitem(bench_gdn_step.SHAPE, key, value)
    for tokens in (4, 1):
        layer = bench_gdn_step.layer_inputs(tokens, 5, "cpu", torch.Generator().manual_seed(tokens))
        layer = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in layer.items()}
        layer["ba_product"] = layer["x"] @ layer["ba"].T  # from the fp32 copies, as the dot computes it
        start, outs = layer["state"].clone(), {}
        kept = ("two_phase_dot_kept",) if tokens > 1 else ()  # (a block with states only)
        for variant in ("dot", "given", "two_phase", "two_phase_dot", "chunked", "chunked_dot") + kept:
            layer["state"].copy_(start)
            outs[variant] = bench_gdn_step.run(layer, 16, 4, tokens > 1, variant)
        for variant in ("given", "two_phase", "two_phase_dot", "chunked", "chunked_dot") + kept:
            torch.testing.assert_close(outs[variant], outs["dot"], atol=1e-5, rtol=1e-5)
    assert bench_gdn_step.variant_list("dot,two_phase") == ["dot", "two_phase"]
    for bad in ("dot,dot", "dot,fast", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--variants"):
            bench_gdn_step.variant_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="--launches"):
        bench_gdn_step.launch_list("16x4,16")


def test_kernel_groups_put_inductors_kernels_named_after_a_fused_int4_op_with_inductor():
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    group = bench_components.kernel_group
    # names as the H200 profile of 2026-12-05-h200-gdn-warps recorded them
    assert group("triton_red_fused__to_copy_add_marlin_w4_mm_mean_mul_pow_rsqrt_8") == bench_components.INDUCTOR
    assert group("void marlin::Marlin<1125899906909960l, 256, 1, 8, 8, true, 4, 2, false>(int4 const*)").startswith("int4")
    assert group("void at::native::tinygemm_m16n8k16_chunk_kernel<at::native::ALayout_RM<>>").startswith("int4")
    assert group("_gemv_kernel") == "gemv (ours)" and group("_gated_delta_step_kernel") == "gated delta (ours)"
    assert group("nvjet_hsh_64x32_64x16_2x1_v_bz_splitK_TNN") == "cuBLAS matmul" and group("Memset (Device)") == "memcpy / memset"
    # the tensor-core W4 kernels, one row and 2-16 (2026-12-06-h100-w4-mma), and inductor's kernel named after their op
    assert group("_w4_mma_kernel") == group("_w4_mma_rows_kernel") == "w4 mma (ours)"
    assert group("triton_poi_fused_mul_silu_split_w4_mma_mm_4") == bench_components.INDUCTOR
    assert group("_gated_rms_norm_kernel") == "gated norm (ours)"  # kernels.gated_norm
    assert group("_qk_norm_rope_kernel") == "qk norm rope (ours)"  # kernels.qk_norm_rope


def test_main_run_targets_take_the_engines_gdn_block_kernel_unless_told():
    """bench_components' main-run engines run a 16-bit model's verify blocks through the two-phase GDN kernel (the
    engine's default), and through the step kernel with --gdn-step-kernel; they replay rollbacks unless --no-gdn-replay."""
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    target = bench_components.build_target("tiny", "cpu", torch.bfloat16)
    args = argparse.Namespace(attention="sdpa", gdn_ba=["dot"], gdn_step_kernel=False)
    assert bench_components.target_engine(target, args, 32).gdn_two_phase
    args.gdn_step_kernel = True
    assert not bench_components.target_engine(target, args, 32).gdn_two_phase
    # the engines keep a two-phase verify block's GDN inputs for a replay (the engine's default) unless --no-gdn-replay
    args.gdn_step_kernel = False
    assert bench_components.target_engine(target, args, 32).gdn_replay
    args.no_gdn_replay = True
    assert not bench_components.target_engine(target, args, 32).gdn_replay


def test_attention_steps_bench_sets_the_two_engines_side_by_side(monkeypatch):
    """bench_layer_tails.py --attention-steps on the CPU (a tiny shape, fp32, the interpreter, no compile or graphs):
    the engine with kernels.qk_norm_rope and the one without give the same logits for a decode step and a verify
    block, the first through the launch and the second not, and each arm's rounds are timed."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_layer_tails

    import qdflash.engine.qwen3_5 as qwen3_5
    import qdflash.kernels.decode_attention as attention_module

    monkeypatch.setattr(attention_module, "MAX_SPLITS", 2)  # the interpreter's time (test_engine says why)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setenv("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "1")  # compiled_step sets it: undone after
    launches, fused = [], qwen3_5.qk_norm_rope.qk_norm_rope
    monkeypatch.setattr(qwen3_5.qk_norm_rope, "qk_norm_rope", lambda qkv, *a: launches.append(qkv.shape[0]) or fused(qkv, *a))
    args = argparse.Namespace(shape="tiny", device="cpu", dtype=torch.float32, layers=2, context=20, rounds=2, reps=1)
    r = bench_layer_tails.attention_steps(args)
    assert r["t1.logits_max_abs"] < 1e-4 and r["t16.logits_max_abs"] < 1e-4
    assert all(r[f"{arm}.t{t}_us"] > 0 for arm in ("kernel", "inductor") for t in (1, 16))
    assert set(r["t16.saved_us_per_layer"]) == {"median", "min", "max"}
    # the kernel arm's steps only (its 20-token prefill runs SDPA): each attention layer, once for the logits and in
    # each round 3 warm-up calls and a timed one (device_timer's); the other arm never
    assert sorted(set(launches)) == [1, 16] and launches.count(1) == launches.count(16) == 2 * (1 + 2 * (3 + 1))


def test_layer_tails_bench_checks_both_launches_on_a_tiny_shape(monkeypatch):
    """bench_layer_tails.py on the CPU (Triton's interpreter, fp32, its graphs and compile replaced by plain calls: the
    script times on CUDA only): the gated norm kernel gives the module's output for a decode step and a verify block."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_layer_tails

    monkeypatch.setattr(bench_layer_tails, "graph_ms", lambda fn, reps: fn() and 1.0)
    monkeypatch.setattr(bench_layer_tails, "copies_past_l2", lambda nbytes: 2)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setenv("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "1")  # compiled_step sets it: undone after
    for key, value in dict(key_heads=1, heads=2, dk=16, dv=16).items():  # the GDN shape it reads (bench_gdn_step's)
        monkeypatch.setitem(bench_layer_tails.SHAPE, key, value)
    for t in (1, 4):
        norm = bench_layer_tails.gated_norm_rows(t, "cpu", 1, torch.float32)
        assert norm["max_abs"] < 1e-5 and 0 <= norm["equal_fraction"] <= 1 and norm["kernel_us"] == norm["inductor_us"] == 1e3 / 2


def test_replay_check_sets_replayed_rollbacks_against_kept_states(short_qwen, monkeypatch):
    """replay_check (before the GPU run's timings): with the two-phase block's replay on (--gdn-replay; here the fp32
    tiny model through the interpreter), rollbacks into a block replayed and with every state
    kept give the same states and logits; and the engine is left replaying. Off, there is nothing to check; a replay
    whose states differ turns it off."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    from qdflash.engine import build_engine

    engine = build_engine(short_qwen, max_len=64, kernels=True)
    engine.gdn_replay = True
    assert bench_components.replay_check(engine, "cpu")["gdn_replay_check"].startswith("no replay")  # fp32: no two-phase
    engine.gdn_two_phase = True
    r = bench_components.replay_check(engine, "cpu", tokens=8, block=3, keeps=(1,))
    assert r == {"gdn_replay_check.state_max_abs": 0.0, "gdn_replay_check.logits_max_abs": 0.0}, r
    assert engine.gdn_replay and engine.length == 0
    # a replay that leaves the state as it was (here: replays nothing) is caught, and the run keeps every state
    import qdflash.engine.qwen3_5 as qwen3_5

    monkeypatch.setattr(qwen3_5, "gated_delta_replay", lambda tables, n: None)
    r = bench_components.replay_check(engine, "cpu", tokens=8, block=3, keeps=(1,))
    assert r["gdn_replay_check.state_max_abs"] > 0 and r["gdn_replay_check.error"].startswith("the replayed states differ")
    assert not engine.gdn_replay
    engine.gdn_replay = True  # under captured verify blocks it does not switch the replay (the engine would refuse)
    engine.capture([3], cuda_graphs=False)
    assert bench_components.replay_check(engine, "cpu", tokens=8, block=3, keeps=(1,)) == {
        "gdn_replay_check.error": "not checked: the engine holds captured steps (the check runs before capture)"}


def test_arms_that_change_an_engines_gdn_path_clear_its_captured_blocks_first(tiny_qwen, monkeypatch):
    """The unfused-GDN arm measures an engine that holds captured verify blocks (the base's): with the replay on, the
    engine refuses a change of fuse_gdn under them, so the arm clears them first, and again before restoring it."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    from qdflash.engine import build_engine

    engine = build_engine(tiny_qwen, max_len=64, kernels=True)
    engine.gdn_two_phase = engine.gdn_replay = True  # (fp32 tiny: set as a 16-bit model has them)
    engine.capture([3], cuda_graphs=False)
    seen = []

    def measured(engine, *args):  # the arm's measurement: a captured block, as measure_target leaves it
        seen.append(engine.fuse_gdn)
        engine.capture([3], cuda_graphs=False)
        return {"measured": True}

    monkeypatch.setattr(bench_components, "measure_target", measured)
    assert bench_components.unfused_gdn_arm(engine, None, "cpu", None, 0.0) == {"measured": True}
    assert seen == [False] and engine.fuse_gdn and not engine.graphs


def test_drafter_qk_kernel_arm_times_the_step_with_the_kernel_and_keeps_its_failure(tiny_llama, monkeypatch):
    """--drafter-qk-kernel's arm: the drafter's step again with DrafterEngine.qk_norm_rope_kernel (here uncompiled:
    Triton's interpreter does not trace), its drafts against the eager step's and its time over the step's; a
    failure is the arm's result; the engine is left without the kernel either way."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    from qdflash.drafter import init_drafter
    from qdflash.drafter.static import DrafterEngine

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=2, seed=7).eval()
    engine = DrafterEngine(drafter, max_len=32, attention="kernel", kernels=True)
    engine.append(torch.randn(8, len(drafter.config.target_layer_ids) * drafter.config.hidden_size), 0)
    engine.draft_logits(drafter.mask_id, 8)
    used = []

    def step():
        used.append(engine.qk_norm_rope_kernel)
        with torch.no_grad():
            return engine._step(engine._bucket(), None)[1]

    eager = step()
    monkeypatch.setattr(bench_components, "compiled_step", lambda fn, compile: fn)
    monkeypatch.setattr(bench_components, "graphed", lambda fn, device: fn)
    args = argparse.Namespace(compile=True, reps=1)
    forward = torch.zeros(eager.shape[0], int(eager.max()) + 2)
    forward[torch.arange(eager.shape[0]), eager.long()] = 2.0  # the drafter's forward, its top token the eager draft's
    forward[0, -1] = 3.0  # but for row 0, where the draft is 1.0 below the top
    r = bench_components.drafter_qk_kernel_arm(engine, step, eager, args, lambda fn, reps: (fn(), 0.5)[1], "cpu", "d", 1.0,
                                               forward)
    assert r["d.qk_kernel_drafts_agree"] == 1.0 and r["d.step_compiled_qk_kernel_ms"] == 0.5
    assert r["d.qk_kernel.drafts_max_gap"] == 1.0 and r["d.qk_kernel.drafts_agree_with_forward"] == pytest.approx(1 - 1 / eager.shape[0])
    assert r["d.qk_kernel_speedup"] == 2.0 and used[1:] == [True, True] and not engine.qk_norm_rope_kernel
    r = bench_components.drafter_qk_kernel_arm(engine, lambda: 1 / 0, eager, args, None, "cpu", "d", 1.0)
    assert r["d.qk_kernel_error"].startswith("ZeroDivisionError") and not engine.qk_norm_rope_kernel


def test_replay_in_graph_checks_a_captured_block_left_what_a_rollback_replays(short_qwen, monkeypatch):
    """replay_in_graph (after a verify block is captured, with the replay on): the captured block writes the state
    before it and its tokens' inputs to the engine's own buffers, so replaying none of its tokens gives the state before
    it and all of them the state it left, exactly; the states are restored after. A block that kept its inputs
    somewhere else (here: a copy of the scratch, as a graph could) is caught; with the replay off there is no check."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_components

    import qdflash.engine.qwen3_5 as qwen3_5
    from qdflash.engine import build_engine
    from qdflash.engine.graphs import stacked_states

    engine = build_engine(short_qwen, max_len=64, kernels=True)
    engine.gdn_two_phase = engine.gdn_replay = True
    engine.forward(torch.arange(1, 9), 0)
    engine.capture([3], cuda_graphs=False, lengths=[64])
    verify, block = engine.graph_for(3, None, 11), torch.tensor([5, 6, 7])
    states = stacked_states(engine)
    r = bench_components.replay_in_graph(engine, verify, block, 8, "t")
    assert r == {"t.n0_max_abs": 0.0, "t.n3_max_abs": 0.0}, r
    assert torch.equal(stacked_states(engine), states)  # restored
    step = qwen3_5.gated_delta_step
    for kept in engine.kept.values():  # (else the last run's inputs, the same block's, are still there)
        kept.zero_()
    monkeypatch.setattr(qwen3_5, "gated_delta_step",
                        lambda *a, kept=None, **k: step(*a, kept=None if kept is None else kept.clone(), **k))
    r = bench_components.replay_in_graph(engine, verify, block, 8, "t")
    assert r["t.n0_max_abs"] == 0.0 and r["t.n3_max_abs"] > 0 and r["t.error"].startswith("the captured block"), r
    engine.graphs = {}
    engine.gdn_replay = False
    assert bench_components.replay_in_graph(engine, verify, block, 8, "t") == {}
