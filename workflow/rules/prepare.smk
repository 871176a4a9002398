# Stage 1-2: get each model onto disk, tokenize each corpus for it.


rule prepare_model:
    output:
        f"{RESOURCES}/models/{{model}}/shardlab_model.json",
    log:
        f"{RESOURCES}/logs/model_{{model}}.log",
    priority: UNBLOCKS_RUNS
    conda:
        ENV
    params:
        spec=lambda w: json.dumps(MODELS[w.model], sort_keys=True),
        out=lambda w: model_dir(w.model),
    shell:
        "python -m shardlab prepare-model --model-json {params.spec:q} --out {params.out} > {log} 2>&1"


rule prepare_data:
    input:
        flag=f"{RESOURCES}/models/{{model}}/shardlab_model.json",
        source=lambda w: repo_path(CORPORA[w.corpus]["path"]),
    output:
        f"{RESOURCES}/data/{{model}}/{{corpus}}/tokens.npy",
    log:
        f"{RESOURCES}/logs/data_{{model}}_{{corpus}}.log",
    priority: UNBLOCKS_RUNS
    conda:
        ENV
    params:
        data=lambda w: json.dumps(CORPORA[w.corpus], sort_keys=True),
        model=lambda w: json.dumps(MODELS[w.model], sort_keys=True),
        model_dir=lambda w: model_dir(w.model),
        out=lambda w: f"{RESOURCES}/data/{w.model}/{w.corpus}",
        base=workflow.basedir,
    shell:
        "python -m shardlab prepare-data --data-json {params.data:q} --model-json {params.model:q}"
        " --model-dir {params.model_dir} --out {params.out} --base-dir {params.base:q} > {log} 2>&1"
