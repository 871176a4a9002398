"""The three domains' evaluations of one trained model, each metric beside a trivial baseline.

- chemistry: sample SMILES after each solubility tag; RDKit validity, uniqueness, novelty, and
  whether the samples' ESOL-predicted solubility rises with the requested bin (Spearman).
  Baseline: a character-unigram sampler fitted to the training SMILES (validity, uniqueness,
  novelty) and a condition-blind sampler (correlation 0).
- biology: classify held-out sequences by the likelihood of each class tag before them
  (accuracy vs always predicting the training majority class) and residue-level perplexity
  of the sequence given its true tag (vs a residue-unigram model of the training set).
- materials: score every band-gap bin before each held-out formula and predict the posterior
  median; MAE vs predicting the training mean, on the test split and on extra sets (expt_gap).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from shardlab.science.formats import ConditionalFormat
from shardlab.science.language_model import LanguageModel
from shardlab.science.measures import (accuracy_from_scores, canonical_smiles, esol_logs, majority_accuracy,
                                       mean_absolute_error, posterior_median, smiles_quality, spearman,
                                       unigram_perplexity, unigram_samples)


# --- data helpers -------------------------------------------------------------------------------
def labelled_rows(path: Path | str, fmt: ConditionalFormat) -> list[tuple[float | str, str]]:
    """(label, body) of every well-formed row; malformed rows are left out (as in training)."""
    out = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            label, body = fmt.label_of(row), fmt.body_of(row)
            if label is not None and body is not None:
                out.append((label, body))
    return out


def subsample(rows: list, n: int, seed: int) -> list:
    """A fixed random subset (the same for every strategy's model), in a stable order."""
    if len(rows) <= n:
        return rows
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=n, replace=False))
    return [rows[i] for i in keep]


def metric(domain, test_set, name, value, baseline, baseline_name, n, note=""):
    return {"domain": domain, "test_set": test_set, "metric": name, "value": value, "baseline": baseline,
            "baseline_name": baseline_name, "n": n, "note": note}


# --- the three domains --------------------------------------------------------------------------
def evaluate_chemistry(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    train_smiles = [body for _, body in train]
    known = {c for c in map(canonical_smiles, train_smiles) if c}
    n = settings["samples_per_condition"]
    conditions, samples = [], []
    for i, value in enumerate(settings["conditions"]):
        drawn = lm.sample(fmt.tag_text(value), n, max_new_tokens=96, seed=seed + i)
        conditions += [fmt.bin(value)] * len(drawn)
        samples += drawn
    quality = smiles_quality(samples, known)
    base = smiles_quality(unigram_samples(train_smiles, len(samples), seed), known)
    predicted = [(c, esol_logs(s)) for c, s in zip(conditions, samples) if canonical_smiles(s)]
    predicted = [(c, p) for c, p in predicted if p is not None]
    tracking = spearman([c for c, _ in predicted], [p for _, p in predicted])
    test = subsample(labelled_rows(splits / "test.csv", fmt), settings["max_examples"], seed)
    esol_test = [(label, esol_logs(body)) for label, body in test]
    esol_test = [(measured, estimate) for measured, estimate in esol_test if estimate is not None]
    esol_check = spearman([m for m, _ in esol_test], [e for _, e in esol_test])
    total = len(samples)
    return [
        metric("chemistry", "sampled", "validity", quality["validity"], base["validity"], "character-unigram sampler", total),
        metric("chemistry", "sampled", "uniqueness", quality["uniqueness"], base["uniqueness"], "character-unigram sampler", total),
        metric("chemistry", "sampled", "novelty", quality["novelty"], base["novelty"], "character-unigram sampler", total),
        metric("chemistry", "sampled", "condition_tracking_spearman", tracking, 0.0, "condition-blind sampler",
               len(predicted), "Spearman(requested logS bin, ESOL-predicted logS) over valid samples"),
        metric("chemistry", "test", "esol_vs_measured_spearman", esol_check, float("nan"), "none (calibrates the predictor)",
               len(test), "how well ESOL tracks measured logS on held-out molecules"),
    ]


def evaluate_biology(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    classes = sorted({label for label, _ in train})
    test = subsample(labelled_rows(splits / "test.csv", fmt), settings["max_examples"], seed)
    truth, bodies = [label for label, _ in test], [body for _, body in test]
    scores = np.zeros((len(test), len(classes)))
    for k, cls in enumerate(classes):
        tag_lp, body_lp, _ = lm.score([fmt.tag_text(cls)] * len(test), bodies)
        scores[:, k] = tag_lp + body_lp
    majority, majority_acc = majority_accuracy([label for label, _ in train], truth)
    _, body_lp, chars = lm.score([fmt.tag_text(t) for t in truth], bodies)
    perplexity = math.exp(-body_lp.sum() / chars.sum())
    baseline_ppl = unigram_perplexity([body for _, body in train], bodies)
    return [
        metric("biology", "test", "class_accuracy", accuracy_from_scores(scores, classes, truth), majority_acc,
               f"majority class '{majority}'", len(test), f"argmax over {len(classes)} class tags"),
        metric("biology", "test", "residue_perplexity", perplexity, baseline_ppl, "residue-unigram model", len(test),
               "per residue, given the true class tag (lower is better)"),
    ]


def evaluate_materials(lm: LanguageModel, fmt: ConditionalFormat, splits: Path, settings: dict, seed: int) -> list[dict]:
    train = labelled_rows(splits / "train.csv", fmt)
    train_gaps = np.array([label for label, _ in train], float)
    candidates = fmt.candidate_labels(0.0, float(np.quantile(train_gaps, 0.995)))
    test_sets = {"test": splits / "test.csv", **{k: Path(v) for k, v in settings.get("extra_test_sets", {}).items()}}
    rows = []
    for name, path in test_sets.items():
        test = subsample(labelled_rows(path, fmt), settings["max_examples"], seed)
        truth, formulas = [label for label, _ in test], [body for _, body in test]
        scores = np.zeros((len(test), len(candidates)))
        for k, gap in enumerate(candidates):
            tag_lp, body_lp, _ = lm.score([fmt.tag_text(gap)] * len(test), formulas)
            scores[:, k] = tag_lp + body_lp
        predicted = posterior_median(scores, candidates)
        rows.append(metric("materials", name, "gap_mae_eV", mean_absolute_error(predicted, truth),
                           mean_absolute_error([train_gaps.mean()] * len(truth), truth), "training mean", len(test),
                           f"posterior median over {len(candidates)} bins of {fmt.bin_width} eV (lower is better)"))
    return rows


DOMAIN_EVALUATORS = {"chemistry": evaluate_chemistry, "biology": evaluate_biology, "materials": evaluate_materials}
