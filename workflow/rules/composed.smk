# Composed plans: what each rank of a composed run holds and its memory per category against the cost
# model's prediction for the run's Plan, parity per run, and the plan-to-run loop (config plan_search:
# the searched plans' measured ranking against the predicted one). Logic: shardlab.tables.composed.

COMPOSED_TABLES = table_files(
    "composed_ranks",
    "composed_runs",
    "composed_worst",
    "plan_search_runs",
    "plan_search_ranking",
)
COMPOSED_INPUTS = topic_inputs("composed")


rule composed_tables:
    input:
        **COMPOSED_INPUTS,
        tables=table_files("parity", "run_predictions", "run_prediction_ranking", "rank_predictions"),
    output:
        COMPOSED_TABLES,
    log:
        f"{RESULTS}/logs/composed_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
        settings=json.dumps({"plan_search": STUDY.plan_search}, sort_keys=True),
    shell:
        "python -m shardlab tables composed --out-dir {params.out} {params.args} --settings {params.settings:q}"
        " > {log} 2>&1"


if STUDY.experiments_of("composed"):
    REPORT_INPUTS.extend(COMPOSED_TABLES)
