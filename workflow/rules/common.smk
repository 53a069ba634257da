# Shared helpers: config validation (clear errors), result paths, Hydra overrides for each node.
import shlex
import sys

from qdflash.config import node_overrides, results_root, validate_config
from qdflash.errors import QdflashError

try:
    validate_config(config)
except QdflashError as err:
    raise WorkflowError(str(err)) from None

RESULTS = str(results_root(config))
PYTHON = shlex.quote(sys.executable)  # the interpreter running Snakemake has qdflash installed


def hydra_args(node, sections):
    """Shell-quoted overrides for `node`, writing to the rule's single directory output."""

    def params(wildcards, output):
        return " ".join(shlex.quote(arg) for arg in node_overrides(config, node, output[0], sections))

    return params
