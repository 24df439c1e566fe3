"""The `rdlm` command line: a thin layer over the Python API, one module per subcommand.

Each module in COMMANDS defines `register(subparsers)`, which adds its parser and sets `func`,
a function taking the parsed namespace and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from rdlm.checks import check_int
from rdlm.resources import LongRunWarning

if TYPE_CHECKING:
    from rdlm.model.lora_files import AdapterFiles

COMMANDS = [
    "rdlm.cli.info",
    "rdlm.cli.generate",
    "rdlm.cli.chat",
    "rdlm.cli.serve",
    "rdlm.cli.analyze",
    "rdlm.cli.tokenizer",
    "rdlm.cli.lora",
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
    parser.add_argument(
        "--quantize",
        metavar="SPEC",
        type=_quantize_spec,
        help="weight-only quantization per part of the loop: int8, int4, or part=scheme items "
        "(parts prelude, core, coda, head; schemes none, int8, int4), e.g. "
        "'core=int8,prelude=int4,coda=int4,head=int8'; docs/quantization.md",
    )
    takes_effect(
        parser.add_argument(
            "--quantize-group-size",
            type=int,
            default=128,
            metavar="N",
            help="int4: input columns per scale and zero point (32, 64, 128 or 256)",
        ),
        _without_int4,
    )


def _without_int4(args: argparse.Namespace) -> str | None:
    from rdlm.model.quantize import PARTS, QuantSpec

    if args.quantize is None:
        return "it is the group size of --quantize int4, and no --quantize is given"
    spec = QuantSpec.parse(args.quantize)
    if all(getattr(spec, part) != "int4" for part in PARTS):
        return f"it is the group size of int4, and --quantize {args.quantize} quantizes no part to int4"
    return None


def add_lora_arguments(parser, named: bool = False) -> None:
    """--lora / --lora-any-base: LoRA adapters loaded on the model (rdlm.model.lora). `named` (the server's):
    NAME=DIR, repeatable, each served under its NAME; else one DIR."""
    where = "an adapter directory, or a LoRA run's checkpoint step-N/ or run directory (its newest adapter/)"
    if named:
        action = parser.add_argument(
            "--lora",
            action="append",
            type=_named_adapter,
            metavar="NAME=DIR",
            help=f"serve a LoRA adapter under NAME (repeatable; DIR: {where}); a request's `model` picks the "
            "base or an adapter",
        )
    else:
        action = parser.add_argument(
            "--lora", metavar="DIR", help=f"run the model with a LoRA adapter on it: {where}; docs/generation.md"
        )
    action.records_model = True  # type: ignore[attr-defined]  # `main`: --lora stands in for --model
    takes_effect(
        parser.add_argument(
            "--lora-any-base",
            action="store_true",
            help="apply the adapter even to a base other than the one it was trained on (its fingerprint "
            "differs; the shapes must still match)",
        ),
        lambda args: None if args.lora else "it relaxes the check of --lora's base, and no --lora is given",
    )


def _named_adapter(text: str) -> tuple[str, str]:
    from rdlm.inference.params import adapter_name

    name, equals, directory = text.partition("=")
    if not equals or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    try:
        adapter_name("the adapter's NAME", name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, directory


def model_and_adapters(args: argparse.Namespace) -> tuple[str, dict[str, AdapterFiles]]:
    """The model a command runs and the adapters it loads on it (`--lora`, read and checked; none without
    it): `--model`, or where it is not given, the base the first adapter records (rdlm.model.lora)."""
    from rdlm.model.lora import DEFAULT_NAME
    from rdlm.model.lora_serving import adapters_base, read_adapters

    given = getattr(args, "lora", None) or []
    if isinstance(given, str):  # one DIR
        given = [(DEFAULT_NAME, given)]
    names = [name for name, _ in given]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise CLIError(f"--lora: the name {twice[0]!r} is given twice")
    adapters = read_adapters(dict(given))
    if args.model is not None:
        return args.model, adapters
    if not adapters:
        raise CLIError("give the model (--model)")
    return adapters_base(adapters), adapters


class CLIError(Exception):
    """A user error worth one clear line, not a traceback."""


def takes_effect(action: argparse.Action, why_not: Callable[[argparse.Namespace], str | None]) -> argparse.Action:
    """Declare when a flag can take effect: `why_not(args)` says why it cannot in this command line (None:
    it can). `main` refuses a flag given where it would do nothing, naming it and the reason, before any
    work: the one rule of every command (a silently ignored flag is a mistake the user never hears of)."""
    action.why_not = why_not  # type: ignore[attr-defined]  # our own attribute on argparse's Action
    return action


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the flag of `dest` was on the command line (not merely at its default)."""
    return dest in getattr(args, "given_options", ())


def refuse_flags_without_effect(parsers: list[argparse.ArgumentParser], args: argparse.Namespace) -> None:
    for parser in parsers:
        for action in parser._actions:
            why_not = getattr(action, "why_not", None)
            if why_not is not None and given(args, action.dest):
                reason = why_not(args)
                if reason is not None:
                    raise CLIError(f"{'/'.join(action.option_strings)} would have no effect: {reason}")


def add_threads_argument(parser) -> None:
    """--threads: the CPU threads of a command's model work (rdlm.resources.use_threads applies it)."""
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        metavar="N",
        help="CPU threads for the model's work (default: 1 for models under 20M parameters, else "
        "the cores the load average leaves free; more threads than free cores make every "
        "operation wait: benchmarks/bench_threads.py)",
    )


