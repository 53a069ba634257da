import copy

import pytest
import yaml
from hydra import compose, initialize_config_dir

from qdflash.config import GROUP_SECTIONS, load_config, node_overrides, redundant_keys, validate_config, validate_section
from qdflash.errors import QdflashError
from qdflash.paths import REPO_ROOT, config_dir
from qdflash.registry import hydra_model_group

hydra_model_group()  # the `model` group the nodes compose (what every node's app registers)

# every node and the profile sections it reads (workflow/rules/*.smk: hydra_args)
NODE_SECTIONS = {"prepare_data": ["data"], "quality_gate": ["data", "gates"], "quantize_target": ["quant", "eval"],
                 "qad": ["qad", "eval"], "train_drafter": ["drafter", "drafter_train"], "compress_drafter": ["compress"],
                 "bench_speedup": ["bench"], "merge_data": [], "report": [], "figures": []}


@pytest.fixture
def config():
    """config/config.yaml with its profiles merged over the base (what the rules read)."""
    return load_config()


def raw_config():
    return yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())


def error_of(config):
    with pytest.raises(QdflashError) as err:
        validate_config(config)
    return str(err.value)


def test_shipped_config_is_valid(config):
    validate_config(config)


def test_negative_sample_count_names_the_key(config):
    config["profiles"]["default"]["data"]["sources"]["gsm8k"]["n_train"] = -3
    assert "profiles.default.data.sources.gsm8k.n_train = -3 is out of range; it must be >= 0" in error_of(config)


@pytest.mark.parametrize("name", ["..", ".", "../elsewhere", "/tmp/abs", "a/b", ".hidden", "-x", ""])
def test_an_experiment_name_escaping_the_results_tree_is_refused(config, name):
    config["experiment"] = name
    assert f"experiment = {name!r} is not allowed: results/{{experiment}}/" in error_of(config)


@pytest.mark.parametrize("name", ["my-run", "2026-11-30-h200", "e2e", "run.v2_a"])
def test_plain_experiment_names_pass(config, name):
    config["experiment"] = name
    validate_config(config)


def test_a_max_length_with_no_room_for_a_block_is_refused(config):
    config["profiles"]["gpu"]["drafter_train"]["max_length"] = 8  # the schema's minimum; gpu's block_size is 9
    config["profiles"]["gpu"]["scaling"]["drafter_train"]["max_length"] = 9
    msg = error_of(config)
    assert "profiles.gpu.drafter_train.max_length = 8 leaves no room for a block of drafter.block_size = 9: it must be >= 10" in msg
    assert "profiles.gpu.scaling.drafter_train.max_length = 9 leaves no room" in msg


def test_unknown_key_lists_allowed_keys(config):
    config["profiles"]["ci"]["data"]["generation"]["max_new_tokenz"] = 3
    msg = error_of(config)
    assert "unknown key profiles.ci.data.generation.max_new_tokenz" in msg and "max_new_tokens" in msg


def test_bad_enum_lists_allowed_values(config):
    config["profile"] = "laptop"
    assert "allowed values: ci, default, gpu, qwen3.5-4b" in error_of(config)


def test_humaneval_never_trains(config):
    config["profiles"]["ci"]["data"]["sources"]["humaneval"]["n_train"] = 4
    assert "profiles.ci.data.sources.humaneval.n_train = 4 is not allowed; it must be 0" in error_of(config)


def test_unknown_model_of_active_profile(config):
    config["profiles"]["default"]["model"] = "smollm3-135m"
    assert "profiles.default.model = 'smollm3-135m' is not a preset" in error_of(config)
    config["profiles"]["default"]["model"] = "someorg/some-model"  # a Hub id is fine
    validate_config(config)


def test_every_problem_reported_at_once(config):
    config["profiles"]["ci"]["data"]["heldout_fraction"] = 2
    config["profiles"]["ci"]["data"]["generation"]["batch_size"] = 0
    msg = error_of(config)
    assert "heldout_fraction" in msg and "batch_size" in msg


def test_section_validation_for_hydra_apps(config):
    data = copy.deepcopy(config["profiles"]["ci"]["data"])
    validate_section(data, "data", "x")
    data["generation"]["top_p"] = 1.5
    with pytest.raises(QdflashError, match="top_p"):
        validate_section(data, "data", "x")


@pytest.mark.parametrize("profile", ["ci", "default", "gpu", "qwen3.5-4b"])
def test_overrides_reach_hydra_unchanged(config, profile, tmp_path):
    """The Snakemake profile and the Hydra app agree on every value (no drift)."""
    config["profile"] = profile
    args = node_overrides(config, "prepare_data", tmp_path / "out dir's", ["data"])
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="node/prepare_data", overrides=args)
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(cfg.data) == config["profiles"][profile]["data"]
    assert cfg.model.name == config["profiles"][profile]["model"]
    assert cfg.out_dir == str(tmp_path / "out dir's")
    assert cfg.experiment == profile


