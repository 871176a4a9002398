# Stage 4: every run's summary and step log -> the tidy tables of the report's main sections
# (runs, steps, ranks, activations, parity) and the cost model's prediction for every rank of every
# run (rank_predictions: the one the other topics read). Logic: shardlab.tables.runs.

# How small an error the parity check catches (config parity_sensitivity; absent: not measured): one
# torchrun job training the injected-error cases of shardlab.bench.parity_sensitivity.
from shardlab.bench.parity_sensitivity import strategies as sensitivity_strategies

SENSITIVITY = config.get("parity_sensitivity")
SENSITIVITY_LOSSES = [f"{RESULTS}/parity_sensitivity/parity_sensitivity_losses.csv"] if SENSITIVITY else []
# A checkpoint resumed under other plans (config resharding; absent: not run): one job of several launches,
# shardlab.bench.resharding.
RESHARDING = config.get("resharding")
RESHARDING_LOSSES = [f"{RESULTS}/resharding/resharding_losses.csv"] if RESHARDING else []

RUNS_TABLES = table_files(
    "runs",
    "steps",
    "ranks",
    "activations",
    "rank_predictions",
    "parity",
    "parity_rule",
    "environments",
    "launch_cost",
    "experiments",
    "strategies",
    "mechanisms",
    *(["parity_sensitivity", "parity_caught"] if SENSITIVITY else []),
    *(["resharding"] if RESHARDING else []),
)


rule runs_tables:
    input:
        summaries=[f"{run_dir(exp, s)}/summary.json" for exp, s in RUNS],
        metrics=[f"{run_dir(exp, s)}/metrics.jsonl" for exp, s in RUNS],
        experiments=[settings_file(exp) for exp in EXPERIMENTS],
        models=sorted({model_record(exp) for exp in EXPERIMENTS}),
        tables=SENSITIVITY_LOSSES + RESHARDING_LOSSES,
        code=sources_of("tables.runs"),
    output:
        RUNS_TABLES,
    log:
        f"{RESULTS}/logs/runs_tables.log",
    conda:
        ENV
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        args=lambda w, input: table_args(input),
    shell:
        "python -m shardlab tables runs --out-dir {params.out} {params.args} > {log} 2>&1"


if SENSITIVITY:

    rule parity_sensitivity:
        input:
            settings=settings_file(SENSITIVITY["experiment"]),
            model=model_record(SENSITIVITY["experiment"]),
            tokens=tokens_path(SENSITIVITY["experiment"]),
            code=sources_of("bench.parity_sensitivity")
            + sorted({f for s in sensitivity_strategies() for f in run_sources(s)}),
        output:
            SENSITIVITY_LOSSES,
        log:
            f"{RESULTS}/logs/parity_sensitivity.log",
        priority: MANY_CORES
        conda:
            ENV
        # Locally all cores, like a run: its 2 ranks train while nothing else shares the CPUs.
        threads: job_threads(launch_threads(EXPERIMENTS[SENSITIVITY["experiment"]]["launch"], 2))
        params:
            model_dir=lambda w, input: os.path.dirname(input.model),
            dtypes=",".join(SENSITIVITY["dtypes"]),
            timeout=SENSITIVITY["timeout_s"],
        shell:
            "python -m shardlab parity-sensitivity --experiment-config {input.settings}"
            " --model-dir {params.model_dir} --tokens {input.tokens} --dtypes {params.dtypes}"
            " --timeout-s {params.timeout} --out {output} > {log} 2>&1"


if RESHARDING:

    rule resharding:
        input:
            settings=settings_file(RESHARDING["experiment"]),
            model=model_record(RESHARDING["experiment"]),
            tokens=tokens_path(RESHARDING["experiment"]),
            code=sources_of("bench.resharding")
            + sorted({f for s in [RESHARDING["plan"], *RESHARDING["resume_under"]] for f in run_sources(s)}),
        output:
            RESHARDING_LOSSES,
        log:
            f"{RESULTS}/logs/resharding.log",
        priority: MANY_CORES
        conda:
            ENV
        # Locally all cores, like a run: its launches train while nothing else shares the CPUs.
        threads: job_threads(launch_threads(EXPERIMENTS[RESHARDING["experiment"]]["launch"], 2))
        params:
            model_dir=lambda w, input: os.path.dirname(input.model),
            settings=json.dumps(RESHARDING),
        shell:
            "python -m shardlab resharding --experiment-config {input.settings} --model-dir {params.model_dir}"
            " --tokens {input.tokens} --settings {params.settings:q} --out {output} > {log} 2>&1"


# Paired timing: an experiment's parallel strategies timed side by side in rotated rounds, in one launch
# (shardlab.bench.paired_timing); the speed claims rest on it (tables.verdicts).
PAIRED_TIMING = {
    exp: f"{RESULTS}/{exp}/paired_timing_{exp}.csv"
    for exp, settings in EXPERIMENTS.items()
    if "paired_timing" in settings
}


rule paired_timing:
    input:
        settings=lambda w: settings_file(w.exp),
        model=lambda w: model_record(w.exp),
        tokens=lambda w: tokens_path(w.exp),
        code=lambda w: sorted(
            {*sources_of("bench.paired_timing")}
            | {f for s in EXPERIMENTS[w.exp]["strategies"] for f in run_sources(s)}
        ),
    output:
        f"{RESULTS}/{{exp}}/paired_timing_{{exp}}.csv",
    log:
        f"{RESULTS}/{{exp}}/logs/paired_timing.log",
    priority: MANY_CORES
    conda:
        ENV
    # Locally all cores, like a run: nothing else shares the CPUs while it times.
    threads: lambda w: paired_threads(w.exp)
    params:
        model_dir=lambda w, input: os.path.dirname(input.model),
    shell:
        "python -m shardlab bench-paired --experiment-config {input.settings}"
        " --model-dir {params.model_dir} --tokens {input.tokens} --out {output} > {log} 2>&1"


REPORT_INPUTS.extend(RUNS_TABLES)
