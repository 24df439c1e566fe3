"""`rdlm data prepare`: tokenize text/JSONL/parquet into packed, memory-mapped token shards."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="prepare training data")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    d = sub.add_parser("prepare", help="tokenize and pack documents into shards with a validation split")
    d.add_argument("inputs", nargs="+", help="input files (.txt, .jsonl, .parquet)")
    d.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    d.add_argument("--out", required=True, help="output shard directory")
    d.add_argument("--context-length", type=int, required=True, help="model context; rows hold this + 1 tokens")
    d.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out")
    d.add_argument(
        "--packing",
        choices=("stream", "truncate"),
        default="stream",
        help="stream: documents continue into the next row, every token kept; truncate: a row never "
        "starts inside a document (the rest of a long document is dropped)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the choice of held-out documents")
    d.add_argument("--rows-per-shard", type=int, default=65536, help="rows per shard file")
    d.add_argument("--text-field", default="text", help="JSONL/parquet field holding the text")
    d.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already in --out (its shards, meta.json and tokenizer.json are removed "
        "first); refused otherwise",
    )
    d.add_argument(
        "--separator",
        default=None,
        help=r"split .txt files into documents on this string (escapes allowed, e.g. '\n\n\n')",
    )
    d.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from rdlm.data.prepare import prepare
    from rdlm.data.tokenizer import Tokenizer

    separator = args.separator.encode().decode("unicode_escape") if args.separator is not None else None
    meta = prepare(
        args.inputs,
        Tokenizer.load(args.tokenizer),
        args.out,
        args.context_length,
        args.val_fraction,
        args.seed,
        args.rows_per_shard,
        args.text_field,
        separator,
        packing=args.packing,
        overwrite=args.overwrite,
    )
    print(
        json.dumps(
            {
                k: meta[k]
                for k in (
                    "row_length",
                    "documents",
                    "train_documents",
                    "val_documents",
                    "rows",
                    "tokens",
                    "packing",
                    "max_token_id",
                    "vocab_size",
                )
            }
        )
    )
    for split, count in meta["tokens"].items():
        if count["total"]:
            print(
                f"rdlm data prepare: {split}: kept {count['kept']:,} of {count['total']:,} tokens "
                f"({count['kept'] / count['total']:.1%}; packing {meta['packing']})",
                file=sys.stderr,
            )
    if args.val_fraction > 0 and not meta["rows"]["val"]:
        print(
            f"rdlm data prepare: warning: no validation rows ({meta['val_documents']} of {meta['documents']} "
            f"documents held out, too few for a row of {meta['row_length']} tokens): training on this data "
            "will not evaluate; give more documents or a larger --val-fraction",
            file=sys.stderr,
        )
    return 0
