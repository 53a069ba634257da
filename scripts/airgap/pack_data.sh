#!/usr/bin/env bash
# On the H200: bring a generated data folder back, compressed, in pieces that the device tool returns
# (<= 15 MiB each; at most 8 files come back per call, results.tgz and logs included).
#   bash scripts/airgap/pack_data.sh RESULTS_SUBDIR NAME     e.g. pack_data.sh h200/scaling/data/merged scaling-data
# Here: cat NAME.tar.xz.part-* | tar -xJ -C results/<somewhere>
set -euo pipefail
source "$(dirname "$0")/env.sh"
src=$QDFLASH_RESULTS/${1:?results subfolder}; name=${2:?name}; out=${OUT:-/tmp/out}
[ -d "$src" ] || { echo "pack_data: $src does not exist"; exit 3; }
tar -C "$src" -cf - train.jsonl heldout.jsonl train.tokens.jsonl heldout.tokens.jsonl metrics.json config.yaml |
  xz -T0 -6 | split -b 15M -d -a 2 - "$out/$name.tar.xz.part-"
(cd "$out" && sha256sum "$name".tar.xz.part-* | tee "$name.sha256")
ls -la "$out"
