# The report's abstract, each sentence computed from a table (what ran, parity and its sensitivity, memory
# against the cost model, the planner on published runs, the science outcome, the verdicts, what carries
# over to GPUs). Logic: shardlab.tables.abstract.

ABSTRACT_TABLES = table_files("abstract")


rule abstract_tables:
    input:
        tables=lambda w: made_by_study(
            "runs",
            "parity",
            "verdicts",
            "parity_caught",
            "run_prediction_summary",
            "planning_published",
            "science_outcomes",
        ),
        code=sources_of("tables.abstract"),
    output:
        ABSTRACT_TABLES,
    log:
        f"{RESULTS}/logs/abstract_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables abstract --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(ABSTRACT_TABLES)
