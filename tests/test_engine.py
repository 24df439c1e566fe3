"""The decode engine: the static step gives the eager path's tokens, exits are decided on the device and
exited rows leave the batch, s_0 is a function of (seed, position)."""

from dataclasses import replace

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.execution.cache import RecurrentKVCache
from rdlm.inference.execution.graphs import resolve_compile
from rdlm.inference.execution.noise import NoiseBlocks, noise_table
from rdlm.inference.exits.criteria import CRITERIA
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate

PROMPTS = [[5, 17, 99, 3, 42, 7], [250, 11], [1, 2, 3, 4]]
# thresholds at which exits fire at different iterations for different rows of the tiny model
THRESHOLDS = {"kl": 3e-3, "entropy-diff": 1e-4, "latent-diff": 0.1, "minp-kl": 1e-2, "cosine": 5e-3,
              "argmax-stability": None}
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def run_all(model, config: GenerationConfig, engine: EngineArgs | None = None):
    """(batched, each prompt alone) results."""
    return generate(model, PROMPTS, config, engine=engine), [generate(model, p, config, engine=engine) for p in PROMPTS]


def assert_same(a, b):
    assert a.tokens == b.tokens and a.iterations == b.iterations


@pytest.mark.parametrize("extra", [
    dict(),
    dict(cache_strategy="shared", cache_slots=3, num_steps=7),
    dict(continuous_cot=True),
    dict(num_steps=3, prefill_steps=6),                              # more slots than decode iterations
    dict(temperature=0.9, top_p=0.9),
    # the static step against the eager engine with one criterion in every run, the others (about 5 s each) under
    # -m slow (each criterion still decodes in every run: test_every_criterion_is_exercised_with_mixed_exits)
    *[pytest.param(dict(exit_criterion=name, exit_threshold=t, num_steps=12), marks=() if name == "kl" else SLOW)
      for name, t in THRESHOLDS.items()],
    pytest.param(dict(exit_criterion="kl", exit_threshold=3e-3, num_steps=12, cache_strategy="shared", cache_slots=4),
                 marks=SLOW),
    pytest.param(dict(exit_criterion="latent-diff", exit_threshold=0.1, num_steps=12, continuous_cot=True), marks=SLOW),
], ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "fixed")
def test_static_step_gives_the_eager_tokens_batched_and_alone(model, extra):
    config = GenerationConfig(**{"num_steps": 4, "max_new_tokens": 8, "seed": 3, **extra})
    eager, eager_alone = run_all(model, config, EngineArgs(compile=False))
    static, static_alone = run_all(model, config, EngineArgs(compile=True))
    assert_same(eager, static)
    for row in range(len(PROMPTS)):
        for alone in (eager_alone[row], static_alone[row]):
            assert alone.tokens[0] == eager.tokens[row] and alone.iterations[0] == eager.iterations[row]


def test_every_criterion_is_exercised_with_mixed_exits(model):
    # the thresholds above must make rows exit at different iterations, or the test above proves little
    for name, threshold in THRESHOLDS.items():
        result = generate(model, PROMPTS, GenerationConfig(num_steps=12, max_new_tokens=8, seed=3,
                                                           exit_criterion=name, exit_threshold=threshold))
        decoded = {s for row in result.iterations for s in row[1:]}
        assert len(decoded) > 1 and min(decoded) < 12, (name, decoded)
    # every criterion but the learned gate's, which needs a model with a gate (tests/test_families.py)
    assert set(THRESHOLDS) == {name for name, spec in CRITERIA.items() if not spec.uses_gate}


@pytest.mark.parametrize("compile", [False, True])
def test_when_the_host_looks_changes_no_token(model, compile):
    config = GenerationConfig(num_steps=12, max_new_tokens=8, seed=1, exit_criterion="kl", exit_threshold=3e-3)
    results = [generate(model, PROMPTS, config, engine=EngineArgs(compile, n)) for n in (1, 3, 100)]
    for other in results[1:]:
        assert_same(results[0], other)


