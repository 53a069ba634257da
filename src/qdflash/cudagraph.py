"""Capturing work as a CUDA graph, the one way the engine, the kernel tuner and the GPU benchmarks do it.

Warm-up runs go on a side stream first (they compile Triton kernels and let cuBLAS pick algorithms:
nothing may allocate lazily during capture), then one run is recorded; replaying the graph later
launches all of its kernels at once.
"""

from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object], warmup: int = 2, device=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, what the captured call returned: its output buffers, rewritten by every replay)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = fn()
    return graph, out
