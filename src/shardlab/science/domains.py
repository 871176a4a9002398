"""The three domains' evaluations of one trained model, each metric beside a trivial baseline.

- chemistry: sample SMILES after each solubility tag; RDKit validity, uniqueness, novelty, and
  whether the samples' ESOL-predicted solubility rises with the requested bin (Spearman).
  Baseline: a character-unigram sampler fitted to the training SMILES (validity, uniqueness,
  novelty) and a condition-blind sampler (correlation 0). And the other direction: score every
  solubility bin before each held-out molecule and predict the posterior median (MAE in log units
  vs predicting the training mean).
- biology: classify held-out sequences by the likelihood of each class tag before them
  (accuracy vs always predicting the training majority class) and residue-level perplexity
  of the sequence given its true tag (vs a residue-unigram model of the training set).
- materials: score every band-gap bin before each held-out formula and predict the posterior
  median; MAE vs predicting the training mean, on the test split and on extra sets (expt_gap).

Every metric comes with a 95 % percentile-bootstrap interval over its rows (samples or test rows),
so does its baseline, and so does their difference (paired where both score the same rows);
`beats_baseline` is true when the difference's interval excludes zero on the better side.
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path

import numpy as np

from shardlab.science.formats import ConditionalFormat
from shardlab.science.language_model import LanguageModel
from shardlab.core.bootstrap import bootstrap_interval
from shardlab.science.measures import (class_hits, canonical_smiles, quality_indicators,
                                       esol_logs, majority_accuracy, mean_absolute_error, posterior_median, spearman,
                                       unigram_nll, unigram_samples)


# The metrics as the report names them (tables carry both: `metric` for code, `metric_title` for readers).
METRIC_TITLES = {
    "validity": "valid molecules sampled", "uniqueness": "unique molecules sampled",
    "novelty": "sampled molecules not in training", "condition_tracking_spearman":
    "samples following the requested solubility (rank correlation)",
    "esol_vs_measured_spearman": "ESOL estimate against measured solubility (rank correlation)",
    "logs_mae": "solubility error (log units)", "class_accuracy": "structural-class accuracy",
    "residue_perplexity": "residue perplexity", "gap_mae_eV": "band-gap error (eV)",
}
TEST_SET_TITLES = {"expt_gap": "experimental gaps"}


def metric_title(metric: str, test_set: str) -> str:
    """'band-gap error (eV), experimental gaps' for gap_mae_eV on expt_gap (a test set besides the held-out rows or
    the samples is named); a metric not listed keeps its name."""
    where = "" if test_set in ("test", "sampled") else f", {TEST_SET_TITLES.get(test_set, test_set)}"
    return METRIC_TITLES.get(metric, metric) + where


# --- data helpers -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def labelled_rows(path: Path | str, fmt: ConditionalFormat) -> tuple[tuple[float | str, str], ...]:
    """(label, body) of every well-formed row; malformed rows are left out (as in training). Read once per
    process: every model an evaluation scores reads the same splits (~0.4 s a read of materials' training part)."""
    out = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            label, body = fmt.label_of(row), fmt.body_of(row)
            if label is not None and body is not None:
                out.append((label, body))
    return tuple(out)


def subsample(rows: list, n: int, seed: int) -> list:
    """A fixed random subset (the same for every strategy's model), in a stable order."""
    if len(rows) <= n:
        return rows
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=n, replace=False))
    return [rows[i] for i in keep]


def compared(model, baseline, sizes: tuple[int, int] | tuple[int], better: str | None, seed: int) -> dict:
    """Value, baseline and intervals of a metric. `model` and `baseline` are statistics of index arrays
    (the rows to use); one size means both score the same rows (a paired difference), two sizes mean
    independent samples; a float baseline is a constant (e.g. 0 for a condition-blind sampler)."""
    everything = [np.arange(n) for n in sizes]
    value = model(everything[0])
    constant = not callable(baseline)
    base = baseline if constant else baseline(everything[-1])
    low, high = bootstrap_interval(model, sizes[:1], seed=seed)
    base_low, base_high = (base, base) if constant else bootstrap_interval(baseline, sizes[-1:], seed=seed + 1)
    if constant:
        diff_low, diff_high = low - base, high - base
    elif len(sizes) == 1:
        diff_low, diff_high = bootstrap_interval(lambda i: model(i) - baseline(i), sizes, seed=seed + 2)
    else:
        diff_low, diff_high = bootstrap_interval(lambda i, j: model(i) - baseline(j), sizes, seed=seed + 2)
    beats = None
    if better and np.isfinite(diff_low):
        beats = bool(diff_low > 0) if better == "higher" else bool(diff_high < 0)
    return {"value": value, "low": low, "high": high, "baseline": base, "baseline_low": base_low,
            "baseline_high": base_high, "difference_low": diff_low, "difference_high": diff_high, "better": better,
            "beats_baseline": beats}