@pytest.mark.parametrize("sync_every", [1, None])
def test_exited_rows_leave_the_core(model, monkeypatch, sync_every):
    """With the host looking after every iteration (the default on the CPU, where a look waits for nothing),
    the core runs exactly the iterations the rows used: an exited row costs nothing more. Looking every 4
    iterations, rows that exited between looks iterate on, frozen, until the next one."""
    rows_run = []
    step = model.step

    def counting_step(state, *args, **kwargs):
        rows_run.append(state.shape[0])
        return step(state, *args, **kwargs)

    monkeypatch.setattr(model, "step", counting_step)
    base = dict(num_steps=12, max_new_tokens=8, seed=3, exit_criterion="kl", exit_threshold=3e-3, prefill_steps=1)
    result = generate(model, PROMPTS, GenerationConfig(**base), engine=EngineArgs(exit_sync_every=sync_every))
    decoded = sum(s for row in result.iterations for s in row[1:])
    assert sum(rows_run) - 1 * len(PROMPTS) == decoded  # the prefill runs one iteration for all rows
    assert decoded < 12 * sum(len(row) - 1 for row in result.iterations)
    rows_run.clear()
    assert_same(generate(model, PROMPTS, GenerationConfig(**base), engine=EngineArgs(exit_sync_every=4)), result)
    assert sum(rows_run) - 1 * len(PROMPTS) > decoded


def test_exit_every_evaluates_the_criterion_less_often(model):
    base = dict(num_steps=12, max_new_tokens=8, seed=3, exit_criterion="latent-diff", exit_threshold=0.1)
    every = generate(model, PROMPTS, GenerationConfig(**base))
    fourth = generate(model, PROMPTS, GenerationConfig(**base, exit_every=4))
    steps = [s for row in fourth.iterations for s in row[1:]]
    assert all(s % 4 == 0 or s == 12 for s in steps)            # exits only where the criterion is read
    assert sum(steps) >= sum(s for row in every.iterations for s in row[1:])


def test_noise_depends_on_seed_and_position_only(model):
    short = noise_table(model, 5, 1.0, 10, torch.float32, torch.device("cpu"))
    long = noise_table(model, 5, 1.0, 600, torch.float32, torch.device("cpu"))
    other = noise_table(model, 6, 1.0, 10, torch.float32, torch.device("cpu"))
    assert torch.equal(short, long[:10]) and not torch.equal(short, other)
    assert len({tuple(row[:4].tolist()) for row in long}) == 600     # every position its own draw
    # std sqrt(2/5) overall: sqrt(2/(5h)) times the embedding scale sqrt(h)
    assert abs(long.std().item() - (2 / 5) ** 0.5) < 0.02
    assert noise_table(model, 5, 0.0, 10, torch.float32, torch.device("cpu")) is None


def test_noise_blocks_kept_for_the_next_request_give_the_same_table(model):
    """An engine keeps the s_0 blocks it drew (requests mostly share a seed): a table taken from them equals one
    drawn afresh, a caller that changes its table leaves the kept blocks as they were, and the blocks kept stay
    within their byte bound (least recently used out first)."""
    cpu = torch.device("cpu")
    block = 256 * model.config.hidden_size * 4  # bytes of one float32 block
    kept = NoiseBlocks(max_bytes=2 * block)
    fresh = noise_table(model, 5, 1.0, 300, torch.float32, cpu)
    first = noise_table(model, 5, 1.0, 300, torch.float32, cpu, kept)
    assert torch.equal(first, fresh) and len(kept.blocks) == 2
    first.add_(1.0)  # the table handed out is the caller's own
    again = noise_table(model, 5, 1.0, 300, torch.float32, cpu, kept)
    assert torch.equal(again, fresh)
    assert torch.equal(noise_table(model, 5, 0.5, 10, torch.float32, cpu, kept), noise_table(model, 5, 0.5, 10,
                                                                                              torch.float32, cpu))
    assert list(kept.blocks) == [(5, 1.0, 1), (5, 0.5, 0)]  # the bound: two blocks, the oldest gone
    assert noise_table(model, 5, 0.0, 10, torch.float32, cpu, kept) is None


def test_compile_defaults_to_cuda_only():
    assert resolve_compile(None, torch.device("cpu")) is False
    assert resolve_compile(None, torch.device("cuda")) is True
    assert resolve_compile(True, torch.device("cpu")) is True


def test_bad_engine_options_are_named():
    with pytest.raises(ValueError, match="exit_every"):
        GenerationConfig(exit_every=0)
    with pytest.raises(ValueError, match="exit_sync_every"):
        EngineArgs(exit_sync_every=0)
    with pytest.raises(ValueError, match="compile"):
        EngineArgs(compile="yes")


