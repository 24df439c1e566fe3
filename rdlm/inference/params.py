"""What a generation request asks for: `GenerationConfig` (sampling, depth, exits, the cache, continuous
chain of thought, speculative and parallel decoding), what it returns (`TokenEvent`, `GenerationResult`),
and what an engine that serves requests offers its driver (`Engine`, `BatchEvent`).

A leaf of rdlm.inference: the engines, the samplers and every front end (the CLI, the server, the
transformers and lm-eval integrations) import it; it imports only the exit criteria.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from rdlm.inference.exits import ExitCriterion, make_exit_criterion

if TYPE_CHECKING:  # annotations only: the module stays a leaf that imports only the exit criteria
    import torch

    from rdlm.model.lm import RecurrentDepthLM

Decode = Callable[[list[int]], str]
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)
MAX_INIT_SCALE = 1000.0  # s_0's noise scale at most (the paper's is 1; 1e6 already overflows a float16 core)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string in it (what a response returns of a text that hit one)."""
    return text[:min((text.find(s) for s in stops if s in text), default=len(text))]


def kv_cache_budget(slots: int | None) -> dict:
    """The `GenerationConfig` fields of a KV-cache budget of k core slots per token (the front ends'
    `kv_cache_budget`: iteration i uses slot i mod k), or none for None (a slot per iteration)."""
    return {} if slots is None else {"cache_strategy": "shared", "cache_slots": slots}


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    num_steps: int = 32                 # r per token; the maximum when exiting adaptively
    prefill_steps: int | None = None    # r for the prompt (default num_steps)
    # Per-token adaptive compute (paper section 6): a name of rdlm.inference.exits.CRITERIA or an ExitCriterion.
    exit_criterion: str | ExitCriterion | None = None
    exit_threshold: float | None = None  # default: the criterion's own (gate: the checkpoint's)
    min_steps: int | None = None        # fewest iterations before an exit; None: 2 (1 for a learned gate)
    # Sampling; temperature 0 is greedy (the paper's evaluation convention), as is any below 1e-5 (its limit).
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # needs a `decode` function
    # Log-probabilities: None, or k in 0..20: each token's log-probability under the model (the raw logits,
    # before penalty, temperature and filtering) and the k most likely tokens' (TokenEvent.logprob/.top).
    logprobs: int | None = None
    # A depth budget for the whole response, honoured by the continuous batch (rdlm serve): at most
    # `max_latent_iterations` core iterations over all new tokens (the first token's are the prompt's), and
    # a running mean of at most `target_mean_iterations` per token; a token gets at least one iteration,
    # and the response ends ("length") when the budget cannot give the next one any (see `depth_cap`).
    max_latent_iterations: int | None = None
    target_mean_iterations: float | None = None
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
    # CUDA, off on the CPU. In fp32 it never changes tokens, only speed; in bf16 a greedy near-tie can flip
    # (its attention reduces over the preallocated cache; docs/inference.md, "The GPU suite").
    compile: bool | None = None
    # Adaptive exits: the criterion is evaluated every `exit_every` iterations (1: after every
    # iteration, as in the paper); the host reads the exit flags every `exit_sync_every` iterations
    # (exited rows then leave the batch; None: every iteration on the CPU, every 4 on an accelerator).
    # exit_sync_every changes cost only, never tokens.
    exit_every: int = 1
    exit_sync_every: int | None = None
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

        # Stops as tuples (a frozen, hashable config; one stop string given as a str is one string, not its letters).
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        if self.min_steps is None:  # a learned gate may exit after the first iteration, as its reference does
            gate = self.exit_criterion in ("gate", "gate-exact") or getattr(self.exit_criterion, "uses_gate", False)
            object.__setattr__(self, "min_steps", 1 if gate else 2)
        positive("max_new_tokens", 0)
        positive("num_steps")
        positive("min_steps", 1)
        positive("draft_length")
        positive("exit_every")
        if self.exit_sync_every is not None:
            positive("exit_sync_every")
        if self.logprobs is not None:
            positive("logprobs", 0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.logprobs}")
            if self.draft_steps is not None or self.sampler != "sequential":
                raise ValueError("logprobs come with the sequential sampler without speculative decoding")
        if self.max_latent_iterations is not None:
            positive("max_latent_iterations")
        if self.target_mean_iterations is not None:
            value = self.target_mean_iterations
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ValueError(f"target_mean_iterations must be a finite number >= 1, got {value!r}")
        if (self.max_latent_iterations, self.target_mean_iterations) != (None, None) and (
                self.draft_steps is not None or self.sampler != "sequential"):
            raise ValueError("a depth budget (max_latent_iterations, target_mean_iterations) goes with the "
                             "sequential sampler without speculative decoding")
        for name in ("prefill_steps", "cache_slots", "top_k", "draft_steps"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("temperature", "init_scale", "repetition_penalty", "exit_threshold", "freeze_threshold"):
            value = getattr(self, name)  # NaN passes every comparison: refuse it (and infinity) here
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.init_scale <= MAX_INIT_SCALE:
            raise ValueError(f"init_scale must be in [0, {MAX_INIT_SCALE:g}] (the scale of s_0's noise; larger "
                             f"overflows inside the core), got {self.init_scale}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
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
            if self.freezer().uses_gate:  # (raises on unknown names)
                raise ValueError("the parallel sampler's freeze criterion compares a position's iterations; "
                                 "a learned exit gate is not one")

    def criterion(self, model_config=None) -> ExitCriterion | None:
        """The exit criterion; a learned gate's default threshold is `model_config.exit_threshold`."""
        if self.exit_criterion is None or isinstance(self.exit_criterion, ExitCriterion):
            return self.exit_criterion
        threshold = self.exit_threshold
        if threshold is None and self.exit_criterion in ("gate", "gate-exact"):
            threshold = getattr(model_config, "exit_threshold", None)
        return make_exit_criterion(self.exit_criterion, threshold)

    def freezer(self) -> ExitCriterion:
        """The parallel sampler's criterion that freezes a position (a name of CRITERIA or an ExitCriterion)."""
        if isinstance(self.freeze_criterion, ExitCriterion):
            return self.freeze_criterion
        return make_exit_criterion(self.freeze_criterion, self.freeze_threshold)

    def depth_cap(self, produced: int, spent: int) -> int:
        """Core iterations the next new token may run, after `produced` tokens that ran `spent` in all:
        num_steps (prefill_steps for the first), bounded by the depth budget; 0 when the budget is spent."""
        cap = self.num_steps if produced else (self.prefill_steps or self.num_steps)
        if self.max_latent_iterations is not None:
            remaining = self.max_latent_iterations - spent
            if remaining < 1:
                return 0
            later = max(self.max_new_tokens - produced - 1, 0)  # keep one iteration for each later token
            cap = min(cap, max(1, remaining - later))
        if self.target_mean_iterations is not None:
            allowed = self.target_mean_iterations * (produced + 1) - spent   # inf for a target near float's max
            if allowed < cap:
                cap = max(1, math.floor(allowed + 1e-9))
        return cap

    @property
    def has_depth_budget(self) -> bool:
        return self.max_latent_iterations is not None or self.target_mean_iterations is not None

    @property
    def max_steps(self) -> int:
        return max(self.num_steps, self.prefill_steps or self.num_steps)

    @property
    def core_slots(self) -> int:
        """The core cache slots a request cycles through: `cache_slots` when shared, else one per iteration."""
        return self.cache_slots if self.cache_strategy == "shared" else self.max_steps

    def finish_reason(self, tokens: Sequence[int], spent: int = 0, decode: Decode | None = None) -> str | None:
        """Why a response ends with its latest token (`tokens`: all its new tokens so far; `spent`: their
        core iterations): "stop_token", "stop_string" (in the text of its last tokens, through `decode`),
        "length" (max_new_tokens, or a depth budget with nothing left for another token); None while it
        goes on. The one stop check of generate and the continuous batch."""
        if tokens[-1] in self.stop_tokens:
            return "stop_token"
        if self.stop_strings:
            window = max(map(len, self.stop_strings)) + 8  # tokens decoded per check
            if any(s in decode(tokens[-window:]) for s in self.stop_strings):
                return "stop_string"
        if len(tokens) >= self.max_new_tokens or (self.has_depth_budget and self.depth_cap(len(tokens), spent) == 0):
            return "length"
        return None


@dataclass(frozen=True)
class BatchEvent:
    """A token an engine chose for one of its requests."""
    request: int                 # the id `Engine.add` returned
    token: int
    steps: int                   # core iterations run at the position whose logits chose this token
    finish_reason: str | None    # None while the request goes on; "stop_token", "stop_string", "length"
    logprob: float | None = None                      # with GenerationConfig.logprobs (TokenEvent's)
    top: tuple[tuple[int, float], ...] | None = None


class Engine(Protocol):
    """Requests in, tokens out, one step at a time: what `generate` drives (docs/inference.md, "Decode
    engine"). `add` queues a request and returns its id (ValueError for what the engine cannot serve),
    `step` runs the next step and returns the tokens it chose, `cancel` drops a request, `busy` says whether
    one is waiting or running, `take_failures` which requests failed alone (their errors) since the last call.
    `StaticBatch` (rdlm.inference.static) decodes the requests added before its
    first step in lockstep; `ContinuousBatch` (rdlm.inference.batching) admits and finishes them one by one.
    Either ends a request with `GenerationConfig.finish_reason`. The numbers below are `GenerationResult`'s,
    zero for an engine that does not do that work."""
    device: torch.device
    cache_bytes: int                      # the KV cache's size
    prefill_seconds = 0.0                 # prefilling the prompts before the first token's step
    decode_start: float | None = None     # time.perf_counter() when decoding began; None: at the first step
    capture_seconds = 0.0                 # capturing CUDA graphs (rdlm.inference.graphs.StaticSteps)
    drafted = accepted = 0                # self-speculative decoding
    core_passes = wave_steps = 0          # the parallel sampler

    def add(self, prompt: list[int], config: GenerationConfig) -> int: ...

    def step(self) -> list[BatchEvent]: ...

    def cancel(self, request: int) -> None: ...

    def take_failures(self) -> list[tuple[int, Exception]]: ...

    @property
    def busy(self) -> bool: ...

    @property
    def queued(self) -> int: ...          # requests waiting for a row

    @property
    def running(self) -> int: ...         # requests in rows, not finished

    def take_timings(self) -> dict[str, float]: ...   # seconds per phase since the last call (a profiling engine)


@dataclass(frozen=True)
class TokenEvent:
    row: int      # which prompt of the batch
    token: int
    steps: int    # core iterations run at the position whose logits chose this token
    logprob: float | None = None                      # with GenerationConfig.logprobs: log p(token)
    top: tuple[tuple[int, float], ...] | None = None  # ... and the k most likely (token, log p), best first


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
    logprobs: list[list[float]] | None = None  # with GenerationConfig.logprobs: log p of each new token

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_steps(self) -> float:
        flat = [s for row in self.steps for s in row]
        return sum(flat) / len(flat) if flat else 0.0


def check_prompt(model: RecurrentDepthLM, prompt: list[int]) -> None:
    """Refuse a prompt no engine can run: an empty one, or one with an id outside the vocabulary."""
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad or not prompt:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})" if bad else
                         "every prompt needs at least one token")


