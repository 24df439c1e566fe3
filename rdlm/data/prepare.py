"""Preparing token shards from text (`rdlm data prepare`): documents read from .txt, .jsonl and .parquet,
encoded, packed into rows and written as the shard directory rdlm.data.shards reads (its module doc: the
layout; docs/architecture.md#data: the packing).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from rdlm.checks import check_int
from rdlm.data.shards import META_FILE, SHARD_FORMAT, DataError
from rdlm.fileio import atomic_write, claim_output_dir, new_dirs_removed_on_failure, read_jsonl, read_utf8, write_json


def read_documents(
    paths: Sequence[str | os.PathLike], text_field: str = "text", separator: str | None = None
) -> Iterator[str]:
    """Documents from .txt (a file is a document, or split on `separator`), .jsonl and .parquet files."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"input file {path} does not exist")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            for number, record in read_jsonl(path, DataError):
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{path}:{number}: no field {text_field!r}")
                yield str(record[text_field])
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as err:
                raise DataError(f"{path}: reading parquet needs pyarrow (pip install 'rdlm[parquet]')") from err
            table = pq.read_table(path, columns=[text_field])
            yield from (str(t) for t in table.column(text_field).to_pylist() if t is not None)
        else:
            text = read_utf8(path, DataError)  # one policy for every input: UTF-8, or refused naming the file
            yield from (text.split(separator) if separator else [text])


PACKING = ("stream", "truncate")


class Packer:
    """Packs documents (each starting with BOS) into rows of `row_length` tokens, counting what is kept.

    "stream" (the default, as nanoGPT and Megatron pack): the documents form one token stream cut into
    rows, each row starting with the last token of the row before (one token of overlap), so every token
    but the stream's first is the target of exactly one prediction. A long document continues into the
    next rows; BOS marks where a document starts. Only the stream's final partial row is dropped.
    "truncate": a row never starts inside a document: a document's tokens beyond the room left in the
    current row are dropped. For documents longer than a row that keeps only their first row of tokens.
    """

    def __init__(self, row_length: int, policy: str = "stream") -> None:
        if policy not in PACKING:
            raise DataError(f"packing must be one of {', '.join(PACKING)}, got {policy!r}")
        self.row_length, self.policy = row_length, policy
        self.row: list[int] = []
        self.rows = 0
        self.tokens = 0  # every token of every document added

    def add(self, doc: Sequence[int]) -> list[np.ndarray]:
        """The rows `doc` completes (none, one or several)."""
        self.tokens += len(doc)
        if self.policy == "truncate":
            self.row.extend(doc[: self.row_length - len(self.row)])
        else:
            self.row.extend(doc)
        done = []
        while len(self.row) >= self.row_length:
            done.append(np.asarray(self.row[: self.row_length]))
            # stream: the row's last token opens the next row (the context of its first target)
            self.row = self.row[self.row_length - 1 :] if self.policy == "stream" else []
        self.rows += len(done)
        return done

    @property
    def kept_tokens(self) -> int:
        """Distinct document tokens in the emitted rows (the stream's overlap token counted once)."""
        if self.policy == "truncate":
            return self.rows * self.row_length
        return self.rows * (self.row_length - 1) + (1 if self.rows else 0)

    @property
    def dropped_tokens(self) -> int:
        return self.tokens - self.kept_tokens


def pack_documents(documents: Iterable[Sequence[int]], row_length: int, policy: str = "stream") -> Iterator[np.ndarray]:
    packer = Packer(row_length, policy)
    for doc in documents:
        yield from packer.add(doc)


