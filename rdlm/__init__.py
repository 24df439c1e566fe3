"""rdlm: recurrent-depth language models (Geiping et al., 2025) in plain PyTorch."""

from rdlm.model.config import PRESETS, ConfigError, RDLMConfig
from rdlm.model.huginn import CheckpointError, load_pretrained, save_pretrained
from rdlm.model.lm import RecurrentDepthLM, RecurrentOutput
from rdlm.model.recurrence import sample_num_steps

__version__ = "0.1.0"

__all__ = ["PRESETS", "CheckpointError", "ConfigError", "RDLMConfig", "RecurrentDepthLM",
           "RecurrentOutput", "load_pretrained", "sample_num_steps", "save_pretrained", "build_model",
           "load_model"]


def build_model(preset: str = "tiny", seed: int | None = None, **overrides) -> RecurrentDepthLM:
    """A freshly initialized model from a named preset, with optional config field overrides."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    return RecurrentDepthLM(RDLMConfig.from_preset(preset, **overrides))


def load_model(source: str, **kwargs) -> RecurrentDepthLM:
    """A model from a Huginn-layout directory, or a new random one if `source` names a preset."""
    from pathlib import Path

    if source in PRESETS and not Path(source).exists():
        return build_model(source)
    if not Path(source).exists():
        import difflib

        close = difflib.get_close_matches(source, list(PRESETS), n=1)
        hint = f" (did you mean preset {close[0]!r}?)" if close else f"; presets: {', '.join(PRESETS)}"
        raise FileNotFoundError(f"{source!r} is neither a model directory nor a preset{hint}")
    return load_pretrained(source, **kwargs)
