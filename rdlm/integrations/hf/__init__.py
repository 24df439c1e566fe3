"""Hugging Face `transformers` integration: config + model pairs for model_type "huginn_raven" (Huginn and the
retrofitted models) and "ouro" (registered only where transformers has no "ouro" of its own).

    import rdlm.integrations.hf  # registers the classes with AutoConfig / AutoModelForCausalLM / AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("path/to/huginn-dir")          # no trust_remote_code
    out = model.generate(ids, max_new_tokens=32, num_steps=16, do_sample=False)

The released Huginn-0125 `config.json` names the authors' remote code in `auto_map`. Once the type
"huginn_raven" is registered locally, transformers resolves to the local classes and never asks for
`trust_remote_code`. The weights are read and written by `rdlm.model.huginn`, the one home of the Huginn
layout: `RavenForCausalLM` wraps a `RecurrentDepthLM` and only adapts calling conventions.

Supported transformers versions: SUPPORTED_TRANSFORMERS below (configs are dataclasses from 5.0 on).
"""

from __future__ import annotations

SUPPORTED_TRANSFORMERS = (">=5.0", "<6")


def _check_transformers_version() -> None:
    try:
        import transformers
    except ImportError as err:
        raise ImportError("rdlm.integrations.hf needs transformers: pip install 'rdlm[hf]'") from err
    from packaging.version import Version

    version = Version(transformers.__version__)
    if not Version("5.0") <= version < Version("6"):
        raise ImportError(
            f"rdlm.integrations.hf supports transformers {','.join(SUPPORTED_TRANSFORMERS)}, found "
            f"{transformers.__version__}; pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'"
        )


_check_transformers_version()

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rdlm.integrations.hf.cache import RecurrentCache, padding_attention_mask  # noqa: E402
from rdlm.integrations.hf.config import GENERATION_CONFIG_NAME, MODEL_TYPE, OuroConfig, RavenConfig  # noqa: E402
from rdlm.integrations.hf.generation import (  # noqa: E402
    RDLM_GENERATION_DEFAULTS,
    unsupported_generation_options,
    with_rdlm_generation_defaults,
)
from rdlm.integrations.hf.model import OuroForCausalLM, RavenForCausalLM  # noqa: E402
from rdlm.integrations.hf.tokenizer import RavenTokenizerFast, load_tokenizer  # noqa: E402

__all__ = [
    "GENERATION_CONFIG_NAME",
    "MODEL_TYPE",
    "RDLM_GENERATION_DEFAULTS",
    "SUPPORTED_TRANSFORMERS",
    "OuroConfig",
    "OuroForCausalLM",
    "RavenConfig",
    "RavenForCausalLM",
    "RavenTokenizerFast",
    "RecurrentCache",
    "load_tokenizer",
    "padding_attention_mask",
    "register",
    "unsupported_generation_options",
    "with_rdlm_generation_defaults",
]


def register() -> None:
    """Register with the Auto classes (idempotent). Done on import of this module."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    for config, model in ((RavenConfig, RavenForCausalLM), (OuroConfig, OuroForCausalLM)):
        if config.model_type not in CONFIG_MAPPING:  # a type transformers has itself stays its own
            AutoConfig.register(config.model_type, config)
        if CONFIG_MAPPING[config.model_type] is not config:
            continue
        if config not in AutoModelForCausalLM._model_mapping:
            AutoModelForCausalLM.register(config, model)
        if config is RavenConfig and config not in TOKENIZER_MAPPING:  # Ouro ships its own tokenizer class
            AutoTokenizer.register(config, fast_tokenizer_class=RavenTokenizerFast)


register()
