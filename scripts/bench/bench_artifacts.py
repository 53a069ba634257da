"""On the H200: the bench_speedup node on artifacts brought along from this checkout's results tree
(`stage.py --results ...`, placed by setup.sh), in the dtype asked for.

    python3 scripts/bench/bench_artifacts.py --dtype bfloat16 --name h200-default-bf16 [hydra overrides]
    python3 scripts/bench/bench_artifacts.py --dtype float32 --profile gpu --source h200 --name h200-fp32 --served \
        bench.compile_drafter=false                     # after run.sh 1330 gpu h200: is the served stack lossless?

It runs the node with exactly the overrides the DAG gives it for the profile (qdflash.config.
node_overrides: the same bench section, the same inputs), with device=cuda (--device) and the dtype asked for, so
the numbers are the default profile's artifacts measured on the GPU. The node folder is copied to
$OUT/<name>/ (metrics.json, speed.csv, the resolved config, the log, the offline W&B run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
from qdflash.config import load_config, node_overrides  # noqa: E402
from qdflash.variants import compressed_drafters, served_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", required=True, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--name", required=True, help="experiment name of the run and its folder under $OUT")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="default")
    parser.add_argument("--source", default=None,
                        help="the experiment whose artifacts are measured, under $QDFLASH_RESULTS (default: the profile "
                             "name, as stage.py --results places them; e.g. h200 after run.sh ... gpu h200)")
    parser.add_argument("--qad", default=None, help="target/<this>/model is the QAD target (default: the profile's "
                        "served one, as the DAG names it: qad_<qad_from>_w<first target bits>g<group>)")
    parser.add_argument("--compressed", nargs="*", default=None,
                        help="drafter/<these> (default: the profile's compressed drafters, as the DAG names them)")
    parser.add_argument("--served", action="store_true",
                        help="only the methods the selection chooses from (the stage-2 drafter and the compressed ones, on "
                             "the QAD target) and the autoregressive run they are checked against (bench.methods), and "
                             "no untimed tau pass (bench.tau_prompts_per_category=0)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. 'bench.buckets=[[64,128],[2048,256],[8192,256]]'")
    args = parser.parse_args()

    config = load_config()  # profiles merged over the base, as the rules read them
    config["profile"], config["experiment"] = args.profile, args.name
    profile = config["profiles"][args.profile]
    profile["device"], profile["dtype"] = args.device, args.dtype
    args.qad = args.qad or served_target(profile)
    args.compressed = compressed_drafters(profile) if args.compressed is None else args.compressed
    results = Path(os.environ["QDFLASH_RESULTS"])
    source = results / (args.source or args.profile)
    for folder in [source / "data" / "bf16", source / "target" / args.qad, source / "drafter" / "stage1",
                   source / "drafter" / "stage2", *(source / "drafter" / c for c in args.compressed)]:
        if not (folder / "metrics.json").is_file():
            sys.exit(f"bench_artifacts: {folder} is missing (brought along by stage.py --results, or made by run.sh here)")
    out_dir = results / args.name / "bench" / "speedup"
    extra = {"data_dir": str(source / "data" / "bf16"), "qad_model": str(source / "target" / args.qad / "model"),
             "stage1": str(source / "drafter" / "stage1" / "drafter"), "stage2": str(source / "drafter" / "stage2" / "drafter"),
             "compressed": [str(source / "drafter" / c / "drafter") for c in args.compressed]}
    overrides = node_overrides(config, "bench_speedup", out_dir, ["bench"], extra) + args.overrides
    if args.served:  # the same names bench_speedup gives these methods
        served = ["ar_qad", "spec_qad_stage2", *(f"spec_qad_{c}" for c in args.compressed)]
        overrides.append(f"bench.methods=[{','.join(served)}]")
        overrides.append("bench.tau_prompts_per_category=0")  # a losslessness check: no untimed tau pass
    print("bench_artifacts: python3 -m qdflash.stages.bench_speedup " + " ".join(overrides), flush=True)
    status = subprocess.call([sys.executable, "-m", "qdflash.stages.bench_speedup", *overrides])
    dest = Path(os.environ.get("OUT", "/tmp/out")) / args.name
    if out_dir.is_dir():
        shutil.copytree(out_dir, dest, symlinks=True, dirs_exist_ok=True)
    else:  # a failed node leaves only its .partial-* folder: bring back its log
        for partial in out_dir.parent.glob(f"{out_dir.name}.partial-*"):
            shutil.copytree(partial, dest / partial.name, symlinks=True, ignore=shutil.ignore_patterns("wandb"))
    sys.exit(status)


if __name__ == "__main__":
    main()
