# Quality gates: every quantized target variant against the 16-bit target, through lm-eval.

TARGET_VARIANTS = [os.path.basename(p) for p in PTQ_VARIANTS + QAD_VARIANTS]
GATE = f"{RESULTS}/gates/{{tvariant}}"
GATES = expand(GATE, tvariant=TARGET_VARIANTS)


rule quality_gate:
    """The variant and the 16-bit target on the same evaluation items (lm-eval, local tasks); each
    task's gate judged on paired per-item scores with a 95% interval and a minimum sample count."""
    input:
        target=f"{RESULTS}/target/{{tvariant}}",
    output:
        directory(GATE),
    wildcard_constraints:
        tvariant=r"(ptq|qad)_(rtn|gptq)_w\d+g(\d+|ch)",
    params:
        args=hydra_args("quality_gate", ["data", "gates"], lambda wc, input: {"variant": f"{input.target}/model"}),
        config=fingerprint(["data", "gates"]),
    threads: workflow.cores
    shell:
        "{PYTHON} -m qdflash.stages.quality_gate {params.args}"
