#!/usr/bin/env bash
# On the H200, after run.sh has made an experiment's data/bf16, a PTQ target (target/$PTQ, default
# ptq_gptq_w4g32) and gates/bf16: QAD runs with other settings from that one PTQ artifact, each one's
# quality gates started as soon as it is done (beside the next run's training), every node exactly as
# the DAG would run it (scripts/bench/run_node.py: the profile's overrides, then these).
#   bash scripts/airgap/qad_sweep.sh EXPERIMENT "lr=5e-6,steps=400" "lr=2e-6,steps=400" ...
#   PTQ=ptq_gptq_w8g32 bash scripts/airgap/qad_sweep.sh EXPERIMENT "lr=1.1e-7,steps=400"
# Each argument is comma-separated qad.* overrides; its runs land in $QDFLASH_RESULTS/EXPERIMENT/sweep/
# (qad_<grid>_<overrides> and gates-qad_<grid>_<overrides>), their logs in $OUT. Why not DAG variants:
# the DAG's targets are keyed by method / bits / group only, and a sweep of the QAD recipe is a one-off.
set -uo pipefail
source "$(dirname "$0")/env.sh"
experiment=${1:?usage: qad_sweep.sh EXPERIMENT OVERRIDES...}; shift
res=$QDFLASH_RESULTS/$experiment; out=${OUT:-/tmp/out}; ptq=${PTQ:-ptq_gptq_w4g32}
for need in data/bf16 "target/$ptq" gates/bf16; do
  [ -f "$res/$need/metrics.json" ] || { echo "qad_sweep: $res/$need is not a finished node (run run.sh first)"; exit 3; }
done
mkdir -p "$res/sweep" "$out"
gates=()
for spec in "$@"; do
  name=qad_${ptq#ptq_}_$(echo "$spec" | tr ',=' '_-')
  overrides=$(echo "$spec" | tr ',' '\n' | sed 's/^/qad./')
  echo "qad_sweep: $name ($(echo $overrides))"
  # shellcheck disable=SC2086  # one override per word
  if ! python3 scripts/bench/run_node.py gpu qad "$res/sweep/$name" qad,eval data_dir="$res/data/bf16" \
       ptq_dir="$res/target/$ptq" $overrides > "$out/$name.log" 2>&1; then
    echo "qad_sweep: $name failed (log: $name.log)"; continue
  fi
  python3 scripts/bench/run_node.py gpu quality_gate "$res/sweep/gates-$name" data,gates variant="$res/sweep/$name/model" \
    reference="$res/gates/bf16" > "$out/gates-$name.log" 2>&1 &
  gates+=($!)
done
status=0
for pid in "${gates[@]}"; do wait "$pid" || status=1; done
echo "qad_sweep: done (gates exit status $status)"
exit $status
