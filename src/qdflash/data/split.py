"""Deterministic selection: content hashes, dedupe, train / held-out split, the no-overlap rule.

Everything here depends only on the text of a prompt, never on file order or on how many items are
asked for: raising a sample count adds items and never moves one between splits.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def normalize(text: str) -> str:
    """Case- and whitespace-insensitive form used for dedupe and overlap checks. `str.split()` splits
    on exactly the characters `\\s` matches (str.isspace), so this is `re.sub(r"\\s+", " ", text).strip()`,
    several times faster on long texts (the data stage normalizes ~50 K prompts)."""
    return " ".join(text.split()).lower()


def content_key(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def unit_interval(text: str, salt: str) -> float:
    """A uniform number in [0, 1) fixed by the text and a salt (one salt per decision)."""
    digest = hashlib.sha256(f"{salt}\x00{normalize(text)}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(text: str, heldout_fraction: float) -> bool:
    return unit_interval(text, "heldout") < heldout_fraction


def select_prompts(
    pool: Iterable[T],
    *,
    text: Callable[[T], str],
    n: int,
    forbidden: set[str] = frozenset(),
    accept: Callable[[T], bool] = lambda _item: True,
    salt: str = "order",
) -> tuple[list[T], dict[str, int]]:
    """Take `n` items from `pool` in hash order, skipping duplicates, forbidden texts (content keys
    of evaluation items) and items `accept` rejects. Returns the items and counts of what was skipped."""
    seen: set[str] = set()
    ordered = sorted(pool, key=lambda item: unit_interval(text(item), salt))
    chosen: list[T] = []
    skipped = {"duplicate": 0, "evaluation_item": 0, "rejected": 0}
    for item in ordered:
        if len(chosen) >= n:
            break
        key = content_key(text(item))
        if key in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(key)
        if key in forbidden:
            skipped["evaluation_item"] += 1
            continue
        if not accept(item):
            skipped["rejected"] += 1
            continue
        chosen.append(item)
    return chosen, skipped


def split_pool(pool: Sequence[T], *, text: Callable[[T], str], heldout_fraction: float) -> tuple[list[T], list[T]]:
    """Partition by content hash into (train, held-out)."""
    train, heldout = [], []
    for item in pool:
        (heldout if is_heldout(text(item), heldout_fraction) else train).append(item)
    return train, heldout


def mostly_ascii(text: str, threshold: float = 0.95) -> bool:
    """A cheap English filter for ShareGPT (SmolLM2 is an English model)."""
    return bool(text) and sum(ch.isascii() for ch in text) / len(text) >= threshold
