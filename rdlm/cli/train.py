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
from pathlib import Path
from typing import Any

from rdlm.cli import CLIError


def _converter(annotation: str):
    base = annotation.replace(" | None", "")
    if base == "bool":
        return None
    if base.startswith("tuple[float"):
        return lambda s: tuple(float(x) for x in s.split(","))
    if base.startswith("tuple[int"):
        return lambda s: tuple(int(x) for x in s.split(","))
    return {"int": int, "float": float, "str": str}.get(base)


def _none_or(convert):
    return lambda s: None if s.lower() in ("none", "null", "off") else convert(s)


def register(subparsers) -> None:
    from rdlm.train import TrainConfig

    p = subparsers.add_parser("train", help="train or fine-tune a recurrent-depth model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a JSON file of TrainConfig fields (flags override it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (JSON value), e.g. --set mean_recurrence=16")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model_overrides":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        convert = _converter(str(f.type))
        if convert is None:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default: {default})")
        else:
            if "None" in str(f.type):
                convert = _none_or(convert)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            p.add_argument(flag, type=convert, default=None, help=f"(default: {shown})")
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
        if f.name != "model_overrides" and value is not None:
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
