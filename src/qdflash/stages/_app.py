"""The wrapper every node uses: Hydra config from config/node/<name>.yaml, tracking, clean errors."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Callable

import hydra
from omegaconf import DictConfig

from ..distributed import teardown, world
from ..errors import QdflashError
from ..paths import config_dir
from ..registry import hydra_model_group
from ..tracking import NodeRun, node_run

log = logging.getLogger("qdflash")


def stage(name: str) -> Callable[[Callable[[DictConfig, NodeRun], None]], Callable[[], None]]:
    """Turn `body(cfg, run)` into a Hydra app. A QdflashError (bad input) ends the process with exit
    code 2 and its message only; other exceptions keep their traceback (they are bugs)."""

    hydra_model_group()  # `model=<preset>`: the registry's presets, not files

    def wrap(body: Callable[[DictConfig, NodeRun], None]) -> Callable[[], None]:
        @hydra.main(config_path=str(config_dir()), config_name=f"node/{name}", version_base="1.3")
        def main(cfg: DictConfig) -> None:
            try:
                with node_run(cfg, name) as run:
                    body(cfg, run)
            except QdflashError as err:
                log.error("%s: %s", name, err)
                print(f"\nqdflash {name} failed: {err}", file=sys.stderr)
                sys.exit(2)
            finally:
                teardown()

        def entry() -> None:
            overrides = {key: value for key, _, value in (a.lstrip("+~").partition("=") for a in sys.argv[1:])}

            def refuse(reason: str) -> None:
                print(f"\nqdflash {name} failed: {reason}", file=sys.stderr)
                sys.exit(2)

            # Hydra writes into its run dir before the body runs, and the node renames that folder to
            # out_dir: a folder that already exists (a user's) must not become it (qdflash.tracking)
            run_dir = overrides.get("hydra.run.dir")
            if run_dir and Path(run_dir).expanduser().exists():
                refuse(f"hydra.run.dir={run_dir} already exists; the run folder is a fresh staging folder renamed "
                       "to out_dir on success. Leave hydra.run.dir at its default.")
            # out_dir is mandatory (???) and Hydra resolves its run dir from it before any code of ours
            # runs: without it Hydra fails inside its own error formatting, naming no key
            asks_for_help = any(a in ("--help", "-h", "--hydra-help", "--info", "-i") or a.startswith("--cfg") for a in sys.argv[1:])
            if not asks_for_help and "out_dir" not in overrides:
                refuse(f"out_dir=<folder> is required (the folder the node writes its outputs to), e.g. python -m "
                       f"qdflash.stages.{name} out_dir=results/by-hand/{name} ...; every key: python -m qdflash.stages.{name} --cfg job")
            if not world().main:  # under torchrun: Hydra's own folder for ranks > 0 goes to scratch, not beside out_dir
                sys.argv += [f"hydra.run.dir={tempfile.mkdtemp(prefix=f'qdflash-hydra-rank{world().rank}-')}",
                             "hydra.output_subdir=null"]
            main()

        return entry

    return wrap
