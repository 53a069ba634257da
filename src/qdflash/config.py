"""The experiment config (config/config.yaml): profiles merged over one base, validation with clear
errors, and the translation of a profile into Hydra overrides for each node (one function, so paths and
overrides cannot drift).

One source per value: a profile in config/config.yaml is an overlay, deep-merged over the base. The
base's node sections (GROUP_SECTIONS) are not written in config.yaml: they are the Hydra group defaults
themselves, config/<section>/default.yaml, read here. So a node run by hand with no overrides runs with
the `default` profile's values (an empty overlay), and the base cannot drift from the Hydra defaults:
there is no copy to generate or to check (tests/test_config.py still checks the composed result).
config.yaml's `base:` holds the rest (model, device, dtype, variants). A key that only some jobs or
profiles set (quant.bits, bench.verify_tokens, drafter_train.parallel, ...) is not in the base: its node
default sits in config/node/<node>.yaml, so a profile that does not name it passes nothing for it.
Everything that reads a profile goes through `resolve_profiles` / `load_config` / `active_profile` and
sees it merged."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml

from .errors import QdflashError
from .paths import REPO_ROOT, config_dir
from .registry import PRESETS

SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
CONFIG_PATH = REPO_ROOT / "config" / "config.yaml"
# profile sections that are Hydra config groups: their base is config/<section>/default.yaml
GROUP_SECTIONS = ("data", "quant", "qad", "eval", "drafter", "drafter_train", "compress", "gates", "bench")
PRESET_MODELS = tuple(PRESETS)


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _key(path: Iterable) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    key = _key(error.absolute_path)
    value = error.instance
    kind = error.validator
    if kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(value) - set(allowed))
        prefix = f"{key}." if error.absolute_path else ""
        return f"unknown key {', '.join(prefix + u for u in unknown)}; allowed keys here: {', '.join(allowed)}"
    if kind == "enum":
        return f"{key} = {value!r} is not allowed; allowed values: {', '.join(map(str, error.validator_value))}"
    if kind == "const":
        return f"{key} = {value!r} is not allowed; it must be {error.validator_value!r}"
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        return f"{key} = {value!r} is out of range; it must be {op} {error.validator_value}"
    if kind == "type":
        return f"{key} = {value!r} has the wrong type; expected {error.validator_value}"
    if kind == "required":
        return f"{key}: {error.message}"
    if kind == "pattern" and "description" in error.schema:
        return f"{key} = {value!r} is not allowed: {error.schema['description']}"
    return f"{key}: {error.message}"


def validation_errors(instance: Any, schema: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    errors = []
    for error in validator.iter_errors(instance):
        # allOf / $ref wrappers: report the innermost, most specific failures
        leaves = list(error.context) if error.context else [error]
        errors.extend(_describe(e) for e in leaves)
    return sorted(set(errors))


def model_problem(key: str, model: str) -> str | None:
    """A model must be a preset, an existing folder / .gguf file, or a Hub id (`org/name`)."""
    if model in PRESET_MODELS or Path(model).expanduser().exists() or _HUB_ID.match(model):
        return None
    return (
        f"{key} = {model!r} is not a preset ({', '.join(PRESET_MODELS)}), not an existing folder or .gguf "
        f"file, and not a Hub id of the form org/name"
    )


@functools.lru_cache(maxsize=None)
def _group_defaults(folder: str, section: str) -> dict:
    return yaml.safe_load((Path(folder) / section / "default.yaml").read_text()) or {}


def profile_base(config: dict) -> dict:
    """What every profile is merged over: config.yaml's `base` plus, for each of GROUP_SECTIONS, the
    Hydra group's defaults file (config/<section>/default.yaml, under $QDFLASH_CONFIG_DIR if set)."""
    base = copy.deepcopy(config.get("base") or {})
    for section in GROUP_SECTIONS:
        base[section] = copy.deepcopy(_group_defaults(str(config_dir()), section))
    return base


