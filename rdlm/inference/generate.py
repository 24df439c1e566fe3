"""Generation: prefill, then decode one token at a time over a `RecurrentKVCache` (paper section 6).

    result = generate(model, [[1, 2, 3], [4, 5]], GenerationConfig(num_steps=8, max_new_tokens=16))
    for event in stream(model, prompts, config): ...          # TokenEvent(row, token, iterations)

Every zero-shot inference feature of the paper is a field of `GenerationConfig`:
- fixed compute: `num_steps` iterations per token (any r);
- per-token adaptive compute: `exit_criterion` (rdlm.inference.exits.criteria), with `min_steps` and `num_steps` as max;
- KV-cache sharing: `cache_strategy="shared"`, `cache_slots=k`;
- continuous chain of thought: `continuous_cot=True` warm-starts s_0 from the previous token's state;
- self-speculative decoding: `draft_steps=N`, `draft_length=L` drafts with N iterations and verifies
  with `num_steps` in one forward (rdlm.inference.runner.speculative);
- the parallel (diffusion-style) sampler: `sampler="parallel"` refines a wavefront of positions at
  once, `inner_recurrence` iterations per step (see rdlm.inference.runner.parallel).

Batches of prompts with different lengths are left-padded; each row has its own positions, attention
mask, s_0 noise and sampling generator, so a row gives the same tokens as its prompt alone. The random
s_0 of a decoded token depends only on (seed, position), which is what makes speculative decoding
reproduce plain greedy decoding: exactly in float32; in bfloat16 or float16 up to near-ties (the
verification scores L positions in one batched forward, whose matmul and attention reductions round
differently from one-token decoding, so two logits within a few units in the last place can swap:
measured on huginn-tiny-bf16, 21 of 24 greedy runs of 24 tokens identical, each divergence at a top-2
gap of at most 0.008).

Per decoded token the work is: prelude, r core iterations and the coda for one position over the
preallocated cache; while the rows go together each token runs in lockstep (rdlm.inference.runner.lockstep: on
CUDA as CUDA graphs, exits decided on the device). Nothing is re-stacked, and no Python structure grows
with the sequence except the list of output tokens.

`generate` is one driver over the engine interface (`Engine`, rdlm.inference.events): add every prompt
to an engine, step it until idle, and turn its events into `TokenEvent`s and one `GenerationResult`.
The engine is the `ContinuousBatch` that `rdlm serve` runs too (rdlm.inference.batching), one row per
prompt, for every feature above: self-speculative decoding and the parallel sampler run a round per step
in their rows, and `max_new_tokens=0` prefills alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from rdlm.inference.batching import ContinuousBatch, EngineArgs
from rdlm.inference.events import GenerationResult, TokenEvent
from rdlm.inference.execution.cpu_compile import LENGTH_BUCKET, compile_pays
from rdlm.inference.execution.graphs import sync
from rdlm.inference.execution.model_calls import KEY_MULTIPLE
from rdlm.inference.params import Decode, GenerationConfig, check_length, check_prompts, cut_at_stop
from rdlm.inference.runner.parallel import wave_room
from rdlm.inference.runner.sampling import sample
from rdlm.inference.scheduling.scheduler import in_rounds
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters
from rdlm.resources import check_time, forward_seconds

__all__ = ["Decode", "GenerationConfig", "GenerationResult", "TokenEvent", "generate", "sample", "stream"]

# --------------------------------------------------------------------------------------------------
# Public API


def as_prompts(prompts: Sequence[int] | Sequence[Sequence[int]] | Tensor) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return [[int(t) for t in p] for p in prompts]


def check_generation_time(
    config, device: torch.device, batch: int, prompt_length: int, generation: GenerationConfig
) -> None:
    """Refuse a generation whose one token (or whole run) cannot end in any reasonable time; warn when long."""
    r = generation.num_steps
    prefill = forward_seconds(config, device, batch * prompt_length, 1, generation.prefill_steps or r)
    token = forward_seconds(config, device, batch, 1, r)
    check_time(
        prefill + generation.max_new_tokens * token,
        max(token, prefill),
        f"generating {generation.max_new_tokens} tokens at r = {r}",
        "token",
    )


def stream(
    model: RecurrentDepthLM,
    prompts,
    config: GenerationConfig | None = None,
    decode: Decode | None = None,
    *,
    engine: EngineArgs | None = None,
) -> Generator[TokenEvent, None, GenerationResult]:
    """Yield each new token as soon as it is chosen; the generator's return value (StopIteration.value,
    or `yield from`) is the GenerationResult. `engine`: how the engine runs (`EngineArgs`; default its
    defaults)."""
    config = config or GenerationConfig()
    if engine is None:  # the deprecated engine fields of a request's config, where they are set
        engine = EngineArgs(config.compile, config.exit_sync_every)
    prompts = as_prompts(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return (yield from _run(model, prompts, config, decode, engine))
    finally:
        model.train(was_training)


def generate(
    model: RecurrentDepthLM,
    prompts,
    config: GenerationConfig | None = None,
    *,
    decode: Decode | None = None,
    on_token: Callable[[TokenEvent], None] | None = None,
    engine: EngineArgs | None = None,
) -> GenerationResult:
    """Generate for one prompt (a list of ids) or a batch (a list of lists); `on_token` streams; `engine`: how
    the engine runs (`EngineArgs`: the static step, how often the host looks at exits)."""
    events = stream(model, prompts, config, decode, engine=engine)
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            return stop.value
        if on_token is not None:
            on_token(event)


def _engine(
    model: RecurrentDepthLM,
    prompts: list[list[int]],
    config: GenerationConfig,
    decode: Decode | None,
    engine: EngineArgs,
) -> ContinuousBatch:
    """The engine for these prompts: the continuous batch (rdlm.inference.batching), one row per prompt, all
    prefilled together, each token run in lockstep while the rows go together (rdlm.inference.runner.lockstep),
    iteration by iteration under a depth budget, which each row spends at its own pace, and a round per step
    for self-speculative decoding and the parallel sampler."""
    check_prompts(model, prompts)
    longest = max(map(len, prompts))
    # the room after the longest prompt: its new tokens, and what a round may write past the last one (a
    # speculative round's drafts, the parallel sampler's wave running ahead)
    room = config.max_new_tokens
    if config.draft_steps is not None:
        room += config.draft_length
    elif config.sampler == "parallel":
        room += wave_room(model, config, longest)
    check_length(model, longest, room)
    # Refused before the cache is allocated: a job that would not end in any reasonable time.
    device = next(model.parameters()).device
    check_generation_time(model.config, device, len(prompts), longest, config)
    compile, max_length = engine.compile, longest + room
    if device.type == "cpu":
        if compile is None:  # compiled where it pays (rdlm.inference.execution.cpu_compile)
            iterations = config.max_new_tokens * config.num_steps
            compile = compile_pays(len(prompts), iterations, in_rounds(config), bool(loaded_adapters(model)))
        # a length compiled code can be reused at; else a multiple of KEY_MULTIPLE, so that the prompts read their
        # keys as any batch with a longer buffer (`rdlm serve`'s) reads them, the same float32 sums
        bucket = LENGTH_BUCKET if compile else KEY_MULTIPLE
        max_length = min(model.config.context_length, -(-max_length // bucket) * bucket)
    return ContinuousBatch(
        model,
        max_batch=len(prompts),
        max_length=max_length,
        num_slots=config.core_slots,
        decode=decode,
        exit_sync_every=engine.exit_sync_every,
        prefill_chunk=longest,
        compile=compile,
    )


def _run(
    model: RecurrentDepthLM,
    prompts: list[list[int]],
    config: GenerationConfig,
    decode: Decode | None,
    args: EngineArgs,
) -> Generator[TokenEvent, None, GenerationResult]:
    """Add every prompt to an engine and step it until idle: its tokens as they come, then the result."""
    engine = _engine(model, prompts, config, decode, args)
    rows = {engine.add(p, config): row for row, p in enumerate(prompts)}
    tokens: list[list[int]] = [[] for _ in prompts]
    iterations: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] | None = None if config.logprobs is None else [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    t0 = time.perf_counter()
    while engine.busy:
        events = engine.step()
        for _, err in engine.take_failures():  # a prompt that fails fails the call
            raise err
        for event in events:
            row = rows[event.request]
            tokens[row].append(event.token)
            iterations[row].append(event.iterations)
            if logprobs is not None:
                assert event.logprob is not None  # config.logprobs: every token is scored (sampling.sample)
                logprobs[row].append(event.logprob)
            if event.finish_reason is not None:
                reasons[row] = event.finish_reason
            yield TokenEvent(row, event.token, event.iterations, event.logprob, event.top)
    sync(engine.device)
    decode_seconds = time.perf_counter() - (t0 if engine.decode_start is None else engine.decode_start)
    texts = None if decode is None else [cut_at_stop(decode(row), config.stop_strings) for row in tokens]
    return GenerationResult(
        tokens,
        iterations,
        reasons,
        texts,
        engine.prefill_seconds,
        decode_seconds - (engine.capture_seconds - engine.decode_capture),  # compiled while decoding: left out
        engine.drafted,
        engine.accepted,
        engine.cache_bytes,
        sum(map(len, prompts)),
        engine.capture_seconds,
        engine.core_passes,
        engine.wave_steps,
        logprobs,
    )
