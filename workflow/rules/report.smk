# Report: the experiment's tables and the fastest variant that passes every gate.

TABLES = f"{RESULTS}/tables"
FIGURES = f"{RESULTS}/figures"


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
        report(directory(TABLES), patterns=["{name}.csv"], caption="../report/tables.rst", category="Tables"),
    log:
        log_file("report"),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args(
            "report", [],
            lambda wc, input: {"results": RESULTS, "target": os.path.basename(QAD_MAIN),
                               "target_bits": VARIANTS["target_bits"][0],
                               "target_gate": f"{RESULTS}/gates/{os.path.basename(QAD_MAIN)}",
                               "gate_dirs": list(input.gates), "bench_dirs": list(input.bench),
                               "drafter_dirs": [input.stage1, input.stage2, *input.compressed]},
        ),
    resources: **rule_resources("report")
    shell:
        "{params.python} -m qdflash.stages.report {params.args} > {log} 2>&1"


rule figures:
    """tau and speed vs drafter bits and window, target quality vs bits, the speed / quality Pareto
    plot: drawn from the tables only (notebooks/results.ipynb draws the same)."""
    input:
        TABLES,
    output:
        report(directory(FIGURES), patterns=["{name}.png"], caption="../report/figures.rst", category="Figures"),
    log:
        log_file("figures"),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args("figures", [], lambda wc, input: {"tables": input[0]}),
    resources: **rule_resources("figures")
    shell:
        "{params.python} -m qdflash.stages.figures {params.args} > {log} 2>&1"


rule export_drafter:
    """The selected variant's drafter in the DFlash checkpoint format (qdflash.drafter.export), which
    z-lab's dflash, vLLM and SGLang load. Not part of `all`: a report may select no variant (the CPU
    profiles' tiny targets pass no gate), and then this rule fails saying so."""
    input:
        tables=TABLES,
        target=QAD_MAIN,
        drafters=[STAGE2, *DRAFTER_VARIANTS],
    output:
        directory(f"{RESULTS}/export/drafter-dflash"),
    log:
        log_file("export_drafter"),
    conda:
        ENV
    params:
        python=PYTHON,
        results=lambda wc, input: os.path.dirname(input.tables),  # the experiment folder the tables are of
    resources: **rule_resources("export_drafter")
    shell:
        "{params.python} -m qdflash.drafter.export --results {params.results} --out {output} > {log} 2>&1"
