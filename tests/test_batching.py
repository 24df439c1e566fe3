"""Continuous batching: a request in a busy batch gives the tokens of `generate` for its prompt alone."""

import random
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.execution.model_calls import ModelCalls
from rdlm.inference.exits.criteria import make_exit_criterion
from rdlm.inference.generate import GenerationConfig, generate
from rdlm.inference.runner.row_exits import RowExits
from rdlm.inference.scheduling import scheduler as scheduling

CONFIGS = [
    GenerationConfig(num_steps=4, max_new_tokens=6, seed=3),
    GenerationConfig(num_steps=12, max_new_tokens=7, exit_criterion="kl", exit_threshold=3e-3),
    GenerationConfig(num_steps=12, max_new_tokens=5, exit_criterion="latent-diff", exit_threshold=0.1,
                     continuous_cot=True),
    GenerationConfig(num_steps=6, max_new_tokens=6, cache_strategy="shared", cache_slots=3),
    GenerationConfig(num_steps=5, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5),
    GenerationConfig(num_steps=3, prefill_steps=6, max_new_tokens=5),
    GenerationConfig(num_steps=12, max_new_tokens=6, exit_criterion="argmax-stability"),
    GenerationConfig(num_steps=8, max_new_tokens=6, repetition_penalty=1.5, init_scale=0.0),
]


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def drain(batch: ContinuousBatch) -> dict[int, list]:
    events: dict[int, list] = {}
    while batch.busy:
        for event in batch.step():
            events.setdefault(event.request, []).append(event)
    return events


def busy_batch(model: RecurrentDepthLM, **options) -> ContinuousBatch:
    return ContinuousBatch(model, max_batch=4, max_length=32, num_slots=12, **options)


@contextmanager
def on(model: RecurrentDepthLM, device: str):
    """The module's model on `device` for a while, back on the CPU afterwards."""
    try:
        yield model.to(device)
    finally:
        model.to("cpu")


def each_alone(batch: ContinuousBatch, requests: list | None = None) -> ContinuousBatch:
    """`requests` (prompt, config), by default twelve with every kind of config, through the batch; asserts
    that each gets the tokens, iterations and finish reason of `generate` for its prompt alone. Returns the
    drained batch."""
    if requests is None:
        rng = random.Random(0)
        requests = [([rng.randrange(512) for _ in range(rng.randint(1, 9))], CONFIGS[k % len(CONFIGS)])
                    for k in range(12)]
    ids = [batch.add(prompt, config) for prompt, config in requests]
    events = drain(batch)
    for rid, (prompt, config) in zip(ids, requests):
        alone = generate(batch.model, prompt, config)
        assert [e.token for e in events[rid]] == alone.tokens[0]
        assert [e.iterations for e in events[rid]] == alone.iterations[0]
        assert [e.finish_reason for e in events[rid]][-1] == alone.finish_reasons[0]
        assert all(e.finish_reason is None for e in events[rid][:-1])
    return batch


BUSY = [(1, 256, 1), (3, 2, 1), (1, 5, 4), (4, 3, 6), (2, 12, 2)]   # exit_sync_every, prefill_chunk, coda_every


# `pytest -m cuda` runs the cuda cases alone (on a GPU machine; pyproject.toml registers the marker).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exit_sync_every,prefill_chunk,coda_every", BUSY)
def test_a_busy_batch_gives_each_request_its_tokens_alone(model, device, exit_sync_every, prefill_chunk, coda_every):
    """Whenever the host looks at the exit flags (every step, or every 3 or 4 with rows frozen between), with
    prompts prefilled whole or in chunks of 2, 3 or 5 tokens interleaved with the decoding rows, and with
    done rows running their coda at once or waiting for others (up to 4 or 6 steps). (A chunk of fewer
    tokens than prefill_chunk runs several iterations per step.)"""
    with on(model, device):
        batch = each_alone(busy_batch(model, exit_sync_every=exit_sync_every, prefill_chunk=prefill_chunk,
                                      coda_every=coda_every, compile=False))
    assert batch.step_runner.static_step.steps.runs == 0                      # the eager path


@pytest.mark.parametrize("device", DEVICES)
def test_the_static_step_is_the_default_on_cuda_only(model, device):
    with on(model, device):
        assert busy_batch(model).step_runner.static_step.on == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exit_sync_every,prefill_chunk,coda_every", BUSY)
