"""The model families rdlm runs and their checkpoint layouts (docs/model-families.md): one adapter per
family, found by name or by a config.json, as torchtitan's model registry finds a model's state-dict adapter.

One `RecurrentDepthLM` runs them all; a family is a configuration of it (`RDLMConfig` fields) plus a layout:

- "huginn" (`families.huginn`): Huginn-0125 (Geiping et al. 2025), config.json model_type "huginn_raven".
- "retrofit-llama" / "retrofit-olmo" (`families.retrofit`): McLeish et al. 2025's retrofitted models, in the
  Huginn layout with more keys; one adapter class, an instance per source family.
- "ouro" (`families.ouro`): ByteDance's Ouro, model_type "ouro", in transformers' Llama-style tensor names.

Each adapter detects its config.json, maps it to and from an `RDLMConfig` and maps tensor names both ways;
`rdlm.model.huginn` reads and writes directories through them. Remote code shipped beside a checkpoint
(`auto_map`) is never imported: the config keys say everything. Nothing outside this package asks which
family a model is: what differs is a config field, and what a file holds is its adapter's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rdlm.model.config import RDLMConfig
from rdlm.model.families.base import CheckpointError, FamilyAdapter, declared_family, standard_rope_keys
from rdlm.model.families.huginn import HUGINN, MODEL_TYPE
from rdlm.model.families.ouro import OURO
from rdlm.model.families.retrofit import RETROFIT_LLAMA, RETROFIT_OLMO, RetrofitAdapter

# name (RDLMConfig.family) -> adapter; read-only.
ADAPTERS: Mapping[str, FamilyAdapter] = MappingProxyType(
    {adapter.name: adapter for adapter in (HUGINN, RETROFIT_LLAMA, RETROFIT_OLMO, OURO)}
)
# transformers model_type of a retrofit source -> the adapter of what it becomes (rdlm.model.retrofit).
RETROFIT_SOURCES: Mapping[str, RetrofitAdapter] = MappingProxyType(
    {adapter.source_model_type: adapter for adapter in (RETROFIT_LLAMA, RETROFIT_OLMO)}
)

__all__ = [
    "ADAPTERS",
    "MODEL_TYPE",
    "RETROFIT_SOURCES",
    "CheckpointError",
    "FamilyAdapter",
    "adapter_of",
    "detect",
    "standard_rope_keys",
]


def adapter_of(config: RDLMConfig) -> FamilyAdapter:
    """The adapter of the layout `config` is saved in (its `family`)."""
    return ADAPTERS[config.family]


def detect(raw: Mapping[str, Any], tensor_names: set[str] | None = None, source: str = "config.json") -> FamilyAdapter:
    """The adapter of a config.json dict (RoPE keys in the standard spelling): among the families of its
    model_type, the one rdlm's section declares, else the one that claims it (for the retrofitted
    variants, from `tensor_names` too: see `FamilyAdapter.needs_tensor_names`)."""
    kind = raw.get("model_type", MODEL_TYPE)
    candidates = [adapter for adapter in ADAPTERS.values() if adapter.model_type == kind]
    if not candidates:
        expected = " or ".join(map(repr, dict.fromkeys(adapter.model_type for adapter in ADAPTERS.values())))
        raise CheckpointError(f"{source}: model_type is {kind!r}, expected {expected}")
    declared = declared_family(raw)
    for adapter in candidates:
        if adapter.name == declared:
            return adapter
    for adapter in candidates:
        if adapter.claims(raw, tensor_names):
            return adapter
    raise CheckpointError(f"{source}: no model family of model_type {kind!r} recognises this config")
