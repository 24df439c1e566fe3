"""The parallel (diffusion-style) sampler for recurrent depth.

Sequential decoding finishes a token's r core iterations before it starts the next token. The sampler
of Geiping et al. 2025, "Efficient Parallel Samplers for Recurrent-Depth Models and Their Connection to
Diffusion Language Models" (arXiv 2510.14961; `generate_diffusion_style` in the authors' repository
seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py) instead advances a *wavefront* of
positions whose states are still being refined, like a diffusion model denoising along the sequence:

    wave = positions start .. start + W - 1; the tokens of the first are final, the others are drafts
    every step:
        prelude over the wave's tokens; e = EMA of each position's embeddings over its steps
        s <- (1 - m_p) s + m_p * noise,  m_p = state_noise_mixing / (1 + iterations run at p)
        `inner_recurrence` core iterations on every position of the wave (one batched call each)
        coda over the wave: the logits at p draft the token at p + 1 (the newest position drafts a new one)
        freeze: a position whose state stopped moving (the freeze criterion between this step and the
            previous one, latent-diff < 0.03 by default) makes the tokens up to it final and the wave
            restart there (as in the reference); a position that has had its full r = num_steps
            iterations makes its own draft final and leaves the wave. Everything before the latest
            such position leaves the wave with it (its cache entries stay).
        append `headway` new positions (the newest draft, then copies of it as placeholders) starting
            from s_0 (or, with continuous_cot, from the newest states), at most `max_wavefront` in all

Each step costs `inner_recurrence` core calls over W positions instead of one position's, so when a
position needs about r / inner_recurrence steps to settle, one token is final per step for
inner_recurrence core calls rather than r. With `max_wavefront=1` and `inner_recurrence = r` the wave
is one position that runs its r iterations and is done: plain sequential decoding, token for token.

Cache: the wave runs over the session's cache like a prompt block: at step t the wave's entries are
(re)written at its buffer indices, and entries before the wave start are final. Iteration i of a step
uses cache slot i (full) or i mod k (shared), so later positions read the entries of the same inner
iteration of earlier ones. The reference's Huginn default, `latest-m4-compress-s4`, keeps one entry
per core layer (the latest iteration's): `cache_strategy="shared", cache_slots=1` here.

Where this differs from the reference (each checked against it on the huginn-tiny fixture,
tests/fixtures/parallel_reference.json):
- The freeze criterion compares a position with its own state of the previous step. The reference,
  after a step that froze c positions, compares position q with the previous state of position q + c
  (it keeps the previous states from the new wave start, then slices them by the start's move again).
  With that bookkeeping reproduced, this sampler gives the reference's tokens, per-position iteration
  counts and step counts exactly (tests/test_parallel.py).
- A position that has had r = num_steps iterations is final (the reference iterates a position until
  it settles, however long); this bounds the work per token and makes the degenerate case sequential.
- With headway > 1, the placeholder tokens are copies of the newest draft (the reference draws
  random ids); state-mixing noise comes from a generator seeded with `seed`; its damping counts the
  iterations run at the position (the reference also counts the prefill's r at the first new one).
- Without a full prefill, prompt tokens are never redrafted (the reference rewrites the prompt after a
  step in which an early prompt position is the last to settle).

In the engine: a request with `sampler="parallel"` decodes in its own row of the continuous batch
(rdlm.inference.batching), its prompt prefilled as any other's (unless `full_prefill` is off: then the
first wave is the prompt). The scheduler plans a wave step of it at every batch step
(rdlm.inference.scheduling.plan.StepPlan.rounds) and the step runner runs it here (rdlm.inference.runner.rounds), in
calls over its row alone; `ParallelSampler` holds its wave. Several prompts each run their own wave in their own
row, one after the other at every step: the waves' calls are not batched together (rows commit different
numbers of positions per step, so their starts and widths diverge; one call over them would need a per-row
start and width in its mask and cache writes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rdlm.inference.execution.model_calls import ModelCalls
from rdlm.inference.exits.track import ExitTrack, at_cap
from rdlm.inference.params import GenerationConfig
from rdlm.inference.runner.row_state import RowState
from rdlm.inference.runner.sampling import NonFiniteLogitsError, all_finite, sample
from rdlm.model.lm import RecurrentDepthLM


def check_parallel(model: RecurrentDepthLM, config: GenerationConfig, prompt_length: int) -> None:
    """Refuse a parallel-sampler request this model or prompt cannot run."""
    if not model.config.takes_initial_state:
        raise ValueError(
            "the parallel sampler refines drafts from a noise state; a model whose s_0 is its "
            "embedding (Ouro) has none: use the sequential sampler"
        )
    if not config.full_prefill and config.max_wavefront is not None and prompt_length > config.max_wavefront:
        raise ValueError(
            f"without a full prefill the prompt ({prompt_length} tokens) is the first "
            f"wave and must fit in max_wavefront ({config.max_wavefront}); prefill it or "
            "raise max_wavefront"
        )


def wave_room(model: RecurrentDepthLM, config: GenerationConfig, prompt_length: int) -> int:
    """Buffer entries a parallel-sampler request may use past its last new token: the wave may run ahead of
    it (positions beyond it still decide freezes), within the model's context."""
    room = model.config.context_length - prompt_length - config.max_new_tokens
    ahead = (config.max_wavefront or model.config.context_length) + config.headway
    return max(0, min(ahead, room))