def at_least(minimum: int):
    """An argparse type: an integer >= `minimum` (argparse names the flag in its one-line error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        return check_int("", value, minimum, error=argparse.ArgumentTypeError)  # argparse names the flag

    parse.__name__ = f"integer >= {minimum}"
    return parse


def check_exit_threshold(
    criterion: str | None,
    threshold: float | None,
    flag: str = "--exit-threshold",
    criterion_flag: str = "--exit-criterion",
) -> None:
    """Refuse a threshold no token can pass: a score criterion's score is never below 0, so a threshold
    <= 0 means "never exit" (the Python API allows it on purpose, to time a criterion; a flag never means
    that). A threshold without a criterion would be ignored."""
    from rdlm.inference.exits.criteria import CRITERIA

    if threshold is None:
        return
    if criterion is None:
        raise CLIError(f"{flag} needs {criterion_flag} (it is that criterion's threshold)")
    spec = CRITERIA.get(criterion)
    if spec is not None and not (spec.uses_gate or spec.counts_steps) and threshold <= 0:
        raise CLIError(
            f"{flag} {threshold:g}: a token exits once its {criterion} score is below the threshold, "
            f"and the score is never below 0, so no token could exit; give a threshold > 0 (the "
            f"default is {spec.threshold:g})"
        )


def add_model_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """The model a command runs on, spelled `--model X` as in every command (or positionally, `rdlm info
    X`); `main` puts it in `args.model`."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=f"{help} (or --model MODEL)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the model (as the positional MODEL)")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of `parser`'s subcommands by name (none without subcommands): argparse keeps them in its
    subparsers action, the first of its subparsers group."""
    if parser._subparsers is None:
        return {}
    return cast("argparse._SubParsersAction[argparse.ArgumentParser]", parser._subparsers._group_actions[0]).choices


def _takes_adapters(parser: Parser, args: argparse.Namespace) -> bool:
    """Whether the command takes --lora for adapters (`add_lora_arguments`), whose recorded base may stand in
    for a missing --model."""
    return any(getattr(a, "records_model", False) for p in parser.command_parsers(args) for a in p._actions)


def _require_model(parser: Parser, args: argparse.Namespace) -> None:
    """generate and chat (an optional --model): --model, or an adapter's --lora."""
    if _takes_adapters(parser, args) and args.model is None and not args.lora:
        parser.command_parsers(args)[-1].error("the following arguments are required: --model")


def _merge_model(args: argparse.Namespace, parser: Parser) -> None:
    if not hasattr(args, "model_option"):
        return
    given, option = args.model, args.model_option
    command = _subcommands(parser)[args.command]  # its usage line, in the error
    if given is not None and option is not None and given != option:
        command.error(f"the model is given twice ({given!r} and --model {option!r})")
    if given is None and option is None and not (_takes_adapters(parser, args) and args.lora):  # its recorded base
        command.error("the following arguments are required: --model MODEL")
    args.model = option if option is not None else given
    del args.model_option


class ShowDefaults(argparse.HelpFormatter):
    """Ends an option's help with its default, unless the help names it already or there is none to show
    (None, False, an empty list: the option is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is argparse.SUPPRESS
            or default is None
            or default is False
            or default == []
            or default == ""
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else "%(default)s"
        return f"{text} (default: {shown})"


def _with_defaults_shown(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser keeps its own formatter for the description and shows option defaults."""
    formatter = cast(type, parser.formatter_class)  # a class (typeshed: a callable)
    if not issubclass(formatter, ShowDefaults):
        shown = type(f"ShowDefaults{formatter.__name__}", (ShowDefaults, formatter), {})
        parser.formatter_class = cast("argparse._FormatterClass", shown)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_defaults_shown(sub)


class Parser(argparse.ArgumentParser):
    """A usage error is one line naming what is wrong and where the options are listed, not the whole usage
    (a missing --model printed 30 lines of it). Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is named by the subcommand it was given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.command_parsers(parsed)[-1].error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def command_parsers(self, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
        """This parser and the subcommands' parsers `parsed` went through (`rdlm data prepare`: three)."""
        chain: list[argparse.ArgumentParser] = [self]
        for dest in ("command", "action"):
            where = chain[-1]
            sub = _subcommands(where).get(getattr(parsed, dest, ""))
            if sub is None:
                break
            chain.append(sub)
        return chain

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, and `given_options`: the dests of the flags on the command line (`given`), told from
        flags left at their default even when given with the default's value (`--weights ema`)."""
        self._given: set[str] = set()
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.given_options = frozenset(self._given | set(getattr(parsed, "given_options", ())))
        return parsed, extras

    def _get_values(self, action, arg_strings):
        if action.option_strings:  # argparse converts an optional's values only when the flag is given
            self._given.add(action.dest)
        return super()._get_values(action, arg_strings)


def build_parser() -> Parser:
    import torch

    from rdlm import __version__

    parser = Parser(prog="rdlm", description="Recurrent-depth language models.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"rdlm {__version__} (torch {torch.__version__})",
        help="print rdlm's version (and torch's) and exit",
    )
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
    _require_model(parser, args)
    name = " ".join(filter(None, (args.command, getattr(args, "action", None))))  # `data prepare`, as typed
    try:
        refuse_flags_without_effect(parser.command_parsers(args), args)
        with warnings.catch_warnings():
            warnings.simplefilter("always", LongRunWarning)
            warnings.showwarning = one_line_warnings(name, warnings.showwarning)
            return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (`rdlm info M | head`): stop quietly, as Unix tools do
        _silence_stdout()
        return 128 + signal.SIGPIPE
    except (CLIError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, FloatingPointError) as err:
        print(f"rdlm {name}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a path that is a file, no permission: one line naming the path
        where = f"{err.filename}: " if err.filename else ""
        print(f"rdlm {name}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a closed pipe is not another error."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing is left to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
