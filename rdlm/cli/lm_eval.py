"""`rdlm lm-eval ...`: EleutherAI's lm-eval command line with the `rdlm` model type registered.

Everything after `lm-eval` goes to the harness unchanged, e.g.
    rdlm lm-eval --model rdlm --model_args pretrained=DIR,num_steps=32 --tasks arc_challenge
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lm-eval",
        help="run the lm-evaluation-harness with the rdlm model type",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        prefix_chars="+",
    )
    p.add_argument("harness_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate

        import rdlm.integrations.lm_eval  # noqa: F401  (registers the model type "rdlm")
    except ImportError as err:
        raise ValueError(f"{err}; install the evaluation extra: pip install 'rdlm[eval]'") from err
    sys.argv = ["lm-eval", *args.harness_args]
    cli_evaluate()
    return 0
