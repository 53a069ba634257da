#!/usr/bin/env bash
# On the H200, one detached job (issue 21): where a cached drafter training step's time goes, then the copy study
# (config/gpu-drafter-copy.yaml) and each of its drafters decoding the benchmark prompts, the filler among them,
# as the 12k study's drafter was (results/published/2026-12-03-h200-drafter-12k), all within SECONDS.
#   bash scripts/airgap/detach.sh start main env QDFLASH_GIT_COMMIT=<sha> PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
#     bash scripts/airgap/study_copy.sh 1500
# $OUT/extras.tgz (refreshed after each step): the step benchmark's JSON and log, each decoding benchmark's
# study.json and logs, each snakemake call's log; the nodes' own files come in results.tgz (pack.sh).
set -uo pipefail
source "$(dirname "$0")/env.sh"
end=$((SECONDS + ${1:?usage: study_copy.sh SECONDS}))
R=$QDFLASH_RESULTS; E=h200-drafter-copy; S=$R/$E/scaling; X=$R/extras
mkdir -p "$X" "$OUT"
left() { echo $((end - SECONDS)); }
keep() { tar -czf "$OUT/extras.tgz" -C "$R" extras $([ -d "$R/studycopy" ] && echo studycopy); }
bench() {  # bench NAME: the study's decoding benchmark of drafter NAME (OUT unset: its files stay in $R/studycopy)
  [ -d "$S/drafter/$1/drafter" ] && [ "$(left)" -gt 30 ] || { echo "study_copy: no drafter $1 or no time left, no benchmark"; return; }
  OUT= timeout "$(left)" python3 scripts/bench/study_drafter.py bench "$R/studycopy" "$1" --drafter "$S/drafter/$1/drafter" \
    --data "$S/data/merged" --verify-tokens 6,block --verify-adaptive > "$X/bench-$1.log" 2>&1
  echo "study_copy: bench $1 exit $? ($(left) s left)"; keep
}
timeout 240 python3 scripts/bench/bench_drafter_step.py --cached --profile --steps 10 \
  --out "$X/drafter_step_cached.json" > "$X/drafter_step_cached.log" 2>&1
echo "study_copy: step benchmark exit $? ($(left) s left)"; keep
bash scripts/airgap/run.sh $(($(left) - 500)) gpu $E "$S/drafter/n12000-L2" --configfile config/gpu-drafter-copy.yaml
cp "$OUT/snakemake.log" "$X/snakemake-1.log"; keep
bench n12000-L2
if [ "$(left)" -gt 450 ]; then  # the arm's training (~6 min) and its benchmark (~2 min) need at least this
  bash scripts/airgap/run.sh $(($(left) - 150)) gpu $E drafter_scaling --configfile config/gpu-drafter-copy.yaml
  cp "$OUT/snakemake.log" "$X/snakemake-2.log"; keep
  bench n12000-L2-p8
fi
echo "study_copy: done ($(left) s left)"
