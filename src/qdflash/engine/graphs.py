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

from ..cudagraph import capture


class StaticStep:
    """The captured step's computation without the capture: the same static buffers, attention over a
    fixed length of the cache and tensor positions, run eagerly. On the CPU this is how the graph
    path is tested; `CapturedStep` records exactly this call."""

    def __init__(self, engine, tokens: int, layer_ids: list[int] | None, attend_len: int, step=None, tree: bool = False):
        self.engine, self.layer_ids, self.attend_len, self.step = engine, layer_ids, attend_len, step or engine._step
        self.ids = torch.zeros(tokens, dtype=torch.long, device=engine.device)
        self.offsets = torch.arange(tokens, device=engine.device)
        self.positions = self.offsets.clone()
        # a tree's step (`engine.forward_tree`): the nodes' slots, and each node's ancestors as bits
        self.slots = self.offsets.clone() if tree else None
        self.tree = (1 << (self.offsets + 1)) - 1 if tree else None  # (a chain until the first call)

    def _load(self, ids: torch.Tensor, start: int, depths: torch.Tensor | None = None,
              bits: torch.Tensor | None = None) -> None:
        self.ids.copy_(ids)
        if self.tree is None:
            torch.add(self.offsets, start, out=self.positions)
            return
        torch.add(self.offsets, start, out=self.slots)
        torch.add(self.offsets if depths is None else depths, start, out=self.positions)
        if bits is not None:
            self.tree.copy_(bits)

    def _run(self):
        with torch.no_grad():
            if self.tree is None:
                return self.step(self.ids, self.positions, self.attend_len, self.layer_ids)
            return self.step(self.ids, self.positions, self.attend_len, self.layer_ids, slots=self.slots, tree=self.tree)

    def __call__(self, ids: torch.Tensor, start: int, depths: torch.Tensor | None = None, bits: torch.Tensor | None = None):
        self._load(ids, start, depths, bits)
        return self._run()


class CapturedStep(StaticStep):
    """The same step recorded as a CUDA graph: a call copies the inputs and replays it.

    Warm-up and capture run the step for real at positions attend_len - tokens .. attend_len - 1 (the
    recurrent states are restored afterwards): capture before a generation, or while the cache holds
    fewer positions than that, so no position in use is overwritten."""

    def __init__(self, engine, tokens: int, layer_ids: list[int] | None, attend_len: int, warmup: int = 2, step=None,
                 tree: bool = False):
        super().__init__(engine, tokens, layer_ids, attend_len, step, tree)
        self._load(torch.zeros(tokens, dtype=torch.long), attend_len - tokens)
        saved = snapshot(engine)
        self.graph, self.out = capture(self._run, warmup, engine.device)
        restore(engine, saved)

    def __call__(self, ids: torch.Tensor, start: int, depths: torch.Tensor | None = None, bits: torch.Tensor | None = None):
        self._load(ids, start, depths, bits)
        self.graph.replay()
        return self.out


def snapshot(engine) -> dict:
    """Copies of the recurrent states: the only caches a step reads before writing."""
    return {i: s.clone() for i, s in getattr(engine, "state", {}).items()}


def stacked_states(engine) -> torch.Tensor:
    """Every recurrent state stacked into one tensor: a copy, to compare one moment's states with another's."""
    return torch.stack(list(engine.state.values()))


def restore(engine, saved: dict) -> None:
    for i, s in saved.items():
        engine.state[i].copy_(s)
