# Tensor/sequence parallelism (issue 4): activation memory by component vs the Korthikanti formulas,
# and the TP inference benchmark (greedy generation with KV cache, single device vs hand-written tp) on
# the model of the first experiment that has a TP run.

TP_STRATEGIES = ("single", "tp", "tp_sp", "tp_dtensor", "tp_sp_dtensor")
TP_EXPERIMENTS = sorted({exp for exp, s in RUNS if s in TP_STRATEGIES[1:]})
TP_TABLES = [
    f"{RESULTS}/tables/{name}.csv"
    for name in ("tp_activation_components", "tp_inference")
]


rule tp_activation_components:
    input:
        summaries=[
            f"{run_dir(exp, s)}/summary.json"
            for exp, s in RUNS
            if exp in TP_EXPERIMENTS and s in TP_STRATEGIES
        ],
        settings=[f"{RESULTS}/{exp}/experiment.json" for exp in TP_EXPERIMENTS],
        models=[
            f"{model_dir(EXPERIMENTS[exp]['model']['name'])}/shardlab_model.json"
            for exp in TP_EXPERIMENTS
        ],
        code=["src/shardlab/tables/tensor_parallel.py", "src/shardlab/costs/activations.py"],
    output:
        f"{RESULTS}/tables/tp_activation_components.csv",
    log:
        f"{RESULTS}/logs/tp_activation_components.log",
    conda:
        ENV
    params:
        # resources/models/<name>/shardlab_model.json -> resources/models
        models_dir=lambda w, input: os.path.dirname(os.path.dirname(input.models[0])),
    shell:
        "python -m shardlab.tables.tensor_parallel --models-dir {params.models_dir} --out {output} {input.summaries} > {log} 2>&1"


rule tp_inference:
    input:
        settings=[f"{RESULTS}/{exp}/experiment.json" for exp in TP_EXPERIMENTS[:1]],
        model=[
            f"{model_dir(EXPERIMENTS[exp]['model']['name'])}/shardlab_model.json"
            for exp in TP_EXPERIMENTS[:1]
        ],
        code=[
            "src/shardlab/bench/inference.py",
            "src/shardlab/strategies/tensor_parallel/tensor_parallel.py",
        ],
    output:
        f"{RESULTS}/tables/tp_inference.csv",
    log:
        f"{RESULTS}/logs/tp_inference.log",
    conda:
        ENV
    # All cores: the timing must not share the CPU with a training run.
    threads: workflow.cores
    params:
        model_dir=lambda w, input: os.path.dirname(input.model[0]),
    shell:
        "python -m shardlab.bench.inference --experiment-config {input.settings[0]} --model-dir {params.model_dir}"
        " --out {output} > {log} 2>&1"


if TP_EXPERIMENTS:
    REPORT_INPUTS.extend(TP_TABLES)