def check_prompts(model: RecurrentDepthLM, prompts: list[list[int]]) -> None:
    """`check_prompt` for each of a batch of prompts; no prompt at all is refused as an empty one."""
    for prompt in prompts or [[]]:
        check_prompt(model, prompt)


def check_length(model: RecurrentDepthLM, prompt_length: int, new_tokens: int) -> None:
    """Refuse a prompt and new tokens that do not fit the model's context."""
    if prompt_length + new_tokens > model.config.context_length:
        raise ValueError(f"prompt ({prompt_length}) + new tokens ({new_tokens}) exceeds the context length "
                         f"{model.config.context_length}")


def check_request(model: RecurrentDepthLM, prompt: list[int], config: GenerationConfig,
                  decode: Decode | None = None) -> ExitCriterion | None:
    """Refuse a request no engine can run (`check_prompt`, stop strings without `decode` to read them, an
    exit gate the model lacks); returns its exit criterion."""
    check_prompt(model, prompt)
    if config.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (a tokenizer)")
    return check_criterion(model, config)


def check_criterion(model: RecurrentDepthLM, config: GenerationConfig) -> ExitCriterion | None:
    """The exit criterion of `config`, refused when it needs a learned exit gate the model lacks."""
    criterion = config.criterion(model.config)
    check_gate(model, criterion)
    return criterion


def check_gate(model: RecurrentDepthLM, criterion: ExitCriterion | None) -> None:
    """Refuse an exit criterion that reads a learned exit gate on a model without one."""
    if criterion is not None and criterion.uses_gate and model.exit_gate is None:
        raise ValueError(f"exit criterion {criterion.name!r} needs a model with a learned exit gate "
                         "(an Ouro checkpoint); this one has none")
