# Context and expert parallelism: activation memory vs sequence length (and vs the reference), the
# load per expert, and the MoE runs beside the dense runs with the same settings.
# Logic: shardlab.tables.context_expert.

CONTEXT_EXPERT_TABLES = table_files(
    "cp_memory",
    "cp_activation",
    "cp_activation_ratio",
    "expert_load",
    "expert_load_shares",
    "moe_dense",
)


# The topic's runs, plus every experiment's settings: the builder looks among them for the
# experiments whose model, data and training match a MoE experiment (its dense comparison).
CONTEXT_EXPERT_INPUTS = topic_inputs("context_expert") | {"experiments": [settings_file(e) for e in EXPERIMENTS]}


rule context_expert_tables:
    input:
        **CONTEXT_EXPERT_INPUTS,
        tables=table_files("runs", "ranks", "rank_predictions"),
    output:
        CONTEXT_EXPERT_TABLES,
    log:
        f"{RESULTS}/logs/context_expert_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables context_expert --out-dir {params.out} {params.args} > {log} 2>&1"


if STUDY.experiments_of("context_expert"):
    REPORT_INPUTS.extend(CONTEXT_EXPERT_TABLES)
