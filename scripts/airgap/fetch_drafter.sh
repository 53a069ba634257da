#!/usr/bin/env bash
# On the H200: bring a trained drafter back, its weights in bf16 and cut into pieces that a call can
# return (8 files of at most 16 MiB, 64 MiB together), so that it can be studied on the CPU here (e.g. with the target
# converted from the same GGUF). A 2-layer drafter of the Qwen2.5-0.5B
# shape is ~68 MB in bf16: 5 pieces, over two calls (pieces 0-3, then 4).
#   bash scripts/airgap/fetch_drafter.sh EXPERIMENT [NODE] [FIRST]  # NODE: stage2 (default), stage1, gptq_w4g128, ...
#                                                   # FIRST: the first piece this call returns (0, then 4, ...)
# Here, from the call's files_at:
#   mkdir -p drafter && cat <files_at 1>/drafter.safetensors.part-* <files_at 2>/drafter.safetensors.part-* \
#     > drafter/model.safetensors && cp <files_at 1>/drafter-config.json drafter/config.json \
#     && sha256sum -c <files_at 1>/drafter.sha256          # every call's pieces, in call order
# Only floating tensors are cast; what is packed (a compressed drafter's ints) stays as it is.
set -euo pipefail
source "$(dirname "$0")/env.sh"
experiment=${1:?usage: fetch_drafter.sh EXPERIMENT [NODE] [FIRST]}; node=${2:-stage2}; first=${3:-0}
[[ "$first" =~ ^[0-9]+$ ]] || { echo "fetch_drafter: FIRST must be a piece number (0, 4, ...), not '$first'"; exit 2; }
first=$((10#$first))  # "08" is piece 8, not an octal error
piece_kib=${QDFLASH_PIECE_KIB:-15360}  # 15 MiB: a call's limit is 16 MiB a file (the tests cut tiny drafters finer)
src=$QDFLASH_RESULTS/$experiment/drafter/$node/drafter
[ -f "$src/model.safetensors" ] || { echo "fetch_drafter: no drafter at $src"; exit 2; }
out=${OUT:-/tmp/out}; work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$src/model.safetensors" "$work/model.safetensors" <<'EOF'
import sys

import torch
from safetensors.torch import load_file, save_file

state = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, sys.argv[2])
EOF
(cd "$work" && sha256sum model.safetensors | sed 's#model.safetensors#drafter/model.safetensors#' > "$out/drafter.sha256")
# a call returns at most 8 files and 64 MiB together: 4 pieces of 15 MiB with the config and the sha256. A
# larger drafter (the 0.5B one: 5 pieces) comes back over several calls, FIRST naming the first piece of each
total=$(( ($(stat -c %s "$work/model.safetensors") + piece_kib * 1024 - 1) / (piece_kib * 1024) ))
[ "$first" -lt "$total" ] || { echo "fetch_drafter: FIRST=$first, but the drafter is $total pieces (0-$((total - 1)))"; exit 2; }
split -b "${piece_kib}K" -d -a 2 "$work/model.safetensors" "$work/drafter.safetensors.part-"
last=$(( first + 3 < total - 1 ? first + 3 : total - 1 ))
for i in $(seq "$first" "$last"); do mv "$work/drafter.safetensors.part-$(printf %02d "$i")" "$out/"; done
cp "$src/config.json" "$out/drafter-config.json"
echo "fetch_drafter: $node of $experiment -> pieces $first-$last of 0-$((total - 1)) ($(du -ch "$out"/drafter.safetensors.part-* | tail -1 | cut -f1))"
[ "$last" -eq $((total - 1)) ] || echo "fetch_drafter: the rest in the next call: bash scripts/airgap/fetch_drafter.sh $experiment $node $((last + 1))"
