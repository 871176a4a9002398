"""The science base model: the tokenizer choice, document windows, the learning-rate schedule, the
bootstrap intervals of the domain metrics, and pretraining followed by fine-tuning that really
starts from the pretrained weights."""

from __future__ import annotations

import copy
import json
import math
import os

import numpy as np
import pytest
import torch

from helpers import REPO, TEST_EXPERIMENT
from shardlab.config import deep_merge
from shardlab.core.data import TokenBatches, fit_tokenizer
from shardlab.errors import ConfigError
from shardlab.core.model import padded_vocab_size, snapshot_dir, snapshots
from shardlab.runner.loop import learning_rate, snapshot_due
from shardlab.science import tokenization
from shardlab.science.domains import compared
from shardlab.core.bootstrap import bootstrap_interval
from shardlab.science.measures import quality_indicators, unigram_nll
from shardlab.study import check_pretrain


# --- tokenizer ----------------------------------------------------------------------------------
class TwoCharTokenizer:
    """A stand-in with a known cut: every body in tokens of two characters (the last may be one)."""

    def __len__(self):
        return 10

    def __call__(self, texts, add_special_tokens=False, return_offsets_mapping=False):
        offsets = [[(i, min(i + 2, len(t))) for i in range(0, len(t), 2)] for t in texts]
        ids = [[hash(t[a:b]) for a, b in o] for t, o in zip(texts, offsets)]
        self.strings = {hash(t[a:b]): t[a:b] for t, o in zip(texts, offsets) for a, b in o}
        return {"input_ids": ids, "offset_mapping": offsets}

    def convert_ids_to_tokens(self, ids):
        return [self.strings[i] for i in ids]


def test_units_of_each_domain():
    assert tokenization.unit_boundaries("[nH]1ccBr", tokenization.UNITS["chemistry"]) == {4, 5, 6, 7}
    assert tokenization.unit_boundaries("CCl", tokenization.UNITS["chemistry"]) == {1}
    assert tokenization.unit_boundaries("Fe2O3", tokenization.UNITS["materials"]) == {2, 3, 4}
    assert tokenization.unit_boundaries("MKV", tokenization.UNITS["biology"]) == {1, 2}


def test_crossing_rare_and_length_on_a_known_cut():
    # "CCl" = C|Cl -> tokens "CC" (straddles the boundary at 1), "l"; "CO" = C|O -> "CO" straddles too.
    row = tokenization.measure(TwoCharTokenizer(), "pairs", "chemistry", ["CCl"] * 25, ["CCl", "CO"])
    assert row["unit_crossing_fraction"] == pytest.approx(2 / 3)
    assert row["tokens_per_char"] == pytest.approx(3 / 5)
    assert row["rare_token_fraction"] == pytest.approx(1 / 3)  # "CO" never occurs in training
    assert row["types_used"] == 2


def test_char_tokenizer_is_one_token_per_character_and_round_trips():
    docs = ["<logS=-2.0> CCO[nH]Cl", "<gap=1.25> Fe2O3", "<class=c> MKLLA"]
    tok = fit_tokenizer("char", docs)
    assert len(tok) == len(set("".join(docs))) + 1  # + end-of-text
    ids = tok(docs[0], add_special_tokens=False)["input_ids"]
    assert len(ids) == len(docs[0]) and tok.decode(ids) == docs[0]
    with pytest.raises(ValueError, match="unknown tokenizer"):
        fit_tokenizer("words", docs)


