#!/usr/bin/env bash
# The device job of this publication (started by scripts/airgap/detach.sh after setup.sh; PROVENANCE.md).
# Logs go to $L (outside $OUT: a call brings back at most 8 files), packed into $OUT/logs.tgz at each stage.
set -uo pipefail
source scripts/airgap/env.sh
E=h200-qad-sweep; R=$QDFLASH_RESULTS/$E; L=$QDFLASH_GPU_ROOT/logs; mkdir -p "$L"
pack() { tar -czf "$OUT/logs.tgz" -C "$L" . ; OUT=$OUT bash scripts/airgap/pack.sh > /dev/null; echo "job: packed ($1) at ${SECONDS}s"; }
echo "job: QAD step benchmark"
timeout 200 python3 scripts/bench/bench_qad_step.py --shape qwen2.5-coder-0.5b --batch-sizes 8,16 \
  --out "$L/qad_step.json" > "$L/qad_step.log" 2>&1; tail -n 4 "$L/qad_step.log" | head -n 2; pack bench
echo "job: DAG (data, GPTQ w4g32, 16-bit gates)"
OUT=$L bash scripts/airgap/run.sh 900 gpu $E "$R/target/ptq_gptq_w4g32" "$R/gates/bf16" > "$L/dag.log" 2>&1; tail -n 3 "$L/dag.log"; pack dag
echo "job: QAD sweep"
Q="eval_every=100,checkpoint_every=1000"
OUT=$L bash scripts/airgap/qad_sweep.sh $E "lr=5e-6,steps=400,$Q" "lr=2e-6,steps=400,$Q" "lr=1e-5,steps=400,$Q" 2>&1 | tee "$L/sweep.log"; pack sweep
echo "job: W4 round benchmarks"
for c in 2048 8192 256; do
  timeout 240 python3 scripts/bench/bench_round.py --shape qwen2.5-coder-0.5b --w4 32 --drafter-dtype float32 \
    --attention sdpa,kernel --verify-tokens 6 --context $c --reps 20 --new 16 --out "$L/round-w4-$c.json" > "$L/round-w4-$c.log" 2>&1
  echo "job: round at $c: exit $?"; pack "round $c"
done
echo "job: done"
