# Drafter scaling study (optional; `snakemake drafter_scaling --config profile=gpu`): stage-1 tau
# against the 16-bit target as a function of training data and drafter depth, each with its training
# time. Its data is generated in shards (each fits in a short job; merge_data joins them) and every
# training run reads a nested subset of the same merged data, so sizes differ only in data. `arms`:
# named drafter_train changes (e.g. the labels), each one more run at the largest size and first depth.
import copy
import re

from qdflash.config import flatten as flat_overrides  # (snakemake has its own `flatten`)
from qdflash.config import scaling_arms

SCALING = PROFILE.get("scaling")

if SCALING:
    SCALING_DIR = f"{RESULTS}/scaling"
    SCALING_SHARD = f"{SCALING_DIR}/data/shard-{{index}}"
    SCALING_SHARDS = expand(SCALING_SHARD, index=range(SCALING["shards"]))
    SCALING_DATA = f"{SCALING_DIR}/data/merged"
    if SCALING.get("design", "grid") == "grid":
        SCALING_PAIRS = [(s, d) for s in SCALING["sizes"] for d in SCALING["depths"]]
    else:  # cross: the data axis at the first depth, the depth axis at the largest data size
        SCALING_PAIRS = [(s, SCALING["depths"][0]) for s in SCALING["sizes"]]
        SCALING_PAIRS += [(max(SCALING["sizes"]), d) for d in SCALING["depths"][1:]]
    # run name -> (examples, layers, drafter_train overrides); an arm changes only its overrides, at the
    # largest size and the first depth, so it compares with that run at equal data and steps
    SCALING_SPECS = {f"n{s}-L{d}": (s, d, {}) for s, d in SCALING_PAIRS}
    SCALING_ARMS = scaling_arms(SCALING)
    for _arm, _overrides in SCALING_ARMS.items():
        SCALING_SPECS[f"n{max(SCALING['sizes'])}-L{SCALING['depths'][0]}-{_arm}"] = (max(SCALING["sizes"]), SCALING["depths"][0], _overrides)
    SCALING_RUNS = [f"{SCALING_DIR}/drafter/{name}" for name in SCALING_SPECS]

    # the profile's data and training sections with the study's own sizes
    SCALING_DATA_SECTION = copy.deepcopy(PROFILE["data"])
    for _source, _n in SCALING["n_train"].items():
        SCALING_DATA_SECTION["sources"][_source]["n_train"] = _n
    SCALING_DATA_SECTION["generation"]["max_new_tokens"] = SCALING["max_new_tokens"]
    SCALING_DATA_SECTION["generation"]["measure_speed"]["enabled"] = False
    SCALING_TRAIN_SECTION = {**PROFILE["drafter_train"], **SCALING.get("drafter_train", {}), "epochs": SCALING["epochs"]}

    rule scaling_data_shard:
        """One shard of the scaling data: every n-th selected prompt, answered by the 16-bit target.
        One at a time (H200: three side by side made 5.0K tokens/s together, one alone 9.1K); short
        jobs, so a job cut off by a time limit loses little."""
        output:
            directory(SCALING_SHARD),
        log:
            log_file("scaling_data_shard", "shard-{index}"),
        conda:
            ENV
        params:
            python=PYTHON,
                args=hydra_args(
                "prepare_data", [],
                lambda wc, input: {**dict(flat_overrides("data", SCALING_DATA_SECTION)), "shard.index": int(wc.index),
                                   "shard.count": SCALING["shards"]},
            ),
            config=section_fingerprint({"data": SCALING_DATA_SECTION, "shards": SCALING["shards"]}),
        threads: rule_threads("scaling_data_shard")
        resources: **rule_resources("scaling_data_shard")
        shell:
            "{params.python} -m qdflash.stages.prepare_data {params.args} > {log} 2>&1"

    rule scaling_data:
        """The shards interleaved back into one data folder (the order of an unsharded run)."""
        input:
            SCALING_SHARDS,
        output:
            directory(SCALING_DATA),
        log:
            log_file("scaling_data"),
        conda:
            ENV
        params:
            python=PYTHON,
                args=hydra_args("merge_data", [], lambda wc, input: {"shards": list(input)}),
        shell:
            "{params.python} -m qdflash.stages.merge_data {params.args} > {log} 2>&1"

    rule scaling_drafter:
        """Stage 1 of run {run}: its size's examples (a fixed nested subset), its depth, its arm's
        drafter_train overrides, `epochs` passes. All cores: one training run at a time, so its wall
        time is its own."""
        input:
            data=SCALING_DATA,
        output:
            directory(f"{SCALING_DIR}/drafter/{{run}}"),
        log:
            log_file("scaling_drafter", "{run}"),
        conda:
            ENV
        params:
            python=PYTHON,
                args=hydra_args(
                "train_drafter", ["drafter"],
                lambda wc, input: {**dict(flat_overrides("drafter_train", {**SCALING_TRAIN_SECTION, **SCALING_SPECS[wc.run][2]})),
                                   "stage": 1, "data_dir": input.data, "drafter.num_layers": SCALING_SPECS[wc.run][1],
                                   "drafter_train.max_examples": SCALING_SPECS[wc.run][0]},
            ),
            # a plain string (Snakemake records no function's params): every run's values, the arms' included
            config=section_fingerprint({"drafter": PROFILE["drafter"], "train": SCALING_TRAIN_SECTION, "arms": SCALING_ARMS}),
        threads: rule_threads("scaling_drafter")
        resources: **rule_resources("scaling_drafter")
        wildcard_constraints:
            run="|".join(re.escape(name) for name in SCALING_SPECS),
        shell:
            "{params.python} -m qdflash.stages.train_drafter {params.args} > {log} 2>&1"

    rule drafter_scaling:
        """The scaling table: tau (overall and per category), parameters, steps and training time."""
        input:
            SCALING_RUNS,
        output:
            csv=f"{SCALING_DIR}/table.csv",
            md=f"{SCALING_DIR}/table.md",
            png=report(f"{SCALING_DIR}/tau_by_epoch.png", caption="../report/scaling.rst", category="Drafter scaling"),
        log:
            log_file("drafter_scaling"),
        conda:
            ENV
        params:
            python=PYTHON,
            runs=lambda wc, output: os.path.dirname(output.csv),
        shell:
            "{params.python} -m qdflash.tables scaling {params.runs} --csv {output.csv} --md {output.md} --png {output.png} > {log} 2>&1"

