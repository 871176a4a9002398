"""Science cases: shipped data, splits, conditional text, domain metrics, and saving the trained model."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from helpers import TEST_TOKENS_PER_STEP, assert_within
from shardlab.strategies import REGISTRY
from shardlab.study import load_study_file
from shardlab.tables.parity import tolerance
from shardlab.core.data import TEXT_FORMATS, read_documents
from shardlab.core.model import snapshots
from shardlab.science import domains, measures
from shardlab.science import evaluate as ev
from shardlab.science.language_model import LanguageModel
from shardlab.science.formats import BIOLOGY, CHEMISTRY, FORMATS, MATERIALS, parse_conditional
from shardlab.core.splits import PARTS, part_of, write_splits
from shardlab.tables import TableInputs
from shardlab.tables.science import build, time_to_target

REPO = Path(__file__).resolve().parents[1]

# (file, data rows, first column): the counts stated in data/README.md.
SHIPPED = [
    ("data/chemistry/aqsoldb.csv", 9982, "SMILES"),
    ("data/biology/scop.train.csv", 15680, "seq"),
    ("data/biology/scop.test.csv", 3921, "seq"),
    ("data/materials/mp_gap.csv", 106113, "formula"),
    ("data/materials/expt_gap.csv", 4604, "formula"),
]


# --- data rules -------------------------------------------------------------------------------
@pytest.mark.parametrize("path,rows,key", SHIPPED)
def test_shipped_files_have_the_documented_rows_and_attribution(path, rows, key):
    with open(REPO / path, newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames[0] == key
        assert sum(1 for _ in reader) == rows
    readme = (REPO / "data/README.md").read_text()
    line = next((l for l in readme.splitlines() if f"`{path.removeprefix('data/')}" in l), None)
    assert line is not None, f"no attribution row for {path} in data/README.md"
    assert f"{rows:,}" in line, f"the README row of {path} does not state {rows:,} rows"
    assert any(lic in line for lic in ("CC0", "CC-BY", "MIT")), f"no licence on the row of {path}"


def test_splits_are_deterministic_disjoint_and_complete(tmp_path):
    source = REPO / "data/chemistry/aqsoldb.csv"
    split = {"seed": 3, "validation_fraction": 0.1, "test_fraction": 0.1}
    first = write_splits(source, split, tmp_path / "a")
    again = write_splits(source, split, tmp_path / "b")
    other = write_splits(source, dict(split, seed=4), tmp_path / "c")
    assert {p: v["sha256"] for p, v in first["parts"].items()} == {p: v["sha256"] for p, v in again["parts"].items()}
    assert first["parts"]["test"]["sha256"] != other["parts"]["test"]["sha256"]
    keys = {p: [r["SMILES"] for r in csv.DictReader(open(tmp_path / "a" / f"{p}.csv"))] for p in PARTS}
    assert sum(len(v) for v in keys.values()) == 9982  # every row in exactly one part
    for a in PARTS:
        for b in PARTS:
            if a < b:
                assert not set(keys[a]) & set(keys[b]), f"{a} and {b} share molecules"
    assert 0.07 < len(keys["test"]) / 9982 < 0.13 and 0.07 < len(keys["validation"]) / 9982 < 0.13


def test_training_reads_exactly_the_saved_train_split(tmp_path):
    data = {"path": REPO / "data/materials/expt_gap.csv", "split": {"seed": 0}}
    write_splits(data["path"], data["split"], tmp_path)
    saved = [MATERIALS(r) for r in csv.DictReader(open(tmp_path / "train.csv"))]
    docs, skipped = read_documents(data["path"], "mp_gap", None, data["split"], "train")
    assert docs == [d for d in saved if d] and skipped == saved.count(None)


def test_a_shipped_test_file_is_the_test_part(tmp_path):
    split = {"seed": 0, "validation_fraction": 0.1, "test_path": "data/biology/scop.test.csv"}
    manifest = write_splits(REPO / "data/biology/scop.train.csv", split, tmp_path, base_dir=REPO)
    assert manifest["parts"]["test"]["rows"] == 3921
    assert manifest["parts"]["train"]["rows"] + manifest["parts"]["validation"]["rows"] == 15680


def test_part_of_ignores_row_order_and_duplicates_stay_together():
    assert part_of("CCO", 0, 0.1, 0.1) == part_of("CCO", 0, 0.1, 0.1)
    parts = [part_of(f"key{i}", 0, 0.2, 0.3) for i in range(5000)]
    assert abs(parts.count("test") / 5000 - 0.3) < 0.03 and abs(parts.count("validation") / 5000 - 0.2) < 0.03


def test_science_configs_are_valid():
    for name in ("config/config.yaml", "config/test.yaml"):
        study = load_study_file(REPO / name, base_dir=REPO)
        science = [e for e in study.experiments.values() if e["data"]["format"] in FORMATS]
        assert science, f"{name} has no science experiment"
    study = load_study_file(REPO / "config/config.yaml", base_dir=REPO)
    parallel = set()
    for domain in ("chemistry", "biology", "materials"):
        exp = study.experiments[f"science_{domain}"]
        assert "single" in exp["strategies"]  # the reference every parallel fine-tuning is checked against
        assert exp["training"]["save_model"] and exp["training"]["eval_every"] > 0
        parallel |= set(exp["strategies"]) - {"single"}
    # Replicated and sharded data parallelism, tensor and pipeline parallelism all fine-tune a case.
    assert {REGISTRY[s].family.value for s in parallel} >= {"data parallel", "zero", "tensor parallel",
                                                             "pipeline parallel"}


# --- conditional text -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,path", [(CHEMISTRY, "data/chemistry/aqsoldb.csv"),
                                      (BIOLOGY, "data/biology/scop.test.csv"),
                                      (MATERIALS, "data/materials/expt_gap.csv")])
def test_formats_are_registered_and_round_trip_on_real_rows(fmt, path):
    assert TEXT_FORMATS[fmt.name] is fmt
    rows = list(csv.DictReader(open(REPO / path)))[:500]
    for row in rows:
        text = fmt(row)
        label, body = fmt.parse(text)
        expected = fmt.bin(float(row[fmt.label_column])) if fmt.numeric else row[fmt.label_column]
        assert (label, body) == (expected, row[fmt.body_column].strip())
        assert fmt.text(label, body) == text  # a binned label formats to the same tag


def test_binning_and_tags():
    assert CHEMISTRY(dict(SMILES="CCO", Solubility="-3.24")) == "<logS=-3.0> CCO"
    assert CHEMISTRY(dict(SMILES="CCO", Solubility="-3.26")) == "<logS=-3.5> CCO"
    assert MATERIALS(dict(formula="K4Mn4O8", target="1.3322")) == "<gap=1.25> K4Mn4O8"
    assert MATERIALS(dict(formula="Cr3Ni1", target="-0.01")) == "<gap=0.00> Cr3Ni1"  # no "-0.00"
    assert BIOLOGY(dict(seq="MSPF", label="c")) == "<class=c> MSPF"
    assert parse_conditional("<gap=0.50> NaCl") == ("gap", "0.50", "NaCl")
    assert MATERIALS.candidate_labels(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError):
        CHEMISTRY.parse("<gap=1.00> NaCl")
    with pytest.raises(ValueError):
        parse_conditional("CCO")


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("seq,label\nMSPF,c\n,a\nMKV,\nMK V,b\nmkv,a\nMKVL,d\n")  # empty seq, empty label, space, lower case
    docs, skipped = read_documents(bad, "scop_class")
    assert docs == ["<class=c> MSPF", "<class=d> MKVL"] and skipped == 4
    bad.write_text("formula,target\nNaCl,5.0\nKCl,n/a\n,1.0\nLiF,nan\nMgO,inf\nCsI,6.1\n")
    docs, skipped = read_documents(bad, "mp_gap")
    assert docs == ["<gap=5.00> NaCl", "<gap=6.00> CsI"] and skipped == 4
    bad.write_text("SMILES,Solubility\nCCO,1.1\nCCO,not-a-number\n  ,0.0\n")
    docs, skipped = read_documents(bad, "aqsoldb_logs")
    assert docs == ["<logS=1.0> CCO"] and skipped == 2


# --- domain metrics on hand-made cases --------------------------------------------------------
def test_smiles_validity_uniqueness_novelty():
    # "C1CC" has an unclosed ring, "xyz" is not SMILES, "" is empty; "OCC" is ethanol again.
    quality = measures.smiles_quality(["CCO", "C1CC", "", "OCC", "xyz", "c1ccccc1", "CCO junk"], training={"CCO"})
    assert quality["validity"] == pytest.approx(3 / 7)  # "CCO junk" is not one molecule
    assert quality["uniqueness"] == pytest.approx(2 / 3)
    assert quality["novelty"] == pytest.approx(1 / 2)  # benzene is new, ethanol is not
    assert math.isnan(measures.smiles_quality(["C1CC"], set())["uniqueness"])


def test_esol_orders_known_solubilities_and_spearman():
    ethanol, benzene, anthracene = measures.esol_logs("CCO"), measures.esol_logs("c1ccccc1"), measures.esol_logs("c1ccc2cc3ccccc3cc2c1")
    assert ethanol > benzene > anthracene  # measured logS: 1.1 > -1.6 > -6.4
    assert measures.esol_logs("not smiles") is None
    assert measures.spearman([1, 2, 3, 4], [10, 20, 25, 100]) == pytest.approx(1.0)
    assert measures.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(measures.spearman([1, 1, 1], [1, 2, 3]))
    # Ties share their mean rank: x ranks (0.5, 0.5, 2, 3), y ranks (0, 1, 2, 3); Pearson of those by hand.
    assert measures._ranks(np.array([2.0, 2.0, 5.0, 7.0])).tolist() == [0.5, 0.5, 2.0, 3.0]
    assert measures._ranks(np.array([3.0, 1.0, 3.0, 3.0])).tolist() == [2.0, 0.0, 2.0, 2.0]
    assert measures.spearman([2, 2, 5, 7], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5), rel=1e-12)


def test_classification_accuracy_and_majority_baseline():
    scores = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.5, 0.1, 0.4], [0.2, 0.2, 0.6]]))
    assert measures.class_hits(scores, ["a", "b", "c"], ["a", "b", "c", "c"]).mean() == pytest.approx(0.75)
    assert measures.majority_accuracy(["c", "c", "a"], ["a", "b", "c", "c"]) == ("c", pytest.approx(0.5))


def test_band_gap_posterior_median_and_mae():
    candidates = [0.0, 0.5, 1.0, 1.5]
    certain = np.log(np.array([[1e-9, 1.0, 1e-9, 1e-9], [1e-9, 1e-9, 1e-9, 1.0]]))
    assert list(measures.posterior_median(certain, candidates)) == [0.5, 1.5]
    split = np.log(np.array([[0.3, 0.1, 0.1, 0.5]]))  # cdf 0.3, 0.4, 0.5 -> median at 1.0
    assert list(measures.posterior_median(split, candidates)) == [1.0]
    assert measures.mean_absolute_error([0.5, 1.5], [1.0, 1.0]) == pytest.approx(0.5)


def test_unigram_baselines():
    assert measures.unigram_perplexity(["ACGT" * 10], ["GATTACA"]) == pytest.approx(4.0)
    samples = measures.unigram_samples(["CCO", "CCCC"], 20, seed=0)
    assert len(samples) == 20 and set("".join(samples)) <= set("CO") and {len(s) for s in samples} <= {3, 4}


@pytest.fixture(scope="module")
def tiny_biology_lm(tmp_path_factory):
    """A random tiny model with a tokenizer fitted to SCOP text, and the saved SCOP splits."""
    from shardlab.core.data import fit_tokenizer
    from shardlab.core.model import build_local_model

    root = tmp_path_factory.mktemp("bio")
    split = {"seed": 0, "validation_fraction": 0.1, "test_path": "data/biology/scop.test.csv"}
    write_splits(REPO / "data/biology/scop.train.csv", split, root / "splits", base_dir=REPO)
    docs, _ = read_documents(REPO / "data/biology/scop.train.csv", "scop_class", 300, split, "train")
    build_local_model({"vocab_size": 320, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                       "intermediate_size": 64, "max_position_embeddings": 64}, root / "model")
    fit_tokenizer("bpe", docs, 320).save_pretrained(root / "model")
    return LanguageModel(root / "model", batch_size=3), root / "splits"


def test_scores_split_tag_and_body_exactly(tiny_biology_lm):
    """Scoring tag and body apart equals one forward pass over the whole text; long bodies are cut."""
    import torch

    lm, _ = tiny_biology_lm
    tags, bodies = ["<class=a>", "<class=g>"], ["MKVLAAGIVG", "MSPFTGSAAPTPEWRHLRVEITDGVATVTLARPDKLNALTFEAYADLRDLLAEL" * 3]
    tag_lp, body_lp, chars = lm.score(tags, bodies)
    ids = [lm.eos, *lm._ids(f"{tags[0]} {bodies[0]}"), lm.eos]
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0]
    whole = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).sum()
    assert tag_lp[0] + body_lp[0] == pytest.approx(float(whole), abs=1e-4)
    assert chars[0] == len(bodies[0]) and 0 < chars[1] < len(bodies[1])  # context 64 tokens: cut


def test_biology_evaluation_rows_on_a_random_model(tiny_biology_lm):
    lm, splits = tiny_biology_lm
    rows = {r["metric"]: r for r in domains.evaluate_biology(lm, BIOLOGY, splits, {"max_examples": 12}, seed=0)}
    assert rows["class_accuracy"]["n"] == 12 and 0 <= rows["class_accuracy"]["value"] <= 1
    assert rows["class_accuracy"]["baseline_name"] == "majority class 'c'"
    assert rows["residue_perplexity"]["value"] > 1 and 15 < rows["residue_perplexity"]["baseline"] < 21


def _gain_rows(before: np.ndarray, after: np.ndarray, better: str = "lower") -> list[dict]:
    """fine_tuning_gains on one run whose base and final model scored these per-row values."""
    def scored_rows(values):
        return [{"domain": "materials", "test_set": "test", "metric": "gap_mae_eV", "value": float(values.mean()),
                 "low": 0.0, "high": 9.0, "better": better, "n": len(values), "note": "", "per_example": values},
                {"domain": "materials", "test_set": "test", "metric": "no_rows", "value": 1.0, "note": ""}]

    row = {"experiment": "science_materials", "strategy": "single", "run_status": "ok"}
    start = ev.ModelPoint(Path("base"), "base", final=False, extra_test_sets=True, row={**row, "step": 0})
    end = ev.ModelPoint(Path("final"), "final", final=True, extra_test_sets=True, row={**row, "step": 8})
    return ev.fine_tuning_gains([start, end], {start: scored_rows(before), end: scored_rows(after)}, seed=0)


def test_fine_tuning_gain_is_the_paired_difference_and_can_fail():
    """A model that improves every row by 0.1 eV (while the rows themselves spread over 2 eV) shows a
    paired interval that excludes zero; the same rows unchanged, or worsened, do not count as taught."""
    rng = np.random.default_rng(0)
    before = rng.uniform(0.0, 2.0, 60)
    (gain,) = _gain_rows(before, before - 0.1)  # only metrics with per-row values are compared
    assert gain["compared_with"] == ev.BASE_MODEL and gain["metric"] == "gap_mae_eV" and gain["final"]
    assert gain["baseline"] == pytest.approx(before.mean()) and gain["value"] == pytest.approx(before.mean() - 0.1)
    assert gain["difference_low"] == pytest.approx(-0.1) and gain["difference_high"] == pytest.approx(-0.1)
    assert gain["beats_baseline"] is True
    noisy = before + rng.normal(0.0, 0.3, 60)  # changed rows, no change on average
    assert _gain_rows(before, noisy)[0]["beats_baseline"] is False
    assert _gain_rows(before, before + 0.1)[0]["beats_baseline"] is False
    assert _gain_rows(before, before + 0.1, better="higher")[0]["beats_baseline"] is True


# --- tables -------------------------------------------------------------------------------------
def _science_inputs() -> TableInputs:
    """A materials experiment with two finished runs and one out of memory, its evaluation table, and a
    non-science experiment the builder must leave out."""
    exp = {"name": "science_materials", "strategies": ["single", "ddp", "fsdp2_full"], "data": {"format": "mp_gap"},
           "training": {"steps": 2}}
    other = {"name": "plain", "strategies": ["single"], "data": {"format": "smiles"}, "training": {"steps": 2}}
    summaries = [{"experiment": "plain", "strategy": "single", "status": "ok", "final_val_loss": 1.0,
                  "step_log": [{"step": 0, "elapsed_s": 1.0, "val_loss": 1.0}]},
                 {"experiment": "science_materials", "strategy": "fsdp2_full", "status": "oom",
                  "reason": "rank 0: OutOfMemoryError", "ranks": [], "step_log": []}]
    for strategy, losses in (("single", [4.0, 3.0]), ("ddp", [3.8, 2.5])):
        summaries.append({"experiment": "science_materials", "strategy": strategy, "status": "ok", "world_size": 2,
                          "final_val_loss": losses[-1], "tokens_per_s": 10.0,
                          "ranks": [{"peak_bytes": 5}, {"peak_bytes": 7}],
                          "step_log": [{"step": i, "elapsed_s": i + 1.0, "val_loss": v} for i, v in enumerate(losses)]})
    metrics = pd.DataFrame([{"experiment": "science_materials", "strategy": "single", "run_status": "ok", "step": step,
                             "final": step == 2, "domain": "materials", "test_set": "test", "metric": "gap_mae_eV",
                             "value": value, "baseline": baseline, "baseline_name": "training mean", "n": 10, "note": "",
                             "compared_with": against, "better": "lower", "beats_baseline": value < baseline,
                             "difference_low": value - baseline - 0.05, "difference_high": value - baseline + 0.05}
                            for step, value, baseline, against in ((2, 1.0, 1.2, "trivial baseline"),
                                                                   (0, 1.3, 1.2, "trivial baseline"),
                                                                   (1, 1.1, 1.2, "trivial baseline"),
                                                                   (2, 1.0, 1.3, ev.BASE_MODEL))])
    return TableInputs(summaries, {"science_materials": exp, "plain": other}, {},
                       {"science_metrics.science_materials": metrics})


def test_published_figures_sit_beside_the_measured_metric_they_match():
    from shardlab.tables.science import PUBLISHED, published_rows

    finals = pd.DataFrame({"domain": ["materials"] * 3 + ["chemistry"], "metric": ["gap_mae_eV"] * 3 + ["validity"],
                           "test_set": ["test", "test", "expt_gap", "sampled"], "value": [1.3, 1.5, 1.0, 0.7],
                           "low": [1.1, 1.3, 0.9, 0.6], "high": [1.5, 1.7, 1.1, 0.8],
                           "better": ["lower"] * 3 + ["higher"]})
    references = [{"domain": "materials", "metric": "gap_mae_eV", "test_set": "test", "value": 0.27},
                  {"domain": "materials", "metric": "gap_mae_eV", "test_set": "expt_gap", "value": 0.33},
                  {"domain": "chemistry", "metric": "validity", "value": 0.97}]  # no test set: any
    table = published_rows(finals, references).set_index(["metric", "test_set"])
    assert table.loc[("gap_mae_eV", "test"), ["value", "published", "runs"]].tolist() == pytest.approx([1.4, 0.27, 2])
    assert table.loc[("gap_mae_eV", "expt_gap"), "published"] == 0.33
    assert table.loc[("validity", "sampled"), "published"] == 0.97
    assert len(published_rows(finals, references[:1])) == 1  # a metric without a reference has no row
    # The shipped references: every one names its source and how it differs; each figure is one the
    # evaluators measure (a typo in a metric name would leave it out of the report silently).
    shipped = yaml.safe_load(PUBLISHED.read_text())
    measured = {("chemistry", m) for m in ("logs_mae", "validity", "uniqueness", "novelty", "condition_tracking_spearman")}
    measured |= {("biology", "class_accuracy"), ("biology", "residue_perplexity"), ("materials", "gap_mae_eV")}
    assert {(r["domain"], r["metric"]) for r in shipped} == measured
    assert all(r["source"] and r["differs"] and (r["value"] is None or r["url"]) for r in shipped)


def test_time_to_target_and_the_science_tables():
    assert time_to_target([(1.0, 5.0), (2.0, 3.9), (3.0, 3.5)], 4.0) == 2.0
    assert time_to_target([(1.0, 5.0)], 4.0) is None
    tables = build(_science_inputs())
    runs = tables["science_runs"].set_index("strategy")
    assert list(runs.index) == ["single", "ddp", "fsdp2_full"] and set(tables["science_runs"]["experiment"]) == {
        "science_materials"}  # the experiment's order; the non-science experiment is left out
    assert (runs["target_val_loss"] == 3.0).all()  # the worst final loss: every finished run reaches it
    assert runs.loc["single", "time_to_target_s"] == 2.0 and runs.loc["ddp", "time_to_target_s"] == 2.0
    assert pd.isna(runs.loc["fsdp2_full", "time_to_target_s"]) and runs.loc["fsdp2_full", "status"] == "oom"
    assert runs.loc["ddp", "peak_bytes_max_rank"] == 7 and runs.loc["ddp", "domain"] == "materials"
    assert runs.loc["ddp", "steps"] == 2 and pd.isna(runs.loc["fsdp2_full", "steps"])
    curves = tables["science_curves"]
    assert len(curves) == 4 and list(curves[curves.strategy == "ddp"]["step"]) == [1, 2]
    assert list(tables["science_metrics"].columns) == [*ev.COLUMNS, "metric_title"] and len(tables["science_metrics"]) == 1
    assert tables["science_metrics"]["value"].tolist() == [1.0]  # the final model's row only
    assert tables["science_fine_tuning"][["value", "baseline"]].values.tolist() == [[1.0, 1.3]]
    domain_curve = tables["science_domain_curves"]
    assert domain_curve["step"].tolist() == [0, 1, 2] and domain_curve["value"].tolist() == [1.3, 1.1, 1.0]
    # One row per metric, its verdicts over the runs computed once (every count in the report counts these rows).
    outcome = tables["science_outcomes"].set_index("metric").loc["gap_mae_eV"]
    assert outcome["metric_title"] == "band-gap error (eV)" and (outcome["value"], outcome["before"]) == (1.0, 1.3)
    assert (outcome["beats_baseline"], outcome["improved"], outcome["worse"]) == ("every run", "every run", "no run")


def test_science_tables_without_evaluations_keep_their_columns():
    inputs = _science_inputs()
    inputs.tables.clear()
    assert list(build(inputs)["science_metrics"].columns) == [*ev.COLUMNS, "metric_title"]


# --- the trained model leaves the run (real torchrun) --------------------------------------------
def _saved_weights(summary):
    return _weights(Path(summary["attempt"]) / "model")


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    assert files, f"no saved model in {model_dir}"
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


@pytest.mark.parity
@pytest.mark.torchrun
def test_saved_models_match_the_single_device_run_and_evaluate(run_strategy, tiny_assets, tmp_path):
    """training.save_model: every strategy's gathered weights equal the reference's after training, under the
    Hugging Face names: data parallel, FSDP2 shards, TP shards, pipeline stages, and TP shards inside stages."""
    # log_every and eval_every past the run: snapshots keep their own schedule, not the log's.
    save = {"training": {"save_model": True, "save_model_every": 1, "steps": 3, "log_every": 10, "eval_every": 0}}
    composed = {"strategy_options": {"composed": {"world_size": 4, "tp": 2, "pp": 2, "n_microbatches": 2}}}
    strategies = ["single", "ddp", "fsdp2_full", "tp", "pp_1f1b", "composed"]
    summaries = {s: run_strategy(s, {**save, **(composed if s == "composed" else {})})[0] for s in strategies}
    for name, summary in summaries.items():
        assert summary["status"] == "ok", summary.get("reason")
    reference = _saved_weights(summaries["single"])
    from safetensors.torch import load_file

    initial = load_file(next(Path(tiny_assets[0]).glob("*.safetensors")))
    assert any(not np.allclose(v, initial[k]) for k, v in reference.items())  # the saved model is the trained one
    tol = tolerance(max(float(v.abs().max()) for v in reference.values()), TEST_TOKENS_PER_STEP,
                    steps=save["training"]["steps"])
    for name in strategies[1:]:
        state = _saved_weights(summaries[name])
        assert state.keys() == reference.keys(), name
        assert_within(f"weights: {name}", max(float((state[k] - reference[k]).abs().max()) for k in reference), tol)
    # training.save_model_every: the gathered weights after steps 1 and 2 too, equal to the reference's.
    for name, summary in summaries.items():
        assert list(snapshots(summary["attempt"])) == [1, 2], name
    first = _weights(snapshots(summaries["single"]["attempt"])[1])
    assert any(not np.allclose(v, initial[k]) and not np.allclose(v, reference[k]) for k, v in first.items())
    for name in strategies[1:]:
        state = _weights(snapshots(summaries[name]["attempt"])[1])
        assert_within(f"weights after 1 step: {name}", max(float((state[k] - first[k]).abs().max()) for k in first),
                      tolerance(max(float(v.abs().max()) for v in first.values()), TEST_TOKENS_PER_STEP, steps=1))

    # The evaluator reads the run folders: a saved model is scored, a failed run is recorded.
    runs = Path(summaries["single"]["attempt"]).parent.parent.parent / "runs"
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text(json.dumps({"status": "oom", "reason": "rank 0: OutOfMemoryError"}))
    write_splits(REPO / "data/chemistry/aqsoldb.csv", {"seed": 0}, tmp_path / "splits")
    exp = {"name": "t", "strategies": ["single", "broken"], "data": {"format": "aqsoldb_logs"}, "training": {"seq_len": 32, "steps": 3},
           "evaluation": {"max_examples": 10, "samples_per_condition": 3, "conditions": [-4.0, 0.0]}}
    rows = ev.evaluate_runs(exp, runs, tmp_path / "splits", base_model=Path(tiny_assets[0]))
    single = [r for r in rows if r["strategy"] == "single"]
    assert {r["metric"] for r in single if r["final"]} >= {"validity", "uniqueness", "condition_tracking_spearman"}
    # A curve per metric: the base model (step 0), the snapshots, the final model (marked final).
    validity = {r["step"]: r for r in single if r["metric"] == "validity"}
    assert sorted(validity) == [0, 1, 2, 3] and [validity[s]["final"] for s in (0, 1, 2, 3)] == [False, False, False, True]
    broken = [r for r in rows if r["strategy"] == "broken"]
    assert len(broken) == 1 and broken[0]["run_status"] == "oom" and "OutOfMemory" in broken[0]["note"]
    # Scored by two forked processes at once: the same rows, in the same order (NaN equal to NaN).
    parallel = ev.evaluate_runs(exp, runs, tmp_path / "splits", base_model=Path(tiny_assets[0]), workers=2)
    assert pd.DataFrame(parallel).equals(pd.DataFrame(rows))


def test_hub_export_writes_the_shipped_columns(tmp_path):
    from datasets import Dataset

    from shardlab.science.sources import export_rows, parse_columns

    hub = Dataset.from_dict({"smiles": ["CCO", "c1ccccc1"], "logS": [1.1, -1.6], "extra": [0, 1]})
    n = export_rows(hub, parse_columns("SMILES=smiles, Solubility=logS"), tmp_path / "hub.csv")
    assert n == 2
    docs, skipped = read_documents(tmp_path / "hub.csv", "aqsoldb_logs")
    assert docs == ["<logS=1.0> CCO", "<logS=-1.5> c1ccccc1"] and skipped == 0
    with pytest.raises(KeyError):
        export_rows(hub, {"SMILES": "canonical_smiles"}, tmp_path / "bad.csv")
    with pytest.raises(ValueError):
        parse_columns("SMILES")


def test_a_failed_run_is_recorded_by_the_evaluation_not_fatal(tmp_path):
    """A run that failed (a TP run on a vocabulary it cannot split, say) leaves one not_evaluated row
    with its reason, and the evaluation of the experiment still exits 0."""
    (tmp_path / "runs" / "tp").mkdir(parents=True)
    (tmp_path / "runs" / "tp" / "summary.json").write_text(json.dumps({"status": "failed", "reason": "boom"}))
    exp = {"name": "science_chemistry", "strategies": ["tp"], "data": {"format": "aqsoldb_logs"},
           "training": {"steps": 3, "seed": 0, "seq_len": 32}}
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    out = tmp_path / "metrics.csv"
    assert ev.main(["--experiment-config", str(tmp_path / "exp.json"), "--runs", str(tmp_path / "runs"),
                    "--splits", str(tmp_path), "--out", str(out)]) == 0
    (row,) = pd.read_csv(out).to_dict("records")
    assert (row["metric"], row["run_status"], row["note"], row["compared_with"]) == (
        "not_evaluated", "failed", "boom", "trivial baseline")