def deep_merge(base: dict, overlay: dict, prefix: str = "") -> dict:
    """`overlay` over `base`, map by map (a new dict; neither input changes). A non-map value, and a
    map whose keys the profile chooses (REPLACED_WHOLE: gates.tasks), replaces base's value whole."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and isinstance(out.get(key), dict) and path not in REPLACED_WHOLE:
            out[key] = deep_merge(out[key], value, path)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_profiles(config: dict) -> dict:
    """A copy of `config` with every profile merged over the base (idempotent: a config already
    resolved comes back equal, so callers need not know which one they hold)."""
    base = profile_base(config)
    out = dict(config)
    out["profiles"] = {name: deep_merge(base, overlay or {}) for name, overlay in (config.get("profiles") or {}).items()}
    return out


def load_config(path: str | Path = CONFIG_PATH) -> dict:
    """config/config.yaml with every profile merged over the base (what Snakemake's rules see)."""
    return resolve_profiles(yaml.safe_load(Path(path).read_text()))


def redundant_keys(config: dict) -> list[str]:
    """Overlay keys that repeat the base's value (a profile should say only what differs)."""
    base = profile_base(config)

    def walk(over: Any, under: Any, path: str) -> list[str]:
        if isinstance(over, dict) and isinstance(under, dict) and path not in REPLACED_WHOLE:
            return [k for key, sub in over.items() if key in under
                    for k in walk(sub, under[key], f"{path}.{key}" if path else str(key))]
        return [path] if over == under else []

    return [f"profiles.{name}.{k}" for name, overlay in config["profiles"].items() for k in walk(overlay or {}, base, "")]


def validate_config(config: dict, where: str = "config/config.yaml") -> dict:
    """Validate the whole experiment config, every profile merged over the base; raise one
    QdflashError listing every problem. Returns the config with its profiles merged."""
    config = resolve_profiles(config)
    problems = validation_errors(config, load_schema())
    if isinstance(config.get("profile"), str) and config["profile"] not in (config.get("profiles") or {}):
        problems.append(f"profile = {config['profile']!r} is not allowed; allowed values: {', '.join(sorted(config['profiles']))}")
    if not problems:
        for name, profile in config["profiles"].items():
            problem = model_problem(f"profiles.{name}.model", profile["model"])
            if problem and name == config["profile"]:
                problems.append(problem)
            problems += scaling_problems(f"profiles.{name}.scaling", profile)
            problems += block_problems(f"profiles.{name}", profile)
    if problems:
        raise QdflashError(f"{where} is invalid:\n  - " + "\n  - ".join(problems))
    return config


def scaling_arms(scaling: dict) -> dict[str, dict]:
    """The scaling study's arms (name -> drafter_train overrides); an arm set to null (an overlay's way
    to drop an arm of the profile it extends: Snakemake merges config files key by key) is left out."""
    return {name: arm for name, arm in (scaling.get("arms") or {}).items() if arm is not None}


def scaling_problems(where: str, profile: dict) -> list[str]:
    """What the schema cannot say about `scaling`: its sources exist, its overrides are drafter_train
    keys, its largest size fits the data."""
    scaling = profile.get("scaling")
    if not scaling:
        return []
    unknown = sorted(set(scaling["n_train"]) - set(profile["data"]["sources"]))
    if unknown:
        return [f"{where}.n_train: {unknown} are not sources of this profile's data ({sorted(profile['data']['sources'])})"]
    train_keys = set(load_schema()["$defs"]["drafter_train"]["properties"])
    for key, overrides in [("drafter_train", scaling.get("drafter_train") or {}),
                           *((f"arms.{name}", arm) for name, arm in scaling_arms(scaling).items())]:
        unknown = sorted(set(overrides) - train_keys)
        if unknown:
            return [f"{where}.{key}: {unknown} are not drafter_train keys ({sorted(train_keys)})"]
    total = sum(scaling["n_train"].values())
    if max(scaling["sizes"]) > total:
        return [f"{where}.sizes: the largest size {max(scaling['sizes'])} exceeds the {total} training prompts of n_train"]
    return []


def block_problems(where: str, profile: dict) -> list[str]:
    """What the schema cannot say: a training sequence cut to max_length must hold a drafter block
    after its first token (drafter.blocks: anchor a >= 1, then block_size - 1 tokens), or the drafter
    trains on nothing. A real cut must be far longer (the prompt comes first); the node checks that.
    And a speculative round verifies at most one block: bench.verify_tokens <= drafter.block_size; a
    block drafts positions 1..block_size - 1: drafter_train.loss_positions (and the scaling study's) at most that."""
    block = profile["drafter"]["block_size"]
    scaling = profile.get("scaling") or {}
    lengths = {"drafter_train.max_length": profile["drafter_train"]["max_length"]}
    if (scaling.get("drafter_train") or {}).get("max_length") is not None:
        lengths["scaling.drafter_train.max_length"] = scaling["drafter_train"]["max_length"]
    problems = [f"{where}.{key} = {n} leaves no room for a block of drafter.block_size = {block}: it must be >= {block + 1}"
                for key, n in lengths.items() if n < block + 1]
    verify = (profile.get("bench") or {}).get("verify_tokens")
    if verify is not None and verify > block:  # the schema says >= 2
        problems.append(f"{where}.bench.verify_tokens = {verify} exceeds drafter.block_size = {block}: a round verifies "
                        f"at most the block (2 <= verify_tokens <= {block}, or null for the whole block)")
    sections = {"drafter_train": profile.get("drafter_train") or {},
                "scaling.drafter_train": scaling.get("drafter_train") or {},
                **{f"scaling.arms.{name}": arm or {} for name, arm in (scaling.get("arms") or {}).items()}}
    for key, section in sections.items():
        positions = section.get("loss_positions")
        if positions is not None and positions > block - 1:  # the schema says >= 1
            problems.append(f"{where}.{key}.loss_positions = {positions}: a block of drafter.block_size = {block} drafts "
                            f"positions 1..{block - 1} (1 <= loss_positions <= {block - 1}, or null for all)")
    return problems


def validate_section(section: Any, definition: str, where: str) -> None:
    """Validate one part of a config (e.g. a node's `data` group) against `$defs/<definition>`."""
    schema = load_schema()
    sub = {"$ref": f"#/$defs/{definition}", "$defs": schema["$defs"]}
    problems = validation_errors(section, sub)
    if problems:
        raise QdflashError(f"{where} is invalid:\n  - " + "\n  - ".join(problems))


def resolved_inputs(values: dict) -> dict[str, str]:
    """Where the data of a rule's profile sections resolves now (qdflash.data.sources.resolution;
    IFEval's file for a gate): part of the rule's fingerprint beside the values themselves."""
    from .data.sources import describe_files, resolution
    from .errors import SourceNotFound
    from .evaluation.ifeval import ifeval_data_file

    found = {name: resolution(name, source.get("path")) for name, source in (values.get("data") or {}).get("sources", {}).items()}
    ifeval = ((values.get("gates") or {}).get("tasks") or {}).get("ifeval")
    if ifeval is not None and not ifeval.get("lm_eval_task"):
        try:
            found["gates.ifeval"] = describe_files(ifeval_data_file(ifeval.get("path")))
        except SourceNotFound:
            found["gates.ifeval"] = "not found"
        except QdflashError as err:  # a path given that is not there: the node says so when it runs
            found["gates.ifeval"] = str(err)
    return found


def active_profile(config: dict) -> dict:
    """The profile that runs, merged over the base."""
    return deep_merge(profile_base(config), config["profiles"][config["profile"]])


def experiment_name(config: dict) -> str:
    return config.get("experiment") or config["profile"]


def results_root(config: dict) -> Path:
    return Path(config["results_dir"]) / experiment_name(config)


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_PLAIN = re.compile(r"^[A-Za-z0-9_./+:-]+$")


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text) and text not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# maps whose keys the profile chooses (which gate tasks run): the node's defaults are replaced whole,
# not merged into (a default task the profile leaves out must not run)
REPLACED_WHOLE = ("gates.tasks",)


def flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and prefix not in REPLACED_WHOLE:
        out: list[tuple[str, Any]] = []
        for key, sub in value.items():
            out.extend(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return [(prefix, value)]


def node_overrides(
    config: dict, node: str, out_dir: str | Path, sections: Iterable[str], extra: dict | None = None
) -> list[str]:
    """Hydra overrides (`key=value`) that run `node` with the active profile's values.

    `sections`: which profile sections the node reads (e.g. ["data"]); model, device and dtype are
    always passed. A model that is not a preset is passed as `model.name=<path or Hub id>`.
    `extra`: overrides that come from the DAG itself (input folders, sweep wildcards).
    """
    profile = active_profile(config)
    model = profile["model"]
    args = [f"model={model}" if model in PRESET_MODELS else f"model.name={_hydra_value(model)}"]
    args += [
        f"device={profile['device']}",
        f"dtype={profile['dtype']}",
        f"experiment={_hydra_value(experiment_name(config))}",
        f"out_dir={_hydra_value(str(out_dir))}",
        f"tracking.wandb.mode={config['wandb']['mode']}",
        f"tracking.wandb.project={_hydra_value(config['wandb']['project'])}",
    ]
    if config["wandb"].get("entity"):
        args.append(f"tracking.wandb.entity={_hydra_value(config['wandb']['entity'])}")
    listed = set(_group_defaults(str(config_dir()), "data")["sources"])  # the data node's own sources

    def override(key: str, value: Any) -> str:
        # a data source the node's defaults do not list (an optional one a profile adds, e.g. copy) is
        # appended ("+"): Hydra refuses to set a key its config does not have
        parts = key.split(".")
        new = len(parts) > 3 and parts[:2] == ["data", "sources"] and parts[2] not in listed
        return f"{'+' if new else ''}{key}={_hydra_value(value)}"

    for section in sections:
        for key, value in flatten(section, profile[section]):
            args += [f"~{key}", f"+{key}={_hydra_value(value)}"] if key in REPLACED_WHOLE else [override(key, value)]
    args += [override(key, value) for key, value in (extra or {}).items()]
    return args
