"""Every option of every `rdlm` subcommand explains itself in --help."""

import argparse
import json
import re

import pytest

from rdlm.cli import build_parser


def options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("rdlm",)):
    """(command path, action) for every argument of `parser` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, path + (name,))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_of_every_subcommand_has_help_text():
    found = list(options(build_parser()))
    assert len({path for path, _ in found}) >= 12 and len(found) > 150  # the walk sees the whole CLI
    missing = [f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}" for path, action in found
               if not re.sub(r"\(default: [^)]*\)", "", action.help or "").strip()
               or action.help == argparse.SUPPRESS]
    assert not missing, "options without help: " + ", ".join(missing)


def test_help_shows_each_options_default():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert re.search(r"--accumulation ACCUMULATION\s+micro-batches per optimizer step.*\(default:\s+1\)",
                     train, re.S)
    assert re.search(r"--betas BETAS\s+AdamW betas \(two numbers\) \(default: 0\.9,0\.95\)", train)
    demo = parser._subparsers._group_actions[0].choices["demo"].format_help()
    assert re.search(r"--seed SEED\s+seed of the data and of training \(default: 0\)", demo)


def test_help_printed_while_parsing_shows_the_defaults(capsys):
    """`--help` runs inside the parse, which also records the flags given (rdlm.cli.given): the help it prints
    shows each default as it is."""
    from rdlm.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    shown = capsys.readouterr().out
    assert re.search(r"128 or 256\) \(default: 128\)", shown) and "object at 0x" not in shown


def test_every_command_taking_a_model_accepts_the_model_flag(huginn_tiny_dir, capsys):
    from rdlm.cli import main

    parser = build_parser()
    for command in ("info", "eval", "analyze", "serve", "generate", "chat"):
        args = parser.parse_args([command, "--model", "some/dir"] + (["--text", "x"] if command == "eval" else []))
        if hasattr(args, "model_option"):
            assert args.model is None and args.model_option == "some/dir"
        else:
            assert args.model == "some/dir"
    assert main(["info", "--model", str(huginn_tiny_dir)]) == 0
    flag = json.loads(capsys.readouterr().out)
    assert main(["info", str(huginn_tiny_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == flag["config"] and flag["config"]["core_layers"] == 2


@pytest.mark.parametrize("argv, message", [
    (["info"], "the following arguments are required: --model MODEL"),
    (["info", "a", "--model", "b"], "the model is given twice"),
])
def test_a_missing_or_doubled_model_is_named(argv, message, capsys):
    from rdlm.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_version_prints_rdlm_and_torch(capsys):
    import torch

    import rdlm
    from rdlm.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"rdlm {rdlm.__version__} (torch {torch.__version__})"
