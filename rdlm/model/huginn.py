"""Model directories of every family (docs/checkpoint-format.md, docs/model-families.md): the one home of
reading and writing them. What a family's files hold (config keys, tensor names) is its adapter's
(`rdlm.model.families`); this module finds, reads, checks, shards and swaps the files.

A model directory holds `config.json` (the family's own keys: model_type "huginn_raven" for Huginn and
the retrofitted models, "ouro" for Ouro), weights in safetensors (one file, or shards listed by
`model.safetensors.index.json`) and optionally `tokenizer.json`. Weights are only ever read with
safetensors: nothing is unpickled, and no code shipped beside the weights is run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rdlm.fileio import confined_name, recover_dir, staging_dir, write_json
from rdlm.model.config import RDLMConfig
from rdlm.model.families import CheckpointError, adapter_of, detect, standard_rope_keys
from rdlm.model.lm import RecurrentDepthLM, rope_tables

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


# ------------------------------------------------------------------------------------------------
# config.json


def config_from_huginn(
    raw: dict[str, Any], source: str = CONFIG_NAME, tensor_names: set[str] | None = None
) -> RDLMConfig:
    """Read a config.json dict of any family rdlm runs (its adapter, `rdlm.model.families.detect`; the
    retrofitted OLMo variant is told from the Llama one by its tensor names).

    The one reader of model configs: `rdlm.load_pretrained` and `rdlm.integrations.hf.RavenConfig.to_rdlm`
    both come here."""
    raw = standard_rope_keys(raw)
    return detect(raw, tensor_names, source).config_from_json(raw, source)


def config_to_huginn(config: RDLMConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of `config` in its family's layout."""
    return adapter_of(config).config_to_json(config, dtype)


def read_config(path: str | os.PathLike) -> RDLMConfig:
    """The model config of a model directory (config.json, and the tensor names where the family needs them)."""
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} (not a model directory)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    needs_names = detect(standard_rope_keys(raw), source=str(config_path)).needs_tensor_names
    return config_from_huginn(raw, str(config_path), tensor_names(path) if needs_names else None)


def tensor_names(path: str | os.PathLike) -> set[str]:
    """The tensor names of a model directory, read from the index or the file headers only."""
    names: set[str] = set()
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt") as handle:
                names.update(handle.keys())
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from err
    return names


# ------------------------------------------------------------------------------------------------
# Loading


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory: the shards of its index, or its single file."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: malformed index ({err})") from err
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index}: weight_map must be an object of tensor name -> file name, got "
                f"{type(weight_map).__name__} {str(weight_map)[:60]}"
            )
        files = [path / confined(name, index) for name in dict.fromkeys(weight_map.values())]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" ({', '.join(pickles)} not read: pickle files are never loaded)" if pickles else ""
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_NAME}{hint}")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: listed weight file is missing")
    return files


def confined(name: Any, source: str | os.PathLike) -> str:
    """A file name read from a model directory's own metadata, refused unless it stays inside it."""
    return confined_name(name, source, CheckpointError, "model directory")


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a model directory under the file's own names."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (not a dict: no iteration)
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from err
    return tensors


