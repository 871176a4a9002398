"""Domain evaluation of fine-tuned models, each metric beside a trivial baseline.

- chemistry: sample SMILES after each solubility tag; RDKit validity, uniqueness, novelty, and
  whether the samples' ESOL-predicted solubility rises with the requested bin (Spearman).
  Baseline: a character-unigram sampler fitted to the training SMILES (validity, uniqueness,
  novelty) and a condition-blind sampler (correlation 0).
- biology: classify held-out sequences by the likelihood of each class tag before them
  (accuracy vs always predicting the training majority class) and residue-level perplexity
  of the sequence given its true tag (vs a residue-unigram model of the training set).
- materials: score every band-gap bin before each held-out formula and predict the posterior
  median; MAE vs predicting the training mean, on the test split and on extra sets (expt_gap).

Only the model's own likelihoods are used, so the same code evaluates the tiny local model
and a hub model (with its own tokenizer).
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from shardlab.science.formats import FORMATS, ConditionalFormat


# --- pure metric functions (tested on hand-made cases) ------------------------------------------
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


# --- the language model as a scorer and sampler -------------------------------------------------
class LanguageModel:
    """log p(tag, body) for conditional text, and sampling after a tag.

    Texts are scored as the training stream presents them: end-of-text, tag, " body", end-of-text.
    The byte-level pre-tokenizer always splits at the space after the tag, so tokenizing tag and
    body separately gives the same tokens as tokenizing the whole text.
    """

    def __init__(self, model_dir: Path | str, batch_size: int = 64):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.config.use_cache = True  # training saved it off; sampling needs the KV cache to be cheap
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.eos_token_id
        self.max_len = getattr(self.model.config, "max_position_embeddings", 2048)
        self.batch_size = batch_size

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(self, tags: list[str], bodies: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pair: (log p of the tag tokens, log p of the body tokens + end, body characters scored).

        Bodies longer than the model's context are cut; only the characters kept are counted."""
        import torch

        rows, spans = [], []
        for tag, body in zip(tags, bodies):
            tag_ids, body_ids = self._ids(tag), self._ids(" " + body)
            room = self.max_len - len(tag_ids) - 2
            kept = body_ids[:room]
            chars = len(self.tokenizer.decode(kept).strip()) if len(kept) < len(body_ids) else len(body)
            rows.append([self.eos, *tag_ids, *kept] + ([self.eos] if len(kept) == len(body_ids) else []))
            spans.append((len(tag_ids), chars))
        tag_lp, body_lp, chars = np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start:start + self.batch_size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), self.eos, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, row in enumerate(batch):
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            token_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            token_lp = (token_lp * mask[:, 1:]).numpy()
            for i, row in enumerate(batch):
                n_tag, n_chars = spans[start + i]
                tag_lp[start + i] = token_lp[i, :n_tag].sum()
                body_lp[start + i] = token_lp[i, n_tag:len(row) - 1].sum()
                chars[start + i] = n_chars
        return tag_lp, body_lp, chars

    def sample(self, tag: str, n: int, max_new_tokens: int, seed: int) -> list[str]:
        """`n` bodies generated after `tag` (ancestral sampling, temperature 1), cut at end-of-text."""
        import torch

        torch.manual_seed(seed)
        prompt = torch.tensor([[self.eos, *self._ids(tag)]]).repeat(n, 1)
        max_new_tokens = min(max_new_tokens, self.max_len - prompt.shape[1])
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                      top_p=1.0, temperature=1.0, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.eos, use_cache=True)
        texts = []
        for row in out[:, prompt.shape[1]:].tolist():
            row = row[:row.index(self.eos)] if self.eos in row else row
            texts.append(self.tokenizer.decode(row).strip())
        return texts


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


def evaluate_runs(exp: dict, runs_dir: Path, splits: Path, seed: int = 0) -> list[dict]:
    """One metric row per (strategy, metric); a run without a model is recorded, not fatal."""
    fmt = FORMATS[exp["data"]["format"]]
    settings = exp.get("evaluation") or {}
    settings = {"max_examples": 100, "samples_per_condition": 16, "conditions": [-6.0, -4.0, -2.0, 0.0],
                "extra_test_sets": {}, **settings}
    rows = []
    for strategy in exp["strategies"]:
        run = runs_dir / strategy
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        status = summary.get("status", "missing")
        base = {"experiment": exp["name"], "strategy": strategy, "run_status": status}
        if status != "ok" or not (run / "model").is_dir():
            reason = summary.get("reason") or "no saved model (training.save_model off?)"
            rows.append({**base, **metric(fmt.domain, "-", "not_evaluated", float("nan"), float("nan"), "-", 0, reason)})
            continue
        lm = LanguageModel(run / "model")
        for row in DOMAIN_EVALUATORS[fmt.domain](lm, fmt, splits, settings, seed):
            rows.append({**base, **row})
    return rows


COLUMNS = ["experiment", "strategy", "run_status", "domain", "test_set", "metric", "value", "baseline",
           "baseline_name", "n", "note"]


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab.science.evaluate --experiment-config exp.json --runs DIR --splits DIR --out CSV`."""
    import argparse

    parser = argparse.ArgumentParser(prog="shardlab.science.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment-config", type=Path, required=True, help="resolved experiment JSON")
    parser.add_argument("--runs", type=Path, required=True, help="results/<experiment>/runs")
    parser.add_argument("--splits", type=Path, required=True, help="the experiment's saved splits")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny forwards: extra threads only spin against each other (24 s vs 1.4 s measured)
    exp = json.loads(args.experiment_config.read_text())
    rows = evaluate_runs(exp, args.runs, args.splits, seed=exp["training"]["seed"])
    write_rows(rows, args.out)
    for row in rows:
        print(f"{row['strategy']:>16s} {row['test_set']:>10s} {row['metric']:>28s} {row['value']:.4g} "
              f"(baseline {row['baseline']:.4g}: {row['baseline_name']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
