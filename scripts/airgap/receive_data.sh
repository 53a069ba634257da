#!/usr/bin/env bash
# On the H200: put a data folder brought back earlier by pack_data.sh into the results tree, so that
# a later session trains on exactly the same data instead of generating it again.
#   bash scripts/airgap/receive_data.sh CARRIED_DIR NAME RESULTS_SUBDIR
#   e.g. receive_data.sh .gpu-stage/scaling-data scaling-data h200/scaling/data/merged
# then run Snakemake with `--allowed-rules` naming only the rules downstream of that folder.
set -euo pipefail
source "$(dirname "$0")/env.sh"
src=${1:?carried folder}; name=${2:?name}; dest=$QDFLASH_RESULTS/${3:?results subfolder}
(cd "$src" && sha256sum -c "$name.sha256") || { echo "receive_data: checksum mismatch in $src"; exit 4; }
if [ -e "$dest" ]; then echo "receive_data: $dest exists already (left as it is)"; exit 0; fi
mkdir -p "$dest.partial" && cat "$src/$name".tar.xz.part-* | xz -dc | tar -x -C "$dest.partial" && mv "$dest.partial" "$dest"
echo "receive_data: $(wc -l < "$dest/train.tokens.jsonl") training rows -> $dest"
