"""GPU kernels (Triton) for the batch-1 fast path: a W4A16 matmul that stays memory-bound from 1 to
16 rows (`w4a16`), a 16-bit GEMV for one row where it beats cuBLAS (`gemv`), and the Gated DeltaNet recurrence that keeps the state after every position of a
verify block, alone or with the rest of a step's layer middle fused around it (`gated_delta`).

Both run wherever Triton does: on a CUDA device, and on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is first imported), which is how the tests check them
against the plain-torch reference on a machine without a GPU.

`set_pdl(True)` launches the matmul kernels and the fused GDN step with programmatic dependent launch on
Hopper and later (each then goes through a custom op of ours, since torch.compile drops a Triton launch's
options): what it is for and why it keeps the stream's order is in its docstring.
"""

from __future__ import annotations

import os

import torch

from ..errors import QdflashError

MAX_ROWS = 16  # rows the matmul kernels take, padded to one tensor-core tile: a verify block of 16 tokens
_PDL = [False]  # set_pdl


def set_pdl(on: bool) -> None:
    """Launch the matmul kernels (`gemv`, `w4a16`) and the fused GDN step (`gated_delta.gated_delta_step`) with
    programmatic dependent launch where the GPU has it
    (Hopper and later), from now on: every later launch, a tuning's timings and a captured step's kernels.

    Why: a decode step is ~400 kernels of a few microseconds each, and between two of them the GPU drains
    the first, flushes its writes and only then starts the second, whose first weight loads wait a DRAM
    round trip more. A matmul's weight is no kernel's output, so with PDL a launch starts its programs
    while the previous kernel's last ones still run, issues its first weight tile's loads, and only then
    waits (`gdc_wait`) for the previous kernel's results (its input row) and before writing anything.
    Every program waits unconditionally, so a kernel still ends after the one before it: the stream's
    order holds for the kernels around it, whether they use PDL or not. (The GDN step also loads the layer's
    recurrent state before waiting: only that layer's kernel writes it, in an earlier step.)
    Off by default until it is measured in a step on the H200. Takes effect only where every visible GPU has
    compute capability 9 or more (the CPU's interpreter and older GPUs have no grid dependency control)."""
    _PDL[0] = bool(on) and torch.cuda.is_available() and all(
        torch.cuda.get_device_capability(i)[0] >= 9 for i in range(torch.cuda.device_count()))


def pdl_for(t: torch.Tensor) -> bool:
    """Whether a kernel on `t`'s device launches with PDL (`set_pdl`). Read while torch.compile traces a step,
    so it only reads a flag: the device check is `set_pdl`'s."""
    return _PDL[0] and t.is_cuda


def row_bucket(rows: int) -> int:
    """What a kernel is tuned for at `rows` rows: 1 (a decode step) or MAX_ROWS (2-16: a verify block)."""
    return 1 if rows == 1 else MAX_ROWS


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_usable(device: torch.device | str, kernels: bool | str = "auto") -> bool:
    """Whether to run the Triton kernels for tensors on `device`. "auto": on CUDA where triton is
    installed. True: also on the CPU, which needs Triton's interpreter (`TRITON_INTERPRET=1` before
    triton is imported; the tests do this). False: never."""
    if kernels == "auto":
        return triton_available() and torch.device(device).type == "cuda"
    if kernels and not triton_available():
        raise QdflashError("kernels=True but triton is not installed")
    if kernels and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise QdflashError("kernels=True on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    return bool(kernels)


def graph_ms(fn, replays: int = 10) -> float:
    """Median ms of one replay of `fn` captured as a CUDA graph (after a warm-up that compiles): how
    a kernel is timed for tuning, as it runs in a captured decode step (launch overhead excluded)."""
    from ..cudagraph import capture

    graph, _ = capture(fn, warmup=1)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copies_past_l2(weight_bytes: int, l2_bytes: int = 64 << 20) -> int:
    """How many copies of a weight, read in turn, keep it from being served by the L2 cache (>= 4x L2):
    a decode step reads every weight once, from HBM, so that is how a kernel must be timed."""
    return max(2, -(-4 * l2_bytes // weight_bytes))


def fastest(configs, call, copies: int):
    """(config, ms per weight copy) of the config whose `call(config)` (one matmul per weight copy)
    replays fastest in a CUDA graph; (None, inf) without configs."""
    best = (None, float("inf"))
    for config in configs:
        ms = graph_ms(lambda: call(config)) / copies
        if ms < best[1]:
            best = (config, ms)
    return best