def test_engine_settings_in_a_request_s_config_still_work_with_a_deprecation_warning(model):
    """An engine setting given the old way, in the request's config, reaches the engine `generate` builds (the
    same tokens as through EngineArgs) and changes neither the config's equality nor its sampling group."""
    base = GenerationConfig(num_steps=6, max_new_tokens=4, exit_criterion="kl", exit_threshold=3e-3)
    with pytest.warns(DeprecationWarning, match="EngineArgs"):
        old = replace(base, compile=True, exit_sync_every=3)
    assert old == base and hash(old) == hash(base)
    assert_same(generate(model, PROMPTS, old), generate(model, PROMPTS, base, engine=EngineArgs(True, 3)))
    with pytest.raises(ValueError, match="exit_sync_every"):
        GenerationConfig(exit_sync_every=0)


# --------------------------------------------------------------------------------------------------
# The cache's static mode: one token per row at a device-side index, whole buffers returned

CONFIG = RDLMConfig.from_preset("tiny")


def kv(batch, value):
    shape = (batch, CONFIG.num_heads, 1, CONFIG.head_dim)
    return torch.full(shape, value), torch.full(shape, -value)


def test_static_update_writes_at_the_index_and_returns_the_whole_buffer():
    cache = RecurrentKVCache(CONFIG, 2, 6, num_slots=2)
    index = torch.tensor(3)
    k_all, v_all = cache.at(index).update(("core", 1, 1), *kv(2, 7.0))
    assert k_all.shape[2] == 6 and k_all.data_ptr() == cache.core_k[1, 1].data_ptr()
    assert k_all[:, :, 3].eq(7).all() and k_all[:, :, :3].eq(0).all() and v_all[:, :, 3].eq(-7).all()
    subset = cache.at(index, rows=torch.tensor([1]))      # a subset of the rows: only row 1 is written
    k_sub, _ = subset.update(("core", 1, 1), *kv(1, 9.0))
    assert k_sub.shape[0] == 1 and k_sub[0, :, 3].eq(9).all()
    assert cache.core_k[1, 1, 0, :, 3].eq(7).all() and cache.core_k[1, 1, 1, :, 3].eq(9).all()


@pytest.mark.parametrize("steps", [2, torch.tensor([1, 3])])
def test_fill_missing_at_a_device_index_equals_the_slice_path(steps):
    caches = [RecurrentKVCache(CONFIG, 2, 4, num_slots=4) for _ in range(2)]
    for cache in caches:
        for i in range(4):
            cache.at(2).update(("core", 0, i), *kv(2, float(i + 1)))
    caches[0].fill_missing(steps, 2, 3)
    caches[1].fill_missing(steps, torch.tensor(2))
    assert torch.equal(caches[0].core_k, caches[1].core_k) and torch.equal(caches[0].core_v, caches[1].core_v)
    expected = [1, 2, 2, 2] if isinstance(steps, int) else [1, 1, 1, 1]
    assert [caches[1].core_k[0, s, 0, 0, 2, 0].item() for s in range(4)] == expected


def test_a_failed_graph_capture_leaves_the_engine_running_eagerly(monkeypatch):
    """A CUDA error inside a capture (an H200 run once hit one) does not fail the request: the warm-up's
    outputs stand, a warning says so, and the engine's later static steps run eagerly. (The CUDA calls are
    stand-ins here; the CUDA variants of tests/test_batching.py capture for real.)"""
    import contextlib
    import gc

    from rdlm.inference.execution.graphs import StaticSteps

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    class FailingCapture:
        def __init__(self, graph, pool=None) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    steps = StaticSteps(torch.device("cpu"), True)
    steps.graphs = True                                    # as on CUDA
    runs = []

    def body() -> tuple:
        runs.append(len(runs) + 1)
        return (torch.tensor(runs[-1]),)

    with pytest.warns(RuntimeWarning, match="runs its static steps eagerly"):
        first = steps.run(("step",), body)
    assert int(first[0]) == 1 and runs == [1, 2]           # the warm-up's output; the failed capture ran the body
    assert steps.graphs is False and not steps.graphed and gc.isenabled()
    assert int(steps.run(("step",), body)[0]) == 3 and steps.runs == 2   # eager from now on
