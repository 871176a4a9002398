"""Domain metrics as pure functions, each beside the trivial baseline it is read against
(tested on hand-made cases): SMILES validity/uniqueness/novelty and Delaney's ESOL estimate
(chemistry), rank correlation, classification accuracy and the majority class (biology), the
posterior median over binned labels and its absolute error (materials), character-unigram
perplexity and samples (the baselines)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def canonical_smiles(smiles: str) -> str | None:
    """RDKit canonical SMILES, or None when RDKit cannot parse it (empty strings are invalid)."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")  # invalid samples are expected; don't flood the log
    if not smiles or not smiles.strip() or len(smiles.split()) > 1:
        return None  # RDKit would read "CCO junk" as CCO named "junk": a body has no whitespace
    mol = Chem.MolFromSmiles(smiles.strip())
    return Chem.MolToSmiles(mol) if mol is not None and mol.GetNumAtoms() > 0 else None


def smiles_quality(samples: list[str], training: set[str]) -> dict:
    """validity (parseable / all), uniqueness (distinct canonical / valid), novelty (distinct not in training / distinct)."""
    canonical = [canonical_smiles(s) for s in samples]
    valid = [c for c in canonical if c is not None]
    distinct = set(valid)
    return {
        "validity": len(valid) / len(samples) if samples else float("nan"),
        "uniqueness": len(distinct) / len(valid) if valid else float("nan"),
        "novelty": len(distinct - training) / len(distinct) if distinct else float("nan"),
    }


def esol_logs(smiles: str) -> float | None:
    """Delaney's ESOL (2004) linear estimate of log solubility from four RDKit descriptors."""
    from rdkit import Chem
    from rdkit.Chem import Crippen, Descriptors

    mol = Chem.MolFromSmiles(smiles) if smiles else None
    if mol is None or mol.GetNumHeavyAtoms() == 0:
        return None
    aromatic = sum(atom.GetIsAromatic() for atom in mol.GetAtoms()) / mol.GetNumHeavyAtoms()
    return (0.16 - 0.63 * Crippen.MolLogP(mol) - 0.0062 * Descriptors.MolWt(mol)
            + 0.066 * Descriptors.NumRotatableBonds(mol) - 0.74 * aromatic)


def spearman(x, y) -> float:
    """Rank correlation (average ranks for ties); NaN when either side is constant or too short."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(values: np.ndarray) -> np.ndarray:
    order = values.argsort(kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=float)
    for v in np.unique(values):  # ties share their mean rank
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def accuracy_from_scores(scores: np.ndarray, classes: list[str], truth: list[str]) -> float:
    """scores[i, k] = log p(class k, sequence i); predict the argmax class."""
    predicted = [classes[k] for k in scores.argmax(axis=1)]
    return float(np.mean([p == t for p, t in zip(predicted, truth)]))


def majority_accuracy(train_labels: list[str], truth: list[str]) -> tuple[str, float]:
    majority = Counter(train_labels).most_common(1)[0][0]
    return majority, float(np.mean([t == majority for t in truth]))


def posterior_median(scores: np.ndarray, candidates: list[float]) -> np.ndarray:
    """Per row: the candidate at which the posterior (softmax of joint log-likelihoods) reaches 1/2.

    The median, not the mean, because it minimises the expected absolute error (MAE)."""
    order = np.argsort(candidates)
    values = np.asarray(candidates, float)[order]
    logp = scores[:, order] - scores[:, order].max(axis=1, keepdims=True)
    post = np.exp(logp)
    cdf = np.cumsum(post / post.sum(axis=1, keepdims=True), axis=1)
    return values[(cdf >= 0.5).argmax(axis=1)]


def mean_absolute_error(predicted, truth) -> float:
    return float(np.mean(np.abs(np.asarray(predicted, float) - np.asarray(truth, float))))


def unigram_perplexity(train_texts: list[str], test_texts: list[str]) -> float:
    """Per-character perplexity of a character-unigram model (add-one smoothed) of the training texts."""
    counts = Counter("".join(train_texts))
    alphabet = set(counts) | set("".join(test_texts))
    total = sum(counts.values()) + len(alphabet)
    nll = [-math.log((counts[c] + 1) / total) for text in test_texts for c in text]
    return math.exp(sum(nll) / len(nll))


def unigram_samples(train_texts: list[str], n: int, seed: int) -> list[str]:
    """Strings with training lengths and characters drawn independently from training frequencies."""
    rng = np.random.default_rng(seed)
    counts = Counter("".join(train_texts))
    chars = list(counts)
    probs = np.array([counts[c] for c in chars], float)
    probs /= probs.sum()
    lengths = rng.choice([len(t) for t in train_texts], size=n)
    return ["".join(rng.choice(chars, size=length, p=probs)) for length in lengths]
