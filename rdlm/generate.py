"""Generation: prefill, then decode one token at a time over a `RecurrentKVCache` (SPEC section 4).

    result = generate(model, [[1, 2, 3], [4, 5]], GenerationConfig(num_steps=8, max_new_tokens=16))
    for event in stream(model, prompts, config): ...          # TokenEvent(row, token, steps)

Every zero-shot inference feature of the paper is a field of `GenerationConfig`:
- fixed compute: `num_steps` iterations per token (any r);
- per-token adaptive compute: `exit_criterion` (rdlm.exits), with `min_steps` and `num_steps` as max;
- KV-cache sharing: `cache_strategy="shared"`, `cache_slots=k`;
- continuous chain of thought: `continuous_cot=True` warm-starts s_0 from the previous token's state;
- self-speculative decoding: `draft_steps=N`, `draft_length=L` drafts with N iterations and verifies
  with `num_steps` in one forward (see `Session.speculate`).

Batches of prompts with different lengths are left-padded; each row has its own positions, attention
mask, s_0 noise and sampling generator, so a row gives the same tokens as its prompt alone. The random
s_0 of a decoded token depends only on (seed, position), which is what makes speculative decoding
reproduce plain greedy decoding exactly.

Per decoded token the work is: prelude, r core iterations and the coda for one position, attending over
slices (views) of the preallocated cache. Nothing is re-stacked, and no Python structure grows with the
sequence except the list of output tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from rdlm.cache import RecurrentKVCache
from rdlm.exits import ExitCriterion, make_exit_criterion
from rdlm.model import RecurrentDepthLM

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    num_steps: int = 32                 # r per token; the maximum when exiting adaptively
    prefill_steps: int | None = None    # r for the prompt (default num_steps)
    # Per-token adaptive compute (SPEC section 4): a name of rdlm.exits.CRITERIA or an ExitCriterion.
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

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        positive("max_new_tokens", 0)
        positive("num_steps")
        positive("min_steps", 1)
        positive("draft_length")
        for name in ("prefill_steps", "cache_slots", "top_k", "draft_steps"):
            if getattr(self, name) is not None:
                positive(name)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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
# A batch being decoded: cache, attention mask, positions, per-row randomness

class Session:
    """Prefill and decode for a batch of prompts over one cache. Buffer index t of row b holds that
    row's token at position t - pad[b] (prompts are left-padded to a common length)."""

    def __init__(self, model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
                 extra_tokens: int = 0) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = model.config.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        self.model, self.config = model, config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch = len(prompts)
        self.prompt_length = max(len(p) for p in prompts)
        max_length = self.prompt_length + config.max_new_tokens + extra_tokens
        if max_length > model.config.context_length:
            raise ValueError(f"prompt ({self.prompt_length}) + new tokens ({config.max_new_tokens}) exceeds "
                             f"the context length {model.config.context_length}")
        slots = config.cache_slots if config.cache_strategy == "shared" else config.max_steps
        self.cache = RecurrentKVCache(model.config, self.batch, max_length, slots, config.cache_strategy,
                                      self.dtype, self.device)
        self.pad = torch.tensor([self.prompt_length - len(p) for p in prompts], device=self.device)
        self.ids = torch.zeros(self.batch, self.prompt_length, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            self.ids[b, self.prompt_length - len(p):] = torch.tensor(p, device=self.device)
        self.key_valid = torch.zeros(self.batch, max_length, dtype=torch.bool, device=self.device)
        self.length = 0  # buffer entries written so far
        self.criterion = config.criterion()
        self.noise = torch.Generator(device=self.device)
        self.samplers = [torch.Generator(device=self.device).manual_seed(config.seed)
                         for _ in range(self.batch)]
        self.seen = torch.zeros(self.batch, vocab, dtype=torch.bool, device=self.device)
        for b, p in enumerate(prompts):
            self.seen[b, torch.tensor(p, device=self.device)] = True
        self.last_state: Tensor | None = None

    # ---- inputs of one model call: tokens at buffer indices start .. start + n - 1

    def positions(self, start: int, n: int) -> Tensor:
        index = torch.arange(start, start + n, device=self.device)
        return (index.unsqueeze(0) - self.pad.unsqueeze(1)).clamp_min(0)

    def mask(self, start: int, n: int) -> Tensor:
        """[B, 1, n, start + n]: causal over the buffer and no padding; a pad query sees itself only
        (so its softmax is defined; nobody attends to it)."""
        end = start + n
        keys = self.key_valid[:, None, None, :end]
        if n == 1:
            return keys
        q = torch.arange(start, end, device=self.device).view(-1, 1)
        k = torch.arange(end, device=self.device).view(1, -1)
        return (keys & (k <= q)) | (k == q)

    def initial_state(self, embedded: Tensor, start: int) -> Tensor:
        """s_0 for tokens start..: noise drawn per row from (seed, position) for a decoded token, and
        from (seed, prompt) for the prompt, so rows do not depend on the rest of the batch."""
        c = self.config
        state = torch.zeros_like(embedded)
        if c.init_scale == 0 or self.model.config.state_init == "zero":
            return state
        n = embedded.shape[1]
        for b in range(self.batch):
            if start == 0:  # the prompt, without its left padding
                first = int(self.pad[b])
                self.noise.manual_seed(c.seed * 1_000_003)
                state[b:b + 1, first:] = self.model.init_state(embedded[b:b + 1, first:], c.init_scale,
                                                               self.noise)
            else:
                for j in range(n):
                    position = start + j - int(self.pad[b])
                    self.noise.manual_seed(c.seed * 1_000_003 + position + 1)
                    state[b:b + 1, j:j + 1] = self.model.init_state(embedded[b:b + 1, j:j + 1], c.init_scale,
                                                                    self.noise)
        return state

    # ---- model calls

    def begin(self, ids: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor, int]:
        """Mark the new tokens valid and run the prelude. Returns (e, rope, mask, start)."""
        start, n = self.length, ids.shape[1]
        self.key_valid[:, start:start + n] = True
        if start == 0:
            self.key_valid[:, :n] &= torch.arange(n, device=self.device) >= self.pad.unsqueeze(1)
        rope, mask = self.model.rope(self.positions(start, n)), self.mask(start, n)
        self.cache.start = start
        return self.model.embed(ids, rope, mask, self.cache), rope, mask, start

    def forward(self, ids: Tensor, num_steps: int, initial_state: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """Run tokens through the model at a fixed r; append them to the cache. (last logits, state)."""
        e, rope, mask, start = self.begin(ids)
        state = self.initial_state(e, start) if initial_state is None else initial_state
        for i in range(num_steps):
            state = self.model.step(state, e, i, rope, mask, self.cache)
        self.cache.fill_missing(torch.full((self.batch,), num_steps, device=self.device),
                                start, start + ids.shape[1])
        logits = self.model.readout(state, rope, mask, self.cache)
        self.length = start + ids.shape[1]
        return logits[:, -1], state

    def forward_adaptive(self, ids: Tensor, initial_state: Tensor | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """One new token per row, iterating until the exit criterion fires per row (between
        min_steps and num_steps). Exited rows keep their state and stop writing core cache entries.
        Returns (logits [B, V], state, steps [B])."""
        c, crit, cache = self.config, self.criterion, self.cache
        e, rope, mask, start = self.begin(ids)
        state = self.initial_state(e, start) if initial_state is None else initial_state
        steps = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        exited = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        streak, prev_logits, logits = None, None, None
        for i in range(c.num_steps):
            cache.core_writers = ~exited if i else None
            new = self.model.step(state, e, i, rope, mask, cache)
            prev_state, state = state, torch.where(exited.view(-1, 1, 1), state, new)
            steps += ~exited
            last = i + 1 == c.num_steps
            logits = self.model.readout(state, rope, mask, cache)[:, -1] if crit.uses_logits or last else None
            if i > 0 and not last:  # compare iterations i and i-1 (there is no iteration -1 to compare)
                done, streak = crit.update(streak, prev_logits, logits, prev_state[:, -1], state[:, -1])
                exited |= done & (steps >= c.min_steps)
            prev_logits = logits
            if last or bool(exited.all()):
                break
        cache.core_writers = None
        cache.fill_missing(steps, start, start + 1)
        if logits is None:
            logits = self.model.readout(state, rope, mask, cache)[:, -1]
        self.length = start + 1
        return logits, state, steps

    def prefill(self) -> Tensor:
        steps = self.config.prefill_steps or self.config.num_steps
        logits, state = self.forward(self.ids, steps)
        self.last_state = state[:, -1:]
        return logits

    def decode(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Feed one token per row; returns (next logits [B, V], iterations run [B])."""
        self.seen[torch.arange(self.batch, device=self.device), tokens] = True
        warm = self.last_state if self.config.continuous_cot else None
        ids = tokens.view(-1, 1)
        if self.criterion is None:
            logits, state = self.forward(ids, self.config.num_steps, warm)
            steps = torch.full((self.batch,), self.config.num_steps, device=self.device)
        else:
            logits, state, steps = self.forward_adaptive(ids, warm)
        self.last_state = state[:, -1:]
        return logits, steps

    def speculate(self, pending: int) -> tuple[list[int], int, int]:
        """One round of self-speculative decoding (batch of one), from the `pending` token (chosen,
        not yet fed). Draft L tokens with N iterations each; then continue those L positions from
        iteration N to M in one forward: the prelude output and the first N iterations are the
        draft's (they do not depend on the total depth), the cache already holds slots 0..N-1.
        Accept drafts while they equal the verified greedy choice.
        Returns (new tokens: accepted drafts then the next pending token, drafted, accepted)."""
        c = self.config
        n_draft, depth, length = c.draft_steps, c.num_steps, c.draft_length
        start = self.length
        length = min(length, self.cache.max_length - start)
        fed, embedded, states = [pending], [], []
        for j in range(length):
            e, rope, mask, _ = self.begin(torch.tensor([[fed[-1]]], device=self.device))
            state = self.initial_state(e, self.length)
            for i in range(n_draft):
                state = self.model.step(state, e, i, rope, mask, self.cache)
            logits = self.model.readout(state, rope, mask, self.cache)
            self.length += 1
            embedded.append(e)
            states.append(state)
            fed.append(int(logits[0, -1].argmax()))
        drafts = fed[1:]
        # Verify: iterations N..M-1 for all L drafted positions at once.
        self.length = start
        rope, mask = self.model.rope(self.positions(start, length)), self.mask(start, length)
        self.cache.start = start
        e, state = torch.cat(embedded, dim=1), torch.cat(states, dim=1)
        for i in range(n_draft, depth):
            state = self.model.step(state, e, i, rope, mask, self.cache)
        verified = self.model.readout(state, rope, mask, self.cache)[0].argmax(dim=-1).tolist()
        accepted = 0
        while accepted < length and drafts[accepted] == verified[accepted]:
            accepted += 1
        processed = min(accepted + 1, length)  # positions whose cache entries are now final
        self.length = start + processed
        self.key_valid[:, self.length:] = False
        return drafts[:processed - 1] + [verified[processed - 1]], length, accepted


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
    logits = session.prefill()
    sync(session.device)
    t1 = time.perf_counter()
    iterations = torch.full((batch,), config.prefill_steps or config.num_steps)
    if speculative:
        pending = int(logits[0].argmax())
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
    else:
        while not all(finished):
            chosen = sample(logits, config, session.samplers, session.seen).tolist()
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
    return GenerationResult(tokens, steps, reasons, texts, t1 - t0, t2 - t1, drafted, accepted,
                            session.cache.nbytes, sum(len(p) for p in prompts))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
