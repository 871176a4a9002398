"""Stages 1-2 of the DAG: get a model onto disk, tokenize a corpus for it.

    python -m shardlab prepare-model --model-json '{...}' --out resources/models/<name>
    python -m shardlab prepare-data --data-json '{...}' --model-json '{...}' --model-dir DIR --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import shardlab.science.formats  # noqa: F401  (registers the science text formats)
from shardlab import cli
from shardlab.core.data import prepare_corpus
from shardlab.core.model import ModelUnavailable, prepare_model
from shardlab.errors import ConfigError

MODEL_JSON = "the experiment's `model` settings as JSON"


def model_main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab prepare-model", description="Build or download a model.")
    parser.add_argument("--model-json", required=True, type=cli.json_value, help=MODEL_JSON)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model_cfg = args.model_json
    try:
        prepare_model(model_cfg, args.out)
    except ModelUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"model '{model_cfg['name']}' ready in {args.out}")
    return 0


def data_main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab prepare-data", description="Tokenize a corpus for a model.")
    parser.add_argument("--data-json", required=True, type=cli.json_value, help="the experiment's `data` settings as JSON")
    parser.add_argument("--model-json", required=True, type=cli.json_value, help=MODEL_JSON)
    parser.add_argument("--model-dir", type=cli.existing_dir, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base-dir", type=cli.existing_dir, default=Path("."),
                        help="what a relative data path is relative to")
    args = parser.parse_args(argv)
    data = dict(args.data_json)
    data["path"] = str(args.base_dir / data["path"])  # an absolute path stays as it is
    try:
        meta = prepare_corpus(data, args.model_json, args.model_dir, args.out)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"corpus '{meta['corpus']}': {meta['documents']} documents, {meta['tokens']} tokens, "
          f"{meta['skipped_rows']} malformed rows skipped -> {args.out}")
    return 0
