"""The CPU's compiled decode step (rdlm.inference.execution.cpu_compile): the same tokens as the eager engine in
float32 and with quantized weights, never code frozen with other weights, the switches, and the thread count left
as it was."""

import dataclasses
import warnings

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.execution import cpu_compile
from rdlm.inference.execution.model_calls import ModelCalls, Pack
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate
from rdlm.inference.runner.static_step import StaticStep
from rdlm.model.quantize import quantize

PROMPTS = [[5, 9, 2, 7, 1, 3], [11, 4], [8, 8, 6, 2, 9]]


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "1")  # (the suite's conftest keeps it off elsewhere)


@pytest.fixture
def without_autotune(monkeypatch):
    """Tests of what the step does around its compiled code (guards, warm-up, exits, lengths) compile without
    inductor's GEMM search (`max_autotune`, most of a compile's minute here); the tests of its tokens, in float32
    and quantized, keep the settings rdlm ships."""
    monkeypatch.setitem(cpu_compile.INDUCTOR, "max_autotune", False)


def tiny(seed: int = 0) -> RecurrentDepthLM:
    torch.manual_seed(seed)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def run(model, config: GenerationConfig, compile: bool):
    return generate(model, PROMPTS, config, engine=EngineArgs(compile=compile))


@pytest.mark.slow  # compiles with inductor's GEMM search (minutes on 2 cores)
def test_the_compiled_step_gives_the_eager_tokens_and_iterations(compiling):
    """A batch of three prompts of different lengths at a fixed r and with a KL exit (one compiled shape for
    both: the exits are read outside the compiled iteration), against the eager engine."""
    model = tiny()
    threads = torch.get_num_threads()
    for config in (
        GenerationConfig(num_steps=8, max_new_tokens=10, seed=3),
        GenerationConfig(num_steps=8, max_new_tokens=10, exit_criterion="kl", exit_threshold=1e-3, seed=3),
    ):
        eager, compiled = run(model, config, False), run(model, config, True)
        assert compiled.tokens == eager.tokens
        assert compiled.iterations == eager.iterations
        assert compiled.finish_reasons == eager.finish_reasons
    assert compiled.compile_seconds < 1.0  # the second config (the same shapes) reused the first one's code
    assert torch.get_num_threads() == threads  # the step's one thread was given back


@pytest.mark.slow  # an inductor compile (a minute or two on 2 cores, cold cache)
def test_state_only_exits_fuse_in_the_compiled_step_with_the_eager_tokens(compiling, without_autotune, monkeypatch):
    """latent-diff and cosine exits are read inside the compiled iteration (rdlm.inference.runner.row_exits), so
    their rows run up to `exit_sync_every` iterations a call, each frozen at its exit: every request's tokens,
    iterations and finish reason are the eager engine's (whose host reads the criteria), and the exits compile
    nothing beyond the code a fixed r compiled."""
    model = tiny()
    fused = []
    iterations = StaticStep.iterations
    monkeypatch.setattr(StaticStep, "iterations",
                        lambda self, n, *args: (fused.append(n), iterations(self, n, *args))[1])
    engine = EngineArgs(compile=True, exit_sync_every=4)
    generate(model, PROMPTS, GenerationConfig(num_steps=12, max_new_tokens=10, seed=3), engine=engine)
    for name, threshold in (("latent-diff", 0.1), ("cosine", 0.01)):
        config = GenerationConfig(num_steps=12, max_new_tokens=10, exit_criterion=name, exit_threshold=threshold,
                                  seed=3)
        fused.clear()
        eager = generate(model, PROMPTS, config, engine=EngineArgs(compile=False))
        compiled = generate(model, PROMPTS, config, engine=engine)
        assert compiled.tokens == eager.tokens
        assert compiled.iterations == eager.iterations
        assert compiled.finish_reasons == eager.finish_reasons
        assert compiled.compile_seconds < 1.0                      # the fixed r's compiled code, reused
        assert max(fused) == 4 and sum(n > 1 for n in fused) > 10  # fused up to each look
        decoded = [n for row in compiled.iterations for n in row[1:]]
        assert min(decoded) < 12 and len(set(decoded)) > 2          # tokens exit, at iterations of their own


