#!/usr/bin/env bash
# On the H200: run (or resume) the DAG for a profile within one call, then pack results into $OUT.
#   bash scripts/airgap/run.sh SECONDS PROFILE EXPERIMENT [targets / snakemake args...]   e.g. run.sh 520 gpu h200
#   bash scripts/airgap/run.sh 480 gpu h200 drafter_scaling      (the drafter scaling study)
# Snakemake resumes from the complete outputs in $QDFLASH_RESULTS (outside the checkout) at the next
# call; a node cut off by the time limit leaves only a *.partial-* folder, which is not taken as done.
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -f "$QDFLASH_STAGE/READY" ] || { echo "run: setup.sh has not finished on this machine"; exit 3; }
seconds=${1:?usage: run.sh SECONDS PROFILE EXPERIMENT [snakemake args]}; profile=${2:?profile}; experiment=${3:?experiment}
shift 3
mkdir -p "$QDFLASH_RESULTS" "${OUT:-/tmp/out}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "${OUT:-/tmp/out}/device.txt"
# targets and flags first: --config takes every word after it
# --keep-going: a failed node stops only what depends on it; the rest of the DAG still runs in this call
timeout --signal=INT "$seconds" python3 -m snakemake "$@" --cores all --rerun-incomplete --keep-going \
  --config profile="$profile" experiment="$experiment" results_dir="$QDFLASH_RESULTS" 2>&1 | tee "${OUT:-/tmp/out}/snakemake.log"
status=${PIPESTATUS[0]}
bash "$(dirname "$0")/pack.sh"
echo "run: snakemake exit status $status"
exit "$status"
