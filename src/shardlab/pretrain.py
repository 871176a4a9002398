"""The science base model (rule pretrain): one small GPT-NeoX pretrained on the language of the
science domains (the union of the experiments' training sequences, without their conditions), saved
like a hub checkpoint that each science experiment fine-tunes on the conditional task.

    python -m shardlab pretrain --settings JSON --out resources/models/<name> [--base-dir DIR] [--step STEP]

Steps (`--step corpus`, then `--step train`: the workflow's jobs pretrain_corpus and pretrain): read every listed experiment's training rows (never its validation or test rows) as
conditional text; measure the tokenizer candidates on each domain and pick one
(`shardlab.science.tokenization`, table tokenizers.<name>.csv beside the model), fitted on the
conditional text so that the tags have tokens; build the initial model; train it on the sequences
alone (SMILES, residues, formulas: no solubility, class or band-gap tag, so whatever the fine-tuned
model knows of the conditions, fine-tuning taught it) with the study's own runner (`pretrain.strategy`: progress, checkpoints, failure records);
copy the trained weights, the tokenizer and a record here. A failed pretraining fails the job with
the run's reason: nothing downstream can fine-tune without it.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np

from shardlab import cli
from shardlab.core.data import encode_documents, fit_tokenizer, read_documents
from shardlab.core.model import architecture, build_local_model, padded_vocab_size
from shardlab.science import tokenization
from shardlab.science.formats import FORMATS


def tokenizer_table(model: str) -> str:
    """The tokenizer comparison's file in the model folder, named after the model (tables key by stem)."""
    return f"{tokenization.TABLE_PREFIX}{model}.csv"


def domain_documents(corpora: list[dict], base_dir: Path) -> dict[str, dict[str, list[str]]]:
    """{domain: {"train": conditional texts, "validation": ...}} from each corpus' deterministic split."""
    out = {}
    for data in corpora:
        fmt = FORMATS[data["format"]]
        parts = {part: read_documents(base_dir / data["path"], data["format"], data.get("max_documents"),
                                      data["split"], part)[0] for part in ("train", "validation")}
        out[fmt.domain] = parts
    return out


def union(texts_by_domain: dict[str, list[str]], seed: int) -> list[str]:
    """Every domain's training texts in one seeded order, so no domain sits at the end of the stream
    (the runner's validation windows come from the stream's tail)."""
    texts = [t for domain_texts in texts_by_domain.values() for t in domain_texts]
    random.Random(seed).shuffle(texts)
    return texts


def bodies(docs: dict[str, dict[str, list[str]]], corpora: list[dict]) -> dict[str, tuple[list[str], list[str]]]:
    fmts = {FORMATS[d["format"]].domain: FORMATS[d["format"]] for d in corpora}
    return {domain: tuple([fmts[domain].parse(t)[1] for t in parts[p]] for p in ("train", "validation"))
            for domain, parts in docs.items()}


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def choose_tokenizer(model_cfg: dict, docs: dict, corpora: list[dict], texts: list[str], out: Path) -> str:
    """Measure the candidates on every domain, write the comparison beside the model, and return the
    tokenizer the base model uses (model.tokenizer, or the measured shared choice for 'auto')."""
    rows = tokenization.compare(bodies(docs, corpora), texts, model_cfg.get("vocab_size", 512))
    decisions = tokenization.choose(rows)
    kind = tokenization.shared_choice(decisions) if model_cfg["tokenizer"] == "auto" else model_cfg["tokenizer"]
    for row in rows:
        decision = next(d for d in decisions if d["domain"] == row["domain"])
        row.update(chosen_for_domain=decision["chosen"] == row["tokenizer"], used_by_base_model=row["tokenizer"] == kind,
                   reason=decision["reason"])
    write_csv(rows, out / tokenizer_table(model_cfg["name"]))
    for d in decisions:
        print(f"[pretrain] tokenizer for {d['domain']}: {d['chosen']} ({d['reason']})", flush=True)
    return kind


CORPUS_RECORD = "pretraining/corpus/corpus.json"  # what the training step needs of the corpus step


