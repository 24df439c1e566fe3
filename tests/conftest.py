from pathlib import Path

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM

FIXTURES = Path(__file__).parent / "fixtures"
HUGINN_TINY = FIXTURES / "huginn-tiny"
HUGINN_TINY_BF16 = FIXTURES / "huginn-tiny-bf16"


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    # Test models are tiny: intra-op threads gain nothing, and on a shared, busy CPU their spin-waits
    # make each small matmul orders of magnitude slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


@pytest.fixture
def huginn_tiny_dir() -> Path:
    return HUGINN_TINY


@pytest.fixture
def huginn_tiny_bf16_dir() -> Path:
    return HUGINN_TINY_BF16
