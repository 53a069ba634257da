"""What every DAG node does on entry and exit.

- its outputs are written into a staging folder (Hydra's run dir, ``<out_dir>.partial-<time>``) and
  moved to ``out_dir`` only when the node succeeded, so a failed node never leaves a folder that
  Snakemake (or a person) would take as complete;
- the resolved Hydra config is saved as ``config.yaml``;
- a W&B run (project from config, group = experiment, job_type = node), offline unless
  ``WANDB_MODE=online`` (or ``tracking.wandb.mode``) says otherwise, lives in ``<out_dir>/wandb/``;
- ``metrics.json`` (one flat JSON object: numbers, strings, lists of them) is the output of record,
  written atomically at the end together with the environment (device, versions, git commit and a
  digest of the package's sources).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from .errors import QdflashError
from .paths import REPO_ROOT

log = logging.getLogger(__name__)
MARKER = ".qdflash-node.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def check_metric_value(key: str, value: Any) -> Any:
    """metrics.json contract: numbers, strings, or lists of them; no NaN (it is not JSON)."""
    def ok(v):
        if isinstance(v, bool) or v is None:
            return False
        if isinstance(v, float):
            return math.isfinite(v)
        return isinstance(v, (int, str))

    if ok(value) or (isinstance(value, (list, tuple)) and all(ok(v) for v in value)):
        return list(value) if isinstance(value, tuple) else value
    raise TypeError(f"metric {key!r} = {value!r}: metrics.json holds numbers, strings or lists of them")


def git_commit() -> str:
    """HEAD of the checkout (+ "-dirty"); where there is no git (the GPU machine gets a copy of the
    tree without it) the caller passes it in $QDFLASH_GIT_COMMIT."""
    if os.environ.get("QDFLASH_GIT_COMMIT"):
        return os.environ["QDFLASH_GIT_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=None)
def source_digest(root: Path = Path(__file__).resolve().parent) -> str:
    """sha256 (16 hex digits) of the package's Python sources: relative paths and contents, sorted.
    It names the code that ran even where git cannot: on the GPU machine, the checkout's copy carries
    a git state of its own, so `git rev-parse` there reports some other commit, "-dirty". Check a
    recorded value against a commit with
    `git worktree add /tmp/at <sha> && python -c "from pathlib import Path; from qdflash.tracking import
    source_digest; print(source_digest(Path('/tmp/at/src/qdflash')))"`."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def content_digest(*paths: Path) -> str:
    """sha256 of the contents of files, or of every file under a folder (by relative path): what an
    input *is*, where its path says nothing (a re-run node writes other bytes to the same folder)."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0" if path.is_dir() else b"\0")
            with open(file, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()


def environment() -> dict[str, str | int]:
    """Device, versions and commit: recorded with every number a node produces."""
    import torch
    import transformers

    from . import __version__

    env: dict[str, str | int] = {
        "env.python": platform.python_version(),
        "env.torch": torch.__version__,
        "env.transformers": transformers.__version__,
        "env.qdflash": __version__,
        "env.git_commit": git_commit(),
        "env.source_sha256": source_digest(),
        "env.host": platform.node(),
        "env.cpu_count": os.cpu_count() or 0,
        "env.torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["env.device"] = torch.cuda.get_device_name(0)
        env["env.cuda"] = torch.version.cuda or "unknown"
        env["env.gpu_count"] = torch.cuda.device_count()
    else:
        env["env.device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def _made_by_qdflash(folder: Path) -> bool:
    return (folder / MARKER).is_file()


class NodeRun:
    """Handle given to a node's body: `dir` to write into, `log()` for metrics during the run,
    `metrics` for the output of record."""

    def __init__(self, cfg: DictConfig, node: str, staging: Path, out_dir: Path):
        self.cfg = cfg
        self.node = node
        self.dir = staging
        self.out_dir = out_dir
        self.metrics: dict[str, Any] = {}
        self._wandb = None
        self._start = time.time()

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Metrics over time (W&B history); use `metrics[...] = ...` for the final record."""
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def _start_wandb(self) -> None:
        wb = self.cfg.tracking.wandb
        mode = os.environ.get("WANDB_MODE", wb.mode)
        if mode == "disabled":
            return
        import wandb

        self._wandb = wandb.init(
            project=wb.project,
            entity=wb.entity,
            group=self.cfg.experiment,
            job_type=self.node,
            name=f"{self.cfg.experiment}/{self.node}",
            dir=str(self.dir),
            mode=mode,
            config=OmegaConf.to_container(self.cfg, resolve=True),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.metrics["wandb.mode"] = mode
        self.metrics["wandb.run_id"] = self._wandb.id

    def _finish_wandb(self, exit_code: int) -> None:
        if self._wandb is not None:
            if exit_code == 0:
                self._wandb.summary.update({k: v for k, v in self.metrics.items() if not isinstance(v, list)})
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None


def _staging_dir(out_dir: Path) -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under Hydra (called from Python): a fresh folder of a unique name
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-{time.strftime('%Y%m%d-%H%M%S')}-", dir=out_dir.parent))
    # The staging folder is renamed to out_dir on success: anything but a folder of our naming beside
    # out_dir (a user's folder given as hydra.run.dir) would be moved away whole.
    run_dir = run_dir.resolve()
    if run_dir.parent != out_dir.parent or not run_dir.name.startswith(f"{out_dir.name}.partial-"):
        raise QdflashError(f"hydra.run.dir={run_dir}: the staging folder must be {out_dir}.partial-<anything> "
                           f"(it is renamed to out_dir on success); leave hydra.run.dir at its default")
    return run_dir


@contextmanager
def one_writer(out_dir: Path) -> Iterator[None]:
    """Hold `<out_dir>.lock` (flock) while a node writes out_dir: a second node given the same out_dir
    stops at once instead of replacing the first one's output or deleting its staging folder as a
    stale one. Snakemake locks its working directory, but nodes run by hand are not under it."""
    lock = out_dir.with_name(out_dir.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(lock, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise QdflashError(f"{out_dir} is being written by another qdflash node ({holder}; lock {lock}). "
                               f"Wait for it to finish, or give this one another out_dir.") from None
        if os.path.exists(lock) and os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino:
            break  # else the holder removed the file between our open and our lock: take the new one
        handle.close()
    try:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {platform.node()}")
        handle.flush()
        yield
    finally:
        os.unlink(lock)  # still held: a node that opened it meanwhile finds another inode and retries
        handle.close()


@contextmanager
def node_run(cfg: DictConfig, node: str) -> Iterator[NodeRun]:
    """Wrap a node's body: see the module docstring. Under torchrun only rank 0 writes: the other
    ranks get a run in a scratch folder that is thrown away (no W&B run, no metrics.json)."""
    from .distributed import world

    if not world().main:
        scratch = Path(tempfile.mkdtemp(prefix=f"qdflash-{node}-rank{world().rank}-"))
        try:
            yield NodeRun(cfg, node, scratch, Path(cfg.out_dir).resolve())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    out_dir = Path(cfg.out_dir).resolve()
    with one_writer(out_dir), _main_run(cfg, node, out_dir) as run:
        yield run


@contextmanager
def _main_run(cfg: DictConfig, node: str, out_dir: Path) -> Iterator[NodeRun]:
    if out_dir.exists():
        if not cfg.get("overwrite", False):
            raise QdflashError(
                f"output folder {out_dir} already exists. Delete it or pass overwrite=true "
                f"(Snakemake removes a rule's outputs itself before re-running it)."
            )
        if not _made_by_qdflash(out_dir):
            raise QdflashError(f"output folder {out_dir} exists and was not made by qdflash (no {MARKER}); refusing to replace it")
    staging = _staging_dir(out_dir)
    staging.mkdir(parents=True, exist_ok=True)
    run = NodeRun(cfg, node, staging, out_dir)
    (staging / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run.metrics.update(environment())
    run._start_wandb()
    log.info("%s: writing to %s (moved to %s on success)", node, staging, out_dir)
    try:
        yield run
    except BaseException:
        run._finish_wandb(exit_code=1)
        log.error("%s failed: partial outputs left in %s (not taken as done)", node, staging)
        raise
    run.metrics["wall_time_s"] = round(time.time() - run._start, 3)
    metrics = {key: check_metric_value(key, value) for key, value in run.metrics.items()}
    run._finish_wandb(exit_code=0)
    write_json_atomic(staging / "metrics.json", metrics)
    write_json_atomic(staging / MARKER, {"node": node, "experiment": cfg.experiment, "finished": time.time()})
    if out_dir.exists():  # overwrite=true on a folder qdflash made
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, out_dir)
    for stale in out_dir.parent.glob(f"{out_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # failed attempts superseded by this success (we hold the lock: none is running)
    log.info("%s: done in %.1f s -> %s", node, metrics["wall_time_s"], out_dir)