def load_pretrained(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> RecurrentDepthLM:
    """Load a model directory of any family (read through its adapter, `rdlm.model.families`). dtype None
    keeps the file's floating dtype (bf16 or fp32)."""
    for note in recover_dir(path):  # a save that a crash interrupted: the complete copy comes back
        print(f"rdlm: {note}", file=sys.stderr)
    config = read_config(path)
    spec = read_quantization(path)
    tensors = read_weights(path)
    adapter = adapter_of(config)
    quantized = adapter.quantized_from_file(tensors, path) if spec is not None else {}
    rope_table = adapter.rope_from_file(tensors)
    state, unexpected = adapter.from_file(tensors)
    file_name = adapter.file_name
    # A tied head saved beside the embedding must equal it; it is not a parameter of its own.
    if (
        config.tie_embeddings
        and "lm_head.weight" in state
        and not torch.equal(state.pop("lm_head.weight"), state.get("embedding.weight", torch.empty(0)))
    ):
        raise CheckpointError(
            f"{path}: lm_head.weight differs from {file_name('embedding.weight')}, "
            "but the config says the embeddings are tied"
        )
    with torch.device("meta"):
        model = RecurrentDepthLM(config)
    if dtype is None:
        embedding = state.get("embedding.weight")
        dtype = embedding.dtype if embedding is not None and embedding.is_floating_point() else torch.float32
    if spec is not None:
        _attach_stored_quantized(model, spec, quantized, state, dtype, device, path)
    expected = {name: p.shape for name, p in model.named_parameters()}
    missing = [file_name(n) for n in expected if n not in state]
    unexpected += [file_name(n) for n in state if n not in expected]
    if missing or unexpected:
        parts = ([f"missing tensor(s) {_listing(missing)}"] if missing else []) + (
            [f"unexpected tensor(s) {_listing(unexpected)}"] if unexpected else []
        )
        raise CheckpointError(f"{path}: " + "; ".join(parts))
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(
                f"{path}: tensor {file_name(name)} has shape {list(state[name].shape)}, expected {list(shape)}"
            )
        if not state[name].is_floating_point():
            raise CheckpointError(f"{path}: tensor {file_name(name)} has dtype {state[name].dtype}")
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    model.load_state_dict(state, assign=True)
    cos, sin = stored_rope_tables(rope_table, config, path)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.source = str(path)  # named by errors about the weights (non-finite logits)
    return model.eval()


def read_quantization(path: str | os.PathLike):
    """The QuantSpec a model directory's config.json records (rdlm.model.quantize), or None."""
    from rdlm.model.quantize import CONFIG_KEY, QuantizationError, QuantSpec

    raw = json.loads((Path(path) / CONFIG_NAME).read_text())  # read_config has validated the file
    if raw.get(CONFIG_KEY) is None:
        return None
    try:
        return QuantSpec.from_json(raw[CONFIG_KEY], f"{Path(path) / CONFIG_NAME}")
    except QuantizationError as err:
        raise CheckpointError(str(err)) from None


def _attach_stored_quantized(
    model, spec, quantized: dict[str, torch.Tensor], state: dict[str, torch.Tensor], dtype: torch.dtype, device, path
) -> None:
    """Put the stored quantized layers into `model` (built on the meta device); their biases come out of
    `state`. Anything left over or ill-fitting is refused in one line."""
    from rdlm.model.quantize import QuantizationError, attach_quantized, layers

    for part, name, _module in list(layers(model)):
        if getattr(spec, part) != "none" and f"{name}.bias" in state:
            quantized[f"{name}.bias"] = state.pop(f"{name}.bias").to(device=device, dtype=dtype)
    if spec.head != "none" and model.lm_head is None:
        state.pop("lm_head.weight", None)  # a float copy of a tied head is the embedding; the quantized one is used
    try:
        attach_quantized(model, spec, quantized, device, str(path))
    except QuantizationError as err:
        raise CheckpointError(str(err)) from None
    if quantized:
        raise CheckpointError(
            f"{path}: unexpected quantized tensor(s) {_listing(list(quantized))} (config.json's quantization is {spec})"
        )


def stored_rope_tables(
    table: torch.Tensor | None, config: RDLMConfig, source: str | os.PathLike = "checkpoint"
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin [context_length, head_dim/2] in float32: the checkpoint's own table when it has one,
    else computed (`rope_tables`).

    The reference code keeps RoPE as a saved buffer `freqs_cis` [1, context, 1, head_dim/2, 2] (cos, sin
    pairs; older files may hold it complex) and uses the stored values. A bfloat16 checkpoint stores them
    rounded to bfloat16, and the reference multiplies those rounded values into float32 queries and keys;
    so do we, whatever dtype the model is loaded in. A table that is not the config's RoPE beyond storage
    round-off is refused rather than used or silently replaced.
    """
    cos, sin = rope_tables(config.head_dim, config.context_length, config.rope_base, config.rope_scaling)
    if table is None:
        return cos, sin
    if table.is_complex():
        table = torch.view_as_real(table)
    expected = (1, config.context_length, 1, config.head_dim // 2, 2)
    if tuple(table.shape) != expected:
        raise CheckpointError(
            f"{source}: freqs_cis has shape {list(table.shape)}, expected {list(expected)} "
            f"(context {config.context_length}, head dim {config.head_dim})"
        )
    if not table.is_floating_point():
        raise CheckpointError(f"{source}: freqs_cis has dtype {table.dtype}")
    stored_cos, stored_sin = table[0, :, 0, :, 0].float(), table[0, :, 0, :, 1].float()
    error = max((stored_cos - cos).abs().max().item(), (stored_sin - sin).abs().max().item())
    if not error <= ROPE_TOLERANCE:
        raise CheckpointError(
            f"{source}: freqs_cis is not the RoPE table of rope_base={config.rope_base} "
            f"(max difference {error:.3g}); the file and its config disagree"
        )
    return stored_cos.contiguous(), stored_sin.contiguous()


# Storage round-off of a RoPE table: half a bfloat16 step at 1 is 2^-9 ~ 2e-3; a float16 table is closer.
ROPE_TOLERANCE = 1e-2


# ------------------------------------------------------------------------------------------------
# Saving


def save_pretrained(
    model: RecurrentDepthLM,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    extra_json: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
) -> Path:
    """Write `model` to `path` in its family's layout (`rdlm.model.families`), atomically; `extra_json` maps
    more file names to JSON data written with it (e.g. transformers' generation_config.json), `extra_files`
    more file names to files copied in with it (a source's tokenizer: the model and the files it needs
    appear together or not at all).

    Everything is written to a temporary sibling directory, flushed to disk, then swapped in place
    of `path`; files already in `path` that the layout does not own (a tokenizer, notes, data) are
    carried over (hard links where the file system allows, symlinks as symlinks), and the directory
    keeps its permissions. A crash at any point leaves either the old directory or the new one, never
    a mix (see `rdlm.fileio.recover_dir`).
    """
    path = Path(path)
    params = dict(model.named_parameters())
    dtype = dtype or next(iter(params.values())).dtype
    config = model.config
    adapter = adapter_of(config)
    raw_config = adapter.config_to_json(config, dtype)  # first: refuses a model the family's layout cannot hold
    spec = getattr(model, "quantization", None)
    quantized: dict[str, torch.Tensor] = {}
    if spec is not None:
        from rdlm.model.quantize import CONFIG_KEY, quantized_tensors

        quantized = adapter.quantized_to_file(quantized_tensors(model), dtype)  # or refuses the layout
        raw_config[CONFIG_KEY] = spec.to_json()
    cpu = {n: p.detach().to("cpu", dtype).contiguous() for n, p in params.items()}
    rope = adapter.rope_to_file(model.rope_cos, model.rope_sin, dtype)
    tensors = {**adapter.to_file(cpu, config), **quantized, **rope}

    with staging_dir(path) as tmp:
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_FILE, metadata={"format": "pt"})
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for name, shard in zip(names, shards, strict=True):
                save_file(shard, tmp / name, metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json(tmp / CONFIG_NAME, raw_config)
        for name, data in (extra_json or {}).items():
            write_json(tmp / name, data)
        for name, source in (extra_files or {}).items():
            shutil.copy2(source, tmp / name)
        if path.is_dir():
            for old in path.iterdir():
                if not is_model_file(old.name) and not (tmp / old.name).exists():
                    _carry(old, tmp / old.name)
    return path


def _carry(source: Path, target: Path) -> None:
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, target)


def _link_or_copy(source, target) -> None:
    try:
        os.link(source, target)  # never modified in place, so sharing the inode is safe and free
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def is_model_file(name: str) -> bool:
    """Whether the layout owns a file of this name (save_pretrained replaces it; nothing else)."""
    return name in (CONFIG_NAME, INDEX_NAME, SINGLE_FILE) or bool(_SHARD_RE.match(name))
