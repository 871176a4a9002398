# Stage 4: every run's summary and step log -> tidy tables (one row per run / step / rank).

TABLES = [
    f"{RESULTS}/tables/{name}.csv" for name in ("runs", "steps", "ranks", "activations")
]


rule aggregate_runs:
    input:
        summaries=[f"{run_dir(exp, s)}/summary.json" for exp, s in RUNS],
        metrics=[f"{run_dir(exp, s)}/metrics.jsonl" for exp, s in RUNS],
    output:
        TABLES,
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
    shell:
        "python -m shardlab.tables.runs --out-dir {params.out} {input.summaries} > {log} 2>&1"


REPORT_INPUTS.extend(TABLES)
