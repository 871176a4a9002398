"""How far a parallel run may be from its single-device reference: one rule, for every strategy family,
dtype and size, used by the tests, the tables, the report and the GPU check.

A correct parallel strategy computes the same sums as the single-device run, in another order: a
rank-local partial sum then an all-reduce (data parallel, ZeRO), a hidden dimension split over
shards (tensor parallel), blocks merged by log-sum-exp (ring attention), tokens regrouped by
expert. Another CPU's kernels or another thread count reorder sums too. In floating point these
orders round differently, so the runs agree only up to rounding, and the tolerance must come from
how large that rounding can be, not from what one machine happened to show.

Where the noise comes from decides which of two estimates the tolerance rests on:

* **A bound, in float32 at small sizes.** For values of magnitude `scale` after `steps` steps,

      bound = CONFIDENCE * steps * sqrt(n) * u * scale

  with `u` the unit roundoff (2**-24), `n` the length of the reductions a strategy reorders (the
  tokens of the global batch: the mean loss, every weight gradient). Two orders of an n-term sum
  differ by about sqrt(n) * u when roundings behave as independent zero-mean errors (Higham & Mary,
  "A new approach to probabilistic rounding error analysis", SISC 2019); CONFIDENCE = 4 makes that
  hold with probability >= 1 - 2 exp(-8) and absorbs cancellation; errors of successive steps add
  up. The bound is used alone while it allows at most A_PRIORI_LIMIT (0.1 %) of the loss: 1.4e-4 on
  losses near 6 for the tests' 6 steps of 8 x 32 tokens, where every correct strategy stays below
  5e-6 on three CPU kernel paths.
* **A measurement, everywhere else.** In bf16 a bound is useless: u = 2**-8, and a rounding flip in
  a weight's bf16 copy moves the forward by a whole bf16 ulp, so the bound exceeds the loss itself;
  in float32 the sqrt(n) factor grows with the batch (2.4 % of the loss at 1M tokens and 100 steps).
  There the experiment also runs its reference a second time with its sums split where parallel
  strategies split them (`single_reordered`: micro-batches and every linear layer's input-feature sum
  in two), the same math, and the largest distance between the two loss curves is the noise floor
  that rounding alone produces at this dtype, batch and step count. In bf16, DeepSpeed and FSDP2
  round differently again (their bf16 keeps the weights in bf16, where `single` runs autocast over
  fp32 weights): their own recipe on one process (`bf16_twin` in the registry) measures that
  distance, and their floor is the larger of the two. The tolerance is NOISE_MULTIPLE (5) times the
  floor, and never below the float32 rounding of the compared losses themselves (the bound with
  n = 1). Over 4 bf16 steps every correct strategy measured stayed within 2.6 times its floor (14
  strategies, two CPU kernel paths), while a 0.5 % error in the mean gradient moved the loss by 9 to
  30 times it (`bench.parity_sensitivity`; docs/correctness.md). Over long runs rounding
  differences grow chaotically: the floor, and with it the tolerance, grows too.

A tolerance above CEILING (5 %) of the loss could not tell a missing gradient average from rounding,
so such a check is not passed but reported as undecided, with its reason; so is a bf16 (or large
float32) comparison whose noise floor was not measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from shardlab.config import block_experiment
from shardlab.errors import ConfigError
from shardlab.strategies import NOISE_RUNS, REGISTRY

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}
CONFIDENCE = 4.0
A_PRIORI_LIMIT = 1e-3
NOISE_MULTIPLE = 5.0
CEILING = 0.05


def tolerance(scale: float, reduction_length: int, steps: int = 1, dtype: str = "fp32") -> float:
    """The a-priori rounding bound for values of magnitude `scale`, see the module doc."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff known for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}")
    return CONFIDENCE * max(steps, 1) * math.sqrt(max(reduction_length, 1)) * UNIT_ROUNDOFF[dtype] * abs(scale)


def tokens_per_step(training: dict) -> int:
    return training["global_batch_size"] * training["seq_len"]


