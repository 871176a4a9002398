"""Bad configuration stops everything before any job runs, with a message naming the field."""

import copy
import json
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, TEST_EXPERIMENT, with_experiments
from shardlab.errors import ConfigError
from shardlab.study import load_study

BASE = yaml.safe_load((REPO / "config" / "test.yaml").read_text())


def mutated(path: str, value):
    """A copy of the test config with `path` (dot-separated) set to `value` (None deletes the key)."""
    cfg = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg


BAD_CONFIGS = [
    ("experiments.data_parallel.strategies", ["single", "warp_drive"], "experiments.data_parallel.strategies[1]", "unknown strategy"),
    ("defaults.launch.world_size", 0, "defaults.launch.world_size", ""),
    ("defaults.training.steps", -5, "defaults.training.steps", "minimum"),
    ("defaults.data.path", "data/missing.csv", "experiments.data_parallel.data.path", "file not found"),
    ("defaults.training.global_batch_size", 7, "experiments.data_parallel.training.global_batch_size", "not divisible"),
    ("defaults.training.micro_batch_size", 3, "experiments.data_parallel.training.micro_batch_size", "does not divide"),
    ("defaults.model.num_heads", 5, "experiments.data_parallel.model.num_heads", "must divide hidden_size"),
    ("defaults.training.seq_len", 4096, "experiments.data_parallel.training.seq_len", "max_position_embeddings"),
    ("defaults.training.optimizer", "adagrad", "defaults.training.optimizer", ""),
    ("defaults.model.source", "hub", "experiments.data_parallel.model.hub_id", "required"),
    ("defaults.data.format", "fasta", "experiments.data_parallel.data.format", "unknown format"),
    ("defaults.training.warmup_steps", 6, "experiments.data_parallel.training.warmup_steps", "smaller than"),
    ("defaults.launch.backend", "mpi", "defaults.launch.backend", ""),
    ("defaults.training.lr", 0, "defaults.training.lr", ""),
    ("experiments", {}, "experiments", ""),
    ("defaults.training.typo_field", 1, "defaults.training", "typo_field"),
    ("experiments.data_parallel.strategy_options", {"zero2": {"stage": 2}},
     "experiments.data_parallel.strategy_options.zero2", "does not run"),
    ("results_dir", "/tmp/shardlab-elsewhere", "results_dir", "outside the project"),
    ("resources_dir", "../resources", "resources_dir", "allow_outside_project: true"),
]


@pytest.mark.parametrize("path,value,field,problem", BAD_CONFIGS, ids=[c[0] + "=" + str(c[1])[:12] for c in BAD_CONFIGS])
def test_bad_config_is_rejected_naming_the_field(path, value, field, problem):
    with pytest.raises(ConfigError) as err:
        load_study(mutated(path, value), base_dir=REPO)
    assert err.value.field == field, str(err.value)
    assert problem in str(err.value)


def test_good_configs_pass():
    for name in ("config.yaml", "test.yaml", "runpod.yaml"):
        load_study(yaml.safe_load((REPO / "config" / name).read_text()), base_dir=REPO)


def test_output_dirs_outside_the_project_need_an_opt_in():
    load_study(dict(mutated("results_dir", "/tmp/shardlab-elsewhere"), allow_outside_project=True), base_dir=REPO)
    load_study(mutated("results_dir", "results/../results/sub"), base_dir=REPO)  # inside, however spelt


def test_schema_defaults_are_filled():
    cfg = copy.deepcopy(BASE)
    study = load_study(cfg, base_dir=REPO)
    assert cfg["defaults"]["training"]["dtype"] == "fp32"
    assert study.experiments["data_parallel"]["training"]["fault_injection"] == "none"


def test_check_config_command_and_the_snakefile_share_one_check(tmp_path):
    """`shardlab check-config` rejects what the Snakefile rejects, e.g. a model name defined twice."""
    cfg = copy.deepcopy(BASE)
    other = next(n for n in cfg["experiments"] if n != "data_parallel")
    cfg["experiments"][other]["model"] = {"hidden_size": 32}  # same model name, other settings
    bad = tmp_path / "twice.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "shardlab", "check-config", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "defined differently" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "defined differently" in proc.stdout + proc.stderr


def test_snakemake_stops_before_any_job_on_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mutated("defaults.training.global_batch_size", 7)))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "experiments.data_parallel.training.global_batch_size" in proc.stdout + proc.stderr
    assert "rule run_strategy" not in proc.stdout  # nothing was scheduled


