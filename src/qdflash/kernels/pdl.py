"""Programmatic dependent launch (PDL) for our kernels: `set_pdl` turns it on, `pdl_for` says whether a launch uses
it, and `pdl_wait` is what each kernel calls in every program before it touches another kernel's output, `pdl_release`
what it calls once its main loop is done.

Why: a decode step is ~400 kernels of a few microseconds each, and between two of them the GPU drains the first,
flushes its writes and only then starts the second, whose first weight loads wait a DRAM round trip more. A matmul's
weight is no kernel's output, so with PDL a launch starts its programs while the previous kernel's last ones still
run, issues its first weight tile's loads, and only then waits for the previous kernel's results (its input row) and
before writing anything.

Why the stream's order holds: a kernel launched with PDL may start before the kernel before it has ended, and only
that one: every earlier kernel has ended already (a PDL kernel of ours waits for its predecessor in every program
before it ends; any other kernel starts only after its predecessor ended). So what may be read before the wait is
what the previous kernel cannot be writing: weights (no kernel writes them) and, for the GDN step, the layer's
recurrent state (only that layer's GDN kernel writes it, never the kernel right before it). Every program waits
unconditionally, reads every other input and writes only after it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None

_PDL = [False]  # set_pdl


def set_pdl(on: bool) -> None:
    """Launch the matmul kernels (`gemv`, `w4a16`) and the fused GDN step (`gated_delta.gated_delta_step`) with
    programmatic dependent launch from now on: every later launch, a tuning's timings and a captured step's kernels
    (the module docstring says why). Off by default until it is measured in a step on the H200. Takes effect only
    where every visible GPU has compute capability 9 or more (the CPU's interpreter and older GPUs have no grid
    dependency control)."""
    _PDL[0] = bool(on) and torch.cuda.is_available() and all(
        torch.cuda.get_device_capability(i)[0] >= 9 for i in range(torch.cuda.device_count()))


def pdl_for(t: torch.Tensor) -> bool:
    """Whether a kernel on `t`'s device launches with PDL (`set_pdl`). Read while torch.compile traces a step,
    so it only reads a flag: the device check is `set_pdl`'s."""
    return _PDL[0] and t.is_cuda


def launch_options(pdl: bool) -> dict:
    """The keyword arguments that make a Triton launch a PDL one (none for a plain launch)."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def pdl_wait():
        """In a kernel launched with PDL: wait until the previous kernel has ended and its writes are visible."""
        tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release():
        """In a kernel launched with PDL, once its main loop is done: let the next kernel's programs start (they wait in
        turn before reading what this one writes). Not right after `pdl_wait`: the next kernel's programs then take SM
        slots while this one still has programs to run (a GEMV of ~1,300 programs runs in waves), and on the H200 a
        16-bit Qwen3.5-4B decode step released that early ran 3.429 ms against 3.065 without PDL
        (results/published/2026-12-05-h200-epilogues-pdl)."""
        tl.extra.cuda.gdc_launch_dependents()
