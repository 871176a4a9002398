"""Conditional text: one labelled row -> `<tag=value> body`, with a parser that inverts it.

The label comes first so that a causal LM learns p(body | label): sampling after a tag is
conditional generation, and comparing the likelihood of each tag before a fixed body is
classification (or regression over binned numbers). Numeric labels are binned (rounded to a
multiple of the bin width) so the tag vocabulary stays small enough for a tiny model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardlab.core.data import register_text_format

_TAG = re.compile(r"^<(?P<tag>[A-Za-z]+)=(?P<value>[^<>\s]+)> (?P<body>\S+)$")
_CLASS = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class ConditionalFormat:
    name: str            # key in shardlab.core.data.TEXT_FORMATS
    domain: str          # chemistry | biology | materials
    tag: str             # "logS", "class", "gap"
    body_column: str
    label_column: str
    bin_width: float | None = None  # numeric labels only; None means a class label
    decimals: int = 1
    body_pattern: str = r"^\S+$"    # a well-formed body (no whitespace)

    @property
    def numeric(self) -> bool:
        return self.bin_width is not None

    def bin(self, value: float) -> float:
        """The representative of `value`'s bin: the nearest multiple of the bin width."""
        binned = round(round(value / self.bin_width) * self.bin_width, self.decimals)
        return binned + 0.0  # turns -0.0 into 0.0 so "<gap=-0.00>" never appears

    def tag_text(self, label) -> str:
        if self.numeric:
            return f"<{self.tag}={self.bin(float(label)):.{self.decimals}f}>"
        return f"<{self.tag}={label}>"

    def text(self, label, body: str) -> str:
        return f"{self.tag_text(label)} {body}"

    def label_of(self, row: dict):
        """The row's label (float or class string), or None when missing or malformed."""
        raw = (row.get(self.label_column) or "").strip()
        if self.numeric:
            try:
                value = float(raw)
            except ValueError:
                return None
            return value if math.isfinite(value) else None
        return raw if _CLASS.match(raw) else None

    def body_of(self, row: dict) -> str | None:
        body = (row.get(self.body_column) or "").strip()
        return body if body and re.match(self.body_pattern, body) else None

    def __call__(self, row: dict) -> str | None:
        """A TEXT_FORMATS formatter: the conditional text, or None for a malformed row."""
        label, body = self.label_of(row), self.body_of(row)
        if label is None or body is None:
            return None
        return self.text(label, body)

    def parse(self, text: str) -> tuple[float | str, str]:
        """(label, body) from this format's text; the numeric label is the bin value."""
        tag, value, body = parse_conditional(text)
        if tag != self.tag:
            raise ValueError(f"expected tag '{self.tag}', got '{tag}' in {text!r}")
        return (float(value) if self.numeric else value), body

    def candidate_labels(self, low: float, high: float) -> list[float]:
        """Every bin value from `low` to `high` (numeric formats), for scoring tags."""
        first, last = self.bin(low), self.bin(high)
        n = int(round((last - first) / self.bin_width))
        return [self.bin(first + i * self.bin_width) for i in range(n + 1)]


def parse_conditional(text: str) -> tuple[str, str, str]:
    """('tag', 'value', 'body') from `<tag=value> body`; ValueError when the text is not one."""
    match = _TAG.match(text.strip())
    if not match:
        raise ValueError(f"not conditional text: {text!r}")
    return match["tag"], match["value"], match["body"]


CHEMISTRY = ConditionalFormat("aqsoldb_logs", "chemistry", "logS", "SMILES", "Solubility", bin_width=0.5, decimals=1)
BIOLOGY = ConditionalFormat("scop_class", "biology", "class", "seq", "label", body_pattern=r"^[A-Z]+$")
MATERIALS = ConditionalFormat("mp_gap", "materials", "gap", "formula", "target", bin_width=0.25, decimals=2,
                              body_pattern=r"^[A-Za-z0-9().]+$")

FORMATS: dict[str, ConditionalFormat] = {f.name: f for f in (CHEMISTRY, BIOLOGY, MATERIALS)}
for _format in FORMATS.values():
    register_text_format(_format.name, _format)