def test_the_choice_follows_the_measurements():
    rows = [{"domain": "chemistry", "tokenizer": "char", "unit_crossing_fraction": 0.0, "rare_token_fraction": 0.0,
             "tokens_per_char": 1.0},
            {"domain": "chemistry", "tokenizer": "bpe", "unit_crossing_fraction": 0.24, "rare_token_fraction": 0.0,
             "tokens_per_char": 0.7},
            {"domain": "materials", "tokenizer": "char", "unit_crossing_fraction": 0.0, "rare_token_fraction": 0.002,
             "tokens_per_char": 1.0},
            {"domain": "materials", "tokenizer": "bpe", "unit_crossing_fraction": 0.0, "rare_token_fraction": 0.001,
             "tokens_per_char": 0.9}]
    decisions = {d["domain"]: d for d in tokenization.choose(rows)}
    assert decisions["chemistry"]["chosen"] == "char" and "24%" in decisions["chemistry"]["reason"]
    assert decisions["materials"]["chosen"] == "bpe"  # both keep inside units; fewer rare tokens wins
    assert tokenization.shared_choice(list(decisions.values())) == "char"
    assert tokenization.shared_choice([decisions["materials"]]) == "bpe"


def test_bpe_straddles_smiles_atoms_and_residues_on_the_shipped_data():
    """The measurement the default study's choice rests on, on real rows: the fitted BPE merges across
    SMILES atoms and residues; characters never do."""
    from shardlab.pretrain import bodies, domain_documents, union

    from shardlab.study import load_study_file

    corpora = load_study_file(REPO / "config/config.yaml", REPO).pretrain_settings("science-base")["corpora"]
    corpora = [dict(c, max_documents=300) for c in corpora]
    docs = domain_documents(corpora, REPO)
    texts = union({domain: parts["train"] for domain, parts in docs.items()}, 0)
    rows = tokenization.compare(bodies(docs, corpora), texts, 512)
    crossing = {(r["domain"], r["tokenizer"]): r["unit_crossing_fraction"] for r in rows}
    assert crossing[("chemistry", "bpe")] > 0.05 and crossing[("biology", "bpe")] > 0.05
    assert all(crossing[(d, "char")] == 0 for d in ("chemistry", "biology", "materials"))
    assert tokenization.shared_choice(tokenization.choose(rows)) == "char"


# --- data windows and the learning rate ----------------------------------------------------------
def test_document_windows_start_at_a_document():
    eos = 0
    stream = np.array([eos, 5, 6, 7, eos, 8, 9, eos, 5, 5, 5, 5, eos, 6, 6, eos] * 20, dtype=np.int32)
    batches = TokenBatches(stream, seq_len=4, global_batch_size=16, seed=3, document_token=eos)
    for step in range(5):
        inputs, _ = batches.global_batch(step)
        assert (inputs[:, 0] == eos).all()
    anywhere = TokenBatches(stream, seq_len=4, global_batch_size=64, seed=3)
    assert (anywhere.global_batch(0)[0][:, 0] != eos).any()


def test_cosine_schedule():
    training = {"lr": 1.0, "steps": 101, "lr_schedule": "cosine", "lr_warmup_steps": 10}
    assert learning_rate(training, 0) == pytest.approx(0.1)
    assert learning_rate(training, 9) == pytest.approx(1.0)
    assert learning_rate(training, 100) == pytest.approx(0.1)
    assert learning_rate(training, 55) == pytest.approx(0.55)  # half-way down the cosine
    assert learning_rate(dict(training, lr_schedule="constant"), 100) == 1.0


def test_snapshots_are_due_every_n_steps_but_not_at_the_last():
    training = {"steps": 32, "save_model_every": 16}
    assert [step + 1 for step in range(32) if snapshot_due(training, step)] == [16]  # 32 is the final model
    assert [step + 1 for step in range(10) if snapshot_due({"steps": 10, "save_model_every": 3}, step)] == [3, 6, 9]
    assert not any(snapshot_due({"steps": 10}, step) for step in range(10))


def test_a_runs_snapshots_are_found_in_step_order(tmp_path):
    for n in (16, 8):
        (snapshot_dir(tmp_path, n)).mkdir(parents=True)
        (snapshot_dir(tmp_path, n) / "config.json").write_text("{}")
    snapshot_dir(tmp_path, 24).mkdir()  # a folder without a saved model in it is no snapshot
    assert snapshots(tmp_path) == {8: snapshot_dir(tmp_path, 8), 16: snapshot_dir(tmp_path, 16)}