def build_corpus(settings: dict, out: Path, base_dir: Path) -> dict:
    """The corpus step (one thread): choose and fit the tokenizer, encode the sequences and build the
    initial model under `out`/pretraining; returns the corpus record."""
    model_cfg, corpora = settings["model"], settings["corpora"]
    work = out / "pretraining"
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    docs = domain_documents(corpora, base_dir)
    seed = model_cfg.get("seed", 0)
    texts = union({d: parts["train"] for d, parts in docs.items()}, seed)  # with their tags
    sequences = union({d: train for d, (train, _) in bodies(docs, corpora).items()}, seed)  # without
    print(f"[pretrain] {len(sequences):,} training sequences, their conditions left out: "
          + ", ".join(f"{d} {len(p['train']):,}" for d, p in docs.items()), flush=True)

    kind = choose_tokenizer(model_cfg, docs, corpora, texts, out)
    tokenizer = fit_tokenizer(kind, texts, model_cfg.get("vocab_size"))
    tokenizer.save_pretrained(work / "corpus")
    tokens = encode_documents(tokenizer, sequences)
    np.save(work / "corpus" / "tokens.npy", tokens)
    build_local_model({**model_cfg, "vocab_size": padded_vocab_size(len(tokenizer))}, work / "init")
    init_record = {"name": model_cfg["name"], "source": "local", "shape": architecture(work / "init" / "config.json")}
    (work / "init" / "shardlab_model.json").write_text(json.dumps(init_record))
    record = {"tokenizer_used": kind, "vocab_size": len(tokenizer), "documents": len(sequences),
              "corpus_tokens": int(tokens.size)}
    (out / CORPUS_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    return record


def pretrain(settings: dict, out: Path) -> dict:
    """The training step: train the initial model on the prepared corpus with the study's runner and
    save the result into `out`; returns its record."""
    from shardlab.runner.launch import launch

    model_cfg, exp = settings["model"], settings["experiment"]
    work = out / "pretraining"  # kept across job attempts: a checkpointed pretraining resumes
    corpus = json.loads((out / CORPUS_RECORD).read_text())
    exp_config = work / "experiment.json"
    exp_config.write_text(json.dumps(exp, indent=2, sort_keys=True))
    run = work / "runs" / exp["strategies"][0]  # the runner keeps attempts/ and checkpoints/ beside runs/
    summary = launch(exp, exp_config, exp["strategies"][0], work / "init", work / "corpus" / "tokens.npy", run)
    if summary["status"] != "ok":
        raise RuntimeError(f"pretraining {summary['status']}: {summary.get('reason')} (log: {run / 'run.log'})")
    for item in (run / "model").iterdir():
        shutil.copy2(item, out / item.name)
    record = {**model_cfg, "tokenizer_used": corpus["tokenizer_used"], "vocab_size": corpus["vocab_size"],
              "shape": architecture(out / "config.json"),
              "pretraining": {"documents": corpus["documents"], "conditions": False,
                              "corpus_tokens": corpus["corpus_tokens"], "steps": exp["training"]["steps"],
                              "final_val_loss": summary.get("final_val_loss"),
                              "train_wall_s": summary.get("train_wall_s"), "run": str(run)}}
    (out / "shardlab_model.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, type=cli.json_value,
                        help="JSON: {model, experiment, corpora} (shardlab.study.pretrain_settings)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base-dir", type=cli.existing_dir, default=Path("."),
                        help="what the corpora's paths are relative to")
    parser.add_argument("--step", choices=("corpus", "train", "all"), default="all",
                        help="corpus: tokenizer, tokens and initial model (one thread); train: the training run "
                             "on them (the workflow runs the two as separate jobs); all: both")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step in ("corpus", "all"):
        build_corpus(args.settings, args.out, args.base_dir)
    if args.step == "corpus":
        return 0
    try:
        record = pretrain(args.settings, args.out)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[pretrain] base model '{record['name']}' ready in {args.out}: final validation loss "
          f"{record['pretraining']['final_val_loss']:.4f} after {record['pretraining']['steps']} steps", flush=True)
    return 0
