# Speed: batch-1 speculative decoding against the baselines (qdflash.bench).

BENCH_ONE = f"{RESULTS}/bench/speedup_{window_name('{window}')}"


# one benchmark job per drafter window of the sweep; each runs every drafter variant and the baselines
BENCH = expand(BENCH_ONE, window=[window_label(w) for w in VARIANTS["drafter_windows"]])


rule bench_speedup:
    """tokens/s, time to first token, tau and speedups of every method on the same prompts; greedy
    outputs checked against autoregressive decoding of the same target."""
    input:
        data=DATA_BF16,
        qad=QAD_MAIN,
        stage1=STAGE1,
        stage2=STAGE2,
        compressed=DRAFTER_VARIANTS,
    output:
        directory(BENCH_ONE),
    wildcard_constraints:
        window=WINDOW_PATTERN,
    log:
        log_file("bench_speedup", window_name("{window}")),
    conda:
        ENV
    params:
        python=PYTHON,
        args=hydra_args(
            "bench_speedup", ["bench"],
            lambda wc, input: {"data_dir": input.data, "qad_model": f"{input.qad}/model",
                               "stage1": f"{input.stage1}/drafter", "stage2": f"{input.stage2}/drafter",
                               "compressed": [f"{d}/drafter" for d in input.compressed],
                               "bench.window": parse_window(wc.window)},
        ),
        config=fingerprint(["bench"]),
    threads: rule_threads("bench_speedup")
    resources: **rule_resources("bench_speedup")
    shell:
        "{params.python} -m qdflash.stages.bench_speedup {params.args} > {log} 2>&1"