def test_the_static_step_gives_each_request_its_tokens_alone(model, device, exit_sync_every, prefill_chunk, coda_every):
    """`compile=True`: every step runs the decoding rows' core iteration as one fixed-shape step over all 4
    rows (a CUDA graph captured once on CUDA), rows that are free, prefilling, done or waiting for their coda
    masked out on the device, and the prompt chunks in a call of their own; every request still gets its
    tokens alone."""
    with on(model, device):
        batch = busy_batch(model, exit_sync_every=exit_sync_every, prefill_chunk=prefill_chunk,
                           coda_every=coda_every, compile=True)
        steps = batch.step_runner.static_step.steps
        keys = set()
        run = steps.run
        steps.run = lambda key, *args, **kw: keys.add(key) or run(key, *args, **kw)
        each_alone(batch)
    assert steps.runs > 50                                # the static step ran (most iterations go through it)
    assert keys and all(key[0] == "core iterations" for key in keys)
    # one graph per number of iterations fused into a call, captured once and replayed at every later step
    assert set(steps.graphed) == (keys if device == "cuda" else set())


def test_the_static_step_compiles_to_one_graph_for_the_whole_run(model, monkeypatch):
    """The step is data, not control flow: torch.compile takes it whole (fullgraph: no host sync, no graph
    break) once, and every later step, whatever rows decode at whatever iterations, reuses that graph."""
    graphs = []

    def count(graph: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(graph)
        return graph.forward                                 # dynamo's capture only: inductor's codegen is slow on CPU

    batch = busy_batch(model, exit_sync_every=4, prefill_chunk=3, coda_every=6, compile=True)
    static = batch.step_runner.static_step
    monkeypatch.setattr(static, "iteration", torch.compile(static.iteration, fullgraph=True, backend=count))

    each_alone(batch)
    assert batch.step_runner.static_step.steps.runs > 50 and len(graphs) == 1


def test_rows_that_exit_early_go_on_to_their_next_token(model, monkeypatch):
    """Iteration granularity: a step runs one core iteration for rows at different tokens, and the core
    never runs more token-iterations than the tokens used (no idling behind the slowest row)."""
    tokens_run = []
    step = model.step

    def counting_step(state, *args, **kwargs):
        tokens_run.append(state.shape[0] * state.shape[1])  # rows x tokens: prompts are packed in one row
        return step(state, *args, **kwargs)

    config = GenerationConfig(num_steps=12, max_new_tokens=6, exit_criterion="kl", exit_threshold=3e-3)
    batch = ContinuousBatch(model, max_batch=3, max_length=32, num_slots=12)
    ids = [batch.add(p, config) for p in ([5, 17, 99], [250, 11], [1, 2, 3, 4])]
    monkeypatch.setattr(model, "step", counting_step)
    events = drain(batch)
    decoded = sum(e.iterations for rid in ids for e in events[rid][1:])
    prefill = 12 * 3 * 4             # the prompts admitted together: 3 rows padded to 4 tokens, 12 iterations
    assert sum(tokens_run) - prefill == decoded
    assert len(set(e.iterations for rid in ids for e in events[rid][1:])) > 1   # tokens exited at different depths


@pytest.mark.parametrize("compile", [False, True])
def test_a_long_prompt_prefills_while_the_other_rows_go_on_decoding(model, compile):
    """A prompt runs its iterations inside the batch's steps, a chunk at a time, in the same call as the
    decoding rows (with the static step: a call beside it): they go on producing tokens while it prefills,
    and both get their tokens alone."""
    config = GenerationConfig(num_steps=2, max_new_tokens=12)
    batch = ContinuousBatch(model, max_batch=2, max_length=48, num_slots=4, prefill_chunk=8, compile=compile)
    short = batch.add([7, 8], config)
    while not batch.step():                                  # the short prompt's first token
        pass
    long_prompt = list(range(3, 33))                         # 30 tokens: 4 chunks of at most 8
    late = batch.add(long_prompt, config)
    events, static_runs = [], None
    while batch.busy:
        events += batch.step()
        if static_runs is None and any(e.request == late for e in events):
            static_runs = batch.step_runner.static_step.steps.runs   # the static steps run while the long prompt prefilled
    order = [e.request for e in events]
    # Four chunks of 2 iterations each: 8 steps, in which the short request (a token every 2 steps) goes on.
    assert order[:order.index(late)].count(short) >= 3
    assert static_runs >= 6 if compile else static_runs == 0
    for rid, prompt in ((late, long_prompt), (short, [7, 8])):
        tokens = [e.token for e in events if e.request == rid]
        assert tokens == generate(model, prompt, config).tokens[0][-len(tokens):]


@pytest.mark.parametrize("compile", [False, True])
def test_prompts_of_different_lengths_admitted_together_prefill_in_chunks_by_length(model, compile, monkeypatch):
    """Four prompts of 3-30 tokens admitted together go in chunks by length (each padded to its own longest), two
    more join while those rows decode; with the static step a token chosen mid-way through the others' waits
    to start in phase with them. Every request gets its tokens alone."""
    rng = random.Random(4)
    lengths = [3, 30, 4, 26, 2, 17]
    configs = [GenerationConfig(num_steps=4, max_new_tokens=n) for n in (2, 6, 6, 6, 6, 6)]  # the first ends early
    requests = [([rng.randrange(512) for _ in range(n)], c) for n, c in zip(lengths, configs, strict=True)]
    groups, length_groups = [], scheduling.length_groups
    monkeypatch.setattr(scheduling, "length_groups", lambda n, cost: groups.append(length_groups(n, cost)) or groups[-1])
    held = []
    batch = ContinuousBatch(model, max_batch=4, max_length=64, num_slots=8, compile=compile)
    hold = batch.scheduler._hold_for_phase
    monkeypatch.setattr(batch.scheduler, "_hold_for_phase", lambda starting: held.append(hold(starting)) or held[-1])
    each_alone(batch, requests)
    assert groups[0] == [[0, 2], [1, 3]]                     # 3 and 4 tokens apart from 30 and 26
    assert any(held) == compile                              # the static step keeps its rows in phase


def test_cancel_frees_the_row_and_others_are_undisturbed(model):
    config = GenerationConfig(num_steps=4, max_new_tokens=8)
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4)
    a, b, c = (batch.add(p, config) for p in ([1, 2], [3, 4, 5], [6]))
    first = batch.step()                     # no row decodes yet: the prompts prefill in one step
    assert {e.request for e in first} == {a, b}              # c waits for a row
    batch.cancel(a)
    events = drain(batch)
    assert a not in events and len(events[b]) == 7 and len(events[c]) == 8
    assert [e.token for e in events[c]] == generate(model, [6], config).tokens[0]