def row(domain, test_set, name, baseline_name, n, stats: dict, note="", per_example=None) -> dict:
    """One metric row; `per_example`: the values over the test rows whose mean the metric is (where it
    is one), so that two models' metrics can be compared row by row (`evaluate.fine_tuning_gains`)."""
    out = {"domain": domain, "test_set": test_set, "metric": name, "baseline_name": baseline_name, "n": n,
           "note": note, **stats}
    if per_example is not None:
        out["per_example"] = np.asarray(per_example, float)
    return out


def mean_of(flags: np.ndarray):
    """The statistic `mean of the flags picked`, for `compared`."""
    return lambda i: float(np.mean(flags[i])) if len(i) else float("nan")


@functools.lru_cache(maxsize=4)
def training_molecules(train_csv: Path, fmt: ConditionalFormat) -> frozenset[str]:
    """Canonical SMILES of the training split, for novelty: the same for every model an evaluation scores
    (canonicalising them took ~1.5 s a model)."""
    return frozenset(c for c in (canonical_smiles(body) for _, body in labelled_rows(train_csv, fmt)) if c)


def label_by_scoring(lm: LanguageModel, fmt: ConditionalFormat, candidates: list[float], bodies: list[str]) -> np.ndarray:
    """Each body's label predicted by the model: the posterior median over the candidate tags, scored
    by the likelihood of tag + body (what a conditional model learned of the label given the body)."""
    tag_lp, body_lp, _ = lm.score_grid([fmt.tag_text(value) for value in candidates], bodies)
    return posterior_median(tag_lp + body_lp, candidates)


def label_mae_row(domain: str, test_set: str, metric: str, fmt: ConditionalFormat, predicted: np.ndarray,
                  truth: np.ndarray, train_labels: np.ndarray, n_bins: int, unit: str, seed: int) -> dict:
    """MAE of predicted labels against predicting the training mean, paired on the same rows."""
    mean = np.full(len(truth), train_labels.mean())
    return row(domain, test_set, metric, "training mean", len(truth),
               compared(lambda i: mean_absolute_error(predicted[i], truth[i]),
                        lambda i: mean_absolute_error(mean[i], truth[i]), (len(truth),), "lower", seed),
               f"posterior median over {n_bins} bins of {fmt.bin_width} {unit} (lower is better)",
               per_example=np.abs(predicted - truth))


