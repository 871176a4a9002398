# Stage 4: every run's summary and step log -> the tidy tables of the report's main sections
# (runs, steps, ranks, activations, parity). Logic: shardlab.tables.runs.

RUNS_TABLES = table_files(
    "runs", "steps", "ranks", "activations", "parity", "environments", "experiments"
)


rule runs_tables:
    input:
        summaries=[f"{run_dir(exp, s)}/summary.json" for exp, s in RUNS],
        metrics=[f"{run_dir(exp, s)}/metrics.jsonl" for exp, s in RUNS],
        experiments=[settings_file(exp) for exp in EXPERIMENTS],
        models=sorted({model_record(exp) for exp in EXPERIMENTS}),
        code=code("tables/__init__", "tables/runs", "tables/parity"),
    output:
        RUNS_TABLES,
    log:
        f"{RESULTS}/logs/runs_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables runs --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(RUNS_TABLES)
