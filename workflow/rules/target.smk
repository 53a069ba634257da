# Target: post-training quantization (RTN | GPTQ) and QAD on the same grid.

GROUP = group_label(PROFILE["quant"]["group_size"])
PTQ_NAME, QAD_NAME = (target_name(kind, "{method}", "{bits}", "{group}") for kind in ("ptq", "qad"))
PTQ = f"{RESULTS}/target/{PTQ_NAME}"
QAD = f"{RESULTS}/target/{QAD_NAME}"
PTQ_VARIANTS = expand(PTQ, method=VARIANTS["ptq_methods"], bits=VARIANTS["target_bits"], group=GROUP)
QAD_VARIANTS = expand(QAD, method=VARIANTS["qad_from"], bits=VARIANTS["target_bits"], group=GROUP)


rule quantize_target:
    """W{bits} g{group} weights by RTN or GPTQ (calibrated on the 16-bit target's own responses)."""
    input:
        data=DATA_BF16,
    output:
        directory(PTQ),
    log:
        log_file("quantize_target", PTQ_NAME),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args(
            "quantize_target",
            ["quant", "eval"],
            lambda wc, input: {"data_dir": input.data, "quant.method": wc.method, "quant.bits": int(wc.bits),
                               "quant.group_size": group_size(wc.group)},
        ),
        config=fingerprint(["quant", "eval"]),
    threads: rule_threads("quantize_target")
    priority: CRITICAL_PATH_PRIORITY
    resources: **rule_resources("quantize_target")
    shell:
        "{params.python} -m qdflash.stages.quantize_target {params.args} > {log} 2>&1"


rule qad:
    """Quantization-aware distillation from the PTQ artifact, grid kept (scales frozen)."""
    input:
        data=DATA_BF16,
        ptq=PTQ,
    output:
        directory(QAD),
    log:
        log_file("qad", QAD_NAME),
    conda:
        ENV
    params:
        args=hydra_args("qad", ["qad", "eval"], lambda wc, input: {"data_dir": input.data, "ptq_dir": input.ptq}),
        launch=launcher("qad"),
        config=fingerprint(["qad", "eval"]),
    threads: rule_threads("qad")
    priority: CRITICAL_PATH_PRIORITY
    resources: **rule_resources("qad")
    shell:
        "{params.launch} qdflash.stages.qad {params.args} > {log} 2>&1"
