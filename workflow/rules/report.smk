# Report: the experiment's tables and the fastest variant that passes every gate.

TABLES = f"{RESULTS}/tables"


rule report:
    """quality / speed / training / summary tables; `selected` = the fastest variant whose target
    passes every gate (none when no variant qualifies, with the reason in metrics.json)."""
    input:
        gates=GATES,
        bench=BENCH,
        stage1=STAGE1,
        stage2=STAGE2,
        compressed=DRAFTER_VARIANTS,
        targets=PTQ_VARIANTS + QAD_VARIANTS,
    output:
        directory(TABLES),
    params:
        args=hydra_args(
            "report", [],
            lambda wc, input: {"results": RESULTS, "target": os.path.basename(QAD_MAIN),
                               "target_bits": VARIANTS["target_bits"][0],
                               "target_gate": f"{RESULTS}/gates/{os.path.basename(QAD_MAIN)}",
                               "gate_dirs": list(input.gates), "bench_dirs": list(input.bench),
                               "drafter_dirs": [input.stage1, input.stage2, *input.compressed]},
        ),
    shell:
        "{PYTHON} -m qdflash.stages.report {params.args}"
