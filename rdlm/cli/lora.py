"""`rdlm lora merge ADAPTER --out DIR`: a LoRA adapter folded into its base's weights (rdlm.model.lora,
docs/fine-tuning.md); `rdlm lora info ADAPTER`: what an adapter holds and the base it records."""

from __future__ import annotations

import argparse
import json

from rdlm.model import dtypes


def register(subparsers) -> None:
    p = subparsers.add_parser("lora", help="merge or inspect LoRA adapters")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = sub.add_parser(
        "merge",
        help="write the base with an adapter merged into its weights (its logits equal base + adapter)",
    )
    m.add_argument("adapter", help="an adapter directory (PEFT's format), or a lora run or checkpoint (its adapter/)")
    m.add_argument(
        "--base",
        help="the base model (a model directory, checkpoint, run or preset; default: the one the adapter records)",
    )
    m.add_argument("--out", required=True, help="the model directory to write (new or empty; docs/files.md)")
    m.add_argument(
        "--dtype", choices=(*dtypes.CHOICES, "keep"), default="keep", help="weight dtype (default: the base's)"
    )
    m.add_argument("--max-shard-size", default="5GB", help="split weights into shards of at most this size")
    m.add_argument(
        "--lora-any-base",
        action="store_true",
        help="merge into a base of the right shapes whose weights differ from the one the adapter was trained on",
    )
    m.add_argument("--overwrite", action="store_true", help="replace a model already in --out (its other files stay)")
    m.set_defaults(func=run_merge)
    i = sub.add_parser("info", help="an adapter's rank, parts, trainable parameters and recorded base, as JSON")
    i.add_argument("adapter", help="an adapter directory, or a lora run or checkpoint")
    i.set_defaults(func=run_info)


def run_merge(args: argparse.Namespace) -> int:
    from rdlm.model.convert import merge_lora

    out, notes = merge_lora(
        args.adapter,
        args.out,
        args.base,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        any_base=args.lora_any_base,
        overwrite=args.overwrite,
    )
    for note in notes:
        print(f"rdlm lora merge: note: {note}")
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from rdlm.model.lora_files import read_adapter

    files = read_adapter(args.adapter)
    parameters = sum(a.numel() + b.numel() for a, b in files.tensors.values())
    print(
        json.dumps(
            {
                "directory": str(files.directory),
                "lora": files.spec.to_json(),
                "layers": len(files.tensors),
                "parameters": parameters,
                "base": files.info.get("base") or {"source": files.base_source},
                "trained_over_quantization": files.info.get("quantization"),
            },
            indent=2,
        )
    )
    return 0
