"""Which tokenizer suits each domain, decided from measurements of the training text.

A science body is written in units a scientist would name: SMILES atoms and bonds, amino-acid
residues, element symbols and their counts. A tokenizer whose tokens straddle two units (a BPE
merge such as `O3` + `)` or `LL`) makes the model learn each unit again inside many tokens; one
whose tokens are rare in the training text gives a short pretraining too few examples per
embedding. Both are measured on every domain's bodies, for each candidate:

- `char`: one token per character (a byte-level BPE with no merges), the vocabulary seen in training;
- `bpe`: the byte-level BPE fitted to the same text at the model's `vocab_size` (the study's default).

`choose` keeps, per domain, the candidates whose tokens stay inside units (`MAX_CROSSING`) and
then the one with the fewest rare tokens, then the shortest sequences. One base model serves all
domains, so it gets one tokenizer: the one every domain accepts (`shared_choice`).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from shardlab.core.data import TOKENIZERS, fit_tokenizer

# Units of each domain's bodies. SMILES: bracket atoms, two-letter organic atoms, then any one
# character (atoms, bonds, ring digits, branches; the usual SMILES tokenizer regex). Formulas:
# element symbols and numbers. Sequences: residues.
UNITS = {
    "chemistry": re.compile(r"\[[^\]]+\]|Br|Cl|%\d\d|."),
    "materials": re.compile(r"[A-Z][a-z]?|\d+(?:\.\d+)?|."),
    "biology": re.compile(r"."),
}
MAX_CROSSING = 0.01  # a tokenizer whose tokens straddle units more often than this is rejected
RARE_COUNT = 20      # a token type seen fewer times in the training text counts as rare
CANDIDATES = TOKENIZERS
TABLE_PREFIX = "tokenizers."  # the comparison's file is <prefix><model>.csv beside the model (rule pretrain)


def unit_boundaries(text: str, units: re.Pattern) -> set[int]:
    """Character offsets where one unit ends and the next begins."""
    return {m.end() for m in units.finditer(text)} - {len(text)}


def crossing_tokens(tokenizer, bodies: list[str], units: re.Pattern) -> tuple[int, list[str]]:
    """(tokens that straddle a unit boundary, every token string) over `bodies`."""
    crossing, types = 0, []
    encoded = tokenizer(bodies, add_special_tokens=False, return_offsets_mapping=True)
    for body, ids, offsets in zip(bodies, encoded["input_ids"], encoded["offset_mapping"]):
        inner = unit_boundaries(body, units)
        crossing += sum(any(b in inner for b in range(start + 1, end)) for start, end in offsets)
        types += tokenizer.convert_ids_to_tokens(ids)
    return crossing, types


def measure(tokenizer, kind: str, domain: str, train_bodies: list[str], test_bodies: list[str]) -> dict:
    """One row of the comparison: how `tokenizer` cuts one domain's held-out bodies."""
    counts = Counter(t for ids in tokenizer(train_bodies, add_special_tokens=False)["input_ids"]
                     for t in tokenizer.convert_ids_to_tokens(ids))
    crossing, test_types = crossing_tokens(tokenizer, test_bodies, UNITS[domain])
    chars = sum(map(len, test_bodies))
    return {
        "domain": domain, "tokenizer": kind, "vocab_size": len(tokenizer), "bodies": len(test_bodies),
        "tokens_per_char": len(test_types) / chars if chars else float("nan"),
        "unit_crossing_fraction": crossing / len(test_types) if test_types else float("nan"),
        "rare_token_fraction": float(np.mean([counts[t] < RARE_COUNT for t in test_types])) if test_types else float("nan"),
        "types_used": len(counts),
    }


def compare(bodies: dict[str, tuple[list[str], list[str]]], docs: list[str], vocab_size: int) -> list[dict]:
    """Rows for every (domain, candidate): `bodies` = {domain: (training bodies, held-out bodies)};
    every candidate is fitted once to `docs`, the union the base model trains on."""
    rows = []
    for kind in CANDIDATES:
        tokenizer = fit_tokenizer(kind, docs, vocab_size)
        rows += [measure(tokenizer, kind, domain, train, test) for domain, (train, test) in bodies.items()]
    return rows


def choose(rows: list[dict]) -> list[dict]:
    """Per domain, the chosen candidate and why (computed from the measured rows)."""
    decisions = []
    for domain in dict.fromkeys(r["domain"] for r in rows):
        mine = [r for r in rows if r["domain"] == domain]
        ok = [r for r in mine if r["unit_crossing_fraction"] <= MAX_CROSSING] or mine
        best = min(ok, key=lambda r: (r["rare_token_fraction"], r["tokens_per_char"]))
        rejected = [r for r in mine if r not in ok]
        why = "; ".join(f"{r['tokenizer']}: {r['unit_crossing_fraction']:.0%} of tokens straddle two units"
                        for r in rejected)
        why = why or f"every candidate keeps inside units; fewest rare tokens ({best['rare_token_fraction']:.1%})"
        decisions.append({"domain": domain, "chosen": best["tokenizer"], "reason": why})
    return decisions


def shared_choice(decisions: list[dict]) -> str:
    """The one tokenizer of a base model that serves every domain: character-level if any domain
    rejects merges (a character tokenizer can only be finer than a domain's units, never across them)."""
    chosen = {d["chosen"] for d in decisions}
    return chosen.pop() if len(chosen) == 1 else "char"
