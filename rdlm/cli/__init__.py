"""The `rdlm` command line: a thin layer over the Python API, one module per subcommand.

Each module in COMMANDS defines `register(subparsers)`, which adds its parser and sets `func`,
a function taking the parsed namespace and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from rdlm.resources import LongRunWarning

COMMANDS = [
    "rdlm.cli.info",
    "rdlm.cli.generate",
    "rdlm.cli.chat",
    "rdlm.cli.serve",
    "rdlm.cli.analyze",
    "rdlm.cli.tokenizer",
    "rdlm.cli.data",
    "rdlm.cli.train",
    "rdlm.cli.demo",
    "rdlm.cli.lm_eval",
    "rdlm.cli.convert",
    "rdlm.cli.eval",
]


class CLIError(Exception):
    """A user error worth one clear line, not a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdlm", description="Recurrent-depth language models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def one_line_warnings(command: str, default):
    """Show rdlm's own warnings (a long job's estimate) as one line, without a source excerpt."""
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, LongRunWarning):
            print(f"rdlm {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    return show


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", LongRunWarning)
            warnings.showwarning = one_line_warnings(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as err:
        print(f"rdlm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a path that is a file, no permission: one line naming the path
        where = f"{err.filename}: " if err.filename else ""
        print(f"rdlm {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
