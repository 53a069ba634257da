#!/usr/bin/env bash
# On the H200: bring a trained drafter back, its weights in bf16 and cut into pieces that a call can
# return (8 files of at most 16 MiB), so that it can be studied on the CPU here (e.g. with the target
# converted from the same GGUF). A 2-layer drafter of the Qwen2.5-0.5B shape is ~68 MB in bf16: 5 pieces.
#   bash scripts/airgap/fetch_drafter.sh EXPERIMENT [NODE]      # NODE: stage2 (default), stage1, gptq_w4g128, ...
# Here, from the call's files_at:
#   mkdir -p drafter && cat <files_at>/drafter.safetensors.part-* > drafter/model.safetensors \
#     && cp <files_at>/drafter-config.json drafter/config.json && sha256sum -c <files_at>/drafter.sha256
# Only floating tensors are cast; what is packed (a compressed drafter's ints) stays as it is.
set -euo pipefail
source "$(dirname "$0")/env.sh"
experiment=${1:?usage: fetch_drafter.sh EXPERIMENT [NODE]}; node=${2:-stage2}
src=$QDFLASH_RESULTS/$experiment/drafter/$node/drafter
[ -f "$src/model.safetensors" ] || { echo "fetch_drafter: no drafter at $src"; exit 2; }
out=${OUT:-/tmp/out}; work=$(mktemp -d)
python3 - "$src/model.safetensors" "$work/model.safetensors" <<'EOF'
import sys

import torch
from safetensors.torch import load_file, save_file

state = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, sys.argv[2])
EOF
(cd "$work" && sha256sum model.safetensors | sed 's#model.safetensors#drafter/model.safetensors#' > "$out/drafter.sha256")
# a call returns at most 8 files: the pieces, the config and the sha256 must fit (a 2-layer drafter at the
# 4B shape, ~2.5x the 0.5B one, would not: bring it back over several calls, or compressed)
pieces=$(( ($(stat -c %s "$work/model.safetensors") + 15 * 1048576 - 1) / (15 * 1048576) ))
if [ "$pieces" -gt 6 ]; then rm -rf "$work"; echo "fetch_drafter: $pieces pieces of 15 MiB, more than the 6 a call can return beside the config and sha256"; exit 2; fi
split -b 15M -d -a 2 "$work/model.safetensors" "$out/drafter.safetensors.part-"
cp "$src/config.json" "$out/drafter-config.json"
rm -rf "$work"
echo "fetch_drafter: $node of $experiment -> $(ls "$out"/drafter.safetensors.part-* | wc -l) pieces ($(du -ch "$out"/drafter.safetensors.part-* | tail -1 | cut -f1))"
