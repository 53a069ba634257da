"""JSON-lines reading and atomic writing."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import QdflashError


def read_jsonl(path: str | Path) -> Iterator[dict]:
    return (row for _, row in read_jsonl_lines(path))


def read_jsonl_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line. Whatever is wrong with the file (not UTF-8, a
    line that is not a JSON object, a truncated or corrupt .gz) is a QdflashError naming it and the line."""
    path = Path(path)
    if not path.is_file():  # every reader (bench, merge, drafter) gets the same clear message
        raise QdflashError(f"{path} not found: expected a JSON-lines file written by a qdflash node (prepare_data / merge_data)")
    opener = gzip.open if path.suffix == ".gz" else open
    line_no = 0
    try:
        with opener(path, "rb") as handle:  # bytes, decoded line by line: an error names its line
            for line_no, raw in enumerate(handle, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise QdflashError(f"{path}:{line_no}: not UTF-8 text ({err.reason} at byte {err.start} of the line)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise QdflashError(f"{path}:{line_no}: not a JSON object per line ({err.msg})") from None
                if not isinstance(row, dict):
                    raise QdflashError(f"{path}:{line_no}: a JSON {type(row).__name__}, where a JSON object per line is expected")
                yield line_no, row
    except (EOFError, OSError, zlib.error) as err:  # gzip: truncated (EOFError), not gzip (BadGzipFile), corrupt
        raise QdflashError(f"{path}: unreadable after line {line_no} ({type(err).__name__}: {err or 'truncated'}); "
                           f"expected {'a complete gzip file of ' if opener is gzip.open else ''}JSON lines") from None


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