def needs_noise_floor(training: dict) -> bool:
    """Whether parity at these settings rests on a measured noise floor (a second, reordered reference
    run) rather than the float32 bound: any dtype but fp32, and fp32 once the bound exceeds A_PRIORI_LIMIT."""
    return training["dtype"] != "fp32" or tolerance(1.0, tokens_per_step(training), training["steps"]) > A_PRIORI_LIMIT


def planned_tolerance(exp: dict) -> str:
    """What the rule will allow in an experiment, said before anything runs: its estimate, as fractions of
    the loss, and the noise-floor runs it rests on."""
    training = exp["training"]
    steps, tokens = training["steps"], tokens_per_step(training)
    sizes = f"{training['dtype']}, {steps} steps of {training['global_batch_size']} x {training['seq_len']} tokens"
    bound = tolerance(1.0, tokens, steps)
    if not needs_noise_floor(training):
        return f"{sizes}: float32 bound, {bound:.4%} of the loss"
    said = (f"{sizes}: {NOISE_MULTIPLE:g} x the noise floor measured by the runs, at least {tolerance(1.0, 1, steps):.4%} "
            f"and at most {CEILING:.0%} of the loss (above: undecided); the float32 bound alone would be {bound:.3%}")
    if runs := noise_floor_runs(exp):
        said += f"; noise-floor runs: {', '.join(runs)}"
    if none := unmeasured_references(exp):
        said += f"; no reordered run exists for {', '.join(none)}: comparisons with it are undecided"
    return said


@dataclass(frozen=True)
class LossTolerance:
    """The largest loss deviation rounding explains (None: the check cannot decide, see `undecided`)."""

    value: float | None
    scale: float  # the largest |loss| compared
    basis: str  # where the value comes from, in words
    undecided: str | None = None

    @property
    def fraction(self) -> float | None:
        return self.value / self.scale if self.value is not None and self.scale else None


def loss_tolerance(reference: Sequence[float], tokens: int, dtype: str = "fp32",
                   noise_floor: float | None = None) -> LossTolerance:
    """Tolerance for per-step losses compared over all the reference's steps, from the measured noise
    floor when there is one, else from the float32 bound where that is tight enough (module doc)."""
    scale, steps = max(abs(x) for x in reference), len(reference)
    bound = tolerance(scale, tokens, steps)
    if noise_floor is not None:
        least = tolerance(scale, 1, steps)
        value = max(NOISE_MULTIPLE * noise_floor, least)
        basis = (f"{NOISE_MULTIPLE:g} x measured noise floor {noise_floor:.2g}" if value > least
                 else f"float32 rounding of the losses ({least:.2g}; noise floor {noise_floor:.2g})")
    elif dtype == "fp32" and bound <= A_PRIORI_LIMIT * scale:
        value, basis = bound, "float32 rounding bound"
    else:
        why = "float32 at this size" if dtype == "fp32" else dtype
        return LossTolerance(None, scale, "none", f"no noise floor: {why} needs the reordered reference run")
    if value > CEILING * scale:
        return LossTolerance(value, scale, basis, f"tolerance {value / scale:.1%} of the loss exceeds the "
                                                  f"{CEILING:.0%} ceiling: rounding noise too large to check parity")
    return LossTolerance(value, scale, basis)


def max_deviation(values: Sequence[float], reference: Sequence[float]) -> float:
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} values against {len(reference)} reference values")
    return max((abs(a - b) for a, b in zip(values, reference)), default=0.0)


def within(deviation: float, allowed: LossTolerance) -> bool | None:
    """The check's verdict: True/False, or None when it cannot decide."""
    return None if allowed.undecided else deviation <= allowed.value


PARITY_COLUMNS = ["experiment", "strategy", "topic", "family", "reference", "status", "dtype", "steps_compared",
                  "max_loss_deviation", "noise_floor", "noise_floor_runs", "tolerance", "tolerance_fraction",
                  "tolerance_basis", "within_tolerance", "undecided", "val_loss_deviation"]


