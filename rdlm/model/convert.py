"""Conversion between rdlm training checkpoints and the Huginn-0125 layout, and between dtypes and
shardings of that layout (`rdlm convert`).

A training checkpoint (rdlm.train.checkpoint) already keeps its weights as Huginn-layout directories,
`step-N/model/` and `step-N/ema/` (the exponential moving average, the paper's cheap "cooldown",
docs/architecture.md#optimizer), next to optimizer state and `trainer.json`. Converting one means choosing which
weights to release and writing them with `rdlm.model.huginn.save_pretrained`: the layout's one home. A
sharded checkpoint (FSDP, `step-N/dcp/`) is first gathered into whole tensors on this machine
(`rdlm.model.checkpoints.load_weights`, no processes to launch). A run directory (holding
`checkpoints/step-*`) means its newest complete checkpoint.

Same-dtype conversions are bit-exact; bf16 -> fp32 -> bf16 is too (fp32 holds every bf16 value).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from typing import Any

import torch

from rdlm.fileio import atomic_write, check_parents
from rdlm.model.dtypes import resolve_dtype
from rdlm.model.huginn import CONFIG_NAME, DEFAULT_SHARD_BYTES, save_pretrained
from rdlm.model.resolve import ModelSource, resolve_model_source

# Files a model directory may carry besides weights and config; copied along unchanged.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def resolve_source(path: str | os.PathLike, weights: str = "ema") -> ModelSource:
    """What `convert` reads from `path` (rdlm.model.resolve; a preset has no weights to convert)."""
    found = resolve_model_source(path, weights)
    if found.kind == "preset":
        raise ValueError(f"{os.fspath(path)!r} is a preset (random weights), nothing to convert: give a model "
                         "directory, a training checkpoint step-N/ or a run directory (write ./NAME for a "
                         "directory of that name)")
    return found


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '100KB' or a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r} is not a number of bytes or like 5GB / 500MB")
    unit = (match.group(2) or "B").upper().replace("I", "")
    return int(float(match.group(1)) * {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[unit])


def check_destination(destination: str | os.PathLike, source: Path, in_place: bool = False) -> Path:
    """Refuse a destination whose files conversion could lose: a file, a non-empty directory that is
    not a model directory, or the source itself (unless `in_place`)."""
    destination = check_parents(destination, "destination")
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"destination {destination} is a file, not a directory")
    if destination.is_dir() and destination.resolve() == source.resolve() and not in_place:
        raise FileExistsError(f"destination {destination} is the source: converting in place replaces "
                              "its weights; pass --in-place (in_place=True) to do that")
    if destination.is_dir() and not (destination / CONFIG_NAME).is_file() and any(destination.iterdir()):
        raise FileExistsError(f"destination {destination} is a non-empty directory without {CONFIG_NAME}, "
                              "not a model directory: refusing to write into it (choose a new or empty "
                              "directory)")
    return destination


def convert(source: str | os.PathLike, destination: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
            max_shard_bytes: int | str = DEFAULT_SHARD_BYTES, weights: str = "ema", in_place: bool = False,
            quantize: Any = None, group_size: int = 128) -> Path:
    """Write the weights of `source` to `destination` in the Huginn layout.

    dtype: "bf16", "fp32", a torch dtype, or None / "keep" for the source's own. Shards larger than
    `max_shard_bytes` are split, with `model.safetensors.index.json`. Tokenizer and generation files of
    the source are copied along. quantize: weight-only quantization (rdlm.model.quantize) of the saved
    weights, in `dtype`'s activations.

    Only what the layout owns (config.json, the weight files, the index) is replaced in an existing
    model directory; anything else there stays. A file, a non-empty directory that is not a model
    directory, and the source itself (unless `in_place`) are refused as destinations.
    """
    dtype = resolve_dtype(dtype)
    found = resolve_source(source, weights)
    # the file's own dtype (FSDP shards are gathered in float32); quantized in the dtype it is saved in
    model = found.load(dtype=dtype if quantize else None, quantize=quantize, group_size=group_size)
    # The tokenizer and generation files sit beside the weights, or beside trainer.json when sharded.
    src = found.checkpoint if found.sharded else found.directory
    destination = check_destination(destination, src, in_place)
    save_pretrained(model, destination, dtype=dtype, max_shard_bytes=parse_size(max_shard_bytes))
    if src.resolve() != destination.resolve():
        for name in SIDE_FILES:
            if (src / name).is_file():
                _copy_atomic(src / name, destination / name)
    return destination


def _copy_atomic(src: Path, dst: Path) -> None:
    with open(src, "rb") as source, atomic_write(dst, "wb") as target:
        shutil.copyfileobj(source, target)