# --- intervals ----------------------------------------------------------------------------------
def test_bootstrap_interval_of_a_mean():
    x = np.random.default_rng(0).normal(size=400)
    low, high = bootstrap_interval(lambda i: x[i].mean(), (len(x),), replicates=2000)
    half_width = 1.96 * x.std() / math.sqrt(len(x))  # the normal-theory interval of a mean
    assert low == pytest.approx(x.mean() - half_width, abs=0.03) and high == pytest.approx(x.mean() + half_width, abs=0.03)
    assert all(map(math.isnan, bootstrap_interval(lambda i: 1.0, (0,))))  # nothing to resample


def test_compared_paired_and_constant_baselines():
    model = np.array([1.0, 1.0, 0.0, 1.0] * 25)
    base = np.array([0.0, 1.0, 0.0, 0.0] * 25)
    stats = compared(lambda i: model[i].mean(), lambda i: base[i].mean(), (100,), "higher", seed=0)
    assert stats["value"] == 0.75 and stats["baseline"] == 0.25 and stats["beats_baseline"] is True
    assert stats["difference_low"] > 0.3 and stats["difference_high"] < 0.7
    worse = compared(lambda i: base[i].mean(), lambda i: model[i].mean(), (100,), "lower", seed=0)
    assert worse["beats_baseline"] is True  # lower is better, and it is lower
    blind = compared(lambda i: 0.05 * len(set(i)) / len(i), 0.0, (10,), "higher", seed=0)
    assert blind["baseline_low"] == blind["baseline_high"] == 0.0 and blind["beats_baseline"] is True


def test_smiles_quality_as_per_item_flags():
    flags = quality_indicators(["CCO", None, "CCO", "c1ccccc1", ""], training={"CCO"})
    assert flags["validity"].tolist() == [True, False, True, True, False]
    assert flags["uniqueness"].tolist() == [True, False, True]
    assert flags["novelty"].tolist() == [False, True]


def test_score_grid_is_bodies_by_tags():
    """Every body after every tag, in one call of `score`, laid out [body, tag]."""
    from shardlab.science.language_model import LanguageModel

    lm = LanguageModel.__new__(LanguageModel)  # no model: `score` is stubbed with a known answer
    lm.score = lambda tags, bodies: (np.array([float(t[1]) for t in tags]), np.array([10.0 * len(b) for b in bodies]),
                                     np.array([float(len(b)) for b in bodies]))
    tag_lp, body_lp, chars = lm.score_grid(["<1>", "<2>", "<3>"], ["A", "BBBB"])
    assert tag_lp.tolist() == [[1, 2, 3], [1, 2, 3]]
    assert body_lp.tolist() == [[10, 10, 10], [40, 40, 40]] and chars[:, 0].tolist() == [1, 4]


def test_unigram_nll_per_text():
    nll = unigram_nll(["AB"], ["A", "BB"])  # counts A1 B1 + add-one over {A, B}: p = 1/2 each
    assert nll == pytest.approx([math.log(2), 2 * math.log(2)])


# --- configuration -----------------------------------------------------------------------------
def _experiments(model_overrides: dict) -> dict:
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"model": {"source": "pretrain", "tokenizer": "char", **model_overrides}})
    science = {"format": "aqsoldb_logs", "split": {"seed": 0, "validation_fraction": 0.1, "test_fraction": 0.1}}
    return {"test": deep_merge(exp, {"data": science})}


def test_pretrain_settings_are_checked_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.pretrain"):
        check_pretrain(_experiments({}))
    with pytest.raises(ConfigError, match=r"pretrain\.experiments\[0\]"):
        check_pretrain(_experiments({"pretrain": {"experiments": ["nope"], "training": {}}}))
    with pytest.raises(ConfigError, match=r"max_documents\.other"):
        check_pretrain(_experiments({"pretrain": {"experiments": ["test"], "training": {}, "max_documents": {"other": 5}}}))
    local = {"test": deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"model": {"tokenizer": "auto"}})}
    with pytest.raises(ConfigError, match=r"model\.tokenizer"):
        check_pretrain(local)


