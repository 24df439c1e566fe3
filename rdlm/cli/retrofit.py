"""`rdlm retrofit SRC OUT --prelude ... --core ... --coda ...`: a pretrained Llama-family transformer ->
a retrofitted recurrent-depth model (rdlm.model.retrofit, docs/retrofit.md)."""

from __future__ import annotations

import argparse

from rdlm.model import dtypes
from rdlm.model.retrofit import ADAPTER_INITS, parse_layers, retrofit


def register(subparsers) -> None:
    p = subparsers.add_parser("retrofit", help="turn a pretrained Llama/OLMo-2 checkpoint into a recurrent-depth model")
    p.add_argument(
        "source",
        help="a transformers model directory (config.json, safetensors, tokenizer.json) of model_type llama or olmo2",
    )
    p.add_argument(
        "destination",
        help="the model directory to write (the retrofitted models' Huginn layout): new, "
        "empty, or with --overwrite a model directory; never the source (docs/files.md)",
    )
    p.add_argument(
        "--prelude",
        default="",
        help="source layers of the prelude, in order: 0,1,2,3 or 0-3 (layers named nowhere are dropped)",
    )
    p.add_argument("--core", required=True, help="source layers of the core block, iterated r times: e.g. 10-17")
    p.add_argument("--coda", default="", help="source layers of the coda, in order: e.g. 18-21")
    p.add_argument(
        "--adapter-init",
        choices=ADAPTER_INITS,
        default="identity",
        help="the adapter over [s, e]: identity passes e (r = 1 computes the source model without the "
        "dropped layers), sum adds s, random is rdlm's initialisation",
    )
    p.add_argument("--dtype", choices=(*dtypes.CHOICES, "keep"), default="keep", help="weight dtype (default: keep)")
    p.add_argument("--mean-recurrence", type=int, default=4, help="the model's default r (training's mean r)")
    p.add_argument("--backprop-depth", type=int, default=4, help="k: iterations with gradient in training")
    p.add_argument("--seed", type=int, default=0, help="seed of a random adapter")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a model already in DESTINATION (its other files stay)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prelude, core, coda = parse_layers(args.prelude), parse_layers(args.core), parse_layers(args.coda)
    dtype = None if args.dtype == "keep" else dtypes.resolve_dtype(args.dtype)
    model = retrofit(
        args.source,
        args.destination,
        prelude,
        core,
        coda,
        adapter_init=args.adapter_init,
        dtype=dtype,
        seed=args.seed,
        mean_recurrence=args.mean_recurrence,
        backprop_depth=args.backprop_depth,
        overwrite=args.overwrite,
    )
    c = model.config
    print(
        f"wrote {args.destination}: {c.family}, prelude {prelude}, core {core} (x r), coda {coda}; "
        f"{model.num_parameters():,} parameters"
    )
    return 0
