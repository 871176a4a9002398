# Context- and expert-parallel tables: activation memory vs sequence length, per-expert load.
# Reads every run of the experiments that contain cp_ring, moe_single or ep_moe.

CONTEXT_EXPERT_STRATEGIES = ("cp_ring", "moe_single", "ep_moe")
CONTEXT_EXPERT_EXPERIMENTS = sorted(
    {exp for exp, s in RUNS if s in CONTEXT_EXPERT_STRATEGIES}
)
CONTEXT_EXPERT_TABLES = [
    f"{RESULTS}/tables/{name}.csv" for name in ("cp_memory", "expert_load")
]


rule context_expert_tables:
    input:
        summaries=[
            f"{run_dir(exp, s)}/summary.json"
            for exp, s in RUNS
            if exp in CONTEXT_EXPERT_EXPERIMENTS
        ],
        settings=[
            f"{RESULTS}/{exp}/experiment.json" for exp in CONTEXT_EXPERT_EXPERIMENTS
        ],
        code="src/shardlab/tables/context_expert.py",
    output:
        CONTEXT_EXPERT_TABLES,
    log:
        f"{RESULTS}/logs/context_expert_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
    shell:
        "python -m shardlab.tables.context_expert --out-dir {params.out} {input.summaries} > {log} 2>&1"


if CONTEXT_EXPERT_EXPERIMENTS:
    REPORT_INPUTS.extend(CONTEXT_EXPERT_TABLES)