def test_a_value_the_rows_cannot_hold_fails_its_request_alone(model):
    """The failure path of a value that escaped the declared bounds (min_steps = 2**63, set past the checks):
    its request fails alone, at its first token's start, and the request beside it gets its tokens alone."""
    config = GenerationConfig(num_steps=4, max_new_tokens=6)
    broken = GenerationConfig(num_steps=4, max_new_tokens=6)
    object.__setattr__(broken, "min_steps", 2**63)
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4)
    good, bad = batch.add([1, 2, 3], config), batch.add([4, 5], broken)
    events = drain(batch)
    failures = dict(batch.take_failures())
    assert set(failures) == {bad} and isinstance(failures[bad], OverflowError)
    assert "min_steps = 9223372036854775808" in str(failures[bad])
    assert [e.token for e in events[good]] == generate(model, [1, 2, 3], config).tokens[0]
    assert not batch.busy and batch.running == 0


def test_a_request_cancelled_while_its_prompt_prefills_leaves_its_row_clean(model):
    """Cancelled mid-prefill: its prompt stops writing to the row (which the next request takes over), and
    the request prefilled beside it is undisturbed."""
    config = GenerationConfig(num_steps=6, max_new_tokens=5)
    batch = ContinuousBatch(model, max_batch=3, max_length=32, num_slots=6, prefill_chunk=10)
    d = batch.add([12, 13], replace(config, max_new_tokens=12))
    assert [e.request for e in batch.step()] == [d]         # alone, its prompt is prefilled in one step
    a, b, c = (batch.add(p, config) for p in ([9, 8, 7, 6, 5], [4, 3], [2, 1, 11]))
    batch.step(), batch.step()              # 2 prompts padded to 5 tokens: one iteration a step beside d
    assert batch.step_runner.chunks and next(iter(batch.step_runner.chunks.values())).iteration == 2
    batch.cancel(a)
    events = drain(batch)
    assert a not in events
    for rid, prompt in ((b, [4, 3]), (c, [2, 1, 11])):
        assert [e.token for e in events[rid]] == generate(model, prompt, config).tokens[0]
    assert [e.token for e in events[d]] == generate(model, [12, 13], replace(config, max_new_tokens=12)).tokens[0][1:]


