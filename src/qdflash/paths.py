"""Where things live: the repository's config folder, the model cache, the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# src/qdflash -> src -> repository root (the project is installed editable: `pip install -e .`).
REPO_ROOT = PACKAGE_DIR.parents[1]


def env_path(name: str) -> Path | None:
    """$name as a path, or None where it is unset or empty: an empty variable (`export QDFLASH_CACHE_DIR=`)
    would otherwise be the current folder, where a model conversion would write gigabytes unasked."""
    value = os.environ.get(name, "").strip()
    return Path(value) if value else None


def config_dir() -> Path:
    """The Hydra config root (`config/` of the repository, or $QDFLASH_CONFIG_DIR)."""
    return (env_path("QDFLASH_CONFIG_DIR") or REPO_ROOT / "config").resolve()


def cache_dir() -> Path:
    """Converted models and tokenizers are cached here ($QDFLASH_CACHE_DIR, else ~/.cache/qdflash)."""
    default = (env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "qdflash"
    path = env_path("QDFLASH_CACHE_DIR") or default
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_data_dir() -> Path | None:
    """`../shared/data` beside the checkout, when it exists (docs/design.md, "Offline assets")."""
    candidate = REPO_ROOT.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None
