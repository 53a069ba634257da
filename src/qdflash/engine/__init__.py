"""Lean inference models of our own (gpt-fast style) that run the target's weights with static caches.

    engine = build_engine(target, max_len=4096)     # llama-style targets today
    logits, features = engine.forward(ids, start)    # ids [T] at positions start..start+T-1

The model code is a few hundred lines with nothing between the math and the tensors: fused q/k/v and
gate/up projections, one static KV cache written in place (a rollback is a change of length: no copy),
so that the decode step and the verify block can later be captured as CUDA graphs. Families: llama
and Qwen2 (`llama.py`; Qwen2 adds q/k/v biases) and the Qwen3.5 hybrid (`qwen3_5.py`: Gated DeltaNet
with per-position recurrent states kept during a verify, so a rollback restores the exact state
without feeding tokens again). Others get a clear error, and `qdflash.spec` then runs transformers'
forward.

`batched.BatchGenerator` runs the same weights over many rows at once (self-distillation data:
continuous batching, one CUDA graph per batch bucket), for all three families.
"""

from .batched import BatchGenerator
from .llama import LeanLlama, build_engine
from .qwen3_5 import LeanQwen35

__all__ = ["BatchGenerator", "LeanLlama", "LeanQwen35", "build_engine"]
