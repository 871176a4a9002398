# Communication analysis (issue 7): one collective benchmark job (torchrun) with its alpha-beta
# fit, then each run's communication volume, share of step time and what-if step times.

COMM_BENCH_TABLES = [
    f"{RESULTS}/tables/{name}.csv" for name in ("comm_bench", "comm_fit")
]
COMM_MODEL_TABLES = [
    f"{RESULTS}/tables/{name}.csv"
    for name in ("comm_volume", "comm_share", "comm_whatif", "comm_projection")
]


rule comm_bench:
    input:
        code=[
            f"src/shardlab/{m}.py" for m in ("bench/comm", "costs/alpha_beta", "costs/collectives")
        ],
    output:
        bench=COMM_BENCH_TABLES[0],
        fit=COMM_BENCH_TABLES[1],
    log:
        f"{RESULTS}/logs/comm_bench.log",
    conda:
        ENV
    # All cores, like a training run: no other job may share the CPUs while collectives are timed.
    threads: workflow.cores
    params:
        settings=json.dumps(config.get("comm_bench", {}), sort_keys=True),
    shell:
        "python -m shardlab.bench.comm --settings {params.settings:q}"
        " --bench-out {output.bench} --fit-out {output.fit} > {log} 2>&1"


rule comm_share:
    input:
        runs=f"{RESULTS}/tables/runs.csv",
        fit=COMM_BENCH_TABLES[1],
        experiments=[f"{RESULTS}/{exp}/experiment.json" for exp in EXPERIMENTS],
        code=[f"src/shardlab/{m}.py" for m in ("costs/comm_volume", "tables/communication", "costs/alpha_beta")],
    output:
        COMM_MODEL_TABLES,
    log:
        f"{RESULTS}/logs/comm_share.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        resources=RESOURCES,
    shell:
        "python -m shardlab.tables.communication --runs {input.runs} --fit {input.fit} --experiments {input.experiments}"
        " --resources {params.resources} --out-dir {params.out} > {log} 2>&1"


REPORT_INPUTS.extend(COMM_BENCH_TABLES + COMM_MODEL_TABLES)
