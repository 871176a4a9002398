# Config validation (before any job) and the names every rule file shares.
import glob
import json
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from shardlab.errors import ConfigError
from shardlab.provenance import page_sources, sources
from shardlab.strategies import SINGLE, launch_threads
from shardlab.study import load_study, prepared_inputs, run_resources, run_sources

validate(config, "../schemas/config.schema.yaml")

RESULTS = config["results_dir"]
RESOURCES = config["resources_dir"]
ENV = "../envs/shardlab.yaml"

# The one check path (also `python -m shardlab check-config`): schema, settings, registry, formats.
try:
    STUDY = load_study(config, base_dir=workflow.basedir)
except ConfigError as err:
    raise WorkflowError(f"invalid configuration: {err}")
EXPERIMENTS = STUDY.experiments
RUNS = STUDY.runs
MODELS = STUDY.by_name("model")
CORPORA = STUDY.by_name("data")
SHARED_REFERENCE = STUDY.shared_references


def model_dir(model):
    return f"{RESOURCES}/models/{model}"


def model_record(exp):
    """The prepared model's record (settings + architecture): resources/models/<name>/shardlab_model.json."""
    return f"{model_dir(EXPERIMENTS[exp]['model']['name'])}/shardlab_model.json"


def tokens_path(exp):
    return str(prepared_inputs(config, EXPERIMENTS[exp])[1])


def run_dir(exp, strategy):
    return f"{RESULTS}/{exp}/runs/{strategy}"


def settings_file(exp):
    return f"{RESULTS}/{exp}/experiment.json"


def run_files(exp, name):
    """One file (e.g. summary.json) of every run of an experiment."""
    return [f"{run_dir(exp, s)}/{name}" for s in EXPERIMENTS[exp]["strategies"]]


def table_files(*names):
    return [f"{RESULTS}/tables/{name}.csv" for name in names]


# The run-to-run noise of throughput ratios measured on this machine (scripts/timing-noise.py; not a
# DAG output): the tables that widen throughput intervals by it read it.
TIMING_NOISE = (
    [os.path.join(workflow.basedir, config["report"]["timing_noise"])] if config["report"]["timing_noise"] else []
)


# The GPU checks kept in the repository (scripts/gpu-summary.py's <date>-<device>.json; the predictions
# table shows the newest, shardlab.tables.gpu_check.table); none yet: [].
GPU_MEASUREMENTS = sorted(glob.glob(os.path.join(workflow.basedir, config["report"]["gpu_measurements"], "*.json")))


SRC = f"{workflow.basedir}/src/shardlab"  # absolute: inputs hold under --directory too


def repo_path(path):
    """A path from the config (e.g. data.path), relative to the repository, as the config check reads it."""
    return os.path.join(workflow.basedir, path)


def sources_of(module):
    """The files a shardlab module (e.g. 'tables.verdicts') executes: itself and everything it imports."""
    return [str(p) for p in sources(f"shardlab.{module}")]


def report_sources():
    """The files the report executes: the renderer, and every shardlab module its pages import (with theirs)."""
    pages = [f"{workflow.basedir}/reports/report.qmd", *glob.glob(f"{workflow.basedir}/reports/sections/*.qmd")]
    return sorted(set(sources_of("reporting.render")) | {str(p) for p in page_sources(pages)})


def job_threads(threads_used):
    """Threads a measuring job (a run, a benchmark) asks for. Locally every core, so these jobs never
    overlap and none's timings are polluted by another's; under a cluster executor what the job
    itself uses, never the submit host's core count (which is not even defined there).
    """
    if not workflow.local_exec:
        return threads_used
    try:
        return workflow.cores
    except WorkflowError:  # no --cores (e.g. --summary): nothing is scheduled
        return threads_used


# Jobs that take every core (runs, benchmarks, pretraining: job_threads) or two (the planner's searches)
# go first whenever one is ready: they would otherwise alternate with one-thread jobs (tables, evaluations),
# which then run alone beside an idle core; deferred, those gather and run side by side once the measurements
# are done, the longest of them (the science evaluations) first.
MANY_CORES, LONG_ONE_CORE = 2, 1
# Before them, the one-thread jobs that every run waits for (a model on disk, its tokens): two at a time
# they take ~10 s where, queued behind the first measurements, they held the first run back ~35 s.
UNBLOCKS_RUNS = 3


