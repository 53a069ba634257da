"""Does a prompt's first prefill of a new length cost more than the next one, and does the engine's prefill
attention (qdflash.engine.base.prefill_attention) remove that? Pure torch, on the GPU at hand: SDPA over a
Qwen2.5-0.5B-shaped prefill (14 query heads, 2 KV heads, head dim 64, bf16) at lengths never seen before in the
process, first call against second call, (a) as the engine ran it before (a boolean causal mask, enable_gqa, SDPA's
own backend choice) and (b) as prefill_attention runs it. Each arm gets its own lengths, so no arm reuses
another's per-shape state. Then one-query decode steps over a growing key length (transformers' eager
`generate`), SDPA's choice against no cuDNN; and transformers' own eager `generate` on a randomly initialized model of
Qwen2.5-0.5B's shape (24 layers), ms a token with SDPA's choice against cuDNN's SDPA turned off.
    python scripts/investigations/prefill_first_call.py --out $OUT/prefill_first_call.json
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from qdflash.engine.base import prefill_attention


def old_way(q, keys, values, positions, rep):
    n, t = keys.shape[1], q.shape[1]
    mask = torch.arange(n, device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=rep > 1)
    return out[0].transpose(0, 1).reshape(t, -1)


def timed(fn, *args):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_generate(new_tokens=64):
    """ms a token of transformers' eager greedy `generate` (the latency harness's baseline server), cuDNN SDPA on
    (torch's default) against off, each timed on prompt lengths the process has not run before."""
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    out = []
    for arm, cudnn, lengths in (("hf_sdpa_choice", True, [400, 503, 611]), ("hf_no_cudnn", False, [401, 505, 613]),
                                ("hf_sdpa_choice_again", True, [402, 507, 617])):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for t in lengths:
            ids = torch.randint(0, 150000, (1, t), device="cuda")
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
            seconds = timed(lambda: model.generate(ids, **kw))
            out.append({"arm": arm, "prompt_tokens": t, "new_tokens": new_tokens,
                        "ms_per_token": round(seconds * 1e3 / new_tokens, 2)})
            print(json.dumps(out[-1]), flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    return {"transformers": transformers.__version__, "rows": out}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, dtype, heads, kv, d = "cuda", torch.bfloat16, 14, 2, 64
    rows = []
    for fn in (old_way, prefill_attention):  # the process's one-time start-up, outside every arm
        for _ in range(2):
            t = 17
            fn(torch.randn(heads, t, d, device=dev, dtype=dtype), torch.randn(kv, t, d, device=dev, dtype=dtype),
               torch.randn(kv, t, d, device=dev, dtype=dtype), torch.arange(t, device=dev), heads // kv)
    for arm, fn, lengths in (("sdpa_choice_mask_gqa", old_way, [71, 156, 349, 2049, 7453]),
                             ("prefill_attention", prefill_attention, [73, 158, 351, 2051, 7455])):
        for t in lengths:
            q = torch.randn(heads, t, d, device=dev, dtype=dtype)
            keys = torch.randn(kv, t, d, device=dev, dtype=dtype)
            values = torch.randn(kv, t, d, device=dev, dtype=dtype)
            positions = torch.arange(t, device=dev)
            first = timed(fn, q, keys, values, positions, heads // kv)
            second = timed(fn, q, keys, values, positions, heads // kv)
            rows.append({"arm": arm, "tokens": t, "first_ms": round(first * 1e3, 3), "second_ms": round(second * 1e3, 3)})
            print(json.dumps(rows[-1]), flush=True)
    # decoding as transformers' eager `generate` does it: one query over a key length that grows every step, so
    # every step is a shape SDPA has not seen (the plain16 baseline's ~56 ms a token on the H200 is the suspect)
    decode = []
    for arm, backends, start in (("decode_sdpa_choice", None, 500), ("decode_no_cudnn", "pinned", 1500)):
        keys = torch.randn(1, heads, start + 64, d, device=dev, dtype=dtype)
        times = []
        for step in range(64):
            n = start + step
            q = torch.randn(1, heads, 1, d, device=dev, dtype=dtype)
            k, v = keys[:, :, :n], keys[:, :, :n]
            if backends is None:
                times.append(timed(F.scaled_dot_product_attention, q, k, v))
            else:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                    times.append(timed(F.scaled_dot_product_attention, q, k, v))
        times.sort()
        decode.append({"arm": arm, "steps": 64, "median_ms": round(times[32] * 1e3, 3), "max_ms": round(times[-1] * 1e3, 3)})
        print(json.dumps(decode[-1]), flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "decode": decode,
              "hf_generate": hf_generate()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