def test_the_compiled_step_runs_only_where_asked_and_allowed(compiling, monkeypatch):
    model = tiny()
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4, compile=True)
    assert batch.step_runner.static_step.compiled is not None
    assert not batch.settings.lockstep  # every token goes through the compiled step
    assert ContinuousBatch(model, 2, 32, 4, compile=False).step_runner.static_step.compiled is None
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "0")  # the switch: the static step stays, uncompiled
    off = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4, compile=True)
    assert off.step_runner.static and off.step_runner.static_step.compiled is None and off.settings.lockstep


def test_where_compiling_pays_by_default(compiling, monkeypatch):
    pays = cpu_compile.compile_pays
    assert pays(1, cpu_compile.COMPILE_MIN_ITERATIONS, rounds=False)
    assert not pays(1, cpu_compile.COMPILE_MIN_ITERATIONS - 1, rounds=False)  # too short to pay its compile
    assert not pays(cpu_compile.SINGLE_THREAD_ROWS + 1, 10**6, rounds=False)  # large batches: eager is faster
    assert not pays(1, 10**6, rounds=True)  # speculative rounds do not run the static step
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "force")  # always, where the static step runs
    assert pays(64, 1, rounds=False) and not pays(1, 10**6, rounds=True)
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "0")
    assert not pays(1, 10**6, rounds=False)


def test_where_a_server_compiles_by_default(compiling, monkeypatch):
    """A server pays its compile back over its life: it compiles up to SERVER_COMPILE_ROWS rows (the compiled
    step on every thread above SINGLE_THREAD_ROWS), a model with LoRA adapters never, and the switch wins."""
    compiles = cpu_compile.server_compiles
    assert cpu_compile.SERVER_COMPILE_ROWS > cpu_compile.SINGLE_THREAD_ROWS
    assert compiles(1) and compiles(cpu_compile.SINGLE_THREAD_ROWS + 1) and compiles(cpu_compile.SERVER_COMPILE_ROWS)
    assert not compiles(cpu_compile.SERVER_COMPILE_ROWS + 1)  # larger batches were not measured: eager
    assert not compiles(8, adapters=True)
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "force")
    assert compiles(4 * cpu_compile.SERVER_COMPILE_ROWS) and not compiles(8, adapters=True)
    monkeypatch.setenv(cpu_compile.COMPILE_ENV, "0")
    assert not compiles(1)


@pytest.mark.slow  # compiles twice (minutes on 2 cores)
def test_weights_changed_in_place_are_compiled_again(compiling, without_autotune):
    """Compiled code holds the weights it was frozen with: after an in-place update (what an optimizer step
    or load_state_dict does) the compiled step must give the new weights' tokens, not the old ones'. One engine
    serves before and after (as `rdlm serve` keeps one): a call of shapes its step has run skips dynamo's full
    guard check, so the update must reach it through the stamp, as must the other settings that check covers."""
    model = tiny(1)
    config = GenerationConfig(num_steps=4, max_new_tokens=8, seed=0)
    batch = ContinuousBatch(model, max_batch=len(PROMPTS), max_length=32, num_slots=4, compile=True)

    def served():
        ids = [batch.add(prompt, config) for prompt in PROMPTS]
        tokens: dict[int, list[int]] = {rid: [] for rid in ids}
        while batch.busy:
            for e in batch.step():
                tokens[e.request].append(e.token)
        return [tokens[rid] for rid in ids]

    before = served()
    assert before == run(model, config, False).tokens == served()  # (the second: shapes the step has run)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    eager = run(model, config, False).tokens
    assert eager != before  # (the update changes the tokens, so the check below can fail)
    assert served() == eager
    stamp = cpu_compile.weights_stamp(model)
    assert stamp == cpu_compile.weights_stamp(model) != cpu_compile.weights_stamp(tiny(1))  # another object
    model.set_attention("eager")
    assert cpu_compile.weights_stamp(model) != stamp
    model.set_attention("sdpa")
    assert cpu_compile.weights_stamp(model) == stamp
    model.train()
    assert cpu_compile.weights_stamp(model) != stamp
    model.eval()
    model.config = dataclasses.replace(model.config, test_time_noise=0.5)
    assert cpu_compile.weights_stamp(model) != stamp