def floor_runs(strategy: str, dtype: str) -> list[str | None]:
    """The runs whose distance from `strategy`'s reference is the rounding noise its comparison allows: the
    reference in another summation order and, outside fp32, the strategy's own bf16 recipe on one process."""
    spec = REGISTRY[strategy]
    return [REGISTRY[spec.reference].reordered, *([spec.bf16_twin] if dtype != "fp32" and spec.bf16_twin else [])]


def noise_floor_runs(exp: dict) -> list[str]:
    """The runs an experiment's parity checks need beside its own, where the rule rests on a measured noise
    floor (`tables.parity`): each floor run of each compared strategy whose reference the experiment runs."""
    if not needs_noise_floor(exp["training"]):
        return []
    strategies = [name for name in exp.get("strategies", []) if name in REGISTRY]  # unknown names: the config check's
    wanted = [run for name in strategies if REGISTRY[name].reference in strategies and REGISTRY[name].reference != name
              for run in floor_runs(name, exp["training"]["dtype"])]
    return [run for run in dict.fromkeys(wanted) if run is not None and run not in strategies]


def unmeasured_references(exp: dict) -> list[str]:
    """References the experiment compares runs with that have no reordered repeat (so no noise floor)."""
    strategies = exp.get("strategies", [])
    return sorted({REGISTRY[s].reference for s in strategies if REGISTRY[s].reference in strategies
                   and REGISTRY[s].reference != s and REGISTRY[REGISTRY[s].reference].reordered is None})


def _losses(summary: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in summary.get("step_log", [])}


def _distance(run: dict, reference: dict) -> float | None:
    mine, theirs = _losses(run), _losses(reference)
    common = sorted(set(mine) & set(theirs))
    return max_deviation([mine[k] for k in common], [theirs[k] for k in common]) if common else None


def noise_floor(by_run: dict, experiment: str, strategy: str, dtype: str) -> float | None:
    """The largest loss distance from the reference among `floor_runs` (None unless every one finished)."""
    reference = by_run.get((experiment, REGISTRY[strategy].reference))
    runs = [by_run.get((experiment, name)) for name in floor_runs(strategy, dtype)]
    if reference is None or reference["status"] != "ok" or any(r is None or r["status"] != "ok" for r in runs):
        return None
    distances = [_distance(r, reference) for r in runs]
    return None if None in distances else max(distances)


def rule_rows() -> pd.DataFrame:
    """The rule's constants, one row: what the report states the rule to be (it reads tables, not code)."""
    return pd.DataFrame([{"confidence": CONFIDENCE, "a_priori_limit": A_PRIORI_LIMIT, "noise_multiple": NOISE_MULTIPLE,
                          "ceiling": CEILING}])


def parity_rows(summaries: list[dict], experiments: dict[str, dict]) -> pd.DataFrame:
    """One row per run that has a reference (its registry `reference`, same experiment), noise-floor runs
    aside: the largest per-step loss deviation, the tolerance for its dtype and size (with the noise floor
    it rests on, where measured), and the verdict."""
    by_run = {(s["experiment"], s["strategy"]): s for s in summaries}
    rows = []
    for s in summaries:
        spec = REGISTRY[s["strategy"]]
        reference = by_run.get((s["experiment"], spec.reference))
        if spec.reference == s["strategy"] or reference is None or s["strategy"] in NOISE_RUNS:
            continue
        training = experiments[s["experiment"]]["training"] if s["experiment"] in experiments else {}
        row = {"experiment": s["experiment"], "strategy": s["strategy"], "topic": spec.topic, "family": spec.family,
               "reference": spec.reference, "status": s["status"], "dtype": training.get("dtype")}
        mine, ref = _losses(s), _losses(reference)
        common = sorted(set(mine) & set(ref))
        if s["status"] == "ok" and reference["status"] == "ok" and common and training:
            losses = [ref[k] for k in common]
            floor, runs = None, None
            if needs_noise_floor(training):
                floor = noise_floor(by_run, s["experiment"], s["strategy"], training["dtype"])
                runs = ", ".join(str(r) for r in floor_runs(s["strategy"], training["dtype"]))
            allowed = loss_tolerance(losses, tokens_per_step(training), training["dtype"], floor)
            deviation = max_deviation([mine[k] for k in common], losses)
            val = (abs(s["final_val_loss"] - reference["final_val_loss"])
                   if s.get("final_val_loss") is not None and reference.get("final_val_loss") is not None else None)
            row.update(steps_compared=len(common), max_loss_deviation=deviation, noise_floor=floor,
                       noise_floor_runs=runs, tolerance=allowed.value, tolerance_fraction=allowed.fraction,
                       tolerance_basis=allowed.basis, within_tolerance=within(deviation, allowed),
                       undecided=allowed.undecided, val_loss_deviation=val)
        rows.append(row)
    return pd.DataFrame(rows, columns=PARITY_COLUMNS)


