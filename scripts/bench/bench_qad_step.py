"""What one QAD training step costs at a target's shape, with the loss's fp32 LM-head products exact
and on TF32 tensor cores (`qad.tf32`), side by side in one process.

    python3 scripts/bench/bench_qad_step.py --shape qwen2.5-coder-0.5b --batch-sizes 8,16 --out $OUT/qad_step.json
    python3 scripts/bench/bench_qad_step.py --layers 1 --seq-len 32 --batch-sizes 1 --steps 1   # the CPU: the code path only

Speed does not depend on weight values, so the teacher is the shape's config with random weights
(bench_round's SHAPES, built on the device) and the student its RTN W4 copy with trainable latents,
exactly as the qad node builds it (qdflash.qad.make_student_trainable). A step is what the node's loop
does: the teacher's and the student's hidden states, the chunked KL over the whole vocabulary and its
backward (qdflash.qad.kl_sum_count), gradient clipping and AdamW. Reported per TF32 setting and batch:
the median step (ms, synchronized; bench_round.timed), packed tokens/s, the KL head alone (forward and backward of
qdflash.distill.chunked_kl on the step's hidden states) and the peak GPU memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_round import SHAPES, random_model, timed  # noqa: E402
from qdflash.distill import chunked_kl, lm_head_weight, tf32_matmuls  # noqa: E402
from qdflash.models import synchronize  # noqa: E402
from qdflash.qad import kl_sum_count, make_student_trainable  # noqa: E402
from qdflash.quant.apply import quantize_weights, replace_linears, select_linears  # noqa: E402
from qdflash.quant.grid import GridSpec  # noqa: E402
from qdflash.tracking import environment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    parser.add_argument("--group", type=int, default=32, help="the W4 grid's group size")
    parser.add_argument("--batch-sizes", default="8", help="comma-separated packed sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="qad.chunk_tokens")
    parser.add_argument("--tf32", default="off,on", help="comma-separated: the settings to time (qad.tf32)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting (after 3 warm-ups)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    shape = SHAPES[args.shape][1]
    layers = args.layers or shape["num_hidden_layers"]
    teacher = random_model(args.shape, layers, device, dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = copy.deepcopy(teacher)
    replace_linears(student, quantize_weights(student, select_linears(student), GridSpec(4, args.group, True), method="rtn"))
    student.to(device)
    latents = make_student_trainable(student, reference=teacher)
    student.train()
    optimizer = torch.optim.AdamW(latents, lr=1e-9, weight_decay=0.0)  # the step's cost, not its learning
    vocab = shape["vocab_size"]
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
                    "shape": args.shape, "layers": layers, "grid": f"w4g{args.group}", "seq_len": args.seq_len,
                    "chunk_tokens": args.chunk_tokens, "trained_latents": sum(t.numel() for t in latents),
                    "steps": args.steps, "env": environment(), "runs": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = torch.randint(100, min(vocab, 40000), (batch, args.seq_len), device=device)
        mask = torch.ones_like(ids)
        for setting in args.tf32.split(","):
            if setting not in ("off", "on"):
                raise SystemExit(f"--tf32: {setting!r} is not off or on")
            on = setting == "on" and device.type == "cuda"

            def step():
                with tf32_matmuls(on):
                    total, count = kl_sum_count(teacher, student, ids, mask, temperature=1.0, chunk_tokens=args.chunk_tokens)
                    optimizer.zero_grad(set_to_none=True)
                    (total / count).backward()
                torch.nn.utils.clip_grad_norm_(latents, 1.0)
                optimizer.step()

            with torch.no_grad():  # the step's final hidden states, for the head alone
                h_t = teacher.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, shape["hidden_size"])
            h_s = h_t.detach().clone().requires_grad_(True)

            def head():
                with tf32_matmuls(on):
                    chunked_kl(h_s, h_t, lm_head_weight(student), lm_head_weight(teacher),
                               chunk_tokens=args.chunk_tokens).sum().backward()

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step_ms = timed(step, device, args.steps)
            head_ms = timed(head, device, args.steps)
            run = {"batch": batch, "tf32": on, "step_ms": round(step_ms, 2), "head_ms": round(head_ms, 2),
                   "head_share": round(head_ms / step_ms, 3),
                   "tokens_per_s": round(batch * args.seq_len / (step_ms / 1e3), 1),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
