"""The command line's contract, shared by every `shardlab` subcommand: a bad argument exits 2 with one
line that names it (argparse prints the usage block too; ours does not, so a log shows the cause
and nothing else), and the argument types that turn a user's typo into that line, not a traceback.
Imports nothing from shardlab, so every layer may use it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `prog: error: what is wrong`, exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # a prefix that happens to match is a silent typo
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """argparse's, but a misspelt flag is named before any missing required one (argparse reports only
        the latter, which hides the typo that caused it)."""
        args = sys.argv[1:] if args is None else list(args)
        options = args[:args.index("--")] if "--" in args else args
        unknown = [a.split("=", 1)[0] for a in options
                   if a.startswith("--") and a.split("=", 1)[0] not in self._option_string_actions]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2)

    def refuse(self, args: argparse.Namespace, flags: list[str], where: str) -> None:
        """Fail on any of `flags` given a value other than its default: where a flag does not apply,
        ignoring it silently would read as if it had worked."""
        given = [flag for flag in flags if getattr(args, dest(flag)) != self.get_default(dest(flag))]
        if given:
            self.error(f"{', '.join(given)}: {'does' if len(given) == 1 else 'do'} not apply to {where}")


def dest(flag: str) -> str:
    """'--micro-batch' -> 'micro_batch' (argparse's attribute name for a flag)."""
    return flag.lstrip("-").replace("-", "_")


def argument(read):
    """`read` as an argparse type: its ValueError's message (not a traceback) and exit 2."""
    def parse(text: str):
        try:
            return read(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = read.__name__  # argparse names the type in its message
    return parse


def count(text: str) -> int:
    """A positive integer: a device count, a length, a number of repeats."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of at least 1")
    return value


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return path


def json_value(text: str):
    """JSON text (a settings block the workflow passes inline)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg} at character {err.pos})") from None


def what_if_item(text: str) -> tuple[str, float]:
    """'network_gbps=2' -> ('network_gbps', 2.0): a catalog figure and the factor to scale it by."""
    key, _, factor = text.partition("=")
    try:
        return key.strip(), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not figure=factor (e.g. network_gbps=2)") from None
