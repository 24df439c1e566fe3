"""Training data: token rows, on disk or in memory, served in a deterministic, resumable order
(docs/architecture.md#data).

A *row* is `context_length + 1` token ids: the model reads `row[:-1]` and predicts `row[1:]`. A row may
carry a loss mask (True where a token is a prediction target): prompt/response data puts the loss on
responses only, right padding is never a target.

Sources, all behind one small interface (`RowSource`: `len()`, `rows(indices)`, `max_token_id()`):

- `TokenShards(dir, split)`: memory-mapped numpy shards written by `rdlm.data.prepare.prepare`
  (`rdlm data prepare`).
- `MemoryRows(tokens, loss_mask, targets)`: rows already in memory (a tensor or array), e.g. synthetic
  tasks (targets: per-position supervision other than the next token);
  `MemoryRows.from_sequences` pads variable-length sequences, `MemoryRows.from_pairs` builds
  prompt/response rows, `load_prompt_response` reads them from JSONL through a tokenizer.

Shard directory layout (written by rdlm.data.prepare):

    meta.json                       {"format": "rdlm-token-shards", "row_length", "dtype", "vocab_size",
                                     "bos_id", "max_token_id", "splits": {"train": [{"file", "rows"}], ...}}
    train-00000.npy, ...            uint16/uint32 arrays [rows, row_length]
    val-00000.npy, ...
    tokenizer.json                  the tokenizer the ids come from

Packing (docs/architecture.md#data): every document starts with BOS; documents are packed into rows one
after another; the part of a document that would spill into the next row is dropped rather than
starting that row without its context. A held-out share of *documents* (not rows) forms the validation split.

`Batches` turns a source into micro-batches: an epoch is a permutation of the rows drawn from
(seed, epoch), and the rows of micro-batch (step, micro, rank) are a pure function of those numbers and
the batch geometry, so a resumed run or a different number of workers sees the same global batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from rdlm.checks import check_int
from rdlm.fileio import confined_name, read_jsonl

SHARD_FORMAT = "rdlm-token-shards"
META_FILE = "meta.json"
IGNORE_INDEX = -100


class DataError(ValueError):
    """Training data is missing, empty or does not fit the model; the message names the problem."""


# A source's rows: tokens, the loss mask or None, and the targets where they differ from the tokens.
Rows = tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]


class RowSource(Protocol):
    def __len__(self) -> int: ...

    @property
    def row_length(self) -> int: ...

    def rows(self, indices: np.ndarray) -> Rows:
        """int64 tokens [n, row_length], an optional bool loss mask of the same shape and, optionally,
        int64 targets of the same shape (see `make_batch`)."""

    def max_token_id(self) -> int: ...


# --------------------------------------------------------------------------------------------------
# In-memory rows


def _tensor(values) -> Tensor:
    return values if isinstance(values, Tensor) else torch.as_tensor(np.asarray(values))


class MemoryRows:
    def __init__(
        self,
        tokens: Tensor | np.ndarray | Sequence[Sequence[int]],
        loss_mask: Tensor | np.ndarray | None = None,
        targets: Tensor | np.ndarray | None = None,
        trim: bool = False,
    ) -> None:
        """`trim` (with a loss mask): a batch of rows ends at its last supervised column, so short rows of
        right-padded data cost what they need (the model is causal: earlier positions are the same)."""
        tokens = _tensor(tokens)
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise DataError(f"rows must be a 2-d array [rows, length >= 2], got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point():
            raise DataError(f"rows must hold integer token ids, got dtype {tokens.dtype}")
        if len(tokens) == 0:
            raise DataError("no rows given")
        self.tokens = tokens.long()
        mask = self._like_tokens(loss_mask, "loss_mask")
        self.loss_mask = None if mask is None else mask.bool()
        # Targets differ from the tokens where a position is supervised with something other than the
        # next input token, e.g. the intermediate state of a reasoning task that the input never shows.
        targets = self._like_tokens(targets, "targets")
        self.targets = None if targets is None else targets.long()
        if trim and self.loss_mask is None:
            raise DataError("trim needs a loss mask: it cuts the columns after the last supervised one")
        self.trim = trim

    def _like_tokens(self, values: Tensor | np.ndarray | None, name: str) -> Tensor | None:
        if values is None:
            return None
        values = _tensor(values)
        if values.shape != self.tokens.shape:
            raise DataError(f"{name} has shape {tuple(values.shape)}, rows have {tuple(self.tokens.shape)}")
        return values

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> MemoryRows:
        """Right-pad sequences to `length` (default: the longest); padding is never a target."""
        return cls.from_pairs([((), s) for s in sequences], pad_id, length)

    @classmethod
    def from_pairs(
        cls, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, length: int | None = None
    ) -> MemoryRows:
        """Rows prompt + response, right-padded; the loss falls on response tokens only."""
        if not pairs:
            raise DataError("no prompt/response pairs given")
        longest = max(len(p) + len(r) for p, r in pairs)
        if length is not None and length < 2:
            raise DataError(f"row length must be >= 2 (None: the longest pair), got {length}")
        length = longest if length is None else length
        tokens = torch.full((len(pairs), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), length), dtype=torch.bool)
        for i, (prompt, response) in enumerate(pairs):
            row = [*prompt, *response][:length]
            if len(row) < 2:
                raise DataError(f"pair {i} has fewer than 2 tokens")
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, len(prompt) : len(row)] = True
        return cls(tokens, mask)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def row_length(self) -> int:
        return self.tokens.shape[1]

    def rows(self, indices: np.ndarray) -> Rows:
        index = torch.as_tensor(indices, dtype=torch.long)
        tokens = self.tokens[index]
        mask = None if self.loss_mask is None else self.loss_mask[index]
        targets = None if self.targets is None else self.targets[index]
        if self.trim:
            assert mask is not None  # trim needs a loss mask (refused without one above)
            used = mask.any(dim=0).nonzero()
            end = max(2, int(used[-1]) + 1 if len(used) else 2)
            tokens, mask = tokens[:, :end], mask[:, :end]
            targets = None if targets is None else targets[:, :end]
        return (tokens, mask) if targets is None else (tokens, mask, targets)

    def max_token_id(self) -> int:
        return int(self.tokens.max() if self.targets is None else max(self.tokens.max(), self.targets.max()))

    def min_token_id(self) -> int:
        return int(self.tokens.min() if self.targets is None else min(self.tokens.min(), self.targets.min()))


def load_prompt_response(path: str | os.PathLike, tokenizer, length: int | None = None) -> MemoryRows:
    """JSONL of {"prompt", "response"} or {"messages": [{"role", "content"}, ...]} as chat rows.

    Each example is written in the chat format (docs/checkpoint-format.md#tokenizer); the loss falls on
    the assistant's reply and its closing <|end_turn|>, which teaches the model to stop.
    """
    if not getattr(tokenizer, "has_chat", True):
        raise DataError(
            f"prompt/response data is written in the chat format; the tokenizer {tokenizer.source} has no chat tokens"
        )
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt/response file {path} does not exist")
    pairs = []
    for number, example in read_jsonl(path, DataError):
        if isinstance(example, dict) and "messages" in example:
            messages = example["messages"]
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{path}:{number}: field 'messages' must be a non-empty list")
            for i, message in enumerate(messages):
                if (
                    not isinstance(message, dict)
                    or not isinstance(message.get("role"), str)
                    or not isinstance(message.get("content"), str)
                ):
                    raise DataError(
                        f"{path}:{number}: field 'messages[{i}]' must be an object with string "
                        f"'role' and 'content', got {message!r}"[:300]
                    )
            if messages[-1]["role"] != "assistant":
                raise DataError(f"{path}:{number}: 'messages' must end with an assistant turn")
            prompt_messages, reply = messages[:-1], messages[-1]["content"]
        elif isinstance(example, dict) and "prompt" in example and "response" in example:
            for key in ("prompt", "response"):
                if not isinstance(example[key], str):
                    raise DataError(
                        f"{path}:{number}: field {key!r} must be a string, got "
                        f"{type(example[key]).__name__} {example[key]!r}"[:300]
                    )
            prompt_messages, reply = [{"role": "user", "content": example["prompt"]}], example["response"]
        else:
            raise DataError(f"{path}:{number}: expected keys 'prompt' and 'response', or 'messages'")
        prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True)
        response = tokenizer.encode(str(reply).strip(), special=False) + [tokenizer.end_turn_id]
        pairs.append((prompt, response))
    if not pairs:
        raise DataError(f"{path}: no examples")
    return MemoryRows.from_pairs(pairs, tokenizer.pad_id, length)


# --------------------------------------------------------------------------------------------------
# Shards on disk


class TokenShards:
    """One split of a shard directory, memory-mapped."""

    def __init__(self, directory: str | os.PathLike, split: str = "train") -> None:
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        entries = self.meta["splits"].get(split)
        if not entries:
            raise DataError(
                f"{self.directory}: no rows in split {split!r} "
                f"(splits: {', '.join(k for k, v in self.meta['splits'].items() if v) or 'none'})"
            )
        self.split = split
        self.arrays = []
        for entry in entries:
            file = self.directory / confined_name(
                entry["file"], self.directory / META_FILE, DataError, "data directory"
            )
            if not file.is_file():
                raise DataError(f"{file}: shard listed in {META_FILE} is missing")
            try:
                array = np.load(file, mmap_mode="r", allow_pickle=False)
            except ValueError as err:
                raise DataError(f"{file}: not a readable numpy shard ({err})") from err
            if array.ndim != 2 or array.shape != (entry["rows"], self.meta["row_length"]):
                raise DataError(f"{file}: shape {array.shape}, expected ({entry['rows']}, {self.meta['row_length']})")
            self.arrays.append(array)
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def row_length(self) -> int:
        return int(self.meta["row_length"])

    def rows(self, indices: np.ndarray) -> tuple[Tensor, Tensor | None]:
        indices = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(self.offsets, indices, side="right") - 1
        out = np.empty((len(indices), self.row_length), dtype=np.int64)
        top = self.max_token_id()
        for s in np.unique(shard):
            where = shard == s
            out[where] = self.arrays[s][indices[where] - self.offsets[s]]
            if out[where].max(initial=0) > top:  # meta.json is what the model's vocabulary was checked against
                raise DataError(
                    f"{self.directory / self.meta['splits'][self.split][s]['file']} holds token id "
                    f"{int(out[where].max())}, above max_token_id {top} in {META_FILE}: "
                    f"{META_FILE} does not describe its shards"
                )
        return torch.from_numpy(out), None

    def max_token_id(self) -> int:
        return int(self.meta["max_token_id"])


def read_meta(directory: Path) -> dict:
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist")
    meta_file = directory / META_FILE
    if not meta_file.is_file():
        if not any(directory.iterdir()):
            raise DataError(f"data directory {directory} is empty (run `rdlm data prepare` first)")
        raise DataError(f"{directory} has no {META_FILE}: not a directory written by `rdlm data prepare`")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{meta_file}: not valid JSON ({err.msg})") from err
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise DataError(f"{meta_file}: format is {found!r}, expected {SHARD_FORMAT!r}")
    check_meta(meta, meta_file)
    return meta


def check_meta(meta: dict, meta_file: Path) -> None:
    """The fields readers rely on, each present and of its kind, named when not."""

    def integer(key: str, minimum: int) -> int:
        return check_int(f"{meta_file}: {key!r}", meta.get(key), minimum, error=DataError)

    integer("row_length", 2)
    top = integer("max_token_id", 0)
    if "vocab_size" in meta and top >= integer("vocab_size", 1):
        raise DataError(f"{meta_file}: max_token_id {top} is not below vocab_size {meta['vocab_size']}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise DataError(f"{meta_file}: no 'splits' (an object of split name -> list of shard files)")
    for split, entries in splits.items():
        if not isinstance(entries, list):
            raise DataError(f"{meta_file}: splits[{split!r}] must be a list of shard entries, got {entries!r}")
        for i, entry in enumerate(entries):
            if (
                not isinstance(entry, dict)
                or isinstance(entry.get("rows"), bool)
                or not isinstance(entry.get("rows"), int)
                or entry["rows"] < 0
            ):
                raise DataError(
                    f"{meta_file}: splits[{split!r}][{i}] must be an object with 'file' and "
                    f"an integer 'rows' >= 0, got {entry!r}"[:300]
                )
            confined_name(entry.get("file"), meta_file, DataError, "data directory")


# --------------------------------------------------------------------------------------------------
# Batching


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # [b, L]
    labels: Tensor  # [b, L], IGNORE_INDEX where there is no target
    num_targets: int


def make_batch(tokens: Tensor, loss_mask: Tensor | None, targets: Tensor | None = None) -> Batch:
    """Inputs tokens[:, :-1]; position t is trained to predict targets[:, t + 1] (default: the next
    token), where the loss mask allows."""
    labels = (tokens if targets is None else targets)[:, 1:].clone()
    if loss_mask is not None:
        labels[~loss_mask[:, 1:]] = IGNORE_INDEX
    return Batch(tokens[:, :-1], labels, int((labels != IGNORE_INDEX).sum()))


class Batches:
    """Deterministic micro-batches: the rows of (step, micro, rank) depend on nothing else.

    The global batch of optimizer step `t` is rows t*G .. t*G+G-1 of the endless sequence of epoch
    permutations, G = micro_batch_size * accumulation * world_size. Micro-batch `m` of rank `k` takes
    the slice starting at (m * world_size + k) * micro_batch_size, so one process with the same global
    batch sees exactly the union of what the workers see.
    """

    def __init__(
        self,
        source: RowSource,
        micro_batch_size: int,
        accumulation: int = 1,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(source) == 0:
            raise DataError("the data source has no rows")
        self.source, self.micro_batch_size, self.accumulation = source, micro_batch_size, accumulation
        self.world_size, self.seed, self.shuffle = world_size, seed, shuffle
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self.source)
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._epoch = epoch
        return self._perm

    def positions(self, step: int, micro: int, rank: int) -> np.ndarray:
        start = step * self.global_batch_size + (micro * self.world_size + rank) * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size)

    def indices(self, positions: np.ndarray) -> np.ndarray:
        n = len(self.source)
        out = np.empty(len(positions), dtype=np.int64)
        for i, pos in enumerate(positions):
            out[i] = self._permutation(int(pos) // n)[int(pos) % n]
        return out

    def get(self, step: int, micro: int, rank: int = 0) -> Batch:
        return make_batch(*self.source.rows(self.indices(self.positions(step, micro, rank))))

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / len(self.source)


def fixed_batches(source: RowSource, batch_size: int, max_rows: int | None = None) -> list[Batch]:
    """The first `max_rows` rows in order, as batches: for evaluation, the same every time."""
    n = len(source) if max_rows is None else min(len(source), max_rows)
    return [make_batch(*source.rows(np.arange(i, min(i + batch_size, n)))) for i in range(0, n, batch_size)]