def check_sensitivity_config(config: dict, experiments: dict[str, dict]) -> None:
    """The sensitivity cases train with an experiment of the study, with SGD (Adam would normalise a gradient
    scale error away); raises ConfigError naming the field."""
    named = block_experiment(config, "parity_sensitivity", experiments)
    if named is None:
        return
    block, exp = named
    if exp["training"]["optimizer"] != "sgd":
        raise ConfigError("parity_sensitivity.experiment", f"{block['experiment']!r} trains with "
                                                           f"{exp['training']['optimizer']}; the injected gradient-scale "
                                                           "errors need sgd")


SENSITIVITY_COLUMNS = ["experiment", "dtype", "case", "strategy", "injected", "gradient_error", "status", "reason",
                       "max_loss_deviation", "noise_floor", "tolerance", "tolerance_fraction", "tolerance_basis",
                       "expected", "outcome", "as_expected"]


def sensitivity_rows(losses: pd.DataFrame, experiments: dict[str, dict]) -> pd.DataFrame:
    """The parity check held against errors injected on purpose (`bench.parity_sensitivity`'s per-step
    losses): per dtype and case, the largest loss deviation from the reference case, the rule's tolerance
    (resting on the reordered case where the rule measures a floor), and whether the check passed a correct
    strategy and caught an injected error ('outcome': pass, fail or undecided; 'expected': pass, fail, or
    either for a probe below the size the check is meant to catch)."""
    rows = []
    for (experiment, dtype), part in losses.groupby(["experiment", "dtype"], sort=False):
        if (part["status"] != "ok").any():
            rows.append({"experiment": experiment, "dtype": dtype, "status": "failed", "reason": part["reason"].iloc[0]})
            continue
        curves = {key: group.sort_values("step")["loss"].tolist()
                  for key, group in part.groupby(["case", "strategy", "injected"], sort=False)}
        reference = next(k for k in curves if k[2] == "none" and REGISTRY[k[1]].reference == k[1])
        reordered = next(k for k in curves if k[1] == REGISTRY[reference[1]].reordered)
        training = dict(experiments[experiment]["training"], dtype=dtype)
        floor = max_deviation(curves[reordered], curves[reference])
        allowed = loss_tolerance(curves[reference], tokens_per_step(training), dtype,
                                 floor if needs_noise_floor(training) else None)
        for key, curve in curves.items():
            if key == reference:
                continue
            case = part[(part["case"] == key[0]) & (part["strategy"] == key[1])].iloc[0]
            deviation = max_deviation(curve, curves[reference])
            verdict = within(deviation, allowed)
            outcome = "undecided" if verdict is None else "pass" if verdict else "fail"
            rows.append({"experiment": experiment, "dtype": dtype, "case": key[0], "strategy": key[1],
                         "injected": key[2], "gradient_error": case["gradient_error"], "status": "ok",
                         "max_loss_deviation": deviation, "noise_floor": floor, "tolerance": allowed.value,
                         "tolerance_fraction": allowed.fraction, "tolerance_basis": allowed.undecided or allowed.basis,
                         "expected": case["expected"], "outcome": outcome,
                         "as_expected": case["expected"] in (outcome, "either") and outcome != "undecided"})
    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)
