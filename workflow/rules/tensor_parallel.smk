# Tensor/sequence parallelism: activation memory by component vs the Korthikanti formulas,
# throughput against the production twins, memory per rank by category beside the runs of other
# experiments with the same model and training settings (logic: shardlab.tables.tensor_parallel),
# and the TP inference benchmark (greedy generation with KV cache, single device vs the registry's
# hand-written TP strategy; shardlab.bench.inference) on the model of the first experiment that has
# a TP run.

TP_TABLES = table_files(
    "tp_activation_components",
    "tp_activation_totals",
    "tp_throughput",
    "tp_twins",
    "tp_memory_categories",
    "tp_recompute",
)
TP_INFERENCE = table_files("tp_inference")
TP_EXPERIMENTS = STUDY.experiments_of("tensor_parallel")
TP_INPUTS = topic_inputs("tensor_parallel", metrics=True)  # step logs: intervals of the throughput ratios
TP_BENCH_LAUNCH = EXPERIMENTS[TP_EXPERIMENTS[0]]["launch"] if TP_EXPERIMENTS else None
# Every experiment's settings: the memory comparison looks for the ones with the TP experiment's
# model and training settings.
TP_INPUTS["experiments"] = [settings_file(exp) for exp in EXPERIMENTS]


rule tensor_parallel_tables:
    input:
        **TP_INPUTS,
        tables=table_files("ranks"),
    output:
        TP_TABLES,
    log:
        f"{RESULTS}/logs/tensor_parallel_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables tensor_parallel --out-dir {params.out} {params.args} > {log} 2>&1"


rule tp_inference:
    input:
        settings=[settings_file(exp) for exp in TP_EXPERIMENTS[:1]],
        model=[model_record(exp) for exp in TP_EXPERIMENTS[:1]],
        code=sources_of("bench.inference"),
    output:
        TP_INFERENCE,
    log:
        f"{RESULTS}/logs/tp_inference.log",
    priority: MANY_CORES
    conda:
        ENV
    # Locally all cores: the timing must not share the CPU with a training run.
    threads: lambda w: job_threads(launch_threads(TP_BENCH_LAUNCH, TP_BENCH_LAUNCH["world_size"]))
    resources:
        gpu=lambda w: bench_gpus(TP_BENCH_LAUNCH, TP_BENCH_LAUNCH["world_size"]),
        tasks_per_gpu=0,
    params:
        model_dir=lambda w, input: os.path.dirname(input.model[0]),
    shell:
        "python -m shardlab bench-inference --experiment-config {input.settings[0]} --model-dir {params.model_dir}"
        " --out {output} > {log} 2>&1"


if TP_EXPERIMENTS:
    REPORT_INPUTS.extend(TP_TABLES + TP_INFERENCE)
