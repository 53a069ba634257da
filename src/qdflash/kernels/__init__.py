"""GPU kernels (Triton) for the batch-1 fast path: a W4A16 matmul that stays memory-bound from 1 to
16 rows (`w4a16`), a 16-bit GEMV for one row where it beats cuBLAS (`gemv`), and the Gated DeltaNet recurrence that keeps the state after every position of a
verify block, alone or with the rest of a step's layer middle fused around it (`gated_delta`), and that layer's
gated RMSNorm in one launch (`gated_norm`).

Both run wherever Triton does: on a CUDA device, and on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is first imported), which is how the tests check them
against the plain-torch reference on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..errors import QdflashError

MAX_ROWS = 16  # rows the matmul kernels take, padded to one tensor-core tile: a verify block of 16 tokens


def row_bucket(rows: int) -> int:
    """What a kernel is tuned for at `rows` rows: 1 (a decode step) or MAX_ROWS (2-16: a verify block)."""
    return 1 if rows == 1 else MAX_ROWS


def first_best(items, score):
    """The first of `items` with the highest `score(item)`: max(items, key=score) as a loop, which dynamo traces. Why:
    dynamo cannot trace max / min with a key, and a config heuristic runs inside a compiled step (an untuned shape):
    a graph break there splits every layer's step (scripts/bench/check_step_graphs.py)."""
    best, pick = None, None
    for item in items:
        value = score(item)
        if best is None or value > best:  # strictly: the first of equals, as max
            best, pick = value, item
    if best is None:
        raise ValueError("first_best of nothing")
    return pick


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


_PDL = [False]  # `pdl`'s switch: read by a launch as it happens (a captured graph keeps the launch it recorded)


@contextlib.contextmanager
def pdl(enabled: bool = True):
    """Within it, the kernels that support it launch with programmatic dependent launch (PDL: `launch_pdl`, their
    programs' `jit.pdl_start`): on a Hopper GPU a launch may then be scheduled while the kernel before it in the stream
    still runs, and waits in its programs for that kernel's results, instead of the whole launch waiting in the stream.
    Why: a batch-1 step is ~300 launches of a few microseconds each, and the time between them is ~10-20% of a
    compiled W4 step. `EngineBase.pdl` sets it around a capture."""
    before = _PDL[0]
    _PDL[0] = bool(enabled)
    try:
        yield
    finally:
        _PDL[0] = before


def pdl_enabled() -> bool:
    """Whether a launch now is to use PDL (`pdl`)."""
    return _PDL[0]


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on `device` can launch with PDL: a CUDA GPU of compute capability 9 or later (griddepcontrol)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


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


def fastest(configs, call, copies: int, times: list | None = None):
    """(config, ms per weight copy) of the config whose `call(config)` (one matmul per weight copy)
    replays fastest in a CUDA graph; (None, inf) without configs. `times`: each config's (config, ms) appended."""
    best = (None, float("inf"))
    for config in configs:
        ms = graph_ms(lambda: call(config)) / copies
        if times is not None:
            times.append((config, ms))
        if ms < best[1]:
            best = (config, ms)
    return best
