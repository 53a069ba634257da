"""Is the fused GDN step kernel of one source tree the same machine code as another's? Compiles
`qdflash.kernels.gated_delta._gated_delta_step_kernel` from each tree for the H200 (sm_90) on this machine, with no
GPU (Triton's own compiler and its bundled cuobjdump), at Qwen3.5-4B's layer shape and the default launch (16 value
columns, 4 warps, the a / b dot in the kernel, per-position states kept; no PDL, no norm in trees that had them), and
prints per tree and block length: registers, SASS instruction count and a hash of the instructions with constant-bank
offsets blanked (a kernel with more parameters addresses them elsewhere). Why: on the H200 the kernel took 152 us a
decode step at d0dc17c and 180 us from 639ca92 on (results/published/2026-12-05-h200-components-gaps); 0f4f112
restored the older input loads, and this shows its decode-step SASS equals d0dc17c's.

    git worktree add /tmp/old d0dc17c
    python scripts/investigations/gdn_sass.py /tmp/old/src src --tokens 1,16

Run it with the device's Triton (3.6 on the H200 image) for the device's code: other versions schedule differently.
Each tree compiles in a process of its own (the two trees' modules share a name).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

COMPILE = r"""
import hashlib, json, os, re, subprocess, sys, tempfile
src, tokens = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, src)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qdflash.kernels import gated_delta
fn = gated_delta._gated_delta_step_kernel
types = {"qkvz_ptr": "*bf16", "qkvz_stride": "i32", "conv_in_ptr": "*bf16", "conv_w_ptr": "*bf16", "pos_ptr": "*i64",
         "x_ptr": "*bf16", "ba_ptr": "*bf16", "ba_stride": "i32", "decay_ptr": "*fp32", "dt_bias_ptr": "*bf16",
         "state_ptr": "*fp32", "out_ptr": "*fp32", "states_ptr": "*fp32", "norm_w_ptr": "*bf16", "y_ptr": "*bf16",
         "arrivals_ptr": "*i32", "HV": "i32", "KEY_DIM": "i32", "CONV_DIM": "i32", "SCALE": "fp32", "EPS": "fp32"}
# every constexpr any version of the kernel took, at Qwen3.5-4B's layer shape and the default launch
consts = dict(HIDDEN=2560, HIDDEN_P=4096, H_CHUNKS=5, BLOCK_H=512, T=tokens, T_P=tokens, REP=2, KW=4, KW_P=4, DK=128,
              DV=128, BLOCK_V=16, BA_DOT=True, STORE_STATES=True, PDL=False, NORM=False, ROUND_PRODUCT=False)
sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={n: consts[n] for n in sig if sig[n] == "constexpr"}),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernel.asm["cubin"])
    f.flush()
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
lines = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[..]", re.sub(r"/\*[0-9a-f]{4}\*/|/\* 0x[0-9a-f]+ \*/", "", line)).strip()
         for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
print(json.dumps({"triton": triton.__version__, "tokens": tokens, "instructions": len(lines),
                  "sass_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16],
                  **{k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+", help="source directories holding the qdflash package (a checkout's src/)")
    parser.add_argument("--tokens", default="1,16", help="block lengths, comma-separated (1: a decode step)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces triton.language
    for tree in args.trees:
        if not os.path.isfile(os.path.join(tree, "qdflash", "kernels", "gated_delta.py")):
            raise SystemExit(f"gdn_sass: {tree} holds no qdflash/kernels/gated_delta.py (give a checkout's src/)")
        for tokens in args.tokens.split(","):
            out = subprocess.run([sys.executable, "-c", COMPILE, os.path.abspath(tree), tokens], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                raise SystemExit(f"gdn_sass: {tree} at {tokens} tokens did not compile:\n{out.stderr[-2000:]}")
            print(json.dumps({"tree": tree, **json.loads(out.stdout.strip().splitlines()[-1])}))


if __name__ == "__main__":
    main()
