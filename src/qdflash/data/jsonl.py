"""JSON-lines reading and atomic writing."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import QdflashError


def read_jsonl(path: str | Path) -> Iterator[dict]:
    path = Path(path)
    if not path.is_file():  # every reader (bench, merge, drafter) gets the same clear message
        raise QdflashError(f"{path} not found: expected a JSON-lines file written by a qdflash node (prepare_data / merge_data)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise QdflashError(f"{path}:{line_no}: not a JSON object per line ({err.msg})") from None


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows to `path` through a temporary file renamed into place (never half-written)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def load_token_examples(data_dir: str | Path, split: str, limit: int | None = None) -> list[dict]:
    """The tokenized form written by prepare_data (`<split>.tokens.jsonl`: input_ids, loss_mask)."""
    path = Path(data_dir) / f"{split}.tokens.jsonl"
    if not path.is_file():
        raise QdflashError(f"{path} not found: data_dir must be a prepare_data output folder")
    rows = []
    for row in read_jsonl(path):
        if "input_ids" not in row or "loss_mask" not in row:
            raise QdflashError(f"{path}: rows need input_ids and loss_mask")
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows
