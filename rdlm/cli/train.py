"""`rdlm train`: the command-line face of `rdlm.train.train` (one flag per TrainConfig field).

    rdlm train --model small --data shards/ --out-dir runs/a --steps 1000
    rdlm train --out-dir runs/a --resume --steps 2000                           # continue (and extend) a run
    rdlm train --model runs/a --prompt-response chat.jsonl --out-dir runs/b      # fine-tune
    torchrun --nproc-per-node 2 -m rdlm train ...                               # data parallel

--out-dir is required: the model is saved only there (`--out-dir none` trains without saving anything, to
time a run or try settings). --resume continues the run in --out-dir with its own recorded settings,
model and data (its newest checkpoint's trainer.json); only the flags that may change with a resumed run
(how long it runs, how it reports and saves, the hardware) may be given, others must equal the run's.
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

from rdlm.cli import CLIError, takes_effect

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
            raise TypeError(
                f"field {name!r}: type {annotation} has no command-line flag (tuples must hold one of int, float, str)"
            )
        convert = _comma_separated(element, None if variadic else len(items))
    else:
        raise TypeError(
            f"field {name!r}: type {annotation} has no command-line flag (bool, int, float, str, "
            "X | None and tuples of those are supported)"
        )
    return _none_or(convert) if optional else convert


def add_config_flags(p: argparse.ArgumentParser, config_class: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `config_class` (--micro-batch-size for micro_batch_size),
    defaulting to None (not given); the help is the field's own (its metadata) and its default."""
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{config_class.__name__}.{f.name} has no default")
        convert = flag_type(f.name, hints[f.name])
        text = f.metadata.get("help", "")
        # The field's default, unless its help says what it is (None stands for "the model's", "no clip", ...)
        if default is not None and "default" not in text:
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            text = f"{text} (default: {shown})".lstrip()
        if convert is None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, type=convert, default=None, help=text)


def register(subparsers) -> None:
    from rdlm.train import TrainConfig

    p = subparsers.add_parser(
        "train",
        help="train or fine-tune a recurrent-depth model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="a JSON file of TrainConfig fields (flags override it)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field (JSON value), e.g. --set mean_recurrence=16",
    )
    add_config_flags(p, TrainConfig, skip=NOT_FLAGS)
    for action in p._actions:
        if action.dest == "out_dir":  # not given (no attribute) is told from `--out-dir none`
            action.default = argparse.SUPPRESS
            action.help = (
                "run directory: checkpoints, log.jsonl, TensorBoard events; required (none: train "
                "without saving anything)"
            )
        if action.dest in SETTING_OF:
            takes_effect(action, _needs_setting(*SETTING_OF[action.dest]))
    p.set_defaults(func=run)


# Flags that set a detail of another setting, and do nothing without it: (field, the values it needs, in words).
SETTING_OF: dict[str, tuple[str, Any, str]] = {
    "curriculum_start": ("curriculum", None, "--curriculum linear or 1-sqrt"),
    "curriculum_fraction": ("curriculum", None, "--curriculum linear or 1-sqrt"),
    "muon_lr": ("optimizer", "muon", "--optimizer muon"),
    "muon_weight_decay": ("optimizer", "muon", "--optimizer muon"),
    "lora_rank": ("lora", True, "--lora"),
    "lora_alpha": ("lora", True, "--lora"),
    "lora_dropout": ("lora", True, "--lora"),
    "lora_parts": ("lora", True, "--lora"),
    "lora_base_dtype": ("lora", True, "--lora"),
    "quantize_group_size": ("quantize", None, "--quantize with int4"),
}


def _needs_setting(field: str, value: Any, words: str):
    def why_not(args: argparse.Namespace) -> str | None:
        setting = _setting(args, field)
        if setting is None or (value is not None and setting != value):
            return f"it applies with {words}, which this run does not have"
        return None

    return why_not


def _setting(args: argparse.Namespace, field: str) -> Any:
    """A TrainConfig field as the run will have it: its flag, else --config's value, else (--resume) the run's."""
    if getattr(args, field, None) is not None:
        return getattr(args, field)
    if args.config and field in (values := read_config_file(Path(args.config))):
        return values[field]
    if args.resume and getattr(args, "out_dir", None) is not None:
        from rdlm.train.resume import recorded_config

        found = recorded_config(args.out_dir)
        if found is not None:
            return found[0].get(field)
    from rdlm.train import TrainConfig

    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == field)


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CLIError(f"config file {path} does not exist")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CLIError(f"{path}: not valid JSON ({err.msg})") from err
    except UnicodeDecodeError as err:
        raise CLIError(f"{path}: not UTF-8 text (byte {err.start})") from err
    if not isinstance(values, dict):
        raise CLIError(
            f'{path}: expected a JSON object of TrainConfig fields (like {{"steps": 100}}), got '
            f"{type(values).__name__} {json.dumps(values)[:40]}"
        )
    return values


def build_config(args: argparse.Namespace, require_out_dir: bool = False):
    """The TrainConfig of the command line: --config's fields, then the flags given; with --resume and a
    run in --out-dir, the run's recorded fields with only those that may change set anew."""
    from rdlm.train import TrainConfig

    values: dict[str, Any] = read_config_file(Path(args.config)) if args.config else {}
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name, None)
        if f.name not in NOT_FLAGS and value is not None:
            values[f.name] = value
    if hasattr(args, "out_dir"):
        values["out_dir"] = args.out_dir
    elif "out_dir" not in values and require_out_dir:
        raise CLIError(
            "give --out-dir DIR: the trained model is saved only there (--out-dir none trains without saving anything)"
        )
    overrides = dict(values.get("model_overrides", {}))
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CLIError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    if overrides or "model_overrides" in values:
        values["model_overrides"] = overrides
    if values.get("resume") and values.get("out_dir") is not None:
        values = resumed_values(values)
    values.setdefault("model_overrides", {})
    config = TrainConfig.from_dict(values)  # every value checked first
    if require_out_dir and not config.resume and not (config.data or config.prompt_response):
        raise CLIError(
            "no training data: give --data DIR (token shards from `rdlm data prepare`) or --prompt-response FILE.jsonl"
        )
    return config


def resumed_values(given: dict[str, Any]) -> dict[str, Any]:
    """The fields of a resumed run: its recorded ones, with the `given` ones that may change; a given field
    that may not change must equal the recorded one. A run without a checkpoint yet starts as given."""
    from rdlm.train.config import MAY_CHANGE_ON_RESUME, TrainConfig
    from rdlm.train.resume import recorded_config

    found = recorded_config(given["out_dir"])
    if found is None:
        if not (given.get("data") or given.get("prompt_response")):
            raise CLIError(
                f"--resume: {given['out_dir']} holds no checkpoint to resume from; to start the run, "
                "give its model and data (--data DIR or --prompt-response FILE.jsonl)"
            )
        return given
    recorded, checkpoint = found
    recorded = TrainConfig.from_dict(recorded).to_dict()  # tuples as the flags give them
    fixed = []
    for key, value in given.items():
        if key in MAY_CHANGE_ON_RESUME or key == "out_dir":
            continue
        was = recorded.get(key)
        if (tuple(value) if isinstance(value, list) else value) != was:
            flag = "--set" if key == "model_overrides" else "--" + key.replace("_", "-")
            fixed.append(f"{flag} {_shown(value)} (the run's: {_shown(was)})")
    if fixed:
        allowed = ", ".join("--" + k.replace("_", "-") for k in MAY_CHANGE_ON_RESUME if k != "resume")
        raise CLIError(
            f"--resume continues the run with its own settings ({checkpoint}/trainer.json); it "
            f"cannot change {'; '.join(fixed)}. A resumed run may change only {allowed}"
        )
    changed = {k: v for k, v in given.items() if k in MAY_CHANGE_ON_RESUME}
    return {**recorded, **changed, "out_dir": given["out_dir"], "overwrite": False}


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={json.dumps(v)}" for k, v in value.items()) or "(none)"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def run(args: argparse.Namespace) -> int:
    from rdlm.train import TrainingError, train

    config = build_config(args, require_out_dir=True)
    try:
        result = train(config)
    except TrainingError as err:
        raise CLIError(str(err)) from err
    summary: dict[str, Any] = {
        "steps": result.steps_done,
        "final_loss": result.losses[-1] if result.losses else None,
        "skipped_steps": result.bad_steps,
        "seconds": round(result.seconds, 2),
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
    }
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
