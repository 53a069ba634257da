# Drafter: stage 1 against the 16-bit target; the QAD target regenerates the data; stage 2 adapts.

# Stage 2 adapts to one quantized target: the QAD variant of the first target bit width.
QAD_MAIN = f"{RESULTS}/target/{served_target(PROFILE)}"
DATA_QAD = f"{RESULTS}/data/qad"
STAGE1 = f"{RESULTS}/drafter/stage1"
STAGE2 = f"{RESULTS}/drafter/stage2"
DRAFTER_NAME = drafter_name("{dmethod}", "{dbits}", "{dgroup}")
DRAFTER_COMPRESSED = f"{RESULTS}/drafter/{DRAFTER_NAME}"
# one compress_drafter job per compressed grid of the sweep (16 bits = the uncompressed stage-2 drafter)
DRAFTER_VARIANTS = [f"{RESULTS}/drafter/{name}" for name in compressed_drafters(PROFILE)]


rule regenerate_data:
    """The QAD target's own responses (prepare_data on its dense twin): stage 2's data."""
    input:
        qad=QAD_MAIN,
    output:
        directory(DATA_QAD),
    log:
        log_file("regenerate_data"),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args("prepare_data", ["data"], lambda wc, input: {"model.name": f"{input.qad}/model/dense", "data_role": "qad"}),
        config=fingerprint(["data"]),
    threads: rule_threads("regenerate_data")
    priority: CRITICAL_PATH_PRIORITY
    resources: **rule_resources("regenerate_data")
    shell:
        "{params.python} -m qdflash.stages.prepare_data {params.args} > {log} 2>&1"


rule drafter_stage1:
    """DFlash drafter from scratch against the 16-bit target, on its self-distilled data."""
    input:
        data=DATA_BF16,
    output:
        directory(STAGE1),
    log:
        log_file("drafter_stage1"),
    conda:
        ENV
    params:
        args=hydra_args("train_drafter", ["drafter", "drafter_train"], lambda wc, input: {"stage": 1, "data_dir": input.data}),
        launch=launcher("drafter_stage1"),
        config=fingerprint(["drafter", "drafter_train"]),
    threads: rule_threads("drafter_stage1")
    resources: **rule_resources("drafter_stage1")
    shell:
        "{params.launch} qdflash.stages.train_drafter {params.args} > {log} 2>&1"


rule drafter_stage2:
    """Weights-only warm start from stage 1; target = the QAD twin, data = its regenerated responses."""
    input:
        data=DATA_QAD,
        qad=QAD_MAIN,
        stage1=STAGE1,
    output:
        directory(STAGE2),
    log:
        log_file("drafter_stage2"),
    conda:
        ENV
    params:
        args=hydra_args(
            "train_drafter",
            ["drafter", "drafter_train"],
            lambda wc, input: {"stage": 2, "data_dir": input.data, "model.name": f"{input.qad}/model/dense",
                               "init_from": f"{input.stage1}/drafter"},
        ),
        launch=launcher("drafter_stage2"),
        config=fingerprint(["drafter", "drafter_train"]),
    threads: rule_threads("drafter_stage2")
    priority: CRITICAL_PATH_PRIORITY
    resources: **rule_resources("drafter_stage2")
    shell:
        "{params.launch} qdflash.stages.train_drafter {params.args} > {log} 2>&1"


rule compress_drafter:
    """The stage-2 drafter on a W-bit grid (every linear, fc included); GPTQ calibrated on
    teacher-forced anchor blocks of the QAD target's data; tau-hat before and after."""
    input:
        data=DATA_QAD,
        qad=QAD_MAIN,
        drafter=STAGE2,
    output:
        directory(DRAFTER_COMPRESSED),
    wildcard_constraints:
        dmethod=METHOD_PATTERN,
        dbits=r"\d+",
        dgroup=GROUP_PATTERN,
    log:
        log_file("compress_drafter", DRAFTER_NAME),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args(
            "compress_drafter",
            ["compress"],
            lambda wc, input: {"data_dir": input.data, "model.name": f"{input.qad}/model/dense",
                               "drafter_dir": f"{input.drafter}/drafter", "compress.method": wc.dmethod,
                               "compress.bits": int(wc.dbits), "compress.group_size": group_size(wc.dgroup)},
        ),
        config=fingerprint(["compress"]),
    threads: rule_threads("compress_drafter")
    priority: CRITICAL_PATH_PRIORITY
    resources: **rule_resources("compress_drafter")
    shell:
        "{params.python} -m qdflash.stages.compress_drafter {params.args} > {log} 2>&1"
