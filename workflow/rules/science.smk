# Science cases (issue 6): deterministic data splits, domain evaluation of each run's saved model
# (training.save_model), and the tables of the report's science section. Logic: shardlab.science.
from shardlab.science.formats import FORMATS as SCIENCE_FORMATS

SCIENCE_EXPERIMENTS = [
    n for n, e in EXPERIMENTS.items() if e["data"]["format"] in SCIENCE_FORMATS
]
SCIENCE_TABLES = [
    f"{RESULTS}/tables/science_{name}.csv" for name in ("runs", "curves", "metrics")
]


rule science_splits:
    input:
        settings=f"{RESULTS}/{{exp}}/experiment.json",
        source=lambda w: EXPERIMENTS[w.exp]["data"]["path"],
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
    shell:
        "python -m shardlab.core.splits --config {input.settings} --out {params.out} > {log} 2>&1"


rule science_evaluate:
    input:
        settings=f"{RESULTS}/{{exp}}/experiment.json",
        splits=f"{RESULTS}/{{exp}}/splits/manifest.json",
        summaries=lambda w: run_files(w.exp, "summary.json"),
    output:
        f"{RESULTS}/{{exp}}/science_metrics.csv",
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
        settings=[f"{RESULTS}/{exp}/experiment.json" for exp in SCIENCE_EXPERIMENTS],
        metrics=[f"{RESULTS}/{exp}/science_metrics.csv" for exp in SCIENCE_EXPERIMENTS],
        steps=[
            f for exp in SCIENCE_EXPERIMENTS for f in run_files(exp, "metrics.jsonl")
        ],
    output:
        SCIENCE_TABLES,
    log:
        f"{RESULTS}/logs/science_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        # results/<exp>/experiment.json -> results
        results=lambda w, input: os.path.dirname(os.path.dirname(input.settings[0])),
    shell:
        "python -m shardlab.tables.science --results {params.results} --out-dir {params.out}"
        " --experiments {input.settings} --metrics {input.metrics} > {log} 2>&1"


if SCIENCE_EXPERIMENTS:
    REPORT_INPUTS.extend(SCIENCE_TABLES)
