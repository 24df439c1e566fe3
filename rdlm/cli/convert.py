"""`rdlm convert SRC DST`: training checkpoint or Huginn-layout directory -> Huginn layout (bf16/fp32,
sharded with an index when large)."""

from __future__ import annotations

import argparse

from rdlm.cli import add_quantize_arguments, takes_effect
from rdlm.model import dtypes
from rdlm.model.convert import convert


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a training checkpoint or model dir to the Huginn layout")
    p.add_argument("source", help="a Huginn-layout dir, a training checkpoint (step-N/) or a run dir")
    p.add_argument(
        "destination",
        help="the Huginn-layout directory to write: new, empty, or with --overwrite a model "
        "directory (only its config.json, weight and tokenizer files are replaced, atomically; "
        "docs/files.md)",
    )
    p.add_argument("--dtype", choices=(*dtypes.CHOICES, "keep"), default="keep", help="weight dtype (default: keep)")
    p.add_argument("--max-shard-size", default="5GB", help="split weights into shards of at most this size")
    takes_effect(
        p.add_argument(
            "--weights",
            choices=("ema", "model"),
            default="ema",
            help="from a training checkpoint: the EMA weights (default, the raw ones where it "
            "has none) or the raw ones",
        ),
        _weights_without_choice,
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="allow DESTINATION to be the source model directory (its weights are replaced)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a model already in DESTINATION (its other files stay)"
    )
    add_quantize_arguments(p)
    p.set_defaults(func=run)


def _weights_without_choice(args: argparse.Namespace) -> str | None:
    """--weights picks between a training checkpoint's two sets of weights; a model directory has one."""
    from rdlm.model.resolve import resolve_model_source

    try:
        found = resolve_model_source(args.source, args.weights)
    except (ValueError, OSError):
        return None  # the command names what is wrong with the source
    if found.kind not in ("checkpoint", "run"):
        return (
            f"{args.source} is a model directory, with one set of weights; --weights chooses in a training checkpoint"
        )
    if found.weights != args.weights:
        return f"{args.source} has no EMA weights (its run kept none: ema_decay none); give --weights model"
    return None


def run(args: argparse.Namespace) -> int:
    out = convert(
        args.source,
        args.destination,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        weights=args.weights,
        in_place=args.in_place,
        quantize=args.quantize,
        group_size=args.quantize_group_size,
        overwrite=args.overwrite,
    )
    files = sorted(p.name for p in out.iterdir())
    shards = len(list(out.glob("*.safetensors")))
    print(f"wrote {out} ({shards} weight file(s)): {', '.join(files)}")
    return 0
