# The planner at scale: the config's planning scenarios searched by the cost model, the published
# training runs it is held to (calibration and held-out rows, per source and stack), and the
# cross-check against DeepSpeed's and Megatron's one-liners. Nothing runs; the rule reruns when the planning config or the cost model changes.
# Logic: shardlab.tables.planning.

PLANNING_TABLES = table_files(
    "planning_scenarios",
    "planning_top",
    "planning_rejected",
    "planning_what_if",
    "planning_zero_ladder",
    "planning_published",
    "planning_published_by_source",
    "planning_published_by_stack",
    "planning_published_memory",
    "planning_crosscheck",
)


rule planning_tables:
    input:
        code=sources_of("tables.planning"),
        catalogs=[
            f"{SRC}/costs/hardware.yaml",
            f"{SRC}/costs/models.yaml",
            f"{SRC}/costs/published.yaml",
            f"{SRC}/costs/stacks.yaml",
        ],
    output:
        PLANNING_TABLES,
    log:
        f"{RESULTS}/logs/planning_tables.log",
    priority: MANY_CORES
    conda:
        ENV
    threads: 2  # the searches, in as many processes (shardlab.tables.planning.run_searches)
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        # A change to the planning block changes this param and reruns the rule.
        settings=json.dumps({"planning": config["planning"]}, sort_keys=True),
    shell:
        "python -m shardlab tables planning --out-dir {params.out} --settings {params.settings:q} --workers {threads}"
        " > {log} 2>&1"


# Without scenarios the rule and the report section are left out.
if config["planning"]["scenarios"]:
    REPORT_INPUTS.extend(PLANNING_TABLES)
