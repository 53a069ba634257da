"""figures node: the experiment's figures, drawn from its tables (qdflash.figures).

Output (out_dir = results/{experiment}/figures/): drafter_bits.png (τ and speedup vs the drafter's
bits), drafter_window.png (τ and the same-job speedup vs the drafter's sliding window, on the longest bucket
every window job measured), target_bits.png (target quality and gate scores vs bits), pareto.png
(speedup vs quality, frontier marked); a figure the tables cannot support (e.g. one window only)
is left out and named in metrics.json. notebooks/results.ipynb draws the same figures inline.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI

from omegaconf import DictConfig  # noqa: E402

from ..figures import draw_all, read_tables  # noqa: E402
from ..tracking import NodeRun  # noqa: E402
from ._app import stage  # noqa: E402

log = logging.getLogger("qdflash.figures")
EXPECTED = ("drafter_bits", "drafter_window", "target_bits", "pareto")


@stage("figures")
def main(cfg: DictConfig, run: NodeRun) -> None:
    figures = draw_all(read_tables(Path(cfg.tables)))
    for name, fig in figures.items():
        fig.savefig(run.dir / f"{name}.png", dpi=int(cfg.dpi))
        log.info("%s.png", name)
    missing = [name for name in EXPECTED if name not in figures]
    if missing:
        log.info("not drawn (the tables hold nothing for them): %s", ", ".join(missing))
    run.metrics.update({"figures": sorted(figures), "not_drawn": missing})


if __name__ == "__main__":
    main()
