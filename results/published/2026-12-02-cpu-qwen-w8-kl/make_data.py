"""The data folder of this publication's runs: the first 50 training and held-out rows that came back
from the H200 (results/published/2026-12-02-h200-qad-sweep: pack.sh returns `*.head50.jsonl` of each
data file), tokenized again with the target's chat template (qdflash.data.chat.tokenize_conversation),
as quantize_target reads them (`train.tokens.jsonl`, `heldout.tokens.jsonl`).

    python3 results/published/2026-12-02-cpu-qwen-w8-kl/make_data.py HEAD50_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

from qdflash.data.chat import tokenize_conversation
from qdflash.models import load_target

source, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
target = load_target("qwen2.5-coder-0.5b", device="cpu")
tokenizer, eos = target.tokenizer, target.eos_token_ids
for split in ("train", "heldout"):
    rows = [json.loads(line) for line in (source / f"{split}.head50.jsonl").open()]
    with (out / f"{split}.tokens.jsonl").open("w") as f:
        for row in rows:
            t = tokenize_conversation(tokenizer, row["messages"], eos_token_ids=eos)
            f.write(json.dumps({"id": row["id"], "input_ids": t["input_ids"], "loss_mask": t["loss_mask"]}) + "\n")
    print(split, len(rows), "rows")
