# Shared helpers: config validation (clear errors), result paths, Hydra overrides for each node.
import hashlib
import json
import os
import shlex
import sys

from qdflash.config import active_profile, node_overrides, resolved_inputs, results_root, validate_config
from qdflash.errors import QdflashError
# variant names (target / drafter / window): built and parsed in one place, qdflash.variants
from qdflash.variants import (GROUP_PATTERN, METHOD_PATTERN, TARGET_PATTERN, WINDOW_PATTERN, compressed_drafters, drafter_name,
                              group_label, group_size, parse_window, served_target, target_name, window_label, window_name)

# config/config.yaml's profiles are overlays (qdflash.config): from here on every rule reads them merged
# over the base (the Hydra group defaults config/<section>/default.yaml plus `base:`), after any
# --configfile (e.g. config/gpu-rehearsal.yaml) and --config Snakemake merged into the overlays
try:
    config["profiles"] = validate_config(config)["profiles"]
except QdflashError as err:
    raise WorkflowError(str(err)) from None

RESULTS = str(results_root(config))
PROFILE = active_profile(config)
VARIANTS = PROFILE["variants"]
PYTHON = shlex.quote(sys.executable)  # the interpreter running Snakemake has qdflash installed

# The environment every node runs in, declared by each of the rules (`conda: ENV`): environment.yml plus
# `scripts/install.sh`, i.e. the interpreter running Snakemake. Snakemake cannot build it per rule
# (`--use-conda`): two asset packages must be installed with `pip --no-deps`, which an environment
# file cannot express, so that deployment is refused with the way that works.
ENV = os.path.join(workflow.basedir, "environment.yml")
if "conda" in {str(getattr(m, "value", m)).lower() for m in workflow.deployment_settings.deployment_method}:
    raise WorkflowError("--use-conda / --software-deployment-method conda is not supported: create the environment once "
                        "(`conda env create -f environment.yml && conda activate qdflash && bash scripts/install.sh`, "
                        "README 'Set-up') and run Snakemake inside it")


def log_file(rule_name, name=None):
    """The rule's `log:` file (the node's whole stdout and stderr), outside its output folder so that
    a failed node's log survives the removal of its output (`--show-failed-logs` prints it)."""
    return os.path.join(RESULTS, "logs", rule_name, *([name] if name else [])) + ".log"


# What each job asks a cluster for (profiles.<name>.resources; workflow/profiles/slurm): GPUs, CPUs,
# memory, minutes. A profile without the section runs every rule on this machine with no GPU request.
RESOURCE_DEFAULTS = {"gpu": 0, "cpus": 1, "mem_mb": 8000, "runtime": 60}


def rule_resources(rule_name):
    """The resources of one rule: the profile's entry for it over its `default` entry over the
    built-in defaults (snakemake-executor-plugin-slurm reads gpu, cpus_per_task, mem_mb, runtime)."""
    table = PROFILE.get("resources") or {}
    merged = {**RESOURCE_DEFAULTS, **table.get("default", {}), **table.get(rule_name, {})}
    return {"gpu": merged["gpu"], "cpus_per_task": merged["cpus"], "mem_mb": merged["mem_mb"], "runtime": merged["runtime"]}


def rule_threads(rule_name):
    """The cores a node holds on this machine, which decide how many nodes run side by side.
    By default every node holds all cores (--cores), so nodes run one at a time: on a CPU each
    node's torch uses them all, and on a multi-GPU host no two nodes compete for GPU 0. A profile
    with `share_device: true` (one H200: generate and lm-eval leave it mostly idle, host-bound) gives
    each job its resources' `cpus` instead: nodes share the GPU, and a job whose `cpus` is the
    whole machine (the speed benchmark) runs alone. Snakemake caps threads at --cores."""
    if not PROFILE.get("share_device", False):
        try:
            return workflow.cores
        except WorkflowError:  # no --cores: `--report`, `--lint`; no job runs, so threads do not matter
            return 1
    return rule_resources(rule_name)["cpus_per_task"]


# Where nodes share one GPU (share_device), up to --cores / cpus of them run at once, and Snakemake
# picks among the ready ones by priority. The chain that sets the wall time (PTQ -> QAD -> the QAD
# target's answers -> stage 2 -> compression) goes first; gates and stage 1 have slack beside it. The
# benchmarks need no priority: they come last and hold every core. Elsewhere (one node at a time)
# this only orders ready nodes.
CRITICAL_PATH_PRIORITY = 10


def launcher(rule_name):
    """How a node starts: one process, or one per GPU through torchrun for a multi-GPU training rule
    (qdflash.distributed reads the world size torchrun sets)."""
    gpus = rule_resources(rule_name)["gpu"]
    if gpus > 1:
        return f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node {gpus} -m"
    return f"{PYTHON} -m"


def hydra_args(node, sections, extra=None):
    """Shell-quoted overrides for `node`, writing to the rule's single directory output.
    `extra(wildcards, input)` returns the overrides that come from the DAG (inputs, wildcards)."""

    def params(wildcards, input, output):
        more = extra(wildcards, input) if extra else {}
        return " ".join(shlex.quote(arg) for arg in node_overrides(config, node, output[0], sections, more))

    return params


def fingerprint(sections):
    """A plain-string param per rule: the profile values the node reads. Snakemake does not record
    params computed by functions (hydra_args), so without this a changed profile value would not
    make the rule re-run; with it, the `params` re-run trigger sees the change."""
    return section_fingerprint({k: PROFILE[k] for k in sections})


def section_fingerprint(values):
    """`fingerprint` of any config values a rule reads (plus the model, device and dtype), and of
    where its data sources resolve now: the same values find other data when $QDFLASH_DATA_DIR or
    ../shared/data gains, loses or changes a source (a skipped optional GSM8K that appears re-runs)."""
    keys = {k: PROFILE[k] for k in ("model", "device", "dtype")}
    resolved = resolved_inputs(values)
    if resolved:  # rules that read no data keep their fingerprint
        keys["resolved"] = resolved
    return hashlib.sha256(json.dumps({**keys, **values}, sort_keys=True).encode()).hexdigest()[:16]
