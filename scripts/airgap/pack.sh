#!/usr/bin/env bash
# Pack what comes back from the H200 into $OUT/results.tgz: every node's metrics.json, config.yaml,
# logs and W&B offline runs, its tables (*.csv, *.md), figures (*.png) and per-item gate scores
# (scores.json), and the first 50 rows of each data file (the full data stays there).
set -euo pipefail
source "$(dirname "$0")/env.sh"
out=${OUT:-/tmp/out}; work=$(mktemp -d)
(cd "$QDFLASH_RESULTS" && find . -type f \( -name metrics.json -o -name config.yaml -o -name '*.log' -o -path '*/wandb/*' \
   -o -name '*.csv' -o -name '*.md' -o -name '*.png' -o -name scores.json \) \
   -not -path '*/tokens*' -print0 | xargs -0 -r cp --parents -t "$work")
(cd "$QDFLASH_RESULTS" && find . -type f -name '*.jsonl' -not -name '*.tokens.jsonl' -print0 |
   while IFS= read -r -d '' f; do mkdir -p "$work/$(dirname "$f")"; head -n 50 "$f" > "$work/${f%.jsonl}.head50.jsonl"; done)
tar -czf "$out/results.tgz" -C "$work" . && rm -rf "$work"
echo "pack: $(du -h "$out/results.tgz" | cut -f1) -> results.tgz"
