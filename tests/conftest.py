import os
from pathlib import Path

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM

# The suite checks the eager engine, the reference: the CPU's compiled decode step (rdlm.inference.execution.cpu_compile)
# would spend seconds compiling in every server and long generation. tests/test_cpu_compile.py turns it on.
# Set before any test starts a process, which inherits it.
os.environ.setdefault("RDLM_COMPILE", "0")

FIXTURES = Path(__file__).parent / "fixtures"
HUGINN_TINY = FIXTURES / "huginn-tiny"
HUGINN_TINY_BF16 = FIXTURES / "huginn-tiny-bf16"


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    # Test models are tiny: intra-op threads gain nothing, and on a shared, busy CPU their spin-waits
    # make each small matmul orders of magnitude slower. An explicit OMP_NUM_THREADS is honoured, so the
    # suite can be run with several threads (reductions then split differently: no test may depend on it).
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
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


# bfloat16 round-off of logits. A bfloat16 forward rounds every layer output and the residual stream to 8
# significant bits (unit round-off u = 2^-8), the logits themselves once more at the un-embedding. The
# sandwich norms renormalize the state after every layer, so the relative error of the final state stays
# a few u instead of growing with depth (measured flat over r = 1, 4, 16), and a logit is off by a few u
# times the logits' scale. Bound: 8 u max|logits|. Measured on huginn-tiny-bf16: at most 3.3 u max|logits|
# for rdlm with three kernel sets (ATEN_CPU_CAPABILITY=default, avx2, avx512) and 2.9 for the authors'
# own bfloat16 logits, both against the float32 computation of the same weights.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def bf16_logit_bound(reference: torch.Tensor) -> float:
    """Largest difference between bfloat16 logits and the float32 `reference` of the same weights."""
    return 8 * BF16_UNIT_ROUNDOFF * reference.abs().max().item()


def assert_within_bf16_roundoff(logits: torch.Tensor, reference: torch.Tensor) -> None:
    """bfloat16 `logits` equal the float32 `reference` within bfloat16 round-off, and choose the same
    token wherever the reference's top two logits are further apart than that round-off."""
    bound = bf16_logit_bound(reference)
    difference = (logits.float() - reference).abs().max().item()
    assert difference <= bound, f"max difference {difference:.4f} > bf16 round-off bound {bound:.4f}"
    top2 = reference.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 2 * bound
    assert decided.any()
    assert torch.equal(logits.argmax(-1)[decided], reference.argmax(-1)[decided])


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


FAST_DOCS_TEST = "test_page_runs_top_to_bottom"  # tests/test_docs.py


def background_docs(items) -> list:
    """The fast docs pages' tests, when other tests run beside them (their pages then run in the background)."""
    docs = [item for item in items if getattr(item, "originalname", None) == FAST_DOCS_TEST]
    return docs if len(docs) < len(items) else []


def pytest_collection_modifyitems(config, items):
    """The docs pages' tests go last: their run goes on in the background meanwhile (tests/test_docs.py)."""
    if docs := background_docs(items):
        chosen = set(map(id, docs))
        items[:] = [item for item in items if id(item) not in chosen] + docs


def pytest_collection_finish(session):
    if (docs := background_docs(session.items)) and not session.config.option.collectonly:
        root = session.config._tmp_path_factory.mktemp("docs")
        docs[0].module.start_in_background([item.callspec.params["page"] for item in docs], root)


def pytest_sessionfinish(session):
    if docs := background_docs(session.items):
        docs[0].module.stop_background()
