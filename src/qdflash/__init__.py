"""qdflash: quantize the target, quantize the drafter (DFlash speculative decoding pipeline)."""

__version__ = "0.1.0"
