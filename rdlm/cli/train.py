"""`rdlm train`: the command-line face of `rdlm.train.train` (one flag per TrainConfig field).

    rdlm train --model small --data shards/ --out-dir runs/a --steps 1000
    rdlm train --model runs/a --prompt-response chat.jsonl --out-dir runs/b      # fine-tune
    torchrun --nproc-per-node 2 -m rdlm train ...                               # data parallel
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import types
import typing
from pathlib import Path
from typing import Any

from rdlm.cli import CLIError


# Fields set otherwise than by a flag of their own.
NOT_FLAGS = ("model_overrides",)  # --set KEY=VALUE
NONE_WORDS = ("none", "null", "off")


def _comma_separated(element: type, length: int | None):
    def parse(text: str) -> tuple:
        items = [element(x) for x in text.split(",")]
        if length is not None and len(items) != length:
            raise argparse.ArgumentTypeError(f"expected {length} comma-separated values, got {text!r}")
        return tuple(items)

    parse.__name__ = f"comma-separated {element.__name__}"
    return parse


def _none_or(convert):
    def parse(text: str):
        return None if text.lower() in NONE_WORDS else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def flag_type(name: str, annotation: Any):
    """The argparse `type` of a dataclass field's flag, None for a bool (a --x/--no-x switch).

    Handled: bool, int, float, str, `X | None` of those (none/null/off give None), and tuples of
    int/float/str (`tuple[float, float]`, `tuple[int, ...]`, written comma-separated). Any other
    type raises TypeError naming the field, so a new field cannot silently become a switch."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"field {name!r}: type {annotation} has no command-line flag (a union)")
        annotation, optional = members[0], True
    if annotation is bool and not optional:
        return None
    if annotation in (int, float, str):
        convert = annotation
    elif typing.get_origin(annotation) is tuple and typing.get_args(annotation):
        items = typing.get_args(annotation)
        variadic = len(items) == 2 and items[1] is Ellipsis
        element = items[0]
        if element not in (int, float, str) or not (variadic or all(i is element for i in items)):
            raise TypeError(f"field {name!r}: type {annotation} has no command-line flag "
                            "(tuples must hold one of int, float, str)")
        convert = _comma_separated(element, None if variadic else len(items))
    else:
        raise TypeError(f"field {name!r}: type {annotation} has no command-line flag (bool, int, float, str, "
                        "X | None and tuples of those are supported)")
    return _none_or(convert) if optional else convert


def add_config_flags(p: argparse.ArgumentParser, config_class: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `config_class` (--micro-batch-size for micro_batch_size),
    defaulting to None (not given); the help is the field's own (its metadata) and its default."""
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        convert = flag_type(f.name, hints[f.name])
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        text = f"{f.metadata.get('help', '')} (default: {shown})".lstrip()
        if convert is None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, type=convert, default=None, help=text)


def register(subparsers) -> None:
    from rdlm.train import TrainConfig

    p = subparsers.add_parser("train", help="train or fine-tune a recurrent-depth model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a JSON file of TrainConfig fields (flags override it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (JSON value), e.g. --set mean_recurrence=16")
    add_config_flags(p, TrainConfig, skip=NOT_FLAGS)
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from rdlm.train import TrainConfig

    values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise CLIError(f"config file {path} does not exist")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CLIError(f"{path}: not valid JSON ({err.msg})") from err
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name, None)
        if f.name not in NOT_FLAGS and value is not None:
            values[f.name] = value
    overrides = dict(values.get("model_overrides", {}))
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CLIError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    values["model_overrides"] = overrides
    return TrainConfig.from_dict(values)


def run(args: argparse.Namespace) -> int:
    from rdlm.train import TrainingError, train

    config = build_config(args)
    try:
        result = train(config)
    except TrainingError as err:
        raise CLIError(str(err)) from err
    summary = {"steps": result.steps_done, "final_loss": result.losses[-1] if result.losses else None,
               "skipped_steps": result.bad_steps, "seconds": round(result.seconds, 2),
               "checkpoint": str(result.checkpoint) if result.checkpoint else None}
    if result.evals:
        summary["eval"] = {k: round(v, 4) for k, v in result.evals[-1].items() if isinstance(v, float)}
    if result.stopped_by is not None:
        summary["stopped_by"] = signal.Signals(result.stopped_by).name
    if result.checkpoint is None or _is_main():
        print(json.dumps(summary, indent=2))
    # Stopped by a signal: saved and clean, but not finished (128 + the signal, as the shell reports it).
    return 0 if result.stopped_by is None else 128 + result.stopped_by


def _is_main() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