@pytest.mark.slow  # compiles every warm-up shape (minutes on 2 cores)
def test_warm_up_compiles_without_changing_the_batch(compiling, without_autotune):
    model = tiny()
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4, compile=True)
    rid = batch.add([3, 1, 4, 1, 5], GenerationConfig(num_steps=4, max_new_tokens=6))
    tokens = [e.token for e in batch.step()]  # a row mid-request: its state and cache must survive the warm-up
    t, cache, step = batch.step_runner.t, batch.cache, batch.step_runner.static_step

    def kept():  # what a warm-up must leave as it was: the rows' tensors and every cache entry
        caches = [getattr(cache, f"{group}_{x}") for group in ("prelude", "core", "coda") for x in "kv"]
        return [t.state, t.embedded, t.iterations, t.stopped, *caches]

    saved = [x.clone() for x in kept()]
    seconds = batch.warm_up()
    compiled = step.compile_seconds
    assert seconds >= compiled > 0
    batch.warm_up()
    assert step.compile_seconds == compiled  # compiled once (the second warm-up's few µs measure nothing new)
    assert not any(part.failed for part in (step.compiled, *step.ends))  # (not eager after a compiler error: 2 rows)
    for old, new in zip(saved, kept(), strict=True):
        assert torch.equal(old, new)
    while batch.busy:
        tokens += [e.token for e in batch.step() if e.request == rid]
    alone = generate(model, [3, 1, 4, 1, 5], GenerationConfig(num_steps=4, max_new_tokens=6),
                     engine=EngineArgs(compile=False))
    assert tokens == alone.tokens[0]


KL_EXIT = GenerationConfig(num_steps=12, max_new_tokens=8, exit_criterion="kl", exit_threshold=3e-3, seed=3)