class ParallelSampler:
    """Decode one request with a wavefront of partly converged positions (see the module doc), over its row of
    the batch's runner (buffer index == position).

    Per-position bookkeeping (tokens, iterations run) lives in tensors over the row's whole buffer; the wave's
    own tensors (states, smoothed embeddings, criterion streaks, previous logits) are [1, W, ...] and shift
    when the wave start moves. Drafts are drawn from the request's generator, which chose its first token."""

    def __init__(self, calls: ModelCalls, request: RowState, first_token: int | None = None) -> None:
        self.calls, self.request, self.model = calls, request, calls.model
        self.config = c = request.config
        self.row, self.prompt_length = request.row, len(request.prompt)
        self.criterion = c.freezer()
        length, device = calls.cache.max_length, calls.device
        self.tokens = torch.zeros(length + 1, dtype=torch.long, device=device)  # final, then drafts
        self.tokens[: self.prompt_length] = calls.upload(request.prompt)
        self.iterations = torch.zeros(length + 1, dtype=torch.long, device=device)  # run at each position
        self.noise = torch.Generator(device=device).manual_seed(c.seed)
        self.core_passes = 0  # core block calls, each over the whole wave
        self.wave_steps = 0
        self.start = 0  # first position of the wave; positions before it are final in the cache
        self.final = self.prompt_length  # positions before this hold final tokens
        if first_token is not None:  # the first token, chosen after a full prefill
            self.tokens[self.prompt_length] = first_token
            self.final = self.prompt_length + 1
            self._open(self.prompt_length, 1, exact=True)
        else:  # the first wave is the prompt
            self._open(0, self.prompt_length, exact=True)

    # ---- the wave's tensors

    def _open(self, start: int, n: int, exact: bool) -> None:
        """The first wave: positions start .. start + n - 1, all with final tokens."""
        self.start = start
        self.state = self.previous = self._initial_state(start, n)
        self.exact = torch.full((n,), exact, dtype=torch.bool, device=self.calls.device)
        self.smoothed = torch.zeros_like(self.state) if self.config.embedding_ema > 0 else None
        self.streak = torch.zeros(n, dtype=torch.long, device=self.calls.device)
        self.prev_logits: Tensor | None = None
        self.has_logits = torch.zeros(n, dtype=torch.bool, device=self.calls.device)

    def _initial_state(self, start: int, n: int) -> Tensor:
        """s_0 of new positions: the request's (seed, position) noise, the same as sequential decoding."""
        calls, noise = self.calls, self.request.noise
        zeros = torch.zeros(1, n, self.model.config.hidden_size, dtype=calls.dtype, device=calls.device)
        return calls.start_state(zeros, None if noise is None else noise[start : start + n].unsqueeze(0))

    @property
    def exhausted(self) -> bool:
        """The wave ran out of room (the row's buffer is full): no token can become final any more."""
        return self.state.shape[1] == 0

    # ---- decoding

    def step(self) -> list[tuple[int, int]]:
        """One wavefront step; returns the tokens that became final, each with the iterations run at the
        position that chose it."""
        c, calls, row = self.config, self.calls, self.row
        a, width = self.start, self.state.shape[1]
        calls.rewind(a, row)  # the wave's entries are (re)written from its start
        calls.admit(a, width, row)
        call = calls.block(a, width, row=row).but(budget=self.request.budget)
        e = calls.embed(self.tokens[a : a + width].view(1, width), call)
        if self.smoothed is not None:  # EMA of the input embeddings as drafts change
            old = torch.where(self.exact.view(1, -1, 1), e, self.smoothed)
            e = self.smoothed = (1 - c.embedding_ema) * e + c.embedding_ema * old
        prev, state = self.previous, self.state
        if c.state_noise_mixing > 0:  # dampened: positions that iterated more get less noise
            mix = c.state_noise_mixing / (1 + self.iterations[a : a + width].to(state.dtype))
            noise = calls.state_noise(state, c.init_scale, self.noise)
            state = state * (1 - mix.view(1, -1, 1)) + mix.view(1, -1, 1) * noise
        state = calls.iterate(state, e, call, range(c.inner_recurrence))
        self.core_passes += c.inner_recurrence
        self.wave_steps += 1
        self.iterations[a : a + width] += c.inner_recurrence
        logits = calls.readout(state, call)[0]  # [W, V]: logits at p draft p + 1
        first_draft = max(self.final, a + 1)  # final tokens are never redrafted
        self.tokens[first_draft : a + width + 1] = self._draft(logits)[first_draft - a - 1 :]

        # Freeze. Criterion between this step's and the previous step's state (or logits) per position.
        # The reading is the exit state's own (`ExitTrack.read_criterion`: patience, streaks); a position's first
        # step has nothing to compare its logits with, so it is not read (its streak is 0).
        crit = self.criterion
        prev_logits = logits if self.prev_logits is None else self.prev_logits
        track = ExitTrack(
            self.iterations[a : a + width], torch.zeros_like(self.streak, dtype=torch.bool), self.streak, None
        )
        read = track.read_criterion(
            crit,
            prev_logits,
            logits,
            prev[0],
            state[0],
            min_steps=0,
            running=self.has_logits if crit.uses_logits else None,
        )
        self.streak = read.streak
        index = torch.arange(width, device=calls.device)
        settled = torch.where(read.exited, index, -1).max()
        done = torch.where(at_cap(self.iterations[a : a + width], c.num_steps), index + 1, -1).max()
        finite = all_finite(logits).all().long()
        settled, done, finite = torch.stack((settled, done, finite)).tolist()  # the one host sync of a step
        if not finite:
            raise NonFiniteLogitsError(self.model, a + 1 - self.prompt_length)
        new_start = a + max(settled, done, 0)
        new_final = max(self.final, new_start + 1)
        out = [
            (int(t), int(n))
            for t, n in zip(
                self.tokens[self.final : new_final].tolist(),
                self.iterations[self.final - 1 : new_final - 1].tolist(),
                strict=True,
            )
        ]
        self.final = new_final

        # The next wave: drop what froze, append `headway` new positions. Like the reference, the
        # width limit counts from this step's start; the wave keeps at least one position.
        end = a + width + c.headway
        if c.max_wavefront is not None:
            end = min(end, a + c.max_wavefront)
        end = min(max(end, new_start + 1), calls.cache.max_length)
        keep, new = new_start - a, max(0, end - (a + width))
        fresh = torch.arange(a + width, a + width + new, device=calls.device) < new_final
        self.tokens[a + width + 1 : a + width + new] = self.tokens[a + width]  # placeholders: newest draft
        if c.continuous_cot and width >= c.headway:
            init = state[:, width - c.headway :][:, :new]
        else:
            init = self._initial_state(a + width, new)
        self._next_wave(state, keep, init)
        self.exact = torch.cat((self.exact[keep:], fresh))
        if self.smoothed is not None:
            self.smoothed = torch.cat((self.smoothed[:, keep:], torch.zeros_like(init)), dim=1)
        self.streak = torch.cat((self.streak[keep:], self.streak.new_zeros(new)))
        if crit.uses_logits:
            self.prev_logits = torch.cat((logits[keep:], logits.new_zeros(new, logits.shape[-1])))
            self.has_logits = torch.cat((torch.ones_like(self.has_logits[keep:width]), self.has_logits.new_zeros(new)))
        self.start = new_start
        calls.rewind(new_start, row)
        return out

    def _next_wave(self, state: Tensor, keep: int, init: Tensor) -> None:
        """The next wave's states: this step's from `keep` on, then the new positions' s_0. The freeze
        criterion compares each position with its own state here (`previous`)."""
        self.state = self.previous = torch.cat((state[:, keep:], init), dim=1)

    def _draft(self, logits: Tensor) -> Tensor:
        """Tokens [n] from logits [n, V] (greedy at temperature 0), all drawn from the request's generator."""
        return sample(logits, self.config, [self.request.generator] * logits.shape[0])