def test_the_pretraining_run_of_the_default_study():
    """The first listed experiment's training, overridden by pretrain.training; the fine-tuning's
    snapshots (save_model_every) are not the base model's."""
    from shardlab.study import load_study_file, pretrain_settings

    study = load_study_file(REPO / "config/config.yaml", REPO)
    experiments = copy.deepcopy(study.experiments)
    experiments["science_chemistry"]["training"]["save_model_every"] = 16  # fine-tuning snapshots
    settings = pretrain_settings(experiments["science_chemistry"]["model"], experiments)
    training = settings["experiment"]["training"]
    assert training["save_model_every"] == 0 and training["save_model"] and training["steps"] == 400
    assert [c["corpus"] for c in settings["corpora"]] == ["aqsoldb_logs", "scop_class", "mp_gap"]


# --- pretrain, then fine-tune ------------------------------------------------------------------
def _first_step_loss(model_dir, tokens, exp) -> float:
    from shardlab.core.model import load_model
    from shardlab.strategies.base import causal_lm_loss

    inputs, labels = TokenBatches.from_file(tokens, exp["training"], exp["data"]).global_batch(0)
    with torch.no_grad():
        return float(causal_lm_loss(load_model(model_dir)(input_ids=inputs).logits, labels))


@pytest.mark.torchrun
def test_fine_tuning_starts_from_the_pretrained_weights(tmp_path):
    """Pretrain a small base model with the real rule's code, fine-tune it with the runner, and check
    the fine-tuning's first loss is the pretrained model's loss on that batch, not the initial model's
    (a run that silently started from random weights fails here)."""
    from shardlab.core.data import prepare_corpus
    from shardlab.pretrain import build_corpus, pretrain
    from shardlab.runner.launch import launch
    from shardlab.study import load_study_file, pretrain_settings

    study = load_study_file(REPO / "config/config.yaml", REPO)
    experiments = copy.deepcopy(study.experiments)
    model = copy.deepcopy(experiments["science_chemistry"]["model"])
    model["pretrain"].update(max_documents=200, training={"steps": 30, "global_batch_size": 16, "seq_len": 32,
                                                          "lr": 0.003, "eval_every": 0, "log_every": 10})
    model["pretrain"]["strategy"] = "single"
    model["name"] = "test-base"
    settings = pretrain_settings(model, experiments)
    base = tmp_path / "models" / "test-base"
    build_corpus(settings, base, REPO)
    record = pretrain(settings, base)
    assert record["tokenizer_used"] == "char" and (base / "tokenizers.test-base.csv").is_file()
    assert record["pretraining"]["final_val_loss"] < math.log(record["vocab_size"])  # it learned something
    # The tokenizer's tokens, padded to embedding rows that split over TP degrees up to 128.
    assert record["shape"]["vocab_size"] == padded_vocab_size(record["vocab_size"]) > record["vocab_size"]
    # The base model learns the domains' language, not their conditions: no tag in its corpus, though
    # its tokenizer spells the tags the fine-tuning adds.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base / "pretraining" / "corpus")
    corpus = tokenizer.decode(np.load(base / "pretraining" / "corpus" / "tokens.npy").tolist())
    assert "C" in corpus and "<logS=" not in corpus and "<class=" not in corpus and "<gap=" not in corpus
    assert tokenizer.decode(tokenizer("<logS=-2.0>")["input_ids"]) == "<logS=-2.0>"

    exp = copy.deepcopy(experiments["science_chemistry"])
    exp["model"] = dict(record, source="pretrain")
    exp["data"] = dict(exp["data"], max_documents=300, path=str(REPO / exp["data"]["path"]))
    exp["training"] = dict(exp["training"], steps=3, warmup_steps=1, seq_len=32, global_batch_size=8, save_model=False, eval_every=0)
    exp["launch"] = dict(exp["launch"], world_size=1)
    prepare_corpus(exp["data"], exp["model"], base, tmp_path / "data")
    tokens = tmp_path / "data" / "tokens.npy"
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    summary = launch(exp, tmp_path / "exp.json", "single", base, tokens, tmp_path / "results" / "runs" / "single")
    assert summary["status"] == "ok", summary.get("reason")
    first = json.loads((tmp_path / "results" / "runs" / "single" / "metrics.jsonl").read_text().splitlines()[0])
    pretrained = _first_step_loss(base, tokens, exp)
    initial = _first_step_loss(base / "pretraining" / "init", tokens, exp)
    assert first["loss"] == pytest.approx(pretrained, rel=1e-5)
    assert abs(first["loss"] - initial) > 0.5  # the initial weights give a clearly different loss


