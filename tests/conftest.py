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


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def write_training_run(tmp_path: Path, model: RecurrentDepthLM) -> tuple[Path, RecurrentDepthLM]:
    """(run directory, EMA model): two checkpoints step-N/{model,ema}/ as rdlm.train.checkpoint writes
    them, the EMA being half the raw weights, each with a tokenizer.json."""
    from rdlm import load_pretrained, save_pretrained
    from rdlm.data.tokenizer import train_tokenizer
    from rdlm.train.checkpoint import save_checkpoint

    ema = load_pretrained(save_pretrained(model, tmp_path / "scratch"))
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(model.parameters())
    tokenizer = train_tokenizer(["ravens are black birds"] * 10, vocab_size=300)
    for step in (100, 200):
        save_checkpoint(tmp_path / "run", step, model, ema, optimizer.state_dict(), names, {"step": step},
                        tokenizer=tokenizer)
    return tmp_path / "run", ema