def test_requests_that_cannot_be_served_are_refused_by_name(model):
    batch = ContinuousBatch(model, max_batch=2, max_length=16, num_slots=4)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        batch.add(list(range(10)), GenerationConfig(num_steps=2, max_new_tokens=8))
    with pytest.raises(ValueError, match="needs 8 core cache slots.*at most 4"):
        batch.add([1], GenerationConfig(num_steps=8, max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        batch.add([10_000], GenerationConfig(num_steps=2, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt \(3 tokens\) is the first wave and must fit in max_wavefront \(2\)"):
        batch.add([1, 2, 3], GenerationConfig(num_steps=4, max_new_tokens=2, sampler="parallel", full_prefill=False,
                                              max_wavefront=2))
    with pytest.raises(ValueError, match="max_batch"):
        ContinuousBatch(model, max_batch=0)
    # a shared cache of 4 slots serves any r
    rid = batch.add([1, 2], GenerationConfig(num_steps=9, max_new_tokens=3, cache_strategy="shared", cache_slots=4))
    assert len(drain(batch)[rid]) == 3


def test_non_finite_logits_fail_the_request_naming_the_weights():
    from rdlm.inference.runner.sampling import NonFiniteLogitsError

    torch.manual_seed(0)
    broken = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        broken.coda[0].mlp.out.weight.fill_(float("nan"))
    broken.source = "runs/broken"
    batch = ContinuousBatch(broken, max_batch=2, max_length=16, num_slots=4)
    request = batch.add([1, 2, 3], GenerationConfig(num_steps=2, max_new_tokens=3))
    assert drain(batch) == {} and not batch.busy
    [(failed, err)] = batch.take_failures()
    assert failed == request and isinstance(err, NonFiniteLogitsError)
    assert "non-finite logits at new token 1; weights may be NaN: runs/broken" in str(err)
    with pytest.raises(NonFiniteLogitsError, match="weights may be NaN: runs/broken"):   # generate raises it
        generate(broken, [[1, 2, 3]], GenerationConfig(num_steps=2, max_new_tokens=3))


def test_a_request_whose_row_turns_nan_fails_alone_and_its_row_is_clean_for_the_next():
    """A prompt holding a token that embeds as infinity (the head untied, so only rows reading it) fails
    alone; the row beside it gets its tokens; then the freed row, next to a longer prompt, reads its cache
    past its own length (masked entries, weight 0: a NaN left there would still poison the sum) and its
    request gets the tokens of its prompt alone."""
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", tie_embeddings=False)).eval()
    with torch.no_grad():
        model.embedding.weight[7] = float("inf")
    config = GenerationConfig(num_steps=4, max_new_tokens=6)
    short, long = [1, 2, 3], [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    alone = {tuple(p): generate(model, [p], config).tokens[0] for p in (short, long)}
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4)
    first, poisoned = batch.add(short, config), batch.add([*short, 7, 7, 7, 7, 7, 7], config)   # rows 0 and 1
    events = drain(batch)
    assert [e.token for e in events[first]] == alone[tuple(short)] and poisoned not in events
    assert [request for request, _ in batch.take_failures()] == [poisoned]
    cache = batch.cache
    assert not any(t[..., 1, :, :, :].isnan().any() for t in (cache.prelude_k, cache.prelude_v, cache.core_k,
                                                                cache.core_v, cache.coda_k, cache.coda_v))
    again = {batch.add(long, config): long, batch.add(short, config): short}      # short in the failed row
    assert {tuple(again[r]): [e.token for e in got] for r, got in drain(batch).items()} == alone


def test_an_engine_counts_its_queued_and_running_requests(model):
    """What `rdlm serve` exports as its queue length and batch size (the Engine interface)."""
    config = GenerationConfig(num_steps=2, max_new_tokens=3)
    batch = ContinuousBatch(model, max_batch=2, max_length=16, num_slots=4)
    for prompt in ([1, 2], [3], [4, 5, 6]):
        batch.add(prompt, config)
    assert (batch.queued, batch.running) == (3, 0)
    batch.step()
    assert (batch.queued, batch.running) == (1, 2)
    drain(batch)
    assert (batch.queued, batch.running) == (0, 0)


def test_speculative_and_parallel_requests_decode_in_rounds_beside_token_by_token_rows(model):
    """Self-speculative decoding and the parallel sampler are rounds of the same engine: in a busy batch, beside
    rows decoding token by token and a prefill alone, each gives what its algorithm guarantees against plain
    sequential greedy decoding (an independent side): speculative greedy is greedy (float32), and a wave of
    one position at full depth is sequential; the others get their tokens alone."""
    greedy = GenerationConfig(num_steps=5, max_new_tokens=7, seed=3)
    speculative = replace(greedy, draft_steps=2, draft_length=3)
    wave = replace(greedy, sampler="parallel", inner_recurrence=5, max_wavefront=1)
    sampled = GenerationConfig(num_steps=4, max_new_tokens=6, temperature=0.8, seed=5)
    requests = [([5, 17, 99], speculative), ([8, 8, 1, 2], sampled), ([250, 11], wave),
                ([1, 2, 3], replace(greedy, max_new_tokens=0)), ([7, 300, 21], speculative)]
    batch = ContinuousBatch(model, max_batch=3, max_length=32, num_slots=6)
    ids = [batch.add(prompt, config) for prompt, config in requests]
    events = drain(batch)
    for rid, (prompt, config) in zip(ids, requests):
        got = [(e.token, e.iterations) for e in events.get(rid, [])]
        if config.max_new_tokens == 0:
            assert got == []                                   # prefilled, then gone without a token
            continue
        plain = generate(model, prompt, greedy if config is not sampled else sampled)
        assert got == list(zip(plain.tokens[0], plain.iterations[0]))
        assert events[rid][-1].finish_reason == "length"
    assert batch.drafted >= 2 * 3 and 0 <= batch.accepted <= batch.drafted      # two requests' rounds
    assert batch.wave_steps == 6 and batch.core_passes == 6 * 5                # one wave step per token after the first
    assert not batch.busy
    batch.step()   # the next plan tells the runner which requests left: it forgets them and their waves
    assert not batch.step_runner.rounds.waves and not batch.step_runner.rows


def test_a_cancelled_wave_leaves_nothing_behind(model):
    config = GenerationConfig(num_steps=4, max_new_tokens=20, sampler="parallel", inner_recurrence=2)
    batch = ContinuousBatch(model, max_batch=1, max_length=64, num_slots=4)
    rid = batch.add([3, 4, 5], config)
    while not batch.step_runner.rounds.waves:
        batch.step()
    batch.cancel(rid)
    batch.step()
    assert not batch.step_runner.rounds.waves and not batch.step_runner.rows and not batch.busy


def test_a_config_given_lists_works_in_the_batch_as_with_tuples(model):
    """Stops passed as lists (or one stop string as a str) are kept as tuples: the config stays hashable
    and the batch groups rows by config to choose their tokens."""
    listed = GenerationConfig(num_steps=2, max_new_tokens=4, stop_tokens=[7, 9], stop_strings="ab")
    assert listed.stop_tokens == (7, 9) and listed.stop_strings == ("ab",) and isinstance(hash(listed), int)
    config = GenerationConfig(num_steps=2, max_new_tokens=4, stop_tokens=[7, 9])
    batch = ContinuousBatch(model, max_batch=2, max_length=16, num_slots=4)
    ids = [batch.add(prompt, config) for prompt in ([1, 2], [3])]
    events = drain(batch)
    for rid, prompt in zip(ids, ([1, 2], [3])):
        assert [e.token for e in events[rid]] == generate(model, prompt, replace(config, stop_tokens=(7, 9))).tokens[0]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_exits_run_several_iterations_in_one_static_call(model, device):
    """With the static step and nothing that can change between iterations but their counts (no exit
    criterion, no prompt in flight or able to join, no row waiting for its coda), a step runs the largest
    power of two of iterations that no row's cap cuts short, in one call (a graph per power of two on
    CUDA); every request still gets its tokens, iterations and finish reason alone."""
    rng = random.Random(3)
    configs = [GenerationConfig(num_steps=8, max_new_tokens=5, seed=1),
               GenerationConfig(num_steps=12, max_new_tokens=4, temperature=0.8, top_k=40, seed=2),
               GenerationConfig(num_steps=5, max_new_tokens=6, cache_strategy="shared", cache_slots=3)]
    requests = [([rng.randrange(512) for _ in range(rng.randint(1, 6))], configs[k % 3]) for k in range(9)]
    with on(model, device):
        batch = each_alone(busy_batch(model, exit_sync_every=4, coda_every=6, compile=True), requests)
    assert batch.step_runner.static_step.fused_iterations >= 16         # not most: with these caps rows often wait for a coda
    assert any(key[0] == "core iterations" for key in batch.step_runner.static_step.steps.graphed) == (device == "cuda")


def test_the_fused_iterations_compile_to_one_graph_per_count(model, monkeypatch):
    """Several iterations in one call are data too: torch.compile takes each count whole (fullgraph: no
    host sync, no graph break), one graph per power of two, reused by every later call of that count."""
    graphs = []

    def count(graph: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(graph)
        return graph.forward

    batch = busy_batch(model, exit_sync_every=4, coda_every=6, compile=True)
    compiled = torch.compile(batch.step_runner.static_step.iterations, fullgraph=True, backend=count)
    counts = []
    monkeypatch.setattr(batch.step_runner.static_step, "iterations", lambda n, *args: (counts.append(n), compiled(n, *args))[1])
    configs = [GenerationConfig(num_steps=8, max_new_tokens=5), GenerationConfig(num_steps=6, max_new_tokens=5)]
    for k, prompt in enumerate(([1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11, 12])):
        batch.add(prompt, configs[k % 2])   # two depths: the rows never go in lockstep
    drain(batch)
    assert len(counts) > 5 and len(graphs) == len(set(counts)) <= 4   # counts 2, 4 and 8


def test_a_row_found_done_stops_computing_before_the_look(model, monkeypatch):
    """Eagerly on the CPU, where reading the exit flags waits for nothing, a row whose token is done leaves
    the core's calls at the next step, not at the host's next look (every 4 steps here); it still waits
    for that look, so every token comes at the same step as when it rode along frozen."""
    step = model.step
    depths = (12, 11, 12)   # two depth settings: no lockstep, one iteration a step
    configs = [GenerationConfig(num_steps=r, max_new_tokens=6, exit_criterion="kl", exit_threshold=3e-3)
               for r in depths]

    def run(peek: bool) -> tuple[list, int]:
        tokens_run = []

        def counting_step(state, *args, **kwargs):
            tokens_run.append(state.shape[0] * state.shape[1])
            return step(state, *args, **kwargs)

        batch = ContinuousBatch(model, max_batch=3, max_length=32, num_slots=12, exit_sync_every=4, coda_every=2)
        if not peek:
            monkeypatch.setattr(batch.scheduler, "settings", replace(batch.settings, rides_along=True))
        ids = [batch.add(p, c) for p, c in zip(([5, 17, 99], [250, 11], [1, 2, 3, 4]), configs)]
        monkeypatch.setattr(model, "step", counting_step)
        timeline, n = [], 0
        while batch.busy:
            n += 1
            timeline += [(n, ids.index(e.request), e.token, e.iterations, e.finish_reason) for e in batch.step()]
        monkeypatch.setattr(model, "step", step)
        decoded = sum(e[3] for e in timeline) - sum(depths)   # the first tokens come from the prompts
        return timeline, sum(tokens_run), decoded

    (timeline, run_peek, decoded), (riding, run_riding, _) = run(True), run(False)
    assert timeline == riding            # the same tokens, iterations and finish reasons, at the same steps
    assert run_riding > run_peek         # done rows iterated on until the look
    # the core ran the prompts' iterations (admitted together, prefilled in one chunk per depth, each padded
    # to its longest prompt: 2 x 4 tokens at 12, 1 x 2 at 11) and exactly the iterations the tokens used
    assert run_peek == 2 * 4 * 12 + 1 * 2 * 11 + decoded
    assert len({e[3] for e in timeline if e[3] not in depths}) > 1   # tokens exited at different depths


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("config", [
    CONFIGS[0], CONFIGS[1], CONFIGS[3],
    GenerationConfig(num_steps=6, max_new_tokens=5, exit_criterion="kl", exit_threshold=3e-3,
                     cache_strategy="shared", cache_slots=4, continuous_cot=True),
], ids=["fixed", "kl", "shared", "kl-shared-cot"])
def test_rows_in_step_run_each_token_in_lockstep(model, monkeypatch, compile, config):
    """Requests added together with one depth setting (`generate`'s batch) start and end every token
    together, so each token runs all its iterations in one step (rdlm.inference.runner.lockstep, on the static path
    with `compile`); the tokens are those of the iteration-by-iteration schedule. A row that has not been
    used yet rides along (4 rows, 3 requests)."""
    prompts = [[5, 17, 99], [250, 11, 3, 8], [1, 2]]

    def run(lockstep: bool) -> tuple[list, int]:
        batch = busy_batch(model, compile=compile, exit_sync_every=2)
        if not lockstep:
            monkeypatch.setattr(batch.scheduler, "in_lockstep", lambda starting, prompts: False)
        ids = [batch.add(p, config) for p in prompts]
        steps, events = 0, {}
        while batch.busy:
            steps += 1
            for e in batch.step():
                events.setdefault(e.request, []).append((e.token, e.iterations, e.finish_reason))
        return [events[i] for i in ids], steps

    (together, steps), (one_by_one, more_steps) = run(True), run(False)
    assert together == one_by_one
    assert steps == config.max_new_tokens                    # the prefill and first token, then a token a step
    # one by one, a step runs an iteration (on the static path at fixed r: a token, fused iterations)
    assert more_steps > steps or (compile and config.exit_criterion is None)


@pytest.mark.parametrize("criterion", [None, "kl"])
def test_a_lockstep_token_compiles_whole_on_the_static_path(model, criterion):
    """A lockstep token's iterations on the static path are data, not control flow: torch.compile takes them
    whole (fullgraph: no host sync, no graph break) as CUDA graphs need, the r iterations of fixed r and each
    chunk of iterations between two looks at the exit flags, and the tokens are the uncompiled ones."""
    graphs = []

    def count(graph: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(graph)
        return graph.forward                                 # dynamo's capture only: inductor's codegen is slow on CPU

    config = GenerationConfig(num_steps=6, max_new_tokens=4, exit_criterion=criterion,
                              exit_threshold=3e-3 if criterion else None)

    def run(compiled: bool) -> list:
        batch = busy_batch(model, compile=True, exit_sync_every=2)
        if compiled:
            lockstep = batch.step_runner.lockstep
            owner = lockstep if criterion else lockstep.calls   # the chunks; the r iterations
            owner.iterate = torch.compile(owner.iterate, fullgraph=True, backend=count)
        ids = [batch.add(p, config) for p in ([1, 2, 3], [4, 5], [6])]
        events = drain(batch)
        return [[(e.token, e.iterations) for e in events[i]] for i in ids]

    assert run(True) == run(False) and graphs


@pytest.mark.parametrize("criterion", [None, "kl"])
def test_lockstep_rows_go_on_over_a_row_freed_between_them(model, monkeypatch, criterion):
    """Requests that end early free rows between rows still in lockstep: the others go on over the slice that
    spans them, the freed row frozen and writing nothing, with the tokens of the iteration-by-iteration
    schedule."""
    config = GenerationConfig(num_steps=6, max_new_tokens=6, exit_criterion=criterion,
                              exit_threshold=3e-3 if criterion else None)
    short = replace(config, max_new_tokens=2)
    requests = [([5, 17, 99], config), ([250, 11, 3, 8], short), ([1, 2], config), ([7, 7], short)]
    spanned = []

    def run(lockstep: bool) -> list:
        batch = busy_batch(model, compile=False)
        if lockstep:
            rows_of = batch.step_runner._eager_rows

            def tracked(requests, budget):
                out = rows_of(requests, budget)
                spanned.append(out[4] is not None)   # rows between them ride along
                return out

            monkeypatch.setattr(batch.step_runner, "_eager_rows", tracked)
        else:
            monkeypatch.setattr(batch.scheduler, "in_lockstep", lambda starting, prompts: False)
        ids = [batch.add(p, c) for p, c in requests]
        events = drain(batch)
        return [[(e.token, e.iterations, e.finish_reason) for e in events[i]] for i in ids]

    assert run(True) == run(False)
    assert any(spanned) and not all(spanned)


def test_the_static_steps_reading_of_state_only_criteria_decides_as_the_hosts(model):
    """`RowExits.read` (the static step's reading of latent-diff and cosine, on the device) against `update`
    (the host's, by each row's schedule): the same streaks and exits after every iteration, for rows of either
    criterion with their own thresholds, patience, reading intervals, caps and min_steps, some rows not running
    at some iterations and one row with a criterion that reads logits, left to the host by both."""
    criteria = [make_exit_criterion("latent-diff", 0.3), make_exit_criterion("cosine", 0.05),
                make_exit_criterion("latent-diff", 0.5, patience=2), None,
                make_exit_criterion("cosine", 0.08, patience=3), make_exit_criterion("kl", 1e-3)]
    every, caps, min_steps = [1, 1, 1, 1, 2, 1], [12, 10, 12, 12, 11, 12], [2, 3, 2, 2, 4, 2]
    b, h = len(criteria), model.config.hidden_size
    calls = ModelCalls(model, b, 16, 12, "full")
    rows, call = calls.tokens(list(range(b)), [0] * b)
    g = torch.Generator().manual_seed(0)
    state = torch.randn(b, 1, h, generator=g)
    host, device = (RowExits(calls, b, model.config.vocab_size, state) for _ in range(2))
    for row, criterion in enumerate(criteria):
        device.admit(row, criterion, every[row])
    assert device.in_step == ("latent-diff", "cosine")
    iterations, counts = torch.zeros(b, dtype=torch.long), [0] * b
    cap, least = torch.tensor(caps), torch.tensor(min_steps)
    fired = set()
    for i in range(12):
        running = torch.rand(b, generator=g) > 0.2
        running &= ~(device.exited | (iterations >= cap))
        scale = 0.6 * 0.75 ** i  # the steps shrink: the scores cross their thresholds at different iterations
        step = scale * torch.randn(b, 1, h, generator=g) * state.norm(dim=-1, keepdim=True) / h ** 0.5
        new = torch.where(running.view(-1, 1, 1), state + step, state)
        iterations += running.long()
        counts = [n + int(run) for n, run in zip(counts, running.tolist(), strict=True)]
        members = [SimpleNamespace(criterion=c, iteration=counts[j], cap=caps[j],
                                   config=SimpleNamespace(exit_every=every[j])) for j, c in enumerate(criteria)]
        host.update(members, rows, call, state, new, running, iterations, least)
        streak, exited = device.read(device.in_step, state, new, running, iterations, cap, least)
        device.logits.copy_(host.logits)  # (the kl row: the host's alone)
        by_state = torch.tensor([c is not None and c.spec.state_only for c in criteria])
        assert torch.equal(streak[by_state], host.streak[by_state])
        assert torch.equal(exited[by_state], host.exited[by_state])
        assert torch.equal(streak[~by_state], device.streak[~by_state])   # left alone
        fired |= {(j, counts[j]) for j in (exited & ~device.exited).nonzero().flatten().tolist()}
        device.streak.copy_(streak)
        device.exited.copy_(exited)
        state = new
    assert {j for j, _ in fired} == {0, 1, 2, 4}  # every state-only row exited, at iterations of its own
    assert len({n for _, n in fired}) > 1


@pytest.mark.parametrize("start,n", [(0, 5), (4, 13), (0, 1), (60, 9)])
def test_a_cpu_prompt_chunk_reads_its_keys_to_a_multiple_of_16_and_computes_the_same(model, monkeypatch, start, n):
    """A chunk of several tokens reads its keys up to a multiple of KEY_MULTIPLE buffer entries (the CPU attention
    kernel's whole vectors), those past its tokens masked; its prelude, core iteration and coda compute what the
    call reading exactly its keys does, within float32 round-off (the kernel sums the same terms in other blocks).
    A lone token, or a chunk with many keys, reads its own keys."""
    from rdlm.inference.execution import model_calls

    g, h = 2, model.config.hidden_size
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (g, n))
    outputs = {}
    for multiple in (1, model_calls.KEY_MULTIPLE):
        monkeypatch.setattr(model_calls, "KEY_MULTIPLE", multiple)
        calls = ModelCalls(model, 3, 80, 4, "full")
        rows = calls.upload([2, 0])
        if start:  # earlier entries of the rows, read by the chunk
            calls.admit(0, start, rows)
            calls.cache.core_k.normal_(generator=torch.Generator().manual_seed(1))
            calls.cache.core_v.normal_(generator=torch.Generator().manual_seed(2))
        call = calls.prompt(start, n, rows, 4)
        keys = call.mask.shape[-1]
        padded = n > 1 and start + n < model_calls.KEY_PADDED_BELOW
        want = -(-(start + n) // multiple) * multiple if padded else start + n
        assert keys == want and not call.mask[..., start + n:].any()
        with torch.inference_mode():
            e = calls.embed(ids, call)
            state = calls.iterate_once(torch.randn(g, n, h, generator=torch.Generator().manual_seed(4)), e, 0, call)
            outputs[multiple] = (e, state, calls.coda_output(state, call))
    for a, b in zip(*outputs.values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
