# The report's decision guide: per technique what each rank holds, what it moves and where it goes,
# and the planner's plans at scale beside published ones. Logic: shardlab.tables.guide.

GUIDE_TABLES = table_files("guide_techniques", "guide_plans")


rule guide_tables:
    input:
        tables=lambda w: made_by_study(
            "mechanisms",
            "ranks",
            "comm_volume",
            "planning_scenarios",
            "planning_top",
            "planning_published",
        ),
        code=sources_of("tables.guide"),
    output:
        GUIDE_TABLES,
    log:
        f"{RESULTS}/logs/guide_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables guide --out-dir {params.out} {params.args} > {log} 2>&1"


REPORT_INPUTS.extend(GUIDE_TABLES)
