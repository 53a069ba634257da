# Quality gates: every quantized target variant against the 16-bit target, through lm-eval.

TARGET_VARIANTS = [os.path.basename(p) for p in PTQ_VARIANTS + QAD_VARIANTS]
GATE = f"{RESULTS}/gates/{{tvariant}}"
GATES = expand(GATE, tvariant=TARGET_VARIANTS)
GATE_REFERENCE = f"{RESULTS}/gates/bf16"


rule quality_reference:
    """The 16-bit target's per-item scores on the gate items, once for every variant's gate."""
    output:
        directory(GATE_REFERENCE),
    log:
        log_file("quality_reference"),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args("quality_gate", ["data", "gates"]),
        config=fingerprint(["data", "gates"]),
    threads: rule_threads("quality_reference")
    resources: **rule_resources("quality_reference")
    shell:
        "{params.python} -m qdflash.stages.quality_gate {params.args} > {log} 2>&1"


rule quality_gate:
    """The variant and the 16-bit target on the same evaluation items (lm-eval, local tasks); each
    task's gate judged on paired per-item scores with a 95% interval and a minimum sample count."""
    input:
        target=f"{RESULTS}/target/{{tvariant}}",
        reference=GATE_REFERENCE,
    output:
        directory(GATE),
    wildcard_constraints:
        tvariant=TARGET_PATTERN,
    log:
        log_file("quality_gate", "{tvariant}"),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args("quality_gate", ["data", "gates"], lambda wc, input: {"variant": f"{input.target}/model", "reference": input.reference}),
        config=fingerprint(["data", "gates"]),
    threads: rule_threads("quality_gate")
    resources: **rule_resources("quality_gate")
    shell:
        "{params.python} -m qdflash.stages.quality_gate {params.args} > {log} 2>&1"
