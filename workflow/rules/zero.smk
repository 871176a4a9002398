# The ZeRO ladder (issue 3): measured vs predicted model-state memory, the decision tree's check
# against the runs' outcomes, and the tree itself as a table. Logic: shardlab.tables.zero.
from shardlab.costs.memory import RUNGS as ZERO_RUNGS

ZERO_EXPERIMENTS = [
    n for n, e in EXPERIMENTS.items() if set(e["strategies"]) & set(ZERO_RUNGS)
]
ZERO_TABLES = [
    f"{RESULTS}/tables/{name}.csv"
    for name in ("zero_memory", "zero_tree_check", "zero_plan")
]


rule zero_tables:
    input:
        settings=[f"{RESULTS}/{exp}/experiment.json" for exp in ZERO_EXPERIMENTS],
        summaries=[
            f"{run_dir(exp, s)}/summary.json"
            for exp in ZERO_EXPERIMENTS
            for s in EXPERIMENTS[exp]["strategies"]
        ],
        code=[
            f"src/shardlab/{m}.py"
            for m in ("tables/zero", "costs/zero_tree", "costs/memory")
        ],
    output:
        ZERO_TABLES,
    log:
        f"{RESULTS}/logs/zero_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
    shell:
        "python -m shardlab.tables.zero --experiment-configs {input.settings} --out-dir {params.out} > {log} 2>&1"


if ZERO_EXPERIMENTS:
    REPORT_INPUTS.extend(ZERO_TABLES)
