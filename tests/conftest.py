from pathlib import Path

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM

FIXTURES = Path(__file__).parent / "fixtures"
HUGINN_TINY = FIXTURES / "huginn-tiny"


@pytest.fixture
def tiny_model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


@pytest.fixture
def huginn_tiny_dir() -> Path:
    return HUGINN_TINY