@pytest.mark.parametrize("profile", ["ci", "default", "gpu", "qwen3.5-4b"])
def test_gate_tasks_are_the_profiles_exactly(config, profile, tmp_path):
    """The profile's gate tasks replace the node's defaults (a default task it leaves out does not
    run; a task the defaults lack, e.g. gsm8k, can be added)."""
    from omegaconf import OmegaConf

    config["profile"] = profile
    args = node_overrides(config, "quality_gate", tmp_path / "g", ["data", "gates"])
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="node/quality_gate", overrides=args)
    assert OmegaConf.to_container(cfg.gates) == config["profiles"][profile]["gates"]


def test_model_path_override(config, tmp_path):
    config["profiles"]["ci"]["model"] = str(tmp_path / "my model")
    config["profile"] = "ci"
    args = node_overrides(config, "prepare_data", tmp_path / "o", ["data"])
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="node/prepare_data", overrides=args)
    assert cfg.model.name == str(tmp_path / "my model")


def test_scaling_sizes_must_fit_its_data(config):
    scaling = config["profiles"]["gpu"]["scaling"]
    scaling["sizes"] = [100, 10**6]
    assert "profiles.gpu.scaling.sizes: the largest size 1000000 exceeds" in error_of(config)
    scaling["sizes"] = [100]
    scaling["n_train"]["wikipedia"] = 5
    assert "profiles.gpu.scaling.n_train: ['wikipedia'] are not sources" in error_of(config)


def test_scaling_arms_must_override_drafter_train_keys(config):
    scaling = config["profiles"]["gpu"]["scaling"]
    scaling["arms"] = {"deeper": {"num_layers": 4}}  # a drafter key, not a drafter_train one
    assert "profiles.gpu.scaling.arms.deeper: ['num_layers'] are not drafter_train keys" in error_of(config)
    scaling["arms"] = {"bad name": {"labels": "target"}}
    assert "bad name" in error_of(config)
    scaling["arms"] = {"target_labels": {"labels": "target"}}
    scaling["drafter_train"]["learning_rate"] = 1e-3
    assert "profiles.gpu.scaling.drafter_train: ['learning_rate'] are not drafter_train keys" in error_of(config)


def differences(want, got, path=""):
    """Where `got` (a composed Hydra section) differs from `want` (a profile's section): every leaf of
    `want`; gates.tasks compared whole (the profile's tasks replace the node's)."""
    if isinstance(want, dict) and isinstance(got, dict) and path != "gates.tasks":
        return [d for key, sub in want.items() for d in differences(sub, got.get(key, "<missing>"), f"{path}.{key}" if path else key)]
    return [] if want == got else [f"{path}: by hand {got!r}, default profile {want!r}"]


def test_a_node_run_by_hand_runs_with_the_default_profile(config):
    """Every node composed by Hydra with no overrides (as the README runs one by hand) has the
    `default` profile's value for every key of every section it reads, and its model, device, dtype:
    the DAG of the default profile and a node run by hand agree."""
    from omegaconf import OmegaConf

    default = config["profiles"]["default"]
    assert set(GROUP_SECTIONS) == {s for sections in NODE_SECTIONS.values() for s in sections}
    problems = []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for node, sections in NODE_SECTIONS.items():
            cfg = OmegaConf.to_container(compose(config_name=f"node/{node}", overrides=["out_dir=by-hand"]), resolve=True)
            for section in sections:
                problems += [f"{node}: {d}" for d in differences(default[section], cfg[section], section)]
            problems += [f"{node}: {d}" for d in differences({k: default[k] for k in ("device", "dtype")}, cfg)]
            if cfg["model"]["name"] != default["model"]:
                problems.append(f"{node}: model {cfg['model']['name']!r}, default profile {default['model']!r}")
    assert problems == []


def test_profiles_are_overlays_of_what_differs():
    """A profile says only what differs from the base: no overlay key repeats the base's value (a
    repeated value is a second copy that could drift), and `default` is the base itself."""
    raw = raw_config()
    assert redundant_keys(raw) == []
    assert raw["profiles"]["default"] == {}


def test_merged_profiles_are_resolved_once_and_for_all(config):
    """Merging is idempotent (a merged config comes back equal), so every reader may merge again."""
    from qdflash.config import resolve_profiles

    assert resolve_profiles(config) == config
    assert config["profiles"]["ci"]["quant"]["exclude"] == config["profiles"]["default"]["quant"]["exclude"]  # from the base
    assert config["profiles"]["ci"]["gates"]["tasks"] == {"mmlu": {"ratio": 0.9, "max_items": 8}}  # replaced whole


def test_any_profile_name_validates_through_one_definition(config):
    """A new profile is one more overlay: the schema checks it through the one profile definition."""
    config["profiles"]["laptop"] = {"device": "cpu", "drafter": {"num_layers": 2}}
    config["profile"] = "laptop"
    assert validate_config(config)["profiles"]["laptop"]["drafter"] == {**config["profiles"]["default"]["drafter"], "num_layers": 2}
    config["profiles"]["laptop"]["drafter"]["num_layerz"] = 2
    assert "unknown key profiles.laptop.drafter.num_layerz" in error_of(config)
