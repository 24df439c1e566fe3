"""Every option of every `rdlm` subcommand explains itself in --help."""

import argparse
import re

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
