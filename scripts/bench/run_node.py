"""Run one node of a profile without Snakemake, with exactly the overrides the DAG passes it
(qdflash.config.node_overrides), e.g. to time the data stage alone on the H200:

    python scripts/bench/run_node.py gpu prepare_data /root/qdflash/results/h200-gen/data/bf16 data

Arguments: PROFILE NODE OUT_DIR SECTIONS (comma-separated) [key=value ...] (extra overrides).
"""

from __future__ import annotations

import subprocess
import sys
import time

from qdflash.config import load_config, node_overrides


def main() -> None:
    profile, node, out, sections, *extra = sys.argv[1:]
    config = load_config()  # profiles merged over the base, as the rules read them
    config["profile"] = profile
    args = node_overrides(config, node, out, [s for s in sections.split(",") if s], dict(e.split("=", 1) for e in extra))
    print(" ".join([sys.executable, "-m", f"qdflash.stages.{node}", *args]), flush=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", f"qdflash.stages.{node}", *args])
    print(f"run_node: {node} exit {done.returncode} after {time.perf_counter() - start:.1f} s", flush=True)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