def test_identical_single_device_references_are_shared_and_different_ones_are_not():
    cfg = with_experiments(copy.deepcopy(BASE), {
        "a": {"strategies": ["single", "ddp"]},
        "b": {"strategies": ["single", "dp_naive"]},  # same settings as a: shares a's reference
        "c": {"strategies": ["single"], "training": {"steps": 5}},  # different steps: its own run
    })
    assert load_study(cfg, base_dir=REPO).shared_references == {"b": "a"}


def test_one_process_runs_get_the_cores_of_the_widest_run(monkeypatch):
    """Throughput at equal cores: `single` gets ranks x threads_per_rank of the experiment's widest run (the
    4-rank dp x pp hybrid here), never more than the machine's cores, and parallel runs keep theirs."""
    from shardlab.runner.worker import compute
    from shardlab.strategies import threads_per_rank

    exp = {"launch": {"threads_per_rank": 1, "world_size": 2}, "strategies": ["single", "ddp", "hybrid_dp_pp"],
           "strategy_options": {"hybrid_dp_pp": {"world_size": 4}}}
    monkeypatch.setattr("shardlab.strategies.available_cores", lambda: 64)
    assert [threads_per_rank(exp, s) for s in ("single", "ddp", "hybrid_dp_pp")] == [4, 1, 1]
    monkeypatch.setattr("shardlab.strategies.available_cores", lambda: 2)
    assert threads_per_rank(exp, "single") == 2
    assert threads_per_rank(dict(exp, strategies=["single"]), "single") == 1  # alone, nothing to match
    # what each run records: cores its threads occupy (at most the machine's), or GPUs
    assert compute({"device_type": "cpu", "world_size": 4, "threads_per_rank": 1, "cpu_cores": 2}) == {"unit": "core", "count": 2}
    assert compute({"device_type": "cuda", "world_size": 8, "threads_per_rank": 4, "cpu_cores": 64}) == {"unit": "GPU", "count": 8}


def test_bf16_experiments_get_their_noise_floor_runs_and_bad_sensitivity_settings_are_named():
    cfg = mutated("defaults.training.dtype", "bf16")
    cfg["experiments"]["data_parallel"]["strategies"] = ["single", "ddp", "zero3"]
    study = load_study(cfg, base_dir=REPO)
    assert study.experiments["data_parallel"]["noise_floor_runs"] == ["single_reordered", "deepspeed_single"]
    assert ("data_parallel", "single_reordered") in study.runs
    assert study.experiments["data_parallel"]["strategies"] == ["single", "ddp", "zero3"]  # what the user listed
    assert load_study(copy.deepcopy(BASE), base_dir=REPO).experiments["data_parallel"]["noise_floor_runs"] == []
    with pytest.raises(ConfigError) as err:
        load_study(dict(copy.deepcopy(BASE), parity_sensitivity={"experiment": "data_parallel"}), base_dir=REPO)
    assert err.value.field == "parity_sensitivity.experiment" and "sgd" in str(err.value)
    one_row = mutated("defaults.training.dtype", "bf16")
    one_row["defaults"]["training"]["micro_batch_size"] = 1
    with pytest.raises(ConfigError) as err:
        load_study(one_row, base_dir=REPO)
    assert err.value.field.endswith("training.micro_batch_size") and "2 sequences" in str(err.value)


def test_a_vocabulary_smaller_than_the_corpus_ids_is_named_in_data_preparation(tmp_path):
    """A 16-token model cannot embed the SMILES corpus (the tokenizer keeps its whole alphabet, ids up
    to ~90): data preparation stops with the field and the size needed, writing no tokens, instead of
    every run failing at step 1 with an index error. The same corpus with 256 tokens is prepared."""
    from shardlab.core.model import prepare_model

    for vocab, fails in ((16, True), (256, False)):
        model = dict(TEST_EXPERIMENT["model"], name=f"v{vocab}", vocab_size=vocab)
        model_dir = prepare_model(model, tmp_path / f"model{vocab}")
        out = tmp_path / f"data{vocab}"
        proc = subprocess.run([sys.executable, "-m", "shardlab", "prepare-data", "--data-json",
                               json.dumps(TEST_EXPERIMENT["data"]), "--model-json", json.dumps(model),
                               "--model-dir", str(model_dir), "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert (proc.returncode != 0) == fails, proc.stderr[-2000:]
        assert (out / "tokens.npy").exists() != fails
        if fails:
            assert "config field 'model.vocab_size'" in proc.stderr and "at least" in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
