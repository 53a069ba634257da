"""The Triton kernels against their torch references (on the CPU through Triton's interpreter; on a
GPU for real): the W4A16 matmul equals F.linear with the dequantized weight, and the Gated DeltaNet
recurrence kernel equals the engine's torch loop, per-position states included."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from qdflash.engine.qwen3_5 import recurrence_torch  # noqa: E402
from qdflash.errors import QdflashError  # noqa: E402
from qdflash.kernels.gated_delta import gated_delta_recurrence  # noqa: E402
from qdflash.kernels.w4a16 import Config, candidate_configs, pack_int4, unpack_int4, w4a16_matmul  # noqa: E402
from qdflash.quant.grid import GridSpec, compute_scale, dequantize, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class GraphRecorder:
    """A torch.compile backend that keeps the FX graphs dynamo hands it and runs them as they are: what a compiled
    step's trace holds, without a compiler."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm

    def ops(self) -> list:
        """The functions the first graph calls."""
        return [node.target for node in self.graphs[0].graph.nodes if node.op == "call_function"]


def quantized(n, k, group, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    spec = GridSpec(4, group, True)
    scale, zero = compute_scale(w, spec, scale_dtype=torch.bfloat16)
    q = quantize(w, scale, zero, spec)
    return q, scale, dequantize(q, scale, zero, spec)


def test_pack_round_trip_and_range():
    q, _, _ = quantized(8, 64, 32)
    q[0, :8] = torch.tensor([-8, 7, 0, -1, 1, 3, -5, 6])  # both ends of the grid, nibble 7 in the sign bit
    words = pack_int4(q)
    assert words.shape == (8, 8) and words.dtype == torch.int32
    assert torch.equal(unpack_int4(words), q.to(torch.int8))
    with pytest.raises(QdflashError, match="outside the symmetric 4-bit range"):
        pack_int4(torch.full((2, 8), 9, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 dot is broken; bf16 runs on the GPU bench
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_w4a16_matmul_equals_dequantized_linear(dtype, rows):
    n, k, group = 96, 512, 32
    q, scale, deq = quantized(n, k, group)
    words, scale = pack_int4(q).to(DEVICE), scale.to(DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    ref = x.float() @ deq.to(dtype).float().T.to(DEVICE)
    configs = candidate_configs(k, group, rows=rows)
    configs = [c for c in configs if c.block_n == 32 and c.block_k8 == 16][:3] + [c for c in configs if c.block_n != 32][:2]
    assert {c.split_k for c in configs} >= {1, 2}, "split-K must be among the configs checked"
    for config in configs:
        y = w4a16_matmul(x, words, scale, group, config)
        assert y.dtype == dtype and y.shape == (rows, n)
        torch.testing.assert_close(y.float(), ref, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_w4a16_reduces_its_k_splits_in_its_launch(dtype, monkeypatch):
    """With `counts` a one-row W4A16 call split over K sums its splits' partials in its own launch (the last program of
    each column block, `jit.reduce_splits_last`): the torch-summed result to the fp32 sums' order, no torch sum after it
    (one kernel launch), N not a multiple of the column block, two calls in a row on the same counts (each leaves them
    zero); one split, 2-16 rows and too few counts as before / a clear error."""
    from qdflash.kernels import w4a16 as w4_module

    n, k, group = 100, 1024, 32
    q, scale, _ = quantized(n, k, group)
    words, scale = pack_int4(q).to(DEVICE), scale.to(DEVICE, dtype)
    counts = w4_module.split_counts(n, DEVICE)
    g = torch.Generator().manual_seed(7)
    sums = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, f=torch.Tensor.sum, **kw: sums.append(1) or f(self, *a, **kw))
    for split in (2, 8):  # (every power-of-two split takes the same path: two of them)
        config = Config(8, 16, split)
        for _ in range(2):
            x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
            sums.clear()
            got = w4a16_matmul(x, words, scale, group, config, counts)
            assert not sums and got.dtype == dtype and got.shape == (1, n)
            want = w4a16_matmul(x, words, scale, group, config)  # partial sums reduced by torch
            assert sums
            torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5)
            assert int(counts.abs().sum()) == 0
    x5 = torch.randn(5, k, generator=g).to(DEVICE, dtype)  # 2-16 rows: the tensor-core kernel and torch's sum, as before
    torch.testing.assert_close(w4a16_matmul(x5, words, scale, group, Config(32, 16, 2), counts),
                               w4a16_matmul(x5, words, scale, group, Config(32, 16, 2)))
    with pytest.raises(QdflashError, match="one per column block"):
        w4a16_matmul(x, words, scale, group, Config(8, 16, 2), counts[:3])


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (as Triton's interpreter stores bf16) -> their fp32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns, rounded to nearest even (as PTX's .rn; no NaN here)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def run_ptx(asm: str, operands: dict) -> dict:
    """Execute the few PTX instructions our inline asm uses (mov / shr / and / lop3 / prmt on 32-bit patterns,
    fma.rn.bf16x2, setp / selp, ld.global from operands["memory"]) on `operands` ($n -> bits; "%laneid" for one that
    reads it), one lane's, returning
    every operand and register after it: the asm's text checked on the CPU, which neither the interpreter nor a
    compile for sm_90 runs. mma.sync is a warp's: `warp_mma` runs it."""
    regs = dict(operands)

    def value(token):
        token = token.strip()
        if "+" in token:  # an address with an offset: [reg+imm]
            base, offset = token.split("+")
            return value(base) + value(offset)
        if token.startswith("0f"):  # a float literal's bits
            return int(token[2:], 16)
        return int(token, 16) if token.startswith("0x") else int(token) if token.isdigit() else regs[token]

    def bf16(bits):
        return float(bf16_to_f32(np.array([bits]))[0])

    def to_bits(x):  # exact in fp32 here (a 4-bit times an 8-bit significand), then rounded to nearest even
        return int(f32_to_bf16(np.array([x]))[0])

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op.startswith("ld.global"):  # dst or {lo, hi} (v2.b32: one 64-bit value), [address]: operands["memory"][address]
            *dsts, address = (a.strip(" []{}") for a in args.split(","))
            bits, width = regs["memory"][value(address)], 64 if op.endswith(".b64") else 32
            if op.endswith(".v4.b32"):  # 16 bytes: two 64-bit cells, the memory's addresses bytes here
                assert value(address) % 16 == 0, f"run_ptx: {op} at {value(address)}, not 16-byte aligned"
                bits |= regs["memory"][value(address) + 8] << 64
            for i, dst in enumerate(dsts):
                regs[dst] = bits >> width * i & ((1 << width) - 1)
            continue
        if op in ("mov.b32", "mov.b64") and args.startswith("{"):  # unpack: {lo, hi}, src
            lo, hi, src = (a.strip(" {}") for a in args.replace("}", ",").split(",") if a.strip())
            bits = 16 if op == "mov.b32" else 32
            regs[lo], regs[hi] = value(src) & ((1 << bits) - 1), value(src) >> bits
            continue
        dst, *srcs = [a.strip() for a in args.split(",", 1)[0:1] + [args.split(",", 1)[1]]]
        if op in ("mov.b32", "mov.b64") and "{" in srcs[0]:  # pack: dst, {lo, hi}
            lo, hi = (value(a.strip(" {}")) for a in srcs[0].split(","))
            regs[dst] = lo | hi << (16 if op == "mov.b32" else 32)
            continue
        a = [value(t) for t in srcs[0].split(",")]
        if op in ("mov.b32", "mov.u32"):
            regs[dst] = a[0]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op in ("setp.eq.u32", "setp.ne.u32"):
            regs[dst] = (a[0] == a[1]) == (op == "setp.eq.u32")
        elif op == "selp.f32":
            regs[dst] = a[0] if a[2] else a[1]
        elif op == "prmt.b32":  # byte i of the result: byte (selector nibble i) of {a, b} (a's bytes 0-3, b's 4-7)
            pool = [(a[0] & 0xFFFFFFFF) >> 8 * i & 0xFF for i in range(4)] + [(a[1] & 0xFFFFFFFF) >> 8 * i & 0xFF for i in range(4)]
            regs[dst] = sum(pool[a[2] >> 4 * i & 7] << 8 * i for i in range(4))
        elif op == "shr.u32":
            regs[dst] = (a[0] & 0xFFFFFFFF) >> a[1]
        elif op == "lop3.b32":
            regs[dst] = sum(((a[3] >> ((a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1))) & 1) << i for i in range(32))
        elif op == "fma.rn.bf16x2":
            halves = [to_bits(bf16(a[0] >> s & 0xFFFF) * bf16(a[1] >> s & 0xFFFF) + bf16(a[2] >> s & 0xFFFF)) for s in (0, 16)]
            regs[dst] = halves[0] | halves[1] << 16
        else:
            raise AssertionError(f"run_ptx: no {op}")
    return regs


def test_bf16_nibbles_asm_dequantizes_a_word_as_the_reference_does():
    """BF16_NIBBLES (the fast W4 path's inline PTX) turns each int32 word of `pack_int4` and its bf16 scale into the
    word's 8 weights in column order, each round_bf16(q * scale): bit for bit what dequantize().to(bf16) gives, for
    every nibble value and scales of several magnitudes (its instructions executed by `run_ptx`)."""
    from qdflash.kernels.w4a16 import BF16_NIBBLES, dequantize_words

    g = torch.Generator().manual_seed(5)
    q = torch.cat([torch.arange(-8, 8).repeat(2), torch.randint(-8, 8, (160,), generator=g)]).to(torch.int8).view(-1, 32)
    words = pack_int4(q)  # [6, 4]: a row is one group of 32
    scale = (torch.rand(q.shape[0], 1, generator=g) * torch.logspace(-6, 2, q.shape[0])[:, None]).to(torch.bfloat16)
    want = (dequantize_words(words, scale, 32).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF).view(*words.shape, 8)
    for row in range(words.shape[0]):
        for i in range(words.shape[1]):
            scale_bits = int(scale[row, 0].view(torch.int16)) & 0xFFFF
            regs = run_ptx(BF16_NIBBLES, {"$8": int(words[row, i]) & 0xFFFFFFFF, "$9": scale_bits})
            assert [regs[f"${j}"] for j in range(8)] == want[row, i].tolist(), (row, i)


def warp_mma(lanes: list[dict], a_regs: list[str], b_regs: list[str], c_regs: list[str]) -> list[list[int]]:
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 of one warp, from each lane's registers as PTX's ISA lays
    out the fragments (g = lane / 4, t = lane % 4; register i of A holds a_2i low, a_2i+1 high): a0,a1 = A[g][2t, 2t+1],
    a2,a3 = A[g+8][2t, 2t+1], a4,a5 = A[g][2t+8, 2t+9], a6,a7 = A[g+8][2t+8, 2t+9]; b0,b1 = B[2t, 2t+1][g], b2,b3 =
    B[2t+8, 2t+9][g]; c0,c1 = C[g][2t, 2t+1], c2,c3 = C[g+8][2t, 2t+1]. Returns each lane's D as fp32 bits (fp64 sums)."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        halves = [bf16_to_f32(np.array([regs[r] >> s & 0xFFFF]))[0] for r in a_regs for s in (0, 16)]
        for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                                        (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]):
            A[row, col] = halves[i]
        halves = [bf16_to_f32(np.array([regs[r] >> s & 0xFFFF]))[0] for r in b_regs for s in (0, 16)]
        for i, k in enumerate([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]):
            B[k, g] = halves[i]
        for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            C[row, col] = np.array([regs[c_regs[i]]], dtype=np.uint32).view(np.float32)[0]
    D = A @ B + C
    return [[int(np.array([D[row, col]], dtype=np.float32).view(np.uint32)[0])
             for row, col in [(lane // 4, 2 * (lane % 4)), (lane // 4, 2 * (lane % 4) + 1),
                              (lane // 4 + 8, 2 * (lane % 4)), (lane // 4 + 8, 2 * (lane % 4) + 1)]] for lane in range(32)]


def run_warp(asm: str, operands: list[dict]) -> list[dict]:
    """Execute `asm` on a warp: each lane's instructions by `run_ptx` (operands[lane]), each mma.sync by `warp_mma`
    across the 32 lanes (its D, A, B, C registers read off the instruction), in program order. Returns each lane's
    registers after it."""
    import re

    lanes = [dict(o) for o in operands]
    segments = re.split(r"(mma\.sync[^;]*;)", asm.strip().strip("{}"))
    for segment in segments:
        if segment.startswith("mma.sync"):
            d, a, b, c = [[r.strip() for r in group.split(",")] for group in re.findall(r"\{([^}]*)\}", segment)]
            out = warp_mma(lanes, a, b, c)
            for regs, values in zip(lanes, out):
                regs.update(zip(d, values))
        elif segment.strip():
            lanes = [run_ptx("{" + segment + "}", regs) for regs in lanes]
    return lanes


@pytest.mark.parametrize("scales_given", [False, True])
def test_w4_mma_asm_gives_one_row_of_the_dequantized_product(scales_given):
    """The tensor-core one-row W4 kernel's PTX (w4_mma.MMA_WORD, then DIAGONAL) on `w4_mma.pack`'s words, one warp
    of its blocked layout (4 row pairs x 8 lanes along the words, 4 words a lane, two K tiles) executed on the CPU:
    the lanes' bit tricks by `run_ptx`, the mma by `warp_mma` (the ISA's fragment layout), the useful lanes picked by
    lane id. The row pairs' sums are x @ the weight dequantized and rounded to bf16 (fp32 sums), every row: the word's
    nibble order, the scale pairs and the diagonal agree."""
    from qdflash.kernels import w4_mma

    n, k, group = 8, 256, 32
    q, scale, deq = quantized(n, k, group, seed=3)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)
    x = torch.randn(k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = x.double() @ deq.to(torch.bfloat16).double().T
    mma_words, pairs = w4_mma.pack_words(words), w4_mma.pack_scales(scale)
    xs = x.view(torch.int64)
    memory = {i: int(v) & 0xFFFFFFFF for i, v in enumerate(pairs.flatten())}  # the scale pairs, row-major (MMA_WORD loads them)
    acc = [[0] * 4 for _ in range(32)]
    accs = [acc] * 4  # per register j (words 4 * (lane % 8) + j of a tile): each lane's c0..c3 as fp32 bits
    for tile in range(k // 4 // 32):
        for j in range(4):  # lane l holds pair l // 8, words tile * 32 + 4 * (l % 8) + j
            operands = []
            for lane in range(32):
                pair, word = lane // 8, tile * 32 + 4 * (lane % 8) + j
                address = pair * pairs.shape[1] + word * 4 // group
                if scales_given:  # LOAD_B32 first, its own op
                    address = run_ptx("{" + w4_mma.LOAD_B32 + "}", {"$1": address, "memory": memory})["$0"]
                operands.append({"$4": int(mma_words[pair, word]) & 0xFFFFFFFF, "$5": address,
                                 "memory": memory, "$6": int(xs[word]) & 0xFFFFFFFFFFFFFFFF,
                                 **{f"${7 + i}": accs[j][lane][i] for i in range(4)}})
            accs[j] = [[regs[f"${i}"] for i in range(4)] for regs in run_warp(w4_mma.word_asm(scales_given), operands)]
    got = np.zeros(n)
    for j in range(4):
        for lane in range(32):
            out = run_ptx(w4_mma.DIAGONAL, {"$2": accs[j][lane][0], "$3": accs[j][lane][1], "$4": accs[j][lane][2],
                                            "$5": accs[j][lane][3], "%laneid": lane})
            for row, reg in ((0, "$0"), (1, "$1")):
                got[2 * (lane // 8) + row] += np.array([out[reg]], dtype=np.uint32).view(np.float32)[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("m", [16, 5])
def test_w4_mma_rows_asm_gives_every_row_of_the_dequantized_product(m):
    """The 2-16-row kernel's PTX (w4_mma.rows_asm: 16 rows two mmas, up to 8 one) on `pack`'s words, one warp of its
    layout (lanes: 8 row pairs x 4 along 16-word tiles, 4 words a lane), run by `run_warp`: quad g feeds activation
    rows g and g + 8 (past m: row m - 1, as the kernel clamps), and lane t of quad g ends with row pair g times
    activation rows 2t, 2t + 1 (+ 8): with the 4 registers summed, X @ the weight dequantized and rounded to bf16.
    Each lane's scale pairs and activations for its 4 words are loaded first, as the kernel loads them, by
    LOAD_B32_X4 / LOAD_B64_X4 (one scale load, two 16-byte loads an activation row; the activations' memory
    byte-addressed and aligned)."""
    from qdflash.kernels import w4_mma

    n, k, group = 16, 128, 32
    q, scale, deq = quantized(n, k, group, seed=6)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    want = x.double() @ deq.to(torch.bfloat16).double().T
    mma_words, pairs = w4_mma.pack_words(words), w4_mma.pack_scales(scale)
    xs = x.view(torch.int64)  # [m, k / 4]
    memory = {i: int(v) & 0xFFFFFFFF for i, v in enumerate(pairs.flatten())}
    memory.update({1024 + 8 * i: int(v) & 0xFFFFFFFFFFFFFFFF for i, v in enumerate(xs.flatten())})  # activations' bytes
    high = m > 8
    asm, outs = w4_mma.rows_asm(high), 8 if high else 4
    first_acc = outs + (4 if high else 3)
    accs = [[[0] * outs for _ in range(32)] for _ in range(4)]
    run = lambda load, address: run_ptx(load, {"$4": address, "memory": memory})  # noqa: E731
    for tile in range(k // 4 // 16):
        loaded = []  # per lane, its 4 words' scale pairs and activations (rows a, b), loaded first
        for lane in range(32):
            pair, word = lane // 4, tile * 16 + 4 * (lane % 4)  # the lane's first word (LOAD_*_X4 read the first address)
            row_a, row_b = min(pair, m - 1), min(pair + 8, m - 1)
            s4 = run(w4_mma.LOAD_B32_X4, pair * pairs.shape[1] + word * 4 // group)
            xa4 = run(w4_mma.LOAD_B64_X4, 1024 + 8 * (row_a * xs.shape[1] + word))
            xb4 = run(w4_mma.LOAD_B64_X4, 1024 + 8 * (row_b * xs.shape[1] + word))
            loaded.append([(s4[f"${j}"], xa4[f"${j}"], xb4[f"${j}"]) for j in range(4)])
        for j in range(4):
            operands = []
            for lane in range(32):
                scale_pair, xa, xb = loaded[lane][j]
                regs = {f"${outs}": int(mma_words[lane // 4, tile * 16 + 4 * (lane % 4) + j]) & 0xFFFFFFFF,
                        f"${outs + 1}": scale_pair, f"${outs + 2}": xa,
                        **{f"${first_acc + i}": accs[j][lane][i] for i in range(outs)}}
                if high:
                    regs[f"${outs + 3}"] = xb
                operands.append(regs)
            accs[j] = [[regs[f"${i}"] for i in range(outs)] for regs in run_warp(asm, operands)]
    got = np.zeros((m, n))
    as_float = lambda bits: float(np.array([bits], dtype=np.uint32).view(np.float32)[0])  # noqa: E731
    for j in range(4):
        for lane in range(32):
            pair, t, c = lane // 4, lane % 4, accs[j][lane]
            for first, regs in ((0, c[:4]), (8, c[4:])):
                for i, (row, act) in enumerate([(0, 2 * t), (0, 2 * t + 1), (1, 2 * t), (1, 2 * t + 1)]):
                    if regs and first + act < m:
                        got[first + act, 2 * pair + row] += as_float(regs[i])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_w4_mma_packs_only_what_it_runs_and_refuses_the_rest():
    """Row pairs, bf16, CUDA, a tile that fills the GPU: elsewhere it is no candidate (the CPU here) and pack says why; the packed words keep every
    nibble (unpacked back by the documented order they are the ints again) and the scale pairs both scales."""
    from qdflash.kernels import w4_mma

    q, scale, _ = quantized(8, 256, 32)
    words = pack_int4(q)
    assert not w4_mma.supported(2560, 4096, 32, torch.bfloat16, "cpu")
    assert w4_mma.supported(2560, 4096, 32, torch.bfloat16, "cuda") == (w4_mma.triton is not None)
    assert not w4_mma.supported(2559, 4096, 32, torch.bfloat16, "cuda") and not w4_mma.supported(2560, 4096, 32, torch.float16, "cuda")
    assert not w4_mma.supported(64, 2560, 32, torch.bfloat16, "cuda")  # too few rows for any tile to fill the GPU
    with pytest.raises(QdflashError, match="cannot run a 8x256 weight"):
        w4_mma.pack(words, scale, 32, torch.bfloat16)
    with pytest.raises(QdflashError, match="do not pair up"):
        w4_mma.pack_words(words[:7])
    packed = w4_mma.pack_words(words).to(torch.int64) & 0xFFFFFFFF
    order = [(0, 0), (1, 0), (0, 2), (1, 2), (0, 1), (1, 1), (0, 3), (1, 3)]
    back = torch.zeros(4, 2, 64, 4, dtype=torch.int64)
    for p, (row, slot) in enumerate(order):
        back[:, row, :, slot] = (packed >> 4 * p & 0xF) - 8
    assert torch.equal(back.view(8, 256), q.to(torch.int64))
    pairs = w4_mma.pack_scales(scale.to(torch.bfloat16)).to(torch.int64) & 0xFFFFFFFF
    low = (pairs & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    high = (pairs >> 16).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(low, scale.to(torch.bfloat16)[0::2]) and torch.equal(high, scale.to(torch.bfloat16)[1::2])


def test_w4_mma_tiles_are_one_quad_a_row_pair_and_hold_no_word_twice():
    """Every tile `configs` gives at Qwen3.5-4B's shapes fits K, and the blocked layout Triton gives a [pairs, words]
    int32 tile (16-byte loads: 4 words a lane, lanes along the words first) covers it without holding a word twice,
    with >= 4 lanes along the words (a quad shares its row pair): what DIAGONAL's lane-id choice needs. The compiled
    layouts are checked by test_w4_mma_compiles_for_the_h200_in_the_layout_it_assumes."""
    from qdflash.kernels import w4_mma

    for n, k in [(2560, 4096), (2560, 9216), (10240, 2560), (12288, 2560), (18432, 2560), (248320, 2560)]:
        tiles = w4_mma.configs(n, k, 32)
        assert tiles and w4_mma.default_config(n, k, 32) in tiles
        for c in tiles:
            lanes_w = min(32, c.block_w // 4)
            assert w4_mma.fits(c, n, k) and lanes_w >= 4 and c.block_p >= (32 // lanes_w) * c.num_warps, c
        tiles = w4_mma.configs(n, k, 32, rows=16)  # 4 lanes x 4 words along K, 8 quads of lanes along the pairs a warp
        assert tiles and w4_mma.default_config(n, k, 32, rows=9) in tiles
        for c in tiles:
            assert w4_mma.fits(c, n, k, 16) and c.block_w == 16 and c.block_p % (8 * c.num_warps) == 0, c
            assert (n // 2) % c.block_p == 0 and (k // 4) % (16 * c.split_k) == 0, c


def test_external_tiles_are_checked_before_they_are_timed():
    """An EXTERNAL kernel with tiles of its own: tuning keeps the tiles whose product matches the dequantized one and
    says what was wrong with the others (one off by a factor, one that raises); a kernel without tiles has the one
    None tile."""
    from qdflash.kernels import w4a16

    q, scale, deq = quantized(16, 256, 32)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)

    class Tiled:
        @staticmethod
        def configs(n, k, group, rows):
            return ["right", "off", "raises"]

        @staticmethod
        def matmul(x, weight, group, config=None):
            if config == "raises":
                raise RuntimeError("no such tile")
            return (x.float() @ weight.T) * (1.5 if config == "off" else 1.0)

    weight = deq.to(torch.bfloat16).float()
    kept, problems = w4a16._external_tiles(Tiled, x, (weight,), w4a16._rounded_product(x, words, scale, 32), 16, 256, 32)
    assert kept == ["right"] and len(problems) == 2
    assert "off: off the dequantized product" in problems[0] and "raises: raised RuntimeError: no such tile" in problems[1]
    assert w4a16._external_tiles(object(), x, (), None, 16, 256, 32) == ([None], [])


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """Triton's interpreter taught what the fast W4 kernel needs and it lacks: our BF16_NIBBLES asm (run by numpy
    as `run_ptx` shows the PTX computes: round_bf16((nibble - 8) * scale)) and a bf16 dot (it multiplies bf16's bit
    patterns as integers). Test-only patches of the interpreter's builder; skipped on a GPU, where they are real."""
    if DEVICE != "cpu":
        pytest.skip("on a GPU the kernel runs for real")
    from triton.runtime import interpreter
    import triton.language as tl

    from qdflash.kernels.w4a16 import BF16_NIBBLES

    builder = interpreter.InterpreterBuilder
    if not all(hasattr(builder, name) for name in ("create_inline_asm", "create_dot")):
        pytest.skip("this Triton's interpreter has no builder hooks to patch")

    class Results:
        def __init__(self, handles):
            self.handles = handles

        def get_result(self, i):
            return self.handles[i]

    def inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert asm == BF16_NIBBLES and pack == 1
        words, scale = values[0].data.astype(np.int64) & 0xFFFFFFFF, bf16_to_f32(values[1].data)
        return Results([interpreter.TensorHandle(f32_to_bf16((((words >> 4 * j) & 0xF) - 8).astype(np.float32) * scale),
                                                 tl.bfloat16) for j in range(8)])

    plain_dot = builder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(bf16_to_f32(a.data), tl.float32)
            b = interpreter.TensorHandle(bf16_to_f32(b.data), tl.float32)
        return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_inline_asm", inline_asm)
    monkeypatch.setattr(builder, "create_dot", dot)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fast_w4a16_kernel_equals_the_dequantized_product(rows, bf16_interpreter):
    """The fast tensor-core W4 kernel (Config.fast: BF16_NIBBLES's bf16 weights met as 8 dots of [BN, BK8] with x's
    strided columns) at 1, 5 and 16 rows, split-K or not, in bf16: F.linear with the weight dequantized and rounded
    to bf16, up to the fp32 accumulation order and the bf16 output. Through the launch itself: w4a16_matmul refuses a
    fast config off the GPU."""
    from qdflash.kernels import w4a16 as w4_module

    n, k, group = 64, 512, 32
    q, scale, deq = quantized(n, k, group)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)  # bf16 values already: the grid's scales are stored in bf16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    ref = x.float() @ deq.to(torch.bfloat16).float().T
    for config in (Config(32, 16, 1, fast=True), Config(16, 16, 2, fast=True), Config(64, 32, 1, fast=True)):
        out = w4_module._launch(x, words, scale, group, config)
        y = out[0].float() if config.split_k == 1 else out.sum(0)
        torch.testing.assert_close(y, ref, atol=2e-2 * float(ref.abs().max()), rtol=1e-2)


def test_tuning_drops_fast_configs_that_fail_or_are_off(monkeypatch):
    """tune() times a fast (inline-PTX) config only after its product matched the dequantized one on the device:
    one that raises (here: off the GPU it is refused) or is off by more than EXTERNAL_TOLERANCE is dropped, with
    what was wrong; the others stay."""
    from qdflash.kernels import w4a16 as w4_module

    q, scale, _ = quantized(32, 256, 32)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)
    x = torch.randn(1, 256).to(torch.bfloat16)
    plain, fast, other = Config(32, 16), Config(32, 16, fast=True), Config(16, 16, 2, fast=True)
    reference = w4_module._rounded_product(x, words, scale, 32)
    kept, problems = w4_module._check_fast(x, words, scale, 32, [plain, fast], reference)
    assert kept == [plain] and len(problems) == 1 and "raised QdflashError" in problems[0]
    matmul = w4_module.w4a16_matmul

    def fake(x, words, scale, group, config=None):  # the fast tile (32, 16) right, the other off by a factor
        out = matmul(x.float(), words, scale, group, Config(config.block_n, config.block_k8, config.split_k))
        return out if config.block_n == 32 else out * 1.5

    monkeypatch.setattr(w4_module, "w4a16_matmul", fake)
    kept, problems = w4_module._check_fast(x, words, scale, 32, [plain, fast, other], reference)
    assert kept == [plain, fast] and len(problems) == 1 and "off the dequantized product" in problems[0]


def test_tuning_checks_an_external_tile_at_2_to_8_rows_and_in_its_swiglu_epilogue():
    """An EXTERNAL kernel's tile tuned at 16 rows also runs 2-8 rows (w4_mma's one-mma form): one wrong only there is
    dropped, the problem naming the rows it was checked at. For an MLP's gate / up (swiglu), a tile the epilogue takes
    (`swiglu_fits`) is checked in it too, against the product's (gate, up) pairs; a tile it does not take is not."""
    from types import SimpleNamespace

    from qdflash.kernels import w4_mma
    from qdflash.kernels import w4a16 as w4_module

    q, scale, _ = quantized(32, 256, 32)
    words, scale = pack_int4(q), scale.to(torch.bfloat16)
    x = torch.randn(16, 256).to(torch.bfloat16)
    reference = w4_module._rounded_product(x, words, scale, 32)
    good, low_wrong, epilogue_wrong, split = (w4_mma.Config(8, 64), w4_mma.Config(16, 64), w4_mma.Config(32, 64),
                                              w4_mma.Config(8, 64, 2))
    seen = []

    def matmul(x, words, scale, group, config=None, swiglu=False):  # the dequantized product, wrong where named
        seen.append((x.shape[0], swiglu))
        out = reference[:x.shape[0]].to(x.dtype)
        if config == low_wrong and x.shape[0] <= 8:
            out = out * 1.5
        if swiglu:
            out = w4_module._swiglu_reference(out.float(), x.dtype).to(x.dtype)
            return out * 1.5 if config in (epilogue_wrong, split) else out
        return out

    module = SimpleNamespace(configs=lambda n, k, group, rows: [good, low_wrong, epilogue_wrong, split], matmul=matmul,
                             swiglu_fits=w4_mma.swiglu_fits)
    kept, problems = w4_module._external_tiles(module, x, (words, scale), reference, 32, 256, 32)
    assert kept == [good, epilogue_wrong, split] and len(problems) == 1 and f"at {w4_module.ONE_MMA_CHECK} rows" in problems[0]
    assert {rows for rows, _ in seen} == {16, w4_module.ONE_MMA_CHECK} and not any(s for _, s in seen)
    seen.clear()
    kept, problems = w4_module._external_tiles(module, x, (words, scale), reference, 32, 256, 32, swiglu=True)
    assert kept == [good, split] and len(problems) == 2 and "silu(gate) * up epilogue" in problems[1]
    assert sorted({(rows, s) for rows, s in seen}) == [(w4_module.ONE_MMA_CHECK, False), (16, False), (16, True)]
    assert sum(s for _, s in seen) == 2  # good and epilogue_wrong: the split tile is not run in the epilogue


def test_w4a16_matmul_refuses_what_it_cannot_do():
    q, scale, _ = quantized(32, 128, 32)
    words = pack_int4(q)
    with pytest.raises(QdflashError, match="at most 16"):
        w4a16_matmul(torch.randn(17, 128), words, scale, 32)
    with pytest.raises(QdflashError, match="do not fit"):
        w4a16_matmul(torch.randn(1, 256), words, scale, 32)
    with pytest.raises(QdflashError, match="does not tile"):
        w4a16_matmul(torch.randn(1, 128), words, scale, 32, Config(32, 16, split_k=2))
    with pytest.raises(QdflashError, match="does not tile"):
        w4a16_matmul(torch.randn(4, 128), words, scale, 32, Config(8, 16))  # a tensor-core tile needs >= 16 columns
    with pytest.raises(QdflashError, match="does not tile"):
        w4a16_matmul(torch.randn(1, 128), words, scale, 32, Config(8, 16, fast=True))  # fast: tensor cores at 1 row too
    with pytest.raises(QdflashError, match="bf16 activations on a CUDA GPU"):  # inline PTX: no interpreter, no fp16 / fp32
        w4a16_matmul(torch.randn(1, 128).to(torch.bfloat16), words, scale.to(torch.bfloat16), 32, Config(32, 16, fast=True))
    # scales stored wider than bf16: the same tile without the bit tricks (which read bf16 scales)
    torch.testing.assert_close(w4a16_matmul(torch.randn(1, 128, generator=torch.Generator().manual_seed(0)), words, scale, 32,
                                            Config(32, 16, fast=True)),
                               w4a16_matmul(torch.randn(1, 128, generator=torch.Generator().manual_seed(0)), words, scale, 32,
                                            Config(32, 16)), rtol=0, atol=0)
    # fast candidates only where asked (tune: bf16 on CUDA), tensor-core tiles of <= 2048 words, for 1 row too
    assert not any(c.fast for c in candidate_configs(2560, 32, 2560, 1))
    fast = [c for c in candidate_configs(2560, 32, 2560, 1, fast=True) if c.fast]
    assert fast and all(c.block_n >= 16 and 16 <= c.block_k8 and c.block_n * c.block_k8 <= 2048 for c in fast)


@pytest.mark.parametrize("tokens,dv", [(1, 64), (5, 64), (37, 64), (5, 16)])  # 37: several launches of 16; dv 16: tiny-qwen3.5
def test_gated_delta_kernel_equals_torch_loop(tokens, dv):
    g = torch.Generator().manual_seed(tokens)
    h, dk = 4, 16
    q, k = torch.randn(tokens, h, dk, generator=g), torch.nn.functional.normalize(torch.randn(tokens, h, dk, generator=g), dim=-1)
    v = torch.randn(tokens, h, dv, generator=g)
    decay, beta = -torch.rand(tokens, h, generator=g), torch.rand(tokens, h, generator=g)
    start = torch.randn(h, dk, dv, generator=g)
    ref_state, ref_states = start.clone(), torch.zeros(tokens + 1, h, dk, dv)
    ref = recurrence_torch(q, k, v, decay, beta, ref_state, ref_states)
    state, states = start.clone().to(DEVICE), torch.zeros(tokens + 1, h, dk, dv, device=DEVICE)
    out = gated_delta_recurrence(*(x.to(DEVICE) for x in (q, k, v, decay, beta)), state, states)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.cpu(), ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.cpu(), ref_state, atol=1e-5, rtol=1e-5)
    assert not torch.equal(states[0], states[-1]), "the state moved (the test can fail)"


def gdn_middle_reference(qkvz, x, conv_w, ba_w, decay, dt_bias, key_heads, dk, state):
    """The unfused layer middle (engine.qwen3_5's `_delta_net` between its projections) over a whole
    sequence from position 0: causal conv, silu, l2norm, gates, recurrence. Returns o and the states."""
    from qdflash.engine.qwen3_5 import l2norm

    heads, dv, kw = state.shape[0], state.shape[2], conv_w.shape[-1]
    key_dim, conv_dim = key_heads * dk, conv_w.shape[0]
    window = torch.cat([torch.zeros(kw - 1, conv_dim), qkvz[:, :conv_dim]])
    mixed = torch.nn.functional.silu(torch.nn.functional.conv1d(window.T[None], conv_w, groups=conv_dim)[0].T)
    t = mixed.shape[0]
    q, k, v = mixed.split([key_dim, key_dim, heads * dv], dim=-1)
    rep = heads // key_heads
    q = l2norm(q.reshape(t, key_heads, dk)).repeat_interleave(rep, -2) / dk ** 0.5
    k = l2norm(k.reshape(t, key_heads, dk)).repeat_interleave(rep, -2)
    b, a = (x @ ba_w.T).split([heads, heads], dim=-1)
    states = torch.zeros(t + 1, *state.shape)
    out = recurrence_torch(q, k, v.reshape(t, heads, dv), decay * torch.nn.functional.softplus(a + dt_bias),
                           torch.sigmoid(b), state.clone(), states)
    return out, states


@pytest.mark.parametrize("ba_weight,two_phase", [(True, False), (False, False), (False, True), (True, True),
                                                 (False, "chunked"), (True, "chunked")])
def test_gated_delta_step_is_the_unfused_layer_middle(ba_weight, two_phase):
    """gated_delta_step (conv + silu + l2norm + gates + recurrence in one launch) fed a sequence in pieces
    (a prompt from position 0, a decode step, verify blocks; history from its buffer and from the block)
    gives the unfused layer's outputs and states, writes the block's conv inputs to the buffer, and each
    token's output is bit for bit the same whether it came in a block or in a one-token step. `two_phase`: the block
    kernel that computes every token's inputs first (its sums in another order: blocks and steps then agree to fp32
    rounding); "chunked": that kernel with the block's recurrence as matmuls (the chunked form), likewise to fp32
    rounding."""
    from qdflash.kernels.gated_delta import gated_delta_step

    g = torch.Generator().manual_seed(3)
    key_heads, heads, dk, dv, kw, hidden, tokens = 2, 4, 16, 16, 4, 48, 12
    key_dim = key_heads * dk
    conv_dim = 2 * key_dim + heads * dv
    conv_w = torch.randn(conv_dim, 1, kw, generator=g) * 0.5
    ba_w = torch.randn(2 * heads, hidden, generator=g) * 0.3
    decay, dt_bias = -torch.rand(heads, generator=g), torch.randn(heads, generator=g)
    qkvz, x = torch.randn(tokens, conv_dim + heads * dv, generator=g), torch.randn(tokens, hidden, generator=g)
    state0 = torch.randn(heads, dk, dv, generator=g) * 0.1
    ref, ref_states = gdn_middle_reference(qkvz, x, conv_w, ba_w, decay, dt_bias, key_heads, dk, state0)

    def run(pieces):
        conv_in, state, outs = torch.zeros(32, conv_dim, device=DEVICE), state0.clone().to(DEVICE), []
        for start, end in pieces:
            states = torch.zeros(end - start + 1, heads, dk, dv, device=DEVICE)
            # one product: its rows do not depend on how it is cut; given, it is the tail of wider rows (as a fused
            # qkvz + b / a projection hands it over)
            ba = ba_w if ba_weight else torch.cat([qkvz, x @ ba_w.T], 1)[start:end, qkvz.shape[1]:]
            outs.append(gated_delta_step(qkvz[start:end].to(DEVICE), conv_in, conv_w.to(DEVICE),
                                         torch.arange(start, end, device=DEVICE), x[start:end].to(DEVICE), ba.to(DEVICE),
                                         decay.to(DEVICE), dt_bias.to(DEVICE), state, states, key_heads=key_heads,
                                         key_dim=key_dim, ba_weight=ba_weight, two_phase=two_phase is True,
                                         chunked=two_phase == "chunked"))
            torch.testing.assert_close(states.cpu(), ref_states[start:end + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.cpu(), ref_states[-1], atol=1e-5, rtol=1e-5)
        assert torch.equal(conv_in[:tokens].cpu(), qkvz[:, :conv_dim]) and not conv_in[tokens:].any()
        return torch.cat(outs).cpu()

    blocks = run([(0, 2), (2, 3), (3, 8), (8, 12)])  # 2 < kw - 1: the first block's history is the zero start
    torch.testing.assert_close(blocks, ref, atol=1e-5, rtol=1e-5)
    steps = run([(s, s + 1) for s in range(tokens)])
    if two_phase:
        torch.testing.assert_close(steps, blocks, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(steps, blocks)
    with pytest.raises(QdflashError, match="1..16"):
        gated_delta_step(torch.zeros(17, qkvz.shape[1]), torch.zeros(32, conv_dim), conv_w, torch.arange(17), torch.zeros(17, hidden),
                         ba_w, decay, dt_bias, state0.clone(), key_heads=key_heads, key_dim=key_dim)
    with pytest.raises(QdflashError, match="contiguous fp32"):
        gated_delta_step(qkvz[:1], torch.zeros(32, conv_dim), conv_w, torch.arange(1), x[:1], ba_w, decay, dt_bias,
                         state0.double(), key_heads=key_heads, key_dim=key_dim)
    with pytest.raises(QdflashError, match="ask for one"):  # two forms of the block kernel: neither silently wins
        gated_delta_step(qkvz[:2], torch.zeros(32, conv_dim), conv_w, torch.arange(2), x[:2], ba_w, decay, dt_bias,
                         state0.clone(), key_heads=key_heads, key_dim=key_dim, two_phase=True, chunked=True)


@pytest.mark.parametrize("tokens", [2, 16])  # a short block and the full one (rollback tests cover other lengths)
def test_a_replayed_block_state_is_the_one_the_block_kept(tokens):
    """gated_delta_step(kept=): a two-phase block that keeps its tokens' inputs writes the same outputs and state as one
    that keeps every position's state, but of the states only the first; gated_delta_replay then gives, for every
    layer in one launch, the state after any n of the block's tokens: the block's own states[n], bit for bit (the same
    lines on the same inputs). Bad buffers are refused by name."""
    from qdflash.kernels.gated_delta import gated_delta_replay, gated_delta_step, replay_scratch, replay_tables

    g = torch.Generator().manual_seed(5)
    layers, key_heads, heads, dk, dv, kw, hidden, max_block = 2, 2, 4, 16, 32, 4, 48, 16
    key_dim = key_heads * dk
    conv_dim = 2 * key_dim + heads * dv
    conv_w = torch.randn(conv_dim, 1, kw, generator=g).to(DEVICE) * 0.5
    ba_w = (torch.randn(2 * heads, hidden, generator=g) * 0.3).to(DEVICE)
    decay, dt_bias = -torch.rand(heads, generator=g).to(DEVICE), torch.randn(heads, generator=g).to(DEVICE)
    common = dict(key_heads=key_heads, key_dim=key_dim, two_phase=True)
    states0 = torch.zeros(layers, max_block + 1, heads, dk, dv, device=DEVICE)
    kept = torch.zeros(layers, *replay_scratch(heads, dk, dv, max_block), device=DEVICE)
    state = (torch.randn(layers, heads, dk, dv, generator=g) * 0.1).to(DEVICE)
    full = []
    for layer in range(layers):
        qkvz = torch.randn(tokens, conv_dim + heads * dv, generator=g).to(DEVICE)
        x, positions = torch.randn(tokens, hidden, generator=g).to(DEVICE), torch.arange(3, 3 + tokens, device=DEVICE)
        history = torch.randn(32, conv_dim, generator=g).to(DEVICE)
        every = torch.zeros(tokens + 1, heads, dk, dv, device=DEVICE)
        expected_state = state[layer].clone()
        out = gated_delta_step(qkvz, history.clone(), conv_w, positions, x, ba_w, decay, dt_bias, expected_state, every,
                               **common)
        got = gated_delta_step(qkvz, history.clone(), conv_w, positions, x, ba_w, decay, dt_bias, state[layer],
                               states0[layer], kept=kept[layer], **common)
        assert torch.equal(got, out) and torch.equal(state[layer], expected_state)
        assert torch.equal(states0[layer, 0], every[0]) and not states0[layer, 1:].any()  # the first state only
        full.append(every)
    replayed = [torch.full_like(state[0], float("nan")) for _ in range(layers)]  # each layer's an allocation of its own
    tables = replay_tables([states0[layer, 0] for layer in range(layers)], [kept[layer] for layer in range(layers)],
                           replayed)
    for n in (0, 1, tokens - 1, tokens):
        for lean in (False, True):  # the lean form: the state's reduction alone, the next row loaded ahead
            for x in replayed:
                x.fill_(float("nan"))
            gated_delta_replay(tables, n, lean=lean)
            for layer in range(layers):
                assert torch.equal(replayed[layer], full[layer][n]), (n, layer, lean)
    with pytest.raises(QdflashError, match="up to 16"):
        gated_delta_replay(tables, 17)
    with pytest.raises(QdflashError, match="one of each a layer"):
        replay_tables([states0[0, 0]], [kept[0], kept[1]], replayed)
    with pytest.raises(QdflashError, match="expected for every layer"):
        replay_tables([states0[0, 0], states0[1, 0]], [kept[0], kept[1, :, :, :4].contiguous()], replayed)
    with pytest.raises(QdflashError, match="contiguous fp32"):
        replay_tables([states0[0, 0], states0[1, 0]], [kept[0], kept[1]], [replayed[0], replayed[1].double()])
    with pytest.raises(QdflashError, match="16-byte aligned"):  # (a state one float into its buffer)
        replay_tables([states0[0, 0], states0[1, 0]], [kept[0], kept[1]],
                      [replayed[0], torch.zeros(replayed[1].numel() + 1, device=DEVICE)[1:].view_as(replayed[1])])
    with pytest.raises(QdflashError, match="kept scratch is for a two-phase block"):
        gated_delta_step(torch.zeros(2, conv_dim + heads * dv, device=DEVICE), torch.zeros(32, conv_dim, device=DEVICE),
                         conv_w, torch.arange(2, device=DEVICE), torch.zeros(2, hidden, device=DEVICE), ba_w, decay, dt_bias,
                         state[0].clone(), states0[0], key_heads=key_heads, key_dim=key_dim, kept=kept[0])
    with pytest.raises(QdflashError, match="kept must be contiguous fp32"):
        gated_delta_step(torch.zeros(2, conv_dim + heads * dv, device=DEVICE), torch.zeros(32, conv_dim, device=DEVICE),
                         conv_w, torch.arange(2, device=DEVICE), torch.zeros(2, hidden, device=DEVICE), ba_w, decay, dt_bias,
                         state[0].clone(), states0[0], kept=kept[0, :, :1], **common)
    with pytest.raises(QdflashError, match="kept must be contiguous fp32"):  # not [programs, rows, row]
        gated_delta_step(torch.zeros(2, conv_dim + heads * dv, device=DEVICE), torch.zeros(32, conv_dim, device=DEVICE),
                         conv_w, torch.arange(2, device=DEVICE), torch.zeros(2, hidden, device=DEVICE), ba_w, decay, dt_bias,
                         state[0].clone(), states0[0], kept=kept[0].flatten(1), **common)
    assert tables.block_v == 16 and tables.rows == 16  # the launch the scratch was written with travels with it


def test_a_chunked_verify_block_is_its_sixteen_one_token_steps():
    """A 16-token block (a verify block's length) in the chunked form (`_chunk_state`: the block's products as matmuls, a
    16 x 16 lower-triangular inverse) gives the outputs, per-position states and final state of 16 one-token steps of
    the step kernel to fp32 rounding, with strongly correlated keys (large k . k', where the triangular system is far
    from the identity), large gates and a state of unit scale."""
    from qdflash.kernels.gated_delta import gated_delta_step

    g = torch.Generator().manual_seed(1)
    key_heads, heads, dk, dv, kw, tokens = 1, 2, 32, 32, 4, 16
    key_dim, conv_dim = key_heads * dk, 2 * key_heads * dk + heads * dv
    conv_w = torch.randn(conv_dim, 1, kw, generator=g) * 0.5
    decay, dt_bias = -torch.rand(heads, generator=g) * 2, torch.randn(heads, generator=g)
    qkvz = torch.randn(tokens, conv_dim + heads * dv, generator=g) * 4
    qkvz[:, dk:2 * dk] = qkvz[:1, dk:2 * dk] + 0.1 * qkvz[:, dk:2 * dk]  # every key near the first one
    ba, state0, x = torch.randn(tokens, 2 * heads, generator=g) * 2, torch.randn(heads, dk, dv, generator=g), torch.zeros(tokens, 8)
    common = dict(key_heads=key_heads, key_dim=key_dim, ba_weight=False)
    conv_in, state = torch.zeros(32, conv_dim, device=DEVICE), state0.clone().to(DEVICE)
    states = torch.zeros(tokens + 1, heads, dk, dv, device=DEVICE)
    block = gated_delta_step(qkvz.to(DEVICE), conv_in, conv_w.to(DEVICE), torch.arange(tokens, device=DEVICE), x.to(DEVICE),
                             ba.to(DEVICE), decay.to(DEVICE), dt_bias.to(DEVICE), state, states, chunked=True, **common).cpu()
    conv_in, step_state, outs, step_states = torch.zeros(32, conv_dim, device=DEVICE), state0.clone().to(DEVICE), [], [state0]
    for t in range(tokens):
        kept = torch.zeros(2, heads, dk, dv, device=DEVICE)
        outs.append(gated_delta_step(qkvz[t:t + 1].to(DEVICE), conv_in, conv_w.to(DEVICE), torch.arange(t, t + 1, device=DEVICE),
                                     x[t:t + 1].to(DEVICE), ba[t:t + 1].to(DEVICE), decay.to(DEVICE), dt_bias.to(DEVICE), step_state,
                                     kept, **common).cpu())
        step_states.append(kept[1].cpu())
    torch.testing.assert_close(block, torch.cat(outs), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(states.cpu(), torch.stack(step_states), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.cpu(), step_state.cpu(), atol=1e-5, rtol=1e-5)


SM90_COMPILE = """
import json, os, re, subprocess, sys, tempfile
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, num_warps, aligned = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
# a constexpr the case leaves out takes its default, as at a launch (ASTSource does not fill it in)
constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
sig = {**signature, **{key: "constexpr" for key in constexprs}}
# arguments divisible by 16 (pointers: bytes), as Triton specializes them at a launch where they are
attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig) if arg in aligned}
kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": num_warps})
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernel.asm["cubin"])
    f.flush()
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
ptx = kernel.asm["ptx"].splitlines()
# atomics: how many, how many of them acq_rel at gpu scope by one thread (predicated), with a CTA barrier between the
# last global store before it and it (every thread's stores done before the one that publishes them)
atoms = [i for i, line in enumerate(ptx) if re.search(r"\\batom\\.", line)]
stores = [i for i, line in enumerate(ptx) if "st.global" in line]
published = sum(bool(re.search(r"@%p\\d+ atom\\.global\\.gpu\\.acq_rel\\.", ptx[i]))
                and any("bar.sync" in line for line in ptx[max([j for j in stores if j < i], default=0):i]) for i in atoms)
# the layouts of the inline asm ops' first results (which lane holds which element is what their PTX computes with)
ttgir = kernel.asm["ttgir"]
aliases = dict(re.findall(r"^(#\\w+) = #ttg\\.blocked<\\{([^}]*)\\}>", ttgir, re.M))
asm_layouts = [{key: [int(v) for v in re.findall(r"\\d+", val)] for key, val in re.findall(r"(\\w+) = \\[([^]]*)\\]", aliases[name])}
               for name in re.findall(r"tt\\.elementwise_inline_asm .*?-> tensor<[^#]*(#\\w+)>", ttgir)]
# the layout of each reduction along axis 0's first operand (the layout decides the order of the sums, so the rounding)
lines = ttgir.splitlines()
starts = [i for i, line in enumerate(lines) if '"tt.reduce"' in line and "axis = 0 " in line]
reduce0 = []
for i in starts:
    close = next(line for line in lines[i:] if line.lstrip().startswith("}) : ("))
    reduce0.append(re.search(r"tensor<[^#]*(#\\w+)>", close).group(1))
print(json.dumps({**{k: int(v) for k, v in re.findall(r"(REG|STACK):(\\d+)", usage)},
                  "BF16X2_FMAS": sum("fma.rn.bf16x2" in line for line in ptx), "ATOMS": len(atoms), "PUBLISHED_ATOMS": published,
                  "MMAS": sum("mma.sync" in line for line in ptx), "ASM_LAYOUTS": asm_layouts,
                  "GDC": [line.split()[0].rstrip(";") for line in ptx if "griddepcontrol" in line],  # in program order
                  "REDUCE0_LAYOUTS": [aliases.get(name, name) for name in reduce0],
                  "CONVERTS_IN_LOOPS": sum("ttg.convert_layout" in line for line in ttgir.split("scf.for")[1:] for line in
                                           line.split("scf.yield")[0].splitlines())}))
"""


def sm90_resources(module: str, name: str, signature: dict, constexprs: dict, num_warps: int = 4, aligned=()) -> dict:
    """Compile the Triton kernel `module.name` for the H200 (sm_90) on this machine, with no GPU (Triton's own
    compiler and bundled tools), and read the cubin's registers / stack per thread: what the interpreter cannot
    check. In a process of its own without TRITON_INTERPRET: the interpreter replaces parts of triton.language."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no CUDA backend tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SM90_COMPILE, json.dumps([module, name, signature, constexprs, num_warps, list(aligned)])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def gdn_step_case(tokens):
    from qdflash.kernels.gated_delta import STEP_BLOCK_V

    signature = {"qkvz_ptr": "*bf16", "qkvz_stride": "i32", "conv_in_ptr": "*bf16", "conv_w_ptr": "*bf16", "pos_ptr": "*i64",
                 "x_ptr": "*bf16", "ba_ptr": "*bf16", "ba_stride": "i32", "decay_ptr": "*fp32", "dt_bias_ptr": "*bf16", "state_ptr": "*fp32",
                 "out_ptr": "*fp32", "states_ptr": "*fp32", "HV": "i32", "KEY_DIM": "i32", "CONV_DIM": "i32",
                 "SCALE": "fp32"}
    return "qdflash.kernels.gated_delta", "_gated_delta_step_kernel", signature, dict(
        HIDDEN=2560, H_CHUNKS=5, BLOCK_H=512, T=tokens, REP=2, KW=4, DK=128, DV=128, BLOCK_V=STEP_BLOCK_V, BA_DOT=True,
        STORE_STATES=True)


def gdn_block_case(tokens, chunked=False, first_only=False):
    """The two-phase GDN block kernel at Qwen3.5-4B's heads, its default value block (with BLOCK_WARPS), the b / a product
    given; `chunked`: its recurrence in the chunked form, the b / a dot in the kernel (as the engine's default gdn_ba
    runs it); `first_only`: keeping its inputs for a replay instead of every position's state (gdn_replay)."""
    from qdflash.kernels.gated_delta import STEP_BLOCK_V

    signature = {"qkvz_ptr": "*bf16", "qkvz_stride": "i32", "conv_in_ptr": "*bf16", "conv_w_ptr": "*bf16", "pos_ptr": "*i64",
                 "x_ptr": "*bf16", "ba_ptr": "*bf16", "ba_stride": "i32", "decay_ptr": "*fp32", "dt_bias_ptr": "*bf16",
                 "state_ptr": "*fp32", "out_ptr": "*fp32", "states_ptr": "*fp32", "scratch_ptr": "*fp32",
                 "HV": "i32", "KEY_DIM": "i32", "CONV_DIM": "i32", "SCALE": "fp32"}
    return "qdflash.kernels.gated_delta", "_gated_delta_block_kernel", signature, dict(
        T=tokens, T_P=max(tokens, 16) if chunked else tokens, SCRATCH_ROWS=16, REP=2, KW=4, DK=128, DV=128, BLOCK_V=STEP_BLOCK_V, STORE_STATES=True,
        FIRST_STATE_ONLY=first_only, CHUNKED=chunked, CHUNK_K=32, BA_DOT=chunked, HIDDEN=2560, H_CHUNKS=5, BLOCK_H=512)


@pytest.mark.parametrize("dk", [32, 128])
def test_the_replay_sums_the_state_in_the_block_kernels_layout(dk):
    """gated_delta_replay reruns the block kernel's update lines in a kernel of its own, so the replayed state equals the
    block's bit for bit only where the state's reduction over dk has the same layout in both (the layout orders the
    sums). Its addresses come from a table, and without their 16-byte alignment declared Triton gave the replay's state
    another layout (sizePerThread [1, 1] against [1, 4]), and on the H100 the tiny shape's replay was 4.7e-10 off
    (results/published/2026-12-06-h100-lean-replay). Here, for sm_90, both forms of the replay, at the tiny shape's
    heads (dk 32) and Qwen3.5-4B's (128), sum in the block kernel's layout (as launched: torch's pointers aligned)."""
    from qdflash.kernels.gated_delta import BLOCK_WARPS, STEP_BLOCK_V

    module, name, signature, constexprs = gdn_block_case(16, first_only=True)
    constexprs.update(DK=dk, DV=dk)
    pointers = [arg for arg in signature if arg.endswith("_ptr")]  # (aligned at any shape; HV, KEY_DIM need not be)
    block = sm90_resources(module, name, signature, constexprs, BLOCK_WARPS, pointers)
    assert len(block["REDUCE0_LAYOUTS"]) == 1, block  # the state's S^T k (and S^T q)
    for lean in (False, True):
        replay = sm90_resources(module, "_gated_delta_replay_kernel", {"tables_ptr": "*i64", "N": "i32", "LAYERS": "i32", "HV": "i32"},
                                dict(SCRATCH_ROWS=16, DK=dk, DV=dk, BLOCK_V=STEP_BLOCK_V, LEAN=lean), BLOCK_WARPS, ["tables_ptr"])
        assert replay["REDUCE0_LAYOUTS"] == block["REDUCE0_LAYOUTS"], (lean, replay, block)


def attention_case(tree, block=False):
    from qdflash.kernels.decode_attention import BLOCK_N, MAX_SPLITS

    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i64", "tree_ptr": "*i64",
                 "out_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32", "stride_row": "i32", "stride_head": "i32",
                 "stride_pos": "i32", "B": "i32"}
    # no start, and no tree but a tree's: None, as decode_attention passes them (a constexpr at the launch)
    nones = dict(start_ptr=None) if tree else dict(start_ptr=None, tree_ptr=None)
    if not tree:
        del signature["tree_ptr"]
    # a verify block or a tree: its rows share programs, 2 rows of 7 heads each
    return "qdflash.kernels.decode_attention", "_decode_attention_kernel", signature, dict(
        KVH=2, REP=7, REP_PAD=16, TOKS=2 if tree or block else 1, D=64, BLOCK_N=BLOCK_N, IEEE=False, SPLITS=MAX_SPLITS,
        HAS_START=False, TREE=tree if tree else 0, **nones)


def rows_gemv_case(tiles):
    """The 2-16-row GEMV at its largest tile."""
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
                 "stride_wn": "i32", "stride_os": "i32", "stride_om": "i32", "K_PER_SPLIT": "i32"}
    return "qdflash.kernels.gemv", "_gemv_rows_kernel", signature, dict(BLOCK_N=128, BLOCK_K=64, TILES=tiles,
                                                                        IEEE=False)


def matmul_cases():
    """The one-row 16-bit GEMV (K loop run and unrolled) and the W4A16 kernels (1 row, also reducing its K splits in its
    launch; 2-16 rows, also the fast tile) at tiles the H200 tuning picks for Qwen3.5-4B's shapes."""
    one = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_wn": "i32", "stride_os": "i32",
           "K_PER_SPLIT": "i32"}
    w4_one = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_wn": "i32",
              "stride_sn": "i32", "stride_os": "i32", "K_PER_SPLIT": "i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
    w4_rows = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32", "stride_om": "i32"}
    return {"gemv 1": ("qdflash.kernels.gemv", "_gemv_kernel", one, dict(BLOCK_N=8, BLOCK_K=512, TILES=0)),
            "gemv 1 unrolled": ("qdflash.kernels.gemv", "_gemv_kernel", one, dict(BLOCK_N=8, BLOCK_K=512, TILES=5)),
            "w4 1": ("qdflash.kernels.w4a16", "_w4a16_gemv_kernel", w4_one,
                     dict(GROUP=32, BLOCK_N=16, BLOCK_K8=64, SPLITS=1)),
            # 2,560 x 9,216 split 8 ways over K, reduced in the launch (its partial sums fp32)
            "w4 1 split": ("qdflash.kernels.w4a16", "_w4a16_gemv_kernel", w4_one | {"out_ptr": "*fp32"},
                           dict(GROUP=32, BLOCK_N=8, BLOCK_K8=128, SPLITS=8)),
            "w4 rows": ("qdflash.kernels.w4a16", "_w4a16_kernel", w4_rows, dict(GROUP=32, BLOCK_M=16, BLOCK_N=64, BLOCK_K8=16,
                                                                                K_PER_SPLIT=2560, FAST=False)),
            # the fast (BF16_NIBBLES) tile at its largest candidate, 2048 words
            "w4 rows fast": ("qdflash.kernels.w4a16", "_w4a16_kernel", w4_rows, dict(GROUP=32, BLOCK_M=16, BLOCK_N=64, BLOCK_K8=32,
                                                                                     K_PER_SPLIT=2560, FAST=True))}


def aligned_args(signature):
    """The arguments a launch at the engine's shapes specializes as multiples of 16: torch's pointers, these strides,
    a split's K (its K are multiples of 128 per split) and the GDN kernels' row strides and sizes."""
    return [arg for arg in signature if arg.endswith(("_ptr", "_stride")) or arg.startswith("stride")
            or arg in ("K_PER_SPLIT", "HV", "KEY_DIM", "CONV_DIM")]


@pytest.mark.parametrize("case", sorted(matmul_cases()))
def test_matmul_kernels_compile_for_the_h200_without_spilling(case):
    """The matmul kernels (`matmul_cases`) lower for sm_90 without a spill. The fast W4 tile carries BF16_NIBBLES's
    bf16x2 FMAs (8 a word) into its PTX, the others none. The one-row W4 GEMV reducing its K splits in its launch counts
    a program's arrival with one atomic, acq_rel at gpu scope, by one thread after a CTA barrier; the others have no
    atomic."""
    module, name, signature, constexprs = matmul_cases()[case]
    used = sm90_resources(module, name, signature, constexprs, 4, aligned_args(signature))
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255, used
    assert (used["BF16X2_FMAS"] > 0) == case.endswith("fast"), used
    assert used["ATOMS"] == used["PUBLISHED_ATOMS"] == ("split" in case), used


@pytest.mark.parametrize("tile", [(16, 32, 1, False), (8, 64, 2, False), (4, 128, 1, False), (32, 64, 1, False),
                                  (16, 64, 1, True), (8, 64, 4, True)])
def test_w4_mma_compiles_for_the_h200_in_the_layout_it_assumes(tile):
    """The tensor-core one-row W4 kernel lowers for sm_90 without a spill, with its mma in the PTX, and Triton lays out
    both inline asm ops' operands as w4_mma's module docstring needs: lanes along the words first, >= 4 of them (a
    quad's lanes share a row pair), the layout covering the tile without holding a word twice; with `prefetch` too (its
    scales loaded by an asm op of their own). Tiles up to 64 words wide convert no layout in the K loop (128-wide ones
    convert the activations' load: slower, still right)."""
    block_p, block_w, splits, prefetch = tile
    signature = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16" if splits == 1 else "*fp32", "N2": "i32",
                 "stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32", "W_PER_SPLIT": "i32", "y_ptr": "*bf16",
                 "counts_ptr": "*i32"}
    used = sm90_resources("qdflash.kernels.w4_mma", "_w4_mma_kernel", signature,
                          dict(GROUP_WORDS=8, BLOCK_P=block_p, BLOCK_W=block_w, SPLITS=splits, PREFETCH=prefetch, PDL=False), 4,
                          aligned_args(signature) + ["W_PER_SPLIT"])
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255 and used["MMAS"] > 0, used
    assert used["CONVERTS_IN_LOOPS"] == 0 or block_w > 64, used
    assert used["GDC"] == [], used  # no programmatic dependent launch unless asked (PDL)
    # MMA_WORD (and with prefetch LOAD_B32, for the first two tiles and in the loop for the one two ahead), DIAGONAL:
    # one layout
    assert len(used["ASM_LAYOUTS"]) == 2 + 3 * prefetch and all(a == used["ASM_LAYOUTS"][0] for a in used["ASM_LAYOUTS"]), used
    layout = used["ASM_LAYOUTS"][0]
    per_thread, lanes, warps = layout["sizePerThread"], layout["threadsPerWarp"], layout["warpsPerCTA"]
    assert layout["order"] == [1, 0] and per_thread[0] == 1 and lanes[1] >= 4 and lanes[1] % 4 == 0, layout
    assert lanes[0] * warps[0] <= block_p and per_thread[1] * lanes[1] * warps[1] <= block_w, layout


@pytest.mark.parametrize("case", ["gemv 1", "gemv rows", "w4 mma 1", "w4 mma rows 8", "w4 mma rows 16"])
def test_swiglu_epilogues_compile_for_the_h200(case):
    """The kernels that make silu(gate) * up in their epilogue (SWIGLU: the 16-bit GEMV at 1 and 2-16 rows, both int4
    mma kernels) lower for sm_90 without a spill, at one K split and tiles of the sizes tuning picks for Qwen3.5-4B's
    18,432 x 2,560 gate / up, the mma kernels still with their mmas."""
    ptrs = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16"}
    tail = {"stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32", "W_PER_SPLIT": "i32", "y_ptr": "*bf16",
            "counts_ptr": "*i32"}
    if case == "gemv 1":
        module, name, signature = "qdflash.kernels.gemv", "_gemv_kernel", matmul_cases()["gemv 1"][2]
        constexprs, extra = dict(BLOCK_N=8, BLOCK_K=512, TILES=0), []
    elif case == "gemv rows":
        module, name, signature, constexprs = rows_gemv_case(0)
        constexprs, extra = {**constexprs, "BLOCK_N": 32, "BLOCK_K": 128}, []
    elif case == "w4 mma 1":
        module, name, signature = "qdflash.kernels.w4_mma", "_w4_mma_kernel", {**ptrs, "N2": "i32", **tail}
        constexprs, extra = dict(GROUP_WORDS=8, BLOCK_P=8, BLOCK_W=64, SPLITS=1, PREFETCH=False, PDL=False), ["W_PER_SPLIT"]
    else:
        module, name = "qdflash.kernels.w4_mma", "_w4_mma_rows_kernel"
        signature = {**ptrs, "M": "i32", "N2": "i32", "stride_xm": "i32", **tail}
        constexprs = dict(GROUP_WORDS=8, BLOCK_P=64, HIGH=case.endswith("16"), SPLITS=1, PREFETCH=True, PDL=False)
        extra = ["W_PER_SPLIT"]
    used = sm90_resources(module, name, signature, {**constexprs, "SWIGLU": True}, 4, aligned_args(signature) + extra)
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255 and used["ATOMS"] == 0, used
    assert used["MMAS"] > 0 or case == "gemv 1", used  # (the 2-16-row GEMV's dot is an mma too)


@pytest.mark.parametrize("rows", [1, 16])
def test_w4_mma_kernels_under_pdl_wait_then_let_the_next_launch(rows):
    """PDL=True (kernels.pdl): both int4 mma kernels compile for sm_90 with one griddepcontrol.wait and one
    griddepcontrol.launch_dependents after it (jit.pdl_start: the next launch may start once this one's predecessor is
    done, never before), still without a spill."""
    common = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16"}
    if rows == 1:
        name, constexprs = "_w4_mma_kernel", dict(GROUP_WORDS=8, BLOCK_P=16, BLOCK_W=64, SPLITS=1, PREFETCH=False, PDL=True)
        signature = {**common, "N2": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32", "W_PER_SPLIT": "i32",
                     "y_ptr": "*bf16", "counts_ptr": "*i32"}
    else:
        name, constexprs = "_w4_mma_rows_kernel", dict(GROUP_WORDS=8, BLOCK_P=32, HIGH=True, SPLITS=1, PREFETCH=False, PDL=True)
        signature = {**common, "M": "i32", "N2": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
                     "stride_os": "i32", "W_PER_SPLIT": "i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
    used = sm90_resources("qdflash.kernels.w4_mma", name, signature, constexprs, 4, aligned_args(signature) + ["W_PER_SPLIT"])
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255 and used["MMAS"] > 0, used
    assert used["GDC"] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], used  # the wait first


def test_w4_mma_launches_with_pdl_only_inside_kernels_pdl(monkeypatch):
    """w4_mma's launch passes PDL / launch_pdl to its kernel inside `kernels.pdl()` only (read at the launch: what a
    graph captures), and `pdl` restores the setting it found, also when its body raises."""
    from qdflash import kernels
    from qdflash.kernels import w4_mma

    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(w4_mma, "_w4_mma_kernel", Kernel(), raising=False)
    monkeypatch.setattr(w4_mma, "_w4_mma_rows_kernel", Kernel(), raising=False)
    monkeypatch.setattr(w4_mma, "triton", type("T", (), {"cdiv": staticmethod(lambda a, b: -(-a // b))}))
    x, words = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.int32)
    scales, counts = torch.zeros(8, 8, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    w4_mma._launch(x, words, scales, counts, 16, 32, 8, 64, 1, 4, False)
    with kernels.pdl():
        assert kernels.pdl_enabled()
        w4_mma._launch(x, words, scales, counts, 16, 32, 8, 64, 1, 4, False)
        w4_mma._launch(torch.zeros(16, 256, dtype=torch.bfloat16), words, scales, counts, 16, 32, 8, 16, 1, 4, False)
    assert not kernels.pdl_enabled()
    assert "PDL" not in launched[0] and "launch_pdl" not in launched[0]
    assert all(k["PDL"] is True and k["launch_pdl"] is True for k in launched[1:]) and len(launched) == 3
    with pytest.raises(RuntimeError), kernels.pdl():
        raise RuntimeError
    assert not kernels.pdl_enabled()


@pytest.mark.parametrize("tile", [(32, 4, True, 1, False), (64, 8, False, 2, False), (64, 4, True, 4, False),
                                  (32, 4, True, 1, True), (64, 8, False, 2, True)])
def test_w4_mma_rows_kernel_compiles_for_the_h200_in_the_layout_it_assumes(tile):
    """The 2-16-row tensor-core W4 kernel lowers for sm_90 without a spill and without a layout conversion in its K
    loop, its mmas in the PTX (two a word for 9-16 rows), and its inline asm's operands laid out as it assumes: 4 words
    a lane, 4 lanes along the 16-word tile and 8 along the pairs (a warp's quads at the same columns), warps along the
    pairs only (so pair p sits in quad p % 8, and lane t of a quad holds words 4t..4t+3)."""
    block_p, warps, high, splits, prefetch = tile
    signature = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16" if splits == 1 else "*fp32", "M": "i32",
                 "N2": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32",
                 "W_PER_SPLIT": "i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
    used = sm90_resources("qdflash.kernels.w4_mma", "_w4_mma_rows_kernel", signature,
                          dict(GROUP_WORDS=8, BLOCK_P=block_p, HIGH=high, SPLITS=splits, PREFETCH=prefetch, PDL=False), warps,
                          aligned_args(signature) + ["W_PER_SPLIT"])
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255 and used["CONVERTS_IN_LOOPS"] == 0, used
    assert used["MMAS"] * 8 == used["BF16X2_FMAS"] * (2 if high else 1) > 0, used  # a word: 8 bf16x2 FMAs, 1 or 2 mmas
    # the mma asm and its loads (LOAD_B32_X4, LOAD_B64_X4 for one or two activation rows: pack=4, so a lane's 4 words
    # must be its [1, 4] registers, as asserted below), with prefetch for the first two tiles and the one two ahead
    assert len(used["ASM_LAYOUTS"]) == 1 + (3 if prefetch else 1) * (3 if high else 2), used
    assert all(layout == {"sizePerThread": [1, 4], "threadsPerWarp": [8, 4], "warpsPerCTA": [warps, 1], "order": [1, 0]}
               for layout in used["ASM_LAYOUTS"]), used


@pytest.mark.parametrize("case", ["gdn step 1", "gdn step 16", "gdn block 16", "gdn block kept 16", "gdn replay 16",
                                  "gdn replay lean 16",
                                  "gdn block chunked 5",
                                  "gdn block chunked 16", "attention", "attention tree 16", "attention block 16",
                                  "gemv rows 0", "gemv rows 16", "gated norm 128", "qk norm rope 256",
                                  "qk norm rope plain 256"])
def test_kernels_compile_for_the_h200_without_spilling(case):
    """Kernels lower for sm_90 (the interpreter accepts what a GPU compile may not: scalar masks, dtype mixes)
    and keep what they hold per program in registers (a spill is a local-memory round trip in the loop):
    the fused GDN kernel at the Qwen3.5-4B head size (dk = dv = 128, a [dk, STEP_BLOCK_V] state slice per program)
    for a decode step and a verify block, the block kernel in its two-phase and chunked forms, and the decode
    attention at Qwen2.5-0.5B's heads (14 over 2 KV heads of 64) for a decode step, a verify block (its rows two to a
    program) and a tree of 16 nodes (what a tree round verifies on the GPU); the block kernel keeping its inputs and
    the replay of them (gdn_replay's rollback); and the 16-bit GEMV's 2-16-row form at its
    largest tile, its K loop run and unrolled (16 tiles); and the GDN layer's gated norm (`kernels.gated_norm`) at
    Qwen3.5-4B's value heads, and its attention layers' q / k norms and rotation (`kernels.qk_norm_rope`), as a DFlash
    drafter layer's too. None of them has an atomic."""
    from qdflash.kernels.gated_delta import BLOCK_WARPS, CHUNKED_WARPS, STEP_WARPS

    kind, _, arg = case.rpartition(" ")
    num_warps = 4
    if kind.startswith("qk norm rope"):
        # qk_norm_rope's launch, at Qwen3.5-4B's attention heads (16 over 4 KV heads, 64 of 256 dims rotate, gated q,
        # zero-centered norms); "plain": a DFlash drafter layer's at that target (all 256 rotate, q ungated, plain norms)
        num_warps, plain = 1, kind.endswith("plain")
        module, name = "qdflash.kernels.qk_norm_rope", "_qk_norm_rope_kernel"
        constexprs = (dict(HEADS=16, KVH=4, D=int(arg), ROT=int(arg), GATED=False, ZERO_CENTERED=False) if plain
                      else dict(HEADS=16, KVH=4, D=int(arg), ROT=64, GATED=True, ZERO_CENTERED=True))
        signature = {**{f"{p}_ptr": "*bf16" for p in ("qkv", "pos", "cos", "sin", "qw", "kw", "q", "k", "v")},
                     "pos_ptr": "*i64", "stride_t": "i32", "stride_cache": "i32", "q_eps": "fp32", "k_eps": "fp32"}
    elif kind == "gated norm":
        num_warps = 1  # gated_norm's launch
        module, name, constexprs = "qdflash.kernels.gated_norm", "_gated_rms_norm_kernel", dict(H=32, D=int(arg), ROUND_PRODUCT=True)
        signature = {"o_ptr": "*fp32", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_zt": "i32", "eps": "fp32"}
    elif kind.startswith("gdn replay"):  # the rollback's replay of a kept block, every layer, at the block kernel's launch
        from qdflash.kernels.gated_delta import STEP_BLOCK_V

        num_warps, module, name = BLOCK_WARPS, "qdflash.kernels.gated_delta", "_gated_delta_replay_kernel"
        signature = {"tables_ptr": "*i64", "N": "i32", "LAYERS": "i32", "HV": "i32"}
        constexprs = dict(SCRATCH_ROWS=16, DK=128, DV=128, BLOCK_V=STEP_BLOCK_V, LEAN=kind.endswith("lean"))
    elif kind.startswith("gdn"):
        num_warps = (CHUNKED_WARPS if "chunked" in kind else BLOCK_WARPS) if "block" in kind else STEP_WARPS
        module, name, signature, constexprs = (gdn_block_case(int(arg), chunked="chunked" in kind, first_only="kept" in kind)
                                               if "block" in kind else gdn_step_case(int(arg)))
    else:
        module, name, signature, constexprs = (rows_gemv_case(int(arg)) if kind.startswith("gemv") else
                                               attention_case(int(arg) if "tree" in kind else 0, "block" in kind))
    # the GEMV's and the chunked GDN block's launches at the engine's shapes: torch's pointers and these strides are
    # multiples of 16 (the chunked block spilled only so)
    aligned = aligned_args(signature) if kind.startswith("gemv") or "chunked" in kind else []
    used = sm90_resources(module, name, signature, constexprs, num_warps, aligned)
    assert used["STACK"] == 0 and 0 < used["REG"] <= 255, used
    assert used["ATOMS"] == 0, used


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_equals_linear_and_is_used_only_where_tuned(dtype, monkeypatch):
    from qdflash.engine.linear import dense_linear
    from qdflash.kernels import gemv as gemv_module

    n, k = 40, 1024
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(n, k, generator=g).to(DEVICE, dtype), torch.randn(1, k, generator=g).to(DEVICE, dtype)
    ref = x.float() @ w.float().T
    configs = gemv_module.candidate_configs(4096, k)
    assert {c.split_k for c in configs} >= {1, 2}
    unrolled = [c for c in configs if c.unrolled]
    assert {c.split_k for c in unrolled} >= {1, 2}, "the unrolled loop, split and not"
    # a few tiles, split-K among them, the K loop unrolled and not; n=40 is not a multiple of BN
    for config in configs[:: max(1, len(configs) // 4)] + unrolled[:: max(1, len(unrolled) // 3)]:
        y = gemv_module.gemv(x, w, config)
        assert y.dtype == dtype and y.shape == (1, n)
        torch.testing.assert_close(y.float(), ref, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    with pytest.raises(QdflashError, match="does not tile"):
        gemv_module.gemv(x, w, gemv_module.GemvConfig(8, 512, split_k=4))
    # a weight too narrow for those tiles (Qwen3.5's GDN a/b, 64 x 2,560) still gets candidates, K split where it divides
    narrow = gemv_module.candidate_configs(64, 2560)
    assert narrow and all(gemv_module.fits(c, 2560) for c in narrow) and {c.split_k for c in narrow} >= {1, 5, 10}
    w64, x64 = torch.randn(64, 2560, generator=g).to(DEVICE, dtype), torch.randn(1, 2560, generator=g).to(DEVICE, dtype)
    for config in (narrow[0], max(narrow, key=lambda c: c.split_k)):
        torch.testing.assert_close(gemv_module.gemv(x64, w64, config).float(), x64.float() @ w64.float().T,
                                   atol=5e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    # the engine's dense projections take the GEMV only for a tuned shape, one row, kernels on
    calls = []
    monkeypatch.setattr("qdflash.engine.linear.gemv", lambda *a: calls.append(a) or gemv_module.gemv(*a))
    dense_linear(x, w, kernels=True)
    assert not calls, "untuned: cuBLAS / F.linear"
    monkeypatch.setitem(gemv_module._TUNED, (n, k, dtype, 1), configs[0])
    torch.testing.assert_close(dense_linear(x, w, kernels=True).float(), ref, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    three = torch.randn(3, k, generator=g).to(DEVICE, dtype)
    dense_linear(three, w, kernels=True)  # three rows, their bucket not tuned: F.linear
    dense_linear(x, w, kernels=False)
    assert len(calls) == 1
    monkeypatch.setitem(gemv_module._TUNED, (n, k, dtype, 16), gemv_module.candidate_configs(4096, k, rows=16)[0])
    torch.testing.assert_close(dense_linear(three, w, kernels=True).float(), three.float() @ w.float().T,
                               atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    assert len(calls) == 2 and calls[-1][0].shape == (3, k)
    dense_linear(torch.randn(17, k, generator=g).to(DEVICE, dtype), w, kernels=True)  # a prefill: F.linear
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 dot is broken
@pytest.mark.parametrize("rows", [2, 16])
def test_gemv_rows_equals_linear(dtype, rows):
    """The 2-16-row form (a verify block): every tile config it is tuned over at this K, split and unrolled
    among them, 40 weight rows (not a multiple of any row block) and `rows` rows of x (padded to 16)."""
    from qdflash.kernels import gemv as gemv_module

    n, k = 40, 512
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(n, k, generator=g).to(DEVICE, dtype), torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    ref = x.float() @ w.float().T
    configs = gemv_module.candidate_configs(2048, k, rows=rows)
    assert {c.split_k for c in configs} >= {1, 2} and {c.unrolled for c in configs} == {False, True}
    assert all(c.block_n >= 16 for c in configs)
    for config in configs[:: max(1, len(configs) // 6)]:
        y = gemv_module.gemv(x, w, config)
        assert y.dtype == dtype and y.shape == (rows, n)
        torch.testing.assert_close(y.float(), ref, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)
    with pytest.raises(QdflashError, match="1..16"):
        gemv_module.gemv(torch.randn(17, k).to(DEVICE, dtype), w, configs[0])




@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_swiglu_epilogue(dtype, rows):
    """gemv(swiglu=True) on a weight of (gate, up) row pairs is silu(gate) * up of the two matmuls, [rows, N / 2], with
    pairs (50) not a multiple of some tiles' (their last program's pairs past N / 2 masked); a K split (its sums not
    final in any program) is refused."""
    from qdflash.kernels import gemv as gemv_module

    half, k = 50, 512
    g = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(half, k, generator=g).to(DEVICE, dtype) / 8 for _ in range(2))
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = gemv_module.swiglu_pairs(gate, up)
    assert torch.equal(w[0::2], gate) and torch.equal(w[1::2], up)
    ref = (F.silu((x.float() @ gate.float().T).to(dtype)) * (x.float() @ up.float().T).to(dtype)).float()
    configs = [c for c in gemv_module.candidate_configs(4096, k, rows) if gemv_module.swiglu_fits(c, 2 * half)]
    configs = configs[:: max(1, len(configs) // 4)]
    assert any(c.unrolled for c in configs) and any(half % (c.block_n // 2) for c in configs)
    for config in configs:
        y = gemv_module.gemv(x, w, config, swiglu=True)
        assert y.dtype == dtype and y.shape == (rows, half)
        torch.testing.assert_close(y.float(), ref, atol=2e-2 if dtype == torch.float16 else 1e-5, rtol=1e-3)
    split = next(c for c in gemv_module.candidate_configs(4096, k, rows) if c.split_k > 1)
    with pytest.raises(QdflashError, match="one K split"):
        gemv_module.gemv(x, w, split, swiglu=True)
    with pytest.raises(QdflashError, match="differ"):
        gemv_module.swiglu_pairs(gate, up[:-1])


def test_tuning_keeps_the_fastest_and_the_gemv_only_where_it_beats_cublas(monkeypatch):
    """The tuners' bookkeeping, with a stand-in for the CUDA-graph timer: each timed call runs once
    (under Triton's interpreter) and is charged the next made-up time. l2_bytes=1: two weight copies."""
    import qdflash.kernels as kernels
    from qdflash.kernels import gemv as gemv_module
    from qdflash.kernels import w4a16

    def timer(per_call_ms):
        charged = iter(per_call_ms)

        def fake_graph_ms(fn, replays=10):
            fn()
            return 2 * next(charged)  # one timed call runs both weight copies
        monkeypatch.setattr(kernels, "graph_ms", fake_graph_ms)
        monkeypatch.setattr(gemv_module, "graph_ms", fake_graph_ms)

    monkeypatch.setattr(gemv_module, "_TUNED", {})
    monkeypatch.setattr(w4a16, "_TUNED", {})
    gemv_configs = gemv_module.candidate_configs(512, 1024)[:3]
    monkeypatch.setattr(gemv_module, "candidate_configs", lambda n, k, rows=1: gemv_configs)
    timer([5.0, 7.0, 4.0, 6.0])  # cuBLAS 5; the GEMV tiles 7, 4, 6
    result = gemv_module.tune(16, 1024, device=DEVICE, dtype=torch.float32, l2_bytes=1)
    assert result == {"cublas_ms": 5.0, "gemv_ms": 4.0, "config": gemv_configs[1].__dict__, "used": True}
    assert gemv_module.gemv_config(16, 1024, torch.float32) == gemv_configs[1]
    assert gemv_module.gemv_config(16, 1024, torch.float32, rows=16) is None, "a verify block's bucket is tuned apart"
    timer([3.0, 7.0, 4.0, 6.0])  # cuBLAS beats every tile: the shape stays on cuBLAS
    assert not gemv_module.tune(16, 2048, device=DEVICE, dtype=torch.float32, l2_bytes=1)["used"]
    assert gemv_module.gemv_config(16, 2048, torch.float32) is None

    w4_configs = w4a16.candidate_configs(512, 32, None, rows=1)[:2]
    monkeypatch.setattr(w4a16, "candidate_configs", lambda k, group, n=None, rows=16, fast=False: w4_configs)
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", set())
    monkeypatch.setattr(w4a16, "_EXTERNAL_FASTER", {})
    # the tiles 3 and 2, torch's int4 op 4 (the CPU twin of tinygemm takes fp32; gemlite does not run on the CPU),
    # then cuBLAS on the 16-bit weight 5
    timer([3.0, 2.0, 4.0, 5.0])
    assert w4a16.tune(16, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1) == (
        w4_configs[1], 2.0, 5.0, {"tinygemm": 4.0, "gemlite": None, "fbgemm": None, "marlin": None, "machete": None, "mma": None})
    assert w4a16.default_config(16, 512, 32, rows=1, dtype=torch.float32) == w4_configs[1]
    assert not w4a16.dense_faster(16, 512, 32, 1, torch.float32) and w4a16.backend(16, 512, 32, 1, torch.float32) == "w4a16"
    assert (16, 512, 32, 1, torch.bfloat16) not in w4a16._TUNED  # a bf16 engine's tiles are its own
    timer([3.0, 2.0, 2.5, 1.5])  # cuBLAS beats the fastest tile and tinygemm: this shape and row bucket run dense, no other
    assert w4a16.tune(32, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[2] == 1.5
    assert w4a16.dense_faster(32, 512, 32, 1, torch.float32) and w4a16.backend(32, 512, 32, 1, torch.float32) == "dense"
    assert not w4a16.dense_faster(32, 512, 32, 16, torch.float32) and not w4a16.dense_faster(32, 512, 32, 1, torch.bfloat16)
    assert not w4a16.dense_faster(16, 512, 32, 1, torch.float32)
    timer([3.0, 2.0, 1.0, 1.5])  # tinygemm beats both; re-tuned, the shape moves from dense to it
    assert w4a16.tune(32, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[3]["tinygemm"] == 1.0
    assert w4a16.backend(32, 512, 32, 1, torch.float32) == "tinygemm" and not w4a16.dense_faster(32, 512, 32, 1, torch.float32)
    assert w4a16.backend(32, 512, 32, 16, torch.float32) == "w4a16"  # another row bucket: not tuned, the kernel
    timer([3.0, 2.0, 5.0])  # a shape tinygemm does not take (N not a multiple of 8): tiles, then cuBLAS only
    assert w4a16.tune(12, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1) == (
        w4_configs[1], 2.0, 5.0, {"tinygemm": None, "gemlite": None, "fbgemm": None, "marlin": None, "machete": None, "mma": None})


def test_tinygemm_is_checked_before_it_is_timed(monkeypatch):
    """A tinygemm product off the dequantized one (e.g. a packing read differently on some torch) is
    never chosen, however fast: tuning warns and leaves it out."""
    import qdflash.kernels as kernels
    from qdflash.kernels import tinygemm, w4a16

    monkeypatch.setattr(kernels, "graph_ms", lambda fn, replays=10: (fn(), 2.0)[1])
    monkeypatch.setattr(w4a16, "_TUNED", {})
    monkeypatch.setattr(w4a16, "_EXTERNAL_FASTER", {})
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", set())
    one_config = w4a16.candidate_configs(512, 32, None, rows=1)[:1]
    monkeypatch.setattr(w4a16, "candidate_configs", lambda k, group, n=None, rows=16, fast=False: one_config)
    real = tinygemm.matmul
    monkeypatch.setattr(tinygemm, "matmul", lambda x, p, sz, group: real(x, p, sz, group) * 1.1)
    with pytest.warns(UserWarning, match="is off the dequantized product"):
        result = w4a16.tune(16, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)
    assert result[3]["tinygemm"] is None and w4a16.backend(16, 512, 32, 1, torch.float32) != "tinygemm"

    def refuses(*args):  # a torch build whose op refuses the packing
        raise RuntimeError("_convert_weight_to_int4pack: unexpected layout")
    monkeypatch.setattr(tinygemm, "pack", refuses)
    with pytest.warns(UserWarning, match="raised RuntimeError: _convert_weight_to_int4pack: unexpected layout"):
        assert w4a16.tune(16, 512, 32, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[3]["tinygemm"] is None


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_tinygemm_equals_dequantized_linear(group, rows):
    """torch's int4 op on this project's packed ints, repacked (u = q + 8, zero 0): the dequantized
    product in fp32 (its CPU twin; the CUDA op is checked by `tune` on the device before use), and
    within bf16 rounding in bf16."""
    from qdflash.kernels import tinygemm

    n, k = 64, 512
    q, scale, deq = quantized(n, k, group)
    words = pack_int4(q)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    reference = torch.nn.functional.linear(x, deq)
    packed = tinygemm.pack(words, scale, group, torch.float32)
    torch.testing.assert_close(tinygemm.matmul(x, *packed, group), reference, atol=1e-4, rtol=1e-4)
    packed16 = tinygemm.pack(words, scale, group, torch.bfloat16)
    out16 = tinygemm.matmul(x.bfloat16(), *packed16, group)
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - reference).abs().max() / reference.abs().max() < 1e-2
    with pytest.raises(QdflashError, match="tinygemm cannot run a 64x448 weight in group 32"):  # K not a multiple of 128
        tinygemm.pack(torch.zeros(n, 448 // 8, dtype=torch.int32), torch.ones(n, 448 // 32), 32, torch.float32)
    assert not tinygemm.supported(n, k, group, torch.float32, "cuda")  # bf16 only on CUDA
    assert not tinygemm.supported(n, k, 16, torch.float32, "cpu") and not tinygemm.supported(60, k, group, torch.float32, "cpu")


def test_a_packed_projection_runs_dense_only_where_tuning_said_so(monkeypatch):
    """A 4-bit Projection with the kernels on: the W4A16 kernel for 1-16 rows, except for a row bucket
    that tuning timed faster on the dequantized 16-bit weight, which it then keeps (computed once)."""
    from qdflash.engine import linear
    from qdflash.kernels import w4a16
    from qdflash.quant.quantlinear import QuantizedWeight, QuantLinear

    n, k, group = 64, 256, 32
    q, scale, deq = quantized(n, k, group)
    layer = QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False), QuantizedWeight(q, scale, None, GridSpec(4, group, True)))
    projection = linear.Projection.of([layer], torch.float32, kernels=True)
    assert projection.fast
    calls = []
    monkeypatch.setattr(linear, "w4a16_matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or w4a16_matmul(*a, **kw))
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", {(n, k, group, 16, torch.float32)})  # dense won at 2-16 rows only
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    one = projection(x[:1])
    assert calls == [1] and projection._dense is None  # one row: the kernel, no 16-bit copy made
    six = projection(x)
    assert calls == [1] and projection._dense is not None
    assert torch.equal(six, torch.nn.functional.linear(x, deq))  # the dequantized weight's exact product
    torch.testing.assert_close(one, six[:1], atol=1e-4, rtol=1e-4)
    kept = projection._dense
    projection(x[:3])
    assert projection._dense is kept and calls == [1]
    long = torch.randn(20, k, generator=torch.Generator().manual_seed(2))  # a prefill: the kept copy, no kernel
    monkeypatch.setattr(projection, "dequantized", lambda: pytest.fail("dequantized again although a 16-bit copy is kept"))
    assert torch.equal(projection(long), torch.nn.functional.linear(long, deq)) and calls == [1]


@pytest.mark.parametrize("split", [1, 2])
def test_a_packed_gate_up_makes_swiglu_in_the_mma_epilogue_at_one_split(monkeypatch, split):
    """An MLP's packed gate / up (`Projection.of(..., swiglu=True)`) keeps (gate, up) row pairs, ints and scales alike;
    where tuning chose w4_mma and its tile has one K split, `swiglu` asks the kernel for silu(gate) * up (its epilogue),
    else it makes it from the kernel's output: both silu(gate) * up of the two layers (w4_mma stood in for by the
    dequantized product: the kernel itself is PTX, compiled by the sm_90 tests and checked on the GPU by tuning)."""
    from qdflash.engine import linear
    from qdflash.kernels import w4_mma
    from qdflash.kernels.w4a16 import dequantize_words
    from qdflash.quant.quantlinear import QuantizedWeight, QuantLinear

    n, k, group = 32, 256, 32
    layers, deqs = [], []
    for seed in (0, 1):
        q, scale, deq = quantized(n, k, group, seed)
        layers.append(QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False),
                                                 QuantizedWeight(q, scale, None, GridSpec(4, group, True))))
        deqs.append(deq)
    projection = linear.Projection.of(layers, torch.bfloat16, kernels=True, swiglu=True)
    assert projection.fast and projection.pairs and projection.out_features == 2 * n
    calls = []

    def matmul(x, words, scale, group, config=None, swiglu=False):  # w4_mma.matmul on `pack`'s state (here: untouched)
        calls.append(swiglu)
        out = (x.float() @ dequantize_words(words, scale, group).to(x.dtype).float().T).to(x.dtype)
        return torch.nn.functional.silu(out[:, 0::2]) * out[:, 1::2] if swiglu else out

    monkeypatch.setattr(linear, "backend", lambda *a: "mma")
    monkeypatch.setattr(w4_mma, "default_config", lambda n, k, group, rows: w4_mma.Config(8, 64, split))
    monkeypatch.setattr(w4_mma, "pack", lambda words, scale, group, dtype: (words, scale))
    monkeypatch.setattr(w4_mma, "matmul", matmul)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    gate, up = ((x.float() @ d.to(torch.bfloat16).float().T).to(torch.bfloat16) for d in deqs)
    for rows in (1, 3):
        assert torch.equal(linear.swiglu(projection, x[:rows]), torch.nn.functional.silu(gate[:rows]) * up[:rows])
    assert calls == [split == 1] * 2


def test_a_packed_projection_runs_tinygemm_only_where_tuning_chose_it(monkeypatch):
    """Where tuning timed torch's int4 op fastest (here: one row), the projection repacks its ints for
    it once and uses it; other row counts keep the Triton kernel. The same numbers either way."""
    from qdflash.engine import linear
    from qdflash.kernels import tinygemm, w4a16
    from qdflash.quant.quantlinear import QuantizedWeight, QuantLinear

    n, k, group = 64, 256, 32
    q, scale, deq = quantized(n, k, group)
    layer = QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False), QuantizedWeight(q, scale, None, GridSpec(4, group, True)))
    projection = linear.Projection.of([layer], torch.float32, kernels=True)
    kernel_rows, packs = [], []
    monkeypatch.setattr(linear, "w4a16_matmul", lambda *a, **kw: kernel_rows.append(a[0].shape[0]) or w4a16_matmul(*a, **kw))
    monkeypatch.setattr(tinygemm, "pack", lambda *a, _real=tinygemm.pack: packs.append(a[2]) or _real(*a))
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", set())
    monkeypatch.setattr(w4a16, "_EXTERNAL_FASTER", {(n, k, group, 1, torch.float32): "tinygemm"})
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    one, again = projection(x[:1]), projection(x[1:2])
    assert kernel_rows == [] and packs == [group] and projection._dense is None  # packed once, for both calls
    torch.testing.assert_close(torch.cat([one, again]), torch.nn.functional.linear(x[:2], deq), atol=1e-4, rtol=1e-4)
    six = projection(x)
    assert kernel_rows == [6] and packs == [group]
    torch.testing.assert_close(six[:1], one, atol=1e-4, rtol=1e-4)


class FakeGemlite:
    """gemlite's API as its README and `GemLiteLinearTriton.pack` document it (the real package needs CUDA):
    pack(W_q uint8 [N, K], scales [N, K / group], zeros) keeps W = (W_q - zeros) * scales; calling the
    layer is x @ W.T in its input dtype. What is tested is our mapping of the packed ints onto it, and the
    dispatch."""

    class DType:
        BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

    class GemLiteLinearTriton:
        def __init__(self, W_nbits, group_size, in_features, out_features, input_dtype, output_dtype):
            assert W_nbits == 4 and input_dtype == output_dtype
            self.group, self.shape, self.compute_dtype = group_size, (out_features, in_features), input_dtype

        def pack(self, W_q, scales, zeros):
            assert W_q.dtype == torch.uint8 and W_q.shape == self.shape and int(W_q.max()) <= 15
            assert scales.shape == (self.shape[0], self.shape[1] // self.group) and scales.dtype == self.compute_dtype
            self.weight = (W_q.float() - zeros) * scales.float().repeat_interleave(self.group, dim=1)
            self.scale_by = 1.0
            return self

        def __call__(self, x):
            assert x.dtype == self.compute_dtype
            return (self.scale_by * torch.nn.functional.linear(x.float(), self.weight)).to(x.dtype)


def test_tuning_records_the_tile_an_external_kernel_won_with(monkeypatch):
    """An EXTERNAL kernel with tiles: `tune` remembers its fastest tile for the kernel and keeps it for the record
    (`external_tiles`: whether w4_mma won with `prefetch` is what its time alone does not say); a kernel without
    tiles records none, and an untuned shape has nothing."""
    from dataclasses import dataclass

    import qdflash.kernels as kernels
    from qdflash.kernels import w4a16
    from qdflash.kernels.w4a16 import dequantize_words

    n, k, group = 16, 256, 32
    remembered = []

    @dataclass(frozen=True)
    class Tile:
        width: int
        prefetch: bool

    class Tiled:
        supported = staticmethod(lambda n, k, group, dtype, device: True)
        pack = staticmethod(lambda words, scale, group, dtype: (dequantize_words(words, scale, group).to(dtype),))
        configs = staticmethod(lambda n, k, group, rows: [Tile(32, False), Tile(32, True), Tile(64, True)])
        remember = staticmethod(lambda n, k, group, rows, tile: remembered.append(tile))

        @staticmethod
        def matmul(x, weight, group, config=None):
            return torch.nn.functional.linear(x, weight)

    class Plain:  # no tiles of its own
        supported, pack, matmul = Tiled.supported, Tiled.pack, Tiled.matmul

    monkeypatch.setattr(w4a16, "EXTERNAL", {"tiled": Tiled, "plain": Plain})
    times = iter([3.0, 2.0, 4.0, 1.0, 5.0, 6.0])  # our one tile 3; tiled's 2, 4, 1; plain 5; cuBLAS 6
    monkeypatch.setattr(kernels, "graph_ms", lambda fn, replays=10: (fn(), 2 * next(times))[1])  # 2 weight copies a call
    for table in ("_TUNED", "_EXTERNAL_FASTER", "_EXTERNAL_TILE_TIMES"):
        monkeypatch.setattr(w4a16, table, {})
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", set())
    configs = w4a16.candidate_configs(k, group, None, rows=1)[:1]
    monkeypatch.setattr(w4a16, "candidate_configs", lambda k, group, n=None, rows=16, fast=False: configs)
    assert w4a16.external_tiles(n, k, group, 1, torch.float32) == {}
    others = w4a16.tune(n, k, group, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[3]
    assert others == {"tiled": 1.0, "plain": 5.0} and remembered == [Tile(64, True)]
    assert w4a16.external_tiles(n, k, group, 1, torch.float32) == {"tiled": {"width": 64, "prefetch": True}}
    assert w4a16.backend(n, k, group, 1, torch.float32) == "tiled" and w4a16.external_tiles(n, k, group, 16, torch.float32) == {}
    timed = w4a16.external_tile_times(n, k, group, 1, torch.float32)
    assert timed == {"tiled": [({"width": 32, "prefetch": False}, 2.0), ({"width": 32, "prefetch": True}, 4.0),
                               ({"width": 64, "prefetch": True}, 1.0)]}, timed
    import sys

    from qdflash.paths import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import bench_w4_kernels  # the table's best with and without prefetch, and every tile's time

    assert bench_w4_kernels.tile_times(timed) == {
        "tiled_tile_ms": [{"width": 32, "prefetch": False, "ms": 2.0}, {"width": 32, "prefetch": True, "ms": 4.0},
                          {"width": 64, "prefetch": True, "ms": 1.0}], "tiled_prefetch_ms": 1.0, "tiled_plain_ms": 2.0}


def test_gemlite_is_timed_checked_and_dispatched_like_tinygemm(monkeypatch):
    """gemlite (kernels.gemlite_w4; here its documented API on the CPU): this project's ints repacked as
    u = q + 8 with zero 8 give the dequantized product; tuning times it beside the others and a shape
    where it won runs it (packed once); a gemlite off the dequantized product is refused with a warning."""
    import qdflash.kernels as kernels
    from qdflash.engine import linear
    from qdflash.kernels import gemlite_w4, w4a16
    from qdflash.quant.quantlinear import QuantizedWeight, QuantLinear

    monkeypatch.setattr(gemlite_w4, "_MODULE", [FakeGemlite])
    assert not gemlite_w4.supported(64, 512, 32, torch.bfloat16, "cpu")  # CUDA only
    monkeypatch.setattr(gemlite_w4, "supported", lambda n, k, group, dtype, device: dtype in gemlite_w4.KINDS)
    n, k, group = 64, 512, 32
    q, scale, deq = quantized(n, k, group)
    words = pack_int4(q)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    reference = torch.nn.functional.linear(x, deq)
    out16 = gemlite_w4.matmul(x, *gemlite_w4.pack(words, scale, group, torch.bfloat16), group)
    assert out16.dtype == torch.bfloat16 and (out16.float() - reference).abs().max() / reference.abs().max() < 1e-2
    torch.testing.assert_close(gemlite_w4.matmul(x, *gemlite_w4.pack(words, scale, group, torch.float32), group), reference,
                               atol=1e-4, rtol=1e-4)

    times = iter([3.0, 2.0, 4.0, 1.0, 5.0])  # tiles 3, 2; tinygemm 4 (its CPU twin), gemlite 1, cuBLAS 5
    monkeypatch.setattr(kernels, "graph_ms", lambda fn, replays=10: (fn(), 2 * next(times))[1])
    monkeypatch.setattr(w4a16, "_TUNED", {})
    monkeypatch.setattr(w4a16, "_DENSE_FASTER", set())
    monkeypatch.setattr(w4a16, "_EXTERNAL_FASTER", {})
    configs = w4a16.candidate_configs(k, group, None, rows=1)[:2]
    monkeypatch.setattr(w4a16, "candidate_configs", lambda k, group, n=None, rows=16, fast=False: configs)
    assert w4a16.tune(n, k, group, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[3] == {"tinygemm": 4.0, "gemlite": 1.0, "fbgemm": None, "marlin": None, "machete": None, "mma": None}
    assert w4a16.backend(n, k, group, 1, torch.float32) == "gemlite"

    layer = QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False), QuantizedWeight(q, scale, None, GridSpec(4, group, True)))
    projection = linear.Projection.of([layer], torch.float32, kernels=True)
    packs = []
    monkeypatch.setattr(gemlite_w4, "pack", lambda *a, _real=gemlite_w4.pack: packs.append(a[2]) or _real(*a))
    one, again = projection(x[:1]), projection(x[1:2])
    assert packs == [group] and set(projection._external) == {"gemlite"}  # packed once, for both calls
    torch.testing.assert_close(torch.cat([one, again]), reference[:2], atol=1e-4, rtol=1e-4)

    real_pack = FakeGemlite.GemLiteLinearTriton.pack
    monkeypatch.setattr(FakeGemlite.GemLiteLinearTriton, "pack",
                        lambda self, *a: setattr(real_pack(self, *a), "scale_by", 1.1) or self)  # 10% off
    times = iter([3.0, 2.0, 4.0, 5.0])  # gemlite is checked first and not timed
    monkeypatch.setattr(kernels, "graph_ms", lambda fn, replays=10: (fn(), 2 * next(times))[1])
    with pytest.warns(UserWarning, match="gemlite on 64x512 .* is off the dequantized product"):
        assert w4a16.tune(n, k, group, rows=1, device=DEVICE, dtype=torch.float32, l2_bytes=1)[3]["gemlite"] is None
    assert w4a16.backend(n, k, group, 1, torch.float32) == "w4a16"


def test_fbgemm_takes_our_ints_two_per_byte_low_nibble_first():
    """kernels.fbgemm_w4 (FBGEMM's CUTLASS int4 GEMM; CUDA only, so not a candidate here): our packed ints
    become FBGEMM's int8 layout, column 2i in the low nibble and 2i+1 in the high one, each signed, as
    FBGEMM's `pack_int4` writes them; the nibbles read back (sign-extended) are the ints."""
    from qdflash.kernels import fbgemm_w4

    q, _, _ = quantized(16, 256, 128)
    two = fbgemm_w4.two_per_byte(unpack_int4(pack_int4(q)))
    assert two.dtype == torch.int8 and two.shape == (16, 128)
    low, high = torch.bitwise_right_shift(torch.bitwise_left_shift(two, 4), 4), torch.bitwise_right_shift(two, 4)
    assert torch.equal(low, q[:, 0::2]) and torch.equal(high, q[:, 1::2])
    assert not fbgemm_w4.supported(16, 256, 128, torch.bfloat16, "cpu")  # CUDA only
    with pytest.raises(QdflashError, match="odd"):
        fbgemm_w4.two_per_byte(q[:, :3])


def test_marlin_reads_our_words_as_gptq_and_its_scales_in_8x8_tiles():
    """kernels.marlin_w4 (vLLM's Marlin ops; CUDA only, so not a candidate here): our words [N, K/8] are
    GPTQ's [K/8, N] transposed (word i of output n holds features 8i..8i+7, nibble j = q + 8 of feature
    8i + j); the scales go [K/group, N] with every 64 consecutive entries an 8 x 8 tile transposed."""
    from qdflash.kernels import marlin_w4

    n, k, group = 64, 256, 32
    q, scale, _ = quantized(n, k, group)
    gptq = marlin_w4.gptq_words(pack_int4(q))
    assert gptq.shape == (k // 8, n) and gptq.dtype == torch.int32
    for out, feature in ((0, 0), (5, 13), (63, 255), (17, 128)):
        word = int(gptq[feature // 8, out]) & 0xFFFFFFFF
        assert (word >> (4 * (feature % 8))) & 0xF == int(q[out, feature]) + 8
    permuted = marlin_w4.permute_scales(scale)
    assert permuted.shape == (k // group, n)
    flat, source = permuted.reshape(-1), scale.t().reshape(-1)
    for index in (0, 1, 8, 9, 63, 64, 100, 511):
        tile, within = divmod(index, 64)
        row, col = divmod(within, 8)
        assert flat[index] == source[64 * tile + 8 * col + row]
    assert not marlin_w4.supported(n, k, group, torch.bfloat16, "cpu")  # CUDA only
    marlin_w4._MODULE[:] = [True]  # as if the ops loaded: the shape rules alone
    try:
        assert marlin_w4.supported(64, 256, 128, torch.bfloat16, "cuda")
        assert not marlin_w4.supported(64, 128, 128, torch.bfloat16, "cuda")  # one group: per-channel scale order
        assert not marlin_w4.supported(96, 256, 128, torch.bfloat16, "cuda")  # N not a multiple of 64
    finally:
        marlin_w4._MODULE[:] = []
    assert marlin_w4.UINT4B8 == 1125899907892224  # vLLM's scalar_types.uint4b8.id (vllm 0.26.0)
    with pytest.raises(QdflashError, match="64-entry tiles"):
        marlin_w4.permute_scales(scale[:8, :1])


def test_marlin_is_one_node_a_compiled_step_traces_through(monkeypatch):
    """marlin_w4.matmul goes through our custom op `qdflash::marlin_w4_mm`, whose fake kernel lets
    torch.compile trace it without a graph break (vLLM's `_C::marlin_gemm` loaded alone has none: the H200
    step broke at every projection). Marlin itself is CUDA only, so its call (`_gemm`) is stood in for by
    the dequantized product here; what is tested is the op's registration: the fake's shape and dtype
    against the real call (torch.library.opcheck), and a fullgraph compile that keeps it as one node."""
    from qdflash.kernels import marlin_w4

    n, k, group = 64, 256, 32
    q, scale, weight = quantized(n, k, group)

    def reference(x, tiled, scales, workspace, n_out):  # what Marlin computes, from the same weight
        assert n_out == weight.shape[0]
        return (x.float() @ weight.float().t()).to(scales.dtype)

    monkeypatch.setattr(marlin_w4, "_gemm", reference)
    tiled, scales, workspace = pack_int4(q), scale.to(torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    x = torch.randn(3, k)
    torch.library.opcheck(marlin_w4._marlin_mm, (x.to(torch.bfloat16), tiled, scales, workspace, n))

    backend = GraphRecorder()

    def step(x):  # a projection between elementwise work, as in a decode step
        return torch.nn.functional.silu(marlin_w4.matmul(x * 2.0, tiled, scales, workspace, n, group)) + 1.0

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    ops = backend.ops()
    assert ops.count(torch.ops.qdflash.marlin_w4_mm.default) == 1, ops


def test_w4_mma_is_one_node_a_compiled_step_traces_through(monkeypatch):
    """w4_mma.matmul goes through our custom op `qdflash::w4_mma_mm` (as Marlin does), so a compiled decode step holds
    it as one node instead of tracing the launch; its tile is the tuned one. The kernel is CUDA only, so its launch is
    stood in for by the dequantized product (rounded to bf16, as it rounds the weights): opcheck compares the fake's
    shape and dtype with the call, and a fullgraph compile keeps the op as one node."""
    from qdflash.kernels import w4_mma

    n, k, group = 64, 256, 32
    q, scale, deq = quantized(n, k, group)
    weight = deq.to(torch.bfloat16).float()
    tiles = []

    def reference(x, words, scales, counts, n_out, group_, block_p, block_w, split_k, num_warps, prefetch, swiglu=False):
        tiles.append(w4_mma.Config(block_p, block_w, split_k, num_warps, prefetch))
        assert n_out == n and group_ == group and words.shape == (n // 2, k // 4)
        out = (x.float() @ weight.t()).to(x.dtype)
        return torch.nn.functional.silu(out[:, 0::2]) * out[:, 1::2] if swiglu else out

    monkeypatch.setattr(w4_mma, "_launch", reference)
    monkeypatch.setattr(w4_mma, "_TUNED", {})
    words, pairs = w4_mma.pack_words(pack_int4(q)), w4_mma.pack_scales(scale)
    counts = torch.zeros(8, dtype=torch.int32)
    x = torch.randn(1, k).to(torch.bfloat16)
    torch.library.opcheck(w4_mma._mma_mm, (x, words, pairs, counts, n, group, 8, 32, 2, 4, True))
    block = torch.randn(16, k).to(torch.bfloat16)  # a verify block: the rows kernel, [16, N] out
    torch.library.opcheck(w4_mma._mma_mm, (block, words, pairs, counts, n, group, 32, 16, 1, 4, False))
    # silu(gate) * up in the epilogue (rows as (gate, up) pairs): [rows, N / 2] out, the fake's shape too
    torch.library.opcheck(w4_mma._mma_mm, (block, words, pairs, counts, n, group, 32, 16, 1, 4, False, True))
    tile = w4_mma.Config(4, 32, 2, prefetch=True)
    w4_mma.remember(n, k, group, 1, tile)
    backend = GraphRecorder()

    def step(x):  # a projection between elementwise work, as in a decode step
        return torch.nn.functional.silu(w4_mma.matmul(x * 2.0, words, pairs, counts, n, group)) + 1.0

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), step(x)) and tiles[-1] == tile
    assert backend.ops().count(torch.ops.qdflash.w4_mma_mm.default) == 1, backend.ops()
    with pytest.raises(QdflashError, match="1-16 bf16 rows of 256 expected"):
        w4_mma.matmul(x.float(), words, pairs, counts, n, group)


def test_machete_takes_our_words_as_they_are_and_only_its_shapes(monkeypatch):
    """kernels.machete_w4 (vLLM's Machete ops; Hopper only, so not a candidate here): the shapes it takes
    (groups 64 / 128, K a multiple of 64, N of 128, compute capability 9.0), its prepack reading our words
    [N, K/8] as GPTQ's [K/8, N] column-major (a transposed view, no copy) and the scales [K/group, N];
    then, through our custom op with the dequantized product standing in for Machete, the fake's shape and
    dtype against the real call (torch.library.opcheck) and a fullgraph compile that keeps it one node."""
    from qdflash.kernels import machete_w4, w4a16

    assert w4a16.EXTERNAL["machete"] is machete_w4
    assert not machete_w4.supported(128, 256, 128, torch.bfloat16, "cpu")  # CUDA only
    machete_w4._MODULE[:] = [True]  # as if the ops loaded: the shape rules alone
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert machete_w4.supported(128, 256, 128, torch.bfloat16, "cuda")
        assert machete_w4.supported(256, 512, 64, torch.float16, "cuda")
        assert not machete_w4.supported(128, 256, 32, torch.bfloat16, "cuda")  # the target's group: not Machete's
        assert not machete_w4.supported(64, 256, 128, torch.bfloat16, "cuda")  # N not a multiple of 128
        assert not machete_w4.supported(128, 256, 128, torch.float32, "cuda")  # 16-bit activations only
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert not machete_w4.supported(128, 256, 128, torch.bfloat16, "cuda")  # Hopper only
    finally:
        machete_w4._MODULE[:] = []

    n, k, group = 128, 256, 128
    q, scale, weight = quantized(n, k, group)
    words = pack_int4(q)
    seen = {}

    def prepack(b, a_type, b_type, scales_type):  # what vLLM's prepack is handed
        seen.update(shape=tuple(b.shape), stride=b.stride(), shares=b.data_ptr() == words.data_ptr(), b_type=b_type)
        return b.t().contiguous()

    monkeypatch.setattr(torch.ops._C, "machete_prepack_B", prepack, raising=False)
    monkeypatch.setattr(machete_w4, "supported", lambda *a: True)
    prepacked, scales = machete_w4.pack(words, scale, group, torch.bfloat16)
    assert seen == {"shape": (k // 8, n), "stride": (1, k // 8), "shares": True, "b_type": machete_w4.marlin_w4.UINT4B8}
    assert scales.shape == (k // group, n) and scales.dtype == torch.bfloat16 and torch.equal(scales, scale.t().to(torch.bfloat16))

    def reference(x, prepacked, scales, group_size):  # what Machete computes, from the same weight
        assert group_size == group
        return (x.float() @ weight.float().t()).to(scales.dtype)

    monkeypatch.setattr(machete_w4, "_mm", reference)
    x = torch.randn(3, k)
    torch.library.opcheck(machete_w4._machete_mm, (x.to(torch.bfloat16), prepacked, scales, group))
    backend = GraphRecorder()

    def step(x):
        return torch.nn.functional.silu(machete_w4.matmul(x * 2.0, prepacked, scales, group)) + 1.0

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    ops = backend.ops()
    assert ops.count(torch.ops.qdflash.machete_w4_mm.default) == 1, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_split_and_shared_row(dtype, splits):
    """The decode attention kernel with its positions cut into chunks (flash-decoding: empty chunks
    included, lengths not a multiple of the block) equals the softmax attention over each row's own
    positions, also from a start position per row (a sliding window); T rows over one cache row of stride 0 (a verify block) give each row the result it
    gets alone, i.e. what a one-token step at that position computes."""
    from qdflash.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    kv_heads, rep, d, max_len = 2, 3, 16, 300
    lengths = torch.tensor([1, 17, 64, 65, 200, 300])
    b = lengths.numel()
    k_cache, v_cache = (torch.randn(b, kv_heads, max_len, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(b, kv_heads * rep, d, generator=g).to(dtype)
    got = decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), lengths.to(DEVICE), block_n=32,
                           splits=splits).cpu().float()
    for i, n in enumerate(lengths.tolist()):
        keys = k_cache[i, :, :n].float().repeat_interleave(rep, 0)  # [heads, n, D]
        values = v_cache[i, :, :n].float().repeat_interleave(rep, 0)
        weights = torch.softmax(q[i].float()[:, None] @ keys.transpose(1, 2) * d ** -0.5, dim=-1)
        expected = (weights @ values)[:, 0]
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got[i], expected, atol=tol, rtol=tol)
    starts = torch.tensor([0, 3, 0, 10, 150, 299])  # a sliding window: row i attends starts[i]..lengths[i]-1
    windowed = decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), lengths.to(DEVICE), block_n=32,
                                splits=splits, starts=starts.to(DEVICE)).cpu().float()
    for i, (a, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        keys = k_cache[i, :, a:n].float().repeat_interleave(rep, 0)
        values = v_cache[i, :, a:n].float().repeat_interleave(rep, 0)
        weights = torch.softmax(q[i].float()[:, None] @ keys.transpose(1, 2) * d ** -0.5, dim=-1)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(windowed[i], (weights @ values)[:, 0], atol=tol, rtol=tol)
    shared = decode_attention(q.to(DEVICE), k_cache[-1:].expand(b, -1, -1, -1).to(DEVICE),
                              v_cache[-1:].expand(b, -1, -1, -1).to(DEVICE), lengths.to(DEVICE), block_n=32, splits=splits)
    for i in range(b):
        alone = decode_attention(q[i : i + 1].to(DEVICE), k_cache[-1:].to(DEVICE), v_cache[-1:].to(DEVICE),
                                 lengths[i : i + 1].to(DEVICE), block_n=32, splits=splits)
        assert torch.equal(shared[i], alone[0])  # bit for bit: a row's result depends on its own inputs only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_is_the_models_gated_norm(dtype):
    """kernels.gated_norm: one launch gives what the engine's unfused lines give with transformers' module
    (norm(o rounded) * weight * silu(z), each rounding where torch rounds), z strided as the tail of a qkvz output.
    fp32: to the reduction order's rounding. bf16: most outputs bit for bit (a rounding left out or added would move
    many by an ulp), none off by more than one; on the CPU against the same lines rounding toward zero, as Triton's
    interpreter casts to bf16 (the GPU rounds to nearest, as torch does)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    from qdflash.kernels.gated_norm import gated_rms_norm, supported

    g = torch.Generator().manual_seed(0)
    t, h, d = 5, 4, 32
    norm = Qwen3_5RMSNormGated(d, eps=1e-6)
    norm.weight.data = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    assert supported(norm)
    o = (3 * torch.randn(t, h, d, generator=g)).to(DEVICE)
    qkvz = torch.randn(t, 24 + h * d, generator=g).to(DEVICE, dtype)
    z = qkvz[:, 24:]  # the z columns of a fused projection's rows
    norm = norm.to(DEVICE)
    ref = norm(o.to(dtype), z.reshape(t, h, d)).reshape(t, -1)
    got = gated_rms_norm(o, z, norm.weight, norm.variance_epsilon)
    assert got.dtype == dtype and got.shape == (t, h * d)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        def cast(x):  # to bf16 as this device's kernel casts: to nearest on a GPU, toward zero in the interpreter
            if DEVICE == "cuda":
                return x.to(dtype)
            return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)

        def lines(weight):  # the module's lines; weight x norm rounded only where torch's product is bf16
            x = cast(o).float()
            normed = cast(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).float()
            product = weight.float() * normed
            if weight.dtype == dtype:
                product = cast(product).float()
            gate = z.reshape(t, h, d).float()
            return cast(product * (gate / (1 + torch.exp(-gate)))).reshape(t, -1)

        if DEVICE != "cuda":
            ref = lines(norm.weight)
        # an fp32 weight with bf16 activations (torch keeps weight x norm in fp32): the kernel's other rounding
        wide = norm.weight.float()
        for want, have in ((ref, got), (lines(wide), gated_rms_norm(o, z, wide, norm.variance_epsilon))):
            assert (have == want).float().mean().item() > 0.97
            ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-3)
            assert ((have.float() - want.float()).abs() <= ulp * 1.01).all()
    with pytest.raises(QdflashError, match=r"z \[5, 128\]"):
        gated_rms_norm(o, z[:, :-1], norm.weight, norm.variance_epsilon)
    assert not supported(Qwen3_5RMSNormGated(24))  # D not a power of two: the module runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_is_the_models_norms_rotation_and_cache_writes(dtype):
    """kernels.qk_norm_rope: one launch gives the q that transformers' q_norm and rotation give (the engine's module
    lines), and writes k (k_norm, rotated) and v into the caches at the tokens' positions, nothing else; qkv rows
    strided (a wider buffer's). fp32: to the reduction order's rounding. bf16: most values bit for bit (a rounding
    left out or added would move many), none off by more than one ulp; on the CPU against the same lines rounding
    toward zero, as Triton's interpreter casts to bf16. A layer the kernel cannot compute is refused by name."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from qdflash.kernels.qk_norm_rope import qk_norm_rope, supported
    from qdflash.ops import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, d, rot, max_len = 3, 4, 2, 32, 8, 24
    q_norm, k_norm = Qwen3_5RMSNorm(d, eps=1e-6), Qwen3_5RMSNorm(d, eps=0.5)  # each its own eps (a large one: seen)
    for norm in (q_norm, k_norm):
        norm.weight.data = (0.3 * torch.randn(d, generator=g)).to(dtype)
        norm.to(DEVICE)
    assert supported(d, rot, q_norm, k_norm, dtype) and not supported(24, rot, q_norm, k_norm, dtype)
    assert not supported(d, 7, q_norm, k_norm, dtype)
    width = heads * 2 * d + 2 * kv_heads * d
    buffer = (3 * torch.randn(t, width + 16, generator=g)).to(DEVICE, dtype)
    qkv = buffer[:, 16:]  # strided rows
    positions = torch.tensor([5, 6, 17], device=DEVICE)
    cos, sin = rope_tables(rot, max_len, 10000.0, DEVICE, dtype)
    k_cache = torch.zeros(kv_heads, max_len, d, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = qk_norm_rope(qkv, positions, cos, sin, q_norm, k_norm, k_cache, v_cache, heads)

    def cast(x):  # to the dtype as this device's kernel casts: to nearest on a GPU, toward zero in the interpreter
        if DEVICE == "cuda" or dtype == torch.float32:
            return x.to(dtype)
        return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)

    def lines(x, norm):  # [T, H, D]: the module's norm, then the rotation's bf16 ops, each rounded
        x = x.float()
        normed = cast(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.float()))
        if DEVICE == "cuda" or dtype == torch.float32:  # the engine's own lines
            return torch.cat([apply_rope(normed[..., :rot].transpose(0, 1), cos[positions], sin[positions]).transpose(0, 1),
                              normed[..., rot:]], dim=-1)
        c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
        part = normed[..., :rot].float()
        turned = torch.cat([-part[..., rot // 2:], part[..., : rot // 2]], dim=-1)
        return torch.cat([cast(cast(part * c).float() + cast(turned * s).float()), normed[..., rot:]], dim=-1)

    want_q = lines(qkv[:, : heads * 2 * d].reshape(t, heads, 2 * d)[..., :d], q_norm)
    want_k = lines(qkv[:, heads * 2 * d: heads * 2 * d + kv_heads * d].reshape(t, kv_heads, d), k_norm)
    v = qkv[:, heads * 2 * d + kv_heads * d:].reshape(t, kv_heads, d)
    got_k, got_v = k_cache[:, positions].transpose(0, 1), v_cache[:, positions].transpose(0, 1)
    assert torch.equal(got_v, v)  # v copied as it is
    others = torch.ones(max_len, dtype=torch.bool)
    others[positions.cpu()] = False
    assert not k_cache[:, others.to(DEVICE)].any() and not v_cache[:, others.to(DEVICE)].any()  # nothing else written
    for want, have in ((want_q, q), (want_k, got_k)):
        assert have.dtype == dtype and have.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
        else:
            assert (have == want).float().mean().item() > 0.97
            ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-3)
            assert ((have.float() - want.float()).abs() <= ulp * 1.01).all()
    with pytest.raises(QdflashError, match=r"qkv \[T, 384\]"):
        qk_norm_rope(qkv[:, :-1], positions, cos, sin, q_norm, k_norm, k_cache, v_cache, heads)
    with pytest.raises(QdflashError, match="int64 positions"):
        qk_norm_rope(qkv, positions.int(), cos, sin, q_norm, k_norm, k_cache, v_cache, heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_computes_the_drafters_q_k_norms_and_rotation(dtype):
    """kernels.qk_norm_rope with gated=False and the drafter's plain RMSNorms (`drafter.model.RMSNorm`, Triton's
    interpreter): q, and the k / v it writes into the caches at the tokens' positions, as the drafter layer's own
    lines compute them (`rms_norm`: the normalized row rounded, times w, rounded; `rotary`), for a block's rows and
    for k / v-only context rows (heads=0); the caches' other positions untouched. fp32 to its rounding; bf16 to a
    unit in its last place, since the interpreter truncates fp32 to bf16 where a GPU rounds to nearest (a
    zero-centered norm's 1 + w, with w in 0.5..1.5 here, would be off by ~2x)."""
    pytest.importorskip("triton")
    from qdflash.drafter.model import RMSNorm, rotary
    from qdflash.kernels import qk_norm_rope
    from qdflash.ops import rope_tables

    torch.manual_seed(0)
    heads, kv_heads, d, t, theta = 4, 2, 16, 3, 1e6
    q_norm, k_norm = RMSNorm(d, 1e-6).to(dtype), RMSNorm(d, 1e-5).to(dtype)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    assert qk_norm_rope.supported(d, d, q_norm, k_norm, dtype) and not qk_norm_rope.zero_centered(q_norm)
    assert not qk_norm_rope.supported(d, d, q_norm, k_norm, torch.float16)  # a plain norm's weight in another dtype
    cos, sin = rope_tables(d, 32, theta, "cpu", dtype)
    positions = torch.tensor([5, 6, 7])
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d) * 3).to(dtype)
    k_cache, v_cache = torch.zeros(kv_heads, 32, d, dtype=dtype), torch.zeros(kv_heads, 32, d, dtype=dtype)
    q = qk_norm_rope.qk_norm_rope(qkv, positions, cos, sin, q_norm, k_norm, k_cache, v_cache, heads, gated=False)

    def heads_of(x, n):  # [T, n * D] -> [n, T, D]
        return x.reshape(t, n, d).transpose(0, 1)

    with torch.no_grad():
        want_q = rotary(q_norm(heads_of(qkv[:, : heads * d], heads)), positions, theta)
        want_k = rotary(k_norm(heads_of(qkv[:, heads * d : (heads + kv_heads) * d], kv_heads)), positions, theta)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.transpose(0, 1), want_q, **tol)
    torch.testing.assert_close(k_cache[:, 5:8], want_k, **tol)
    assert torch.equal(v_cache[:, 5:8], heads_of(qkv[:, (heads + kv_heads) * d :], kv_heads))
    assert not k_cache[:, :5].any() and not k_cache[:, 8:].any()
    # a context row: its k / v projection alone, no query heads
    kv = qkv[:, heads * d :].contiguous()
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    out = qk_norm_rope.qk_norm_rope(kv, positions, cos, sin, k_norm, k_norm, k2, v2, 0, gated=False)
    assert out.shape == (t, 0, d) and torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


def test_first_best_is_max_with_a_key_and_traces_as_one_graph():
    """kernels.first_best: max(items, key=score) (the first of equals), and min by a negated score, for the config
    heuristics of w4a16 and w4_mma (the 4B shapes, both row buckets); dynamo traces both heuristics without a break
    (fullgraph), where max / min with a key over their Configs broke a compiled step; nothing to choose from is an error."""
    import random

    from qdflash.kernels import first_best, w4_mma, w4a16

    rng = random.Random(0)
    for _ in range(200):
        items = [(rng.randint(0, 3), rng.randint(0, 3), i) for i in range(rng.randint(1, 12))]
        assert first_best(items, lambda t: t[:2]) == max(items, key=lambda t: t[:2])
        assert first_best(items, lambda t: (-t[0], t[1])) == min(items, key=lambda t: (t[0], -t[1]))
    for n, k in ((2560, 9216), (9216, 2560), (12288, 2560), (248320, 2560)):  # Qwen3.5-4B's
        for rows in (1, 16):
            fitting = w4_mma.configs(n, k, 128, rows)
            if fitting:
                assert w4_mma.default_config(n, k, 128, rows) == min(
                    fitting, key=lambda c: (abs(-(-n // (2 * c.block_p)) * c.split_k - 512), -c.block_w))
            fitting = candidate_configs(k, 128, n, rows)
            enough = [c for c in fitting if -(-n // c.block_n) * c.split_k >= 256] or fitting
            assert w4a16.default_config(n, k, 128, rows) == max(
                enough, key=lambda c: (c.block_k8, -c.split_k, c.block_n if rows > 1 else -c.block_n))

    # inside a compiled step, untuned: traced without a break (max / min with a key over Configs broke it)
    for rows in (1, 16):
        @torch.compile(backend="eager", fullgraph=True)
        def picks(x):
            return x * w4_mma.default_config(2560, 9216, 128, rows).block_p * w4a16.default_config(2560, 9216, 128, rows).block_n

        assert picks(torch.ones(1)).item() == (w4_mma.default_config(2560, 9216, 128, rows).block_p
                                               * w4a16.default_config(2560, 9216, 128, rows).block_n)
    with pytest.raises(ValueError, match="first_best of nothing"):
        first_best([], lambda t: t)