@pytest.mark.parametrize(
    "spec, config",
    [
        ("int8", KL_EXIT),
        ("int4", KL_EXIT),
        # w8a8 rounds every activation to 128 levels anew at each iteration, so a round-off difference of the
        # compiled norms (float32, fused by inductor) can move one across a rounding step, and the loop carries
        # it: at r = 12 one row of this batch diverges after 5 tokens. Its product itself is FBGEMM's
        # (tests/test_w8a8.py); a short loop keeps the tokens a test of the compiled wiring.
        ("w8a8", GenerationConfig(num_steps=4, max_new_tokens=8, seed=3)),
    ],
)
@pytest.mark.slow  # three compiles with the GEMM search (minutes)
def test_the_compiled_step_gives_the_eager_tokens_with_quantized_weights(compiling, spec, config):
    """The prelude, core and coda quantized by each scheme and compiled (inductor's lowering of PyTorch's
    int8/int4 kernels; w8a8's FBGEMM product in tensor ops), against the eager quantized engine. The head stays
    in float32: PyTorch's weight-only kernels give bfloat16 outputs on the CPU, so a quantized head's logits
    come rounded to bfloat16, with exact ties between tokens on this tiny model, and its compiled lowering
    rounds elsewhere (logits 5e-3 apart at a scale of 2.3, under a bfloat16 step): the greedy choice between
    tied tokens is then a coin toss, not a test of the wiring."""
    model = quantize(tiny(2), f"{spec},head=none", group_size=32)
    parts = {name.split(".")[0]: s for name, s in model.quantized_layers.items()}
    assert {parts[p] for p in ("prelude", "core", "coda")} == {spec} and "lm_head" not in parts
    eager = run(model, config, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = run(model, config, True)
    assert not [w for w in caught if "compiling the decode step failed" in str(w.message)]
    assert compiled.compile_seconds > 0
    assert compiled.tokens == eager.tokens and compiled.iterations == eager.iterations
    if config.exit_criterion is not None:
        assert len({s for row in eager.iterations for s in row[1:]}) > 1  # the exits decide at different iterations


@pytest.mark.slow  # compiles at several lengths (minutes)
def test_the_compiled_step_reads_the_rows_keys_only_and_compiles_once_for_every_length(
    compiling, without_autotune, monkeypatch
):
    """The compiled step attends to the buffer up to the decoding rows' end (rounded up to KEYS_STEP), not to
    the whole buffer, a length the compiler takes as dynamic: rows that grow past several multiples of it run
    one compiled graph per part (the core iteration, the prelude, the coda with the head), with the eager
    engine's tokens; the prompts' iteration adds the graph of its one compile, whatever the prompts' lengths."""
    from torch._dynamo.utils import counters

    from rdlm.inference.runner.static_step import KEYS_STEP, StaticStep

    model = tiny()
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    calls = ModelCalls(model, 4, 16, 4, "full")
    with torch.inference_mode():
        calls.compiled_prompts = cpu_compile.CompiledPrompts(model)
        calls.iterate_packed(packed_prompts(calls, 0)[0])
    prompt_graphs = counters["stats"]["unique_graphs"] - graphs
    assert prompt_graphs >= 1
    prompts = [list(range(1, 30)), [4, 2], list(range(3, 20))]
    config = GenerationConfig(num_steps=4, max_new_tokens=50, seed=1)
    lengths, keys = [], StaticStep.keys
    monkeypatch.setattr(StaticStep, "keys", lambda self, end: (lengths.append(end), keys(self, end))[1])
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompts, config, engine=EngineArgs(compile=True))
    assert compiled.tokens == generate(model, prompts, config, engine=EngineArgs(compile=False)).tokens
    assert counters["stats"]["unique_graphs"] - graphs == 3 + prompt_graphs
    ends = sorted(set(lengths) - {1})  # (1: the warm-up's)
    assert min(ends) <= 32 and max(ends) > 64 and len({-(-e // KEYS_STEP) for e in ends}) >= 3


def packed_prompts(calls, seed: int) -> tuple[Pack, list[slice]]:
    """Two prompt chunks in one pack as the continuous batch runs them: rows 0-1 with 5 tokens from position 0 at
    iteration 2, row 3 with 3 tokens from position 4 at iteration 0 (random states, the keys before written)."""
    g = torch.Generator().manual_seed(seed)
    h = calls.model.config.hidden_size
    pack, parts = Pack(), []
    for start, n, rows, iteration in ((0, 5, [0, 1], 2), (4, 3, [3], 0)):
        call = calls.prompt(start, n, calls.upload(rows), 4)
        state, embedded = torch.randn(len(rows), n, h, generator=g), torch.randn(len(rows), n, h, generator=g)
        parts.append(pack.add(call, state, embedded, iteration))
    return pack, parts


def test_the_prompts_iteration_compiled_computes_the_eager_one_for_any_token_count():
    """`CompiledPrompts` (frozen weights, no GEMM search: seconds on two cores) against the eager packed call: the
    same states and the same cache entries written (by the chunks' attention, an opaque op), for packs of 13 and
    then 26 tokens, the second without compiling again (the token count is a dynamic size)."""
    model = tiny()
    calls = ModelCalls(model, 4, 16, 4, "full")
    calls.admit(0, 8, calls.upload([0, 1, 3]))
    torch.manual_seed(1)
    for cache in (calls.cache.core_k, calls.cache.core_v):
        cache.normal_()  # the earlier keys of row 3 (positions 0-3) are read by its chunk
    compiled = cpu_compile.CompiledPrompts(model)
    for seed in (0, 1):
        pack, _ = packed_prompts(calls, seed)
        if seed == 1:  # twice the tokens: the same pack again after itself
            pack.segments += [dataclasses.replace(s, tokens=slice(s.tokens.start + 13, s.tokens.stop + 13))
                              for s in pack.segments]
            pack.parts = [p + p for p in pack.parts]
        before = [c.clone() for c in (calls.cache.core_k, calls.cache.core_v)]
        with torch.inference_mode():
            eager = calls.iterate_packed(pack)
            written = [c.clone() for c in (calls.cache.core_k, calls.cache.core_v)]
            calls.cache.core_k.copy_(before[0])
            calls.cache.core_v.copy_(before[1])
            calls.compiled_prompts = compiled
            seconds = compiled.seconds
            out = calls.iterate_packed(pack)
            calls.compiled_prompts = None
        assert out.shape == eager.shape == (1, 13 * (1 + seed), model.config.hidden_size)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        for new, reference in zip((calls.cache.core_k, calls.cache.core_v), written, strict=True):
            torch.testing.assert_close(new, reference, rtol=1e-5, atol=1e-5)
        assert not compiled.failed and not cpu_compile._packed_calls  # (each call's registration dropped after it)
        if seed == 1:
            assert compiled.seconds == seconds  # 26 tokens ran the code compiled for 13


def test_a_compiler_failure_in_the_prompts_iteration_warns_and_runs_eagerly(monkeypatch):
    model = tiny()
    calls = ModelCalls(model, 4, 16, 4, "full")
    compiled = cpu_compile.CompiledPrompts(model)

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_compiled", broken)
    pack, _ = packed_prompts(calls, 0)
    with torch.inference_mode():
        eager = calls.iterate_packed(pack)
        calls.compiled_prompts = compiled
        with pytest.warns(RuntimeWarning, match="prompts' iteration failed.*no C\\+\\+ compiler"):
            out = calls.iterate_packed(pack)
        again = calls.iterate_packed(pack)  # eager from then on, without another warning
    assert compiled.failed and torch.equal(out, eager) and torch.equal(again, eager)
    assert not cpu_compile._packed_calls


@pytest.mark.slow  # the decode step's compile (a minute or two on 2 cores)
def test_prompts_admitted_beside_decoding_rows_give_the_eager_tokens_compiled(compiling, without_autotune):
    """Prompts of three lengths admitted while a row decodes (their iterations packed in chunks of their own, each
    at its own iteration, and compiled): every request's tokens equal the eager engine's, and the warm-up compiled
    the prompts' iteration ahead of them."""
    model = tiny()

    def tokens(compile: bool) -> tuple[list[list[int]], ContinuousBatch, float]:
        batch = ContinuousBatch(model, max_batch=4, max_length=48, num_slots=8, compile=compile)
        batch.warm_up()
        prompts = batch.step_runner.calls.compiled_prompts
        warmed = 0.0 if prompts is None else prompts.seconds
        config = GenerationConfig(num_steps=6, max_new_tokens=8)
        ids = [batch.add([3, 1, 4, 1, 5], config)]
        events = batch.step() + batch.step()
        ids += [batch.add(p, config) for p in ([9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7], [1, 8, 2, 8])]
        while batch.busy:
            events += batch.step()
        return [[e.token for e in events if e.request == i] for i in ids], batch, warmed

    (eager, _, _), (compiled, batch, warmed) = tokens(False), tokens(True)
    assert compiled == eager and all(len(t) == 8 for t in compiled)
    prompts = batch.step_runner.calls.compiled_prompts
    assert prompts is not None and not prompts.failed
    assert warmed > 0 and prompts.seconds == warmed  # compiled by the warm-up, not while the requests waited


def test_the_prompts_iteration_compiles_again_for_weights_changed_in_place():
    """Its weights are frozen into the compiled code: after an in-place change, `refresh` (each step's first act)
    compiles again, and the result is the new weights' (never the code frozen with the old ones)."""
    model = tiny()
    calls = ModelCalls(model, 4, 16, 4, "full")
    compiled = cpu_compile.CompiledPrompts(model)
    results = []
    with torch.inference_mode():
        for _ in range(2):
            pack, _ = packed_prompts(calls, 0)
            calls.compiled_prompts = None
            eager = calls.iterate_packed(pack)
            calls.compiled_prompts = compiled
            compiled.refresh()
            results.append((calls.iterate_packed(pack), eager))
            model.core[0].mlp.fc.weight.mul_(1.5)
    (first, first_eager), (second, second_eager) = results
    torch.testing.assert_close(first, first_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, second_eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, second, atol=1e-3)


def _timed_threads(costs: dict[tuple[int, int], float], seen: list[int]):
    """A stand-in for a packed call: it sleeps `costs[tokens, threads]` seconds and records its thread count."""
    import time

    def call(tokens: int) -> None:
        seen.append(torch.get_num_threads())
        time.sleep(costs[tokens, torch.get_num_threads()])

    return call


def test_the_prompts_calls_take_more_threads_from_the_fewest_tokens_where_they_paid(monkeypatch):
    """`measure_threads` alternates each size on one thread and on all: more threads from the fewest tokens where
    they paid at that size and every larger one; none where they lost at the largest; never on one thread."""
    monkeypatch.setattr(cpu_compile, "PROMPT_THREAD_TOKENS", (8, 32, 128))
    compiled = cpu_compile.CompiledPrompts(tiny())
    before = torch.get_num_threads()
    ms = 1e-3
    seen: list[int] = []
    pays_from_32 = {(8, 1): 2 * ms, (8, 2): 4 * ms, (32, 1): 6 * ms, (32, 2): 3 * ms, (128, 1): 12 * ms,
                    (128, 2): 6 * ms}
    compiled.measure_threads(2, _timed_threads(pays_from_32, seen))
    assert (compiled.threads, compiled.wide_from) == (2, 32) and set(seen) == {1, 2}
    assert torch.get_num_threads() == before
    loses_at_128 = dict(pays_from_32)
    loses_at_128[128, 2] = 14 * ms
    compiled.measure_threads(2, _timed_threads(loses_at_128, seen))
    assert compiled.wide_from is None
    seen.clear()
    compiled.measure_threads(1, _timed_threads(pays_from_32, seen))
    assert compiled.wide_from is None and not seen


def test_a_wide_prompts_call_compiles_for_its_thread_count_and_computes_the_eager_one():
    """A pack of at least `wide_from` tokens runs the code compiled for `threads` threads (dynamo guards on the
    count: one more compile), with the eager packed call's states, one thread restored after."""
    model = tiny()
    calls = ModelCalls(model, 4, 16, 4, "full")
    calls.admit(0, 8, calls.upload([0, 1, 3]))
    compiled = cpu_compile.CompiledPrompts(model)
    compiled.threads, compiled.wide_from = 2, 13  # (the pack's 13 tokens)
    pack, _ = packed_prompts(calls, 0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            eager = calls.iterate_packed(pack)
            calls.compiled_prompts = compiled
            out = calls.iterate_packed(pack)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    # float32 round-off: the same terms summed in another order by another thread split
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert compiled._sizes == {(2, False)} and not compiled.failed


def test_a_wide_prompts_call_runs_on_its_threads_and_cpus_then_restores_both(monkeypatch):
    """Calls of at least `wide_from` tokens run on `threads` threads, on `cpus` (the engine process pinned to one CPU
    widens to them for the call); smaller ones as the caller runs; both restored after."""
    import os

    compiled = cpu_compile.CompiledPrompts(tiny())
    seen = []
    monkeypatch.setattr(compiled, "_call", lambda states, *rest: seen.append(
        (states.shape[1], torch.get_num_threads(), os.sched_getaffinity(0))))
    own = os.sched_getaffinity(0)
    pinned = {min(own)}
    compiled.threads, compiled.wide_from, compiled.cpus = 2, 16, own
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, pinned)
    try:
        for tokens in (8, 16, 40):
            compiled(torch.zeros(1, tokens, 4), None, None, None, None)
            assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == pinned
    finally:
        os.sched_setaffinity(0, own)
        torch.set_num_threads(before)
    assert seen == [(8, 1, pinned), (16, 2, own), (40, 2, own)]
