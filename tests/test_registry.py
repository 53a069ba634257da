"""The model registry is the one place a preset is named: docs, Hydra's model group, the config
validation and load_target all read it."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from qdflash.config import PRESET_MODELS, model_problem
from qdflash.engine import build_engine
from qdflash.models import OFFLINE_SOURCES, PRESETS as LOADABLE
from qdflash.paths import REPO_ROOT, config_dir
from qdflash.registry import PRESETS, hydra_model_group, markdown_table, write_docs


def test_the_docs_show_the_registry(tmp_path):
    """docs/models.md holds the table of the rows, and `python -m qdflash.registry` writes it there."""
    docs = (REPO_ROOT / "docs" / "models.md").read_text()
    assert markdown_table() in docs, "the presets changed: run python -m qdflash.registry"
    stale = tmp_path / "models.md"
    stale.write_text(docs.replace(markdown_table(), "| old | table |"))
    write_docs(stale)
    assert stale.read_text() == docs


def test_every_preset_is_a_model_every_part_knows():
    assert set(PRESET_MODELS) == set(LOADABLE) == set(PRESETS)
    for name, preset in PRESETS.items():
        assert model_problem("model", name) is None
        assert preset.offline in (None, "tiny", *OFFLINE_SOURCES), name
        assert preset.hub_id or preset.offline, f"{name}: neither a Hub id nor an offline route"
    assert "not a preset" in model_problem("model", "no-such-model")


def test_model_equals_a_preset_composes_its_row():
    """`model=<preset>` on a node's command line: the name and chat-template options of its row."""
    hydra_model_group()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for name, preset in PRESETS.items():
            cfg = compose(config_name="node/prepare_data", overrides=["out_dir=x", f"model={name}"])
            assert OmegaConf.to_container(cfg.model) == {"name": name, "chat_template_kwargs": preset.chat_template_kwargs}


@pytest.mark.parametrize("family", sorted({p.family for p in PRESETS.values()}))
def test_every_family_of_the_registry_has_an_engine_and_a_tiny_stand_in(family, request):
    """A preset's family is one the lean engine builds, shown on the tiny preset of that family."""
    tiny = [name for name, p in PRESETS.items() if p.family == family and p.offline == "tiny"]
    assert tiny, f"no tiny preset of the family {family}: the tests cannot run it"
    target = request.getfixturevalue({"tiny-llama": "tiny_llama", "tiny-qwen2": "tiny_qwen2", "tiny-qwen3.5": "tiny_qwen"}[tiny[0]])
    assert target.config.model_type == family
    build_engine(target, max_len=32)
