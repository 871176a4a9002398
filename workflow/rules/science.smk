# Science cases: deterministic data splits, domain evaluation of each run's saved model
# (training.save_model), and the tables of the report's science section. Science experiments are
# those whose data format is a science format. Logic: shardlab.core.splits, shardlab.science.evaluate,
# shardlab.tables.science.
SCIENCE_EXPERIMENTS = STUDY.science_experiments
SCIENCE_TABLES = table_files(
    "science_runs",
    "science_curves",
    "science_metrics",
    "science_fine_tuning",
    "science_outcomes",
    "science_published",
    "science_domain_curves",
    "science_tokenizers",
)
PRETRAINED = STUDY.pretrained_models
# Each pretrained model's pretraining run: (its settings, the strategy that runs it).
PRETRAIN_RUNS = {
    m: (STUDY.pretrain_settings(m)["experiment"], STUDY.pretrain_settings(m)["experiment"]["strategies"][0])
    for m in PRETRAINED
}
TOKENIZER_TABLES = [f"{model_dir(m)}/tokenizers.{m}.csv" for m in PRETRAINED]


# An experiment's evaluation, named after it: TableInputs keys tables by file stem.
SCIENCE_METRICS = f"{RESULTS}/{{exp}}/science_metrics.{{exp}}.csv"
SCIENCE_RUNS = [(e, s) for e, s in RUNS if e in SCIENCE_EXPERIMENTS]
# What science_tables reads (cf. topic_inputs): the science experiments' runs with their step logs,
# their settings and evaluations, and the table code.
SCIENCE_INPUTS = {
    "summaries": [f"{run_dir(e, s)}/summary.json" for e, s in SCIENCE_RUNS],
    "metrics": [f"{run_dir(e, s)}/metrics.jsonl" for e, s in SCIENCE_RUNS],
    "experiments": [settings_file(e) for e in SCIENCE_EXPERIMENTS],
    "tables": [SCIENCE_METRICS.format(exp=e) for e in SCIENCE_EXPERIMENTS] + TOKENIZER_TABLES,
    "code": sources_of("tables.science") + [f"{SRC}/science/published.yaml"],
}


# The science base model (model.source: pretrain): pretrained once on the union of the science
# experiments' training parts, by the study's runner, then fine-tuned by every science run like a
# hub checkpoint: its corpus (tokenizer measured and fitted, tokens, initial model) in a one-thread job,
# then its training run. Logic: shardlab.pretrain, shardlab.science.tokenization.
ruleorder: pretrain > prepare_model


rule pretrain_corpus:
    input:
        sources=lambda w: [repo_path(c["path"]) for c in STUDY.pretrain_settings(w.model)["corpora"]],
        code=lambda w: sources_of("pretrain"),
    output:
        corpus=f"{RESOURCES}/models/{{model}}/pretraining/corpus/corpus.json",
        tokenizers=f"{RESOURCES}/models/{{model}}/tokenizers.{{model}}.csv",
    log:
        f"{RESOURCES}/logs/pretrain_corpus_{{model}}.log",
    wildcard_constraints:
        model="|".join(PRETRAINED) or "(?!)",
    conda:
        ENV
    params:
        settings=lambda w: json.dumps(STUDY.pretrain_settings(w.model), sort_keys=True),
        out=lambda w: model_dir(w.model),
        base=workflow.basedir,
    shell:
        "python -m shardlab pretrain --step corpus --settings {params.settings:q} --out {params.out}"
        " --base-dir {params.base:q} > {log} 2>&1"


rule pretrain:
    input:
        corpus=rules.pretrain_corpus.output.corpus,
        code=lambda w: sources_of("pretrain") + run_sources(PRETRAIN_RUNS[w.model][1]),
    output:
        record=f"{RESOURCES}/models/{{model}}/shardlab_model.json",
    log:
        f"{RESOURCES}/logs/pretrain_{{model}}.log",
    wildcard_constraints:
        model="|".join(PRETRAINED) or "(?!)",
    priority: MANY_CORES
    conda:
        ENV
    # Locally all cores, like a run: the pretraining is a training run of the study's runner.
    threads: lambda w: job_threads(run_resources(*PRETRAIN_RUNS[w.model])["threads"])
    params:
        settings=lambda w: json.dumps(STUDY.pretrain_settings(w.model), sort_keys=True),
        out=lambda w: model_dir(w.model),
    shell:
        "python -m shardlab pretrain --step train --settings {params.settings:q} --out {params.out} > {log} 2>&1"


rule science_splits:
    input:
        settings=settings_file("{exp}"),
        source=lambda w: repo_path(EXPERIMENTS[w.exp]["data"]["path"]),
    output:
        manifest=f"{RESULTS}/{{exp}}/splits/manifest.json",
        parts=[f"{RESULTS}/{{exp}}/splits/{part}.csv" for part in ("train", "validation", "test")],
    log:
        f"{RESULTS}/{{exp}}/logs/splits.log",
    conda:
        ENV
    params:
        out=lambda w: f"{RESULTS}/{w.exp}/splits",
        base=workflow.basedir,
    shell:
        "python -m shardlab save-splits --config {input.settings} --out {params.out} --base-dir {params.base:q}"
        " > {log} 2>&1"


rule science_evaluate:
    input:
        settings=settings_file("{exp}"),
        splits=f"{RESULTS}/{{exp}}/splits/manifest.json",
        summaries=lambda w: run_files(w.exp, "summary.json"),
        base_model=lambda w: model_record(w.exp),  # step 0 of every curve: the model before fine-tuning
        code=sources_of("science.evaluate"),
    output:
        SCIENCE_METRICS,
    log:
        f"{RESULTS}/{{exp}}/logs/science_evaluate.log",
    wildcard_constraints:
        exp="|".join(SCIENCE_EXPERIMENTS) or "(?!)",
    priority: LONG_ONE_CORE
    conda:
        ENV
    # One torch thread (tiny forwards): the three evaluations run side by side with each other and the tables
    # once the runs are done, which on 2 cores beat one evaluation at a time over 2 processes.
    threads: 1
    params:
        runs=lambda w: f"{RESULTS}/{w.exp}/runs",
        splits=lambda w: f"{RESULTS}/{w.exp}/splits",
        base_model=lambda w: model_dir(EXPERIMENTS[w.exp]["model"]["name"]),
    shell:
        "python -m shardlab evaluate-science --experiment-config {input.settings} --runs {params.runs}"
        " --splits {params.splits} --base-model {params.base_model} --workers {threads} --out {output} > {log} 2>&1"


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
