"""What does a GDN token cost in synchronization? Compiles the two-phase block kernel
(`qdflash.kernels.gated_delta._gated_delta_block_kernel`, keeping every state and keeping its inputs) and the replay
(`_gated_delta_replay_kernel`, lean and not) of one or more source trees for the H200 (sm_90) on this machine, with
no GPU (Triton's own compiler), at Qwen3.5-4B's GDN heads (dk = dv = 128) and the engine's launch (16 value columns, 4
warps, a 16-token block), and prints per kernel its registers and, for its token loop (the PTX loop the state is
carried through), the CTA barriers, shared-memory stores and loads, warp shuffles and global loads of one token.
Why: a block's tokens run in turn, and each token's chain is its state update, where every CTA barrier (a reduction
across warps, or a vector Triton moves to another layout through shared memory) waits on all four warps.

    git worktree add /tmp/before 50e4fdc
    python scripts/investigations/gdn_loop_sync.py /tmp/before/src src

(50e4fdc: 9 barriers a token in the block kernel; 110a81e stores a token's output from the reduction's layout: 7.
4c5776a laid the loop out with its lanes along dk, 2 barriers a token keeping inputs; on an H100 that block was 3.5%
slower and it was reverted: results/published/2026-12-07-h100-gdn-layout-reverted.)
It also prints the registers and stack per thread: at the engine's launch (the b / a dot in the kernel, gdn_ba="dot";
the pointers, strides and head sizes multiples of 16, as a launch at Qwen3.5-4B's shapes specializes them) the block
kernel spills 16 bytes with Triton 3.9 in both forms (at 6fe1803), where tests/test_kernels.py's no-spill case, the
product given, does not. Run it with the device's Triton (3.6 on the H200 image) for the device's code: other
versions schedule differently (with triton 3.6.0 on PYTHONPATH, e.g. `pip install --no-deps --target /tmp/tr36
triton==3.6.0`, the block kernel has 254 registers and no stack in both forms at 6fe1803: the spill is Triton 3.9's).
Each tree compiles in a process of its own (the trees' modules share a name).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

COMPILE = r"""
import collections, json, os, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qdflash.kernels import gated_delta as gd

def compiled(fn, signature, constexprs, aligned):
    sig = {**signature, **{key: "constexpr" for key in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig) if arg in aligned}  # as a launch specializes
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": gd.BLOCK_WARPS})

def resources(kernel):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {{"REG": "registers", "STACK": "stack"}[k]: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}

def token_loop(ptx):
    '''The counts of the PTX loop that runs most lines (the token loop; phase 1's loops are short).'''
    lines, best = ptx.splitlines(), collections.Counter()
    for i, line in enumerate(lines):
        head = re.match(r"^(\$L__BB\d+_\d+):.*Loop Header", line)
        if head:
            end = next(j for j in range(i, len(lines)) if re.search(r"bra(\.uni)?\s+" + re.escape(head.group(1)) + ";", lines[j]))
            keys = {"bar.sync": "barriers", "st.shared": "shared_stores", "ld.shared": "shared_loads",
                    "shfl.sync": "shuffles", "ld.global": "global_loads"}
            count = collections.Counter(name for body in lines[i:end + 1] for key, name in keys.items() if key in body)
            count["lines"] = end - i
            best = max(best, count, key=lambda c: c["lines"])
    return dict(best)

block_sig = {"qkvz_ptr": "*bf16", "qkvz_stride": "i32", "conv_in_ptr": "*bf16", "conv_w_ptr": "*bf16", "pos_ptr": "*i64",
             "x_ptr": "*bf16", "ba_ptr": "*bf16", "ba_stride": "i32", "decay_ptr": "*fp32", "dt_bias_ptr": "*bf16",
             "state_ptr": "*fp32", "out_ptr": "*fp32", "states_ptr": "*fp32", "scratch_ptr": "*fp32",
             "HV": "i32", "KEY_DIM": "i32", "CONV_DIM": "i32", "SCALE": "fp32"}
# as a launch at Qwen3.5-4B's shapes specializes them: torch's pointers, the strides and the head sizes multiples of 16
pointers = [name for name in block_sig if name.endswith(("_ptr", "_stride")) or name in ("HV", "KEY_DIM", "CONV_DIM")]
out = {}
for kept in (False, True):
    constexprs = dict(T=16, T_P=16, SCRATCH_ROWS=16, REP=2, KW=4, DK=128, DV=128, BLOCK_V=gd.STEP_BLOCK_V, STORE_STATES=True,
                      FIRST_STATE_ONLY=kept, CHUNKED=False, CHUNK_K=32, BA_DOT=True, HIDDEN=2560, H_CHUNKS=5, BLOCK_H=512)
    k = compiled(gd._gated_delta_block_kernel, block_sig, constexprs, pointers)
    out["block keeping inputs" if kept else "block keeping every state"] = {**resources(k), **token_loop(k.asm["ptx"])}
replay_sig = {"tables_ptr": "*i64", "N": "i32", "LAYERS": "i32", "HV": "i32"}
for lean in (False, True):
    constexprs = dict(SCRATCH_ROWS=16, DK=128, DV=128, BLOCK_V=gd.STEP_BLOCK_V)
    try:
        k = compiled(gd._gated_delta_replay_kernel, replay_sig, {**constexprs, "LEAN": lean}, ["tables_ptr"])
    except Exception:  # a tree before the lean replay (3bfee95): its one form
        if lean:
            continue
        k = compiled(gd._gated_delta_replay_kernel, replay_sig, constexprs, ["tables_ptr"])
    out["replay lean" if lean else "replay"] = {**resources(k), **token_loop(k.asm["ptx"])}
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="*", default=["src"], help="source trees (each holding qdflash/); default src")
    args = parser.parse_args()
    for tree in args.trees:
        run = subprocess.run([sys.executable, "-c", COMPILE, tree], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{tree}: the compile failed:\n{run.stderr[-3000:]}")
        for kernel, counts in json.loads(run.stdout.strip().splitlines()[-1]).items():
            print(f"{tree:<24} {kernel:<28} " + "  ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
