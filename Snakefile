# qdflash: quantize the target, quantize the drafter.
#   snakemake --cores all                         (embedded default profile: SmolLM2-135M on the CPU)
#   snakemake --cores all --config profile=ci     (tiny-qwen3.5, every code path, minutes)
# Each rule runs one Hydra app (python -m qdflash.stages.<node>) whose overrides come from
# qdflash.config.node_overrides, so paths and overrides cannot drift (workflow/rules/common.smk).

import os


# relative to this file, so `snakemake --directory elsewhere` finds it too
configfile: os.path.join(workflow.basedir, "config", "config.yaml")


# (here, not in common.smk: the linter wants rule files without functions and common.smk without rules)
wildcard_constraints:
    method="rtn|gptq",
    bits=r"\d+",
    group=r"\d+|ch",


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/drafter.smk"
include: "workflow/rules/scaling.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/gates.smk"
include: "workflow/rules/report.smk"


# a resources entry must name a rule of this DAG (a typo would silently keep the defaults)
_unknown = set(PROFILE.get("resources") or {}) - {r.name for r in workflow.rules} - {"default"}
if _unknown:
    raise WorkflowError(f"profiles.{config['profile']}.resources: {sorted(_unknown)} are not rules of this workflow "
                        f"(rules: {sorted(r.name for r in workflow.rules)})")


rule all:
    input:
        DATA_BF16,
        PTQ_VARIANTS,
        QAD_VARIANTS,
        STAGE1,
        STAGE2,
        DRAFTER_VARIANTS,
        GATES,
        BENCH,
        TABLES,
        FIGURES,
    default_target: True
