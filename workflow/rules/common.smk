# Config validation (before any job) and the names every rule file shares.
import glob
import json
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from shardlab.config import ConfigError, check_experiment, resolve_experiment, shared_references

validate(config, "../schemas/config.schema.yaml")

RESULTS = config["results_dir"]
RESOURCES = config["resources_dir"]
ENV = "../envs/shardlab.yaml"


def _resolve_all(config):
    experiments = {}
    for name in config["experiments"]:
        try:
            exp = resolve_experiment(config, name)
            check_experiment(exp, base_dir=workflow.basedir)
        except ConfigError as err:
            raise WorkflowError(f"invalid configuration: {err}")
        experiments[name] = exp
    return experiments


EXPERIMENTS = _resolve_all(config)
RUNS = [
    (exp, strategy) for exp, e in EXPERIMENTS.items() for strategy in e["strategies"]
]


def _unique_by_name(section):
    """Models and corpora are shared by name across experiments; one name, one definition."""
    by_name = {}
    for exp in EXPERIMENTS.values():
        spec = exp[section]
        key = spec["name"] if section == "model" else spec["corpus"]
        if by_name.setdefault(key, spec) != spec:
            raise WorkflowError(
                f"invalid configuration: {section} '{key}' is defined differently in two experiments "
                f"(experiments.{exp['name']}.{section}); give the variant its own name"
            )
    return by_name


MODELS = _unique_by_name("model")
CORPORA = {exp["data"]["corpus"]: exp["data"] for exp in EXPERIMENTS.values()}
_unique_by_name("data")


SHARED_REFERENCE = shared_references(EXPERIMENTS)


def model_dir(model):
    return f"{RESOURCES}/models/{model}"


def tokens_path(exp):
    e = EXPERIMENTS[exp]
    return f"{RESOURCES}/data/{e['model']['name']}/{e['data']['corpus']}/tokens.npy"


def run_dir(exp, strategy):
    return f"{RESULTS}/{exp}/runs/{strategy}"


def run_files(exp, name):
    """One file (e.g. summary.json) of every run of an experiment."""
    return [f"{run_dir(exp, s)}/{name}" for s in EXPERIMENTS[exp]["strategies"]]


# Tables the report reads; rule files of other topics extend this list.
REPORT_INPUTS = []


wildcard_constraints:
    exp="[A-Za-z0-9_-]+",
    strategy="[a-z0-9_]+",
    model="[A-Za-z0-9_.-]+",
    corpus="[A-Za-z0-9_.-]+",
