# Science cases (issue 6): deterministic data splits, domain evaluation of each run's saved model
# (training.save_model), and the tables of the report's science section. Science experiments are
# those whose data format is a science format. Logic: shardlab.core.splits, shardlab.science.evaluate,
# shardlab.tables.science.
SCIENCE_EXPERIMENTS = STUDY.science_experiments
SCIENCE_TABLES = table_files("science_runs", "science_curves", "science_metrics")


# An experiment's evaluation, named after it: TableInputs keys tables by file stem.
SCIENCE_METRICS = f"{RESULTS}/{{exp}}/science_metrics.{{exp}}.csv"
SCIENCE_RUNS = [(e, s) for e, s in RUNS if e in SCIENCE_EXPERIMENTS]
# What science_tables reads (cf. topic_inputs): the science experiments' runs with their step logs,
# their settings and evaluations, and the table code.
SCIENCE_INPUTS = {
    "summaries": [f"{run_dir(e, s)}/summary.json" for e, s in SCIENCE_RUNS],
    "metrics": [f"{run_dir(e, s)}/metrics.jsonl" for e, s in SCIENCE_RUNS],
    "experiments": [settings_file(e) for e in SCIENCE_EXPERIMENTS],
    "tables": [SCIENCE_METRICS.format(exp=e) for e in SCIENCE_EXPERIMENTS],
    "code": code(
        "tables/__init__", "tables/science", "science/formats", "science/evaluate"
    ),
}


rule science_splits:
    input:
        settings=settings_file("{exp}"),
        source=lambda w: repo_path(EXPERIMENTS[w.exp]["data"]["path"]),
    output:
        manifest=f"{RESULTS}/{{exp}}/splits/manifest.json",
        parts=[
            f"{RESULTS}/{{exp}}/splits/{part}.csv"
            for part in ("train", "validation", "test")
        ],
    log:
        f"{RESULTS}/{{exp}}/logs/splits.log",
    conda:
        ENV
    params:
        out=lambda w: f"{RESULTS}/{w.exp}/splits",
        base=workflow.basedir,
    shell:
        "python -m shardlab.core.splits --config {input.settings} --out {params.out} --base-dir {params.base:q}"
        " > {log} 2>&1"


rule science_evaluate:
    input:
        settings=settings_file("{exp}"),
        splits=f"{RESULTS}/{{exp}}/splits/manifest.json",
        summaries=lambda w: run_files(w.exp, "summary.json"),
        code=code(
            "science/evaluate",
            "science/domains",
            "science/measures",
            "science/language_model",
        ),
    output:
        SCIENCE_METRICS,
    log:
        f"{RESULTS}/{{exp}}/logs/science_evaluate.log",
    wildcard_constraints:
        exp="|".join(SCIENCE_EXPERIMENTS) or "(?!)",
    conda:
        ENV
    threads: 1  # the evaluator pins torch to one thread (tiny forwards)
    params:
        runs=lambda w: f"{RESULTS}/{w.exp}/runs",
        splits=lambda w: f"{RESULTS}/{w.exp}/splits",
    shell:
        "python -m shardlab.science.evaluate --experiment-config {input.settings} --runs {params.runs}"
        " --splits {params.splits} --out {output} > {log} 2>&1"


rule science_tables:
    input:
        **SCIENCE_INPUTS,
    output:
        SCIENCE_TABLES,
    log:
        f"{RESULTS}/logs/science_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables science --out-dir {params.out} {params.args} > {log} 2>&1"


if SCIENCE_EXPERIMENTS:
    REPORT_INPUTS.extend(SCIENCE_TABLES)
