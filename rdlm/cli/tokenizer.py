"""`rdlm tokenizer train`: a byte-level BPE tokenizer with the special tokens of Huginn-0125
(docs/checkpoint-format.md#tokenizer)."""

from __future__ import annotations

import argparse
import json

from rdlm.cli import CLIError, at_least
from rdlm.fileio import check_parents


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenizer", help="train or inspect a tokenizer")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("train", help="train a BPE tokenizer on text, JSONL or parquet files")
    t.add_argument("inputs", nargs="+", help="input files (.txt, .jsonl, .parquet)")
    t.add_argument("--out", required=True, help="output directory (or .json file) for tokenizer.json")
    t.add_argument("--vocab-size", type=int, default=8192, help="including the special tokens")
    t.add_argument("--min-frequency", type=at_least(0), default=2, help="fewest occurrences of a pair to merge it")
    t.add_argument("--overwrite", action="store_true", help="replace a tokenizer.json already at --out")
    t.add_argument("--text-field", default="text", help="JSONL/parquet field holding the text")
    t.add_argument("--separator", default=None, help="split .txt files into documents on this string")
    t.set_defaults(func=run_train)
    e = sub.add_parser("encode", help="print the token ids of a text")
    e.add_argument("tokenizer", help="tokenizer.json or a directory holding one")
    e.add_argument("text", help="the text to encode")
    e.set_defaults(func=run_encode)


def run_train(args: argparse.Namespace) -> int:
    from rdlm.data.prepare import read_documents
    from rdlm.data.tokenizer import TOKENIZER_FILE, train_tokenizer

    if args.separator is not None:
        args.separator = args.separator.encode().decode("unicode_escape")
    out = check_parents(args.out, "--out")
    target = out / TOKENIZER_FILE if out.is_dir() or out.suffix != ".json" else out  # where Tokenizer.save writes
    if target.exists() and not args.overwrite:  # refused before training, which may take minutes
        raise CLIError(f"{target} already exists; pass --overwrite to replace it, or choose another --out")
    docs = read_documents(args.inputs, args.text_field, args.separator)
    tok = train_tokenizer(docs, args.vocab_size, args.min_frequency)
    path = tok.save(args.out)
    if tok.vocab_size < args.vocab_size:
        print(f"note: the corpus supported only {tok.vocab_size} tokens of the {args.vocab_size} asked for")
    print(
        json.dumps(
            {
                "tokenizer": str(path),
                "vocab_size": tok.vocab_size,
                "bos_id": tok.bos_id,
                "eos_id": tok.eos_id,
                "end_turn_id": tok.end_turn_id,
                "pad_id": tok.pad_id,
            }
        )
    )
    return 0


def run_encode(args: argparse.Namespace) -> int:
    from rdlm.data.tokenizer import Tokenizer

    try:
        tok = Tokenizer.load(args.tokenizer)
    except ValueError as err:
        raise CLIError(str(err)) from err
    print(",".join(map(str, tok.encode(args.text))))
    return 0
