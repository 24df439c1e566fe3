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
    "rdlm.cli.retrofit",
    "rdlm.cli.eval",
]


def _quantize_spec(text: str) -> str:
    from rdlm.model.quantize import QuantizationError, QuantSpec

    try:
        QuantSpec.parse(text)
    except QuantizationError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_quantize_arguments(parser) -> None:
    """--quantize / --quantize-group-size: weight-only quantization at load time (rdlm.model.quantize)."""
    parser.add_argument("--quantize", metavar="SPEC", type=_quantize_spec,
                        help="weight-only quantization per part of the loop: int8, int4, or part=scheme items "
                             "(parts prelude, core, coda, head; schemes none, int8, int4), e.g. "
                             "'core=int8,prelude=int4,coda=int4,head=int8'; docs/quantization.md")
    parser.add_argument("--quantize-group-size", type=int, default=128, metavar="N",
                        help="int4: input columns per scale and zero point (32, 64, 128 or 256)")


class CLIError(Exception):
    """A user error worth one clear line, not a traceback."""


def add_model_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """The model a command runs on, spelled `--model X` as in every command (or positionally, `rdlm info
    X`); `main` puts it in `args.model`."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=f"{help} (or --model MODEL)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the model (as the positional MODEL)")


def _merge_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not hasattr(args, "model_option"):
        return
    given, option = args.model, args.model_option
    command = parser._subparsers._group_actions[0].choices[args.command]  # its usage line, in the error
    if given is not None and option is not None and given != option:
        command.error(f"the model is given twice ({given!r} and --model {option!r})")
    if given is None and option is None:
        command.error("the following arguments are required: --model MODEL")
    args.model = option if option is not None else given
    del args.model_option


class ShowDefaults(argparse.HelpFormatter):
    """Ends an option's help with its default, unless the help names it already or there is none to show
    (None, False, an empty list: the option is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is argparse.SUPPRESS
                or default is None or default is False or default == [] or default == ""):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else "%(default)s"
        return f"{text} (default: {shown})"


def _with_defaults_shown(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser keeps its own formatter for the description and shows option defaults."""
    if not issubclass(parser.formatter_class, ShowDefaults):
        parser.formatter_class = type(f"ShowDefaults{parser.formatter_class.__name__}",
                                      (ShowDefaults, parser.formatter_class), {})
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_defaults_shown(sub)


def build_parser() -> argparse.ArgumentParser:
    import torch

    from rdlm import __version__

    parser = argparse.ArgumentParser(prog="rdlm", description="Recurrent-depth language models.")
    parser.add_argument("--version", action="version", version=f"rdlm {__version__} (torch {torch.__version__})",
                        help="print rdlm's version (and torch's) and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    _with_defaults_shown(parser)
    return parser


def one_line_warnings(command: str, default):
    """Show rdlm's own warnings (a long job's estimate) as one line, without a source excerpt."""
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, LongRunWarning):
            print(f"rdlm {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    return show


def console() -> None:
    """The `rdlm` program: `main` on the command line's arguments, then the process's exit
    (rdlm.train.distributed.exit_process)."""
    code = main()
    from rdlm.train.distributed import exit_process

    exit_process(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _merge_model(args, parser)
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
