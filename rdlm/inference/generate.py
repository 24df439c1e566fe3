"""Generation: prefill, then decode one token at a time over a `RecurrentKVCache` (paper section 6).

    result = generate(model, [[1, 2, 3], [4, 5]], GenerationConfig(num_steps=8, max_new_tokens=16))
    for event in stream(model, prompts, config): ...          # TokenEvent(row, token, steps)

Every zero-shot inference feature of the paper is a field of `GenerationConfig`:
- fixed compute: `num_steps` iterations per token (any r);
- per-token adaptive compute: `exit_criterion` (rdlm.inference.exits), with `min_steps` and `num_steps` as max;
- KV-cache sharing: `cache_strategy="shared"`, `cache_slots=k`;
- continuous chain of thought: `continuous_cot=True` warm-starts s_0 from the previous token's state;
- self-speculative decoding: `draft_steps=N`, `draft_length=L` drafts with N iterations and verifies
  with `num_steps` in one forward (see `Session.speculate`);
- the parallel (diffusion-style) sampler: `sampler="parallel"` refines a wavefront of positions at
  once, `inner_recurrence` iterations per step (see rdlm.inference.parallel).

Batches of prompts with different lengths are left-padded; each row has its own positions, attention
mask, s_0 noise and sampling generator, so a row gives the same tokens as its prompt alone. The random
s_0 of a decoded token depends only on (seed, position), which is what makes speculative decoding
reproduce plain greedy decoding: exactly in float32; in bfloat16 or float16 up to near-ties (the
verification scores L positions in one batched forward, whose matmul and attention reductions round
differently from one-token decoding, so two logits within a few units in the last place can swap:
measured on huginn-tiny-bf16, 21 of 24 greedy runs of 24 tokens identical, each divergence at a top-2
gap of at most 0.008).

Per decoded token the work is: prelude, r core iterations and the coda for one position over the
preallocated cache, as a static step of the decode engine (rdlm/inference/engine.py: CUDA graphs on CUDA, exits
decided on the device). Nothing is re-stacked, and no Python structure grows with the sequence except
the list of output tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from rdlm.inference.engine import NonFiniteLogitsError, Session, read_tokens
from rdlm.inference.parallel import ParallelSampler
from rdlm.inference.params import Decode, GenerationConfig, GenerationResult, TokenEvent, cut_at_stop
from rdlm.inference.sampling import sample, token_logprobs
from rdlm.model.lm import RecurrentDepthLM

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


def stream(model: RecurrentDepthLM, prompts, config: GenerationConfig | None = None,
           decode: Decode | None = None) -> Iterator[TokenEvent]:
    """Yield each new token as soon as it is chosen; the generator's return value (StopIteration.value,
    or `yield from`) is the GenerationResult."""
    config = config or GenerationConfig()
    prompts = as_prompts(prompts)
    if config.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (a tokenizer)")
    if config.draft_steps is not None and len(prompts) != 1:
        raise ValueError(f"speculative decoding takes one prompt at a time, got {len(prompts)}")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return (yield from _run(model, prompts, config, decode))
    finally:
        model.train(was_training)


def generate(model: RecurrentDepthLM, prompts, config: GenerationConfig | None = None, *,
             decode: Decode | None = None, on_token: Callable[[TokenEvent], None] | None = None
             ) -> GenerationResult:
    """Generate for one prompt (a list of ids) or a batch (a list of lists); `on_token` streams."""
    events = stream(model, prompts, config, decode)
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            return stop.value
        if on_token is not None:
            on_token(event)


def _run_batched(model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
                 decode: Decode | None) -> Iterator[TokenEvent]:
    """Every prompt as a request of a continuous batch (rdlm.inference.batching), run until idle: the path
    of a depth budget, which each row spends at its own pace."""
    from rdlm.inference.batching import ContinuousBatch

    longest = max(map(len, prompts)) + config.max_new_tokens
    slots = config.cache_slots if config.cache_strategy == "shared" else config.max_steps
    batch = ContinuousBatch(model, max_batch=len(prompts), max_length=longest, num_slots=slots, decode=decode,
                            sync_every=config.exit_sync_every)
    rows = {batch.add(p, config): row for row, p in enumerate(prompts)}
    result = GenerationResult([[] for _ in prompts], [[] for _ in prompts], ["length"] * len(prompts),
                              cache_bytes=batch.cache.nbytes, prompt_tokens=sum(map(len, prompts)),
                              logprobs=None if config.logprobs is None else [[] for _ in prompts])
    t0 = time.perf_counter()
    while batch.busy:
        for event in batch.step():
            row = rows[event.request]
            result.tokens[row].append(event.token)
            result.steps[row].append(event.steps)
            if result.logprobs is not None:
                result.logprobs[row].append(event.logprob)
            if event.finish_reason is not None:
                result.finish_reasons[row] = event.finish_reason
            yield TokenEvent(row, event.token, event.steps, event.logprob, event.top)
    sync(batch.device)
    result.decode_seconds = time.perf_counter() - t0
    if decode is not None:
        result.texts = [cut_at_stop(decode(row), config.stop_strings) for row in result.tokens]
    return result


def _run(model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
         decode: Decode | None) -> Iterator[TokenEvent]:
    if config.has_depth_budget and config.max_new_tokens > 0:
        return (yield from _run_batched(model, prompts, config, decode))
    speculative = config.draft_steps is not None
    parallel = None
    if config.sampler == "parallel":
        parallel = ParallelSampler(model, prompts, config)
        session = parallel.session
    else:
        session = Session(model, prompts, config, extra_tokens=config.draft_length if speculative else 0)
    batch = session.batch
    tokens: list[list[int]] = [[] for _ in range(batch)]
    steps: list[list[int]] = [[] for _ in range(batch)]
    reasons = ["length"] * batch
    finished = [config.max_new_tokens == 0] * batch

    logprobs: list[list[float]] | None = None if config.logprobs is None else [[] for _ in range(batch)]

    def emit(row: int, token: int, n_steps: int, scored: tuple | None = None) -> TokenEvent:
        tokens[row].append(token)
        if scored is not None:
            logprobs[row].append(scored[0])
        steps[row].append(n_steps)
        reason = config.finish_reason(tokens[row], decode=decode)
        if reason is not None:
            finished[row], reasons[row] = True, reason
        return TokenEvent(row, token, n_steps, *(scored or (None, None)))

    drafted = accepted = 0
    t0 = time.perf_counter()
    logits = session.prefill() if parallel is None or config.full_prefill else None
    sync(session.device)
    t1 = time.perf_counter()
    iterations = torch.full((batch,), config.prefill_steps or config.num_steps)
    if speculative:
        (pending,), finite = read_tokens(logits[0].argmax(), logits)
        if not finite:
            raise NonFiniteLogitsError(model, 1)
        if not finished[0]:
            yield emit(0, pending, int(iterations[0]))
        while not finished[0]:
            new, n_drafted, n_accepted = session.speculate(pending)
            drafted, accepted = drafted + n_drafted, accepted + n_accepted
            for token in new:
                yield emit(0, token, config.num_steps)
                if finished[0]:
                    break
            pending = new[-1]
    elif parallel is not None and not finished[0]:
        for token, n_steps in parallel.run(logits):
            yield emit(0, token, n_steps)
            if finished[0]:
                break
    else:
        while not all(finished):
            # Sampled from finite numbers (a NaN would fail inside the sampler); the logits' own
            # finiteness comes back with the tokens.
            chosen = sample(torch.nan_to_num(logits), config, session.samplers, session.seen)
            scored = None if config.logprobs is None else token_logprobs(logits, chosen, config.logprobs)
            chosen, finite = read_tokens(chosen, logits)
            if not finite:
                raise NonFiniteLogitsError(model, max(map(len, tokens)) + 1)
            for row in range(batch):
                if not finished[row]:
                    yield emit(row, chosen[row], int(iterations[row]), scored and scored[row])
            if all(finished):
                break
            logits, iterations = session.decode(torch.tensor(chosen, device=session.device))
            iterations = iterations.cpu()
    sync(session.device)
    t2 = time.perf_counter()
    texts = None if decode is None else [cut_at_stop(decode(row), config.stop_strings) for row in tokens]
    return GenerationResult(tokens, steps, reasons, texts, t1 - t0, t2 - t1 - session.capture_seconds,
                            drafted, accepted, session.cache.nbytes, sum(len(p) for p in prompts),
                            session.capture_seconds, parallel.core_passes if parallel else 0,
                            parallel.wave_steps if parallel else 0, logprobs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
