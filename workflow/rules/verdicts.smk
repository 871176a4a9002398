# The study's claims, each with its verdict computed from the other tables (the report's executive
# summary). Logic: shardlab.tables.verdicts.

VERDICT_TABLES = table_files("verdicts", "strategy_choice", "run_to_run_noise")
# The tables the claims are judged on; a topic the study does not run leaves its claims undecided.
VERDICT_EVIDENCE = table_files("runs", "steps", "ranks", "parity")
if STUDY.experiments_of("zero"):
    VERDICT_EVIDENCE += table_files("zero_memory")
if STUDY.experiments_of("tensor_parallel"):
    VERDICT_EVIDENCE += table_files("tp_memory_categories")
VERDICT_EVIDENCE += TIMING_NOISE + list(PAIRED_TIMING.values())


rule verdicts_tables:
    input:
        tables=VERDICT_EVIDENCE,
        code=sources_of("tables.verdicts"),
    output:
        VERDICT_TABLES,
    log:
        f"{RESULTS}/logs/verdicts_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables verdicts --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(VERDICT_TABLES)
