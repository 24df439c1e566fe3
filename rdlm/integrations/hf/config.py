"""The transformers configs rdlm registers: model_type "huginn_raven" (Huginn and the retrofitted models)
and "ouro" (where transformers itself has no such type), their config.json keys read and written by the
families' adapters (`rdlm.model.families`, through `rdlm.model.huginn`)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import ClassVar

import torch
from transformers import PreTrainedConfig

from rdlm.model import huginn
from rdlm.model.config import RDLMConfig
from rdlm.model.families import MODEL_TYPE, adapter_of

GENERATION_CONFIG_NAME = "generation_config.json"


class RavenConfig(PreTrainedConfig):
    """The Huginn config.json keys (docs/checkpoint-format.md#config-keys); defaults are Huginn-0125's.

    Keys rdlm does not model (init_values, sampling_scheme, ...) are kept as plain attributes so that
    a loaded config saves back unchanged. `to_rdlm()` gives the model's `RDLMConfig`.
    """

    model_type = MODEL_TYPE
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "block_size",
    }

    n_embd: int = 5280
    n_heads: int = 55
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    intermediate_size: int = 17920
    vocab_size: int = 65536
    block_size: int = 4096
    norm_eps: float = 1e-6
    rope_base: float = 50000.0
    qk_bias: bool = True
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = 65505
    pad_token_id: int | None = 65509
    tie_word_embeddings: bool = False  # tying lives inside RecurrentDepthLM, not in transformers' loader

    def to_rdlm(self) -> RDLMConfig:
        return huginn.config_from_huginn(self.to_dict(), source=f"{MODEL_TYPE} config")

    @classmethod
    def from_rdlm(cls, config: RDLMConfig, dtype: torch.dtype = torch.float32) -> RavenConfig:
        return cls(**huginn.config_to_huginn(config, dtype))


class OuroConfig(PreTrainedConfig):
    """Ouro's config.json keys (docs/model-families.md), kept as they are; `to_rdlm()` gives the model's
    `RDLMConfig`. Registered only where transformers has no "ouro" type of its own."""

    model_type = "ouro"
    tie_word_embeddings: bool = False

    def to_rdlm(self) -> RDLMConfig:
        return huginn.config_from_huginn(self.to_dict(), source="ouro config")

    @classmethod
    def from_rdlm(cls, config: RDLMConfig, dtype: torch.dtype = torch.float32) -> OuroConfig:
        return cls(**huginn.config_to_huginn(config, dtype))


# transformers model_type -> config class: each family's adapter names the model_type its files have.
CONFIG_CLASSES: dict[str, type[PreTrainedConfig]] = {
    RavenConfig.model_type: RavenConfig,
    OuroConfig.model_type: OuroConfig,
}


def config_class_of(config: RDLMConfig) -> type[PreTrainedConfig]:
    """The transformers config class of a model's family."""
    return CONFIG_CLASSES[adapter_of(config).model_type]


@contextlib.contextmanager
def quiet_rope_notes() -> Iterator[None]:
    """transformers 5 renames a config's `rope_scaling` to `rope_parameters` and says so on every load; the
    retrofitted models' files spell it the old way (their authors' code reads that), so the note is noise."""
    logger = logging.getLogger("transformers.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`rope_scaling` is deprecated", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)
