# Data parallelism (the study's first claim): throughput of the hand-written strategies against
# their reference, their production twin and each other, and the per-step time blocked in gradient
# communication, and interleaved DP's bucket-size sweep against the alpha-beta fit (experiments
# dp_bucket_*). Logic: shardlab.tables.data_parallel.

DP_TABLES = table_files("dp_throughput", "dp_pairs", "dp_comm_steps", "dp_buckets")
DP_EVIDENCE = table_files("comm_fit") + TIMING_NOISE


rule data_parallel_tables:
    input:
        **topic_inputs("data_parallel", metrics=True),
        tables=DP_EVIDENCE,
    output:
        DP_TABLES,
    log:
        f"{RESULTS}/logs/data_parallel_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables data_parallel --out-dir {params.out} {params.args} > {log} 2>&1"


if STUDY.experiments_of("data_parallel"):
    REPORT_INPUTS.extend(DP_TABLES)