# --- the three domains --------------------------------------------------------------------------
def evaluate_chemistry(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    train_smiles = [body for _, body in train]
    known = training_molecules(splits / "train.csv", fmt)
    n = settings["samples_per_condition"]
    conditions, samples = [], []
    for i, value in enumerate(settings["conditions"]):
        drawn = lm.sample(fmt.tag_text(value), n, max_new_tokens=96, seed=seed + i, temperature=settings["temperature"])
        conditions += [fmt.bin(value)] * len(drawn)
        samples += drawn
    canonical = [canonical_smiles(s) for s in samples]
    flags = quality_indicators(canonical, known)
    base = quality_indicators([canonical_smiles(s) for s in unigram_samples(train_smiles, len(samples), seed)], known)
    quality = {name: compared(mean_of(flags[name]), mean_of(base[name]), (len(flags[name]), len(base[name])),
                              None if name == "novelty" else "higher", seed) for name in flags}
    estimates = [(c, esol_logs(s)) for c, s in zip(conditions, canonical) if s]
    estimates = np.array([(c, e) for c, e in estimates if e is not None], float).reshape(-1, 2)
    tracking = lambda i: spearman(estimates[i, 0], estimates[i, 1])  # noqa: E731
    test = subsample(labelled_rows(splits / "test.csv", fmt), settings["max_examples"], seed)
    calibration = np.array([(label, e) for label, e in ((label, esol_logs(body)) for label, body in test)
                            if e is not None], float).reshape(-1, 2)
    esol_check = lambda i: spearman(calibration[i, 0], calibration[i, 1])  # noqa: E731
    train_logs = np.array([label for label, _ in train], float)
    candidates = fmt.candidate_labels(*np.quantile(train_logs, [0.005, 0.995]))
    truth = np.array([label for label, _ in test], float)
    predicted = label_by_scoring(lm, fmt, candidates, [body for _, body in test])
    unigram = "character-unigram sampler"
    temperature = f"sampled at temperature {settings['temperature']}"
    return [
        row("chemistry", "sampled", "validity", unigram, len(samples), quality["validity"], temperature),
        row("chemistry", "sampled", "uniqueness", unigram, len(flags["uniqueness"]), quality["uniqueness"],
            "distinct molecules among the valid samples"),
        row("chemistry", "sampled", "novelty", unigram, len(flags["novelty"]), quality["novelty"],
            "distinct valid samples not in the training set (the unigram sampler's few valid ones are trivially new)"),
        row("chemistry", "sampled", "condition_tracking_spearman", "condition-blind sampler", len(estimates),
            compared(tracking, 0.0, (len(estimates),), "higher", seed),
            "Spearman(requested logS bin, ESOL-predicted logS) over valid samples"),
        row("chemistry", "test", "esol_vs_measured_spearman", "none (calibrates the predictor)", len(calibration),
            compared(esol_check, float("nan"), (len(calibration),), None, seed),
            "how well ESOL tracks measured logS on held-out molecules"),
        label_mae_row("chemistry", "test", "logs_mae", fmt, predicted, truth, train_logs, len(candidates), "log units",
                      seed),
    ]


def evaluate_biology(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    test = subsample(labelled_rows(splits / "test.csv", fmt), settings["max_examples"], seed)
    truth, bodies = np.array([label for label, _ in test]), [body for _, body in test]
    classes = sorted({label for label, _ in train} | set(truth))  # a class unseen in training is a candidate too
    tag_lp, body_lps, scored_chars = lm.score_grid([fmt.tag_text(cls) for cls in classes], bodies)
    scores = tag_lp + body_lps
    hits = class_hits(scores, classes, truth)
    train_labels = [label for label, _ in train]
    majority = majority_accuracy(train_labels, truth)[0]
    true_class = (np.arange(len(test)), np.array([classes.index(t) for t in truth], int))
    body_lp, chars = body_lps[true_class], scored_chars[true_class]  # given the true tag
    # The unigram model scores the same residues the model could (those inside its context).
    base_nll = unigram_nll([body for _, body in train], [b[:int(c)] for b, c in zip(bodies, chars)])
    perplexity = lambda nll: (lambda i: math.exp(nll[i].sum() / chars[i].sum()))  # noqa: E731
    context = f"per residue of the first {int(chars.max())} at most (the model's context), given the true class tag"
    return [
        row("biology", "test", "class_accuracy", f"majority class '{majority}'", len(test),
            compared(mean_of(hits), lambda i: majority_accuracy(train_labels, truth[i])[1], (len(test),), "higher",
                     seed),
            f"argmax over {len(classes)} class tags", per_example=hits),
        row("biology", "test", "residue_perplexity", "residue-unigram model", len(test),
            compared(perplexity(-body_lp), perplexity(base_nll), (len(test),), "lower", seed), context),
    ]


def evaluate_materials(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    train_gaps = np.array([label for label, _ in train], float)
    candidates = fmt.candidate_labels(0.0, float(np.quantile(train_gaps, 0.995)))
    test_sets = {"test": splits / "test.csv", **{k: Path(v) for k, v in settings.get("extra_test_sets", {}).items()}}
    rows = []
    for name, path in test_sets.items():
        test = subsample(labelled_rows(path, fmt), settings["max_examples"], seed)
        truth = np.array([label for label, _ in test], float)
        predicted = label_by_scoring(lm, fmt, candidates, [body for _, body in test])
        rows.append(label_mae_row("materials", name, "gap_mae_eV", fmt, predicted, truth, train_gaps, len(candidates),
                                  "eV", seed))
    return rows


DOMAIN_EVALUATORS = {"chemistry": evaluate_chemistry, "biology": evaluate_biology, "materials": evaluate_materials}