def test_identical_weights_are_scored_once(tmp_path, monkeypatch):
    from shardlab.science import evaluate as ev

    calls = []
    monkeypatch.setattr(ev, "LanguageModel", lambda path, context=None: path)
    monkeypatch.setattr(ev, "DOMAIN_EVALUATORS", {"chemistry": lambda lm, *a: calls.append(lm) or [
        {"domain": "chemistry", "test_set": "t", "metric": "m", "value": float(len(calls)), "note": ""}]})
    for strategy, weights in (("single", b"a"), ("ddp", b"b"), ("fsdp2_full", b"b")):
        run = tmp_path / strategy
        (run / "model").mkdir(parents=True)
        (run / "model" / "model.safetensors").write_bytes(weights)
        (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    exp = {"name": "x", "strategies": ["single", "ddp", "fsdp2_full"], "data": {"format": "aqsoldb_logs"},
           "training": {"seq_len": 8, "steps": 4}}
    rows = ev.evaluate_runs(exp, tmp_path, tmp_path)
    assert len(calls) == 2  # single, then ddp; fsdp2_full's bytes equal ddp's
    assert [r["value"] for r in rows] == [1.0, 2.0, 2.0]
    assert rows[2]["strategy"] == "fsdp2_full" and "identical (sha256) to those of ddp after 4 steps" in rows[2]["note"]
    assert all(r["final"] and r["step"] == 4 for r in rows)


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def test_ordered_map_keeps_order_and_forks_only_when_given_workers():
    from shardlab.core.pool import ordered_map

    jobs = list(range(8))
    alone = ordered_map(_pid_and_square, jobs, workers=1)
    assert [r for _, r in alone] == [x * x for x in jobs] and {pid for pid, _ in alone} == {os.getpid()}
    forked = ordered_map(_pid_and_square, jobs, workers=2)
    assert [r for _, r in forked] == [x * x for x in jobs] and os.getpid() not in {pid for pid, _ in forked}


def test_a_fitted_vocabulary_is_padded_for_tensor_parallelism():
    assert [padded_vocab_size(n) for n in (1, 71, 128, 129)] == [128, 128, 128, 256]
    assert all(padded_vocab_size(71) % tp == 0 for tp in (2, 4, 8))


def test_a_gathered_state_dict_under_other_names_is_not_saved(tmp_path):
    """A strategy whose full_state_dict keeps its own names (pipeline stages did) would write a model whose
    weights all load as missing, that is random: saving it is an error naming the keys."""
    from transformers import GPTNeoXForCausalLM

    from shardlab.core.model import tiny_neox_config
    from shardlab.runner.worker import save_final_model

    model = GPTNeoXForCausalLM(tiny_neox_config({"vocab_size": 128, "hidden_size": 16, "num_layers": 2,
                                                 "num_heads": 2, "intermediate_size": 32}))

    class Staged:
        name = "pp_1f1b"

        def full_state_dict(self):
            return {f"0.{name}": t for name, t in model.state_dict().items()}

    with pytest.raises(RuntimeError, match="does not name the model's weights: missing .*gpt_neox"):
        save_final_model(Staged(), model, tmp_path, tmp_path / "model")
    assert not (tmp_path / "model").exists()
