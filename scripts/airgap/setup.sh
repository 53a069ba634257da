#!/usr/bin/env bash
# On the H200: join the pieces, check the sha256, install all wheels in one pip call. Idempotent.
set -euo pipefail
source "$(dirname "$0")/env.sh"
if [ -f "$QDFLASH_STAGE/READY" ]; then echo "setup: already done"; exit 0; fi
manifest=$QDFLASH_STAGE/MANIFEST
[ -f "$manifest" ] || { echo "setup: no pieces received (run receive.sh first)"; exit 3; }
count=$(python3 -c "import json;print(json.load(open('$manifest'))['pieces'])")
want=$(python3 -c "import json;print(json.load(open('$manifest'))['sha256'])")
missing=""
for i in $(seq 0 $((count - 1))); do
  p=$(printf "part-%02d" "$i"); [ -f "$QDFLASH_STAGE/pieces/$p" ] || missing="$missing $p"
done
[ -z "$missing" ] || { echo "setup: missing pieces:$missing (the machine was given back in between? send them again)"; exit 3; }
cat $(for i in $(seq 0 $((count - 1))); do printf "$QDFLASH_STAGE/pieces/part-%02d " "$i"; done) > "$QDFLASH_STAGE/bundle.tar.gz"
got=$(sha256sum "$QDFLASH_STAGE/bundle.tar.gz" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "setup: sha256 mismatch ($got != $want)"; exit 4; }
echo "setup: bundle intact (sha256 $got)"
rm -rf "$QDFLASH_STAGE/bundle" "$QDFLASH_SITE" && tar -xzf "$QDFLASH_STAGE/bundle.tar.gz" -C "$QDFLASH_STAGE"
rm -f "$QDFLASH_STAGE/bundle.tar.gz" "$QDFLASH_STAGE"/pieces/*
if [ -d "$QDFLASH_STAGE/bundle/results" ]; then  # node folders brought along (stage.py --results)
  mkdir -p "$QDFLASH_RESULTS" && cp -rn "$QDFLASH_STAGE/bundle/results/." "$QDFLASH_RESULTS/"
  echo "setup: results brought along: $(cd "$QDFLASH_STAGE/bundle/results" && find . -name metrics.json -printf '%h ')"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$QDFLASH_SITE" "$QDFLASH_STAGE"/bundle/wheels/*.whl
python3 -c "import snakemake, hydra, wandb, transformers, gguf, torch; print('setup: ok | torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))"
# every third-party module src/qdflash imports (lazy ones too) must import here, or a node fails mid-run
# (the server's fastapi/uvicorn/openai too, when the bundle brought them: stage.py's serve set)
python3 "$(dirname "$0")/preflight.py" --wheels "$QDFLASH_STAGE/bundle/wheels" || { echo "setup: not ready (preflight)"; exit 5; }
touch "$QDFLASH_STAGE/READY"
