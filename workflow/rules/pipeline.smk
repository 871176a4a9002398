# Pipeline-parallel tables: bubble (measured vs theory) and per-stage memory, one op timeline per run.
# Reads every run of the experiments that contain a pipeline strategy (and their single reference).

PIPELINE_STRATEGIES = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "hybrid_dp_pp")
PIPELINE_EXPERIMENTS = sorted({exp for exp, s in RUNS if s in PIPELINE_STRATEGIES})
PIPELINE_TABLES = [
    f"{RESULTS}/tables/{name}.csv" for name in ("pipeline", "pipeline_timeline")
]


rule pipeline_tables:
    input:
        summaries=[
            f"{run_dir(exp, s)}/summary.json"
            for exp, s in RUNS
            if s in PIPELINE_STRATEGIES
        ],
        code="src/shardlab/tables/pipeline.py",
    output:
        PIPELINE_TABLES,
    log:
        f"{RESULTS}/logs/pipeline_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
    shell:
        "python -m shardlab.tables.pipeline --out-dir {params.out} {input.summaries} > {log} 2>&1"


if PIPELINE_EXPERIMENTS:
    REPORT_INPUTS.extend(PIPELINE_TABLES)
