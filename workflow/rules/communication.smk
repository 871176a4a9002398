# Communication: one collective benchmark job (torchrun) with its alpha-beta fit, then
# each run's communication plan (from the registry), its share of step time, what-if step times
# per network link, the plans at the study's scale, and the fit curves. Logic:
# shardlab.bench.comm (benchmark), shardlab.tables.communication (tables), shardlab.costs.network.

COMM_BENCH_TABLES = table_files("comm_bench", "comm_fit")
COMMUNICATION_TABLES = table_files("comm_volume", "comm_share", "comm_whatif", "comm_projection", "comm_fit_curve")


rule comm_bench:
    input:
        code=sources_of("bench.comm"),
    output:
        bench=COMM_BENCH_TABLES[0],
        fit=COMM_BENCH_TABLES[1],
    log:
        f"{RESULTS}/logs/comm_bench.log",
    priority: MANY_CORES
    conda:
        ENV
    # Locally all cores, like a training run: no other job may share the CPUs while collectives are timed.
    threads: job_threads(launch_threads({"threads_per_rank": 1}, config["comm_bench"]["world_size"]))
    resources:
        gpu=bench_gpus(config["comm_bench"], config["comm_bench"]["world_size"]),
        tasks_per_gpu=0,
    params:
        settings=json.dumps(config.get("comm_bench", {}), sort_keys=True),
    shell:
        "python -m shardlab bench-comm --settings {params.settings:q}"
        " --bench-out {output.bench} --fit-out {output.fit} > {log} 2>&1"


# Every run of the study: the registry gives each strategy's plan, runs.csv its times.
rule communication_tables:
    input:
        tables=[*table_files("runs"), COMM_BENCH_TABLES[1]],
        experiments=[settings_file(exp) for exp in EXPERIMENTS],
        models=sorted({model_record(exp) for exp in EXPERIMENTS}),
        code=sources_of("tables.communication"),
    output:
        COMMUNICATION_TABLES,
    log:
        f"{RESULTS}/logs/communication_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables communication --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(COMM_BENCH_TABLES + COMMUNICATION_TABLES)
