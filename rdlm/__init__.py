"""rdlm: recurrent-depth language models (Geiping et al., 2025) in plain PyTorch."""

from rdlm.model.config import PRESETS, ConfigError, RDLMConfig
from rdlm.model.huginn import CheckpointError, load_pretrained, save_pretrained
from rdlm.model.lm import RecurrentDepthLM, RecurrentOutput
from rdlm.model.recurrence import sample_num_steps

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ConfigError",
    "RDLMConfig",
    "RecurrentDepthLM",
    "RecurrentOutput",
    "build_model",
    "load_model",
    "load_pretrained",
    "sample_num_steps",
    "save_pretrained",
]


def build_model(preset: str = "tiny", seed: int | None = None, **overrides) -> RecurrentDepthLM:
    """A freshly initialized model from a named preset, with optional config field overrides."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    return RecurrentDepthLM(RDLMConfig.from_preset(preset, **overrides))


def load_model(
    source: str, *, dtype=None, device="cpu", weights: str = "ema", quantize=None, group_size: int = 128
) -> RecurrentDepthLM:
    """The model `source` names, in eval mode: a preset (a new random model; `preset:NAME` when a folder
    of that name holds a model too), a Huginn-layout directory, a training checkpoint `step-N/` or a run
    directory (its newest complete checkpoint). dtype: a name ("bf16", "float32", ...) or torch dtype,
    None for the file's own; weights: of a checkpoint, "ema" (when the run kept one) or "model".
    quantize: weight-only quantization per part ("int8", "int4", "core=int4,prelude=int8,head=none", ...;
    group_size is int4's; docs/quantization.md). The rules are rdlm.model.resolve's, shared by every
    command's `--model`."""
    from rdlm.model.resolve import load_model as load

    return load(source, dtype=dtype, device=device, weights=weights, quantize=quantize, group_size=group_size)
