"""Does the static drafter's attention kernel give every block row the eager drafter's logits, at the
Qwen2.5-Coder-0.5B shape with block 16 (the tests use smaller blocks), with and without a window?
Random weights, fp32, Triton's interpreter on the CPU.

    python scripts/investigations/drafter_kernel_rows.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_round import Target, random_model  # noqa: E402

from qdflash.drafter.model import init_drafter  # noqa: E402
from qdflash.drafter.static import DrafterEngine  # noqa: E402
from qdflash.spec import DrafterSession  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    target = Target(random_model("qwen2.5-coder-0.5b", 2, torch.device("cpu"), torch.float32))
    drafter = init_drafter(target, block_size=16, num_layers=2)
    for p in drafter.parameters():
        p.data.normal_(0, 0.05)  # away from init, so that rows differ
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    for context, window in ((100, None), (1500, 1024)):
        features = torch.randn(context, width)
        eager = DrafterSession(drafter, window)
        eager.append(features, 0)
        engine = DrafterEngine(drafter, max_len=2048, cuda_graphs=False, attention="kernel")
        engine.session(window).append(features, 0)
        (logits_e, drafts_e), (logits_k, drafts_k) = eager.draft_logits(5, context), engine.draft_logits(5, context)
        rows = (logits_e - logits_k).abs().amax(-1)
        print(f"context {context}, window {window}: largest logit difference per block row "
              f"{' '.join(f'{x:.1e}' for x in rows.tolist())}; same drafts {drafts_e.tolist() == drafts_k.tolist()}")


if __name__ == "__main__":
    main()
