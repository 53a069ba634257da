"""How many machine instructions does a W4 kernel spend per weight in its K loop? Compiles the one-row fp32 FMA GEMV
(`w4a16._w4a16_gemv_kernel`) and the tensor-core kernels (`w4_mma._w4_mma_kernel`, plain and with prefetch, and
`_w4_mma_rows_kernel` for a 16-row verify block) for the H200 (sm_90) on this machine, with no GPU (Triton's own
compiler and its bundled cuobjdump), at group 32 and 4 warps, and prints per kernel: registers, the instructions of the
innermost loop (the body between a backward branch and its target) by opcode, and those over the weights a thread
handles in one pass of it. Why: at one row a 4-bit GEMV has few instructions per byte to spend before instruction
issue, not memory, bounds it (kernels/w4_mma.py's docstring).

    python scripts/investigations/w4_sass.py

Run it with the device's Triton (3.6 on the H200 image) for the device's code: other versions schedule differently.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

COMPILE = r"""
import importlib, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
sig = {**signature, **{key: "constexpr" for key in constexprs}}
# pointers, strides and a split's K are multiples of 16 at the engine's shapes, as Triton specializes them at a launch
attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig) if arg.endswith("_ptr") or arg.startswith(("stride", "W_PER", "K_PER"))}
kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernel.asm["cubin"])
    f.flush()
    print(subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout)
    print(subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout)
"""

W4_ONE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_wn": "i32",
          "stride_sn": "i32", "stride_os": "i32", "K_PER_SPLIT": "i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
MMA_ONE = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16", "N2": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_os": "i32", "W_PER_SPLIT": "i32", "y_ptr": "*bf16", "counts_ptr": "*i32"}
MMA_ROWS = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N2": "i32", "stride_xm": "i32",
            "stride_wn": "i32", "stride_sn": "i32", "stride_os": "i32", "W_PER_SPLIT": "i32", "y_ptr": "*bf16",
            "counts_ptr": "*i32"}
# label -> (module, kernel, signature, constexprs, weights a thread handles in one pass of the K loop: tile / 128 threads)
CASES = {
    "fp32 FMA GEMV, 16 x 64 words": ("qdflash.kernels.w4a16", "_w4a16_gemv_kernel", W4_ONE,
                                     dict(GROUP=32, BLOCK_N=16, BLOCK_K8=64, SPLITS=1), 16 * 64 * 8 // 128),
    "mma, 16 pairs x 64 words": ("qdflash.kernels.w4_mma", "_w4_mma_kernel", MMA_ONE,
                                 dict(GROUP_WORDS=8, BLOCK_P=16, BLOCK_W=64, SPLITS=1, PREFETCH=False, PDL=False), 16 * 64 * 8 // 128),
    "mma prefetch, 16 pairs x 64 words": ("qdflash.kernels.w4_mma", "_w4_mma_kernel", MMA_ONE,
                                          dict(GROUP_WORDS=8, BLOCK_P=16, BLOCK_W=64, SPLITS=1, PREFETCH=True, PDL=False),
                                          16 * 64 * 8 // 128),
    "mma rows (16), 32 pairs x 16 words": ("qdflash.kernels.w4_mma", "_w4_mma_rows_kernel", MMA_ROWS,
                                           dict(GROUP_WORDS=8, BLOCK_P=32, HIGH=True, SPLITS=1, PREFETCH=False, PDL=False),
                                           32 * 16 * 8 // 128),
}


def loop_body(sass: str) -> list[str]:
    """The instructions of the last loop closed by a backward branch (the K loop: the kernels have one)."""
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(lines)}
    body = []
    for i, (address, text) in enumerate(lines):
        target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            body = [t for _, t in lines[index[int(target.group(1), 16)]:i + 1]]
    return body


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces triton.language
    for label, (module, name, signature, constexprs, weights) in CASES.items():
        out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, name, signature, constexprs])],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"w4_sass: {label} did not compile:\n{out.stderr[-2000:]}")
        body = loop_body(out.stdout)
        if not body:
            raise SystemExit(f"w4_sass: no loop found in {label}'s SASS")
        opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        print(json.dumps({"kernel": label, "registers": int(re.search(r"REG:(\d+)", out.stdout).group(1)),
                          "loop_instructions": len(body), "weights_a_thread": weights,
                          "instructions_a_weight": round(len(body) / weights, 2), "opcodes": dict(opcodes.most_common())}))


if __name__ == "__main__":
    main()
