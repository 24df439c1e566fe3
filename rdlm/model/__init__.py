"""The model: its configuration, the recurrent-depth network, the distribution of r, and the
Huginn-0125 checkpoint layout (load, save, convert training checkpoints)."""

from rdlm.model.config import PRESETS, ConfigError, RDLMConfig
from rdlm.model.lm import RecurrentDepthLM, RecurrentOutput

__all__ = ["PRESETS", "ConfigError", "RDLMConfig", "RecurrentDepthLM", "RecurrentOutput"]
