#!/usr/bin/env bash
# On a 2-GPU machine: drafter training throughput on 1 GPU and on 2 GPUs (torchrun, DDP), the same
# global batch and steps, on the default profile's data brought along (stage.py --results).
#   bash scripts/bench/ddp_throughput.sh [STEPS [BATCH]]   -> $OUT/ddp-b<BATCH>/{gpus1,gpus2}/metrics.json
set -uo pipefail
source "$(dirname "$0")/../airgap/env.sh"   # the results folder the data was brought to (docs/airgap.md)
steps=${1:-60}; batch=${2:-16}; out=${OUT:-/tmp/out}/ddp-b$batch; mkdir -p "$out"
data=$QDFLASH_RESULTS/default/data/bf16
[ -f "$data/train.tokens.jsonl" ] || { echo "ddp_throughput: $data was not brought along"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
args=(model=smollm2-135m device=cuda dtype=bfloat16 stage=1 "data_dir=$data" experiment=ddp-throughput
      drafter.num_layers=2 drafter.block_size=16 "drafter_train.steps=$steps" "drafter_train.batch_size=$batch"
      drafter_train.anchors_per_seq=32 drafter_train.max_length=1024 drafter_train.eval_every=100000
      drafter_train.heldout_samples=16 drafter_train.cache_features=false drafter_train.attention=sdpa)
for gpus in 1 2; do
  dest=$QDFLASH_RESULTS/ddp-throughput/gpus$gpus
  rm -rf "$dest"
  if [ "$gpus" = 1 ]; then launch=(python3 -m); else launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" -m); fi
  "${launch[@]}" qdflash.stages.train_drafter "${args[@]}" "out_dir=$dest" > "$out/gpus$gpus.log" 2>&1
  echo "gpus $gpus: exit $?"; tail -3 "$out/gpus$gpus.log"
  mkdir -p "$out/gpus$gpus" && cp "$dest/metrics.json" "$dest/config.yaml" "$out/gpus$gpus/" 2>/dev/null
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for g in (1, 2):
    m = json.loads((out / f"gpus{g}" / "metrics.json").read_text())
    steady = (m["train.seconds"] - m["train.first_step_seconds"]) / max(m["train.steps"] - 1, 1)
    print(f"gpus {g}: world {m['train.world_size']}, {m['train.steps']} steps x {m['train.batch_size']} seq, "
          f"train {m['train.seconds']} s (first step {m['train.first_step_seconds']} s), steady {steady*1e3:.1f} ms/step, "
          f"{m['train.batch_size'] / steady:.1f} seq/s, final loss {m['train.loss_curve'][-1]}, tau {m['final.tau']}")
PY
