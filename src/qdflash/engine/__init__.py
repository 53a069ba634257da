"""Lean inference models of our own (gpt-fast style) that run the target's weights with static caches.

    engine = build_engine(target, max_len=4096)     # llama-style targets today
    logits, features = engine.forward(ids, start)    # ids [T] at positions start..start+T-1

The model code is a few hundred lines with nothing between the math and the tensors: fused q/k/v and
gate/up projections, one static KV cache written in place (a rollback is a change of length: no copy),
so that the decode step and the verify block can later be captured as CUDA graphs. What every engine
shares is `base.py`. Families: llama and Qwen2 (`llama.py`; Qwen2 adds q/k/v biases) and the Qwen3.5 hybrid (`qwen3_5.py`: Gated DeltaNet
with per-position recurrent states kept during a verify, or optionally on a GPU the block's inputs to re-run the
accepted tokens' state updates from, so a rollback restores the state without feeding tokens again). Others get a clear error, and `qdflash.spec` then runs transformers'
forward.

`batched.BatchGenerator` runs the same weights over many rows at once (self-distillation data:
continuous batching, one CUDA graph per batch bucket), for all three families.
"""

from ..errors import QdflashError
from .batched import BatchGenerator
from .llama import LeanLlama
from .qwen3_5 import LeanQwen35


def build_engine(target, max_len: int | None = None, kernels: bool | str = "auto", attention: str = "sdpa",
                 gdn_ba: str | None = None):
    """The lean model for `target` (sharing its embedding, norms and LM head; fused copies of the
    projections, packed 4-bit where the target's layers are QuantLinear on the symmetric 4-bit grid).
    `kernels`: the Triton kernels ("auto": on CUDA); `attention`: EngineBase.set_attention; `gdn_ba` (Qwen3.5
    only; None: its default): LeanQwen35's. Raises QdflashError for families not built yet."""
    model_type = getattr(target.config, "model_type", "?")
    builders = {"llama": LeanLlama, "qwen2": LeanLlama, "qwen3_5_text": LeanQwen35}  # qwen2: llama + q/k/v biases
    if model_type not in builders:
        raise QdflashError(f"no lean engine for model type {model_type!r} yet (built: {', '.join(builders)})")
    options = {}
    if gdn_ba is not None:
        if builders[model_type] is not LeanQwen35:
            raise QdflashError(f"gdn_ba={gdn_ba!r}: only a Qwen3.5 engine has Gated DeltaNet layers (this is {model_type!r})")
        options["gdn_ba"] = gdn_ba
    try:
        engine = builders[model_type](target.model, max_len or getattr(target.config, "max_position_embeddings", 4096), kernels,
                                      **options)
    except TypeError as err:  # a projection the engine cannot run (Projection.of says which)
        raise QdflashError(f"lean engine: {err}") from err
    engine.set_attention(attention)
    return engine


__all__ = ["BatchGenerator", "LeanLlama", "LeanQwen35", "build_engine"]
