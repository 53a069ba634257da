# Speed: batch-1 speculative decoding against the baselines (qdflash.bench).

BENCH = f"{RESULTS}/bench/speedup"


rule bench_speedup:
    """tokens/s, time to first token, tau and speedups of every method on the same prompts; greedy
    outputs checked against autoregressive decoding of the same target."""
    input:
        data=DATA_BF16,
        qad=QAD_MAIN,
        stage1=STAGE1,
        stage2=STAGE2,
    output:
        directory(BENCH),
    params:
        args=hydra_args(
            "bench_speedup", ["bench"],
            lambda wc, input: {"data_dir": input.data, "qad_model": f"{input.qad}/model",
                               "stage1": f"{input.stage1}/drafter", "stage2": f"{input.stage2}/drafter"},
        ),
        config=fingerprint(["bench"]),
    threads: workflow.cores
    shell:
        "{PYTHON} -m qdflash.stages.bench_speedup {params.args}"
