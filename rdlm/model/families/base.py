"""What every family adapter shares: the interface (`FamilyAdapter`), the error, and the config.json helpers
each family's reader uses (key types, RoPE spelling, rdlm's own section)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rdlm.model.config import RDLMConfig, check_keys


class CheckpointError(ValueError):
    """A model directory or weight file is missing, malformed, or does not fit the config."""


class FamilyAdapter(ABC):
    """One model family's checkpoint layout: how to recognise its config.json, map it to and from an
    `RDLMConfig`, and name its tensors both ways (torchtitan's state-dict adapters, with the config
    mapping and the detection beside them). `rdlm.model.huginn` reads and writes directories through
    these methods alone; the registry (`rdlm.model.families.ADAPTERS`) finds the adapter of a file or a
    config. What the model computes differently per family is `RDLMConfig` fields, never an adapter's."""

    name: str  # RDLMConfig.family
    model_type: str  # config.json's model_type (transformers' key for the config class)
    needs_tensor_names = False  # telling it from its siblings needs the checkpoint's tensor names

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @abstractmethod
    def claims(self, raw: Mapping[str, Any], tensor_names: set[str] | None) -> bool:
        """Whether a config.json of this family's model_type that declares no family is this family's."""

    @abstractmethod
    def config_from_json(self, raw: Mapping[str, Any], source: str) -> RDLMConfig:
        """The model config of a config.json dict (RoPE keys in the standard spelling); a key this family
        cannot hold is a CheckpointError naming it."""

    @abstractmethod
    def config_to_json(self, config: RDLMConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The config.json of `config`; a CheckpointError if the layout cannot hold the model."""

    @abstractmethod
    def from_file(self, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
        """The file's tensors as rdlm parameters, and the file names rdlm has no place for."""

    @abstractmethod
    def to_file(self, params: Mapping[str, Tensor], config: RDLMConfig) -> dict[str, Tensor]:
        """rdlm parameters as the file's tensors, in the order they are written (and sharded)."""

    @abstractmethod
    def file_name(self, name: str) -> str:
        """The file's name of an rdlm parameter, for messages."""

    @abstractmethod
    def quantized_from_file(self, tensors: dict[str, Tensor], source: str | os.PathLike) -> dict[str, Tensor]:
        """Take the quantized layers' tensors (`X.qweight`, `X.scales`, `X.zeros`) out of `tensors`, keyed by
        rdlm's module names (rdlm.model.quantize)."""

    @abstractmethod
    def quantized_to_file(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
        """rdlm.model.quantize.quantized_tensors under the file's names; a bias in `dtype`."""

    def rope_from_file(self, tensors: dict[str, Tensor]) -> Tensor | None:
        """Take a stored RoPE table out of `tensors` (rdlm.model.huginn.stored_rope_tables), if the layout has one."""
        return None

    def rope_to_file(self, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        """The RoPE table the layout stores beside the weights, if any."""
        return {}


# ------------------------------------------------------------------------------------------------
# config.json helpers

_JSON_KINDS = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
    type(None): "null",
}
_ACCEPTS = {"integer": (int,), "number": (int, float), "boolean": (bool,)}


def check_key_types(raw: Mapping[str, Any], kinds: Mapping[str, str], source: str) -> None:
    """Refuse a config.json key of the wrong JSON type ("integer", "number" or "boolean"), naming the key as
    the file spells it: `"n_embd": "64"` is a string, not the integer the model's shape needs."""
    for key, kind in kinds.items():
        value = raw.get(key)
        if value is None:
            continue
        wrong_bool = isinstance(value, bool) and kind != "boolean"
        if wrong_bool or not isinstance(value, _ACCEPTS[kind]):
            raise CheckpointError(
                f"{source}: {key} must be {'an' if kind == 'integer' else 'a'} {kind}, got "
                f"{value!r} ({_JSON_KINDS.get(type(value), type(value).__name__)})"
            )


def standard_rope_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with RoPE in the config.json spelling (`rope_theta`, `rope_scaling`): transformers 5 keeps both
    inside `rope_parameters` (its configs' `to_dict()`), which is read the same way."""
    raw = dict(raw)
    params = raw.pop("rope_parameters", None)
    if isinstance(params, dict):
        params = dict(params)
        theta = params.pop("rope_theta", None)
        if raw.get("rope_theta") is None and theta is not None:
            raw["rope_theta"] = theta
        if raw.get("rope_scaling") is None and params.get("rope_type", "default") != "default":
            raw["rope_scaling"] = params
    if "rope_theta" in raw and raw["rope_theta"] is None:
        del raw["rope_theta"]
    return raw


def declared_family(raw: Mapping[str, Any]) -> str | None:
    """The family rdlm wrote in the file's "rdlm" section, if any."""
    return raw.get("rdlm", {}).get("family") if isinstance(raw.get("rdlm"), dict) else None


def with_rdlm_section(
    values: dict[str, Any], raw: Mapping[str, Any], source: str, keys: Mapping[str, str] | None = None
) -> RDLMConfig:
    """The config of `values` and the file's "rdlm" section: fields rdlm adds (sampler, ...) travel there,
    so a round trip is lossless. `keys`: the file's name of a field, which an error about it names too."""
    extra = raw.get("rdlm", {})
    try:
        if not isinstance(extra, dict):
            raise ValueError(f"the rdlm section must be an object, got {extra!r}")
        check_keys(extra)
        values.update(extra)
        return RDLMConfig.from_dict(values)
    except ValueError as err:
        field, _, rest = str(err).partition(" ")
        theirs = (keys or {}).get(field, field)
        named = f"{theirs} ({field}) {rest}" if theirs != field and field not in (extra or {}) else str(err)
        raise CheckpointError(f"{source}: {named}") from err


# Fields beyond Huginn-0125's; a Huginn-layout file keeps those that differ from the default in its
# "rdlm" section (the retrofitted and Ouro layouts have keys of their own for most of them).
_GENERAL = (
    "num_kv_heads",
    "head_size",
    "qk_norm",
    "rope_pairs",
    "rope_scaling",
    "embed_scale",
    "final_norm",
    "adapter_bias",
    "exit_gate",
    "exit_threshold",
    "norm_scheme",
    "injection",
    "state_init",
)


def rdlm_section(config: RDLMConfig, general: bool) -> dict[str, Any]:
    """The file's "rdlm" section: the fields no family key holds (and with `general`, every field beyond
    Huginn-0125's that differs from its default)."""
    section = {
        key: getattr(config, key)
        for key in ("family", "recurrence_sampler", "recurrence_sigma", "activation_checkpointing", "name")
    }
    if general:
        default = RDLMConfig()
        section.update({key: getattr(config, key) for key in _GENERAL if getattr(config, key) != getattr(default, key)})
    return section
