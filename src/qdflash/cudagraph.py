"""Capturing work as a CUDA graph, the one way the engine, the kernel tuner and the GPU benchmarks do it.

Warm-up runs go on a side stream first (they compile Triton kernels and let cuBLAS pick algorithms:
nothing may allocate lazily during capture), then one run is recorded; replaying the graph later
launches all of its kernels at once.

Every graph captured here is kept alive until the process ends. torch 2.11 keys cuBLAS workspaces by
capture stream, and destroying a graph clears the workspaces of its stream, including the one still
embedded in other live graphs captured on that stream (pytorch/pytorch#193402). Tuning kernels
captures and drops hundreds of timing graphs, and the engine replaces graphs, so the captured
steps replayed later would read freed workspace: an illegal memory access (seen on the H200 in an
fp32 benchmark after the second engine's tuning). Timing graphs hold only their small outputs.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIVE: list = []  # every graph captured in this process (see the module docstring)


def capture(fn: Callable[[], object], warmup: int = 2, device=None, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, what the captured call returned: its output buffers, rewritten by every replay).
    `pool`: a memory pool shared with other graphs (`torch.cuda.graph_pool_handle()`): only for
    graphs whose outputs nobody reads after another one of them replays."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        out = fn()
    _LIVE.append(graph)
    return graph, out
