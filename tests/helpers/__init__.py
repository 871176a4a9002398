"""What tests share besides fixtures: the tiny experiment every strategy test runs, one real torchrun
launch of it (through `shardlab.runner.launch`, exactly as the workflow does), and the parity
assertions every comparison with the single-device reference goes through."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from shardlab.config import deep_merge
from shardlab.core.step_stats import read_step_log
from shardlab.tables.parity import loss_tolerance, max_deviation

REPO = Path(__file__).resolve().parents[2]

# Small enough that a 2-rank torchrun run takes seconds; SGD so that a sum-vs-mean gradient
# error shows in the loss (Adam's normalisation would hide it); fp32, no dropout.
TEST_EXPERIMENT = {
    "name": "test",
    "model": {"name": "test-neox", "source": "local", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
              "intermediate_size": 256, "vocab_size": 256, "max_position_embeddings": 128, "seed": 0},
    "data": {"corpus": "aqsoldb", "path": str(REPO / "data/chemistry/aqsoldb.csv"), "format": "smiles",
             "max_documents": 2000},
    "training": {"steps": 6, "warmup_steps": 1, "seq_len": 32, "global_batch_size": 8, "micro_batch_size": None,
                 "optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "dtype": "fp32", "seed": 7, "log_every": 1,
                 "eval_every": 0, "eval_batches": 1, "fault_injection": "none"},
    "launch": {"world_size": 2, "device": "cpu", "backend": "gloo", "threads_per_rank": 1, "timeout_s": 300},
    "strategy_options": {},
}

# The mixture-of-experts model of the expert-parallel tests: capacity 1.0, so that tokens are dropped.
MOE_OPTIONS = {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "aux_loss_coef": 0.01}
MOE_OVERRIDES = {"strategy_options": {"moe_single": MOE_OPTIONS, "ep_moe": MOE_OPTIONS}}
# AdamW, for the tests where the optimizer's state matters (resuming under another plan).
ADAMW_OVERRIDES = {"training": {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01}}


def with_experiments(config: dict, experiments: dict) -> dict:
    """A study config with these experiments instead of its own; a block that names an experiment no longer
    there (resharding) goes with them."""
    config = dict(config, experiments=experiments)
    if config.get("resharding", {}).get("experiment") not in experiments:
        config.pop("resharding", None)
    return config


def launch_test_run(assets, root: Path, strategy: str, overrides: dict | None = None):
    """One real torchrun launch (through shardlab.runner.launch) of TEST_EXPERIMENT + overrides under `root`.
    Returns (summary, per-step records)."""
    from shardlab.runner.launch import launch

    model_dir, tokens = assets
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides or {})
    root.mkdir(parents=True, exist_ok=True)
    exp_path = root / f"{strategy}-{len(list(root.iterdir()))}.json"
    exp_path.write_text(json.dumps(exp))
    out = root / "runs" / strategy
    summary = launch(exp, exp_path, strategy, model_dir, tokens, out)
    return summary, read_step_log(out / "metrics.jsonl")


TEST_TOKENS_PER_STEP = TEST_EXPERIMENT["training"]["global_batch_size"] * TEST_EXPERIMENT["training"]["seq_len"]
PARITY_LOG = os.environ.get("SHARDLAB_PARITY_LOG")  # scripts/parity-across-cpus.sh collects deviations here


def assert_within(name: str, deviation: float, tol: float) -> None:
    """Every parity comparison goes through here: one message, and a log line for the CPU sweep."""
    if PARITY_LOG:
        with open(PARITY_LOG, "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "check": name,
                                  "deviation": deviation, "tolerance": tol}) + "\n")
    assert deviation <= tol, f"max |{name} - reference| = {deviation:.3g} > {tol:.3g} (shardlab.tables.parity)"


def assert_losses_match(losses, reference, tokens_per_step=TEST_TOKENS_PER_STEP, dtype="fp32", noise_floor=None):
    """Per-step losses vs the reference within the rule of shardlab.tables.parity (the float32 bound, or
    the tolerance from a measured noise floor)."""
    allowed = loss_tolerance(reference, tokens_per_step, dtype, noise_floor)
    assert allowed.undecided is None, allowed.undecided
    assert_within("loss", max_deviation(losses, reference), allowed.value)


def zero_rung(strategy: str):
    """The ZeRO rung (costs.sharded_states.ZeroRung) of a registered strategy's Plan."""
    from shardlab.costs.sharded_states import ZeroRung
    from shardlab.strategies import REGISTRY

    fields = REGISTRY[strategy].plan_fields(2, {})
    return ZeroRung.of(fields.get("zero", 0), fields.get("offload", "none"), fields["framework"])


def rung_states(strategy: str, *args, **kwargs):
    """costs.sharded_states.predict for a registered strategy's rung (the memory model's own tests)."""
    from shardlab.costs.sharded_states import predict

    return predict(zero_rung(strategy), *args, **kwargs)


def run_command(capsys, main, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a command line's `main(argv)`, argparse's exits included."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