def run_threads(exp, strategy):
    return job_threads(run_resources(EXPERIMENTS[exp], strategy)["threads"])


def paired_threads(exp):
    """Threads of an experiment's paired timing: one launch on its world size, like a run."""
    launch = EXPERIMENTS[exp]["launch"]
    return job_threads(launch_threads(launch, launch["world_size"]))


# Executors that can give one job several nodes (the launcher starts one torchrun agent per node with
# srun). The local executor runs a multi-node experiment's ranks on this machine (torchrun --standalone);
# the Kubernetes executor runs one pod per job, so it cannot.
MULTI_NODE_EXECUTORS = ("slurm", "slurm-jobstep", "local", "dryrun", "touch")


def executor_name():
    plugin = workflow.executor_plugin
    return plugin.cli_prefix if plugin is not None else "local"


def run_job_resources(exp, strategy):
    """What a run job asks its executor for, derived from the experiment's launch settings
    (shardlab.study.run_resources, the layout of shardlab.config.run_layout), never written per rule.
    One node: `gpu` GPUs (locally a limit for --resources gpu=N; Slurm --gpus, Kubernetes
    nvidia.com/gpu). Several nodes (Slurm): --nodes, one task per node that the launcher starts with
    srun (mpi), GPUs per node as gres. tasks_per_gpu=0: a gpu resource would otherwise turn tasks into
    --ntasks-per-gpu. None leaves a resource unset (the cluster's default)."""
    r = run_resources(EXPERIMENTS[exp], strategy)
    several = r["nodes"] > 1
    if several and executor_name() not in MULTI_NODE_EXECUTORS:
        raise WorkflowError(
            f"experiments.{exp}: '{strategy}' runs on {r['nodes']} nodes, but the {executor_name()} executor "
            f"starts each job on one machine (multi-node runs need: {', '.join(MULTI_NODE_EXECUTORS)}; "
            "locally set launch.nodes: 1)"
        )
    return {
        "nodes": r["nodes"],
        "tasks": r["nodes"] if several else 1,
        "mpi": "srun" if several else None,
        "gpu": r["gpus"] if r["gpus"] and not several else None,
        "gres": f"gpu:{r['gpus_per_node']}" if r["gpus"] and several else None,
        "tasks_per_gpu": 0,
        "mem_mb": r["mem_mb"],
    }


def bench_gpus(settings, world):
    """GPUs a benchmark job (comm_bench, tp_inference) asks for: one per rank on CUDA with a fixed world
    size ('auto' takes the GPUs of the machine it lands on, so asks for none, like a run)."""
    return world if settings.get("device") == "cuda" and world != "auto" else None


def run_job_resource(name):
    return lambda w: run_job_resources(w.exp, w.strategy)[name]


def topic_inputs(topic, metrics=False):
    """The inputs of a topic's tables, i.e. its runs (and their references) from the registry, those
    experiments' settings and model records, and the table code."""
    runs = STUDY.runs_of(topic)
    experiments = STUDY.experiments_of(topic)
    inputs = {
        "summaries": [f"{run_dir(e, s)}/summary.json" for e, s in runs],
        "experiments": [settings_file(e) for e in experiments],
        "models": sorted({model_record(e) for e in experiments}),
        "code": sources_of(f"tables.{topic}"),
    }
    if metrics:
        inputs["metrics"] = [f"{run_dir(e, s)}/metrics.jsonl" for e, s in runs]
    return inputs


def table_args(input):
    """The `shardlab tables` arguments for a rule's declared inputs."""
    return " ".join(
        f"--{kind} " + " ".join(input[kind])
        for kind in ("summaries", "metrics", "experiments", "models", "tables", "records")
        if kind in input.keys() and len(input[kind])
    )


# Tables the report reads; rule files of other topics extend this list.
REPORT_INPUTS = []


def made_by_study(*names):
    """The named tables this study makes (planning's only with scenarios): a summary reads what exists."""
    return [path for path in table_files(*names) if path in REPORT_INPUTS]
