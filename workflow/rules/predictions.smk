# The planner on this study's own runs: every finished run's predicted memory and step time beside
# what it measured, on this machine as calibrated by the DAG (logic: shardlab.tables.predictions); and the
# newest GPU check kept in the repository, as its record has it (shardlab.tables.gpu_check).
PREDICTION_TABLES = table_files("run_predictions", "run_prediction_ranking", "run_prediction_summary", "gpu_measured")
PREDICTION_EVIDENCE = table_files("comm_fit", "rank_predictions") + TIMING_NOISE


rule run_predictions_tables:
    input:
        summaries=[f"{run_dir(exp, s)}/summary.json" for exp, s in RUNS],
        experiments=[settings_file(exp) for exp in EXPERIMENTS],
        models=sorted({model_record(exp) for exp in EXPERIMENTS}),
        tables=PREDICTION_EVIDENCE,
        records=GPU_MEASUREMENTS,
        code=sources_of("tables.predictions"),
        catalog=f"{SRC}/costs/hardware.yaml",
    output:
        PREDICTION_TABLES,
    log:
        f"{RESULTS}/logs/run_predictions_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables predictions --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(PREDICTION_TABLES)
