"""Domain metrics as pure functions, each beside the trivial baseline it is read against
(tested on hand-made cases): SMILES validity/uniqueness/novelty and Delaney's ESOL estimate
(chemistry), rank correlation, classification accuracy and the majority class (biology), the
posterior median over binned labels and its absolute error (materials), character-unigram
perplexity and samples (the baselines); `core.bootstrap` gives each its interval."""

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
    return canonical_quality([canonical_smiles(s) for s in samples], training)


def canonical_quality(canonical, training: set[str]) -> dict:
    """`smiles_quality` of samples already canonicalised (None or "" for an invalid one)."""
    return {name: float(np.mean(flags)) if len(flags) else float("nan")
            for name, flags in quality_indicators(canonical, training).items()}


def quality_indicators(canonical, training: set[str]) -> dict[str, np.ndarray]:
    """Each quality as the mean of per-item flags, so that it can be bootstrapped over items (resampling
    the samples themselves would repeat molecules and bias uniqueness down): validity, one flag per
    sample; uniqueness, one per valid sample (the first occurrence of its molecule); novelty, one per
    distinct molecule (not in training)."""
    valid = [c for c in canonical if c]
    seen: set[str] = set()
    first = []
    for c in valid:
        first.append(c not in seen)
        seen.add(c)
    return {"validity": np.array([bool(c) for c in canonical]), "uniqueness": np.array(first, bool),
            "novelty": np.array([c not in training for c in dict.fromkeys(valid)], bool)}


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
    """Ranks from 0, ties sharing their mean rank (vectorised: the bootstrap calls this thousands of times)."""
    order = values.argsort(kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # where each run of equal values begins
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = np.repeat((starts + ends - 1) / 2, ends - starts)
    return ranks


def class_hits(scores: np.ndarray, classes: list[str], truth) -> np.ndarray:
    """scores[i, k] = log p(class k, sequence i): whether each sequence's argmax class is its true one (the
    accuracy is their mean)."""
    return np.asarray(classes)[scores.argmax(axis=1)] == np.asarray(truth)


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


def unigram_nll(train_texts: list[str], test_texts: list[str]) -> np.ndarray:
    """Per test text, the negative log-likelihood (nats) of a character-unigram model (add-one
    smoothed) of the training texts."""
    counts = Counter("".join(train_texts))
    alphabet = set(counts) | set("".join(test_texts))
    total = sum(counts.values()) + len(alphabet)
    return np.array([sum(-math.log((counts[c] + 1) / total) for c in text) for text in test_texts])


def unigram_perplexity(train_texts: list[str], test_texts: list[str]) -> float:
    """Per-character perplexity of a character-unigram model (add-one smoothed) of the training texts."""
    return math.exp(unigram_nll(train_texts, test_texts).sum() / sum(map(len, test_texts)))


def unigram_samples(train_texts: list[str], n: int, seed: int) -> list[str]:
    """Strings with training lengths and characters drawn independently from training frequencies."""
    rng = np.random.default_rng(seed)
    counts = Counter("".join(train_texts))
    chars = list(counts)
    probs = np.array([counts[c] for c in chars], float)
    probs /= probs.sum()
    lengths = rng.choice([len(t) for t in train_texts], size=n)
    return ["".join(rng.choice(chars, size=length, p=probs)) for length in lengths]
