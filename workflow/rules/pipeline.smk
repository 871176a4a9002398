# Pipeline parallelism: bubble (measured vs theory), per-stage memory, one op timeline per run, and
# the dp x pp hybrid beside its single pipeline. Logic: shardlab.tables.pipeline.

PIPELINE_TABLES = table_files(
    "pipeline",
    "pipeline_timeline",
    "pipeline_theory",
    "pipeline_memory",
    "pipeline_hybrid",
)


rule pipeline_tables:
    input:
        **topic_inputs("pipeline"),
    output:
        PIPELINE_TABLES,
    log:
        f"{RESULTS}/logs/pipeline_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables pipeline --out-dir {params.out} {params.args} > {log} 2>&1"


if STUDY.experiments_of("pipeline"):
    REPORT_INPUTS.extend(PIPELINE_TABLES)
