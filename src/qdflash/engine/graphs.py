"""One engine step (a fixed number of tokens) captured as a CUDA graph.

A decode step of a 4B model is ~1,000 kernels; launched one by one from Python they cost more than the
weights take to read. Captured once, the whole step is one launch. What makes an engine step
capturable: fixed shapes (T tokens; attention reads a fixed length of the static cache, masked by
position; one graph per power-of-two length),
positions as a tensor, and caches updated in place, so replaying the graph reads and writes the same
buffers the eager code would. Inputs are copied into static buffers before each replay; the outputs
are the graph's own buffers (valid until the next replay of this graph).
"""

from __future__ import annotations

import torch


class StaticStep:
    """The captured step's computation without the capture: the same static buffers, full-cache
    attention and tensor positions, run eagerly. On the CPU this is how the graph path is tested."""

    def __init__(self, engine, tokens: int, layer_ids: list[int] | None, attend_len: int, step=None):
        self.engine, self.layer_ids, self.attend_len, self.step = engine, layer_ids, attend_len, step or engine._step
        self.ids = torch.zeros(tokens, dtype=torch.long, device=engine.device)
        self.offsets = torch.arange(tokens, device=engine.device)
        self.positions = self.offsets.clone()

    def __call__(self, ids: torch.Tensor, start: int):
        self.ids.copy_(ids)
        torch.add(self.offsets, start, out=self.positions)
        with torch.no_grad():
            return self.step(self.ids, self.positions, self.attend_len, self.layer_ids)


class CapturedStep:
    def __init__(self, engine, tokens: int, layer_ids: list[int] | None, attend_len: int, warmup: int = 2, step=None):
        self.engine = engine
        step = step or engine._step
        device = engine.device
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.offsets = torch.arange(tokens, device=device)
        # warmup and capture run the step for real: at the last positions this graph can serve, which
        # are written before they are ever read, and with the recurrent states restored afterwards
        self.positions = self.offsets + attend_len - tokens
        saved = snapshot(engine)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):  # compile Triton kernels, pick cuBLAS algorithms: nothing may allocate lazily while capturing
                step(self.ids, self.positions, attend_len, layer_ids)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.out = step(self.ids, self.positions, attend_len, layer_ids)
        restore(engine, saved)

    def __call__(self, ids: torch.Tensor, start: int):
        self.ids.copy_(ids)
        torch.add(self.offsets, start, out=self.positions)
        self.graph.replay()
        return self.out


def snapshot(engine) -> dict:
    """Copies of the recurrent states: the only caches a step reads before writing."""
    return {i: s.clone() for i, s in getattr(engine, "state", {}).items()}


def restore(engine, saved: dict) -> None:
    for i, s in saved.items():
        engine.state[i].copy_(s)
