"""Corpus -> token file, and deterministic global batches drawn from it.

A *text format* turns one CSV row into one training document (or None to skip a malformed row).
Formats are registered by name (`register_text_format`); topics add their own (the science
formats register themselves when `shardlab.science.formats` is imported). For a locally built model a tokenizer (model.tokenizer: byte-level BPE or
characters) is fitted to the corpus; a hub or pretrained model uses its own tokenizer.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlab.core.splits import rows_of_part
from shardlab.errors import ConfigError, load_artifact

EOS = "<|endoftext|>"
TOKENIZERS = ("char", "bpe")  # what model.tokenizer may fit for a local or pretrained model


def smiles_text(row: dict) -> str | None:
    smiles = (row.get("SMILES") or "").strip()
    return smiles or None


#: name -> row formatter.
TEXT_FORMATS: dict[str, Callable[[dict], str | None]] = {"smiles": smiles_text}


def register_text_format(name: str, formatter: Callable[[dict], str | None]) -> None:
    if TEXT_FORMATS.get(name, formatter) is not formatter:
        raise ValueError(f"text format '{name}' is registered twice")
    TEXT_FORMATS[name] = formatter


def _rows(path: Path | str, split: dict | None, part: str | None):
    """The CSV's rows, or only those of one deterministic split part (`data.split`)."""
    if split and part:
        yield from rows_of_part(path, split, part)
        return
    with open(path, newline="") as fh:
        yield from csv.DictReader(fh)


def read_documents(path: Path | str, fmt: str, max_documents: int | None = None,
                   split: dict | None = None, part: str | None = None) -> tuple[list[str], int]:
    """The corpus' documents and how many malformed rows were skipped.

    With `split` (the `data.split` settings) and `part`, only rows of that part are read.
    """
    to_text = TEXT_FORMATS[fmt]
    docs, skipped = [], 0
    for row in _rows(path, split, part):
        text = to_text(row)
        if text is None:
            skipped += 1
            continue
        docs.append(text)
        if max_documents and len(docs) >= max_documents:
            break
    return docs, skipped


def fit_tokenizer(kind: str, docs: list[str], vocab_size: int | None = None):
    """A tokenizer fitted to the corpus (model.tokenizer), wrapped for transformers: `bpe`, a byte-level
    BPE of `vocab_size` tokens; `char`, one token per character seen (the same BPE trained to no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer '{kind}' (choose from {', '.join(TOKENIZERS)})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if kind == "bpe":
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:  # a vocabulary below the alphabet's size: the trainer keeps every character seen and merges nothing
        trainer = trainers.BpeTrainer(vocab_size=1, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def load_tokenizer(model_dir: Path | str):
    from transformers import AutoTokenizer

    return load_artifact("tokenizer", model_dir, lambda: AutoTokenizer.from_pretrained(model_dir))


def encode_documents(tokenizer, docs: list[str]) -> np.ndarray:
    """One stream: each document followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)


def check_vocabulary(tokens: np.ndarray, model_cfg: dict, model_dir: Path | str, corpus: str) -> None:
    """Every token id must have a row in the model's embedding; otherwise every run would fail at its
    first step with an index error, so say it here, before any run."""
    embeddings = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    needed = int(tokens.max()) + 1
    if needed > embeddings:
        raise ConfigError("model.vocab_size", f"model '{model_cfg['name']}' has {embeddings} token embeddings, but "
                                              f"corpus '{corpus}' tokenizes to ids up to {needed - 1}: set "
                                              f"vocab_size to at least {needed}")


def prepare_corpus(data_cfg: dict, model_cfg: dict, model_dir: Path | str, out_dir: Path | str) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    split = data_cfg.get("split")
    docs, skipped = read_documents(data_cfg["path"], data_cfg["format"], data_cfg.get("max_documents"),
                                   split, split and split.get("part", "train"))
    if model_cfg["source"] == "local":
        tokenizer = fit_tokenizer(model_cfg.get("tokenizer", "bpe"), docs, model_cfg.get("vocab_size"))
    else:
        tokenizer = load_tokenizer(model_dir)
    tokens = encode_documents(tokenizer, docs)
    check_vocabulary(tokens, model_cfg, model_dir, data_cfg["corpus"])
    tokenizer.save_pretrained(out_dir)
    np.save(out_dir / "tokens.npy", tokens)
    meta = {"corpus": data_cfg["corpus"], "documents": len(docs), "skipped_rows": skipped,
            "tokens": int(tokens.size), "vocab_size": len(tokenizer), "max_token_id": int(tokens.max())}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


class TokenBatches:
    """Deterministic global batches of random windows: batch `step` is the same on every rank and run.

    The first `1 - val_fraction` of the stream is for training, the rest for validation. With
    `document_token` (data.windows: documents) a window starts only at that token, the end-of-text
    before a document, so every sequence begins with a whole document: a conditional text's tag is
    then always in context, as it is when the model is scored or sampled after a tag.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int, val_fraction: float = 0.05,
                 document_token: int | None = None):
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        self.seq_len, self.batch, self.seed = seq_len, global_batch_size, seed
        if len(self.val) <= seq_len + 1:
            raise ValueError(f"corpus too small ({len(tokens)} tokens) for seq_len={seq_len}")
        self.streams = {"train": self.train, "val": self.val}
        self.starts = {part: self._starts(stream, document_token) for part, stream in self.streams.items()}

    def _starts(self, stream: np.ndarray, document_token: int | None) -> np.ndarray | None:
        if document_token is None:
            return None
        starts = np.flatnonzero(stream[: len(stream) - self.seq_len - 1] == document_token)
        if not starts.size:
            raise ValueError(f"no document start (token {document_token}) leaves room for seq_len={self.seq_len}")
        return starts

    @classmethod
    def from_file(cls, path: Path | str, training: dict, data: dict | None = None) -> "TokenBatches":
        document_token = None
        if (data or {}).get("windows") == "documents":
            document_token = load_tokenizer(Path(path).parent).eos_token_id  # saved beside the tokens
        return cls(np.load(path), training["seq_len"], training["global_batch_size"], training["seed"],
                   document_token=document_token)

    def _windows(self, part: str, rng: np.random.Generator, n: int):
        import torch

        stream, starts = self.streams[part], self.starts[part]
        if starts is None:
            starts = rng.integers(0, len(stream) - self.seq_len - 1, size=n)
        else:
            starts = starts[rng.integers(0, len(starts), size=n)]
        windows = np.stack([stream[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def global_batch(self, step: int):
        """(inputs, labels), each [global_batch_size, seq_len]; labels are inputs shifted by one."""
        return self._windows("train", np.random.default_rng([self.seed, step]), self.batch)

    def validation(self, n_batches: int = 4) -> Iterator:
        rng = np.random.default_rng([self.seed, 1 << 30])
        for _ in range(n_batches):
            yield self._windows("val", rng, self.batch)
