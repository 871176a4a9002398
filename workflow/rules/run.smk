# Stage 3: one torchrun job per (experiment, strategy). A failed or OOM run still produces its
# summary.json (status + reason), so the DAG goes on. Every attempt is also kept under
# results/<exp>/attempts/, which Snakemake never deletes.


rule experiment_settings:
    output:
        f"{RESULTS}/{{exp}}/experiment.json",
    log:
        f"{RESULTS}/{{exp}}/logs/experiment.log",
    conda:
        ENV
    params:
        # A change to an experiment's settings changes this param and reruns only that experiment.
        settings=lambda w: json.dumps(EXPERIMENTS[w.exp], sort_keys=True),
    # The standard library's JSON tool: a shardlab start (~1 s of imports) for each of 20 files held the
    # first runs back.
    shell:
        "printf %s {params.settings:q} | python -m json.tool --sort-keys > {output} 2> {log}"


rule run_strategy:
    input:
        settings=lambda w: settings_file(w.exp),
        model=lambda w: model_record(w.exp),
        tokens=lambda w: tokens_path(w.exp),
        code=lambda w: run_sources(w.strategy),
    output:
        summary=f"{RESULTS}/{{exp}}/runs/{{strategy}}/summary.json",
        metrics=f"{RESULTS}/{{exp}}/runs/{{strategy}}/metrics.jsonl",
    log:
        f"{RESULTS}/{{exp}}/logs/{{strategy}}.log",
    priority: MANY_CORES
    conda:
        ENV
    # Locally all cores: runs never overlap, so no run's timings are polluted by another's.
    threads: lambda w: run_threads(w.exp, w.strategy)
    resources:
        nodes=run_job_resource("nodes"),
        tasks=run_job_resource("tasks"),
        mpi=run_job_resource("mpi"),
        gpu=run_job_resource("gpu"),
        gres=run_job_resource("gres"),
        tasks_per_gpu=run_job_resource("tasks_per_gpu"),
        mem_mb=run_job_resource("mem_mb"),
    params:
        model_dir=lambda w: model_dir(EXPERIMENTS[w.exp]["model"]["name"]),
        out=lambda w: run_dir(w.exp, w.strategy),
    # tee -i: a Ctrl-C reaches tee too, and the launcher's record of the interrupt must still be logged.
    shell:
        "python -m shardlab launch --experiment-config {input.settings} --strategy {wildcards.strategy}"
        " --model-dir {params.model_dir} --tokens {input.tokens} --out {params.out} 2>&1 | tee -i {log}"


# The same deterministic single-device run is not repeated for experiments with identical settings.
ruleorder: share_reference > run_strategy


rule share_reference:
    input:
        summary=lambda w: f"{run_dir(SHARED_REFERENCE[w.exp], SINGLE.name)}/summary.json",
        metrics=lambda w: f"{run_dir(SHARED_REFERENCE[w.exp], SINGLE.name)}/metrics.jsonl",
        settings=lambda w: settings_file(w.exp),  # the borrowing experiment's own settings
    output:
        summary=f"{RESULTS}/{{exp}}/runs/{SINGLE.name}/summary.json",
        metrics=f"{RESULTS}/{{exp}}/runs/{SINGLE.name}/metrics.jsonl",
    log:
        f"{RESULTS}/{{exp}}/logs/{SINGLE.name}.log",
    wildcard_constraints:
        exp="|".join(SHARED_REFERENCE) or "(?!)",
    conda:
        ENV
    params:
        source=lambda w, input: os.path.dirname(input.summary),
        out=lambda w, output: os.path.dirname(output.summary),
    shell:
        "python -m shardlab share-run {params.source} {params.out} {wildcards.exp} > {log} 2>&1"
