"""Triton helpers more than one kernel calls (one definition of a rounding rule each)."""

from __future__ import annotations

# Inline PTX: the word {word}'s nibble pairs (i, i + 4) as bf16 pairs q = nibble - 8 in r0-r3, by the bit tricks
# w4a16.BF16_NIBBLES's comment explains (the caller declares r0-r3, one, bias, nz and scales them)
NIBBLE_PAIRS = """mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
mov.b32 nz, 0x80008000;
shr.u32 r1, {word}, 4;
shr.u32 r2, {word}, 8;
shr.u32 r3, {word}, 12;
lop3.b32 r0, {word}, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 r1, r1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 r2, r2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 r3, r3, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 r0, r0, one, bias;
fma.rn.bf16x2 r1, r1, one, bias;
fma.rn.bf16x2 r2, r2, one, bias;
fma.rn.bf16x2 r3, r3, one, bias;
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = tl = None

if triton is not None:

    @triton.jit
    def reduce_splits_last(part_ptr, y_ptr, counts_ptr, block, cols, N, stride_split, SPLITS: tl.constexpr):
        """A split-K GEMV's reduction by the last of a column block's SPLITS programs to finish, in its launch: each has
        stored its partial sums of columns `cols` (fp32, split s at part_ptr + s * stride_split) and counts itself on the
        block's counter: a CTA barrier first (every thread's stores done), then one atomic by one thread, acq_rel at gpu
        scope (a release of this program's stores, an acquire of the others'). The one that counts last sums the block's
        SPLITS partials in a fixed order (deterministic), reading them from L2 (`.cg`: its SM's L1 is not coherent with
        the other programs'), writes them in y's dtype and sets the counter back to 0 for the next launch. Why: reduced
        apart, the partial sums are a launch of their own (torch's sum), which at batch 1 costs about what the split
        saves. SPLITS: a power of two."""
        tl.debug_barrier()
        if tl.atomic_add(counts_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            rs = tl.arange(0, SPLITS)
            ok = cols < N
            parts = tl.load(part_ptr + rs[:, None] * stride_split + cols[None, :], mask=ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + cols, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(counts_ptr + block, 0)

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A kernel's first lines under programmatic dependent launch (`kernels.pdl`; PDL a launch's constexpr, with
        `launch_pdl`): wait until the kernel before it in the stream has finished and its writes are visible (before
        this program reads or writes anything), then let the next kernel launch. So this kernel depends on its
        predecessor's completion as without PDL, and a successor that waits in its own programs (ours do, here) on
        this one's; what goes is the time a launch took once its predecessor ended. Inductor's kernels under PDL
        (`triton.enable_pdl`) wait only before what depends on the node before them: `bench_components --pdl` sets
        the steps' logits against the same steps captured without PDL (a race would show there). Nothing without PDL."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def silu_rounded(x, dt: tl.constexpr):
        """silu of x as a 16-bit model's unfused ops give it: x rounded to the model's dtype `dt` (the op before's
        output), silu in fp32 (torch's: x / (1 + e^-x)), rounded to `dt` again; returned in fp32."""
        x = x.to(dt).to(tl.float32)
        return (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)

    @triton.jit
    def swiglu_rounded(gate, up, dt: tl.constexpr):
        """silu(gate) * up as a 16-bit model's unfused eager ops give it (a matmul's gate and up outputs rounded to
        `dt`, `silu_rounded`, the product in fp32 rounded to `dt`), in `dt`: a matmul's epilogue on its (gate, up)
        pairs. (A compiled step's inductor kernel does not round silu in between: its logits may differ slightly.)"""
        return (silu_rounded(gate, dt) * up.to(dt).to(tl.float32)).to(dt)
