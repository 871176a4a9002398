# The ZeRO ladder: measured vs predicted model-state memory, the decision tree's check against the
# runs' outcomes, and the tree itself as a table. Logic: shardlab.tables.zero.

ZERO_TABLES = table_files("zero_memory", "zero_tree_check", "zero_plan", "zero_rungs", "zero_verdicts")


rule zero_tables:
    input:
        **topic_inputs("zero"),
        tables=table_files("rank_predictions"),
    output:
        ZERO_TABLES,
    log:
        f"{RESULTS}/logs/zero_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables zero --out-dir {params.out} {params.args} > {log} 2>&1"


if STUDY.experiments_of("zero"):
    REPORT_INPUTS.extend(ZERO_TABLES)
