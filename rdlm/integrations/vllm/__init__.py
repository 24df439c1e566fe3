"""vLLM plugin: serve rdlm's models (every family rdlm reads) with vLLM, the recurrence done per token
(docs/vllm.md). vLLM finds it through its `vllm.general_plugins` entry point once rdlm is installed beside
vLLM; nothing is copied into vLLM.

    python -m vllm.entrypoints.openai.api_server --model DIR --hf-overrides '{"rdlm_num_steps": 16}'
    vllm.LLM(DIR, hf_overrides={"rdlm_exit_criterion": "latent-diff"})

`register` is the entry point: it registers rdlm's transformers configs (model_type "huginn_raven" and, where
transformers has none, "ouro") and the model class under the architectures the checkpoints name.
The model itself (rdlm.integrations.vllm.model) imports vLLM, and is imported by vLLM only when it loads one.
"""

from __future__ import annotations

ARCHITECTURES = ("RavenForCausalLM", "OuroForCausalLM")
MODEL_CLASS = "rdlm.integrations.vllm.model:RecurrentDepthForCausalLM"


def register() -> None:
    """vLLM's plugin entry point (idempotent): rdlm's configs with transformers, its model with vLLM."""
    from vllm import ModelRegistry

    import rdlm.integrations.hf  # noqa: F401  (registers the configs with transformers' AutoConfig)

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, MODEL_CLASS)
