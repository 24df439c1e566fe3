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

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from rdlm.data.tokenizer import TOKENIZER_FILE, Tokenizer
from rdlm.fileio import claim_output_dir
from rdlm.model.dtypes import resolve_dtype
from rdlm.model.huginn import CONFIG_NAME, DEFAULT_SHARD_BYTES, is_model_file, read_quantization, save_pretrained
from rdlm.model.resolve import ModelSource, cast_parameters, resolve_model_source

# Files a model directory may carry besides weights and config; copied along unchanged.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def resolve_source(path: str | os.PathLike, weights: str = "ema") -> ModelSource:
    """What `convert` reads from `path` (rdlm.model.resolve; a preset has no weights to convert)."""
    found = resolve_model_source(path, weights)
    if found.kind == "preset":
        raise ValueError(
            f"{os.fspath(path)!r} is a preset (random weights), nothing to convert: give a model "
            "directory, a training checkpoint step-N/ or a run directory (write ./NAME for a "
            "directory of that name)"
        )
    return found


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '100KB' or a number of bytes, at least one (0 would put every tensor in a shard of its own)."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
        if not match:
            raise ValueError(f"size {text!r} is not a number of bytes or like 5GB / 500MB")
        unit = (match.group(2) or "B").upper().replace("I", "")
        size = int(float(match.group(1)) * {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[unit])
    if size < 1:
        raise ValueError(f"shard size {text!r} is less than one byte: give a size like 5GB or 500MB")
    return size


def model_dir_file(name: str) -> bool:
    """What writing a model directory replaces there: the layout's files and the tokenizer files copied in."""
    return is_model_file(name) or name in SIDE_FILES


def check_destination(
    destination: str | os.PathLike,
    source: Path,
    in_place: bool = False,
    overwrite: bool = False,
    in_place_flag: str | None = "--in-place",
    flag: str = "destination",
) -> Path:
    """Refuse a destination whose files writing a model there could lose (rdlm.fileio.claim_output_dir, the
    rule every command shares): a file; the source itself (unless `in_place`, and never when `in_place_flag`
    is None); a model directory (unless `overwrite`: its config, weights and tokenizer are replaced, its
    other files kept); a non-empty directory that holds no model."""
    return claim_output_dir(
        destination,
        model_dir_file,
        overwrite,
        "a model",
        flag=flag,
        source=source,
        in_place_flag=in_place_flag,
        in_place=in_place,
        remove=False,
        others_allowed=lambda ours: CONFIG_NAME in ours,
    )


def check_side_files(source: Path) -> dict[str, Path]:
    """The tokenizer and generation files of `source` to copy along, each checked to parse first."""
    found = {name: source / name for name in SIDE_FILES if (source / name).is_file()}
    for name, path in found.items():
        if name == TOKENIZER_FILE:
            Tokenizer.check_file(path, ValueError)
        else:
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: not valid JSON ({err}); fix or remove it first") from None
    return found


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    weights: str = "ema",
    in_place: bool = False,
    quantize: Any = None,
    group_size: int = 128,
    overwrite: bool = False,
) -> Path:
    """Write the weights of `source` to `destination` in the Huginn layout.

    dtype: "bf16", "fp32", a torch dtype, or None / "keep" for the source's own. Shards larger than
    `max_shard_bytes` are split, with `model.safetensors.index.json`. Tokenizer and generation files of
    the source are copied along. quantize: weight-only quantization (rdlm.model.quantize) of the saved
    weights, in `dtype`'s activations.

    A model directory is replaced only with `overwrite` (in place of the source, only with `in_place`): its
    config.json, weight files, index and tokenizer files; anything else there stays. A file and a non-empty
    directory that is not a model directory are refused as destinations (`check_destination`, docs/files.md).
    """
    dtype = resolve_dtype(dtype)
    max_bytes = parse_size(max_shard_bytes)
    found = resolve_source(source, weights)
    # The tokenizer and generation files sit beside the weights, or beside trainer.json when sharded.
    src = found.checkpoint if found.sharded else found.directory
    assert src is not None  # a model source found has its directory (a checkpoint's, when sharded)
    destination = check_destination(destination, src, in_place, overwrite)
    side = {} if src.resolve() == destination.resolve() else check_side_files(src)
    # the file's own dtype (FSDP shards are gathered in float32); quantized in the dtype it is saved in
    model = found.load(dtype=dtype if quantize else None, quantize=quantize, group_size=group_size)
    save_pretrained(model, destination, dtype=dtype, max_shard_bytes=max_bytes, extra_files=side)
    return destination


def merge_lora(
    adapter: str | os.PathLike,
    destination: str | os.PathLike,
    base: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    any_base: bool = False,
    overwrite: bool = False,
) -> tuple[Path, list[str]]:
    """Write `base` with LoRA `adapter` merged into its weights (W + alpha/rank B A, computed in float32) to
    `destination`, in the base's layout with its tokenizer and generation files. base None: the base the
    adapter records. dtype: of the written weights (None: the base's own). Refused before anything is
    written: a missing base, a base the adapter was not made for (rdlm.model.lora.check_base), a base saved
    quantized (the update would be rounded into its integer weights), a destination that would lose files.
    Returns the directory and notes for the user (an adapter trained over a quantized base)."""
    from rdlm.model.lora import merge_adapter
    from rdlm.model.lora_files import load_adapter, read_adapter, recorded_base

    files = read_adapter(adapter)
    if base is None:
        base = recorded_base(files, "--base")
    found = resolve_source(base, "model")
    src = found.checkpoint if found.sharded else found.directory
    assert src is not None
    destination = check_destination(destination, src, overwrite=overwrite, in_place_flag=None, flag="--out")
    side = check_side_files(src)
    stored_quantization = read_quantization(found.directory) if found.directory is not None else None
    if stored_quantization is not None:  # (read from its config.json, before the weights are)
        raise ValueError(
            f"{base} is saved quantized ({stored_quantization}): merging would round the adapter's update into "
            "its integer weights; merge into the unquantized model (and quantize the merged one if you want)"
        )
    model = found.load()  # in the file's own dtype, the merged model's default
    stored = model.embedding.weight.dtype
    cast_parameters(model, torch.float32)
    load_adapter(model, files, any_base=any_base, dtype=torch.float32)
    merge_adapter(model)
    notes = []
    trained_over = files.info.get("quantization")
    if trained_over:
        notes.append(
            f"the adapter was trained over a quantized base ({trained_over}: QLoRA); the merged model holds the "
            "unquantized weights, so its outputs differ from the quantized base + adapter by the quantization "
            "error (quantize the merged model to serve it as trained)"
        )
    max_bytes = parse_size(max_shard_bytes)
    save_pretrained(
        model, destination, dtype=resolve_dtype(dtype) or stored, max_shard_bytes=max_bytes, extra_files=side
    )
    return destination, notes
