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

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from rdlm.inference.engine import NonFiniteLogitsError, Session, read_tokens
from rdlm.inference.exits import ExitCriterion, make_exit_criterion
from rdlm.model.lm import RecurrentDepthLM

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    num_steps: int = 32                 # r per token; the maximum when exiting adaptively
    prefill_steps: int | None = None    # r for the prompt (default num_steps)
    # Per-token adaptive compute (paper section 6): a name of rdlm.inference.exits.CRITERIA or an ExitCriterion.
    exit_criterion: str | ExitCriterion | None = None
    exit_threshold: float | None = None  # default: the criterion's own
    min_steps: int = 2
    # Sampling; temperature 0 is greedy (the paper's evaluation convention).
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # needs a `decode` function
    # KV cache: "full" (a slot per iteration) or "shared" (k = cache_slots slots, slot i mod k).
    cache_strategy: str = "full"
    cache_slots: int | None = None
    continuous_cot: bool = False        # s_0 of a token = final state of the previous token
    init_scale: float = 1.0             # s_0 noise scale; 0 gives the all-zero state
    seed: int = 0
    # Self-speculative decoding: draft `draft_length` tokens with `draft_steps` iterations.
    draft_steps: int | None = None
    draft_length: int = 4
    # The decode engine (rdlm.inference.engine): a static decode step captured in a CUDA graph. None: on for
    # CUDA, off on the CPU. Never changes tokens, only speed.
    compile: bool | None = None
    # Adaptive exits: the criterion is evaluated every `exit_every` iterations (1: after every
    # iteration, as in the paper); the host reads the exit flags every `exit_sync_every` iterations
    # (exited rows then leave the batch). exit_sync_every changes cost only, never tokens.
    exit_every: int = 1
    exit_sync_every: int = 4
    # The parallel (diffusion-style) sampler (rdlm.inference.parallel; batch 1): "sequential" or "parallel".
    sampler: str = "sequential"
    inner_recurrence: int = 4           # core iterations per wavefront step, on every wave position
    headway: int = 1                    # new positions appended per step
    freeze_criterion: str | ExitCriterion = "latent-diff"  # when a position's state stopped moving
    freeze_threshold: float | None = None  # default: the criterion's own (latent-diff: 0.03)
    max_wavefront: int | None = 128     # most positions in flight; None: no limit
    state_noise_mixing: float = 0.0     # m: s <- (1 - m/(1+i)) s + m/(1+i) noise before each step
    embedding_ema: float = 0.1          # EMA weight of a position's earlier input embeddings
    full_prefill: bool = True           # prefill the prompt at r; False: the prompt is the first wave

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        positive("max_new_tokens", 0)
        positive("num_steps")
        positive("min_steps", 1)
        positive("draft_length")
        positive("exit_every")
        positive("exit_sync_every")
        for name in ("prefill_steps", "cache_slots", "top_k", "draft_steps"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("temperature", "init_scale", "repetition_penalty", "exit_threshold", "freeze_threshold"):
            value = getattr(self, name)  # NaN passes every comparison: refuse it (and infinity) here
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.init_scale < 0:
            raise ValueError(f"init_scale must be >= 0, got {self.init_scale}")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.cache_strategy not in ("full", "shared"):
            raise ValueError(f"cache_strategy must be 'full' or 'shared', got {self.cache_strategy!r}")
        if self.cache_strategy == "shared" and self.cache_slots is None:
            raise ValueError("cache_strategy 'shared' needs cache_slots (the budget k)")
        if self.exit_criterion is not None and self.draft_steps is not None:
            raise ValueError("speculative decoding runs a fixed number of steps; drop exit_criterion")
        if self.draft_steps is not None:
            if self.draft_steps >= self.num_steps:
                raise ValueError(f"draft_steps ({self.draft_steps}) must be smaller than num_steps "
                                 f"({self.num_steps}), the verification depth")
            if self.temperature != 0:
                raise ValueError("speculative decoding is greedy: use temperature 0")
            if self.cache_strategy != "full" or self.continuous_cot or self.repetition_penalty != 1:
                raise ValueError("speculative decoding needs the full cache, no continuous_cot and no "
                                 "repetition_penalty (so that verification reproduces plain decoding)")
        if self.exit_criterion is not None:
            self.criterion()  # raises on unknown names
        if self.sampler not in ("sequential", "parallel"):
            raise ValueError(f"sampler must be 'sequential' or 'parallel', got {self.sampler!r}")
        positive("inner_recurrence")
        positive("headway")
        if self.max_wavefront is not None:
            positive("max_wavefront")
        if not 0 <= self.state_noise_mixing <= 1:
            raise ValueError(f"state_noise_mixing must be in [0, 1], got {self.state_noise_mixing}")
        if not 0 <= self.embedding_ema < 1:
            raise ValueError(f"embedding_ema must be in [0, 1), got {self.embedding_ema}")
        if self.sampler == "parallel":
            if self.exit_criterion is not None or self.draft_steps is not None:
                raise ValueError("the parallel sampler freezes positions with freeze_criterion; drop "
                                 "exit_criterion and draft_steps")
            if self.inner_recurrence > self.num_steps:
                raise ValueError(f"inner_recurrence ({self.inner_recurrence}) must be at most num_steps "
                                 f"({self.num_steps}), the iterations after which a position is final")
            if self.repetition_penalty != 1:
                raise ValueError("the parallel sampler has no repetition_penalty")
            from rdlm.inference.parallel import freeze_criterion  # rdlm.inference.parallel imports this module
            freeze_criterion(self)  # raises on unknown names

    def criterion(self) -> ExitCriterion | None:
        if self.exit_criterion is None or isinstance(self.exit_criterion, ExitCriterion):
            return self.exit_criterion
        return make_exit_criterion(self.exit_criterion, self.exit_threshold)

    @property
    def max_steps(self) -> int:
        return max(self.num_steps, self.prefill_steps or self.num_steps)


@dataclass(frozen=True)
class TokenEvent:
    row: int      # which prompt of the batch
    token: int
    steps: int    # core iterations run at the position whose logits chose this token


@dataclass
class GenerationResult:
    tokens: list[list[int]]             # new tokens per prompt (stop token included, stop string not cut)
    steps: list[list[int]]              # iterations per new token
    finish_reasons: list[str]           # "stop_token", "stop_string" or "length"
    texts: list[str] | None = None      # decoded new text (cut before a stop string) when decode given
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    drafted: int = 0                    # speculative decoding: drafted tokens ...
    accepted: int = 0                   # ... and how many of them verification accepted
    cache_bytes: int = 0
    prompt_tokens: int = 0
    compile_seconds: float = 0.0        # capturing the static decode step (not in decode_seconds)
    core_passes: int = 0                # parallel sampler: core block calls after the prefill, each
    wave_steps: int = 0                 # over a whole wave; and its wavefront steps

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_steps(self) -> float:
        flat = [s for row in self.steps for s in row]
        return sum(flat) / len(flat) if flat else 0.0


# --------------------------------------------------------------------------------------------------
# Sampling

def sample(logits: Tensor, config: GenerationConfig, generators: Sequence[torch.Generator] | None = None,
           seen: Tensor | None = None) -> Tensor:
    """Next tokens [B] from logits [B, V]: repetition penalty, then greedy or temperature with
    top-k / top-p / min-p filtering. Each row draws from its own generator (reproducible per row)."""
    logits = logits.float()
    if seen is not None and config.repetition_penalty != 1:
        p = config.repetition_penalty  # CTRL-style: shrink the logits of tokens already seen
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= config.top_p  # keeps the first
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if config.min_p is not None:
        probs = probs.masked_fill(probs < config.min_p * probs.amax(dim=-1, keepdim=True), 0)
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p; one q vector per row.
    if generators is None:
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
    return (probs / q).argmax(dim=-1)


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


def _run(model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
         decode: Decode | None) -> Iterator[TokenEvent]:
    speculative = config.draft_steps is not None
    parallel = None
    if config.sampler == "parallel":
        from rdlm.inference.parallel import ParallelSampler  # rdlm.inference.parallel imports this module
        parallel = ParallelSampler(model, prompts, config)
        session = parallel.session
    else:
        session = Session(model, prompts, config, extra_tokens=config.draft_length if speculative else 0)
    batch = session.batch
    tokens: list[list[int]] = [[] for _ in range(batch)]
    steps: list[list[int]] = [[] for _ in range(batch)]
    reasons = ["length"] * batch
    finished = [config.max_new_tokens == 0] * batch
    stop_tokens = set(config.stop_tokens)
    window = max((len(s) for s in config.stop_strings), default=0) + 8  # tokens decoded per check

    def emit(row: int, token: int, n_steps: int) -> TokenEvent:
        tokens[row].append(token)
        steps[row].append(n_steps)
        if token in stop_tokens:
            finished[row], reasons[row] = True, "stop_token"
        elif config.stop_strings and any(s in decode(tokens[row][-window:]) for s in config.stop_strings):
            finished[row], reasons[row] = True, "stop_string"
        elif len(tokens[row]) >= config.max_new_tokens:
            finished[row] = True
        return TokenEvent(row, token, n_steps)

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
            chosen, finite = read_tokens(chosen, logits)
            if not finite:
                raise NonFiniteLogitsError(model, max(map(len, tokens)) + 1)
            for row in range(batch):
                if not finished[row]:
                    yield emit(row, chosen[row], int(iterations[row]))
            if all(finished):
                break
            logits, iterations = session.decode(torch.tensor(chosen, device=session.device))
            iterations = iterations.cpu()
    sync(session.device)
    t2 = time.perf_counter()
    texts = None
    if decode is not None:
        texts = []
        for row in tokens:
            text = decode(row)
            cut = min((text.find(s) for s in config.stop_strings if s in text), default=len(text))
            texts.append(text[:cut])
    return GenerationResult(tokens, steps, reasons, texts, t1 - t0, t2 - t1 - session.capture_seconds,
                            drafted, accepted, session.cache.nbytes, sum(len(p) for p in prompts),
                            session.capture_seconds, parallel.core_passes if parallel else 0,
                            parallel.wave_steps if parallel else 0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
