"""A causal language model as a scorer of conditional text and a sampler after a tag.

Only the model's own likelihoods are used, so the same code evaluates the tiny local model and a
hub model (with its own tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class LanguageModel:
    """log p(tag, body) for conditional text, and sampling after a tag.

    Texts are scored as the training stream presents them: end-of-text, tag, " body", end-of-text.
    The byte-level pre-tokenizer always splits at the space after the tag, so tokenizing tag and
    body separately gives the same tokens as tokenizing the whole text.
    """

    def __init__(self, model_dir: Path | str, batch_size: int = 64, context: int | None = None):
        """`context`: the longest sequence scored or sampled (the training seq_len: positions beyond it
        were never trained); the model's own limit when None."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        # Eager attention: on one CPU thread a forward of 64 x 30 tokens took 18 ms against SDPA's 32 ms.
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        self.model.config.use_cache = True  # training saved it off; sampling needs the KV cache to be cheap
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.eos_token_id
        self.max_len = min(context or 1 << 30, getattr(self.model.config, "max_position_embeddings", 2048))
        # Embedding rows past the tokenizer's (vocabulary padding, core.model.padded_vocab_size) are never drawn.
        self.padding_ids = list(range(len(self.tokenizer), self.model.config.vocab_size)) or None
        self.batch_size = batch_size

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _ids_of(self, texts: set[str]) -> dict[str, list[int]]:
        """Each distinct text tokenized once (a grid repeats every tag and body many times)."""
        texts = sorted(texts)
        return dict(zip(texts, self.tokenizer(texts, add_special_tokens=False)["input_ids"])) if texts else {}

    def score(self, tags: list[str], bodies: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pair: (log p of the tag tokens, log p of the body tokens + end, body characters scored).

        Bodies longer than the model's context are cut; only the characters kept are counted. Pairs are
        batched by length, so a batch pads little."""
        import torch

        tag_ids, body_ids = self._ids_of(set(tags)), self._ids_of({" " + body for body in bodies})
        rows, spans = [], []
        for tag, body in zip(tags, bodies):
            tag_row, body_row = tag_ids[tag], body_ids[" " + body]
            room = self.max_len - len(tag_row) - 2
            kept = body_row[:room]
            chars = len(self.tokenizer.decode(kept).strip()) if len(kept) < len(body_row) else len(body)
            rows.append([self.eos, *tag_row, *kept] + ([self.eos] if len(kept) == len(body_row) else []))
            spans.append((len(tag_row), chars))
        tag_lp, body_lp, chars = np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for start in range(0, len(rows), self.batch_size):
            picked = order[start:start + self.batch_size]
            batch = [rows[i] for i in picked]
            width = len(batch[-1])
            ids = torch.full((len(batch), width), self.eos, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, row in enumerate(batch):
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            token_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            token_lp = (token_lp * mask[:, 1:]).numpy()
            for i, (row, pair) in enumerate(zip(batch, picked)):
                n_tag, n_chars = spans[pair]
                tag_lp[pair] = token_lp[i, :n_tag].sum()
                body_lp[pair] = token_lp[i, n_tag:len(row) - 1].sum()
                chars[pair] = n_chars
        return tag_lp, body_lp, chars

    def score_grid(self, tags: list[str], bodies: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`score` of every body after every tag, each array of shape (bodies, tags): classification, or
        binned regression, by the likelihood of each tag, in one pass."""
        scored = self.score([tag for tag in tags for _ in bodies], list(bodies) * len(tags))
        return tuple(a.reshape(len(tags), len(bodies)).T for a in scored)

    def sample(self, tag: str, n: int, max_new_tokens: int, seed: int, temperature: float = 1.0) -> list[str]:
        """`n` bodies generated after `tag` (ancestral sampling at `temperature`), cut at end-of-text."""
        import torch

        torch.manual_seed(seed)
        prompt = torch.tensor([[self.eos, *self._ids(tag)]]).repeat(n, 1)
        max_new_tokens = min(max_new_tokens, self.max_len - prompt.shape[1])
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                      top_p=1.0, temperature=temperature, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.eos, use_cache=True,
                                      suppress_tokens=self.padding_ids)
        texts = []
        for row in out[:, prompt.shape[1]:].tolist():
            row = row[:row.index(self.eos)] if self.eos in row else row
            texts.append(self.tokenizer.decode(row).strip())
        return texts