# The files `prepare` writes (any others in its directory are someone else's).
_SHARD_RE = re.compile(r"^((train|val)-\d{5}\.npy|meta\.json|tokenizer\.json)$")


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer,
    out_dir: str | os.PathLike,
    context_length: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    rows_per_shard: int = 65536,
    text_field: str = "text",
    separator: str | None = None,
    batch_docs: int = 256,
    packing: str = "stream",
    overwrite: bool = False,
) -> dict:
    """Tokenize documents into packed, memory-mappable shards with a held-out validation split (`packing`:
    see `Packer`); meta.json records how many tokens the rows kept and how many were dropped. A dataset
    already in `out_dir` is replaced only with `overwrite`, which removes its files first (a directory of other
    files is refused); a failed run leaves no new directory behind."""
    if not inputs:
        raise DataError("no input files given")
    if packing not in PACKING:
        raise DataError(f"--packing must be one of {', '.join(PACKING)}, got {packing!r}")
    check_int("context_length", context_length, error=DataError)
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    check_int("--rows-per-shard", rows_per_shard, error=DataError)
    out = Path(out_dir)
    claim_output_dir(out, _SHARD_RE.match, overwrite, "a dataset", others_allowed=False)
    with new_dirs_removed_on_failure(out):
        out.mkdir(parents=True, exist_ok=True)
        return _prepare(
            inputs,
            tokenizer,
            out,
            context_length,
            val_fraction,
            seed,
            rows_per_shard,
            text_field,
            separator,
            batch_docs,
            packing,
        )


def _prepare(
    inputs,
    tokenizer,
    out: Path,
    context_length: int,
    val_fraction: float,
    seed: int,
    rows_per_shard: int,
    text_field: str,
    separator: str | None,
    batch_docs: int,
    packing: str,
) -> dict:
    row_length = context_length + 1
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    buffers: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    counts = {"documents": 0, "train_documents": 0, "val_documents": 0}
    max_id = 0

    def flush(split: str, final: bool = False) -> None:
        while len(buffers[split]) >= rows_per_shard or (final and buffers[split]):
            chunk, buffers[split] = buffers[split][:rows_per_shard], buffers[split][rows_per_shard:]
            name = f"{split}-{len(splits[split]):05d}.npy"
            with atomic_write(out / name, "wb") as handle:
                np.save(handle, np.stack(chunk).astype(dtype), allow_pickle=False)
            splits[split].append({"file": name, "rows": len(chunk)})

    packers = {"train": Packer(row_length, packing), "val": Packer(row_length, packing)}
    pending: dict[str, list[str]] = {"train": [], "val": []}

    def encode_pending(which: str) -> None:
        nonlocal max_id
        for doc in tokenizer.encode_batch(pending[which], add_bos=True, special=False):
            max_id = max(max_id, max(doc))
            buffers[which].extend(packers[which].add(doc))
        pending[which] = []
        flush(which)

    for text in read_documents(inputs, text_field, separator):
        if not text.strip():
            continue
        counts["documents"] += 1
        # A document's split is drawn from the seed, so it never changes between runs.
        which = "val" if rng.random() < val_fraction else "train"
        counts[f"{which}_documents"] += 1
        pending[which].append(text)
        if len(pending[which]) >= batch_docs:
            encode_pending(which)
    for which in ("train", "val"):
        if pending[which]:
            encode_pending(which)
    for which in ("train", "val"):
        flush(which, final=True)
    if not splits["train"]:
        raise DataError(
            f"no complete training row of {row_length} tokens: the inputs hold too little text "
            f"({counts['documents']} documents)"
        )
    meta = {
        "format": SHARD_FORMAT,
        "row_length": row_length,
        "context_length": context_length,
        "dtype": np.dtype(dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "max_token_id": max_id,
        "seed": seed,
        "val_fraction": val_fraction,
        **counts,
        "packing": packing,
        "tokens": {
            k: {"total": pk.tokens, "kept": pk.kept_tokens, "dropped": pk.dropped_tokens} for k, pk in packers.items()
        },
        "rows": {k: sum(e["rows"] for e in v) for k, v in splits.items()},
        "splits": splits,
    }
    tokenizer.save(out / "tokenizer.json")
    write_json(out / META_FILE, meta)
    return meta
