#!/usr/bin/env bash
# On the H200: keep one carried piece outside the checkout.  bash scripts/airgap/receive.sh .gpu-stage/part-NN
set -euo pipefail
source "$(dirname "$0")/env.sh"
part=${1:?usage: receive.sh .gpu-stage/part-NN}
mkdir -p "$QDFLASH_STAGE/pieces"
cp "$part/piece" "$QDFLASH_STAGE/pieces/$(basename "$part")"
cp "$part/MANIFEST" "$QDFLASH_STAGE/MANIFEST"
echo "pieces on this machine: $(ls "$QDFLASH_STAGE/pieces" | tr '\n' ' ')(of $(python3 -c "import json;print(json.load(open('$QDFLASH_STAGE/MANIFEST'))['pieces'])"))"
